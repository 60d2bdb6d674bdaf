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
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "AGGREGATIONS",
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

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


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


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                    normalize_std: bool = True) -> torch.Tensor:
    """Group-normalized advantages (N,) for rewards (N,) in consecutive groups of ``group_size``.

    ``(r - mean_group) / (std_group + eps)`` with the unbiased (n - 1) standard deviation (as
    verl and the GRPO paper's implementation); ``normalize_std=False`` gives Dr. GRPO's
    ``r - mean_group``. A group whose rewards are all equal gets advantage 0.
    """
    r = torch.as_tensor(rewards)
    if r.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be 1-D (one per response), not {tuple(r.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"grpo_advantages: group_size must be a positive int, not {group_size!r}")
    if r.shape[0] % group_size:
        raise ValueError(f"grpo_advantages: {r.shape[0]} rewards are not whole groups of {group_size}")
    if normalize_std and group_size < 2:
        raise ValueError("grpo_advantages: std normalization needs group_size >= 2")
    r = r.float() if not r.is_floating_point() else r
    g = r.reshape(-1, group_size)
    centered = g - g.mean(1, keepdim=True)
    if normalize_std:
        centered = centered / (g.std(1, keepdim=True) + eps)
    return centered.reshape(-1)


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
             global_tokens=None, global_seqs=None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    ``token-mean``: sum over masked tokens / ``global_tokens`` (default: this batch's masked
    tokens). ``seq-mean-token-sum``: per-sequence token sums, averaged over sequences.
    ``seq-mean-token-mean``: per-sequence token means, averaged over sequences. The sequence
    means divide by ``global_seqs`` when given (default: this batch's rows).
    """
    m = _mask_like(mask, loss)
    if agg == "token-mean":
        denom = m.sum().clamp(min=1.0) if global_tokens is None else global_tokens
        return (loss * m).sum() / denom
    if agg == "seq-mean-token-sum":
        per_seq = (loss * m).sum(-1)
    elif agg == "seq-mean-token-mean":
        per_seq = (loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    else:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, not {agg!r}")
    nseq = loss.shape[0] if global_seqs is None else global_seqs
    return per_seq.sum() / nseq


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: Optional[torch.Tensor] = None, eps_low: float = 0.2, eps_high: Optional[float] = None,
                agg: str = "token-mean", global_tokens=None, is_weights: Optional[torch.Tensor] = None,
                return_stats: bool = False):
    """PPO clipped surrogate: per token ``max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))``
    with ``r = exp(logp - old_logp)``, aggregated by :func:`agg_loss`.

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
    adv = advantages
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_tok = torch.maximum(pg1, pg2)
    if is_weights is not None:
        per_tok = per_tok * is_weights.detach().to(per_tok.dtype)
    loss = agg_loss(per_tok, mask, agg, global_tokens)
    if not return_stats:
        return loss
    with torch.no_grad():
        m = _mask_like(mask, logp)
        stats = {"clipfrac": masked_mean((pg2 > pg1).to(logp.dtype), m),
                 "ratio_mean": masked_mean(ratio, m)}
    return loss, stats


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
