"""The tpu's C++ PrivateUse1 hooks (pinned host memory, generators), built once, loaded at import.

torch 2.13 asks a PrivateUse1 backend for its pinned allocator (``getPinnedMemoryAllocator``),
whether a pointer is pinned (``isPinnedPtr``) and for new generators (``getNewGenerator``:
``torch.Generator(device="tpu")``) only through a C++ ``PrivateUse1HooksInterface``; the Python
hooks class cannot answer any of them, and no pure-Python route is cheap: ``empty(...,
pin_memory=True)`` reaches the CPU factory kernel, so intercepting it means a Python kernel in front
of every CPU ``empty``/``empty_strided`` (``benchmarks/bench_parallel.py --pinned`` measures it).
DDP's reducer needs pinned memory (``static_graph=True``, ``find_unused_parameters=True`` stage their
used-parameter map in pinned memory and assert ``is_pinned()``), and so do ``pin_memory()`` and
``DataLoader(pin_memory=True)``.

So ``csrc/pinned_hooks.cpp`` (one small file, a C interface, no pybind11) registers the hooks in C++.
``scripts/setup.sh`` builds it (``pinned.build()``: g++ and ninja through ``torch.utils.cpp_extension``,
about 10 s) into ``csrc/build/``; ``import torchtpu`` loads it when built. Without a build (no
compiler), or with ``TORCHTPU_PINNED_HOOKS=0``, the Python hooks are registered as before:
``pin_memory()`` returns an ordinary copy, DDP with ``static_graph``/``find_unused_parameters``
fails in its first backward with torch's ``NotImplementedError`` naming ``getPinnedMemoryAllocator``,
and ``torch.Generator(device="tpu")`` raises torch's ``NotImplementedError`` naming
``getNewGenerator`` (random ops without ``generator=`` are unaffected). ``pinned_hooks_active()``
says which hooks serve the process.

A tpu generator holds a seed and an offset; the random ops' kernels take their JAX key from them
(``torchtpu/base/rng.py``) and advance the offset. The hooks' default generator
(``getDefaultGenerator``) holds the global stream's seed and offset, so ``torch.manual_seed``,
``torch.tpu.get_rng_state`` and ``torch.tpu.default_generators[0]`` are one stream, as on CUDA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys

import torch

from ..base import rng

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "pinned_hooks.cpp")
_BUILD_DIR = os.path.join(os.path.dirname(_SOURCE), "build")

_lib = None  # the loaded library once its hooks are registered


def _library_name() -> str:
    # a new source or another torch gets its own library: a stale build is never loaded
    h = hashlib.sha256()
    with open(_SOURCE, "rb") as f:
        h.update(f.read())
    h.update(torch.__version__.encode())
    return f"torchtpu_pinned_{h.hexdigest()[:12]}"


def library_path() -> str:
    """Where the built hooks library is (or will be)."""
    return os.path.join(_BUILD_DIR, _library_name() + ".so")


def build(verbose: bool = False) -> str:
    """Compile ``csrc/pinned_hooks.cpp`` (a no-op when up to date); returns the library's path."""
    from torch.utils import cpp_extension

    os.makedirs(_BUILD_DIR, exist_ok=True)
    cpp_extension.load(
        name=_library_name(), sources=[_SOURCE], build_directory=_BUILD_DIR,
        extra_cflags=["-O2"], is_python_module=False, verbose=verbose,
    )
    path = library_path()
    for f in os.listdir(_BUILD_DIR):  # builds of an older source or torch
        if f.startswith("torchtpu_pinned_") and f.endswith(".so") and os.path.join(_BUILD_DIR, f) != path:
            os.remove(os.path.join(_BUILD_DIR, f))
    # the Strict Eager hit path's C++ part is built beside the hooks (scripts/setup.sh calls this);
    # without it the Python path runs, so its failure does not fail the hooks' build
    from . import native

    try:
        native.build(verbose)
    except Exception as e:  # noqa: BLE001 - reported, and the Python path serves
        print(f"torchtpu: the C++ dispatch fast path did not build ({type(e).__name__}: {e}); "
              "the Python path serves", file=sys.stderr)
    return path


def register_hooks() -> bool:
    """Register the C++ hooks if the library is built; False (nothing done) when it is not.

    Must run before any other PrivateUse1 hooks are registered: torch takes one set per process.
    """
    global _lib
    if _lib is not None:
        return True
    path = library_path()
    if os.environ.get("TORCHTPU_PINNED_HOOKS", "1") == "0" or not os.path.exists(path):
        return False
    lib = ctypes.CDLL(path)
    if lib.torchtpu_register_hooks() != 1:
        raise RuntimeError(
            "torchtpu: PrivateUse1 hooks were already registered in this process (by another backend or an "
            "earlier torch._C._acc.register_python_privateuseone_hook), so tpu's pinned allocator cannot be"
        )
    _lib = lib
    get_default = ctypes.PyDLL(path).torchtpu_default_generator  # holds the GIL, raises a set error
    get_default.restype = ctypes.py_object
    rng.use_default_generator(get_default())
    return True


def pinned_hooks_active() -> bool:
    """Whether the C++ hooks (pinned allocator, ``is_pinned``) serve the tpu in this process."""
    return _lib is not None


def stats() -> dict:
    """Pinned host memory: live blocks and bytes, page-locked bytes (``mlock`` within RLIMIT_MEMLOCK),
    allocations so far. All zero while the C++ hooks are not active."""
    out = (ctypes.c_int64 * 4)()
    if _lib is not None:
        _lib.torchtpu_pinned_stats(out)
    return {"blocks": out[0], "bytes": out[1], "locked_bytes": out[2], "allocations": out[3]}

