"""torchtpu_rl on Ray: weight sync (both transports), faults, checkpoint/resume, the RLHF example.

One learner actor and two rollout-worker actors (a tiny policy, the RLHF example's
configuration so the XLA cache is shared with the job-submission test) serve every
test of the module; the Ray head is the session fixture of tests/conftest.py.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import numpy as np
import pytest
import torch

import torchtpu
from torchtpu_rl import weight_sync as ws

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_common  # noqa: E402

ANSWER_LEN = 4


# ------------------------------------------------------------------ weight sync, in process
def _mixed_state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(37, 19, generator=g),
        "b16": torch.randn(300, generator=g).to(torch.bfloat16),
        "idx": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
        "flag": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(3000, generator=g),  # spans several 4 KiB buckets
    }


def test_bucket_plan_covers_every_byte_once():
    sd = _mixed_state()
    plan = ws.plan_buckets(sd, bucket_bytes=4096)
    assert plan.num_buckets == -(-plan.total_bytes // 4096) > 3
    seen = {s.name: np.zeros(s.nbytes, np.int32) for s in plan.slots}
    for b in range(plan.num_buckets):
        lo, hi = plan.bucket_range(b)
        assert hi - lo == (4096 if b < plan.num_buckets - 1 else plan.total_bytes - lo)
        for i, a, z in plan.segments(b):
            seen[plan.slots[i].name][a:z] += 1
            assert lo <= plan.slots[i].offset + a and plan.slots[i].offset + z <= hi
    assert all((v == 1).all() for v in seen.values())
    assert all(s.offset % ws.ALIGN == 0 for s in plan.slots)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ws.plan_buckets(sd, bucket_bytes=100)
    with pytest.raises(ValueError, match="'w'"):
        plan.check_matches({**sd, "w": torch.zeros(3)})


@pytest.mark.parametrize("where", ["host", "device"])
def test_pack_unpack_round_trip(where):
    """The bytes of every tensor survive the bucket layout: host arena (object store / gloo)
    and the jitted device pack/unpack of tpu buckets."""
    sd = {k: v.to("tpu") for k, v in _mixed_state().items()}
    plan = ws.plan_buckets(sd, bucket_bytes=4096)
    if where == "host":
        arena = ws._new_arena(plan.total_bytes)
        an = arena.numpy()
        tensors = list(sd.values())
        for b in range(plan.num_buckets):
            for i, a, z in plan.segments(b):
                d = plan.slots[i].offset + a
                an[d:d + z - a] = ws.host_bytes(tensors[i])[a:z]
        out = ws._tensors_from_arena(plan, arena, "tpu")
    else:
        arrays = [torchtpu.to_jax(t) for t in sd.values()]
        buckets = []
        for b in range(plan.num_buckets):
            idx = sorted({i for i, _, _ in plan.segments(b)})
            buckets.append(ws._pack_fn(plan, b)(*[arrays[i] for i in idx]))
        out = {s.name: torchtpu.from_jax(a, s.dtype) for s, a in zip(plan.slots, ws._unpack_fn(plan)(*buckets))}
    assert ws.tensor_checksums(out) == ws.tensor_checksums(sd)
    assert all(v.device.type == "tpu" for v in out.values())


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
    from torchtpu_rl.workers import make_topology

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


def test_killed_rollout_worker_is_restarted_and_requeued(topo):
    """ray.kill a worker mid-rollout: it restarts, gets the current weights, its prompts run again."""
    import ray

    d = _driver(topo, requests_per_worker=2)
    d.step()  # warm: weights synced, programs compiled
    victim = topo.workers[0]
    old_pid = ray.get(victim.status.remote())["pid"]
    killed = {}

    def kill_mid_rollout(driver, step):
        if killed:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ray.get(victim.status.remote())["generating"] is not None:
                break
            time.sleep(0.005)
        ray.kill(victim, no_restart=False)
        killed["step"] = step

    d.on_rollouts_queued = kill_mid_rollout
    from torchtpu_rl.driver import PromptDataset

    expected = [p for _, p, _ in PromptDataset(rl_common.make_items(ANSWER_LEN), seed=0).take(8)[4:8]]
    m = d.step()
    assert killed
    kinds = [e["event"] for e in d.events]
    assert "worker_died" in kinds and "worker_restarted" in kinds and "worker_resynced" in kinds
    new = ray.get(topo.workers[0].status.remote())
    assert new["pid"] != old_pid and new["version"] == m["policy_version"]
    # nothing lost: the whole step's batch (4 prompts x 4 samples) was trained on, every
    # trajectory of one (the same) policy version
    assert m["samples"] == 16 and m["rollout_versions"] == [m["policy_version"] - 1] and m["faults"] >= 1
    assert d.last_batch.prompts() == [p for p in expected for _ in range(4)]
    assert d.last_batch.policy_version.tolist() == [m["policy_version"] - 1] * 16
    learner_sums, worker_sums = _all_checksums(topo)
    assert all(s == learner_sums for s in worker_sums)


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
