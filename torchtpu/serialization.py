"""Storage-level plumbing so that torch's copy, pickle and save machinery works on tpu.

Why this is needed: torch builds ``deepcopy``, ``pickle``, ``torch.save`` and
``torch.load`` on *storages*. ``copy.deepcopy(t)`` clones ``t``'s
``UntypedStorage``; ``torch.save`` writes ``storage.cpu()`` under the location
tag ``"tpu:0"``; ``torch.load`` (and unpickling, which is ``torch.load`` of a
legacy stream) rebuilds it with ``torch.UntypedStorage(n, device="tpu")`` plus
``storage.copy_``. For a PrivateUse1 device written in Python that first step
is fatal: torch 2.13 takes the device allocator from a C++ table that Python
cannot fill, finds none, and dereferences it (a segfault).

So, rather than special-casing tensors (a tensor-level ``__reduce_ex__`` would
also lose storage sharing between views and ignore ``map_location``), tpu
storages are given the few storage operations torch's own code relies on:

- ``UntypedStorage(n, device="tpu")`` makes a storage of ``n`` zero bytes (this
  is the crash fix; everything else in torch then goes through tpu kernels:
  ``storage.copy_`` is a byte-view ``copy_``, and ``runtime/storage.py`` lets a tensor
  of any dtype read a storage's bytes);
- ``clone()`` (deepcopy) shares the immutable jax buffer: no device work;
- ``cpu()`` (``torch.save``) and ``_write_file`` / ``_set_from_file``
  (pickle's legacy save and load) move the bytes through a host storage,
  and ``_byteswap`` (``torch.load`` of a big-endian file) works on the
  buffer, instead of through the data pointer, which on tpu is a fake,
  never-dereferenceable address (torch's C++ would segfault on it);
- slicing (an aliasing view at an address) raises a clear error; in-place
  ``resize_`` (a C++ hook Python cannot provide) frees the device memory at 0
  bytes and allocates it again at the storage's size (FSDP2's use), and
  raises a clear error for any other size.

``torch.load``'s location tags need nothing extra: torch's PrivateUse1
package (``register_package(23, ...)``) tags tpu storages ``"tpu:0"`` and
restores them with ``storage.to("tpu:0")`` after checking
``torch.tpu.device_count()``; ``map_location="cpu"`` keeps them on the host.

Pickling a tpu tensor is torch's own path (the storage pickles as a legacy
``torch.save`` blob), with the loader named from this module so that
unpickling imports torchtpu.

``torch.multiprocessing`` shares CPU tensors through shared memory and cuda
ones through IPC handles; a tpu tensor has neither, so its reducer sends the
value (the receiving process holds its own chip) instead of failing inside
``_share_fd_cpu_``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .base import metrics
from .runtime import device as _device
from .runtime import storage as _storage

_UntypedStorage = torch.UntypedStorage
_orig_new = torch._C.StorageBase.__new__
_orig_clone = _UntypedStorage.clone
_orig_cpu = _UntypedStorage.cpu
_orig_write_file = _UntypedStorage._write_file
_orig_set_from_file = _UntypedStorage._set_from_file
_orig_byteswap = _UntypedStorage._byteswap
_orig_getitem = _UntypedStorage.__getitem__
_orig_resize = _UntypedStorage.resize_
_orig_reduce = _UntypedStorage.__reduce__
_orig_typed_reduce = torch.TypedStorage.__reduce__


def _tpu_device(device):
    """``device`` as a tpu ``torch.device``, or None if it names another device."""
    if device is None:
        return None
    if isinstance(device, int):  # torch reads a bare index as one of the current accelerator
        acc = torch._C._accelerator_getAccelerator()
        return torch.device("tpu", device) if acc is not None and acc.type == "tpu" else None
    device = torch.device(device)
    return device if device.type == "tpu" else None


def _tpu_data(s) -> _storage.StorageData:
    sd = getattr(s, "_tpu", None)
    if sd is None:
        raise RuntimeError(
            "torchtpu: this tpu storage has no device data attached (it was not made by torchtpu)"
        )
    return sd


def new_storage(nbytes: int, host_bytes: np.ndarray | None = None) -> torch.UntypedStorage:
    """A tpu ``UntypedStorage`` of ``nbytes`` bytes (zeros, or ``host_bytes``)."""
    if nbytes < 0:
        raise RuntimeError(f"Storage size must be non-negative, got {nbytes}")
    if host_bytes is None:
        buf = _storage.to_device(np.zeros((nbytes,), np.uint8))
    else:
        host_bytes = np.ascontiguousarray(host_bytes, dtype=np.uint8).reshape(-1)
        metrics.record_host_transfer(host_bytes.nbytes)
        buf = jax.device_put(host_bytes, _device.jax_device())
    return _storage.new_storage(nbytes, buf, torch.uint8)


def host_bytes(s) -> np.ndarray:
    """The bytes of tpu storage ``s`` as a host ``uint8`` array (one device->host transfer)."""
    sd = _tpu_data(s)
    arr = np.asarray(_storage.to_host(sd.buf)).reshape(-1)
    return np.ascontiguousarray(arr).view(np.uint8)[: sd.nbytes]


def _storage_new(cls, *args, device=None, **kwargs):
    tpu = _tpu_device(device)
    if tpu is None:
        if device is None:
            return _orig_new(cls, *args, **kwargs)
        return _orig_new(cls, *args, device=device, **kwargs)
    _device.check_device(tpu)
    if cls is not _UntypedStorage:
        raise TypeError(f"torchtpu: cannot make a {cls.__name__} on tpu (use torch.UntypedStorage)")
    if kwargs:
        raise TypeError(f"torchtpu: UntypedStorage(..., device='tpu') got unsupported arguments {sorted(kwargs)}")
    if not args:
        return new_storage(0)
    if len(args) != 1:
        raise TypeError("torchtpu: UntypedStorage(size or sequence, device='tpu') takes one argument")
    (arg,) = args
    if isinstance(arg, int):
        return new_storage(arg)
    # a sequence of byte values, as for a CPU storage
    host = np.asarray(torch.UntypedStorage(arg).tolist(), dtype=np.uint8)
    return new_storage(host.size, host)


def _storage_clone(self):
    if self.device.type != "tpu":
        return _orig_clone(self)
    sd = _tpu_data(self)
    # jax arrays are immutable and every write replaces a storage's buffer, so
    # sharing the buffer is a copy (the zero-copy deepcopy of a model).
    return _storage.new_storage(sd.nbytes, sd.buf, sd.dtype)


def _storage_cpu(self):
    if self.device.type != "tpu":
        return _orig_cpu(self)
    return torch.from_numpy(host_bytes(self).copy()).untyped_storage()


def _storage_write_file(self, *args, **kwargs):
    if self.device.type != "tpu":
        return _orig_write_file(self, *args, **kwargs)
    return _storage_cpu(self)._write_file(*args, **kwargs)


def _storage_set_from_file(self, f, offset, is_real_file, element_size):
    if self.device.type != "tpu":
        return _orig_set_from_file(self, f, offset, is_real_file, element_size)
    host = torch.UntypedStorage(self.nbytes())
    host._set_from_file(f, offset, is_real_file, element_size)
    self.copy_(host)
    return self


def _storage_byteswap(self, elem_size):
    if self.device.type != "tpu":
        return _orig_byteswap(self, elem_size)
    n = self.nbytes()
    if elem_size not in (1, 2, 4, 8) or n % elem_size:
        raise RuntimeError(f"byteswap: {n} bytes cannot be swapped in elements of {elem_size} bytes")
    sd = _tpu_data(self)
    sd.retype(torch.uint8)
    sd.buf = jnp.flip(sd.buf.reshape(-1, elem_size), axis=1).reshape(-1)


def _storage_getitem(self, *args, **kwargs):
    if self.device.type == "tpu" and args and isinstance(args[0], slice):
        # a storage slice aliases memory at an address; tpu bytes have none
        raise RuntimeError("torchtpu: a tpu storage cannot be sliced; slice a tensor over it instead")
    return _orig_getitem(self, *args, **kwargs)


def _storage_resize(self, size):
    if self.device.type != "tpu":
        return _orig_resize(self, size)
    # torch keeps a PrivateUse1 storage's byte count in C++, which only a C++ hook could change. What
    # FSDP2 does with resize_ still has its meaning: resize_(0) frees the device memory, and
    # resize_(nbytes()) gives the storage memory again (zeros; written before it is read).
    if size == 0:
        _tpu_data(self).release()
        return self
    if size == self.nbytes():
        _tpu_data(self).buf  # noqa: B018 - allocates a released storage's buffer
        return self
    raise RuntimeError(
        f"torchtpu: a tpu storage cannot be resized in place from {self.nbytes()} to {size} bytes (only to 0, "
        "which frees its memory, and back); resize the tensor (t.resize_) or make a new storage"
    )


# ---------------------------------------------------------------- pickle
def load_storage_bytes(b: bytes):
    """Unpickle a tpu storage. Being in torchtpu, naming it in the pickle stream makes
    ``pickle.loads`` import torchtpu (so a Ray worker that never imported it gets tpu
    tensors, not "TPU device module is not registered")."""
    return torch.storage._load_from_bytes(b)


def _storage_reduce(self):
    fn, args = _orig_reduce(self)
    return (load_storage_bytes, args) if self.device.type == "tpu" else (fn, args)


def _typed_storage_reduce(self):
    fn, args = _orig_typed_reduce(self)
    return (load_storage_bytes, args) if self._untyped_storage.device.type == "tpu" else (fn, args)


# ---------------------------------------------------------------- torch.multiprocessing
def _rebuild_tpu_tensor(cls, cpu_tensor, requires_grad):
    t = cpu_tensor.to("tpu")
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t


def _install_multiprocessing():
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    torch_reduce_tensor = reductions.reduce_tensor

    def reduce_tensor(tensor):
        if tensor.device.type != "tpu":
            return torch_reduce_tensor(tensor)
        if tensor.requires_grad and not tensor.is_leaf:
            return torch_reduce_tensor(tensor)  # torch's own clear error
        return (_rebuild_tpu_tensor, (type(tensor), tensor.detach().cpu(), tensor.requires_grad))

    # torch registers its reducer per tensor class when torch.multiprocessing is imported
    for cls, reducer in list(ForkingPickler._extra_reducers.items()):
        if reducer is torch_reduce_tensor:
            ForkingPickler.register(cls, reduce_tensor)
    reductions.reduce_tensor = reduce_tensor


_installed = False


def install() -> None:
    """Give tpu storages the operations torch's deepcopy/pickle/save/load use (idempotent)."""
    global _installed
    if _installed:
        return
    _UntypedStorage.__new__ = staticmethod(_storage_new)
    _UntypedStorage.clone = _storage_clone
    _UntypedStorage.cpu = _storage_cpu
    _UntypedStorage._write_file = _storage_write_file
    _UntypedStorage._set_from_file = _storage_set_from_file
    _UntypedStorage._byteswap = _storage_byteswap
    _UntypedStorage.__getitem__ = _storage_getitem
    _UntypedStorage.resize_ = _storage_resize
    _UntypedStorage.__reduce__ = _storage_reduce
    torch.TypedStorage.__reduce__ = _typed_storage_reduce
    _install_multiprocessing()
    _installed = True
