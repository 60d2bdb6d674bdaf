"""How long an RL run stands still when an actor dies, and the chaos run at length.

Part 1, recovery times (side by side with the undisturbed step time of the same run):
the GRPO digit-completion job of examples/rlhf_grpo.py (learner, rollout workers, a
reward actor) runs with periodic checkpoints; at seeded random steps the learner is
killed mid-step (after its rollouts were queued), a rollout worker during a
weight sync (collective transport) and the reward actor. Reported per kind:
seconds from the kill to the end of the first step after recovery (learner:
``first_step_after_recovery``, which includes restarting the actor, loading the
checkpoint, re-syncing the workers and redoing the steps since the checkpoint),
the steps redone, and the ratio to the median undisturbed step.

Part 2, the chaos comparison: the same seeded run undisturbed and with the kills;
final rewards (mean of the last 5 steps) of both, and whether every step's
prompts, responses and rewards are equal (they should be: rollout seeds are a
function of (seed, step, request) and the learner restarts from a checkpoint with
its RNG). The test (tests/rl/test_fault_tolerance.py) is the short version.

    python benchmarks/bench_rl_recovery.py --steps 60 --out runs/bench_rl_recovery.json
    python benchmarks/bench_rl_recovery.py --steps 8 --checkpoint-every 2     # smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402

THREADS = common.early_threads()
common.pin_threads(THREADS)

import rl_common  # noqa: E402


def _driver(topo, transport, ckpt_dir, every, seed, prompts, group):
    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.rollout import SamplingParams

    return RLDriver(topo, PromptDataset(rl_common.make_items(4), seed=seed), None,
                    sampling=SamplingParams(max_new_tokens=4), prompts_per_step=prompts, group_size=group, seed=seed,
                    transport=transport, checkpoint_dir=ckpt_dir, checkpoint_every=every, sync_abort_s=5.0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--transport", default="collective", choices=("collective", "object_store"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--xla-cache", default=os.path.join("runs", "xla_cache"),
                   help="persistent XLA cache of the actors (a restarted actor compiles from it; '' to disable)")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--out", default="runs/bench_rl_recovery.json")
    args = p.parse_args()

    import ray
    from ray import cloudpickle

    from torchtpu_rl.driver import ray_session
    from torchtpu_rl.policy import make_policy
    from torchtpu_rl.topology import make_topology

    cloudpickle.register_pickle_by_value(rl_common)
    if args.xla_cache:
        os.environ.setdefault("TORCHTPU_COMPILATION_CACHE_DIR", os.path.abspath(args.xla_cache))
    pf = functools.partial(make_policy, rl_common.VOCAB, d_model=args.d_model, n_layers=1, n_heads=2,
                           max_seq_len=16, seed=0)
    tmp = tempfile.mkdtemp(prefix="bench_rl_recovery_")
    with ray_session(num_cpus=2):
        env = common.environment(args.threads)
        topo = make_topology(pf, rl_common.PAD, num_rollout_workers=args.workers, algo="grpo",
                             learner_kwargs={"group_size": args.group_size, "lr": 1e-2, "kl_coef": 0.01},
                             reward_fn=rl_common.digit_reward, reward_in_actor=True, max_restarts=10)
        try:
            ref = _driver(topo, "object_store", os.path.join(tmp, "ref"), args.steps, args.seed,
                          args.prompts_per_step, args.group_size)
            start = os.path.join(tmp, "start.pt")
            ref.save_checkpoint(start)
            t0 = time.perf_counter()
            ref_hist = ref.run(args.steps, progress=False)
            ref_wall = time.perf_counter() - t0
            ref_step = statistics.median(h["step_s"] for h in ref_hist)

            rng = random.Random(args.seed + 21)
            at = dict(zip(("learner", "sync", "reward"), rng.sample(range(2, args.steps + 1), 3)))
            d = _driver(topo, args.transport, os.path.join(tmp, "chaos"), args.checkpoint_every, args.seed,
                        args.prompts_per_step, args.group_size)
            d.load_checkpoint(start)
            kills = {}

            def queued(driver, step):
                if step + 1 == at["learner"] and "learner" not in kills:
                    kills["learner"] = time.perf_counter()
                    ray.kill(topo.learner, no_restart=False)
                if step + 1 == at["reward"] and "reward" not in kills:
                    kills["reward"] = time.perf_counter()
                    ray.kill(topo.reward_actor, no_restart=False)

            def trained(driver, step):
                if step + 1 == at["sync"] and "sync" not in kills:
                    kills["sync"] = time.perf_counter()
                    ray.kill(topo.workers[-1], no_restart=False)

            d.on_rollouts_queued, d.on_trained = queued, trained
            ends = {}

            def on_step(m):
                now = time.perf_counter()
                for kind, t in kills.items():
                    ends.setdefault(kind, (now - t, m["step"]))

            t0 = time.perf_counter()
            hist = d.run(args.steps, progress=False, on_step=on_step)
            chaos_wall = time.perf_counter() - t0
        finally:
            topo.shutdown()
    restored = next((e for e in d.events if e["event"] == "learner_restored"), {})
    first = next((e for e in d.events if e["event"] == "first_step_after_recovery"), {})
    recovery = {
        "learner": {"killed_at_step": at["learner"], "restored_to_step": restored.get("step"),
                    # completed steps lost with the learner (the step it died in is done again in any case)
                    "completed_steps_redone": at["learner"] - 1 - restored.get("step", 0),
                    "restart_and_restore_s": restored.get("seconds"),
                    "death_to_first_step_after_recovery_s": first.get("seconds"),
                    "ratio_vs_step": (first.get("seconds") or 0) / ref_step},
        "rollout_worker_in_sync": {"killed_at_step": at["sync"], "kill_to_step_end_s": ends.get("sync", (None,))[0],
                                   "ratio_vs_step": (ends.get("sync", (0,))[0] or 0) / ref_step,
                                   "sync_failed": [e for e in d.events if e["event"] == "sync_failed"]},
        "reward_actor": {"killed_at_step": at["reward"], "kill_to_step_end_s": ends.get("reward", (None,))[0],
                         "ratio_vs_step": (ends.get("reward", (0,))[0] or 0) / ref_step},
    }
    last = min(5, args.steps)
    same = [a["reward_mean"] == b["reward_mean"] for a, b in zip(ref_hist, hist)]
    chaos = {"final_reward_undisturbed": statistics.mean(h["reward_mean"] for h in ref_hist[-last:]),
             "final_reward_chaos": statistics.mean(h["reward_mean"] for h in hist[-last:]),
             "reward_std_last_steps_undisturbed": statistics.pstdev(h["reward_mean"] for h in ref_hist[-last:]),
             "steps_equal": sum(same), "steps": args.steps, "wall_undisturbed_s": ref_wall, "wall_chaos_s": chaos_wall,
             "undisturbed_median_step_s": ref_step}
    print(f"undisturbed step {ref_step:.2f} s; learner death -> first step after recovery "
          f"{recovery['learner']['death_to_first_step_after_recovery_s']:.2f} s "
          f"({recovery['learner']['completed_steps_redone']} completed steps redone); worker killed in a sync -> step end "
          f"{recovery['rollout_worker_in_sync']['kill_to_step_end_s']:.2f} s; reward actor -> step end "
          f"{recovery['reward_actor']['kill_to_step_end_s']:.2f} s", flush=True)
    print(f"final reward (last {last} steps): undisturbed {chaos['final_reward_undisturbed']:.4f}, chaos "
          f"{chaos['final_reward_chaos']:.4f}; steps with equal rewards {sum(same)}/{args.steps}", flush=True)
    common.write_json(args.out, {"environment": env, "config": vars(args), "recovery": recovery, "chaos": chaos,
                                 "events": d.events})


if __name__ == "__main__":
    main()
