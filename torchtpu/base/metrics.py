"""Counters of what the runtime did: compiles, cache hits, CPU fallbacks, flushes.

``compiles`` counts the executables XLA built or loaded (JAX's own compile
events), whichever path asked for them; ``snapshot()["cache"]`` splits them
into persistent-cache hits and new XLA compilations, with compile seconds per
graph and unique graphs per step (``mark_step``); ``report()`` prints it all.

Bucketing hooks (used by :mod:`torchtpu.bucketing`): work done inside a
``bucket_scope`` has its compiles and cache misses counted per bucket key as
well (``compiles_by_bucket``, ``misses_by_bucket``), and an op (or graph) that
builds more executables than a threshold gets one :class:`RecompileWarning`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import threading
import warnings

import jax
import torch

from .frames import warn_at_user_line

_lock = threading.Lock()
_state = {
    "compiles": 0,
    "cache_hits": 0,
    "cache_misses": collections.Counter(),  # op -> executables built
    "cpu_fallbacks": collections.Counter(),  # op -> calls
    "flushes": collections.Counter(),  # reason -> count
    "compile_time_s": 0.0,
    "compiles_by_bucket": collections.Counter(),  # bucket key -> XLA compiles inside its scope
    "misses_by_bucket": collections.defaultdict(collections.Counter),  # bucket key -> op -> executables
    "bucket_overflows": collections.Counter(),  # "[policy:]truncate|split|...": count
    "shape_generic_calls": collections.Counter(),  # op -> calls run by the compile-storm policy on CPU
    "host_transfer_bytes": 0,  # bytes copied between device buffers and host memory, either direction
    "persistent_cache_requests": 0,  # executables looked up in JAX's persistent cache
    "persistent_cache_hits": 0,  # ... and loaded from it instead of compiled
    "persistent_cache_load_s": 0.0,
    "compile_s_by_graph": collections.Counter(),  # op or graph name -> seconds XLA spent compiling it
    "graph_runs": 0,  # fused and compiled graphs dispatched
    "graphs_per_step": collections.deque(maxlen=256),  # unique graphs run in each step (mark_step)
}
_step_graphs: set = set()  # the graphs run since the last mark_step

# ---------------------------------------------------------------- bucket scopes
_tls = threading.local()  # .items: tuple of (name, value); .key: its string form


def current_bucket_key():
    """The bucket key of the innermost ``bucket_scope`` of this thread (None outside any)."""
    return getattr(_tls, "key", None)


@contextlib.contextmanager
def bucket_scope(items):
    """Attribute compiles and cache misses in this block (this thread) to a bucket key.

    ``items`` is a sequence of (name, value) pairs. Nested scopes combine, the inner
    value of a repeated name winning: ``seq=64`` inside ``batch=8`` is ``batch=8,seq=64``.
    """
    prev_items = getattr(_tls, "items", ())
    prev_key = getattr(_tls, "key", None)
    merged = dict(prev_items)
    for name, value in items:
        merged.pop(str(name), None)  # re-set names move to the end, in scope order
        merged[str(name)] = value
    new_items = tuple(merged.items())
    key = ",".join(f"{k}={v}" for k, v in new_items) if new_items else None
    _tls.items, _tls.key = new_items, key
    try:
        yield key
    finally:
        _tls.items, _tls.key = prev_items, prev_key


def _on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        # XLA compiles synchronously in the thread that asked, so the thread's scope is the right one,
        # and the executable it builds is the one whose miss this thread recorded last
        key = getattr(_tls, "key", None)
        loaded = getattr(_tls, "cache_hit", False)
        label = getattr(_tls, "miss", None) or "other"
        _tls.cache_hit = False
        _tls.miss = None
        with _lock:
            _state["compiles"] += 1
            if loaded:
                _state["persistent_cache_load_s"] += duration
            else:
                _state["compile_time_s"] += duration
                _state["compile_s_by_graph"][label] += duration
            if key is not None:
                _state["compiles_by_bucket"][key] += 1


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        with _lock:
            _state["persistent_cache_requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        _tls.cache_hit = True  # this thread's compile event that follows was a load
        with _lock:
            _state["persistent_cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


# ---------------------------------------------------------------- recompile warning
class RecompileWarning(UserWarning):
    """An op or graph keeps compiling new executables: its input shapes are dynamic."""


def _threshold_from_env():
    raw = os.environ.get("TORCHTPU_RECOMPILE_WARNING_THRESHOLD", "16").strip().lower()
    if raw in ("", "0", "none", "off", "false"):
        return None
    try:
        n = int(raw)
    except ValueError:
        # a typo in an env var must not make `import torchtpu` fail
        warnings.warn(f"TORCHTPU_RECOMPILE_WARNING_THRESHOLD must be a positive integer or 'off', not {raw!r}; "
                      "using 16", RuntimeWarning, stacklevel=2)
        return 16
    return n if n > 0 else None


_threshold = _threshold_from_env()
_warned: set = set()
_SHAPE_LOG_MAX = 256
_shape_log: dict = {}  # op -> list of input-shape signatures (for the warning's suggestion)


def set_recompile_warning_threshold(n) -> None:
    """Warn (once per op) when an op has built more than ``n`` executables; ``None`` or 0 turns
    the warning off. Setting it re-arms the warning for every op."""
    global _threshold
    if n is not None:
        n = int(n)
        if n < 0:
            raise ValueError(f"recompile warning threshold must be >= 0 or None, not {n}")
    with _lock:
        _threshold = n if n else None
        _warned.clear()


def get_recompile_warning_threshold():
    return _threshold


def _shapes_in(key):
    """The torch.Size objects in a kernel cache key, in order (its tensors' shapes)."""
    out = []
    stack = [key]
    # depth-first, left to right
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Size):
            out.append(tuple(x))
        elif isinstance(x, (tuple, list)):
            stack.extend(reversed(x))
    return tuple(out)


def record_hit():
    """One call served by an executable already built (on every op's path: kept to one increment)."""
    _state["cache_hits"] += 1


def record_miss(op, key=None):
    """One new executable built for ``op`` (an op name, or a graph's name).

    ``key`` (optional) is the cache key it was built for; the shapes in it let the
    recompile warning say which dimension varies and suggest a bucket policy.
    """
    bkey = getattr(_tls, "key", None)
    _tls.miss = op  # the XLA compile that follows in this thread builds it
    shapes = _shapes_in(key) if key is not None else None
    with _lock:
        n = _state["cache_misses"][op] + 1
        _state["cache_misses"][op] = n
        if bkey is not None:
            _state["misses_by_bucket"][bkey][op] += 1
        if shapes is not None:
            log = _shape_log.setdefault(op, [])
            if len(log) < _SHAPE_LOG_MAX:
                log.append(shapes)
        fire = _threshold is not None and n > _threshold and op not in _warned
        if fire:
            _warned.add(op)
            threshold = _threshold
            log = list(_shape_log.get(op, ()))
    if fire:
        _warn_recompiles(op, n, threshold, log)


def _varying_dims(log):
    """[(input index, dim, sorted distinct sizes)] over signatures of the most common structure."""
    if not log:
        return []
    structure = collections.Counter(tuple(len(s) for s in sig) for sig in log).most_common(1)[0][0]
    sigs = [sig for sig in log if tuple(len(s) for s in sig) == structure]
    out = []
    for i, rank in enumerate(structure):
        for d in range(rank):
            sizes = sorted({sig[i][d] for sig in sigs})
            if len(sizes) > 1:
                out.append((i, d, sizes))
    return out


def _suggestion(log):
    varying = _varying_dims(log)
    if not varying:
        return (
            "Pad dynamic dimensions to a few fixed sizes with torchtpu.bucketing "
            "(BucketPolicy.pow2(min, max) or BucketPolicy.fit(observed_sizes, max_buckets), "
            "then pad_to_bucket / pad_sequences)."
        )
    # the dimension with the most distinct sizes is the one to bucket
    i, d, sizes = max(varying, key=lambda v: len(v[2]))
    lo, hi = max(1, sizes[0]), max(1, sizes[-1])
    lo_p2 = 1 << (lo.bit_length() - 1)  # largest power of two <= lo
    n_pow2 = 1 + sum(1 for k in range(64) if lo_p2 < (1 << k) < hi) + (hi != lo_p2)
    others = "" if len(varying) == 1 else f" ({len(varying) - 1} other dimension(s) vary too)"
    return (
        f"Dim {d} of input {i} took {len(sizes)} sizes between {sizes[0]} and {sizes[-1]}{others}. "
        f"Pad it to buckets with torchtpu.bucketing: BucketPolicy.pow2({lo_p2}, {hi}) gives at most "
        f"{n_pow2} programs (<= 2x padding); BucketPolicy.fit(observed_sizes, max_buckets) picks the "
        "boundaries with the least padding for your data. Then pad_to_bucket(x, dim, policy) or "
        "pad_sequences(...)."
    )


def _warn_recompiles(op, n, threshold, log):
    msg = (
        f"torchtpu: {op} has compiled {n} executables (more than the recompile warning threshold "
        f"{threshold}): each new input shape is a new XLA compile. {_suggestion(log)} "
        "torchtpu.bucketing.set_recompile_warning_threshold(n) or "
        "TORCHTPU_RECOMPILE_WARNING_THRESHOLD changes the threshold."
    )
    warn_at_user_line(msg, RecompileWarning)


# ---------------------------------------------------------------- other counters
def record_fallback(op):
    with _lock:
        _state["cpu_fallbacks"][op] += 1


def record_shape_generic(op):
    """One call of ``op`` run shape-generically by the compile-storm policy (dispatch/storm.py)."""
    with _lock:
        _state["shape_generic_calls"][op] += 1


def record_graph_run(graph) -> None:
    """A fused or compiled graph (any hashable naming its executable) was dispatched."""
    with _lock:
        _state["graph_runs"] += 1
        _step_graphs.add(graph)


def mark_step() -> int:
    """End a training step: the number of unique fused and compiled graphs it ran is kept
    (``snapshot()["cache"]["unique_graphs_per_step"]``); a steady loop runs the same few."""
    with _lock:
        n = len(_step_graphs)
        _state["graphs_per_step"].append(n)
        _step_graphs.clear()
    return n


def record_flush(reason):
    with _lock:
        _state["flushes"][reason] += 1


def record_host_transfer(nbytes) -> None:
    """``nbytes`` copied between a device buffer and host memory (either direction): ``.cpu()``,
    ``.to("tpu")``, host-staged collectives, the CPU fallback, checkpoint bytes."""
    with _lock:
        _state["host_transfer_bytes"] += int(nbytes)


def record_overflow(kind, n=1):
    """Count a bucket overflow that was handled (truncated, split, dropped); ``n`` items."""
    with _lock:
        _state["bucket_overflows"][kind] += n


def snapshot() -> dict:
    """A copy of every counter: ``compiles``, ``cache_hits``, ``cache_misses`` (op -> count),
    ``cpu_fallbacks`` (op -> count), ``flushes`` (reason -> count), ``compile_time_s``,
    ``compiles_by_bucket`` (bucket key -> XLA compiles inside ``bucket_scope``),
    ``misses_by_bucket`` (bucket key -> op -> executables built), ``bucket_overflows``
    (kind -> count), ``shape_generic_calls`` (op -> calls the compile-storm policy ran on CPU),
    ``host_transfer_bytes`` (bytes the runtime copied between device buffers and host memory)."""
    with _lock:
        out = copy.deepcopy(_state)
    for k in ("cache_misses", "cpu_fallbacks", "flushes", "compiles_by_bucket", "bucket_overflows",
              "shape_generic_calls"):
        out[k] = dict(out[k])
    out["misses_by_bucket"] = {k: dict(v) for k, v in out["misses_by_bucket"].items()}
    out["cache"] = _cache_stats(out)
    for k in ("persistent_cache_requests", "persistent_cache_hits", "persistent_cache_load_s", "compile_s_by_graph",
              "graph_runs", "graphs_per_step"):
        del out[k]
    return out


def _cache_stats(s) -> dict:
    on = jax.config.jax_compilation_cache_dir
    # (JAX counts a request per compile even with no cache directory set)
    req, hits = (s["persistent_cache_requests"], s["persistent_cache_hits"]) if on else (0, 0)
    runs = s["cache_hits"] + sum(s["cache_misses"].values())
    return {
        "persistent_dir": on,
        "requests": req,  # executables looked up in the persistent cache
        "hits": hits,  # ... found there (loaded, not compiled)
        "hit_rate": hits / req if req else None,
        "xla_compiles": s["compiles"] - hits,  # new XLA compilations
        "compile_s": s["compile_time_s"],
        "load_s": s["persistent_cache_load_s"],
        "compile_s_by_graph": dict(s["compile_s_by_graph"].most_common()),
        # the in-process executable caches (per-op kernels, fused graphs, compiled graphs)
        "executable_lookups": runs,
        "executable_hit_rate": s["cache_hits"] / runs if runs else None,
        "graph_runs": s["graph_runs"],
        "unique_graphs_per_step": list(s["graphs_per_step"]),
    }


def report() -> str:
    """The compilation caches' health in a few lines (also printed by ``print_report``)."""
    c = snapshot()["cache"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    steps = c["unique_graphs_per_step"]
    lines = [
        f"torchtpu compilation caches (persistent dir: {c['persistent_dir'] or 'off'})",
        f"  persistent cache: {c['hits']}/{c['requests']} hits ({pct(c['hit_rate'])}), loads {c['load_s']:.2f} s",
        f"  new XLA compiles: {c['xla_compiles']}, {c['compile_s']:.2f} s",
        f"  in-process executables: {c['executable_lookups']} lookups, hit rate {pct(c['executable_hit_rate'])}",
        f"  unique graphs per step (last {min(len(steps), 8)} of {len(steps)}): {steps[-8:] or 'no steps marked'}",
    ]
    top = list(c["compile_s_by_graph"].items())[:5]
    if top:
        lines.append("  slowest to compile: " + "; ".join(f"{k} {v:.2f} s" for k, v in top))
    return "\n".join(lines)


def reset():
    """Zero every counter and re-arm the recompile warning (compiled executables stay cached)."""
    with _lock:
        _state["compiles"] = 0
        _state["cache_hits"] = 0
        _state["compile_time_s"] = 0.0
        _state["host_transfer_bytes"] = 0
        _state["persistent_cache_requests"] = _state["persistent_cache_hits"] = _state["graph_runs"] = 0
        _state["persistent_cache_load_s"] = 0.0
        _state["compile_s_by_graph"].clear()
        _state["graphs_per_step"].clear()
        _step_graphs.clear()
        for k in ("cache_misses", "cpu_fallbacks", "flushes", "compiles_by_bucket", "misses_by_bucket",
                  "bucket_overflows", "shape_generic_calls"):
            _state[k].clear()
        _warned.clear()
        _shape_log.clear()
