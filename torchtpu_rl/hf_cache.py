"""A static KV cache for Hugging Face causal LMs, for :class:`~torchtpu_rl.rollout.RolloutEngine`.

:class:`SlotCache` is a ``transformers`` :class:`~transformers.Cache` whose layers are
preallocated ``(batch, kv_heads, slots, head_dim)`` buffers written in place. Every
forward writes its T tokens to the consecutive slots that start at ``SlotCache.position``,
a 0-d device tensor, so the prefill and every decode step keep one shape each: one
``torch.compile(backend="tpu")`` program per (batch, slots) bucket, the step index never
baked into a program. The model's own code runs unchanged: its attention calls
``past_key_values.update`` and Hugging Face's mask functions build the causal (and
sliding-window) masks from the 2-D slot mask and the cache's sizes.

Grouped-query attention: Hugging Face's sdpa path repeats each key/value head for its group of
query heads whenever it passes a mask (always, here), so every decode step wrote a
(batch, heads, slots, head_dim) copy of the whole cache per layer and step time grew with the
slot count. :func:`use_grouped_attention` switches a GQA model to :func:`grouped_attention`
(registered with ``transformers``' attention and mask interfaces): each group of query heads
meets its key/value head directly, and a decode step (one query) reads the cache through fused
products and sums, not a dot that XLA fed with a transposed copy of the cache. Figures:
benchmarks/README.md.

Why not ``transformers.StaticCache``: its sliding-window layers track their length in a
Python int, so under ``torch.compile`` every decode step of a Gemma2 or windowed Mistral
model recompiled (measured: 8 graphs in 12 steps, ~200 ms a step, against 2 graphs and
~1 ms here). Here sliding layers keep every slot too; the window lives in the mask only
(slot distance = position distance, since prompts are left-padded and responses follow
without gaps), so every layer has the same static shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["GROUPED_ATTENTION", "SlotCache", "cached_logits", "grouped_attention", "kv_cache_support",
           "use_grouped_attention"]

# attention layer kinds whose keys/values a slot buffer holds exactly; others (linear attention,
# chunked attention, shared KV) need a cache of their own
_CACHEABLE_LAYERS = ("full_attention", "sliding_attention")
GROUPED_ATTENTION = "torchtpu_grouped"  # see grouped_attention
_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", GROUPED_ATTENTION)


def kv_cache_support(model) -> tuple[bool, str]:
    """``(True, "")`` when ``model`` (a Hugging Face causal LM) can decode with a :class:`SlotCache`,
    else ``(False, why)``."""
    if not isinstance(model, PreTrainedModel):
        return False, f"{type(model).__name__} is not a Hugging Face PreTrainedModel"
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return False, "it is an encoder-decoder model"
    if not getattr(model, "_can_compile_fullgraph", False):
        return False, (f"{type(model).__name__} does not declare static-cache support "
                       "(_can_compile_fullgraph is False)")
    text_cfg = cfg.get_text_config(decoder=True)
    try:
        layer_types, _ = get_layer_types_and_kwargs(text_cfg)
    except Exception as e:  # a config shape the cache layer table does not know
        return False, f"its layer types could not be read from the config ({e})"
    other = sorted(set(layer_types) - set(_CACHEABLE_LAYERS))
    if other:
        return False, f"it has {other} layers (only {list(_CACHEABLE_LAYERS)} are cached)"
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in _ATTENTION_IMPLEMENTATIONS:
        return False, (f"its attention implementation is {impl!r} (cached decoding supports "
                       f"{', '.join(_ATTENTION_IMPLEMENTATIONS)})")
    return True, ""


class _SlotLayer(CacheLayerMixin):
    """One attention layer's keys and values: T new tokens go to slots ``position .. position + T - 1``."""

    is_compileable = True

    def __init__(self, keys, values, position, sliding: bool, layer_idx: int):
        super().__init__()
        self.keys, self.values = keys, values
        self.position = position  # shared by every layer of the cache
        self.is_sliding = sliding
        self.layer_idx = layer_idx
        self.max_cache_len = keys.shape[2]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: the buffers are preallocated (allocated inside a compiled step they
        would become program outputs)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[1] != self.keys.shape[1] or key_states.shape[3] != self.keys.shape[3]:
            raise ValueError(f"SlotCache layer {self.layer_idx}: the model produced keys of shape "
                             f"{tuple(key_states.shape)}, the cache holds (batch, heads, slots, head_dim) = "
                             f"{tuple(self.keys.shape)}; the config's num_key_value_heads/head_dim do not match "
                             "the attention module")
        slots = torch.arange(key_states.shape[2], device=self.device) + self.position
        self.keys.index_copy_(2, slots, key_states.to(self.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0  # masks span every slot; unwritten ones are 0 in the slot mask

    def get_seq_length(self):
        return self.position  # a tensor: Hugging Face's masks take it as the queries' offset

    def get_max_length(self) -> int:
        return self.max_cache_len


class SlotCache(Cache):
    """Static keys/values of every attention layer of ``model`` for ``batch_size`` rows and
    ``slots`` token slots, on ``device`` in ``dtype`` (default: the model's parameters')."""

    def __init__(self, model, batch_size: int, slots: int, device=None, dtype=None):
        cfg = model.config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(cfg)
        ref = next(model.parameters())
        device = ref.device if device is None else torch.device(device)
        dtype = ref.dtype if dtype is None else dtype
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.position = torch.zeros((), dtype=torch.int64, device=device)
        shape = (batch_size, kv_heads, slots, head_dim)
        layers = [_SlotLayer(torch.zeros(shape, dtype=dtype, device=device),
                             torch.zeros(shape, dtype=dtype, device=device), self.position,
                             kind == "sliding_attention", i)
                  for i, kind in enumerate(layer_types)]
        super().__init__(layers=layers)
        self.slots = slots


def cached_logits(model, cache: SlotCache, input_ids, attention_mask, cache_position):
    """Last-position logits (B, vocab) of ``input_ids`` (B, T) written to slots ``cache_position``
    (T,) (consecutive). ``attention_mask`` (B, slots) is 1 at real tokens, this forward's
    included; positions count the real slots before each token (left padding does not count),
    as Hugging Face's ``generate`` computes them."""
    cache.position.copy_(cache_position[0])
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).index_select(1, cache_position)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


# ================================================================= grouped-query attention


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      softcap=None, **kwargs):
    """Attention of ``query`` (B, Hq, L, E) over ``key``/``value`` (B, Hk, S, E) with Hq = r * Hk, as a
    ``transformers`` attention function: each group of r query heads is one (r * L, E) x (E, S)
    product with its key head, nothing repeated. Eager attention's arithmetic (scores * scaling,
    Gemma2's soft-capping, the mask, softmax in float32, dropout in training); returns
    ``(output (B, L, Hq, E), None)``."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("grouped_attention: attention sinks (s_aux) are not supported")
    B, hq, L, E = query.shape
    hk, S = key.shape[1], key.shape[2]
    r = hq // hk
    scale = E ** -0.5 if scaling is None else scaling
    if L == 1:
        # a decode step: products summed over E read each cached key once, in place; a matmul made
        # XLA copy (and transpose) the whole cache for its dot every step
        q = query.reshape(B, hk, r, 1, 1, E).float()
        scores = (q * key.float()[:, :, None, None]).sum(-1) * scale  # (B, hk, r, 1, S)
    else:
        scores = torch.matmul(query.reshape(B, hk, r * L, E), key.transpose(2, 3)) * scale
        scores = scores.reshape(B, hk, r, L, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        m = attention_mask[:, :, None] if attention_mask.shape[1] == 1 else attention_mask.reshape(B, hk, r, L, -1)
        if m.dtype == torch.bool:  # the most negative number, not -inf: a row of padding stays finite
            scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min)
        else:
            scores = scores + m
    probs = torch.softmax(scores.float(), dim=-1)
    if dropout and module.training:
        probs = F.dropout(probs, p=dropout, training=True)
    if L == 1:
        out = (probs[..., None] * value.float()[:, :, None, None]).sum(-2).to(value.dtype)  # (B, hk, r, 1, E)
    else:
        out = torch.matmul(probs.to(value.dtype).reshape(B, hk, r * L, S), value)
    return out.reshape(B, hq, L, -1).transpose(1, 2).contiguous(), None


def _materialized_bool_mask(*args, **kwargs):
    # always a (B, 1, L, S) boolean mask: grouped_attention has no is_causal shortcut
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
AttentionMaskInterface.register(GROUPED_ATTENTION, _materialized_bool_mask)


def use_grouped_attention(model) -> bool:
    """Switch ``model`` (a Hugging Face model with grouped-query attention and sdpa or eager attention)
    to :func:`grouped_attention`; True if it was switched (or already was)."""
    cfg = model.config.get_text_config(decoder=True)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == GROUPED_ATTENTION:
        return True
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if impl not in ("sdpa", "eager") or kv_heads == heads:
        return False
    model.set_attn_implementation(GROUPED_ATTENTION)
    return model.config._attn_implementation == GROUPED_ATTENTION
