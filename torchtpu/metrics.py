"""Counters of what the runtime did: compiles, cache hits, CPU fallbacks, flushes.

``compiles`` counts real XLA compilations (JAX's own compile events), so it is
true whichever path asked for them.
"""

from __future__ import annotations

import collections
import copy
import threading

import jax

_lock = threading.Lock()
_state = {
    "compiles": 0,
    "cache_hits": 0,
    "cache_misses": collections.Counter(),  # op -> executables built
    "cpu_fallbacks": collections.Counter(),  # op -> calls
    "flushes": collections.Counter(),  # reason -> count
    "compile_time_s": 0.0,
}


def _on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _state["compiles"] += 1
            _state["compile_time_s"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def record_hit():
    _state["cache_hits"] += 1


def record_miss(op):
    with _lock:
        _state["cache_misses"][op] += 1


def record_fallback(op):
    with _lock:
        _state["cpu_fallbacks"][op] += 1


def record_flush(reason):
    with _lock:
        _state["flushes"][reason] += 1


def snapshot() -> dict:
    """A copy of every counter: ``compiles``, ``cache_hits``, ``cache_misses`` (op -> count),
    ``cpu_fallbacks`` (op -> count), ``flushes`` (reason -> count), ``compile_time_s``."""
    with _lock:
        out = copy.deepcopy(_state)
    for k in ("cache_misses", "cpu_fallbacks", "flushes"):
        out[k] = dict(out[k])
    return out


def reset():
    with _lock:
        _state["compiles"] = 0
        _state["cache_hits"] = 0
        _state["compile_time_s"] = 0.0
        for k in ("cache_misses", "cpu_fallbacks", "flushes"):
            _state[k].clear()
