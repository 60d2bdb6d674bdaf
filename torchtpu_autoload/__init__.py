"""``import torch`` alone makes the ``tpu`` device available: torch's ``torch.backends`` entry point.

torch calls :func:`load` at the end of its own import (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
It imports neither JAX nor torchtpu; it only names the device and leaves stand-ins that import
torchtpu on first use:

- ``tpu`` parses as a device (PrivateUse1 renamed), and the first op on it (``torch.ones(2,
  device="tpu")``, ``x.to("tpu")``) reaches a PrivateUse1 fallback that imports torchtpu, which
  installs the real kernels, then runs the op again;
- ``torch.tpu`` is a module whose first attribute read imports torchtpu;
- the c10d backends ``tpu`` and ``tpu_dist`` (Ray Train's name) are registered once
  ``torch.distributed`` is imported, with a creator that imports torchtpu;
- TorchRec learns the ``tpu`` compute device when ``torchrec`` is imported (``torchtpu_rec`` is
  imported right after it), so ``DistributedModelParallel(model, device=torch.device("tpu"))`` and
  ``Topology(compute_device="tpu")`` need no project import.

``TORCHTPU_TORCH_TPU_COMPAT=1`` (opt-in) also serves ``import torch_tpu`` (Ray Train's TPU path
imports that name) from torchtpu's stand-in, unless a real ``torch_tpu`` is installed
(:func:`enable_torch_tpu_compat`).

``torch.compile(backend="tpu")`` needs nothing here: Dynamo finds the backend through the
``torch_dynamo_backends`` entry point. The package sits above the others (it may import torchtpu
and torchtpu_rec, only inside functions) so that torchtpu itself imports none of them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import types

_lock = threading.RLock()
_state = {"loaded": False, "fallback": None}


def _step_aside() -> None:
    """Before torchtpu's own import (by whatever route): remove the stand-ins, so that it registers
    its own ``torch.tpu`` and PrivateUse1 fallback (the CPU fallback)."""
    import torch

    with _lock:
        lib = _state["fallback"]
        if lib is not None:
            _state["fallback"] = None
            lib._destroy()
        if isinstance(getattr(torch, "tpu", None), _LazyDeviceModule):
            delattr(torch, "tpu")
            sys.modules.pop("torch.tpu", None)


def _import_torchtpu():
    with _lock:
        return importlib.import_module("torchtpu")


class _LazyDeviceModule(types.ModuleType):
    """``torch.tpu`` until torchtpu is imported: any attribute imports it and reads the real module."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _import_torchtpu()
        import torch

        return getattr(torch.tpu, name)

    def __dir__(self):
        _import_torchtpu()
        import torch

        return dir(torch.tpu)


def _first_tpu_op(op, *args, **kwargs):
    """The first op on a tpu tensor or with ``device="tpu"``: import torchtpu, then run it."""
    _import_torchtpu()
    return op(*args, **kwargs)


# ---------------------------------------------------------------- torch.distributed
def _create_process_group(*args, **kwargs):
    torchtpu = _import_torchtpu()
    return torchtpu.distributed.backend._create(*args, **kwargs)


def _register_c10d() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in ("tpu", "tpu_dist"):
        if name not in dist.Backend.backend_list:
            dist.Backend.register_backend(name, _create_process_group, extended_api=True, devices=["tpu", "cpu"])


# ---------------------------------------------------------------- import hooks
class _AroundImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``before()`` and ``after()`` around the first import of module ``name`` (its loader wrapped)."""

    def __init__(self, name, before=None, after=None):
        self.name = name
        self.before = before
        self.after = after
        self.loader = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.loader is not None:
            return None
        sys.meta_path.remove(self)  # one module, once: the real finders find it
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if self.before is not None:
            self.before()
        self.loader.exec_module(module)
        if self.after is not None:
            self.after()


def _teach_torchrec() -> None:
    importlib.import_module("torchtpu_rec")


def _after_import(name, then) -> None:
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AroundImport(name, after=then))


# ---------------------------------------------------------------- torch_tpu (opt-in)
COMPAT_ENV = "TORCHTPU_TORCH_TPU_COMPAT"
_COMPAT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_tpu_compat")


class _TorchTPUCompatFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_tpu`` (torchtpu's stand-in) when no finder before it did: it sits last on
    ``sys.meta_path``, so a real ``torch_tpu`` on the path is always found first."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_tpu":
            return None  # its submodules are found on the package's __path__ (the stand-in's directory)
        return importlib.util.spec_from_file_location(
            "torch_tpu", os.path.join(_COMPAT_DIR, "__init__.py"), submodule_search_locations=[_COMPAT_DIR])


def torch_tpu_is_compat() -> bool:
    """Whether ``import torch_tpu`` gives torchtpu's stand-in (False: a real one, or none)."""
    mod = sys.modules.get("torch_tpu")
    if mod is not None:
        return getattr(mod, "IS_TORCHTPU_COMPAT", False)
    return any(isinstance(f, _TorchTPUCompatFinder) for f in sys.meta_path) and _real_torch_tpu() is None


def _real_torch_tpu():
    for finder in sys.meta_path:
        if isinstance(finder, _TorchTPUCompatFinder) or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec("torch_tpu", None)
        if spec is not None:
            return spec
    return None


def enable_torch_tpu_compat() -> bool:
    """Serve ``import torch_tpu`` (and ``torch_tpu._loader.load()``, which imports torchtpu) from
    torchtpu's stand-in, so that Ray Train's ``ScalingConfig(use_tpu=True)`` path runs on tpu.

    Opt-in (``TORCHTPU_TORCH_TPU_COMPAT=1`` does it at ``import torch``); stands aside for a real
    ``torch_tpu``: returns False and changes nothing when one is installed or already imported.
    True when the stand-in serves the name (idempotent)."""
    with _lock:
        mod = sys.modules.get("torch_tpu")
        if mod is not None:
            return bool(getattr(mod, "IS_TORCHTPU_COMPAT", False))
        if _real_torch_tpu() is not None:
            return False
        if not any(isinstance(f, _TorchTPUCompatFinder) for f in sys.meta_path):
            sys.meta_path.append(_TorchTPUCompatFinder())
        return True


def _compat_requested() -> bool:
    v = os.environ.get(COMPAT_ENV, "").strip()
    if v in ("", "0"):
        return False
    if v != "1":
        raise ValueError(f"{COMPAT_ENV}={v!r}: expected 1 (serve torch_tpu from torchtpu) or 0")
    return True


# ---------------------------------------------------------------- the entry point
def load() -> None:
    """torch's ``torch.backends`` entry point (idempotent)."""
    with _lock:
        if _compat_requested():
            enable_torch_tpu_compat()
        if _state["loaded"] or "torchtpu" in sys.modules:
            _state["loaded"] = True
            return
        import torch

        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "tpu"):
            return  # another backend holds PrivateUse1: torchtpu's own import says so, if asked
        torch.utils.rename_privateuse1_backend("tpu")
        torch._register_device_module("tpu", _LazyDeviceModule("torch.tpu", "The tpu device module (torchtpu, "
                                                                           "imported on first use)."))
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(_first_tpu_op, "PrivateUse1")
        _state["fallback"] = lib
        sys.meta_path.insert(0, _AroundImport("torchtpu", before=_step_aside))
        _after_import("torch.distributed", _register_c10d)
        _after_import("torchrec", _teach_torchrec)
        _state["loaded"] = True
