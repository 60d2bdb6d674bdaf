"""torchtpu: PyTorch on TPUs through JAX/XLA.

``import torchtpu`` registers the ``tpu`` device. Every op on a tpu tensor runs
as an XLA executable: on a TPU host on the TPU, elsewhere on XLA's CPU (or GPU)
backend with the same code.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_ENABLE_X64", "1")  # int64 stays int64, float64 stays float64

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import torch  # noqa: E402

from . import device as _device  # noqa: E402

_device.register()

from . import fallback as _fallback  # noqa: E402
from . import bucketing, metrics  # noqa: E402
from . import lazy as _lazy  # noqa: E402
from . import registry as _registry  # noqa: E402
from . import ops  # noqa: E402,F401
from .fallback import TPUFallbackWarning, cpu_fallback_enabled, set_cpu_fallback  # noqa: E402
from .interop import from_jax, to_jax  # noqa: E402
from .runtime import (  # noqa: E402
    enable_persistent_cache,
    execution_mode,
    get_execution_mode,
    set_execution_mode,
    synchronize,
)

_registry.register_all()
_fallback.install()

from . import serialization as _serialization  # noqa: E402

_serialization.install()

if os.environ.get("TORCHTPU_COMPILATION_CACHE_DIR"):
    enable_persistent_cache(os.environ["TORCHTPU_COMPILATION_CACHE_DIR"])


def sync() -> None:
    """Start every pending (DeferAndFuse) tpu computation and return without waiting for it,
    like ``torch_xla``'s ``mark_step`` or a CUDA launch: the next step's Python overlaps this
    one's XLA run. Host reads (``.item()``, ``.cpu()``) and ``torch.tpu.synchronize()`` wait."""
    _lazy.flush("sync")


def device() -> torch.device:
    return torch.device("tpu", 0)


__all__ = [
    "TPUFallbackWarning",
    "bucketing",
    "cpu_fallback_enabled",
    "device",
    "enable_persistent_cache",
    "execution_mode",
    "from_jax",
    "get_execution_mode",
    "metrics",
    "set_cpu_fallback",
    "set_execution_mode",
    "sync",
    "synchronize",
    "to_jax",
]

from . import distributed as _distributed  # noqa: E402

_distributed.register()  # the "tpu" torch.distributed backend

# The ~400k objects torch and JAX create at import are permanent; every full pass of Python's
# cyclic collector re-scans them (about 0.6 s here). Each tpu op makes a few tracked objects, and
# DeferAndFuse keeps them until the flush, so full passes come every ~100 training steps and cost
# more than the recording itself (benchmarks/README.md). Freezing what exists now takes them out
# of those passes; nothing is freed or moved. TORCHTPU_GC_FREEZE=0 turns it off.
if os.environ.get("TORCHTPU_GC_FREEZE", "1") not in ("0", "false", "False", ""):
    import gc as _gc

    _gc.freeze()
