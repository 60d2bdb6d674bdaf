"""The policy interface and per-token log-probabilities.

A policy is any causal language model ``nn.Module`` called as
``model(input_ids, attention_mask=None)`` that returns logits (B, T, vocab), or
a Hugging Face style output with ``.logits`` (or a tuple whose first item is the
logits). :func:`make_policy` builds the project's own :class:`TinyTransformer`,
which has its own static KV cache; Hugging Face causal LMs decode with
:class:`~torchtpu_rl.hf_cache.SlotCache` (what :mod:`torchtpu_rl.rollout` uses
for fast generation; other models are generated without a cache).

Hugging Face models are given ``position_ids`` counted from the attention mask
(``cumsum - 1``: left padding does not count), as their ``generate`` does;
without them a left-padded prompt would be read at shifted positions. The
rollout engine and the learner both go through :func:`policy_logits`, so they
score the same positions.

Log-prob convention (shared by the rollout engine and the learner): the
log-prob of a sampled token is ``log_softmax(logits / temperature)`` at that
token -- the temperature-scaled distribution before top-k/top-p truncation,
what verl and OpenRLHF recompute in the learner -- so rollout log-probs and a
full-sequence recompute agree up to float rounding.
"""

from __future__ import annotations

import copy
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtpu_models import TinyTransformer, TransformerConfig

__all__ = [
    "ValueModel",
    "clone_policy",
    "get_logits",
    "is_hf_model",
    "make_policy",
    "policy_logits",
    "position_ids_from_mask",
    "sequence_logprobs",
    "supports_kv_cache",
    "token_logprobs",
]


def get_logits(output) -> torch.Tensor:
    """The logits tensor of a model's output: a tensor, an object with ``.logits``, or a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"policy output must be logits, an object with .logits, or a tuple of tensors; "
                    f"got {type(output).__name__}")


def is_hf_model(model) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (without importing ``transformers``: a model of
    it can only exist once it is imported)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def position_ids_from_mask(attention_mask) -> torch.Tensor:
    """Positions (B, T) int64 of a (left- or right-) padded batch: the number of real tokens before
    each token (0 at left padding), as Hugging Face's ``generate`` derives them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _forward(model, input_ids, attention_mask, **kwargs):
    if is_hf_model(model):
        # positions from the mask (left padding); no KV cache object built for a full forward
        pos = position_ids_from_mask(attention_mask) if attention_mask is not None else None
        return model(input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False, **kwargs)
    return model(input_ids, attention_mask=attention_mask, **kwargs)


def policy_logits(model: nn.Module, input_ids, attention_mask=None) -> torch.Tensor:
    """``model(input_ids, attention_mask)``'s logits (B, T, vocab), checked for shape (Hugging Face
    models also get ``position_ids`` from the mask)."""
    logits = get_logits(_forward(model, input_ids, attention_mask))
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(f"policy returned logits of shape {tuple(logits.shape)} for input_ids "
                         f"{tuple(input_ids.shape)}; expected (batch, seq, vocab)")
    return logits


def supports_kv_cache(model: nn.Module) -> bool:
    """True when ``model`` decodes with a static KV cache: this project's API (``init_kv_cache`` and
    ``forward(..., kv_cache=, cache_position=)``), or a Hugging Face causal LM that
    :func:`torchtpu_rl.hf_cache.kv_cache_support` accepts."""
    if callable(getattr(model, "init_kv_cache", None)):
        return True
    if is_hf_model(model):
        from .hf_cache import kv_cache_support

        return kv_cache_support(model)[0]
    return False


def make_policy(vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, max_seq_len: int = 64,
                device=None, seed: Optional[int] = None, **config) -> TinyTransformer:
    """A :class:`TinyTransformer` policy (pre-norm decoder, RoPE, tied embeddings by default).

    Built on CPU (under ``torch.manual_seed(seed)`` when given, so every process can build the
    same initial weights) and moved to ``device``. ``config`` goes to :class:`TransformerConfig`.
    """
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"make_policy: vocab_size must be an int >= 2, not {vocab_size!r}")
    cfg = TransformerConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                            max_seq_len=max_seq_len, **config)
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = TinyTransformer(cfg)
    else:
        model = TinyTransformer(cfg)
    return model.to(device) if device is not None else model


def clone_policy(model: nn.Module, device=None, requires_grad: Optional[bool] = None) -> nn.Module:
    """An independent copy of ``model`` (same weights) on ``device`` (default: the model's).

    The copy is made on the host (device tensors are not deep-copied), so it works for tpu
    models; ``requires_grad=False`` freezes it (a reference policy)."""
    params = list(model.parameters())
    src_dev = params[0].device if params else torch.device("cpu")
    device = src_dev if device is None else torch.device(device)
    if isinstance(model, TinyTransformer):
        clone = TinyTransformer(model.config)
        clone.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    elif src_dev.type == "cpu":
        clone = copy.deepcopy(model)
    else:
        # move a host copy: deepcopy of device storages is not supported for every backend
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        clone = copy.deepcopy(model.to("cpu"))
        model.to(src_dev)
        clone.load_state_dict(state)
    clone = clone.to(device)
    clone.train(model.training)
    if requires_grad is not None:
        for p in clone.parameters():
            p.requires_grad_(requires_grad)
    return clone


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens``: (B, T, V), (B, T) -> (B, T) float32."""
    logits = logits.float()
    if temperature not in (0, 0.0, 1, 1.0):
        logits = logits / float(temperature)
    return F.log_softmax(logits, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _entropy(logits):
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sequence_logprobs(model: nn.Module, input_ids, attention_mask=None, response_mask=None,
                      temperature: float = 1.0, return_entropy: bool = False):
    """Per-token log-probs of ``input_ids`` under ``model`` (one full forward).

    ``input_ids`` (B, L) is prompt and response concatenated. ``response_mask`` says which
    tokens to score: (B, L) aligned with ``input_ids``, or (B, R) for the last R columns (the
    response part of a :class:`~torchtpu_rl.rollout.RolloutBatch`). The result has the mask's
    shape: ``log p(token_j | tokens_<j)`` where the mask is set, 0 elsewhere. Without a mask
    every token but the first is scored, (B, L) with column 0 zero. ``return_entropy`` also
    gives the entropy of each scored position's distribution (same shape).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), not {tuple(input_ids.shape)}")
    B, L = input_ids.shape
    logits = policy_logits(model, input_ids, attention_mask)
    if response_mask is None:
        response_mask = (torch.arange(L, device=input_ids.device) > 0)[None].expand(B, L)
    if response_mask.dim() != 2 or response_mask.shape[0] != B or response_mask.shape[1] > L:
        raise ValueError(f"response_mask must be (batch, <= {L}) for input_ids {tuple(input_ids.shape)}, "
                         f"not {tuple(response_mask.shape)}")
    R = response_mask.shape[1]
    # position j predicts token j + 1: score the next ids, then roll the result so column j holds
    # token j's log-prob (column 0 wraps around and is never a response token). Rolls, not slices:
    # a slice of a grad tensor differentiates into slice_scatter, a roll into a roll.
    next_ids = torch.roll(input_ids, -1, 1)
    lp = torch.roll(token_logprobs(logits, next_ids, temperature), 1, 1)
    ent = torch.roll(_entropy(logits / (temperature or 1.0)), 1, 1) if return_entropy else None
    if R < L:
        cols = torch.arange(L - R, L, device=input_ids.device)
        lp = lp.index_select(1, cols)
        ent = ent.index_select(1, cols) if return_entropy else None
    m = response_mask.to(lp.dtype)
    lp = lp * m
    if return_entropy:
        return lp, ent * m
    return lp


class ValueModel(nn.Module):
    """A critic: a transformer trunk plus a linear value head, ``forward -> values (B, T)``.

    ``backbone`` is a :class:`TinyTransformer` (its ``hidden_states``) or a Hugging Face causal
    LM (the ``last_hidden_state`` of its base model: the LM head, vocab-sized, is not computed).
    The head starts at zero, so the initial values are 0 (no bias in the first advantages).
    """

    def __init__(self, backbone: nn.Module, hidden_size: Optional[int] = None):
        super().__init__()
        self.backbone = backbone
        if hidden_size is None:
            cfg = getattr(backbone, "config", None)
            hidden_size = getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", None)
        if not hidden_size:
            raise ValueError("ValueModel: pass hidden_size (the backbone's config has neither d_model "
                             "nor hidden_size)")
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module, device=None) -> "ValueModel":
        """A critic whose trunk starts as a copy of ``policy`` (as OpenRLHF/verl initialize it)."""
        trunk = clone_policy(policy, device=device, requires_grad=True)
        vm = cls(trunk)
        return vm.to(next(trunk.parameters()))  # the trunk's device and dtype

    def forward(self, input_ids, attention_mask=None):
        if callable(getattr(self.backbone, "hidden_states", None)):
            h = self.backbone.hidden_states(input_ids, attention_mask)
        elif is_hf_model(self.backbone) and self.backbone.base_model is not self.backbone:
            h = _forward(self.backbone.base_model, input_ids, attention_mask).last_hidden_state
        else:
            out = _forward(self.backbone, input_ids, attention_mask, output_hidden_states=True)
            h = out.hidden_states[-1]
        return self.value_head(h).squeeze(-1).float()
