"""Weight quantization of a model on ``tpu`` through torchao.

``torchao.quantization.quantize_`` works on a tpu model as it is: torchao's tensor subclasses
(``Int8Tensor``, ``Float8Tensor``) wrap plain tpu tensors, and the aten ops their linears issue
have tpu lowerings (``ops/linalg.py``: ``_int_mm`` and int8 ``mm`` as integer dots accumulating
in int32, ``_scaled_mm`` / ``_weight_int8pack_mm``, the ``out_dtype`` higher-order op in eager
and compiled graphs). :func:`quantize_` adds what a user of a whole model needs around it: one
name per scheme, the layers left in float named in one warning, and float8 refused with a clear
error where the XLA backend cannot run it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from .runtime import device as _device

SCHEMES = ("int8_weight_only", "int8_dynamic", "fp8_weight_only")


@functools.cache
def float8_supported() -> bool:
    """Whether the XLA backend of the tpu device compiles and runs a float8 dot (float32 accumulation)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    try:
        a = jax.device_put(jnp.ones((2, 2), jnp.float8_e4m3fn), _device.jax_device())
        out = jax.jit(lambda x: lax.dot(x, x, preferred_element_type=jnp.float32))(a)
        return bool(out[0, 0] == 2.0)
    except Exception:  # XLA refuses the type or the dot on this backend
        return False


def _config(scheme: str):
    from torchao.quantization import (Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                      Int8WeightOnlyConfig)

    return {"int8_weight_only": Int8WeightOnlyConfig, "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
            "fp8_weight_only": Float8WeightOnlyConfig}[scheme]()


def _matmul_layers(model: nn.Module) -> dict:
    """Every module that multiplies by a 2-D weight of its own: ``nn.Linear``, and look-alikes such
    as GPT-2's ``Conv1D`` (which torchao does not quantize). Embeddings are lookups, not matmuls."""
    out = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, nn.Linear) or (
                isinstance(w, torch.Tensor) and w.dim() == 2 and not isinstance(mod, nn.Embedding)
                and not list(mod.children())):
            out[name] = mod
    return out


def quantize_(model: nn.Module, scheme: str, *, skip: Optional[Callable[[str, nn.Module], bool]] = None,
              keep_output_layer: bool = True) -> list:
    """Quantize ``model``'s linear layers in place with torchao (``scheme``: ``"int8_weight_only"``,
    ``"int8_dynamic"`` (int8 activations too, an int8 x int8 dot) or ``"fp8_weight_only"``);
    returns the names of the quantized layers.

    ``keep_output_layer``: leave the model's output projection (``get_output_embeddings()``,
    often tied to the input embedding) in float, as vLLM and FlashRL do: its logits feed the
    sampler directly. ``skip(name, module)`` keeps more layers in float. Other layers that cannot
    be quantized (not an ``nn.Linear``, or torchao refuses the weight) stay in float, named in one
    warning. ``fp8_weight_only`` on an XLA backend without float8 is an error.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"torchtpu.quantization.quantize_: scheme must be one of {SCHEMES}, not {scheme!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"torchtpu.quantization.quantize_: model must be an nn.Module, not {type(model).__name__}")
    if scheme.startswith("fp8") and not float8_supported():
        raise RuntimeError(
            f"torchtpu.quantization.quantize_: {scheme!r} needs float8 support in the XLA backend, and the "
            f"{_device.jax_device().platform!r} backend here cannot run a float8 dot; use 'int8_weight_only' "
            "or 'int8_dynamic'")
    from torchao.quantization import quantize_ as ao_quantize_

    out_layer = model.get_output_embeddings() if keep_output_layer and hasattr(model, "get_output_embeddings") \
        else None
    config = _config(scheme)
    done, refused = [], []
    for name, mod in _matmul_layers(model).items():
        if mod is out_layer or (skip is not None and skip(name, mod)):
            continue
        if type(mod) is not nn.Linear or not mod.weight.dtype.is_floating_point:
            refused.append(f"{name} ({type(mod).__name__})")
            continue
        try:
            # one layer at a time, so a weight torchao refuses leaves that layer alone
            ao_quantize_(mod, config, filter_fn=lambda m, fqn: m is mod)
        except Exception as e:  # noqa: BLE001 (torchao raises AssertionError, ValueError, ...)
            refused.append(f"{name} ({type(e).__name__}: {e})")
            continue
        done.append(name)
    if refused:
        warnings.warn(f"torchtpu.quantization.quantize_({scheme!r}): {len(refused)} layer(s) stay in float: "
                      + ", ".join(refused), stacklevel=2)
    return done
