"""The learner: GRPO or PPO updates of a causal-LM policy from rollout batches.

``Learner.train_step(batch, rewards)`` does one policy update (one new
``policy_version``) from a :class:`~torchtpu_rl.rollout.RolloutBatch` and one
scalar reward per sequence:

1. prompt + response are laid out as one (rows, length) batch, the length padded
   to a bucket and the rows to whole micro-batches (``torchtpu.bucketing``), so
   the device sees a few shapes only;
2. without gradients: the current policy's log-probs (``old_logp``), the
   reference policy's (KL), the critic's values (PPO);
3. advantages: GRPO group-normalized rewards, or PPO GAE over token rewards
   (score on the last token, minus ``kl_coef * k1`` per token), whitened;
4. ``ppo_epochs`` passes over shuffled mini-batches; each mini-batch is one
   optimizer step, its micro-batches accumulate gradients of a token-mean loss
   normalized by the mini-batch's token count (the global-batch token mean);
5. truncated importance sampling (``tis_cap``) reweights tokens whose behaviour
   log-prob (the rollout's) differs from ``old_logp``: rollouts of an older
   policy version, or another engine's numerics.

Rows of a GRPO batch come in consecutive groups of ``group_size`` responses to
the same prompt.
"""

from __future__ import annotations

import random
import time
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from torchtpu import bucketing
from torchtpu.bucketing import BucketPolicy

from . import algorithms as A
from .policy import ValueModel, clone_policy, sequence_logprobs
from .rollout import RolloutBatch

__all__ = ["Learner"]


def _to_cpu(obj):
    """A copy of a (nested) state with every tensor on the host."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _policy_micro_loss(policy, ids, am, rm, old, adv, w, ref, gtok, scale, temp, eps_low, eps_high, agg, kl_kind,
                       kl_coef, kl_in_loss, entropy_coef):
    """Loss of one micro-batch (forward included) and its detached parts; compiled as one program."""
    gt = gtok if agg == "token-mean" else None
    logp, ent = sequence_logprobs(policy, ids, am, rm, temp, return_entropy=True)
    pg, st = A.policy_loss(logp, old, adv, rm, eps_low, eps_high, agg, gt, is_weights=w, return_stats=True)
    loss = pg * scale
    parts = {"pg_loss": pg.detach() * scale, "clipfrac": st["clipfrac"], "ratio_mean": st["ratio_mean"]}
    if ref is not None:
        kl = A.agg_loss(A.kl_estimate(logp, ref, kl_kind), rm, agg, gt) * scale
        if kl_in_loss:
            loss = loss + kl_coef * kl
        parts["kl"] = kl.detach()
    ent_agg = A.agg_loss(ent, rm, agg, gt) * scale
    if entropy_coef:
        loss = loss - entropy_coef * ent_agg
    parts["entropy"] = ent_agg.detach()
    parts["loss"] = loss.detach()
    return loss, parts


def _value_micro_loss(critic, ids, am, rm, old_values, returns, gtok, scale, clip, agg):
    gt = gtok if agg == "token-mean" else None
    v = torch.roll(critic(ids, am), 1, 1) * rm  # token j's state value is read at position j - 1
    return A.value_loss(v, old_values, returns, rm, clip, agg, gt) * scale


class Learner:
    """GRPO (``algo="grpo"``) or PPO (``algo="ppo"``) learner for ``policy`` on ``device``.

    Optimizer: AdamW(``lr``, ``betas``, ``weight_decay``), gradient clipping at ``grad_clip``
    (None: off). KL to ``ref_policy`` (default: a frozen copy of the initial policy, made when
    ``kl_coef > 0``) is a loss term for GRPO (``kl_kind="k3"``) and a per-token reward penalty for
    PPO (``kl_kind="k1"``) unless ``kl_in_reward`` says otherwise. ``eps_low``/``eps_high``: the
    clip range. ``loss_agg``: see :func:`torchtpu_rl.algorithms.agg_loss`. ``tis_cap``: truncated
    IS cap (None: off). PPO: ``critic`` (default: a :class:`ValueModel` whose trunk is a copy of
    the policy), ``critic_lr``, ``value_clip``, ``gamma``, ``lam``, ``whiten_advantages``.
    ``temperature``: the sampling temperature the rollouts used (log-probs are scored with it;
    default: the batch's). ``compile``: run each micro-batch's forward + loss (and its backward)
    as ``torch.compile(backend="tpu")`` programs (default: on for tpu).
    """

    def __init__(self, policy: nn.Module, ref_policy: Optional[nn.Module] = None, algo: str = "grpo", *,
                 group_size: Optional[int] = None, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 adam_eps: float = 1e-8, grad_clip: Optional[float] = 1.0, kl_coef: float = 0.0,
                 kl_kind: Optional[str] = None, kl_in_reward: Optional[bool] = None, eps_low: float = 0.2,
                 eps_high: Optional[float] = None, loss_agg: str = "token-mean", ppo_epochs: int = 1,
                 mini_batch_size: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 tis_cap: Optional[float] = None, entropy_coef: float = 0.0, critic: Optional[nn.Module] = None,
                 critic_lr: Optional[float] = None, value_clip: Optional[float] = 0.2, gamma: float = 1.0,
                 lam: float = 0.95, whiten_advantages: Optional[bool] = None, grpo_eps: float = 1e-6,
                 grpo_normalize_std: bool = True, temperature: Optional[float] = None, device="tpu",
                 length_buckets: Optional[BucketPolicy] = None, compile: Optional[bool] = None, seed: int = 0):
        if algo not in ("grpo", "ppo"):
            raise ValueError(f"Learner: algo must be 'grpo' or 'ppo', not {algo!r}")
        if loss_agg not in A.AGGREGATIONS:
            raise ValueError(f"Learner: loss_agg must be one of {A.AGGREGATIONS}, not {loss_agg!r}")
        if algo == "grpo" and (group_size is None or group_size < 2):
            raise ValueError(f"Learner: GRPO needs group_size >= 2 (responses per prompt), not {group_size!r}")
        if ppo_epochs < 1:
            raise ValueError(f"Learner: ppo_epochs must be >= 1, not {ppo_epochs}")
        for n, v in (("mini_batch_size", mini_batch_size), ("micro_batch_size", micro_batch_size)):
            if v is not None and v < 1:
                raise ValueError(f"Learner: {n} must be >= 1, not {v}")
        if kl_coef < 0:
            raise ValueError(f"Learner: kl_coef must be >= 0, not {kl_coef}")
        self.device = torch.device(device)
        self.algo = algo
        self.group_size = group_size
        self.policy = policy.to(self.device).train()
        self.kl_coef = float(kl_coef)
        self.kl_in_reward = (algo == "ppo") if kl_in_reward is None else bool(kl_in_reward)
        self.kl_kind = kl_kind or ("k1" if self.kl_in_reward else "k3")
        if ref_policy is None and self.kl_coef > 0:
            ref_policy = clone_policy(self.policy, device=self.device, requires_grad=False)
        self.ref_policy = ref_policy.to(self.device).eval() if ref_policy is not None else None
        if self.ref_policy is not None:
            for p in self.ref_policy.parameters():
                p.requires_grad_(False)
        self.eps_low, self.eps_high = float(eps_low), float(eps_low if eps_high is None else eps_high)
        self.loss_agg = loss_agg
        self.ppo_epochs = int(ppo_epochs)
        self.mini_batch_size = mini_batch_size
        self.micro_batch_size = micro_batch_size
        self.tis_cap = tis_cap
        self.entropy_coef = float(entropy_coef)
        self.grad_clip = grad_clip
        self.gamma, self.lam = float(gamma), float(lam)
        self.whiten_advantages = (algo == "ppo") if whiten_advantages is None else bool(whiten_advantages)
        self.grpo_eps, self.grpo_normalize_std = grpo_eps, grpo_normalize_std
        self.value_clip = value_clip
        self.temperature = temperature
        cfg = getattr(policy, "config", None)
        top = getattr(cfg, "max_seq_len", None) or 4096
        self.length_buckets = length_buckets or BucketPolicy.pow2(8, max(8, top), name="learner_length")
        self.optimizer = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=lr,
                                           betas=tuple(betas), eps=adam_eps, weight_decay=weight_decay)
        self.critic = None
        self.critic_optimizer = None
        if algo == "ppo":
            self.critic = (critic if critic is not None else ValueModel.from_policy(self.policy)).to(self.device)
            self.critic.train()
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=critic_lr or lr,
                                                      betas=tuple(betas), eps=adam_eps, weight_decay=weight_decay)
        # one compiled program per micro-batch shape for forward + loss (+ its backward); default on tpu
        self.compile = (self.device.type == "tpu") if compile is None else bool(compile)
        self._compiled = None
        self._compiled_score = None
        self.policy_version = 0
        self._gen = torch.Generator().manual_seed(int(seed))  # mini-batch shuffling (host)
        self.last_metrics: dict = {}

    # ------------------------------------------------------------ layout
    def _layout(self, batch: RolloutBatch, rows_multiple: int):
        """Host tensors (rows padded to a multiple of ``rows_multiple``, length to a bucket):
        ids, attention mask, response mask, behaviour log-probs; all (rows, Lb) aligned with ids."""
        B = len(batch)
        P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        L = P + R
        Lb = self.length_buckets.bucket(L)
        Bp = -(-B // rows_multiple) * rows_multiple
        ids = torch.full((Bp, Lb), batch.pad_id, dtype=torch.int64)
        am = torch.zeros((Bp, Lb), dtype=torch.int64)
        rmask = torch.zeros((Bp, Lb), dtype=torch.float32)
        blogp = torch.zeros((Bp, Lb), dtype=torch.float32)
        ids[:B, :P] = batch.prompt_ids
        ids[:B, P:L] = batch.response_ids
        am[:B, :P] = batch.prompt_mask.long()
        am[:B, P:L] = batch.response_mask.long()
        rmask[:B, P:L] = batch.response_mask.float()
        blogp[:B, P:L] = batch.logprobs.float() * batch.response_mask.float()
        return ids, am, rmask, blogp, P

    # ------------------------------------------------------------ one update
    def train_step(self, batch: RolloutBatch, rewards) -> dict:
        """One policy update from ``batch`` and per-sequence ``rewards`` (B,); returns metrics and
        increments ``policy_version``."""
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"Learner.train_step: batch must be a RolloutBatch, not {type(batch).__name__}")
        t0 = time.perf_counter()
        batch = batch.to_cpu()
        B = len(batch)
        r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).cpu()
        if r.shape[0] != B:
            raise ValueError(f"Learner.train_step: {r.shape[0]} rewards for {B} sequences")
        bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"Learner.train_step: rewards {bad[:8]} are not finite (e.g. rewards[{bad[0]}] = "
                             f"{r[bad[0]].item()}); fix the reward function or filter those samples")
        if self.algo == "grpo" and B % self.group_size:
            raise ValueError(f"Learner.train_step: GRPO batch of {B} rows is not whole groups of {self.group_size}")
        temp = self.temperature if self.temperature is not None else batch.temperature
        temp = temp if temp and temp > 0 else 1.0
        mini = self.mini_batch_size or B
        micro = min(self.micro_batch_size or mini, mini)
        ids, am, rmask, blogp, P = self._layout(batch, micro)
        Bp, Lb = ids.shape
        dev = self.device
        ids_d, am_d, rmask_d, blogp_d = (t.to(dev) for t in (ids, am, rmask, blogp))

        with bucketing.bucket_scope(batch=micro, length=Lb):
            # ---- 2. no-grad passes over micro-batches
            old, ref, vals = [], [], []
            score = self._score_fn()
            with torch.no_grad():
                for s in range(0, Bp, micro):
                    sl = slice(s, s + micro)
                    old.append(score(self.policy, ids_d[sl], am_d[sl], rmask_d[sl], temp))
                    if self.ref_policy is not None and self.kl_coef > 0:
                        ref.append(score(self.ref_policy, ids_d[sl], am_d[sl], rmask_d[sl], temp))
                    if self.critic is not None:
                        vals.append(self._values(ids_d[sl], am_d[sl], rmask_d[sl]))
            old_logp = torch.cat(old) if len(old) > 1 else old[0]
            ref_logp = (torch.cat(ref) if len(ref) > 1 else ref[0]) if ref else None
            old_values = (torch.cat(vals) if len(vals) > 1 else vals[0]) if vals else None

            # ---- 3. advantages
            if self.algo == "grpo":
                adv_seq = A.grpo_advantages(r, self.group_size, self.grpo_eps, self.grpo_normalize_std)
                adv = torch.zeros(Bp, Lb)
                adv[:B] = adv_seq[:, None]
                adv = adv * rmask
                returns = None
            else:
                tok_r = torch.zeros(Bp, Lb)
                lens = batch.response_lengths
                for i in range(B):
                    n = int(lens[i])
                    if n:
                        tok_r[i, P + n - 1] = r[i]
                if self.kl_in_reward and ref_logp is not None:
                    kl_tok = A.kl_estimate(old_logp, ref_logp, self.kl_kind).cpu() * rmask
                    tok_r = tok_r - self.kl_coef * kl_tok
                adv, returns = A.gae(tok_r, old_values.cpu(), rmask, self.gamma, self.lam)
            if self.whiten_advantages:
                adv = A.masked_whiten(adv, rmask)
            adv_d = adv.to(dev)
            returns_d = returns.to(dev) if returns is not None else None

            # behaviour -> old importance weights (rollouts from an older version or another engine)
            isw = A.truncated_is_weights(blogp_d, old_logp, self.tis_cap, rmask_d) if self.tis_cap else None

            # ---- 4. updates
            stats = []
            n_opt = 0
            for _ in range(self.ppo_epochs):
                perm = torch.randperm(B, generator=self._gen)
                for ms in range(0, B, mini):
                    rows = perm[ms:ms + mini]
                    stats.append(self._update(rows, micro, ids_d, am_d, rmask_d, rmask, old_logp, ref_logp, adv_d,
                                              isw, old_values, returns_d, temp))
                    n_opt += 1
            # one host read for every metric of the step
            keys = list(stats[0].keys())
            vals_h = torch.stack([torch.stack([s[k].detach().float().reshape(()) for k in keys])
                                  for s in stats]).cpu()
        self.policy_version += 1
        dt = time.perf_counter() - t0
        ntok = int(rmask.sum())
        m = {k: float(vals_h[:, j].mean()) for j, k in enumerate(keys)}
        versions = batch.policy_version
        m.update({
            "reward_mean": float(r.mean()), "reward_std": float(r.std()) if B > 1 else 0.0,
            "response_length_mean": float(batch.response_lengths.float().mean()),
            "response_tokens": ntok, "optimizer_steps": n_opt, "step_seconds": dt,
            "tokens_per_s": ntok * self.ppo_epochs / dt if dt > 0 else float("nan"),
            "policy_version": self.policy_version,
            "staleness_max": int(self.policy_version - 1 - int(versions.min())) if B else 0,
        })
        self.last_metrics = m
        return m

    def _values(self, ids, am, rmask):
        # the value of token j's state is read at position j - 1 (as the logits that predict it)
        return torch.roll(self.critic(ids, am), 1, 1) * rmask

    def _update(self, rows, micro, ids_d, am_d, rmask_d, rmask_h, old_logp, ref_logp, adv_d, isw, old_values,
                returns_d, temp):
        """One optimizer step over ``rows`` (host indices), in micro-batches of ``micro`` rows."""
        n = rows.shape[0]
        rows_l = rows.tolist()
        # normalizers of the whole mini-batch, as device scalars (a python float would be baked into a
        # compiled program and recompile it every step)
        gtok = torch.tensor(max(float(rmask_h[rows].sum()), 1.0)).to(self.device)
        token_mean = self.loss_agg == "token-mean"
        scale = torch.tensor(1.0 if token_mean else micro / float(n)).to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        acc = {}
        chunks = [rows_l[s:s + micro] for s in range(0, n, micro)]
        pfn, vfn = self._micro_fns()
        for chunk in chunks:
            keep = torch.ones(micro)
            if len(chunk) < micro:
                # pad the micro-batch with a repeated row whose tokens weigh nothing: one shape only
                keep[len(chunk):] = 0.0
                chunk = chunk + [chunk[0]] * (micro - len(chunk))
            idx = torch.tensor(chunk, dtype=torch.int64).to(self.device)
            keep_d = keep.to(self.device)[:, None]
            ids, am = ids_d.index_select(0, idx), am_d.index_select(0, idx)
            rm = rmask_d.index_select(0, idx) * keep_d
            old = old_logp.index_select(0, idx)
            adv = adv_d.index_select(0, idx)
            w = isw.index_select(0, idx) if isw is not None else None
            ref = ref_logp.index_select(0, idx) if ref_logp is not None else None
            loss, parts = pfn(self.policy, ids, am, rm, old, adv, w, ref, gtok, scale, temp, self.eps_low,
                              self.eps_high, self.loss_agg, self.kl_kind, self.kl_coef,
                              not self.kl_in_reward, self.entropy_coef)
            loss.backward()
            if self.critic is not None:
                vl = vfn(self.critic, ids, am, rm, old_values.index_select(0, idx), returns_d.index_select(0, idx),
                         gtok, scale, self.value_clip, self.loss_agg)
                vl.backward()
                parts["value_loss"] = vl.detach()
            for k, v in parts.items():
                # token-mean pieces are already fractions of the mini-batch: they add up
                acc[k] = acc[k] + v if k in acc else v
        for k in ("clipfrac", "ratio_mean"):
            acc[k] = acc[k] / len(chunks)
        if self.grad_clip is not None:
            acc["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
            if self.critic is not None:
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.critic_optimizer is not None:
            self.critic_optimizer.step()
        return acc

    def _score_fn(self):
        if not self.compile:
            return sequence_logprobs
        if self._compiled_score is None:
            self._compiled_score = torch.compile(sequence_logprobs, backend="tpu", dynamic=False)
        return self._compiled_score

    def _micro_fns(self):
        if not self.compile:
            return _policy_micro_loss, _value_micro_loss
        if self._compiled is None:
            self._compiled = (torch.compile(_policy_micro_loss, backend="tpu", dynamic=False),
                              torch.compile(_value_micro_loss, backend="tpu", dynamic=False))
        return self._compiled

    # ------------------------------------------------------------ weights and checkpoints
    def policy_state_dict(self) -> dict:
        """The policy's weights on the host (what rollout workers load)."""
        return _to_cpu(self.policy.state_dict())

    def state_dict(self) -> dict:
        """Everything to continue exactly: model(s), optimizer(s), RNG states, policy version.
        (The driver adds its own data cursor.) All tensors on the host."""
        sd = {
            "algo": self.algo,
            "policy_version": self.policy_version,
            "policy": _to_cpu(self.policy.state_dict()),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "rng": {
                "torch": torch.get_rng_state(),
                "tpu": torch.tpu.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "learner": self._gen.get_state(),
            },
        }
        if self.ref_policy is not None:
            sd["ref_policy"] = _to_cpu(self.ref_policy.state_dict())
        if self.critic is not None:
            sd["critic"] = _to_cpu(self.critic.state_dict())
            sd["critic_optimizer"] = _to_cpu(self.critic_optimizer.state_dict())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("algo") != self.algo:
            raise ValueError(f"Learner.load_state_dict: checkpoint is for algo {sd.get('algo')!r}, "
                             f"this learner is {self.algo!r}")
        with torch.no_grad():
            self.policy.load_state_dict(sd["policy"])
            if self.ref_policy is not None and "ref_policy" in sd:
                self.ref_policy.load_state_dict(sd["ref_policy"])
            if self.critic is not None:
                if "critic" not in sd:
                    raise ValueError("Learner.load_state_dict: PPO checkpoint has no critic")
                self.critic.load_state_dict(sd["critic"])
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.critic_optimizer is not None:
            self.critic_optimizer.load_state_dict(sd["critic_optimizer"])
        rng = sd["rng"]
        torch.set_rng_state(rng["torch"])
        torch.tpu.set_rng_state(rng["tpu"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self._gen.set_state(rng["learner"])
        self.policy_version = int(sd["policy_version"])
