"""``python -m torchtpu_rl.train --engine serving``: the rollout workers generate with the request-level
:class:`~torchtpu_rl.serving.ServingEngine`, its figures land in metrics.jsonl, and its flags (and the static
engine's options it lacks) are checked before Ray starts. Same tiny model and data as test_train_entry."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import yaml

from test_train_entry import _read, run_inputs, xla_cache  # noqa: F401  (module fixtures reused)
from torchtpu_rl import driver, train, workers

KV_PAGES = 6  # 4 slots of sequences up to 5 pages: they preempt each other


@pytest.fixture(scope="module")
def serving_run(ray_driver, run_inputs, xla_cache):  # noqa: F811
    """The entry point as a user runs it (a Ray job of the command line), with the serving engine sized small
    enough (4 slots, 6 pages of 8 tokens) that slots are shared and sequences preempt each other."""
    from ray_integration import jobs

    out = run_inputs / "out_serving"
    cmd = [sys.executable, "-m", "torchtpu_rl.train", "--config", str(run_inputs / "run.yaml"), "--steps", "2",
           "--engine", "serving", "--max-slots", "4", "--page-size", "8", "--kv-pages", str(KV_PAGES),
           "--lr", "0.003", "--out", str(out), "--no-progress", "--xla-cache", xla_cache, "--report-to", "none"]
    env = {"OMP_NUM_THREADS": "1", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    job = jobs.submit(ray_driver.dashboard_url, cmd, env_vars=env)
    status = jobs.wait(ray_driver.dashboard_url, job, timeout_s=600)
    log = jobs.logs(ray_driver.dashboard_url, job)
    assert status == "SUCCEEDED", log[-4000:]
    return out


def test_serving_engine_run_reports_its_figures_per_step(serving_run):
    rows = _read(serving_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["samples"] == 8 and 0 < r["response_length_mean"] <= 8
        assert 0 < r["row_utilization"] <= 1, r
        # every kept response token was decoded or sampled at the end of a prefill
        assert r["useful_tokens"] == r["response_tokens"] > 0
        assert r["decode_rows"] >= 1 and r["prefill_tokens"] >= 1
        assert r["prefix_hit_tokens"] >= 0 and r["preemptions"] >= 0
        assert 1 <= r["kv_pages_peak"] <= KV_PAGES
    # 6 pages for 4 slots: preempted sequences are recomputed, their prefixes found in the prefix cache
    assert sum(r["preemptions"] for r in rows) > 0 and sum(r["prefix_hit_tokens"] for r in rows) > 0
    meta = json.loads((serving_run / "checkpoints" / "step_2" / "run.json").read_text())
    assert meta["config"]["engine"] == "serving" and meta["config"]["kv_pages"] == KV_PAGES
    assert (serving_run / "hf" / "config.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--engine", "serving", "--max-slots", "0"], "--max-slots must be a positive integer, not 0"),
    (["--engine", "serving", "--page-size", "-1"], "--page-size must be a positive integer, not -1"),
    (["--engine", "serving", "--kv-pages", "2"], "--kv-pages 2 cannot hold one sequence: --max-prompt-tokens 32 "
                                                 r"\+ --max-new-tokens 8 take 3 pages of --page-size 16"),
    (["--max-slots", "4"], "--max-slots sizes the serving engine: give --engine serving"),
    (["--engine", "serving", "--rollout-quantization", "int8"], "--rollout-quantization int8: the serving engine"),
    (["--engine", "serving", "--rollout-dtype", "bfloat16"], "--rollout-dtype bfloat16: the serving engine"),
    (["--engine", "serving", "--lora-rank", "4"], "--lora-rank 4: the serving engine .* does not merge LoRA"),
    (["--colocate"], "--colocate .* needs --engine serving"),
    (["--colocate", "--engine", "serving", "--mode", "async", "--rollout-workers", "2"],
     "--colocate .* needs --rollout-workers 1, --mode sync"),
])
def test_bad_engine_flags_exit_2_naming_the_flag_before_ray_starts(run_inputs, tmp_path, capsys,  # noqa: F811
                                                                  flags, message):
    argv = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o")] + flags
    assert train.cli(argv) == 2
    assert re.search(message, capsys.readouterr().err)
    with pytest.raises(train.TrainError, match=message):  # _setup: everything done before Ray starts
        train._setup(train.parse_args(argv))


def test_engine_options_from_a_config_file_and_their_defaults(run_inputs, tmp_path):  # noqa: F811
    cfg = yaml.safe_load((run_inputs / "run.yaml").read_text())
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump({**cfg, "engine": "serving", "page_size": 8}))
    s = train._setup(train.parse_args(["--config", str(path), "--out", str(tmp_path / "o")]))
    # defaults: a step's 2 x 4 samples as slots, each slot room for 32 + 8 tokens (5 pages of 8)
    assert s["engine_kwargs"] == {"engine": "serving", "max_slots": 8, "page_size": 8, "kv_pages": 40}
    name, cls, kw = workers.rollout_engine(s["engine_kwargs"])
    assert (name, cls.__name__, kw["kv_pages"]) == ("serving", "ServingEngine", 40)
    assert train.ENGINES == workers.ENGINES
    # two workers: each decodes its share of the step (1 prompt x 4 samples) at once
    two = train._setup(train.parse_args(["--config", str(path), "--out", str(tmp_path / "q"), "--rollout-workers",
                                         "2"]))
    assert two["engine_kwargs"]["max_slots"] == 4 and two["engine_kwargs"]["kv_pages"] == 20
    static = train._setup(train.parse_args(["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "p")]))
    assert workers.rollout_engine(static["engine_kwargs"])[1].__name__ == "RolloutEngine"


def test_an_option_the_engine_lacks_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"the serving rollout engine \(ServingEngine\) does not take batch_buckets, "
                                         "use_kv_cache; it takes .*max_slots"):
        workers.rollout_engine({"engine": "serving", "use_kv_cache": False, "batch_buckets": (8,)})
    with pytest.raises(ValueError, match=r"rollout engine must be one of \('static', 'serving'\), not 'vllm'"):
        workers.rollout_engine({"engine": "vllm"})


def test_step_figures_combine_over_workers():
    def result(**stats):
        return workers.RolloutResult(0, {}, 1, 0, 0, 0.0, 0, stats)

    a = result(useful_tokens=30, decode_rows=40, row_utilization=0.75, prefill_tokens=20, prefix_hit_tokens=4,
               preemptions=1, kv_pages_peak=7, seconds=1.0)
    b = result(useful_tokens=10, decode_rows=10, row_utilization=1.0, prefill_tokens=5, prefix_hit_tokens=0,
               preemptions=0, kv_pages_peak=9, seconds=2.0)
    assert driver.engine_stats([a, b]) == {"useful_tokens": 40, "decode_rows": 50, "prefill_tokens": 25,
                                           "prefix_hit_tokens": 4, "preemptions": 1, "kv_pages_peak": 9,
                                           "row_utilization": (30 + 10) / 50}
    assert driver.engine_stats([result(seconds=1.0, response_tokens=3)]) == {}  # the static engine's figures


def test_trainer_takes_a_run_config_as_it_takes_the_same_options_as_a_mapping(run_inputs):  # noqa: F811
    """``Trainer(model=, reward_funcs=, config=RunConfig(...), train_dataset=)``: the typed config in TRL's
    shape (no reward of its own: the reward functions come beside it) builds the run a mapping of the same
    options builds; a RunConfig's bad value fails where it is made, naming the flag."""
    from torchtpu_rl.config import ConfigError, LearnerConfig, RolloutConfig, RunConfig, SyncConfig

    cfg = yaml.safe_load((run_inputs / "run.yaml").read_text())
    model, data = cfg.pop("model"), cfg.pop("data")
    typed = RunConfig(rollout=RolloutConfig(prompts_per_step=2, group_size=4, max_new_tokens=8, max_prompt_tokens=32,
                                            requests_per_worker=2),
                      learner=LearnerConfig(lr=0.5, kl_coef=0.01, entropy_coef=0.01),
                      sync=SyncConfig(mode="async", max_staleness=2), seed=3, steps=5)
    a = train.Trainer(model=model, reward_funcs=["math_answer", "format"], config=typed, train_dataset=data,
                      reward_weights=[1.0, 0.1], prompt_key=cfg["prompt_key"], format_regex=cfg["format_regex"])
    mapping = {**{k: cfg[k] for k in ("prompt_key", "format_regex")}, "prompts_per_step": 2, "group_size": 4,
               "max_new_tokens": 8, "max_prompt_tokens": 32, "requests_per_worker": 2, "lr": 0.5, "kl_coef": 0.01,
               "entropy_coef": 0.01, "mode": "async", "max_staleness": 2, "seed": 3, "steps": 5}
    b = train.Trainer(model=model, reward_funcs=["math_answer", "format"], config=mapping, train_dataset=data,
                      reward_weights=[1.0, 0.1])
    assert a.setup["learner_kwargs"] == b.setup["learner_kwargs"]
    assert a.setup["learner_kwargs"]["entropy_coef"] == 0.01 and a.setup["learner_kwargs"]["lr"] == 0.5
    assert a.setup["engine_kwargs"] == b.setup["engine_kwargs"] and a.setup["sampling"] == b.setup["sampling"]
    assert (a.args.mode, a.args.max_staleness, a.args.requests_per_worker, a.args.steps) == ("async", 2, 2, 5)
    assert [n for n, _ in a.setup["rewards"]] == ["math_answer", "format"]
    with pytest.raises(ConfigError, match="--entropy-coef must be a finite number, not nan"):
        LearnerConfig(entropy_coef=float("nan"))
    with pytest.raises(train.TrainError, match="give at least one --reward"):  # no rewards anywhere
        train.Trainer(model=model, config=typed, train_dataset=data, prompt_key=cfg["prompt_key"])


def test_colocated_grpo_run_equals_the_two_actor_run_with_the_same_seeds(ray_driver, run_inputs):  # noqa: F811
    """``make_topology(colocate=True)``: the learner and a serving engine on its own parameters in one
    actor (a sync is a version bump: 0 bytes, the KV pages released while the learner trains). A short
    GRPO run gives the same rollouts, rewards, losses and final weights as a learner actor beside a
    rollout-worker actor with the same seeds, in N + 2 control messages a step."""
    import functools

    import ray

    from torchtpu_rl import hf
    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.protocol import SamplingParams
    from torchtpu_rl.topology import make_topology

    tok = hf.load_tokenizer(str(run_inputs / "model"))
    policy_fn = functools.partial(hf.load_policy, str(run_inputs / "model"), device="cpu")
    engine = {"engine": "serving", "max_slots": 8, "page_size": 8, "kv_pages": 16}
    items = [(tok.encode(t)[:12], None) for t in ("one plus two", "three times four", "five minus one", "six")]

    def reward(prompts, responses, metas):  # a deterministic function of the tokens
        return [sum(t % 3 == 0 for t in r) / max(1, len(r)) for r in responses]

    def run(colocate: bool):
        topo = make_topology(policy_fn, tok.pad_token_id, num_rollout_workers=1, colocate=colocate,
                             learner_kwargs={"group_size": 4, "lr": 0.05, "kl_coef": 0.01}, engine_kwargs=engine,
                             seed=0)
        try:
            d = RLDriver(topo, PromptDataset(items, seed=0), reward, sampling=SamplingParams(max_new_tokens=6),
                         prompts_per_step=2, group_size=4, seed=3)
            steps = [d.step()]
            before = d.control_messages
            steps.append(d.step())
            return (steps, d.control_messages - before, d.last_batch.responses(),
                    ray.get(topo.learner.checksums.remote()), ray.get(topo.workers[0].status.remote()))
        finally:
            topo.shutdown()

    apart, colocated = run(False), run(True)
    keys = ["reward_mean", "policy_version", "pg_loss", "kl", "response_tokens", "staleness"]
    assert [[m[k] for k in keys] for m in colocated[0]] == [[m[k] for k in keys] for m in apart[0]]
    assert colocated[2] == apart[2] and colocated[3] == apart[3]  # the same tokens, the same final weights
    assert apart[1] == colocated[1] == 1 + 2  # one request (2 prompts on one worker), train_step, publish_to
    for m in colocated[0]:
        assert m["sync_bytes"] == 0 and m["kv_bytes_released"] > 0 and m["peak_memory_bytes"] > 0
    assert colocated[4]["version"] == colocated[0][-1]["policy_version"] and not colocated[4]["kv_released"]
    assert apart[0][-1]["sync_bytes"] > 0


def test_colocated_topology_refuses_what_it_cannot_run(ray_driver):
    from torchtpu_rl.topology import make_topology

    with pytest.raises(ValueError, match="colocate=True runs one ColocatedWorker .*num_rollout_workers=2"):
        make_topology(lambda: None, 0, num_rollout_workers=2, colocate=True, engine_kwargs={"engine": "serving"})
    with pytest.raises(ValueError, match="colocate=True .*engine_kwargs=None"):
        make_topology(lambda: None, 0, colocate=True)


def test_a_killed_colocated_actor_is_restored_from_the_last_checkpoint(ray_driver, run_inputs, tmp_path):  # noqa: F811
    """The colocated actor is the learner and the rollout worker at once: killed while its rollouts are in
    flight, it is restarted by Ray, the last checkpoint is loaded into it, its engine is synced by a version
    bump again, and the run goes on from the checkpoint's step."""
    import functools

    import ray

    from torchtpu_rl import hf
    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.protocol import SamplingParams
    from torchtpu_rl.topology import make_topology

    tok = hf.load_tokenizer(str(run_inputs / "model"))
    topo = make_topology(functools.partial(hf.load_policy, str(run_inputs / "model"), device="cpu"),
                         tok.pad_token_id, colocate=True, learner_kwargs={"group_size": 4, "lr": 0.05, "kl_coef": 0.0},
                         engine_kwargs={"engine": "serving", "max_slots": 8, "page_size": 8, "kv_pages": 16},
                         max_restarts=2)
    try:
        items = [(tok.encode(t)[:12], None) for t in ("one plus two", "three times four")]
        d = RLDriver(topo, PromptDataset(items, seed=0), lambda p, r, m: [len(x) / 6 for x in r],
                     sampling=SamplingParams(max_new_tokens=6), prompts_per_step=2, group_size=4, seed=3,
                     checkpoint_dir=str(tmp_path), checkpoint_every=1)
        pid = ray.get(topo.learner.status.remote())["pid"]
        killed = []

        def queued(driver, step):
            if step == 1 and not killed:
                ray.kill(topo.learner, no_restart=False)
                killed.append(step)

        d.on_rollouts_queued = queued
        out = d.run(3, progress=False)
        kinds = [e["event"] for e in d.events]
        assert killed and "learner_died" in kinds and "learner_restored" in kinds, d.events
        assert [m["step"] for m in out] == [1, 2, 3] and out[-1]["policy_version"] == 3
        status = ray.get(topo.learner.status.remote())
        assert status["pid"] != pid and status["version"] == 3 and not status["kv_released"]
    finally:
        topo.shutdown()
