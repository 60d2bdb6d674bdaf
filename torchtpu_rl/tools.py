"""Tools an agent calls: Python functions with JSON-schema signatures, parsed from completions in the
Qwen / Hermes format, executed in a sandbox (:mod:`torchtpu_rl.sandbox`).

- A tool is a function with type hints and a Google-style docstring (``Args:``): its schema comes from
  ``transformers.utils.get_json_schema``, the form Hugging Face chat templates take as ``tools=``. A
  function may instead carry its schema as ``fn.json_schema``. No schema is an error naming the tool.
- :func:`resolve_tools` turns ``--tools`` specs (built-in names, ``MODULE:FUNCTION``,
  ``path/to/file.py:FUNCTION``) into :class:`Tool` objects (picklable: a reference, not the function).
- :func:`parse_tool_calls` reads every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of
  an assistant turn; a block that is not valid JSON, lacks a name, names an unknown tool, or has
  arguments that do not fit the schema is a :class:`ToolCallError`, which becomes the observation the
  model sees (and is counted as a parse failure).
- :func:`check_template_renders_tools`: the tokenizer's chat template renders the tools' schemas and a
  ``tool`` message; else an error before any actor starts.

Built-ins (:data:`BUILTINS`): ``calculator`` (arithmetic expressions, evaluated on the AST: no names,
no calls) and ``python`` (runs code, returns what it prints). Both run in the sandbox like any tool.

This module imports only the standard library at import time: the sandboxed child loads it by path.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import math
import operator
import os
import re
import sys
from typing import Callable, Optional, Sequence

__all__ = ["BUILTINS", "Tool", "ToolCall", "ToolCallError", "calculator", "check_template_renders_tools",
           "parse_tool_calls", "python", "resolve_tools", "tool_schema"]


# ================================================================= built-in tools
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    value = _evaluate(ast.parse(str(expression).strip(), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer():
            value = int(value)
        else:
            value = round(value, 10)
    return str(value)


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: Python source code; use print() to show results.
    """
    buf = io.StringIO()
    old = sys.stdout
    sys.stdout = buf
    try:
        exec(compile(str(code), "<tool:python>", "exec"), {"__name__": "__tool__"})
    finally:
        sys.stdout = old
    return buf.getvalue()


BUILTINS = {"calculator": calculator, "python": python}


# ================================================================= tools as data
class ToolSpecError(ValueError):
    """A --tools entry that cannot be a tool (not found, not callable, no JSON schema)."""


def tool_schema(fn: Callable, name: str) -> dict:
    """The function's JSON schema in Hugging Face's tool form ``{"type": "function", "function": {...}}``."""
    given = getattr(fn, "json_schema", None)
    if given is not None:
        if not (isinstance(given, dict) and given.get("type") == "function" and "name" in given.get("function", {})):
            raise ToolSpecError(f"--tools: tool {name!r}: its json_schema must be {{'type': 'function', 'function': "
                                f"{{'name', 'description', 'parameters'}}}}, not {given!r}")
        return given
    try:
        from transformers.utils import get_json_schema
    except ImportError as e:  # pragma: no cover - transformers is a dependency of the RL wing
        raise ToolSpecError(f"tool {name!r}: needs transformers to read its schema ({e})") from e
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises its own parsing exceptions
        raise ToolSpecError(f"--tools: tool {name!r} has no JSON schema: give it type hints and a docstring with an "
                            f"'Args:' section for every argument (transformers' get_json_schema), or a "
                            f"json_schema attribute ({type(e).__name__}: {e})") from e


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool by reference (picklable; the sandboxed child imports it): ``ref`` is ``module:function`` or
    ``file.py:function``; ``schema`` the JSON schema the chat template renders."""

    name: str
    ref: str
    schema: dict
    path: tuple = ()  # directories a module:function is imported from in the child
    stdlib_only: bool = False  # the child can skip site-packages (faster start): the built-ins

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def _load_ref(spec: str) -> tuple:
    """(function, its sandbox ref, import path) for ``module:function`` or ``file.py:function``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ToolSpecError(f"--tools {spec!r}: give a built-in name ({', '.join(BUILTINS)}), MODULE:FUNCTION or "
                            "path/to/file.py:FUNCTION")
    from .plugins import import_target  # (not at the top: the sandboxed child loads this file by path)

    mod = import_target(target, f"--tools {spec!r}", ToolSpecError, "_tools")
    if target.endswith(".py"):
        ref, extra = f"{os.path.abspath(target)}:{attr}", ()
    else:
        ref, extra = spec, ()
        f = getattr(mod, "__file__", None)
        if f:  # the directory the module's top package sits in, so the sandboxed child imports it too
            root = os.path.dirname(os.path.abspath(f))
            ups = len(target.split(".")) - (0 if os.path.basename(f) == "__init__.py" else 1)
            for _ in range(ups):
                root = os.path.dirname(root)
            extra = (root,)
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ToolSpecError(f"--tools {spec!r}: {target!r} has no {attr!r}")
    if not callable(fn):
        raise ToolSpecError(f"--tools {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn, ref, extra


def resolve_tools(specs: Sequence) -> list:
    """``--tools`` entries (names, ``MODULE:FUNCTION``, ``file.py:FUNCTION``, comma-separated lists, or
    :class:`Tool` objects) as Tools, their schemas read and names unique."""
    out, names = [], set()
    flat = []
    for s in specs or []:
        if isinstance(s, Tool):
            flat.append(s)
        elif isinstance(s, str):
            flat.extend(p.strip() for p in s.split(",") if p.strip())
        else:
            raise ToolSpecError(f"--tools: an entry must be a name or a 'MODULE:FUNCTION' string, not {s!r}")
    for s in flat:
        if isinstance(s, Tool):
            tool = s
        elif s in BUILTINS:
            fn = BUILTINS[s]
            tool = Tool(s, f"{os.path.abspath(__file__)}:{fn.__name__}", tool_schema(fn, s), stdlib_only=True)
        else:
            fn, ref, extra = _load_ref(s)
            schema = tool_schema(fn, s)
            tool = Tool(schema["function"]["name"], ref, schema, extra)
        if tool.name in names:
            raise ToolSpecError(f"--tools: two tools are named {tool.name!r}")
        names.add(tool.name)
        out.append(tool)
    return out


# ================================================================= parsing calls
@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict


class ToolCallError(ValueError):
    """A ``<tool_call>`` block that cannot be run (the observation says why)."""


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}


def _check_arguments(tool: Tool, args: dict) -> None:
    params = tool.parameters
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        raise ToolCallError(f"tool {tool.name!r} needs argument(s) {missing}")
    unknown = [k for k in args if k not in props]
    if unknown:
        raise ToolCallError(f"tool {tool.name!r} takes no argument(s) {unknown} (it takes {sorted(props)})")
    for k, v in args.items():
        want = props[k].get("type")
        types = want if isinstance(want, list) else [want]
        py = tuple(t for w in types if w in _JSON_TYPES for t in
                   (_JSON_TYPES[w] if isinstance(_JSON_TYPES[w], tuple) else (_JSON_TYPES[w],)))
        if py and (not isinstance(v, py) or (isinstance(v, bool) and bool not in py)):
            raise ToolCallError(f"tool {tool.name!r}: argument {k!r} must be {want}, not {type(v).__name__}")


def parse_tool_calls(text: str, tools: Sequence[Tool]) -> tuple:
    """``(calls, errors)`` of an assistant turn: each ``<tool_call>`` block as a :class:`ToolCall`, or a
    :class:`ToolCallError` saying why it cannot run; an opened block never closed is an error too. No
    block at all: ``([], [])``."""
    by_name = {t.name: t for t in tools}
    calls, errors = [], []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos}): "
                                        f"{body[:200]!r}"))
            continue
        try:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ToolCallError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
            if obj["name"] not in by_name:
                raise ToolCallError(f"there is no tool {obj['name']!r} (tools: {sorted(by_name)})")
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    raise ToolCallError(f"the arguments of {obj['name']!r} are not a JSON object") from None
            if not isinstance(args, dict):
                raise ToolCallError(f"the arguments of {obj['name']!r} must be a JSON object, not "
                                    f"{type(args).__name__}")
            _check_arguments(by_name[obj["name"]], args)
        except ToolCallError as e:
            errors.append(e)
            continue
        calls.append(ToolCall(obj["name"], args))
    opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
    if opened > closed:
        errors.append(ToolCallError("a <tool_call> block was opened and never closed with </tool_call>"))
    return calls, errors


# ================================================================= the chat template
class TemplateError(ValueError):
    """The tokenizer's chat template cannot render the tools or their results."""


def check_template_renders_tools(tokenizer, tools: Sequence[Tool]) -> None:
    """The chat template takes ``tools=`` and renders each tool's name, and renders a ``tool`` message; else
    a :class:`TemplateError` saying which part fails."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("--tools needs a tokenizer with a chat template that renders tools (this tokenizer "
                            "has no chat template)")
    schemas = [t.schema for t in tools]
    probe = [{"role": "user", "content": "probe"}]
    try:
        text = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's own error, re-raised naming the flag
        raise TemplateError(f"--tools: the tokenizer's chat template fails with tools= ({type(e).__name__}: {e})") \
            from e
    missing = [t.name for t in tools if t.name not in text]
    if missing:
        raise TemplateError(f"--tools: the tokenizer's chat template does not render tools (tool(s) {missing} do not "
                            "appear in the rendered prompt); use a tool-calling template (e.g. Qwen2.5's)")
    marker = "probe-tool-result-7731"
    msgs = probe + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(msgs, tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001
        raise TemplateError(f"--tools: the tokenizer's chat template cannot render a 'tool' message "
                            f"({type(e).__name__}: {e})") from e
    if marker not in text:
        raise TemplateError("--tools: the tokenizer's chat template drops 'tool' messages (the tool results would "
                            "never reach the model)")


def tool_names(tools: Optional[Sequence[Tool]]) -> list:
    return [t.name for t in tools or []]
