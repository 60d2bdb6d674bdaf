"""Which XLA platform the ``tpu`` device runs on, and what it is.

``TORCHTPU_PLATFORM=tpu|cuda|cpu`` chooses the platform (JAX's ``jax_platforms``) at import; unset,
JAX takes the best one installed: a TPU with ``torchtpu[tpu]`` (libtpu), an NVIDIA GPU with
``torchtpu[cuda]`` (JAX's CUDA plugin), else XLA's CPU backend. An accelerator platform that is
installed but not used (the device fell back to CPU) gets one warning at import.
``torch.tpu.get_device_properties().platform`` says what the device is; ``torch.tpu.is_available()``
stays true on every platform, because torch's own code (DDP, ``torch._utils``) reads it as "the
device can be used", which it can, on XLA's CPU backend too.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import platform as _host
import warnings

import jax

log = logging.getLogger(__name__)

CHOICES = {"tpu": "tpu", "cuda": "cuda", "gpu": "cuda", "cpu": "cpu"}
# the distributions that bring each accelerator platform (the extras torchtpu[tpu] and torchtpu[cuda])
PLUGINS = {"tpu": ("libtpu", "libtpu-nightly"), "cuda": ("jax-cuda12-plugin", "jax-cuda13-plugin")}
_EXTRA = {"tpu": 'pip install "torchtpu[tpu]" (on a TPU VM)', "cuda": 'pip install "torchtpu[cuda]"'}


class PlatformError(RuntimeError):
    """The platform asked for with ``TORCHTPU_PLATFORM`` cannot be used."""


def requested():
    """The platform ``TORCHTPU_PLATFORM`` asks for (``tpu``, ``cuda``, ``cpu``), or None."""
    raw = os.environ.get("TORCHTPU_PLATFORM", "").strip().lower()
    if not raw:
        return None
    if raw not in CHOICES:
        raise PlatformError(f"TORCHTPU_PLATFORM={raw!r}: choose tpu, cuda or cpu (or leave it unset)")
    return CHOICES[raw]


def select() -> None:
    """Point JAX at the requested platform (at import). The backend itself starts later, at first
    use (``first_use``): started here, it would keep ``init_process_group`` from bringing up JAX's
    multi-process runtime. A requested accelerator whose runtime is not installed fails here."""
    want = requested()
    if want is None:
        return
    jax.config.update("jax_platforms", want)
    if want != "cpu" and want not in installed_accelerators():
        raise PlatformError(f"TORCHTPU_PLATFORM={want}, but JAX cannot start that platform (its runtime is not "
                            f"installed). Install it: {_EXTRA[want]}; or unset TORCHTPU_PLATFORM to use what this "
                            "machine has.")


_started = False


def first_use() -> None:
    """Once, when the runtime first puts data on the device: a requested platform that cannot start
    fails naming the setting, and a device that fell back to CPU gets its warning."""
    global _started
    if _started:
        return
    _started = True
    d = device()
    log.info("the tpu device is %s", d)
    warn_if_fell_back()


def installed_accelerators() -> list:
    """Accelerator platforms whose runtime is installed (whether or not a device is present)."""
    found = []
    for name, dists in PLUGINS.items():
        for d in dists:
            try:
                importlib.metadata.version(d)
            except importlib.metadata.PackageNotFoundError:
                continue
            found.append(name)
            break
    return found


def device():
    """This process's JAX device (the ``tpu`` device), with a clear error when the requested
    platform has none."""
    try:
        return jax.local_devices()[0]
    except RuntimeError as e:
        want = requested()
        if want is None:
            raise
        hint = _EXTRA.get(want, "")
        raise PlatformError(f"TORCHTPU_PLATFORM={want}, but JAX cannot start that platform ({e}). "
                            + (f"Install its runtime: {hint}; " if want not in installed_accelerators() and hint
                               else "") + "or unset TORCHTPU_PLATFORM to use what this machine has.") from None


def kind() -> str:
    """``tpu``, ``cuda`` or ``cpu``: what the device is."""
    p = device().platform
    return "cuda" if p in ("gpu", "cuda") else p


def is_accelerator() -> bool:
    return kind() != "cpu"


def warn_if_fell_back() -> None:
    """One warning when an accelerator runtime is installed but the device is XLA's CPU backend
    and nothing asked for it: a run that would otherwise train on CPU without a word."""
    if requested() is not None or is_accelerator():
        return
    missed = installed_accelerators()
    if missed:
        warnings.warn(
            f"torchtpu: {' and '.join(missed)} support is installed but no such device was found: the tpu device "
            "runs on XLA's CPU backend. Check the accelerator is visible to this process (another process may "
            "hold it), or set TORCHTPU_PLATFORM=cpu to choose CPU on purpose (and silence this warning).",
            RuntimeWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """``torch.tpu.get_device_properties()``, named as ``torch.cuda``'s are where they mean the same."""

    name: str  # the device kind: "TPU v5 lite", "NVIDIA H100 80GB HBM3", or the host CPU
    platform: str  # "tpu", "cuda" or "cpu"
    total_memory: int  # bytes the device's buffers can use (host memory on the CPU backend)
    jax_device: str  # the JAX device, e.g. "TPU_0(process=0,(0,0,0,0))"
    local_device_count: int  # JAX devices of this process (reached through sharding)
    process_index: int
    coords: tuple = ()  # the chip's position in its slice (TPU)
    core_on_chip: int = 0


def _host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _host_available() -> int:
    """Host memory a new allocation can get: MemAvailable (free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_info(d=None) -> tuple[int, int]:
    """(free, total) bytes of the memory the device's buffers live in (host memory on the CPU backend)."""
    d = d or device()
    try:
        s = d.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats (XLA CPU)
        s = None
    if s and "bytes_limit" in s:
        return int(s["bytes_limit"]) - int(s.get("bytes_in_use", 0)), int(s["bytes_limit"])
    return _host_available(), _host_memory()


def total_memory(d=None) -> int:
    return memory_info(d)[1]


def device_name(d=None) -> str:
    d = d or device()
    if d.platform == "cpu":
        cpu = _host.processor() or _host.machine()
        return f"XLA CPU ({cpu})"
    return d.device_kind


def properties() -> DeviceProperties:
    d = device()
    return DeviceProperties(
        name=device_name(d), platform=kind(), total_memory=total_memory(d), jax_device=str(d),
        local_device_count=jax.local_device_count(), process_index=jax.process_index(),
        coords=tuple(getattr(d, "coords", ()) or ()), core_on_chip=int(getattr(d, "core_on_chip", 0) or 0))
