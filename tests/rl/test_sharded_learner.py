"""A sharded RL learner: 2 learner processes (FSDP2), started with ray_integration's TPUHostGroup on a
simulated v4-16 slice (two Ray nodes of the session head), and one rollout worker.

One topology serves the module: a learner step on a fixed batch against the single learner (in this
process on the CPU device, same policy, same batch), then a short GRPO run through the driver whose syncs keep versions
and checksums, and a sharded (DCP) checkpoint resumed exactly.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_common  # noqa: E402

ANSWER_LEN = 4
GROUP = 4
LEARNER = {"group_size": GROUP, "lr": 1e-3, "kl_coef": 0.05, "adam_eps": 1e-2, "compile": False}


def _policy_fn():
    from torchtpu_rl.policy import make_policy

    return functools.partial(make_policy, rl_common.VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, seed=0)


@pytest.fixture(scope="module")
def topo(ray_driver):
    import ray_integration as ri
    from ray_integration import SliceSpec
    from torchtpu_rl.topology import make_topology

    sl = ri.start_simulated_slice(ray_driver, SliceSpec.parse("v4-16"), name="sim-v4-16-rl")
    try:
        # the slice's chips all go to the learner: the rollout worker asks for no TPU
        t = make_topology(_policy_fn(), rl_common.PAD, num_rollout_workers=1, algo="grpo", learner_kwargs=LEARNER,
                          learner_processes=2, actor_options={"resources": {}})
        try:
            yield t
        finally:
            t.shutdown()
    finally:
        ri.stop_simulated_slice(ray_driver, sl)


def _fixed_batch():
    """Two prompt groups of GROUP responses with varied lengths (made-up tokens and log-probs)."""
    from torchtpu_rl import RolloutBatch

    g = torch.Generator().manual_seed(0)
    rows, P, R = 2 * GROUP, 5, ANSWER_LEN
    plens = torch.randint(1, P + 1, (rows,), generator=g)
    rlens = torch.randint(1, R + 1, (rows,), generator=g)
    pmask = (torch.arange(P)[None] >= P - plens[:, None]).long()
    rmask = torch.arange(R)[None] < rlens[:, None]
    ids = torch.randint(0, 10, (rows, P + R), generator=g)
    batch = RolloutBatch(prompt_ids=ids[:, :P] * pmask + rl_common.PAD * (1 - pmask), prompt_mask=pmask,
                         response_ids=ids[:, P:] * rmask, response_mask=rmask,
                         logprobs=-torch.rand(rows, R, generator=g) * rmask,
                         policy_version=torch.zeros(rows, dtype=torch.int64), stopped=torch.zeros(rows, dtype=bool),
                         pad_id=rl_common.PAD)
    return batch, torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 1.0, 0.75])


def test_one_step_matches_the_single_learner(topo):
    import ray

    from torchtpu_rl import Learner
    from torchtpu_rl.weight_sync import WeightReceiver

    batch, rewards = _fixed_batch()
    got_ref = topo.learner.train_step.remote(batch.state(), rewards.tolist())
    # the single learner on the CPU device (no XLA compiles here while the ranks compile theirs)
    single = Learner(_policy_fn()(), algo="grpo", device="cpu", **LEARNER)
    want = single.train_step(batch, rewards)
    got = ray.get(got_ref)
    for k in ("pg_loss", "kl", "entropy", "loss", "grad_norm", "reward_mean", "reward_std", "response_length_mean",
              "rollout_logprob_diff_max", "rollout_logprob_diff_mean", "is_ratio_mean"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert got["response_tokens"] == want["response_tokens"] and got["policy_version"] == 1
    # the whole weights, gathered from the shards and published by rank 0, are the single learner's
    update = ray.get(topo.learner.publish_weights.remote())
    assert update.version == 1
    weights = WeightReceiver(device="cpu").receive(update)
    ref = single.policy_state_dict()
    assert sorted(weights) == sorted(ref)
    for k, v in ref.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert any(not torch.equal(v, _policy_fn()().state_dict()[k]) for k, v in ref.items())  # the step moved them


def _driver(topo, **kw):
    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.rollout import SamplingParams

    return RLDriver(topo, PromptDataset(rl_common.make_items(ANSWER_LEN), seed=0), rl_common.digit_reward,
                    sampling=SamplingParams(max_new_tokens=ANSWER_LEN), prompts_per_step=2, group_size=GROUP, seed=3,
                    **kw)


def test_grpo_run_syncs_versions_and_checksums_and_resumes(topo, tmp_path):
    import ray

    def synced(version):
        learner_sums = ray.get(topo.learner.checksums.remote())
        worker_sums = ray.get(topo.workers[0].checksums.remote())
        assert worker_sums == learner_sums  # every tensor of the worker is the learner's (rank 0 gathered)
        assert ray.get(topo.workers[0].status.remote())["version"] == version
        return learner_sums

    d = _driver(topo)
    start = ray.get(topo.learner.version.remote())
    ckpt = str(tmp_path / "ckpt.pt")
    d.save_checkpoint(ckpt)  # sharded: DCP shards beside the file
    assert os.path.isdir(ckpt + ".shards")
    d.sync_weights()
    sums0 = synced(start)
    m = d.step()
    assert m["policy_version"] == start + 1 and m["staleness"] == 0
    sums1 = synced(start + 1)  # the next version, published and verified
    assert sums1 != sums0
    # a re-save goes to a new shard directory; the old one goes only once the file names the new one
    from torchtpu_rl.checkpoint import read_checkpoint

    again_path = str(tmp_path / "again.pt")
    d.save_checkpoint(again_path)
    first = read_checkpoint(again_path)["learner"]["shards"]
    d.save_checkpoint(again_path)
    second = read_checkpoint(again_path)["learner"]["shards"]
    assert first != second and os.path.isdir(tmp_path / second) and not os.path.exists(tmp_path / first)

    d2 = _driver(topo)
    d2.load_checkpoint(ckpt)  # the learner back at the saved version, the worker re-synced to it
    assert ray.get(topo.learner.version.remote()) == start
    assert synced(start) == sums0
    again = d2.step()
    assert again["policy_version"] == start + 1 and synced(start + 1) == sums1
    for k in ("reward_mean", "pg_loss", "kl", "entropy", "response_tokens"):
        assert again[k] == m[k], k
