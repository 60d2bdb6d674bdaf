"""When to checkpoint a run and which checkpoints to keep: one policy for the driver's periodic
checkpoints (``RLDriver(checkpoint_dir=...)``) and the entry point's ``checkpoints/step_N``
(``python -m torchtpu_rl.train``). What a checkpoint holds is :mod:`torchtpu_rl.checkpoint`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from typing import Optional

__all__ = ["CheckpointPolicy", "remove_checkpoint"]

SHARDS_SUFFIX = ".shards"  # a sharded learner's DCP shards beside its file (checkpoint.SHARDS_SUFFIX)


class CheckpointPolicy:
    """Checkpoint every ``every`` steps, or (``every`` None) when ``interval_s`` seconds passed since the
    last one; keep the newest ``keep``."""

    def __init__(self, every: Optional[int] = None, interval_s: float = 600.0, keep: int = 2):
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"CheckpointPolicy: every must be a positive int or None, not {every!r}")
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"CheckpointPolicy: interval_s must be a finite number of seconds > 0, not {interval_s!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"CheckpointPolicy: keep must be a positive int, not {keep!r}")
        self.every = every
        self.interval_s = float(interval_s)
        self.keep = keep
        self._last = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the step that just ended (``step`` steps done) is checkpointed."""
        if self.every:
            return step % self.every == 0
        return time.monotonic() - self._last >= self.interval_s

    def saved(self) -> None:
        """A checkpoint was written (or loaded) now: the interval counts from here."""
        self._last = time.monotonic()

    def stale(self, paths: list) -> list:
        """Of ``paths`` (oldest first), the ones beyond the newest ``keep``."""
        return list(paths[:-self.keep]) if len(paths) > self.keep else []


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint: a directory (``step_N/``), or a file with a sharded learner's shards beside it."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    shutil.rmtree(path + SHARDS_SUFFIX, ignore_errors=True)
