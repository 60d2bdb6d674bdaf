"""Memory accounting of device buffers: what ``torch.tpu.memory_allocated`` and the peak report."""

from __future__ import annotations

import re
import threading

import torch

from . import platform


class MemoryStats:
    """Bytes of live device buffers, counted per storage."""

    def __init__(self):
        # reentrant: a storage's __del__ (sub) can run inside add on the same thread, when the
        # garbage collector or a tracer (coverage, hypothesis) runs Python code there
        self.lock = threading.RLock()
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

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.allocated

    def snapshot(self) -> tuple[int, int, int]:
        """(allocated, peak, number of storages), read together."""
        with self.lock:
            return self.allocated, self.peak, self.num_storages


MEMORY = MemoryStats()


# ---------------------------------------------------------------- allocations that cannot succeed
# Below this a request is not checked against the free memory before it is made (the check reads the
# device's memory statistics); XLA's own RESOURCE_EXHAUSTED still becomes torch.OutOfMemoryError.
CHECK_FROM_BYTES = 64 << 20
_MAX_BYTES = (1 << 63) - 1  # PyTorch's storage sizes are int64


def _fmt(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def out_of_memory(requested: int, free: int | None = None, total: int | None = None) -> torch.OutOfMemoryError:
    """The ``torch.OutOfMemoryError`` of a tpu allocation of ``requested`` bytes, worded as CUDA's."""
    if free is None or total is None:
        free, total = platform.memory_info()
    allocated = MEMORY.allocated
    return torch.OutOfMemoryError(
        f"tpu out of memory. Tried to allocate {_fmt(requested)} ({requested} bytes). tpu 0 has a total capacity "
        f"of {_fmt(total)} ({total} bytes) of which {_fmt(free)} ({free} bytes) is free. Of the allocated memory "
        f"{_fmt(allocated)} is allocated by tensors ({MEMORY.num_storages} storages).")


_fraction = [1.0]  # torch.tpu.set_per_process_memory_fraction


def set_memory_fraction(fraction: float) -> None:
    _fraction[0] = float(fraction)


def memory_fraction() -> float:
    return _fraction[0]


def check_allocation(nbytes: int, sizes=None) -> None:
    """Refuse, before XLA is asked, an allocation that cannot succeed: a size overflowing int64 (the
    ``RuntimeError`` CPU raises; XLA would abort the interpreter) or more bytes than are free
    (``torch.OutOfMemoryError``, with the requested and free bytes)."""
    if nbytes > _MAX_BYTES:
        shown = list(sizes) if sizes is not None else [nbytes]
        raise RuntimeError(f"Storage size calculation overflowed with sizes={shown}")
    if _fraction[0] < 1.0:  # the process's cap: what its tensors hold plus this request
        free, total = platform.memory_info()
        cap = int(_fraction[0] * total)
        if MEMORY.allocated + nbytes > cap:
            raise out_of_memory(nbytes, min(free, max(cap - MEMORY.allocated, 0)), total)
    if nbytes >= CHECK_FROM_BYTES:
        free, total = platform.memory_info()
        if nbytes > free:
            raise out_of_memory(nbytes, free, total)


def is_resource_exhausted(e: BaseException) -> bool:
    """Is ``e`` XLA's out-of-memory error (a ``JaxRuntimeError`` RESOURCE_EXHAUSTED)?"""
    return type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "RESOURCE_EXHAUSTED" in str(e)


def out_of_memory_from(e: BaseException, requested: int = 0) -> torch.OutOfMemoryError:
    """``torch.OutOfMemoryError`` for XLA's RESOURCE_EXHAUSTED ``e``: the bytes XLA says it tried to
    allocate, else ``requested``."""
    m = re.search(r"allocating (\d+) bytes", str(e))
    return out_of_memory(int(m.group(1)) if m else requested)
