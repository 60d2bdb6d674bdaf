"""Op names: one spelling for each use.

``qualified_name`` (``aten::add.Tensor``, ``aten::mm.default``) keys the lowering table and
the installed kernels; ``short_name`` (``aten::add.Tensor``, ``aten::mm``) is what metrics,
warnings and errors show, as PyTorch prints overloads."""

from __future__ import annotations

import torch


def qualified_name(op: torch._ops.OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def short_name(op: torch._ops.OpOverload) -> str:
    overload = op._schema.overload_name
    return op._schema.name + ("." + overload if overload else "")


def normalize(name: str) -> str:
    """``"add"`` / ``"aten::add"`` / ``"add.Tensor"`` -> ``"aten::add.default"`` / ``"aten::add.Tensor"``."""
    qual = name if "::" in name else f"aten::{name}"
    if "." not in qual.split("::")[1]:
        qual += ".default"
    return qual


def op_from_name(qual: str) -> torch._ops.OpOverload:
    """The ``OpOverload`` named by a qualified (or short) name."""
    ns, rest = normalize(qual).split("::")
    name, overload = rest.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)
