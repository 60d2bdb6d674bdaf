"""``python -m torchtpu_rl.train``: GRPO / PPO post-training of a Hugging Face causal LM on text.

    python -m torchtpu_rl.train --model DIR --data train.jsonl --prompt-key question \\
        --reward math_answer --reward format --reward-weight 1 --reward-weight 0.1 \\
        --algo grpo --steps 200 --prompts-per-step 8 --group-size 8 --max-new-tokens 256 \\
        --eval-data test.jsonl --eval-every 20 --out runs/my_run

Every flag can also come from a YAML or TOML file (``--config run.yaml``; keys are the
flag names, with ``-`` or ``_``); flags given on the command line override it.

Outputs in ``--out``:

- ``metrics.jsonl``: one JSON object per step, appended when the step ends (``step``,
  ``reward_mean``, ``kl``, ``response_length_mean``, ``policy_version``, the seconds of each
  phase ``rollout_s`` / ``reward_s`` / ``learn_s`` / ``sync_s``, each reward's mean
  ``reward/<name>``, the learner's losses and statistics, ...);
- ``eval.jsonl``: greedy decoding of ``--eval-data`` before training, every ``--eval-every``
  steps and at the end (``accuracy``: the fraction of samples the first reward scores >= 1,
  ``reward_mean`` and each reward's mean);
- ``samples.jsonl``: at each evaluation, the first ``--eval-samples`` (prompt, completion, reward);
- ``tb/``: TensorBoard event files of the same scalars (``--report-to``: tensorboard, wandb offline,
  none); ``curves.png``: reward and eval curves;
- ``checkpoints/step_N/``: ``state.pt`` (policy, critic, optimizers, RNG, data cursor, policy
  version: :mod:`torchtpu_rl.checkpoint`) and ``run.json`` (model, algorithm, settings), every
  ``--save-every`` steps and at the end, the newest ``--keep-checkpoints`` kept; the frozen reference
  policy once in ``checkpoints/reference.pt``; ``--resume`` takes one (or a run directory: its latest
  with a ``state.pt``) and refuses one made by another model or algorithm;
- ``hf/``: the trained policy (``save_pretrained``, safetensors) and the tokenizer;
- ``summary.json``: the run's figures.

It connects to Ray from ``RAY_ADDRESS`` (so it runs unchanged under ``ray job submit``) or
starts a local head.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
import warnings
from typing import Optional

__all__ = ["build_parser", "load_config", "main", "parse_args"]

from .config import AGGREGATIONS, LOSS_TYPES, REPORT_TO, SCALE_REWARDS, ConfigError, RunConfig

RUN_FORMAT = "torchtpu_rl.train/1"
ENGINES = ("static", "serving")  # workers.ENGINES, spelled here: parsing flags imports no torch


class TrainError(ValueError):
    """A problem with the run's inputs (flags, files, checkpoint); reported without a traceback."""


# ------------------------------------------------------------------ command line and config file
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchtpu_rl.train",
                                description="GRPO / PPO post-training of a Hugging Face causal LM on text prompts, "
                                            "with rollout workers and a learner as Ray actors on tpu.")
    a = p.add_argument
    a("--config", help="YAML (.yaml/.yml), TOML (.toml) or JSON (.json) file with any of these options (or TRL / verl "
                       "names for them); flags override it")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="local Hugging Face causal-LM directory (config.json, weights, tokenizer)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter dtype")
    g.add_argument("--bf16", action="store_true", help="same as --dtype bfloat16")
    g.add_argument("--rollout-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the rollout workers' parameter dtype (default: --dtype); weights sync in --dtype")
    g.add_argument("--data", help="training prompts: .jsonl or .parquet")
    g.add_argument("--prompt-key", default="prompt", help="the prompt column (text or chat messages)")
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="auto: chat-message prompts use the tokenizer's template, text stays text; on: text "
                        "prompts become a user message too; off: refuse chat prompts")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="the largest prompt bucket (default: 512, or what the model's max_position_embeddings "
                        "leaves after --max-new-tokens when that is less)")
    g.add_argument("--on-long-prompt", choices=("skip", "error"), default="skip",
                   help="prompts above --max-prompt-tokens: skip and count them, or stop")
    g = p.add_argument_group("rewards")
    g.add_argument("--reward", action="append", default=None,
                   help="a reward: built-in name (math_answer, format, length_penalty), MODULE:FUNCTION or "
                        "FILE.py:FUNCTION, called as fn(prompts, completions, **columns); repeatable")
    g.add_argument("--reward-weight", action="append", type=float, default=None,
                   help="weight of each --reward, in order (default 1 each)")
    g.add_argument("--reward-model", help="Hugging Face sequence-classification directory scored in a reward actor")
    g.add_argument("--reward-model-weight", type=float, default=1.0)
    g.add_argument("--format-regex", help="the pattern of the built-in 'format' reward")
    g.add_argument("--length-buffer", type=int, help="the built-in length_penalty's soft zone, in tokens")
    g.add_argument("--on-reward-error", choices=("stop", "continue"), default="stop",
                   help="a reward that raises or returns NaN: stop the run, or score the sample 0 and go on")
    g.add_argument("--max-reward-error-fraction", type=float, default=0.5,
                   help="with --on-reward-error continue: stop anyway when more than this fraction of a step's "
                        "samples fail (a reward failing everywhere would train on zeros)")
    g = p.add_argument_group("multi-turn episodes: environments and tools (docs/rl.md, 'Agentic RL')")
    g.add_argument("--env", help="an environment, one instance per episode: a built-in (math_feedback, echo_turns), "
                                 "MODULE:CLASS or FILE.py:CLASS with reset(row) -> str | None and step(completion) -> "
                                 "(observation, reward, done); its rewards train (no --reward needed)")
    g.add_argument("--tools", action="append", default=None,
                   help="tools the model calls with <tool_call>{json}</tool_call>: built-ins (calculator, python), "
                        "MODULE:FUNCTION or FILE.py:FUNCTION with a JSON schema (type hints and an Args: docstring); "
                        "repeatable or comma-separated; run in a sandbox")
    g.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (default 4)")
    g.add_argument("--max-episode-tokens", type=int, default=None,
                   help="tokens after the prompt per episode (assistant turns and observations)")
    g.add_argument("--max-episode-seconds", type=float, default=None, help="wall time per episode")
    g.add_argument("--tool-timeout-s", type=float, default=5.0, help="a tool call's wall-time limit (killed after)")
    g.add_argument("--tool-cpu-s", type=int, default=5, help="a tool call's CPU-time limit")
    g.add_argument("--tool-memory-mb", type=int, default=512, help="a tool call's memory (address-space) limit")
    g.add_argument("--tool-max-output-bytes", type=int, default=16384, help="a tool call's result size limit")
    g = p.add_argument_group("algorithm and sampling")
    g.add_argument("--algo", choices=("grpo", "ppo"), default="grpo")
    g.add_argument("--steps", type=int, default=100, help="training steps of the whole run (a resume continues)")
    g.add_argument("--prompts-per-step", type=int, default=8)
    g.add_argument("--group-size", type=int, default=8, help="responses sampled per prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--kl-coef", type=float, default=0.001, help="KL to the reference policy (0: no reference)")
    g.add_argument("--ppo-epochs", type=int, default=1)
    g.add_argument("--mini-batch-size", type=int, help="rows per optimizer step (default: the whole batch)")
    g.add_argument("--micro-batch-size", type=int, help="rows per forward/backward (default: the mini-batch)")
    g.add_argument("--micro-batch-tokens", type=int, help="micro-batches by a token budget instead of rows")
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    g.add_argument("--clip-eps", type=float, default=0.2, help="the policy ratio's clip range below 1 (and above, "
                   "unless --clip-eps-high)")
    g.add_argument("--clip-eps-high", type=float, default=None, help="the clip range above 1 (DAPO's clip-higher)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus in the loss")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--loss-agg", choices=AGGREGATIONS, default=None,
                   help="how token losses make the batch's loss (default: the --loss-type's; token-mean without one)")
    # ---- the loss family, DAPO dynamic sampling, sequence packing (docs/rl.md, "Loss types")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default=None,
                   help="TRL's loss_type: grpo, bnpo, dr_grpo, dapo (adds the length_penalty overlong reward), gspo "
                        "(sequence importance ratio), rloo, reinforce_pp, cispo (default: --algo's loss)")
    g.add_argument("--scale-rewards", choices=SCALE_REWARDS, default=None,
                   help="divide advantages by the group's reward std, the batch's, or not (default: the "
                        "--loss-type's; group without one)")
    g.add_argument("--epsilon-high", dest="clip_eps_high", type=float, default=None,
                   help="TRL's name of --clip-eps-high (default: the --loss-type's: dapo 0.28, cispo 4.0)")
    g.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO: drop prompt groups whose rewards are all equal and sample more prompts to fill the "
                        "step (at most --max-sampling-rounds generation rounds)")
    g.add_argument("--max-sampling-rounds", type=int, default=4,
                   help="--dynamic-sampling: generation rounds per step at most, the first included")
    g.add_argument("--pack-sequences", action="store_true",
                   help="learner: pack sequences end to end into rows (block-diagonal attention), not padded rows")
    # ----
    g.add_argument("--rollout-quantization", choices=("none", "int8", "int8_weight_only", "fp8"), default="none",
                   help="rollout workers generate with quantized weights (int8: int8 weights and activations), "
                        "re-quantized after every weight sync")
    g.add_argument("--rollout-is", choices=("token", "sequence", "none"), default=None,
                   help="truncated importance sampling of the rollout/learner mismatch (default: token with "
                        "--rollout-quantization, else none)")
    g.add_argument("--rollout-is-threshold", type=float, default=2.0, help="the truncation threshold (> 0)")
    g.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning); "
                   "weight syncs send the adapters only")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scale numerator (updates scaled by alpha/rank)")
    g.add_argument("--lora-targets", action="append", default=None,
                   help="module names the adapters go on (repeatable or comma-separated; default all-linear)")
    g.add_argument("--lora-modules-to-save", action="append", default=None,
                   help="modules trained in full beside the adapters (peft's modules_to_save; repeatable or "
                        "comma-separated), e.g. lm_head: a small or freshly initialized model learns through its "
                        "output layer, which the adapters leave frozen")
    g = p.add_argument_group("rollout engine")
    g.add_argument("--engine", choices=ENGINES, default="static",
                   help="static: RolloutEngine (a batch per call, prompts and responses padded to buckets); serving: "
                        "ServingEngine (continuous batching over a paged KV cache with prefix sharing; no "
                        "--rollout-quantization, --rollout-dtype or LoRA)")
    g.add_argument("--max-slots", type=int, default=None,
                   help="serving: sequences decoded at once per worker (default: its share of a step's samples, "
                        "--prompts-per-step / --rollout-workers x --group-size, at most 256)")
    g.add_argument("--page-size", type=int, default=None, help="serving: tokens per KV page (default 16)")
    g.add_argument("--kv-pages", type=int, default=None,
                   help="serving: the KV budget in pages of --page-size tokens per worker (default: every slot's "
                        "longest sequence, --max-prompt-tokens + --max-new-tokens; fewer pages preempt and "
                        "recompute sequences when they run out)")
    g = p.add_argument_group("topology")
    g.add_argument("--rollout-workers", type=int, default=1)
    g.add_argument("--colocate", action="store_true",
                   help="the learner and the serving engine in one process on one device (verl's hybrid engine): "
                        "the engine reads the learner's weights (a sync is a version bump), its KV pages are "
                        "released while the learner trains; needs --engine serving, one rollout worker, --mode sync")
    g.add_argument("--requests-per-worker", type=int, default=1,
                   help="rollout requests (of whole prompt groups) per worker and step")
    g.add_argument("--learner-processes", type=int, default=1,
                   help="N > 1: the learner is N processes (one per host of a TPU slice of N hosts, TPUHostGroup) "
                        "training one FSDP2-sharded GRPO policy; weights sync through the object store")
    g.add_argument("--mode", choices=("sync", "async"), default="sync")
    g.add_argument("--max-staleness", type=int, default=1, help="async: trajectories at most this many versions old")
    g.add_argument("--transport", choices=("object_store", "collective"), default="object_store")
    g.add_argument("--sync-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: float32 weights travel to the rollout workers as bfloat16 (half the bytes)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("outputs")
    g.add_argument("--out", default="runs/rl_train", help="the run directory (a relative path is taken from the "
                   "directory the command runs in)")
    g.add_argument("--overwrite-out", action="store_true",
                   help="a fresh run (no --resume) into an --out that holds an earlier run's checkpoints deletes "
                        "them and its outputs; without it that is refused")
    g.add_argument("--keep-checkpoints", type=int, default=2,
                   help="keep the newest N checkpoints/step_N (older ones are deleted as new ones are written)")
    g.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps (0: every --save-interval-s; always at the end); a learner "
                        "that dies is restarted from the latest")
    g.add_argument("--save-interval-s", type=float, default=600.0,
                   help="with --save-every 0: checkpoint when this many seconds passed since the last one")
    g.add_argument("--eval-data", help="held-out prompts (.jsonl/.parquet), greedy-decoded and scored")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (always before and at the end)")
    g.add_argument("--eval-limit", type=int, help="use the first N eval prompts")
    g.add_argument("--resume", help="checkpoints/step_N directory, or a run directory (its latest checkpoint)")
    g.add_argument("--xla-cache", default=os.path.join("runs", "xla_cache"),
                   help="persistent XLA compilation cache shared by the actors ('' to disable)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--report-to", action="append", choices=REPORT_TO, default=None,
                   help="loggers beside the jsonl files (repeatable; default tensorboard): tensorboard (tb/), wandb "
                        "(offline mode, in --out/wandb; needs the wandb package), none")
    g.add_argument("--eval-samples", type=int, default=4,
                   help="sample completions (prompt, completion, reward) kept from each evaluation in samples.jsonl "
                        "(and TensorBoard text)")
    g = p.add_argument_group("local Ray head (started when RAY_ADDRESS is not set)")
    g.add_argument("--ray-num-cpus", type=int, default=None,
                   help="logical CPUs of the local head (default: this machine's CPU count)")
    g.add_argument("--ray-object-store-mb", type=int, default=None,
                   help="object-store size of the local head in MB (default: twice the model's weight files, at "
                        "least 200; weight syncs pass through it)")
    return p


def _trl_loss_type(v):
    if v not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {list(LOSS_TYPES)}")
    return v


def _trl_scale_rewards(v):
    table = {True: "group", "group": "group", False: "none", "none": "none", "batch": "batch"}
    if v not in table:
        raise ValueError("scale_rewards must be true/'group', 'batch' or false/'none'")
    return table[v]


# config-file keys in TRL's GRPOConfig / verl's names, with the flag each sets (and how its value reads)
CONFIG_ALIASES = {
    # TRL GRPOConfig
    "learning_rate": ("lr", None), "num_generations": ("group_size", None), "beta": ("kl_coef", None),
    "epsilon": ("clip_eps", None), "epsilon_high": ("clip_eps_high", None),
    "max_completion_length": ("max_new_tokens", None), "max_prompt_length": ("max_prompt_tokens", None),
    "loss_type": ("loss_type", _trl_loss_type), "scale_rewards": ("scale_rewards", _trl_scale_rewards),
    "num_iterations": ("ppo_epochs", None), "per_device_train_batch_size": ("micro_batch_size", None),
    "max_grad_norm": ("grad_clip", None), "max_steps": ("steps", None), "output_dir": ("out", None),
    "save_steps": ("save_every", None), "eval_steps": ("eval_every", None),
    "save_total_limit": ("keep_checkpoints", None), "report_to": ("report_to", None),
    # verl (actor / rollout options)
    "clip_ratio": ("clip_eps", None), "clip_ratio_low": ("clip_eps", None), "clip_ratio_high": ("clip_eps_high", None),
    "entropy_coeff": ("entropy_coef", None), "kl_loss_coef": ("kl_coef", None), "loss_agg_mode": ("loss_agg", None),
    "ppo_mini_batch_size": ("mini_batch_size", None), "ppo_micro_batch_size_per_gpu": ("micro_batch_size", None),
    "response_length": ("max_new_tokens", None), "grad_clip": ("grad_clip", None),
}


def load_config(path: str, parser: Optional[argparse.ArgumentParser] = None) -> dict:
    """The options in a YAML or TOML file, keyed by their ``argparse`` names, or by TRL's ``GRPOConfig`` /
    verl's names where they mean the same (:data:`CONFIG_ALIASES`); an unknown key, or one option given
    twice under two names, is an error naming the file and the key."""
    parser = parser or build_parser()
    if not os.path.isfile(path):
        raise TrainError(f"config file {path!r} does not exist")
    low = path.lower()
    try:
        if low.endswith(".toml"):
            import tomllib

            with open(path, "rb") as f:
                raw = tomllib.load(f)
        elif low.endswith((".yaml", ".yml")):
            import yaml

            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        elif low.endswith(".json"):
            with open(path) as f:
                raw = json.load(f)
        else:
            raise TrainError(f"config file {path!r}: use .yaml, .yml, .toml or .json")
    except TrainError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised naming the file
        raise TrainError(f"cannot read config file {path!r}: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise TrainError(f"config file {path!r} must hold a mapping of options, not a {type(raw).__name__}")
    return _options_from_mapping(raw, f"config file {path!r}", parser)


def _options_from_mapping(raw: dict, where: str, parser: argparse.ArgumentParser) -> dict:
    """``raw``'s options keyed by their ``argparse`` names (see :func:`load_config`); errors name ``where``."""
    known = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out = {}
    named = {}
    for key, value in raw.items():
        dest = str(key).replace("-", "_")
        if dest in CONFIG_ALIASES:
            dest, read = CONFIG_ALIASES[dest]
            if read is not None:
                try:
                    value = read(value)
                except ValueError as e:
                    raise TrainError(f"{where}: {e}, not {value!r}") from None
        if dest in named:
            raise TrainError(f"{where}: {key!r} and {named[dest]!r} both set --{dest.replace('_', '-')}")
        named[dest] = key
        if dest not in known:
            raise TrainError(f"{where}: unknown option {key!r} (options: "
                             f"{', '.join(sorted(k.replace('_', '-') for k in known))})")
        action = known[dest]
        if isinstance(action, argparse._AppendAction) and not isinstance(value, list):
            value = [value]
        if action.choices is not None and value not in action.choices:
            raise TrainError(f"{where}: {key} must be one of {list(action.choices)}, not {value!r}")
        if action.type is not None and value is not None:
            try:
                value = [action.type(v) for v in value] if isinstance(value, list) else action.type(value)
            except (TypeError, ValueError):
                raise TrainError(f"{where}: {key}={value!r} is not a valid "
                                 f"{getattr(action.type, '__name__', action.type)}") from None
        out[dest] = value
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Defaults < the ``--config`` file < command-line flags."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    lists = {}
    if first.config:
        cfg = load_config(first.config, parser)
        # repeatable flags given on the command line replace the file's list (argparse would append to it)
        appends = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction)}
        lists = {k: cfg.pop(k) for k in list(cfg) if k in appends}
        parser.set_defaults(**cfg)
    args = parser.parse_args(argv)
    for k, v in lists.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.bf16:
        args.dtype = "bfloat16"
    return args


# ------------------------------------------------------------------ checks
def _check_args(args) -> RunConfig:
    """The flags as a :class:`~torchtpu_rl.config.RunConfig` (every range and combination checked there)."""
    for name in ("model", "data"):
        if not getattr(args, name):
            raise TrainError(f"--{name} is required (on the command line or in --config)")
    try:
        config = RunConfig.from_args(args)
    except ConfigError as e:
        raise TrainError(str(e)) from e
    args.report_to = config.report_to
    if "wandb" in args.report_to:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise TrainError("--report-to wandb needs the wandb package (pip install wandb); it logs in offline mode")
    return config


def _is_checkpoint(d: str) -> bool:
    """run.json is written last, but a copy or a cleanup can still leave it without its state.pt."""
    return os.path.isfile(os.path.join(d, "run.json")) and os.path.isfile(os.path.join(d, "state.pt"))


def _checkpoint_steps(out: str) -> list:
    """The step numbers of ``out/checkpoints/step_N`` that hold a run.json (complete or not), ascending."""
    ck = os.path.join(out, "checkpoints")
    names = os.listdir(ck) if os.path.isdir(ck) else []
    return sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()
                  and os.path.isfile(os.path.join(ck, n, "run.json")))


def _checkpoint_dir(path: str) -> str:
    """A checkpoint directory (has run.json and state.pt), or a run directory's latest complete one."""
    if os.path.isfile(os.path.join(path, "run.json")):
        return path
    ck = os.path.join(path, "checkpoints")
    steps = _checkpoint_steps(path)
    if not steps:
        raise TrainError(f"--resume {path!r}: not a checkpoint directory (no run.json) and no checkpoints/step_N "
                         "inside it")
    whole = [n for n in steps if _is_checkpoint(os.path.join(ck, f"step_{n}"))]
    if not whole:
        raise TrainError(f"--resume {path!r}: none of its checkpoints {['step_%d' % n for n in steps]} has a "
                         "state.pt")
    torn = [n for n in steps if n > whole[-1]]
    if torn:
        warnings.warn(f"--resume {path!r}: skipping newer checkpoint(s) {['step_%d' % n for n in torn]} without a "
                      f"state.pt; resuming from step_{whole[-1]}", UserWarning, stacklevel=2)
    return os.path.join(ck, f"step_{whole[-1]}")


def _prepare_out(args) -> None:
    """A fresh run (no --resume) must not leave an earlier run's checkpoints in --out, where a later --resume
    of this directory would pick them: refused unless --overwrite-out, which deletes them and its outputs."""
    if args.resume or not os.path.isdir(args.out):
        return
    steps = _checkpoint_steps(args.out)
    if steps and not args.overwrite_out:
        raise TrainError(f"--out {args.out!r} holds checkpoints of an earlier run (step_{steps[-1]} the newest): "
                         f"continue it with --resume {args.out!r}, choose another --out, or pass --overwrite-out "
                         "to delete them")
    import shutil

    for name in ("checkpoints", "hf"):
        shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
    for name in ("summary.json", "curves.png"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.out, name))


def _prune_checkpoints(ckpts: str, keep: int) -> list:
    """Delete all but the newest ``keep`` complete step_N directories (and any older torn ones)."""
    from .checkpoint_policy import CheckpointPolicy, remove_checkpoint

    steps = _checkpoint_steps(os.path.dirname(ckpts))
    whole = [n for n in steps if _is_checkpoint(os.path.join(ckpts, f"step_{n}"))]
    stale = set(CheckpointPolicy(keep=keep).stale(whole))
    gone = [n for n in steps if n in stale or (n not in whole and whole and n < whole[-1])]
    for n in gone:
        remove_checkpoint(os.path.join(ckpts, f"step_{n}"))
    return gone


def _check_resume(ckpt: str, args, fingerprint: dict) -> dict:
    if not os.path.isfile(os.path.join(ckpt, "state.pt")):
        raise TrainError(f"--resume {ckpt!r}: state.pt is missing")
    try:
        with open(os.path.join(ckpt, "run.json")) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise TrainError(f"--resume {ckpt!r}: run.json is not valid JSON ({e})") from e
    if meta.get("format") != RUN_FORMAT:
        raise TrainError(f"--resume {ckpt!r}: run.json has format {meta.get('format')!r}, expected {RUN_FORMAT!r}")
    if meta["algo"] != args.algo:
        raise TrainError(f"refusing to resume from {ckpt!r}: it is a checkpoint of a {meta['algo']} run, this run is "
                         f"{args.algo} (--algo); its optimizer and critic state do not carry over")
    diff = [k for k in sorted(set(fingerprint) | set(meta["model_fingerprint"]))
            if fingerprint.get(k) != meta["model_fingerprint"].get(k)]
    if diff:
        theirs = meta["model_fingerprint"]
        detail = ", ".join(f"{k}: {theirs.get(k)!r} there, {fingerprint.get(k)!r} here" for k in diff)
        raise TrainError(f"refusing to resume from {ckpt!r}: it was made with model {meta['model']!r}, a different "
                         f"model from --model {args.model!r} ({detail})")
    if meta.get("dtype", "float32") != args.dtype:
        raise TrainError(f"refusing to resume from {ckpt!r}: its weights are {meta.get('dtype')}, this run asks for "
                         f"{args.dtype} (--dtype)")
    if meta.get("seed") != args.seed:
        raise TrainError(f"refusing to resume from {ckpt!r}: it was made with --seed {meta.get('seed')}, this run has "
                         f"--seed {args.seed} (rollout seeds and the data order follow the seed)")
    if meta.get("data") != _data_id(args.data):
        warnings.warn(f"resuming from {ckpt!r} (made with --data {meta.get('data')!r}) on --data {args.data!r}: the "
                      "data cursor continues at the same position", UserWarning, stacklevel=2)
    return meta


def _lora_spec(args, cfg):
    """The LoRA settings, their targets checked against the model's layers (built on the meta device)."""
    if not args.lora_rank:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from .lora import LoraSpec

    def names(items):
        return tuple(t.strip() for item in items for t in item.split(",") if t.strip())

    try:
        spec = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, targets=names(args.lora_targets or ["all-linear"]),
                        modules_to_save=names(args.lora_modules_to_save or []))
        with torch.device("meta"):
            spec.saved_modules(AutoModelForCausalLM.from_config(cfg))  # checks the targets too
    except ValueError as e:
        raise TrainError(str(e)) from e
    return spec


# ------------------------------------------------------------------ outputs
def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v




class _NoWriter:
    """The TensorBoard writer's surface when ``--report-to`` leaves TensorBoard out."""

    def add_scalar(self, *a, **k):
        pass

    def add_text(self, *a, **k):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class _Outputs:
    """metrics.jsonl, eval.jsonl, samples.jsonl (always: resume reads them) and the ``--report-to`` loggers
    (TensorBoard, W&B in offline mode), appended as the run goes."""

    STEP_KEYS = {"rollout_wait_s": "rollout_s", "learner_call_s": "learn_s"}

    def __init__(self, out: str, resume_step: Optional[int], report_to=("tensorboard",), config=None):
        self.out = out
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        self.eval_path = os.path.join(out, "eval.jsonl")
        self.samples_path = os.path.join(out, "samples.jsonl")
        paths = (self.metrics_path, self.eval_path, self.samples_path)
        if resume_step is not None:  # rows of steps after the checkpoint are redone: drop them
            for path in paths:
                self._truncate(path, resume_step)
        else:  # a fresh run: no rows or event files of an earlier run in this directory
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
            tb = os.path.join(out, "tb")
            for name in (os.listdir(tb) if os.path.isdir(tb) else []):
                if name.startswith("events.out.tfevents."):
                    os.remove(os.path.join(tb, name))
        self.tb = _NoWriter()
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out, "tb"), purge_step=(resume_step + 1) if resume_step else None)
        self.wandb = None
        if "wandb" in report_to:
            import wandb

            self.wandb = wandb.init(mode="offline", dir=out, config=config, resume="allow")

    def _log(self, prefix: str, row: dict) -> None:
        scalars = {f"{prefix}/{k}": v for k, v in row.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and v is not None and math.isfinite(v)}
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def samples(self, step: int, prompts, completions, rewards) -> list:
        """Sample completions of an evaluation: one row each (prompt, completion, reward)."""
        rows = [{"step": step, "prompt": p, "completion": c, "reward": r}
                for p, c, r in zip(prompts, completions, rewards)]
        for row in rows:
            self._append(self.samples_path, row)
        if rows:
            table = "| prompt | completion | reward |\n|---|---|---|\n" + "\n".join(
                f"| {r['prompt'][-200:]!r} | {r['completion'][:200]!r} | {r['reward']:.3g} |" for r in rows)
            self.tb.add_text("eval/samples", table, step)
        return rows

    @staticmethod
    def _truncate(path: str, step: int) -> None:
        if not os.path.exists(path):
            return
        rows = _read_jsonl(path)  # a torn last line (a run killed mid-write) is dropped here
        with open(path, "w") as f:
            for r in rows:
                if r.get("step", 0) <= step:
                    f.write(json.dumps(r) + "\n")

    @staticmethod
    def _append(path: str, row: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def step(self, m: dict, last_sync: dict) -> dict:
        row = {"step": m["step"], "policy_version": m["policy_version"], "reward_mean": m["reward_mean"],
               "reward_std": m["reward_std"], "kl": m.get("kl"), "response_length_mean": m.get("response_length_mean"),
               "rollout_s": m["rollout_wait_s"], "reward_s": m["reward_s"], "learn_s": m["learner_call_s"],
               # async: the sync overlaps the next step; this is the last one that finished
               "sync_s": m["sync_s"] if m.get("sync_s") is not None else last_sync.get("sync_s"),
               "step_s": m["step_s"], "time": time.time()}
        skip = {"rollout_versions", "reward_mean", "reward_std"}
        for k, v in m.items():
            numeric = isinstance(v, (int, float)) or v is None
            if numeric and k not in row and k not in skip and k not in self.STEP_KEYS:
                row[k] = v
        self._append(self.metrics_path, row)
        self._log("train", row)
        return row

    def eval(self, e: dict) -> dict:
        row = {k: v for k, v in e.items() if k not in ("rewards", "values")}
        self._append(self.eval_path, row)
        self._log("eval", row)
        return row

    def drop_after(self, step: int) -> None:
        """Forget the rows of steps after ``step`` (redone after a learner restart)."""
        for path in (self.metrics_path, self.eval_path, self.samples_path):
            self._truncate(path, step)

    def close(self):
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _read_jsonl(path: str) -> list:
    """The rows of a jsonl file; a torn last line (the run was killed while appending it) is left out with a
    warning, a bad line before it is an error naming the file and the line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [(i + 1, line) for i, line in enumerate(f) if line.strip()]
    rows = []
    for k, (no, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k < len(lines) - 1:
                raise TrainError(f"{path!r} line {no} is not valid JSON ({e}); only a torn last line is "
                                 "recovered from") from e
            warnings.warn(f"{path!r}: dropping its torn last line {no} ({line[:60]!r}...)", UserWarning, stacklevel=2)
    return rows


def plot_curves(out: str, title: str = "") -> str:
    """``curves.png`` in ``out``: training reward (and KL) per step, eval accuracy / reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, evals = _read_jsonl(os.path.join(out, "metrics.jsonl")), _read_jsonl(os.path.join(out, "eval.jsonl"))
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    handles = []
    if rows:
        steps = [r["step"] for r in rows]
        handles += ax[0].plot(steps, [r["reward_mean"] for r in rows], label="train reward (mean)")
        if any(r.get("kl") is not None for r in rows):
            k = ax[0].twinx()
            handles += k.plot(steps, [r.get("kl") if r.get("kl") is not None else float("nan") for r in rows],
                              color="C2", alpha=0.5, label="KL to reference (right axis)")
            k.set_ylabel("KL")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("reward")
    if handles:
        ax[0].legend(handles=handles, loc="upper left")
    ax[0].set_title(title or "training")
    if evals:
        es = [e["step"] for e in evals]
        if any(e.get("accuracy") is not None for e in evals):
            ax[1].plot(es, [e.get("accuracy") for e in evals], "o-", label="eval accuracy")
        ax[1].plot(es, [e["reward_mean"] for e in evals], "s--", label="eval reward (mean)")
        ax[1].legend()
    ax[1].set_xlabel("step")
    ax[1].set_title("held-out (greedy)")
    fig.tight_layout()
    path = os.path.join(out, "curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fingerprint_name(fp: dict) -> str:
    return (fp.get("architectures") or [fp.get("model_type") or "model"])[0]


def _accuracy(e: dict, reward_name: Optional[str]) -> Optional[float]:
    values = (e.get("values") or {}).get(reward_name) if reward_name else None
    if not values:
        return None
    return sum(1.0 for v in values if v is not None and v >= 1.0) / len(values)


# ------------------------------------------------------------------ the run
def _setup(args) -> dict:
    """Everything that is checked before any actor starts: model, tokenizer, data, rewards, resume. A
    problem with any of them is a :class:`TrainError` (exit 2) naming it."""
    try:
        return _check_inputs(args)
    except TrainError:
        raise
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise TrainError(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)) from e


def _check_inputs(args) -> dict:
    from . import hf
    from .data import load_prompts
    from .rewards import resolve_reward
    from .rollout import SamplingParams

    config = _check_args(args)
    args.out = os.path.abspath(args.out)  # the actors' working directory is not this one
    cfg = hf.causal_lm_config(args.model)  # refuses a directory that is not a causal LM, before any actor starts
    weight_files = hf.check_weights(args.model, "--model")
    config.derive_from_model(getattr(cfg, "max_position_embeddings", None),
                             sum(os.path.getsize(os.path.join(args.model, f)) for f in weight_files))
    for name in ("ray_num_cpus", "ray_object_store_mb"):  # (run.json keeps the flags as run)
        setattr(args, name, getattr(config, name))
    args.max_prompt_tokens = config.rollout.max_prompt_tokens
    lora = _lora_spec(args, cfg)
    fingerprint = hf.model_fingerprint(args.model)
    tokenizer = hf.load_tokenizer(args.model)
    hf.check_tokenizer_fits(tokenizer, cfg, args.model)
    if args.reward_model:
        hf.reward_model_config(args.reward_model)
    ckpt = meta = None
    if args.resume:
        ckpt = os.path.abspath(_checkpoint_dir(args.resume))
        meta = _check_resume(ckpt, args, fingerprint)
    _prepare_out(args)
    chat = {"auto": None, "on": True, "off": False}[args.chat_template]
    engine_kwargs = config.engine_kwargs()
    episodes = _episode_spec(config, tokenizer, args) if config.episode.enabled else None
    tools = [t.schema for t in episodes.tools] if episodes is not None else None  # rendered into the prompts
    dataset = load_prompts(args.data, tokenizer, args.prompt_key, max_prompt_tokens=args.max_prompt_tokens,
                           on_long_prompt=args.on_long_prompt, chat_template=chat, seed=args.seed, tools=tools)
    eval_set = None
    if args.eval_data:
        eval_set = load_prompts(args.eval_data, tokenizer, args.prompt_key, max_prompt_tokens=args.max_prompt_tokens,
                                on_long_prompt=args.on_long_prompt, chat_template=chat, seed=args.seed, shuffle=False,
                                limit=args.eval_limit, tools=tools)
    opts = {"max_new_tokens": args.max_new_tokens, "format_regex": args.format_regex,
            "length_buffer": args.length_buffer}
    specs = list(args.reward or [])
    weights = list(args.reward_weight or [1.0] * len(specs))
    if args.loss_type == "dapo" and "length_penalty" not in specs:
        # DAPO's overlong reward shaping: 0 up to max_new_tokens - buffer, then down to -1 (--length-buffer)
        specs.append("length_penalty")
        weights.append(1.0)
    rewards = [resolve_reward(r, **opts) if isinstance(r, str) else _named_reward(r) for r in specs]
    if episodes is not None:
        engine_kwargs["episodes"] = episodes
        if config.episode.env is not None:  # the environment's reward first: eval accuracy reads it
            from .rewards import env_reward

            rewards.insert(0, ("env_reward", env_reward))
            weights.insert(0, 1.0)
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = hf.generation_eos_ids(args.model)
    stops.update(gen_eos)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, stop_token_ids=tuple(sorted(stops)))
    return dict(config=config, tokenizer=tokenizer, fingerprint=fingerprint, ckpt=ckpt, meta=meta, dataset=dataset,
                eval_set=eval_set, lora=lora, rewards=rewards, weights=weights, sampling=sampling,
                engine_kwargs=engine_kwargs, learner_kwargs=config.learner_kwargs())


def _episode_spec(config, tokenizer, args):
    """The rollout workers' :class:`~torchtpu_rl.episodes.EpisodeSpec`: the environment class and the tools
    resolved and checked here (a bad class, a tool without a schema, a template that cannot render tools:
    a TrainError naming the flag, before Ray starts)."""
    from .environments import resolve_env
    from .episodes import EpisodeSpec
    from .sandbox import SandboxLimits
    from .tools import check_template_renders_tools, resolve_tools

    ep = config.episode
    env = None
    if ep.env is not None:
        resolve_env(ep.env)  # raises naming --env
        target, sep, attr = ep.env.rpartition(":")
        # a file path travels absolute: the actors' working directory is not this one
        env = f"{os.path.abspath(target)}:{attr}" if sep and target.endswith(".py") else ep.env
    tools = resolve_tools(ep.tools or [])
    chat = args.chat_template != "off" and bool(getattr(tokenizer, "chat_template", None))
    if tools:
        if not chat:
            raise TrainError("--tools needs the tokenizer's chat template (it renders the tools and their results); "
                             f"this run has --chat-template {args.chat_template} and a tokenizer "
                             f"{'with' if getattr(tokenizer, 'chat_template', None) else 'without'} one")
        check_template_renders_tools(tokenizer, tools)
    limits = SandboxLimits(timeout_s=ep.tool_timeout_s, cpu_s=ep.tool_cpu_s, memory_mb=ep.tool_memory_mb,
                           max_output_bytes=ep.tool_max_output_bytes)
    return EpisodeSpec(tokenizer=tokenizer, env=env, tools=tuple(tools), max_turns=ep.max_turns,
                       max_episode_tokens=ep.max_episode_tokens, max_episode_seconds=ep.max_episode_seconds,
                       max_context_tokens=config.rollout.max_prompt_tokens, chat=chat, sandbox=limits)


def _save(driver, topo, args, fingerprint, out_ckpts: str) -> str:
    d = os.path.join(out_ckpts, f"step_{driver.step_idx}")
    os.makedirs(d, exist_ok=True)
    # also the driver's last_checkpoint (learner restarts); the frozen reference policy is stored once
    driver.save_checkpoint(os.path.join(d, "state.pt"), os.path.join(out_ckpts, "reference.pt"))
    meta = {"format": RUN_FORMAT, "step": driver.step_idx, "policy_version": driver.learner_version,
            "algo": args.algo, "model": os.path.abspath(args.model), "model_fingerprint": fingerprint,
            "dtype": args.dtype, "seed": args.seed, "data": _data_id(args.data),
            "config": {k: v for k, v in vars(args).items()}, "saved_at": time.time()}
    tmp = os.path.join(d, "run.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, default=_described)
    os.replace(tmp, os.path.join(d, "run.json"))  # run.json last: its presence marks a whole checkpoint
    _prune_checkpoints(out_ckpts, args.keep_checkpoints)
    return d


def _data_id(data) -> str:
    return os.path.abspath(data) if isinstance(data, (str, os.PathLike)) else _described(data)


def _described(obj) -> str:
    """What run.json records for a value that is not JSON (a reward function, an in-memory dataset)."""
    if callable(obj):
        return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"
    n = len(obj) if hasattr(obj, "__len__") else "?"
    return f"<{type(obj).__module__}.{type(obj).__name__} of {n} rows>"


def _named_reward(r) -> tuple:
    if isinstance(r, tuple) and len(r) == 2 and callable(r[1]):
        return str(r[0]), r[1]
    if callable(r):
        return getattr(r, "__name__", type(r).__name__), r
    raise TrainError(f"a reward must be a built-in name, 'MODULE:FUNCTION', a callable or a (name, callable) pair, "
                     f"not {r!r}")


class Trainer:
    """GRPO / PPO post-training in the shape TRL users know:

        Trainer(model="models/qwen", reward_funcs=[my_reward, "format"], config="run.yaml",
                train_dataset="train.jsonl").train()

    ``model``: a local Hugging Face causal-LM directory. ``reward_funcs``: built-in names, ``MODULE:FUNCTION``
    specs, callables ``fn(prompts, completions, **columns) -> list`` or ``(name, fn)`` pairs. ``config``: a
    :class:`~torchtpu_rl.config.RunConfig` (its fields are the flags' names; its ``reward`` may stay None
    when ``reward_funcs`` are given, as a TRL ``GRPOConfig`` has none), a YAML/TOML/JSON file, a mapping (flag names or TRL ``GRPOConfig`` / verl names, :data:`CONFIG_ALIASES`)
    or an ``argparse.Namespace`` of :func:`parse_args`. ``train_dataset`` / ``eval_dataset``: a jsonl or
    parquet path, a ``datasets.Dataset`` or a list of dicts. ``python -m torchtpu_rl.train`` is this class
    over the command line. Everything is checked when it is built (:class:`TrainError`, before Ray starts);
    :meth:`train` runs and returns the summary. Further keyword ``options`` are flags by name
    (``prompt_key="messages"``, ``out="runs/x"``), applied over ``config``'s.
    """

    def __init__(self, model=None, reward_funcs=None, config=None, train_dataset=None, eval_dataset=None,
                 reward_weights=None, **options):
        if isinstance(config, argparse.Namespace):
            if options:
                raise TrainError(f"Trainer: options {sorted(options)} beside an argparse.Namespace config: set "
                                 "them on the namespace")
            args = config
        else:
            parser = build_parser()
            args = parser.parse_args([])
            if isinstance(config, (str, os.PathLike)):
                opts = load_config(os.fspath(config), parser)
            elif isinstance(config, RunConfig):
                opts = config.flags()
            elif isinstance(config, dict):
                opts = _options_from_mapping(config, "config", parser)
            elif config is None:
                opts = {}
            else:
                raise TrainError(f"Trainer: config must be a RunConfig, a file path, a mapping or an argparse.Namespace, not "
                                 f"{type(config).__name__}")
            if options:  # flag-named options over the config's (``prompt_key="messages"``, ``out=...``)
                opts.update(_options_from_mapping(options, "Trainer", parser))
            for k, v in opts.items():
                setattr(args, k, v)
            if args.bf16:
                args.dtype = "bfloat16"
        for name, value in (("model", model), ("data", train_dataset), ("eval_data", eval_dataset),
                            ("reward_weight", reward_weights)):
            if value is not None:
                setattr(args, name, os.fspath(value) if isinstance(value, os.PathLike) else value)
        if reward_funcs is not None:
            args.reward = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
            if args.reward_weight is not None:
                args.reward_weight = [float(w) for w in args.reward_weight]
        self.args = args
        self.setup = _setup(args)

    def train(self) -> dict:
        """Run training; returns the summary (also written to ``summary.json``)."""
        return _run(self.args, self.setup)


def main(argv=None) -> dict:
    """Run training from the command line; returns the summary (also written to ``summary.json``)."""
    return Trainer(config=parse_args(argv)).train()


def _run(args, s: dict) -> dict:
    t_start = time.perf_counter()
    if args.xla_cache:
        os.environ.setdefault("TORCHTPU_CACHE_DIR", os.path.abspath(args.xla_cache))
    import ray

    from . import hf
    from .checkpoint_policy import CheckpointPolicy
    from .driver import RLDriver, ray_session
    from .rewards import RewardSet
    from .topology import make_topology
    from .workers import ActorReward

    os.makedirs(args.out, exist_ok=True)
    tokenizer = s["tokenizer"]
    policy_fn = functools.partial(hf.load_policy, os.path.abspath(args.model), dtype=args.dtype, device="cpu")
    with ray_session(num_cpus=args.ray_num_cpus, object_store_memory=args.ray_object_store_mb * 2**20):
        ray_address = ray.get_runtime_context().gcs_address
        topo = make_topology(policy_fn, tokenizer.pad_token_id, num_rollout_workers=args.rollout_workers,
                             algo=args.algo, learner_kwargs=s["learner_kwargs"], engine_kwargs=s["engine_kwargs"],
                             seed=args.seed, lora=s["lora"], learner_processes=args.learner_processes,
                             colocate=args.colocate,
                             sync_dtype=None if args.sync_dtype == "float32" else args.sync_dtype,
                             reward_model_dir=os.path.abspath(args.reward_model) if args.reward_model else None)
        outputs = None
        try:
            rewards = list(s["rewards"])
            weights = list(s["weights"])
            if topo.rewards is not None:
                rewards.append(("reward_model", ActorReward(topo.rewards)))
                weights.append(args.reward_model_weight)
            reward_set = RewardSet(rewards, weights)
            acc_name = reward_set.names[0]
            driver = RLDriver(topo, s["dataset"], reward_set, sampling=s["sampling"],
                              prompts_per_step=args.prompts_per_step, group_size=args.group_size, mode=args.mode,
                              max_staleness=args.max_staleness, transport=args.transport, seed=args.seed,
                              requests_per_worker=args.requests_per_worker,
                              on_reward_error=args.on_reward_error,
                              max_reward_error_fraction=args.max_reward_error_fraction, tokenizer=tokenizer,
                              dynamic_sampling=args.max_sampling_rounds if args.dynamic_sampling else 0)
            resume_step = None
            if s["ckpt"]:
                driver.load_checkpoint(os.path.join(s["ckpt"], "state.pt"))
                resume_step = driver.step_idx
                print(f"resumed from {s['ckpt']} at step {resume_step} (policy version {driver.learner_version})",
                      flush=True)
            outputs = _Outputs(args.out, resume_step, args.report_to,
                               config={k: _described(v) if callable(v) else v for k, v in vars(args).items()
                                       if isinstance(v, (str, int, float, bool, list, type(None)))})
            ckpts = os.path.join(args.out, "checkpoints")
            last = {"eval": None, "save": None}
            policy = CheckpointPolicy(args.save_every or None, args.save_interval_s, args.keep_checkpoints)
            if resume_step is None:  # a learner that dies before the first periodic checkpoint restarts here
                _save(driver, topo, args, s["fingerprint"], ckpts)

            def learner_restored(drv, step):  # steps after the checkpoint are redone: drop their rows
                outputs.drop_after(step)
                history[:] = [h for h in history if h["step"] <= step]
                last["save"] = step

            def evaluate():
                if s["eval_set"] is None:
                    return None
                e = driver.evaluate(s["eval_set"])
                e["accuracy"] = _accuracy(e, acc_name)
                last["eval"] = driver.step_idx
                n = min(args.eval_samples, len(e["rewards"]))
                if n:
                    texts = tokenizer.batch_decode(driver.last_eval_batch.responses()[:n], skip_special_tokens=True)
                    outputs.samples(driver.step_idx, [s["eval_set"].text(i) for i in range(n)], texts,
                                    e["rewards"][:n])
                return outputs.eval(e)

            first_eval = evaluate() if resume_step is None else None
            history = []

            def on_step(m):
                history.append(outputs.step(m, driver.last_sync))
                if args.eval_every and driver.step_idx % args.eval_every == 0:
                    evaluate()
                if policy.due(driver.step_idx):
                    _save(driver, topo, args, s["fingerprint"], ckpts)
                    last["save"] = driver.step_idx
                    policy.saved()

            driver.on_learner_restored = learner_restored

            remaining = max(0, args.steps - driver.step_idx)
            t_train = time.perf_counter()
            driver.run(remaining, progress=not args.no_progress, on_step=on_step)
            train_s = time.perf_counter() - t_train
            if last["save"] != driver.step_idx:
                _save(driver, topo, args, s["fingerprint"], ckpts)
            final_eval = evaluate() if last["eval"] != driver.step_idx else None
            hf_dir = ray.get(topo.learner.save_hf.remote(os.path.abspath(os.path.join(args.out, "hf")), tokenizer))
            events = driver.events
        finally:
            if outputs is not None:
                outputs.close()
            topo.shutdown()
    evals = _read_jsonl(os.path.join(args.out, "eval.jsonl"))
    rows = _read_jsonl(os.path.join(args.out, "metrics.jsonl"))
    name = f"{fingerprint_name(s['fingerprint'])} ({os.path.basename(os.path.abspath(args.model))})"
    plot = plot_curves(args.out, f"{args.algo.upper()} on {name}")
    summary = {
        "algo": args.algo, "model": os.path.abspath(args.model), "steps": len(rows), "final_step": driver.step_idx,
        "resumed_from": s["ckpt"], "train_steps_this_run": len(history), "train_s": train_s,
        "wall_s": time.perf_counter() - t_start, "prompts": len(s["dataset"]), "prompts_skipped": s["dataset"].skipped,
        "first_reward": rows[0]["reward_mean"] if rows else None,
        "final_reward": (sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:])) if rows else None,
        "eval_first": evals[0] if evals else None, "eval_final": evals[-1] if evals else None,
        "hf_dir": hf_dir, "curves": plot, "ray_address": ray_address, "events": events,
        "first_eval_this_run": first_eval, "final_eval_this_run": final_eval,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print(json.dumps({k: summary[k] for k in ("steps", "train_s", "first_reward", "final_reward")}, default=str))
    if evals:
        print(f"eval accuracy {evals[0].get('accuracy')} (step {evals[0]['step']}) -> {evals[-1].get('accuracy')} "
              f"(step {evals[-1]['step']})", flush=True)
    return summary


def cli(argv=None) -> int:
    try:
        main(argv)
    except TrainError as e:
        print(f"python -m torchtpu_rl.train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
