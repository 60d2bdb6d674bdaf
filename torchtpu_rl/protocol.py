"""The one data protocol between the RL controller (the driver) and its workers.

Everything that crosses a process boundary in a run is one of these types, and this module
imports nothing else of ``torchtpu_rl`` (the bottom floor: the rollout engines, the learner,
the workers and the driver all stand on it, and the learner and the rollout engines never
import each other):

- :class:`SamplingParams`: how to sample.
- :class:`RolloutBatch`: trajectories, batch dim first in every tensor (B rows; P prompt and
  R response columns). ``concat`` / ``split`` / ``select`` reshape it on the batch dim.
- :class:`RolloutRequest` / :class:`RolloutResult`: one unit of rollout work (whole prompt
  groups, a seed) and what a worker returns for it (the batch as host tensors, the version
  that generated it). :func:`split_groups` cuts a step's prompts into requests of whole
  groups; :func:`gather_results` puts the results back together in request order: the
  ``split by whole groups`` / ``concat`` pair of the rollout group's dispatch.
- The wire errors: :class:`WorkerNotReady`, :class:`LearnerRestarted` (raised inside actors)
  and :class:`LearnerDied` (raised in the driver when the learner process is gone).
- :func:`engine_stats`: the serving engine's per-call figures combined over a step's results.

A weight update (``weight_sync.WeightUpdate``: the version, the plan, the object references of
its buckets) is the fourth message kind; it lives with the sender and receiver that make it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "LearnerDied",
    "LearnerRestarted",
    "RolloutBatch",
    "RolloutRequest",
    "RolloutResult",
    "RewardRequest",
    "SamplingParams",
    "StepRollouts",
    "WorkerNotReady",
    "engine_stats",
    "gather_results",
    "seed_for",
    "split_groups",
    "split_rewards",
]


# ================================================================= sampling
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1.0 are off;
    a sequence ends after ``max_new_tokens`` or at the first token in ``stop_token_ids``
    (which is kept in the response)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple = ()

    def __post_init__(self):
        try:
            n = operator.index(self.max_new_tokens)
        except TypeError:
            raise TypeError(f"SamplingParams.max_new_tokens must be an int, not {self.max_new_tokens!r}") from None
        if n < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, not {n}")
        t = float(self.temperature)
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 and finite, not {self.temperature!r}")
        k = operator.index(self.top_k)
        if k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), not {k}")
        p = float(self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], not {self.top_p!r}")
        stops = self.stop_token_ids
        if isinstance(stops, int):
            stops = (stops,)
        stops = tuple(operator.index(s) for s in stops)
        if any(s < 0 for s in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, not {stops}")
        object.__setattr__(self, "max_new_tokens", n)
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_k", k)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ================================================================= batch of trajectories
@dataclasses.dataclass
class RolloutBatch:
    """Trajectories of one or more generate calls (on the host unless moved).

    - ``prompt_ids`` (B, P) int64, left-padded with ``pad_id``; ``prompt_mask`` (B, P) int64.
    - ``response_ids`` (B, R) int64, right-padded; ``response_mask`` (B, R) bool, True at
      generated tokens (a stop token included).
    - ``logprobs`` (B, R) float32: log-prob of each sampled token under the policy that sampled
      it (0 at padding).
    - ``policy_version`` (B,) int64: the policy version that produced each sequence.
    - ``stopped`` (B,) bool: the sequence ended with a stop token (else at max_new_tokens).
    - ``temperature``: the sampling temperature (the learner scores log-probs with it).
    - ``token_versions`` (B, R) int64 or None: the policy version that sampled each response token,
      when weights changed mid-sequence (:class:`~torchtpu_rl.serving.ServingEngine`).
    - ``loss_mask`` (B, R) bool or None: the response tokens that carry loss, for multi-turn episodes
      (:mod:`~torchtpu_rl.episodes`): the assistant's tokens, not the observations and tool results
      between its turns (None: every real response token, ``response_mask``).
    - ``episodes``: None, or one record (a dict: the messages after the prompt, the environment's reward,
      turns, tool-call counts) per row of a multi-turn episode.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    policy_version: torch.Tensor
    stopped: torch.Tensor
    pad_id: int = 0
    temperature: float = 1.0
    token_versions: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    episodes: Optional[list] = None

    _TENSORS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "policy_version",
                "stopped")

    def __post_init__(self):
        B = self.prompt_ids.shape[0]
        for name in self._TENSORS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"RolloutBatch.{name} must be a tensor, not {type(t).__name__}")
            if t.shape[0] != B:
                raise ValueError(f"RolloutBatch.{name} has {t.shape[0]} rows, prompt_ids has {B}")
        if self.token_versions is not None and self.token_versions.shape != self.response_ids.shape:
            raise ValueError(f"RolloutBatch.token_versions must have response_ids' shape "
                             f"{tuple(self.response_ids.shape)}, not {tuple(self.token_versions.shape)}")
        if self.loss_mask is not None and self.loss_mask.shape != self.response_ids.shape:
            raise ValueError(f"RolloutBatch.loss_mask must have response_ids' shape "
                             f"{tuple(self.response_ids.shape)}, not {tuple(self.loss_mask.shape)}")
        if self.episodes is not None and len(self.episodes) != B:
            raise ValueError(f"RolloutBatch.episodes has {len(self.episodes)} records for {B} rows")
        if self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError("RolloutBatch.prompt_mask must have prompt_ids' shape")
        for name in ("response_mask", "logprobs"):
            if getattr(self, name).shape != self.response_ids.shape:
                raise ValueError(f"RolloutBatch.{name} must have response_ids' shape "
                                 f"{tuple(self.response_ids.shape)}, not {tuple(getattr(self, name).shape)}")

    # ------------------------------------------------------------ views
    def __len__(self):
        return self.prompt_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return len(self)

    @property
    def device(self) -> torch.device:
        return self.prompt_ids.device

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + R): prompt and response concatenated."""
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + R) int64: 1 at real prompt and response tokens."""
        return torch.cat([self.prompt_mask.long(), self.response_mask.long()], 1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.long().sum(1)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.prompt_mask.long().sum(1)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def prompts(self) -> list:
        """Prompts as lists of ints (padding removed)."""
        ids, m = self.prompt_ids.cpu(), self.prompt_mask.cpu().bool()
        return [ids[i][m[i]].tolist() for i in range(len(self))]

    def responses(self) -> list:
        """Responses as lists of ints (padding removed; a final stop token kept)."""
        ids, m = self.response_ids.cpu(), self.response_mask.cpu().bool()
        return [ids[i][m[i]].tolist() for i in range(len(self))]

    # ------------------------------------------------------------ moves and reshapes
    def _map(self, fn, episodes=None) -> "RolloutBatch":
        tv = None if self.token_versions is None else fn(self.token_versions)
        lm = None if self.loss_mask is None else fn(self.loss_mask)
        return dataclasses.replace(self, token_versions=tv, loss_mask=lm,
                                   episodes=self.episodes if episodes is None else episodes,
                                   **{n: fn(getattr(self, n)) for n in self._TENSORS})

    @property
    def loss_mask_or_response(self) -> torch.Tensor:
        """(B, R) bool: the response tokens that carry loss (``loss_mask``, else ``response_mask``)."""
        return self.response_mask.bool() if self.loss_mask is None else self.loss_mask.bool()

    def token_versions_or_rows(self) -> torch.Tensor:
        """(B, R) per-token policy versions: ``token_versions``, or each row's ``policy_version``."""
        if self.token_versions is not None:
            return self.token_versions
        return self.policy_version[:, None].expand(self.response_ids.shape).clone()

    def to(self, device) -> "RolloutBatch":
        return self._map(lambda t: t.to(device))

    def to_cpu(self) -> "RolloutBatch":
        return self.to("cpu")

    def select(self, index) -> "RolloutBatch":
        """Rows ``index`` (a list/tensor of row numbers or a slice)."""
        if isinstance(index, slice):
            return self._map(lambda t: t[index], None if self.episodes is None else self.episodes[index])
        idx = torch.as_tensor(index, dtype=torch.int64)
        eps = None if self.episodes is None else [self.episodes[i] for i in idx.reshape(-1).tolist()]
        return self._map(lambda t: t.index_select(0, idx.to(t.device)), eps)

    def split(self, sizes) -> list:
        """Split into batches of ``sizes`` rows (an int: equal chunks, the last may be smaller)."""
        B = len(self)
        if isinstance(sizes, int):
            if sizes < 1:
                raise ValueError(f"RolloutBatch.split: chunk size must be >= 1, not {sizes}")
            sizes = [min(sizes, B - s) for s in range(0, B, sizes)]
        sizes = [int(s) for s in sizes]
        if sum(sizes) != B or any(s < 0 for s in sizes):
            raise ValueError(f"RolloutBatch.split: sizes {sizes} do not add up to the batch size {B}")
        out, start = [], 0
        for s in sizes:
            out.append(self.select(slice(start, start + s)))
            start += s
        return out

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """One batch of all rows: prompts left-padded, responses right-padded to the widest."""
        batches = list(batches)
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        pad_id = batches[0].pad_id
        P = max(b.prompt_ids.shape[1] for b in batches)
        R = max(b.response_ids.shape[1] for b in batches)

        def lp(t, w, v):
            return F.pad(t, (w - t.shape[1], 0), value=v) if t.shape[1] < w else t

        def rp(t, w, v):
            return F.pad(t, (0, w - t.shape[1]), value=v) if t.shape[1] < w else t

        temps = {b.temperature for b in batches}
        if len(temps) > 1:
            raise ValueError(f"RolloutBatch.concat: batches sampled at different temperatures {sorted(temps)}")
        return RolloutBatch(
            prompt_ids=torch.cat([lp(b.prompt_ids, P, pad_id) for b in batches]),
            prompt_mask=torch.cat([lp(b.prompt_mask, P, 0) for b in batches]),
            response_ids=torch.cat([rp(b.response_ids, R, pad_id) for b in batches]),
            response_mask=torch.cat([rp(b.response_mask, R, False) for b in batches]),
            logprobs=torch.cat([rp(b.logprobs, R, 0.0) for b in batches]),
            policy_version=torch.cat([b.policy_version for b in batches]),
            stopped=torch.cat([b.stopped for b in batches]),
            pad_id=pad_id,
            temperature=batches[0].temperature,
            token_versions=(None if all(b.token_versions is None for b in batches) else
                            torch.cat([rp(b.token_versions_or_rows(), R, 0) for b in batches])),
            loss_mask=(None if all(b.loss_mask is None for b in batches) else
                       torch.cat([rp(b.loss_mask_or_response, R, False) for b in batches])),
            episodes=(None if all(b.episodes is None for b in batches) else
                      [e for b in batches for e in (b.episodes or [None] * len(b))]),
        )

    def state(self) -> dict:
        """A plain dict of host tensors and ints (picklable for Ray or torch.save)."""
        cpu = self.to_cpu()
        out = {n: getattr(cpu, n) for n in self._TENSORS}
        out.update(pad_id=self.pad_id, temperature=self.temperature)
        if cpu.token_versions is not None:
            out["token_versions"] = cpu.token_versions
        if cpu.loss_mask is not None:
            out["loss_mask"] = cpu.loss_mask
        if self.episodes is not None:
            out["episodes"] = self.episodes
        return out

    @classmethod
    def from_state(cls, state: dict) -> "RolloutBatch":
        return cls(**state)


# ================================================================= reward work
@dataclasses.dataclass
class RewardRequest:
    """A contiguous slice (from sample ``start``) of a batch to score on one reward actor."""

    start: int
    prompts: list
    responses: list
    metadata: list


def split_rewards(prompts: Sequence, responses: Sequence, metadata: Sequence, n_actors: int) -> list:
    """The samples cut into at most ``n_actors`` contiguous :class:`RewardRequest` s of near-equal size
    (concatenated in ``start`` order they are the batch again)."""
    n = len(prompts)
    if not (len(responses) == len(metadata) == n):
        raise ValueError(f"split_rewards: {n} prompts, {len(responses)} responses, {len(metadata)} metadata")
    k = max(1, min(int(n_actors), n))
    bounds = [n * j // k for j in range(k + 1)]
    return [RewardRequest(a, list(prompts[a:b]), list(responses[a:b]), list(metadata[a:b]))
            for a, b in zip(bounds, bounds[1:]) if b > a]


# ================================================================= rollout work
@dataclasses.dataclass
class RolloutRequest:
    """One unit of rollout work: whole prompt groups, a seed, and the step it belongs to."""

    request_id: int
    step: int
    prompts: list  # token-id lists, each group's prompt repeated group_size times
    params: Any  # SamplingParams
    seed: int
    rows: list = dataclasses.field(default_factory=list)  # each prompt's dataset columns (episodes' reset)


@dataclasses.dataclass
class RolloutResult:
    request_id: int
    batch: dict  # RolloutBatch.state(): host tensors
    policy_version: int
    worker_index: int
    pid: int
    seconds: float
    response_tokens: int
    stats: dict = dataclasses.field(default_factory=dict)  # the engine's last_stats (numbers) for this call


@dataclasses.dataclass
class StepRollouts:
    """The rollouts of one step: its prompts, its requests, the results gathered so far."""

    step: int
    items: list  # (dataset_index, prompt, metadata) per prompt
    requests: list  # RolloutRequest
    results: dict  # request_id -> RolloutResult
    refs: dict = dataclasses.field(default_factory=dict)  # the calls in flight: ObjectRef -> (request, worker)

    def state(self) -> dict:
        """A plain, checkpointable dict (every result gathered; a request's prompts are in ``items``)."""
        return {"step": self.step, "items": [[i, p, m] for i, p, m in self.items],
                "requests": [{"request_id": r.request_id, "seed": r.seed} for r in self.requests],
                "results": [dataclasses.asdict(self.results[r.request_id]) for r in self.requests]}

    @classmethod
    def from_state(cls, state: dict, params: SamplingParams) -> "StepRollouts":
        reqs = [RolloutRequest(r["request_id"], state["step"], [], params, r["seed"]) for r in state["requests"]]
        return cls(state["step"], [tuple(x) for x in state["items"]], reqs,
                   {r.request_id: RolloutResult(**res) for r, res in zip(reqs, state["results"])})


EVAL_STREAM = 2**31 - 1  # the "step" of evaluation requests' seeds: never a training step


def seed_for(seed: int, step: int, request: int) -> int:
    """The sampling seed of request ``request`` of step ``step``: a re-run request draws the same."""
    return int(np.random.SeedSequence([seed, step, request]).generate_state(1, np.uint64)[0] >> 1)


def split_groups(items: Sequence, n_requests: int, group_size: int, params: SamplingParams, *, step: int,
                 first_id: int, seed: int) -> list:
    """``items`` (``(dataset_index, prompt, metadata)`` per prompt) cut into ``n_requests`` requests of
    whole prompt groups (each prompt repeated ``group_size`` times), as even as the counts allow."""
    bounds = np.linspace(0, len(items), n_requests + 1).astype(int)
    return [RolloutRequest(first_id + r, step, [list(p) for _, p, _ in items[bounds[r]:bounds[r + 1]]
                                                for _ in range(group_size)], params, seed_for(seed, step, r),
                           [m for _, _, m in items[bounds[r]:bounds[r + 1]] for _ in range(group_size)])
            for r in range(n_requests)]


def gather_results(results: Sequence[RolloutResult]) -> RolloutBatch:
    """One batch of the results' rows, in the order given (request order)."""
    return RolloutBatch.concat([RolloutBatch.from_state(r.batch) for r in results])


# The serving engine's per-call figures that a step reports, and how its workers' calls combine
# (row_utilization: weighted by decode rows). The static engine reports none of them.
ENGINE_STATS = {"useful_tokens": sum, "decode_rows": sum, "prefill_tokens": sum, "prefix_hit_tokens": sum,
                "preemptions": sum, "kv_pages_peak": max}


# multi-turn episodes' per-call counts (episodes.EPISODE_STATS), summed over a step's calls
EPISODE_STATS = ("episodes", "episode_turns", "episodes_truncated", "tool_calls", "tool_parse_failures",
                 "tool_errors", "tool_timeouts", "assistant_tokens", "observation_tokens")


def engine_stats(results: Sequence[RolloutResult]) -> dict:
    """The step's :data:`ENGINE_STATS` over its rollout results (those whose engine reports them), and
    the episodes' :data:`EPISODE_STATS` (with ``tool_parse_failure_rate``: failures per tool-call attempt)."""
    out = {}
    eps = [r.stats for r in results if "episodes" in r.stats]
    if eps:
        out = {k: sum(s.get(k, 0) for s in eps) for k in EPISODE_STATS}
        attempts = out["tool_calls"] + out["tool_parse_failures"]
        out["tool_parse_failure_rate"] = out["tool_parse_failures"] / attempts if attempts else 0.0
        out["turns_per_episode"] = out["episode_turns"] / out["episodes"] if out["episodes"] else 0.0
    stats = [r.stats for r in results if "row_utilization" in r.stats]
    if not stats:
        return out
    out.update({k: combine(s[k] for s in stats) for k, combine in ENGINE_STATS.items() if all(k in s for s in stats)})
    rows = sum(s["decode_rows"] for s in stats)
    kept = sum(s["row_utilization"] * s["decode_rows"] for s in stats if s["decode_rows"])
    out["row_utilization"] = kept / rows if rows else float("nan")
    return out


# ================================================================= wire errors
class WorkerNotReady(RuntimeError):
    """A (re)started rollout worker got work before its first weights."""


class LearnerRestarted(RuntimeError):
    """A learner process Ray restarted got work before the driver loaded a checkpoint into it.

    Ray sends calls made after the restart to the new process, which holds the initial weights:
    training or publishing them would go on silently from the wrong state."""


class LearnerDied(Exception):
    """The learner actor died (raised in the driver's process; the driver restores it from a checkpoint)."""
