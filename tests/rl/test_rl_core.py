"""torchtpu_rl single-process core: algorithms, sampling, rollout engine, learner.

Algorithm tests compare against values worked out by hand in the comments (not
recomputed with the same formulas). Rollout and learner tests run on tpu with a
tiny policy (vocab 16, d_model 32, one layer) so that the programs compile fast;
the models are shared by the module so executables are reused across tests.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import torchtpu  # noqa: F401  (registers the tpu device)
from torchtpu.bucketing import BucketOverflowError, BucketPolicy
from torchtpu_rl import (
    Learner,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    agg_loss,
    gae,
    grpo_advantages,
    kl_estimate,
    make_policy,
    policy_loss,
    sample_from_logits,
    sequence_logprobs,
    truncated_is_weights,
    value_loss,
)

V = 16
CFG = dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=32)


def tiny_policy(seed=0, device=None):
    return make_policy(V, seed=seed, device=device, **CFG)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               rtol=tol, atol=tol)


# ============================================================== algorithms (hand values)
def test_grpo_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.5 / 0.577351 = +-0.866024
    # group 2: all equal -> 0 / (0 + eps) = 0
    close(grpo_advantages(r, 4), [0.866024, -0.866024, -0.866024, 0.866024, 0, 0, 0, 0])
    close(grpo_advantages(r, 4, normalize_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="whole groups"):
        grpo_advantages(r, 3)


def test_gae_hand_values():
    # gamma 0.9, lambda 0.8, V = (0.5, 0.6, 0.7), reward 1 on the last token:
    # d2 = 1 - 0.7 = 0.3                         A2 = 0.3
    # d1 = 0.9 * 0.7 - 0.6 = 0.03                A1 = 0.03 + 0.72 * 0.3 = 0.246
    # d0 = 0.9 * 0.6 - 0.5 = 0.04                A0 = 0.04 + 0.72 * 0.246 = 0.21712
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), None, 0.9, 0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])
    # a masked last slot is skipped (its value 9 never enters): d1 = 1 - 0.6 = 0.4, A1 = 0.4,
    # A0 = 0.04 + 0.72 * 0.4 = 0.328
    adv, ret = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.6, 9.0]]),
                   torch.tensor([[1, 1, 0]]), 0.9, 0.8)
    close(adv, [[0.328, 0.4, 0.0]])
    close(ret, [[0.828, 1.0, 0.0]])


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(0.25 / 0.5) = -0.693147
    close(kl_estimate(logp, ref, "k1"), [0.693147])  # -log r
    close(kl_estimate(logp, ref, "k2"), [0.240227])  # 0.5 * 0.693147^2
    close(kl_estimate(logp, ref, "k3"), [0.193147])  # r - 1 - log r = 0.5 - 1 + 0.693147
    close(kl_estimate(logp, logp, "k3"), [0.0])
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")


def test_policy_loss_hand_values():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    # eps_low 0.2, eps_high 0.3 -> clip to [0.8, 1.3]
    # t0: max(-1.5, -1.3) = -1.3 (clipped);  t1: max(0.5, 0.8) = 0.8 (clipped);  t2: max(-2.2, -2.2) = -2.2
    loss, st = policy_loss(logp, old, adv, None, 0.2, 0.3, return_stats=True)
    close(loss, -2.7 / 3)
    close(st["clipfrac"], 2 / 3)
    close(policy_loss(logp, old, adv, None, 0.2, 0.3, global_tokens=6), -2.7 / 6)  # global token mean
    close(policy_loss(logp, old, adv, torch.tensor([[1, 1, 0]]), 0.2, 0.3), (-1.3 + 0.8) / 2)
    # sequence-level advantages broadcast over tokens; symmetric clip by default (0.8 .. 1.2): -1.2
    close(policy_loss(logp[:, :1], old[:, :1], torch.tensor([1.0])), -1.2)
    # importance weights scale each token: 0.5 * -1.3 + 1 * 0.8 + 2 * -2.2 = -4.25
    close(policy_loss(logp, old, adv, None, 0.2, 0.3, is_weights=torch.tensor([[0.5, 1.0, 2.0]])), -4.25 / 3)


def test_loss_aggregations_hand_values():
    loss = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    close(agg_loss(loss, mask, "token-mean"), 6 / 3)
    close(agg_loss(loss, mask, "token-mean", global_tokens=12), 6 / 12)
    close(agg_loss(loss, mask, "seq-mean-token-sum"), (3 + 3) / 2)
    close(agg_loss(loss, mask, "seq-mean-token-mean"), (1.5 + 3) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        agg_loss(loss, mask, "mean")


def test_value_loss_and_tis_hand_values():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]])
    # t0: (1-2)^2 = 1 vs clipped 0.5+0.2=0.7 -> 1.69: 1.69;  t1: 0 vs clipped 0.5-0.2=0.3 -> 0.09: 0.09
    close(value_loss(v, old, ret, None, clip=0.2), 0.5 * (1.69 + 0.09) / 2)
    close(value_loss(v, old, ret, None, clip=None), 0.5 * (1.0 + 0.0) / 2)
    # ratios pi_old / pi_behaviour = 0.4 / 0.2 = 2 (capped at 1.5) and 0.1 / 0.5 = 0.2
    w = truncated_is_weights(torch.log(torch.tensor([0.2, 0.5])), torch.log(torch.tensor([0.4, 0.1])), cap=1.5)
    close(w, [1.5, 0.2])


# ============================================================== sampling
def test_sampling_greedy_topk_topp_on_tpu():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    tok, logp = sample_from_logits(logits.to("tpu"), temperature=0.0)
    assert tok.cpu().tolist() == logits.argmax(-1).tolist()
    close(logp.cpu(), torch.log_softmax(logits, -1).gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1))

    # one distribution, 512 draws: top-k keeps the k largest only
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0] + [-3.0] * (V - 8))
    many = row.repeat(512, 1).to("tpu")
    tok, logp = sample_from_logits(many, temperature=1.0, top_k=2)
    assert set(tok.cpu().tolist()) == {0, 1}
    # the log-prob is of the temperature-scaled, untruncated distribution
    close(logp.cpu(), torch.log_softmax(row, -1)[tok.cpu()])
    # top-p on probabilities 0.5, 0.3, 0.15, 0.05: mass before token 1 is 0.5 < 0.7 (kept), before token 2
    # it is 0.8 (dropped) -> {0, 1}; drawn about 5:3
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tok, _ = sample_from_logits(probs.log().repeat(2048, 1).to("tpu"), temperature=1.0, top_p=0.7)
    t = tok.cpu()
    assert set(t.tolist()) == {0, 1}
    frac0 = (t == 0).float().mean().item()
    assert abs(frac0 - 0.625) < 0.05, frac0
    # temperature: draws follow softmax(logits / T); at T = 0.5 probabilities 0.5/0.3/... become p^2 normalized
    tok, logp = sample_from_logits(probs.log().repeat(2048, 1).to("tpu"), temperature=0.5)
    p2 = probs ** 2 / (probs ** 2).sum()
    close(logp.cpu(), p2.log()[tok.cpu()], tol=1e-4)
    assert abs((tok.cpu() == 0).float().mean().item() - p2[0].item()) < 0.05


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    assert SamplingParams(stop_token_ids=3).stop_token_ids == (3,)


# ============================================================== rollout engine
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]
# every engine call of the module stays in one bucket (batch 4, prompt 4, 4 new tokens: 8 KV slots) except
# where a test is about other buckets, so the programs compile once
SP_SAMPLE = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=8)


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(tiny_policy(), pad_id=0, device="tpu", compile=False,
                         prompt_buckets=BucketPolicy.pow2(4, 8), response_buckets=BucketPolicy.pow2(4, 8),
                         batch_buckets=BucketPolicy.pow2(4, 8, overflow="split"))


def test_greedy_generation_is_argmax_and_logprobs_match_recompute(engine):
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0), policy_version=7)
    assert b.response_ids.shape == (4, 4) and bool(b.response_mask.all())
    assert b.policy_version.tolist() == [7] * 4
    assert b.prompts() == PROMPTS
    # teacher-forced full forward on a CPU copy: each greedy token is the argmax at the previous position
    cpu_model = tiny_policy().eval()
    with torch.no_grad():
        logits = cpu_model(b.input_ids, b.attention_mask)
    P = b.prompt_ids.shape[1]
    assert torch.equal(logits[:, P - 1:-1].argmax(-1), b.response_ids)
    lp = sequence_logprobs(cpu_model, b.input_ids, b.attention_mask, b.response_mask).detach()
    close(lp, b.logprobs, tol=1e-4)


def test_sampled_logprobs_match_full_forward_and_stop_tokens(engine):
    torch.manual_seed(1)
    b = engine.generate(PROMPTS, SP_SAMPLE)
    assert b.response_ids.shape == (4, 4)
    # a full forward of prompt + response (on a CPU copy: the reference implementation) gives the same
    # log-probs at temperature 0.8 as the ones recorded while sampling with the KV cache
    with torch.no_grad():
        lp = sequence_logprobs(tiny_policy().eval(), b.input_ids, b.attention_mask, b.response_mask,
                               temperature=0.8)
    close(lp, b.logprobs, tol=1e-4)

    # stop tokens: take the greedy continuation and stop at its 3rd token of row 0
    g = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    stop = int(g.response_ids[0, 2])
    s = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(stop,)))
    for i, (full, got) in enumerate(zip(g.responses(), s.responses())):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut], (i, full, got)
        assert bool(s.stopped[i]) == (stop in full)
    assert s.response_ids.shape[1] == max(len(r) for r in s.responses())
    assert (s.logprobs[~s.response_mask] == 0).all()


def test_kv_cache_generation_equals_no_cache(engine):
    nc = RolloutEngine(engine.model, pad_id=0, device="tpu", compile=False, use_kv_cache=False,
                       prompt_buckets=engine.prompt_buckets, response_buckets=engine.response_buckets,
                       batch_buckets=engine.batch_buckets)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    a = engine.generate(PROMPTS, sp)
    b = nc.generate(PROMPTS, sp)
    assert torch.equal(a.response_ids, b.response_ids)
    close(a.logprobs, b.logprobs, tol=1e-5)


def test_compiles_stay_bounded_as_lengths_vary(engine, metrics):
    engine.generate([[1, 2, 3]] * 3, SP_SAMPLE)  # warm: batch bucket 4, prompt bucket 4, response bucket 4
    before = metrics.snapshot()["compiles"]
    # raw batch sizes 1..4, prompt lengths 1..4, 1..4 new tokens: all inside the warm buckets
    for n, plen, new in [(1, 1, 3), (2, 2, 4), (4, 4, 2), (3, 2, 1), (2, 4, 4)]:
        b = engine.generate([[(i + j) % V for j in range(plen)] for i in range(n)],
                            SamplingParams(max_new_tokens=new, temperature=0.8, top_k=8))
        assert len(b) == n and b.response_ids.shape[1] <= new
    assert metrics.snapshot()["compiles"] == before, "varying lengths inside known buckets compiled new programs"
    with pytest.raises(BucketOverflowError, match="prompt 0 has 9 tokens"):
        engine.generate([[1] * 9], SP_SAMPLE)


def test_weight_swap_protocol(engine):
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = engine.generate(PROMPTS, sp)
    other = tiny_policy(seed=5)
    eng2 = RolloutEngine(tiny_policy(seed=0), pad_id=0, device="tpu", compile=False,
                         prompt_buckets=engine.prompt_buckets, response_buckets=engine.response_buckets,
                         batch_buckets=engine.batch_buckets)
    eng2.update_weights(other.state_dict(), policy_version=3)
    assert not eng2.paused and not eng2._caches
    after = eng2.generate(PROMPTS, sp)
    assert after.policy_version.tolist() == [3] * 4
    ref = RolloutEngine(other, pad_id=0, device="tpu", compile=False, prompt_buckets=engine.prompt_buckets,
                        response_buckets=engine.response_buckets, batch_buckets=engine.batch_buckets)
    assert torch.equal(after.response_ids, ref.generate(PROMPTS, sp).response_ids)
    assert not torch.equal(after.logprobs, before.logprobs)


def test_batches_above_the_largest_bucket_are_chunked():
    # host-side logic, the same on every device: checked on cpu where it costs no compiles
    eng = RolloutEngine(tiny_policy(), pad_id=0, device="cpu", batch_buckets=BucketPolicy.pow2(1, 4, overflow="split"))
    prompts = [[1 + i % 5, 2] for i in range(10)]  # chunks of 4, 4, 2
    b = eng.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(b) == 10 and b.prompts() == prompts
    one = eng.generate(prompts[8:], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert b.responses()[8:] == one.responses()


def test_rollout_batch_concat_split_roundtrip(engine):
    a = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2, temperature=0.0), policy_version=1)
    b = engine.generate(PROMPTS[2:], SamplingParams(max_new_tokens=4, temperature=0.0), policy_version=2)
    c = RolloutBatch.concat([a, b])
    assert len(c) == 4 and c.policy_version.tolist() == [1, 1, 2, 2]
    assert c.prompts() == PROMPTS
    assert c.responses() == a.responses() + b.responses()
    x, y = c.split(2)
    assert x.responses() == a.responses() and y.prompts() == b.prompts()
    assert RolloutBatch.from_state(c.state()).responses() == c.responses()


# ============================================================== compiled decode step
def test_compiled_decode_matches_eager(engine, metrics):
    comp = RolloutEngine(engine.model, pad_id=0, device="tpu", compile=True,
                         prompt_buckets=engine.prompt_buckets, response_buckets=engine.response_buckets,
                         batch_buckets=engine.batch_buckets)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    a = comp.generate(PROMPTS, sp)
    assert torch.equal(a.response_ids, engine.generate(PROMPTS, sp).response_ids)
    before = metrics.snapshot()["compiles"]
    comp.generate([[2, 3]] * 3, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert metrics.snapshot()["compiles"] == before
    # weights loaded in place reach the compiled program
    other = tiny_policy(seed=5)
    comp.update_weights(other.state_dict(), policy_version=1)
    got = comp.generate(PROMPTS, sp)
    engine_other = RolloutEngine(other, pad_id=0, device="cpu", compile=False)
    assert torch.equal(got.response_ids, engine_other.generate(PROMPTS, sp).response_ids)
    comp.update_weights(tiny_policy(seed=0).state_dict(), policy_version=2)


# ============================================================== learner
def _grpo_batch(engine, seed=3):
    torch.manual_seed(seed)
    prompts = [p for p in PROMPTS[:2] for _ in range(2)]  # two groups of two
    b = engine.generate(prompts, SP_SAMPLE)
    # reward: how many 7s the response has (a verifiable toy task), + 0.25 on odd rows so no group ties
    rewards = torch.tensor([float(sum(t == 7 for t in r)) + 0.25 * (i % 2) for i, r in enumerate(b.responses())])
    return b, rewards


def test_grpo_step_moves_policy_toward_rewarded_responses(engine):
    b, rewards = _grpo_batch(engine)
    # the default tpu learner: compiled micro-batch programs (forward + loss, and their backward)
    learner = Learner(tiny_policy(), algo="grpo", group_size=2, lr=5e-3, kl_coef=0.01, device="tpu")
    assert learner.compile
    ids, am, rm = b.input_ids.to("tpu"), b.attention_mask.to("tpu"), b.response_mask.to("tpu")
    with torch.no_grad():
        before = sequence_logprobs(learner.policy, ids, am, rm).sum(1).cpu()
    m = learner.train_step(b, rewards)
    assert learner.policy_version == 1 and m["policy_version"] == 1
    with torch.no_grad():
        after = sequence_logprobs(learner.policy, ids, am, rm).sum(1).cpu()
    adv = grpo_advantages(rewards, 2)
    delta = after - before
    # better-than-group responses became more likely, worse ones less likely
    assert (delta[adv > 0.1] > 0).all() and (delta[adv < -0.1] < 0).all(), (adv, delta)
    assert m["kl"] == 0.0 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    with pytest.raises(ValueError, match=r"rewards \[2\] are not finite"):
        learner.train_step(b, torch.tensor([0.0, 0.0, float("nan"), 0.0]))


def test_ppo_step_and_learner_state_dict_roundtrip(engine):
    b, rewards = _grpo_batch(engine, seed=4)
    # eager learner here (the compiled one is covered above); 2 epochs x 2 mini-batches, micro-batches of 1
    kw = dict(algo="ppo", lr=5e-3, kl_coef=0.05, device="tpu", mini_batch_size=2, micro_batch_size=1,
              ppo_epochs=2, tis_cap=2.0, compile=False)
    a = Learner(tiny_policy(), **kw)
    m1 = a.train_step(b, rewards)
    assert m1["optimizer_steps"] == 4 and "value_loss" in m1
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    m2 = a.train_step(b, rewards)
    # a fresh learner (other initial weights) resumed from the checkpoint continues exactly
    c = Learner(tiny_policy(seed=9), **kw)
    c.load_state_dict(saved)
    assert c.policy_version == 1
    m2c = c.train_step(b, rewards)
    assert c.policy_version == a.policy_version == 2
    for k in ("loss", "pg_loss", "value_loss", "kl", "grad_norm"):
        assert m2c[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    for (n, p), q in zip(a.policy.state_dict().items(), c.policy.state_dict().values()):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=0, atol=0, msg=n)
    for p, q in zip(a.critic.parameters(), c.critic.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=0, atol=0)
    # the value head learned something: values moved off their zero init
    assert a.critic.value_head.weight.detach().abs().sum().item() > 0


def test_checkpoints_store_the_frozen_reference_once(engine, tmp_path):
    """With a reference file, each checkpoint holds the reference policy's digest, not its weights; the file is
    written once. A learner built from the run's initial policy loads without reading it; one built from other
    weights gets the stored reference (its KL then matches); a checkpoint without the file is refused."""
    import os

    from torchtpu_rl.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint

    b, rewards = _grpo_batch(engine, seed=5)
    kw = dict(algo="grpo", group_size=2, lr=5e-3, kl_coef=0.1, device="tpu", compile=False)
    a = Learner(tiny_policy(), **kw)
    a.train_step(b, rewards)
    ref = tmp_path / "reference.pt"
    save_checkpoint(tmp_path / "s1.pt", a, {"step": 1}, reference_path=ref)
    written = ref.stat().st_mtime_ns
    a.train_step(b, rewards)
    save_checkpoint(tmp_path / "s2.pt", a, {"step": 2}, reference_path=ref)
    assert ref.stat().st_mtime_ns == written  # not stored again
    state = read_checkpoint(tmp_path / "s2.pt")
    assert "ref_policy" not in state["learner"] and state["reference"] == "reference.pt"
    save_checkpoint(tmp_path / "whole.pt", a, {"step": 2})  # no reference file: the weights inside
    assert os.path.getsize(tmp_path / "whole.pt") - os.path.getsize(tmp_path / "s2.pt") > 0.9 * os.path.getsize(ref)
    want = a.train_step(b, rewards)
    same = Learner(tiny_policy(), **kw)
    load_checkpoint(tmp_path / "s2.pt", same)
    other = Learner(tiny_policy(seed=9), **kw)  # another reference: the stored one is loaded
    load_checkpoint(tmp_path / "s2.pt", other)
    assert other.reference_digest() == a.reference_digest()
    for learner in (same, other):
        got = learner.train_step(b, rewards)
        assert got["kl"] == pytest.approx(want["kl"], rel=1e-5, abs=1e-7)
    ref.unlink()
    with pytest.raises(FileNotFoundError, match="reference policy file .*reference.pt' is missing"):
        load_checkpoint(tmp_path / "s2.pt", Learner(tiny_policy(seed=9), **kw))
    with pytest.raises(ValueError, match="holds its reference policy's digest only"):
        Learner(tiny_policy(seed=9), **kw).load_state_dict(state["learner"])
