"""Quantized rollouts and LoRA weight sync on one Hugging Face model, side by side in one run.

The model is ``tests/helpers.py``'s ``tiny_hf_causal_lm("qwen2", ...)`` at ``--hidden`` /
``--layers`` / ``--vocab`` (randomly initialized, nothing downloaded). Rollout variants, each a
compiled, KV-cached ``RolloutEngine`` on tpu over a copy of the same weights:

- ``float32``, ``bfloat16`` (``RolloutEngine(dtype=)``);
- ``int8_weight_only`` (int8 weights, float activations), ``int8`` (int8 weights and activations:
  int8 x int8 dots accumulating in int32), ``fp8`` (float8 e4m3 weights), all through
  ``RolloutEngine(quantization=)`` (torchao; the output layer stays in float).

Per variant: rollout tokens/s (``--batch`` prompts x ``--new-tokens``, sampled, no stop token;
one warm-up call compiles, then ``--repeats`` timed calls taking turns across variants), weight
memory (``torch.tpu.memory_allocated`` held by the engine's model), and, on held-out text
(sequences the float32 model generated with other seeds), the logits' relative error against
float32 and the perplexity. Ratios are against float32.

Weight sync (``--no-sync`` skips it; a local Ray head is started): a full-model learner vs a LoRA
learner (``--lora-rank``, all linear layers but the output layer) publishing into a rollout worker
through the object store, in this process: bytes per sync and seconds (publish + install); and the
full-precision update into an int8 rollout worker (``full_int8``: the cost of re-quantizing on
arrival; quantizing at the sender instead is not implemented).

    python benchmarks/bench_quantization.py --out runs/bench_quantization.json
    python benchmarks/bench_quantization.py --quick
"""

from __future__ import annotations

import argparse
import gc
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers import tiny_hf_causal_lm  # noqa: E402

torch.set_num_threads(THREADS)

VARIANTS = {
    "float32": {},
    "bfloat16": {"dtype": torch.bfloat16},
    "int8_weight_only": {"quantization": "int8_weight_only"},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
}


def make_model(args, seed=0):
    return tiny_hf_causal_lm("qwen2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                             seed=seed, max_position_embeddings=args.prompt_len + args.new_tokens + 64)


def prompts(args, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]


def held_out_text(engine, args):
    """Sequences the float32 model sampled (other seeds than the timed prompts): prompt + response ids."""
    torch.manual_seed(1234)
    batch = engine.generate(prompts(args, 99), SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0))
    return torch.cat([batch.prompt_ids, batch.response_ids], dim=1)


def logits_of(engine, ids):
    with torch.no_grad():
        return engine.model(ids.to("tpu")).logits.float().cpu()


def perplexity(logits, ids):
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(torch.exp(-logp.mean()))


def bench_rollout(args) -> dict:
    buckets = dict(prompt_buckets=BucketPolicy.pow2(args.prompt_len, args.prompt_len),
                   response_buckets=BucketPolicy.pow2(args.new_tokens, args.new_tokens))
    engines, memory, first_s = {}, {}, {}
    for name, kw in VARIANTS.items():
        gc.collect()
        torchtpu.synchronize()
        before = torch.tpu.memory_allocated()
        engines[name] = RolloutEngine(make_model(args), 0, device="tpu", **buckets, **kw)
        torchtpu.synchronize()
        memory[name] = torch.tpu.memory_allocated() - before
        t0 = time.perf_counter()
        engines[name].generate(prompts(args, 0), SamplingParams(max_new_tokens=args.new_tokens))
        first_s[name] = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    per = {name: [] for name in engines}
    for r in range(args.repeats):
        for name, eng in engines.items():
            torch.manual_seed(r)
            t0 = time.perf_counter()
            batch = eng.generate(prompts(args, r + 1), params)
            per[name].append(batch.num_response_tokens / (time.perf_counter() - t0))
    ids = held_out_text(engines["float32"], args)
    ref = logits_of(engines["float32"], ids)
    out = {}
    for name, eng in engines.items():
        lg = logits_of(eng, ids)
        out[name] = {"tokens_per_s": statistics.median(per[name]), "tokens_per_s_repeats": per[name],
                     "weight_bytes": memory[name], "first_call_s": first_s[name],
                     "logits_rel_error": float((lg - ref).norm() / ref.norm()), "perplexity": perplexity(lg, ids)}
    out["ratios_vs_float32"] = {
        name: {"tokens_per_s": statistics.median([a / b for a, b in zip(per[name], per["float32"])]),
               "weight_bytes": memory[name] / memory["float32"]}
        for name in engines if name != "float32"}
    return out


def bench_sync(args) -> dict:
    import functools

    from torchtpu_rl.driver import ray_session
    from torchtpu_rl.lora import LoraSpec
    from torchtpu_rl.workers import LearnerWorker, RolloutWorker

    policy_fn = functools.partial(make_model, args)
    lora = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets="all-linear")
    out = {}
    with ray_session():
        # full_int8: the full-precision update into an int8 rollout worker, which quantizes it on arrival
        for name, spec, quant in (("full", None, None), ("full_int8", None, "int8"), ("lora", lora, None)):
            learner = LearnerWorker(policy_fn, learner_kwargs={"group_size": 2, "compile": False}, lora=spec)
            engine_kwargs = {"lora": spec} if spec else {}
            if quant:
                engine_kwargs["quantization"] = quant
            worker = RolloutWorker(policy_fn, 0, engine_kwargs=engine_kwargs)
            worker.update_weights(learner.publish_weights())  # warm-up: the install's programs compile once
            times = []
            for _ in range(args.sync_repeats):
                t0 = time.perf_counter()
                info = worker.update_weights(learner.publish_weights())
                times.append(time.perf_counter() - t0)
            out[name] = {"bytes": learner.sender.last_timings["bytes"], "seconds": statistics.median(times),
                         "seconds_repeats": times, "paused_s": info["paused_s"]}
            del learner, worker
            gc.collect()
    out["ratios"] = {"bytes full/lora": out["full"]["bytes"] / out["lora"]["bytes"],
                     "seconds full/lora": out["full"]["seconds"] / out["lora"]["seconds"],
                     "seconds full_int8/full": out["full_int8"]["seconds"] / out["full"]["seconds"]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench_quantization.json")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.batch, args.prompt_len = 64, 1, 256, 4, 8
        args.new_tokens, args.repeats, args.sync_repeats = 8, 2, 2
    result = {}
    if not args.no_sync:  # first: see the note on the full-size run in benchmarks/README.md
        result["weight_sync"] = bench_sync(args)
    result["rollout"] = bench_rollout(args)
    for name, r in result["rollout"].items():
        if name != "ratios_vs_float32":
            print(f"{name:>17}: {r['tokens_per_s']:9.1f} tok/s  weights {r['weight_bytes'] / 1e6:7.2f} MB  "
                  f"logits rel err {r['logits_rel_error']:.4f}  ppl {r['perplexity']:.2f}")
    print("ratios vs float32:", {k: {m: round(x, 3) for m, x in v.items()}
                                 for k, v in result["rollout"]["ratios_vs_float32"].items()})
    if "weight_sync" in result:
        s = result["weight_sync"]
        print(f"weight sync: full {s['full']['bytes']} B {s['full']['seconds'] * 1e3:.1f} ms (into an int8 worker "
              f"{s['full_int8']['seconds'] * 1e3:.1f} ms), LoRA {s['lora']['bytes']} B "
              f"{s['lora']['seconds'] * 1e3:.1f} ms; {s['ratios']}")
    common.write_json(args.out, {"args": vars(args), "results": result, "env": common.environment(THREADS)})


if __name__ == "__main__":
    main()
