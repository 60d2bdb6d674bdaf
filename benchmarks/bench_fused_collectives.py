"""A step of compute + all_reduce on tpu tensors: Strict Eager vs DeferAndFuse vs torch.compile.

``--world`` processes (``torch.multiprocessing`` spawn), default group ``"tpu"``. The step is an MLP
layer's forward and a gradient-like product per rank, averaged over the ranks with a functional
collective (``torch.distributed._functional_collectives.all_reduce``), then an SGD-like update:

* ``strict_eager``: every op and the collective run as they are called;
* ``defer_and_fuse``: the ops and the collective are recorded into one graph, which runs as one XLA
  program over the ranks' devices (one descriptor exchange per graph);
* ``compiled``: ``torch.compile(step, backend="tpu")``.

The modes take turns repeat by repeat (``common.time_interleaved``), each closed by
``torchtpu.synchronize()``. Reported: microseconds per step (rank 0), the ratios, and per mode the
flush reasons, CPU fallbacks and descriptor exchanges per step.

    python benchmarks/bench_fused_collectives.py --world 2 --dim 512 --batch 256 --layers 4 \\
        --iters 20 --repeats 7 --out runs/bench_fused_collectives.json
    python benchmarks/bench_fused_collectives.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import early_threads, environment, pin_threads, spawn_ranks, time_interleaved, write_json  # noqa: E402

MODES = ("strict_eager", "defer_and_fuse", "compiled")


def _worker(rank, port, args, queue):
    import torch  # (thread settings come from the parent's environment, pinned before torch loaded)
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import torchtpu

    world = args.world
    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.dim, generator=g).to("tpu")
    weights = [(torch.randn(args.dim, args.dim, generator=torch.Generator().manual_seed(i)) / args.dim ** 0.5)
               .to("tpu") for i in range(args.layers)]

    def step(x, ws):
        out = []
        h = x
        for w in ws:
            a = torch.tanh(h @ w)
            grad = funcol.all_reduce(h.T @ a / h.shape[0], "avg", group)  # averaged over the ranks
            out.append(w - 0.01 * grad)
            h = a
        return out

    compiled = torch.compile(step, backend="tpu")
    state = {m: list(weights) for m in MODES}

    def runner(mode):
        def run():
            if mode == "compiled":
                state[mode] = compiled(x, state[mode])
            else:
                with torchtpu.execution_mode(mode):
                    state[mode] = step(x, state[mode])
        return run

    fns = {m: runner(m) for m in MODES}
    syncs = {m: torchtpu.synchronize for m in MODES}
    pg = group

    # what each mode does per step (after a warm-up step)
    counts = {}
    for m in MODES:
        fns[m]()
        torchtpu.synchronize()
        before = torchtpu.metrics.snapshot()
        ex0 = pg.descriptor_exchanges
        for _ in range(3):
            fns[m]()
        torchtpu.synchronize()
        after = torchtpu.metrics.snapshot()
        counts[m] = {
            "flushes_per_step": {k: (after["flushes"].get(k, 0) - before["flushes"].get(k, 0)) / 3
                                 for k in after["flushes"] if after["flushes"].get(k, 0) != before["flushes"].get(k, 0)},
            "cpu_fallbacks": {k: v - before["cpu_fallbacks"].get(k, 0) for k, v in after["cpu_fallbacks"].items()
                              if v != before["cpu_fallbacks"].get(k, 0)},
            "descriptor_exchanges_per_step": (pg.descriptor_exchanges - ex0) / 3,
            "host_transfer_bytes_per_step": (after["host_transfer_bytes"] - before["host_transfer_bytes"]) / 3,
        }
    # the three modes compute the same weights from the same start
    for m in MODES:
        state[m] = list(weights)
        fns[m]()
    torchtpu.synchronize()
    max_diff = {m: max(float((a - b).abs().max().cpu()) for a, b in zip(state[m], state["strict_eager"]))
                for m in MODES}
    timing = time_interleaved(fns, iters=args.iters, repeats=args.repeats, warmup=args.warmup, syncs=syncs)
    if rank == 0:
        queue.put({"timing": timing, "per_step": counts, "max_abs_diff_vs_strict_eager": max_diff})
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=early_threads(argv))
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (a smoke run)")
    p.add_argument("--out", default="runs/bench_fused_collectives.json")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.batch, args.layers, args.iters, args.repeats, args.warmup = 64, 32, 2, 3, 2, 1
    pin_threads(args.threads)
    result = spawn_ranks(_worker, args.world, args)
    t = result["timing"]
    print(f"world {args.world}, dim {args.dim}, batch {args.batch}, layers {args.layers}")
    for m in MODES:
        print(f"  {m:15s} {t[m]['median_us'] / 1e3:8.2f} ms/step  {result['per_step'][m]}")
    for k in ("strict_eager/defer_and_fuse", "strict_eager/compiled", "defer_and_fuse/compiled"):
        print(f"  {k}: {t['ratios'][k]:.2f}")
    print(f"  max |diff| vs strict eager: {result['max_abs_diff_vs_strict_eager']}")
    write_json(args.out, {"args": vars(args), "environment": environment(args.threads), **result})


if __name__ == "__main__":
    main()
