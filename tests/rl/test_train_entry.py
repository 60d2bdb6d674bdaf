"""``python -m torchtpu_rl.train`` end to end on a small Hugging Face model made here: as a Ray job (config
file + flags, metrics.jsonl, eval.jsonl, TensorBoard, curves, checkpoints, hf/ reloaded by plain
transformers), then resumed in this process from its checkpoint (the same step as the uninterrupted run),
resumes of another model or algorithm refused, and bad inputs named before any actor starts."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_text_arith  # noqa: E402

from torchtpu_rl import train  # noqa: E402

STEPS = 2


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    """A tiny Qwen2 model + BPE tokenizer with a chat template (the example's, untrained), train and eval
    jsonl of chat prompts with an ``answer`` column, a YAML config, and a reward file."""
    d = tmp_path_factory.mktemp("train_entry")
    rows, held = rl_text_arith.make_splits(64, 8, seed=1)
    tok = rl_text_arith.build_tokenizer(rows + held)
    model = rl_text_arith.build_model(tok, hidden=32, layers=1, heads=2, seed=0)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    other = rl_text_arith.build_model(tok, hidden=48, layers=1, heads=2, seed=0)
    other.save_pretrained(d / "other_model")
    tok.save_pretrained(d / "other_model")
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    reward_model = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id, max_position_embeddings=128))
    reward_model.save_pretrained(d / "reward_model")
    tok.save_pretrained(d / "reward_model")
    cfg = {
        "model": str(d / "model"), "data": _jsonl(d / "train.jsonl", rows), "prompt_key": "messages",
        # an untrained model's text matches "e" sometimes: the format reward gives the first steps a signal
        "reward": ["math_answer", "format"], "reward_weight": [1.0, 0.1], "format_regex": "e",
        "algo": "grpo", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0,
        "lr": 0.5, "kl_coef": 0.01, "eval_data": _jsonl(d / "eval.jsonl", held), "max_prompt_tokens": 32,
        "seed": 3,
    }
    import yaml

    (d / "run.yaml").write_text(yaml.safe_dump(cfg))
    return d


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def job_run(ray_driver, run_inputs, xla_cache):
    """The entry point as a Ray job: the YAML config plus flags (``--lr`` overrides the file's)."""
    from ray_integration import jobs

    out = run_inputs / "out"
    cmd = [sys.executable, "-m", "torchtpu_rl.train", "--config", str(run_inputs / "run.yaml"), "--steps",
           str(STEPS), "--lr", "0.003", "--save-every", "1", "--eval-every", "2", "--out", str(out), "--no-progress",
           "--xla-cache", xla_cache]
    env = {"OMP_NUM_THREADS": "1", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    job = jobs.submit(ray_driver.dashboard_url, cmd, env_vars=env)
    status = jobs.wait(ray_driver.dashboard_url, job, timeout_s=600)
    log = jobs.logs(ray_driver.dashboard_url, job)
    assert status == "SUCCEEDED", log[-4000:]
    return out, log


def test_train_runs_as_a_ray_job_and_writes_every_output(job_run, ray_driver, run_inputs):
    out, log = job_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ray_address"] == ray_driver.address  # connected to the cluster, not a head of its own
    rows = _read(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("reward_mean", "kl", "response_length_mean", "rollout_s", "reward_s", "learn_s", "sync_s",
                  "reward/math_answer", "reward/format", "pg_loss", "grad_norm"):
            assert isinstance(r[k], (int, float)), (k, r)
        assert 0 < r["response_length_mean"] <= 8 and r["samples"] == 8
    evals = _read(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2] and all(e["samples"] == 8 for e in evals)
    assert all(0.0 <= e["accuracy"] <= 1.0 and "reward/math_answer" in e for e in evals)
    # TensorBoard: the same scalars, one point per step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/reward_mean")] == [1, 2]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 2]
    assert (out / "curves.png").stat().st_size > 5000
    # sample completions of each evaluation (--eval-samples 4): prompt, completion, reward
    samples = _read(out / "samples.jsonl")
    assert [r["step"] for r in samples] == [0] * 4 + [2] * 4
    assert all(r["prompt"].startswith("<|user|>") and isinstance(r["completion"], str) and
               isinstance(r["reward"], float) for r in samples)
    for s in (1, 2):
        meta = json.loads((out / "checkpoints" / f"step_{s}" / "run.json").read_text())
        assert meta["step"] == s and meta["algo"] == "grpo"
        assert (out / "checkpoints" / f"step_{s}" / "state.pt").exists()
    # the newest 2 (--keep-checkpoints) of step_0, 1, 2; the frozen reference policy stored once beside them
    assert sorted(os.listdir(out / "checkpoints")) == ["reference.pt", "step_1", "step_2"]
    from torchtpu_rl.checkpoint import read_checkpoint

    state = read_checkpoint(out / "checkpoints" / "step_2" / "state.pt")
    assert "ref_policy" not in state["learner"] and state["reference"] == "../reference.pt"
    assert meta["config"]["lr"] == 0.003 and meta["config"]["group_size"] == 4  # flag over file, file over default
    assert "rl:" not in log  # --no-progress


def test_hf_output_is_the_trained_policy_for_plain_transformers(job_run, run_inputs):
    """hf/ reloads in plain transformers on CPU to the logits of the learner's final weights (read from the
    step-2 checkpoint), which differ from the initial model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchtpu_rl.checkpoint import read_checkpoint

    out, _ = job_run
    reloaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    tok = AutoTokenizer.from_pretrained(out / "hf")
    trained = AutoModelForCausalLM.from_pretrained(run_inputs / "model")
    initial = AutoModelForCausalLM.from_pretrained(run_inputs / "model")
    trained.load_state_dict(read_checkpoint(out / "checkpoints" / "step_2" / "state.pt")["learner"]["policy"])
    ids = tok("<|user|>Ann has 3 pens. She gets 4 more.<|assistant|>The answer is 7.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got, want, before = reloaded(ids).logits, trained(ids).logits, initial(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - before).abs().max() > 1e-4


def test_resume_continues_the_run_exactly(job_run, run_inputs, ray_driver, xla_cache, monkeypatch):
    """Resume from the job's step-1 checkpoint in this process: step 2 has the uninterrupted run's rewards and
    losses; rows of later steps already in --out are dropped and written again. A reward model (a Hugging Face
    sequence classifier in a reward actor) joins the rewards with weight 0: scored, logged, not counted.
    --out is relative: the learner actor (another working directory) writes its state.pt under it."""
    out, _ = job_run
    out2 = run_inputs / "resumed"
    out2.mkdir()
    monkeypatch.chdir(run_inputs)
    (out2 / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _read(out / "metrics.jsonl")))
    summary = train.main(["--config", str(run_inputs / "run.yaml"), "--steps", str(STEPS), "--lr", "0.003",
                          "--resume", str(out / "checkpoints" / "step_1"), "--out", "resumed", "--no-progress",
                          "--xla-cache", xla_cache, "--eval-data", "",  # "" turns the file's eval off
                          "--reward-model", str(run_inputs / "reward_model"), "--reward-model-weight", "0"])
    assert summary["resumed_from"].endswith("step_1") and summary["train_steps_this_run"] == 1
    first = _read(out / "metrics.jsonl")
    again = _read(out2 / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2]
    for k in ("reward_mean", "policy_version", "response_length_mean", "reward/math_answer"):
        assert again[1][k] == first[1][k], k
    assert again[1]["pg_loss"] == pytest.approx(first[1]["pg_loss"], abs=1e-6)
    assert again[1]["kl"] == pytest.approx(first[1]["kl"], abs=1e-6)
    assert isinstance(again[1]["reward/reward_model"], float) and "reward/reward_model" not in first[1]
    assert json.loads((out2 / "checkpoints" / "step_2" / "run.json").read_text())["policy_version"] == 2
    assert (out2 / "checkpoints" / "step_2" / "state.pt").is_file()


def test_resume_of_another_algorithm_or_model_is_refused(job_run, run_inputs, capsys):
    out, _ = job_run
    base = ["--config", str(run_inputs / "run.yaml"), "--out", str(run_inputs / "refused")]
    with pytest.raises(train.TrainError, match=r"step_2'.*checkpoint of a grpo run, this run is ppo"):
        train.main(base + ["--resume", str(out), "--algo", "ppo"])  # a run directory: its latest checkpoint
    with pytest.raises(train.TrainError, match=r"different model from --model .*other_model.*hidden_size: 32 there, "
                                               r"48 here"):
        train.main(base + ["--resume", str(out), "--model", str(run_inputs / "other_model")])
    with pytest.raises(train.TrainError, match="made with --seed 3, this run has --seed 4"):
        train.main(base + ["--resume", str(out), "--seed", "4"])
    assert train.cli(base + ["--resume", str(out / "checkpoints" / "step_1"), "--dtype", "bfloat16"]) == 2
    assert "its weights are float32, this run asks for bfloat16" in capsys.readouterr().err
    with pytest.raises(train.TrainError, match="no run.json"):
        train.main(base + ["--resume", str(run_inputs)])


def test_bad_inputs_are_named_before_any_actor_starts(run_inputs, tmp_path):
    cfg = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o")]
    with pytest.raises(train.TrainError, match=r"train.jsonl.*no column 'question'"):
        train.main(cfg + ["--prompt-key", "question"])
    with pytest.raises(train.TrainError, match=r"data file .*nope.jsonl.* does not exist"):
        train.main(cfg + ["--data", str(tmp_path / "nope.jsonl")])
    with pytest.raises(train.TrainError, match=r"is not a causal language model"):
        from transformers import Qwen2Config, Qwen2ForSequenceClassification

        Qwen2ForSequenceClassification(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                   num_labels=1)).save_pretrained(tmp_path / "rm")
        train.main(cfg + ["--model", str(tmp_path / "rm")])
    with pytest.raises(train.TrainError, match="unknown reward 'accuracy'"):
        train.main(cfg + ["--reward", "accuracy", "--reward-weight", "1"])
    with pytest.raises(train.TrainError, match="1 --reward-weight for 2 --reward"):
        train.main(cfg + ["--reward-weight", "1"])  # replaces the file's two weights
    with pytest.raises(train.TrainError, match="--learner-processes 2 .*sharded learner.*--algo ppo"):
        train.main(cfg + ["--learner-processes", "2", "--algo", "ppo"])
    with pytest.raises(train.TrainError, match="--prompts-per-step 2 must be a multiple of --learner-processes 3"):
        train.main(cfg + ["--learner-processes", "3"])
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "m"\nlearning_rte = 0.1\n')
    with pytest.raises(train.TrainError, match=r"bad.toml.*unknown option 'learning_rte'"):
        train.main(["--config", str(bad)])
    good = tmp_path / "good.toml"
    good.write_text(f'model = "{run_inputs / "model"}"\ndata = "{run_inputs / "train.jsonl"}"\n'
                    'reward = "math_answer"\nsteps = 7\nmode = "async"\n')
    args = train.parse_args(["--config", str(good), "--steps", "9"])
    assert (args.steps, args.mode, args.reward, args.prompt_key) == (9, "async", ["math_answer"], "prompt")


def test_a_bad_reward_stops_the_run_naming_the_reward_and_the_sample(job_run, run_inputs, tmp_path, xla_cache):
    """A reward function that returns NaN for the first prompt of step 1 (its name is in that prompt):
    the run stops with RewardError naming the reward, the sample and its prompt."""
    from torchtpu_rl import hf
    from torchtpu_rl.data import load_prompts
    from torchtpu_rl.driver import RewardError

    tok = hf.load_tokenizer(run_inputs / "model")
    ds = load_prompts(str(run_inputs / "train.jsonl"), tok, "messages", seed=3)  # the run's seed: its order
    name = ds.text(ds.take(1)[0][0]).removeprefix("<|user|>").split()[0]
    f = tmp_path / "flaky.py"
    f.write_text(f"def nan_for_{name}(prompts, completions, **columns):\n"
                 f"    return [float('nan') if '{name} has' in p else 0.0 for p in prompts]\n")
    with pytest.raises(RewardError, match=rf"reward for sample 0 RewardFunctionError: reward 'nan_for_{name}' "
                                          rf"returned nan \(prompt=<\|user\|>{name} has"):
        train.main(["--config", str(run_inputs / "run.yaml"), "--steps", "1", "--out", str(tmp_path / "o"),
                    "--reward", f"{f}:nan_for_{name}", "--reward-weight", "1", "--eval-data", "", "--no-progress",
                    "--xla-cache", xla_cache])



def test_example_builds_a_model_directory_with_a_warm_up(tmp_path):
    """examples/rl_text_arith.py's first half: data, tokenizer with chat template, Qwen2 model, a few warm-up
    steps on tpu (the loss falls), saved as a directory the entry point loads."""
    from torchtpu_rl import hf
    from torchtpu_rl.data import load_prompts

    prep = rl_text_arith.prepare(str(tmp_path), n_train=64, n_eval=8, hidden=32, layers=1, sft_steps=3,
                                 log=lambda *a: None)
    (s0, first), (s2, last) = prep["sft_losses"]
    assert (s0, s2) == (0, 2) and last < first
    tok = hf.load_tokenizer(prep["model"])
    assert tok.chat_template and tok.pad_token == "<pad>"
    policy = hf.load_policy(prep["model"], device="cpu")
    assert type(policy).__name__ == "Qwen2ForCausalLM" and policy.config.vocab_size == len(tok)
    ds = load_prompts(prep["eval"], tok, "messages")
    assert len(ds) == 8 and ds.texts[0].startswith("<|user|>") and ds.texts[0].endswith("<|assistant|>")
    rl_text_arith.main(["--data-only", "--out", str(tmp_path / "d"), "--train-size", "10", "--eval-size", "3"])
    assert len(_read(tmp_path / "d" / "data" / "eval.jsonl")) == 3


# ------------------------------------------------------------------ defects found running it as a new user
def _copy_model(src, dst, skip=()):
    import shutil

    dst.mkdir()
    for f in os.listdir(src):
        if f not in skip:
            shutil.copy(src / f, dst / f)
    return dst


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1"], "--lr must be a finite number > 0, not -1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, not nan"),
    (["--kl-coef", "-1"], "--kl-coef must be a finite number >= 0"),
    (["--mini-batch-size", "0"], "--mini-batch-size must be a positive integer, not 0"),
    (["--micro-batch-tokens", "0"], "--micro-batch-tokens must be a positive integer, not 0"),
    (["--reward-weight", "1", "--reward-weight", "nan"], "--reward-weight must be finite numbers: weight 2 "
                                                         "\\(of --reward 'format'\\) is nan"),
    (["--grad-clip", "-1"], "--grad-clip must be a finite number >= 0"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--max-reward-error-fraction", "1.5"], r"--max-reward-error-fraction must be a fraction in \[0, 1\]"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be a positive integer"),
    (["--max-sampling-rounds", "0"], "--max-sampling-rounds must be a positive integer, not 0"),
    (["--algo", "ppo", "--loss-type", "gspo"], "--loss-type gspo is a critic-free group loss: give --algo grpo"),
    (["--algo", "ppo", "--dynamic-sampling"], "--dynamic-sampling drops prompt groups .* needs --algo grpo"),
    (["--algo", "ppo", "--pack-sequences"], "--pack-sequences packs the policy's forward of a single learner"),
    (["--epsilon-high", "-0.1"], "--clip-eps-high must be a finite number > 0"),
])
def test_bad_numbers_exit_2_naming_the_flag_before_ray_starts(run_inputs, tmp_path, capsys, flags, message):
    argv = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o")] + flags
    assert train.cli(argv) == 2  # before Ray starts: the checks come first
    assert re.search(message, capsys.readouterr().err)
    with pytest.raises(train.TrainError, match=message):
        train._setup(train.parse_args(argv))


def test_model_directory_defects_are_named_before_ray_starts(run_inputs, tmp_path):
    cfg = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o")]
    torn = _copy_model(run_inputs / "model", tmp_path / "torn")
    w = torn / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # a copy cut short
    with pytest.raises(train.TrainError, match=r"weight file .*torn/model.safetensors' is torn or unreadable"):
        train._setup(train.parse_args(cfg + ["--model", str(torn)]))
    bare = _copy_model(run_inputs / "model", tmp_path / "bare",
                       skip=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"))
    with pytest.raises(train.TrainError, match=r"bare' has no tokenizer files"):
        train._setup(train.parse_args(cfg + ["--model", str(bare)]))


def test_defaults_derived_from_the_model(run_inputs, tmp_path):
    """The model's context is 128 positions: the default prompt budget is what --max-new-tokens leaves (512
    would be refused); an explicit budget that does not fit stays an error. The local head's object store
    defaults to twice the weights (at least 200 MB) and its CPUs to this machine's."""
    base = ["--model", str(run_inputs / "model"), "--data", str(run_inputs / "train.jsonl"), "--prompt-key",
            "messages", "--reward", "math_answer", "--max-new-tokens", "8", "--out", str(tmp_path / "o")]
    args = train.parse_args(base)
    s = train._setup(args)
    assert args.max_prompt_tokens == 120 and s["engine_kwargs"]["prompt_buckets"].buckets[-1] == 120
    assert args.ray_object_store_mb == 200 and args.ray_num_cpus == os.cpu_count()
    args = train.parse_args(base + ["--ray-num-cpus", "3", "--ray-object-store-mb", "300"])
    train._setup(args)
    assert (args.ray_num_cpus, args.ray_object_store_mb) == (3, 300)
    with pytest.raises(train.TrainError, match="--max-prompt-tokens 512 \\+ --max-new-tokens 8 exceed the model's "
                                               "max_position_embeddings 128"):
        train._setup(train.parse_args(base + ["--max-prompt-tokens", "512"]))
    with pytest.raises(train.TrainError, match="--max-new-tokens 128 leaves no room for a prompt"):
        train._setup(train.parse_args(base + ["--max-new-tokens", "128"]))


def _fake_checkpoint(out, step, state=True):
    d = out / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"format": train.RUN_FORMAT, "step": step}))
    if state:
        (d / "state.pt").write_bytes(b"x")
    return d


def test_relative_out_is_taken_from_the_working_directory(run_inputs, tmp_path, monkeypatch):
    """--out is made absolute before any actor sees it (a learner actor runs in another directory)."""
    monkeypatch.chdir(tmp_path)
    args = train.parse_args(["--config", str(run_inputs / "run.yaml"), "--out", "runs/rel"])
    train._setup(args)
    assert args.out == str(tmp_path / "runs" / "rel")


def test_a_fresh_run_into_an_earlier_runs_out_is_refused_or_overwritten(run_inputs, tmp_path):
    out = tmp_path / "o"
    _fake_checkpoint(out, 3)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = ["--config", str(run_inputs / "run.yaml"), "--out", str(out)]
    with pytest.raises(train.TrainError, match=r"holds checkpoints of an earlier run \(step_3 the newest\): continue "
                                               r"it with --resume .*or pass --overwrite-out"):
        train._setup(train.parse_args(cfg))
    assert (out / "checkpoints" / "step_3" / "run.json").exists()
    train._setup(train.parse_args(cfg + ["--overwrite-out"]))
    assert not (out / "checkpoints").exists()


def test_resume_skips_checkpoints_without_state_and_prunes_keep_the_newest(tmp_path):
    out = tmp_path / "o"
    for s in (1, 2):
        _fake_checkpoint(out, s)
    _fake_checkpoint(out, 3, state=False)  # run.json without its state.pt (a copy cut short, a cleanup)
    with pytest.warns(UserWarning, match=r"skipping newer checkpoint\(s\) \['step_3'\] without a state.pt"):
        assert train._checkpoint_dir(str(out)) == str(out / "checkpoints" / "step_2")
    _fake_checkpoint(out, 4)
    (out / "checkpoints" / "reference.pt").write_bytes(b"r")
    assert train._prune_checkpoints(str(out / "checkpoints"), keep=2) == [1, 3]
    assert sorted(os.listdir(out / "checkpoints")) == ["reference.pt", "step_2", "step_4"]
    empty = tmp_path / "e"
    _fake_checkpoint(empty, 1, state=False)
    with pytest.raises(train.TrainError, match=r"none of its checkpoints \['step_1'\] has a state.pt"):
        train._checkpoint_dir(str(empty))


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    """A run killed while appending to metrics.jsonl leaves half a line: resume drops it (with a warning); a
    bad line before the last is an error naming the file and line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.6}\n{"step": 3, "rew')
    with pytest.warns(UserWarning, match="dropping its torn last line 3"):
        train._Outputs._truncate(str(path), 2)
    assert _read(path) == [{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": 0.6}]
    path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(train.TrainError, match=r"metrics.jsonl' line 2 is not valid JSON"):
        train._read_jsonl(str(path))


def test_config_files_take_trl_and_verl_names(run_inputs, tmp_path):
    """A config file may use TRL's GRPOConfig names (and verl's where they mean the same); each reaches the
    Learner option it names. One option under two names, or a value TRL has and we do not, is named."""
    import yaml

    cfg = {"model": str(run_inputs / "model"), "data": str(run_inputs / "train.jsonl"), "prompt_key": "messages",
           "reward": "math_answer", "learning_rate": 3e-6, "num_generations": 4, "beta": 0.04, "epsilon": 0.2,
           "epsilon_high": 0.28, "max_completion_length": 8, "temperature": 0.9, "loss_type": "dr_grpo",
           "scale_rewards": False, "num_iterations": 2, "per_device_train_batch_size": 4, "entropy_coeff": 0.01,
           "weight_decay": 0.1, "max_grad_norm": 0.5, "output_dir": str(tmp_path / "o")}
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump(cfg))
    args = train.parse_args(["--config", str(tmp_path / "trl.yaml")])
    kw = train._setup(args)["learner_kwargs"]
    assert (kw["lr"], kw["group_size"], kw["kl_coef"], kw["eps_low"], kw["eps_high"]) == (3e-6, 4, 0.04, 0.2, 0.28)
    assert (kw["loss_type"], kw["loss_agg"], kw["scale_rewards"], kw["ppo_epochs"], kw["micro_batch_size"]) == \
        ("dr_grpo", None, "none", 2, 4)
    assert kw["norm_length"] == 8  # Dr. GRPO divides by max_completion_length
    assert (kw["entropy_coef"], kw["weight_decay"], kw["grad_clip"]) == (0.01, 0.1, 0.5)
    assert (args.max_new_tokens, args.temperature, args.out) == (8, 0.9, str(tmp_path / "o"))
    (tmp_path / "twice.yaml").write_text(yaml.safe_dump({**cfg, "lr": 1e-3}))
    with pytest.raises(train.TrainError, match=r"twice.yaml.*'lr' and 'learning_rate' both set --lr"):
        train.parse_args(["--config", str(tmp_path / "twice.yaml")])
    (tmp_path / "batch.yaml").write_text(yaml.safe_dump({**cfg, "scale_rewards": "batch"}))
    assert train._setup(train.parse_args(["--config", str(tmp_path / "batch.yaml")]))["learner_kwargs"][
        "scale_rewards"] == "batch"
    (tmp_path / "rows.yaml").write_text(yaml.safe_dump({**cfg, "scale_rewards": "rows"}))
    with pytest.raises(train.TrainError, match=r"scale_rewards must be true/'group', 'batch' or false/'none', not "
                                               r"'rows'"):
        train.parse_args(["--config", str(tmp_path / "rows.yaml")])
    with pytest.raises(train.TrainError, match=r"--clip-eps must be in \(0, 1\), not 1.5"):
        train._setup(train.parse_args(["--config", str(tmp_path / "trl.yaml"), "--clip-eps", "1.5"]))


def _digits(prompts, completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def test_trainer_python_entry_point_checks_on_construction(run_inputs, tmp_path):
    """Trainer(model, reward_funcs, config, train_dataset): callables and built-in names as rewards, a mapping
    of TRL names as config, an in-memory dataset; everything checked when it is built."""
    rows = _read(run_inputs / "train.jsonl")
    cfg = {"prompt_key": "messages", "learning_rate": 1e-3, "num_generations": 4, "beta": 0.0,
           "max_completion_length": 8, "out": str(tmp_path / "o")}
    t = train.Trainer(model=run_inputs / "model", reward_funcs=[_digits, "format"], config=cfg, train_dataset=rows)
    assert (t.args.lr, t.args.group_size, t.args.kl_coef) == (1e-3, 4, 0.0)
    assert [n for n, _ in t.setup["rewards"]] == ["_digits", "format"] and len(t.setup["dataset"]) == len(rows)
    with pytest.raises(train.TrainError, match=r"config: unknown option 'learning_rte'"):
        train.Trainer(model=run_inputs / "model", reward_funcs=[_digits], config={"learning_rte": 1},
                      train_dataset=rows)
    with pytest.raises(train.TrainError, match=r"a reward must be a built-in name, 'MODULE:FUNCTION', a callable"):
        train.Trainer(model=run_inputs / "model", reward_funcs=[3], config=cfg, train_dataset=rows)
    with pytest.raises(train.TrainError, match="no column 'messages'"):
        train.Trainer(model=run_inputs / "model", reward_funcs=[_digits], config=cfg, train_dataset=[{"q": "x"}])


def test_trainer_trains_with_a_callable_reward_on_rows(run_inputs, tmp_path, ray_driver, xla_cache):
    rows = _read(run_inputs / "train.jsonl")
    cfg = {"prompt_key": "messages", "learning_rate": 3e-3, "num_generations": 4, "prompts_per_step": 2,
           "max_completion_length": 8, "max_steps": 1, "out": str(tmp_path / "o"), "no_progress": True,
           "xla_cache": xla_cache, "seed": 3}
    summary = train.Trainer(model=run_inputs / "model", reward_funcs=[_digits], config=cfg, train_dataset=rows).train()
    assert summary["steps"] == 1 and summary["train_steps_this_run"] == 1
    meta = json.loads((tmp_path / "o" / "checkpoints" / "step_1" / "run.json").read_text())
    assert meta["config"]["reward"] == [f"{__name__}:_digits"] and meta["data"].endswith(f"of {len(rows)} rows>")


def test_report_to_is_checked_before_ray_starts(run_inputs, tmp_path):
    import importlib.util

    cfg = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o")]
    assert train.parse_args(cfg).report_to is None
    args = train.parse_args(cfg)
    train._setup(args)
    assert args.report_to == ["tensorboard"]
    with pytest.raises(train.TrainError, match=r"--report-to none goes alone, not with \['tensorboard'\]"):
        train._setup(train.parse_args(cfg + ["--report-to", "none", "--report-to", "tensorboard"]))
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(train.TrainError, match="--report-to wandb needs the wandb package"):
            train._setup(train.parse_args(cfg + ["--report-to", "wandb"]))


def test_every_loss_type_trains_a_step_from_the_command_line_options(run_inputs, tmp_path):
    """--loss-type X (with --scale-rewards, --epsilon-high, --pack-sequences) as the run's Learner gets it: the
    loss the algorithms table names, one step on the run's model (cpu) and its batch shapes."""
    import copy

    from torchtpu_rl import Learner, RolloutBatch
    from torchtpu_rl import algorithms as A
    from torchtpu_rl.hf import load_policy

    base = load_policy(str(run_inputs / "model"), device="cpu")
    g = torch.Generator().manual_seed(0)
    rlens = torch.tensor([8, 1, 2, 3, 8, 2, 1, 5])
    rmask = torch.arange(8)[None] < rlens[:, None]
    batch = RolloutBatch(prompt_ids=torch.randint(5, 30, (8, 6), generator=g), prompt_mask=torch.ones(8, 6, dtype=int),
                         response_ids=torch.randint(5, 30, (8, 8), generator=g) * rmask, response_mask=rmask,
                         logprobs=-torch.rand(8, 8, generator=g) * rmask, policy_version=torch.zeros(8, dtype=int),
                         stopped=torch.ones(8, dtype=bool))
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0])  # the second group all equal
    argv = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o"), "--pack-sequences"]
    for lt in A.LOSS_TYPES:
        extra = ["--scale-rewards", "batch"] if lt == "grpo" else ["--epsilon-high", "0.3"] if lt == "gspo" else []
        s = train._setup(train.parse_args(argv + ["--loss-type", lt] + extra + ["--overwrite-out"]))
        kw = dict(s["learner_kwargs"], device="cpu")
        learner = Learner(copy.deepcopy(base), **kw)
        spec = A.LOSS_SPECS[lt]
        assert learner.loss_spec.advantage == spec.advantage and learner.loss_spec.agg == spec.agg, lt
        assert learner.loss_spec.scale_rewards == ("batch" if lt == "grpo" else spec.scale_rewards), lt
        assert learner.eps_high == (0.3 if lt == "gspo" else spec.eps_high or 0.2), lt
        assert learner.pack_sequences
        m = learner.train_step(batch, rewards)
        assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0, lt
        if lt == "dapo":  # DAPO's overlong shaping: the length_penalty reward joins the run's rewards
            assert [n for n, _ in s["rewards"]][-1] == "length_penalty" and s["weights"][-1] == 1.0


def test_dapo_run_with_dynamic_sampling_and_packing(run_inputs, tmp_path, ray_driver, xla_cache):
    """One run of python -m torchtpu_rl.train's Trainer with --loss-type dapo --dynamic-sampling --pack-sequences:
    it trains, and the dynamic-sampling counts reach metrics.jsonl."""
    argv = ["--config", str(run_inputs / "run.yaml"), "--out", str(tmp_path / "o"), "--steps", "1", "--no-progress",
            "--xla-cache", xla_cache, "--loss-type", "dapo", "--dynamic-sampling", "--max-sampling-rounds", "2",
            "--pack-sequences", "--eval-data", ""]
    summary = train.main(argv)
    assert summary["steps"] == 1
    row = _read(tmp_path / "o" / "metrics.jsonl")[0]
    assert 1 <= row["dynamic_sampling_rounds"] <= 2 and row["samples"] == 8
    assert row["dynamic_sampling_short_groups"] <= row["dynamic_sampling_dropped_groups"]
    assert any("length_penalty" in k for k in row), row  # DAPO's overlong shaping is one of the run's rewards

