"""Collective bus bandwidth: the ``tpu`` backend on tpu tensors vs gloo on CPU tensors.

Two processes (``torch.multiprocessing`` spawn). In each, the default group is
``"tpu"`` and a second group over the same ranks is ``"gloo"``. For each
message size (1 MB ... 256 MB; ``--quick``: up to 16 MB) both run
``all_reduce`` (SUM) and ``all_to_all_single`` taking turns repeat by repeat,
so load from other jobs falls on both alike; ``tpu_nocheck`` is the tpu
backend with its cross-rank descriptor check off (``TORCHTPU_DIST_CHECK=0``). A tpu timing includes what a user
pays: the descriptor check, the device-to-host copy, gloo, and the copy of the
results back into the tpu tensor (closed by ``torchtpu.synchronize()``).

Bus bandwidth as nccl-tests defines it, so figures compare across world sizes:
all_reduce ``bytes * 2 (n-1) / n / t``, all_to_all ``bytes * (n-1) / n / t``.
Ratios are tpu time / gloo time (1.0 = the tpu backend adds nothing to gloo).

    python benchmarks/bench_collectives.py --out runs/bench_collectives.json
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


def _sizes(quick):
    top = 16 if quick else 256
    out, s = [], 1
    while s <= top:
        out.append(s)
        s *= 4 if not quick else 2
    if out[-1] != top:
        out.append(top)
    return out


def _nocheck(fn):
    """``fn`` with the cross-rank descriptor check off (TORCHTPU_DIST_CHECK=0), to show what it costs."""
    def run():
        os.environ["TORCHTPU_DIST_CHECK"] = "0"
        try:
            fn()
        finally:
            del os.environ["TORCHTPU_DIST_CHECK"]
    return run


def _worker(rank, world, port, args, queue):
    # thread pinning reached this process through the environment (set by main before spawning)
    import torch
    import torch.distributed as dist

    import torchtpu

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    results = []
    sizes = _sizes(args.quick)
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(sizes) * 2, desc="collectives", file=sys.stderr)
    for mb in sizes:
        n = mb * MB // 4  # float32 elements
        n -= n % world
        cpu = torch.randn(n)
        tpu = cpu.to("tpu")
        for coll in ("all_reduce", "all_to_all"):
            if coll == "all_reduce":
                tpu_fn = lambda: dist.all_reduce(tpu)  # noqa: E731
                fns = {"tpu": tpu_fn, "tpu_nocheck": _nocheck(tpu_fn), "gloo": lambda: dist.all_reduce(cpu, group=gloo)}
                factor = 2 * (world - 1) / world
            else:
                out_t = torch.empty_like(tpu)
                out_c = torch.empty_like(cpu)
                tpu_fn = lambda: dist.all_to_all_single(out_t, tpu)  # noqa: E731
                fns = {"tpu": tpu_fn, "tpu_nocheck": _nocheck(tpu_fn),
                       "gloo": lambda: dist.all_to_all_single(out_c, cpu, group=gloo)}
                factor = (world - 1) / world
            iters = max(1, min(20, (64 // mb))) if not args.quick else max(1, min(10, 16 // mb))
            per = {k: [] for k in fns}
            for name, fn in fns.items():  # warm-up: compiles the tpu copies once
                fn()
                torchtpu.synchronize()
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    dist.barrier(group=gloo)  # both ranks start the timing together
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    if name != "gloo":
                        torchtpu.synchronize()
                    per[name].append((time.perf_counter() - t0) / iters)
            # the slowest rank's time is the collective's time
            med = torch.tensor([statistics.median(per[k]) for k in ("tpu", "tpu_nocheck", "gloo")],
                               dtype=torch.float64)
            ratios = torch.tensor([statistics.median([a / b for a, b in zip(per[k], per["gloo"])])
                                   for k in ("tpu", "tpu_nocheck")], dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX, group=gloo)
            dist.all_reduce(ratios, op=dist.ReduceOp.MAX, group=gloo)
            nbytes = n * 4
            results.append({
                "collective": coll, "size_mb": mb, "bytes": nbytes, "iters": iters, "repeats": args.repeats,
                "tpu_s": med[0].item(), "tpu_nocheck_s": med[1].item(), "gloo_s": med[2].item(),
                "tpu_busbw_gbps": nbytes * factor / med[0].item() / 1e9,
                "tpu_nocheck_busbw_gbps": nbytes * factor / med[1].item() / 1e9,
                "gloo_busbw_gbps": nbytes * factor / med[2].item() / 1e9,
                "ratio_tpu_over_gloo": ratios[0].item(),
                "ratio_tpu_nocheck_over_gloo": ratios[1].item(),
            })
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
    ap.add_argument("--quick", action="store_true", help="sizes up to 16 MB (< 60 s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default="runs/bench_collectives.json")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    world = 2
    t0 = time.time()
    mp.start_processes(_worker, args=(world, port, args, queue), nprocs=world, start_method="spawn")
    results = queue.get()

    print(f"\n{'collective':<12}{'size':>8}{'tpu GB/s':>11}{'nocheck GB/s':>14}{'gloo GB/s':>11}"
          f"{'tpu/gloo':>10}{'nocheck/gloo':>14}")
    for r in results:
        print(f"{r['collective']:<12}{r['size_mb']:>6}MB{r['tpu_busbw_gbps']:>11.3f}"
              f"{r['tpu_nocheck_busbw_gbps']:>14.3f}{r['gloo_busbw_gbps']:>11.3f}"
              f"{r['ratio_tpu_over_gloo']:>10.2f}{r['ratio_tpu_nocheck_over_gloo']:>14.2f}")
    summary = {}
    for coll in ("all_reduce", "all_to_all"):
        for k in ("tpu", "tpu_nocheck"):
            rs = [r[f"ratio_{k}_over_gloo"] for r in results if r["collective"] == coll]
            summary[f"{coll}_median_ratio_{k}_over_gloo"] = statistics.median(rs)
    print(" ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    import torch  # noqa: F401  (environment() reads torch and jax versions)

    env = environment(args.threads)
    write_json(args.out, {"benchmark": "collectives", "world_size": world, "quick": args.quick,
                          "wall_s": time.time() - t0, "environment": env, "results": results,
                          "summary": summary})


if __name__ == "__main__":
    main()
