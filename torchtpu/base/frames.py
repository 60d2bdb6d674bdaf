"""Which stack frame is the user's: errors, warnings and DeferAndFuse's recording sites name the
line of model or user code that caused them, not a line inside torch, JAX or torchtpu."""

from __future__ import annotations

import sys
import warnings

_internal_code: dict = {}  # code object -> is it runtime code (decided once per code object)


def _is_internal(filename: str) -> bool:
    """Runtime code (torch, jax, torchtpu), as opposed to model and user code."""
    return "/torch/" in filename or "/torchtpu/" in filename or "/jax/" in filename or "/jaxlib/" in filename


def user_frame(f):
    """The first frame from ``f`` outward that is not runtime code, or None."""
    internal = _internal_code
    while f is not None:
        c = f.f_code
        inside = internal.get(c)
        if inside is None:
            inside = _is_internal(c.co_filename)
            if len(internal) < 65536:
                internal[c] = inside
        if not inside:
            return f
        f = f.f_back
    return None


def user_site(depth: int = 1):
    """(file, line, function) of the nearest user line, searched from ``depth`` frames above the
    caller of ``user_site`` outward.

    Only (file, line, name) is kept, never the frame: a frame would keep its locals (tensors)
    alive for as long as the site is held."""
    f = user_frame(sys._getframe(depth + 1))
    if f is None:
        return None
    c = f.f_code
    return (c.co_filename, f.f_lineno, c.co_name)


# how many warnings ``warn_at_user_line`` was asked for (the kernel executor reads whether an op's warn
# hook warned: then CPU's kernel, called for its type checks, would warn the same again)
WARN_COUNT = [0]


def warn_at_user_line(message: str, category=UserWarning) -> None:
    """``warnings.warn`` attributed to the nearest user line (as PyTorch's C++ warnings are), so the
    user's filters and the once-per-location rule apply to their code, not to torchtpu's."""
    WARN_COUNT[0] += 1
    f = user_frame(sys._getframe(1))
    if f is None:
        warnings.warn(message, category, stacklevel=2)
        return
    g = f.f_globals
    warnings.warn_explicit(message, category, f.f_code.co_filename, f.f_lineno,
                           module=g.get("__name__", "<unknown>"), registry=g.setdefault("__warningregistry__", {}))


_warned_once: set = set()


def warn_once_at_user_line(message: str, category=UserWarning) -> None:
    """``warn_at_user_line`` once per process for each message (PyTorch's ``TORCH_WARN_ONCE``)."""
    if message in _warned_once:
        return
    _warned_once.add(message)
    warn_at_user_line(message, category)
