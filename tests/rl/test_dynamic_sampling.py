"""DAPO dynamic sampling (torchtpu_rl.dynamic_sampling): all-equal groups are dropped and new prompts fill the
step, within a bound on the rounds (then the dropped groups complete the batch, counted). Through the driver:
tests/rl/test_rl_ray.py::test_dynamic_sampling_fills_the_step_with_informative_groups (its warm topology)."""

from __future__ import annotations

import torch

from torchtpu_rl.dynamic_sampling import fill_informative, informative_groups
from torchtpu_rl.protocol import RolloutBatch

G = 2


def _rows(tags):
    """A batch with one row per tag (the tag is the row's only prompt token: which sample it is)."""
    n = len(tags)
    return RolloutBatch(prompt_ids=torch.tensor(tags)[:, None], prompt_mask=torch.ones(n, 1, dtype=torch.long),
                        response_ids=torch.ones(n, 2, dtype=torch.long), response_mask=torch.ones(n, 2, dtype=bool),
                        logprobs=torch.zeros(n, 2), policy_version=torch.zeros(n, dtype=torch.int64),
                        stopped=torch.ones(n, dtype=bool))


def test_informative_groups():
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5, 2, 3], G) == [1, 3]
    assert informative_groups([1.0, 1.0 + 1e-9], G, tol=1e-6) == []


def test_fill_informative_drops_equal_groups_and_samples_more():
    rounds = []

    def sample_more(n):  # each round: n new prompts, the first of them informative, the others not
        rounds.append(n)
        base = 100 * len(rounds)
        items = [base + k for k in range(n)]
        rewards = [r for k in range(n) for r in ((0.0, 1.0) if k == 0 else (0.5, 0.5))]
        return items, _rows([t for t in items for _ in range(G)]), rewards

    items = [0, 1, 2]
    first = _rows([t for t in items for _ in range(G)])
    kept, batch, rewards, stats = fill_informative(items, first, [1, 0, 2, 2, 3, 3], G, 3, sample_more, max_rounds=5)
    assert rounds == [2, 1]  # 2 groups missing after the first round, 1 after the second
    assert kept == [0, 100, 200] and rewards == [1, 0, 0.0, 1.0, 0.0, 1.0]
    assert batch.prompt_ids[:, 0].tolist() == [0, 0, 100, 100, 200, 200]  # the rows follow their groups
    assert stats == {"dynamic_sampling_rounds": 3, "dynamic_sampling_dropped_groups": 3,
                     "dynamic_sampling_short_groups": 0}
    # the rounds bounded: the dropped groups complete the batch, counted as short
    rounds.clear()
    kept, batch, rewards, stats = fill_informative(items, first, [1, 0, 2, 2, 3, 3], G, 3, sample_more, max_rounds=2)
    assert kept == [0, 100, 1] and len(batch) == 6 and rewards[-2:] == [2, 2]
    assert stats["dynamic_sampling_rounds"] == 2 and stats["dynamic_sampling_short_groups"] == 1
