"""RL losses and estimators for language-model policies (GRPO and PPO).

Plain torch functions over (batch, tokens) tensors with a response ``mask``
(1 at generated tokens, 0 at padding); they run on any device and in every
execution mode. Conventions follow what verl / OpenRLHF / NeMo-RL converge on:

- GRPO: advantages are rewards normalized within each group of ``group_size``
  responses to the same prompt (groups are consecutive rows); the KL to the
  reference policy is a loss term (k3 by default).
- PPO: token-level rewards (the score on the last response token, optionally
  minus ``kl_coef * k1`` per token), GAE(gamma, lambda), clipped value loss.
- The policy loss is the clipped-ratio surrogate with asymmetric clip
  ``[1 - eps_low, 1 + eps_high]`` (DAPO's clip-higher), aggregated as a
  token-mean over the *global* batch: pass ``global_tokens`` (the response tokens
  of the whole mini-batch, across micro-batches and data-parallel ranks) so that
  gradient accumulation gives the same gradient as one big batch.
- Truncated importance sampling (TIS): when rollouts come from an older or a
  different engine's policy, per-token weights ``min(pi_old / pi_behaviour, cap)``
  multiply the policy-gradient loss.
- The loss family (:data:`LOSS_TYPES`, TRL's names): each ``loss_type`` is a
  :class:`LossSpec` -- which advantage estimator, which aggregation, a token or a
  sequence importance ratio, the clipped surrogate or CISPO's clipped IS weight --
  so the learner runs one code path for all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = [
    "AGGREGATIONS",
    "LOSS_SPECS",
    "LOSS_TYPES",
    "LossSpec",
    "SCALE_REWARDS",
    "cispo_loss",
    "group_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_log_ratio",
    "agg_loss",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "masked_mean",
    "masked_whiten",
    "policy_loss",
    "rollout_mismatch_stats",
    "truncated_is_weights",
    "value_loss",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SCALE_REWARDS = ("group", "batch", "none")


def _mask_like(mask, x):
    if mask is None:
        return torch.ones_like(x)
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match {tuple(x.shape)}")
    return mask.to(x.dtype)


def masked_mean(x: torch.Tensor, mask: Optional[torch.Tensor] = None, dim=None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is set (all of them without a mask)."""
    m = _mask_like(mask, x)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: Optional[torch.Tensor] = None, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (population variance), 0 outside the mask."""
    m = _mask_like(mask, x)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def _check_groups(r, group_size, who):
    r = torch.as_tensor(r)
    if r.dim() != 1:
        raise ValueError(f"{who}: rewards must be 1-D (one per response), not {tuple(r.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{who}: group_size must be a positive int, not {group_size!r}")
    if r.shape[0] % group_size:
        raise ValueError(f"{who}: {r.shape[0]} rewards are not whole groups of {group_size}")
    return r.float() if not r.is_floating_point() else r


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6,
                     baseline: str = "mean") -> torch.Tensor:
    """Advantages (N,) for rewards (N,) in consecutive groups of ``group_size``.

    ``baseline="mean"``: ``r - mean_group`` (GRPO); ``"loo"``: ``r_i - mean of the group's other
    rewards`` (RLOO's leave-one-out baseline, ``G / (G - 1)`` times the former). ``scale``
    (TRL's ``scale_rewards``): ``"group"`` divides by the group's standard deviation + ``eps``,
    ``"batch"`` by the whole batch's, ``"none"`` not at all (Dr. GRPO). Standard deviations are
    unbiased (n - 1), as in TRL and verl. A group whose rewards are all equal gets advantage 0.
    """
    r = _check_groups(rewards, group_size, "group_advantages")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"group_advantages: scale must be one of {SCALE_REWARDS}, not {scale!r}")
    if baseline not in ("mean", "loo"):
        raise ValueError(f"group_advantages: baseline must be 'mean' or 'loo', not {baseline!r}")
    if group_size < 2 and (scale == "group" or baseline == "loo"):
        raise ValueError(f"group_advantages: scale={scale!r} / baseline={baseline!r} need group_size >= 2")
    g = r.reshape(-1, group_size)
    if baseline == "mean":
        centered = g - g.mean(1, keepdim=True)
    else:
        centered = g - (g.sum(1, keepdim=True) - g) / (group_size - 1)
    if scale == "group":
        centered = centered / (g.std(1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / ((r.std() if r.numel() > 1 else r.new_zeros(())) + eps)
    return centered.reshape(-1)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                    normalize_std: bool = True) -> torch.Tensor:
    """Group-normalized advantages (N,) for rewards (N,) in consecutive groups of ``group_size``.

    ``(r - mean_group) / (std_group + eps)`` with the unbiased (n - 1) standard deviation (as
    verl and the GRPO paper's implementation); ``normalize_std=False`` gives Dr. GRPO's
    ``r - mean_group``. A group whose rewards are all equal gets advantage 0.
    """
    r = _check_groups(rewards, group_size, "grpo_advantages")
    if normalize_std and group_size < 2:
        raise ValueError("grpo_advantages: std normalization needs group_size >= 2")
    return group_advantages(r, group_size, "group" if normalize_std else "none", eps)


def rloo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none", eps: float = 1e-6) -> torch.Tensor:
    """RLOO: each response's reward minus the mean of the other ``group_size - 1`` rewards of its group
    (Ahmadian et al. 2024); ``scale`` as :func:`group_advantages`."""
    return group_advantages(rewards, group_size, scale, eps, baseline="loo")


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): per-token returns-to-go of ``token_rewards`` (B, T) (the score on the
    last response token, minus the per-token KL penalty when there is one), discounted by ``gamma``,
    then whitened over every response token of the batch (the batch normalization that stands in
    for a critic). Zero outside ``mask``."""
    if token_rewards.shape != mask.shape or token_rewards.dim() != 2:
        raise ValueError(f"reinforce_pp_advantages: token_rewards {tuple(token_rewards.shape)} and mask "
                         f"{tuple(mask.shape)} must be the same (batch, tokens) shape")
    m = mask.to(token_rewards.dtype)
    running = torch.zeros_like(token_rewards[:, 0])
    out = [None] * token_rewards.shape[1]
    for t in reversed(range(token_rewards.shape[1])):
        # padding columns carry the running return over (as gae does), a response token adds to it
        running = (token_rewards[:, t] + gamma * running) * m[:, t] + running * (1 - m[:, t])
        out[t] = running * m[:, t]
    return masked_whiten(torch.stack(out, 1), m)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor] = None, gamma: float = 1.0,
        lam: float = 0.95):
    """Generalized advantage estimation over token-level ``rewards`` and ``values`` (B, T).

    Returns ``(advantages, returns)``, ``returns = advantages + values``. Positions outside
    ``mask`` are skipped: the recursion carries over them (the next real token's value and
    advantage pass through), and they get 0. The value after the last real token is 0 (the
    episode ends with the response).
    """
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must be the "
                         "same (batch, tokens) shape")
    m = _mask_like(mask, values)
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last = torch.zeros(B, dtype=values.dtype, device=values.device)
    adv = [None] * T
    for t in reversed(range(T)):
        mt = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * last
        last = a * mt + last * (1 - mt)
        next_value = values[:, t] * mt + next_value * (1 - mt)
        adv[t] = a * mt
    advantages = torch.stack(adv, 1)
    returns = (advantages + values) * m
    return advantages, returns


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3",
                clamp: Optional[float] = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With ``log r = ref_logp - logp``: k1 = ``-log r`` (unbiased, can be negative),
    k2 = ``(log r)^2 / 2``, k3 = ``r - 1 - log r`` (unbiased, >= 0, low variance).
    ``clamp`` bounds the estimate to [-clamp, clamp] (verl clamps k3 at 10).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_estimate: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    log_r = ref_logp - logp
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r * log_r
    elif kind == "k3":
        kl = torch.exp(log_r) - 1 - log_r
    else:
        raise ValueError(f"kl_estimate: kind must be 'k1', 'k2' or 'k3', not {kind!r}")
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


def agg_loss(loss: torch.Tensor, mask: Optional[torch.Tensor] = None, agg: str = "token-mean",
             global_tokens=None, global_seqs=None, norm_length: Optional[int] = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    ``token-mean``: sum over masked tokens / ``global_tokens`` (default: this batch's masked
    tokens). ``seq-mean-token-sum``: per-sequence token sums, averaged over sequences.
    ``seq-mean-token-mean``: per-sequence token means, averaged over sequences.
    ``seq-mean-token-sum-norm`` (Dr. GRPO): per-sequence token sums divided by the constant
    ``norm_length`` (the longest response allowed; default: ``T``), averaged over sequences:
    no length bias. The sequence means divide by ``global_seqs`` when given (default: this
    batch's rows).
    """
    m = _mask_like(mask, loss)
    if agg == "token-mean":
        denom = m.sum().clamp(min=1.0) if global_tokens is None else global_tokens
        return (loss * m).sum() / denom
    if agg == "seq-mean-token-sum":
        per_seq = (loss * m).sum(-1)
    elif agg == "seq-mean-token-mean":
        per_seq = (loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    elif agg == "seq-mean-token-sum-norm":
        per_seq = (loss * m).sum(-1) / float(norm_length or loss.shape[-1])
    else:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, not {agg!r}")
    nseq = loss.shape[0] if global_seqs is None else global_seqs
    return per_seq.sum() / nseq


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: Optional[torch.Tensor] = None):
    """GSPO's length-normalized sequence log-ratio (B, 1): ``mean over the response tokens of
    (logp - old_logp)``, so ``exp`` of it is ``(pi(y|x) / pi_old(y|x)) ** (1 / |y|)``."""
    m = _mask_like(mask, logp)
    return ((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


PG_FORMS = ("clip", "cispo")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: Optional[torch.Tensor] = None, eps_low: float = 0.2, eps_high: Optional[float] = None,
                agg: str = "token-mean", global_tokens=None, is_weights: Optional[torch.Tensor] = None,
                return_stats: bool = False, ratio_level: str = "token", pg: str = "clip",
                norm_length: Optional[int] = None):
    """The policy-gradient loss, aggregated by :func:`agg_loss`.

    ``pg="clip"``: the PPO clipped surrogate, per token ``max(-A * r, -A * clip(r, 1 - eps_low,
    1 + eps_high))`` with ``r = exp(logp - old_logp)`` (``ratio_level="token"``), or GSPO's
    sequence ratio ``r = exp(sequence_log_ratio)`` given to each of the sequence's tokens
    (``ratio_level="sequence"``). ``pg="cispo"`` (MiniMax-M1): per token
    ``-sg(min(r, 1 + eps_high)) * A * logp``: the IS weight is clipped, not the update, so no
    token's gradient is dropped.

    ``advantages`` is (B, T) or (B,) (one per sequence, broadcast over tokens). ``eps_high``
    defaults to ``eps_low``. ``is_weights`` (B, T), e.g. :func:`truncated_is_weights`, multiply
    each token's loss (treated as constants). ``return_stats`` also returns a dict with
    ``clipfrac`` (fraction of masked tokens where the clip was active) and ``ratio_mean``.
    """
    if logp.shape != old_logp.shape:
        raise ValueError(f"policy_loss: logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ")
    if eps_high is None:
        eps_high = eps_low
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"policy_loss: eps_low/eps_high must be >= 0, not {eps_low}/{eps_high}")
    if ratio_level not in IS_LEVELS:
        raise ValueError(f"policy_loss: ratio_level must be one of {IS_LEVELS}, not {ratio_level!r}")
    if pg not in PG_FORMS:
        raise ValueError(f"policy_loss: pg must be one of {PG_FORMS}, not {pg!r}")
    adv = advantages
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.to(logp.dtype)
    log_ratio = logp - old_logp
    if ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logp, old_logp, mask).expand_as(logp)
    ratio = torch.exp(log_ratio)
    if pg == "cispo":
        weight = ratio.detach().clamp(max=1.0 + eps_high)
        per_tok = -adv * weight * logp
        clipped = ratio.detach() > 1.0 + eps_high
    else:
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_tok = torch.maximum(pg1, pg2)
        clipped = pg2 > pg1
    if is_weights is not None:
        per_tok = per_tok * is_weights.detach().to(per_tok.dtype)
    loss = agg_loss(per_tok, mask, agg, global_tokens, norm_length=norm_length)
    if not return_stats:
        return loss
    with torch.no_grad():
        m = _mask_like(mask, logp)
        stats = {"clipfrac": masked_mean(clipped.to(logp.dtype), m),
                 "ratio_mean": masked_mean(ratio, m)}
    return loss, stats


def cispo_loss(logp, old_logp, advantages, mask=None, eps_high: float = 4.0, **kw):
    """:func:`policy_loss` with ``pg="cispo"`` (the IS weight capped at ``1 + eps_high``)."""
    return policy_loss(logp, old_logp, advantages, mask, eps_high=eps_high, pg="cispo", **kw)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """What a ``loss_type`` means: the advantage estimator (``"group"``: group mean baseline,
    ``"rloo"``: leave-one-out, ``"reinforce_pp"``: batch-whitened returns-to-go), the aggregation
    (:data:`AGGREGATIONS`), the importance ratio's level, the surrogate (:data:`PG_FORMS`), and the
    defaults it brings for ``scale_rewards`` and ``eps_high`` (None: ``eps_low``)."""

    advantage: str
    agg: str
    ratio_level: str = "token"
    pg: str = "clip"
    scale_rewards: str = "group"
    eps_high: Optional[float] = None


# TRL's names (GRPOConfig.loss_type, importance_sampling_level) and the papers' defaults
LOSS_SPECS = {
    "grpo": LossSpec("group", "seq-mean-token-mean"),
    "bnpo": LossSpec("group", "token-mean"),  # TRL's: GRPO's advantages, the batch's token mean
    # Dr. GRPO (Liu et al. 2025): no std scaling, token sums over a constant length
    "dr_grpo": LossSpec("group", "seq-mean-token-sum-norm", scale_rewards="none"),
    # DAPO (Yu et al. 2025): token-level aggregation, clip-higher 0.28 (overlong shaping is a reward)
    "dapo": LossSpec("group", "token-mean", eps_high=0.28),
    # GSPO (Zheng et al. 2025): the length-normalized sequence ratio, clipped per sequence
    "gspo": LossSpec("group", "seq-mean-token-mean", ratio_level="sequence"),
    "rloo": LossSpec("rloo", "token-mean", scale_rewards="none"),
    "reinforce_pp": LossSpec("reinforce_pp", "token-mean", scale_rewards="none"),
    # CISPO (MiniMax-M1): clipped IS weights, token-level aggregation; TRL's cap of 5
    "cispo": LossSpec("group", "token-mean", pg="cispo", eps_high=4.0),
}
LOSS_TYPES = tuple(LOSS_SPECS)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: Optional[torch.Tensor] = None, clip: Optional[float] = 0.2, agg: str = "token-mean",
               global_tokens=None) -> torch.Tensor:
    """Clipped value loss: ``0.5 * max((v - R)^2, (old_v + clip(v - old_v, -clip, clip) - R)^2)``
    per token, aggregated by :func:`agg_loss`; ``clip=None`` is the plain ``0.5 * (v - R)^2``."""
    if values.shape != returns.shape or old_values.shape != returns.shape:
        raise ValueError(f"value_loss: values {tuple(values.shape)}, old_values {tuple(old_values.shape)} and "
                         f"returns {tuple(returns.shape)} must match")
    vf1 = (values - returns) ** 2
    if clip is None:
        per_tok = vf1
    else:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        per_tok = torch.maximum(vf1, (clipped - returns) ** 2)
    return 0.5 * agg_loss(per_tok, mask, agg, global_tokens)


IS_LEVELS = ("token", "sequence")


def truncated_is_weights(behaviour_logp: torch.Tensor, old_logp: torch.Tensor, cap: float = 2.0,
                         mask: Optional[torch.Tensor] = None, level: str = "token") -> torch.Tensor:
    """Truncated importance weights (no grad), verl's ``rollout_is``: per token
    ``min(exp(old_logp - behaviour_logp), cap)``, or per sequence (``level="sequence"``)
    ``min(exp(sum over the sequence's tokens of (old_logp - behaviour_logp)), cap)`` given to each of
    its tokens.

    ``behaviour_logp``: log-probs of the policy that sampled (the rollout's, possibly an older
    ``policy_version`` or another engine's numerics: a quantized rollout); ``old_logp``: the
    learner's recompute. Zero outside ``mask`` when given.
    """
    w, _ = _is_ratios(behaviour_logp, old_logp, cap, mask, level, "truncated_is_weights")
    return w.clamp(max=cap) if mask is None else w.clamp(max=cap) * _mask_like(mask, w)


def _is_ratios(behaviour_logp, old_logp, cap, mask, level, who):
    """(per-token ratios, per-unit ratios: tokens (B, T) or sequences (B,)), untruncated."""
    if behaviour_logp.shape != old_logp.shape:
        raise ValueError(f"{who}: shapes {tuple(behaviour_logp.shape)} and {tuple(old_logp.shape)} differ")
    if not cap > 0:
        raise ValueError(f"{who}: cap must be > 0, not {cap}")
    if level not in IS_LEVELS:
        raise ValueError(f"{who}: level must be one of {IS_LEVELS}, not {level!r}")
    with torch.no_grad():
        log_r = old_logp.detach() - behaviour_logp.detach()
        if mask is not None:
            log_r = log_r * _mask_like(mask, log_r)
        if level == "token":
            r = torch.exp(log_r)
            return r, r
        seq = torch.exp(log_r.sum(-1))
        return seq[:, None].expand_as(log_r), seq


def rollout_mismatch_stats(behaviour_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                           cap: float = 2.0, level: str = "token") -> torch.Tensor:
    """``[is_ratio_mean, is_clipped_frac, rollout_kl]`` as one device tensor (no grad): the mean
    untruncated importance ratio and the fraction above ``cap`` over response tokens (``level="token"``)
    or sequences, and the k3 estimate of KL(rollout policy || learner policy) per response token,
    from the rollout's samples."""
    _, units = _is_ratios(behaviour_logp, old_logp, cap, mask, level, "rollout_mismatch_stats")
    with torch.no_grad():
        m = _mask_like(mask, old_logp)
        if level == "sequence":
            m = (m.sum(-1) > 0).to(units.dtype)  # sequences with at least one response token
        ratio_mean = masked_mean(units, m)
        clipped = masked_mean((units > cap).to(units.dtype), m)
        tok = _mask_like(mask, old_logp)
        kl = masked_mean(kl_estimate(behaviour_logp.detach(), old_logp.detach(), "k3"), tok)
        return torch.stack([ratio_mean, clipped, kl]).float()
