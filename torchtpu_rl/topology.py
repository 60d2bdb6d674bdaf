"""An RL run's actors together: :func:`make_topology` starts the learner (one actor, or a
sharded learner group), the rollout workers and an optional reward actor on the connected Ray
cluster and returns their handles as a :class:`Topology`.

Every actor is created with ``max_restarts`` (see :mod:`torchtpu_rl.workers` for what a restart
means for each); ``num_cpus=0``: the host's chips, not its CPU slots, are the scarce resource, as
ray_integration's slice placement assumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from typing import Callable, Optional

import torch

from . import weight_sync as ws
from .sharded_learner import LearnerGroup, start_learner_group
from .worker_group import LearnerClient, WorkerGroup
from .workers import ColocatedWorker, LearnerWorker, RewardModelActor, RolloutWorker, rollout_engine

__all__ = ["Topology", "make_topology", "ray_session"]


@dataclasses.dataclass
class Topology:
    """A run's actors: the learner (one actor or a sharded group) behind a :class:`LearnerClient`,
    the rollout workers as a :class:`WorkerGroup` (it numbers their ordered calls, so every driver
    of one topology continues the same order), optional reward actors as a :class:`WorkerGroup`
    (a batch is scored in one slice per actor; a dead one is restarted as a rollout worker is)."""

    learner_group: LearnerClient
    workers: WorkerGroup
    rewards: Optional[WorkerGroup] = None
    colocated: bool = False  # the learner and the one rollout worker are one ColocatedWorker actor

    @property
    def learner(self):
        """The learner's actor handle (or its sharded ``LearnerGroup``)."""
        return self.learner_group.actor

    @property
    def reward_actor(self):
        """The first reward actor's handle (None without reward actors)."""
        return self.rewards[0] if self.rewards else None

    def shutdown(self) -> None:
        import ray

        if isinstance(self.learner, LearnerGroup):
            self.learner.shutdown()
        for a in [self.learner, *(() if self.colocated else self.workers), *(self.rewards or ())]:
            if a is not None and not isinstance(a, LearnerGroup):
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass


def _actor_env() -> dict:
    """Environment for our actors: inherit the XLA/thread settings and the compilation cache,
    so every actor compiles the same programs once (the persistent cache is shared on a host)."""
    keep = ("XLA_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHTPU_CACHE_DIR", "TORCHTPU_PLATFORM",
            "TORCHTPU_EXECUTION_MODE", "JAX_ENABLE_X64")
    return {k: os.environ[k] for k in keep if k in os.environ}


def make_topology(policy_fn: Callable[[], torch.nn.Module], pad_id: int, *, num_rollout_workers: int = 1,
                  algo: str = "grpo", learner_kwargs: Optional[dict] = None, engine_kwargs: Optional[dict] = None,
                  seed: int = 0, bucket_bytes: int = ws.DEFAULT_BUCKET_BYTES,
                  reward_fn: Optional[Callable] = None, reward_model_fn: Optional[Callable] = None,
                  reward_model_dir: Optional[str] = None, reward_in_actor: bool = False, max_restarts: int = 3,
                  worker_concurrency: int = 4, actor_options: Optional[dict] = None,
                  sync_dtype: Optional[torch.dtype] = None, rollout_quantization: Optional[str] = None,
                  lora=None, learner_processes: int = 1, learner_slice=None, num_reward_actors: int = 1,
                  colocate: bool = False) -> Topology:
    """Start the learner, ``num_rollout_workers`` rollout workers and (optionally) a reward actor
    (``num_reward_actors`` of them, a :class:`WorkerGroup`) on the connected Ray cluster. ``actor_options`` go to every ``.options()`` (e.g. a
    ``scheduling_strategy`` from a ray_integration slice reservation). ``reward_model_dir``: a
    Hugging Face sequence-classification directory for the reward actor. ``rollout_quantization``
    (``"int8"``, ``"int8_weight_only"``, ``"fp8"``): each rollout worker generates with a quantized
    copy of the weights, re-quantized after every sync (``RolloutEngine(quantization=...)``); pair it
    with truncated importance sampling in the learner (``learner_kwargs={"tis_cap": 2.0}``). ``lora``
    (:class:`~torchtpu_rl.lora.LoraSpec`): the learner trains LoRA adapters of the policy and syncs
    only them; the rollout workers merge them into their weights. ``engine_kwargs["engine"]``:
    ``"static"`` (default, :class:`~torchtpu_rl.rollout.RolloutEngine`) or ``"serving"``
    (:class:`~torchtpu_rl.serving.ServingEngine`, which takes neither quantization nor LoRA). Every actor is restarted by Ray up
    to ``max_restarts`` times when it dies. ``sync_dtype=torch.bfloat16``: float32 weights travel to the
    workers as bfloat16 (weight_sync). ``learner_processes=N`` (> 1): the learner is N processes, one
    per host of a TPU slice of N hosts (``learner_slice``: its accelerator type or reservation; default:
    the cluster's first such slice), started with ray_integration's ``TPUHostGroup``, training one
    FSDP2-sharded GRPO policy (:mod:`torchtpu_rl.sharded_learner`); ``topology.learner`` is then a
    :class:`~torchtpu_rl.sharded_learner.LearnerGroup`, driven like one learner actor (no restarts).
    ``colocate=True`` (verl's hybrid engine, ``--colocate``): the learner and a serving engine on its
    weights are one :class:`~torchtpu_rl.workers.ColocatedWorker` on one device, both the learner and
    the one rollout worker of the topology; a weight sync is a version bump (sync mode only)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("make_topology: connect to Ray first (driver.connect_ray())")
    from ray_integration.resources import require_tpu_chips, tpu_actor_options, tpu_capacity

    if not isinstance(num_rollout_workers, int) or num_rollout_workers < 1:
        raise ValueError(f"num_rollout_workers must be a positive int, got {num_rollout_workers!r}")
    if colocate and (num_rollout_workers != 1 or learner_processes != 1 or lora is not None or sync_dtype is not None
                     or rollout_quantization is not None or (engine_kwargs or {}).get("engine") != "serving"):
        raise ValueError("make_topology: colocate=True runs one ColocatedWorker (the learner and a serving engine "
                         "on its weights): one rollout worker, one learner process, engine_kwargs engine='serving', "
                         f"no LoRA, sync_dtype or rollout quantization (got num_rollout_workers={num_rollout_workers}, "
                         f"learner_processes={learner_processes}, lora={lora!r}, sync_dtype={sync_dtype!r}, "
                         f"rollout_quantization={rollout_quantization!r}, engine_kwargs={engine_kwargs!r})")
    if not isinstance(num_reward_actors, int) or num_reward_actors < 1:
        raise ValueError(f"make_topology: num_reward_actors must be a positive int, got {num_reward_actors!r}")
    if not isinstance(learner_processes, int) or learner_processes < 1:
        raise ValueError(f"make_topology: learner_processes must be a positive int, got {learner_processes!r}")
    if learner_processes > 1 and (algo != "grpo" or lora is not None):
        raise ValueError(f"make_topology: a sharded learner (learner_processes={learner_processes}) trains GRPO "
                         f"without LoRA; got algo={algo!r}, lora={lora!r}")
    if rollout_quantization is not None:
        from .rollout import ROLLOUT_QUANTIZATION

        if rollout_quantization not in ROLLOUT_QUANTIZATION:
            raise ValueError(f"make_topology: rollout_quantization must be one of {sorted(ROLLOUT_QUANTIZATION)} "
                             f"or None, not {rollout_quantization!r}")
        engine_kwargs = {**(engine_kwargs or {}), "quantization": rollout_quantization}
    if lora is not None:
        engine_kwargs = {**(engine_kwargs or {}), "lora": lora}
    rollout_engine(engine_kwargs)  # an engine option the chosen engine does not take: refused before any actor
    ws.check_sync_dtype(sync_dtype)
    base = {"num_cpus": 0, "runtime_env": {"env_vars": _actor_env()}, **(actor_options or {})}
    # on a TPU cluster the learner and each rollout worker get a chip (the learner on a slice's worker 0)
    tpu = "resources" not in base and tpu_capacity()
    if tpu and learner_processes == 1:  # (a sharded learner holds its whole slice: TPUHostGroup reserves it)
        require_tpu_chips(1 + (0 if colocate else num_rollout_workers), "make_topology (a learner and "
                          f"{num_rollout_workers} rollout worker(s))", tpu)
    lopts = {**base, **(tpu_actor_options(slice_head=True, capacity=tpu) if tpu else {}), "max_restarts": max_restarts}
    largs = ((policy_fn,), {"algo": algo, "learner_kwargs": learner_kwargs, "seed": seed,
                            "bucket_bytes": bucket_bytes, "sync_dtype": sync_dtype,
                            "lora": lora})
    if colocate:  # one actor: the learner, and the rollout group's one worker (Ray restarts it, no recipe)
        actor = ray.remote(ColocatedWorker).options(**lopts, max_concurrency=worker_concurrency).remote(
            policy_fn, pad_id, algo=algo, learner_kwargs=learner_kwargs, seed=seed, engine_kwargs=engine_kwargs,
            bucket_bytes=bucket_bytes)
        learner, workers = LearnerClient(actor), WorkerGroup(ColocatedWorker, [actor])
    elif learner_processes > 1:
        kw = {k: v for k, v in largs[1].items() if k not in ("learner_kwargs", "lora")}
        env = {k: v for k, v in _actor_env().items() if k != "XLA_FLAGS"}  # TPUHostGroup sets the device count
        learner = start_learner_group(policy_fn, learner_kwargs or {}, kw, learner_processes, learner_slice, env)
        if tpu:  # the learner holds its whole slice: the rollout workers need chips beside it
            try:
                require_tpu_chips(learner.host_group.spec.num_chips + num_rollout_workers,
                                  f"make_topology (a sharded learner on a {learner.host_group.spec.pod_type} slice and "
                                  f"{num_rollout_workers} rollout worker(s))", tpu)
            except ValueError:
                learner.shutdown()
                raise
        learner = LearnerClient(learner)  # no restart recipe: a sharded learner is not restarted
    else:
        learner = LearnerClient(ray.remote(LearnerWorker).options(**lopts).remote(*largs[0], **largs[1]),
                                (LearnerWorker, *largs, lopts))
    wopts = {**base, **(tpu_actor_options(capacity=tpu) if tpu else {}), "max_restarts": max_restarts,
             "max_concurrency": worker_concurrency}
    if not colocate:
        workers = WorkerGroup.start(RolloutWorker, num_rollout_workers, (policy_fn, pad_id), wopts,
                                    lambda i: {"worker_index": i, "engine_kwargs": engine_kwargs})
    rewards = None
    ropts = {**base, "max_restarts": max_restarts}
    if reward_model_dir is not None:
        rkw = {"model_dir": os.fspath(reward_model_dir)}
    elif reward_in_actor or reward_model_fn is not None:
        rkw = {"reward_fn": None if reward_model_fn is not None else reward_fn, "model_fn": reward_model_fn,
               "pad_id": pad_id}
    if reward_model_dir is not None or reward_in_actor or reward_model_fn is not None:
        rewards = WorkerGroup.start(RewardModelActor, num_reward_actors, (), ropts, lambda i: rkw)
    return Topology(learner, workers, rewards, colocated=bool(colocate))


# ------------------------------------------------------------------ Ray connection
@contextlib.contextmanager
def ray_session(run_dir: Optional[str] = None, *, num_cpus: int = 2, object_store_memory: int = 200 * 1024**2,
                include_dashboard: bool = False):
    """Be connected to Ray for the ``with`` block.

    Already connected: nothing to do. ``RAY_ADDRESS`` set (e.g. under ``ray job submit``):
    connect to it. Otherwise start a local head through ray_integration (stopped at exit).
    Yields the :class:`ray_integration.LocalHead` it started, or None.
    """
    import ray

    if ray.is_initialized():
        yield None
        return
    addr = os.environ.get("RAY_ADDRESS")
    if addr:
        ray.init(address=addr, logging_level="WARNING")
        try:
            yield None
        finally:
            ray.shutdown()
        return
    from ray_integration import LocalHead, connect

    head = LocalHead(run_dir or f"/tmp/rt_rl{uuid.uuid4().hex[:6]}", num_cpus=num_cpus,
                     object_store_memory=object_store_memory, include_dashboard=include_dashboard)
    head.start()
    try:
        connect(head)
        yield head
    finally:
        ray.shutdown()
        head.stop()
