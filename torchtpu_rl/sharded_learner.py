"""A sharded learner: N learner processes, one FSDP2 policy, driven as one learner.

``make_topology(..., learner_processes=N)`` starts the learner as a ray_integration
:class:`~ray_integration.TPUHostGroup` on a slice of N hosts (whole-slice placement; the
hosts form one ``tpu`` process group before the learner is built). Each rank builds the
same policy from ``policy_fn`` and wraps it with FSDP2 ``fully_shard`` (each block, then the
root; bf16 compute with f32 gradient reduction when ``param_dtype`` is bfloat16), and AdamW
steps on its shards (``Learner(fsdp=True)``).

The driver talks to a :class:`LearnerGroup` as it talks to one learner actor:
``group.<method>.remote(*args)`` returns one ObjectRef, rank 0's answer, ready once every
rank has run the call. Dispatch is declared per method (:data:`SPLIT_BATCH`):
``train_step`` gets the batch split by whole GRPO groups, rank ``r`` taking the ``r``-th
contiguous share (group statistics stay within a rank); every other call goes to every rank
with the same arguments. Each rank runs the calls in the order the driver made them, so the
ranks' collectives always line up.

Weight sync: every rank takes part in gathering the whole weights (``get_model_state_dict``
with ``full_state_dict=True``); rank 0 alone publishes them through the object store, under
the same versions and with the same checksums as a single learner.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from . import checkpoint as _ckpt
from . import weight_sync as ws
from .worker_group import CallOrder, InOrder
from .workers import LearnerWorker

__all__ = ["LearnerGroup", "ShardedLearnerWorker", "SPLIT_BATCH", "split_batch", "start_learner_group"]

# the calls whose first two arguments (batch state, rewards) are split across the ranks
SPLIT_BATCH = frozenset({"train_step"})


class ShardedLearnerWorker(LearnerWorker):
    """One rank of a sharded learner, built inside a ``TPUHostGroup`` host actor (the ``tpu``
    process group is already up)."""

    def __init__(self, policy_fn: Callable[[], torch.nn.Module], algo: str = "grpo",
                 learner_kwargs: Optional[dict] = None, seed: int = 0,
                 bucket_bytes: int = ws.DEFAULT_BUCKET_BYTES, device: str = "tpu",
                 sync_dtype: Optional[torch.dtype] = None, lora=None):
        import torch.distributed as dist

        if lora is not None:
            raise ValueError("a sharded learner (learner_processes > 1) does not train LoRA adapters yet")
        super().__init__(policy_fn, algo, {**(learner_kwargs or {}), "fsdp": True}, seed, bucket_bytes, device,
                         sync_dtype)
        self.policy_fn = policy_fn
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._order = InOrder(first=0)

    # ------------------------------------------------------------ call order
    def ordered(self, seq: int, method: str, args: tuple, peer_calls: Optional[list] = None):
        """Run call number ``seq`` once the calls before it have run (host actors are threaded, and
        every rank must enter the same collectives in the same order). Rank 0 then waits for the
        other ranks' share of the call (``peer_calls``), so its answer stands for the whole group
        and a rank's error is raised here."""
        import ray

        with self._order.turn(seq):
            out = getattr(self, method)(*args)
            if peer_calls:
                ray.get(peer_calls)
            return out

    def status(self) -> dict:
        return {**super().status(), "rank": self.rank, "world_size": self.world_size}

    # ------------------------------------------------------------ weights
    def _weights(self) -> dict:
        return self.learner.policy_state_dict()  # every rank gathers; rank 0 holds the result

    def publish_weights(self) -> Optional[ws.WeightUpdate]:
        weights = self._weights()
        return self.sender.publish(weights, self.policy_version) if self.rank == 0 else None

    def checksums(self) -> Optional[dict]:
        weights = self._weights()
        return ws.tensor_checksums(weights) if self.rank == 0 else None

    def collective_setup(self, *args) -> int:
        # the weight-sync group would replace this process's default group, which FSDP2 uses
        raise ValueError("a sharded learner syncs weights through the object store only "
                         "(transport='object_store'), not a collective group")

    def save_hf(self, out_dir: str, tokenizer=None) -> Optional[str]:
        """The whole policy as a Hugging Face directory, written by rank 0."""
        from . import hf

        weights = self._weights()
        if self.rank != 0:
            return None
        model = self.policy_fn()
        model.load_state_dict(weights)
        return hf.save_hf(model, tokenizer, out_dir)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, driver_state: Optional[dict] = None) -> str:
        return _ckpt.save_sharded_checkpoint(path, self.learner, driver_state)

    def load_checkpoint(self, path: str) -> Optional[dict]:
        return _ckpt.load_sharded_checkpoint(path, self.learner)


def split_batch(batch_state: dict, rewards, world_size: int, group_size: int) -> list:
    """``(batch_state, rewards)`` of each rank: contiguous shares of whole groups of ``group_size``
    rows, the same number of groups on every rank (FSDP2's collectives need every rank to run the
    same steps)."""
    rewards = list(rewards)
    B = len(rewards)
    if B % group_size or (B // group_size) % world_size:
        raise ValueError(f"sharded learner: a batch of {B} rows ({B / group_size:g} groups of {group_size}) does not "
                         f"split into whole groups over {world_size} learner processes; make the prompts per step "
                         f"a multiple of {world_size}")
    share = B // world_size
    out = []
    for r in range(world_size):
        rows = slice(r * share, (r + 1) * share)
        part = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B else v)
                for k, v in batch_state.items()}
        out.append((part, rewards[rows]))
    return out


class _Method:
    def __init__(self, group: "LearnerGroup", name: str):
        self._group, self._name = group, name

    def remote(self, *args):
        return self._group.call(self._name, *args)


class LearnerGroup:
    """The ranks of a sharded learner, driven as one learner actor (see the module doc).

    ``group.train_step.remote(batch_state, rewards)`` and every other ``LearnerWorker`` method
    return one ObjectRef (rank 0's answer). ``host_group`` is the ray_integration group."""

    def __init__(self, host_group, group_size: int):
        self.host_group = host_group
        self.group_size = int(group_size)
        self._order = CallOrder(1)
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return self.host_group.world_size

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def call(self, method: str, *args) -> Any:
        actors = self.host_group.actors
        W = len(actors)
        per_rank = (split_batch(args[0], args[1], W, self.group_size) if method in SPLIT_BATCH
                    else [args] * W)
        per_rank = [tuple(p) + tuple(args[2:]) if method in SPLIT_BATCH else p for p in per_rank]
        with self._lock:  # call numbers in the order the calls are sent
            seq = self._order.take()
            peers = [a.call.remote("ordered", (seq, method, per_rank[r]), {}) for r, a in enumerate(actors) if r]
            return actors[0].call.remote("ordered", (seq, method, per_rank[0], peers), {})

    def shutdown(self) -> None:
        self.host_group.shutdown()


def start_learner_group(policy_fn, learner_kwargs: dict, kwargs: dict, processes: int, slice=None,
                        env_vars: Optional[dict] = None, timeout_s: float = 300.0) -> LearnerGroup:
    """Start ``processes`` learner ranks with ``TPUHostGroup`` on a slice of that many hosts
    (``slice``: an accelerator type, SliceSpec or SliceReservation; default: the cluster's first
    slice type with ``processes`` hosts)."""
    from ray_integration import TPUHostGroup, discover_slices

    group_size = (learner_kwargs or {}).get("group_size")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"make_topology: a sharded learner runs GRPO and needs learner_kwargs['group_size'] >= 2, "
                         f"not {group_size!r}")
    if slice is None:
        slices = discover_slices()
        fits = sorted(s.spec.pod_type for s in slices.values() if s.complete and s.spec.num_hosts == processes)
        if not fits:
            have = ", ".join(f"{n} ({s.spec.pod_type}, {s.spec.num_hosts} hosts)" for n, s in sorted(slices.items()))
            raise ValueError(f"make_topology: learner_processes={processes} needs a TPU slice of {processes} hosts "
                             f"(one learner process per host, placed with TPUHostGroup); the Ray cluster has "
                             f"{have or 'no TPU slices'}")
        slice = fits[0]
    hosts = TPUHostGroup(ShardedLearnerWorker, slice, args=(policy_fn,), kwargs={**kwargs,
                         "learner_kwargs": learner_kwargs}, devices_per_host=1, env_vars=env_vars,
                         timeout_s=timeout_s)
    if hosts.world_size != processes:
        hosts.shutdown()
        raise ValueError(f"make_topology: learner_processes={processes}, but slice {hosts.slice_name} has "
                         f"{hosts.world_size} hosts")
    return LearnerGroup(hosts, group_size)
