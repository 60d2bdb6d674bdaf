"""Sequence packing (torchtpu_rl.packing, ``Learner(pack_sequences=True)``): packed rows give the padded
layout's log-probs, loss and gradients (1e-5) for Hugging Face Qwen2 / Llama and TinyTransformer; no token
attends across sequences; the row plan is first-fit with power-of-two row counts; one compiled tpu step."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_hf_causal_lm

from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import Learner, RolloutBatch, make_policy, sequence_logprobs
from torchtpu_rl import algorithms as A
from torchtpu_rl.learner import _policy_micro_loss
from torchtpu_rl.packing import pack_rows, packed_attention_mask, packed_logprobs, plan_rows, pow2_rows

VOCAB = 64
MODELS = {
    "qwen2": lambda: tiny_hf_causal_lm("qwen2", vocab_size=VOCAB),
    "llama": lambda: tiny_hf_causal_lm("llama", vocab_size=VOCAB),
    "qwen2-eager": lambda: tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, attn_implementation="eager"),
    "tiny": lambda: make_policy(VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, seed=0),
}


def _batch(seed=0, rows=8, prompt=5, response=12):
    """Long-tailed response lengths: most short, a few near the limit."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, prompt + 1, (rows,), generator=g)
    rlens = torch.tensor([response if i % 4 == 0 else 1 + i % 3 for i in range(rows)])
    ids = torch.randint(3, VOCAB, (rows, prompt + response), generator=g)
    pmask = (torch.arange(prompt)[None] >= prompt - plens[:, None]).long()
    rmask = torch.arange(response)[None] < rlens[:, None]
    return RolloutBatch(prompt_ids=ids[:, :prompt] * pmask, prompt_mask=pmask, response_ids=ids[:, prompt:] * rmask,
                        response_mask=rmask, logprobs=-torch.rand(rows, response, generator=g) * rmask,
                        policy_version=torch.zeros(rows, dtype=torch.int64), stopped=torch.zeros(rows, dtype=bool))


def _padded(batch):
    ids, am = batch.input_ids, batch.attention_mask
    rm = torch.cat([torch.zeros_like(batch.prompt_mask), batch.response_mask.long()], 1).float()
    return ids, am, rm


def test_plan_rows_is_first_fit_decreasing_with_pow2_row_counts():
    # longest first: 8 -> row 0, 6 -> row 1, 5 fits neither (2, 4 free) -> row 2, 3 -> row 1, 2 -> row 0
    assert plan_rows([5, 3, 8, 2, 6], 10) == [[2, 3], [4, 1], [0]]
    with pytest.raises(ValueError, match="sequence 1 has 11 tokens, more than a packed row's 10"):
        plan_rows([3, 11], 10)
    assert [pow2_rows(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    ids, am, _ = _padded(_batch())
    p = pack_rows(ids, am, 32, rows_bucket=pow2_rows, n_real=6)
    assert p.ids.shape[0] in (1, 2, 4) and p.ids.shape[1] == 32
    assert int(p.valid[:6].sum()) == int(am[:6].sum()) and not p.valid[6:].any()  # filler rows are not packed
    assert int((p.segments > 0).sum()) == int(am[:6].sum())
    # each sequence's positions count from 0, as the padded layout's cumsum(mask) - 1
    for s in range(1, 7):
        assert p.position_ids[p.segments == s].tolist() == list(range(int(am[s - 1].sum())))


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_logprobs_equal_the_padded_ones(name):
    model = MODELS[name]()
    ids, am, rm = _padded(_batch())
    with torch.no_grad():
        ref, ent = sequence_logprobs(model, ids, am, rm, 0.7, return_entropy=True)
        p = pack_rows(ids, am, 32, rows_bucket=pow2_rows)
        got, gent = packed_logprobs(model, p, rm, 0.7, return_entropy=True)
    assert p.ids.numel() < ids.numel() * 32 / ids.shape[1]  # fewer tokens than the rows padded to 32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gent, ent, atol=1e-5, rtol=1e-5)


def test_no_token_attends_across_sequences():
    model = MODELS["qwen2"]()
    ids, am, rm = _padded(_batch())
    p = pack_rows(ids, am, 32)
    mask = packed_attention_mask(p.segments)[:, 0]
    seg = p.segments
    cross = (seg[:, :, None] != seg[:, None, :]) & (seg[:, :, None] > 0)
    assert not (mask & cross).any()
    # changing every token of the other sequences of a row leaves a sequence's log-probs as they were
    row = int((p.segments == 1).nonzero()[0, 0])
    with torch.no_grad():
        before = packed_logprobs(model, p, rm)
        other = (p.segments[row] != 1) & (p.segments[row] > 0)
        assert other.any()
        ids2 = p.ids.clone()
        ids2[row, other] = (ids2[row, other] + 7) % VOCAB
        after = packed_logprobs(model, p._replace(ids=ids2), rm)
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)


@pytest.mark.parametrize("name, loss_type", [("qwen2", "grpo"), ("llama", "gspo"), ("tiny", "dapo")])
def test_packed_and_padded_micro_batch_give_the_same_loss_and_gradients(name, loss_type):
    """The learner's micro-batch loss (forward included), once padded and once packed: loss and every
    parameter's gradient equal to 1e-5."""
    base = MODELS[name]()
    batch = _batch()
    ids, am, rm = _padded(batch)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        old = (sequence_logprobs(base, ids, am, rm) + 0.1 * torch.randn(rm.shape, generator=g)) * rm
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 0.0, 5.0])
    adv = A.group_advantages(rewards, 4)[:, None] * rm
    spec = A.LOSS_SPECS[loss_type]
    out = {}
    for packed in (False, True):
        model = copy.deepcopy(base).train()
        pack = pack_rows(ids, am, 32, rows_bucket=pow2_rows) if packed else None
        loss, parts = _policy_micro_loss(model, ids, am, rm, old, adv, None, None, rm.sum(), 1.0, 1.0,
                                         0.2, spec.eps_high or 0.2, spec.agg, "k3", 0.0, False, 0.01,
                                         spec.ratio_level, spec.pg, 12, pack)
        loss.backward()
        out[packed] = (loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    for k, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], grad, atol=1e-5, rtol=1e-5, msg=k)
    assert any(gr.abs().sum() > 0 for gr in out[False][1].values())


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_packed_learner_step_equals_the_padded_step(device):
    """Whole train_steps (KL and entropy on; cpu: 2 epochs x 2 mini-batches; tpu: the compiled programs,
    one update to keep the compiles few): the same metrics and the same weights."""
    batch = _batch(rows=8)
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 0.0, 5.0])
    updates = dict(ppo_epochs=2, mini_batch_size=4) if device == "cpu" else {}
    kw = dict(algo="grpo", group_size=4, lr=1e-3, kl_coef=0.05, entropy_coef=0.01, device=device,
              length_buckets=BucketPolicy.pow2(4, 32), loss_type="dapo", **updates)
    base = MODELS["qwen2" if device == "cpu" else "tiny"]()
    padded = Learner(copy.deepcopy(base), **kw)
    packed = Learner(copy.deepcopy(base), pack_sequences=True, **kw)
    m_pad = padded.train_step(batch, rewards)
    m_pack = packed.train_step(batch, rewards)
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "rollout_logprob_diff_max"):
        assert m_pack[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-6), k
    for (k, a), b in zip(padded.policy.named_parameters(), packed.policy.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach().cpu(), atol=2e-5, rtol=1e-4, msg=k)


def test_pack_sequences_is_refused_where_it_is_not_built():
    with pytest.raises(ValueError, match="pack_sequences packs the policy's forward of a single GRPO learner"):
        Learner(MODELS["tiny"](), algo="ppo", device="cpu", pack_sequences=True)
    with pytest.raises(ValueError, match="a 4-d attention_mask needs position_ids"):
        MODELS["tiny"]()(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
