"""Per-step metrics of an example as it runs: one JSON line per step appended to ``<out>/metrics.jsonl``
(flushed, so a crashed or running job can be read) and the same numbers as TensorBoard scalars in
``<out>/tb`` (``tensorboard --logdir <out>/tb``)."""

from __future__ import annotations

import json
import os
import time


class StepLog:
    def __init__(self, out: str):
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "metrics.jsonl")
        if os.path.exists(self.path):  # a fresh run: no rows of an earlier run in this directory
            os.remove(self.path)
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(os.path.join(out, "tb"))

    def append(self, step: int, values: dict) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: v for k, v in values.items() if isinstance(v, (int, float, str, bool)) or v is None})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()
