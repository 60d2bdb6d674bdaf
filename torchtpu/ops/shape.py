"""Shape and ordering ops that copy data: cat, flip, roll, repeat, tril/triu,
constant_pad_nd, sort/topk, searchsorted/bucketize, histc, isin, trace,
tril_indices/triu_indices.

(Views — view, transpose, slice, expand, ... — are metadata-only and handled in
core.py; the ``*_copy`` forms are CompositeExplicitAutograd in PyTorch and reach
these lowerings through ``clone``.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..dispatch.lowering import lower
from ..runtime import layout
from ..runtime.device import check_device
from .reductions import _axis, stable_sort


# ---------------------------------------------------------------- cat / flip / roll / repeat
@lower("cat", static=("dim",))
def _cat(tensors, dim=0):
    # PyTorch skips legacy empty tensors of shape (0,) when concatenating others
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), jnp.result_type(*tensors))
    dt = jnp.result_type(*tensors)
    return jnp.concatenate([t.astype(dt) for t in kept], axis=dim % kept[0].ndim)


@lower("flip", static=("dims",))
def _flip(x, dims):
    if x.ndim == 0 or not dims:
        return x
    return jnp.flip(x, axis=tuple(d % x.ndim for d in dims))


@lower("roll", static=("shifts", "dims"))
def _roll(x, shifts, dims=()):
    if x.ndim == 0:
        return x
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), axis=tuple(d % x.ndim for d in dims))


@lower("repeat", static=("repeats",))
def _repeat(x, repeats):
    repeats = tuple(repeats)
    x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@lower("tril", static=("diagonal",))
def _tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lower("triu", static=("diagonal",))
def _triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lower("constant_pad_nd")
def _constant_pad_nd(x, pad, value=0):
    # pad lists (low, high) pairs from the last dim backwards; negative pads crop
    cfg = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        cfg[d] = (pad[2 * i], pad[2 * i + 1], 0)
    v = jnp.asarray(value)
    if x.dtype == jnp.bool_:
        v = v != 0
    return lax.pad(x, v.astype(x.dtype), cfg)


# ---------------------------------------------------------------- sort / topk
@lower("sort.stable", static=("stable", "dim", "descending"))
def _sort_stable(x, stable=None, dim=-1, descending=False):
    return stable_sort(x, _axis(x, dim), descending)


@lower("sort.default", static=("dim", "descending"))
def _sort(x, dim=-1, descending=False):
    return stable_sort(x, _axis(x, dim), descending)


@lower("topk", static=("k", "dim", "largest", "sorted"))
def _topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    ax = _axis(x, dim)
    v, i = stable_sort(x, ax, largest)
    return lax.slice_in_dim(v, 0, k, axis=ax), lax.slice_in_dim(i, 0, k, axis=ax)


# ---------------------------------------------------------------- searchsorted / bucketize / isin / histc
def _search_1d(seq, vals, right):
    # PyTorch's order puts NaN last, as jnp.searchsorted does
    return jnp.searchsorted(seq, vals, side="right" if right else "left", method="compare_all")


def _searchsorted(seq, x, right, side, sorter):
    if side is not None:
        right = side == "right"
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    if seq.ndim == 1:
        return _search_1d(seq, x, right)
    lead = seq.shape[:-1]
    s2 = seq.reshape((-1, seq.shape[-1]))
    x2 = x.reshape((s2.shape[0], -1))
    r = jax.vmap(lambda s, v: _search_1d(s, v, right))(s2, x2)
    return r.reshape(lead + x.shape[-1:])


@lower("searchsorted.Tensor", static=("out_int32", "right", "side"))
def _searchsorted_t(sorted_sequence, x, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(sorted_sequence, x, right, side, sorter)


@lower("searchsorted.Scalar", static=("out_int32", "right", "side"))
def _searchsorted_s(sorted_sequence, x, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(sorted_sequence, jnp.asarray(x), right, side, sorter)


@lower("bucketize.Tensor", static=("out_int32", "right"))
def _bucketize(x, boundaries, out_int32=False, right=False):
    return _search_1d(boundaries, x, right)


@lower("bucketize.Scalar", static=("out_int32", "right"))
def _bucketize_s(x, boundaries, out_int32=False, right=False):
    return _search_1d(boundaries, jnp.asarray(x), right)


def _isin(elements, test, invert):
    elements, test = jnp.asarray(elements), jnp.asarray(test)
    dt = jnp.promote_types(elements.dtype, test.dtype)
    r = jnp.isin(elements.astype(dt), test.astype(dt).reshape(-1))
    return ~r if invert else r


@lower("isin.Tensor_Tensor", static=("assume_unique", "invert"))
def _isin_tt(elements, test_elements, assume_unique=False, invert=False):
    return _isin(elements, test_elements, invert)


@lower("isin.Tensor_Scalar", static=("assume_unique", "invert"))
def _isin_ts(elements, test_element, assume_unique=False, invert=False):
    return _isin(elements, test_element, invert)


@lower("isin.Scalar_Tensor", static=("assume_unique", "invert"))
def _isin_st(element, test_elements, assume_unique=False, invert=False):
    return _isin(element, test_elements, invert)


@lower("histc", static=("bins", "min", "max"))
def _histc(x, bins=100, min=0, max=0):
    xf = x.reshape(-1)
    acc = jnp.float64 if xf.dtype == jnp.float64 else jnp.float32
    if min == max and xf.size > 0:
        lo, hi = jnp.min(xf).astype(acc), jnp.max(xf).astype(acc)
    else:
        lo, hi = jnp.asarray(min, acc), jnp.asarray(max, acc)
    # an empty range widens by one on each side, as PyTorch does
    same = lo == hi
    lo = jnp.where(same, lo - 1, lo)
    hi = jnp.where(same, hi + 1, hi)
    v = xf.astype(acc)
    inside = (v >= lo) & (v <= hi)
    pos = jnp.floor((v - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.clip(pos, 0, bins - 1)  # the right edge belongs to the last bin
    counts = jnp.zeros((bins,), acc).at[pos].add(inside.astype(acc))
    return counts.astype(x.dtype)


# ---------------------------------------------------------------- trace / tril_indices / triu_indices
@lower("trace")
def _trace(x):
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        x = x.astype(jnp.int64)
    elif x.dtype in (jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    return jnp.trace(x)


def _tri_indices(row, col, offset, lower_):
    if row == 0 or col == 0:
        return np.zeros((2, 0), np.int64)
    r, c = (np.tril_indices if lower_ else np.triu_indices)(row, offset, col)
    return np.stack([r, c]).astype(np.int64)


@lower("tril_indices", static=("row", "col", "offset"))
def _tril_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return jnp.asarray(_tri_indices(row, col, offset, True))  # the kernel executor casts to the meta dtype


@lower("triu_indices", static=("row", "col", "offset"))
def _triu_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return jnp.asarray(_tri_indices(row, col, offset, False))  # the kernel executor casts to the meta dtype


# ---------------------------------------------------------------- as_strided_scatter
@lower("as_strided_scatter", static=("size", "stride", "storage_offset"))
def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """``x`` (as a fresh contiguous storage) with ``src`` written at the strided window."""
    lay = (tuple(size), tuple(stride), 0 if storage_offset is None else storage_offset)
    return layout.write(x.reshape(-1), lay, src).reshape(x.shape)


# ---------------------------------------------------------------- slice / select scatter
# (functionalization emits these for writes into views: ``x[:, 1:3] = v`` in a compiled graph)
def _dim_index(ndim, dim, idx):
    dim = dim + ndim if dim < 0 else dim
    return (slice(None),) * dim + (idx,)


@lower("slice_scatter")
def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    return x.at[_dim_index(x.ndim, dim, slice(start, end, step))].set(src.astype(x.dtype))


@lower("select_scatter")
def _select_scatter(x, src, dim, index):
    return x.at[_dim_index(x.ndim, dim, index)].set(src.astype(x.dtype))
