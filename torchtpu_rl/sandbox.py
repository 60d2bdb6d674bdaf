"""Running a tool call in a sandbox: a fresh Python subprocess with CPU-time, memory and output limits,
no network, killed on timeout.

:func:`run_tool` starts ``python -I -B`` (isolated: no PYTHON* variables, no user site, no working
directory on the path; no bytecode written, which the file-size limit would tear) with a small
bootstrap that, in the child before the tool is imported:

- sets ``RLIMIT_CPU`` (seconds of CPU), ``RLIMIT_AS`` (address space: the memory limit), ``RLIMIT_FSIZE``
  (no file larger than the output limit) and ``RLIMIT_CORE`` 0 with :func:`resource.setrlimit`;
- cuts the network: a new user + network namespace through ``unshare(2)`` where the kernel allows it
  unprivileged (only a loopback, down), and in every case ``socket.socket`` and ``socket.create_connection``
  refuse (so a tool that opens a connection gets an error, not a hang);
- imports the tool (``module:function`` or ``path/to/file.py:function``), calls it with the JSON arguments
  and writes ``{"ok": true, "result": ...}`` or the exception as JSON on stdout.

The parent waits at most ``timeout_s`` of wall time, then kills the child's whole process group; it reads
at most ``max_output_bytes`` of stdout. Every outcome is a :class:`ToolOutcome` (``ok``, ``text``,
``status``: ``"ok"``, ``"error"`` (the tool raised), ``"timeout"``, ``"killed"`` (CPU or memory limit, or
a signal), ``"output_limit"``): a tool never crashes the caller.

This module imports only the standard library: the rollout worker calls it, and the child runs without
torch or this package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading

__all__ = ["SandboxLimits", "ToolOutcome", "run_tool"]


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per call: ``timeout_s`` of wall time, ``cpu_s`` of CPU time, ``memory_mb`` of address space,
    ``max_output_bytes`` of result (stdout of the child; the result text is cut to it)."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 16384

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SandboxLimits.{name} must be a number > 0, not {v!r}")


@dataclasses.dataclass
class ToolOutcome:
    ok: bool
    text: str  # the result (str, or JSON of another value), or why it failed
    status: str  # ok | error | timeout | killed | output_limit
    seconds: float = 0.0


# The child: limits first, then the network, then the tool. Arguments arrive on stdin as JSON.
_BOOTSTRAP = r"""
import json, os, resource, sys
spec = json.loads(sys.stdin.readline())
lim = spec["limits"]
resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
mem = int(lim["memory_mb"]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_output_bytes"], lim["max_output_bytes"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:  # a private network namespace: no interface but a loopback that is down
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET; refused quietly where not allowed
except Exception:
    pass
import socket
def _no_network(*a, **k):
    raise PermissionError("network access is disabled in the tool sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
socket.getaddrinfo = _no_network
ref = spec["tool"]
mod_name, _, fn_name = ref.rpartition(":")
if mod_name.endswith(".py"):
    import importlib.util
    s = importlib.util.spec_from_file_location("_sandboxed_tool_module", mod_name)
    mod = importlib.util.module_from_spec(s)
    sys.modules[s.name] = mod
    s.loader.exec_module(mod)
else:
    for p in spec.get("path", []):
        if p not in sys.path:
            sys.path.append(p)
    import importlib
    mod = importlib.import_module(mod_name)
fn = mod
for part in fn_name.split("."):
    fn = getattr(fn, part)
fn = getattr(fn, "__wrapped_tool__", fn)
out = sys.stdout
sys.stdout = open(os.devnull, "w")  # the tool's own prints do not corrupt the reply
try:
    res = fn(**spec["arguments"])
    reply = {"ok": True, "result": res if isinstance(res, str) else json.dumps(res, default=str)}
except BaseException as e:
    reply = {"ok": False, "result": f"{type(e).__name__}: {e}"}
out.write(json.dumps(reply))
out.flush()
"""


def run_tool(tool_ref: str, arguments: dict, limits: SandboxLimits = SandboxLimits(),
             path: tuple = (), stdlib_only: bool = False) -> ToolOutcome:
    """Call the function ``tool_ref`` (``module:function`` or ``file.py:function``) with ``arguments`` in a
    sandboxed child (see the module doc). ``path``: directories a ``module:function`` is imported from.
    ``stdlib_only``: the tool needs no installed package (the child skips ``site``: a faster start)."""
    import time

    t0 = time.perf_counter()
    spec = {"tool": tool_ref, "arguments": arguments, "path": list(path),
            "limits": {"cpu_s": int(max(1, round(limits.cpu_s))), "memory_mb": int(limits.memory_mb),
                       "max_output_bytes": int(limits.max_output_bytes) + 4096}}
    try:
        payload = json.dumps(spec) + "\n"
    except (TypeError, ValueError) as e:
        return ToolOutcome(False, f"arguments are not JSON: {e}", "error")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-I", "-B", *(["-S"] if stdlib_only else []), "-c", _BOOTSTRAP], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd="/",
                            start_new_session=True)  # its own process group: killed as a whole
    cap = int(limits.max_output_bytes) + 4096
    chunks, size = [], [0]

    def read_out():  # read at most the output limit; the rest is discarded as it comes
        while True:
            b = proc.stdout.read(65536)
            if not b:
                return
            if size[0] < cap:
                chunks.append(b[:cap - size[0]])
            size[0] += len(b)

    reader = threading.Thread(target=read_out, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.stdin.write(payload.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=float(limits.timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=5)
    proc.stderr.close()
    dt = time.perf_counter() - t0
    if timed_out:
        return ToolOutcome(False, f"the tool ran past its time limit ({limits.timeout_s:g} s) and was killed",
                           "timeout", dt)
    if size[0] > cap:
        return ToolOutcome(False, f"the tool's output exceeded the limit ({limits.max_output_bytes} bytes)",
                           "output_limit", dt)
    raw = b"".join(chunks).decode("utf-8", "replace")
    if proc.returncode != 0 or not raw:
        rc = proc.returncode
        why = (f"signal {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() else f"exit {rc}")
        if rc in (-signal.SIGXCPU, -signal.SIGKILL):
            what = f"it used more than {limits.cpu_s:g} s of CPU"
        else:
            what = f"it may have exceeded the memory limit ({limits.memory_mb} MB)"
        return ToolOutcome(False, f"the tool process was killed ({why}): {what}", "killed", dt)
    try:
        reply = json.loads(raw)
    except json.JSONDecodeError:
        return ToolOutcome(False, "the tool process returned no readable result", "killed", dt)
    text = str(reply.get("result", ""))
    if len(text.encode()) > limits.max_output_bytes:
        return ToolOutcome(False, f"the tool's output exceeded the limit ({limits.max_output_bytes} bytes)",
                           "output_limit", dt)
    if not reply.get("ok"):
        # a MemoryError inside the tool is the memory limit reached
        if text.startswith("MemoryError"):
            return ToolOutcome(False, f"the tool ran out of its memory limit ({limits.memory_mb} MB) and was stopped",
                               "killed", dt)
        return ToolOutcome(False, text, "error", dt)
    return ToolOutcome(True, text, "ok", dt)
