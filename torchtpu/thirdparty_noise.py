"""Silence two known, harmless third-party log lines, matched exactly (nothing else is filtered).

* torchao, on a CPU build of torch: ``Failed to load .../torchao/_C_*.so: Could not load this library``
  (its CUDA kernels; the tpu path never uses them) once per library at ``import torchao`` (peft, quantized
  rollouts and ``transformers.TrainingArguments`` import it).
* torch's pytree, when torchao registers its Enums: ``<enum ...> is an Enum subclass and is now natively
  supported by torch.compile as an opaque value type. Calling register_constant() on Enum subclasses is
  deprecated ...`` (torchao's to fix; it changes nothing here).

``TORCHTPU_SHOW_THIRD_PARTY_WARNINGS=1`` keeps them.
"""

from __future__ import annotations

import logging
import os
import re

_TORCHAO_SO = re.compile(r"Failed to load \S*torchao[/\\]_C\S*\.so: Could not load this library: ")
_PYTREE_ENUM = ("is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                "Calling register_constant() on Enum subclasses is deprecated")


class _Exact(logging.Filter):
    def __init__(self, match):
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.match(record.getMessage())
        except Exception:  # noqa: BLE001 - a record we cannot format is not one of ours: keep it
            return True


def install() -> None:
    """Attach the filters to the two loggers (idempotent; they exist before their packages are imported)."""
    if os.environ.get("TORCHTPU_SHOW_THIRD_PARTY_WARNINGS", "") not in ("", "0"):
        return
    for name, match in (("torchao", lambda m: _TORCHAO_SO.match(m) is not None),
                        ("torch.utils._pytree", lambda m: _PYTREE_ENUM in m)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Exact) for f in logger.filters):
            logger.addFilter(_Exact(match))
