"""Bucketing vs none on a stream of long-tailed sequence lengths through a transformer forward.

A stream of batches whose sequence length follows a clipped lognormal (the
shape of RL response lengths) goes through ``TinyTransformer``'s forward on
tpu three ways: unbucketed (every new length compiles new programs), padded to
``BucketPolicy.pow2``, and padded to ``BucketPolicy.fit`` (fitted on a separate
calibration sample of lengths, with as many buckets as pow2 has). Reported per
way: XLA compiles, distinct forward shapes, compile time, total wall time,
steady per-batch time, and padding overhead (padded tokens / real tokens - 1).

Padding is on the right and the model is causal, so the logits at real
positions are exactly the unpadded ones (checked against a CPU forward); no
attention mask is needed. Each way runs in its own process so none profits
from another's compiled programs. Ratios are what to read: the machines are
shared and absolute times drift.

    python benchmarks/bench_bucketing.py --out runs/bench_bucketing.json
    python benchmarks/bench_bucketing.py --batches 100      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch CPU and XLA CPU share 2 cores

import numpy as np  # noqa: E402

CONFIGS = ("none", "pow2", "fit")


def lengths_stream(n, args, seed):
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(args.median_len), args.sigma, n)
    return np.clip(np.round(raw), args.min_len, args.max_len).astype(int).tolist()


def policies(args):
    from torchtpu.bucketing import BucketPolicy

    pow2 = BucketPolicy.pow2(args.min_len, args.max_len)
    calib = lengths_stream(args.calibration, args, seed=args.seed + 1)  # not the measured stream
    k = args.fit_buckets or len(pow2)
    fit = BucketPolicy.fit(calib, k, multiple_of=args.multiple_of, max_size=args.max_len)
    return {"none": None, "pow2": pow2, "fit": fit}


def child(args):
    import torch

    import torchtpu
    from torchtpu import metrics
    from torchtpu.bucketing import bucket_scope, pad_to_bucket
    from torchtpu_models import TinyTransformer

    policy = policies(args)[args.child]
    lengths = lengths_stream(args.batches, args, seed=args.seed)
    torch.manual_seed(0)
    cfg = dict(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, max_seq_len=args.max_len)
    ref = TinyTransformer(**cfg).eval()
    model = TinyTransformer(**cfg).eval()
    model.load_state_dict(ref.state_dict())
    model = model.to("tpu")
    check_at = {}  # bucket (or length) -> first batch index using it: checked against the CPU forward
    real = padded_tokens = 0
    times = []
    shapes_compiled = 0
    seen = set()
    err = 0.0
    with torchtpu.execution_mode(args.mode), torch.no_grad():
        torchtpu.sync()
        before = metrics.snapshot()
        t_start = time.perf_counter()
        for i, L in enumerate(lengths):
            t0 = time.perf_counter()
            ids = torch.randint(0, 256, (args.batch_size, L), generator=torch.Generator().manual_seed(i))
            if policy is None:
                x, width = ids, L
            else:
                x, _ = pad_to_bucket(ids, 1, policy)  # on the host: the device sees bucket widths only
                width = x.shape[1]
            with bucket_scope(len=width):
                logits = model(x.to("tpu"))
                torch.tpu.synchronize()  # waits for the result: each time is one real batch
            times.append(time.perf_counter() - t0)
            real += args.batch_size * L
            padded_tokens += args.batch_size * width
            if width not in seen:
                seen.add(width)
                shapes_compiled += 1
                if len(check_at) < args.checks:
                    check_at[width] = i
                    got = logits.cpu()[:, :L]
                    err = max(err, (got - ref(ids)).abs().max().item())
        total = time.perf_counter() - t_start
        after = metrics.snapshot()
    new_shape = set()
    seen.clear()
    for i, L in enumerate(lengths):  # batches that met a new width paid its compiles
        w = L if policy is None else policy.bucket(L)
        if w not in seen:
            seen.add(w)
            new_shape.add(i)
    steady = [t for i, t in enumerate(times) if i not in new_shape]
    cb = after["compiles_by_bucket"]
    return {
        "config": args.child,
        "mode": args.mode,
        "policy": repr(policy) if policy is not None else None,
        "num_buckets": len(policy) if policy is not None else None,
        "batches": len(lengths),
        "distinct_lengths": len(set(lengths)),
        "forward_shapes": shapes_compiled,
        "compiles": after["compiles"] - before["compiles"],
        "executables_built": sum(after["cache_misses"].values()) - sum(before["cache_misses"].values()),
        "compiles_per_shape": statistics.median(
            [cb[k] - before["compiles_by_bucket"].get(k, 0) for k in cb if k.startswith("len=")]),
        "compile_time_s": after["compile_time_s"] - before["compile_time_s"],
        "total_s": total,
        "steady_ms_per_batch": 1000 * statistics.median(steady) if steady else None,
        "real_tokens": real,
        "padded_tokens": padded_tokens,
        "padding_overhead": padded_tokens / real - 1.0,
        "max_abs_err_vs_cpu": err,
        "cpu_fallbacks": sum(after["cpu_fallbacks"].values()) - sum(before["cpu_fallbacks"].values()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--median-len", type=float, default=20.0)
    ap.add_argument("--sigma", type=float, default=0.6, help="lognormal sigma of the lengths")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=64, help="lengths are clipped to [min-len, max-len]")
    ap.add_argument("--fit-buckets", type=int, default=0, help="buckets for fit (default: as many as pow2)")
    ap.add_argument("--multiple-of", type=int, default=1)
    ap.add_argument("--calibration", type=int, default=2000, help="lengths sampled to fit the policy on")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mode", default="strict_eager", help="torchtpu execution mode")
    ap.add_argument("--checks", type=int, default=3, help="batches checked against a CPU forward per way")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_bucketing.json")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    results = {}
    for name in args.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", name]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"bench_bucketing: the {name} run failed (exit {proc.returncode})")
        results[name] = json.loads(lines[-1][len("RESULT "):])
        print(f"{name:>5}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)

    base = results.get("none")
    print(f"\n{args.batches} batches of {args.batch_size} x lognormal(median {args.median_len}, sigma {args.sigma}) "
          f"lengths clipped to [{args.min_len}, {args.max_len}], TinyTransformer forward, {args.mode}")
    hdr = (f"{'way':>5} {'buckets':>7} {'shapes':>6} {'compiles':>8} {'compile s':>9} {'total s':>8} "
           f"{'steady ms':>9} {'pad':>6} {'compiles/none':>13} {'speedup':>7} {'max err':>8}")
    print(hdr)
    print("-" * len(hdr))
    for name, r in results.items():
        ratio_c = f"{r['compiles'] / base['compiles']:.3f}" if base else "-"
        speed = f"{base['total_s'] / r['total_s']:.2f}x" if base else "-"
        steady = f"{r['steady_ms_per_batch']:.1f}" if r["steady_ms_per_batch"] is not None else "-"
        print(f"{name:>5} {r['num_buckets'] or '-':>7} {r['forward_shapes']:>6} {r['compiles']:>8} "
              f"{r['compile_time_s']:>9.1f} {r['total_s']:>8.1f} {steady:>9} {r['padding_overhead']:>6.1%} "
              f"{ratio_c:>13} {speed:>7} {r['max_abs_err_vs_cpu']:>8.1e}")
    for name, r in results.items():
        if r["policy"]:
            print(f"  {name}: {r['policy']}")
    goals = {}
    if "fit" in results:
        f = results["fit"]
        goals = {
            "fit_shapes_le_buckets": f["forward_shapes"] <= f["num_buckets"],
            "fit_padding_overhead_le_25pct": f["padding_overhead"] <= 0.25,
            "fit_faster_than_none": bool(base) and f["total_s"] < base["total_s"],
        }
        print("goals: " + ", ".join(f"{k}={v}" for k, v in goals.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"}, "results": results,
                   "goals": goals}, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
