"""Reward functions on text, TRL's convention, and their weighted combination.

A reward function is called as ``fn(prompts=[...], completions=[...], **columns)`` and
returns one value per sample: a number, or ``None`` when the reward does not apply to that
sample (for multi-turn episodes ``completions`` are message lists: the conversation after the
prompt; :func:`completion_text` reads its last assistant message). ``columns`` are the dataset's
other columns (one list per column, aligned with the samples) plus ``completion_ids`` (the generated token ids). Functions should accept
``**kwargs`` for the columns they do not use.

:class:`RewardSet` combines several with weights: a sample's reward is the weighted sum of
the rewards that apply to it (0 when none does, counted in ``reward/none_applied``). A
function that raises, returns the wrong number of values, or a NaN / inf / non-number is
reported by name (:class:`RewardFunctionError`); the driver then finds the sample(s) and
stops or goes on (``RLDriver(on_reward_error=...)``).

Built-ins (:data:`BUILTINS`, by name on the command line):

- ``math_answer``: 1.0 when the completion's answer equals the reference (column ``answer``,
  ``solution`` or ``ground_truth``), else 0.0. The answer is the last ``\\boxed{...}``, else
  the text after ``####``, else the last number; references are read the same way (GSM8K's
  ``#### 72``, MATH's ``\\boxed{}``) and compared as numbers when both are numbers.
- ``format``: :func:`regex_format` -- 1.0 when the completion matches a regular expression.
- ``env_reward``: :func:`env_reward` -- a multi-turn episode's environment reward (``--env``; added
  first by ``train.py`` when an environment is given).
- ``length_penalty``: :func:`length_penalty` -- 0 up to a soft limit, then down to -1 at the
  hard limit (DAPO's overlong shaping), in tokens of ``completion_ids``.

:func:`resolve_reward` turns ``NAME`` (a built-in), ``module:function`` or
``path/to/file.py:function`` into a named function.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Callable, Optional, Sequence

from .plugins import import_target

__all__ = [
    "BUILTINS",
    "RewardFunctionError",
    "RewardLengthError",
    "RewardSet",
    "completion_text",
    "env_reward",
    "extract_answer",
    "length_penalty",
    "math_answer",
    "regex_format",
    "resolve_reward",
]


class RewardFunctionError(ValueError):
    """A reward function raised or returned something that is not one number-or-None per sample."""


class RewardLengthError(RewardFunctionError):
    """A reward function returned a different number of values than it was given samples."""


# ------------------------------------------------------------------ answers
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]+)")


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced


def extract_answer(text, *, final_number: bool = True) -> Optional[str]:
    """The answer in ``text``: the last ``\\boxed{...}``, else what follows the last ``####``,
    else (``final_number``) the last number; None when there is none."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return str(text)
    text = str(text)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    if final_number:
        nums = _NUMBER.findall(text)
        return nums[-1] if nums else None
    return text.strip()


def _as_number(s: str) -> Optional[Fraction]:
    s = s.strip().strip("$").rstrip(".").replace(",", "").replace(" ", "")
    if s.startswith("\\frac{") and s.endswith("}"):
        parts = s[6:-1].split("}{")
        s = f"{parts[0]}/{parts[1]}" if len(parts) == 2 else s
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _same_answer(pred: str, ref: str) -> bool:
    a, b = _as_number(pred), _as_number(ref)
    if a is not None and b is not None:
        return a == b
    def norm(x):
        return re.sub(r"\s+", "", x).strip("$").rstrip(".").lower()

    return norm(pred) == norm(ref)


REFERENCE_COLUMNS = ("answer", "solution", "ground_truth")


def completion_text(completion) -> str:
    """A completion as text: itself, or for a conversation (a list of messages, multi-turn episodes) the
    content of its last assistant message."""
    if isinstance(completion, (list, tuple)):
        said = [m.get("content") or "" for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        return str(said[-1]) if said else ""
    return "" if completion is None else str(completion)


def env_reward(prompts, completions, env_reward=None, **_) -> list:
    """The environment's reward of each multi-turn episode (the sum of what its ``step`` returned; None
    where it gave none): the ``env_reward`` column the scorer adds for episodes."""
    if env_reward is None:
        raise KeyError("env_reward applies to multi-turn episodes (--env); these samples have no env_reward column")
    return list(env_reward)


def math_answer(prompts, completions, **columns) -> list:
    """1.0 when a completion's final answer equals the reference answer, else 0.0; None for a sample
    without a reference. The reference column is the first of ``answer``, ``solution``,
    ``ground_truth`` that the data has."""
    key = next((k for k in REFERENCE_COLUMNS if k in columns), None)
    if key is None:
        raise KeyError(f"math_answer needs a reference column, one of {list(REFERENCE_COLUMNS)}; the data has "
                       f"{sorted(k for k in columns if k != 'completion_ids')}")
    out = []
    for completion, ref in zip(completions, columns[key]):
        ref_ans = extract_answer(ref, final_number=False) if ref is not None else None
        if ref_ans is None or ref_ans == "":
            out.append(None)
            continue
        pred = extract_answer(completion_text(completion))
        out.append(1.0 if pred is not None and _same_answer(pred, ref_ans) else 0.0)
    return out


def regex_format(pattern: str, *, fullmatch: bool = False, flags: int = re.DOTALL, name: str = "format") -> Callable:
    """A reward of 1.0 for completions that match ``pattern`` (``re.search``, or ``re.fullmatch``
    after stripping surrounding whitespace), else 0.0."""
    try:
        rx = re.compile(pattern, flags)
    except re.error as e:
        raise ValueError(f"regex_format: bad regular expression {pattern!r}: {e}") from None

    def fn(prompts, completions, **_):
        if fullmatch:
            return [1.0 if rx.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]
        return [1.0 if rx.search(completion_text(c)) else 0.0 for c in completions]

    fn.__name__ = name
    fn.__qualname__ = name
    fn.pattern = pattern
    return fn


def length_penalty(max_tokens: int, buffer: Optional[int] = None, *, name: str = "length_penalty") -> Callable:
    """0 for completions of at most ``max_tokens - buffer`` tokens, falling linearly to -1 at
    ``max_tokens`` and staying there beyond (``buffer`` default: a quarter of ``max_tokens``).
    Counts ``completion_ids`` (what the driver passes); without them, whitespace-separated words."""
    max_tokens = int(max_tokens)
    buffer = max(1, int(buffer if buffer is not None else max_tokens // 4))
    if max_tokens < 1 or buffer > max_tokens:
        raise ValueError(f"length_penalty: need 1 <= buffer ({buffer}) <= max_tokens ({max_tokens})")
    soft = max_tokens - buffer

    def fn(prompts, completions, completion_ids=None, **_):
        lens = ([len(c) for c in completion_ids] if completion_ids is not None else
                [len(c.split()) for c in completions])
        return [0.0 if n <= soft else -min(1.0, (n - soft) / buffer) for n in lens]

    fn.__name__ = name
    fn.__qualname__ = name
    return fn


DEFAULT_FORMAT = r"(\\boxed\{.+\}|####\s*\S+)"

# name -> factory(options) -> reward function; options are the run's settings (max_new_tokens, ...)
BUILTINS = {
    "math_answer": lambda opts: math_answer,
    "env_reward": lambda opts: env_reward,
    "format": lambda opts: regex_format(opts.get("format_regex") or DEFAULT_FORMAT),
    "length_penalty": lambda opts: length_penalty(opts.get("max_new_tokens") or 256, opts.get("length_buffer")),
}


def resolve_reward(spec: str, **options) -> tuple:
    """``(name, fn)`` for ``spec``: a built-in name, ``module:function`` or ``file.py:function``.
    ``options`` configure the built-ins (``max_new_tokens``, ``format_regex``, ``length_buffer``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, not {spec!r}")
    spec = spec.strip()
    if spec in BUILTINS:
        return spec, BUILTINS[spec](options)
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTINS)}) or MODULE:FUNCTION "
                         f"(or path/to/file.py:FUNCTION)")
    mod_name, _, fn_name = spec.rpartition(":")
    module = import_target(mod_name, f"reward {spec!r}", ValueError, "_reward")
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: {mod_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    return fn_name, fn


# ------------------------------------------------------------------ combination
def _checked(name: str, vals, n: int) -> list:
    try:
        vals = vals.tolist() if hasattr(vals, "tolist") else list(vals)
    except TypeError:
        raise RewardFunctionError(f"reward {name!r} returned a {type(vals).__name__}, not a list") from None
    if len(vals) != n:
        raise RewardLengthError(f"reward {name!r} returned {len(vals)} values for {n} samples")
    out = []
    for k, v in enumerate(vals):
        where = f" for sample {k} of {n}" if n > 1 else ""
        if v is None:
            out.append(None)
            continue
        if isinstance(v, bool):
            v = float(v)
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward {name!r} returned {v!r}{where}, not a number or None") from None
        if not math.isfinite(f):
            raise RewardFunctionError(f"reward {name!r} returned {f}{where}")
        out.append(f)
    return out


class RewardSet:
    """Several reward functions with weights, as one callable with the driver's signature
    ``(prompts, completions, metadata) -> list[float]`` (``metadata``: one dict of columns per
    sample). ``rewards``: functions or ``(name, function)`` pairs; ``weights`` default to 1.

    After a call, ``last_values`` holds each reward's per-sample values (None where it did not
    apply) and ``last_metrics`` their means (``reward/<name>``) over the samples they applied to.
    """

    def __init__(self, rewards: Sequence, weights: Optional[Sequence[float]] = None):
        rewards = list(rewards)
        if not rewards:
            raise ValueError("RewardSet: no reward functions")
        self.names, self.fns = [], []
        for r in rewards:
            name, fn = r if isinstance(r, tuple) else (getattr(r, "__name__", type(r).__name__), r)
            if not callable(fn):
                raise TypeError(f"RewardSet: reward {name!r} is not callable")
            if name in self.names:
                name = f"{name}_{len(self.names)}"
            self.names.append(name)
            self.fns.append(fn)
        weights = [1.0] * len(self.fns) if weights is None or len(weights) == 0 else [float(w) for w in weights]
        if len(weights) != len(self.fns):
            raise ValueError(f"RewardSet: {len(weights)} weights for {len(self.fns)} rewards ({self.names})")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"RewardSet: weights must be finite, not {weights}")
        self.weights = weights
        self.last_values: dict = {}
        self.last_metrics: dict = {}

    def __repr__(self):
        return f"RewardSet({', '.join(f'{n}*{w:g}' for n, w in zip(self.names, self.weights))})"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], metadata: Optional[Sequence] = None) -> list:
        n = len(prompts)
        if len(completions) != n:
            raise ValueError(f"RewardSet: {n} prompts and {len(completions)} completions")
        metadata = list(metadata) if metadata is not None else [{}] * n
        keys = []
        for m in metadata:
            for k in (m or {}):
                if k not in keys:
                    keys.append(k)
        columns = {k: [(m or {}).get(k) for m in metadata] for k in keys}
        values = {}
        for name, fn in zip(self.names, self.fns):
            try:
                vals = fn(prompts=list(prompts), completions=list(completions), **columns)
            except RewardFunctionError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised naming the reward
                raise RewardFunctionError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
            values[name] = _checked(name, vals, n)
        total, none_applied = [], 0
        for k in range(n):
            applied = [(w, values[name][k]) for name, w in zip(self.names, self.weights) if values[name][k] is not None]
            none_applied += not applied
            total.append(sum(w * v for w, v in applied))
        self.last_values = values
        metrics = {}
        for name in self.names:
            vs = [v for v in values[name] if v is not None]
            metrics[f"reward/{name}"] = sum(vs) / len(vs) if vs else None
        metrics["reward/none_applied"] = none_applied
        self.last_metrics = metrics
        return total
