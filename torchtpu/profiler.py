"""``torchtpu.profiler.profile``: a JAX profiler trace of tpu work, with torch op names.

    with torchtpu.profiler.profile("runs/prof"):
        train_step()

writes ``runs/prof/plugins/profile/<run>/<host>.xplane.pb`` (TensorBoard's profile plugin:
``tensorboard --logdir runs/prof``; or https://ui.perfetto.dev with ``perfetto=True``, which also
writes ``<host>.trace.json.gz``). Eager ops appear as host events named ``aten::<op>`` around their
dispatch; the XLA ops of every executable (eager kernels, DeferAndFuse's fused graphs, compiled
graphs) carry the torch op they come from in their names (``jax.named_scope``), and fused and
compiled graphs are host events too (``torchtpu fused graph``, ``torchtpu compiled graph ...``).
The trace ends with ``torch.tpu.synchronize()``, so the device work issued inside is in it.
"""

from __future__ import annotations

import contextlib
import logging
import os

import jax

from .base import tracing
from .runtime.modes import synchronize

log = logging.getLogger(__name__)


@contextlib.contextmanager
def profile(log_dir: str, *, perfetto: bool = False):
    """Record a profile of the block into ``log_dir`` (see the module docstring)."""
    if tracing.ACTIVE:
        raise RuntimeError("torchtpu.profiler.profile: a profile is already being recorded (they do not nest)")
    os.makedirs(log_dir, exist_ok=True)
    synchronize()  # earlier work stays out of this trace
    jax.profiler.start_trace(log_dir, create_perfetto_trace=perfetto)
    tracing.ACTIVE = True
    try:
        yield log_dir
        synchronize()
    finally:
        tracing.ACTIVE = False
        jax.profiler.stop_trace()
        log.info("torchtpu profile written to %s", log_dir)


def trace_files(log_dir: str) -> list:
    """The trace files a ``profile`` wrote under ``log_dir`` (xplane.pb and, with perfetto, trace.json.gz)."""
    out = []
    for root, _, files in os.walk(log_dir):
        out.extend(os.path.join(root, f) for f in files if f.endswith((".xplane.pb", ".trace.json.gz")))
    return sorted(out)
