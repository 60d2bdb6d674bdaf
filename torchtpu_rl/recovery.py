"""Learner recovery: the run's periodic checkpoints, and bringing a learner that died back.

:class:`LearnerRecovery` holds the one checkpoint policy of a driver
(:class:`~torchtpu_rl.checkpoint_policy.CheckpointPolicy`: every ``every`` steps, or
``interval_s`` after the last one; the newest ``keep`` kept) and the newest checkpoint, which is
what a dead learner restarts from. :meth:`LearnerRecovery.restart` does the actors' part of a
recovery: the calls in flight run out (a worker's receive from the dead learner fails; the
object-store update is lost with it) and are dropped, the learner is restarted by Ray (or started
again from its recipe) and the workers leave a collective group that lost its rank 0. The driver
then loads the checkpoint into it and re-syncs the workers (docs/rl.md, "Faults").
"""

from __future__ import annotations

import os
from typing import Optional

from .checkpoint_policy import CheckpointPolicy, remove_checkpoint
from .sync_controller import WeightSync
from .worker_group import LearnerClient, actor_died_errors

__all__ = ["LearnerRecovery"]


class LearnerRecovery:
    """Periodic checkpoints into ``checkpoint_dir`` (None: none; a caller that writes its own
    through ``RLDriver.save_checkpoint`` has them recorded too) and the restart of a dead learner."""

    def __init__(self, checkpoint_dir: Optional[str] = None, every: Optional[int] = None, interval_s: float = 600.0,
                 keep: int = 2):
        self.policy = CheckpointPolicy(every, interval_s, keep)
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self.last_checkpoint: Optional[str] = None  # the newest checkpoint saved or loaded
        self._own: list = []  # the periodic checkpoints written, oldest first

    def saved(self, path: str) -> None:
        """A checkpoint was written (or loaded) at ``path`` now."""
        self.last_checkpoint = path
        self.policy.saved()

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is written now, after ``step`` steps (always before the first)."""
        return self.checkpoint_dir is not None and (self.last_checkpoint is None or self.policy.due(step))

    def save_periodic(self, driver) -> None:
        """``driver.save_checkpoint`` into ``checkpoint_dir`` (the reference policy once beside), the oldest pruned."""
        path = os.path.join(self.checkpoint_dir, f"step_{driver.step_idx:08d}.pt")
        driver.save_checkpoint(path, os.path.join(self.checkpoint_dir, "reference.pt"))
        if path in self._own:
            self._own.remove(path)
        self._own.append(path)
        for old in self.policy.stale(self._own):
            self._own.remove(old)
            remove_checkpoint(old)

    def restart(self, learner: LearnerClient, sync: WeightSync, in_flight: list, *, died_at: int, sharded: bool,
                timeout_s: float, events: list, error: BaseException) -> dict:
        """The actors' part of a recovery (see the module doc); returns the restarted learner's status."""
        import ray

        events.append({"event": "learner_died", "step": died_at, "error": str(error)})
        if sharded:
            raise RuntimeError(f"RLDriver: a process of the sharded learner died at step {died_at}; restarting a "
                               f"sharded learner is not supported (restart the run with resume)") from error
        if self.last_checkpoint is None:
            raise RuntimeError(f"RLDriver: the learner died at step {died_at} and there is no checkpoint to restart "
                               f"it from (give checkpoint_dir, or save_checkpoint first)") from error
        calls = sync.drop() + list(in_flight)
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        try:
            status, replaced = learner.revive()
        except actor_died_errors() as e:
            raise RuntimeError(f"RLDriver: the learner died at step {died_at} and could not be restarted") from e
        if replaced:
            events.append({"event": "learner_replaced", "step": died_at})
        sync.teardown_workers()
        return status
