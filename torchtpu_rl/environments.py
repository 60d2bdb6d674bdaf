"""Environments of multi-turn episodes: the smallest interface, its checks, and the built-ins.

An environment is a class; one instance serves one episode::

    class MyEnv:
        def reset(self, row: dict) -> str | None: ...          # an optional extra user message first
        def step(self, completion: str) -> tuple: ...          # (observation | None, reward | None, done)

``reset`` gets the episode's dataset row (every column but the prompt). ``step`` gets the assistant's
turn as text and returns the next observation (a user message; ``None``: nothing to say), a reward
(``None``: none this turn; the episode's environment reward is the sum of the rewards given) and
whether the episode is over. Richer forms are accepted: an observation may be a message dict
(``{"role": "user" | "tool", "content": ...}``) or a list of them, and ``step`` may return a 4th item,
an info dict (its plain values are kept in the episode's record, ``info``).

:func:`resolve_env` takes ``--env``: a built-in name (:data:`BUILTINS`), ``MODULE:CLASS`` or
``path/to/file.py:CLASS``, and checks the class follows the interface (an :class:`EnvSpecError` naming
the flag otherwise), before any actor starts.

Built-ins:

- ``math_feedback``: the answer is checked against the row's ``answer`` column after each turn; a wrong
  answer gets "That is not right, try again." and another turn; reward 1 for a right answer, 0 when the
  turns run out.
- ``echo_turns``: two-turn protocol test: asks for a second turn with a fixed observation, reward 1 when
  the second turn is not empty (used by tests and as the shape of a custom env).
"""

from __future__ import annotations

import inspect
from typing import Optional

from .plugins import import_target

__all__ = ["BUILTINS", "EnvSpecError", "EchoTurnsEnv", "MathFeedbackEnv", "resolve_env", "check_env_class"]


class EnvSpecError(ValueError):
    """An --env that cannot be an environment."""


class MathFeedbackEnv:
    """Checks the final number of each turn against ``row["answer"]``; a wrong one gets another try."""

    def reset(self, row: dict) -> Optional[str]:
        self.answer = row.get("answer", row.get("solution", row.get("ground_truth")))
        if self.answer is None:
            raise KeyError(f"math_feedback needs an 'answer' column in the data; the row has {sorted(row)}")
        return None

    def step(self, completion: str):
        from .rewards import math_answer

        right = math_answer([""], [completion], answer=[str(self.answer)])[0]
        if right:
            return None, 1.0, True
        return "That is not right, try again.", 0.0, False


class EchoTurnsEnv:
    """Two turns: after the first, the observation "Say more."; reward 1 when the second turn has text."""

    def reset(self, row: dict) -> Optional[str]:
        self.turn = 0
        return None

    def step(self, completion: str):
        self.turn += 1
        if self.turn == 1:
            return "Say more.", None, False
        return None, 1.0 if completion.strip() else 0.0, True


BUILTINS = {"math_feedback": MathFeedbackEnv, "echo_turns": EchoTurnsEnv}


def check_env_class(cls, spec: str = "") -> None:
    """``cls`` can be built with no arguments and has ``reset(row)`` and ``step(completion)``."""
    where = f"--env {spec!r}" if spec else f"environment {getattr(cls, '__name__', cls)!r}"
    if not inspect.isclass(cls):
        raise EnvSpecError(f"{where}: must name a class (one instance per episode), not a {type(cls).__name__}")
    for name, nargs in (("reset", 1), ("step", 1)):
        fn = getattr(cls, name, None)
        if not callable(fn):
            raise EnvSpecError(f"{where}: class {cls.__name__} has no {name}() method; an environment has "
                               "reset(self, row) -> str | None and step(self, completion) -> (observation, reward, done)")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        varargs = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
        required = [p for p in params[1:] if p.default is p.empty]  # [0] is self
        if not varargs and (len(params) - 1 < nargs or len(required) > nargs):
            raise EnvSpecError(f"{where}: {cls.__name__}.{name} must take one argument "
                               f"({'row' if name == 'reset' else 'completion'}), its signature is {sig}")
    try:
        init = inspect.signature(cls)
        required = [p for p in init.parameters.values() if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    if required:
        raise EnvSpecError(f"{where}: {cls.__name__}() must be constructible with no arguments (one instance per "
                           f"episode); it requires {[p.name for p in required]}")


def resolve_env(spec) -> type:
    """The environment class of ``--env`` (a built-in name, ``MODULE:CLASS``, ``file.py:CLASS`` or a class),
    checked (:func:`check_env_class`)."""
    if inspect.isclass(spec):
        check_env_class(spec)
        return spec
    if not isinstance(spec, str) or not spec:
        raise EnvSpecError(f"--env must be a built-in name, MODULE:CLASS or FILE.py:CLASS, not {spec!r}")
    if spec in BUILTINS:
        return BUILTINS[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise EnvSpecError(f"--env {spec!r}: not a built-in ({', '.join(sorted(BUILTINS))}); give MODULE:CLASS or "
                           "path/to/file.py:CLASS")
    mod = import_target(target, f"--env {spec!r}", EnvSpecError, "_env")
    cls = getattr(mod, attr, None)
    if cls is None:
        raise EnvSpecError(f"--env {spec!r}: {target!r} has no {attr!r}")
    check_env_class(cls, spec)
    return cls
