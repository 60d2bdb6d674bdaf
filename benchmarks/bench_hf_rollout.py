"""Rollout tokens/s on a Hugging Face causal LM: KV-cached tpu engine vs the full-recompute tpu
engine vs ``transformers`` ``generate`` on torch CPU, at 64 and 512 new tokens, in one run.

The model is a randomly initialized Qwen2-shaped ``Qwen2ForCausalLM`` (``--hidden``,
``--layers``, ``--vocab``; made from its config, nothing downloaded). Every side generates the
same ``--batch`` prompts (lengths spread over ``--prompt-min``..``--prompt-max``, left-padded)
with the same sampling (temperature 1, no top-k/top-p, no stop token, so every call produces
exactly batch x new-tokens tokens):

- ``tpu_kv``: ``RolloutEngine`` on tpu, compiled prefill + decode programs over the static
  ``SlotCache`` (torchtpu_rl.hf_cache);
- ``tpu_full``: the same engine with ``use_kv_cache=False``: each new token recomputes the whole
  fixed-size buffer (what Hugging Face models did before the cache);
- ``hf_cpu_generate``: ``model.generate(do_sample=True)`` on torch CPU (its dynamic KV cache).

Each (side, length) pair is timed over ``--repeats`` calls (``--full-repeats`` for the full
recompute, whose 512-token call takes many minutes at the default size: ``--no-full`` skips it),
in alternating blocks. Each length has its own response bucket, so a short warm-up call (previous
length + 1 new tokens) compiles each tpu side's programs; its time is reported on its own and the
timed calls must compile nothing. Per-step time is call time / new tokens. Ratios:
``tpu_kv`` speed over each other side, and each side's per-step time at the longest length over
the shortest (1.0 = flat; the goal is within +-20% for ``tpu_kv``).

    python benchmarks/bench_hf_rollout.py --out runs/bench_hf_rollout.json
    python benchmarks/bench_hf_rollout.py --quick
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
from torchtpu_rl import RolloutEngine, SamplingParams  # noqa: E402

torch.set_num_threads(THREADS)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per generate call")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 512])
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side and length")
    p.add_argument("--full-repeats", type=int, default=1, help="timed calls of the full-recompute side")
    p.add_argument("--no-full", action="store_true", help="skip the full-recompute side")
    p.add_argument("--quick", action="store_true", help="small smoke run (a few minutes)")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--out", default="runs/bench_hf_rollout.json")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 256
        args.batch, args.new_tokens, args.repeats = 4, [16, 64], 2

    model = common.tiny_qwen2(args)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lens]
    P = max(lens)
    ids = torch.zeros(len(prompts), P, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, q in enumerate(prompts):
        ids[i, P - len(q):] = torch.tensor(q)
        mask[i, P - len(q):] = 1

    lengths = sorted(set(args.new_tokens))
    # one response bucket per measured length: a warm-up call of (previous length + 1) new tokens then
    # compiles the same programs as the timed ones without running their full length
    # the smallest: prefill, decode steps and a stop check (every sync_every = 4 steps)
    warm = {n: (lengths[i - 1] + 1 if i else min(n, 6)) for i, n in enumerate(lengths)}
    buckets = dict(prompt_buckets=BucketPolicy.pow2(16, 256), response_buckets=BucketPolicy.explicit(lengths))
    engines = {"tpu_kv": RolloutEngine(common.tiny_qwen2(args), 0, device="tpu", compile=True, **buckets)}
    if not args.no_full:
        engines["tpu_full"] = RolloutEngine(common.tiny_qwen2(args), 0, device="tpu", compile=True, use_kv_cache=False,
                                            **buckets)
    assert engines["tpu_kv"].use_kv_cache

    def run(side, n):
        if side == "hf_cpu_generate":
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                     pad_token_id=0)
            return int((out.shape[1] - P) * out.shape[0])
        return engines[side].generate(prompts, SamplingParams(max_new_tokens=n, temperature=1.0)).num_response_tokens

    sides = list(engines) + ["hf_cpu_generate"]
    reps = {s: (args.full_repeats if s == "tpu_full" else args.repeats) for s in sides}
    total = sum(len(args.new_tokens) * (reps[s] + (s != "hf_cpu_generate")) for s in sides)
    bar = tqdm(total=total, desc="bench_hf_rollout", unit="call")
    torch.manual_seed(0)
    first, times, tokens = {}, {}, {}
    for n in args.new_tokens:
        for s in sides:
            if s != "hf_cpu_generate":
                t0 = time.perf_counter()
                run(s, warm[n])
                first[(s, n)] = time.perf_counter() - t0
                bar.update()
        compiles = torchtpu.metrics.snapshot()["compiles"]
        for r in range(max(reps.values())):
            for s in sides:
                if r >= reps[s]:
                    continue
                t0 = time.perf_counter()
                ntok = run(s, n)
                times.setdefault((s, n), []).append(time.perf_counter() - t0)
                tokens[(s, n)] = ntok
                bar.update()
        first[("timed_compiles", n)] = torchtpu.metrics.snapshot()["compiles"] - compiles
    bar.close()

    res = {}
    for (s, n), ts in times.items():
        t = statistics.median(ts)
        res.setdefault(s, {})[str(n)] = {
            "seconds_per_call": t, "tokens_per_s": tokens[(s, n)] / t, "ms_per_step": t / n * 1e3,
            "warmup_call_s": first.get((s, n)), "calls_s": ts}
    lo, hi = min(args.new_tokens), max(args.new_tokens)
    ratios = {}
    for n in args.new_tokens:
        for s in sides:
            if s != "tpu_kv":
                ratios[f"tpu_kv/{s} speed @{n}"] = (res[s][str(n)]["seconds_per_call"]
                                                   / res["tpu_kv"][str(n)]["seconds_per_call"])
    for s in sides:
        ratios[f"{s} step time @{hi} / @{lo}"] = res[s][str(hi)]["ms_per_step"] / res[s][str(lo)]["ms_per_step"]

    print(f"\nQwen2-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.batch} "
          f"sequences, prompts {args.prompt_min}-{args.prompt_max} tokens; threads={THREADS}")
    for s in sides:
        for n in args.new_tokens:
            r = res[s][str(n)]
            fc = (f"   (compiling warm-up call {r['warmup_call_s']:.1f} s)" if r["warmup_call_s"] is not None
                  else "")
            print(f"  {s:<16} {n:4d} new: {r['tokens_per_s']:9.0f} tok/s  {r['ms_per_step']:8.2f} ms/step{fc}")
    for k, v in ratios.items():
        print(f"  {k:<40} {v:6.2f}x")
    timed = {n: first[("timed_compiles", n)] for n in args.new_tokens}
    print(f"  compiles during the timed calls: {timed} (must be 0)")

    common.write_json(args.out, {
        "benchmark": "hf_rollout",
        "config": vars(args),
        "env": common.environment(THREADS),
        "results": res,
        "ratios": ratios,
        "compiles_during_timed_calls": timed,
        "cpu_fallbacks": torchtpu.metrics.snapshot()["cpu_fallbacks"],
    })


if __name__ == "__main__":
    main()
