"""Registers ``tpu`` with PyTorch and provides the ``torch.tpu`` module.

One ``tpu`` device per process (TorchTPU's model: one process per chip, chosen
by the launcher); it maps to this process's first JAX device. Several JAX
devices in one process are reached through JAX sharding, not device indices.
"""

from __future__ import annotations

import os
import types

import jax
import torch

from . import random as tpu_random
from . import storage

_INDEX_ERROR = (
    "torchtpu: device index {index} is not available: a process owns exactly one tpu device, "
    "'tpu' or 'tpu:0' (launch one process per chip, e.g. with TPU_VISIBLE_CHIPS; reach several "
    "JAX devices of one process through JAX sharding)"
)


def check_device(device) -> None:
    """Raise a clear error for a tpu device index other than 0."""
    if device is None:
        return
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "tpu":
            return
        index = device.index
    if index is not None and index != 0:
        raise RuntimeError(_INDEX_ERROR.format(index=index))


def jax_device():
    """The JAX device this process's ``tpu`` maps to."""
    return jax.local_devices()[0]


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _make_module():
    m = types.ModuleType("torch.tpu")
    m.__doc__ = "The tpu device module (provided by torchtpu)."

    def is_available() -> bool:
        return True

    def is_initialized() -> bool:
        return True

    def _is_in_bad_fork() -> bool:
        return False

    def device_count() -> int:
        return 1

    def current_device() -> int:
        return 0

    def set_device(device) -> None:
        check_device(device if not isinstance(device, str) or ":" in device else device)
        if isinstance(device, int):
            check_device(device)

    def synchronize(device=None) -> None:
        check_device(device)
        from . import runtime

        runtime.synchronize()

    def manual_seed(seed: int) -> None:
        tpu_random.manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        tpu_random.manual_seed(seed)

    def seed() -> None:
        tpu_random.manual_seed(torch.initial_seed())

    def initial_seed() -> int:
        return tpu_random.initial_seed()

    def get_rng_state(device="tpu"):
        s, c = tpu_random.get_state()
        return torch.tensor([s & 0x7FFFFFFFFFFFFFFF, c], dtype=torch.int64)

    def set_rng_state(new_state, device="tpu"):
        tpu_random.set_state((int(new_state[0]), int(new_state[1])))

    def memory_allocated(device=None) -> int:
        check_device(device)
        return storage.MEMORY.allocated

    def max_memory_allocated(device=None) -> int:
        check_device(device)
        return storage.MEMORY.peak

    def reset_peak_memory_stats(device=None) -> None:
        check_device(device)
        with storage.MEMORY.lock:
            storage.MEMORY.peak = storage.MEMORY.allocated

    def memory_stats(device=None) -> dict:
        check_device(device)
        return {
            "allocated_bytes.all.current": storage.MEMORY.allocated,
            "allocated_bytes.all.peak": storage.MEMORY.peak,
            "num_storages": storage.MEMORY.num_storages,
        }

    def get_device_name(device=None) -> str:
        check_device(device)
        d = jax_device()
        return f"{d.platform}:{d.device_kind}"

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    def is_bf16_supported(including_emulation=True) -> bool:
        return True

    class device:
        """Context manager selecting the tpu device (only index 0 exists)."""

        def __init__(self, device):
            check_device(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    for f in (is_available, is_initialized, _is_in_bad_fork, device_count, current_device, set_device,
              synchronize, manual_seed, manual_seed_all, seed, initial_seed, get_rng_state, set_rng_state,
              memory_allocated, max_memory_allocated, reset_peak_memory_stats, memory_stats,
              get_device_name, get_amp_supported_dtype, is_bf16_supported):
        setattr(m, f.__name__, f)
    m.device = device
    return m


_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "tpu"):
        raise RuntimeError(
            f"torchtpu: PrivateUse1 is already taken by '{torch._C._get_privateuse1_backend_name()}'"
        )
    torch.utils.rename_privateuse1_backend("tpu")
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
    module = _make_module()
    torch._register_device_module("tpu", module)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    _registered = True
    seed = os.environ.get("TORCHTPU_SEED")
    tpu_random.manual_seed(int(seed) if seed else torch.initial_seed())
