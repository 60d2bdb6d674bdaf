"""Local Ray clusters on this machine: a head (with the job dashboard) and extra nodes.

Every node is a ``ray start --block`` subprocess in its own session (process group), so
stopping a cluster signals exactly the processes it started — never ``ray stop``, which
kills every Ray process of the user (other clusters on a shared machine included).

The head keeps its state (sockets, logs) under ``run_dir`` (``RAY_TMPDIR``). Unix socket
paths must stay under 108 bytes, so ``run_dir`` must be short (``./.run/ray`` or
``/tmp/rt_xxx``); a long one is refused with an error that names it.

Network exposure: the servers Ray runs in Python (dashboard, runtime-env agent, client server)
and our chosen ports go on ``bind`` (default ``127.0.0.1``; Ray's ``--node-ip-address``, and the
dashboard's host), but Ray 2.60's GCS, raylet and worker gRPC servers listen on every interface
whatever it is told. So every head runs Ray's token authentication (``RAY_AUTH_MODE=token``) unless
the caller explicitly disables it: the token is generated into ``<run_dir>/auth_token`` (0600, in
a 0700 run dir) and clients take it from :meth:`LocalHead.client_env` (``connect(head)`` does).

Ownership: every process of a node carries ``TORCHTPU_RAY_NODE=<tag>`` in its environment, and
the state file records the leader's pid, start time and command line; stopping signals only
processes that prove to be ours by those (never a pid or process group taken on trust).

Simulated TPU hosts (:func:`start_simulated_slice`) are nodes started with the same
environment a GKE/KubeRay TPU pod gets (``TPU_ACCELERATOR_TYPE``, ``TPU_WORKER_ID``,
``TPU_NAME``, ``TPU_TOPOLOGY``, ``TPU_WORKER_HOSTNAMES``) and ``--resources '{"TPU": n}'``;
Ray's own TPU accelerator manager then adds the ``TPU-<pod>-head`` and ``<TPU_NAME>``
resources and the ``ray.io/tpu-*`` labels, exactly as on a real slice.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from .discovery import SIMULATED_LABEL, SliceSpec, alive_nodes

DEFAULT_RUN_DIR = ".run/ray"
DEFAULT_OBJECT_STORE_MEMORY = 80 * 1024**2
# "<run_dir>/session_2026-11-29_19-06-36_483050_17600/sockets/plasma_store" must fit in 107 bytes.
_SESSION_SUFFIX_LEN = len("/n99/session_2026-11-29_19-06-36_483050_1234567/sockets/plasma_store")
_UNIX_PATH_MAX = 107
NODE_TAG_LABEL = "torchtpu.io/node-tag"
STATE_FILE = "head.json"
TOKEN_FILE = "auth_token"
DEFAULT_BIND = "127.0.0.1"
# In the environment of every process of a node we start (inherited by raylet, agents, workers): the proof
# that a process is ours when stopping, beside the leader's pid, start time and command line.
OWNER_ENV = "TORCHTPU_RAY_NODE"
AUTH_MODES = ("token", "disabled")


def resolve_auth(auth: Optional[str] = None) -> str:
    """The Ray auth mode of a head we start: ``auth``, else ``$RAY_AUTH_MODE``, else ``token``.

    Token by default whatever ``bind`` is: Ray 2.60's GCS, raylet and worker gRPC servers listen on
    every interface whatever ``--node-ip-address`` says (measured from /proc/net/tcp6), so every head
    listens beyond loopback. ``disabled`` (tests on a private machine) is honoured with a warning."""
    mode = (auth if auth is not None else os.environ.get("RAY_AUTH_MODE") or "token").lower()
    if mode not in AUTH_MODES:
        raise ValueError(f"Ray auth mode must be one of {AUTH_MODES}, got {mode!r} (auth= or RAY_AUTH_MODE)")
    if mode == "disabled":
        warnings.warn("ray_integration: starting a Ray head WITHOUT token authentication (auth='disabled' or "
                      "RAY_AUTH_MODE=disabled): Ray's GCS and raylet listen on every interface, so anyone who "
                      "reaches this host can run code on the cluster", RuntimeWarning, stacklevel=3)
    return mode


def ray_env(run_dir: Optional[str] = None, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for Ray processes we start: no auth token in $HOME, no usage stats.
    The auth mode comes in ``extra`` (:meth:`LocalHead.client_env`)."""
    env = dict(os.environ)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # A loaded 2-core machine starts Python agents slowly; don't let Ray give up on them early.
    env.setdefault("RAY_agent_register_timeout_ms", "300000")
    if run_dir is not None:
        env["RAY_TMPDIR"] = str(run_dir)
    # `python` in job entrypoints must be this interpreter (the project's venv), not whatever PATH finds.
    bindir = os.path.dirname(sys.executable)
    if env.get("PATH", "").split(os.pathsep)[0] != bindir:
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    # A TPU identity inherited from the caller must not leak onto nodes that are not that host.
    for k in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_NAME", "TPU_TOPOLOGY", "TPU_WORKER_HOSTNAMES",
              "RAY_OVERRIDE_LABELS", "RAY_OVERRIDE_RESOURCES", "RAY_ADDRESS"):
        env.pop(k, None)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def _free_port() -> int:
    # probed on every interface: some of Ray's servers take the port on all of them
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_ports() -> Dict[str, int]:
    """Explicit free ports for one node's processes (several clusters can share the machine)."""
    return {
        "node-manager-port": _free_port(),
        "object-manager-port": _free_port(),
        "dashboard-agent-grpc-port": _free_port(),
        "dashboard-agent-listen-port": _free_port(),
        "metrics-export-port": _free_port(),
        "runtime-env-agent-port": _free_port(),
    }


def _port_args(ports: Dict[str, int]) -> List[str]:
    # Worker ports stay OS-assigned (0) so clusters on one machine never share a range.
    return [f"--{k}={v}" for k, v in ports.items()] + ["--min-worker-port=0", "--max-worker-port=0"]


# Port files the raylet waits for (ray._raylet.*_PORT_NAME) -> the `ray start` option that sets the port.
_PORT_FILES = {
    "dashboard_agent_listen_port": "dashboard-agent-listen-port",
    "metrics_agent_port": "dashboard-agent-grpc-port",
    "metrics_export_port": "metrics-export-port",
    "runtime_env_agent_port": "runtime-env-agent-port",
}


def _prefill_port_files(pgid: int, ports: Dict[str, int], timeout_s: float = 300.0) -> None:
    """Write the agents' port files for the raylet of process group ``pgid`` before the agents do.

    Ray 2.60's raylet waits a fixed ~15 s for its Python agents to write these files (even when
    the ports were given explicitly) and aborts the node otherwise; a busy 2-core machine needs
    longer to start them. We chose the ports, so we can write the same values the agents will.
    """
    from ray._raylet import persist_port

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getpgid(int(entry)) != pgid:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if not args or not args[0].endswith("/raylet"):
                continue
            opt = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
            node_id, session_dir = opt.get("node_id"), opt.get("session_dir")
            if not node_id or not session_dir:
                continue
            for name, option in _PORT_FILES.items():
                if not os.path.exists(os.path.join(session_dir, f"{name}_{node_id}")):
                    with contextlib.suppress(Exception):
                        persist_port(session_dir, node_id, name, int(ports[option]))
            return
        time.sleep(0.1)


def _reload_auth_config() -> None:
    """Ray reads RAY_AUTH_MODE and the token once per process; take the values just set (as Ray's own
    token set-up does)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_run_dir(run_dir) -> Path:
    """Absolute run dir, created private (0700: it holds the cluster's sockets, logs and auth token);
    refuses paths too long for Ray's unix sockets."""
    p = Path(run_dir).expanduser().absolute()
    if len(str(p)) + _SESSION_SUFFIX_LEN > _UNIX_PATH_MAX:
        raise ValueError(
            f"run_dir {str(p)!r} is too long ({len(str(p))} chars): Ray's unix socket paths under it would "
            f"exceed {_UNIX_PATH_MAX} bytes. Use a path of at most {_UNIX_PATH_MAX - _SESSION_SUFFIX_LEN} chars "
            f"(e.g. ./.run/ray from a short project path, or /tmp/rt_<name>)."
        )
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    return p


def _ray_bin() -> List[str]:
    # `python -m ray.scripts.scripts` is the `ray` console script, with the same interpreter as ours.
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def process_identity(pid: int) -> Optional[dict]:
    """``{"pid", "start_time", "cmdline"}`` of a live process (start time in clock ticks since boot,
    which a recycled pid cannot repeat), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return {"pid": pid, "start_time": int(fields[19]), "cmdline": [c.decode(errors="replace") for c in cmd]}


def _owner_tag(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{OWNER_ENV}=".encode()
    for e in env:
        if e.startswith(prefix):
            return e[len(prefix):].decode(errors="replace")
    return None


def _tagged_processes(tag: str) -> List[int]:
    """Live processes of this user whose environment says they belong to the node ``tag``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _owner_tag(int(entry)) == tag:
            out.append(int(entry))
    return out


def _is_leader(pid: int, tag: str, identity: Optional[dict]) -> bool:
    """Is ``pid`` still the `ray start` leader we started: same start time and command line when recorded,
    and our tag in its environment?"""
    now = process_identity(pid)
    if now is None or _owner_tag(pid) != tag:
        return False
    if identity:
        return now["start_time"] == identity.get("start_time") and now["cmdline"] == identity.get("cmdline")
    return True


def _kill_session(pid: int, tag: str, identity: Optional[dict] = None, proc: Optional[subprocess.Popen] = None,
                  timeout_s: float = 15.0) -> dict:
    """Stop one node: SIGTERM its `ray start --block` leader (it shuts its node down), then SIGKILL
    what is left of the node. Only processes proven ours are signalled: the leader by pid, start
    time, command line and tag; the rest by the tag in their environment. Returns what was done:
    ``{"leader": "stopped" | "not running" | "not ours", "killed": [pids]}``."""
    # our own child (the Popen object is the proof: its pid cannot be recycled before we reap it)
    leader_ours = (proc.poll() is None) if proc is not None else _is_leader(pid, tag, identity)
    report = {"leader": "not running" if not _pid_alive(pid) else ("stopped" if leader_ours else "not ours"),
              "killed": []}
    if leader_ours:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                break
            if proc is None and not _pid_alive(pid):
                break
            time.sleep(0.1)
    for p in _tagged_processes(tag):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
            report["killed"].append(p)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
    return report


class _NodeExited(RuntimeError):
    """A `ray start` process died before its node was up."""


@dataclass
class NodeProcess:
    """One `ray start --block` node we started."""

    pid: int
    tag: str
    log_path: str
    labels: Dict[str, str] = field(default_factory=dict)
    resources: Dict[str, float] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    identity: Optional[dict] = None  # process_identity(pid) of the leader once it runs `ray start`
    proc: Optional[subprocess.Popen] = field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        """Is the leader running (and, for a node read back from a state file, still the process we started)?"""
        if self.proc is not None:
            return self.proc.poll() is None
        return _is_leader(self.pid, self.tag, self.identity)

    def record_identity(self) -> None:
        self.identity = process_identity(self.pid)

    def stop(self) -> dict:
        return _kill_session(self.pid, self.tag, self.identity, proc=self.proc)

    def to_json(self) -> dict:
        return {"pid": self.pid, "tag": self.tag, "log_path": self.log_path, "labels": self.labels,
                "resources": self.resources, "env": self.env, "identity": self.identity}


@dataclass
class SimulatedSlice:
    """A TPU slice made of local Ray nodes, one per host, in worker-id order."""

    name: str
    spec: SliceSpec
    nodes: List[NodeProcess]


class LocalHead:
    """A Ray head on this machine (plus any extra nodes), started and stopped by us.

    ``address`` is the GCS address (``ip:port``) for ``ray.init(address=...)``;
    ``dashboard_url`` (``http://<bind>:<port>``) is what ``ray job submit --address`` and
    ``JobSubmissionClient`` take. Every process listens on ``bind`` only (loopback by default);
    ``auth`` is Ray's auth mode (:func:`resolve_auth`); clients take :meth:`client_env`.
    A run dir this object creates is private (0700) and, unless ``detach``, removed by :meth:`stop`.
    """

    def __init__(self, run_dir=DEFAULT_RUN_DIR, *, num_cpus: int = 1,
                 object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY, include_dashboard: bool = True,
                 env: Optional[Dict[str, str]] = None, detach: bool = False, bind: str = DEFAULT_BIND,
                 auth: Optional[str] = None):
        if not isinstance(num_cpus, int) or num_cpus < 0:
            raise ValueError(f"num_cpus must be a non-negative int, got {num_cpus!r}")
        if object_store_memory < 75 * 1024**2:
            raise ValueError(f"object_store_memory={object_store_memory} is below Ray's minimum of 75 MiB")
        self.bind = str(bind)
        self.auth = resolve_auth(auth)
        self._owns_run_dir = not Path(run_dir).expanduser().exists()
        self.run_dir = check_run_dir(run_dir)
        os.chmod(self.run_dir, 0o700)
        # Ray's temp dir (RAY_TMPDIR, --temp-dir): Ray makes it and its session dirs world-writable (0777) each
        # time a node or driver starts, so it sits inside the private run dir, which Ray never touches
        self.ray_dir = self.run_dir / "r"
        self.num_cpus = num_cpus
        self.object_store_memory = int(object_store_memory)
        self.include_dashboard = include_dashboard
        self.extra_env = dict(env or {})
        # Not detached: everything this object started is stopped when this process exits, even
        # if the caller never calls stop(). Detached (the CLI's `head start`): it outlives us.
        self.detach = detach
        if not detach:
            atexit.register(self.stop)
        self.address: Optional[str] = None
        self.dashboard_url: Optional[str] = None
        self.gcs_port: Optional[int] = None
        self.dashboard_port: Optional[int] = None
        self.head: Optional[NodeProcess] = None
        self.nodes: List[NodeProcess] = []
        self.slices: Dict[str, SimulatedSlice] = {}
        self.ports: Dict[str, int] = {}

    @property
    def token_path(self) -> Optional[Path]:
        return self.run_dir / TOKEN_FILE if self.auth == "token" else None

    def token(self) -> Optional[str]:
        """The cluster's auth token (None without token auth)."""
        return self.token_path.read_text().strip() if self.token_path else None

    def client_env(self) -> Dict[str, str]:
        """What a Ray client of this head needs in its environment (``RAY_AUTH_MODE``, the token's path)."""
        env = {"RAY_AUTH_MODE": self.auth}
        if self.token_path:
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        return env

    def use_auth(self) -> None:
        """Make this process a client of this head: its auth mode and token into ``os.environ``
        (Ray reads them per process, for ``ray.init`` and GCS clients alike), then reloaded."""
        os.environ["RAY_AUTH_MODE"] = self.auth
        if self.auth == "token":
            os.environ["RAY_AUTH_TOKEN"] = self.token()
        _reload_auth_config()

    def _write_token(self) -> None:
        """A fresh random token in ``<run_dir>/auth_token`` (0600). A process that is already the client of
        a token cluster (``RAY_AUTH_TOKEN`` set) reuses its token: Ray holds one token per process, and the
        heads it starts must all accept it."""
        if self.token_path is None or self.token_path.exists():
            return
        token = os.environ.get("RAY_AUTH_TOKEN") if os.environ.get("RAY_AUTH_MODE") == "token" else None
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token or secrets.token_hex(32))

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout_s: float = 180.0, attempts: int = 3) -> "LocalHead":
        """Start the head; retried when Ray gives up on its own slow-starting agents (busy machine)."""
        if self.head is not None:
            raise RuntimeError(f"LocalHead in {self.run_dir} is already started (pid {self.head.pid})")
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except _NodeExited:
                if attempt == attempts - 1:
                    raise

    def _start_once(self, timeout_s: float) -> "LocalHead":
        self._write_token()
        self.use_auth()  # we poll the GCS and the dashboard while it starts
        ports = _node_ports()
        self.gcs_port = _free_port()
        self.dashboard_port = _free_port() if self.include_dashboard else None
        addr_file = self.ray_dir / "ray_current_cluster"
        with contextlib.suppress(FileNotFoundError):
            addr_file.unlink()
        cmd = _ray_bin() + [
            "start", "--head", "--block", "--disable-usage-stats",
            f"--port={self.gcs_port}",
            f"--node-ip-address={self.bind}",
            f"--temp-dir={self.ray_dir}",
            f"--num-cpus={self.num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={self.object_store_memory}",
            f"--ray-client-server-port={_free_port()}",
            *_port_args(ports),
            f"--include-dashboard={'true' if self.include_dashboard else 'false'}",
        ]
        if self.include_dashboard:
            cmd += [f"--dashboard-host={self.bind}", f"--dashboard-port={self.dashboard_port}"]
        tag = "head-" + uuid.uuid4().hex[:8]
        env = ray_env(self.ray_dir, {**self.extra_env, **self.client_env(),
                                    "RAY_OVERRIDE_LABELS": json.dumps({NODE_TAG_LABEL: tag})})
        self.head = self._spawn(cmd, env, tag, "head.log", {NODE_TAG_LABEL: tag}, {}, ports=ports)
        self.ports = ports
        try:
            deadline = time.monotonic() + timeout_s
            while not addr_file.exists():
                self._check_started(self.head, deadline, "the head's GCS address file")
                time.sleep(0.2)
            self.address = addr_file.read_text().strip()
            self._wait_for_nodes([tag], deadline)
            if self.include_dashboard:
                self.dashboard_url = f"http://{_url_host(self.bind)}:{self.dashboard_port}"
                self._wait_for_dashboard(deadline)
            _unboost(self.head.pid)
            self.head.record_identity()
            self.write_state()  # the CLI (`head status`, `job ... --run-dir`) finds it
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> List[str]:
        """Stop every node we started (extra nodes first, then the head); only processes proven ours
        are signalled. Removes the state file, and the run dir if this object created it (not detached).
        Idempotent. Returns one line per node saying what was done."""
        done = []
        for node in list(reversed(self.nodes)) + ([self.head] if self.head is not None else []):
            r = node.stop()
            what = {"stopped": f"stopped its leader pid {node.pid}",
                    "not running": f"leader pid {node.pid} was not running",
                    "not ours": f"pid {node.pid} is now another process (left alone)"}[r["leader"]]
            extra = f"; killed {len(r['killed'])} leftover process(es) of it" if r["killed"] else ""
            done.append(f"{node.tag}: {what}{extra}")
        self.nodes = []
        self.slices = {}
        self.head = None
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / STATE_FILE).unlink()
        if self._owns_run_dir and not self.detach:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return done

    def __enter__(self) -> "LocalHead":
        if self.head is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.head is not None and self.head.alive()

    # -- nodes -----------------------------------------------------------------------------
    def add_node(self, *, num_cpus: int = 1, resources: Optional[Dict[str, float]] = None,
                 env: Optional[Dict[str, str]] = None, labels: Optional[Dict[str, str]] = None,
                 object_store_memory: Optional[int] = None, wait: bool = True,
                 timeout_s: float = 120.0, attempts: int = 3) -> NodeProcess:
        """Start one more node (a `ray start --address=<head>` process) joined to this head."""
        if self.address is None:
            raise RuntimeError("LocalHead.add_node: the head is not started")
        tag = "node-" + uuid.uuid4().hex[:8]
        ports = _node_ports()
        all_labels = {**(labels or {}), NODE_TAG_LABEL: tag}
        # Each extra node gets its own temp dir: nodes sharing one session dir also share
        # `runtime_resources`, and one node's runtime-env agent then deletes another's job
        # working_dir from under a running job.
        self._node_count = getattr(self, "_node_count", 0) + 1
        node_dir = self.run_dir / f"n{self._node_count}"
        cmd = _ray_bin() + [
            "start", f"--address={self.address}", "--block", "--disable-usage-stats",
            f"--node-ip-address={self.bind}",
            f"--temp-dir={node_dir}",
            f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--object-store-memory={int(object_store_memory or self.object_store_memory)}",
            *_port_args(ports),
        ]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        node_env = {**self.extra_env, **(env or {}), **self.client_env(),
                    "RAY_OVERRIDE_LABELS": json.dumps(all_labels)}
        for attempt in range(attempts):
            node = self._spawn(cmd, ray_env(self.ray_dir, node_env), tag, f"{tag}.log", all_labels,
                               dict(resources or {}), dict(env or {}), ports=ports)
            self.nodes.append(node)
            if not wait:
                return node
            try:
                self.wait_for_nodes([node], timeout_s)
                self.write_state()
                return node
            except _NodeExited:
                # Ray's raylet gives up when its agents start slowly (a fixed ~15 s); try again.
                self.kill_node(node)
                if attempt == attempts - 1:
                    raise
            except BaseException:
                self.kill_node(node)
                raise

    def wait_for_nodes(self, nodes: List[NodeProcess], timeout_s: float = 120.0) -> None:
        self._wait_for_nodes([n.tag for n in nodes], time.monotonic() + timeout_s, nodes)
        for n in nodes:
            _unboost(n.pid)
            n.record_identity()

    def kill_node(self, node: NodeProcess) -> None:
        """Stop one extra node (a simulated host going away)."""
        node.stop()
        if node in self.nodes:
            self.nodes.remove(node)
            if self.head is not None:
                self.write_state()

    def node_infos(self) -> List[dict]:
        """Alive nodes as dicts: node_id, address, labels, resources (straight from the GCS)."""
        return alive_nodes(self.address)

    # -- helpers ---------------------------------------------------------------------------
    def _spawn(self, cmd, env, tag, log_name, labels, resources, node_env=None, ports=None) -> NodeProcess:
        log_path = self.run_dir / log_name
        if not self.detach:
            cmd = [sys.executable, "-c", _DIE_WITH_PARENT] + list(cmd)
        env = {**env, OWNER_ENV: tag}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.run_dir))
        _boost(proc.pid)
        if ports:
            threading.Thread(target=_prefill_port_files, args=(proc.pid, ports), daemon=True,
                             name=f"ray-ports-{tag}").start()
        return NodeProcess(pid=proc.pid, tag=tag, log_path=str(log_path), labels=labels, resources=resources,
                           env=dict(node_env or {}), proc=proc)

    def _check_started(self, node: NodeProcess, deadline: float, what: str) -> None:
        if not node.alive():
            raise _NodeExited(f"Ray node {node.tag} exited before {what} was ready; log {node.log_path}:\n"
                               + _tail(node.log_path))
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray node {node.tag}: timed out waiting for {what}; log {node.log_path}:\n"
                               + _tail(node.log_path))

    def _wait_for_nodes(self, tags: List[str], deadline: float, nodes: Optional[List[NodeProcess]] = None) -> None:
        pending = set(tags)
        by_tag = {n.tag: n for n in (nodes or [])}
        if self.head is not None:
            by_tag.setdefault(self.head.tag, self.head)
        while True:
            try:
                seen = {n["labels"].get(NODE_TAG_LABEL) for n in alive_nodes(self.address, timeout_s=5)}
            except Exception:  # GCS still starting
                seen = set()
            pending -= seen
            if not pending:
                return
            for t in pending:
                if t in by_tag:
                    self._check_started(by_tag[t], deadline, "node registration")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray nodes {sorted(pending)} did not register with {self.address}")
            time.sleep(0.25)

    def _wait_for_dashboard(self, deadline: float) -> None:
        import urllib.request

        url = f"{self.dashboard_url}/api/version"
        token = self.token()
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        while True:
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            self._check_started(self.head, deadline, f"the dashboard at {self.dashboard_url}")
            time.sleep(0.3)

    # -- state file (for the CLI: start in one process, stop in another) --------------------
    def state(self) -> dict:
        return {
            "pid": self.head.pid if self.head else None,
            "address": self.address,
            "dashboard_url": self.dashboard_url,
            "run_dir": str(self.run_dir),
            "bind": self.bind,
            "auth": self.auth,
            "num_cpus": self.num_cpus,
            "object_store_memory": self.object_store_memory,
            "ports": self.ports,
            "head": self.head.to_json() if self.head else None,
            "nodes": [n.to_json() for n in self.nodes],
        }

    @classmethod
    def attach(cls, run_dir=DEFAULT_RUN_DIR) -> "LocalHead":
        """The head a previous process started in ``run_dir`` (from its state file), to query or stop it."""
        p = Path(run_dir).expanduser().absolute()
        path = p / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(f"no Ray head state in {str(p)!r} (expected {path}); start one with "
                                    f"`python -m ray_integration head start --run-dir {run_dir}`")
        try:
            st = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"the Ray head state {path} is not valid JSON ({e}); remove it") from e
        self = cls.__new__(cls)
        self.run_dir = p
        self.ray_dir = p / "r"
        self.bind = st.get("bind", DEFAULT_BIND)
        self.auth = st.get("auth", "disabled")
        self._owns_run_dir = False
        self.num_cpus = st.get("num_cpus")
        self.object_store_memory = st.get("object_store_memory")
        self.include_dashboard = st.get("dashboard_url") is not None
        self.extra_env = {}
        self.detach = True
        try:
            self.address = st["address"]
            self.dashboard_url = st.get("dashboard_url")
            self.gcs_port = int(self.address.rsplit(":", 1)[1])
            self.dashboard_port = int(self.dashboard_url.rsplit(":", 1)[1]) if self.dashboard_url else None
            self.head = NodeProcess(**st["head"]) if st.get("head") else None
            self.nodes = [NodeProcess(**n) for n in st.get("nodes", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"the Ray head state {path} is malformed ({e!r}); remove it") from e
        self.slices = {}
        self.ports = dict(st.get("ports") or {})
        return self

    def write_state(self) -> Path:
        """The state file (0600), written whole or not at all."""
        path = self.run_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.state(), indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return path


# Ray's raylet aborts if its Python agents take more than ~15 s to start (not configurable in
# 2.60), which a busy 2-core machine exceeds. While a node starts, its processes run at a
# slightly higher priority (where allowed: root); once it is up they go back to normal, and
# the workers it spawns later inherit the normal priority.
_BOOST = 5


def _boost(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) - _BOOST)


def _unboost(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, pgid, os.getpriority(os.PRIO_PROCESS, 0))


# Prefix for nodes that must not outlive the process that started them: ask the kernel to SIGTERM
# this process when its parent dies (Linux PR_SET_PDEATHSIG, kept across exec), then exec the real
# command in place. A `ray start --block` leader shuts its whole node down on SIGTERM, so a test
# process that is killed (no atexit) still takes its Ray nodes with it. (Done as an exec wrapper,
# not a preexec_fn: running Python between fork and exec in a threaded process can deadlock.)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except Exception:\n"
    "    pass\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def _tail(path, n: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def local_head(run_dir=DEFAULT_RUN_DIR, *, num_cpus: int = 1,
               object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY, include_dashboard: bool = True,
               env: Optional[Dict[str, str]] = None, timeout_s: float = 180.0, bind: str = DEFAULT_BIND,
               auth: Optional[str] = None) -> Iterator[LocalHead]:
    """Start a local Ray head for the duration of a ``with`` block; stops everything it started.

    >>> with local_head("/tmp/rt_demo", num_cpus=2) as head:
    ...     connect(head)
    """
    head = LocalHead(run_dir, num_cpus=num_cpus, object_store_memory=object_store_memory,
                     include_dashboard=include_dashboard, env=env, bind=bind, auth=auth)
    try:
        head.start(timeout_s=timeout_s)
        yield head
    finally:
        head.stop()


# -- simulated TPU slices ------------------------------------------------------------------------

def start_simulated_slice(head: LocalHead, spec: SliceSpec, name: Optional[str] = None, *,
                          num_cpus_per_host: int = 1, object_store_memory: Optional[int] = None,
                          timeout_s: float = 180.0) -> SimulatedSlice:
    """Join ``spec.num_hosts`` nodes to ``head``, each advertising one host of a TPU slice.

    Each node gets the environment a GKE TPU pod has and ``--resources '{"TPU": chips_per_host}'``;
    Ray's TPU accelerator manager derives ``TPU-<pod>-head`` (worker 0), ``<name>`` and the
    ``ray.io/tpu-*`` labels from it. The extra ``torchtpu.io/simulated-tpu`` label tells host
    actors to run JAX on its CPU backend with one XLA device per simulated chip.
    """
    if not isinstance(spec, SliceSpec):
        raise TypeError(f"start_simulated_slice: spec must be a SliceSpec, got {type(spec).__name__}")
    name = name or f"sim-{spec.pod_type}-{uuid.uuid4().hex[:6]}"
    if name in head.slices:
        raise ValueError(f"start_simulated_slice: a slice named {name!r} already exists on this head")
    node_ip = head.address.rsplit(":", 1)[0]
    hostnames = ",".join([node_ip] * spec.num_hosts)
    nodes = []
    for worker_id in range(spec.num_hosts):
        env = {
            "TPU_ACCELERATOR_TYPE": spec.pod_type,
            "TPU_TOPOLOGY": spec.topology,
            "TPU_WORKER_ID": str(worker_id),
            "TPU_NAME": name,
            "TPU_WORKER_HOSTNAMES": hostnames,
        }
        nodes.append(head.add_node(num_cpus=num_cpus_per_host, resources={"TPU": spec.chips_per_host}, env=env,
                                   labels={SIMULATED_LABEL: "true"}, object_store_memory=object_store_memory,
                                   wait=True, timeout_s=timeout_s))
    # One node at a time: raylets starting concurrently on one machine can race for ports.
    sl = SimulatedSlice(name=name, spec=spec, nodes=nodes)
    head.slices[name] = sl
    return sl


def stop_simulated_slice(head: LocalHead, sl: SimulatedSlice) -> None:
    for node in sl.nodes:
        head.kill_node(node)
    head.slices.pop(sl.name, None)
