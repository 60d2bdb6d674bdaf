"""The C++ part of the Strict Eager hit path (``csrc/fast_dispatch.cpp``), built once, loaded at import.

What it does: make an op's output tensor (a PrivateUse1 ``TensorImpl`` over a fresh storage of the
right byte size and a fake data pointer) in one call, where Python needs three torch calls
(``storage.new_tensor``). Built like the pinned hooks (``pinned.build()``, run by ``scripts/setup.sh``,
builds both) into ``csrc/build/``, under a name that hashes its source and torch's version, so a stale
build is never loaded. Without a build (no compiler) or with ``TORCHTPU_FAST_DISPATCH=0`` the Python
path runs, with identical results; ``active()`` says which serves the process.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os

import torch

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "fast_dispatch.cpp")
_BUILD_DIR = os.path.join(os.path.dirname(_SOURCE), "build", "fast")  # (its own ninja file)
_PREFIX = "torchtpu_fast_"


def _module_name() -> str:
    h = hashlib.sha256()
    with open(_SOURCE, "rb") as f:
        h.update(f.read())
    h.update(torch.__version__.encode())
    return _PREFIX + h.hexdigest()[:12]


def library_path() -> str:
    return os.path.join(_BUILD_DIR, _module_name() + ".so")


def build(verbose: bool = False) -> str:
    """Compile ``csrc/fast_dispatch.cpp`` (a no-op when up to date); returns the library's path."""
    from torch.utils import cpp_extension

    os.makedirs(_BUILD_DIR, exist_ok=True)
    cpp_extension.load(name=_module_name(), sources=[_SOURCE], build_directory=_BUILD_DIR,
                       extra_cflags=["-O2"], is_python_module=True, verbose=verbose)
    path = library_path()
    for f in os.listdir(_BUILD_DIR):  # builds of an older source or torch
        if f.startswith(_PREFIX) and f.endswith(".so") and os.path.join(_BUILD_DIR, f) != path:
            os.remove(os.path.join(_BUILD_DIR, f))
    return path


def enabled() -> bool:
    return os.environ.get("TORCHTPU_FAST_DISPATCH", "1") not in ("0", "false", "False", "")


def load():
    """The built module, or None (not built, or ``TORCHTPU_FAST_DISPATCH=0``)."""
    path = library_path()
    if not enabled() or not os.path.exists(path):
        return None
    name = _module_name()
    spec = importlib.util.spec_from_file_location(name, path,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODULE = load()


def active() -> bool:
    """Whether the C++ hit path serves this process."""
    return MODULE is not None
