"""A decoder-only language model with the Hugging Face call shape
``forward(input_ids, attention_mask=None) -> logits`` and an optional static
:class:`KVCache` for incremental decoding. Plain PyTorch: nothing here knows
about ``tpu``."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["KVCache", "TransformerConfig", "TinyTransformer", "apply_rope"]


# ============================================================== transformer
@dataclasses.dataclass
class TransformerConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 32
    mlp_ratio: int = 4
    dropout: float = 0.0
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    activation: str = "gelu"  # "gelu" | "silu"
    positions: str = "rope"  # "rope" | "learned"
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    # one qkv Linear, or three (wq, wk, wv) as TorchTitan writes them: tensor parallelism shards each
    # column-wise so that every rank holds whole heads, which one fused weight's row split would not
    fused_qkv: bool = True

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError("RoPE needs an even head dimension")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', not {self.norm!r}")
        if self.activation not in ("gelu", "silu"):
            raise ValueError(f"activation must be 'gelu' or 'silu', not {self.activation!r}")
        if self.positions not in ("rope", "learned"):
            raise ValueError(f"positions must be 'rope' or 'learned', not {self.positions!r}")


def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=1e-6)
    return nn.LayerNorm(cfg.d_model)


def _rope_tables(head_dim: int, max_len: int, base: float):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, hd): the "rotate half" pairing
    return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """Rotary embedding of ``x`` (B, H, T, hd) with ``cos``/``sin`` broadcastable to it."""
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Static key/value buffers for incremental decoding, one (B, H, S, hd) pair per layer.

    Static (preallocated to ``max_len`` slots, written in place at ``cache_position``) rather
    than grown by concatenation, so every decode step has the same shapes: one compiled program
    per (batch, max_len), as Hugging Face's ``StaticCache`` does for XLA. Make one with
    :meth:`TinyTransformer.init_kv_cache`.
    """

    def __init__(self, keys, values):
        if len(keys) != len(values):
            raise ValueError("KVCache: keys and values need one buffer per layer each")
        self.keys = list(keys)
        self.values = list(values)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def __len__(self):
        return len(self.keys)

    def reset(self) -> None:
        """Zero the buffers (stale slots are masked anyway; this is for hygiene between uses)."""
        for t in self.keys + self.values:
            t.zero_()


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        else:
            self.wq = nn.Linear(cfg.d_model, cfg.d_model)
            self.wk = nn.Linear(cfg.d_model, cfg.d_model)
            self.wv = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x, cos=None, sin=None, attn_mask=None, cache=None, cache_position=None):
        B, T, C = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(C, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # heads counted from the width (-1), not n_heads: under tensor parallelism a rank holds a
        # column shard of wq/wk/wv, hence only its own heads
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if cos is not None:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        p = self.dropout if self.training else 0.0
        if cache is not None:
            # write this chunk's keys/values into their slots, attend over every slot
            # (attn_mask hides the slots not written yet and padding)
            k_buf, v_buf = cache
            k_buf.index_copy_(2, cache_position, k.to(k_buf.dtype))
            v_buf.index_copy_(2, cache_position, v.to(v_buf.dtype))
            k, v = k_buf, v_buf
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden)
        self.out = nn.Linear(hidden, cfg.d_model)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.SiLU()
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.out(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = _norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos=None, sin=None, attn_mask=None, cache=None, cache_position=None):
        x = x + self.drop(self.attn(self.ln1(x), cos, sin, attn_mask, cache, cache_position))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer LM (pre-norm), Hugging Face call shape.

    ``forward(input_ids, attention_mask=None, position_ids=None) -> logits``
    of shape (B, T, vocab). ``attention_mask`` (B, T) is 1 for real tokens and
    0 for padding (left or right); positions then count real tokens only, as
    Hugging Face's generate does, so a left-padded prompt sees the same
    positions as an unpadded one.
    """

    def __init__(self, cfg: Optional[TransformerConfig] = None, **overrides):
        super().__init__()
        if cfg is None:
            cfg = TransformerConfig(**overrides)
        elif overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        else:
            cos, sin = _rope_tables(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_base)
            # not persistent: derived from the config, so state_dicts stay weights-only
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # GPT-2's scaled init of residual projections keeps the residual stream's scale with depth
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.out.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def init_kv_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> KVCache:
        """An empty :class:`KVCache` of ``max_len`` slots (at most ``max_seq_len``) for
        ``batch_size`` sequences, on the model's device and dtype unless given."""
        cfg = self.config
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KV cache length {max_len} exceeds max_seq_len {cfg.max_seq_len}")
        ref = self.tok_emb.weight
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        shape = (batch_size, cfg.n_heads, max_len, cfg.d_model // cfg.n_heads)
        return KVCache([torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)],
                       [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)])

    def forward(self, input_ids, attention_mask=None, position_ids=None, kv_cache=None, cache_position=None):
        """Logits (B, T, vocab) of ``input_ids`` (B, T).

        With ``kv_cache`` (a :class:`KVCache`), the T tokens are written to the cache slots
        ``cache_position`` (T,) (default ``0..T-1``: a prefill) and attend to every earlier
        slot; ``attention_mask`` is then (B, max_len) over the cache's slots (Hugging Face's
        convention: past and current tokens), 1 where a slot holds a real token, and the
        positions of the new tokens count the real slots before them. Without a cache,
        ``attention_mask`` may be a (B, 1, T, T) boolean mask used as given (packed sequences),
        with ``position_ids``.
        """
        return self.lm_head(self.hidden_states(input_ids, attention_mask, position_ids, kv_cache, cache_position))

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, kv_cache=None, cache_position=None):
        """The final normalized hidden states (B, T, d_model) that ``lm_head`` reads (value heads
        read them too); arguments as :meth:`forward`."""
        B, T = input_ids.shape
        if kv_cache is not None:
            return self._forward_cached(input_ids, attention_mask, position_ids, kv_cache, cache_position)
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        if attention_mask is not None and attention_mask.dim() == 4:
            # a (B, 1, T, T) boolean mask is used as given (packed sequences: block-diagonal), with the
            # caller's position_ids
            if position_ids is None:
                raise ValueError("a 4-d attention_mask needs position_ids (each token's position in its sequence)")
            x, cos, sin = self._embed(input_ids, position_ids, T)
            attn_mask = attention_mask.bool()
            for block in self.blocks:
                x = block(x, cos, sin, attn_mask)
            return self.ln_f(x)
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x, cos, sin = self._embed(input_ids, position_ids, T)
        attn_mask = None
        if attention_mask is not None:
            attn_mask = self._attention_bias(attention_mask.bool(), T, x.device)
        for block in self.blocks:
            x = block(x, cos, sin, attn_mask)
        return self.ln_f(x)

    def _embed(self, input_ids, position_ids, T):
        x = self.tok_emb(input_ids)
        cos = sin = None
        if self.config.positions == "learned":
            if position_ids is None:
                x = x + self.pos_emb.weight[:T]
            else:
                x = x + self.pos_emb(position_ids)
        else:
            if position_ids is None:
                cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd), broadcast over (B, H)
            else:
                cos = self.rope_cos[position_ids].unsqueeze(1)  # (B, 1, T, hd)
                sin = self.rope_sin[position_ids].unsqueeze(1)
        return self.drop(x), cos, sin

    def _forward_cached(self, input_ids, attention_mask, position_ids, cache, cache_position):
        B, T = input_ids.shape
        if not isinstance(cache, KVCache):
            raise TypeError(f"kv_cache must be a KVCache (see init_kv_cache), not {type(cache).__name__}")
        if len(cache) != len(self.blocks):
            raise ValueError(f"kv_cache has {len(cache)} layers, the model {len(self.blocks)}")
        S = cache.max_len
        if cache.batch_size != B:
            raise ValueError(f"kv_cache is for batch {cache.batch_size}, input_ids has batch {B}")
        dev = input_ids.device
        if cache_position is None:
            if T > S:
                raise ValueError(f"{T} tokens do not fit a KV cache of {S} slots")
            cache_position = torch.arange(T, device=dev)
        if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"with a kv_cache, attention_mask must be (batch, cache slots) = {(B, S)}, "
                             f"not {tuple(attention_mask.shape)}")
        slots = torch.arange(S, device=dev)
        # query t sees slots <= its own slot (causal in slot order), and of those only real ones;
        # its own slot always, so a padding query never has every key masked (NaN)
        causal = slots[None, :] <= cache_position[:, None]  # (T, S)
        own = slots[None, :] == cache_position[:, None]
        if attention_mask is None:
            attn_mask = causal[None, None]
        else:
            key_mask = attention_mask.bool()
            attn_mask = ((causal[None] & key_mask[:, None, :]) | own[None])[:, None]  # (B, 1, T, S)
            if position_ids is None:
                # a token's position = real slots before it (left padding does not count)
                before = attention_mask.long().cumsum(-1) - 1
                position_ids = before.index_select(1, cache_position).clamp(min=0)
        if position_ids is None:
            position_ids = cache_position[None].expand(B, T)
        x, cos, sin = self._embed(input_ids, position_ids, T)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, attn_mask, (cache.keys[i], cache.values[i]), cache_position)
        return self.ln_f(x)

    @staticmethod
    def _attention_bias(key_mask, T, device):
        """(B, 1, T, T) boolean mask: causal and not padding. Every query may see
        itself, so a padding row never has all keys masked (which gives NaN)."""
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=device)
        return ((causal & key_mask[:, None, None, :]) | eye).contiguous()

    def loss(self, input_ids, targets, attention_mask=None, ignore_index: int = -100):
        """Mean next-token cross entropy of ``forward(input_ids)`` against ``targets`` (B, T)."""
        logits = self(input_ids, attention_mask)
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
