"""Checkpoint and resume of an RL run: the learner plus the driver's position.

One file holds everything a run needs to continue *exactly*:

- the learner's ``state_dict()`` (policy, reference policy, value model, optimizer
  state, policy version: whatever :class:`~torchtpu_rl.learner.Learner` keeps),
- the learner process's RNG streams (torch's CPU generator and torchtpu's key state),
- the driver's state (data cursor, step, per-request seed base, rollouts already
  generated but not yet trained on in asynchronous mode).

Everything is moved to host tensors and plain Python values before saving, so
``torch.load(..., weights_only=True)`` reads it back (with numpy arrays allowed: the
learner's numpy RNG state is one).

Files (:func:`atomic_save`): written private (0600, in directories made 0700) to a temporary name
beside the target, fsync'd, renamed over the target, and the directory fsync'd: a crash at any
point leaves either the previous complete checkpoint or the new one, never a torn one. The
temporary file is removed when the write fails, and one left by a killed writer is removed by
the next save of that path. A sharded learner's DCP shards go to a new directory each save; the
checkpoint file that names them is switched last, then the old shards are removed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
import uuid
from typing import Optional

import torch

__all__ = ["FORMAT", "atomic_save", "load_checkpoint", "load_sharded_checkpoint", "read_checkpoint", "save_checkpoint",
           "save_sharded_checkpoint", "to_host"]

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


def _pid_of_tmp(name: str) -> Optional[int]:
    # ".<base>.tmp.<pid>.<random>"
    parts = name.rsplit(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _remove_torn(path: str) -> None:
    """Temporary files of ``path`` left by writers that are gone (killed mid-save)."""
    d, base = os.path.split(path)
    for tmp in glob.glob(os.path.join(glob.escape(d or "."), f".{glob.escape(base)}.tmp.*")):
        pid = _pid_of_tmp(os.path.basename(tmp))
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its writer is alive (another process saving the same path)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync_dir(d: str) -> None:
    fd = os.open(d or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj, path) -> str:
    """``torch.save(obj)`` to ``path`` whole or not at all: 0600 temporary file beside it, fsync, rename,
    fsync of the directory (made 0700 if missing). The temporary file never outlives a failed write."""
    path = os.fspath(path)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, mode=0o700, exist_ok=True)
    _remove_torn(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp.{os.getpid()}.", dir=d or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(d)
    return path


def _rng_state() -> dict:
    return {"torch_cpu": torch.get_rng_state(), "tpu": torch.tpu.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    torch.tpu.set_rng_state(state["tpu"])


def save_checkpoint(path: str, learner, driver_state: Optional[dict] = None,
                    reference_path: Optional[str] = None) -> str:
    """Write ``learner`` (model, optimizer, version), this process's RNG and ``driver_state``.

    ``reference_path``: the frozen reference policy goes there once (written when that file is missing),
    and the checkpoint holds its digest and where it is, instead of another copy of its weights."""
    import torchtpu

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: path must be a str or PathLike, not {type(path).__name__}")
    torchtpu.synchronize()
    ref = reference_path is not None and getattr(learner, "ref_policy", None) is not None
    state = {
        "format": FORMAT,
        "learner": to_host(learner.state_dict(include_reference=False) if ref else learner.state_dict()),
        "policy_version": int(learner.policy_version),
        "rng": _rng_state(),
        "driver": to_host(driver_state) if driver_state is not None else None,
        "saved_at": time.time(),
    }
    path = os.fspath(path)
    if ref:
        reference_path = os.fspath(reference_path)
        if not _reference_matches(reference_path, learner.reference_digest()):
            _save_reference(reference_path, learner)
        state["reference"] = os.path.relpath(os.path.abspath(reference_path), os.path.dirname(os.path.abspath(path)))
    return atomic_save(state, path)


REFERENCE_FORMAT = "torchtpu_rl.reference/1"


def _reference_matches(path: str, digest: str) -> bool:
    if not os.path.isfile(path):
        return False
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("digest") == digest
    except Exception:  # noqa: BLE001 - an unreadable file is written again
        return False


def _save_reference(path: str, learner) -> None:
    atomic_save({"format": REFERENCE_FORMAT, "digest": learner.reference_digest(),
                 "ref_policy": to_host(learner.ref_policy.state_dict())}, path)


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
    if "shards" in state["learner"]:
        raise ValueError(f"checkpoint {os.fspath(path)!r} was saved by a sharded learner "
                         f"({state['learner']['world_size']} processes); load it with learner_processes > 1")
    digest = state["learner"].get("ref_policy_digest")
    if (state.get("reference") and "ref_policy" not in state["learner"]
            and getattr(learner, "ref_policy", None) is not None and learner.reference_digest() != digest):
        # this learner's reference is not the run's (e.g. built from other weights): load the stored one
        ref_path = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), state["reference"])
        if not os.path.isfile(ref_path):
            raise FileNotFoundError(f"checkpoint {os.fspath(path)!r}: its reference policy file {ref_path!r} is "
                                    "missing")
        ref = torch.load(ref_path, map_location="cpu", weights_only=True)
        learner.load_reference(ref["ref_policy"], digest)
    learner.load_state_dict(state["learner"])
    if int(learner.policy_version) != state["policy_version"]:
        raise RuntimeError(f"checkpoint {path!r}: the learner reports policy_version {learner.policy_version} "
                           f"after loading, the checkpoint says {state['policy_version']}")
    _set_rng_state(state["rng"])
    return state["driver"]


# ------------------------------------------------------------ a sharded learner (FSDP2, N ranks)
SHARDS_SUFFIX = ".shards"


def _all_ranks(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_sharded_checkpoint(path: str, learner, driver_state: Optional[dict] = None) -> str:
    """A sharded learner's checkpoint (every rank calls it): the policy's and optimizer's shards with
    ``torch.distributed.checkpoint`` into ``<path>.shards/``, and at ``path`` (rank 0; the format of
    :func:`save_checkpoint`) what is not sharded: the reference policy, the version, every rank's RNG
    streams, the driver's state."""
    import random

    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import torchtpu

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: path must be a str or PathLike, not {type(path).__name__}")
    path = os.fspath(path)
    torchtpu.synchronize()
    model_sd, optim_sd = get_state_dict(learner.policy, learner.optimizer)
    # a new shard directory each save (rank 0 names it): the checkpoint that names the old one stays complete
    # until the file at `path` is switched to the new one
    # (under `<path>.shards/`, one directory per save, so removing `<path>.shards` removes every generation)
    gen = f"v{int(learner.policy_version)}-{uuid.uuid4().hex[:8]}"
    shards = _all_ranks(f"{os.path.basename(path)}{SHARDS_SUFFIX}/{gen}")[0]
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, mode=0o700, exist_ok=True)
    dcp.save({"policy": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(d, shards))
    rng = _all_ranks({**_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()})
    if dist.get_rank() == 0:
        state = {
            "format": FORMAT,
            "learner": {"algo": learner.algo, "param_dtype": str(learner.param_dtype).replace("torch.", ""),
                        "policy_version": int(learner.policy_version), "world_size": dist.get_world_size(),
                        "shards": shards, "learner_rng": learner.generator.get_state(),
                        "ref_policy": (to_host(learner.ref_policy.state_dict())
                                       if learner.ref_policy is not None else None)},
            "policy_version": int(learner.policy_version),
            "rng": rng,
            "driver": to_host(driver_state) if driver_state is not None else None,
            "saved_at": time.time(),
        }
        old = None
        if os.path.exists(path):
            with contextlib.suppress(Exception):  # an unreadable old checkpoint: nothing to clean
                old = read_checkpoint(path)["learner"].get("shards")
        atomic_save(state, path)
        if old and old != shards:
            old_dir = os.path.join(d, old)
            if shards.startswith(old + "/"):  # an old-layout checkpoint: its shard files sit beside the new dir
                for f in os.listdir(old_dir):
                    if os.path.isfile(os.path.join(old_dir, f)):
                        os.unlink(os.path.join(old_dir, f))
            else:
                shutil.rmtree(old_dir, ignore_errors=True)
    dist.barrier()  # the file exists for every rank when this returns
    return path


def load_sharded_checkpoint(path: str, learner) -> Optional[dict]:
    """Restore a sharded learner (every rank calls it) from :func:`save_sharded_checkpoint`'s files;
    returns the driver state. The shards load at any number of learner processes (DCP reshards)."""
    import random

    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = read_checkpoint(path)
    meta = state["learner"]
    if "shards" not in meta:
        raise ValueError(f"checkpoint {os.fspath(path)!r} was saved by a single learner; a sharded learner "
                         f"loads checkpoints of sharded learners")
    if meta["algo"] != learner.algo or meta["param_dtype"] != str(learner.param_dtype).replace("torch.", ""):
        raise ValueError(f"checkpoint {os.fspath(path)!r} is for {meta['algo']} / {meta['param_dtype']}, this learner "
                         f"is {learner.algo} / {learner.param_dtype}")
    model_sd, optim_sd = get_state_dict(learner.policy, learner.optimizer)
    sd = {"policy": model_sd, "optimizer": optim_sd}
    dcp.load(sd, checkpoint_id=os.path.join(os.path.dirname(os.fspath(path)), meta["shards"]))
    set_state_dict(learner.policy, learner.optimizer, model_state_dict=sd["policy"], optim_state_dict=sd["optimizer"])
    if learner.ref_policy is not None and meta["ref_policy"] is not None:
        with torch.no_grad():
            learner.ref_policy.load_state_dict(meta["ref_policy"])
    rank = dist.get_rank()
    rng = state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0]
    _set_rng_state(rng)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    learner.generator.set_state(meta["learner_rng"])
    learner.policy_version = int(meta["policy_version"])
    return state["driver"]
