"""DeferAndFuse vs Strict Eager (and torch CPU eager) on whole training steps.

For the TinyTransformer and the DLRM-style MLP: step time and peak device
memory per step, measured side by side in one run. Each step is forward,
loss, backward, AdamW step and zero_grad, closed by ``torchtpu.sync()`` (so a
step's time includes its flush). Ratios are what to read: the machines are
shared and absolute times drift. Besides wall time it reports the process's
CPU time per step (all threads: python, the autograd thread and XLA's), which
a loaded machine disturbs far less than wall time.

    python benchmarks/bench_defer.py --out runs/bench_defer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch CPU and XLA CPU share 2 cores

import torch  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu.models import DLRMStyleMLP, TinyTransformer  # noqa: E402


def transformer_case(batch, seq):
    torch.manual_seed(0)
    model = TinyTransformer(d_model=128, n_layers=2, n_heads=4, max_seq_len=seq, vocab_size=256)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return model, (lambda m, d: m.loss(d[0], d[1])), (ids[:, :-1], ids[:, 1:])


def dlrm_case(batch, _seq):
    torch.manual_seed(0)
    model = DLRMStyleMLP(table_sizes=(1000, 500, 200), embedding_dim=32, bottom_mlp=(64, 32), top_mlp=(64, 32))
    g = torch.Generator().manual_seed(1)
    dense, sparse, labels = model.make_batch(batch, generator=g)
    return model, (lambda m, d: m.loss(d[0], d[1], d[2])), (dense, sparse, labels)


def _to(x, device):
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x.to(device)


def run(case, device, mode, steps, warmup, batch, seq):
    model, loss_fn, data = case(batch, seq)
    model = model.to(device)
    data = _to(data, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx = torchtpu.execution_mode(mode) if device == "tpu" else _Null()
    times, cpus, peaks = [], [], []
    m0 = None
    with ctx:
        for i in range(warmup + steps):
            if device == "tpu":
                torchtpu.sync()
                torch.tpu.reset_peak_memory_stats()
                base = torch.tpu.memory_allocated()
            if i == warmup:
                m0 = torchtpu.metrics.snapshot()
            t0 = time.perf_counter()
            c0 = time.process_time()
            loss = loss_fn(model, data)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device == "tpu":
                torchtpu.sync()
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if i >= warmup:
                times.append(dt)
                cpus.append(dc)
                if device == "tpu":
                    peaks.append(torch.tpu.max_memory_allocated() - base)
        m1 = torchtpu.metrics.snapshot()
        final_loss = float(loss.detach().cpu())
    return {
        "step_s": statistics.median(times),
        "cpu_s": statistics.median(cpus),
        "compiles_timed": m1["compiles"] - m0["compiles"],
        "flushes_timed": {k: v - m0["flushes"].get(k, 0) for k, v in m1["flushes"].items() if v != m0["flushes"].get(k, 0)},
        "peak_bytes": max(peaks) if peaks else None,
        "final_loss": final_loss,
    }


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default="runs/bench_defer.json")
    ap.add_argument("--quick", action="store_true", help="3 warm-up and 3 timed steps (< 60 s)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = 3, 3
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    results = {"loadavg_1min_at_start": os.getloadavg()[0]}  # above the core count: trust cpu times, not wall
    for name, case in (("transformer", transformer_case), ("dlrm_mlp", dlrm_case)):
        r = {}
        r["cpu_eager"] = run(case, "cpu", None, args.steps, args.warmup, args.batch, args.seq)
        r["strict_eager"] = run(case, "tpu", "strict_eager", args.steps, args.warmup, args.batch, args.seq)
        r["defer_and_fuse"] = run(case, "tpu", "defer_and_fuse", args.steps, args.warmup, args.batch, args.seq)
        r["ratios"] = {
            "strict_over_defer_time": r["strict_eager"]["step_s"] / r["defer_and_fuse"]["step_s"],
            "strict_over_defer_cpu_time": r["strict_eager"]["cpu_s"] / r["defer_and_fuse"]["cpu_s"],
            "defer_over_cpu_time": r["defer_and_fuse"]["step_s"] / r["cpu_eager"]["step_s"],
            "defer_over_cpu_cpu_time": r["defer_and_fuse"]["cpu_s"] / r["cpu_eager"]["cpu_s"],
            "defer_over_strict_peak_memory": r["defer_and_fuse"]["peak_bytes"] / max(1, r["strict_eager"]["peak_bytes"]),
        }
        results[name] = r
        print(f"\n{name}")
        for k in ("cpu_eager", "strict_eager", "defer_and_fuse"):
            v = r[k]
            peak = "" if v["peak_bytes"] is None else f"  peak {v['peak_bytes'] / 2**20:7.2f} MiB"
            extra = f"  compiles {v['compiles_timed']} flushes {v['flushes_timed']}" if k != "cpu_eager" else ""
            print(f"  {k:15s} {v['step_s'] * 1e3:9.2f} ms/step wall {v['cpu_s'] * 1e3:9.2f} ms/step cpu"
                  f"{peak}  loss {v['final_loss']:.4f}{extra}")
        for k, v in r["ratios"].items():
            print(f"  {k:32s} {v:6.2f}x")
    results["metrics"] = torchtpu.metrics.snapshot()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
