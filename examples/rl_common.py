"""Shared pieces of the RLHF examples (rlhf_grpo.py, rlhf_ppo.py): the task, the reward,
the command line and the outputs.

The task is digit completion, a verifiable task whose reward is computed in code:
the prompt is a run of 2-4 consecutive digits (mod 10), e.g. ``7 8 9``, and the
policy must continue it for ``K`` more tokens (``0 1 2 3``). The reward is the
fraction of the ``K`` positions that are right, so it has partial credit and starts
near chance (1/12 with a 12-token vocabulary) for an untrained policy. A
small transformer learns "next = previous + 1" within a few dozen RL steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

VOCAB = 12  # digits 0-9, PAD, BOS
PAD = 10
BOS = 11


def make_items(answer_len: int) -> list:
    """Every prompt of the task with its expected continuation: ``[(prompt, answer), ...]``."""
    items = []
    for start in range(10):
        for n in (2, 3, 4):
            run = [(start + i) % 10 for i in range(n + answer_len)]
            items.append(([BOS] + run[:n], run[n:]))
    return items


def digit_reward(prompts, responses, answers) -> list:
    """Fraction of the ``len(answer)`` response positions that follow the rule "previous digit
    + 1 (mod 10)", each position checked against its own prefix (so one early mistake does not
    zero the rest: per-position credit). A fully right response equals ``answer``."""
    out = []
    for prompt, resp, ans in zip(prompts, responses, answers):
        prev, hits = prompt[-1], 0
        for i in range(len(ans)):
            tok = resp[i] if i < len(resp) else None
            if tok is not None and prev < 10 and tok == (prev + 1) % 10:
                hits += 1
            prev = tok if tok is not None else BOS
        out.append(hits / len(ans))
    return out


def parse_args(algo: str, argv=None, **defaults):
    p = argparse.ArgumentParser(description=f"{algo.upper()} on digit completion, on tpu, with Ray actors")
    p.add_argument("--out", default=f"runs/rlhf_{algo}", help="directory for metrics.json and reward.png")
    p.add_argument("--steps", type=int, default=defaults.get("steps", 40))
    p.add_argument("--workers", type=int, default=1, help="rollout-worker actors")
    p.add_argument("--prompts-per-step", type=int, default=defaults.get("prompts_per_step", 8))
    p.add_argument("--group-size", type=int, default=defaults.get("group_size", 8))
    p.add_argument("--answer-len", type=int, default=4, help="digits to complete (max new tokens)")
    p.add_argument("--lr", type=float, default=defaults.get("lr", 3e-3))
    p.add_argument("--kl-coef", type=float, default=defaults.get("kl_coef", 0.01))
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--transport", choices=("object_store", "collective"), default="object_store")
    p.add_argument("--reward-actor", action="store_true", help="score rewards in a reward actor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--xla-cache", default=os.path.join("runs", "xla_cache"),
                   help="persistent XLA compilation cache shared by the actors ('' to disable)")
    p.add_argument("--checkpoint", default="", help="save a checkpoint here at the end")
    p.add_argument("--resume", default="", help="resume from this checkpoint")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run(algo: str, args, learner_extra: dict | None = None) -> dict:
    """Build the topology, train, write ``metrics.json`` and ``reward.png``; returns the summary."""
    if args.xla_cache:
        os.environ.setdefault("TORCHTPU_CACHE_DIR", os.path.abspath(args.xla_cache))
    import ray

    from torchtpu_rl.driver import PromptDataset, RLDriver, ray_session
    from torchtpu_rl.policy import make_policy
    from torchtpu_rl.rollout import SamplingParams
    from torchtpu_rl.topology import make_topology

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    policy_fn = functools.partial(make_policy, VOCAB, d_model=args.d_model, n_layers=args.layers, n_heads=2,
                                  max_seq_len=16, seed=args.seed)
    learner_kwargs = dict(lr=args.lr, kl_coef=args.kl_coef, seed=args.seed)
    if algo == "grpo":
        learner_kwargs["group_size"] = args.group_size
    learner_kwargs.update(learner_extra or {})
    with ray_session():
        ray_address = ray.get_runtime_context().gcs_address
        if args.reward_actor:
            # the reward function lives in this file: ship it by value to the reward actor
            import cloudpickle

            cloudpickle.register_pickle_by_value(sys.modules[__name__])
        topo = make_topology(policy_fn, PAD, num_rollout_workers=args.workers, algo=algo,
                             learner_kwargs=learner_kwargs, seed=args.seed, reward_fn=digit_reward,
                             reward_in_actor=args.reward_actor)
        try:
            driver = RLDriver(topo, PromptDataset(make_items(args.answer_len), seed=args.seed),
                              None if args.reward_actor else digit_reward,
                              sampling=SamplingParams(max_new_tokens=args.answer_len, temperature=args.temperature),
                              prompts_per_step=args.prompts_per_step, group_size=args.group_size, mode=args.mode,
                              max_staleness=args.max_staleness, transport=args.transport, seed=args.seed)
            if args.resume:
                driver.load_checkpoint(args.resume)
            t_train = time.perf_counter()
            from step_log import StepLog

            steps_log = StepLog(args.out)  # metrics.jsonl and TensorBoard events, step by step
            try:
                history = driver.run(args.steps, progress=not args.no_progress,
                                     on_step=lambda m: steps_log.append(m["step"], m))
            finally:
                steps_log.close()
            train_s = time.perf_counter() - t_train
            if args.checkpoint:
                driver.save_checkpoint(args.checkpoint)
            events = driver.events
        finally:
            topo.shutdown()
    rewards = [h["reward_mean"] for h in history]
    k = max(1, min(5, len(rewards) // 4 or 1))
    summary = {
        "algo": algo,
        "task": "digit_completion",
        "steps": len(history),
        "baseline_reward": rewards[0] if rewards else None,  # rollouts of the untrained policy (version 0)
        "final_reward": sum(rewards[-k:]) / k if rewards else None,  # mean of the last k steps
        "best_reward": max(rewards) if rewards else None,
        "wall_s": time.perf_counter() - t_start,
        "train_s": train_s,
        "first_step_s": history[0]["step_s"] if history else None,  # includes the actors' compiles
        "mean_step_s_after_first": (sum(h["step_s"] for h in history[1:]) / (len(history) - 1)
                                    if len(history) > 1 else None),
        "ray_address": ray_address,
    }
    out = {"summary": summary, "config": vars(args), "learner_kwargs": learner_kwargs, "steps": history,
           "events": events}
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(out, f, indent=2, default=str)
    _plot(history, os.path.join(args.out, "reward.png"), f"{algo.upper()} on digit completion")
    print(json.dumps(summary, indent=2))
    return summary


def _plot(history, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(steps, [h["reward_mean"] for h in history], label="reward (mean)")
    ax[0].plot(steps, [h["reward_max"] for h in history], alpha=0.4, label="reward (max)")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("reward")
    ax[0].set_ylim(-0.02, 1.02)
    ax[0].legend()
    ax[0].set_title(title)
    if history and "kl" in history[0]:
        ax[1].plot(steps, [h.get("kl", float("nan")) for h in history], color="C2")
        ax[1].set_ylabel("KL to reference")
    else:
        ax[1].plot(steps, [h["step_s"] for h in history], color="C3")
        ax[1].set_ylabel("step seconds")
    ax[1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
