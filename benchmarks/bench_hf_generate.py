"""Hugging Face ``model.generate`` on tpu (static and dynamic cache, served at fixed shapes by
torchtpu.hf_generate) vs ``generate`` on torch CPU vs torchtpu_rl's ``RolloutEngine`` on tpu, in
one run: at fixed lengths (``--new-tokens``, default 64 256) and on the long-tailed workload.

The model is a randomly initialized Qwen2-shaped ``Qwen2ForCausalLM`` (made from its config,
nothing downloaded). Every side generates the same ``--batch`` left-padded prompts with the same
sampling (temperature 1, no top-k/top-p, no stop token). The long-tailed workload draws each
sequence's length once (seeded) from a geometric distribution of mean ``--mean-len`` capped at
the largest ``--new-tokens``, as benchmarks/bench_rollout_engine.py does; a static batch decodes to
the longest, and tokens/s counts the useful tokens (each row up to its drawn length).

Each tpu side is called once first (its compiling call, reported apart, with the executables it
compiled); the timed calls, interleaved side after side over ``--repeats``, must compile nothing.
``--full`` is the issue's size (128 sequences, hidden 256, 4 layers, vocab 2048).

``--grpo-steps N`` (default 3; 0 skips it) also times TRL's ``GRPOTrainer`` with the same model on tpu
and on CPU (``use_cpu=True``): ``--grpo-prompts`` prompts x ``--grpo-group`` completions of up to
``--grpo-completion`` tokens per step, a local BPE tokenizer, a length reward; the median of the steps
after the first (which compiles on tpu) is compared.

    python benchmarks/bench_hf_generate.py --out runs/bench_hf_generate.json
    python benchmarks/bench_hf_generate.py --full
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

torch.set_num_threads(THREADS)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--mean-len", type=int, default=48, help="mean drawn length of the long-tailed workload")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--full", action="store_true", help="the issue's size: 128 sequences, hidden 256, 4 layers")
    p.add_argument("--grpo-steps", type=int, default=3)
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--grpo-group", type=int, default=8)
    p.add_argument("--grpo-completion", type=int, default=64)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--out", default="runs/bench_hf_generate.json")
    args = p.parse_args()
    if args.full:
        args.vocab, args.hidden, args.layers, args.heads, args.kv_heads, args.batch = 2048, 256, 4, 8, 2, 128

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lens]
    P = max(lens)
    ids = torch.zeros(len(prompts), P, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, q in enumerate(prompts):
        ids[i, P - len(q):] = torch.tensor(q)
        mask[i, P - len(q):] = 1
    longest = max(args.new_tokens)
    torch.manual_seed(0)
    drawn = torch.distributions.Geometric(probs=torch.tensor(1.0 / args.mean_len)).sample(
        (args.batch,)).add(1).clamp(max=longest).long().tolist()
    workloads = {str(n): (n, args.batch * n) for n in args.new_tokens}
    workloads["long_tailed"] = (max(drawn), sum(drawn))

    cpu_model = common.tiny_qwen2(args)
    tpu_model = common.tiny_qwen2(args).to("tpu")
    ids_t, mask_t = ids.to("tpu"), mask.to("tpu")
    engine = RolloutEngine(common.tiny_qwen2(args), 0, device="tpu", compile=True,
                           prompt_buckets=BucketPolicy.pow2(16, 256),
                           response_buckets=BucketPolicy.pow2(16, max(256, longest)))

    def hf(model, i, m, n, **kw):
        with torch.no_grad():
            out = model.generate(input_ids=i, attention_mask=m, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0, **kw)
        out[0, -1].item()  # wait for the device

    sides = {
        "hf_tpu_static": lambda n: hf(tpu_model, ids_t, mask_t, n, cache_implementation="static"),
        "hf_tpu_dynamic": lambda n: hf(tpu_model, ids_t, mask_t, n),
        "hf_cpu": lambda n: hf(cpu_model, ids, mask, n),
        "rollout_tpu": lambda n: engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=1.0)),
    }
    first, compiles_first, times, timed_compiles = {}, {}, {}, {}
    torch.manual_seed(0)
    for w, (n, _) in workloads.items():
        for s, fn in sides.items():
            if s == "hf_cpu":
                continue
            c0, t0 = torchtpu.metrics.snapshot()["compiles"], time.perf_counter()
            fn(n)
            first[(s, w)] = time.perf_counter() - t0
            compiles_first[(s, w)] = torchtpu.metrics.snapshot()["compiles"] - c0
        c0 = torchtpu.metrics.snapshot()["compiles"]
        for _ in range(args.repeats):
            for s, fn in sides.items():
                t0 = time.perf_counter()
                fn(n)
                times.setdefault((s, w), []).append(time.perf_counter() - t0)
        timed_compiles[w] = torchtpu.metrics.snapshot()["compiles"] - c0

    res, ratios = {}, {}
    for (s, w), ts in times.items():
        t = statistics.median(ts)
        res.setdefault(s, {})[w] = {"seconds_per_call": t, "useful_tokens_per_s": workloads[w][1] / t,
                                    "first_call_s": first.get((s, w)), "first_call_compiles": compiles_first.get((s, w)),
                                    "calls_s": ts}
    for w in workloads:
        for s in ("hf_tpu_static", "hf_tpu_dynamic"):
            for other in ("hf_cpu", "rollout_tpu"):
                ratios[f"{s}/{other} speed @{w}"] = res[other][w]["seconds_per_call"] / res[s][w]["seconds_per_call"]

    print(f"\nQwen2-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.batch} "
          f"sequences, prompts {args.prompt_min}-{args.prompt_max}; long-tailed lengths mean {args.mean_len} "
          f"(longest {max(drawn)}); threads={THREADS}; load {os.getloadavg()[0]:.1f}")
    for s in sides:
        for w in workloads:
            r = res[s][w]
            fc = ("" if r["first_call_s"] is None else
                  f"   (first call {r['first_call_s']:.1f} s, {r['first_call_compiles']} executables)")
            print(f"  {s:<15} {w:>11}: {r['useful_tokens_per_s']:9.0f} useful tok/s{fc}")
    for k, v in ratios.items():
        print(f"  {k:<45} {v:6.2f}x")
    print(f"  compiles during the timed calls: {timed_compiles} (must be 0)")
    grpo = {}
    if args.grpo_steps > 1:
        for dev in ("tpu", "cpu"):
            grpo[dev] = grpo_step_seconds(args, use_cpu=dev == "cpu")
        ratios["grpo_step tpu/cpu speed"] = grpo["cpu"]["warm_step_s"] / grpo["tpu"]["warm_step_s"]
        for dev, r in grpo.items():
            print(f"  GRPOTrainer step on {dev}: first {r['first_step_s']:.1f} s, warm {r['warm_step_s']:.2f} s")
        print(f"  {'grpo_step tpu/cpu speed':<45} {ratios['grpo_step tpu/cpu speed']:6.2f}x")
    common.write_json(args.out, {"benchmark": "hf_generate", "config": vars(args), "env": common.environment(THREADS),
                                 "results": res, "ratios": ratios, "compiles_during_timed_calls": timed_compiles,
                                 "grpo_trainer": grpo,
                                 "cpu_fallbacks": torchtpu.metrics.snapshot()["cpu_fallbacks"]})


def grpo_step_seconds(args, use_cpu):
    """Seconds of each ``GRPOTrainer`` step (generation, rewards, loss, optimizer step) with the benchmark's
    model, on tpu or on CPU."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = [f"{a} plus {b} is {a + b}" for a in range(40) for b in range(40)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=min(args.vocab, 512),
                                                      special_tokens=["<pad>", "<s>", "</s>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>")
    prompts = [f"{a} plus {a + 1} is" for a in range(args.grpo_prompts)]
    ds = datasets.Dataset.from_dict({"prompt": prompts * args.grpo_steps})

    class StepTimes(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    def reward(completions, **kw):
        return [len(c) / 100 for c in completions]

    model = common.tiny_qwen2(args).train()
    cfg = trl.GRPOConfig(output_dir=f"runs/bench_hf_generate_grpo_{'cpu' if use_cpu else 'tpu'}",
                         per_device_train_batch_size=args.grpo_prompts * args.grpo_group,
                         num_generations=args.grpo_group, max_completion_length=args.grpo_completion,
                         max_steps=args.grpo_steps, learning_rate=1e-5, report_to="none", seed=0, save_strategy="no",
                         logging_steps=1, use_cpu=use_cpu)
    times = StepTimes()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                              processing_class=tokenizer, callbacks=[times])
    trainer.train()
    import accelerate  # its state is a process singleton: the next run picks its own device

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    return {"device": trainer.args.device.type, "steps_s": times.times, "first_step_s": times.times[0],
            "warm_step_s": statistics.median(times.times[1:])}


if __name__ == "__main__":
    main()
