"""Registers ``tpu`` with PyTorch and provides the ``torch.tpu`` module.

One ``tpu`` device per process (TorchTPU's model: one process per chip, chosen
by the launcher); it maps to this process's first JAX device. Several JAX
devices in one process are reached through JAX sharding, not device indices.

torch 2.13's Python device guard (``torch._C._acc.DeviceGuard``) lets Python
override ``type_`` only: it reports index 0 and a count of 1 and ignores
``set_device(1)``, so ``tpu:1`` would silently be ``tpu:0``. Every place a
device index can enter therefore checks it (``check_device``): the factories
and copies (ops/core.py), ``torch.tpu.*``, and ``torch.accelerator.*``, whose
C++ entry points (synchronize, set/exchange device, allocator stats) are
routed here because the guard cannot answer them from Python.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import time
import types

import torch

from ..base import platform, rng
from ..base.memory import MEMORY, memory_fraction, set_memory_fraction
from . import pinned
from .modes import synchronize as synchronize_all

_INDEX_ERROR = (
    "torchtpu: device index {index} is not available: a process owns exactly one tpu device, "
    "'tpu' or 'tpu:0' (launch one process per chip, e.g. with TPU_VISIBLE_CHIPS; reach several "
    "JAX devices of one process through JAX sharding)"
)


def check_device(device) -> None:
    """Raise a clear error for a tpu device index other than 0 (``None`` and non-tpu devices pass)."""
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


def _tpu_index(device) -> int:
    """``check_device`` for ``torch.tpu.*`` arguments, which must name the tpu (or be an index)."""
    if device is not None and not isinstance(device, int):
        d = torch.device(device)
        if d.type != "tpu":
            raise ValueError(f"torchtpu: expected a tpu device, got {d}")
    check_device(device)
    return 0


def jax_device():
    """The JAX device this process's ``tpu`` maps to."""
    return platform.device()


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """The hooks when the C++ ones (runtime/pinned.py, which answer the same plus a pinned allocator) are not built."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_PRIVATEUSE1 = torch._C._autograd.DeviceType.PrivateUse1


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):  # called from C++ several times per op: no lookups
        return _PRIVATEUSE1


# ---------------------------------------------------------------- memory figures
def memory_stats_nested() -> dict:
    """Allocator statistics in the nested form torch's C++ allocators report."""
    cur, peak, n = MEMORY.snapshot()
    res_cur, res_peak = cur, peak
    try:  # TPU and GPU backends report what XLA's allocator holds; the CPU backend reports None
        s = jax_device().memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        s = None
    if s:
        res_cur = s.get("bytes_reserved", s.get("bytes_in_use", cur))
        res_peak = s.get("peak_bytes_in_use", res_cur)
    return {
        "allocated_bytes": {"all": {"current": cur, "peak": peak}},
        "reserved_bytes": {"all": {"current": res_cur, "peak": res_peak}},
        "allocation": {"all": {"current": n}},
    }


def memory_info() -> tuple[int, int]:
    """(free, total) bytes of the memory tpu buffers live in."""
    return platform.memory_info(jax_device())


def _make_module():
    m = types.ModuleType("torch.tpu")
    m.__doc__ = "The tpu device module (provided by torchtpu)."

    def is_available() -> bool:
        """The tpu device can be used: always, on XLA's CPU backend too (torch's DDP and device
        utilities read it that way). ``get_device_properties().platform`` says whether it is a TPU."""
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
        _tpu_index(device)

    def synchronize(device=None) -> None:
        _tpu_index(device)
        synchronize_all()

    def manual_seed(seed: int) -> None:
        rng.manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        rng.manual_seed(seed)

    def seed() -> None:
        rng.manual_seed(torch.initial_seed())

    def seed_all() -> None:
        seed()

    def initial_seed() -> int:
        return rng.initial_seed()

    def get_rng_state(device="tpu"):
        """(seed, counter) as an int64 tensor; the 64-bit seed's bits are kept (two's complement)."""
        _tpu_index(device)
        s, c = rng.get_state()
        return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s, c], dtype=torch.int64)

    def set_rng_state(new_state, device="tpu"):
        _tpu_index(device)
        rng.set_state((int(new_state[0]) & 0xFFFFFFFFFFFFFFFF, int(new_state[1])))

    def memory_allocated(device=None) -> int:
        _tpu_index(device)
        return MEMORY.allocated

    def max_memory_allocated(device=None) -> int:
        _tpu_index(device)
        return MEMORY.peak

    def memory_reserved(device=None) -> int:
        _tpu_index(device)
        return memory_stats_nested()["reserved_bytes"]["all"]["current"]

    def max_memory_reserved(device=None) -> int:
        _tpu_index(device)
        return memory_stats_nested()["reserved_bytes"]["all"]["peak"]

    def reset_peak_memory_stats(device=None) -> None:
        _tpu_index(device)
        MEMORY.reset_peak()

    def memory_stats(device=None) -> dict:
        _tpu_index(device)
        nested = memory_stats_nested()
        out = {
            "allocated_bytes.all.current": nested["allocated_bytes"]["all"]["current"],
            "allocated_bytes.all.peak": nested["allocated_bytes"]["all"]["peak"],
            "reserved_bytes.all.current": nested["reserved_bytes"]["all"]["current"],
            "reserved_bytes.all.peak": nested["reserved_bytes"]["all"]["peak"],
            "num_storages": MEMORY.num_storages,
        }
        return collections.OrderedDict(sorted(out.items()))

    def mem_get_info(device=None) -> tuple[int, int]:
        _tpu_index(device)
        return memory_info()

    def empty_cache() -> None:
        """Nothing to release: a device buffer is freed by XLA when its last tensor dies."""

    def get_device_name(device=None) -> str:
        """The device kind (``TPU v4``, ``NVIDIA H100 80GB HBM3``; ``XLA CPU (...)`` on the CPU backend)."""
        _tpu_index(device)
        return platform.device_name()

    def get_device_properties(device=None) -> platform.DeviceProperties:
        _tpu_index(device)
        return platform.properties()

    def get_rng_state_all() -> list:
        """One state per device (one device here), as ``torch.cuda.get_rng_state_all``."""
        return [get_rng_state()]

    def set_rng_state_all(new_states) -> None:
        for state in new_states:
            set_rng_state(state)

    def get_device_capability(device=None) -> tuple[int, int]:
        """(TPU generation, 0) on a TPU (``TPU v5 lite`` -> (5, 0)); a GPU's compute capability through XLA;
        (0, 0) on XLA's CPU backend: code comparing it with cuda's capabilities takes the portable path."""
        _tpu_index(device)
        d = jax_device()
        cc = getattr(d, "compute_capability", None)
        if cc:
            major, _, minor = str(cc).partition(".")
            return int(major), int(minor or 0)
        m = re.search(r"v(\d+)", platform.device_name(d)) if d.platform == "tpu" else None
        return (int(m.group(1)), 0) if m else (0, 0)

    def set_per_process_memory_fraction(fraction: float, device=None) -> None:
        """Cap this process's tpu tensors at ``fraction`` of the device's memory, as ``torch.cuda``'s: an
        allocation beyond it raises ``torch.OutOfMemoryError``."""
        _tpu_index(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        set_memory_fraction(fraction)

    def get_per_process_memory_fraction(device=None) -> float:
        _tpu_index(device)
        return memory_fraction()

    def memory_summary(device=None, abbreviated: bool = False) -> str:
        """A readable table of :func:`memory_stats` (``torch.cuda.memory_summary``'s role)."""
        _tpu_index(device)
        st = memory_stats()
        free, total = memory_info()

        def gib(n):
            return f"{n / (1 << 30):10.3f} GiB"

        rows = [("Allocated memory (tensors)", st["allocated_bytes.all.current"], st["allocated_bytes.all.peak"]),
                ("Reserved memory", st["reserved_bytes.all.current"], st["reserved_bytes.all.peak"])]
        line = "|" + "=" * 75 + "|"
        out = [line, "|" + " PyTorch tpu memory summary, device ID 0 ".center(75) + "|", line,
               f"| {'Metric':<32}| {'Cur Usage':>18} | {'Peak Usage':>18} |", line]
        out += [f"| {name:<32}| {gib(cur):>18} | {gib(peak):>18} |" for name, cur, peak in rows]
        out += [f"| {'Live storages':<32}| {st['num_storages']:>18} | {'':>18} |", line,
                f"| {'Device total / free':<32}| {gib(total):>18} | {gib(free):>18} |",
                f"| {'Per-process fraction':<32}| {memory_fraction():>18.3f} | {'':>18} |", line]
        return "\n".join(out) + "\n"

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    def is_bf16_supported(including_emulation=True) -> bool:
        return True

    class device:
        """Context manager selecting the tpu device (only index 0 exists)."""

        def __init__(self, device):
            _tpu_index(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    for f in (is_available, is_initialized, _is_in_bad_fork, device_count, current_device, set_device,
              current_stream, default_stream, stream,
              synchronize, manual_seed, manual_seed_all, seed, seed_all, initial_seed, get_rng_state,
              set_rng_state, memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
              reset_peak_memory_stats, memory_stats, mem_get_info, empty_cache, get_device_name, get_device_properties,
              get_amp_supported_dtype, is_bf16_supported, get_rng_state_all, set_rng_state_all,
              get_device_capability, set_per_process_memory_fraction, get_per_process_memory_fraction,
              memory_summary):
        setattr(m, f.__name__, f)
    m.device = device
    m.Stream = Stream
    m.Event = Event
    return m


# ---------------------------------------------------------------- streams
# A tpu has one in-order queue: JAX dispatches each executable without waiting and runs them in order.
# torch code written for accelerators (torch.distributed.checkpoint's writer, TorchRec's train pipelines)
# asks the device module for its current stream, enters stream contexts and synchronizes streams or
# events; these answer that on the one queue: waiting on a stream or event waits for all work issued.
class Stream:
    """The tpu's one in-order queue (every ``Stream`` is the same queue)."""

    device_type = "tpu"
    device_index = 0

    def __init__(self, device=None, priority: int = 0, **kwargs):
        _tpu_index(device)

    @property
    def device(self) -> torch.device:
        return torch.device("tpu", 0)

    def synchronize(self) -> None:
        synchronize_all()

    def query(self) -> bool:
        synchronize_all()  # no cheap "is it idle" question to XLA: wait, then it is
        return True

    def wait_stream(self, stream) -> None:  # one queue: already ordered
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "Event":
        return event if event is not None else Event()

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return hash(Stream)

    def __repr__(self) -> str:
        return "torch.tpu.Stream(device=tpu:0)"


class Event:
    """A point in the tpu's queue; waiting on it waits for all work issued. With ``enable_timing`` a
    recorded event waits for the work issued before it and notes the time, so ``elapsed_time`` gives
    the milliseconds of device work between two events (as ``torch.cuda.Event``'s)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None) -> None:
        if self.enable_timing:
            synchronize_all()
            self._time = time.perf_counter()

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds from this event to ``end_event`` (both recorded, both made with enable_timing=True)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0

    def wait(self, stream=None) -> None:  # one queue: later work already runs after it
        pass

    def query(self) -> bool:
        synchronize_all()
        return True

    def synchronize(self) -> None:
        synchronize_all()


_STREAM = Stream()


def current_stream(device=None) -> Stream:
    _tpu_index(device)
    return _STREAM


def default_stream(device=None) -> Stream:
    _tpu_index(device)
    return _STREAM


class stream:  # noqa: N801 (torch.cuda.stream's spelling)
    """Context manager selecting a stream: there is one, so it only checks the argument."""

    def __init__(self, s):
        if s is not None and not isinstance(s, Stream):
            raise TypeError(f"torch.tpu.stream: expected a torch.tpu.Stream or None, got {type(s).__name__}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- torch.accelerator
def _install_accelerator() -> None:
    """Route torch.accelerator's C++ entry points for the tpu to this module.

    ``torch.accelerator.synchronize`` and the allocator statistics end in the
    device guard / a C++ DeviceAllocator, neither of which a Python backend can
    provide in torch 2.13 ("Backend doesn't support synchronizing all streams",
    an internal assert for the allocator). The Python wrappers in
    ``torch.accelerator`` all call these ``torch._C`` functions, so wrapping
    them covers every public spelling (``device_index``, deprecated aliases).
    """
    C = torch._C

    def ours() -> bool:
        acc = C._accelerator_getAccelerator()
        return acc is not None and acc.type == "tpu"

    def wrap(name, fn):
        orig = getattr(C, name)

        def wrapper(*args):
            if ours():
                return fn(*args)
            return orig(*args)

        wrapper.__name__ = name
        wrapper.__wrapped__ = orig
        setattr(C, name, wrapper)

    def index(i):
        check_device(None if i is None or i < 0 else i)
        return 0

    def sync(i=-1):
        index(i)
        synchronize_all()

    def set_index(i):
        index(i)

    def exchange(i):
        index(i)
        return 0

    def stats(i=-1):
        index(i)
        return memory_stats_nested()

    def reset_peak_stats(i=-1):
        index(i)
        MEMORY.reset_peak()

    def reset_accumulated(i=-1):
        index(i)

    def info(i=-1):
        index(i)
        return memory_info()

    wrap("_accelerator_synchronizeDevice", sync)
    wrap("_accelerator_setDeviceIndex", set_index)
    wrap("_accelerator_exchangeDevice", exchange)
    wrap("_accelerator_maybeExchangeDevice", exchange)
    wrap("_accelerator_isAllocatorInitialized", lambda: True)
    wrap("_accelerator_getDeviceStats", stats)
    wrap("_accelerator_resetPeakStats", reset_peak_stats)
    wrap("_accelerator_resetAccumulatedStats", reset_accumulated)
    wrap("_accelerator_emptyCache", lambda: None)
    wrap("_accelerator_getMemoryInfo", info)


# ---------------------------------------------------------------- kernels that are about the device, not an op
_LIBS: list = []


def _pin_memory(self, device=None):
    """``pin_memory()`` of a CPU tensor when the accelerator is tpu: checks the device, then copies.

    With the C++ hooks (runtime/pinned.py) the copy lands in their pinned allocator. Without them a Python backend has no pinned
    allocator in torch 2.13 (torch's kernel raises NotImplementedError, e.g. from
    ``DataLoader(pin_memory=True)``): the copy ``pin_memory`` promises, in ordinary memory
    (``is_pinned()`` False).
    """
    if device is not None and torch.device(device).type != "tpu":
        raise RuntimeError(
            f"torchtpu: cannot pin memory for device {torch.device(device)}: this process's accelerator is tpu"
        )
    check_device(device)
    if not pinned.pinned_hooks_active():
        return self.clone(memory_format=torch.preserve_format)
    # dense strides (the source's when it is dense): an expanded tensor pins too
    return torch.empty_like(self, pin_memory=True).copy_(self)


def _quantized_error(*args, **kwargs):
    dtype = kwargs.get("dtype")
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_quantized:
            dtype = a.dtype
        elif isinstance(a, torch.dtype) and dtype is None:
            dtype = a
    raise TypeError(
        f"torchtpu: dtype {dtype if dtype is not None else 'quantized'} is not supported on tpu "
        "(quantized tensors have no tpu kernels): call .dequantize() first, or keep the int values "
        "in an integer tensor"
    )


def _install_kernels() -> None:
    lib = torch.library.Library("aten", "IMPL")
    # a CPU kernel takes precedence over _pin_memory's CompositeExplicitAutograd one, which cannot check
    # the device index (tpu:1) and without the C++ hooks fails
    lib.impl("_pin_memory", _pin_memory, "CPU")
    # quantized tensors moved to (or made on) tpu dispatch to the QuantizedPrivateUse1 key, where torch
    # otherwise answers with a long "could not run ... from the 'Quantizedtpu' backend" dump
    for op in ("empty.memory_format", "empty_quantized", "_empty_affine_quantized",
               "_empty_per_channel_affine_quantized", "empty_strided", "_to_copy", "copy_"):
        lib.impl(op, _quantized_error, "QuantizedPrivateUse1")
    _LIBS.append(lib)


def _install_module_conversion() -> None:
    """``Module.to("tpu")`` / ``.cpu()`` / ``.half()`` of a tpu module swap tensors in place.

    torch's default conversion shallow-copies only between its built-in dense backends
    (cpu, cuda, ...); for PrivateUse1 it builds a new Parameter per module slot, which
    unties shared weights (an LM head tied to its embedding) and orphans optimizers built
    before the move. Swapping (``torch.__future__.set_swap_module_params_on_conversion``,
    torch's announced future default) keeps each Parameter object, so both survive. It is
    switched on only for conversions that touch tpu, so other devices keep torch's default.
    """
    original = torch.nn.Module._apply
    if getattr(original, "_torchtpu", False):
        return

    def converts_to_tpu(fn) -> bool:
        try:  # conversion fns (to, cpu, half, share_memory_) are cheap on an empty tensor
            with torch.no_grad():
                out = fn(torch.empty(0))
        except Exception:
            return False
        return isinstance(out, torch.Tensor) and out.device.type == "tpu"

    def touches_tpu(module, fn) -> bool:
        tensors = itertools.chain(module.parameters(), module.buffers())
        return any(t.device.type == "tpu" for t in tensors) or converts_to_tpu(fn)

    decided = []  # the outermost _apply decides once for the whole module tree

    def _apply(self, fn, *args, **kwargs):
        future = torch.__future__
        if decided or future.get_swap_module_params_on_conversion():
            return original(self, fn, *args, **kwargs)
        swap = touches_tpu(self, fn)
        decided.append(True)
        if swap:
            future.set_swap_module_params_on_conversion(True)
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            decided.pop()
            if swap:
                future.set_swap_module_params_on_conversion(False)

    _apply._torchtpu = True
    torch.nn.Module._apply = _apply


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
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    module = _make_module()
    torch._register_device_module("tpu", module)
    if not pinned.register_hooks():  # the C++ hooks with the pinned allocator, when built
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
    # as torch.cuda.default_generators: one per device; empty without the C++ hooks (no tpu Generator then)
    module.default_generators = (rng.default_generator(),) if rng.default_generator() is not None else ()
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    _install_accelerator()
    _install_kernels()
    _install_module_conversion()
    _registered = True
    seed = os.environ.get("TORCHTPU_SEED")
    rng.manual_seed(int(seed) if seed else torch.initial_seed())
