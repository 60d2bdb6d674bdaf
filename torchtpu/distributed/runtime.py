"""JAX's multi-process runtime under ``init_process_group("tpu")``.

The default group's creation (whatever launched the processes: torchrun, torch.multiprocessing,
Ray actors) also calls ``jax.distributed.initialize`` with the group's rank and size, on a
coordinator address rank 0 publishes through the group's own store. Every process then sees the
global device list, and a collective on tpu tensors is one XLA program over the participating
processes' devices (``xla.py``). On CPU hosts JAX's CPU collectives run over gloo
(``jax_cpu_collectives_implementation``); on TPU hosts XLA uses ICI/DCN.

JAX must be configured before its backend starts: ``import torchtpu`` leaves it unstarted, so the
group can still do it. If any process cannot join (it ran JAX work before ``init_process_group``, or
it is in an earlier group's runtime of another shape, as after a Ray host group re-forms around a
replaced host), every rank of the group warns and stages collectives through host memory instead
(the ``host`` transport), as does ``TORCHTPU_DIST_TRANSPORT=host``.

``TORCHTPU_JAX_COORDINATOR=host:port`` overrides the coordinator address (default: the store's
host, or ``MASTER_ADDR``, and a free port of rank 0). The coordinator listens on that host only
(``coordinator_bind_address``; JAX's own default is every interface).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import time
import warnings

import jax
from jax._src import xla_bridge

_COORDINATOR_KEY = "torchtpu/jax_coordinator"
_READY_KEY = "torchtpu/jax_ready"

_state = {"active": False, "world": None, "rank": None, "address": None, "devices": None}


def xla_transport_active() -> bool:
    """Do collectives on tpu tensors run as XLA programs across the processes (vs host staging)?"""
    return _state["active"]


def rank_devices(global_ranks) -> list:
    """The JAX device of each of ``global_ranks`` (one per process: its first local device)."""
    devices = _state["devices"]
    return [devices[r] for r in global_ranks]


def _store_host(store) -> str | None:
    """The host of the TCPStore under ``store`` (where every rank already reaches rank 0)."""
    while store is not None:
        host = getattr(store, "host", None)
        if host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _wait_for_keys(store, keys, rank: int, world: int, timeout_s: float, what: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        address = os.environ.get("TORCHTPU_JAX_COORDINATOR") or "to be published by rank 0"
        raise RuntimeError(
            f"torchtpu distributed: JAX's multi-process runtime did not start (process {rank} of {world}, "
            f"coordinator {address}): waited {timeout_s:.0f} s for {what} ({e})") from e


def _coordinator(store, rank: int, world: int, timeout_s: float) -> str:
    """Rank 0 picks the coordinator address and publishes it in the group's store; the others read it."""
    if os.environ.get("TORCHTPU_JAX_COORDINATOR"):
        return os.environ["TORCHTPU_JAX_COORDINATOR"]
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or _store_host(store) or "127.0.0.1"
        if host == "localhost":
            host = "127.0.0.1"
        address = f"{host}:{_free_port(host)}"
        store.set(_COORDINATOR_KEY, address)
        return address
    _wait_for_keys(store, [_COORDINATOR_KEY], rank, world, timeout_s, "rank 0 to publish the coordinator address")
    return store.get(_COORDINATOR_KEY).decode()


def _wait_for_coordinator(address: str, rank: int, world: int, timeout_s: float) -> None:
    """Until the coordinator accepts connections; else a clear error. JAX aborts the whole process when
    it cannot reach its coordinator, so an unreachable address must be caught before JAX tries."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"torchtpu distributed: JAX's multi-process runtime did not start (process {rank} of {world}, "
                    f"coordinator {address}): nothing accepted a connection there within {timeout_s:.0f} s "
                    f"({e})") from e
            time.sleep(0.1)


def _readiness(rank: int, world: int) -> str:
    """This process's state for a group of ``world``: "fresh" (JAX untouched: can start the runtime),
    "same" (the runtime is up as process ``rank`` of ``world``), or why it can do neither."""
    if jax.distributed.is_initialized():
        if jax.process_count() == world and jax.process_index() == rank:
            return "same"
        return (f"JAX's multi-process runtime of this process is process {jax.process_index()} of "
                f"{jax.process_count()} (an earlier group), not {rank} of {world}")
    if xla_bridge.backends_are_initialized():
        return "JAX already ran work in this process before init_process_group(\"tpu\") (a tpu tensor made first?)"
    return "fresh"


def start(store, rank: int, world: int, timeout_s: float) -> bool:
    """Bring up JAX's multi-process runtime for the default group (``rank`` of ``world``).

    The ranks first agree through the group's store: the runtime starts only if every process can
    join it (or all are already in one of this shape, a group made again); otherwise every rank
    stages collectives through host memory, with a warning. Returns whether the XLA transport is on.
    A start-up failure raises, naming the coordinator."""
    _state.update(active=False, world=world, rank=rank)
    if os.environ.get("TORCHTPU_DIST_TRANSPORT", "xla") == "host":
        return False
    if world == 1:
        _state.update(devices=[jax.local_devices()[0]], active=True)
        return True
    mine = _readiness(rank, world)
    store.set(f"{_READY_KEY}/{rank}", mine)
    keys = [f"{_READY_KEY}/{r}" for r in range(world)]
    _wait_for_keys(store, keys, rank, world, timeout_s, "every rank to report")
    states = [store.get(k).decode() for k in keys]
    if len(set(states)) != 1 or states[0] not in ("fresh", "same"):
        why = next((f"rank {r}: {s_}" for r, s_ in enumerate(states) if s_ not in ("fresh", "same")),
                   "some processes are in an earlier group's JAX runtime, others are new")
        warnings.warn(
            f"torchtpu distributed: JAX's multi-process runtime cannot serve this group ({why}): collectives "
            "on tpu tensors are staged through host memory. Create the process group before any tpu work "
            "in a fresh process for XLA collectives.", RuntimeWarning, stacklevel=4)
        return False
    if states[0] == "fresh":
        address = _coordinator(store, rank, world, timeout_s)
        if rank != 0:
            _wait_for_coordinator(address, rank, world, timeout_s)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # a dead peer must not abort the survivors (at exit, or on a missed heartbeat): the group's
        # collectives raise instead
        jax.config.update("jax_enable_recoverability", True)
        try:
            # the coordinator (rank 0) listens on the group's address, not every interface
            jax.distributed.initialize(address, world, rank, initialization_timeout=max(1, int(timeout_s)),
                                       coordinator_bind_address=address if rank == 0 else None)
        except Exception as e:
            raise RuntimeError(
                f"torchtpu distributed: JAX's multi-process runtime did not start (process {rank} of {world}, "
                f"coordinator {address}): {e}") from e
        _state["address"] = address
        atexit.register(_leave, store, rank, world, min(timeout_s, 60.0))
    first = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    _state["devices"] = [first[r] for r in range(world)]
    _state["active"] = True
    return True


_EXITED_KEY = "torchtpu/jax_exited"


def _leave(store, rank: int, world: int, timeout_s: float) -> None:
    """At exit: the other processes leave JAX's runtime before rank 0, whose process hosts the
    coordinator. With recoverability on (a dead peer must not abort the survivors) JAX's own
    shutdown barrier no longer waits for them, and a process whose coordinator is gone is aborted.
    The group's store (served from rank 0) counts who has left; a dead peer costs rank 0 the wait."""
    if not jax.distributed.is_initialized():
        return
    try:
        if rank != 0:
            jax.distributed.shutdown()
            store.add(_EXITED_KEY, 1)
            return
        deadline = time.monotonic() + timeout_s
        while store.add(_EXITED_KEY, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001, S110 - the store (rank 0) is gone or a peer died: leave anyway
        pass


def coordinator_address() -> str | None:
    """The address JAX's multi-process runtime was started on (None in one process or host staging)."""
    return _state["address"]
