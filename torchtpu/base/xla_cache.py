"""JAX's persistent compilation cache, on by default: a process loads the executables an earlier
process compiled (per-op kernels, fused graphs, compiled graphs alike) instead of compiling them.

Configured at ``import torchtpu`` before anything compiles (some runtime modules build small
executables at import). Its hits, loads and compile seconds are in ``torchtpu.metrics``.

Google TorchTPU's names for the same thing are honoured (``TORCHTPU_CACHE_DIR`` wins when both are
set): ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` (and its ``TORCH_TPU_INTERNAL_`` spelling) is
TorchTPU's persistent executable cache directory, our ``TORCHTPU_CACHE_DIR``. TorchTPU's tier-2
cache (``TORCH_TPU_TIER2_COMPILATION_CACHE``, a host-shared in-memory cache) has no counterpart to
configure: the processes of a host already share the persistent directory.

The directory is private (0700) and capped: ``TORCHTPU_CACHE_MAX_SIZE`` bytes (``4G`` by default;
a number with an optional K/M/G/T suffix, ``-1`` for no cap), evicting the least recently used
executables first (JAX's LRU cache: an access time per entry, a file lock shared by the processes).
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

DEFAULT_MAX_SIZE = 4 * 1024**3
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text, what: str = "TORCHTPU_CACHE_MAX_SIZE") -> int:
    """``"512M"``, ``"4G"``, ``"1048576"`` or ``-1`` (no cap) as bytes; a ValueError naming ``what``."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    if t == "-1":
        return -1
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    num = t[:-1] if unit else t
    try:
        n = float(num)
    except ValueError:
        n = -2.0
    if n <= 0 or n != n:
        raise ValueError(f"{what}={text!r}: expected a size in bytes such as 512M, 4G or 1073741824, or -1 for "
                         f"no cap")
    return int(n * _UNITS[unit])


def default_max_size() -> int:
    v = os.environ.get("TORCHTPU_CACHE_MAX_SIZE")
    return DEFAULT_MAX_SIZE if v is None or not v.strip() else parse_size(v)


def enable_persistent_cache(directory: str, max_size: int | None = None) -> None:
    """Keep compiled XLA executables in ``directory`` across processes (JAX's persistent cache):
    a later process loads an executable instead of compiling it. Every executable is kept, even
    the small per-op ones (each is a compile an eager process would otherwise repeat), up to
    ``max_size`` bytes (default :func:`default_max_size`; -1: no cap), least recently used out first."""
    max_size = default_max_size() if max_size is None else int(max_size)
    if max_size != -1 and max_size <= 0:
        raise ValueError(f"enable_persistent_cache: max_size must be positive or -1, got {max_size}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_max_size", max_size)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def disable_persistent_cache() -> None:
    jax.config.update("jax_compilation_cache_dir", None)


def persistent_cache_dir():
    """The directory of the persistent compilation cache, or None when it is off."""
    return jax.config.jax_compilation_cache_dir


# Google TorchTPU's tier-3 (persistent) cache root: the public name wins over the internal one, as there
TORCHTPU_CACHE_ROOT_NAMES = ("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT")


def default_cache_dir():
    """Where the persistent cache goes: ``TORCHTPU_CACHE_DIR`` (empty or ``0``: no cache), else
    TorchTPU's ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` (then its ``TORCH_TPU_INTERNAL_`` form; a
    local path), else ``$XDG_CACHE_HOME/torchtpu/xla`` (``~/.cache/torchtpu/xla``): per user, shared
    by their runs."""
    d = os.environ.get("TORCHTPU_CACHE_DIR")
    if d is not None:
        return None if d.strip() in ("", "0") else os.path.abspath(os.path.expanduser(d))
    for name in TORCHTPU_CACHE_ROOT_NAMES:
        root = os.environ.get(name, "").strip()
        if not root:
            continue  # unset or empty: TorchTPU's tier-3 cache off, ours stays at its default
        if "://" in root:
            raise ValueError(f"{name}={root!r}: torchtpu keeps its compilation cache on a local path only "
                             f"(set TORCHTPU_CACHE_DIR, or {name} to a local directory)")
        return os.path.abspath(os.path.expanduser(root))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def cache_stats() -> dict:
    """The persistent compilation cache now: ``dir`` (None when off), ``entries`` and ``bytes`` on
    disk (every process's executables), ``max_bytes`` (-1: no cap) and this process's lookups:
    ``requests``, ``hits`` (loaded instead of compiled), ``misses`` (compiled, then stored),
    ``hit_rate`` and ``load_s`` (``torchtpu.metrics`` counts them; ``snapshot()["cache"]`` has more)."""
    from . import metrics

    d = persistent_cache_dir()
    entries = size = 0
    if d is not None and os.path.isdir(d):
        with os.scandir(d) as it:
            for e in it:
                if e.name.endswith("-cache") and e.is_file():
                    entries += 1
                    size += e.stat().st_size
    c = metrics.snapshot()["cache"]
    return {"dir": d, "entries": entries, "bytes": size,
            "max_bytes": jax.config.jax_compilation_cache_max_size if d is not None else 0,
            "requests": c["requests"], "hits": c["hits"], "misses": c["requests"] - c["hits"],
            "hit_rate": c["hit_rate"], "load_s": c["load_s"]}


def configure_persistent_cache() -> None:
    """Turn the persistent cache on at ``default_cache_dir()`` (at import). A directory that cannot
    be made (or a remote TorchTPU root) leaves it off, with one warning: the cache saves time, it is
    never worth failing for."""
    try:
        d = default_cache_dir()
    except ValueError as e:
        import warnings

        warnings.warn(f"torchtpu: no persistent compilation cache ({e})", RuntimeWarning, stacklevel=2)
        return
    if d is None:
        log.info("persistent compilation cache off (TORCHTPU_CACHE_DIR)")
        return
    try:
        enable_persistent_cache(d)
        log.info("persistent compilation cache in %s", d)
    except OSError as e:
        import warnings

        warnings.warn(f"torchtpu: no persistent compilation cache ({e}); set TORCHTPU_CACHE_DIR to a writable "
                      "directory, or to 0 to turn it off", RuntimeWarning, stacklevel=2)
