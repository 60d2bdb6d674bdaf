"""torchtpu_rl on Ray: weight sync (both transports), faults, checkpoint/resume, the RLHF example.

(The in-process weight-sync tests are in test_weight_sync.py; actor deaths -- a rollout worker
mid-rollout and during a sync, the reward actor, the learner -- in test_fault_tolerance.py's
chaos run.)

One learner actor and two rollout-worker actors (a tiny policy, the RLHF example's
configuration so the XLA cache is shared with the job-submission test) serve every
test of the module; the Ray head is the session fixture of tests/conftest.py.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_common  # noqa: E402
from helpers import eventually  # noqa: E402

ANSWER_LEN = 4


# ------------------------------------------------------------------ the Ray topology
@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("xla_cache"))
    old = os.environ.get("TORCHTPU_CACHE_DIR")
    os.environ["TORCHTPU_CACHE_DIR"] = d  # inherited by the actors (make_topology)
    yield d
    if old is None:
        os.environ.pop("TORCHTPU_CACHE_DIR", None)
    else:
        os.environ["TORCHTPU_CACHE_DIR"] = old


def _policy_fn():
    from torchtpu_rl.policy import make_policy

    return functools.partial(make_policy, rl_common.VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
                             seed=0)


@pytest.fixture(scope="module")
def topo(ray_driver, xla_cache):
    from torchtpu_rl.topology import make_topology

    t = make_topology(_policy_fn(), rl_common.PAD, num_rollout_workers=2, algo="grpo",
                      learner_kwargs={"group_size": 4, "lr": 3e-3, "kl_coef": 0.01},
                      bucket_bytes=8192)  # the ~20k-parameter policy spans many buckets
    yield t
    t.shutdown()


def _driver(topo, **kw):
    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.rollout import SamplingParams

    kw.setdefault("prompts_per_step", 4)
    kw.setdefault("group_size", 4)
    return RLDriver(topo, PromptDataset(rl_common.make_items(ANSWER_LEN), seed=0), kw.pop("reward_fn",
                    rl_common.digit_reward), sampling=SamplingParams(max_new_tokens=ANSWER_LEN), **kw)


def _all_checksums(topo):
    import ray

    return ray.get(topo.learner.checksums.remote()), ray.get([w.checksums.remote() for w in topo.workers])


@pytest.mark.parametrize("transport,backend", [("object_store", None), ("collective", "tpu"),
                                               ("collective", "tpu-device"), ("collective", "gloo")])
def test_weight_sync_checksums(topo, transport, backend):
    """After a train step and its sync, every tensor of every worker equals the learner's."""
    import ray

    d = _driver(topo, transport=transport, collective_backend=backend)
    before, _ = _all_checksums(topo)
    m = d.step()
    learner_sums, worker_sums = _all_checksums(topo)
    assert learner_sums != before  # the step changed the weights
    assert all(s == learner_sums for s in worker_sums)
    versions = [st["version"] for st in ray.get([w.status.remote() for w in topo.workers])]
    assert versions == [m["policy_version"]] * 2
    assert m["staleness"] == 0 and len(m["rollout_versions"]) == 1
    assert d.last_sync["bytes"] == sum(p.numel() * p.element_size() for p in _policy_fn()().state_dict().values())


@pytest.mark.parametrize("requests_per_worker", [1, 2])
def test_control_messages_per_step(topo, requests_per_worker):
    """A sync-mode step sends N + 2 control messages for N rollout requests, whatever the number R of
    workers: N generate calls, train_step, and one publish_to with which the learner hands the update to
    the whole rollout group (the driver neither relays the update nor calls each worker). The first step
    adds the version query and the initial sync (one publish_to). Every worker installed every update."""
    import ray

    d = _driver(topo, requests_per_worker=requests_per_worker)
    N, R = 2 * requests_per_worker, len(topo.workers)
    updates = [st["updates"] for st in ray.get([w.status.remote() for w in topo.workers])]
    d.step()
    assert d.control_messages == 1 + 1 + (N + 2)
    before = d.control_messages
    m = d.step()
    assert d.control_messages - before == N + 2 and R == 2
    status = ray.get([w.status.remote() for w in topo.workers])
    assert [st["updates"] - u for st, u in zip(status, updates)] == [3] * R  # the initial sync and two steps
    assert [st["version"] for st in status] == [m["policy_version"]] * R


def test_reward_errors_name_the_sample(topo):
    from torchtpu_rl.driver import RewardError

    def flaky(prompts, responses, answers):
        r = rl_common.digit_reward(prompts, responses, answers)
        r[5] = float("nan")
        return r

    d = _driver(topo, reward_fn=flaky)
    with pytest.raises(RewardError, match=r"sample 5 returned nan \(prompt="):
        d.step()
    d = _driver(topo, reward_fn=flaky, on_reward_error="continue")
    with pytest.warns(RuntimeWarning, match="sample 5"):
        m = d.step()
    assert m["reward_errors"] == 1


def test_dynamic_sampling_fills_the_step_with_informative_groups(topo):
    """DAPO dynamic sampling (--dynamic-sampling) through the driver. Prompts starting with an odd digit score 0
    whatever the response (their groups are dropped); the others score the first response token. The step
    still trains on prompts_per_step whole groups, each informative."""

    def reward(prompts, responses, answers):
        return [0.0 if p[1] % 2 else float(r[0]) / 10 for p, r in zip(prompts, responses)]

    d = _driver(topo, reward_fn=reward, dynamic_sampling=6)
    m = d.step()
    assert m["samples"] == 16 and m["dynamic_sampling_rounds"] >= 2 and m["dynamic_sampling_dropped_groups"] >= 1
    b = d.last_batch
    got = reward(b.prompts(), b.responses(), [None] * len(b))
    groups = [got[g * 4:(g + 1) * 4] for g in range(4)]
    informative = sum(1 for g in groups if max(g) > min(g))
    assert informative == 4 - m["dynamic_sampling_short_groups"]
    assert all(b.prompts()[g * 4][1] % 2 == 0 for g in range(informative))  # odd-start groups only as filler


def test_reward_actors_are_a_group_that_scores_in_slices_and_replaces_a_dead_actor(ray_driver):
    """Reward actors as a WorkerGroup: a batch is cut into one slice per actor (round-robin dispatch) and
    put back in order; an actor killed for good (no restarts left) is started again from the group's
    recipe and its slice scored again on the new one."""
    import ray
    from ray import cloudpickle

    from torchtpu_rl.workers import RewardModelActor, score_on_group
    from torchtpu_rl.worker_group import WorkerGroup

    cloudpickle.register_pickle_by_value(rl_common)  # the actors get digit_reward by value
    group = WorkerGroup.start(RewardModelActor, 3, (), {"num_cpus": 0, "max_restarts": 0},
                              lambda i: {"reward_fn": rl_common.digit_reward}, recovery_timeout_s=60)
    try:
        items = rl_common.make_items(ANSWER_LEN)[:7]
        prompts = [p for p, _ in items]
        # right up to position j % (ANSWER_LEN + 1): the rewards differ, so an order mix-up shows
        responses = [[(p[-1] + 1 + k) % 10 if k < j % (ANSWER_LEN + 1) else rl_common.BOS for k in range(ANSWER_LEN)]
                     for j, p in enumerate(prompts)]
        answers = [a for _, a in items]
        want = [float(v) for v in rl_common.digit_reward(prompts, responses, answers)]
        assert len(set(want)) > 2
        assert score_on_group(group, prompts, responses, answers) == want
        # one slice per actor: 7 samples on 3 actors are 2 + 2 + 3, every actor called once
        pids = {ray.get(a.status.remote())["pid"] for a in group}
        assert len(pids) == 3 and group.messages == 3
        ray.kill(group[1], no_restart=True)

        def dead():  # (the kill lands asynchronously: the old process may still answer once)
            try:
                ray.get(group[1].status.remote(), timeout=30)
                return False
            except ray.exceptions.RayActorError:
                return True

        eventually(dead, what="the killed reward actor to be dead")
        deaths = []
        assert score_on_group(group, prompts, responses, answers, lambda i, e: deaths.append(i)) == want
        assert deaths == [1] and group.replaced == 1
        assert ray.get(group[1].status.remote())["pid"] not in pids
        assert score_on_group(group, [], [], []) == []
    finally:
        for a in group:
            ray.kill(a, no_restart=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_resume_is_exact(topo, tmp_path, mode):
    """k steps, checkpoint, m more == resume from the checkpoint and m steps (same rewards,
    losses and final weights); async mode also carries its queued rollouts over."""
    import ray

    k, m = 2, 2
    d = _driver(topo, mode=mode, max_staleness=1, seed=7)
    for _ in range(k):
        d.step()
    ckpt = str(tmp_path / "ckpt.pt")
    d.save_checkpoint(ckpt)
    if mode == "async":
        assert d._pending, "async mode should have queued the next step's rollouts"
    first = [d.step() for _ in range(m)]
    first_sums = ray.get(topo.learner.checksums.remote())

    d2 = _driver(topo, mode=mode, max_staleness=1, seed=7)
    d2.load_checkpoint(ckpt)
    assert d2.step_idx == k and d2.dataset.cursor == d.dataset.cursor - 4 * m
    second = [d2.step() for _ in range(m)]
    keys = ["reward_mean", "policy_version", "staleness", "pg_loss", "kl", "response_tokens"]
    assert [[s[x] for x in keys] for s in first] == [[s[x] for x in keys] for s in second]
    assert ray.get(topo.learner.checksums.remote()) == first_sums
    if mode == "async":
        assert max(s["staleness"] for s in first) == 1


# ------------------------------------------------------------------ the example, as a Ray job
def test_rlhf_example_runs_as_ray_job(ray_driver, xla_cache, tmp_path):
    from ray_integration import jobs

    out = tmp_path / "grpo"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "rlhf_grpo.py"), "--steps", "2", "--out", str(out),
           "--no-progress", "--reward-actor", "--xla-cache", xla_cache]
    env = {"OMP_NUM_THREADS": "1", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    job = jobs.submit(ray_driver.dashboard_url, cmd, env_vars=env)
    status = jobs.wait(ray_driver.dashboard_url, job, timeout_s=600)
    log = jobs.logs(ray_driver.dashboard_url, job)
    assert status == "SUCCEEDED", log[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["steps"]) == 2 and metrics["summary"]["ray_address"] == ray_driver.address
    assert [s["policy_version"] for s in metrics["steps"]] == [1, 2]
    assert {"reward_mean", "kl", "step_s", "rollout_wait_s", "learner_call_s"} <= set(metrics["steps"][0])
    assert (out / "reward.png").stat().st_size > 1000
