"""Gathers and scatters: index/index_put (advanced indexing), index_select, gather,
scatter/scatter_add/scatter_reduce, index_add/index_copy/index_fill/index_reduce,
masked_scatter, take/put, embedding, and the data-dependent ops whose output
shape depends on values (nonzero, masked_select, unique*, repeat_interleave).

Indices are wrapped where PyTorch accepts negative indices (advanced indexing,
take, put, index_fill). Index values PyTorch would reject as out of range are
checked on the device (``runtime/checks.check_index``): the error, PyTorch CPU's
message, is raised at the next host wait naming the op and the user line; the
op itself reads a fill value (NaN for floats) and a scatter drops the value,
never clamping to a valid element. Index tensors on the CPU in advanced indexing
are checked at once, as PyTorch does. Shape and dtype errors are always
PyTorch's, raised before JAX sees the input.

Data-dependent ops are ``@impl`` kernels that read what they need on the host
(the mask, the unique values) and build the result on the device.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..base import dtypes
from ..base.frames import warn_at_user_line, warn_once_at_user_line
from ..dispatch import fallback
from ..dispatch.kernel import MIXED_DEVICE, Kernel
from ..dispatch.lowering import Lowering, impl, lower
from ..runtime import layout, storage
from ..runtime.checks import check_index
from ..runtime.storage import from_jax_array, logical_value

aten = torch.ops.aten
_I64 = jnp.int64


# ---------------------------------------------------------------- helpers
def _wrap(idx, n):
    idx = idx.astype(_I64)
    return jnp.where(idx < 0, idx + n, idx)


def _along(x, dim, index):
    """Index tuple selecting ``index`` along ``dim`` (all of every other dim)."""
    return (slice(None),) * dim + (index,)


def _checked_coords(x, index, dim):
    """``_coords`` of a gather or scatter, its index checked on the device against ``x``."""
    d = _dim(x, dim)
    check_index(index, x.shape[d], _bounds_message(d))
    return _coords(index, d)


def _coords(index, dim):
    """Index tuple for gather/scatter: ``index`` along ``dim``, position elsewhere."""
    return tuple(
        index.astype(_I64) if d == dim else lax.broadcasted_iota(_I64, index.shape, d)
        for d in range(index.ndim)
    )


def _as1d(x):
    return x.reshape(1) if x.ndim == 0 else x


def _dim(x, dim):
    return dim % max(x.ndim, 1)


_OUT_OF_SELF = "index out of range in self"  # CPU's message for index_select, index_add, embedding


def _bounds_message(dim):
    return "index {value} is out of bounds for dimension " + str(dim) + " with size {size}"


def _checked_along(x, dim, index, message=_OUT_OF_SELF):
    """``index`` (flattened, int64) checked on the device against ``x``'s size along ``dim``."""
    index = index.reshape(-1).astype(_I64)
    check_index(index, x.shape[dim], message)
    return index


def _bool_safe(x, fn):
    """Run an accumulating scatter on a bool tensor through int8 (True+True stays True)."""
    if x.dtype == jnp.bool_:
        return fn(x.astype(jnp.int8)) != 0
    return fn(x)


# ---------------------------------------------------------------- gather family
def _index_select_meta(x, dim, index):
    # CPU checks the index before the meta kernel would (which lets both through)
    if index.dim() > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    if index.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
    if x.dim() and x.shape[dim] == 0 and index.numel():
        raise RuntimeError("index_select(): self indexing axis dim should be positive")
    return aten.index_select.default(x, dim, index)


@lower("index_select", static=("dim",), meta=_index_select_meta)
def _index_select(x, dim, index):
    if x.ndim == 0:
        x1 = _as1d(x)
        return x1.at[_checked_along(x1, 0, index)].get(mode="fill").reshape(index.shape if index.ndim else ())
    d = _dim(x, dim)
    return x.at[_along(x, d, _checked_along(x, d, index))].get(mode="fill")


@lower("gather", static=("dim", "sparse_grad"))
def _gather(x, dim, index, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)  # PyTorch allows any shape for an empty index
    x1, i1 = _as1d(x), _as1d(index)
    out = x1.at[_checked_coords(x1, i1, dim)].get(mode="fill")
    return out.reshape(index.shape)


_TAKE_MESSAGE = "out of range: tried to access index {value} on a tensor of {size} elements."


@lower("take")
def _take(x, index):
    flat = x.reshape(-1)
    check_index(index, flat.shape[0], _TAKE_MESSAGE, negative=True)
    return flat.at[_wrap(index, flat.shape[0])].get(mode="fill")


@lower("embedding", static=("padding_idx", "scale_grad_by_freq", "sparse"))
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    check_index(indices, weight.shape[0], _OUT_OF_SELF)
    return weight.at[indices.astype(_I64)].get(mode="fill")


# ---------------------------------------------------------------- scatter family
def _scatter_src(index, src):
    """The part of ``src`` that ``index`` addresses (src may be larger than index)."""
    if src.ndim == 0 or index.ndim == 0:
        return jnp.broadcast_to(src.reshape(()) if src.size == 1 else src, index.shape)
    return src[tuple(slice(0, n) for n in index.shape)]


def _scatter(x, dim, index, src, reduce=None):
    x1, i1 = _as1d(x), _as1d(index)
    c = _checked_coords(x1, i1, dim)
    s = _scatter_src(i1, jnp.asarray(src) if jnp.ndim(src) == 0 else _as1d(src)).astype(x.dtype)
    if reduce is None:
        out = x1.at[c].set(s, mode="drop")
    elif reduce == "add":
        out = _bool_safe(x1, lambda b: b.at[c].add(s.astype(b.dtype), mode="drop"))
    elif reduce == "multiply":
        out = _bool_safe(x1, lambda b: b.at[c].multiply(s.astype(b.dtype), mode="drop"))
    else:
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
    return out.reshape(x.shape)


@lower("scatter.src", static=("dim",))
def _scatter_src_op(x, dim, index, src):
    return _scatter(x, dim, index, src)


@lower("scatter.value", static=("dim",))
def _scatter_value(x, dim, index, value):
    return _scatter(x, dim, index, value)


_SCATTER_REDUCE_DEPRECATED = (
    "The reduce argument of torch.scatter with Tensor src is deprecated and will be removed in a future PyTorch "
    "release. Use torch.scatter_reduce instead for more reduction options.")


@lower("scatter.reduce", static=("dim", "reduce"),
       warn=lambda *args, inplace=False: warn_once_at_user_line(_SCATTER_REDUCE_DEPRECATED))
def _scatter_reduce_legacy(x, dim, index, src, reduce):
    return _scatter(x, dim, index, src, reduce)


@lower("scatter.value_reduce", static=("dim", "reduce"))
def _scatter_value_reduce(x, dim, index, value, reduce):
    return _scatter(x, dim, index, value, reduce)


@lower("scatter_add", static=("dim",))
def _scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, "add")


def _identity(dtype, reduce):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(reduce == "amin")
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


def _reduce_into(x, where, src, reduce, include_self):
    """Scatter-reduce ``src`` into ``x`` at index tuple ``where`` (PyTorch's scatter_reduce rules)."""
    s = src.astype(x.dtype)
    base = x if include_self else x.at[where].set(_identity(x.dtype, reduce), mode="drop")
    if reduce in ("sum", "mean"):
        out = _bool_safe(base, lambda b: b.at[where].add(s.astype(b.dtype), mode="drop"))
        if reduce == "mean":
            cnt = jnp.zeros(x.shape, _I64).at[where].add(jnp.ones(s.shape, _I64), mode="drop")
            cnt = cnt + (1 if include_self else 0)
            safe = jnp.maximum(cnt, 1)
            if jnp.issubdtype(x.dtype, jnp.inexact):
                avg = out / safe.astype(out.dtype)
            else:
                avg = jnp.floor_divide(out, safe.astype(out.dtype))
            out = jnp.where(cnt > 0, avg, out).astype(x.dtype)
        return out
    if reduce == "prod":
        return _bool_safe(base, lambda b: b.at[where].multiply(s.astype(b.dtype), mode="drop"))
    if reduce == "amax":
        return base.at[where].max(s, mode="drop")
    if reduce == "amin":
        return base.at[where].min(s, mode="drop")
    raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")


@lower("scatter_reduce.two", static=("dim", "reduce", "include_self"))
def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    x1, i1 = _as1d(x), _as1d(index)
    c = _checked_coords(x1, i1, dim)
    s = _scatter_src(i1, _as1d(src))
    return _reduce_into(x1, c, s, reduce, include_self).reshape(x.shape)


@lower("index_reduce", static=("dim", "reduce", "include_self"))
def _index_reduce(x, dim, index, source, reduce, include_self=True):
    x1 = _as1d(x)
    d = _dim(x1, dim)
    where = _along(x1, d, _checked_along(x1, d, index))
    return _reduce_into(x1, where, _as1d(source), reduce, include_self).reshape(x.shape)


@lower("index_add", static=("dim",))
def _index_add(x, dim, index, source, alpha=1):
    x1 = _as1d(x)
    d = _dim(x1, dim)
    where = _along(x1, d, _checked_along(x1, d, index))
    s = _as1d(source)
    if x.dtype == jnp.bool_:
        s = s & (jnp.asarray(alpha) != 0)
    else:
        s = (s * alpha).astype(x.dtype) if not isinstance(alpha, int) or alpha != 1 else s.astype(x.dtype)
    return _bool_safe(x1, lambda b: b.at[where].add(s.astype(b.dtype), mode="drop")).reshape(x.shape)


def _index_copy_meta(x, dim, index, source):
    if index.dtype != torch.int64:  # CPU's check, which the meta kernel leaves out
        raise RuntimeError(f"index_copy_(): Expected a long tensor for index, but got "
                           f"{dtypes.scalar_type_name(index.dtype)}")
    return aten.index_copy.default(x, dim, index, source)


@lower("index_copy", static=("dim",), meta=_index_copy_meta)
def _index_copy(x, dim, index, source):
    x1 = _as1d(x)
    d = _dim(x1, dim)
    where = _along(x1, d, _checked_along(x1, d, index, "index_copy_(): " + _bounds_message(d)))
    return x1.at[where].set(_as1d(source).astype(x.dtype), mode="drop").reshape(x.shape)


def _index_fill(x, dim, index, value):
    x1 = _as1d(x)
    d = _dim(x1, dim)
    check_index(index, x1.shape[d], _bounds_message(d), negative=True)
    where = _along(x1, d, _wrap(index.reshape(-1), x1.shape[d]))
    v = jnp.asarray(value)
    v = (v != 0) if x.dtype == jnp.bool_ else v.astype(x.dtype)
    return x1.at[where].set(v, mode="drop").reshape(x.shape)


def _warn_expanded(op, example):
    message = (f"Use of {op}_ on expanded tensors is deprecated. Please clone() the tensor before performing this "
               f"operation. This also applies to advanced indexing e.g. {example}")

    def warn(x, *args, inplace=True):
        if inplace and layout.has_internal_overlap(x.shape, x.stride()):
            warn_at_user_line(message)

    return warn


_index_fill_expanded = _warn_expanded("index_fill", "tensor[mask] = scalar")
_index_put_expanded = _warn_expanded("index_put", "tensor[indices] = tensor")


@lower("index_fill.int_Scalar", static=("dim",), warn=_index_fill_expanded)
def _index_fill_s(x, dim, index, value):
    return _index_fill(x, dim, index, value)


@lower("index_fill.int_Tensor", static=("dim",), warn=_index_fill_expanded)
def _index_fill_t(x, dim, index, value):
    return _index_fill(x, dim, index, value)


def _masked_scatter_meta(x, mask, source):
    if mask.dtype == torch.uint8:  # the meta kernel takes it; CPU (which the kernel then runs) warns and refuses it
        raise RuntimeError("masked_scatter_ only supports boolean masks, but got mask with dtype Byte")
    return aten.masked_scatter.default(x, mask, source)


@lower("masked_scatter", meta=_masked_scatter_meta)
def _masked_scatter(x, mask, source):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    xf = jnp.broadcast_to(x, shape).reshape(-1)
    mf = jnp.broadcast_to(mask, shape).reshape(-1)
    pos = jnp.cumsum(mf.astype(_I64)) - 1  # k-th True takes source's k-th element
    vals = source.reshape(-1).at[pos].get(mode="fill").astype(x.dtype)
    return jnp.where(mf, vals, xf).reshape(shape)


@lower("put", static=("accumulate",))
def _put(x, index, source, accumulate=False):
    flat = x.reshape(-1)
    check_index(index, flat.shape[0], _TAKE_MESSAGE, negative=True)
    i = _wrap(index.reshape(-1), flat.shape[0])
    s = source.reshape(-1).astype(x.dtype)
    if accumulate:
        out = _bool_safe(flat, lambda b: b.at[i].add(s.astype(b.dtype), mode="drop"))
    else:
        out = flat.at[i].set(s, mode="drop")
    return out.reshape(x.shape)


@lower("nonzero_static", static=("size", "fill_value"))
def _nonzero_static(x, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), _I64)
    parts = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack([p.astype(_I64) for p in parts], axis=1)


# ---------------------------------------------------------------- advanced indexing (index / index_put)
def _index_tuple(x, indices):
    out = []
    k = 0  # CPU names the position among the indexed dims
    for i, ind in enumerate(indices):
        if ind is None:
            out.append(slice(None))
        else:
            check_index(ind, x.shape[i], _bounds_message(k), negative=True)
            out.append(_wrap(ind, x.shape[i]))
            k += 1
    return tuple(out)


def advanced_index(x, indices):
    if x.ndim == 0:
        raise IndexError("too many indices for tensor of dimension 0")
    return x.at[_index_tuple(x, indices)].get(mode="fill")


def advanced_index_put(x, indices, values, accumulate=False, unsafe=False):
    where = _index_tuple(x, indices)
    v = values.astype(x.dtype)
    if accumulate:
        return _bool_safe(x, lambda b: b.at[where].add(v.astype(b.dtype), mode="drop"))
    return x.at[where].set(v, mode="drop")


def _index_meta(x, indices):
    """PyTorch's meta for ``index``, with the checks CPU makes first (its types and messages)."""
    _check_index_shapes(x, indices)
    return aten.index.Tensor(x, indices)


def _index_put_meta(x, indices, values, accumulate=False, unsafe=False):
    """PyTorch's meta for ``index_put`` with the value checks CPU makes and the meta leaves out."""
    result = _index_meta(x, indices)
    if not _expandable(values.shape, result.shape):
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(result.shape)}")
    if values.dtype != x.dtype:
        raise RuntimeError(
            f"Index put requires the source and destination dtypes match, got {dtypes.scalar_type_name(x.dtype)} "
            f"for the destination and {dtypes.scalar_type_name(values.dtype)} for the source.")
    return aten.index_put.default(x, indices, values, accumulate)


def _expandable(shape, target) -> bool:
    """Can ``shape`` be expanded to ``target`` (PyTorch's is_expandable_to)?"""
    if len(shape) > len(target):
        return False
    return all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))


def _check_index_shapes(x, indices):
    shapes = [list(i.shape) for i in indices if i is not None]
    try:
        torch.broadcast_shapes(*[tuple(s) for s in shapes])
    except RuntimeError:
        raise IndexError("shape mismatch: indexing tensors could not be broadcast together with shapes "
                         + ", ".join(str(s) for s in shapes)) from None
    for d, i in enumerate(indices):
        if i is not None and x.shape[d] == 0 and i.numel() > 0:
            raise IndexError("index is out of bounds for dimension with size 0")


# private kernels: the @impl entry points below turn bool masks into long indices first
_INDEX = Kernel(aten.index.Tensor, Lowering("aten::index.Tensor", advanced_index, allow_cpu=True, meta=_index_meta))
_INDEX_PUT_LOW = Lowering("aten::index_put", advanced_index_put, static=("accumulate",), allow_cpu=True,
                          meta=_index_put_meta)
_INDEX_PUT = Kernel(aten.index_put.default, _INDEX_PUT_LOW)
_INDEX_PUT_ = Kernel(aten.index_put_.default, _INDEX_PUT_LOW, functional=aten.index_put.default)
_INDEX_PUT_IMPL_LOW = Lowering("aten::_index_put_impl", advanced_index_put, static=("accumulate", "unsafe"), allow_cpu=True,
                               meta=_index_put_meta)
_INDEX_PUT_IMPL_ = Kernel(aten._index_put_impl_.default, _INDEX_PUT_IMPL_LOW, functional=aten._index_put_impl.default)


class _Route(Exception):
    """Inputs this lowering does not take: run the op through the CPU fallback."""


def _host(t):
    return t.numpy() if t.device.type == "cpu" else storage.to_numpy_host(t)


_UINT8_MASK_DEPRECATED = "indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead."


def _expand_masks(x, indices):
    """PyTorch's expandTensors: a bool/uint8 mask becomes one long index per mask dim. Long index
    tensors on the CPU are checked against the sizes they index here, as PyTorch does (tpu ones
    on the device: ``_index_tuple``)."""
    out = []
    for idx in indices:
        if idx is not None and idx.dtype in (torch.bool, torch.uint8):
            if idx.dtype == torch.uint8:
                warn_at_user_line(_UINT8_MASK_DEPRECATED)
            if idx.dim() == 0:
                raise _Route  # x[True]-style 0-d masks add a dim: rare, left to the fallback
            pos = len(out)
            for j in range(idx.dim()):
                if pos + j >= x.dim() or idx.shape[j] != x.shape[pos + j]:
                    raise IndexError(
                        f"The shape of the mask {list(idx.shape)} at index {j} does not match the shape of "
                        f"the indexed tensor {list(x.shape)} at index {pos + j}"
                    )
            for a in np.nonzero(_host(idx)):
                out.append(from_jax_array(a.astype(np.int64)))
        else:
            if idx is not None and idx.dtype not in (torch.int64, torch.int32):
                raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
            out.append(idx)
    if len(out) > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()} (got {len(out)})")
    _check_index_shapes(x, out)
    k = 0  # CPU names the position among the indexed dims
    for d, idx in enumerate(out):
        if idx is None:
            continue
        if idx.device.type == "cpu":
            _check_bounds(_host(idx), x.shape[d], lambda v, n, k=k: IndexError(
                f"index {v} is out of bounds for dimension {k} with size {n}"))
        k += 1
    return out


def _check_bounds(idx, n, error, negative=True):
    """Raise ``error(value, n)`` for the first index in host array ``idx`` outside ``[-n, n)``
    (``[0, n)`` unless ``negative``)."""
    idx = np.asarray(idx).reshape(-1)
    bad = (idx >= n) | (idx < (-n if negative else 0))
    if bad.any():
        raise error(int(idx[np.argmax(bad)]), n)


def _check_operands_on_tpu(self, values=None):
    """Only the indices may be CPU tensors (as for cuda); a CPU ``self``, or CPU ``values`` that are not
    a 0-dim scalar, are refused as cuda refuses them, not moved silently."""
    for t in (self, values):
        if isinstance(t, torch.Tensor) and t.device.type != "tpu" and not (t is values and t.dim() == 0):
            raise RuntimeError(MIXED_DEVICE.format("tpu:0", t.device))


@impl("index.Tensor")
def _index(self, indices):
    if self.device.type != "tpu":
        raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                           f"({self.device})")
    try:
        ind = _expand_masks(self, indices)
    except _Route:
        return fallback.run_on_cpu(aten.index.Tensor, self, indices)
    return _INDEX(self, ind)


@impl("index_put")
def _index_put(self, indices, values, accumulate=False):
    _check_operands_on_tpu(self, values)
    try:
        ind = _expand_masks(self, indices)
    except _Route:
        return fallback.run_on_cpu(aten.index_put.default, self, indices, values, accumulate)
    return _INDEX_PUT(self, ind, values, accumulate)


@impl("index_put_")
def _index_put_(self, indices, values, accumulate=False):
    _check_operands_on_tpu(self, values)
    _index_put_expanded(self)
    try:
        ind = _expand_masks(self, indices)
    except _Route:
        return fallback.run_on_cpu(aten.index_put_.default, self, indices, values, accumulate)
    return _INDEX_PUT_(self, ind, values, accumulate)


@impl("_index_put_impl_")
def _index_put_impl_(self, indices, values, accumulate=False, unsafe=False):
    _check_operands_on_tpu(self, values)
    _index_put_expanded(self)
    try:
        ind = _expand_masks(self, indices)
    except _Route:
        return fallback.run_on_cpu(aten._index_put_impl_.default, self, indices, values, accumulate, unsafe)
    return _INDEX_PUT_IMPL_(self, ind, values, accumulate, unsafe)


# ---------------------------------------------------------------- data-dependent shapes (host reads)
def _tensor(arr, dtype):
    return from_jax_array(np.asarray(arr), dtype)


@impl("nonzero")
def _nonzero(self):
    m = _host(self)
    if m.ndim == 0:
        return _tensor(np.zeros((1 if m.item() else 0, 0), np.int64), torch.int64)
    # CPU's result is column-major: (1, n) strides
    coords = np.nonzero(m)
    n = coords[0].shape[0]
    return storage.new_tensor((n, m.ndim), torch.int64, storage.to_device(np.concatenate(coords).astype(np.int64)),
                              stride=(1, n))


@impl("masked_select")
def _masked_select(self, mask):
    if mask.dtype != torch.bool:
        raise RuntimeError("masked_select: expected BoolTensor for mask")
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    m = np.broadcast_to(_host(mask), shape).reshape(-1)
    flat_idx = storage.to_device(np.flatnonzero(m).astype(np.int64))
    values = jnp.broadcast_to(logical_value(self), shape).reshape(-1)[flat_idx]
    return from_jax_array(values, self.dtype)


def _np_unique(a, axis=None):
    """np.unique with PyTorch's conventions: NaNs are all distinct."""
    return np.unique(a, return_inverse=True, return_counts=True, axis=axis, equal_nan=False)


@impl("_unique2")
def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    a = _host(self)
    u, inv, cnt = _np_unique(a.reshape(-1))
    empty = np.zeros((0,), np.int64)
    return (
        _tensor(u, self.dtype),
        _tensor(inv.reshape(a.shape).astype(np.int64) if return_inverse else empty, torch.int64),
        _tensor(cnt.astype(np.int64) if return_counts else empty, torch.int64),
    )


@impl("_unique")
def _unique(self, sorted=True, return_inverse=False):
    a = _host(self)
    u, inv, _ = _np_unique(a.reshape(-1))
    empty = np.zeros((0,), np.int64)
    return _tensor(u, self.dtype), _tensor(inv.reshape(a.shape).astype(np.int64) if return_inverse else empty, torch.int64)


@impl("unique_dim")
def _unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    a = _host(self)
    d = dim % max(a.ndim, 1)
    if a.shape[d] == 0:
        # np.unique rejects empty axes; PyTorch returns the empty tensor itself
        return _tensor(a, self.dtype), _tensor(np.zeros((0,), np.int64), torch.int64), _tensor(np.zeros((0,), np.int64), torch.int64)
    u, inv, cnt = _np_unique(a, axis=d)
    return _tensor(u, self.dtype), _tensor(inv.reshape(-1).astype(np.int64), torch.int64), _tensor(cnt.astype(np.int64), torch.int64)


@impl("unique_consecutive")
def _unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    a = _host(self)
    if dim is None:
        flat = a.reshape(-1)
        if flat.size == 0:
            starts = np.zeros((0,), bool)
        else:
            starts = np.concatenate([[True], flat[1:] != flat[:-1]])
        u = flat[starts]
        inv = (np.cumsum(starts) - 1).reshape(a.shape)
        cnt = np.diff(np.append(np.flatnonzero(starts), flat.size))
        empty = np.zeros((0,), np.int64)
        return (
            _tensor(u, self.dtype),
            _tensor(inv.astype(np.int64) if return_inverse else empty, torch.int64),
            _tensor(cnt.astype(np.int64) if return_counts else empty, torch.int64),
        )
    d = dim % max(a.ndim, 1)
    m = np.moveaxis(a, d, 0)
    n = m.shape[0]
    if n == 0:
        starts = np.zeros((0,), bool)
    else:
        diff = (m[1:] != m[:-1]).reshape(n - 1, -1).any(axis=1)
        starts = np.concatenate([[True], diff])
    u = np.moveaxis(m[starts], 0, d)
    inv = np.cumsum(starts) - 1
    cnt = np.diff(np.append(np.flatnonzero(starts), n))
    empty = np.zeros((0,), np.int64)
    return (
        _tensor(np.ascontiguousarray(u), self.dtype),
        _tensor(inv.astype(np.int64) if return_inverse else empty, torch.int64),
        _tensor(cnt.astype(np.int64) if return_counts else empty, torch.int64),
    )


@impl("repeat_interleave.Tensor")
def _repeat_interleave(repeats, output_size=None):
    r = _host(repeats).reshape(-1)
    if r.size and r.min() < 0:
        raise RuntimeError("repeats can not be negative")
    out = np.repeat(np.arange(r.size, dtype=np.int64), r.astype(np.int64))
    if output_size is not None and output_size != out.size:
        raise RuntimeError(f"output_size {output_size} does not match the sum of repeats {out.size}")
    return _tensor(out, repeats.dtype)
