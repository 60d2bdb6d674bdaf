"""Zero-copy exchange with JAX."""

from __future__ import annotations

import torch

from .base import dtypes
from .runtime import layout, storage


def _check_tpu(t, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "tpu":
        raise TypeError(f"torchtpu.{what} expects a tpu tensor, got {type(t).__name__} on "
                        f"{getattr(t, 'device', None)}")


def to_jax(t: torch.Tensor, *, flat: bool = False):
    """The ``jax.Array`` behind tpu tensor ``t`` (no host copy; a device copy only for strided views).

    ``flat=True`` gives ``t``'s elements as a 1-D array, which is the storage's own buffer (no device
    work at all) when ``t`` covers its whole storage contiguously."""
    _check_tpu(t, "to_jax")
    return storage.flat_value(t) if flat else storage.logical_value(t)


def from_jax(a, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tpu tensor holding ``jax.Array`` ``a`` (no host copy)."""
    return storage.from_jax_array(a, dtype)


def assign_jax(t: torch.Tensor, a) -> torch.Tensor:
    """Make tpu tensor ``t`` hold the value of ``jax.Array`` ``a`` (broadcast and cast to ``t``), in
    place: every view of ``t``'s storage sees it. A tensor that covers its whole storage takes ``a``
    itself (no device work); a strided view is written through. Returns ``t``."""
    _check_tpu(t, "assign_jax")
    storage.write_value(t, a)
    return t


def bytes_of(a):
    """Flat ``uint8`` bytes of jax array ``a`` (traceable inside ``jax.jit``; bool is one byte,
    complex is (real, imag) pairs)."""
    return layout.to_bytes(a)


def array_from_bytes(u8, dtype: torch.dtype, numel: int):
    """``numel`` elements of torch ``dtype`` from flat ``uint8`` jax bytes (traceable; zero-padded)."""
    return layout.from_bytes(u8, dtypes.to_jax(dtype), numel)
