"""Quickstart: train a small transformer on the ``tpu`` device.

The task is generated in code (no downloads): each sequence is a random block
of ``--period`` tokens repeated to fill the context, so every token after the
first block can be predicted by copying the token ``period`` places back. The
loss counts only those predictable positions: it starts at ln(vocab) = 5.5
(a uniform guess) and falls towards 0 as the model learns to copy, which a
two-layer transformer does in a few hundred steps.

    python examples/quickstart.py                    # tpu, strict eager
    python examples/quickstart.py --device cpu       # the same run on torch CPU
    python examples/quickstart.py --steps 100 --out runs/qs

Writes ``metrics.json`` and ``loss.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import torchtpu
from torchtpu_models import TinyTransformer, TransformerConfig


def make_batch(batch, seq_len, period, vocab, generator):
    """(inputs, targets): repeated random blocks; the first block's targets are ignored."""
    block = torch.randint(0, vocab, (batch, period), generator=generator)
    seq = block.repeat(1, seq_len // period + 2)[:, : seq_len + 1]
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, : period - 1] = -100  # not predictable from the context: no loss there
    return inputs, targets


def accuracy(logits, targets):
    mask = targets != -100
    return ((logits.argmax(-1) == targets) & mask).sum() / mask.sum()


def main():
    p = argparse.ArgumentParser(description="Train a small transformer on tpu (or cpu) on a synthetic copy task.")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="tpu", choices=["tpu", "cpu"])
    p.add_argument("--mode", default="strict_eager", help="tpu execution mode (torchtpu.set_execution_mode)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--period", type=int, default=8, help="length of the repeated block")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--out", default="runs/quickstart")
    args = p.parse_args()

    from tqdm import tqdm

    if args.device == "tpu":
        torchtpu.set_execution_mode(args.mode)
    torch.manual_seed(args.seed)
    cfg = TransformerConfig()  # vocab 256, d_model 64, 2 layers, 4 heads, seq 32
    model = TinyTransformer(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))  # short warmup
    gen = torch.Generator().manual_seed(args.seed + 1)

    print(f"TinyTransformer ({model.num_parameters():,} parameters) on {args.device}"
          + (f", mode {args.mode}" if args.device == "tpu" else "")
          + f": {args.steps} steps, batch {args.batch}, copy task with period {args.period}")
    print(f"a uniform guess has loss ln({cfg.vocab_size}) = {math.log(cfg.vocab_size):.3f}")
    torchtpu.metrics.reset()

    losses, log = [], []
    t_start = time.perf_counter()
    first_step_s = None
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    for step in bar:
        x, y = make_batch(args.batch, cfg.max_seq_len, args.period, cfg.vocab_size, gen)
        x, y = x.to(args.device), y.to(args.device)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        value = loss.item()  # a host read: the step's work is complete here
        if first_step_s is None:
            first_step_s = time.perf_counter() - t_start
        losses.append(value)
        if step % args.log_every == 0 or step == args.steps - 1:
            acc = accuracy(logits.detach(), y).item()
            log.append({"step": step, "loss": value, "accuracy": acc})
            bar.set_postfix(loss=f"{value:.3f}", acc=f"{acc:.2f}")
    bar.close()
    total_s = time.perf_counter() - t_start

    k = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    steady = (total_s - first_step_s) / max(1, args.steps - 1)
    snap = torchtpu.metrics.snapshot()
    print(f"loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f}"
          f"  (accuracy on predictable tokens {log[-1]['accuracy']:.1%})")
    print(f"time: {total_s:.1f} s total, first step {first_step_s:.1f} s (compiles), then {steady * 1e3:.1f} ms/step")
    if args.device == "tpu":
        print(f"tpu: {snap['compiles']} XLA compiles, {snap['cache_hits']} executable cache hits, "
              f"cpu fallbacks: {snap['cpu_fallbacks'] or 'none'}")

    os.makedirs(args.out, exist_ok=True)
    metrics = {
        "device": args.device,
        "mode": args.mode if args.device == "tpu" else None,
        "steps": args.steps,
        "config": vars(cfg),
        "parameters": model.num_parameters(),
        "loss_first": first,
        "loss_last": last,
        "final_accuracy": log[-1]["accuracy"],
        "losses": losses,
        "log": log,
        "total_s": total_s,
        "first_step_s": first_step_s,
        "ms_per_step": steady * 1e3,
        "compiles": snap["compiles"],
        "cache_hits": snap["cache_hits"],
        "cpu_fallbacks": snap["cpu_fallbacks"],
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=1, label="loss")
    ax.axhline(math.log(cfg.vocab_size), color="gray", ls="--", lw=0.8, label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (predictable tokens)")
    ax.set_title(f"TinyTransformer on {args.device}" + (f" ({args.mode})" if args.device == "tpu" else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=120)
    print(f"wrote {args.out}/metrics.json and {args.out}/loss.png")
    if not last < first:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
