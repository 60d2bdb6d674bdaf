"""The long-tailed GRPO rollout: the request-level ServingEngine vs the static-batch RolloutEngine vs
Hugging Face ``generate`` on torch CPU, in one run.

Workload (issue 28): ``--prompts`` prompts of ``--prompt-min``..``--prompt-max`` tokens, each
sampled ``--group`` times (128 sequences by default), temperature 1, on a randomly initialized
Qwen2-shaped model (hidden 256, 4 layers, 8 query / 2 key-value heads, vocab 2048; nothing
downloaded). Response lengths are long-tailed and reproducible: each sequence's length is drawn
once (seeded) from a geometric distribution of mean ``--mean-len``, capped at ``--max-len``, and
is that sequence's ``max_new_tokens`` (no stop token), so every side produces exactly the same
useful tokens:

- ``serving_*``: :class:`~torchtpu_rl.serving.ServingEngine`, one request per sequence with its
  own ``max_new_tokens``: a finished sequence frees its slot at once. ``serving_tpu`` (compiled
  programs on the tpu device, XLA), ``serving_tpu_32`` (32 slots for the 128 sequences: a stream
  with more requests than slots), ``serving_cpu`` (the same engine on torch's cpu device);
- ``rollout_tpu``: :class:`~torchtpu_rl.rollout.RolloutEngine` (compiled, static ``SlotCache``):
  one left-padded batch decoded until its longest row, the longest drawn length;
- ``hf_cpu_generate``: ``model.generate`` on torch CPU, one left-padded batch, ``max_new_tokens``
  = the longest drawn length (a static batch cannot stop a row early either).

The static sides' tokens/s count the same useful tokens (each row up to its drawn length). Each
tpu side is called once to compile (reported apart); then every side is timed over ``--repeats``
calls, interleaved (side after side per repeat, so the machine's load weighs on all alike), that
must compile nothing. Reported: tokens/s and its ratios, ``row_utilization`` (useful tokens / decode
rows computed; a static batch's is useful / (rows x steps)), ``prefill_tokens`` against the sum of
the distinct prompts' lengths, peak KV bytes against the static cache the RolloutEngine allocates,
compiles, and the ms per decode row-step of XLA on CPU (serving_tpu) against torch's (serving_cpu).

    python benchmarks/bench_rollout_engine.py --out runs/bench_rollout_engine.json
    python benchmarks/bench_rollout_engine.py --quick
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

import torchtpu  # noqa: E402
from torchtpu.bucketing import BucketPolicy  # noqa: E402
from torchtpu_rl import RolloutEngine, SamplingParams  # noqa: E402
from torchtpu_rl.kv_pages import kv_bytes_per_token  # noqa: E402
from torchtpu_rl.serving import ServingEngine  # noqa: E402

torch.set_num_threads(THREADS)


def workload(args):
    g = torch.Generator().manual_seed(args.seed)
    plens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in plens]
    # geometric lengths (support 1, 2, ...) of mean mean_len, capped
    p = 1.0 / args.mean_len
    u = torch.rand(args.prompts * args.group, generator=g, dtype=torch.float64)
    lens = (torch.log1p(-u) / torch.log1p(torch.tensor(-p, dtype=torch.float64))).ceil().clamp(1, args.max_len)
    seqs = [(prompts[i // args.group], int(lens[i])) for i in range(args.prompts * args.group)]
    return prompts, seqs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=48)
    p.add_argument("--mean-len", type=float, default=70.0)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--stream-slots", type=int, default=32, help="slots of the more-requests-than-slots side")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per side (interleaved)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small smoke run (a few minutes)")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--out", default="runs/bench_rollout_engine.json")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 256
        args.prompts, args.group, args.mean_len, args.max_len, args.stream_slots = 4, 4, 20, 64, 8

    prompts, seqs = workload(args)
    N = len(seqs)
    useful = sum(n for _, n in seqs)
    longest = max(n for _, n in seqs)
    distinct_prompt_tokens = sum(len(q) for q in prompts)
    flat_prompts = [q for q, _ in seqs]
    token_bytes = kv_bytes_per_token(common.tiny_qwen2(args))
    # the RolloutEngine's static cache for this batch: rows x (prompt bucket + response bucket) slots
    pb = BucketPolicy.pow2(16, 256).bucket(max(len(q) for q in prompts))
    rb = BucketPolicy.pow2(16, 512).bucket(longest)
    static_kv = N * (pb + rb) * token_bytes
    # the serving engines' budget: half the static cache (the issue's goal for the peak)
    kv_pages = static_kv // 2 // (token_bytes * args.page_size)

    sides = {}

    def serving(device, slots):
        eng = ServingEngine(common.tiny_qwen2(args), 0, max_slots=slots, page_size=args.page_size,
                            kv_pages=kv_pages, device=device, compile=device == "tpu")

        def run():
            eng.drop_cache()  # every call is a fresh GRPO step: no prompt was seen before
            for i, (q, n) in enumerate(seqs):
                eng.submit(q, SamplingParams(max_new_tokens=n, temperature=1.0), request_id=f"s{i}")
            outs = list(eng.stream())
            assert sum(len(s.tokens) for o in outs for s in o.samples) == useful
            return dict(eng.last_stats)
        return run

    def rollout():
        eng = RolloutEngine(common.tiny_qwen2(args), 0, device="tpu", compile=True,
                            prompt_buckets=BucketPolicy.pow2(16, 256), response_buckets=BucketPolicy.pow2(16, 512))

        def run():
            b = eng.generate(flat_prompts, SamplingParams(max_new_tokens=longest, temperature=1.0))
            steps = eng.last_stats["decode_steps"]
            return {"decode_rows": N * steps, "row_utilization": useful / (N * steps),
                    "prefill_tokens": sum(len(q) for q in flat_prompts), "kv_bytes_peak": static_kv,
                    "generated": b.num_response_tokens}
        return run

    model = common.tiny_qwen2(args)
    P = max(len(q) for q in prompts)
    ids = torch.zeros(N, P, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, q in enumerate(flat_prompts):
        ids[i, P - len(q):] = torch.tensor(q)
        mask[i, P - len(q):] = 1

    def hf():
        def run():
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=longest, min_new_tokens=longest, eos_token_id=None,
                                     pad_token_id=0)
            steps = out.shape[1] - P
            return {"decode_rows": N * steps, "row_utilization": useful / (N * steps),
                    "prefill_tokens": sum(len(q) for q in flat_prompts)}
        return run

    sides = {"serving_tpu": serving("tpu", N), "serving_tpu_%d" % args.stream_slots: serving("tpu", args.stream_slots),
             "serving_cpu": serving("cpu", N), "rollout_tpu": rollout(), "hf_cpu_generate": hf()}
    # every side warmed up (compiled) first, then the timed calls interleaved, side after side per
    # repeat: the machine's load then weighs on every side alike
    res = {name: {} for name in sides}
    for name, run in sides.items():
        if name != "hf_cpu_generate":
            t0 = time.perf_counter()
            run()
            res[name]["warmup_call_s"] = time.perf_counter() - t0
            print(f"  {name:<18} warm-up call {res[name]['warmup_call_s']:.1f} s", flush=True)
    c0 = torchtpu.metrics.snapshot()["compiles"]
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            t0 = time.perf_counter()
            res[name].update(run())
            times[name].append(time.perf_counter() - t0)
    timed_compiles = torchtpu.metrics.snapshot()["compiles"] - c0
    for name, r in res.items():
        r["seconds"] = statistics.median(times[name])
        r["calls_s"] = times[name]
        r["tokens_per_s"] = useful / r["seconds"]
        r["ms_per_row_step"] = r["seconds"] / r["decode_rows"] * 1e3
        print(f"  {name:<18} {r['tokens_per_s']:8.0f} tok/s  {r['seconds']:7.2f} s  row_util {r['row_utilization']:.2f}"
              f"  prefill {r['prefill_tokens']}  decode rows {r['decode_rows']}", flush=True)
    print(f"  compiles during the timed calls: {timed_compiles} (must be 0)")

    base = res["serving_tpu"]
    ratios = {f"serving_tpu/{s} tokens/s": base["tokens_per_s"] / res[s]["tokens_per_s"]
              for s in res if s != "serving_tpu"}
    ratios["serving_cpu/hf_cpu_generate tokens/s"] = (res["serving_cpu"]["tokens_per_s"]
                                                     / res["hf_cpu_generate"]["tokens_per_s"])
    ratios["serving_cpu/rollout_tpu tokens/s"] = res["serving_cpu"]["tokens_per_s"] / res["rollout_tpu"]["tokens_per_s"]
    ratios["serving prefill / distinct prompt tokens"] = base["prefill_tokens"] / distinct_prompt_tokens
    ratios["serving KV peak / static cache"] = base["kv_bytes_peak"] / static_kv
    ratios["XLA-CPU / torch-CPU ms per decode row-step"] = (base["ms_per_row_step"]
                                                           / res["serving_cpu"]["ms_per_row_step"])
    print(f"\nQwen2-shaped: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.prompts} prompts x "
          f"group {args.group} = {N} sequences, lengths geometric mean {args.mean_len} cap {args.max_len} "
          f"(drawn mean {useful / N:.1f}, longest {longest}); threads={THREADS}; load {os.getloadavg()}")
    for k, v in ratios.items():
        print(f"  {k:<48} {v:6.2f}")
    common.write_json(args.out, {
        "benchmark": "rollout_engine", "config": vars(args), "env": common.environment(THREADS),
        "workload": {"sequences": N, "useful_tokens": useful, "longest": longest,
                     "distinct_prompt_tokens": distinct_prompt_tokens, "static_kv_bytes": static_kv,
                     "kv_pages_budget": kv_pages},
        "results": res, "ratios": ratios, "load": os.getloadavg(), "compiles_during_timed_calls": timed_compiles,
        "cpu_fallbacks": torchtpu.metrics.snapshot()["cpu_fallbacks"]})


if __name__ == "__main__":
    main()
