"""Learner tokens/s with sequence packing (``Learner(pack_sequences=True)``) vs padded rows, on long-tailed
response lengths, in one run.

The batch is ``--prompts`` x ``--group`` sequences: prompts of ``--prompt-min``..``--prompt-max`` tokens,
responses long-tailed as RL rollouts are (most stop early, a few run to ``--response-max``: lengths
``1 + Exponential(mean --response-mean)`` capped at the limit). Both sides are the same compiled tpu GRPO
learner (``--loss-type``, KL to a frozen reference) on a Qwen2-shaped Hugging Face model; padded: each
micro-batch is its rows at the batch's length bucket; packed: the same micro-batches' sequences end to
end in rows of that length (block-diagonal attention), the row count a power of two. Sides are timed in
alternating blocks of ``--iters`` steps (``--repeats`` blocks), after a first (compiling) step each; the
first update's loss of the two sides must agree. Tokens/s is ``learner_tokens_per_s`` (prompt + response
tokens trained on per second).

    python benchmarks/bench_packing.py --out runs/bench_packing.json
    python benchmarks/bench_packing.py --quick
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

THREADS = common.early_threads()
common.pin_threads(THREADS)

import torch  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu.bucketing import BucketPolicy  # noqa: E402
from torchtpu_rl import Learner, RolloutBatch, sequence_logprobs  # noqa: E402

torch.set_num_threads(THREADS)


def long_tailed_batch(args, model):
    g = torch.Generator().manual_seed(0)
    B, P, R = args.prompts * args.group, args.prompt_max, args.response_max
    plens = torch.randint(args.prompt_min, P + 1, (args.prompts,), generator=g).repeat_interleave(args.group)
    expo = -torch.log(torch.rand(B, generator=g)) * args.response_mean
    rlens = (1 + expo.long()).clamp(max=R)
    pmask = (torch.arange(P)[None] >= P - plens[:, None]).long()
    rmask = torch.arange(R)[None] < rlens[:, None]
    prompt_ids = torch.randint(3, args.vocab, (args.prompts, P), generator=g).repeat_interleave(args.group, 0)
    batch = RolloutBatch(prompt_ids=prompt_ids * pmask, prompt_mask=pmask,
                         response_ids=torch.randint(3, args.vocab, (B, R), generator=g) * rmask, response_mask=rmask,
                         logprobs=torch.zeros(B, R), policy_version=torch.zeros(B, dtype=torch.int64),
                         stopped=torch.zeros(B, dtype=torch.bool))
    with torch.no_grad():
        batch.logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
    return batch, torch.randn(B, generator=g), rlens


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--response-max", type=int, default=224)
    p.add_argument("--response-mean", type=float, default=32.0, help="mean of the exponential response lengths")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (default: all)")
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per side (alternating)")
    p.add_argument("--iters", type=int, default=2, help="train steps per timed block")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--out", default="runs/bench_packing.json")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 256
        args.prompts, args.response_max, args.response_mean, args.repeats, args.iters = 4, 96, 12.0, 2, 1

    base = common.tiny_qwen2(args)
    batch, rewards, rlens = long_tailed_batch(args, base)
    kw = dict(algo="grpo", group_size=args.group, lr=1e-5, kl_coef=args.kl_coef, loss_type=args.loss_type,
              micro_batch_size=args.micro_batch_size, length_buckets=BucketPolicy.pow2(16, 2048), device="tpu",
              compile=True)
    learners = {"padded": Learner(copy.deepcopy(base), **kw),
                "packed": Learner(copy.deepcopy(base), pack_sequences=True, **kw)}
    first, metrics = {}, {}
    for name, lr_ in learners.items():
        t0 = time.perf_counter()
        metrics[name] = [lr_.train_step(batch, rewards)]
        first[name] = time.perf_counter() - t0
    a, b = metrics["packed"][0]["loss"], metrics["padded"][0]["loss"]
    assert abs(a - b) <= 1e-4 * (1 + abs(b)), f"packed first loss {a} != padded {b}"
    compiles = torchtpu.metrics.snapshot()["compiles"]
    blocks = {n: [] for n in learners}
    for _ in range(args.repeats):
        for name, lr_ in learners.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                metrics[name].append(lr_.train_step(batch, rewards))
            blocks[name].append((time.perf_counter() - t0) / args.iters)
    timed_compiles = torchtpu.metrics.snapshot()["compiles"] - compiles

    real = int(batch.attention_mask.sum())
    Lb = learners["padded"].length_buckets.bucket(batch.input_ids.shape[1])
    res = {n: {"seconds_per_step": statistics.median(blocks[n]), "learner_tokens_per_s": real / statistics.median(
        blocks[n]), "first_step_s": first[n], "blocks_s": blocks[n], "loss_first": metrics[n][0]["loss"]}
        for n in learners}
    ratio = statistics.median([pd / pk for pd, pk in zip(blocks["padded"], blocks["packed"])])
    print(f"\nQwen2-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {len(batch)} "
          f"sequences, {real} real tokens of {len(batch) * Lb} padded ({real / (len(batch) * Lb):.0%}); responses "
          f"1-{args.response_max}, median {int(rlens.median())}, max {int(rlens.max())}; threads={THREADS}")
    for n, r in res.items():
        print(f"  learner {n:<7} {r['learner_tokens_per_s']:9.0f} tok/s  {r['seconds_per_step'] * 1e3:8.1f} ms/step "
              f"(first step {r['first_step_s']:.1f} s)")
    print(f"  packed/padded (speed) {ratio:6.2f}x; compiles during the timed blocks: {timed_compiles} (must be 0)")
    common.write_json(args.out, {
        "benchmark": "packing", "config": vars(args), "env": common.environment(THREADS),
        "real_tokens": real, "padded_tokens": len(batch) * Lb, "results": res,
        "ratios": {"learner packed/padded (speed)": ratio}, "compiles_during_timed_blocks": timed_compiles,
    })


if __name__ == "__main__":
    main()
