"""An RL run that survives the death of any actor: the chaos run.

One topology (learner, two rollout workers, a reward actor; the tiny policy of
test_rl_ray.py) runs the same seeded GRPO job twice from the same initial learner
state: undisturbed (object-store sync), then with the collective transport while a
rollout worker is killed mid-rollout, the other one during a weight sync, the
reward actor before it scores, and the learner mid-step (after its rollouts were
queued, before it trains), at steps drawn from a seeded generator. The run must
finish with exactly the undisturbed run's prompts, trajectories' policy versions,
rewards and final weights: rollout seeds are a function of (seed, step, request)
and the learner restarts from a checkpoint holding its RNG, so a recovered run
is not just "within noise" of the undisturbed one but equal to it.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_common  # noqa: E402

ANSWER_LEN = 4
STEPS = 6


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("xla_cache"))
    old = os.environ.get("TORCHTPU_COMPILATION_CACHE_DIR")
    os.environ["TORCHTPU_COMPILATION_CACHE_DIR"] = d  # inherited by the actors, and by their restarts
    yield d
    if old is None:
        os.environ.pop("TORCHTPU_COMPILATION_CACHE_DIR", None)
    else:
        os.environ["TORCHTPU_COMPILATION_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def topo(ray_driver, xla_cache):
    from ray import cloudpickle

    from torchtpu_rl.policy import make_policy
    from torchtpu_rl.topology import make_topology

    cloudpickle.register_pickle_by_value(rl_common)  # the reward actor gets digit_reward by value
    pf = functools.partial(make_policy, rl_common.VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, seed=0)
    t = make_topology(pf, rl_common.PAD, num_rollout_workers=2, algo="grpo",
                      learner_kwargs={"group_size": 4, "lr": 1e-2, "kl_coef": 0.01},
                      reward_fn=rl_common.digit_reward, reward_in_actor=True, max_restarts=4)
    yield t
    t.shutdown()


def _driver(topo, **kw):
    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.rollout import SamplingParams

    return RLDriver(topo, PromptDataset(rl_common.make_items(ANSWER_LEN), seed=0), None,
                    sampling=SamplingParams(max_new_tokens=ANSWER_LEN), prompts_per_step=4, group_size=4, seed=3,
                    requests_per_worker=2, sync_abort_s=5.0, **kw)


def _record(d, seen):
    """on_step: what each step trained on (the last record of a step wins: a step redone after a
    learner restart replaces the one that was lost with it)."""
    def on_step(m):
        b = d.last_batch
        seen[m["step"]] = {"prompts": b.prompts(), "responses": b.responses(),
                           "versions": sorted(set(b.policy_version.tolist())), "policy_version": m["policy_version"],
                           "reward": m["reward_mean"]}
    return on_step


def test_chaos_run_matches_undisturbed(topo, tmp_path):
    import ray

    # the undisturbed run; its first checkpoint (before step 1) is the common starting point
    ref = _driver(topo, checkpoint_dir=str(tmp_path / "ref"), checkpoint_every=STEPS)
    start = str(tmp_path / "start.pt")
    ref.save_checkpoint(start)
    ref_seen = {}
    ref.run(STEPS, progress=False, on_step=_record(ref, ref_seen))
    ref_weights = ray.get(topo.learner.checksums.remote())

    rng = random.Random(21)
    kill_worker_at, kill_sync_at, kill_reward_at, kill_learner_at = rng.sample(range(2, STEPS + 1), 4)
    d = _driver(topo, transport="collective", checkpoint_dir=str(tmp_path / "chaos"), checkpoint_every=2)
    d.load_checkpoint(start)
    killed = []
    pids = {"reward": ray.get(topo.reward_actor.status.remote())["pid"],
            "worker": ray.get(topo.workers[0].status.remote())["pid"]}

    def queued(driver, step):  # step is 0-based here; the metrics' "step" counts from 1
        s = step + 1
        if s == kill_worker_at and "worker" not in killed:
            deadline = time.monotonic() + 60  # mid-rollout: once it is generating
            while ray.get(topo.workers[0].status.remote())["generating"] is None and time.monotonic() < deadline:
                time.sleep(0.005)
            ray.kill(topo.workers[0], no_restart=False)
            killed.append("worker")
        if s == kill_reward_at and "reward" not in killed:
            ray.kill(topo.reward_actor, no_restart=False)
            killed.append("reward")
        if s == kill_learner_at and "learner" not in killed:
            ray.kill(topo.learner, no_restart=False)
            killed.append("learner")

    def trained(driver, step):
        if step + 1 == kill_sync_at and "sync" not in killed:
            ray.kill(topo.workers[1], no_restart=False)
            killed.append("sync")

    d.on_rollouts_queued = queued
    d.on_trained = trained
    seen = {}
    hist = d.run(STEPS, progress=False, on_step=_record(d, seen))

    kinds = [e["event"] for e in d.events]
    assert sorted(killed) == ["learner", "reward", "sync", "worker"]
    assert {"worker_resynced", "sync_failed", "learner_died", "learner_restored",
            "first_step_after_recovery"} <= set(kinds), kinds
    assert ray.get(topo.reward_actor.status.remote())["pid"] != pids["reward"]
    assert ray.get(topo.workers[0].status.remote())["pid"] != pids["worker"]
    # worker 0's death was noticed mid-rollout (its requests re-queued), or, when its requests had
    # finished before the kill landed, at the next sync
    mid_rollout = [e for e in d.events if e["event"] == "worker_died" and e["worker"] == 0]
    in_sync = [e for e in d.events if e["event"] == "sync_failed" and e["members"].get("0") == "died"]
    assert mid_rollout or in_sync, d.events
    if mid_rollout:
        assert mid_rollout[0]["step"] == kill_worker_at - 1 and hist[kill_worker_at - 1]["faults"] >= 1
    # noticed in seconds: the broken sync ended long before the group's 120 s timeout
    assert all(e["seconds"] < 60 for e in d.events if e["event"] == "sync_failed")
    restored = next(e for e in d.events if e["event"] == "learner_restored")
    assert restored["step"] < restored["died_at_step"] + 1 and restored["step"] % 2 == 0
    # the run finished; every step's trajectories carry one policy version, the one before its step
    assert d.step_idx == STEPS and [h["step"] for h in hist] == list(range(1, STEPS + 1))
    for s, r in seen.items():
        assert r["versions"] == [r["policy_version"] - 1], (s, r["versions"])
    # no prompt lost or duplicated, and the same run as the undisturbed one: same prompts, responses,
    # rewards, final weights
    assert sorted(seen) == sorted(ref_seen) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert seen[s]["prompts"] == ref_seen[s]["prompts"], s
        assert seen[s]["responses"] == ref_seen[s]["responses"], s
        assert seen[s]["reward"] == ref_seen[s]["reward"], s
    assert ray.get(topo.learner.checksums.remote()) == ref_weights
    learner_sums = ray.get(topo.learner.checksums.remote())
    assert all(s == learner_sums for s in ray.get([w.checksums.remote() for w in topo.workers]))
    print(f"final reward: undisturbed {ref_seen[STEPS]['reward']:.4f}, chaos {seen[STEPS]['reward']:.4f}; "
          f"killed worker@{kill_worker_at} sync@{kill_sync_at} reward@{kill_reward_at} learner@{kill_learner_at}; "
          f"recovery {next(e['seconds'] for e in d.events if e['event'] == 'first_step_after_recovery'):.1f} s; "
          f"worker 0 noticed {'mid-rollout' if mid_rollout else 'in the next sync'}")


def test_learner_death_without_checkpoint_is_a_clear_error(topo):
    """A learner that died for good, and no checkpoint to restart one from: an error that says
    so (a second learner actor, killed at once, plays the dead one: the topology's learner is left
alone)."""
    import dataclasses

    import ray

    from torchtpu_rl.worker_group import LearnerClient

    cls, args, kwargs, _ = topo.learner_group.recipe
    dead = ray.remote(cls).options(num_cpus=0, max_restarts=0).remote(*args, **kwargs)
    ray.kill(dead, no_restart=True)
    d = _driver(dataclasses.replace(topo, learner_group=LearnerClient(dead)))
    with pytest.raises(RuntimeError, match="learner died at step 0 and there is no checkpoint"):
        d.step()


def test_learner_killed_in_an_async_object_store_run(topo, tmp_path):
    """Async mode (rollouts generated ahead) and the object-store transport: the learner dies
    mid-step; what was generated ahead of the checkpoint is discarded and generated again, so
    the run still trains on every prompt exactly once, in order, with trajectories at most
    max_staleness versions old."""
    import ray

    from torchtpu_rl.driver import PromptDataset

    v0 = ray.get(topo.learner.version.remote())  # (the topology's learner trained in earlier tests)
    d = _driver(topo, mode="async", max_staleness=1, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    killed = []

    def queued(driver, step):
        if step == 3 and not killed:  # step 4's rollouts are queued ahead while step 3 trains
            ray.kill(topo.learner, no_restart=False)
            killed.append(step)

    d.on_rollouts_queued = queued
    seen = {}
    hist = d.run(4, progress=False, on_step=_record(d, seen))
    restored = [e for e in d.events if e["event"] == "learner_restored"]
    assert killed and len(restored) == 1, d.events
    assert restored[0]["died_at_step"] == 3 and restored[0]["step"] == 2 and restored[0]["version"] == v0 + 2
    assert [h["step"] for h in hist] == [1, 2, 3, 4] and d.step_idx == 4
    expected = [p for _, p, _ in PromptDataset(rl_common.make_items(ANSWER_LEN), seed=0).take(16)]
    trained = [p for s in sorted(seen) for p in seen[s]["prompts"][::4]]
    assert trained == expected  # none lost, none twice
    for s, r in seen.items():  # (a step's requests may straddle an update: versions v-1 and v-2)
        assert all(0 <= r["policy_version"] - 1 - v <= 1 for v in r["versions"]), (s, r["versions"])
    learner_sums = ray.get(topo.learner.checksums.remote())
    assert all(s == learner_sums for s in ray.get([w.checksums.remote() for w in topo.workers]))


def test_learner_restarted_while_idle_is_restored_not_trained_from_scratch(topo, tmp_path):
    """The learner dies between two steps and Ray restarts it before the driver's next call, which
    then reaches the new process at its initial weights (Ray sends calls made after a restart to the
    new process): the driver must notice and restore the checkpoint, not train the fresh process."""
    import ray

    from torchtpu_rl.worker_group import wait_for_actor

    d = _driver(topo, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    d.run(1, progress=False)
    v = ray.get(topo.learner.version.remote())
    old_pid = ray.get(topo.learner.status.remote())["pid"]
    ray.kill(topo.learner, no_restart=False)
    deadline = time.monotonic() + 120
    while (fresh := wait_for_actor(topo.learner))["pid"] == old_pid and time.monotonic() < deadline:
        time.sleep(0.2)  # (the kill lands asynchronously: the old process may still answer once)
    assert fresh["pid"] != old_pid and fresh["version"] != v, fresh  # restarted, idle, never called
    hist = d.run(1, progress=False)
    kinds = [e["event"] for e in d.events]
    assert "learner_died" in kinds and "learner_restored" in kinds, d.events
    assert hist[-1]["policy_version"] == v + 1 == ray.get(topo.learner.version.remote())
    learner_sums = ray.get(topo.learner.checksums.remote())
    assert all(s == learner_sums for s in ray.get([w.checksums.remote() for w in topo.workers]))
