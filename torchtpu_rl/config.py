"""The typed configuration of an RL run, validated in one place.

Four dataclasses, one per part of the run, whose field names are the command-line flags'
(``--max-new-tokens`` is ``RolloutConfig.max_new_tokens``), so an error names the flag a user
typed as well as the field a Python caller set:

- :class:`RolloutConfig`: what each step generates and with which engine;
- :class:`LearnerConfig`: the algorithm, its optimizer and loss options, LoRA;
- :class:`SyncConfig`: how rollouts and training overlap and how weights travel;
- :class:`EpisodeConfig`: multi-turn episodes (environment, tools, per-episode and sandbox limits);
- :class:`RunConfig`: the three above plus the run's length, seed, rewards, checkpoints,
  evaluation and logging; :meth:`RunConfig.from_args` builds it from ``train.parse_args``'s
  namespace (flags, ``--config`` files and TRL / verl names all land there first) and checks the
  options that tie the parts together. Defaults that depend on the model are derived by
  :meth:`RunConfig.derive_from_model`.

Every check raises :class:`ConfigError` (a ``ValueError``) before any actor starts. This module
imports no torch: parsing and checking a configuration is cheap.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

# the loss family's names (kept here, not imported from algorithms: this module imports no torch)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SCALE_REWARDS = ("group", "batch", "none")

__all__ = ["ConfigError", "EpisodeConfig", "LearnerConfig", "RolloutConfig", "RunConfig", "SyncConfig", "flag"]

DEFAULT_MAX_PROMPT_TOKENS = 512
REPORT_TO = ("tensorboard", "wandb", "none")


class ConfigError(ValueError):
    """An option out of its range or at odds with another; the message names the flag."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Checked:
    """Checks shared by the configs: each raises a :class:`ConfigError` naming the flag."""

    def _fail(self, name: str, what: str):
        raise ConfigError(f"{flag(name)} must be {what}, not {getattr(self, name)!r}")

    def _ints(self, names, low: int = 1, optional: bool = False) -> None:
        for n in names:
            v = getattr(self, n)
            if optional and v is None:
                continue
            if not _is_int(v) or v < low:
                self._fail(n, "a positive integer" if low == 1 else f"an integer >= {low}")

    def _float(self, name: str, ok, what: str, optional: bool = False) -> None:
        v = getattr(self, name)
        if optional and v is None:
            return
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not ok(v):
            self._fail(name, what)

    def _choice(self, name: str, choices) -> None:
        if getattr(self, name) not in choices:
            self._fail(name, f"one of {tuple(choices)}")


@dataclasses.dataclass
class RolloutConfig(_Checked):
    """A step's prompts and samples, and the rollout engine that generates them."""

    prompts_per_step: int = 8
    group_size: int = 8  # responses sampled per prompt
    max_new_tokens: int = 128
    max_prompt_tokens: Optional[int] = None  # None: derived from the model's context (derive_from_model)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    rollout_workers: int = 1
    requests_per_worker: int = 1  # requests of whole groups per worker and step
    engine: str = "static"
    rollout_quantization: str = "none"
    rollout_dtype: Optional[str] = None  # None: the learner's dtype
    max_slots: Optional[int] = None  # serving engine sizes (None: derived)
    page_size: Optional[int] = None
    kv_pages: Optional[int] = None
    # DAPO dynamic sampling: drop groups whose rewards are all equal, sample more prompts to fill the step
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # generation rounds per step at most (the first included)

    def __post_init__(self):
        self._ints(("prompts_per_step", "group_size", "max_new_tokens", "rollout_workers", "requests_per_worker"))
        self._ints(("max_prompt_tokens", "max_slots", "page_size", "kv_pages"), optional=True)
        self._ints(("max_sampling_rounds",))
        self._float("temperature", lambda v: v > 0, "a finite number > 0 for training rollouts (evaluation is greedy)")
        self._float("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        self._ints(("top_k",), low=0)
        self._choice("engine", ("static", "serving"))
        self._choice("rollout_quantization", ("none", "int8", "int8_weight_only", "fp8"))
        if self.engine != "serving":
            given = [f for f in ("max_slots", "page_size", "kv_pages") if getattr(self, f) is not None]
            if given:
                raise ConfigError(f"{flag(given[0])} sizes the serving engine: give --engine serving "
                                  f"(the engine is --engine {self.engine})")
        elif self.rollout_quantization != "none":
            raise ConfigError(f"--rollout-quantization {self.rollout_quantization}: the serving engine (--engine "
                              "serving) generates with the weights as synced; use --engine static for quantized "
                              "rollouts")

    def engine_kwargs(self, param_dtype: str) -> dict:
        """The rollout workers' engine options (the prompt budget known: after derive_from_model)."""
        from torchtpu.bucketing import BucketPolicy  # (torch: only once the run is being built)

        seq = self.max_prompt_tokens + self.max_new_tokens
        if self.engine == "serving":
            # default: a worker's share of a step's samples at once (the driver splits whole prompt groups)
            slots = self.max_slots or min(256, -(-self.prompts_per_step // self.rollout_workers) * self.group_size)
            page = self.page_size or 16
            need = -(-seq // page)
            if self.kv_pages is not None and self.kv_pages < need:
                raise ConfigError(f"--kv-pages {self.kv_pages} cannot hold one sequence: --max-prompt-tokens "
                                  f"{self.max_prompt_tokens} + --max-new-tokens {self.max_new_tokens} take {need} "
                                  f"pages of --page-size {page}")
            return {"engine": "serving", "max_slots": slots, "page_size": page,
                    "kv_pages": self.kv_pages or slots * need}
        P, R = self.max_prompt_tokens, self.max_new_tokens
        kw = {"prompt_buckets": BucketPolicy.pow2(min(16, P), P, name="prompt"),
              "response_buckets": BucketPolicy.pow2(min(8, R), R, name="response")}
        if self.rollout_quantization != "none":
            kw["quantization"] = self.rollout_quantization
        if self.rollout_dtype and self.rollout_dtype != param_dtype:
            kw["dtype"] = self.rollout_dtype
        return kw


@dataclasses.dataclass
class LearnerConfig(_Checked):
    """The algorithm and its options (``learner.Learner``'s keyword arguments, by flag name)."""

    algo: str = "grpo"
    dtype: str = "float32"  # parameter dtype (bfloat16: float32 master weights and optimizer state)
    lr: float = 1e-6
    kl_coef: float = 0.001  # 0: no reference policy
    grad_clip: float = 1.0  # 0: off
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    micro_batch_tokens: Optional[int] = None
    gradient_checkpointing: bool = False
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    entropy_coef: float = 0.0
    weight_decay: float = 0.0
    loss_agg: Optional[str] = None  # None: the --loss-type's (token-mean without one)
    loss_type: Optional[str] = None  # None: --algo's GRPO / PPO loss with --loss-agg
    scale_rewards: Optional[str] = None  # None: the --loss-type's (group without one)
    pack_sequences: bool = False
    rollout_is: Optional[str] = None  # None: token-level with quantized rollouts, else off
    rollout_is_threshold: float = 2.0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: Optional[list] = None
    lora_modules_to_save: Optional[list] = None
    learner_processes: int = 1

    def __post_init__(self):
        self._choice("algo", ("grpo", "ppo"))
        self._choice("dtype", ("float32", "bfloat16"))
        self._float("lr", lambda v: v > 0, "a finite number > 0")
        self._float("kl_coef", lambda v: v >= 0, "a finite number >= 0 (0: no reference policy)")
        self._float("grad_clip", lambda v: v >= 0, "a finite number >= 0 (0: no clipping)")
        self._ints(("ppo_epochs", "learner_processes"))
        self._ints(("mini_batch_size", "micro_batch_size", "micro_batch_tokens"), optional=True)
        self._float("clip_eps", lambda v: 0 < v < 1, "in (0, 1)")
        self._float("clip_eps_high", lambda v: v > 0, "a finite number > 0", optional=True)
        self._float("entropy_coef", lambda v: True, "a finite number")
        self._float("weight_decay", lambda v: v >= 0, "a finite number >= 0")
        self._choice("loss_agg", (None,) + AGGREGATIONS)
        self._choice("loss_type", (None,) + LOSS_TYPES)
        self._choice("scale_rewards", (None,) + SCALE_REWARDS)
        if self.loss_type is not None and self.algo != "grpo":
            raise ConfigError(f"--loss-type {self.loss_type} is a critic-free group loss: give --algo grpo, not "
                              f"--algo {self.algo}")
        if self.pack_sequences and (self.algo != "grpo" or self.learner_processes > 1):
            raise ConfigError(f"--pack-sequences packs the policy's forward of a single learner: not with --algo "
                              f"{self.algo} or --learner-processes {self.learner_processes}")
        self._choice("rollout_is", (None, "token", "sequence", "none"))
        self._float("rollout_is_threshold", lambda v: v > 0, "> 0 (a finite number)")
        self._ints(("lora_rank",), low=0)
        self._float("lora_alpha", lambda v: v > 0, "a finite number > 0")

    def learner_kwargs(self, group_size: int, seed: int, rollout_quantization: str = "none",
                       max_new_tokens: Optional[int] = None) -> dict:
        kw = dict(lr=self.lr, kl_coef=self.kl_coef, grad_clip=self.grad_clip or None, seed=seed,
                  ppo_epochs=self.ppo_epochs, mini_batch_size=self.mini_batch_size,
                  micro_batch_size=self.micro_batch_size, micro_batch_tokens=self.micro_batch_tokens,
                  gradient_checkpointing=bool(self.gradient_checkpointing), eps_low=self.clip_eps,
                  eps_high=self.clip_eps_high, entropy_coef=self.entropy_coef, weight_decay=self.weight_decay,
                  loss_agg=self.loss_agg, param_dtype=self.dtype, loss_type=self.loss_type,
                  scale_rewards=self.scale_rewards, pack_sequences=bool(self.pack_sequences))
        if self.algo == "grpo":
            kw.update(group_size=group_size)
        if max_new_tokens is not None:  # Dr. GRPO's constant divisor: the longest completion (as TRL)
            kw["norm_length"] = max_new_tokens
        level = self.rollout_is or ("token" if rollout_quantization != "none" else "none")
        if level != "none":
            kw.update(tis_cap=self.rollout_is_threshold, tis_level=level)
        return kw


@dataclasses.dataclass
class SyncConfig(_Checked):
    """How generation and training overlap, and how the learner's weights reach the workers."""

    mode: str = "sync"  # async: later steps' rollouts overlap training, at most max_staleness versions old
    max_staleness: int = 1
    transport: str = "object_store"
    sync_dtype: str = "float32"
    colocate: bool = False  # the learner and the serving engine in one process on one device

    def __post_init__(self):
        self._choice("mode", ("sync", "async"))
        self._ints(("max_staleness",), low=0)
        self._choice("transport", ("object_store", "collective"))
        self._choice("sync_dtype", ("float32", "bfloat16"))


@dataclasses.dataclass
class EpisodeConfig(_Checked):
    """Multi-turn episodes (agentic RL): the environment, the tools, the per-episode limits and the tool
    sandbox's limits. Without ``env`` and ``tools`` each prompt is one turn, as before. The env and tool
    specs are resolved (imported, checked) by ``train.py`` before any actor starts."""

    env: Optional[str] = None  # built-in name, MODULE:CLASS or FILE.py:CLASS (environments.resolve_env)
    tools: Optional[list] = None  # built-in names, MODULE:FUNCTION or FILE.py:FUNCTION (tools.resolve_tools)
    max_turns: Optional[int] = None  # None: 4 with an env or tools
    max_episode_tokens: Optional[int] = None  # None: the engine's context bounds an episode
    max_episode_seconds: Optional[float] = None
    tool_timeout_s: float = 5.0
    tool_cpu_s: int = 5
    tool_memory_mb: int = 512
    tool_max_output_bytes: int = 16384

    DEFAULT_MAX_TURNS = 4

    def __post_init__(self):
        self._ints(("max_turns", "max_episode_tokens"), optional=True)
        self._float("max_episode_seconds", lambda v: v > 0, "a number of seconds > 0", optional=True)
        self._float("tool_timeout_s", lambda v: v > 0, "a number of seconds > 0")
        self._ints(("tool_cpu_s", "tool_memory_mb", "tool_max_output_bytes"))
        if self.env is not None and (not isinstance(self.env, str) or not self.env.strip()):
            self._fail("env", "a built-in name, MODULE:CLASS or FILE.py:CLASS")
        if not self.enabled:
            given = [f for f in ("max_turns", "max_episode_tokens", "max_episode_seconds") if getattr(self, f) is not None]
            if given:
                raise ConfigError(f"{flag(given[0])} limits multi-turn episodes: give --env or --tools")
        elif self.max_turns is None:
            self.max_turns = self.DEFAULT_MAX_TURNS

    @property
    def enabled(self) -> bool:
        return self.env is not None or bool(self.tools)


@dataclasses.dataclass
class RunConfig(_Checked):
    """The whole run (see the module doc)."""

    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    episode: EpisodeConfig = dataclasses.field(default_factory=EpisodeConfig)
    steps: int = 100
    seed: int = 0
    reward: Optional[list] = None
    reward_weight: Optional[list] = None
    reward_model: Optional[str] = None
    reward_model_weight: float = 1.0
    on_reward_error: str = "stop"
    max_reward_error_fraction: float = 0.5
    keep_checkpoints: int = 2
    save_every: int = 0
    save_interval_s: float = 600.0
    eval_every: int = 0
    eval_samples: int = 4
    report_to: Optional[list] = None  # None: ["tensorboard"]
    ray_num_cpus: Optional[int] = None  # None: derived (this machine's CPUs)
    ray_object_store_mb: Optional[int] = None  # None: derived (twice the weights)

    PARTS = {"rollout": RolloutConfig, "learner": LearnerConfig, "sync": SyncConfig, "episode": EpisodeConfig}

    def __post_init__(self):
        self._ints(("steps",), low=0)
        self._ints(("keep_checkpoints",))
        self._ints(("save_every", "eval_every", "eval_samples"), low=0)
        self._ints(("ray_num_cpus", "ray_object_store_mb"), optional=True)
        self._float("save_interval_s", lambda v: v > 0, "a finite number of seconds > 0")
        self._float("reward_model_weight", lambda v: True, "a finite number")
        self._float("max_reward_error_fraction", lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
        self._choice("on_reward_error", ("stop", "continue"))
        # reward=None: the rewards come from elsewhere (Trainer's reward_funcs); from_args requires them
        if self.reward is not None and not self.reward and not self.reward_model and self.episode.env is None:
            raise ConfigError("give at least one --reward (or a --reward-model, or an --env whose rewards train)")
        if self.reward_weight and len(self.reward_weight) != len(self.reward or []):
            raise ConfigError(f"{len(self.reward_weight)} --reward-weight for {len(self.reward or [])} --reward; give "
                              "one weight per reward, in order")
        for i, w in enumerate(self.reward_weight or []):
            if not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ConfigError(f"--reward-weight must be finite numbers: weight {i + 1} (of --reward "
                                  f"{(self.reward or ['?'] * (i + 1))[i]!r}) is {w}")
        self.report_to = list(self.report_to or ["tensorboard"])
        for r in self.report_to:
            if r not in REPORT_TO:
                raise ConfigError(f"--report-to must be one of {REPORT_TO}, not {r!r}")
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ConfigError(f"--report-to none goes alone, not with {[r for r in self.report_to if r != 'none']}")
        self._check_together()

    def _check_together(self) -> None:
        """The options that tie the parts together."""
        ro, le, sy = self.rollout, self.learner, self.sync
        if le.algo == "grpo" and ro.group_size < 2:
            raise ConfigError("GRPO needs --group-size >= 2 (advantages are relative to the group)")
        if ro.dynamic_sampling and le.algo != "grpo":
            raise ConfigError(f"--dynamic-sampling drops prompt groups whose rewards are all equal: it needs --algo "
                              f"grpo, not --algo {le.algo}")
        if ro.dynamic_sampling and le.learner_processes > 1:
            raise ConfigError("--dynamic-sampling is not built for a sharded learner (--learner-processes > 1)")
        if ro.engine == "serving":
            if ro.rollout_dtype and ro.rollout_dtype != le.dtype:
                raise ConfigError(f"--rollout-dtype {ro.rollout_dtype}: the serving engine (--engine serving) "
                                  f"generates in --dtype ({le.dtype}); use --engine static for another rollout dtype")
            if le.lora_rank:
                raise ConfigError(f"--lora-rank {le.lora_rank}: the serving engine (--engine serving) does not merge "
                                  "LoRA adapters into its weights; use --engine static with LoRA")
        if sy.colocate:
            bad = [f for f, wrong in (("--engine serving", ro.engine != "serving"),
                                      ("--rollout-workers 1", ro.rollout_workers != 1),
                                      ("--learner-processes 1", le.learner_processes != 1),
                                      ("--mode sync", sy.mode != "sync"),
                                      ("--transport object_store", sy.transport != "object_store"),
                                      ("--sync-dtype float32", sy.sync_dtype != "float32"),
                                      ("--lora-rank 0", bool(le.lora_rank))) if wrong]
            if bad:
                raise ConfigError(f"--colocate (the learner and the serving engine in one process, a sync a version "
                                  f"bump) needs {', '.join(bad)}")
        n = le.learner_processes
        if n > 1:
            if le.algo != "grpo" or le.lora_rank or sy.transport != "object_store":
                raise ConfigError(f"--learner-processes {n} (a sharded learner) trains GRPO with full fine-tuning and "
                                  f"syncs through the object store: not --algo {le.algo}, --lora-rank {le.lora_rank}, "
                                  f"--transport {sy.transport}")
            if ro.prompts_per_step % n:
                raise ConfigError(f"--prompts-per-step {ro.prompts_per_step} must be a multiple of --learner-processes "
                                  f"{n} (each learner process trains on whole prompt groups)")

    @classmethod
    def from_args(cls, args) -> "RunConfig":
        """From a namespace (or mapping) of flag values: each part takes its fields, the run the rest."""
        get = args.get if isinstance(args, dict) else (lambda k, d=None: getattr(args, k, d))

        def pick(klass):
            return {f.name: get(f.name) for f in dataclasses.fields(klass)
                    if f.name not in cls.PARTS and get(f.name) is not None}

        config = cls(**{n: part(**pick(part)) for n, part in cls.PARTS.items()}, **pick(cls))
        if not config.reward and not config.reward_model and config.episode.env is None:
            raise ConfigError("give at least one --reward (or a --reward-model, or an --env whose rewards train)")
        return config

    def flags(self) -> dict:
        """The inverse of :meth:`from_args`: every option set (not None) by its flag's name (``lr``, not
        ``learner.lr``), what ``train.Trainer(config=RunConfig(...))`` applies over the defaults."""
        out = {}
        for f in dataclasses.fields(self):
            part = getattr(self, f.name)
            if f.name in self.PARTS:
                out.update({g.name: getattr(part, g.name) for g in dataclasses.fields(part)})
            else:
                out[f.name] = part
        return {k: v for k, v in out.items() if v is not None}

    def learner_kwargs(self) -> dict:
        """``learner.Learner``'s keyword arguments."""
        return self.learner.learner_kwargs(self.rollout.group_size, self.seed, self.rollout.rollout_quantization,
                                           self.rollout.max_new_tokens)

    def engine_kwargs(self) -> dict:
        """The rollout engine's keyword arguments (after :meth:`derive_from_model`)."""
        return self.rollout.engine_kwargs(self.learner.dtype)

    def derive_from_model(self, max_position_embeddings: Optional[int], weight_bytes: int) -> None:
        """The defaults that depend on the model: the prompt budget (what the context leaves after the
        response) and the local head's object store (weight syncs pass through it). A value given that
        does not fit the model stays an error."""
        ro = self.rollout
        top = max_position_embeddings or 4096
        if ro.max_new_tokens >= top:
            raise ConfigError(f"--max-new-tokens {ro.max_new_tokens} leaves no room for a prompt in the model's "
                              f"max_position_embeddings {top}")
        if ro.max_prompt_tokens is None:
            ro.max_prompt_tokens = min(DEFAULT_MAX_PROMPT_TOKENS, top - ro.max_new_tokens)
        elif ro.max_prompt_tokens + ro.max_new_tokens > top:
            raise ConfigError(f"--max-prompt-tokens {ro.max_prompt_tokens} + --max-new-tokens {ro.max_new_tokens} "
                              f"exceed the model's max_position_embeddings {top}")
        if self.ray_object_store_mb is None:
            self.ray_object_store_mb = max(200, -(-2 * weight_bytes // 2**20))
        if self.ray_num_cpus is None:
            self.ray_num_cpus = os.cpu_count() or 2
