"""The learner: GRPO or PPO updates of a causal-LM policy from rollout batches.

``Learner.train_step(batch, rewards)`` does one policy update (one new
``policy_version``) from a :class:`~torchtpu_rl.rollout.RolloutBatch` and one
scalar reward per sequence:

1. prompt + response are laid out as one (rows, length) batch, the length padded
   to a bucket (``torchtpu.bucketing``); micro-batches are either
   ``micro_batch_size`` rows at that length, or, with ``micro_batch_tokens``, rows
   sorted by length and packed under a token budget, each micro-batch cut to its
   own length bucket and padded to a power-of-two row count (shorter sequences,
   more rows: verl's dynamic batch size), so the device sees a few shapes only;
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

At real sizes: ``param_dtype="bfloat16"`` runs forward and backward in bfloat16
while AdamW updates float32 master weights (copied back to the model after each
step: updates smaller than bfloat16's resolution are not lost);
``gradient_checkpointing`` recomputes each layer's activations in the backward
(Hugging Face models' ``gradient_checkpointing_enable``); ``grad_clip`` clips the
global gradient norm. Metrics: ``learner_tokens_per_s`` (prompt + response tokens
trained on per second, each epoch counted) and ``rollout_logprob_diff_max`` /
``_mean`` (|rollout log-prob - this step's recompute| over response tokens: how far
the rollout engine's numerics, or a stale policy version, are from the learner's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

import torch.nn.functional as F

from torchtpu import bucketing
from torchtpu.bucketing import BucketPolicy

from . import algorithms as A
from .packing import pack_rows, packed_logprobs, pow2_rows
from .policy import ValueModel, clone_policy, sequence_logprobs
from .protocol import RolloutBatch

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


_PARAM_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _param_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _PARAM_DTYPES:
        return _PARAM_DTYPES[dtype.lower()]
    raise ValueError(f"Learner: param_dtype must be 'float32' or 'bfloat16' (or the torch dtype), not {dtype!r}")


def _enable_gradient_checkpointing(model: nn.Module, what: str) -> None:
    target = model.backbone if isinstance(model, ValueModel) else model
    # transformers 5 names it activation checkpointing (gradient_checkpointing_enable is its deprecated alias)
    enable = getattr(target, "activation_checkpointing_enable", None)
    if callable(enable):
        kw = {"activation_checkpointing_kwargs": {"use_reentrant": False}}
    else:
        enable = getattr(target, "gradient_checkpointing_enable", None)
        kw = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if not callable(enable):
        raise ValueError(f"Learner: gradient_checkpointing=True needs a model with gradient_checkpointing_enable() "
                         f"(a Hugging Face PreTrainedModel); the {what} is a {type(target).__name__}")
    # non-reentrant: the form torch.compile traces (the recompute becomes part of the backward program)
    enable(**kw)


# ------------------------------------------------------------ sharded learner (FSDP2)
def _check_fsdp(algo: str, device: torch.device) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("Learner(fsdp=True): torch.distributed is not initialized; each learner process "
                           "must join the process group first (torchtpu_rl starts them through TPUHostGroup)")
    if algo != "grpo":
        # PPO's critic, GAE and advantage whitening need statistics over every rank's rows: not built yet
        raise ValueError(f"Learner(fsdp=True): a sharded learner runs GRPO only, not {algo!r}")
    if device.type != "tpu":
        raise ValueError(f"Learner(fsdp=True): a sharded learner runs on tpu, not {device}")


def _blocks(model: nn.Module) -> list:
    """The repeated blocks FSDP2 shards one by one: a Hugging Face model's ``_no_split_modules``
    (its decoder layer class), else the members of every ``nn.ModuleList`` (TinyTransformer's blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def shard_policy(model: nn.Module, param_dtype: torch.dtype) -> int:
    """``fully_shard`` each block of ``model`` and its root over the default process group (bf16
    ``param_dtype``: bf16 compute, f32 gradient reduction, f32 sharded parameters for the optimizer).
    Gradients are summed across ranks, not averaged: every rank normalizes its loss by the whole
    batch's token count, so the sum is the single learner's gradient. Returns the world size."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kw = {}
    if param_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # SUM, then a division by 1: no PREMUL_SUM needed
    return dist.get_world_size()


def _all_reduce_host(values, op: str = "sum") -> torch.Tensor:
    """A float64 host vector reduced over the learner's ranks (gloo: a few numbers)."""
    import torch.distributed as dist

    t = torch.as_tensor(values, dtype=torch.float64).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def _full(t):
    """A DTensor's full value (a sharded learner's grad norm); other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _AdamW:
    """AdamW over a model's trainable parameters; for low-precision parameters, over float32
    master copies: the gradient is read into the master, clipped and applied there, and the
    result cast back into the model (mixed precision as verl/FSDP keep it)."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        self.params = [p for p in params if p.requires_grad]
        self.master = None
        if any(p.dtype != torch.float32 for p in self.params):
            self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master or self.params, lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, grad_clip):
        """Clip (when ``grad_clip``) and apply; returns the gradient norm before clipping, or None."""
        if self.master is not None:
            for p, m in zip(self.params, self.master):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        trained = self.master or self.params
        norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip) if grad_clip is not None else None
        self.optimizer.step()
        if self.master is not None:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        return norm

    def state_dict(self) -> dict:
        sd = {"optimizer": _to_cpu(self.optimizer.state_dict())}
        if self.master is not None:
            sd["master"] = [_to_cpu(m) for m in self.master]
        return sd

    def load_state_dict(self, sd: dict, what: str) -> None:
        if (self.master is None) != ("master" not in sd):
            raise ValueError(f"Learner.load_state_dict: the {what} checkpoint was saved with "
                             f"{'float32' if 'master' not in sd else 'low-precision'} parameters, this learner has "
                             f"{'float32' if self.master is None else 'low-precision'} ones (param_dtype)")
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.master is not None:
            with torch.no_grad():
                for m, v in zip(self.master, sd["master"]):
                    m.copy_(v)


@dataclasses.dataclass
class _Step:
    """What the stages of one ``Learner.train_step`` hand each other (host tensors, and ``*_d`` on device)."""

    batch: RolloutBatch
    B: int
    r: torch.Tensor
    temp: float
    mini: int
    ids: Optional[torch.Tensor] = None
    am: Optional[torch.Tensor] = None
    rmask: Optional[torch.Tensor] = None
    lengths: Optional[list] = None
    Lb: int = 0
    ids_d: Optional[torch.Tensor] = None
    am_d: Optional[torch.Tensor] = None
    rmask_d: Optional[torch.Tensor] = None
    blogp_d: Optional[torch.Tensor] = None
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    old_values: Optional[torch.Tensor] = None
    adv_d: Optional[torch.Tensor] = None
    returns_d: Optional[torch.Tensor] = None
    isw: Optional[torch.Tensor] = None


def _host_metrics(stats: list, agreement: dict) -> dict:
    """Every metric of a step in one host read: ``{(name, optimizer step): value}`` for the update pieces,
    ``{(name, None): value}`` for the agreement."""
    named = {(k, i): v for i, s in enumerate(stats) for k, v in s.items()}
    named.update({(k, None): v for k, v in agreement.items()})
    host = torch.stack([v.detach().float().reshape(()) for v in named.values()]).cpu()
    return dict(zip(named, host.tolist()))


# metrics combined across a sharded learner's ranks other than by summing (_metrics_across_ranks)
AGREEMENT_MEANS = ("rollout_logprob_diff_mean", "is_ratio_mean", "is_clipped_frac", "rollout_kl")
RANK_MEANS = ("clipfrac", "ratio_mean", "grad_norm")


def _policy_micro_loss(policy, ids, am, rm, old, adv, w, ref, gtok, scale, temp, eps_low, eps_high, agg, kl_kind,
                       kl_coef, kl_in_loss, entropy_coef, ratio_level="token", pg_form="clip", norm_length=None,
                       pack=None):
    """Loss of one micro-batch (forward included) and its detached parts; compiled as one program.
    ``pack``: the micro-batch's sequences packed into rows (:mod:`torchtpu_rl.packing`); the log-probs
    come back in the padded layout, so the loss is the padded one's."""
    gt = gtok if agg == "token-mean" else None
    if pack is not None:
        logp, ent = packed_logprobs(policy, pack, rm, temp, return_entropy=True)
    else:
        logp, ent = sequence_logprobs(policy, ids, am, rm, temp, return_entropy=True)
    pg, st = A.policy_loss(logp, old, adv, rm, eps_low, eps_high, agg, gt, is_weights=w, return_stats=True,
                           ratio_level=ratio_level, pg=pg_form, norm_length=norm_length)
    loss = pg * scale
    parts = {"pg_loss": pg.detach() * scale, "clipfrac": st["clipfrac"], "ratio_mean": st["ratio_mean"]}
    if ref is not None:
        kl = A.agg_loss(A.kl_estimate(logp, ref, kl_kind), rm, agg, gt, norm_length=norm_length) * scale
        if kl_in_loss:
            loss = loss + kl_coef * kl
        parts["kl"] = kl.detach()
    ent_agg = A.agg_loss(ent, rm, agg, gt, norm_length=norm_length) * scale
    if entropy_coef:
        loss = loss - entropy_coef * ent_agg
    parts["entropy"] = ent_agg.detach()
    parts["loss"] = loss.detach()
    return loss, parts


def _value_micro_loss(critic, ids, am, rm, old_values, returns, gtok, scale, clip, agg):
    gt = gtok if agg == "token-mean" else None
    v = torch.roll(critic(ids, am), 1, 1) * rm  # token j's state value is read at position j - 1
    return A.value_loss(v, old_values, returns, rm, clip, agg, gt) * scale


def _loss_spec(algo, loss_type, loss_agg, scale_rewards, grpo_normalize_std) -> A.LossSpec:
    """The learner's :class:`~torchtpu_rl.algorithms.LossSpec`: ``loss_type``'s (its aggregation replaced
    by ``loss_agg`` and its reward scaling by ``scale_rewards`` when given), or without one GRPO / PPO
    with ``loss_agg`` (default token-mean)."""
    if scale_rewards is not None and scale_rewards not in A.SCALE_REWARDS:
        raise ValueError(f"Learner: scale_rewards must be one of {A.SCALE_REWARDS}, not {scale_rewards!r}")
    if loss_type is None:
        scale = scale_rewards or ("group" if grpo_normalize_std else "none")
        return A.LossSpec("group" if algo == "grpo" else "gae", loss_agg or "token-mean", scale_rewards=scale)
    if loss_type not in A.LOSS_SPECS:
        raise ValueError(f"Learner: loss_type must be one of {A.LOSS_TYPES}, not {loss_type!r}")
    if algo != "grpo":
        raise ValueError(f"Learner: loss_type {loss_type!r} is a critic-free (group) loss: give algo='grpo', "
                         f"not {algo!r}")
    spec = A.LOSS_SPECS[loss_type]
    return dataclasses.replace(spec, agg=loss_agg or spec.agg, scale_rewards=scale_rewards or spec.scale_rewards)


class Learner:
    """GRPO (``algo="grpo"``) or PPO (``algo="ppo"``) learner for ``policy`` on ``device``.

    Optimizer: AdamW(``lr``, ``betas``, ``weight_decay``), gradient clipping at ``grad_clip``
    (None: off). KL to ``ref_policy`` (default: a frozen copy of the initial policy, made when
    ``kl_coef > 0``) is a loss term for GRPO (``kl_kind="k3"``) and a per-token reward penalty for
    PPO (``kl_kind="k1"``) unless ``kl_in_reward`` says otherwise. ``eps_low``/``eps_high``: the
    clip range. ``loss_agg``: see :func:`torchtpu_rl.algorithms.agg_loss`. ``tis_cap``: truncated
    IS cap (None: off; verl's ``rollout_is_threshold``, 2.0 with quantized rollouts), ``tis_level``
    ``"token"`` or ``"sequence"`` (verl's ``rollout_is``). Every step logs ``is_ratio_mean``,
    ``is_clipped_frac`` (above the cap, 2.0 when off) and ``rollout_kl`` (k3 estimate of
    KL(rollout || learner) per response token). PPO: ``critic`` (default: a :class:`ValueModel` whose trunk is a copy of
    the policy), ``critic_lr``, ``value_clip``, ``gamma``, ``lam``, ``whiten_advantages``.
    ``temperature``: the sampling temperature the rollouts used (log-probs are scored with it;
    default: the batch's). ``compile``: run each micro-batch's forward + loss (and its backward)
    as ``torch.compile(backend="tpu")`` programs (default: on for tpu).

    The loss family: ``loss_type`` (TRL's names, :data:`torchtpu_rl.algorithms.LOSS_SPECS`: grpo, bnpo,
    dr_grpo, dapo, gspo, rloo, reinforce_pp, cispo; GRPO only) sets the advantage estimator, the
    aggregation (``loss_agg`` overrides it), the ratio level and the surrogate, and its defaults for
    ``eps_high`` and ``scale_rewards`` ("group" / "batch" / "none"); ``norm_length``: Dr. GRPO's constant
    divisor (the longest response allowed; default: the batch's response width). Without ``loss_type``:
    GRPO or PPO with ``loss_agg`` (token-mean) and ``grpo_normalize_std``.
    ``pack_sequences``: each micro-batch's sequences packed end to end into rows
    (:mod:`torchtpu_rl.packing`; GRPO, single learner), the same loss and gradients as padded rows.

    Scale: ``micro_batch_tokens`` packs micro-batches by a token budget (rows x padded length;
    at least one row each; ``micro_batch_size`` then caps the rows); ``gradient_checkpointing``
    (Hugging Face models); ``param_dtype`` "float32" or "bfloat16" for the policy, reference
    and critic (float32 master weights in the optimizer). See the module doc for the metrics.
    """

    def __init__(self, policy: nn.Module, ref_policy: Optional[nn.Module] = None, algo: str = "grpo", *,
                 group_size: Optional[int] = None, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 adam_eps: float = 1e-8, grad_clip: Optional[float] = 1.0, kl_coef: float = 0.0,
                 kl_kind: Optional[str] = None, kl_in_reward: Optional[bool] = None, eps_low: float = 0.2,
                 eps_high: Optional[float] = None, loss_agg: Optional[str] = None, ppo_epochs: int = 1,
                 mini_batch_size: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 tis_cap: Optional[float] = None, entropy_coef: float = 0.0, critic: Optional[nn.Module] = None,
                 critic_lr: Optional[float] = None, value_clip: Optional[float] = 0.2, gamma: float = 1.0,
                 lam: float = 0.95, whiten_advantages: Optional[bool] = None, grpo_eps: float = 1e-6,
                 grpo_normalize_std: bool = True, temperature: Optional[float] = None, device="tpu",
                 length_buckets: Optional[BucketPolicy] = None, compile: Optional[bool] = None, seed: int = 0,
                 micro_batch_tokens: Optional[int] = None, gradient_checkpointing: bool = False,
                 param_dtype="float32", tis_level: str = "token", fsdp: bool = False,
                 loss_type: Optional[str] = None, scale_rewards: Optional[str] = None,
                 norm_length: Optional[int] = None, pack_sequences: bool = False):
        if algo not in ("grpo", "ppo"):
            raise ValueError(f"Learner: algo must be 'grpo' or 'ppo', not {algo!r}")
        self.loss_spec = _loss_spec(algo, loss_type, loss_agg, scale_rewards, grpo_normalize_std)
        loss_agg = self.loss_spec.agg
        if eps_high is None:
            eps_high = self.loss_spec.eps_high
        if kl_in_reward is None and self.loss_spec.advantage == "reinforce_pp":
            kl_in_reward = True  # REINFORCE++ puts the KL penalty in the per-token reward
        if norm_length is not None and (not isinstance(norm_length, int) or norm_length < 1):
            raise ValueError(f"Learner: norm_length must be an int >= 1 (the longest response), not {norm_length!r}")
        self.loss_type = loss_type
        self.norm_length = norm_length
        self.pack_sequences = bool(pack_sequences)
        if loss_agg not in A.AGGREGATIONS:
            raise ValueError(f"Learner: loss_agg must be one of {A.AGGREGATIONS}, not {loss_agg!r}")
        if algo == "grpo" and (group_size is None or group_size < 2):
            raise ValueError(f"Learner: GRPO needs group_size >= 2 (responses per prompt), not {group_size!r}")
        if ppo_epochs < 1:
            raise ValueError(f"Learner: ppo_epochs must be >= 1, not {ppo_epochs}")
        for n, v in (("mini_batch_size", mini_batch_size), ("micro_batch_size", micro_batch_size)):
            if v is not None and v < 1:
                raise ValueError(f"Learner: {n} must be >= 1, not {v}")
        if micro_batch_tokens is not None and (not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 1):
            raise ValueError(f"Learner: micro_batch_tokens must be an int >= 1, not {micro_batch_tokens!r}")
        if kl_coef < 0:
            raise ValueError(f"Learner: kl_coef must be >= 0, not {kl_coef}")
        self.device = torch.device(device)
        self.algo = algo
        self.group_size = group_size
        self.param_dtype = _param_dtype(param_dtype)
        self.fsdp = bool(fsdp)
        self.world_size = 1  # learner processes sharing each batch (fsdp)
        if self.fsdp:
            _check_fsdp(algo, self.device)
        # sharded (fsdp): float32 parameters; FSDP2's MixedPrecisionPolicy computes in param_dtype
        self.policy = policy.to(device=self.device, dtype=torch.float32 if self.fsdp else self.param_dtype).train()
        self.kl_coef = float(kl_coef)
        self.kl_in_reward = (algo == "ppo") if kl_in_reward is None else bool(kl_in_reward)
        self.kl_kind = kl_kind or ("k1" if self.kl_in_reward else "k3")
        if ref_policy is None and self.kl_coef > 0:
            ref_policy = clone_policy(self.policy, device=self.device, requires_grad=False)
        self.ref_policy = (ref_policy.to(device=self.device, dtype=self.param_dtype).eval()
                           if ref_policy is not None else None)
        if self.ref_policy is not None:
            for p in self.ref_policy.parameters():
                p.requires_grad_(False)
        if self.fsdp:  # after the reference policy was copied from the whole model
            self.world_size = shard_policy(self.policy, self.param_dtype)
        self.eps_low, self.eps_high = float(eps_low), float(eps_low if eps_high is None else eps_high)
        self.loss_agg = loss_agg
        self.ppo_epochs = int(ppo_epochs)
        self.mini_batch_size = mini_batch_size
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.gradient_checkpointing = bool(gradient_checkpointing)
        if tis_cap is not None and not tis_cap > 0:
            raise ValueError(f"Learner: tis_cap (the rollout importance-sampling threshold) must be > 0, not {tis_cap}")
        if tis_level not in A.IS_LEVELS:
            raise ValueError(f"Learner: tis_level must be one of {A.IS_LEVELS}, not {tis_level!r}")
        self.tis_cap = tis_cap
        self.tis_level = tis_level
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
        self._adam = _AdamW(self.policy.parameters(), lr, betas, adam_eps, weight_decay)
        self.optimizer = self._adam.optimizer
        self.critic = None
        self._critic_adam = None
        self.critic_optimizer = None
        if algo == "ppo":
            self.critic = (critic if critic is not None else ValueModel.from_policy(self.policy))
            self.critic = self.critic.to(device=self.device, dtype=self.param_dtype).train()
            self._critic_adam = _AdamW(self.critic.parameters(), critic_lr or lr, betas, adam_eps, weight_decay)
            self.critic_optimizer = self._critic_adam.optimizer
        if self.gradient_checkpointing:
            _enable_gradient_checkpointing(self.policy, "policy")
            if self.critic is not None:
                _enable_gradient_checkpointing(self.critic, "critic")
        if self.fsdp and mini_batch_size is not None and mini_batch_size % self.world_size:
            raise ValueError(f"Learner(fsdp=True): mini_batch_size {mini_batch_size} (rows of the whole batch) must "
                             f"be a multiple of the {self.world_size} learner processes")
        # one compiled program per micro-batch shape for forward + loss (+ its backward); default on tpu
        # (sharded too: Dynamo runs FSDP2's gather/reduce hooks between the compiled pieces)
        self.compile = (self.device.type == "tpu") if compile is None else bool(compile)
        self._compiled = None
        self._compiled_score = None
        self._compiled_packed_score = None
        self._host_rows = None
        if self.pack_sequences and (algo != "grpo" or self.fsdp):
            raise ValueError("Learner: pack_sequences packs the policy's forward of a single GRPO learner (not PPO's "
                             "critic, not fsdp)")
        self.policy_version = 0
        self._gen = torch.Generator().manual_seed(int(seed))  # mini-batch shuffling (host)
        self.last_metrics: dict = {}
        self._ref_digest: Optional[str] = None  # the frozen reference's digest, computed on first use
        self._norm_len = norm_length

    # ------------------------------------------------------------ layout
    def _layout(self, batch: RolloutBatch):
        """Host tensors (rows x a length bucket): ids, attention mask, response mask, behaviour
        log-probs, all aligned with ids; and each row's length (last real column + 1)."""
        B = len(batch)
        P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        L = P + R
        Lb = self.length_buckets.bucket(L)
        ids = torch.full((B, Lb), batch.pad_id, dtype=torch.int64)
        am = torch.zeros((B, Lb), dtype=torch.int64)
        rmask = torch.zeros((B, Lb), dtype=torch.float32)
        blogp = torch.zeros((B, Lb), dtype=torch.float32)
        ids[:, :P] = batch.prompt_ids
        ids[:, P:L] = batch.response_ids
        am[:, :P] = batch.prompt_mask.long()
        am[:, P:L] = batch.response_mask.long()
        # multi-turn episodes: only the assistant's tokens carry loss (loss_mask), all real ones attend
        loss = batch.loss_mask_or_response.float()
        rmask[:, P:L] = loss
        blogp[:, P:L] = batch.logprobs.float() * loss
        # prompts are left-padded to P and responses follow: a row needs columns [0, P + its length)
        lengths = (P + batch.response_mask.long().sum(1)).tolist()
        return ids, am, rmask, blogp, lengths

    def _plan(self, rows: list, lengths: list, Lb: int, mini: int) -> list:
        """Micro-batches of ``rows``: ``(rows, length, padded row count)`` each.

        Without a token budget: ``micro_batch_size`` rows (default: the mini-batch) at the full
        length ``Lb``. With ``micro_batch_tokens``: rows sorted by length, packed while
        rows x (the length bucket of the longest) fits the budget; a micro-batch's rows are
        padded to a power of two (at most what the budget allows at its length)."""
        if self.micro_batch_tokens is None:
            micro = min(self.micro_batch_size or mini, mini)
            return [(rows[s:s + micro], Lb, micro) for s in range(0, len(rows), micro)]
        budget = self.micro_batch_tokens
        cap = self.micro_batch_size or len(rows)
        plan, cur, cur_len = [], [], 0
        for r in sorted(rows, key=lambda r: lengths[r]):
            L = self.length_buckets.bucket(max(lengths[r], 1))
            if cur and ((len(cur) + 1) * L > budget or len(cur) == cap):
                plan.append((cur, cur_len))
                cur = []
            cur, cur_len = cur + [r], L
        plan.append((cur, cur_len))
        out = []
        for chunk, L in plan:
            most = max(len(chunk), min(budget // L, cap))  # what the budget (and micro_batch_size) allow
            out.append((chunk, L, min(1 << (len(chunk) - 1).bit_length(), most)))
        return out

    def _even(self, plan: list) -> list:
        """Sharded: every rank runs as many micro-batches as the rank with the most (FSDP2 gathers and
        reduces in every forward and backward), the extra ones empty (no rows: they weigh nothing)."""
        if not self.fsdp:
            return plan
        most = int(_all_reduce_host([len(plan)], "max")[0])
        return plan + [([], plan[-1][1], plan[-1][2])] * (most - len(plan))

    def _micro_inputs(self, chunk, L, R, tensors):
        """Rows ``chunk`` of each (rows, Lb) device tensor, cut to ``L`` columns, padded to ``R`` rows
        with copies of the first row (their tokens weigh nothing: ``keep`` is 0 there)."""
        keep = torch.ones(R)
        if len(chunk) < R:
            keep[len(chunk):] = 0.0
            chunk = chunk + [chunk[0] if chunk else 0] * (R - len(chunk))
        idx = torch.tensor(chunk, dtype=torch.int64).to(self.device)
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            t = t.index_select(0, idx)
            out.append(t[:, :L] if L < t.shape[1] else t)
        return keep.to(self.device)[:, None], out

    # ------------------------------------------------------------ one update
    def train_step(self, batch: RolloutBatch, rewards) -> dict:
        """One policy update from ``batch`` and per-sequence ``rewards`` (B,); returns metrics and
        increments ``policy_version``. The stages, each a method: :meth:`_inputs` (checks and the
        device layout), :meth:`_score` (no-grad log-probs of the policy and the reference, values),
        :meth:`_advantages`, :meth:`_agreement` (rollout vs learner log-probs), :meth:`_updates`
        (the optimizer steps) and :meth:`_report` (one host read, metrics by name)."""
        t0 = time.perf_counter()
        st = self._inputs(batch, rewards)
        with bucketing.bucket_scope(length=st.Lb, micro=self.micro_batch_tokens or min(self.micro_batch_size
                                                                                         or st.mini, st.mini)):
            self._score(st)
            self._advantages(st)
            agreement = self._agreement(st)
            stats = self._updates(st)
            vals = _host_metrics(stats, agreement)
        self.policy_version += 1
        return self._report(st, stats, agreement, vals, time.perf_counter() - t0)

    def _inputs(self, batch: RolloutBatch, rewards) -> "_Step":
        """Checks, then the batch as host tensors of one length bucket and their device copies."""
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"Learner.train_step: batch must be a RolloutBatch, not {type(batch).__name__}")
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
        st = _Step(batch=batch, B=B, r=r, temp=temp if temp and temp > 0 else 1.0,
                   # a sharded learner holds its slice of the batch: mini_batch_size counts rows of the whole batch
                   mini=self.mini_batch_size // self.world_size if self.mini_batch_size else B)
        st.ids, st.am, st.rmask, blogp, st.lengths = self._layout(batch)
        st.Lb = st.ids.shape[1]
        self._host_rows = (st.ids, st.am, batch.pad_id)  # what pack_sequences packs
        # Dr. GRPO's constant divisor: the longest response allowed (default: this batch's response width)
        self._norm_len = self.norm_length or int(batch.response_ids.shape[1])
        st.ids_d, st.am_d, st.rmask_d, st.blogp_d = (t.to(self.device) for t in (st.ids, st.am, st.rmask, blogp))
        return st

    def _score(self, st: "_Step") -> None:
        """No-grad passes over micro-batches, put back in row order: the policy's log-probs before the
        update (``old_logp``), the reference's (KL), the critic's values (PPO)."""
        plan = self._even(self._plan(list(range(st.B)), st.lengths, st.Lb, st.mini))
        old, ref, vals = [], [], []
        score = self._score_fn()
        with torch.no_grad():
            for chunk, L, R in plan:
                keep, (ids_m, am_m, rm_m) = self._micro_inputs(chunk, L, R, (st.ids_d, st.am_d, st.rmask_d))
                n, pad = len(chunk), st.Lb - L
                pack = self._pack(chunk, L, R)

                def logprobs(model):
                    if pack is not None:
                        return self._packed_score_fn()(model, pack, rm_m, st.temp)
                    return score(model, ids_m, am_m, rm_m, st.temp)

                old.append(F.pad(logprobs(self.policy)[:n], (0, pad)))
                if self.ref_policy is not None and self.kl_coef > 0:
                    ref.append(F.pad(logprobs(self.ref_policy)[:n], (0, pad)))
                if self.critic is not None:
                    vals.append(F.pad(self._values(ids_m, am_m, rm_m)[:n], (0, pad)))
        order = [r_ for chunk, _, _ in plan for r_ in chunk]
        inv = None if order == list(range(st.B)) else torch.tensor(order).argsort().to(self.device)

        def rows_back(parts):
            if not parts:
                return None
            t = torch.cat(parts) if len(parts) > 1 else parts[0]
            return t if inv is None else t.index_select(0, inv)

        st.old_logp, st.ref_logp, st.old_values = rows_back(old), rows_back(ref), rows_back(vals)

    def _advantages(self, st: "_Step") -> None:
        """Per-token advantages (GRPO: group-relative; PPO: GAE over the per-token rewards, KL in the
        reward when ``kl_in_reward``), whitened when asked; PPO's returns."""
        rmask, r = st.rmask, st.r
        spec = self.loss_spec
        returns = None
        if spec.advantage in ("group", "rloo"):
            adv = A.group_advantages(r, self.group_size, spec.scale_rewards, self.grpo_eps,
                                     "loo" if spec.advantage == "rloo" else "mean")[:, None] * rmask
        elif spec.advantage == "reinforce_pp":
            adv = A.reinforce_pp_advantages(self._token_rewards(st), rmask)
        else:
            adv, returns = A.gae(self._token_rewards(st), st.old_values.cpu(), rmask, self.gamma, self.lam)
        if self.whiten_advantages:
            adv = A.masked_whiten(adv, rmask)
        st.adv_d = adv.to(self.device)
        st.returns_d = returns.to(self.device) if returns is not None else None
        # behaviour -> old importance weights (rollouts from an older version or another engine)
        st.isw = (A.truncated_is_weights(st.blogp_d, st.old_logp, self.tis_cap, st.rmask_d, self.tis_level)
                  if self.tis_cap else None)

    def _token_rewards(self, st: "_Step") -> torch.Tensor:
        """(B, Lb) host rewards per token: the score on the last response token, minus ``kl_coef`` times
        the per-token KL when the KL is in the reward."""
        tok_r = torch.zeros(st.B, st.Lb)
        P = st.batch.prompt_ids.shape[1]
        for i in range(st.B):
            if st.lengths[i] > P:
                tok_r[i, st.lengths[i] - 1] = st.r[i]
        if self.kl_in_reward and st.ref_logp is not None:
            kl_tok = A.kl_estimate(st.old_logp, st.ref_logp, self.kl_kind).cpu() * st.rmask
            tok_r = tok_r - self.kl_coef * kl_tok
        return tok_r

    def _agreement(self, st: "_Step") -> dict:
        """How far the rollout's log-probs are from this recompute (engine numerics, staleness): device
        scalars by name."""
        diff = (st.blogp_d - st.old_logp).abs() * st.rmask_d
        mismatch = A.rollout_mismatch_stats(st.blogp_d, st.old_logp, st.rmask_d, self.tis_cap or 2.0,
                                            self.tis_level)
        return {"rollout_logprob_diff_max": diff.max(),
                "rollout_logprob_diff_mean": diff.sum() / st.rmask_d.sum().clamp(min=1.0),
                **dict(zip(AGREEMENT_MEANS[1:], mismatch.unbind()))}

    def _updates(self, st: "_Step") -> list:
        """``ppo_epochs`` passes over shuffled mini-batches, one optimizer step each; their pieces (device
        scalars by name), one dict per optimizer step."""
        stats = []
        for _ in range(self.ppo_epochs):
            perm = torch.randperm(st.B, generator=self._gen)
            for ms in range(0, st.B, st.mini):
                stats.append(self._update(perm[ms:ms + st.mini], st.lengths, st.Lb, st.mini, st.ids_d, st.am_d,
                                          st.rmask_d, st.rmask, st.old_logp, st.ref_logp, st.adv_d, st.isw,
                                          st.old_values, st.returns_d, st.temp))
        return stats

    def _report(self, st: "_Step", stats: list, agreement: dict, vals: dict, dt: float) -> dict:
        """The step's metrics: each optimizer-step piece averaged over the step, the agreement, the batch's."""
        r, B = st.r, st.B
        ntok = int(st.rmask.sum())
        real_tok = int(st.am.sum())
        versions, resp_len = st.batch.policy_version, st.batch.response_lengths
        if self.fsdp:  # the metrics of the whole batch, as one learner reports them
            vals = self._metrics_across_ranks(vals, ntok)
            r, versions, resp_len = (self._gather_rows(t) for t in (r, versions, resp_len))
            ntok, real_tok = (int(x) for x in _all_reduce_host([ntok, real_tok]))
            B = r.shape[0]
        m = {k: sum(vals[(k, i)] for i in range(len(stats))) / len(stats) for k in stats[0]}
        m.update({k: vals[(k, None)] for k in agreement})
        m.update({
            "reward_mean": float(r.mean()), "reward_std": float(r.std()) if B > 1 else 0.0,
            "response_length_mean": float(resp_len.float().mean()),
            "response_tokens": ntok, "optimizer_steps": len(stats), "step_seconds": dt,
            "tokens_per_s": ntok * self.ppo_epochs / dt if dt > 0 else float("nan"),
            "learner_tokens_per_s": real_tok * self.ppo_epochs / dt if dt > 0 else float("nan"),
            "policy_version": self.policy_version,
            "staleness_max": int(self.policy_version - 1 - int(versions.min())) if B else 0,
        })
        self.last_metrics = m
        return m

    def _metrics_across_ranks(self, vals: dict, ntok: int) -> dict:
        """Combine the ranks' metrics (``{(name, optimizer step or None): value}``), by name: the loss
        pieces are fractions of the whole mini-batch (they add up); clipfrac, ratio_mean and the grad
        norm (every rank computes the same) are averaged over ranks; the rollout-agreement means are
        weighted by the ranks' response tokens; the largest log-prob difference is the max."""
        W = self.world_size
        names = list(vals)
        v = torch.tensor([vals[n] * (ntok if n[0] in AGREEMENT_MEANS else 1.0) for n in names] + [float(ntok)],
                         dtype=torch.float64)
        total = _all_reduce_host(v)
        tokens = max(float(total[-1]), 1.0)
        biggest = float(_all_reduce_host([vals[("rollout_logprob_diff_max", None)]], "max")[0])
        out = {}
        for n, t in zip(names, total[:-1].tolist()):
            if n[0] == "rollout_logprob_diff_max":
                out[n] = biggest
            elif n[0] in AGREEMENT_MEANS:
                out[n] = t / tokens
            elif n[0] in RANK_MEANS:
                out[n] = t / W
            else:
                out[n] = t
        return out

    def _gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of a host tensor (the same row count on each), in rank order."""
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t.contiguous())
        return torch.cat(out)

    @property
    def generator(self) -> torch.Generator:
        """The host generator that shuffles mini-batches (part of a checkpoint)."""
        return self._gen

    def _values(self, ids, am, rmask):
        # the value of token j's state is read at position j - 1 (as the logits that predict it)
        return torch.roll(self.critic(ids, am), 1, 1) * rmask

    def _update(self, rows, lengths, Lb, mini, ids_d, am_d, rmask_d, rmask_h, old_logp, ref_logp, adv_d, isw,
                old_values, returns_d, temp):
        """One optimizer step over ``rows`` (host indices), in the micro-batches of :meth:`_plan`."""
        n = rows.shape[0]
        plan = self._even(self._plan(rows.tolist(), lengths, Lb, mini))
        # normalizers of the whole mini-batch, as device scalars (a python float would be baked into a
        # compiled program and recompile it every step); sharded: of every rank's rows together
        ntok = float(rmask_h[rows].sum())
        if self.fsdp:
            ntok, n = (float(x) for x in _all_reduce_host([ntok, n]))
        gtok = torch.tensor(max(ntok, 1.0)).to(self.device)
        token_mean = self.loss_agg == "token-mean"
        scales = {}
        self._adam.zero_grad()
        if self._critic_adam is not None:
            self._critic_adam.zero_grad()
        acc = {}
        norm_len = self._norm_len
        pfn, vfn = self._micro_fns()
        real = sum(1 for chunk, _, _ in plan if chunk)
        for chunk, L, R in plan:
            pack = self._pack(chunk, L, R)
            if R not in scales:  # sequence means: each micro-batch's mean over R rows x R / n
                scales[R] = torch.tensor(1.0 if token_mean else R / float(n)).to(self.device)
            keep, (ids, am, rm, old, adv, w, ref, ov, ret) = self._micro_inputs(
                chunk, L, R, (ids_d, am_d, rmask_d, old_logp, adv_d, isw, ref_logp, old_values, returns_d))
            rm = rm * keep
            loss, parts = pfn(self.policy, ids, am, rm, old, adv, w, ref, gtok, scales[R], temp, self.eps_low,
                              self.eps_high, self.loss_agg, self.kl_kind, self.kl_coef,
                              not self.kl_in_reward, self.entropy_coef, self.loss_spec.ratio_level,
                              self.loss_spec.pg, norm_len, pack)
            loss.backward()
            if self.critic is not None:
                vl = vfn(self.critic, ids, am, rm, ov, ret, gtok, scales[R], self.value_clip, self.loss_agg)
                vl.backward()
                parts["value_loss"] = vl.detach()
            if not chunk:  # an empty micro-batch of a sharded learner: its collectives ran, nothing to count
                continue
            for k, v in parts.items():
                # token-mean pieces are already fractions of the mini-batch: they add up
                acc[k] = acc[k] + v if k in acc else v
        for k in ("clipfrac", "ratio_mean"):
            acc[k] = acc[k] / real
        norm = self._adam.step(self.grad_clip)
        if norm is not None:
            acc["grad_norm"] = _full(norm)
        if self._critic_adam is not None:
            self._critic_adam.step(self.grad_clip)
        return acc

    def _pack(self, chunk, L, R):
        """The micro-batch's sequences packed into rows of ``L`` (``pack_sequences``; else None), its ``R``
        padded rows mapped onto them (filler rows read as padding)."""
        if not self.pack_sequences or not chunk:
            return None
        ids, am, pad_id = self._host_rows
        idx = torch.tensor(chunk + [chunk[0]] * (R - len(chunk)), dtype=torch.int64)
        return pack_rows(ids.index_select(0, idx)[:, :L], am.index_select(0, idx)[:, :L], L, pad_id,
                         rows_bucket=pow2_rows, n_real=len(chunk), device=self.device)

    def _packed_score_fn(self):
        if not self.compile:
            return packed_logprobs
        if self._compiled_packed_score is None:
            self._compiled_packed_score = torch.compile(packed_logprobs, backend="tpu", dynamic=False)
        return self._compiled_packed_score

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
        """The policy's weights on the host (what rollout workers load). Sharded: the whole weights,
        gathered (every rank must call it), on rank 0 only (others get ``{}``), in ``param_dtype``."""
        if not self.fsdp:
            return _to_cpu(self.policy.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.to(self.param_dtype) if v.is_floating_point() else v for k, v in full.items()}

    def state_dict(self, include_reference: bool = True) -> dict:
        """Everything to continue exactly: model(s), optimizer(s), RNG states, policy version.
        (The driver adds its own data cursor.) All tensors on the host. ``include_reference=False``: the
        frozen reference policy as its digest only (its weights are stored once elsewhere:
        :func:`torchtpu_rl.checkpoint.save_checkpoint` with ``reference_path``)."""
        sd = {
            "algo": self.algo,
            "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "policy_version": self.policy_version,
            "policy": _to_cpu(self.policy.state_dict()),
            "optimizer": self._adam.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "tpu": torch.tpu.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "learner": self._gen.get_state(),
            },
        }
        if self.ref_policy is not None:
            sd["ref_policy_digest"] = self.reference_digest()
            if include_reference:
                sd["ref_policy"] = _to_cpu(self.ref_policy.state_dict())
        if self.critic is not None:
            sd["critic"] = _to_cpu(self.critic.state_dict())
            sd["critic_optimizer"] = self._critic_adam.state_dict()
        return sd

    def reference_digest(self) -> Optional[str]:
        """sha256 of the frozen reference policy's weights (names, dtypes, shapes, bytes); computed once."""
        if self.ref_policy is None:
            return None
        if self._ref_digest is None:
            h = hashlib.sha256()
            for name, t in sorted(self.ref_policy.state_dict().items()):
                t = t.detach().cpu().contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._ref_digest = h.hexdigest()
        return self._ref_digest

    def load_reference(self, state: dict, digest: Optional[str] = None) -> None:
        """Install reference-policy weights (checked against ``digest`` when given)."""
        if self.ref_policy is None:
            return
        with torch.no_grad():
            self.ref_policy.load_state_dict(state)
        self._ref_digest = None
        if digest is not None and self.reference_digest() != digest:
            raise ValueError("Learner.load_reference: the reference weights do not match the checkpoint's digest")

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("algo") != self.algo:
            raise ValueError(f"Learner.load_state_dict: checkpoint is for algo {sd.get('algo')!r}, "
                             f"this learner is {self.algo!r}")
        mine = str(self.param_dtype).replace("torch.", "")
        if sd.get("param_dtype", "float32") != mine:
            raise ValueError(f"Learner.load_state_dict: checkpoint has param_dtype {sd.get('param_dtype')!r}, "
                             f"this learner {mine!r}")
        if (self.ref_policy is not None and "ref_policy" not in sd and sd.get("ref_policy_digest") is not None
                and sd["ref_policy_digest"] != self.reference_digest()):
            raise ValueError("Learner.load_state_dict: the checkpoint holds its reference policy's digest only, and "
                             "this learner's reference policy is another one; give the reference weights "
                             "(load_reference) or build the learner from the run's initial policy")
        with torch.no_grad():
            self.policy.load_state_dict(sd["policy"])
            if self.ref_policy is not None and "ref_policy" in sd:
                self.ref_policy.load_state_dict(sd["ref_policy"])
                self._ref_digest = None
            if self.critic is not None:
                if "critic" not in sd:
                    raise ValueError("Learner.load_state_dict: PPO checkpoint has no critic")
                self.critic.load_state_dict(sd["critic"])
        self._adam.load_state_dict(sd["optimizer"], "policy")
        if self._critic_adam is not None:
            self._critic_adam.load_state_dict(sd["critic_optimizer"], "critic")
        rng = sd["rng"]
        torch.set_rng_state(rng["torch"])
        torch.tpu.set_rng_state(rng["tpu"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self._gen.set_state(rng["learner"])
        self.policy_version = int(sd["policy_version"])
