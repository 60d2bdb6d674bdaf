"""Where a DeferAndFuse transformer step's time goes: its fused XLA graph alone vs the pure-JAX twin.

Runs the bench_defer transformer step (TinyTransformer d_model 128, 2 layers, batch 8, seq 64,
AdamW foreach) under DeferAndFuse until its step graph is cached, then times, in one process:

- ``defer``: whole steps, pipelined (10 steps, then ``torch.tpu.synchronize()``);
- ``graph_alone``: the cached fused step executable called on fresh inputs of the same shapes,
  each call waited for (XLA's time for the step, without any recording);
- ``jax``: the pure-JAX twin of the same step (benchmarks/jax_transformer.py), pipelined and
  blocked;
- the main thread's CPU time per defer step (the recording of forward and optimizer; the
  backward is recorded on the autograd engine's device thread).

    python benchmarks/bench_defer_graph.py --out runs/bench_defer_graph.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu.runtime.recorder import RECORDER  # noqa: E402
from torchtpu_models import TinyTransformer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_transformer import JaxTrainer  # noqa: E402


def _median_ms(fn, reps, per=1):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) / per * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="runs/bench_defer_graph.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch, seq = 8, 64
    model = TinyTransformer(d_model=128, n_layers=2, n_heads=4, max_seq_len=seq, vocab_size=256)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    jt = JaxTrainer(model, x, y, lr=1e-3, weight_decay=0.01)
    m = model.to("tpu")
    xt, yt = x.to("tpu"), y.to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

    def defer_step():
        with torchtpu.execution_mode("defer_and_fuse"):
            loss = m.loss(xt, yt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torchtpu.sync()

    RECORDER.clear_cache()
    for _ in range(4):
        defer_step()
        jt.step()
    torch.tpu.synchronize()
    jt.sync()
    # the step graph: the cached fused graph with the most nodes
    key, compiled = max(RECORDER.graph_cache_entries(), key=lambda kv: len(kv[0][0]))
    avals = key[3]
    if not all(isinstance(a[0], tuple) for a in avals):
        raise SystemExit("bench_defer_graph: the step graph takes non-array inputs; cannot replay it")

    def graph_alone():
        inputs = [jnp.zeros(shape, dtype) for shape, dtype, _ in avals]
        jax.block_until_ready(inputs)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        return (time.perf_counter() - t0) * 1e3

    def defer_pipelined():
        for _ in range(10):
            defer_step()
        torch.tpu.synchronize()

    def jax_pipelined():
        for _ in range(10):
            jt.step()
        jt.sync()

    def jax_blocked():
        jt.step()
        jt.sync()

    res = {"defer": [], "graph_alone": [], "jax": [], "jax_blocked": [], "defer_main_thread_cpu": []}
    for _ in range(args.repeats):
        c0 = time.thread_time()
        res["defer"].append(_median_ms(defer_pipelined, 1, per=10))
        res["defer_main_thread_cpu"].append((time.thread_time() - c0) / 10 * 1e3)
        res["graph_alone"].append(statistics.median(graph_alone() for _ in range(5)))
        res["jax"].append(_median_ms(jax_pipelined, 1, per=10))
        res["jax_blocked"].append(_median_ms(jax_blocked, 5))
    ms = {k: statistics.median(v) for k, v in res.items()}
    ratios = {"graph_alone/jax_blocked": statistics.median(a / b for a, b in zip(res["graph_alone"], res["jax_blocked"])),
              "defer/jax": statistics.median(a / b for a, b in zip(res["defer"], res["jax"]))}
    print(f"step graph: {len(key[0])} nodes, {len(avals)} inputs, {len(key[2])} donated")
    for k, v in ms.items():
        print(f"{k:24s} {v:7.1f} ms")
    for k, v in ratios.items():
        print(f"{k:24s} {v:7.2f}x")
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"ms": ms, "ratios": ratios, "repeats_ms": res, "loadavg_1min": os.getloadavg()[0]}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
