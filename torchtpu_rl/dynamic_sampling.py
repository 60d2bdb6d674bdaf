"""DAPO's dynamic sampling: keep only prompt groups whose rewards differ, sample more to fill the step.

A group whose ``group_size`` rewards are all equal has advantage 0 under every group baseline (GRPO,
RLOO, Dr. GRPO): it adds no policy gradient, only noise to the aggregation's normalizer. DAPO (Yu et
al. 2025, section 3.2) drops such groups and keeps generating until the batch holds ``want_groups``
informative ones. :func:`fill_informative` does that over rounds of ``sample_more``; the rounds are
bounded (``max_rounds``, the first included): when they run out, the batch is completed with the
dropped groups (they weigh nothing in the policy gradient) so the learner always sees the same
number of rows, and the shortfall is counted in the metrics.

Knows nothing of Ray or the driver: ``sample_more(n_prompts) -> (items, batch, rewards)`` is the
driver's (generate ``n_prompts`` new prompts ``group_size`` times each, and score them).
"""

from __future__ import annotations

from typing import Callable, Sequence

from .protocol import RolloutBatch

__all__ = ["fill_informative", "informative_groups"]


def informative_groups(rewards: Sequence[float], group_size: int, tol: float = 0.0) -> list:
    """Indices of the consecutive groups of ``group_size`` rewards whose max and min differ by more than
    ``tol``."""
    if group_size < 2:
        raise ValueError(f"informative_groups: group_size must be >= 2, not {group_size}")
    if len(rewards) % group_size:
        raise ValueError(f"informative_groups: {len(rewards)} rewards are not whole groups of {group_size}")
    out = []
    for g in range(len(rewards) // group_size):
        vals = [float(v) for v in rewards[g * group_size:(g + 1) * group_size]]
        if max(vals) - min(vals) > tol:
            out.append(g)
    return out


def _rows(groups, group_size):
    return [g * group_size + k for g in groups for k in range(group_size)]


def fill_informative(items: list, batch: RolloutBatch, rewards: list, group_size: int, want_groups: int,
                     sample_more: Callable, max_rounds: int) -> tuple:
    """``(items, batch, rewards, stats)`` of exactly ``want_groups`` groups, informative ones first.

    ``items``/``batch``/``rewards``: the step's first round (one item per group). More rounds ask
    ``sample_more`` for as many prompts as groups are still missing, until the batch is full or
    ``max_rounds`` rounds (this one included) ran. ``stats``: ``dynamic_sampling_rounds``,
    ``dynamic_sampling_dropped_groups`` (all-equal groups seen), ``dynamic_sampling_short_groups``
    (all-equal groups put back to fill the batch when the rounds ran out)."""
    if max_rounds < 1:
        raise ValueError(f"fill_informative: max_rounds must be >= 1, not {max_rounds}")
    kept_items, kept_parts, kept_rewards = [], [], []
    spare = []  # (item, batch, rewards) of the dropped groups, in order
    rounds, dropped = 0, 0
    while True:
        rounds += 1
        good = set(informative_groups(rewards, group_size))
        for g, item in enumerate(items):
            rows = _rows([g], group_size)
            part = (item, batch.select(rows), [rewards[r] for r in rows])
            if g in good and len(kept_items) < want_groups:
                kept_items.append(part[0])
                kept_parts.append(part[1])
                kept_rewards.extend(part[2])
            elif g not in good:
                dropped += 1
                spare.append(part)
        missing = want_groups - len(kept_items)
        if missing <= 0 or rounds >= max_rounds:
            break
        items, batch, rewards = sample_more(missing)
        if not items:  # the data ran out
            break
    short = 0
    for item, part, rw in spare:
        if len(kept_items) >= want_groups:
            break
        kept_items.append(item)
        kept_parts.append(part)
        kept_rewards.extend(rw)
        short += 1
    if len(kept_items) < want_groups:
        raise RuntimeError(f"dynamic sampling: {len(kept_items)} prompt groups after {rounds} rounds, the step needs "
                           f"{want_groups}")
    stats = {"dynamic_sampling_rounds": rounds, "dynamic_sampling_dropped_groups": dropped,
             "dynamic_sampling_short_groups": short}
    return kept_items, RolloutBatch.concat(kept_parts), kept_rewards, stats
