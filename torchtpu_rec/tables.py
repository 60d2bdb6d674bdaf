"""Embedding table specs, stacking and MOD row sharding over SparseCores.

SparseCore's model (from jax-tpu-embedding): tables of the same width are
*stacked* into one array (each keeps a row offset inside it), and the stacked
rows are sharded over the SparseCores of a chip MOD their count: stacked row
``g`` lives on core ``g % n`` at local row ``g // n``. The whole stack is held
as one ``(n * rows_per_core, dim)`` array whose core ``c`` owns the rows
``[c * rows_per_core, (c + 1) * rows_per_core)``; :func:`physical_rows` maps
logical (per-table) rows there.

A :class:`TableSpec` is what TorchRec's ``EmbeddingBagConfig`` / ``EmbeddingConfig``
say plus the fused optimizer (:class:`OptimizerSpec`). A shard of a bigger table
(TorchRec row-wise / column-wise sharding) is simply a smaller table: its spec
carries where it sits in the full table (``row_offset``, ``col_offset``,
``global_num_embeddings``, ``global_embedding_dim``) for checkpoints; ids fed to
it are local to the shard.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = [
    "OPTIMIZERS",
    "POOLINGS",
    "SPARSECORES_PER_CHIP",
    "OptimizerSpec",
    "StackedTable",
    "TableSpec",
    "num_sparsecores",
    "physical_rows",
    "stack_tables",
]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
POOLINGS = ("sum", "mean", "none")  # "none": sequence features (EmbeddingCollection)

# SparseCores per chip, by TPU generation (device_kind substrings, most specific first)
SPARSECORES_PER_CHIP = {"v5p": 4, "v6e": 2, "v6 lite": 2, "v7x": 2, "v7": 2}
_DEFAULT_SPARSECORES = 4  # off TPU (XLA CPU/GPU) the v5p layout is used, so MOD sharding is exercised


def num_sparsecores(generation: Optional[str] = None) -> int:
    """SparseCores per chip: of ``generation`` ("v5p", "v6e", "v7"), else ``TORCHTPU_REC_SPARSECORES``,
    else the attached TPU's generation, else 4 (the v5p layout) off TPU."""
    if generation is None:
        env = os.environ.get("TORCHTPU_REC_SPARSECORES", "").strip()
        if env:
            try:
                n = int(env)
            except ValueError:
                raise ValueError(f"TORCHTPU_REC_SPARSECORES must be a positive integer, not {env!r}") from None
            if n < 1:
                raise ValueError(f"TORCHTPU_REC_SPARSECORES must be >= 1, not {n}")
            return n
        import jax

        dev = jax.devices()[0]
        if dev.platform != "tpu":
            return _DEFAULT_SPARSECORES
        generation = getattr(dev, "device_kind", "")
    g = str(generation).lower()
    for key, n in SPARSECORES_PER_CHIP.items():
        if key in g:
            return n
    raise ValueError(f"unknown TPU generation {generation!r}: known {sorted(SPARSECORES_PER_CHIP)}; "
                     "pass num_sparsecores= explicitly")


# ---------------------------------------------------------------- optimizer
_TORCH_OPTIM_NAMES = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam", "RowWiseAdagrad": "rowwise_adagrad"}
_FBGEMM_NAMES = {"exact_sgd": "sgd", "sgd": "sgd", "exact_adagrad": "adagrad",
                 "exact_row_wise_adagrad": "rowwise_adagrad", "row_wise_adagrad": "rowwise_adagrad",
                 "adam": "adam"}
_KWARG_ALIASES = {"learning_rate": "lr", "betas": None}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """A fused embedding optimizer, with fbgemm's exact (per unique row, duplicates summed) semantics:

    - ``sgd``: ``w -= lr * g``
    - ``adagrad``: ``m += g**2; w -= lr * g / (sqrt(m) + eps)`` (m per element)
    - ``rowwise_adagrad``: ``m += mean(g**2); w -= lr * g / (sqrt(m) + eps)`` (m per row)
    - ``adam``: ``m1 = b1 m1 + (1-b1) g; m2 = b2 m2 + (1-b2) g**2;
      w -= lr * (m1 / (1-b1**t) / (sqrt(m2 / (1-b2**t)) + eps) + weight_decay * w)``
      (t: the step count of the table; only rows in the batch move, like fbgemm's ADAM)

    For the others ``weight_decay`` is L2: ``g += weight_decay * w`` before the update.
    """

    kind: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer kind must be one of {OPTIMIZERS}, not {self.kind!r}")
        for f in ("lr", "eps", "beta1", "beta2", "weight_decay"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise TypeError(f"OptimizerSpec.{f} must be a finite number, not {v!r}")
            object.__setattr__(self, f, float(v))
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ValueError(f"OptimizerSpec: lr, eps and weight_decay must be >= 0 ({self})")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"OptimizerSpec: betas must be in [0, 1) ({self})")

    @classmethod
    def of(cls, optimizer=None, **kwargs) -> "OptimizerSpec":
        """From an OptimizerSpec, a kind name ("adagrad"), fbgemm's ``EmbOptimType``, or a torch /
        torchrec optimizer class (``torch.optim.Adagrad``, ``torchrec.optim.RowWiseAdagrad``: as in
        ``FusedEmbeddingBagCollection(optimizer_type=..., optimizer_kwargs=...)``); ``kwargs`` are
        the hyper-parameters (``lr``/``learning_rate``, ``eps``, ``betas`` or ``beta1``/``beta2``,
        ``weight_decay``)."""
        if optimizer is None:
            optimizer = "sgd"
        if isinstance(optimizer, OptimizerSpec):
            return dataclasses.replace(optimizer, **cls._norm_kwargs(kwargs)) if kwargs else optimizer
        if isinstance(optimizer, type):
            kind = _TORCH_OPTIM_NAMES.get(optimizer.__name__)
            if kind is None:
                raise ValueError(f"no fused embedding optimizer for {optimizer.__name__}: "
                                 f"supported {sorted(_TORCH_OPTIM_NAMES)}")
        else:
            name = getattr(optimizer, "value", optimizer)  # fbgemm EmbOptimType is a str enum
            if not isinstance(name, str):
                raise TypeError(f"optimizer must be an OptimizerSpec, a name, an fbgemm EmbOptimType or an "
                                f"optimizer class, not {type(optimizer).__name__}")
            name = name.lower()
            kind = name if name in OPTIMIZERS else _FBGEMM_NAMES.get(name)
            if kind is None:
                raise ValueError(f"unsupported fused embedding optimizer {optimizer!r}: supported {OPTIMIZERS}")
        return cls(kind, **cls._norm_kwargs(kwargs))

    @staticmethod
    def _norm_kwargs(kwargs):
        out = {}
        for k, v in kwargs.items():
            if k in ("lr", "learning_rate"):
                out["lr"] = v
            elif k == "betas":
                out["beta1"], out["beta2"] = v
            elif k in ("eps", "beta1", "beta2", "weight_decay"):
                out[k] = v
            elif k in ("momentum", "initial_accumulator_value", "lr_decay") and not v:
                continue  # torch defaults that mean "off"
            else:
                raise ValueError(f"unsupported fused optimizer hyper-parameter {k}={v!r}")
        return out

    def state_shapes(self, rows: int, dim: int) -> dict:
        """Optimizer state name -> shape for a table of ``rows`` x ``dim``."""
        if self.kind == "sgd":
            return {}
        if self.kind == "adagrad":
            return {"momentum1": (rows, dim)}
        if self.kind == "rowwise_adagrad":
            return {"momentum1": (rows,)}
        return {"exp_avg": (rows, dim), "exp_avg_sq": (rows, dim)}


# ---------------------------------------------------------------- tables
def _pooling_name(p) -> str:
    name = str(getattr(p, "value", p)).lower()
    if name not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS} (or torchrec PoolingType), not {p!r}")
    return name


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``num_embeddings`` x ``embedding_dim``, looked up by ``feature_names``.

    ``pooling``: "sum" / "mean" (pooled, EmbeddingBagCollection) or "none" (sequence,
    EmbeddingCollection). ``optimizer``: the fused optimizer (None: the collection's).
    ``weight_init_min/max``: uniform init bounds (TorchRec's default: +-sqrt(1/num_embeddings)).
    ``row_offset``/``col_offset``/``global_num_embeddings``/``global_embedding_dim``: where this
    table sits in a bigger one when it is a shard (ids it sees are local to it).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple = ()
    pooling: str = "sum"
    optimizer: Optional[OptimizerSpec] = None
    dtype: torch.dtype = torch.float32
    weight_init_min: Optional[float] = None
    weight_init_max: Optional[float] = None
    row_offset: int = 0
    col_offset: int = 0
    global_num_embeddings: Optional[int] = None
    global_embedding_dim: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec needs a non-empty name, got {self.name!r}")
        for f in ("num_embeddings", "embedding_dim"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"table {self.name!r}: {f} must be a positive integer, not {v!r}")
            object.__setattr__(self, f, int(v))
        feats = self.feature_names
        if isinstance(feats, str):
            feats = (feats,)
        feats = tuple(feats) or (self.name,)
        object.__setattr__(self, "feature_names", feats)
        object.__setattr__(self, "pooling", _pooling_name(self.pooling))
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerSpec):
            object.__setattr__(self, "optimizer", OptimizerSpec.of(self.optimizer))
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"table {self.name!r}: dtype must be float32, bfloat16 or float16, not {self.dtype}")
        if self.global_num_embeddings is None:
            object.__setattr__(self, "global_num_embeddings", self.row_offset + self.num_embeddings)
        if self.global_embedding_dim is None:
            object.__setattr__(self, "global_embedding_dim", self.col_offset + self.embedding_dim)

    @classmethod
    def from_torchrec(cls, config, optimizer=None, **overrides) -> "TableSpec":
        """From torchrec's ``EmbeddingBagConfig`` (pooled) or ``EmbeddingConfig`` (sequence)."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
        from torchrec.types import DataType

        if isinstance(config, EmbeddingBagConfig):
            pooling = _pooling_name(config.pooling)
        elif isinstance(config, EmbeddingConfig):
            pooling = "none"
        else:
            raise TypeError(f"expected torchrec EmbeddingBagConfig or EmbeddingConfig, got {type(config).__name__}")
        dtypes = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
        if config.data_type not in dtypes:
            raise ValueError(f"table {config.name!r}: data_type {config.data_type} is not supported on tpu")
        kw = dict(name=config.name, num_embeddings=config.num_embeddings, embedding_dim=config.embedding_dim,
                  feature_names=tuple(config.feature_names) or (config.name,), pooling=pooling,
                  optimizer=None if optimizer is None else OptimizerSpec.of(optimizer),
                  dtype=dtypes[config.data_type], weight_init_min=config.weight_init_min,
                  weight_init_max=config.weight_init_max)
        kw.update(overrides)
        return cls(**kw)

    @property
    def pooled(self) -> bool:
        return self.pooling != "none"

    def init_bounds(self):
        lo = self.weight_init_min
        hi = self.weight_init_max
        b = math.sqrt(1.0 / self.num_embeddings)
        return (-b if lo is None else lo), (b if hi is None else hi)


@dataclasses.dataclass(frozen=True)
class StackedTable:
    """Tables of one width and optimizer held as one array, MOD-sharded over ``num_cores``.

    ``offsets[i]`` is the first stacked row of ``tables[i]``; ``rows`` the stacked total;
    the array is ``(num_cores * rows_per_core, dim)``.
    """

    name: str
    tables: tuple
    offsets: tuple
    dim: int
    optimizer: OptimizerSpec
    dtype: torch.dtype
    num_cores: int

    @property
    def rows(self) -> int:
        return self.offsets[-1] + self.tables[-1].num_embeddings

    @property
    def rows_per_core(self) -> int:
        return -(-self.rows // self.num_cores)

    @property
    def physical_rows(self) -> int:
        return self.num_cores * self.rows_per_core

    def offset_of(self, table_name: str) -> int:
        for t, o in zip(self.tables, self.offsets):
            if t.name == table_name:
                return o
        raise KeyError(f"table {table_name!r} is not in stack {self.name!r}")

    def physical_rows_of(self, table_name: str) -> np.ndarray:
        """Physical row (in the stacked array) of each row of ``table_name``, in order."""
        t = next(t for t in self.tables if t.name == table_name)
        return physical_rows(self.offset_of(table_name) + np.arange(t.num_embeddings, dtype=np.int64),
                             self.num_cores, self.rows_per_core)


def physical_rows(stacked_ids, num_cores: int, rows_per_core: int):
    """Stacked row ``g`` -> its row in the sharded array: core ``g % n``, local row ``g // n``."""
    return (stacked_ids % num_cores) * rows_per_core + stacked_ids // num_cores


def stack_tables(tables: Sequence[TableSpec], num_cores: int, default_optimizer: Optional[OptimizerSpec] = None,
                 stack: bool = True) -> list:
    """Group ``tables`` into :class:`StackedTable` s: tables of the same width, dtype, optimizer and
    pooled-ness share one stack (in the order given) when ``stack``; otherwise one stack each."""
    if not isinstance(num_cores, int) or num_cores < 1:
        raise ValueError(f"num_cores must be a positive integer, not {num_cores!r}")
    default_optimizer = default_optimizer or OptimizerSpec()
    names = set()
    groups: dict = {}
    for t in tables:
        if not isinstance(t, TableSpec):
            raise TypeError(f"stack_tables expects TableSpec, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"duplicate table name {t.name!r}")
        names.add(t.name)
        opt = t.optimizer or default_optimizer
        key = (t.embedding_dim, t.dtype, opt, t.pooled) if stack else (t.name,)
        groups.setdefault(key, []).append((t, opt))
    out = []
    for members in groups.values():
        specs = tuple(m[0] for m in members)
        offs, acc = [], 0
        for t in specs:
            offs.append(acc)
            acc += t.num_embeddings
        name = specs[0].name if len(specs) == 1 else "stack_" + "_".join(t.name for t in specs)
        out.append(StackedTable(name, specs, tuple(offs), specs[0].embedding_dim, members[0][1], specs[0].dtype,
                                num_cores))
    return out
