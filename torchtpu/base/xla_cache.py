"""JAX's persistent compilation cache, on by default: a process loads the executables an earlier
process compiled (per-op kernels, fused graphs, compiled graphs alike) instead of compiling them.

Configured at ``import torchtpu`` before anything compiles (some runtime modules build small
executables at import). Its hits, loads and compile seconds are in ``torchtpu.metrics``.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)


def enable_persistent_cache(directory: str) -> None:
    """Keep compiled XLA executables in ``directory`` across processes (JAX's persistent cache):
    a later process loads an executable instead of compiling it. Every executable is kept, even
    the small per-op ones (each is a compile an eager process would otherwise repeat)."""
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def disable_persistent_cache() -> None:
    jax.config.update("jax_compilation_cache_dir", None)


def persistent_cache_dir():
    """The directory of the persistent compilation cache, or None when it is off."""
    return jax.config.jax_compilation_cache_dir


def default_cache_dir():
    """Where the persistent cache goes: ``TORCHTPU_CACHE_DIR`` (empty or ``0``: no cache), else
    ``$XDG_CACHE_HOME/torchtpu/xla`` (``~/.cache/torchtpu/xla``): per user, shared by their runs."""
    d = os.environ.get("TORCHTPU_CACHE_DIR")
    if d is not None:
        return None if d.strip() in ("", "0") else os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def configure_persistent_cache() -> None:
    """Turn the persistent cache on at ``default_cache_dir()`` (at import). A directory that cannot
    be made leaves it off, with one warning: the cache saves time, it is never worth failing for."""
    d = default_cache_dir()
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
