"""CPU fallback for ops that have no tpu lowering: copy in, run on CPU, copy out.

One warning per op names it; ``TORCHTPU_CPU_FALLBACK=0`` or
``torchtpu.set_cpu_fallback(False)`` turns it into a ``NotImplementedError``.
Every call is counted in ``torchtpu.metrics.snapshot()["cpu_fallbacks"]``.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.utils import _pytree as pytree

from ..base import metrics
from ..base.opnames import short_name

_enabled = os.environ.get("TORCHTPU_CPU_FALLBACK", "1") not in ("0", "false", "False")
_warned: set = set()
_LIB = torch.library.Library("_", "IMPL")


def set_cpu_fallback(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def cpu_fallback_enabled() -> bool:
    return _enabled


class TPUFallbackWarning(UserWarning):
    pass


def _to_cpu(x):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        return x.to("cpu")
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("cpu")
    return x


def _check_same_device(args, kwargs):
    """PyTorch's rule for device ops: one device per op, a 0-dim CPU tensor counts as a scalar.
    Without it a CPU operand would be silently accepted here, since everything moves to CPU."""
    tpu = cpu = None
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            if x.device.type == "tpu":
                tpu = x.device
            elif x.dim() > 0:
                cpu = x.device
    if tpu is not None and cpu is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {tpu} and {cpu}!"
        )


def run_on_cpu(op, *args, **kwargs):
    """Run ``op`` on CPU copies of its tpu arguments; write mutated arguments back, move results to tpu.
    The boxed fallback of every op without a tpu kernel, and what a kernel calls for inputs it cannot
    handle on the device."""
    name = short_name(op)
    _check_same_device(args, kwargs)
    if not _enabled:
        raise NotImplementedError(
            f"torchtpu: no tpu lowering for {name} and CPU fallback is off "
            "(torchtpu.set_cpu_fallback(True) or TORCHTPU_CPU_FALLBACK=1 enables it)"
        )
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"torchtpu: {name} has no tpu lowering; running it on CPU (copies in and out). "
            "This warning is shown once per op.",
            TPUFallbackWarning,
            stacklevel=3,
        )
    metrics.record_fallback(name)
    return run_on_host(op, *args, **kwargs)


def run_on_host(op, *args, **kwargs):
    """Run ``op`` through PyTorch's CPU kernel: tpu arguments copied to the host, mutated ones
    written back, results moved to tpu. No checks, warnings or counting (``run_on_cpu`` and the
    compile-storm policy, ``storm.py``, decide when it is used)."""
    cpu_args, cpu_kwargs = pytree.tree_map(_to_cpu, (args, kwargs))
    out = op(*cpu_args, **cpu_kwargs)

    # write back into mutated tpu arguments
    schema = op._schema
    flat_in = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
    flat_cpu = list(cpu_args) + [cpu_kwargs.get(a.name) for a in schema.arguments[len(args):]]
    for a, orig, cpu in zip(schema.arguments, flat_in, flat_cpu):
        if a.alias_info is not None and a.alias_info.is_write:
            pairs = zip(orig, cpu) if isinstance(orig, (list, tuple)) else [(orig, cpu)]
            for o, c in pairs:
                if isinstance(o, torch.Tensor) and o.device.type == "tpu":
                    if o.shape != c.shape:
                        o.resize_(c.shape)
                    o.copy_(c)

    # outputs that alias a mutated input are that input; others move to tpu
    def back(x):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            for o, c in zip(flat_in, flat_cpu):
                if c is x and isinstance(o, torch.Tensor):
                    return o
            return x.to("tpu")
        return x

    return pytree.tree_map(back, out)


def install() -> None:
    _LIB.fallback(run_on_cpu, "PrivateUse1")
