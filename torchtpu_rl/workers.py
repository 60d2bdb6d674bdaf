"""The Ray actors of an RL run: rollout workers, the learner, a reward-model actor.

Each class here is a plain Python class; :func:`torchtpu_rl.topology.make_topology` turns them into
Ray actors (``num_cpus=0``: the host's chips, not its CPU slots, are the scarce
resource, as ray_integration's slice placement assumes). Every actor builds its
own policy from the same picklable ``policy_fn`` (e.g.
``functools.partial(make_policy, vocab_size, seed=0)``); the rollout workers'
weights are then overwritten by the learner's at the first sync.

Rollout workers are *threaded* actors (``max_concurrency`` > 1) so that a weight
update can arrive while a generate call runs: the update fetches its bytes
concurrently, then takes the worker's generation lock (pause: the in-flight
batch finishes under the old version), drops the KV cache, installs the new
weights and version, and releases the lock (resume). One lock covers the version
read and the generation, so a trajectory is always tagged with the version of
the weights that produced it.

Every actor is created with ``max_restarts``: a killed worker comes back (with
fresh initial weights and version -1); the driver re-syncs it before giving it
work again and re-queues what it was generating. A restarted learner comes back
at its initial weights; the driver loads its last checkpoint into it
(:class:`~torchtpu_rl.driver.RLDriver`, "Faults" in docs/rl.md). A restarted
reward actor is simply called again.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

from . import checkpoint as _ckpt
from . import weight_sync as ws
from .protocol import (LearnerRestarted, RewardRequest, RolloutBatch, RolloutRequest, RolloutResult, WorkerNotReady,
                       split_rewards)
from .worker_group import ONE_TO_ALL, ROUND_ROBIN, InOrder, WorkerGroup, dispatch

__all__ = [
    "ActorReward",
    "ColocatedWorker",
    "ENGINES",
    "LearnerWorker",
    "RewardModelActor",
    "RolloutWorker",
    "score_on_group",
]


def _seed_all(seed: int) -> None:
    torch.manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)  # seeds torch's CPU generator and torchtpu's key


ENGINES = ("static", "serving")
# what the worker sets itself (or RolloutEngine takes that ServingEngine does not: named in the refusal)
_OWN_ARGS = ("self", "model", "pad_id", "device", "policy_version")


def rollout_engine(engine_kwargs: Optional[dict]) -> tuple:
    """``(engine name, engine class, its keyword arguments)`` for a rollout worker's ``engine_kwargs``: ``engine``
    (``"static"``, the default: :class:`~torchtpu_rl.rollout.RolloutEngine`; ``"serving"``:
    :class:`~torchtpu_rl.serving.ServingEngine`) picks the class, the rest go to it. An option the
    chosen engine does not take is a ValueError naming it, raised where the topology is made (the
    driver's process), not inside an actor."""
    kw = dict(engine_kwargs or {})
    kw.pop("episodes", None)  # the worker's, not the engine's (an episodes.EpisodeSpec)
    engine = kw.pop("engine", "static")
    if engine not in ENGINES:
        raise ValueError(f"rollout engine must be one of {ENGINES}, not {engine!r}")
    if engine == "static":
        from .rollout import RolloutEngine as cls
    else:
        from .serving import ServingEngine as cls
    taken = set(inspect.signature(cls.__init__).parameters) - set(_OWN_ARGS)
    bad = sorted(k for k in kw if k not in taken)
    if bad:
        raise ValueError(f"the {engine} rollout engine ({cls.__name__}) does not take {', '.join(bad)}; it takes "
                         f"{', '.join(sorted(taken))}")
    return engine, cls, kw


class RolloutWorker:
    """A rollout worker: a :class:`~torchtpu_rl.rollout.RolloutEngine` (or, with
    ``engine_kwargs["engine"] == "serving"``, a :class:`~torchtpu_rl.serving.ServingEngine`) on this
    process's chip."""

    def __init__(self, policy_fn: Callable[[], torch.nn.Module], pad_id: int, worker_index: int = 0,
                 engine_kwargs: Optional[dict] = None, device: str = "tpu"):
        import torchtpu  # noqa: F401  (registers the device in this actor process)

        name, cls, kw = rollout_engine(engine_kwargs)
        self._attach(name, cls(policy_fn(), pad_id, device=device, policy_version=-1, **kw), worker_index,
                     ws.WeightReceiver(device="tpu" if torch.device(device).type == "tpu" else "cpu"))
        spec = (engine_kwargs or {}).get("episodes")  # an EpisodeSpec: each prompt is a multi-turn episode
        if spec is not None:
            from .episodes import EpisodeRunner

            self.episodes = EpisodeRunner(spec)

    @classmethod
    def on_engine(cls, engine_name: str, engine, worker_index: int = 0) -> "RolloutWorker":
        """A worker around an engine built elsewhere (a colocated learner's), receiving no weights."""
        self = cls.__new__(cls)
        self._attach(engine_name, engine, worker_index, None)
        return self

    def _attach(self, engine_name: str, engine, worker_index: int, receiver) -> None:
        self.engine_name = engine_name
        self.worker_index = int(worker_index)
        self.engine = engine
        self.receiver = receiver
        self.episodes = None  # an EpisodeRunner when each prompt is a multi-turn episode (episodes.py)
        self.version = -1  # no weights from the learner yet
        self._order = InOrder()  # its lock is the generation lock
        self._generating = None  # request id in flight
        self._sync_id = -1  # the newest object-store sync installed (see _install)
        self.started_at = time.time()
        self.counts = {"generate_calls": 0, "updates": 0}

    # Calls run on several threads (a weight update must be able to arrive mid-generation), but
    # generations and weight installs happen in the order the driver sent them (``seq``, numbered by
    # the WorkerGroup): an update sent after a generate request never overtakes it, so which version
    # generates which batch depends on the driver's decisions only, not on thread timing (async runs
    # are reproducible). A restarted process adopts the first number it receives.

    # ------------------------------------------------------------ generation
    @dispatch(ROUND_ROBIN, ordered=True)
    def generate(self, request: RolloutRequest, seq: Optional[int] = None) -> RolloutResult:
        t0 = time.perf_counter()
        with self._order.turn(seq):
            if self.version < 0:
                raise WorkerNotReady(f"rollout worker {self.worker_index}: no weights yet (sync weights first)")
            self._generating = request.request_id
            try:
                _seed_all(request.seed)
                if self.engine_name == "serving":  # its draws are keyed by a request seed, not torch's RNG
                    self.engine.seed = int(request.seed)
                if self.episodes is not None:
                    batch = self.episodes.run(self.engine, request.prompts, request.rows, request.params,
                                              self.version, reseed=self._reseed(request.seed))
                    last = self.episodes.last_stats
                else:
                    batch = self.engine.generate(request.prompts, request.params, policy_version=self.version)
                    last = self.engine.last_stats
                version = self.version
                stats = {k: v for k, v in last.items() if isinstance(v, (int, float))}
            finally:
                self._generating = None
            self.counts["generate_calls"] += 1
        return RolloutResult(request.request_id, batch.state(), version, self.worker_index, os.getpid(),
                             time.perf_counter() - t0, batch.num_response_tokens, stats)

    def _reseed(self, seed: int):
        """Each turn of an episode run draws from its own seed (the serving engine keys draws by it)."""
        def reseed(turn: int) -> None:
            if self.engine_name == "serving":
                self.engine.seed = int(seed) + 1_000_003 * turn
        return reseed

    # ------------------------------------------------------------ weight updates
    def _install(self, version: int, tensors: dict, seq: Optional[int], sync_id: Optional[int] = None) -> dict:
        """pause -> drop the KV cache -> install -> set version -> resume; returns the install's
        figures (seconds paused, tensors swapped / copied). ``sync_id``: the driver numbers its syncs
        increasingly; an install of an older sync than one already installed (one a learner that died
        had started, overtaken by the re-sync after its restart) is refused."""
        with self._order.turn(seq):  # waits for an in-flight generate to finish
            if sync_id is not None:
                if sync_id < self._sync_id:
                    raise ws.SyncAborted(f"rollout worker {self.worker_index}: sync {sync_id} is older than the "
                                         f"installed sync {self._sync_id}")
                self._sync_id = int(sync_id)
            t0 = time.perf_counter()
            how = self.engine.update_weights(tensors, policy_version=version)
            self.version = int(version)
            self.counts["updates"] += 1
            dt = time.perf_counter() - t0
            return {"paused_s": dt, "install_s": dt, **{f"install_{k}": v for k, v in how.items()}}

    @dispatch(ONE_TO_ALL, ordered=True)
    def update_weights(self, update: ws.WeightUpdate, sync_id: Optional[int] = None, next_seq: Optional[int] = None,
                       seq: Optional[int] = None) -> dict:
        """Install an object-store update: sent by the driver, numbered (``seq``), or by the learner
        (``publish_to``), unnumbered, with the number of the next call the driver will send (``next_seq``)."""
        t0 = time.perf_counter()
        self._order.expect(next_seq)
        try:
            update.plan.check_matches(self.engine.sync_reference(), who=f"rollout worker {self.worker_index}")
            tensors = self.receiver.receive(update)  # fetched outside the pause
        except BaseException:
            self._order.skip(seq)
            raise
        installed = self._install(update.version, tensors, seq, sync_id)
        return {"worker": self.worker_index, "version": self.version, "seconds": time.perf_counter() - t0,
                **installed, **self.receiver.last_timings}

    @dispatch(ONE_TO_ALL)
    def collective_setup(self, init_method: str, world_size: int, backend: str) -> int:
        """Join the weight-sync group as rank ``worker_index + 1`` (the learner is rank 0)."""
        rank = self.worker_index + 1
        if self.receiver.group is not None:
            self.receiver.group.destroy()
        self.receiver.group = ws.CollectiveGroup(backend, init_method, world_size, rank)
        return rank

    @dispatch(ONE_TO_ALL)
    def collective_teardown(self) -> None:
        if self.receiver.group is not None:
            self.receiver.group.destroy()
            self.receiver.group = None

    @dispatch(ONE_TO_ALL, ordered=True)
    def receive_weights(self, seq: Optional[int] = None) -> dict:
        """Take part in the learner's broadcast (the one control call of a collective sync)."""
        t0 = time.perf_counter()
        try:
            if self.receiver.group is None:  # e.g. a restarted process the group was not rebuilt for yet
                raise ws.SyncAborted(f"rollout worker {self.worker_index} is not in the weight-sync group")
            update, tensors = self.receiver.receive_broadcast()
            update.plan.check_matches(self.engine.sync_reference(), who=f"rollout worker {self.worker_index}")
        except BaseException:
            self._order.skip(seq)
            raise
        installed = self._install(update.version, tensors, seq)
        return {"worker": self.worker_index, "version": self.version, "seconds": time.perf_counter() - t0,
                **installed, **self.receiver.last_timings}

    # ------------------------------------------------------------ introspection
    @dispatch(ONE_TO_ALL)
    def status(self) -> dict:
        return {"worker": self.worker_index, "pid": os.getpid(), "version": self.version,
                "generating": self._generating, "started_at": self.started_at,
                "group": self.receiver is not None and self.receiver.group is not None, **self.counts}

    @dispatch(ONE_TO_ALL)
    def checksums(self) -> dict:
        with self._order.lock:
            return ws.tensor_checksums(self.engine.model.state_dict())


class LearnerWorker:
    """The learner actor: policy, reference policy (colocated), optimizer, weight sender."""

    def __init__(self, policy_fn: Callable[[], torch.nn.Module], algo: str = "grpo",
                 learner_kwargs: Optional[dict] = None, seed: int = 0,
                 bucket_bytes: int = ws.DEFAULT_BUCKET_BYTES, device: str = "tpu",
                 sync_dtype: Optional[torch.dtype] = None, lora=None):
        import torchtpu  # noqa: F401

        from .learner import Learner

        _seed_all(seed)
        policy = policy_fn().to(device)
        self.lora = lora  # a lora.LoraSpec: train adapters only, sync adapters only
        if lora is not None:
            policy = lora.apply(policy)
        kw = dict(learner_kwargs or {})
        # the Learner makes the reference policy (a frozen copy of the initial policy) on this
        # actor's device when kl_coef > 0: colocated with the policy
        self.learner = Learner(policy, None, algo=algo, device=device, **kw)
        self.policy = policy
        self.sender = ws.WeightSender(bucket_bytes, sync_dtype=sync_dtype)
        self.device = device
        self.started_at = time.time()
        import ray

        # a Ray actor's process that Ray restarted, until load_checkpoint (False outside an actor)
        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        self.restarted = bool(ctx is not None and ctx.get_actor_id() is not None and ctx.was_current_actor_reconstructed)

    def _check_restored(self, what: str) -> None:
        if self.restarted:
            raise LearnerRestarted(f"learner process {os.getpid()} was restarted by Ray and has no checkpoint "
                                   f"loaded yet: refusing {what}")

    @property
    def policy_version(self) -> int:
        return int(self.learner.policy_version)

    def version(self) -> int:
        return self.policy_version

    def status(self) -> dict:
        return {"pid": os.getpid(), "version": self.policy_version, "started_at": self.started_at,
                "group": self.sender.group is not None}

    def train_step(self, batch_state: dict, rewards: Sequence[float]) -> dict:
        self._check_restored("train_step")
        batch = RolloutBatch.from_state(batch_state)
        t0 = time.perf_counter()
        metrics = dict(self.learner.train_step(batch, torch.as_tensor(list(rewards), dtype=torch.float32)))
        metrics = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in metrics.items()}
        metrics["train_s"] = time.perf_counter() - t0
        metrics["policy_version"] = self.policy_version
        return metrics

    def _weights(self) -> dict:
        if self.lora is not None:
            from .lora import adapter_state_dict

            return adapter_state_dict(self.policy)
        return self.policy.state_dict()

    def publish_weights(self) -> ws.WeightUpdate:
        """Object-store sync: put the weights (one object per bucket), return the small update."""
        self._check_restored("publish_weights")
        return self.sender.publish(self._weights(), self.policy_version)

    def publish_to(self, workers: Sequence, sync_id: Optional[int] = None, next_seqs: Optional[Sequence] = None) -> dict:
        """Object-store sync handed from the learner to the rollout group: publish, then start every
        worker's install from here, so the driver sends one call for the whole group (its sync mode:
        nothing is in flight on the workers, so the installs need no place in their call order; each is
        told the number of the driver's next call to it, ``next_seqs``). Returns the update (the small
        handle) and the installs' ObjectRefs, in worker order."""
        update = self.publish_weights()
        nxt = list(next_seqs) if next_seqs is not None else [None] * len(workers)
        return {"update": update,
                "installs": [w.update_weights.remote(update, sync_id, s) for w, s in zip(workers, nxt)]}

    def collective_setup(self, init_method: str, world_size: int, backend: str) -> int:
        if self.sender.group is not None:
            self.sender.group.destroy()
        self.sender.group = ws.CollectiveGroup(backend, init_method, world_size, 0)
        return 0

    def collective_teardown(self) -> None:
        if self.sender.group is not None:
            self.sender.group.destroy()
            self.sender.group = None

    def broadcast_weights(self) -> dict:
        self._check_restored("broadcast_weights")
        return self.sender.broadcast(self._weights(), self.policy_version)

    def checksums(self) -> dict:
        return ws.tensor_checksums(self._weights())

    def free_port(self) -> str:
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{ws.free_port()}"

    def save_hf(self, out_dir: str, tokenizer=None) -> str:
        """The policy as a Hugging Face directory (``save_pretrained`` + tokenizer)."""
        from . import hf

        if self.lora is not None:
            from .lora import save_lora_hf

            return save_lora_hf(self.policy, tokenizer, out_dir)
        return hf.save_hf(self.policy, tokenizer, out_dir)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, driver_state: Optional[dict] = None,
                        reference_path: Optional[str] = None) -> str:
        self._check_restored("save_checkpoint")
        return _ckpt.save_checkpoint(path, self.learner, driver_state, reference_path)

    def load_checkpoint(self, path: str) -> Optional[dict]:
        state = _ckpt.load_checkpoint(path, self.learner)
        self.restarted = False
        return state


class RewardModelActor:
    """Rewards computed in their own actor: a programmatic ``reward_fn`` (e.g. a sandboxed
    checker), a learned reward model ``model_fn() -> nn.Module`` mapping
    ``(input_ids, attention_mask)`` to per-token scores (B, T) or logits (B, T, V) (the reward
    is the score at each sequence's last real token; for logits, its first channel), or a
    Hugging Face ``AutoModelForSequenceClassification`` directory ``model_dir`` scoring
    ``prompt + completion`` texts with its own tokenizer at the last real token, in bucketed
    batches (:func:`torchtpu_rl.hf.reward_scores`).
    """

    def __init__(self, reward_fn: Optional[Callable] = None, model_fn: Optional[Callable] = None,
                 device: str = "tpu", pad_id: int = 0, model_dir: Optional[str] = None, dtype: str = "float32"):
        if sum(x is not None for x in (reward_fn, model_fn, model_dir)) != 1:
            raise ValueError("RewardModelActor: give exactly one of reward_fn, model_fn and model_dir")
        self.reward_fn = reward_fn
        self.model = None
        self.tokenizer = None
        self.pad_id = int(pad_id)
        self.device = device
        if model_fn is not None or model_dir is not None:
            import torchtpu  # noqa: F401

        if model_fn is not None:
            self.model = model_fn().to(device).eval()
        if model_dir is not None:
            from . import hf

            self.model = hf.load_reward_model(model_dir, dtype=dtype, device=device)
            self.tokenizer = hf.load_tokenizer(model_dir)

    @dispatch(ONE_TO_ALL)
    def status(self) -> dict:
        return {"pid": os.getpid()}

    @dispatch(ROUND_ROBIN)
    def score_request(self, request: RewardRequest) -> list:
        """Score one slice of a batch (the reward group's call: :func:`score_on_group`)."""
        return self.score(request.prompts, request.responses, request.metadata)

    def score(self, prompts: list, responses: list, metadata: list) -> list:
        if self.reward_fn is not None:
            return [float(r) for r in self.reward_fn(prompts, responses, metadata)]
        if self.tokenizer is not None:
            from . import hf

            if not all(isinstance(x, str) for x in [*prompts, *responses]):
                raise TypeError("RewardModelActor: a Hugging Face reward model scores text; give prompt and "
                                "completion strings (RLDriver(tokenizer=...) decodes them)")
            return hf.reward_scores(self.model, self.tokenizer, prompts, responses, device=self.device)
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(seqs), L), dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
            mask[i, :len(s)] = 1
        with torch.no_grad():
            out = self.model(ids.to(self.device), attention_mask=mask.to(self.device))
            from .policy import get_logits

            out = out if isinstance(out, torch.Tensor) else get_logits(out)
            if out.dim() == 3:
                out = out[..., 0]
            last = (mask.sum(1) - 1).to(self.device)
            vals = out.float().gather(1, last[:, None]).squeeze(1).cpu()
        return [float(v) for v in vals]


def score_on_group(group: WorkerGroup, prompts: Sequence, responses: Sequence, metadata: Sequence,
                   on_death: Optional[Callable] = None) -> list:
    """Score a batch on a group of :class:`RewardModelActor` s: cut into one contiguous slice per
    actor (round-robin dispatch), gathered in order. An actor that dies with a slice in flight is
    brought back by its group (Ray's restart, or a new actor from the group's recipe) and the slice
    scored again on it; ``on_death(actor_index, error)`` is told first."""
    if not len(prompts):
        return []

    def died(i, request, e):
        if on_death is not None:
            on_death(i, e)
        group.revive(i)

    parts = group.scatter("score_request", split_rewards(prompts, responses, metadata, len(group)),
                          lambda r: r.start, died)
    return [float(v) for part in parts for v in part]


class ActorReward:
    """Reward actors as a TRL-style reward function ``fn(prompts, completions, **columns)``, so a
    reward model can sit in a :class:`~torchtpu_rl.rewards.RewardSet` beside programmatic
    rewards, with its own weight. ``group``: a :class:`~torchtpu_rl.worker_group.WorkerGroup` of
    :class:`RewardModelActor` s (or one actor handle)."""

    def __init__(self, group, name: str = "reward_model"):
        self.group = group if isinstance(group, WorkerGroup) else WorkerGroup(RewardModelActor, [group])
        self.__name__ = name

    def __call__(self, prompts, completions, **columns):
        return score_on_group(self.group, list(prompts), list(completions), [{}] * len(prompts))


# ------------------------------------------------------------------ colocated mode
def _sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers *are* ``model``'s (the same tensors: an update of
    one is an update of the other) and whose own state (train/eval, attention implementation, config) is
    separate, so a rollout engine can switch it to inference without touching the learner's module."""
    import copy

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


class ColocatedWorker(LearnerWorker):
    """Learner and rollout engine in one process on one device (verl's hybrid engine; ``--colocate``).

    The engine is a :class:`~torchtpu_rl.serving.ServingEngine` over a copy of the policy that shares
    the learner's parameters (:func:`_sharing_copy`): a weight sync is a version bump, no bytes copied.
    Its KV pages are released before each learner step (``ServingEngine.release_memory``: the learner
    has the device's memory) and allocated again at the sync after it (``publish_to``). The actor is
    the learner (``LearnerWorker``'s methods) and the one rollout worker of its topology (``generate``,
    ``status``, ``checksums`` of a :class:`RolloutWorker` around the engine); ``train_step`` adds
    ``peak_memory_bytes`` (the device's peak over the step, KV pages released) and ``kv_bytes_released``."""

    def __init__(self, policy_fn: Callable[[], torch.nn.Module], pad_id: int, algo: str = "grpo",
                 learner_kwargs: Optional[dict] = None, seed: int = 0, engine_kwargs: Optional[dict] = None,
                 device: str = "tpu", bucket_bytes: int = ws.DEFAULT_BUCKET_BYTES):
        name, cls, kw = rollout_engine(engine_kwargs)
        if name != "serving" or set(kw) & {"quantization", "lora", "dtype"}:
            raise ValueError("ColocatedWorker: colocated mode runs the serving engine on the learner's own weights "
                             f"(engine_kwargs={engine_kwargs!r}: no quantization, LoRA or other rollout dtype)")
        LearnerWorker.__init__(self, policy_fn, algo=algo, learner_kwargs=learner_kwargs, seed=seed,
                               bucket_bytes=bucket_bytes, device=device)
        engine = cls(_sharing_copy(self.policy), pad_id, device=device, policy_version=-1, **kw)
        self.rollout = RolloutWorker.on_engine(name, engine)

    @property
    def engine(self):
        return self.rollout.engine

    @dispatch(ROUND_ROBIN, ordered=True)
    def generate(self, request: RolloutRequest, seq: Optional[int] = None) -> RolloutResult:
        return self.rollout.generate(request, seq)

    @dispatch(ONE_TO_ALL)
    def status(self) -> dict:
        return {**self.rollout.status(), "learner_version": self.policy_version, "started_at": self.started_at,
                "kv_released": self.engine.memory_released}

    def train_step(self, batch_state: dict, rewards: Sequence[float]) -> dict:
        with self.rollout._order.lock:  # no generation while the learner has the device
            freed = 0 if self.engine.memory_released else self.engine.release_memory()
            mem = getattr(torch, "tpu", None) if torch.device(self.device).type == "tpu" else None
            if mem is not None:
                mem.reset_peak_memory_stats()
            metrics = LearnerWorker.train_step(self, batch_state, rewards)
            metrics["kv_bytes_released"] = int(freed)
            if mem is not None:
                metrics["peak_memory_bytes"] = int(mem.max_memory_allocated())
        return metrics

    def publish_to(self, workers: Sequence, sync_id: Optional[int] = None, next_seqs: Optional[Sequence] = None) -> dict:
        """The sync of colocated mode: the KV pages back, the engine's version bumped to the learner's."""
        self._check_restored("publish_to")
        t0 = time.perf_counter()
        with self.rollout._order.lock:
            if self.engine.memory_released:
                self.engine.resume_memory()
            self.engine.drop_cache()  # prefixes computed under the old weights
            self.engine.policy_version = self.rollout.version = self.policy_version
            self.rollout._order.expect(next_seqs[0] if next_seqs else None)
            self.rollout.counts["updates"] += 1
        dt = time.perf_counter() - t0
        return {"update": {"version": self.policy_version, "bytes": 0, "install_s": dt, "colocated": True},
                "installs": []}

    def publish_weights(self):
        raise RuntimeError("ColocatedWorker: colocated mode syncs by a version bump (publish_to), not through the "
                           "object store")

    def load_checkpoint(self, path: str) -> Optional[dict]:
        state = LearnerWorker.load_checkpoint(self, path)  # (in place: the engine still shares the parameters)
        self.rollout.version = -1  # synced again by the driver after a load
        return state
