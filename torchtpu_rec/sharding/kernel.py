"""The compute kernel of one shard on tpu: TorchRec's lookup modules, with the tables on tpu.

TorchRec's shardings build one ``GroupedPooledEmbeddingsLookup`` (EmbeddingBagCollection) or
``GroupedEmbeddingsLookup`` (EmbeddingCollection) per sharding type and rank, which instantiates one
"batched" kernel per group of tables (``_create_embedding_kernel``, keyed on the compute kernel). Those
kernels are fbgemm TBEs, which run on CPU/CUDA/MTIA only. The subclasses here override that one factory
method and return :class:`TPUBatchedEmbeddingBag` / :class:`TPUBatchedEmbedding`, which keep the group's
tables in ONE flat tpu parameter (fbgemm's own layout, so TorchRec's ``TableBatchedEmbeddingSlice``,
state_dict and ShardedTensor machinery work unchanged) and run the lookup as one jitted JAX function:

* the ids arrive as host tensors (the input dist keeps the KJT on the host, where SparseCore's
  preprocessing also runs); they are turned into fixed-size (power-of-two bucketed) gather/segment
  buffers on the host, so a training loop compiles a handful of executables, not one per batch;
* forward = gather rows + (weighted) segment sum (pooled) or plain gather (sequence);
* backward = the same function's VJP, producing the dense gradient of the flat table (DENSE kernel,
  trained by any torch optimizer), or, for the FUSED kernel, the optimizer update is applied to the
  table inside the backward (SGD / Adagrad / row-wise Adagrad / Adam), as SparseCore and fbgemm do,
  and no gradient is handed to autograd.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import torchtpu
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.distributed.utils import append_prefix
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

TPU_COMPUTE_KERNELS = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value)


def _bucket(n: int, minimum: int = 16) -> int:
    """Padded length of n id slots: the next power of two (bounded executable count)."""
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


# ----------------------------------------------------------------------------------------------------
# host-side preprocessing: KJT (values/offsets, feature-major) -> fixed-size gather/segment buffers
# ----------------------------------------------------------------------------------------------------

class _HostBatch:
    """Flat gather indices into the group's table, their segment (bag) and weight, padded to a bucket."""

    __slots__ = ("base", "rowdim", "seg", "psw", "n", "padded", "B", "lengths")


def _host_batch(features: KeyedJaggedTensor, feature_table: List[int], table_offsets: List[int],
                table_rows: List[int], table_dims: List[int], feature_names: List[str],
                with_weights: bool) -> _HostBatch:
    if features.variable_stride_per_key():
        raise NotImplementedError("torchtpu_rec: variable batch size per feature (VBE) is not supported on tpu")
    values = features.values()
    if values.device.type != "cpu":
        values = values.cpu()
    lengths = features.lengths()
    if lengths.device.type != "cpu":
        lengths = lengths.cpu()
    ids = values.numpy().astype(np.int64, copy=False)
    lens = lengths.numpy().astype(np.int64, copy=False)
    F = len(feature_table)
    B = features.stride() if F else 0
    if lens.size != F * B:
        raise ValueError(f"torchtpu_rec: KJT has {lens.size} lengths for {F} features x batch {B}")
    n = int(ids.size)
    seg = np.repeat(np.arange(F * B, dtype=np.int32), lens)
    feat = seg // max(B, 1)
    ftab = np.asarray(feature_table, dtype=np.int64)[feat] if n else np.zeros(0, np.int64)
    rows = np.asarray(table_rows, dtype=np.int64)[ftab] if n else np.zeros(0, np.int64)
    bad = (ids < 0) | (ids >= rows)
    if bad.any():
        i = int(np.argmax(bad))
        fname = feature_names[int(feat[i])]
        raise IndexError(
            f"torchtpu_rec: id {int(ids[i])} of feature '{fname}' is out of range for its table shard "
            f"({int(rows[i])} rows)")
    dims = np.asarray(table_dims, dtype=np.int64)[ftab] if n else np.zeros(0, np.int64)
    base = np.asarray(table_offsets, dtype=np.int64)[ftab] + ids * dims if n else np.zeros(0, np.int64)
    padded = _bucket(n)
    hb = _HostBatch()
    hb.n, hb.padded, hb.B = n, padded, B
    hb.base = np.zeros(padded, np.int64)
    hb.base[:n] = base
    hb.rowdim = np.zeros(padded, np.int32)
    hb.rowdim[:n] = dims
    hb.seg = np.full(padded, F * B, np.int32)  # padding goes to a dropped segment
    hb.seg[:n] = seg
    hb.psw = np.zeros(padded, np.float32)
    if with_weights and features.weights_or_none() is not None:
        w = features.weights()
        w = w.detach().cpu().numpy() if w.device.type != "cpu" else w.detach().numpy()
        hb.psw[:n] = w
    else:
        hb.psw[:n] = 1.0
    hb.lengths = lens
    return hb


# ----------------------------------------------------------------------------------------------------
# the jitted lookups
# ----------------------------------------------------------------------------------------------------

def _gather_rows(flat, base, rowdim, maxd):
    """rows[e, j] = flat[base[e] + j] for j < rowdim[e], else 0."""
    j = jnp.arange(maxd, dtype=base.dtype)
    mask = j[None, :] < rowdim[:, None]
    idx = jnp.where(mask, base[:, None] + j[None, :], 0)
    return jnp.where(mask, flat[idx], 0).astype(flat.dtype)


@functools.partial(jax.jit, static_argnames=("B", "dims", "mean"))
def _pooled_fwd(flat, base, rowdim, seg, psw, B, dims, mean):
    F = len(dims)
    maxd = max(dims)
    rows = _gather_rows(flat, base, rowdim, maxd) * psw[:, None].astype(flat.dtype)
    pooled = jax.ops.segment_sum(rows, seg, num_segments=F * B + 1)[: F * B]
    if mean:
        cnt = jax.ops.segment_sum((rowdim > 0).astype(flat.dtype), seg, num_segments=F * B + 1)[: F * B]
        pooled = pooled / jnp.maximum(cnt, 1)[:, None]
    pooled = pooled.reshape(F, B, maxd)
    return jnp.concatenate([pooled[k, :, : dims[k]] for k in range(F)], axis=1)


@functools.partial(jax.jit, static_argnames=("B", "dims", "mean", "size"))
def _pooled_bwd(grad, base, rowdim, seg, psw, B, dims, mean, size):
    """Gradient wrt the flat table and, per id slot, wrt its row (for the fused optimizers)."""
    F = len(dims)
    maxd = max(dims)
    cols = np.cumsum((0,) + tuple(dims))
    g = jnp.stack([jnp.pad(grad[:, cols[k]: cols[k + 1]], ((0, 0), (0, maxd - dims[k]))) for k in range(F)])
    g = g.reshape(F * B, maxd)
    if mean:
        cnt = jax.ops.segment_sum((rowdim > 0).astype(grad.dtype), seg, num_segments=F * B + 1)[: F * B]
        g = g / jnp.maximum(cnt, 1)[:, None]
    g = jnp.concatenate([g, jnp.zeros((1, maxd), g.dtype)])
    j = jnp.arange(maxd, dtype=base.dtype)
    mask = j[None, :] < rowdim[:, None]
    row_grads = jnp.where(mask, g[seg] * psw[:, None].astype(g.dtype), 0)
    idx = jnp.where(mask, base[:, None] + j[None, :], size)  # masked slots scatter out of range (dropped)
    dense = jnp.zeros((size,), grad.dtype).at[idx].add(row_grads, mode="drop")
    return dense


@functools.partial(jax.jit, static_argnames=("dims",))
def _seq_fwd(flat, base, rowdim, dims):
    return _gather_rows(flat, base, rowdim, max(dims))


@functools.partial(jax.jit, static_argnames=("size",))
def _seq_bwd(grad_rows, base, rowdim, size):
    maxd = grad_rows.shape[1]
    j = jnp.arange(maxd, dtype=base.dtype)
    mask = j[None, :] < rowdim[:, None]
    idx = jnp.where(mask, base[:, None] + j[None, :], size)
    return jnp.zeros((size,), grad_rows.dtype).at[idx].add(jnp.where(mask, grad_rows, 0), mode="drop")


# ----------------------------------------------------------------------------------------------------
# fused optimizers (applied to the flat table inside the backward)
# ----------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("kind",), donate_argnums=(0, 2, 3))
def _fused_update(flat, grad, m, v, lr, eps, beta1, beta2, wd, step, rowgroup, kind):
    """One optimizer step on the rows the batch touched (rows with zero grad keep their state)."""
    touched = grad != 0
    g = grad + wd * flat
    if kind == "sgd":
        return flat - lr * jnp.where(touched, g, 0), m, v
    if kind == "adagrad":
        m = m + jnp.where(touched, g * g, 0)
        return flat - lr * jnp.where(touched, g / (jnp.sqrt(m) + eps), 0), m, v
    if kind == "rowwise_adagrad":
        # one accumulator per row: mean of g^2 over the row's elements (fbgemm's EXACT_ROWWISE_ADAGRAD)
        sq = jax.ops.segment_sum(g * g, rowgroup[0], num_segments=rowgroup[1].shape[0])
        rows_touched = jax.ops.segment_max(touched.astype(jnp.int32), rowgroup[0],
                                           num_segments=rowgroup[1].shape[0]) > 0
        m_row = v + jnp.where(rows_touched, sq / rowgroup[1], 0)
        scale = lr / (jnp.sqrt(m_row) + eps)
        return flat - jnp.where(touched, scale[rowgroup[0]] * g, 0), m, m_row
    if kind == "adam":
        m = jnp.where(touched, beta1 * m + (1 - beta1) * g, m)
        v = jnp.where(touched, beta2 * v + (1 - beta2) * g * g, v)
        mhat = m / (1 - beta1 ** step)
        vhat = v / (1 - beta2 ** step)
        return flat - jnp.where(touched, lr * mhat / (jnp.sqrt(vhat) + eps), 0), m, v
    raise ValueError(kind)


_OPT_NAMES = {
    "sgd": "sgd", "exact_sgd": "sgd",
    "adagrad": "adagrad", "exact_adagrad": "adagrad",
    "rowwise_adagrad": "rowwise_adagrad", "exact_rowwise_adagrad": "rowwise_adagrad",
    "adam": "adam",
}


def _optimizer_kind(fused_params: Dict[str, Any]) -> str:
    opt = fused_params.get("optimizer", "sgd")
    name = getattr(opt, "name", None) or str(opt)
    name = name.split(".")[-1].lower()
    if name not in _OPT_NAMES:
        raise ValueError(f"torchtpu_rec: fused optimizer '{name}' is not supported on tpu "
                         f"(supported: {sorted(set(_OPT_NAMES))})")
    return _OPT_NAMES[name]


class _TPUFusedState:
    """Optimizer state of one kernel's flat table; updated in the backward."""

    def __init__(self, kind: str, size: int, dims_rows: List[Tuple[int, int]], fused_params: Dict[str, Any]):
        self.kind = kind
        self.lr = float(fused_params.get("learning_rate", 0.01))
        self.eps = float(fused_params.get("eps", 1e-8 if kind == "adam" else 1e-10))
        self.beta1 = float(fused_params.get("beta1", 0.9))
        self.beta2 = float(fused_params.get("beta2", 0.999))
        self.wd = float(fused_params.get("weight_decay", 0.0))
        self.step = 0
        init_acc = float(fused_params.get("initial_accumulator_value", 0.0))
        self.m = jnp.full((size,), init_acc if kind == "adagrad" else 0.0, jnp.float32)
        # per-element row id and per-row element count (row-wise adagrad)
        row_of = [np.repeat(np.arange(r, dtype=np.int32), d) for r, d in dims_rows]
        offs = np.cumsum([0] + [r for r, _ in dims_rows])
        row_of = np.concatenate([a + o for a, o in zip(row_of, offs)]) if row_of else np.zeros(0, np.int32)
        nrows = int(offs[-1])
        cnt = np.concatenate([np.full(r, d, np.float32) for r, d in dims_rows]) if dims_rows else np.zeros(0, np.float32)
        self.rowgroup = (jnp.asarray(row_of), jnp.asarray(np.maximum(cnt, 1)))
        self.v = jnp.zeros((nrows,) if kind == "rowwise_adagrad" else (size,), jnp.float32)
        if kind == "rowwise_adagrad":
            self.v = self.v + init_acc

    def apply(self, flat, grad):
        self.step += 1
        flat, self.m, self.v = _fused_update(flat, grad, self.m, self.v, self.lr, self.eps, self.beta1,
                                             self.beta2, self.wd, float(self.step), self.rowgroup, self.kind)
        return flat


def _write_flat(param: torch.Tensor, value) -> None:
    """Replace the bytes of tpu parameter ``param`` with jax array ``value`` (in place, no autograd)."""
    with torch.no_grad():
        param.copy_(torchtpu.from_jax(value))


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights, hb, dims, mean, fused):
        flat = torchtpu.to_jax(weights.detach())
        arrs = (jnp.asarray(hb.base), jnp.asarray(hb.rowdim), jnp.asarray(hb.seg), jnp.asarray(hb.psw))
        out = _pooled_fwd(flat, *arrs, B=hb.B, dims=dims, mean=mean)
        ctx.arrs, ctx.B, ctx.dims, ctx.mean, ctx.fused, ctx.size = arrs, hb.B, dims, mean, fused, flat.size
        ctx.weights = weights
        return torchtpu.from_jax(out)

    @staticmethod
    def backward(ctx, grad_out):
        g = torchtpu.to_jax(grad_out.contiguous())
        dense = _pooled_bwd(g, *ctx.arrs, B=ctx.B, dims=ctx.dims, mean=ctx.mean, size=ctx.size)
        if ctx.fused is not None:
            w = ctx.weights
            _write_flat(w, ctx.fused.apply(torchtpu.to_jax(w.detach()), dense))
            return None, None, None, None, None
        return torchtpu.from_jax(dense), None, None, None, None


class _SequenceLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights, hb, dims, fused):
        flat = torchtpu.to_jax(weights.detach())
        arrs = (jnp.asarray(hb.base), jnp.asarray(hb.rowdim))
        rows = _seq_fwd(flat, *arrs, dims=dims)[: hb.n]
        ctx.arrs, ctx.fused, ctx.size, ctx.padded, ctx.weights = arrs, fused, flat.size, hb.padded, weights
        return torchtpu.from_jax(rows)

    @staticmethod
    def backward(ctx, grad_rows):
        g = torchtpu.to_jax(grad_rows.contiguous())
        g = jnp.pad(g, ((0, ctx.padded - g.shape[0]), (0, 0)))
        dense = _seq_bwd(g, *ctx.arrs, size=ctx.size)
        if ctx.fused is not None:
            w = ctx.weights
            _write_flat(w, ctx.fused.apply(torchtpu.to_jax(w.detach()), dense))
            return None, None, None, None
        return torchtpu.from_jax(dense), None, None, None


# ----------------------------------------------------------------------------------------------------
# the table store (what fbgemm's TBE "emb_module" is for TorchRec's kernels)
# ----------------------------------------------------------------------------------------------------

class TPUTableBatchedEmbeddings(nn.Module):
    """The tables of one group in one flat tpu parameter ``weights`` (fbgemm's layout)."""

    def __init__(self, local_rows: List[int], local_cols: List[int], feature_table_map: List[int],
                 feature_names: List[str], device: torch.device, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embedding_specs = list(zip(local_rows, local_cols))
        sizes = [r * c for r, c in self.embedding_specs]
        self.weights_physical_offsets = [int(x) for x in np.cumsum([0] + sizes[:-1])] if sizes else []
        self.feature_table_map = list(feature_table_map)
        self.feature_names = list(feature_names)
        total = int(sum(sizes))
        self.weights = nn.Parameter(torch.zeros(total, dtype=dtype, device=device))

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return [self.weights.detach()[o: o + r * c].view(r, c)
                for o, (r, c) in zip(self.weights_physical_offsets, self.embedding_specs)]

    def host_batch(self, features: KeyedJaggedTensor, with_weights: bool) -> _HostBatch:
        return _host_batch(features, self.feature_table_map, self.weights_physical_offsets,
                           [r for r, _ in self.embedding_specs], [c for _, c in self.embedding_specs],
                           self.feature_names, with_weights)

    def feature_dims(self) -> Tuple[int, ...]:
        return tuple(self.embedding_specs[t][1] for t in self.feature_table_map)


def _table_slices(store: TPUTableBatchedEmbeddings, config: GroupedEmbeddingConfig,
                  table_name_to_count: Dict[str, int]) -> Dict[str, TableBatchedEmbeddingSlice]:
    out = {}
    counts = dict(table_name_to_count)
    for t_idx, (rows, dim) in enumerate(store.embedding_specs):
        name = config.embedding_tables[t_idx].name
        if name not in counts:
            continue
        n = counts.pop(name)
        off = store.weights_physical_offsets[t_idx]
        out[name] = TableBatchedEmbeddingSlice(data=store.weights, start_offset=off,
                                               end_offset=off + n * rows * dim, num_embeddings=-1,
                                               embedding_dim=dim)
    return out


class TPUFusedOptimizer(KeyedOptimizer):
    """TorchRec's view of a fused kernel's optimizer: state lives with the kernel, step() is a no-op
    (the update happened in the backward), zero_grad() has nothing to clear."""

    def __init__(self, params: Dict[str, torch.Tensor], fused: _TPUFusedState):
        self._fused = fused
        state = {p: {} for p in params.values()}
        super().__init__(params, state, [{"params": list(params.values()), "lr": fused.lr}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def step(self, closure: Any = None) -> None:
        # apply lr changes made by schedulers through param_groups
        self._fused.lr = float(self.param_groups[0]["lr"])


class _TPUKernelMixin:
    """Shared setup of the pooled and sequence kernels."""

    def _setup_tpu(self, config: GroupedEmbeddingConfig, device: Optional[torch.device]) -> None:
        device = device if device is not None else torch.device("tpu")
        if device.type not in ("tpu", "meta"):
            raise ValueError(f"torchtpu_rec: the tpu kernel needs a tpu device, got {device}")
        names = [f for t in config.embedding_tables for f in t.feature_names]
        self._emb_module = TPUTableBatchedEmbeddings(self._local_rows, self._local_cols, self._feature_table_map,
                                                     names, device)
        self._param_per_table = _table_slices(self._emb_module, config, self.table_name_to_count)
        kernel = config.compute_kernel
        self._fused: Optional[_TPUFusedState] = None
        if kernel == EmbeddingComputeKernel.FUSED:
            fp = dict(config.fused_params or {})
            self._fused = _TPUFusedState(_optimizer_kind(fp), self._emb_module.weights.numel(),
                                         list(self._emb_module.embedding_specs), fp)
            self._emb_module.weights.requires_grad_(True)
            params = {}
            for t in config.embedding_tables:
                params[f"{t.name}.weight"] = self._param_per_table[t.name]
            self._fused_optimizer = TPUFusedOptimizer(params, self._fused)
            for p in self._param_per_table.values():
                p._in_backward_optimizers = [self._fused_optimizer]  # noqa: SLF001 (TorchRec's convention)
        elif kernel != EmbeddingComputeKernel.DENSE:
            raise ValueError(f"torchtpu_rec: compute kernel '{kernel.value}' is not supported on tpu "
                             f"(use one of {TPU_COMPUTE_KERNELS})")
        if device.type != "meta":
            self.init_parameters()

    @property
    def emb_module(self) -> TPUTableBatchedEmbeddings:
        return self._emb_module

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        if self._fused is None:
            raise AttributeError("fused_optimizer: this tpu kernel is DENSE (trained by the model's optimizer)")
        return self._fused_optimizer

    def init_parameters(self) -> None:
        # uniform(init_min, init_max) per table, drawn on the host then written once
        with torch.no_grad():
            for rows, dim, lo, hi, param in zip(self._local_rows, self._local_cols, self._weight_init_mins,
                                                self._weight_init_maxs, self.split_embedding_weights()):
                param.copy_(torch.empty(rows, dim).uniform_(lo, hi))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        if self._fused is not None:
            # fused tables are trained in the backward: the model's optimizer must not see them
            yield from ()
            return
        combined = "/".join(c.name for c in self._config.embedding_tables)
        yield append_prefix(prefix, f"{combined}.weight"), self._emb_module.weights

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from ()


class TPUBatchedEmbeddingBag(_TPUKernelMixin, BaseBatchedEmbeddingBag[torch.Tensor]):
    """Pooled lookup of one group of tables (one shard's tables of one sharding type) on tpu."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None) -> None:
        super().__init__(config, pg, device, sharding_type)
        self._mean = self._pooling.name == "MEAN"
        self._setup_tpu(config, device)

    def forward(self, features: KeyedJaggedTensor, vbe_output=None, vbe_output_offsets=None) -> torch.Tensor:
        store = self._emb_module
        dims = store.feature_dims()
        if not dims:
            return torch.empty(features.stride(), 0, device=store.weights.device)
        hb = store.host_batch(features, with_weights=True)
        return _PooledLookup.apply(store.weights, hb, dims, self._mean, self._fused)


class TPUBatchedEmbedding(_TPUKernelMixin, BaseBatchedEmbedding[torch.Tensor]):
    """Sequence (unpooled) lookup of one group of tables on tpu: one row per id."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(config, pg, device)
        self._setup_tpu(config, device)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        store = self._emb_module
        dims = store.feature_dims()
        if len(set(dims)) > 1:
            raise ValueError("torchtpu_rec: tables of one EmbeddingCollection group must share embedding_dim")
        hb = store.host_batch(features, with_weights=False)
        return _SequenceLookup.apply(store.weights, hb, dims, self._fused)


def _check_kernel(config: GroupedEmbeddingConfig) -> None:
    if config.compute_kernel.value not in TPU_COMPUTE_KERNELS:
        raise ValueError(f"torchtpu_rec: compute kernel '{config.compute_kernel.value}' of tables "
                         f"{[t.name for t in config.embedding_tables]} is not supported on tpu "
                         f"(use one of {TPU_COMPUTE_KERNELS})")


class TPUGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup with tpu kernels instead of fbgemm TBEs."""

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        _check_kernel(config)
        return TPUBatchedEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type)


class TPUGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """TorchRec's sequence lookup with tpu kernels instead of fbgemm TBEs."""

    def _create_embedding_kernel(self, config, pg, device, env=None):
        _check_kernel(config)
        return TPUBatchedEmbedding(config=config, pg=pg, device=device)
