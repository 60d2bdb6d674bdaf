"""Compile storms: one op called on many distinct small shapes, tpu eager modes against torch CPU.

Each workload calls one op on ``--shapes`` distinct small shapes (one call per shape, the way a
data-dependent loop or a test over sizes does), reading every result back to the host:

* ``index_put_acc``: ``x.index_put_((idx,), v, accumulate=True)`` on ``x = torch.zeros(n)``;
* ``add``: ``a + b`` on ``(n, 3)`` tensors;
* ``sum``: ``x.sum(0)`` on ``(n, 4)``;
* ``view_read``: ``x[1::2]`` of an ``(n, 3)`` tensor read to the host (a strided view per shape).

Configurations, each in its own process so none profits from another's compiled programs:
``cpu`` (torch CPU eager), ``strict_eager`` and ``defer_and_fuse`` (tpu, the compile-storm policy
on: dispatch/storm.py), and ``strict_eager_no_policy`` (the policy off, on ``--off-shapes``
shapes since every shape compiles; its per-shape cost is what the policy saves). Reported per
workload: wall seconds for all shapes, milliseconds per shape, XLA compiles, calls the policy ran
shape-generically, and the ratio to CPU. Every tpu result is checked against CPU.

    python benchmarks/bench_shape_storm.py --out runs/bench_shape_storm.json
    python benchmarks/bench_shape_storm.py --shapes 60 --off-shapes 20     # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, environment, pin_threads, write_json  # noqa: E402

WORKLOADS = ("index_put_acc", "add", "sum", "view_read")
CONFIGS = ("cpu", "strict_eager", "defer_and_fuse", "strict_eager_no_policy")


def _inputs(workload, n, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    if workload == "index_put_acc":
        k = n // 2 + 1
        return (torch.randint(0, n, (k,), generator=g), torch.rand(k, generator=g))
    if workload == "add":
        return (torch.rand(n, 3, generator=g), torch.rand(n, 3, generator=g))
    if workload in ("sum", "view_read"):
        return (torch.rand(n, 4 if workload == "sum" else 3, generator=g),)
    raise ValueError(workload)


def _run(workload, n, inputs, dev):
    import torch

    ins = [x.to(dev) for x in inputs]
    if workload == "index_put_acc":
        x = torch.zeros(n, device=dev)
        x.index_put_((ins[0],), ins[1], accumulate=True)
        return x.cpu()
    if workload == "add":
        return (ins[0] + ins[1]).cpu()
    if workload == "sum":
        return ins[0].sum(0).cpu()
    return ins[0][1::2].cpu()


def child(args):
    import torch

    config = args.child
    dev = "cpu" if config == "cpu" else "tpu"
    count = args.off_shapes if config == "strict_eager_no_policy" else args.shapes
    sizes = [args.first + i for i in range(count)]
    if dev == "tpu":
        import torchtpu
        from torchtpu import metrics

        metrics.set_recompile_warning_threshold(None)
        if config == "strict_eager_no_policy":
            torchtpu.set_shape_storm_policy(None)
        mode = "defer_and_fuse" if config == "defer_and_fuse" else "strict_eager"
        torchtpu.set_execution_mode(mode)
    out = {}
    for workload in args.workloads.split(","):
        inputs = [_inputs(workload, n, i) for i, n in enumerate(sizes)]
        before = metrics.snapshot() if dev == "tpu" else None
        results, times = [], []
        for n, ins in zip(sizes, inputs):
            t0 = time.perf_counter()
            results.append(_run(workload, n, ins, dev))
            times.append(time.perf_counter() - t0)
        total = sum(times)
        err = 0.0
        if dev == "tpu":
            after = metrics.snapshot()
            for n, ins, got in zip(sizes, inputs, results):
                want = _run(workload, n, ins, "cpu")
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                err = max(err, (got - want).abs().max().item() if got.numel() else 0.0)
        out[workload] = {
            "shapes": count,
            "total_s": total,
            "ms_per_shape": 1000 * total / count,
            # the second half of the shapes: after the policy has engaged (or, off, one compile each)
            "late_ms_per_shape": 1000 * statistics.median(times[count // 2:]),
            "compiles": after["compiles"] - before["compiles"] if dev == "tpu" else 0,
            "shape_generic_calls": (sum(after["shape_generic_calls"].values())
                                    - sum(before["shape_generic_calls"].values())) if dev == "tpu" else 0,
            "max_abs_err_vs_cpu": err,
        }
    return out


def main():
    pin_threads(early_threads())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=500, help="distinct shapes per workload")
    ap.add_argument("--off-shapes", type=int, default=100,
                    help="shapes for the policy-off run (each one compiles)")
    ap.add_argument("--first", type=int, default=3, help="the smallest size n")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/bench_shape_storm.json")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    env = environment(args.threads)
    results = {}
    for config in args.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", config]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"bench_shape_storm: the {config} run failed (exit {proc.returncode})")
        results[config] = json.loads(lines[-1][len("RESULT "):])
        print(f"{config}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)

    cpu = results.get("cpu")
    print(f"\none op on distinct small shapes (n = {args.first}..), every result read back; "
          f"policy-off run on {args.off_shapes} shapes")
    hdr = (f"{'workload':>14} {'config':>23} {'shapes':>6} {'total s':>8} {'ms/shape':>9} {'late ms':>8} "
           f"{'compiles':>8} {'generic':>7} {'x cpu':>7} {'late x cpu':>10}")
    print(hdr)
    print("-" * len(hdr))
    for workload in args.workloads.split(","):
        for config, r in results.items():
            w = r[workload]
            c = cpu[workload] if cpu and config != "cpu" else None
            ratio = f"{w['ms_per_shape'] / c['ms_per_shape']:.0f}x" if c else "-"
            late = f"{w['late_ms_per_shape'] / c['late_ms_per_shape']:.0f}x" if c else "-"
            print(f"{workload:>14} {config:>23} {w['shapes']:>6} {w['total_s']:>8.2f} {w['ms_per_shape']:>9.3f} "
                  f"{w['late_ms_per_shape']:>8.3f} {w['compiles']:>8} {w['shape_generic_calls']:>7} {ratio:>7} "
                  f"{late:>10}")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "child"}, "environment": env,
                          "results": results})


if __name__ == "__main__":
    main()
