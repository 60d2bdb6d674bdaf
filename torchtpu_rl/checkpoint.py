"""Checkpoint and resume of an RL run: the learner plus the driver's position.

One file holds everything a run needs to continue *exactly*:

- the learner's ``state_dict()`` (policy, reference policy, value model, optimizer
  state, policy version: whatever :class:`~torchtpu_rl.learner.Learner` keeps),
- the learner process's RNG streams (torch's CPU generator and torchtpu's key state),
- the driver's state (data cursor, step, per-request seed base, rollouts already
  generated but not yet trained on in asynchronous mode).

Everything is moved to host tensors and plain Python values before saving, so
``torch.load(..., weights_only=True)`` reads it back (with numpy arrays allowed: the
learner's numpy RNG state is one). The file is written to a
temporary name and renamed, so a crash while saving never leaves a torn
checkpoint under the real name.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

__all__ = ["FORMAT", "load_checkpoint", "read_checkpoint", "save_checkpoint", "to_host"]

FORMAT = "torchtpu_rl.checkpoint/1"


def to_host(obj):
    """``obj`` with every tensor moved to the CPU (containers rebuilt; other values kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_host(v) for v in obj)
    return obj


def _rng_state() -> dict:
    return {"torch_cpu": torch.get_rng_state(), "tpu": torch.tpu.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    torch.tpu.set_rng_state(state["tpu"])


def save_checkpoint(path: str, learner, driver_state: Optional[dict] = None) -> str:
    """Write ``learner`` (model, optimizer, version), this process's RNG and ``driver_state``."""
    import torchtpu

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: path must be a str or PathLike, not {type(path).__name__}")
    torchtpu.synchronize()
    state = {
        "format": FORMAT,
        "learner": to_host(learner.state_dict()),
        "policy_version": int(learner.policy_version),
        "rng": _rng_state(),
        "driver": to_host(driver_state) if driver_state is not None else None,
        "saved_at": time.time(),
    }
    path = os.fspath(path)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: str) -> dict:
    """The checkpoint's contents (host tensors), checked for format."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    import numpy as np

    # the learner's RNG state includes numpy's (an ndarray): allow exactly those types
    safe = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(safe):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a torchtpu_rl checkpoint (format "
                         f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}, "
                         f"expected {FORMAT!r})")
    return state


def load_checkpoint(path: str, learner) -> Optional[dict]:
    """Restore ``learner`` and this process's RNG from ``path``; returns the driver state."""
    state = read_checkpoint(path)
    learner.load_state_dict(state["learner"])
    if int(learner.policy_version) != state["policy_version"]:
        raise RuntimeError(f"checkpoint {path!r}: the learner reports policy_version {learner.policy_version} "
                           f"after loading, the checkpoint says {state['policy_version']}")
    _set_rng_state(state["rng"])
    return state["driver"]
