"""Compiled training step (torch.compile backend="tpu") against its references, in one run.

TinyTransformer (default config: d_model 64, 2 layers, 4 heads, seq 32, vocab 256),
batch 8, AdamW (foreach), one step = forward, cross entropy, zero_grad, backward,
optimizer.step(). Timed side by side, taking turns repeat by repeat:

- ``jax``: the same model and AdamW written directly in JAX, one jitted step with
  donated state (benchmarks/jax_transformer.py): the executor's limit;
- ``compiled``: the whole step inside ``torch.compile(backend="tpu")``;
- ``compiled_fwd_bwd``: forward+backward compiled, ``optimizer.step()`` eager (strict);
- ``defer``: the whole step eager under DeferAndFuse (closed by ``torchtpu.sync()``);
- ``cpu``: torch CPU eager.

Reports the ratios compiled/jax (goal <= 1.2), compiled/defer, compiled/cpu, the
first-call times (compiled: Dynamo + AOTAutograd + XLA compiles; jax: jit compile),
and checks that the compiled and JAX losses agree for the first steps.

    python benchmarks/bench_compile.py --out runs/bench_compile.json
    python benchmarks/bench_compile.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.pin_threads(common.early_threads())

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import torchtpu  # noqa: E402
import torchtpu.compile  # noqa: E402,F401
from jax_transformer import JaxTrainer  # noqa: E402
from torchtpu.models import TinyTransformer, TransformerConfig  # noqa: E402


def make_torch(device, cfg, batch, mode="whole"):
    """A zero-argument training step on a fixed batch; mode: whole | fwd_bwd | eager."""
    torch.manual_seed(0)
    model = TinyTransformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = (t.to(device) for t in batch)

    def step():
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    if mode == "whole":
        return torch.compile(step, backend="tpu")
    if mode == "fwd_bwd":
        @torch.compile(backend="tpu")
        def fwd_bwd():
            loss = model.loss(x, y)
            loss.backward()
            return loss

        def run():
            opt.zero_grad(set_to_none=True)
            loss = fwd_bwd()
            opt.step()
            return loss

        return run
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10, help="steps per timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no DeferAndFuse/fwd_bwd rows (< 60 s)")
    ap.add_argument("--out", default="runs/bench_compile.json")
    args = ap.parse_args()
    if args.quick:
        args.iters, args.repeats, args.warmup = 5, 3, 2
    torch.set_num_threads(args.threads)
    cfg = TransformerConfig()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1), generator=g)
    batch = (seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    # ---- first calls (compile) and the loss check: compiled and JAX from the same weights
    torch.manual_seed(0)
    jt = JaxTrainer(TinyTransformer(cfg), *batch, lr=1e-3, weight_decay=0.01)
    t0 = time.perf_counter()
    jl = [float(jt.step())]
    first_jax = time.perf_counter() - t0
    comp = make_torch("tpu", cfg, batch, "whole")
    torchtpu.metrics.reset()
    t0 = time.perf_counter()
    cl = [comp().item()]
    first_comp = time.perf_counter() - t0
    t0 = time.perf_counter()
    cl.append(comp().item())  # the optimizer's state exists from here: its graph may recompile once
    second_comp = time.perf_counter() - t0
    compiles_first = torchtpu.metrics.snapshot()["compiles"]
    jl.append(float(jt.step()))
    for _ in range(3):
        cl.append(comp().item())
        jl.append(float(jt.step()))
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(cl, jl))
    print(f"losses compiled {[round(v, 5) for v in cl]}\n       jax      {[round(v, 5) for v in jl]}"
          f"  (max rel diff {loss_rel:.1e})")

    fns = {"jax": jt.step, "compiled": comp}
    syncs = {"jax": jt.sync, "compiled": torchtpu.synchronize}
    if not args.quick:
        fns["compiled_fwd_bwd"] = make_torch("tpu", cfg, batch, "fwd_bwd")
        syncs["compiled_fwd_bwd"] = torchtpu.synchronize
        defer_step = make_torch("tpu", cfg, batch, "eager")

        def defer():
            with torchtpu.execution_mode("defer_and_fuse"):
                loss = defer_step()
                torchtpu.sync()
            return loss

        fns["defer"] = defer
        syncs["defer"] = torchtpu.synchronize
    fns["cpu"] = make_torch("cpu", cfg, batch, "eager")

    # ---- interleaved timing: each repeat runs every variant in turn
    for name, fn in fns.items():
        for _ in range(args.warmup):
            fn()
        if syncs.get(name):
            syncs[name]()
    torchtpu.metrics.reset()
    per = {name: [] for name in fns}
    for _ in tqdm(range(args.repeats), desc="repeats", leave=False):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                loss = fn()
            if name == "cpu":
                loss.item()
            else:
                syncs[name]()
            per[name].append((time.perf_counter() - t0) / args.iters * 1e3)
    steady_compiles = torchtpu.metrics.snapshot()["compiles"]

    ms = {name: statistics.median(v) for name, v in per.items()}

    def ratio(a, b):  # median of per-repeat ratios: load bursts hit both alike
        return statistics.median(x / y for x, y in zip(per[a], per[b]))

    ratios = {"compiled/jax": ratio("compiled", "jax"), "compiled/cpu": ratio("compiled", "cpu"),
              "jax/cpu": ratio("jax", "cpu")}
    if "defer" in fns:
        ratios["compiled/defer"] = ratio("compiled", "defer")
        ratios["compiled_fwd_bwd/jax"] = ratio("compiled_fwd_bwd", "jax")
        ratios["compiled_fwd_bwd/cpu"] = ratio("compiled_fwd_bwd", "cpu")
    print(f"\n{'variant':18s} {'ms/step':>9s}   (median of {args.repeats} x {args.iters} steps)")
    for name in fns:
        print(f"{name:18s} {ms[name]:9.2f}")
    print()
    for k, v in ratios.items():
        print(f"{k:22s} {v:6.2f}x")
    print(f"\nfirst call: compiled {first_comp:.2f} s (second {second_comp:.2f} s, {compiles_first} XLA compiles), "
          f"jax {first_jax:.2f} s")
    print(f"XLA compiles during the timed steps: {steady_compiles} (a steady loop must be 0)")
    if ratios["compiled/jax"] > 1.2:
        print(f"goal compiled/jax <= 1.2 missed by {ratios['compiled/jax'] / 1.2:.2f}x")
    common.write_json(args.out, {
        "environment": common.environment(args.threads),
        "config": {"model": vars(cfg), "batch": args.batch, "iters": args.iters, "repeats": args.repeats},
        "ms_per_step": ms, "repeats_ms": per, "ratios": ratios,
        "first_call_s": {"compiled": first_comp, "compiled_second": second_comp, "jax": first_jax},
        "compiles_first_two_calls": compiles_first, "compiles_steady": steady_compiles,
        "losses": {"compiled": cl, "jax": jl, "max_rel_diff": loss_rel},
    })


if __name__ == "__main__":
    main()
