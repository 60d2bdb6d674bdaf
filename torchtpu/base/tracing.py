"""Profiler hooks shared by the layers: while ``torchtpu.profiler.profile`` records (``ACTIVE``), each
eager kernel's dispatch is a host-side trace event named for its torch op; at trace time every
executable names its XLA ops for the torch ops they come from (``named_scope``), so a profile of a
fused or compiled graph shows ``aten::mm`` and friends, not only ``fusion.12``."""

from __future__ import annotations

import jax

ACTIVE = False  # set by torchtpu.profiler while a trace is recorded (read on every eager op: a plain global)

annotate = jax.profiler.TraceAnnotation  # host-side event: ``with annotate("aten::mm"): ...``
named_scope = jax.named_scope  # trace-time scope: the XLA ops traced inside carry the name
