"""Worker groups: the actors of one kind, started from one recipe, called through declared dispatch.

A worker class declares per method how a call on the whole group fans out and gathers
(:func:`dispatch`, verl's ``register(dispatch_mode=...)`` in spirit):

- :data:`ONE_TO_ALL`: the same arguments to every actor; one answer per actor, in actor order
  (a weight update, a collective setup, status);
- :data:`ROUND_ROBIN`: a list of requests, request ``r`` to actor ``r % n``; each answer keyed by
  its request (rollout generation: the requests are whole prompt groups, ``protocol.split_groups``).

``ordered=True`` marks a method whose calls must run on the actor in the order they were sent
(generation and weight installs on a threaded rollout worker; every call of a sharded learner
rank): the group numbers them per actor (:class:`CallOrder`) and the actor runs them by number
(:class:`InOrder`) -- the one call-ordering mechanism of the RL wing.

:class:`WorkerGroup` owns the actors and the recipe to replace one that is out of restarts,
counts the control messages it sends (``messages``), and collects answers, re-submitting a call
whose actor died once the actor is back (:meth:`WorkerGroup.collect`, :meth:`WorkerGroup.scatter`): the
rollout workers and the reward actors are such groups. :class:`LearnerClient`
is the learner's side of the same: one actor (or a sharded ``LearnerGroup``), its death raised
as :class:`~torchtpu_rl.protocol.LearnerDied`.

Ray is imported inside the functions that talk to actors: the worker classes import this module
for :func:`dispatch` and :class:`InOrder` in processes that never start Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Sequence

from .protocol import LearnerDied, LearnerRestarted, WorkerNotReady

__all__ = [
    "CallOrder",
    "InOrder",
    "LearnerClient",
    "ONE_TO_ALL",
    "ROUND_ROBIN",
    "WorkerGroup",
    "actor_died_errors",
    "call_restartable",
    "dispatch",
    "wait_for_actor",
]

ONE_TO_ALL = "one_to_all"
ROUND_ROBIN = "round_robin"
DISPATCH_MODES = (ONE_TO_ALL, ROUND_ROBIN)


@dataclasses.dataclass(frozen=True)
class Dispatch:
    mode: str
    ordered: bool = False  # the group passes ``seq=`` (its call number on the actor)


def dispatch(mode: str, *, ordered: bool = False) -> Callable:
    """Declare how a call of this worker method on a :class:`WorkerGroup` fans out (see the module doc)."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch: mode must be one of {DISPATCH_MODES}, not {mode!r}")

    def mark(fn):
        fn.__rl_dispatch__ = Dispatch(mode, ordered)
        return fn

    return mark


def declared(cls: type, method: str) -> Dispatch:
    """The :class:`Dispatch` that ``cls.method`` declares (a method without one is no group call)."""
    d = getattr(getattr(cls, method, None), "__rl_dispatch__", None)
    if d is None:
        raise AttributeError(f"{cls.__name__}.{method} declares no dispatch mode (torchtpu_rl.worker_group.dispatch)")
    return d


# ------------------------------------------------------------------ call order
class CallOrder:
    """The sending side: the next call number per actor (thread-safe)."""

    def __init__(self, n: int = 0):
        self._next = [0] * n
        self._lock = threading.Lock()

    def take(self, i: int = 0) -> int:
        with self._lock:
            while len(self._next) <= i:
                self._next.append(0)
            s = self._next[i]
            self._next[i] += 1
            return s

    def peek(self, i: int = 0) -> int:
        """The number the next call to actor ``i`` will take (none is taken)."""
        with self._lock:
            return self._next[i] if i < len(self._next) else 0


class InOrder:
    """The receiving side: calls on a threaded actor run one at a time in the order of their numbers.
    ``first=None``: the first number this process sees is where it starts (a restarted process
    joins mid-stream); a call without a number only takes the lock."""

    def __init__(self, first: Optional[int] = None, lock: Optional[threading.Lock] = None):
        self._next = first
        self._cond = threading.Condition()
        self.lock = lock if lock is not None else threading.Lock()

    @contextlib.contextmanager
    def turn(self, seq: Optional[int]):
        if seq is None:
            with self.lock:
                yield
            return
        with self._cond:
            if self._next is None:
                self._next = seq
            while self._next != seq:
                self._cond.wait()
        try:
            with self.lock:
                yield
        finally:
            with self._cond:
                self._next = seq + 1
                self._cond.notify_all()

    def expect(self, seq: Optional[int]) -> None:
        """The next numbered call is ``seq``: an unnumbered call sent while none is in flight (a sync-mode
        install) anchors the order of a process that has not seen a number yet (restarted, or new:
        otherwise the first of two calls sent together could be overtaken by the second and wait for ever)."""
        if seq is None:
            return
        with self._cond:
            if self._next is None or self._next < seq:
                self._next = int(seq)
                self._cond.notify_all()

    def skip(self, seq: Optional[int]) -> None:
        """Give up call number ``seq`` (it failed before its turn's work), so later calls do not wait for it."""
        if seq is not None:
            with self.turn(seq):
                pass


# ------------------------------------------------------------------ actor deaths
def actor_died_errors() -> tuple:
    """The exceptions Ray raises for a call to an actor that died or is restarting."""
    import ray.exceptions as rex

    return tuple(getattr(rex, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
                 if hasattr(rex, n))


def wait_for_actor(actor, timeout_s: float = 120.0) -> dict:
    """Block until ``actor`` (restarting after a death) answers ``status()``; returns it. Raises
    the last actor error when it does not come back within ``timeout_s`` (out of restarts)."""
    import ray
    import ray.exceptions as rex

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.status.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except actor_died_errors() as e:
            if isinstance(e, getattr(rex, "ActorUnavailableError", ())) and time.monotonic() < deadline:
                time.sleep(0.1)  # restarting
                continue
            raise


def call_restartable(actor, method: str, *args, timeout_s: float = 120.0, on_death: Optional[Callable] = None):
    """``ray.get(actor.<method>.remote(*args))``, called again once the actor is back when it died
    during the call (for stateless calls: a reward actor's ``score``)."""
    import ray

    while True:
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except actor_died_errors() as e:
            if on_death is not None:
                on_death(e)
            wait_for_actor(actor, timeout_s)


# ------------------------------------------------------------------ the group
class WorkerGroup:
    """``actors`` of class ``cls``; ``recipe = (args, kwargs_of(i), options)`` starts actor ``i`` again
    when Ray is out of restarts for it. ``messages`` counts the control calls sent."""

    def __init__(self, cls: type, actors: list, recipe: tuple = (), recovery_timeout_s: float = 120.0):
        self.cls = cls
        self.actors = actors
        self.recipe = recipe
        self.recovery_timeout_s = float(recovery_timeout_s)
        self.order = CallOrder(len(actors))
        self.messages = 0
        self.replaced = 0  # actors started again from the recipe

    @classmethod
    def start(cls, worker_cls: type, n: int, args: tuple, options: dict, kwargs_of: Callable = lambda i: {},
              recovery_timeout_s: float = 120.0) -> "WorkerGroup":
        import ray

        actors = [ray.remote(worker_cls).options(**options).remote(*args, **kwargs_of(i)) for i in range(n)]
        return cls(worker_cls, actors, (args, kwargs_of, options), recovery_timeout_s)

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, i: int):
        return self.actors[i]

    def __iter__(self):
        return iter(self.actors)

    # ------------------------------------------------------------ calls
    def submit(self, i: int, method: str, *args):
        """One call on actor ``i`` (numbered when the method is ordered); returns its ObjectRef."""
        kw = {"seq": self.order.take(i)} if declared(self.cls, method).ordered else {}
        self.messages += 1
        return getattr(self.actors[i], method).remote(*args, **kw)

    def call(self, method: str, *args, indices: Optional[Sequence[int]] = None) -> list:
        """A :data:`ONE_TO_ALL` method on every actor (or ``indices``): ``[(i, ObjectRef)]`` in actor order."""
        if declared(self.cls, method).mode != ONE_TO_ALL:
            raise ValueError(f"{self.cls.__name__}.{method} is not a one-to-all call")
        return [(i, self.submit(i, method, *args)) for i in (range(len(self)) if indices is None else indices)]

    def map(self, method: str, requests: Sequence) -> dict:
        """A :data:`ROUND_ROBIN` method: request ``r`` to actor ``r % n``; ``{ObjectRef: (request, actor)}``."""
        if declared(self.cls, method).mode != ROUND_ROBIN:
            raise ValueError(f"{self.cls.__name__}.{method} is not a round-robin call")
        return {self.submit(r % len(self), method, req): (req, r % len(self)) for r, req in enumerate(requests)}

    def collect(self, method: str, pending: dict, results: dict, key: Callable, on_death: Callable) -> None:
        """Gather ``pending`` (``{ObjectRef: (request, actor)}``, emptied) into ``results[key(request)]``.
        A call whose actor died (or came back restarted, without its state: ``WorkerNotReady``) is
        handed to ``on_death(actor, request, error)`` -- which makes the actor usable again -- and
        submitted to it once more."""
        import ray

        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            req, i = pending.pop(ready[0])
            try:
                results[key(req)] = ray.get(ready[0])
                continue
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, WorkerNotReady):  # restarted before we noticed: same recovery
                    raise
                error = e
            except actor_died_errors() as e:
                error = e
            on_death(i, req, error)
            pending[self.submit(i, method, req)] = (req, i)

    def scatter(self, method: str, requests: Sequence, key: Callable, on_death: Callable) -> list:
        """A :data:`ROUND_ROBIN` call gathered: the answers in request order (:meth:`map` then
        :meth:`collect`, a request whose actor died run again on it once it is back)."""
        results: dict = {}
        self.collect(method, self.map(method, requests), results, key, on_death)
        return [results[key(r)] for r in requests]

    # ------------------------------------------------------------ restarts
    def revive(self, i: int) -> tuple:
        """Wait for Ray to restart actor ``i``, or start a new one from the recipe when it is out of
        restarts. Returns ``(status, replaced)``."""
        import ray

        try:
            return wait_for_actor(self.actors[i], self.recovery_timeout_s), False
        except actor_died_errors():
            if not self.recipe:
                raise
            args, kwargs_of, options = self.recipe
            self.actors[i] = ray.remote(self.cls).options(**options).remote(*args, **kwargs_of(i))
            self.replaced += 1
            return wait_for_actor(self.actors[i], self.recovery_timeout_s), True

    def kill(self, i: int) -> None:
        """Kill actor ``i`` so that Ray restarts it (a member stuck in a broken sync)."""
        import ray

        ray.kill(self.actors[i], no_restart=False)


class LearnerClient:
    """The driver's side of the learner: one ``LearnerWorker`` actor, or a sharded ``LearnerGroup``
    called like one. A call that finds the learner dead, or restarted by Ray without its state,
    raises :class:`~torchtpu_rl.protocol.LearnerDied`."""

    def __init__(self, actor: Any, recipe: tuple = (), recovery_timeout_s: float = 120.0):
        self.actor = actor
        self.recipe = recipe  # (cls, args, kwargs, options): a new actor when Ray is out of restarts
        self.recovery_timeout_s = float(recovery_timeout_s)
        self.messages = 0

    @property
    def world_size(self) -> int:
        """Processes of the learner (a sharded ``LearnerGroup`` has several)."""
        return getattr(self.actor, "world_size", 1)

    def submit(self, method: str, *args):
        self.messages += 1
        return getattr(self.actor, method).remote(*args)

    def call(self, method: str, *args):
        """``ray.get`` of one learner call."""
        import ray

        try:
            return ray.get(self.submit(method, *args))
        except actor_died_errors() as e:
            raise LearnerDied(f"the learner died during {method}") from e
        except ray.exceptions.RayTaskError as e:
            if restarted(e):  # it died while idle and Ray restarted it before this call
                raise LearnerDied(f"the learner was restarted before {method}") from e
            raise

    def revive(self) -> tuple:
        """Wait for Ray to restart the learner (or start a new one from the recipe). ``(status, replaced)``."""
        import ray

        try:
            return wait_for_actor(self.actor, self.recovery_timeout_s), False
        except actor_died_errors():
            if not self.recipe:
                raise
            cls, args, kwargs, options = self.recipe
            self.actor = ray.remote(cls).options(**options).remote(*args, **kwargs)
            return wait_for_actor(self.actor, self.recovery_timeout_s), True

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=False)


def restarted(e: BaseException) -> bool:
    """Did a learner call fail because Ray had restarted the learner (its state is gone)?"""
    return isinstance(getattr(e, "cause", None), LearnerRestarted)
