"""Execution modes and synchronization.

``strict_eager``: every op runs when called, through an executable cached per
(op, input layouts and dtypes, static arguments). ``defer_and_fuse``: ops are
recorded and fused (runtime/recorder.py). Modes are chosen globally
(``set_execution_mode``, ``TORCHTPU_EXECUTION_MODE``) or locally
(``with execution_mode(...)``).
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax
import torch

from . import checks, storage
from .recorder import RECORDER

MODES = ("strict_eager", "defer_and_fuse")
_state = threading.local()
_global_mode = None
# Modes of the ``execution_mode`` blocks now open, innermost last. The autograd
# engine runs a tpu backward in its own device thread, which has no thread-local
# mode: without this, ``loss.backward()`` inside a DeferAndFuse block ran strict.
_scoped: list = []
_scoped_lock = threading.Lock()  # blocks open and close in several threads at once
_graph_task_id = torch._C._current_graph_task_id


def _default_mode():
    # Google TorchTPU's switch, TORCH_TPU_DEFER_AND_FUSE=1, means the same here; ours wins when both are set
    defer = os.environ.get("TORCH_TPU_DEFER_AND_FUSE", "0") not in ("0", "false", "False", "")
    mode = os.environ.get("TORCHTPU_EXECUTION_MODE", "defer_and_fuse" if defer else "strict_eager")
    _check(mode)
    return mode


def _check(mode):
    if mode not in MODES:
        raise ValueError(f"torchtpu: unknown execution mode {mode!r}; choose one of {', '.join(MODES)}")


def deferring() -> bool:
    """True when ops should be recorded rather than run (on the op path: keep it cheap)."""
    m = getattr(_state, "mode", None)
    if m is None:
        if _scoped and _graph_task_id() != -1:
            m = _scoped[-1]  # a backward pass: follow the block that called backward()
        else:
            m = _global_mode or get_execution_mode()
    return m == "defer_and_fuse"


def get_execution_mode() -> str:
    m = getattr(_state, "mode", None)
    if m is not None:
        return m
    global _global_mode
    if _global_mode is None:
        _global_mode = _default_mode()
    return _global_mode


def set_execution_mode(mode: str) -> None:
    """Select the execution mode for the whole process (pending work is flushed first)."""
    global _global_mode
    _check(mode)
    RECORDER.flush("mode_switch")
    _global_mode = mode


@contextlib.contextmanager
def execution_mode(mode: str):
    """Run a block in ``mode``; the previous mode is restored after it."""
    _check(mode)
    RECORDER.flush("mode_switch")
    prev = getattr(_state, "mode", None)
    _state.mode = mode
    with _scoped_lock:
        _scoped.append(mode)
    try:
        yield
    finally:
        RECORDER.flush("mode_switch")
        _state.mode = prev
        with _scoped_lock:  # this block's entry (the last equal one)
            del _scoped[len(_scoped) - 1 - _scoped[::-1].index(mode)]


def synchronize() -> None:
    """Run pending work and wait for every device buffer of live tensors to be computed."""
    RECORDER.flush("sync")
    RECORDER.wait_all()  # the fused graphs in flight (their errors name the recording lines)
    bufs = storage.live_buffers()
    if bufs:
        try:
            jax.block_until_ready(bufs)
        except Exception as e:
            RECORDER.explain(e)
            raise
    checks.raise_pending()


def sync() -> None:
    """Start every pending (DeferAndFuse) tpu computation and return without waiting for it,
    like ``torch_xla``'s ``mark_step`` or a CUDA launch: the next step's Python overlaps this
    one's XLA run. Host reads (``.item()``, ``.cpu()``) and ``torch.tpu.synchronize()`` wait."""
    RECORDER.flush("sync")
