"""How a tensor's layout (size, stride, storage offset) reads and writes its flat buffer.

Pure functions over jax arrays, used *inside* jitted programs: a contiguous
tensor costs nothing and a transpose costs a transpose. Also the byte views
(any dtype <-> flat uint8) that storages of mixed dtypes and weight transfers use.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax


def contiguous_strides(size):
    strides = []
    acc = 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


_contig_cache: dict = {}


def contiguous(size):
    """(contiguous strides, numel) of ``size``, cached: this is on every op's path."""
    if type(size) is list:
        size = tuple(size)
    r = _contig_cache.get(size)
    if r is None:
        size = tuple(size)
        r = (contiguous_strides(size), math.prod(size))
        if len(_contig_cache) < 65536:
            _contig_cache[size] = r
    return r


def storage_numel(size, stride, offset):
    if any(n == 0 for n in size):
        return offset
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def is_contiguous(size, stride) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def has_internal_overlap(size, stride) -> bool:
    return any(n > 1 and s == 0 for n, s in zip(size, stride))


def is_dense(size, stride) -> bool:
    """Do the elements of (size, stride) fill a block of exactly numel elements, each once
    (a permutation of a contiguous layout)?"""
    return _block_plan(size, stride) is not None and not has_internal_overlap(size, stride)


def to_physical(value, stride):
    """Flat buffer holding ``value`` in the element order of the dense layout ``stride`` (traced)."""
    size = tuple(value.shape)
    _, order, dims = _block_plan(size, stride)
    v = value.reshape([size[i] for i in dims])
    pos = {d: k for k, d in enumerate(dims)}
    return jnp.transpose(v, [pos[d] for d in order]).reshape((-1,))


def cast(x, dtype):
    """``x`` as ``dtype``; complex to real keeps the real part, as PyTorch does (JAX would warn)."""
    if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.real(x)
    return x.astype(dtype)


def _block_plan(size, stride):
    """If the non-broadcast dims of a layout are a permutation of a dense block,
    return (block_shape, perm_from_block_to_layout_dims, kept_dims); else None."""
    dims = [i for i, n in enumerate(size) if n != 1 and stride[i] != 0]
    order = sorted(dims, key=lambda i: -stride[i])
    expected = 1
    for i in reversed(order):
        if stride[i] != expected:
            return None
        expected *= size[i]
    block_shape = tuple(size[i] for i in order)
    return block_shape, order, dims


def _index_array(size, stride, offset):
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return idx


def read(buf, lay):
    """The logical value of a tensor with layout ``lay`` over ``buf`` (traced).

    ``buf`` holds the storage's elements in order; its shape is whatever its
    producer gave (an op's output keeps its shape, so ``to_jax`` needs no copy).
    """
    size, stride, offset = lay
    numel = math.prod(size)
    if numel == 0:
        return jnp.zeros(size, buf.dtype)
    if is_contiguous(size, stride) and offset == 0 and buf.size == numel:
        return buf if tuple(buf.shape) == tuple(size) else buf.reshape(size)
    buf = buf.reshape(-1)
    if is_contiguous(size, stride):
        return lax.slice(buf, (offset,), (offset + numel,)).reshape(size)
    plan = _block_plan(size, stride)
    if plan is not None:
        block_shape, order, dims = plan
        bn = math.prod(block_shape)
        block = lax.slice(buf, (offset,), (offset + bn,)).reshape(block_shape)
        # block axes are ``order``; move them to ascending layout-dim order
        perm = sorted(range(len(order)), key=lambda k: order[k])
        block = jnp.transpose(block, perm)
        shape_kept = [1] * len(size)
        for i in dims:
            shape_kept[i] = size[i]
        return jnp.broadcast_to(block.reshape(shape_kept), size)
    return buf[_index_array(size, stride, offset)]


def write(buf, lay, value):
    """``buf`` with the elements addressed by ``lay`` replaced by ``value`` (traced)."""
    size, stride, offset = lay
    numel = math.prod(size)
    value = jnp.broadcast_to(cast(value, buf.dtype), size)
    if numel == 0:
        return buf
    if is_contiguous(size, stride) and offset == 0 and buf.size == numel:
        return value  # the whole storage is replaced: keep the value's own shape
    shape = buf.shape
    return _write_flat(buf.reshape(-1), size, stride, offset, value).reshape(shape)


def _write_flat(buf, size, stride, offset, value):
    numel = math.prod(size)
    if is_contiguous(size, stride):
        return lax.dynamic_update_slice(buf, value.reshape((numel,)), (offset,))
    if is_dense(size, stride):
        return lax.dynamic_update_slice(buf, to_physical(value, stride), (offset,))
    idx = _index_array(size, stride, offset).reshape(-1)
    value = value.reshape((-1,))
    if has_internal_overlap(size, stride):
        # elements sharing a memory location (an expanded tensor): only those the op changed are
        # written, as an in-place scatter on CPU writes only the elements it addresses
        old = buf[idx]
        changed = (value != old) & ~((value != value) & (old != old))
        idx = jnp.where(changed, idx, buf.shape[0])
        return buf.at[idx].set(value, mode="drop")
    return buf.at[idx].set(value)


# ---------------------------------------------------------------- math bits (traced)
def math_bits(t):
    """PyTorch's lazy conjugate / negative bits of tensor ``t`` (``x.conj()``, ``x.conj().imag``) as
    ``(conj, neg)``, or None when neither is set: the flat buffer holds the unconjugated,
    unnegated values and every read and write applies them."""
    conj = t.is_conj()
    neg = t.is_neg()
    return (conj, neg) if conj or neg else None


def apply_math_bits(x, bits):
    """The logical value of stored ``x`` under ``bits`` (``math_bits``); self-inverse, so it is
    also what a write of logical value ``x`` stores."""
    if bits is None:
        return x
    conj, neg = bits
    if conj:
        x = jnp.conj(x)
    if neg:
        x = -x
    return x


# ---------------------------------------------------------------- byte views (traced)
def to_bytes(x):
    """Flat uint8 bytes of ``x``: bool as one byte, complex as (real, imag) pairs."""
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1).reshape(-1)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def from_bytes(u8, jd, numel):
    """``numel`` elements of jax dtype ``jd`` from flat bytes ``u8`` (zero-padded)."""
    jd = np.dtype(jd)
    if jd == np.bool_:
        return fit(u8, numel) != 0
    if jnp.issubdtype(jd, jnp.complexfloating):
        part = np.dtype(np.float32 if jd == np.complex64 else np.float64)
        ri = from_bytes(u8, part, 2 * numel).reshape(numel, 2)
        return lax.complex(ri[:, 0], ri[:, 1])
    k = jd.itemsize
    u8 = fit(u8, numel * k)
    if k == 1:
        return lax.bitcast_convert_type(u8, jd)
    return lax.bitcast_convert_type(u8.reshape(numel, k), jd)


def fit(x, n):
    """The first ``n`` elements of flat ``x``, zero-padded if it is shorter."""
    if x.shape[0] >= n:
        return x[:n]
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],), x.dtype)])
