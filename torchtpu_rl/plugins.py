"""User code named on the command line (``--reward``, ``--env``, ``--tools``): ``MODULE:NAME`` or
``path/to/file.py:NAME``. One loader, so every flag reports a missing file or a failing import alike."""

from __future__ import annotations

import importlib
import importlib.util
import os

__all__ = ["import_target"]


def import_target(target: str, label: str, error: type = ValueError, prefix: str = "_user"):
    """The module ``target`` names: a ``.py`` path (executed from its file, under a private module name) or
    an importable module name. Failures raise ``error`` whose message starts with ``label`` (the flag and
    its value) and says what went wrong."""
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise error(f"{label}: file {target!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"{prefix}_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - re-raised naming the flag
            raise error(f"{label}: importing {target!r} raised {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(target)
    except Exception as e:  # noqa: BLE001 - re-raised naming the flag
        raise error(f"{label}: cannot import module {target!r} ({type(e).__name__}: {e})") from e
