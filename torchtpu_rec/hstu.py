"""HSTU (Zhai et al., "Actions Speak Louder than Words", 2024): a generative recommender over jagged
user-history sequences, in plain PyTorch with fbgemm's jagged ops, so the same module runs on CPU and
on tpu (where those ops are XLA programs, ``torchtpu/jagged.py``).

One HSTU block on jagged rows ``x`` ([total_L, D], one sequence per user, ``offsets``)::

    U, V, Q, K = split(SiLU(W1 · LayerNorm(x)))
    A          = SiLU(Q Kᵀ + rab_pos(i - j) + rab_time(bucket(t_i - t_j))) / max_len · causal mask
    y          = x + W2 · (LayerNorm(A V) ⊙ U)

The pointwise (SiLU, not softmax) attention runs on the sequences padded to ``N``, the bucket of the
batch's longest sequence (``length_policy``, pow2 by default), not to the model's maximum: one XLA
program per bucket, and a batch of short histories costs a short program. The attention is scaled by the
model's ``max_len`` (HSTU's padded length), never by the bucket: a user's scores do not depend on the
batch it came in. Item embeddings come from a
TorchRec ``EmbeddingCollection`` (feature ``"item"``), so ``DistributedModelParallel(model, device=tpu)``
shards them unchanged.

:class:`SASRec` (Kang & McAuley, 2018: softmax causal self-attention with learned absolute positions)
is the usual baseline, over the same embedding collection.
"""

from __future__ import annotations

import math

import fbgemm_gpu  # noqa: F401  (the fbgemm:: jagged ops)
import torch
import torch.nn.functional as F
from torch import nn

from torchtpu.bucketing import BucketPolicy

fbgemm = torch.ops.fbgemm

ITEM_FEATURE = "item"


def item_collection(num_items: int, dim: int, device=None):
    """The TorchRec ``EmbeddingCollection`` of the item table (feature ``"item"``)."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    return EmbeddingCollection(tables=[EmbeddingConfig(name="item_table", embedding_dim=dim, num_embeddings=num_items,
                                                       feature_names=[ITEM_FEATURE])], device=device)


def padded_length(lengths: torch.Tensor, policy: BucketPolicy) -> int:
    """The bucket of the longest sequence (one host read: the program's shape depends on it)."""
    return policy.bucket(max(int(lengths.max().item()) if lengths.numel() else 1, 1))


class RelativeBias(nn.Module):
    """Learned per-head biases of the relative position ``i - j`` (clipped to ``max_len - 1``) and of the
    time gap ``t_i - t_j``, bucketed logarithmically (``num_time_buckets`` buckets, base ``time_base``)."""

    def __init__(self, heads: int, max_len: int, num_time_buckets: int = 32, time_base: float = 2.0):
        super().__init__()
        self.max_len, self.num_time_buckets, self.time_base = max_len, num_time_buckets, time_base
        self.position = nn.Parameter(torch.zeros(heads, max_len))
        self.time = nn.Parameter(torch.zeros(heads, num_time_buckets))

    def forward(self, timestamps: torch.Tensor, n: int) -> torch.Tensor:
        """[B, heads, n, n] biases for padded ``timestamps`` [B, n]."""
        pos = torch.arange(n, device=timestamps.device)
        rel = (pos[:, None] - pos[None, :]).clamp(0, self.max_len - 1)
        gap = (timestamps[:, :, None] - timestamps[:, None, :]).abs()
        bucket = (torch.log1p(gap) / math.log(self.time_base)).floor().long().clamp(0, self.num_time_buckets - 1)
        return self.position[:, rel].unsqueeze(0) + self.time[:, bucket].permute(1, 0, 2, 3)


def jagged_pointwise_attention(q, k, v, timestamps, offsets, n: int, heads: int, bias: RelativeBias,
                               scale_length: int | None = None):
    """HSTU's attention on jagged rows ([total_L, D] each) padded to ``n``: SiLU(QKᵀ + bias) / scale_length
    (default ``n``), causal."""
    total, dim = q.shape
    b = offsets.shape[0] - 1
    qkv = fbgemm.jagged_to_padded_dense(torch.cat([q, k, v], dim=1), [offsets], [n], 0.0)
    qp, kp, vp = (t.reshape(b, n, heads, dim // heads) for t in qkv.split(dim, dim=2))
    ts = fbgemm.jagged_to_padded_dense(timestamps.to(q.dtype).unsqueeze(1), [offsets], [n], 0.0).squeeze(2)
    scores = torch.einsum("bnhd,bmhd->bhnm", qp, kp) + bias(ts, n)
    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(n, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [B, n]
    mask = (pos[:, None] >= pos[None, :])[None] & valid[:, :, None] & valid[:, None, :]  # causal, real rows
    weights = F.silu(scores) * mask[:, None].to(scores.dtype) / (scale_length or n)
    out = torch.einsum("bhnm,bmhd->bnhd", weights, vp).reshape(b, n, dim)
    return fbgemm.dense_to_jagged(out, [offsets], total)[0]


class HSTUBlock(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int, num_time_buckets: int = 32, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"HSTUBlock: dim {dim} is not a multiple of heads {heads}")
        self.dim, self.heads, self.max_len = dim, heads, max_len
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.norm_attn = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.bias = RelativeBias(heads, max_len, num_time_buckets)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, timestamps, offsets, n: int):
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split(self.dim, dim=1)
        attn = jagged_pointwise_attention(q, k, v, timestamps, offsets, n, self.heads, self.bias, self.max_len)
        return x + self.dropout(self.proj(self.norm_attn(attn) * u))


class HSTU(nn.Module):
    """Next-item model: item embeddings (a TorchRec EmbeddingCollection) → HSTU blocks → per-position
    scores over every item. ``forward(items, timestamps)``: ``items`` a KeyedJaggedTensor with feature
    ``"item"`` (one sequence per user), ``timestamps`` its values' timestamps; returns [total_L, num_items]."""

    def __init__(self, num_items: int, dim: int = 64, heads: int = 2, blocks: int = 2, max_len: int = 256,
                 num_time_buckets: int = 32, dropout: float = 0.0, embeddings=None,
                 length_policy: BucketPolicy | None = None):
        super().__init__()
        self.num_items, self.max_len = num_items, max_len
        self.embeddings = embeddings if embeddings is not None else item_collection(num_items, dim)
        self.blocks = nn.ModuleList(HSTUBlock(dim, heads, max_len, num_time_buckets, dropout) for _ in range(blocks))
        self.norm_out = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_items)
        self.length_policy = length_policy or BucketPolicy.pow2(8, max_len, name="hstu_sequence_length")

    def encode(self, items, timestamps, max_length: int | None = None):
        jt = self.embeddings(items)[ITEM_FEATURE]
        x = jt.values()
        offsets = jt.offsets().to(x.device)  # a sharded lookup may leave them on the host
        n = max_length or padded_length(jt.lengths(), self.length_policy)
        for block in self.blocks:
            x = block(x, timestamps, offsets, n)
        return self.norm_out(x), offsets

    def forward(self, items, timestamps, max_length: int | None = None):
        """``max_length``: the padded attention length (default: the bucket of the longest sequence); rows
        of a longer sequence past it are cut, as a host-padded batch's filler sequence is."""
        x, _ = self.encode(items, timestamps, max_length)
        return self.head(x)


class SASRec(nn.Module):
    """The SASRec baseline: learned absolute positions and softmax causal self-attention on the sequences
    padded to the bucket of the longest, over the same item embedding collection; same output as HSTU."""

    def __init__(self, num_items: int, dim: int = 64, heads: int = 2, blocks: int = 2, max_len: int = 256,
                 dropout: float = 0.0, embeddings=None, length_policy: BucketPolicy | None = None):
        super().__init__()
        self.num_items, self.max_len = num_items, max_len
        self.embeddings = embeddings if embeddings is not None else item_collection(num_items, dim)
        self.position = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.norm_out = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_items)
        self.length_policy = length_policy or BucketPolicy.pow2(8, max_len, name="sasrec_sequence_length")

    def forward(self, items, timestamps=None, max_length: int | None = None):
        jt = self.embeddings(items)[ITEM_FEATURE]
        values = jt.values()
        offsets = jt.offsets().to(values.device)
        n = max_length or padded_length(jt.lengths(), self.length_policy)
        x = fbgemm.jagged_to_padded_dense(values, [offsets], [n], 0.0)
        pos = torch.arange(n, device=values.device)
        x = x + self.position(pos)[None]
        lengths = offsets[1:] - offsets[:-1]
        pad = pos[None, :] >= lengths[:, None]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=values.device), diagonal=1)
        h = self.encoder(x, mask=causal, src_key_padding_mask=pad.float().masked_fill(pad, float("-inf")))
        return self.head(fbgemm.dense_to_jagged(self.norm_out(h), [offsets], values.shape[0])[0])
