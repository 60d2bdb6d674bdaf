"""Zero-copy exchange with JAX."""

from __future__ import annotations

import torch

from .registry import from_jax_array, logical_value


def to_jax(t: torch.Tensor):
    """The ``jax.Array`` behind tpu tensor ``t`` (no host copy; a device copy only for strided views)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "tpu":
        raise TypeError(f"torchtpu.to_jax expects a tpu tensor, got {type(t).__name__} on "
                        f"{getattr(t, 'device', None)}")
    return logical_value(t)


def from_jax(a, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tpu tensor holding ``jax.Array`` ``a`` (no host copy)."""
    return from_jax_array(a, dtype)
