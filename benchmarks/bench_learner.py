"""Learner tokens/s on a Hugging Face causal LM: one GRPO ``Learner.train_step`` on tpu (compiled
micro-batch programs) vs the same step in torch CPU eager, in one run.

The policy is a randomly initialized Qwen2-shaped ``Qwen2ForCausalLM`` (``--hidden``,
``--layers``, ``--vocab``; made from its config). The batch is ``--prompts`` x ``--group``
sequences with prompts of ``--prompt-min``..``--prompt-max`` tokens and responses of 1..
``--response-max`` tokens (varied lengths, as rollouts are), the rollout log-probs those of the
CPU model. Both sides run the same configuration: GRPO with a KL term to a frozen reference
(``--kl-coef``), micro-batches by ``--micro-batch-tokens`` (or ``--micro-batch-size`` rows),
``--gradient-checkpointing``, ``--dtype`` float32 or bfloat16 (float32 master weights).

Sides are timed in alternating blocks of ``--iters`` steps (``--repeats`` blocks); the first step
of each side (the tpu side's compiles) is reported on its own and the compiles during the timed
blocks are counted (must be 0). Tokens/s is the learner's ``learner_tokens_per_s``: prompt +
response tokens trained on per second.

``--learner-processes N`` (> 1) adds the sharded learner: N spawned processes in one ``tpu``
process group, each ``Learner(fsdp=True)`` (FSDP2 per decoder layer + root) on its share of the
batch (whole prompt groups), compiled as the tpu side is (``--sharded-eager``: not); two warm-up
steps (reported together as its first step), then timed the same way after the in-process sides
(whose process idles meanwhile); tokens/s over the whole batch, and the ratio to the
one-process tpu learner. On one CPU host the N processes share its cores, so there this measures
what sharding costs (every layer's weights gathered, its gradients reduce-scattered); the speedup
is for hosts with a chip each.

    python benchmarks/bench_learner.py --out runs/bench_learner.json
    python benchmarks/bench_learner.py --learner-processes 2 --out runs/bench_learner_sharded.json
    python benchmarks/bench_learner.py --quick
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
from tqdm import tqdm  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu.bucketing import BucketPolicy  # noqa: E402
from torchtpu_rl import Learner, RolloutBatch, sequence_logprobs  # noqa: E402

torch.set_num_threads(THREADS)


def make_batch(args, model):
    g = torch.Generator().manual_seed(0)
    B, P, R = args.prompts * args.group, args.prompt_max, args.response_max
    plens = torch.randint(args.prompt_min, P + 1, (args.prompts,), generator=g).repeat_interleave(args.group)
    rlens = torch.randint(1, R + 1, (B,), generator=g)
    pmask = (torch.arange(P)[None] >= P - plens[:, None]).long()
    rmask = torch.arange(R)[None] < rlens[:, None]
    prompt_ids = torch.randint(3, args.vocab, (args.prompts, P), generator=g).repeat_interleave(args.group, 0)
    batch = RolloutBatch(prompt_ids=prompt_ids * pmask, prompt_mask=pmask,
                         response_ids=torch.randint(3, args.vocab, (B, R), generator=g) * rmask, response_mask=rmask,
                         logprobs=torch.zeros(B, R), policy_version=torch.zeros(B, dtype=torch.int64),
                         stopped=torch.zeros(B, dtype=torch.bool))
    with torch.no_grad():
        batch.logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask)
    rewards = torch.randn(B, generator=g)
    return batch, rewards


def learner_kwargs(args) -> dict:
    return dict(algo="grpo", group_size=args.group, lr=1e-5, kl_coef=args.kl_coef,
                micro_batch_tokens=args.micro_batch_tokens, micro_batch_size=args.micro_batch_size,
                gradient_checkpointing=args.gradient_checkpointing, param_dtype=args.dtype,
                length_buckets=BucketPolicy.pow2(16, 2048))


def sharded_rank(rank, port, args, nprocs, queue):
    """One rank of the sharded learner: its share of the batch, timed as the in-process sides."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                            timeout=datetime.timedelta(seconds=600))
    base = common.tiny_qwen2(args)
    batch, rewards = make_batch(args, base)
    share = len(batch) // nprocs
    rows = slice(rank * share, (rank + 1) * share)
    mine, my_rewards = batch.select(rows), rewards[rows]
    learner = Learner(base, device="tpu", compile=not args.sharded_eager, fsdp=True, **learner_kwargs(args))
    t0 = time.perf_counter()
    # two warm-up steps: the second one compiles too (the optimizer state's first update on the shards)
    metrics = [learner.train_step(mine, my_rewards), learner.train_step(mine, my_rewards)]
    first = time.perf_counter() - t0
    compiles = torchtpu.metrics.snapshot()["compiles"]
    blocks = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            metrics.append(learner.train_step(mine, my_rewards))
        blocks.append((time.perf_counter() - t0) / args.iters)
    timed_compiles = torchtpu.metrics.snapshot()["compiles"] - compiles
    if rank == 0:
        queue.put({"blocks": blocks, "first": first, "metrics": metrics, "timed_compiles": timed_compiles})
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--response-max", type=int, default=96)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per side (alternating)")
    p.add_argument("--iters", type=int, default=2, help="train steps per timed block")
    p.add_argument("--learner-processes", type=int, default=1,
                   help="N > 1: also time the sharded learner (N processes, FSDP2) on the same batch")
    p.add_argument("--sharded-eager", action="store_true", help="the sharded learner without torch.compile")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--out", default="runs/bench_learner.json")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 256
        args.prompts, args.response_max, args.micro_batch_tokens, args.repeats, args.iters = 2, 32, 256, 2, 1
    if args.micro_batch_tokens <= 0:
        args.micro_batch_tokens = None
    if args.learner_processes < 1 or args.prompts % args.learner_processes:
        p.error(f"--prompts {args.prompts} must be a multiple of --learner-processes {args.learner_processes} "
                f"(each learner process trains on whole prompt groups)")

    base = common.tiny_qwen2(args)
    batch, rewards = make_batch(args, base)
    kw = learner_kwargs(args)
    learners = {"tpu_compiled": Learner(copy.deepcopy(base), device="tpu", compile=True, **kw),
                "cpu_eager": Learner(copy.deepcopy(base), device="cpu", **kw)}
    bar = tqdm(total=len(learners) * (1 + args.repeats * args.iters), desc="bench_learner", unit="step")
    first, metrics = {}, {}
    for name, lr_ in learners.items():
        t0 = time.perf_counter()
        metrics[name] = [lr_.train_step(batch, rewards)]
        first[name] = time.perf_counter() - t0
        bar.update()
    compiles = torchtpu.metrics.snapshot()["compiles"]
    blocks = {n: [] for n in learners}
    for _ in range(args.repeats):
        for name, lr_ in learners.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                metrics[name].append(lr_.train_step(batch, rewards))
                bar.update()
            blocks[name].append((time.perf_counter() - t0) / args.iters)
    bar.close()
    timed_compiles = torchtpu.metrics.snapshot()["compiles"] - compiles
    if args.learner_processes > 1:  # after the in-process sides: the processes would share the cores
        name = f"tpu_fsdp_{args.learner_processes}proc"
        out = common.spawn_ranks(sharded_rank, args.learner_processes, args, args.learner_processes)
        blocks[name], first[name], metrics[name] = out["blocks"], out["first"], out["metrics"]
        timed_compiles += out["timed_compiles"]
        learners[name] = None

    real_tokens = int(batch.attention_mask.sum())
    res = {}
    for name in learners:
        s = statistics.median(blocks[name])
        last = metrics[name][-1]
        res[name] = {"seconds_per_step": s, "learner_tokens_per_s": real_tokens / s,
                     "learner_tokens_per_s_reported": statistics.median(
                         m["learner_tokens_per_s"] for m in metrics[name][1:]),
                     "first_step_s": first[name], "blocks_s": blocks[name],
                     # first step: the recompute of the weights that scored the batch (engine numerics only)
                     "rollout_logprob_diff_max": metrics[name][0]["rollout_logprob_diff_max"],
                     "pg_loss_first": metrics[name][0]["pg_loss"], "kl_last": last.get("kl")}
    ratio = statistics.median([c / t for t, c in zip(blocks["tpu_compiled"], blocks["cpu_eager"])])
    ratios = {"learner tpu_compiled/cpu_eager (speed)": ratio}
    if args.learner_processes > 1:
        name = f"tpu_fsdp_{args.learner_processes}proc"
        ratios[f"learner {name}/tpu_compiled (speed)"] = (statistics.median(blocks["tpu_compiled"])
                                                           / statistics.median(blocks[name]))
        for key in ("pg_loss_first", "rollout_logprob_diff_max"):  # the same batch, the same first update
            a, b = res[name][key], res["tpu_compiled"][key]
            assert abs(a - b) <= 1e-3 * (1 + abs(b)), f"sharded learner {key} {a} != {b}"

    print(f"\nQwen2-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}; "
          f"{len(batch)} sequences, {real_tokens} tokens (prompt {args.prompt_min}-{args.prompt_max}, response "
          f"1-{args.response_max}); micro_batch_tokens={args.micro_batch_tokens}, gradient checkpointing "
          f"{'on' if args.gradient_checkpointing else 'off'}; threads={THREADS}")
    for name, r in res.items():
        print(f"  learner {name:<13} {r['learner_tokens_per_s']:9.0f} tok/s  {r['seconds_per_step'] * 1e3:8.1f} "
              f"ms/step   (first step {r['first_step_s']:.1f} s; its rollout log-prob diff "
              f"{r['rollout_logprob_diff_max']:.1e})")
    for k, v in ratios.items():
        print(f"  {k:<42} {v:6.2f}x")
    print(f"  compiles during the timed blocks: {timed_compiles} (must be 0)")

    common.write_json(args.out, {
        "benchmark": "learner",
        "config": vars(args),
        "env": common.environment(THREADS),
        "tokens_per_step": real_tokens,
        "results": res,
        "ratios": ratios,
        "compiles_during_timed_blocks": timed_compiles,
        "cpu_fallbacks": torchtpu.metrics.snapshot()["cpu_fallbacks"],
    })


if __name__ == "__main__":
    main()
