"""Kernels that are not lowerings: metadata-only views, copies across devices,
factories, host reads and storage resizing."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from ..base import dtypes
from ..base.frames import warn_once_at_user_line
from ..dispatch.kernel import Kernel, check_no_internal_overlap
from ..dispatch.lowering import LOWERINGS, impl, lower
from ..runtime import layout as _layout
from ..runtime import storage
from ..runtime.device import check_device

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


# ---------------------------------------------------------------- views: metadata only
def _metadata_view(op):
    handle = op._handle

    def kernel(*args, **kwargs):
        return handle.redispatch_boxed(_CPU, *args, **kwargs)

    return kernel


for _name in (
    "as_strided",
    "view",
    "_reshape_alias",
    "unfold",
    "view_as_real",
    "view_as_complex",
    "as_strided_",
    "set_.source_Tensor",
    "set_.source_Storage",
    "set_.source_Storage_storage_offset",
):
    _qual = _name if "." in _name else _name + ".default"
    _pkt, _ov = _qual.split(".")
    impl(_qual)(_metadata_view(getattr(getattr(aten, _pkt), _ov)))


_view_dtype_metadata = _metadata_view(aten.view.dtype)


@impl("view.dtype")
def _view_dtype(self, dtype):
    # PyTorch's own kernel: its checks and messages, a view of the same storage (the storage's
    # buffer is reinterpreted in the new dtype when it is next read: StorageData.retype)
    dtypes.to_jax(dtype)  # refuse a dtype tpu cannot hold (complex32) by name, before any view exists
    return _view_dtype_metadata(self, dtype)


# ---------------------------------------------------------------- factories
def _check_factory(device, dtype):
    check_device(device)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    dtypes.to_jax(dtype)  # clear error for an unsupported dtype
    return dtype


@impl("empty.memory_format")
def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = _check_factory(device, dtype)
    if any(s < 0 for s in size):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(size)}: {list(size)}")
    if memory_format is not None and memory_format != torch.contiguous_format:
        # PyTorch's strides for the format (channels_last...), and its error for a format empty refuses
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
        return storage.new_tensor(size, dtype, stride=stride)
    return storage.new_tensor(size, dtype)


@impl("empty_strided")
def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = _check_factory(device, dtype)
    if any(s < 0 for s in size):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(size)}: {list(size)}")
    return storage.new_tensor(size, dtype, stride=tuple(stride))


@lower("scalar_tensor")
def _scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return jnp.asarray(s)


@lower("arange.start_step", static=("start", "end", "step"))
def _arange(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    n = max(0, math.ceil((end - start) / step))
    return start + jnp.arange(n) * step


@lower("arange.default", static=("end",))
def _arange0(end, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return jnp.arange(end)


@lower("arange.start", static=("start", "end"))
def _arange1(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return jnp.arange(start, end)


# ---------------------------------------------------------------- copies
def _cpu_to_jax(t: torch.Tensor):
    return storage.to_device(dtypes.cpu_tensor_to_numpy(t.contiguous()))


_COMPLEX_TO_REAL = "Casting complex values to real discards the imaginary part"


def _warn_complex_to_real(src_dtype, dst_dtype):
    if src_dtype.is_complex and not dst_dtype.is_complex:
        warn_once_at_user_line(_COMPLEX_TO_REAL)


@lower("copy", warn=lambda dst, src, non_blocking=False, inplace=False: _warn_complex_to_real(src.dtype, dst.dtype))
def _copy(dst, src, non_blocking=False):
    return _layout.cast(jnp.broadcast_to(src, dst.shape), dst.dtype)


@lower("_to_copy")
def _to_copy_tpu(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return x  # the kernel executor casts to the dtype PyTorch's meta gives


_copy_inplace = Kernel(aten.copy_.default, LOWERINGS["aten::copy.default"], functional=aten.copy.default)
_to_copy_kernel = Kernel(aten._to_copy.default, LOWERINGS["aten::_to_copy.default"])


@impl("copy_")
def _copy_(dst, src, non_blocking=False):
    if dst.device.type == "tpu":
        _warn_complex_to_real(src.dtype, dst.dtype)
        if src.device.type == "tpu":
            # recorded like any op under DeferAndFuse
            return _copy_inplace(dst, src, non_blocking)
        elif src.device.type == "cpu":
            check_no_internal_overlap(dst)
            value = dtypes.cpu_tensor_to_numpy(src)
        else:
            raise RuntimeError(f"torchtpu: cannot copy from {src.device} to tpu")
        storage.write_value(dst, value)
        return dst
    # dst on cpu (or elsewhere), src on tpu
    host = dtypes.numpy_to_torch(storage.to_numpy_host(src), src.dtype)
    with torch._C._DisableAutocast() if hasattr(torch._C, "_DisableAutocast") else _null():
        dst.copy_(host)
    return dst


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@impl("_to_copy")
def _to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    dtype = self.dtype if dtype is None else dtype
    target = torch.device("tpu") if device is None else torch.device(device)
    if target.type == "tpu":  # a copy to the CPU casts there, and CPU warns itself
        _warn_complex_to_real(self.dtype, dtype)
    if self.device.type == "tpu" and target.type == "tpu":
        check_device(target)
        return _to_copy_kernel(self, dtype=dtype, memory_format=memory_format)
    if self.device.type == "tpu" and target.type == "cpu":
        host = dtypes.numpy_to_torch(storage.to_numpy_host(self), self.dtype)
        if dtype != self.dtype:
            host = host.to(dtype)
        host = _in_memory_format(host, self, memory_format)
        if pin_memory:
            host = host.pin_memory()
        return host
    if target.type == "tpu":  # cpu -> tpu arrives here only through explicit dispatch
        check_device(target)
        value = _cpu_to_jax(self.to(dtype))
        return storage.new_tensor(self.shape, dtype, value)
    raise RuntimeError(f"torchtpu: cannot copy a tpu tensor to {target}")


def _in_memory_format(host, like, memory_format):
    """Contiguous CPU copy ``host`` of tpu tensor ``like`` laid out as PyTorch's ``_to_copy`` lays it:
    ``like``'s own strides for a dense tensor under preserve_format, else the format asked for."""
    if memory_format is None or memory_format == torch.preserve_format:
        if like.is_contiguous() or not _layout.is_dense(like.shape, like.stride()):
            return host
        return torch.empty_strided(like.shape, like.stride(), dtype=host.dtype).copy_(host)
    return host.contiguous(memory_format=memory_format)


@impl("_local_scalar_dense")
def _local_scalar_dense(self):
    arr = storage.to_numpy_host(self)
    return arr.reshape(()).item() if arr.dtype != np.dtype(jnp.bfloat16) else float(arr.reshape(()))


@impl("resize_")
def _resize_(self, size, memory_format=None):
    # PyTorch's meta resize_ on a twin with this tensor's storage size gives CPU's checks, messages,
    # strides (memory formats included) and storage growth
    st = self.untyped_storage()
    twin = torch.empty(0, dtype=self.dtype, device="meta").set_(
        torch.UntypedStorage(st.nbytes(), device="meta"), self.storage_offset(), self.shape, self.stride())
    if memory_format is None:
        twin.resize_(size)
    else:
        twin.resize_(size, memory_format=memory_format)
    nbytes = twin.untyped_storage().nbytes()
    if nbytes > st.nbytes():
        st = storage.grown_storage(self, nbytes)
    aten.set_.source_Storage_storage_offset(self, st, twin.storage_offset(), twin.shape, twin.stride())
    return self
