"""torchtpu: PyTorch on TPUs through JAX/XLA.

``import torchtpu`` registers the ``tpu`` device. Every op on a tpu tensor runs
as an XLA executable: on a TPU host on the TPU, elsewhere on XLA's CPU (or GPU)
backend with the same code.

Layers, each importing only those below it (docs/architecture.md):
``base`` (dtypes, random keys, metrics, memory, op names, user frames) ->
``runtime`` (storage, the DeferAndFuse recorder, execution modes, the device) ->
``dispatch`` (the lowering table, the kernel executor, the installer, the CPU
fallback) -> ``ops`` (lowerings and decompositions) -> the front modules
(``bucketing``, ``interop``, ``serialization``, ``distributed``) -> ``compile``.
This file wires them together, in that order.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_ENABLE_X64", "1")  # int64 stays int64, float64 stays float64

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import torch  # noqa: E402

from .base import platform as _platform  # noqa: E402
from .base import xla_cache  # noqa: E402

_platform.select()  # TORCHTPU_PLATFORM=tpu|cuda|cpu, before any JAX backend starts

# before anything compiles: on by default, TORCHTPU_CACHE_DIR moves it, TORCHTPU_CACHE_DIR=0 turns it off
xla_cache.configure_persistent_cache()

from .base import metrics  # noqa: E402
from .runtime import device as _device  # noqa: E402

_device.register()

from . import ops  # noqa: E402  (fills the lowering table)
from .dispatch import fallback as _fallback  # noqa: E402
from .dispatch import install as _install  # noqa: E402
from .ops import decomp as _decomp  # noqa: E402

_install.install()  # a kernel per lowering and hand-written kernel, their in-place and out= forms
_decomp.register_decompositions()  # PyTorch's decompositions for ops still without a kernel
_fallback.install()  # everything else: the CPU fallback

from .dispatch import autocast as _autocast  # noqa: E402

_autocast.install()  # torch.autocast("tpu"): CUDA's cast policy, bfloat16 by default

from . import bucketing, profiler, serialization as _serialization  # noqa: E402
from .dispatch.fallback import TPUFallbackWarning, cpu_fallback_enabled, set_cpu_fallback  # noqa: E402
from .dispatch.storm import set_shape_storm_policy, shape_storm_policy  # noqa: E402
from .interop import assign_jax, from_jax, to_jax  # noqa: E402
from .runtime.checks import DeviceIndexError  # noqa: E402
from .base.xla_cache import cache_stats, disable_persistent_cache, enable_persistent_cache  # noqa: E402
from .runtime.modes import (  # noqa: E402
    execution_mode,
    get_execution_mode,
    set_execution_mode,
    sync,
    synchronize,
)

_serialization.install()


from . import distributed as _distributed  # noqa: E402

_distributed.register()  # the "tpu" torch.distributed backend

from . import quantization  # noqa: E402  (torchao is imported on first use)
from . import thirdparty_noise as _thirdparty_noise  # noqa: E402

_thirdparty_noise.install()  # two exact, harmless torchao / pytree log lines

from . import hf_generate as _hf_generate  # noqa: E402

if _hf_generate.enabled():
    _hf_generate.install_when_imported()  # HF generate on tpu at fixed shapes, once transformers is imported


def device() -> torch.device:
    """The ``tpu`` device of this process (``torch.device("tpu", 0)``)."""
    return torch.device("tpu", 0)


__all__ = [
    "DeviceIndexError",
    "TPUFallbackWarning",
    "assign_jax",
    "bucketing",
    "cpu_fallback_enabled",
    "device",
    "disable_persistent_cache",
    "cache_stats",
    "enable_persistent_cache",
    "execution_mode",
    "from_jax",
    "quantization",
    "get_execution_mode",
    "metrics",
    "profiler",
    "set_cpu_fallback",
    "set_execution_mode",
    "set_shape_storm_policy",
    "shape_storm_policy",
    "sync",
    "synchronize",
    "to_jax",
]

# The ~400k objects torch and JAX create at import are permanent; every full pass of Python's
# cyclic collector re-scans them (about 0.6 s here). Each tpu op makes a few tracked objects, and
# DeferAndFuse keeps them until the flush, so full passes come every ~100 training steps and cost
# more than the recording itself (benchmarks/README.md). Freezing what exists now takes them out
# of those passes; nothing is freed or moved. TORCHTPU_GC_FREEZE=0 turns it off.
if os.environ.get("TORCHTPU_GC_FREEZE", "1") not in ("0", "false", "False", ""):
    import gc as _gc

    _gc.freeze()
