"""The loss family (``loss_type``, TRL's names) and ``scale_rewards``: each against a reference written
here from the paper's / TRL's formula with plain torch (loops and explicit sums, not our helpers), on
small tensors; then each through the learner (the loss it reports at the first update, where the ratio
is 1, equals the reference on the policy's own log-probs) and the CLI's checks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import tiny_hf_causal_lm

from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import Learner, RolloutBatch, sequence_logprobs
from torchtpu_rl import algorithms as A

G = 2  # group size of the small tensors
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)


def _logps(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 4, generator=g) * 2
    new = old + (torch.rand(4, 4, generator=g) - 0.5) * 0.8  # ratios in about [0.67, 1.5]: some clipped
    return new.requires_grad_(True), old


def _grpo_adv(r, scale="group", eps=1e-6):
    out = []
    for g in range(len(r) // G):
        grp = [float(x) for x in r[g * G:(g + 1) * G]]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        if scale == "batch":
            allr = [float(x) for x in r]
            m_all = sum(allr) / len(allr)
            std = math.sqrt(sum((x - m_all) ** 2 for x in allr) / (len(allr) - 1))
        out += [(x - mean) / (std + eps) if scale != "none" else x - mean for x in grp]
    return torch.tensor(out)


def _clip_tok(new, old, adv, lo, hi):
    """PPO's per-token clipped surrogate, as the papers write it: -min(r A, clip(r) A)."""
    r = torch.exp(new - old)
    a = adv[:, None]
    return -torch.minimum(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)


def test_advantage_estimators_match_their_formulas():
    # GRPO, scale_rewards group / batch / none (TRL)
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(A.group_advantages(REWARDS, G, scale), _grpo_adv(REWARDS, scale))
    # RLOO: r_i minus the mean of the group's other rewards; groups (1, 0) and (0.5, 2)
    torch.testing.assert_close(A.rloo_advantages(REWARDS, G), torch.tensor([1.0, -1.0, -1.5, 1.5]))
    r4 = torch.tensor([1.0, 2.0, 4.0, 9.0])  # one group of 4: 1 - 5, 2 - 14/3, 4 - 4, 9 - 7/3
    torch.testing.assert_close(rloo := A.rloo_advantages(r4, 4), torch.tensor([-4.0, 2 - 14 / 3, 0.0, 9 - 7 / 3]))
    torch.testing.assert_close(rloo, (r4 - r4.mean()) * 4 / 3)  # the identity G/(G-1) (r - mean)
    # REINFORCE++: returns-to-go of per-token rewards, whitened over the batch's response tokens
    tok_r = torch.zeros(4, 4)
    for i, n in enumerate(MASK.sum(1).long().tolist()):
        tok_r[i, n - 1] = REWARDS[i]
    tok_r[:, 0] -= 0.1  # a per-token KL penalty on the first tokens
    ret = torch.zeros(4, 4)
    for i in range(4):
        run = 0.0
        for t in reversed(range(4)):
            if MASK[i, t]:
                run = float(tok_r[i, t]) + run
                ret[i, t] = run
    vals = ret[MASK.bool()]
    mean, var = vals.mean(), ((vals - vals.mean()) ** 2).mean()
    want = (ret - mean) / torch.sqrt(var + 1e-8) * MASK
    torch.testing.assert_close(A.reinforce_pp_advantages(tok_r, MASK), want)
    with pytest.raises(ValueError, match="scale must be one of"):
        A.group_advantages(REWARDS, G, "groups")


@pytest.mark.parametrize("loss_type", A.LOSS_TYPES)
def test_each_loss_type_matches_its_reference(loss_type):
    spec = A.LOSS_SPECS[loss_type]
    new, old = _logps()
    lo = 0.2
    hi = spec.eps_high if spec.eps_high is not None else lo
    adv = (A.rloo_advantages(REWARDS, G) if spec.advantage == "rloo" else
           A.group_advantages(REWARDS, G, spec.scale_rewards))
    ntok = MASK.sum()
    norm_length = 6  # Dr. GRPO's constant (max_completion_length)
    if loss_type in ("grpo", "gspo"):
        if loss_type == "grpo":
            tok = _clip_tok(new, old, adv, lo, hi)
        else:  # GSPO: s_i = (pi / pi_old)(y_i) ** (1 / |y_i|), clipped per sequence
            s = torch.stack([torch.exp(((new[i] - old[i]) * MASK[i]).sum() / MASK[i].sum()) for i in range(4)])
            tok = (-torch.minimum(s * adv, torch.clamp(s, 1 - lo, 1 + hi) * adv))[:, None].expand(4, 4)
        want = torch.stack([(tok[i] * MASK[i]).sum() / MASK[i].sum() for i in range(4)]).mean()
    elif loss_type == "dr_grpo":
        want = (_clip_tok(new, old, adv, lo, hi) * MASK).sum() / (4 * norm_length)
    elif loss_type in ("bnpo", "dapo", "rloo"):
        want = (_clip_tok(new, old, adv, lo, hi) * MASK).sum() / ntok
    elif loss_type == "cispo":  # MiniMax-M1: -sg(min(r, 1 + eps_high)) A log pi, token mean
        w = torch.exp(new - old).detach().clamp(max=1 + hi)
        want = (-(w * adv[:, None] * new) * MASK).sum() / ntok
    else:  # reinforce_pp: per-token advantages (REINFORCE++'s), the clipped surrogate, token mean
        tok_r = torch.zeros(4, 4)
        tok_r[torch.arange(4), MASK.sum(1).long() - 1] = REWARDS
        adv = A.reinforce_pp_advantages(tok_r, MASK)
        r = torch.exp(new - old)
        want = (-torch.minimum(r * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv) * MASK).sum() / ntok
    got = A.policy_loss(new, old, adv, MASK, lo, hi, spec.agg, ratio_level=spec.ratio_level, pg=spec.pg,
                        norm_length=norm_length)
    torch.testing.assert_close(got, want)
    g_got, = torch.autograd.grad(got, new)
    g_want, = torch.autograd.grad(want, new)
    torch.testing.assert_close(g_got, g_want)  # the gradients too (GSPO's runs through the sequence mean)
    assert g_got.abs().sum() > 0


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
    """A token whose ratio is past 1 + eps with a positive advantage has no gradient under PPO's clip;
    CISPO's clipped weight keeps it (the reason for the loss)."""
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(1.5), requires_grad=True)
    adv = torch.ones(1)
    g_ppo, = torch.autograd.grad(A.policy_loss(new, old, adv, eps_low=0.2), new)
    g_cispo, = torch.autograd.grad(A.cispo_loss(new, old, adv, eps_high=0.2), new)
    assert g_ppo.item() == 0.0
    assert g_cispo.item() == pytest.approx(-1.2)  # -min(1.5, 1.2) * A


# ------------------------------------------------------------------ through the learner
VOCAB = 64


def _batch(seed=0, rows=8, prompt=5, response=10):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, prompt + 1, (rows,), generator=g)
    rlens = torch.randint(1, response + 1, (rows,), generator=g)
    ids = torch.randint(3, VOCAB, (rows, prompt + response), generator=g)
    pmask = (torch.arange(prompt)[None] >= prompt - plens[:, None]).long()
    rmask = torch.arange(response)[None] < rlens[:, None]
    return RolloutBatch(prompt_ids=ids[:, :prompt] * pmask, prompt_mask=pmask, response_ids=ids[:, prompt:] * rmask,
                        response_mask=rmask, logprobs=-torch.rand(rows, response, generator=g) * rmask,
                        policy_version=torch.zeros(rows, dtype=torch.int64), stopped=torch.zeros(rows, dtype=bool))


@pytest.fixture(scope="module")
def base_model():
    return tiny_hf_causal_lm("qwen2", vocab_size=VOCAB)


@pytest.mark.parametrize("loss_type", A.LOSS_TYPES)
def test_the_learner_trains_each_loss_type_as_its_reference(loss_type, base_model):
    """The first update's pg_loss, where the policy is the old policy (ratio 1, no clip active), is the
    reference aggregation of -A (CISPO: of -A log pi) over the policy's own log-probs."""
    batch = _batch()
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 0.0, 5.0])  # two groups of 4
    learner = Learner(copy.deepcopy(base_model), algo="grpo", group_size=4, lr=1e-2, kl_coef=0.0, device="cpu",
                      length_buckets=BucketPolicy.pow2(4, 16), loss_type=loss_type, norm_length=10)
    spec = learner.loss_spec
    ids, am = batch.input_ids, batch.attention_mask
    rm = torch.cat([torch.zeros_like(batch.prompt_mask), batch.response_mask.long()], 1).float()
    with torch.no_grad():
        logp = sequence_logprobs(learner.policy, ids, am, rm)
    n = rm.sum(1)
    if spec.advantage == "reinforce_pp":
        tok_r = torch.zeros_like(rm)
        tok_r[torch.arange(8), (batch.prompt_ids.shape[1] + batch.response_mask.sum(1)) - 1] = rewards
        adv = A.reinforce_pp_advantages(tok_r, rm)
    else:
        grp = rewards.reshape(2, 4)
        if spec.advantage == "rloo":
            base = (grp.sum(1, keepdim=True) - grp) / 3
        else:
            base = grp.mean(1, keepdim=True)
        a = grp - base
        if spec.scale_rewards == "group":
            a = a / (grp.std(1, keepdim=True) + 1e-6)
        adv = a.reshape(8, 1).expand_as(rm)
    tok = -adv * (logp if spec.pg == "cispo" else 1.0) * rm
    want = {"seq-mean-token-mean": (tok.sum(1) / n).mean(), "token-mean": tok.sum() / rm.sum(),
            "seq-mean-token-sum-norm": (tok.sum(1) / 10).mean()}[spec.agg]
    m = learner.train_step(batch, rewards)
    assert m["pg_loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert m["clipfrac"] == 0.0 and math.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_learner_and_config_check_the_loss_options(base_model):
    from torchtpu_rl.config import ConfigError, LearnerConfig, RolloutConfig, RunConfig

    with pytest.raises(ValueError, match="loss_type must be one of"):
        Learner(base_model, group_size=4, device="cpu", loss_type="grpoo")
    with pytest.raises(ValueError, match="critic-free"):
        Learner(base_model, algo="ppo", device="cpu", loss_type="rloo")
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        Learner(base_model, group_size=4, device="cpu", scale_rewards="rows")
    with pytest.raises(ConfigError, match="--loss-type must be one of"):
        LearnerConfig(loss_type="ppo")
    with pytest.raises(ConfigError, match="--loss-type gspo is a critic-free group loss: give --algo grpo"):
        LearnerConfig(algo="ppo", loss_type="gspo")
    with pytest.raises(ConfigError, match="--pack-sequences"):
        LearnerConfig(algo="ppo", pack_sequences=True)
    with pytest.raises(ConfigError, match="--max-sampling-rounds must be a positive integer"):
        RolloutConfig(max_sampling_rounds=0)
    with pytest.raises(ConfigError, match="--dynamic-sampling .* needs --algo grpo"):
        RunConfig(rollout=RolloutConfig(dynamic_sampling=True), learner=LearnerConfig(algo="ppo"), reward=["x"])
    kw = RunConfig(learner=LearnerConfig(loss_type="dapo"), reward=["x"]).learner_kwargs()
    assert (kw["loss_type"], kw["norm_length"]) == ("dapo", 128)
    learner = Learner(copy.deepcopy(base_model), device="cpu", **kw)
    assert (learner.eps_low, learner.eps_high, learner.loss_agg) == (0.2, 0.28, "token-mean")  # DAPO's defaults
