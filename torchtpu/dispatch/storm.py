"""The compile-storm policy of the eager modes: an op that keeps meeting new input shapes stops
building one XLA executable per shape.

Every new (op, shapes, dtypes, static arguments) key is an XLA compile (tens to hundreds of
milliseconds) where PyTorch on CPU runs any shape at once. Once an op has built
``executables`` executables (default 32; the ``RecompileWarning`` has fired by then), a call with
a new key whose tensors are small (``max_numel`` elements together, default 65536) runs
shape-generically instead: through PyTorch's own CPU kernel of the same op, its inputs copied to
the host and its results back, which costs microseconds for small tensors and gives CPU's exact
semantics. A key met ``compile_after`` times (default 3) is compiled after all: a shape that
keeps coming back (a training loop) is worth its executable.

Always compiled: large tensors (a host round trip of each call costs more than one compile
amortised over them), random ops (tpu's random streams are not CPU's), any op while the CPU
fallback is off (``torchtpu.set_cpu_fallback(False)``: no op may run on the CPU), and, under
DeferAndFuse, calls made while work is pending (the host copies would flush it).
``torchtpu.metrics.snapshot()["shape_generic_calls"]`` counts the calls run this way, per op.

``set_shape_storm_policy(None)`` (or ``TORCHTPU_STORM_EXECUTABLES=0``) turns the policy off.
"""

from __future__ import annotations

import os

import torch

from ..base import metrics
from . import fallback


def _env_int(name, default):
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "default"):
        return default
    if raw in ("0", "off", "none", "false"):
        return None
    return int(raw)


class _Policy:
    __slots__ = ("executables", "max_numel", "compile_after")

    def __init__(self, executables, max_numel, compile_after):
        self.executables = executables
        self.max_numel = max_numel
        self.compile_after = compile_after


POLICY = _Policy(_env_int("TORCHTPU_STORM_EXECUTABLES", 32), 1 << 16, 3)
_seen: dict = {}  # key -> times met and run shape-generically
_SEEN_MAX = 1 << 16


def set_shape_storm_policy(executables=32, max_numel: int = 1 << 16, compile_after: int = 3) -> None:
    """After an op has built ``executables`` executables, run new keys whose tensors hold at most
    ``max_numel`` elements together through PyTorch's CPU kernel instead of compiling, until a key
    has been met ``compile_after`` times. ``executables=None`` (or 0) turns the policy off."""
    if compile_after < 1 or max_numel < 0:
        raise ValueError(f"compile_after must be >= 1 and max_numel >= 0, got {compile_after}, {max_numel}")
    POLICY.executables = int(executables) if executables else None
    POLICY.max_numel = int(max_numel)
    POLICY.compile_after = int(compile_after)
    _seen.clear()


def shape_storm_policy() -> dict:
    """The policy in force: ``{"executables", "max_numel", "compile_after"}``."""
    return {"executables": POLICY.executables, "max_numel": POLICY.max_numel, "compile_after": POLICY.compile_after}


def run_shape_generic(kernel, key, numel: int) -> bool:
    """Should this call of ``kernel`` (a cache miss of ``key`` over tensors of ``numel`` elements
    together, nothing pending) run through the CPU kernel rather than compile? Counts the key."""
    limit = POLICY.executables
    if (limit is None or len(kernel.cache) < limit or numel > POLICY.max_numel or kernel.lowering.random
            or not fallback.cpu_fallback_enabled() or not _has_cpu_kernel(kernel.op)):
        return False
    n = _seen.get(key, 0) + 1
    if n >= POLICY.compile_after:
        _seen.pop(key, None)
        return False
    if len(_seen) >= _SEEN_MAX:
        _seen.clear()
    _seen[key] = n
    metrics.record_shape_generic(kernel.name)
    return True


_cpu_kernel: dict = {}  # op -> whether PyTorch has a CPU kernel for it


def _has_cpu_kernel(op) -> bool:
    """Our own ops (``torchtpu::sdpa_fwd``) have no CPU kernel: they always compile."""
    has = _cpu_kernel.get(op)
    if has is None:
        name = op.name()
        has = _cpu_kernel[op] = (torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
                                 or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
                                 or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))
    return has


def run(kernel, vals):
    """Run one call of ``kernel`` (its bound arguments ``vals``) through PyTorch's CPU kernel."""
    pos = vals[: kernel.npos]
    kw = {kernel.names[i]: vals[i] for i in range(kernel.npos, len(vals))}
    return fallback.run_on_host(kernel.op, *pos, **kw)
