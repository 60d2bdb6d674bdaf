"""RL core throughput: rollout tokens/s and learner tokens/s, tpu vs torch CPU eager, in one run.

Rollout: ``RolloutEngine.generate`` of ``--prompts`` x ``--group`` sequences
(prompts of ``--prompt-len`` tokens, ``--new-tokens`` sampled tokens each, no
stop token so every call does the same work) with a ``TinyTransformer``
policy. Sides: tpu with the compiled decode step (the default), tpu strict
eager op by op, and torch CPU eager (the same engine code on cpu tensors).
Learner: ``Learner.train_step`` (GRPO, one optimizer step) on one fixed rollout
batch: tpu compiled micro-batch programs, and torch CPU eager. Tokens/s count
response tokens.

The sides are timed in alternating blocks (``--repeats``), the median block is
reported, ratios are medians over adjacent block pairs; the first call of each
tpu side (which compiles) is reported on its own, and the compiles during the
timed blocks (must be 0) are counted.

    python benchmarks/bench_rl.py --out runs/bench_rl.json
    python benchmarks/bench_rl.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

THREADS = common.early_threads()
common.pin_threads(THREADS)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu.bucketing import BucketPolicy  # noqa: E402
from torchtpu_rl import Learner, RolloutEngine, SamplingParams, make_policy  # noqa: E402

torch.set_num_threads(THREADS)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per side (alternating)")
    p.add_argument("--iters", type=int, default=3, help="calls per timed block")
    p.add_argument("--no-eager", action="store_true", help="skip the tpu strict-eager rollout side")
    p.add_argument("--quick", action="store_true", help="small run (< 60 s on a quiet machine)")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--out", default="runs/bench_rl.json")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.iters, args.no_eager = 3, 2, True

    max_len = 1 << (args.prompt_len + args.new_tokens - 1).bit_length()
    mk = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=max(32, max_len))
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(1, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = [q for q in base for _ in range(args.group)]
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    buckets = dict(prompt_buckets=BucketPolicy.pow2(4, 64), response_buckets=BucketPolicy.pow2(4, 64))

    sides = {"tpu_compiled": RolloutEngine(make_policy(args.vocab, seed=0, **mk), 0, device="tpu", compile=True,
                                           **buckets),
             "cpu_eager": RolloutEngine(make_policy(args.vocab, seed=0, **mk), 0, device="cpu", **buckets)}
    if not args.no_eager:
        sides["tpu_eager"] = RolloutEngine(make_policy(args.vocab, seed=0, **mk), 0, device="tpu", compile=False,
                                           **buckets)
    first = {}
    bar = tqdm(total=len(sides) + 2 + args.repeats * (len(sides) + 2), desc="bench_rl", unit="block")
    torch.manual_seed(0)
    for name, eng in sides.items():
        t0 = time.perf_counter()
        eng.generate(prompts, sp)
        first[name] = time.perf_counter() - t0
        bar.update()

    # learner sides on one fixed batch (generated once)
    batch = sides["tpu_compiled"].generate(prompts, sp)
    rewards = torch.tensor([float(sum(t % 2 == 0 for t in r)) for r in batch.responses()])
    learners = {
        "tpu_compiled": Learner(make_policy(args.vocab, seed=0, **mk), algo="grpo", group_size=args.group, lr=1e-4,
                                device="tpu", compile=True),
        "cpu_eager": Learner(make_policy(args.vocab, seed=0, **mk), algo="grpo", group_size=args.group, lr=1e-4,
                             device="cpu"),
    }
    for name, lr_ in learners.items():
        t0 = time.perf_counter()
        lr_.train_step(batch, rewards)
        first["learner_" + name] = time.perf_counter() - t0
        bar.update()

    compiles_before = torchtpu.metrics.snapshot()["compiles"]
    roll_t = {n: [] for n in sides}
    learn_t = {n: [] for n in learners}
    roll_tok = {n: [] for n in sides}
    for _ in range(args.repeats):
        for name, eng in sides.items():
            t0, ntok = time.perf_counter(), 0
            for _ in range(args.iters):
                ntok += eng.generate(prompts, sp).num_response_tokens
            roll_t[name].append((time.perf_counter() - t0) / args.iters)
            roll_tok[name].append(ntok / args.iters)
            bar.update()
        for name, lr_ in learners.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                lr_.train_step(batch, rewards)
            learn_t[name].append((time.perf_counter() - t0) / args.iters)
            bar.update()
    bar.close()
    timed_compiles = torchtpu.metrics.snapshot()["compiles"] - compiles_before

    ntok_learn = batch.num_response_tokens
    res = {"rollout": {}, "learner": {}}
    for name in sides:
        s = statistics.median(roll_t[name])
        res["rollout"][name] = {"seconds_per_call": s, "tokens_per_s": statistics.median(roll_tok[name]) / s,
                                "first_call_s": first[name], "blocks_s": roll_t[name]}
    for name in learners:
        s = statistics.median(learn_t[name])
        res["learner"][name] = {"seconds_per_step": s, "tokens_per_s": ntok_learn / s,
                                "first_step_s": first["learner_" + name], "blocks_s": learn_t[name]}

    def ratio(times, a, b):  # per block pair: load from other jobs hits both
        return statistics.median([x / y for x, y in zip(times[b], times[a])])

    ratios = {f"rollout {n}/cpu_eager (speed)": ratio(roll_t, n, "cpu_eager") for n in sides if n != "cpu_eager"}
    ratios["learner tpu_compiled/cpu_eager (speed)"] = ratio(learn_t, "tpu_compiled", "cpu_eager")

    print(f"\nTinyTransformer policy: vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers; "
          f"{len(prompts)} sequences x {args.new_tokens} new tokens (prompt {args.prompt_len}); threads={THREADS}")
    for name, r in res["rollout"].items():
        print(f"  rollout {name:<13} {r['tokens_per_s']:10.0f} tok/s  {r['seconds_per_call'] * 1e3:8.1f} ms/call"
              f"   (first call {r['first_call_s']:.1f} s)")
    for name, r in res["learner"].items():
        print(f"  learner {name:<13} {r['tokens_per_s']:10.0f} tok/s  {r['seconds_per_step'] * 1e3:8.1f} ms/step"
              f"   (first step {r['first_step_s']:.1f} s)")
    for k, v in ratios.items():
        print(f"  {k:<42} {v:6.2f}x")
    print(f"  compiles during the timed blocks: {timed_compiles} (a steady loop must reuse its programs)")

    common.write_json(args.out, {
        "benchmark": "rl",
        "config": vars(args),
        "env": common.environment(THREADS),
        "sequences": len(prompts),
        **res,
        "ratios": ratios,
        "compiles_during_timed_blocks": timed_compiles,
        "cpu_fallbacks": torchtpu.metrics.snapshot()["cpu_fallbacks"],
    })


if __name__ == "__main__":
    main()
