"""TPUHostGroup: one actor per host of a reserved slice, joined in one torch.distributed group.

Each host actor runs in its slice bundle (bundle ``i`` = ``TPU_WORKER_ID`` ``i`` = rank ``i``;
rank 0, on the slice's head host, is the coordinator), with the host's TPU environment set in its
``runtime_env`` before anything imports JAX. It imports torchtpu, joins the process group, then
builds the user's object (``actor_cls(*args, **kwargs)``), so the user's ``__init__`` already sees
``torch.distributed`` initialized. ``current_host()`` inside the actor gives rank, world size,
worker id, slice name and the collective device.

On simulated hosts (``torchtpu.io/simulated-tpu`` label) JAX runs on its CPU backend with one
XLA device per simulated chip (``--xla_force_host_platform_device_count``) unless told otherwise.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

from .discovery import SliceSpec
from .placement import SliceReservation, reserve_slices, slice_of

# The process-group backend host groups use. "tpu" is torchtpu's distributed backend
# (torchtpu/distributed.py); until that module exists this falls back to "gloo" (CPU tensors).
# Override with TORCHTPU_RAY_BACKEND=gloo|tpu.
BACKEND_ENV = "TORCHTPU_RAY_BACKEND"


def default_backend() -> str:
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        return forced
    import importlib.util

    return "tpu" if importlib.util.find_spec("torchtpu.distributed") is not None else "gloo"


class HostFailure(RuntimeError):
    """A host actor died or did not answer; ``ranks`` says which."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message)
        self.ranks = list(ranks)


@dataclass(frozen=True)
class HostContext:
    """What a host actor knows about its place in the group (``current_host()``)."""

    rank: int
    world_size: int
    worker_id: int
    slice_name: str
    pod_type: str
    backend: str
    generation: int  # bumped each time the group is rebuilt

    @property
    def device(self) -> str:
        """Device for collective tensors: ``tpu`` with the tpu backend, ``cpu`` with gloo."""
        return "tpu" if self.backend == "tpu" else "cpu"


_CURRENT: Optional[HostContext] = None


def current_host() -> HostContext:
    """Inside a host actor: this host's :class:`HostContext`."""
    if _CURRENT is None:
        raise RuntimeError("current_host() is only available inside a TPUHostGroup host actor")
    return _CURRENT


@dataclass
class HostStatus:
    rank: int
    worker_id: int
    alive: bool
    error: Optional[str] = None
    pid: Optional[int] = None


class _HostActor:
    """The Ray actor on one host; wraps the user's object."""

    def __init__(self):
        self._obj = None
        self._user_cls = None

    def ping(self) -> dict:
        return {"pid": os.getpid(), "worker_id": int(os.environ.get("TPU_WORKER_ID", "-1"))}

    def coordinator_address(self):
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return ip, port

    def _join(self, addr, rank: int, world: int, backend: str, generation: int, timeout_s: float) -> None:
        global _CURRENT
        import torch.distributed as dist

        import torchtpu  # noqa: F401  (registers the tpu device, and the tpu backend when present)

        if backend == "tpu":
            import torchtpu.distributed  # noqa: F401
        if dist.is_initialized():
            dist.destroy_process_group()
        ip, port = addr
        os.environ.update(MASTER_ADDR=ip, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK="0")
        from torchtpu.distributed.store import init_process_group_bound

        # the group's store listens on this node's address only (a plain tcp:// init method: every interface)
        init_process_group_bound(backend, f"tcp://{ip}:{port}", world, rank, timedelta(seconds=timeout_s))
        _CURRENT = HostContext(rank=rank, world_size=world, worker_id=int(os.environ["TPU_WORKER_ID"]),
                               slice_name=os.environ.get("TPU_NAME", ""),
                               pod_type=os.environ.get("TPU_ACCELERATOR_TYPE", ""), backend=backend,
                               generation=generation)

    def setup(self, user_cls, args, kwargs, addr, rank, world, backend, generation, timeout_s):
        self._join(addr, rank, world, backend, generation, timeout_s)
        self._user_cls = user_cls
        self._obj = user_cls(*args, **(kwargs or {}))
        return self.ping()

    def rejoin(self, addr, rank, world, backend, generation, timeout_s):
        """Survivor of a host failure: rebuild the process group, keep the user's object."""
        self._join(addr, rank, world, backend, generation, timeout_s)
        hook = getattr(self._obj, "on_group_rebuilt", None)
        if callable(hook):
            hook()
        return self.ping()

    def call(self, method: str, args, kwargs):
        fn = getattr(self._obj, method, None)
        if not callable(fn):
            raise AttributeError(f"{type(self._obj).__name__} has no method {method!r}")
        return fn(*args, **(kwargs or {}))

    def apply(self, fn, args, kwargs):
        return fn(self._obj, *args, **(kwargs or {}))

    def info(self) -> dict:
        import jax

        return {"pid": os.getpid(), "rank": _CURRENT.rank if _CURRENT else None,
                "env": {k: os.environ.get(k) for k in ("TPU_WORKER_ID", "TPU_NAME", "TPU_ACCELERATOR_TYPE",
                                                      "TPU_TOPOLOGY", "TPU_WORKER_HOSTNAMES")},
                "jax_devices": len(jax.local_devices()), "jax_platform": jax.default_backend()}

    def shutdown(self):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TPUHostGroup:
    """Run ``actor_cls`` on every host of one TPU slice, as one process group.

    >>> group = TPUHostGroup(MyHost, "v4-16", args=(cfg,))      # reserves a slice, starts 2 hosts
    >>> group.run("train_step", batch)                          # -> [result of rank 0, rank 1]
    >>> group.health_check(); group.recover()                   # restart dead hosts, rebuild the group
    >>> group.shutdown()

    Args:
        actor_cls: a plain class (not ``@ray.remote``); built on each host after the group is up.
        slice: a ``SliceReservation`` (use ``slice_index``) or a SliceSpec / accelerator type to
            reserve one slice now (released by ``shutdown``).
        devices_per_host: XLA devices JAX sees on each host (simulated hosts default to one per chip).
        backend: process-group backend; default ``default_backend()`` ("tpu", or "gloo" until it exists).
        env_vars / runtime_env: extra runtime_env for the host actors.
    """

    def __init__(self, actor_cls: type, slice, *, args: tuple = (), kwargs: Optional[dict] = None,
                 slice_index: int = 0, devices_per_host: Optional[int] = None, backend: Optional[str] = None,
                 env_vars: Optional[Dict[str, str]] = None, runtime_env: Optional[dict] = None,
                 timeout_s: float = 180.0, placement_timeout_s: float = 60.0):
        import ray

        if not isinstance(actor_cls, type):
            raise TypeError(f"TPUHostGroup: actor_cls must be a plain class, got {actor_cls!r} "
                            "(pass the class itself, not a @ray.remote actor or an instance)")
        if devices_per_host is not None and (not isinstance(devices_per_host, int) or devices_per_host < 1):
            raise ValueError(f"TPUHostGroup: devices_per_host must be a positive int, got {devices_per_host!r}")
        self._owns_reservation = not isinstance(slice, SliceReservation)
        if self._owns_reservation:
            slice = reserve_slices(slice if isinstance(slice, (SliceSpec, str)) else _bad_slice(slice),
                                   1, timeout_s=placement_timeout_s)
        self.reservation: SliceReservation = slice
        self.slice_index = slice_index
        self.spec: SliceSpec = slice.spec
        self.pg = slice.placement_group(slice_index)
        self.slice_name = slice.slice_names[slice_index]
        self.actor_cls = actor_cls
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.backend = backend or default_backend()
        self.devices_per_host = devices_per_host
        self.extra_env = dict(env_vars or {})
        self.runtime_env = dict(runtime_env or {})
        self.timeout_s = timeout_s
        self.generation = 0
        self.restarts = 0
        info = slice_of(slice, slice_index)
        self.simulated = info.simulated
        self._hostnames = ",".join(info.nodes[i]["address"] or "" for i in sorted(info.nodes))
        self._remote_cls = ray.remote(_HostActor)
        self._abandoned: List[Any] = []
        self._actors: List[Any] = [None] * self.spec.num_hosts
        try:
            for rank in range(self.spec.num_hosts):
                self._actors[rank] = self._make_actor(rank)
            self._form_group(new_ranks=list(range(self.spec.num_hosts)))
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        return self.spec.num_hosts

    @property
    def actors(self) -> List[Any]:
        """The Ray actor handles, in rank order (advanced use: direct ``.call.remote``)."""
        return list(self._actors)

    # -- actors -------------------------------------------------------------------------------
    def _host_env(self, rank: int) -> Dict[str, str]:
        env = {
            "TPU_WORKER_ID": str(rank),
            "TPU_NAME": self.slice_name,
            "TPU_ACCELERATOR_TYPE": self.spec.pod_type,
            "TPU_TOPOLOGY": self.spec.topology,
            "TPU_WORKER_HOSTNAMES": self._hostnames,
        }
        devices = self.devices_per_host or (self.spec.chips_per_host if self.simulated else None)
        if self.simulated:
            env["JAX_PLATFORMS"] = "cpu"
        if devices is not None:
            # ${XLA_FLAGS} keeps the node's own flags (Ray expands it from the worker's environment).
            env["XLA_FLAGS"] = f"${{XLA_FLAGS}} --xla_force_host_platform_device_count={devices}"
        env.update(self.extra_env)
        return env

    def _make_actor(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        renv = dict(self.runtime_env)
        renv["env_vars"] = {**renv.get("env_vars", {}), **self._host_env(rank)}
        return self._remote_cls.options(
            num_cpus=0, resources={"TPU": self.spec.chips_per_host}, max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=False),
            runtime_env=renv, name=None,
        ).remote()

    def _form_group(self, new_ranks: List[int]) -> None:
        self.generation += 1
        world = self.world_size
        addr = tuple(self._get(self._actors[0].coordinator_address.remote(), [0], "coordinator address"))
        refs, ranks = [], []
        for rank, a in enumerate(self._actors):
            if rank in new_ranks:
                refs.append(a.setup.remote(self.actor_cls, self.args, self.kwargs, addr, rank, world,
                                           self.backend, self.generation, self.timeout_s))
            else:
                refs.append(a.rejoin.remote(addr, rank, world, self.backend, self.generation, self.timeout_s))
            ranks.append(rank)
        self._gather(refs, ranks, "forming the process group")

    def _get(self, ref, ranks, what):
        return self._gather([ref], ranks, what)[0]

    def _gather(self, refs, ranks, what, timeout_s: Optional[float] = None):
        """ray.get in rank order, but fail fast: the first dead host raises HostFailure at once
        (its peers may be blocked in a collective waiting for it)."""
        import ray
        from ray.exceptions import RayActorError

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        rank_of = {r.hex(): rank for r, rank in zip(refs, ranks)}
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left))
            if not ready:
                late = sorted(rank_of[r.hex()] for r in pending)
                raise HostFailure(f"hosts {late} of slice {self.slice_name}: no answer within {timeout_s}s "
                                  f"while {what}", late)
            try:
                ray.get(ready[0])
            except RayActorError as e:
                rank = rank_of[ready[0].hex()]
                self._abandoned.extend(pending)  # peers' calls fail later; collected in recover()
                raise HostFailure(f"host {rank} of slice {self.slice_name} died while {what}: "
                                  f"{str(e).splitlines()[0]}", [rank]) from e
        return ray.get(refs)

    # -- user-facing --------------------------------------------------------------------------
    def run(self, method: str, *args, timeout_s: Optional[float] = None, **kwargs) -> List[Any]:
        """Call ``method(*args, **kwargs)`` on every host's object; results in rank order."""
        refs = [a.call.remote(method, args, kwargs) for a in self._actors]
        return self._gather(refs, list(range(self.world_size)), f"running {method!r}", timeout_s)

    def run_each(self, method: str, per_host_args: Sequence[tuple], timeout_s: Optional[float] = None) -> List[Any]:
        """Like ``run`` with one argument tuple per host (rank order)."""
        if len(per_host_args) != self.world_size:
            raise ValueError(f"run_each: got {len(per_host_args)} argument tuples for {self.world_size} hosts")
        refs = [a.call.remote(method, tuple(x), {}) for a, x in zip(self._actors, per_host_args)]
        return self._gather(refs, list(range(self.world_size)), f"running {method!r}", timeout_s)

    def apply(self, fn: Callable, *args, timeout_s: Optional[float] = None, **kwargs) -> List[Any]:
        """Run ``fn(obj, *args, **kwargs)`` on every host (``obj`` = that host's user object)."""
        refs = [a.apply.remote(fn, args, kwargs) for a in self._actors]
        return self._gather(refs, list(range(self.world_size)), f"applying {getattr(fn, '__name__', fn)}",
                            timeout_s)

    def host_info(self) -> List[dict]:
        """Per host: pid, rank, TPU env, JAX device count and platform."""
        return self._gather([a.info.remote() for a in self._actors], list(range(self.world_size)), "host info")

    def health_check(self, timeout_s: float = 10.0) -> List[HostStatus]:
        """Ping every host actor; a host that is dead or silent for ``timeout_s`` is not alive."""
        import ray

        refs = [a.ping.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                out.append(HostStatus(rank, rank, False, f"no reply within {timeout_s}s"))
                continue
            try:
                r = ray.get(ref)
                out.append(HostStatus(rank, rank, True, None, r["pid"]))
            except Exception as e:  # RayActorError and friends: the actor is gone
                out.append(HostStatus(rank, rank, False, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
        return out

    def recover(self, timeout_s: Optional[float] = None) -> List[int]:
        """Restart dead hosts in their bundles and rebuild the process group; returns restarted ranks."""
        import ray

        dead = [s.rank for s in self.health_check() if not s.alive]
        if not dead:
            return []
        for rank in dead:
            try:
                ray.kill(self._actors[rank], no_restart=True)
            except Exception:
                pass
        # Survivors' calls that were waiting on the dead host end with an error: consume them.
        if self._abandoned:
            ray.wait(self._abandoned, num_returns=len(self._abandoned), timeout=10)
            for ref in self._abandoned:
                try:
                    ray.get(ref, timeout=0)
                except Exception:
                    pass
            self._abandoned = []
        # If the host's node went away, Ray re-places the bundle once a matching node is back.
        left = self.timeout_s if timeout_s is None else timeout_s
        ready, _ = ray.wait([self.pg.ready()], timeout=left)
        if not ready:
            raise HostFailure(f"slice {self.slice_name}: bundles of hosts {dead} were not re-placed within "
                              f"{left}s (is the host's node gone?)", dead)
        for rank in dead:
            self._actors[rank] = self._make_actor(rank)
        self._form_group(new_ranks=dead)
        self.restarts += len(dead)
        return dead

    def shutdown(self) -> None:
        """Stop the host actors (and release the slice if this group reserved it). Idempotent."""
        import ray

        actors = [a for a in getattr(self, "_actors", []) if a is not None]
        if actors:
            try:
                ray.wait([a.shutdown.remote() for a in actors], num_returns=len(actors), timeout=10)
            except Exception:
                pass
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
        self._actors = [None] * len(getattr(self, "_actors", []))
        if getattr(self, "_owns_reservation", False) and getattr(self, "reservation", None) is not None:
            self.reservation.release()
            self.reservation = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _bad_slice(x):
    raise TypeError(f"TPUHostGroup: slice must be a SliceReservation, SliceSpec or accelerator type string, "
                    f"got {type(x).__name__}")
