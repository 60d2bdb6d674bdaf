"""Symbolic sizes of dynamic-shape graphs: a size is an int or a sympy expression (SymInt)."""

from __future__ import annotations

import torch


class NotBucketable(Exception):
    """A dynamic graph whose results would change if its dynamic dims were padded."""


def size_expr(s):
    """A size as an int or a sympy expression (SymInt)."""
    if isinstance(s, torch.SymInt):
        e = s.node.expr
        return int(e) if e.is_number else e
    return int(s)


def is_symbolic(e) -> bool:
    return not isinstance(e, int)


def eval_size(e, env) -> int:
    """Value of size ``e`` with the symbols of ``env`` ({sympy.Symbol: sympy.Integer}) substituted."""
    if isinstance(e, int):
        return e
    r = e.xreplace(env)
    if not r.is_number:
        raise NotBucketable(f"size {e} depends on a symbol that is not a graph input")
    return int(r)


def val_shape(val, env):
    return tuple(eval_size(size_expr(s), env) for s in val.shape)
