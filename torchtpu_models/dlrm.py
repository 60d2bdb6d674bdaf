"""DLRM in miniature: dense features through a bottom MLP, pooled sparse
embedding bags, pairwise dot interaction, top MLP, one logit per sample.
Plain PyTorch."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DLRMConfig", "DLRMStyleMLP"]


# ============================================================== DLRM-style model
@dataclasses.dataclass
class DLRMConfig:
    num_dense: int = 8
    embedding_dim: int = 16
    table_sizes: Sequence[int] = (100, 50, 20)
    bag_size: int = 3  # ids per sample per sparse feature (fixed: a dense (B, L) id tensor)
    bottom_mlp: Sequence[int] = (32, 16)  # the last must equal embedding_dim
    top_mlp: Sequence[int] = (32, 16)
    pooling: str = "sum"  # EmbeddingBag mode

    def __post_init__(self):
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError("the bottom MLP's last width must equal embedding_dim (dot interaction)")


def _mlp(widths, in_dim):
    layers = []
    for w in widths:
        layers += [nn.Linear(in_dim, w), nn.ReLU()]
        in_dim = w
    return nn.Sequential(*layers), in_dim


class DLRMStyleMLP(nn.Module):
    """DLRM in miniature: ``forward(dense, sparse) -> logits`` (B,).

    ``dense`` is (B, num_dense) float; ``sparse`` is a list with one (B, bag_size)
    int64 id tensor per table. Each id bag is sum-pooled by an ``nn.EmbeddingBag``;
    the pooled vectors and the bottom MLP's output interact by pairwise dot
    products (upper triangle), which are concatenated with the bottom output and
    fed to the top MLP.
    """

    def __init__(self, cfg: Optional[DLRMConfig] = None, **overrides):
        super().__init__()
        if cfg is None:
            cfg = DLRMConfig(**overrides)
        elif overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        self.bottom, _ = _mlp(cfg.bottom_mlp, cfg.num_dense)
        self.tables = nn.ModuleList(
            [nn.EmbeddingBag(n, cfg.embedding_dim, mode=cfg.pooling) for n in cfg.table_sizes]
        )
        n_vec = 1 + len(cfg.table_sizes)
        li, lj = torch.triu_indices(n_vec, n_vec, offset=1)
        self.register_buffer("_li", li, persistent=False)
        self.register_buffer("_lj", lj, persistent=False)
        n_inter = n_vec * (n_vec - 1) // 2
        top, width = _mlp(cfg.top_mlp, cfg.embedding_dim + n_inter)
        self.top = nn.Sequential(*top, nn.Linear(width, 1))
        for t in self.tables:
            nn.init.uniform_(t.weight, -1.0 / math.sqrt(t.num_embeddings), 1.0 / math.sqrt(t.num_embeddings))

    def forward(self, dense, sparse):
        x = self.bottom(dense)  # (B, D)
        pooled = [table(ids) for table, ids in zip(self.tables, sparse)]  # each (B, D)
        z = torch.stack([x] + pooled, dim=1)  # (B, F, D)
        inter = torch.bmm(z, z.transpose(1, 2))  # (B, F, F)
        flat = inter[:, self._li, self._lj]  # (B, F*(F-1)/2)
        return self.top(torch.cat([x, flat], dim=1)).squeeze(-1)

    def loss(self, dense, sparse, labels):
        return F.binary_cross_entropy_with_logits(self(dense, sparse), labels)

    def make_batch(self, batch_size: int, generator: Optional[torch.Generator] = None, device=None):
        """A synthetic, learnable batch: the label is a fixed function of the dense
        features and of the parity of the first sparse id, so the loss can fall."""
        cfg = self.config
        dense = torch.randn(batch_size, cfg.num_dense, generator=generator)
        sparse = [torch.randint(0, n, (batch_size, cfg.bag_size), generator=generator) for n in cfg.table_sizes]
        score = dense[:, 0] - 0.5 * dense[:, 1] + (sparse[0][:, 0] % 2).float() - 0.5
        labels = (score > 0).float()
        if device is not None:
            dense = dense.to(device)
            sparse = [s.to(device) for s in sparse]
            labels = labels.to(device)
        return dense, sparse, labels
