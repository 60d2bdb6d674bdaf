"""Device-side index checks and the launch-blocking debug mode.

An out-of-range index in a gather or scatter cannot be seen by the host without
waiting for the device, so it is checked where the indices are: a lowering that
takes index values calls :func:`check_index` while it is traced, which computes
on the device one ``[bad, first bad value]`` pair per check site. The executable
(an eager kernel's, a DeferAndFuse node's, a compiled graph's) returns those
pairs as one extra small output, and the host reads them the next time it waits
anyway (a host read: ``.item()``, ``.cpu()``, printing; ``synchronize``), then
raises :class:`DeviceIndexError` naming the op and the user line that issued it,
as CUDA's device-side asserts surface at the next synchronizing call. Results
belong to the thread that issued the op: it is that thread's next wait that
raises (docs/architecture.md, "Threads").

``TORCHTPU_INDEX_CHECKS=0`` builds executables without the checks (read at
import: executables already built keep what they were built with).
``TORCHTPU_LAUNCH_BLOCKING=1`` makes every op and graph synchronous, so any
error (these checks included) surfaces at its own line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import jax.numpy as jnp
import numpy as np
import torch

from .recorder import RECORDER, LazyBuf

log = logging.getLogger(__name__)


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default) not in ("0", "false", "False", "")


INDEX_CHECKS = _env_flag("TORCHTPU_INDEX_CHECKS", "1")
# TPU_LAUNCH_BLOCKING is Google TorchTPU's name for it (as CUDA_LAUNCH_BLOCKING is CUDA's)
LAUNCH_BLOCKING = _env_flag("TORCHTPU_LAUNCH_BLOCKING", os.environ.get("TPU_LAUNCH_BLOCKING", "0"))
if LAUNCH_BLOCKING:
    log.info("TORCHTPU_LAUNCH_BLOCKING=1 (or TPU_LAUNCH_BLOCKING=1): every op and graph waits for the device")


class DeviceIndexError(IndexError, RuntimeError):
    """An index value out of range, found on the device. An ``IndexError`` (and a ``RuntimeError``,
    which PyTorch raises on CPU for gather and scatter) whose first line is PyTorch CPU's message."""


# ---------------------------------------------------------------- trace time: the check sites
_tls = threading.local()


class _Sites:
    """The checks one traced executable makes: their on-device results and their messages."""

    __slots__ = ("results", "messages", "op", "where")

    def __init__(self):
        self.results = []
        self.messages = []
        # set by a compiled graph's interpreter before each node: its op and FX stack trace (an eager
        # kernel's op and line are known per call instead)
        self.op = None
        self.where = None

    def output(self):
        """The extra output: an int64 (sites, 2) array of [out of range?, first such value]."""
        return jnp.stack(self.results)


@contextlib.contextmanager
def collecting():
    """Collect the index checks of the lowerings traced in this block (this thread)."""
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    sites = _Sites()
    stack.append(sites)
    try:
        yield sites
    finally:
        stack.pop()


def check_index(index, size: int, message: str, negative: bool = False) -> None:
    """Check traced ``index`` values against ``[0, size)`` (``[-size, size)`` if ``negative``).

    ``message`` is PyTorch CPU's message for the op, ``{value}`` standing for the first bad index.
    Outside :func:`collecting` (a lowering traced by other code) nothing is checked."""
    stack = getattr(_tls, "stack", None)
    if not INDEX_CHECKS or not stack or index.size == 0:
        return
    sites = stack[-1]
    flat = index.reshape(-1).astype(jnp.int64)
    bad = (flat >= size) | (flat < (-size if negative else 0))
    first = jnp.argmax(bad)
    sites.results.append(jnp.stack([bad[first].astype(jnp.int64), flat[first]]))
    where = sites.where
    sites.messages.append((message.replace("{size}", str(size)), sites.op,
                           site_of_stack_trace(where) if isinstance(where, str) else where))


def site_of_stack_trace(stack_trace):
    """(file, line, function) of the last frame of an FX node's ``stack_trace`` (the user line)."""
    if not stack_trace:
        return None
    import re

    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stack_trace)
    if not found:
        return None
    f, line, fn = found[-1]
    return (f, int(line), fn)


# ---------------------------------------------------------------- run time: pending results
# Results are kept per issuing thread, so a bad index is raised in the thread whose op it was (as a
# CUDA error is raised on the stream that ran the kernel), never in another thread that happens to
# wait first. An op issued inside a backward pass runs on the autograd engine's worker thread, which
# the user never waits on: its results go to one shared list that every thread's next wait reads.
_tls_pending = threading.local()
_shared: list = []  # results of ops issued by backward passes
_lock = threading.Lock()  # guards _shared (a thread's own list is touched by that thread only)
_MAX_PENDING = 1024  # a loop that never waits: past this, the oldest half is read (long finished)
_graph_task_id = torch._C._current_graph_task_id


def _own() -> list:
    """The pending results of this thread's ops: (array or LazyBuf of (k, 2), ((message, op, where), ...))."""
    own = getattr(_tls_pending, "results", None)
    if own is None:
        own = _tls_pending.results = []
    return own


def note(result, messages, op=None, where=None) -> None:
    """An executable was dispatched with check results ``result``; ``op``/``where`` name the
    issuing op and user line where the messages (eager kernels) do not."""
    if op is not None:
        messages = tuple((m, op, where) for m, _, _ in messages)
    if type(result) is LazyBuf:
        RECORDER.watch(result)
    if _graph_task_id() != -1:
        with _lock:
            _shared.append((result, messages))
            full = len(_shared) > _MAX_PENDING
    else:
        own = _own()
        own.append((result, messages))
        full = len(own) > _MAX_PENDING
    if full:
        raise_pending(limit=_MAX_PENDING // 2)


def raise_pending(limit=None) -> None:
    """Read the check results of this thread's ops (and of backward passes) computed so far
    (waiting for them) and raise the first failure. Results of DeferAndFuse nodes not flushed
    yet stay pending."""
    own = getattr(_tls_pending, "results", None)
    if own:
        _raise_from(own, limit, None)
    if _shared:
        _raise_from(_shared, limit, _lock)


def _raise_from(pending: list, limit, lock) -> None:
    with lock or contextlib.nullcontext():
        taken = pending[:limit] if limit is not None else list(pending)
        del pending[: len(taken)]
    keep = []
    failure = None
    for result, messages in taken:
        if type(result) is LazyBuf:
            if result.value is None:
                if result.node is not None and result.node.pos >= 0:
                    keep.append((result, messages))  # not flushed yet
                continue  # (a failed graph: its error was raised already)
            result = result.value
        if failure is not None:
            continue
        try:
            rows = np.asarray(result).reshape(-1, 2)
        except Exception:  # the executable itself failed: that error is raised where its outputs are read
            continue
        for (bad, value), (message, op, where) in zip(rows, messages):
            if bad:
                failure = (int(value), message, op, where)
                break
    if keep:
        with lock or contextlib.nullcontext():
            pending[:0] = keep
    if failure is not None:
        value, message, op, where = failure
        at = f"{where[0]}:{where[1]} in {where[2]}" if where else "an unknown line"
        raise DeviceIndexError(
            f"{message.replace('{value}', str(value))}\n"
            f"torchtpu device-side index check: index {value} in {op} issued at {at} "
            "(raised at the next point the host waited; TORCHTPU_LAUNCH_BLOCKING=1 raises at the op itself)")


def clear_pending() -> None:
    """Forget unread check results of this thread and of backward passes (after an error: the
    values they guard are gone too)."""
    _own().clear()
    with _lock:
        _shared.clear()
