"""The weight-sync controller: learner group -> rollout group, and bringing dead workers back.

How a sync reaches the workers (docs/rl.md, "Weight sync"):

- ``object_store`` with ``learner_fan_out`` (the driver's sync mode): one control call for the
  whole rollout group, ``publish_to(workers)`` on the learner, which publishes and starts every
  worker's ``update_weights`` itself; the driver waits for the installs through the references it
  returns. No generation is in flight or queued during such a sync, so the installs need no place
  in the workers' call order (a learner that dies midway leaves no gap in it); each install tells
  its worker the number of the driver's next call to it, which anchors the order of a worker
  process that has not seen a number yet (``InOrder.expect``);
- ``object_store`` otherwise (async mode, where an update must land between two numbered
  generations, and a sharded learner): ``publish_weights`` on the learner, then
  ``update_weights(update)`` on every worker with the publish call's ObjectRef as the argument:
  Ray hands the update to the workers straight from the learner, the driver never relays it (it
  reads the handle's timings only when the sync is finished);
- ``collective``: ``broadcast_weights`` on the learner beside ``receive_weights`` on every worker
  (a group built once with ``collective_setup``, rebuilt when a member dies).

A member that dies during a sync is noticed through Ray's actor-death notification; a member
left blocked by a broken collective group is killed ``sync_abort_s`` after the first failure
(never the group's own timeout). Dead workers are revived by their :class:`WorkerGroup` and
re-synced; a learner that died raises :class:`~torchtpu_rl.protocol.LearnerDied` for the driver's
recovery.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from . import weight_sync as ws
from .protocol import LearnerDied
from .worker_group import LearnerClient, WorkerGroup, actor_died_errors, restarted

__all__ = ["WeightSync"]

LEARNER = "learner"  # the learner's key among a sync's members (workers are keyed by index)


def _sync_id() -> int:
    """A number for each object-store sync, increasing over every driver of this host (the workers
    refuse an install older than one they have: ``RolloutWorker._install``)."""
    return time.monotonic_ns()


def _lost_errors() -> tuple:
    """Ray's errors for an object lost with its owner (an update's buckets, or the answer of an install
    the learner started, when the learner died)."""
    import ray.exceptions as rex

    return tuple(getattr(rex, n) for n in ("ObjectLostError", "OwnerDiedError", "ObjectFetchTimedOutError")
                 if hasattr(rex, n))


def _sync_failure(e) -> bool:
    """Did a sync call fail because the sync itself broke (a member left the collective group, the
    update's objects were lost with their owner), rather than a bug?"""
    lost = _lost_errors()
    return isinstance(e, lost) or isinstance(getattr(e, "cause", None), (ws.SyncAborted, *lost))


class WeightSync:
    """Weight syncs from ``learner`` to the rollout ``workers`` (see the module doc). ``events``: the
    run's event list (faults and recoveries are appended); ``step_of()``: the step to tag them with."""

    def __init__(self, learner: LearnerClient, workers: WorkerGroup, *, transport: str = "object_store",
                 collective_backend: Optional[str] = None, sync_abort_s: float = 10.0,
                 events: Optional[list] = None, step_of: Callable[[], int] = lambda: -1,
                 learner_fan_out: bool = False):
        if transport not in ws.TRANSPORTS:
            raise ValueError(f"transport must be one of {ws.TRANSPORTS}, not {transport!r}")
        self.learner = learner
        self.workers = workers
        self.transport = transport
        self.backend = collective_backend or ws.DEFAULT_COLLECTIVE_BACKEND
        self.sync_abort_s = float(sync_abort_s)
        self.events = events if events is not None else []
        self.step_of = step_of
        # the learner starts the workers' installs (one call for the group); not a sharded learner's
        self.learner_fan_out = bool(learner_fan_out) and transport == "object_store" and learner.world_size == 1
        self._fanned_out = False  # the sync in flight was started by publish_to
        self.worker_version = -1  # the version installed on every worker
        self.version = -1  # the version of the latest sync started
        self.last_update = None  # ObjectRef of the latest published update: a restarted worker is re-synced from it
        self.last_sync: dict = {}
        self._refs: list = []  # (member, ObjectRef) of the sync in flight
        self._started = 0.0
        self._group_ready = False

    @property
    def in_flight(self) -> bool:
        return bool(self._refs)

    @property
    def fanned_out(self) -> bool:
        """A sync started by the learner's ``publish_to`` is in flight."""
        return bool(self._refs) and self._fanned_out

    # ------------------------------------------------------------ one sync
    def start(self, version: int) -> None:
        """Send the learner's weights (at ``version``) to every worker; :meth:`finish` waits for it."""
        if self._refs:
            self.finish()
        self._started = time.perf_counter()
        self.version = int(version)
        self._fanned_out = self.learner_fan_out
        if self._fanned_out:
            nxt = [self.workers.order.peek(i) for i in range(len(self.workers))]
            self._refs = [(LEARNER, self.learner.submit("publish_to", list(self.workers.actors), _sync_id(), nxt))]
        elif self.transport == "object_store":
            self.last_update = self.learner.submit("publish_weights")
            self._refs = [(LEARNER, self.last_update)] + self.workers.call("update_weights", self.last_update,
                                                                            _sync_id())
        else:
            self._refs = self._broadcast()

    def _broadcast(self) -> list:
        if not self._group_ready:
            self._setup_group()
        return [(LEARNER, self.learner.submit("broadcast_weights"))] + self.workers.call("receive_weights")

    def finish(self) -> dict:
        """Wait for the sync in flight; dead or stuck workers are revived and re-synced. Returns its figures."""
        refs, self._refs = self._refs, []
        infos, failed = self._wait(refs)
        if self._fanned_out and LEARNER in infos:  # then the installs the learner started
            self.last_update = infos[LEARNER]["update"]  # (the small handle: a re-sync hands it on)
            more, failed = self._wait(list(enumerate(infos[LEARNER]["installs"])))
            infos = {**more, LEARNER: self.last_update}
        if failed:
            self.events.append({"event": "sync_failed", "step": self.step_of(), "version": self.version,
                                "members": {str(k): v for k, v in failed.items()},
                                "seconds": time.perf_counter() - self._started})
            if LEARNER in failed and (failed[LEARNER] != "aborted" or self.transport == "object_store"):
                # (object store: the update's objects are gone with their owner, the learner)
                self.last_update = None
                raise LearnerDied(f"the learner {failed[LEARNER]} during the weight sync")
            if self.transport == "object_store" and any(v == "aborted" for v in failed.values()):
                self.learner.call("status")  # raises LearnerDied when the update was lost with it
            if self.transport == "collective":
                self._group_ready = False
            self.resync([k for k in failed if k != LEARNER] or list(range(len(self.workers))))
        self.worker_version = self.version
        worker_infos = [v for k, v in infos.items() if k != LEARNER]
        sender = infos.get(LEARNER)
        sender = (sender.timings if isinstance(sender, ws.WeightUpdate) else sender) or {}
        self.last_sync = {"sync_s": time.perf_counter() - self._started, "version": self.version,
                          "bytes": worker_infos[0]["bytes"] if worker_infos else sender.get("bytes"),
                          "max_paused_s": max((i.get("paused_s", 0.0) for i in worker_infos), default=0.0)}
        # the four phases: the sender's, and the slowest worker's
        for k in ("pack_s", "publish_s", "prefault_s", "cast_max_abs_error", "cast_rel_error"):
            if k in sender:
                self.last_sync[k] = sender[k]
        for k in ("fetch_s", "install_s"):
            if worker_infos:
                self.last_sync[k] = max(i.get(k, 0.0) for i in worker_infos)
        return self.last_sync

    def drop(self) -> list:
        """Forget the sync in flight (the learner died): returns its refs, for the caller to let run out."""
        refs, self._refs = [r for _, r in self._refs], []
        self.last_update = None
        return refs

    # ------------------------------------------------------------ waiting
    def _wait(self, refs: list) -> tuple:
        """Wait for a sync's calls ``[(member, ref)]``. Returns ``(infos, failed)``: the results by
        member and ``{member: why}`` for those that died ("died"), left a broken collective group
        ("aborted"; the object-store update lost with a dead learner counts too) or were still
        blocked ``sync_abort_s`` after the first failure ("stuck": killed here, restarted by Ray)."""
        import ray

        pending = {ref: who for who, ref in refs}
        infos, failed, deadline = {}, {}, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not done:
                for who in pending.values():
                    failed[who] = "stuck"
                    self.learner.kill() if who == LEARNER else self.workers.kill(who)
                break
            who = pending.pop(done[0])
            try:
                infos[who] = ray.get(done[0])
                continue
            except actor_died_errors():
                failed[who] = "died"
            except _lost_errors():  # an install the learner started, the learner gone since
                failed[who] = "aborted"
            except ray.exceptions.RayTaskError as e:
                if restarted(e):  # the learner lost its state (a worker: the update it was handed failed so)
                    failed[who] = "died" if who == LEARNER else "aborted"
                elif _sync_failure(e):
                    failed[who] = "aborted"
                else:
                    raise
            if deadline is None:
                deadline = time.monotonic() + self.sync_abort_s
        return infos, failed

    # ------------------------------------------------------------ the collective group
    def _setup_group(self) -> None:
        world = 1 + len(self.workers)
        for _ in range(3):
            init = self.learner.call("free_port")
            refs = [(LEARNER, self.learner.submit("collective_setup", init, world, self.backend))]
            refs += self.workers.call("collective_setup", init, world, self.backend)
            _, failed = self._wait(refs)
            if not failed:
                self._group_ready = True
                return
            if LEARNER in failed:
                raise LearnerDied(f"the learner {failed[LEARNER]} while the sync group was built")
            for i in failed:  # a worker died while joining: again with its restarted process
                self.revive(i)
        raise RuntimeError("could not build the weight-sync group (members kept dying)")

    def teardown_workers(self) -> None:
        """The workers leave the collective group (it lost its rank 0)."""
        import ray

        self._group_ready = False
        if self.transport == "collective":
            ray.get([r for _, r in self.workers.call("collective_teardown")])

    # ------------------------------------------------------------ faults
    def revive(self, i: int) -> dict:
        """Wait for Ray to restart worker ``i`` (or a replacement from the group's recipe); its status."""
        status, replaced = self.workers.revive(i)
        if replaced:
            self.events.append({"event": "worker_replaced", "worker": i, "step": self.step_of()})
            self._group_ready = False
        return status

    def ensure(self, i: int, *_) -> None:
        """Make worker ``i`` usable at the current weights (restarted and re-synced if it died); the
        rollout group's ``on_death`` for a generate call."""
        status = self.revive(i)
        if status["version"] == self.version and (
                self.transport == "object_store" or (self._group_ready and status["group"])):
            return
        self.resync([i], statuses={i: status})

    def resync(self, indices: list, statuses: Optional[dict] = None) -> None:
        """Bring workers ``indices`` (some may have died) back to the current weights. With the
        collective transport the group is rebuilt for everyone and the weights broadcast again."""
        import ray

        t0 = time.perf_counter()
        statuses = dict(statuses or {})
        for i in indices:
            if i not in statuses:
                statuses[i] = self.revive(i)
            if statuses[i]["version"] < 0:  # a new process (an aborted survivor keeps its weights)
                self.events.append({"event": "worker_restarted", "worker": i, "pid": statuses[i]["pid"],
                                    "step": self.step_of()})
        for _ in range(3):
            if self.transport == "object_store":
                if self.last_update is None:
                    break
                refs = self.workers.call("update_weights", self.last_update, _sync_id(), indices=indices)
            else:
                self._group_ready = False
                self.learner.call("collective_teardown")
                ray.get([r for _, r in self.workers.call("collective_teardown")])
                refs = self._broadcast()
            _, failed = self._wait(refs)
            if not failed:
                break
            if LEARNER in failed and failed[LEARNER] != "aborted":
                raise LearnerDied(f"the learner {failed[LEARNER]} while re-syncing workers")
            indices = sorted(k for k in failed if k != LEARNER) or indices
            for i in indices:
                self.revive(i)
        else:
            raise RuntimeError(f"could not re-sync rollout workers {indices} to version {self.version}")
        for i in indices:
            self.events.append({"event": "worker_resynced", "worker": i, "seconds": time.perf_counter() - t0,
                                "version": self.version})
