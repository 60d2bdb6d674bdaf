"""Where the bytes of a tpu tensor live.

A tpu tensor is a plain ``torch.Tensor`` on PrivateUse1 whose torch-side
metadata (sizes, strides, storage offset, a storage of the right byte size) is
real, so every view op torch implements with metadata alone works unchanged.
The storage's data pointer is a fake address; its bytes are a flat 1-D
``jax.Array`` hung off the (PyObject-preserved) ``UntypedStorage`` as ``_tpu``
(a :class:`StorageData`).

Reading a tensor means applying its layout (size, stride, offset) to that flat
buffer; writing means scattering back (``layout.read`` / ``layout.write``,
done inside jitted programs). Host transfers go through ``to_numpy_host``.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.array import ArrayImpl  # the concrete array type: a type check needs no backend

from ..base import dtypes, metrics, platform
from ..base.memory import MEMORY, check_allocation, is_resource_exhausted, out_of_memory_from
from . import layout as _layout
from . import checks, native
from .recorder import RECORDER, LazyBuf

_DEV = None  # torch.device("tpu", 0), set once the backend is renamed
_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_create_empty = torch._C._acc.create_empty_tensor
_make_storage = torch._C._construct_storage_from_data_pointer
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed
_native_make_tensor = native.MODULE.make_tensor if native.MODULE is not None else None

# weak references to the storages with a concrete buffer (what synchronize waits for): a plain set of
# weakrefs, each removing itself when its storage dies; its operations are single C calls, so threads
# may add while another copies it, and a WeakSet's Python-level add is avoided on every op's path
_LIVE: set = set()
_live_discard = _LIVE.discard
_ARRAY = ArrayImpl  # the concrete jax array type (fast check)
_weakref = weakref.ref
_adopt = RECORDER.adopt
_RECORDER_LOCK = RECORDER.lock


class StorageData:
    """The device bytes of one storage: a flat jax array of ``numel`` elements.

    ``raw_buf`` is the buffer as held: under DeferAndFuse it may be a pending
    ``recorder.LazyBuf``; reading ``buf`` materializes it (a flush), so code
    outside the op path always sees a concrete array. Bytes are counted once a
    concrete buffer exists.

    Storages are untyped bytes, as in PyTorch: ``dtype`` is the element type
    the buffer is held in now, and a tensor of another dtype over the same
    storage (a byte view made by torch's storage code: ``storage.copy_``,
    ``torch.load``, ``UntypedStorage(n, device="tpu")``) reinterprets it.
    """

    __slots__ = ("raw_buf", "nbytes", "counted", "dtype", "__weakref__")

    def __init__(self, buf, nbytes, dtype):
        # the ``buf`` setter, inlined: this runs for every op output
        self.nbytes = nbytes
        self.dtype = dtype
        self.raw_buf = buf
        if type(buf) is LazyBuf:
            # counted, and known to synchronize(), once a concrete buffer arrives (most
            # pending outputs are intermediates that never get one)
            self.counted = False
            _adopt(self)
        else:
            self.counted = True
            MEMORY.add(nbytes)
            _LIVE.add(_weakref(self, _live_discard))

    @property
    def buf(self):
        b = self.raw_buf
        if type(b) is LazyBuf:
            # under the recorder's lock, until the buffer held is concrete: another thread may record
            # a write into this storage between the flush and the read
            with _RECORDER_LOCK:
                while type(b := self.raw_buf) is LazyBuf:
                    v = RECORDER.materialize(b, "materialize")
                    if self.raw_buf is b:
                        self.buf = v
        elif b is None:  # released (storage.resize_(0)) and used again: fresh memory, as an allocation
            self.buf = _zeros_flat(-(-self.nbytes // self.dtype.itemsize), dtypes.to_jax(self.dtype))
            b = self.raw_buf
        return b

    @buf.setter
    def buf(self, b):
        # every in-place op's outputs land here
        self.raw_buf = b
        if type(b) is LazyBuf:
            _adopt(self)
        elif not self.counted:
            self.counted = True
            MEMORY.add(self.nbytes)
            _LIVE.add(_weakref(self, _live_discard))

    def release(self) -> None:
        """Drop the device buffer (``storage.resize_(0)``: FSDP2 frees unsharded parameters so between
        uses). The storage keeps its size; its next use gets a fresh zero buffer."""
        if self.counted:
            MEMORY.sub(self.nbytes)
            self.counted = False
            _LIVE.discard(_weakref(self))  # (equal to the one added while self is alive)
        self.raw_buf = None

    @property
    def released(self) -> bool:
        return self.raw_buf is None

    def retype(self, dtype: torch.dtype) -> None:
        """Hold the buffer as ``dtype`` elements: the same bytes, reinterpreted."""
        b = self.buf
        jd = np.dtype(dtypes.to_jax(dtype))
        if b.dtype != jd:
            self.raw_buf = _bitcast_jit(np.dtype(b.dtype), jd, self.nbytes)(b)
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


def live_buffers() -> list:
    """The concrete buffers of every live storage (what ``synchronize`` waits for)."""
    sds = [r() for r in _LIVE.copy()]  # (a set's copy is one C call: other threads add storages meanwhile)
    return [b for b in (sd.raw_buf for sd in sds if sd is not None) if b is not None and type(b) is not LazyBuf]


_bitcast_cache: dict = {}


def _bitcast_jit(src, dst, nbytes):
    key = (src, dst, nbytes)
    fn = _bitcast_cache.get(key)
    if fn is None:
        numel = -(-nbytes // dst.itemsize)
        fn = jax.jit(lambda b: _layout.from_bytes(_layout.fit(_layout.to_bytes(b), nbytes), dst, numel))
        _bitcast_cache[key] = fn
    return fn


# ---------------------------------------------------------------- making tensors
_zeros_cache: dict = {}


def to_device(host) -> jax.Array:
    """A device array holding a copy of numpy array ``host``: a transfer, never an XLA compile
    (``jnp.asarray`` of a numpy array compiles a program per shape, which a stream of new shapes
    pays again and again). The copy is made on the host first: on the CPU backend the device array
    would otherwise share ``host``'s memory, which its owner may change."""
    host = np.array(host, order="C", copy=True)
    metrics.record_host_transfer(host.nbytes)
    platform.first_use()  # once: the platform's checks wait for the first data on the device
    return jax.device_put(host)


_SMALL = 1 << 20  # elements: below this a zero buffer is a host transfer, not a compiled fill


def _zeros_flat(numel, jdtype):
    """Immutable zero buffers are shared: jax arrays never change in place."""
    key = (numel, jdtype)
    z = _zeros_cache.get(key)
    if z is None:
        if numel > _SMALL:
            nbytes = numel * jnp.dtype(jdtype).itemsize
            check_allocation(nbytes)
            try:
                z = jnp.zeros((numel,), jdtype)
            except Exception as e:
                if is_resource_exhausted(e):
                    raise out_of_memory_from(e, nbytes) from e
                raise
        else:
            z = to_device(np.zeros((numel,), jdtype))
        if numel <= (1 << 16):
            _zeros_cache[key] = z
    return z


# Each storage gets a distinct fake data pointer so that code comparing
# data_ptr()s (aliasing checks, dedup in serializers) sees the truth. They lie
# in non-canonical x86-64 address space: any C++ code that dereferences one
# faults at once instead of reading someone else's memory. Storages up to
# _SMALL_SLOT bytes (nearly every op output) take the next slot of their own
# region from a counter (no lock: ``next`` of an itertools.count is atomic);
# larger ones are laid end to end in the region above, under a lock.
_FAKE_PTR_BASE = 0x7FF0 << 48
_SMALL_SLOT = 1 << 20
_SMALL_SLOTS = (0x7FF8 << 48) - _FAKE_PTR_BASE >> 20  # slots below the large region
_small_slot = itertools.count()
_LARGE_BASE = 0x7FF8 << 48
_next_ptr = _LARGE_BASE
_ptr_lock = threading.Lock()


def _fake_ptr(nbytes):
    global _next_ptr
    if nbytes <= _SMALL_SLOT:
        return _FAKE_PTR_BASE + (next(_small_slot) % _SMALL_SLOTS << 20)
    with _ptr_lock:
        p = _next_ptr
        _next_ptr += (nbytes + 64) & ~63
        if _next_ptr >= (0x7FFF << 48):
            _next_ptr = _LARGE_BASE
    return p


def new_storage(nbytes: int, buf, dtype: torch.dtype) -> torch.UntypedStorage:
    """A tpu ``UntypedStorage`` of ``nbytes`` bytes held as flat ``buf`` of ``dtype`` elements."""
    s = _make_storage(_fake_ptr(nbytes), _DEV or _dev(), nbytes)
    s._tpu = StorageData(buf, nbytes, dtype)
    return s


def new_tensor(size, dtype: torch.dtype, buf=None, stride=None) -> torch.Tensor:
    """A fresh tpu tensor of ``size`` (contiguous unless ``stride``) over flat ``buf``."""
    if stride is None:
        stride, numel = _layout.contiguous(size)
    else:
        numel = _layout.storage_numel(size, stride, 0)
    if buf is None:
        check_allocation(numel * dtype.itemsize, size)  # an int64 overflow would abort inside XLA
        buf = _zeros_flat(numel, dtypes.to_jax(dtype))
    nbytes = numel * dtype.itemsize
    if _native_make_tensor is not None:  # one C++ call (runtime/native.py)
        t = _native_make_tensor(size, stride, dtype, nbytes, _fake_ptr(nbytes))
        t.untyped_storage()._tpu = StorageData(buf, nbytes, dtype)
        return t
    t = _create_empty(_EMPTY, dtype)
    _set_storage(_CPU_KEYSET, t, new_storage(nbytes, buf, dtype), 0, size, stride)
    return t


def new_output(size, stride, nbytes, dtype, buf) -> torch.Tensor:
    """``new_tensor`` for a kernel's output, whose strides and byte size its executable's entry holds."""
    if _native_make_tensor is not None:
        t = _native_make_tensor(size, stride, dtype, nbytes, _fake_ptr(nbytes))
        t.untyped_storage()._tpu = StorageData(buf, nbytes, dtype)
        return t
    t = _create_empty(_EMPTY, dtype)
    _set_storage(_CPU_KEYSET, t, new_storage(nbytes, buf, dtype), 0, size, stride)
    return t


_EMPTY = [0]


def replace_storage(t: torch.Tensor, size, buf) -> None:
    """Give ``t`` a fresh contiguous storage of ``size`` (``resize_``/``set_`` semantics)."""
    size = tuple(size)
    stride, numel = _layout.contiguous(size)
    if buf is None:
        buf = _zeros_flat(numel, dtypes.to_jax(t.dtype))
    _set_storage(_CPU_KEYSET, t, new_storage(numel * t.dtype.itemsize, buf, t.dtype), 0, size, stride)


def grown_storage(t: torch.Tensor, nbytes: int) -> torch.UntypedStorage:
    """A new storage of ``nbytes`` starting with the bytes of ``t``'s storage, zeros after
    (``resize_`` growing a tensor). Storages here are not resizable in place, so other views of
    the old storage keep the old one."""
    numel = -(-nbytes // t.dtype.itemsize)
    check_allocation(nbytes)
    try:
        buf = _layout.fit(storage_data(t).buf.reshape(-1), numel)
    except Exception as e:
        if is_resource_exhausted(e):
            raise out_of_memory_from(e, nbytes) from e
        raise
    return new_storage(nbytes, buf, t.dtype)


def _dev():
    global _DEV
    _DEV = torch.device("tpu", 0)
    return _DEV


def layout(t: torch.Tensor):
    """Hashable description of how ``t`` reads its flat buffer."""
    return (tuple(t.shape), t.stride(), t.storage_offset())


def covers_storage(t: torch.Tensor, buf) -> bool:
    """Is ``t`` a contiguous view of all of flat ``buf`` (so ``buf`` holds exactly its elements)?"""
    size, stride, offset = layout(t)
    return offset == 0 and buf.size == math.prod(size) and _layout.is_contiguous(size, stride)


# ---------------------------------------------------------------- values as jax arrays
def logical_value(t: torch.Tensor):
    """The jax array holding the value of tpu tensor ``t`` (a copy only if ``t`` is a strided view
    or carries a conjugate / negative bit)."""
    buf = storage_data(t).buf
    bits = _layout.math_bits(t)
    if bits is None and covers_storage(t, buf):
        return buf if tuple(buf.shape) == tuple(t.shape) else buf.reshape(t.shape)
    return _read_jit(layout(t), bits)(buf)


def flat_value(t: torch.Tensor):
    """``t``'s elements as a flat jax array, with no device work when ``t`` covers its whole
    storage (the storage's own buffer, whatever shape it was produced in)."""
    buf = storage_data(t).buf
    if covers_storage(t, buf) and _layout.math_bits(t) is None:
        return buf
    return logical_value(t).reshape(-1)


@functools.lru_cache(maxsize=4096)
def _read_jit(lay, bits=None):
    return jax.jit(lambda b: _layout.apply_math_bits(_layout.read(b, lay), bits))


def from_jax_array(arr, dtype=None) -> torch.Tensor:
    """A tpu tensor holding jax array ``arr`` (a numpy array is transferred)."""
    arr = to_device(arr) if isinstance(arr, np.ndarray) else jnp.asarray(arr)
    dt = dtypes.to_torch(arr.dtype) if dtype is None else dtype
    return new_tensor(arr.shape, dt, arr)


_write_cache: dict = {}
_cast_cache: dict = {}


def write_value(dst: torch.Tensor, value) -> None:
    """Write ``value`` (a jax or numpy array; broadcast and cast) into tpu tensor ``dst``: a buffer
    swap when ``dst`` covers its whole storage, else a strided write. Every view of the storage
    sees it. A host value into a small storage is written on the host (no program per layout)."""
    sd = storage_data(dst)
    lay = layout(dst)
    size = lay[0]
    if tuple(value.shape) != tuple(size):
        try:
            np.broadcast_shapes(value.shape, size)
        except ValueError:
            raise RuntimeError(
                f"The size of tensor a ({list(size)}) must match the size of tensor b ({list(value.shape)})"
            ) from None
    bits = _layout.math_bits(dst)
    if isinstance(value, np.ndarray):
        if covers_storage(dst, sd.buf) or sd.buf.size <= _HOST_STRIDED_MAX:
            sd.buf = _write_on_host(sd.buf, lay, bits, value, np.dtype(dtypes.to_jax(dst.dtype)))
            return
        value = to_device(value)
    if bits is not None:  # the buffer holds what reads through the bits give back as ``value``
        value = _unbits_jit(bits)(value)
    if covers_storage(dst, sd.buf) and tuple(value.shape) == tuple(size):
        jd = dtypes.to_jax(dst.dtype)
        sd.buf = value if value.dtype == jd else _cast(value, jd)
        return
    key = (lay, sd.buf.shape, sd.buf.dtype, value.shape, value.dtype)
    fn = _write_cache.get(key)
    if fn is None:
        fn = jax.jit(lambda b, v: _layout.write(b, lay, v))
        _write_cache[key] = fn
    sd.buf = fn(sd.buf, value)


@functools.lru_cache(maxsize=None)
def _unbits_jit(bits):
    return jax.jit(lambda v: _layout.apply_math_bits(v, bits))


def _cast(value, jd):
    key = (value.dtype, jd)
    fn = _cast_cache.get(key)
    if fn is None:
        fn = jax.jit(lambda v: _layout.cast(v, jd))
        _cast_cache[key] = fn
    return fn(value)


# ---------------------------------------------------------------- host transfers
# A strided view of a storage up to this many elements (or covering a quarter of it) is read and
# written on the host: the whole buffer crosses, but no XLA program is built per layout, which a
# stream of new shapes (or a test over many views) would otherwise pay again and again.
_HOST_STRIDED_MAX = 1 << 16


def _host_view(flat, lay, writeable=False):
    size, stride, offset = lay
    item = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], size, [s * item for s in stride], writeable=writeable)


def _host_bits(x, bits):
    if bits is not None:
        conj, neg = bits
        x = np.conj(x) if conj else x
        x = np.negative(x) if neg else x
    return x


def _host_cast(x, dtype):
    if np.iscomplexobj(x) and not np.issubdtype(dtype, np.complexfloating):
        x = x.real  # PyTorch keeps the real part
    return x.astype(dtype, copy=False)


def _write_on_host(buf, lay, bits, value, dtype):
    """``buf`` with ``value`` written at layout ``lay`` (through the math ``bits``), done on the host."""
    value = _host_bits(_host_cast(np.asarray(value), dtype), bits)
    size = lay[0]
    if lay[2] == 0 and buf.size == math.prod(size) and _layout.is_contiguous(size, lay[1]):
        return to_device(np.broadcast_to(value, size)).reshape(buf.shape)
    flat = np.array(to_host(buf)).reshape(-1)  # a private copy to write into
    _host_view(flat, lay, writeable=True)[...] = value
    return to_device(flat).reshape(buf.shape)


def to_host(arrays):
    """``jax.device_get`` of a device array (or a list of them), counted in ``host_transfer_bytes``:
    every device->host read of the runtime goes through here or ``to_numpy_host``."""
    metrics.record_host_transfer(sum(a.nbytes for a in arrays) if isinstance(arrays, list) else arrays.nbytes)
    return jax.device_get(arrays)


def to_numpy_host(t: torch.Tensor) -> np.ndarray:
    """Host copy of a tpu tensor's logical value (blocks). The one host-read path."""
    if RECORDER.pending:
        RECORDER.flush("host_read")
    try:
        sd = storage_data(t)
        buf = sd.buf
        bits = _layout.math_bits(t)
        lay = layout(t)
        if bits is None and covers_storage(t, buf):
            host = np.asarray(to_host(buf)).reshape(lay[0])
        elif buf.size <= _HOST_STRIDED_MAX or 4 * math.prod(lay[0]) >= buf.size:
            flat = np.asarray(to_host(buf)).reshape(-1)
            host = _host_bits(np.array(_host_view(flat, lay)), bits)
        else:
            host = np.asarray(to_host(logical_value(t)))
    except Exception as e:  # a fused graph still in flight failed: name the lines that recorded it
        RECORDER.explain(e)
        raise
    checks.raise_pending()  # the host waited: the device-side index checks of earlier ops are in
    return host
