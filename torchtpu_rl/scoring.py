"""Scoring a step's samples: one reward call per batch, the offending samples found one by one when it
fails, and the error policy (stop, or score a default and go on up to a ceiling).

Used by :class:`~torchtpu_rl.driver.RLDriver`; it knows nothing of Ray: the reward is any callable
``(prompts, responses, metadata) -> list``, the driver's own or a wrapper that calls a reward actor.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

from .rewards import RewardLengthError

__all__ = ["RewardError", "Scorer"]


class RewardError(RuntimeError):
    """A reward function raised or returned a non-finite value for a sample."""

    def __init__(self, message, sample: Optional[dict] = None):
        super().__init__(message)
        self.sample = sample


class Scorer:
    """``score(prompts, responses, metas, step) -> (rewards, n_bad, parts)``.

    ``on_error="stop"``: a sample whose reward raises or is not a finite number stops the run
    (:class:`RewardError` naming the sample). ``"continue"``: it is scored ``default`` and the run goes on,
    unless more than ``max_error_fraction`` of the step's samples failed (then it stops all the same: a
    reward failing everywhere would train on the default alone). A reward returning the wrong number of
    values always stops the run: that is the function's contract broken, not one sample's problem.
    ``events`` (a list) receives a ``reward_error`` record per step with errors.
    """

    def __init__(self, reward: Callable, *, on_error: str = "stop", default: float = 0.0,
                 max_error_fraction: float = 0.5, events: Optional[list] = None, metrics_of: Optional[object] = None):
        if on_error not in ("stop", "continue"):
            raise ValueError(f"Scorer: on_error must be 'stop' or 'continue', not {on_error!r}")
        if not (isinstance(max_error_fraction, (int, float)) and 0 <= max_error_fraction <= 1):
            raise ValueError(f"Scorer: max_error_fraction must be in [0, 1], not {max_error_fraction!r}")
        if not math.isfinite(float(default)):
            raise ValueError(f"Scorer: the default reward must be finite, not {default!r}")
        self.reward = reward
        self.on_error = on_error
        self.default = float(default)
        self.max_error_fraction = float(max_error_fraction)
        self.events = events if events is not None else []
        self.metrics_of = metrics_of  # the object whose ``last_metrics`` holds per-reward means (a RewardSet)

    def _call(self, ps, rs, ms) -> list:
        vals = self.reward(ps, rs, ms)
        try:
            vals = vals.tolist() if hasattr(vals, "tolist") else list(vals)
        except TypeError:
            raise RewardError(f"the reward returned a {type(vals).__name__}, not a list of numbers") from None
        if len(vals) != len(ps):
            raise RewardLengthError(f"the reward returned {len(vals)} values for {len(ps)} samples")
        return vals

    def score_batch(self, items, batch, group_size: int, step: int, dataset=None, tokenizer=None) -> tuple:
        """Score a rollout batch whose rows are each of ``items``' (``(dataset_index, prompt, metadata)``)
        prompts ``group_size`` times: on token ids and metadata, or with a ``tokenizer`` (text mode) on
        the prompts' texts (``dataset.text``), the decoded completions and per sample the item's columns
        plus ``completion_ids`` -- what a RewardSet of TRL-style functions takes."""
        responses = batch.responses()
        metas = [m for _, _, m in items for _ in range(group_size)]
        if tokenizer is None:
            return self.score(batch.prompts(), responses, metas, step)
        texts = [dataset.text(idx) for idx, _, _ in items for _ in range(group_size)]
        metas = [{**(m if isinstance(m, dict) else {"metadata": m}), "completion_ids": r}
                 for m, r in zip(metas, responses)]
        if batch.episodes is not None:
            # multi-turn episodes: the completion is the conversation after the prompt, as messages (TRL's
            # form for chat data); the environment's reward is the env_reward column (rewards.env_reward)
            completions = [e["messages"] for e in batch.episodes]
            for m, e in zip(metas, batch.episodes):
                m.update(env_reward=e["env_reward"], turns=e["turns"], tool_calls=e["tool_calls"])
        else:
            completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
        return self.score(texts, completions, metas, step)

    def score(self, prompts, responses, metas, step: int) -> tuple:
        errors = []
        extra = {}
        try:
            vals = self._call(prompts, responses, metas)
            extra = dict(getattr(self.metrics_of, "last_metrics", None) or {})
        except RewardError:
            raise
        except RewardLengthError as e:  # re-scoring sample by sample would hide it
            raise RewardError(f"{e} in step {step}; a reward must return one value per sample") from e
        except Exception:  # noqa: BLE001 - the offending samples are found below
            vals = None
        if vals is None:  # find the offending samples one by one
            vals = []
            for k in range(len(prompts)):
                try:
                    vals.append(self._call([prompts[k]], [responses[k]], [metas[k]])[0])
                except RewardLengthError as e:
                    raise RewardError(f"{e} (sample {k} alone) in step {step}; a reward must return one value "
                                      "per sample") from e
                except Exception as e:  # noqa: BLE001 - reported with the sample
                    vals.append(None)
                    errors.append((k, f"{type(e).__name__}: {e}"))
        out = []
        for k, v in enumerate(vals):
            try:
                f = float(v) if v is not None else None
            except (TypeError, ValueError):
                f = None
                errors.append((k, f"returned {v!r}, not a number"))
            if f is not None and not math.isfinite(f):
                errors.append((k, f"returned {f}"))
                f = None
            out.append(f)
        if errors:
            errors.sort()
            k, why = errors[0]
            sample = {"index": k, "prompt": prompts[k], "response": responses[k], "metadata": metas[k]}
            msg = (f"reward for sample {k} {why} (prompt={prompts[k]}, response={responses[k]}, "
                   f"metadata={metas[k]!r}); {len(errors)} bad sample(s) in step {step}")
            if self.on_error == "stop":
                raise RewardError(msg, sample)
            if len(errors) > self.max_error_fraction * len(prompts):
                raise RewardError(f"{msg}: {len(errors)} of {len(prompts)} samples failed, more than "
                                  f"max_error_fraction {self.max_error_fraction:g} allows with "
                                  f"on_reward_error='continue'", sample)
            warnings.warn(msg + f"; scoring them {self.default} (on_reward_error='continue')",
                          RuntimeWarning, stacklevel=3)
            self.events.append({"event": "reward_error", "step": step, "count": len(errors),
                                "first": sample, "why": why})
        return [self.default if f is None else f for f in out], len(errors), extra
