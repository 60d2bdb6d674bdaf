"""The bottom of torchtpu_rl, in one process: the protocol's split / gather, the typed configs'
checks (each error names the flag), declared dispatch and the one call order (real threads)."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
import torch

from torchtpu_rl import train
from torchtpu_rl.config import ConfigError, LearnerConfig, RolloutConfig, RunConfig, SyncConfig
from torchtpu_rl.protocol import (RolloutBatch, RolloutResult, SamplingParams, StepRollouts, gather_results,
                                  split_groups)
from torchtpu_rl.worker_group import ONE_TO_ALL, ROUND_ROBIN, CallOrder, InOrder, WorkerGroup, declared, dispatch
from torchtpu_rl.workers import RolloutWorker


# ------------------------------------------------------------------ protocol
def _batch(rows: int, width: int, version: int) -> RolloutBatch:
    ids = torch.arange(rows * width).reshape(rows, width)
    return RolloutBatch(ids, torch.ones_like(ids), ids[:, :2] + 1, torch.ones(rows, 2, dtype=torch.bool),
                        torch.zeros(rows, 2), torch.full((rows,), version), torch.zeros(rows, dtype=torch.bool))


def test_split_groups_keeps_whole_groups_and_seeds_by_request():
    items = [(i, [i, i + 1], {"i": i}) for i in range(5)]
    params = SamplingParams(max_new_tokens=2)
    reqs = split_groups(items, 2, 3, params, step=4, first_id=10, seed=7)
    assert [r.request_id for r in reqs] == [10, 11] and all(r.step == 4 for r in reqs)
    assert [len(r.prompts) for r in reqs] == [2 * 3, 3 * 3]  # 5 prompts as 2 + 3 groups of 3 samples
    assert reqs[0].prompts[:3] == [[0, 1]] * 3 and reqs[1].prompts[-1] == [4, 5]
    again = split_groups(items, 2, 3, params, step=4, first_id=0, seed=7)
    assert [r.seed for r in again] == [r.seed for r in reqs]  # a re-run request draws the same
    assert split_groups(items, 2, 3, params, step=5, first_id=0, seed=7)[0].seed != reqs[0].seed


def test_gather_results_concats_in_request_order_and_step_rollouts_round_trip():
    a, b = _batch(2, 3, 1), _batch(1, 5, 2)
    results = [RolloutResult(0, a.state(), 1, 0, 1, 0.1, 4), RolloutResult(1, b.state(), 2, 1, 2, 0.2, 2)]
    batch = gather_results(results)
    assert len(batch) == 3 and batch.prompt_ids.shape == (3, 5)
    assert batch.policy_version.tolist() == [1, 1, 2]
    assert batch.prompt_mask[0].tolist() == [0, 0, 1, 1, 1]  # left-padded to the widest prompt
    params = SamplingParams(max_new_tokens=2)
    sr = StepRollouts(3, [(0, [1], None), (1, [2], {"x": 1})], split_groups([(0, [1], None), (1, [2], None)], 2, 1,
                                                                            params, step=3, first_id=0, seed=0),
                      {0: results[0], 1: results[1]})
    back = StepRollouts.from_state(sr.state(), params)
    assert back.step == 3 and back.items == sr.items and back.results.keys() == sr.results.keys()
    assert [r.seed for r in back.requests] == [r.seed for r in sr.requests]


# ------------------------------------------------------------------ configs
def _args(*flags):
    return train.parse_args(["--model", "m", "--data", "d", "--reward", "math_answer", *flags])


def test_run_config_takes_each_flag_into_its_part():
    c = RunConfig.from_args(_args("--lr", "3e-3", "--group-size", "4", "--mode", "async", "--max-staleness", "2",
                                  "--rollout-workers", "3", "--steps", "7"))
    assert (c.learner.lr, c.rollout.group_size, c.sync.mode, c.sync.max_staleness) == (3e-3, 4, "async", 2)
    assert (c.rollout.rollout_workers, c.steps, c.report_to) == (3, 7, ["tensorboard"])
    kw = c.learner_kwargs()
    assert (kw["lr"], kw["group_size"], kw["grad_clip"]) == (3e-3, 4, 1.0)
    # a mapping works as well as a namespace (the Trainer's config dicts)
    assert RunConfig.from_args({"reward": ["format"], "lr": 0.5}).learner.lr == 0.5


@pytest.mark.parametrize("make, message", [
    (lambda: SyncConfig(mode="later"), r"--mode must be one of \('sync', 'async'\), not 'later'"),
    (lambda: SyncConfig(max_staleness=-1), "--max-staleness must be an integer >= 0, not -1"),
    (lambda: LearnerConfig(lr=math.nan), "--lr must be a finite number > 0, not nan"),
    (lambda: LearnerConfig(grad_clip=-1.0), "--grad-clip must be a finite number >= 0"),
    (lambda: LearnerConfig(clip_eps=1.0), r"--clip-eps must be in \(0, 1\)"),
    (lambda: RolloutConfig(group_size=0), "--group-size must be a positive integer, not 0"),
    (lambda: RolloutConfig(group_size=True), "--group-size must be a positive integer, not True"),
    (lambda: RolloutConfig(max_slots=4), "--max-slots sizes the serving engine: give --engine serving"),
    (lambda: RunConfig(reward=["format"], rollout=RolloutConfig(group_size=1)), "GRPO needs --group-size >= 2"),
    (lambda: RunConfig.from_args({"reward": None}), r"give at least one --reward"),
    (lambda: RunConfig(reward=[]), r"give at least one --reward"),
    (lambda: RunConfig(reward=["a"], learner=LearnerConfig(learner_processes=2, algo="ppo")),
     "--learner-processes 2 .*sharded learner"),
])
def test_config_errors_name_the_flag(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_defaults_derive_from_the_model_and_a_given_value_that_does_not_fit_stays_an_error():
    c = RunConfig(reward=["format"], rollout=RolloutConfig(max_new_tokens=32))
    c.derive_from_model(128, 3 * 2**20)
    assert c.rollout.max_prompt_tokens == 96 and c.ray_object_store_mb == 200
    c = RunConfig(reward=["format"], rollout=RolloutConfig(max_new_tokens=32, max_prompt_tokens=100))
    with pytest.raises(ConfigError, match="--max-prompt-tokens 100 \\+ --max-new-tokens 32 exceed the model's "
                                          "max_position_embeddings 128"):
        c.derive_from_model(128, 0)


# ------------------------------------------------------------------ dispatch and call order
def test_worker_methods_declare_their_dispatch():
    assert declared(RolloutWorker, "generate") == declared(RolloutWorker, "generate")
    assert (declared(RolloutWorker, "generate").mode, declared(RolloutWorker, "generate").ordered) == (ROUND_ROBIN, True)
    assert declared(RolloutWorker, "update_weights").mode == ONE_TO_ALL
    assert not declared(RolloutWorker, "status").ordered
    with pytest.raises(AttributeError, match="RolloutWorker.engine_stats declares no dispatch mode"):
        declared(RolloutWorker, "engine_stats")
    group = WorkerGroup(RolloutWorker, [])
    with pytest.raises(ValueError, match="RolloutWorker.generate is not a one-to-all call"):
        group.call("generate")
    with pytest.raises(ValueError, match="RolloutWorker.update_weights is not a round-robin call"):
        group.map("update_weights", [])
    with pytest.raises(ValueError, match="dispatch: mode must be one of"):
        dispatch("all_to_one")


def test_calls_run_in_the_order_they_were_numbered_whatever_the_threads():
    """Sixteen calls numbered by a CallOrder arrive on threads in a shuffled order; InOrder runs them
    by number (the first number seen is where a fresh process starts)."""
    order, inorder, ran = CallOrder(1), InOrder(), []
    seqs = [order.take() for _ in range(16)]
    assert seqs == list(range(16))
    rng = random.Random(0)
    arrival = seqs[1:]
    rng.shuffle(arrival)
    arrival = [0] + arrival  # the first call in starts the count

    def call(seq):
        with inorder.turn(seq):
            ran.append(seq)
            time.sleep(0.001)

    threads = []
    for seq in arrival:
        t = threading.Thread(target=call, args=(seq,))
        t.start()
        threads.append(t)
        time.sleep(0.002)
    inorder.skip(16)  # a call given up (a failed sync) does not block the ones after it
    t = threading.Thread(target=call, args=(17,))
    t.start()
    threads.append(t)
    for t in threads:
        t.join(10)
    assert ran == list(range(16)) + [17]


def test_an_expected_number_anchors_a_fresh_process_order():
    """A fresh InOrder told the next number (``expect``: a sync-mode install sent before any numbered call)
    runs two numbered calls in order even when the second arrives first; without it the second would
    start the count and the first wait for ever. An expect behind the count changes nothing."""
    order, inorder, ran = CallOrder(1), InOrder(), []
    order.take(), order.take()  # calls 0 and 1 went to a process that died
    assert order.peek() == 2
    inorder.expect(order.peek())
    inorder.expect(1)  # (behind: ignored)
    seqs = [order.take(), order.take()]

    def call(seq):
        with inorder.turn(seq):
            ran.append(seq)

    threads = [threading.Thread(target=call, args=(s,)) for s in reversed(seqs)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert ran == [2, 3] and not any(t.is_alive() for t in threads)
