"""Collective bus bandwidth: XLA collectives vs the host-staged route vs gloo on CPU tensors.

``--world`` processes (``torch.multiprocessing`` spawn; each world size its own job). In each, the
default group is ``"tpu"`` (JAX's multi-process runtime under it) and a second group over the same
ranks is ``"gloo"``. For each message size (``--sizes``, MB) and collective (all_reduce SUM,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single) three paths take turns repeat by
repeat, so load from other jobs falls on all alike:

* ``xla``: tpu tensors, one XLA program over the processes' devices (no host copies);
* ``staged``: tpu tensors inside ``torchtpu.distributed.host_staged()``: device->host copy, gloo,
  copy back (the route before XLA collectives);
* ``gloo``: CPU tensors through the gloo group.

A tpu timing includes what a user pays (the descriptor check; closed by ``torchtpu.synchronize()``).
Bus bandwidth as nccl-tests defines it: all_reduce ``bytes * 2 (n-1) / n / t``, the others
``bytes * (n-1) / n / t`` (bytes: the full buffer). Ratios: staged time / xla time (> 1: XLA faster),
gloo time / xla time.

    python benchmarks/bench_collectives.py --world 2 4 --sizes 1 16 256 --out runs/bench_collectives.json
    python benchmarks/bench_collectives.py --quick
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import early_threads, environment, pin_threads, write_json  # noqa: E402

MB = 1 << 20


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
PATHS = ("xla", "staged", "gloo")


def _calls(coll, world, tpu, cpu, gloo):
    """{path: one call of ``coll``} on tpu tensors (xla, staged) and CPU tensors (gloo)."""
    import torch
    import torch.distributed as dist

    from torchtpu.distributed import host_staged

    n = tpu.numel()
    if coll == "all_reduce":
        def make(x, group):
            return lambda: dist.all_reduce(x, group=group)
    elif coll == "all_gather":  # each rank contributes n / world elements: the output is the full buffer
        def make(x, group):
            out = torch.empty(n, dtype=x.dtype, device=x.device)
            part = x[: n // world]
            return lambda: dist.all_gather_into_tensor(out, part, group=group)
    elif coll == "reduce_scatter":
        def make(x, group):
            out = torch.empty(n // world, dtype=x.dtype, device=x.device)
            return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    else:
        def make(x, group):
            out = torch.empty_like(x)
            return lambda: dist.all_to_all_single(out, x, group=group)
    xla = make(tpu, None)
    staged_call = make(tpu, None)

    def staged():
        with host_staged():
            staged_call()
    return {"xla": xla, "staged": staged, "gloo": make(cpu, gloo)}


def _worker(rank, world, port, args, queue):
    # thread pinning reached this process through the environment (set by main before spawning)
    import torch
    import torch.distributed as dist

    import torchtpu
    from torchtpu.distributed import xla_transport_active

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    assert xla_transport_active(), "JAX's multi-process runtime did not come up"
    gloo = dist.new_group(backend="gloo")
    results = []
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(args.sizes) * len(COLLECTIVES), desc=f"collectives x{world}", file=sys.stderr)
    for mb in args.sizes:
        n = int(mb * MB) // 4  # float32 elements
        n -= n % world
        cpu = torch.randn(n)
        tpu = cpu.to("tpu")
        for coll in COLLECTIVES:
            fns = _calls(coll, world, tpu, cpu, gloo)
            factor = 2 * (world - 1) / world if coll == "all_reduce" else (world - 1) / world
            iters = max(1, min(args.iters, int(64 // mb)))
            per = {k: [] for k in fns}
            for fn in fns.values():  # warm-up: compiles the programs once
                fn()
                torchtpu.synchronize()
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    dist.barrier(group=gloo)  # the ranks start the timing together
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    if name != "gloo":
                        torchtpu.synchronize()
                    per[name].append((time.perf_counter() - t0) / iters)
            # the slowest rank's time is the collective's time
            med = torch.tensor([statistics.median(per[k]) for k in PATHS], dtype=torch.float64)
            ratios = torch.tensor([statistics.median([a / b for a, b in zip(per[k], per["xla"])])
                                   for k in ("staged", "gloo")], dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX, group=gloo)
            dist.all_reduce(ratios, op=dist.ReduceOp.MIN, group=gloo)
            nbytes = n * 4
            row = {"collective": coll, "world": world, "size_mb": mb, "bytes": nbytes, "iters": iters,
                   "repeats": args.repeats, "staged_over_xla": ratios[0].item(), "gloo_over_xla": ratios[1].item()}
            for k, t in zip(PATHS, med.tolist()):
                row[f"{k}_s"] = t
                row[f"{k}_busbw_gbps"] = nbytes * factor / t / 1e9
            results.append(row)
            if bar is not None:
                bar.update(1)
        # correctness of what was timed: the tpu result matches gloo's
        check = torch.arange(8, dtype=torch.float32) + rank
        t = check.to("tpu")
        dist.all_reduce(t)
        dist.all_reduce(check, group=gloo)
        torch.testing.assert_close(t.cpu(), check)
        del cpu, tpu
    if bar is not None:
        bar.close()
    if rank == 0:
        queue.put(results)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def main():
    threads = early_threads()
    pin_threads(threads)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 and 4 MB, 2 processes")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 256], help="message sizes in MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="calls per timing (fewer for large messages)")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default="runs/bench_collectives.json")
    args = ap.parse_args()
    if args.quick:
        args.world, args.sizes, args.repeats, args.iters = [2], [1, 4], 2, 3

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    t0 = time.time()
    results = []
    for world in args.world:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(world, port, args, queue), nprocs=world, start_method="spawn")
        results += queue.get()

    print(f"\n{'collective':<15}{'world':>6}{'size':>9}{'xla GB/s':>10}{'staged GB/s':>13}{'gloo GB/s':>11}"
          f"{'staged/xla':>12}{'gloo/xla':>10}")
    for r in results:
        print(f"{r['collective']:<15}{r['world']:>6}{r['size_mb']:>7g}MB{r['xla_busbw_gbps']:>10.3f}"
              f"{r['staged_busbw_gbps']:>13.3f}{r['gloo_busbw_gbps']:>11.3f}"
              f"{r['staged_over_xla']:>12.2f}{r['gloo_over_xla']:>10.2f}")
    summary = {}
    for coll in COLLECTIVES:
        for k in ("staged", "gloo"):
            rs = [r[f"{k}_over_xla"] for r in results if r["collective"] == coll]
            summary[f"{coll}_median_{k}_over_xla"] = statistics.median(rs)
    print(" ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    import torch  # noqa: F401  (environment() reads torch and jax versions)

    env = environment(args.threads)
    write_json(args.out, {"benchmark": "collectives", "worlds": args.world, "sizes_mb": args.sizes,
                          "quick": args.quick, "wall_s": time.time() - t0, "environment": env,
                          "results": results, "summary": summary})


if __name__ == "__main__":
    main()
