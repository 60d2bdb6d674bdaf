"""Where the bytes of a tpu tensor live.

A tpu tensor is a plain ``torch.Tensor`` on PrivateUse1 whose torch-side
metadata (sizes, strides, storage offset, a storage of the right byte size) is
real, so every view op torch implements with metadata alone works unchanged.
The storage's data pointer is null; its bytes are a flat 1-D ``jax.Array``
hung off the (PyObject-preserved) ``UntypedStorage`` as ``_tpu``.

Reading a tensor means applying its layout (size, stride, offset) to that flat
buffer; writing means scattering back. Both are done *inside* the jitted op so
a contiguous tensor costs nothing and a transpose costs a transpose.
"""

from __future__ import annotations

import math
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from . import dtypes
from . import lazy as _lazy

_DEV = None  # torch.device("tpu", 0), set once the backend is renamed
_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_create_empty = torch._C._acc.create_empty_tensor
_make_storage = torch._C._construct_storage_from_data_pointer
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed


# ---------------------------------------------------------------- memory stats
class _MemoryStats:
    """Bytes of live device buffers, counted per storage."""

    def __init__(self):
        self.lock = threading.Lock()
        self.allocated = 0
        self.peak = 0
        self.num_storages = 0

    def add(self, n):
        with self.lock:
            self.allocated += n
            self.num_storages += 1
            if self.allocated > self.peak:
                self.peak = self.allocated

    def note_transient(self, n):
        """``n`` bytes held only for a moment on top of what is allocated (a fused graph's
        temporaries while it runs): they count toward the peak, not the allocation."""
        with self.lock:
            if self.allocated + n > self.peak:
                self.peak = self.allocated + n

    def sub(self, n):
        with self.lock:
            self.allocated -= n
            self.num_storages -= 1


MEMORY = _MemoryStats()
_LAZYBUF = _lazy.LazyBuf
_weakref = weakref.ref
LIVE: "weakref.WeakSet[StorageData]" = weakref.WeakSet()  # for synchronize()
_ARRAY_TYPES = (type(jnp.zeros(())),)  # the concrete jax array type (fast check)


class StorageData:
    """The device bytes of one storage: a flat jax array of ``numel`` elements.

    Under DeferAndFuse ``_buf`` may be a pending ``lazy.LazyBuf``; reading
    ``buf`` materializes it (a flush), so code outside the op path always sees
    a concrete array. Bytes are counted once a concrete buffer exists.

    Storages are untyped bytes, as in PyTorch: ``dtype`` is the element type
    the buffer is held in now, and a tensor of another dtype over the same
    storage (a byte view made by torch's storage code: ``storage.copy_``,
    ``torch.load``, ``UntypedStorage(n, device="tpu")``) reinterprets it.
    """

    __slots__ = ("_buf", "nbytes", "counted", "dtype", "__weakref__")

    def __init__(self, buf, nbytes, dtype):
        # the ``buf`` setter, inlined: this runs for every op output
        self.nbytes = nbytes
        self.dtype = dtype
        self._buf = buf
        if type(buf) is _LAZYBUF:
            # counted, and known to synchronize(), once a concrete buffer arrives (most
            # pending outputs are intermediates that never get one)
            self.counted = False
            _lazy._owners.append(_weakref(self))
        else:
            self.counted = True
            MEMORY.add(nbytes)
            LIVE.add(self)

    @property
    def buf(self):
        b = self._buf
        if type(b) is not _ARRAY_TYPES[0] and b is not None and _lazy.is_lazy(b):
            _lazy.materialize(b, "materialize")
            b = self._buf
        return b

    @buf.setter
    def buf(self, b):
        # inlined lazy.is_lazy / lazy.register_owner: every in-place op's outputs land here
        self._buf = b
        if type(b) is _LAZYBUF:
            _lazy._owners.append(_weakref(self))
        elif not self.counted:
            self.counted = True
            MEMORY.add(self.nbytes)
            LIVE.add(self)

    def retype(self, dtype: torch.dtype) -> None:
        """Hold the buffer as ``dtype`` elements: the same bytes, reinterpreted."""
        b = self.buf
        jd = np.dtype(dtypes.to_jax(dtype))
        if b.dtype != jd:
            self._buf = _bitcast_jit(np.dtype(b.dtype), jd, self.nbytes)(b)
        self.dtype = dtype

    def __del__(self):
        try:
            if self.counted:
                MEMORY.sub(self.nbytes)
        except Exception:  # interpreter shutdown
            pass


def storage_data(t: torch.Tensor) -> StorageData:
    try:
        sd = t.untyped_storage()._tpu
    except AttributeError:
        raise RuntimeError(
            "torchtpu: this tpu tensor has no device data attached (it was made by a path "
            "torchtpu does not know). Please report the op that produced it."
        ) from None
    if sd.dtype is not t.dtype:
        sd.retype(t.dtype)
    return sd


def _to_bytes(x):
    """Flat uint8 bytes of ``x`` (traced)."""
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1).reshape(-1)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(u8, jd, numel):
    """``numel`` elements of dtype ``jd`` from flat bytes ``u8`` (zero-padded; traced)."""
    jd = np.dtype(jd)
    if jd == np.bool_:
        return _fit(u8, numel) != 0
    if jnp.issubdtype(jd, jnp.complexfloating):
        part = np.dtype(np.float32 if jd == np.complex64 else np.float64)
        ri = _from_bytes(u8, part, 2 * numel).reshape(numel, 2)
        return lax.complex(ri[:, 0], ri[:, 1])
    k = jd.itemsize
    u8 = _fit(u8, numel * k)
    if k == 1:
        return lax.bitcast_convert_type(u8, jd)
    return lax.bitcast_convert_type(u8.reshape(numel, k), jd)


def _fit(x, n):
    if x.shape[0] >= n:
        return x[:n]
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],), x.dtype)])


_bitcast_cache: dict = {}


def _bitcast_jit(src, dst, nbytes):
    key = (src, dst, nbytes)
    fn = _bitcast_cache.get(key)
    if fn is None:
        numel = -(-nbytes // dst.itemsize)
        fn = jax.jit(lambda b: _from_bytes(_fit(_to_bytes(b), nbytes), dst, numel))
        _bitcast_cache[key] = fn
    return fn


def is_tpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "tpu"


# ---------------------------------------------------------------- making tensors
_zeros_cache: dict = {}


def _zeros_flat(numel, jdtype):
    """Immutable zero buffers are shared: jax arrays never change in place."""
    key = (numel, jdtype)
    z = _zeros_cache.get(key)
    if z is None:
        z = jnp.zeros((numel,), jdtype)
        if numel <= (1 << 16):
            _zeros_cache[key] = z
    return z


# Each storage gets a distinct fake data pointer so that code comparing
# data_ptr()s (aliasing checks, dedup in serializers) sees the truth. They lie
# in non-canonical x86-64 address space: any C++ code that dereferences one
# faults at once instead of reading someone else's memory.
_FAKE_PTR_BASE = 0x7FF0 << 48
_next_ptr = _FAKE_PTR_BASE
_ptr_lock = threading.Lock()


def _fake_ptr(nbytes):
    global _next_ptr
    with _ptr_lock:
        p = _next_ptr
        _next_ptr += (nbytes + 64) & ~63
        if _next_ptr >= (0x7FFF << 48):
            _next_ptr = _FAKE_PTR_BASE
    return p


def _new_storage(nbytes, buf, dtype):
    s = _make_storage(_fake_ptr(nbytes), _DEV or _dev(), nbytes)
    s._tpu = StorageData(buf, nbytes, dtype)
    return s


def new_tensor(size, dtype: torch.dtype, buf=None, stride=None) -> torch.Tensor:
    """A fresh tpu tensor of ``size`` (contiguous unless ``stride``) over flat ``buf``."""
    if stride is None:
        stride, numel = _contiguous(size)
    else:
        numel = storage_numel(size, stride, 0)
    if buf is None:
        buf = _zeros_flat(numel, dtypes.to_jax(dtype))
    t = _create_empty(_EMPTY, dtype)
    _set_storage(_CPU_KEYSET, t, _new_storage(numel * dtype.itemsize, buf, dtype), 0, size, stride)
    return t


_EMPTY = [0]


def replace_storage(t: torch.Tensor, size, buf) -> None:
    """Give ``t`` a fresh contiguous storage of ``size`` (``resize_``/``set_`` semantics)."""
    size = tuple(size)
    stride, numel = _contiguous(size)
    if buf is None:
        buf = _zeros_flat(numel, dtypes.to_jax(t.dtype))
    _set_storage(_CPU_KEYSET, t, _new_storage(numel * t.dtype.itemsize, buf, t.dtype), 0, size, stride)


_contig_cache: dict = {}


def _contiguous(size):
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


def _dev():
    global _DEV
    _DEV = torch.device("tpu", 0)
    return _DEV


def contiguous_strides(size):
    strides = []
    acc = 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def storage_numel(size, stride, offset):
    if any(n == 0 for n in size):
        return offset
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def layout(t: torch.Tensor):
    """Hashable description of how ``t`` reads its flat buffer."""
    return (tuple(t.shape), t.stride(), t.storage_offset())


# ---------------------------------------------------------------- strided read / write (traced)
def _is_contiguous(size, stride):
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


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
    if _is_contiguous(size, stride) and offset == 0 and buf.size == numel:
        return buf if tuple(buf.shape) == tuple(size) else buf.reshape(size)
    buf = buf.reshape(-1)
    if _is_contiguous(size, stride):
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


def has_internal_overlap(size, stride):
    return any(n > 1 and s == 0 for n, s in zip(size, stride))


def write(buf, lay, value):
    """``buf`` with the elements addressed by ``lay`` replaced by ``value`` (traced)."""
    size, stride, offset = lay
    numel = math.prod(size)
    value = jnp.broadcast_to(value.astype(buf.dtype), size)
    if numel == 0:
        return buf
    if _is_contiguous(size, stride) and offset == 0 and buf.size == numel:
        return value  # the whole storage is replaced: keep the value's own shape
    shape = buf.shape
    return _write_flat(buf.reshape(-1), size, stride, offset, value).reshape(shape)


def _write_flat(buf, size, stride, offset, value):
    numel = math.prod(size)
    if _is_contiguous(size, stride):
        return lax.dynamic_update_slice(buf, value.reshape((numel,)), (offset,))
    plan = _block_plan(size, stride)
    if plan is not None and not has_internal_overlap(size, stride):
        block_shape, order, dims = plan
        v = value.reshape([size[i] for i in dims])
        pos = {d: k for k, d in enumerate(dims)}
        v = jnp.transpose(v, [pos[d] for d in order]).reshape((-1,))
        return lax.dynamic_update_slice(buf, v, (offset,))
    idx = _index_array(size, stride, offset).reshape(-1)
    return buf.at[idx].set(value.reshape((-1,)))


# ---------------------------------------------------------------- host transfers
def to_numpy_host(t: torch.Tensor) -> np.ndarray:
    """Host copy of a tpu tensor's logical value (blocks). The one host-read path."""
    from .registry import logical_value

    if _lazy._pending:
        _lazy.flush("host_read")
    try:
        return np.asarray(jax.device_get(logical_value(t)))
    except Exception as e:  # a fused graph still in flight failed: name the lines that recorded it
        _lazy.explain(e)
        raise


def host_to_cpu_tensor(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return dtypes.numpy_to_torch(arr, dtype)


def weak_storage_ref(t):
    return weakref.ref(storage_data(t))
