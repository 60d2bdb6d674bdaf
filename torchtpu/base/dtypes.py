"""torch dtype <-> jax dtype, and host (numpy) conversions that keep dtypes exact."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e4m3fnuz: jnp.float8_e4m3fnuz,
    torch.float8_e5m2fnuz: jnp.float8_e5m2fnuz,
    torch.float8_e8m0fnu: jnp.float8_e8m0fnu,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}

# numpy has no bfloat16/float8: host copies go through a same-width integer view
_BITCAST_VIA = {
    torch.bfloat16: (torch.int16, np.int16),
    torch.float8_e4m3fn: (torch.int8, np.int8),
    torch.float8_e5m2: (torch.int8, np.int8),
    torch.float8_e4m3fnuz: (torch.int8, np.int8),
    torch.float8_e5m2fnuz: (torch.int8, np.int8),
    torch.float8_e8m0fnu: (torch.uint8, np.uint8),
}


def to_jax(dtype: torch.dtype):
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(
            f"torchtpu: dtype {dtype} is not supported on tpu "
            f"(supported: {', '.join(str(d).removeprefix('torch.') for d in _TORCH_TO_JAX)})"
        ) from None


@functools.lru_cache(maxsize=None)
def scalar_type_name(dtype: torch.dtype) -> str:
    """PyTorch's C++ name of ``dtype`` as its error messages spell it (``Float``, ``Long``, ``BFloat16``)."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def to_torch(jdtype) -> torch.dtype:
    try:
        return _JAX_TO_TORCH[np.dtype(jdtype)]
    except KeyError:
        raise TypeError(f"torchtpu: jax dtype {jdtype} has no torch equivalent") from None


def cpu_tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array with the exact jax dtype of ``t`` (no copy when possible)."""
    to_jax(t.dtype)  # a clear error naming an unsupported dtype (complex32, ...), not numpy's
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    via = _BITCAST_VIA.get(t.dtype)
    if via is not None:
        return t.contiguous().view(via[0]).numpy().view(np.dtype(to_jax(t.dtype)))
    return t.numpy()


def numpy_to_torch(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` holding a copy of ``arr`` in torch's own memory (resizable, as
    ``out=`` kernels and ``resize_`` need; a tensor over numpy's memory is not)."""
    arr = np.asarray(arr)
    via = _BITCAST_VIA.get(dtype)
    if via is not None:
        arr = arr.view(via[1])
    src = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    out = torch.empty(arr.shape, dtype=src.dtype if via is None else via[0]).copy_(src)
    if via is not None:
        return out.view(dtype)
    return out if out.dtype == dtype else out.to(dtype)


def numpy_view_as_torch(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over ``arr``'s own memory, no copy (bfloat16/float8 through a same-width int view);
    ``arr`` must already hold ``dtype``'s elements."""
    via = _BITCAST_VIA.get(dtype)
    if via is not None:
        return torch.from_numpy(arr.view(via[1])).view(dtype)
    return torch.from_numpy(arr)


assert ml_dtypes  # jax's bfloat16 numpy type comes from ml_dtypes
