"""The learner at real sizes: micro-batches by a token budget, gradient checkpointing, bfloat16
parameters with float32 master weights, and the rollout/learner log-prob agreement metric.

The token-budget plan and the mixed-precision optimizer are checked on the cpu device against a
plain one-micro-batch float32 step (fast); one tpu test runs them all through the compiled
micro-batch programs on a Hugging Face model fed by the compiled tpu rollout engine.
"""

import copy

import pytest
import torch
from helpers import no_fallback, tiny_hf_causal_lm

from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import Learner, RolloutBatch, RolloutEngine, SamplingParams

VOCAB = 64
GROUP = 4


def _batch(seed=0, rows=8, prompt=5, response=12):
    """A rollout batch with varied prompt and response lengths (token ids and log-probs made up:
    the learner only needs them to be consistent)."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, prompt + 1, (rows,), generator=g)
    rlens = torch.randint(1, response + 1, (rows,), generator=g)
    ids = torch.randint(3, VOCAB, (rows, prompt + response), generator=g)
    cols = torch.arange(prompt)
    pmask = (cols[None] >= prompt - plens[:, None]).long()
    rmask = torch.arange(response)[None] < rlens[:, None]
    return RolloutBatch(prompt_ids=ids[:, :prompt] * pmask, prompt_mask=pmask,
                        response_ids=ids[:, prompt:] * rmask, response_mask=rmask,
                        logprobs=-torch.rand(rows, response, generator=g) * rmask,
                        policy_version=torch.zeros(rows, dtype=torch.int64), stopped=torch.zeros(rows, dtype=bool))


def _rewards(batch):
    return torch.tensor([float(sum(t % 3 == 0 for t in r)) for r in batch.responses()])


def _params(model):
    return {k: v.detach().float().cpu() for k, v in model.named_parameters()}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_token_budget_micro_batches_give_the_one_batch_update(algo):
    batch = _batch()
    kw = dict(algo=algo, group_size=GROUP if algo == "grpo" else None, lr=1e-2, kl_coef=0.05, entropy_coef=0.01,
              device="cpu", length_buckets=BucketPolicy.pow2(4, 32), grad_clip=1.0)
    base = tiny_hf_causal_lm("qwen2", vocab_size=VOCAB)
    whole = Learner(copy.deepcopy(base), **kw)
    packed = Learner(copy.deepcopy(base), micro_batch_tokens=40, **kw)
    plan = packed._plan(list(range(len(batch))), packed._layout(batch)[4], 32, len(batch))
    assert sorted(r for rows, _, _ in plan for r in rows) == list(range(len(batch)))  # every row once
    assert len(plan) > 2 and len({L for _, L, _ in plan}) > 1  # several micro-batches of several lengths
    assert all(R * L <= 40 or len(rows) == 1 for rows, L, R in plan)
    m_whole = whole.train_step(batch, _rewards(batch))
    m_packed = packed.train_step(batch, _rewards(batch))
    for k in ("pg_loss", "kl", "entropy", "grad_norm", "rollout_logprob_diff_max"):
        assert m_packed[k] == pytest.approx(m_whole[k], rel=1e-4, abs=1e-6), k
    for k, v in _params(whole.policy).items():
        torch.testing.assert_close(_params(packed.policy)[k], v, atol=1e-5, rtol=1e-4)
    # the rollout log-probs here are made up: the metric is their distance to the recompute
    assert m_whole["rollout_logprob_diff_max"] > 0.1
    assert m_whole["learner_tokens_per_s"] > m_whole["tokens_per_s"] > 0  # prompt tokens count too


def test_bfloat16_params_train_float32_master_weights():
    batch = _batch(seed=1)
    base = tiny_hf_causal_lm("llama", vocab_size=VOCAB)
    kw = dict(algo="grpo", group_size=GROUP, lr=1e-4, device="cpu", length_buckets=BucketPolicy.pow2(4, 32))
    ref = Learner(copy.deepcopy(base), **kw)
    bf16 = Learner(copy.deepcopy(base), param_dtype="bfloat16", **kw)
    assert all(p.dtype == torch.bfloat16 for p in bf16.policy.parameters())
    assert all(m.dtype == torch.float32 for m in bf16._adam.master)
    before = [m.clone() for m in bf16._adam.master]
    ref.train_step(batch, _rewards(batch))
    bf16.train_step(batch, _rewards(batch))
    # the master weights take the update (lr 1e-4: mostly below bfloat16's resolution of the weights)
    moved = [(m - b).abs().max().item() for m, b in zip(bf16._adam.master, before)]
    assert min(moved) > 0
    for p, m in zip(bf16.policy.parameters(), bf16._adam.master):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    for (k, v), m in zip(_params(ref.policy).items(), bf16._adam.master):
        torch.testing.assert_close(m.detach(), v, atol=2e-2, rtol=0, msg=k)  # float32 update, bf16 forward
    # a float32 learner refuses the bfloat16 checkpoint, saying why
    with pytest.raises(ValueError, match="param_dtype 'bfloat16'"):
        ref.load_state_dict(bf16.state_dict())
    bf16.load_state_dict(bf16.state_dict())


def test_options_are_checked():
    model = tiny_hf_causal_lm("qwen2", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="param_dtype must be 'float32' or 'bfloat16'"):
        Learner(model, group_size=GROUP, device="cpu", param_dtype="float16")
    with pytest.raises(ValueError, match="micro_batch_tokens must be an int >= 1"):
        Learner(model, group_size=GROUP, device="cpu", micro_batch_tokens=0)
    from torchtpu_rl import make_policy

    with pytest.raises(ValueError, match="gradient_checkpointing_enable.*TinyTransformer"):
        Learner(make_policy(VOCAB), group_size=GROUP, device="cpu", gradient_checkpointing=True)


@pytest.fixture(scope="module")
def tpu_rollout():
    """A tiny Hugging Face policy and a sampled batch of it from the compiled tpu rollout engine."""
    base = tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, num_layers=1)
    eng = RolloutEngine(copy.deepcopy(base), 0, device="tpu", compile=True,
                        prompt_buckets=BucketPolicy.pow2(8, 16), response_buckets=BucketPolicy.pow2(8, 16))
    prompts = [[5, 9, 13], [7, 3, 8, 21, 30], [11], [40, 41]]
    batch = eng.generate([p for p in prompts for _ in range(2)], SamplingParams(max_new_tokens=8, temperature=1.0))
    return base, batch, _rewards(batch)


TPU_KW = dict(algo="grpo", group_size=2, lr=1e-3, kl_coef=0.05, length_buckets=BucketPolicy.pow2(16, 32))


def test_compiled_learner_on_tpu_with_checkpointing_and_token_budget(tpu_rollout):
    """Rollouts from the compiled tpu engine, then a compiled learner step with gradient checkpointing
    and a token budget: the rollout's log-probs are the learner's, the update plain torch's on CPU."""
    base, batch, rewards = tpu_rollout
    learner = Learner(copy.deepcopy(base), device="tpu", compile=True, gradient_checkpointing=True,
                      micro_batch_tokens=64, **TPU_KW)
    assert learner.policy.is_activation_checkpointing
    with no_fallback():
        m = learner.train_step(batch, rewards)
    assert m["rollout_logprob_diff_max"] < 1e-4
    assert m["learner_tokens_per_s"] > 0
    cpu = Learner(copy.deepcopy(base), device="cpu", micro_batch_tokens=64, **TPU_KW)
    m_cpu = cpu.train_step(batch, rewards)
    assert m["pg_loss"] == pytest.approx(m_cpu["pg_loss"], abs=1e-5)
    for k, v in _params(cpu.policy).items():
        torch.testing.assert_close(_params(learner.policy)[k], v, atol=1e-5, rtol=1e-4, msg=k)


def test_compiled_bfloat16_learner_on_tpu(tpu_rollout):
    base, batch, rewards = tpu_rollout
    learner = Learner(copy.deepcopy(base), device="tpu", compile=True, param_dtype="bfloat16", **TPU_KW)
    with no_fallback():
        m = learner.train_step(batch, rewards)
    cpu = Learner(copy.deepcopy(base), device="cpu", param_dtype="bfloat16", **TPU_KW)
    m_cpu = cpu.train_step(batch, rewards)
    # float32 rollouts scored by a bfloat16 policy: close to bfloat16's precision, not equal
    assert 0 < m["rollout_logprob_diff_max"] < 0.1
    for k in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert m[k] == pytest.approx(m_cpu[k], rel=0.05, abs=1e-3), k
    for p, mw in zip(learner.policy.parameters(), learner._adam.master):
        assert p.dtype == torch.bfloat16 and mw.dtype == torch.float32
        assert torch.equal(p.detach().cpu(), mw.detach().cpu().to(torch.bfloat16))
