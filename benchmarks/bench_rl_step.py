"""One end-to-end RL step on text, split into rollout / reward / learn / sync, sync vs async, in one run.

The policy is the text example's (examples/rl_text_arith.py): a small Qwen2-shaped
``transformers`` model with a BPE tokenizer trained on arithmetic word problems, or any
Hugging Face causal-LM directory given with ``--model`` (its tokenizer beside it, the
example's prompts). The run is what ``python -m torchtpu_rl.train`` does: a learner actor
and ``--workers`` rollout actors on a local Ray head, text prompts with the chat template,
the ``math_answer`` reward on decoded completions, GRPO, weight sync through the object
store.

Per step it reports the driver's phases: ``rollout`` (waiting for the step's rollouts),
``reward`` (decode + reward functions), ``learn`` (the learner's train_step call) and
``sync`` (learner -> workers weight update), their share of the step, rollout / learner
tokens per second, the driver's own overhead (sync mode: the step's time outside the four
phases) and the control messages a step sends (every actor call this process makes, counted
at Ray's ``ActorMethod.remote``, so the figure is the same for any version of the driver). The two modes run in alternating blocks (``--blocks``) so load from other
jobs falls on both; each block is a fresh driver over the same actors whose first step is
not timed (it primes the pipeline). Ratios are medians over adjacent block pairs.

``--before REV`` runs the same benchmark first on git revision ``REV`` of this repository (checked
out in a temporary worktree, this tree's built C++ extension copied in) and prints before / after:
step time, driver overhead, control messages per step, in one run of this script.

    python benchmarks/bench_rl_step.py --out runs/bench_rl_step.json
    python benchmarks/bench_rl_step.py --quick           # smoke run
    python benchmarks/bench_rl_step.py --workers 2 --before main
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

THREADS = common.early_threads()
common.pin_threads(THREADS)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

PHASES = {"rollout": "rollout_wait_s", "reward": "reward_s", "learn": "learner_call_s", "sync": "sync_s"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face causal-LM directory (default: build the example's model)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=3, help="blocks per mode (alternating sync / async)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--xla-cache", default=os.path.join("runs", "xla_cache"))
    p.add_argument("--out", default="runs/bench_rl_step.json")
    p.add_argument("--before", metavar="REV", help="also run git revision REV first and print before / after")
    args = p.parse_args()
    before = run_revision(args.before, sys.argv[1:]) if args.before else None
    if args.quick:
        args.hidden, args.layers, args.prompts_per_step, args.group_size = 32, 1, 4, 4
        args.max_new_tokens, args.steps, args.blocks = 8, 2, 1
    if args.xla_cache:
        os.environ.setdefault("TORCHTPU_CACHE_DIR", os.path.abspath(args.xla_cache))

    import functools

    import rl_text_arith
    from tqdm import tqdm

    from torchtpu.bucketing import BucketPolicy
    from torchtpu_rl import hf
    from torchtpu_rl.data import load_prompts
    from torchtpu_rl.driver import RLDriver, ray_session
    from torchtpu_rl.rewards import RewardSet, math_answer
    from torchtpu_rl.rollout import SamplingParams
    from torchtpu_rl.topology import make_topology

    tmp = tempfile.mkdtemp(prefix="bench_rl_step_")
    rows, _ = rl_text_arith.make_splits(512, 0)
    data = os.path.join(tmp, "train.jsonl")
    rl_text_arith.write_jsonl(data, rows)
    model_dir = args.model
    if model_dir is None:
        tok = rl_text_arith.build_tokenizer(rows)
        model = rl_text_arith.build_model(tok, args.hidden, args.layers)
        model_dir = os.path.join(tmp, "model")
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    tok = hf.load_tokenizer(model_dir)
    n_params = sum(p.numel() for p in hf.load_policy(model_dir, device="cpu").parameters())
    policy_fn = functools.partial(hf.load_policy, model_dir, device="cpu")
    engine_kwargs = {"prompt_buckets": BucketPolicy.pow2(16, 64, name="prompt"),
                     "response_buckets": BucketPolicy.pow2(8, max(8, args.max_new_tokens), name="response")}
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                              stop_token_ids=(tok.eos_token_id,))
    import ray.actor

    calls = [0]  # every actor method call this process makes (the driver's control messages)
    remote = ray.actor.ActorMethod._remote

    def counted(self, *a, **k):
        calls[0] += 1
        return remote(self, *a, **k)

    ray.actor.ActorMethod._remote = counted
    modes = ("sync", "async")
    per = {m: [] for m in modes}  # mode -> list of blocks -> list of step metrics
    first_step_s = None
    with ray_session():
        topo = make_topology(policy_fn, tok.pad_token_id, num_rollout_workers=args.workers, algo="grpo",
                             learner_kwargs={"group_size": args.group_size, "lr": 1e-4, "kl_coef": 0.001},
                             engine_kwargs=engine_kwargs)
        try:
            bar = tqdm(total=args.blocks * len(modes) * (args.steps + 1), desc="bench_rl_step", unit="step")
            for b in range(args.blocks):
                for mode in modes:
                    dataset = load_prompts(data, tok, "messages", seed=b)
                    driver = RLDriver(topo, dataset, RewardSet([math_answer]), sampling=sampling,
                                      prompts_per_step=args.prompts_per_step, group_size=args.group_size, mode=mode,
                                      max_staleness=1, seed=b, tokenizer=tok)
                    seen = []

                    mark = [calls[0]]

                    def on_step(m, driver=driver, seen=seen, mark=mark):
                        m["driver_s"] = m["step_s"] - sum(m[k] or 0.0 for k in PHASES.values())
                        if m.get("sync_s") is None:
                            m["sync_s"] = driver.last_sync.get("sync_s")  # async: the last finished sync
                        m["control_messages"], mark[0] = calls[0] - mark[0], calls[0]
                        seen.append(m)
                        bar.update()

                    # the first step primes (weights synced, async: next rollouts queued) and is not timed
                    driver.run(args.steps + 1, progress=False, on_step=on_step)
                    if first_step_s is None:
                        first_step_s = seen[0]["step_s"]  # includes the actors' compiles
                    block = seen[1:]
                    per[mode].append(block)
            bar.close()
        finally:
            topo.shutdown()

    def med(mode, key):
        return statistics.median(m[key] for blk in per[mode] for m in blk if m.get(key) is not None)

    res = {}
    for mode in modes:
        step_s = med(mode, "step_s")
        r = {"step_s": step_s}
        for name, key in PHASES.items():
            r[f"{name}_s"] = med(mode, key)
            r[f"{name}_share"] = r[f"{name}_s"] / step_s
        steps = [m for blk in per[mode] for m in blk]
        r["rollout_tokens_per_s"] = statistics.median(m["response_tokens"] / m["rollout_worker_s"] for m in steps)
        r["learner_tokens_per_s"] = statistics.median(m.get("learner_tokens_per_s", m["tokens_per_s"]) for m in steps)
        r["samples_per_s"] = statistics.median(m["samples"] / m["step_s"] for m in steps)
        r["control_messages_per_step"] = statistics.median(m["control_messages"] for m in steps)
        if mode == "sync":  # (async: the sync finishes inside the next step, outside the phases)
            r["driver_overhead_s"] = med(mode, "driver_s")
        res[mode] = r
    block_step = {m: [statistics.median(x["step_s"] for x in blk) for blk in per[m]] for m in modes}
    ratios = {"step time async/sync": statistics.median(a / s for a, s in zip(block_step["async"],
                                                                                block_step["sync"]))}

    print(f"\nQwen2 policy from {model_dir if args.model else 'the example'}: {n_params / 1e6:.2f} M parameters; "
          f"{args.prompts_per_step} prompts x {args.group_size} samples x <= {args.max_new_tokens} new tokens, "
          f"{args.workers} rollout worker(s); threads={THREADS}; first step {first_step_s:.1f} s (compiles)")
    for mode, r in res.items():
        parts = "  ".join(f"{n} {r[f'{n}_s'] * 1e3:7.1f} ms ({r[f'{n}_share'] * 100:4.1f}%)" for n in PHASES)
        print(f"  {mode:<5} step {r['step_s'] * 1e3:7.1f} ms: {parts}")
        print(f"        rollout {r['rollout_tokens_per_s']:8.0f} tok/s   learner {r['learner_tokens_per_s']:8.0f} "
              f"tok/s   {r['samples_per_s']:6.1f} samples/s   {r['control_messages_per_step']:g} control messages/step"
              + (f"   driver overhead {r['driver_overhead_s'] * 1e3:.2f} ms" if "driver_overhead_s" in r else ""))
    for k, v in ratios.items():
        print(f"  {k:<28} {v:6.2f}x")
    out = {
        "benchmark": "rl_step",
        "config": vars(args),
        "env": common.environment(THREADS),
        "parameters": n_params,
        "first_step_s": first_step_s,
        **res,
        "ratios": ratios,
        "blocks_step_s": block_step,
    }
    if before is not None:
        out["before"] = {"revision": args.before, **{m: before[m] for m in modes}}
        print(f"  before ({args.before}) -> after (this tree); load {os.getloadavg()[0]:.1f}")
        for mode in modes:
            for key in ("step_s", "driver_overhead_s", "control_messages_per_step"):
                if key in res[mode] and key in before[mode]:
                    b, a = before[mode][key], res[mode][key]
                    print(f"    {mode:<5} {key:<26} {b:10.4g} -> {a:10.4g}   after/before {a / b:5.2f}x")
    common.write_json(args.out, out)


def run_revision(rev: str, argv: list) -> dict:
    """This benchmark at git revision ``rev`` (a temporary detached worktree) in a subprocess; its JSON."""
    import shutil
    import subprocess

    tree = tempfile.mkdtemp(prefix="bench_rl_step_before_")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, rev], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        build = os.path.join(ROOT, "torchtpu", "csrc", "build")
        if os.path.isdir(build):
            shutil.copytree(build, os.path.join(tree, "torchtpu", "csrc", "build"), dirs_exist_ok=True)
        out = os.path.join(tree, "before.json")
        rest, skip = [], False
        for a in argv:  # the same options, less --before / --out
            if skip:
                skip = False
            elif a in ("--before", "--out"):
                skip = True
            elif not a.startswith(("--before=", "--out=")):
                rest.append(a)
        env = {**os.environ, "PYTHONPATH": tree}
        subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "bench_rl_step.py"), *rest, "--out", out],
                       check=True, env=env, cwd=ROOT)
        with open(out) as f:
            import json

            return json.load(f)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)


if __name__ == "__main__":
    main()
