"""Agentic RL: environments, tool calls in a sandbox, multi-turn episodes whose observations carry no loss,
and ``python -m torchtpu_rl.train --env ... --tools ... --max-turns 2`` end to end."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_text_arith  # noqa: E402  (a template without tools)
import rl_tool_calc  # noqa: E402  (the tool example's task, tokenizer and template)

from torchtpu_rl import train  # noqa: E402
from torchtpu_rl.environments import EchoTurnsEnv, EnvSpecError, resolve_env  # noqa: E402
from torchtpu_rl.episodes import EpisodeRunner, EpisodeSpec, _Render  # noqa: E402
from torchtpu_rl.protocol import RolloutBatch, SamplingParams, engine_stats  # noqa: E402
from torchtpu_rl.sandbox import SandboxLimits, run_tool  # noqa: E402
from torchtpu_rl.tools import (TemplateError, ToolSpecError, check_template_renders_tools,  # noqa: E402
                               parse_tool_calls, resolve_tools)


@pytest.fixture(scope="module")
def task():
    rows, held = rl_tool_calc.make_splits(64, 8, seed=1)
    tok = rl_tool_calc.build_tokenizer(rows + held)
    return rows, held, tok


def _prompt(tok, row, tools=None):
    text = tok.apply_chat_template(row["messages"], tools=[t.schema for t in tools] if tools else None,
                                   tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """An engine whose turns are given in advance (the episode runner's control flow, turn by turn, without a
    model's randomness); the runner on a real engine is tested below and end to end."""

    def __init__(self, tok, script):
        self.tok, self.script, self.pad_id, self.calls, self.last_stats = tok, list(script), tok.pad_token_id, [], {}

    def generate(self, prompts, params, policy_version=None):
        self.calls.append([list(p) for p in prompts])
        texts = self.script.pop(0)
        seqs = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        R = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), R), self.pad_id)
        mask = torch.zeros((len(seqs), R), dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), True
        P = max(len(p) for p in prompts)
        pid = torch.full((len(prompts), P), self.pad_id)
        pm = torch.zeros((len(prompts), P), dtype=torch.int64)
        for i, p in enumerate(prompts):
            pid[i, P - len(p):], pm[i, P - len(p):] = torch.tensor(p), 1
        return RolloutBatch(pid, pm, ids, mask, -torch.ones(ids.shape) * mask, torch.zeros(len(seqs), dtype=torch.int64),
                            torch.ones(len(seqs), dtype=torch.bool), pad_id=self.pad_id)


# ------------------------------------------------------------------ tools and the sandbox
def test_tool_calls_are_parsed_and_bad_ones_say_why(task):
    tools = resolve_tools(["calculator", "python"])
    assert [t.name for t in tools] == ["calculator", "python"]
    assert tools[0].schema["function"]["parameters"]["required"] == ["expression"]
    calls, errors = parse_tool_calls('think <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
                                     '</tool_call> and <tool_call>{"name": "python", "arguments": '
                                     '"{\\"code\\": \\"print(1)\\"}"}</tool_call>', tools)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+3"}),
                                                      ("python", {"code": "print(1)"})] and errors == []
    assert parse_tool_calls("no call here", tools) == ([], [])
    cases = {'<tool_call>{"name": "calculator", "arguments": {</tool_call>': "not valid JSON",
             '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "there is no tool 'search'",
             '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>': r"needs argument\(s\) \['expression'\]",
             '<tool_call>{"name": "calculator", "arguments": {"expression": 3}}</tool_call>': "must be string",
             '<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>': "needs argument",
             '<tool_call>["calculator"]</tool_call>': "must be a JSON object",
             '<tool_call>{"name": "calculator"': "never closed"}
    for text, why in cases.items():
        calls, errors = parse_tool_calls(text, tools)
        assert calls == [] and len(errors) == 1, text
        assert __import__("re").search(why, str(errors[0])), (text, str(errors[0]))


def test_tools_run_in_the_sandbox_and_every_failure_is_an_outcome(tmp_path):
    calc, py = resolve_tools(["calculator", "python"])
    assert run_tool(calc.ref, {"expression": "(47 + 38) * 2 / 4"}, stdlib_only=True).text == "42.5"
    assert run_tool(py.ref, {"code": "print(sum(range(10)))"}, stdlib_only=True).text == "45\n"
    (tmp_path / "bad_tools.py").write_text(textwrap.dedent('''
        def hang(seconds: int) -> str:
            """Sleep.

            Args:
                seconds: how long
            """
            import time
            time.sleep(seconds)
            return "woke"

        def spin(n: int) -> str:
            """Burn CPU.

            Args:
                n: unused
            """
            while True:
                n += 1

        def hog(mb: int) -> str:
            """Allocate.

            Args:
                mb: megabytes
            """
            return str(len(bytearray(mb * 2**20)))

        def boom(x: int) -> str:
            """Raise.

            Args:
                x: anything
            """
            raise ValueError(f"bad x {x}")

        def chatty(n: int) -> str:
            """Print a lot.

            Args:
                n: characters
            """
            return "y" * n

        def net(host: str) -> str:
            """Connect.

            Args:
                host: where
            """
            import socket
            socket.create_connection((host, 80), timeout=1)
            return "connected"
    '''))
    tools = {t.name: t for t in resolve_tools([f"{tmp_path / 'bad_tools.py'}:{n}" for n in
                                               ("hang", "spin", "hog", "boom", "chatty", "net")])}
    lim = SandboxLimits(timeout_s=2.0, cpu_s=1, memory_mb=256, max_output_bytes=1000)
    out = {n: run_tool(tools[n].ref, a, lim) for n, a in (("hang", {"seconds": 60}), ("spin", {"n": 0}),
                                                          ("hog", {"mb": 1024}), ("boom", {"x": 3}),
                                                          ("chatty", {"n": 5000}), ("net", {"host": "127.0.0.1"}))}
    assert out["hang"].status == "timeout" and "killed" in out["hang"].text and out["hang"].seconds < 10
    assert out["spin"].status in ("killed", "timeout") and not out["spin"].ok
    assert out["hog"].status == "killed" and "memory limit (256 MB)" in out["hog"].text
    assert out["boom"].status == "error" and out["boom"].text == "ValueError: bad x 3"
    assert out["chatty"].status == "output_limit"
    assert out["net"].status == "error" and "network access is disabled" in out["net"].text
    assert run_tool(tools["hog"].ref, {"mb": 1}, lim).text == str(2**20)  # within the limits it runs


def test_tool_results_and_failures_become_observations_and_are_counted(task):
    rows, _, tok = task
    tools = resolve_tools(["calculator"])
    spec = EpisodeSpec(tokenizer=tok, tools=tuple(tools), max_turns=3, max_context_tokens=256)
    runner = EpisodeRunner(spec)
    script = [[rl_tool_calc.tool_call_text("47+38"), '<tool_call>{"name": "calculator"</tool_call>',
               "The answer is 9."],
              ["The answer is 85.", rl_tool_calc.tool_call_text("2**1000000")]]
    eng = ScriptedEngine(tok, script + [["The answer is 1."]])
    prompts = [_prompt(tok, r, tools) for r in rows[:3]]
    batch = runner.run(eng, prompts, rows[:3], SamplingParams(max_new_tokens=64), 0)
    e0, e1, e2 = batch.episodes
    assert [m["role"] for m in e0["messages"]] == ["assistant", "tool", "assistant"]
    assert e0["messages"][1]["content"] == "85" and e0["messages"][0]["tool_calls"][0]["function"]["name"] == "calculator"
    assert e1["tool_parse_failures"] == 1 and e1["messages"][1]["content"].startswith("error: the tool call is not valid")
    assert e1["tool_errors"] == 1 and "exponent too large" in e1["messages"][3]["content"]
    assert e2["turns"] == 1 and e2["tool_calls"] == 0  # an answer without a tool call ends the episode
    # the second turn's prompt is the first prompt + the first turn + the rendered tool result
    turn2 = eng.calls[1][0]
    assert tok.decode(turn2).endswith('"47+38"}}</tool_call></s><|tool|>85<|assistant|>')
    # observations carry no loss: the loss mask is the assistant's tokens only
    lm, rm = batch.loss_mask[0], batch.response_mask[0]
    obs = tok(tok.decode(batch.response_ids[0][rm & ~lm]), add_special_tokens=False)["input_ids"]
    assert tok.decode(obs) == "<|tool|>85<|assistant|>"
    st = runner.last_stats
    assert (st["episodes"], st["tool_calls"], st["tool_parse_failures"], st["tool_errors"]) == (3, 2, 1, 1)
    from torchtpu_rl.protocol import RolloutResult

    agg = engine_stats([RolloutResult(0, batch.state(), 0, 0, 0, 0.0, 0, st)])
    assert agg["tool_parse_failure_rate"] == 1 / 3 and agg["turns_per_episode"] == (2 + 3 + 1) / 3


def test_limits_end_episodes_after_an_assistant_turn(task):
    rows, _, tok = task
    tools = resolve_tools(["calculator"])
    call = rl_tool_calc.tool_call_text("1+1")
    for spec, reason in ((EpisodeSpec(tokenizer=tok, tools=tuple(tools), max_turns=2), "max_turns"),
                         (EpisodeSpec(tokenizer=tok, tools=tuple(tools), max_turns=9, max_episode_tokens=40),
                          "max_episode_tokens"),
                         (EpisodeSpec(tokenizer=tok, tools=tuple(tools), max_turns=9, max_context_tokens=60), "context"),
                         (EpisodeSpec(tokenizer=tok, tools=tuple(tools), max_turns=9, max_episode_seconds=1e-9),
                          "max_episode_seconds")):
        eng = ScriptedEngine(tok, [[call]] * 9)
        batch = EpisodeRunner(spec).run(eng, [_prompt(tok, rows[0], tools)], rows[:1], SamplingParams(8), 0)
        ep = batch.episodes[0]
        assert ep["truncated"] == reason, (reason, ep)
        assert ep["messages"][-1]["role"] == "assistant" and batch.loss_mask[0][batch.response_mask[0]][-1]


# ------------------------------------------------------------------ a two-turn environment trains on its mask
def test_two_turn_env_on_the_engine_trains_only_on_assistant_tokens(task):
    device = "cpu"  # the mask logic is the device's business nowhere; tpu runs in the end-to-end test below
    from torchtpu_rl.learner import Learner
    from torchtpu_rl.rollout import RolloutEngine

    rows, _, tok = task
    model = rl_tool_calc.build_model(tok, hidden=32, layers=1, heads=2, seed=0)
    eng = RolloutEngine(rl_tool_calc.build_model(tok, hidden=32, layers=1, heads=2, seed=0), tok.pad_token_id,
                        device=device)
    runner = EpisodeRunner(EpisodeSpec(tokenizer=tok, env="echo_turns", max_turns=2, max_context_tokens=128))
    torch.manual_seed(0)
    prompts = [_prompt(tok, r) for r in rows[:2] for _ in range(2)]
    batch = runner.run(eng, prompts, [r for r in rows[:2] for _ in range(2)],
                       SamplingParams(max_new_tokens=6, stop_token_ids=(tok.eos_token_id,)), 0)
    render = _Render(tok, True, [])
    for i, ep in enumerate(batch.episodes):
        assert ep["turns"] == 2 and [m["role"] for m in ep["messages"]] == ["assistant", "user", "assistant"]
        assert ep["env_reward"] in (0.0, 1.0)
        rm, lm = batch.response_mask[i], batch.loss_mask[i]
        # exactly the observation's tokens are masked: the first turn's tokens, then "Say more." rendered
        n1 = int(lm[rm].long().cumprod(0).sum())  # the first turn's length
        first = batch.response_ids[i][:n1].tolist()
        stopped = first[-1] == tok.eos_token_id
        obs = render.observation([{"role": "user", "content": "Say more."}], tok.eos_token_id if stopped else None)
        assert batch.response_ids[i][n1:n1 + len(obs)].tolist() == obs
        assert not lm[n1:n1 + len(obs)].any() and lm[n1 + len(obs):int(rm.sum())].all()
        assert (batch.logprobs[i][~lm] == 0).all() and (batch.logprobs[i][lm] < 0).all()
    learner = Learner(model.to(device), algo="grpo", group_size=2, lr=1e-3, kl_coef=0.0, device=device)
    _, _, rmask, _, _ = learner._layout(batch)
    P = batch.prompt_ids.shape[1]
    assert torch.equal(rmask[:, P:P + batch.response_ids.shape[1]].bool(), batch.loss_mask)
    m = learner.train_step(batch, [1.0, 0.0, 0.5, 0.0])
    assert m["response_tokens"] == int(batch.loss_mask.sum()) < int(batch.response_mask.sum())
    # a batch without a loss mask trains on every response token, as before
    plain = RolloutBatch.from_state({k: v for k, v in batch.state().items() if k not in ("loss_mask", "episodes")})
    assert learner._layout(plain)[2].sum() == batch.response_mask.sum()


def test_the_batch_carries_its_mask_and_records_through_concat_select_and_state(task):
    rows, _, tok = task
    runner = EpisodeRunner(EpisodeSpec(tokenizer=tok, env="echo_turns", max_turns=2))
    eng = ScriptedEngine(tok, [["a", "bb"], ["ccc", ""]])
    a = runner.run(eng, [_prompt(tok, r) for r in rows[:2]], rows[:2], SamplingParams(8), 0)
    b = RolloutBatch(a.prompt_ids, a.prompt_mask, a.response_ids[:, :3], a.response_mask[:, :3], a.logprobs[:, :3],
                     a.policy_version, a.stopped, pad_id=a.pad_id)
    c = RolloutBatch.concat([a, b])
    assert c.loss_mask.shape == c.response_ids.shape and torch.equal(c.loss_mask[2:, :3], b.response_mask)
    assert c.episodes[:2] == a.episodes and c.episodes[2:] == [None, None]
    s = RolloutBatch.from_state(a.state()).select([1])
    assert s.episodes == [a.episodes[1]] and torch.equal(s.loss_mask, a.loss_mask[1:])
    assert [e["env_reward"] for e in a.episodes] == [1.0, 0.0]  # echo_turns: the second turn had text


# ------------------------------------------------------------------ bad input, named before Ray starts
def test_bad_environments_tools_and_templates_are_refused_naming_them(task, tmp_path):
    _, _, tok = task
    (tmp_path / "envs.py").write_text(textwrap.dedent('''
        class NoStep:
            def reset(self, row):
                return None

        class TwoArgs:
            def reset(self, row):
                return None
            def step(self, completion, extra):
                return None, 0.0, True

        class NeedsConfig:
            def __init__(self, config):
                pass
            def reset(self, row):
                return None
            def step(self, completion):
                return None, 0.0, True

        def not_a_class(row):
            return None

        def undocumented(x):
            return x
    '''))
    f = tmp_path / "envs.py"
    for spec, why in ((f"{f}:NoStep", "has no step"), (f"{f}:TwoArgs", "must take one argument"),
                      (f"{f}:NeedsConfig", "constructible with no arguments"), (f"{f}:not_a_class", "must name a class"),
                      (f"{f}:Missing", "has no 'Missing'"), ("nowhere.py:X", "does not exist"),
                      ("nosuchmodule_xyz:X", "cannot import module"), ("unknown_builtin", "not a built-in")):
        with pytest.raises(EnvSpecError, match=why):
            resolve_env(spec)
    assert resolve_env("echo_turns") is EchoTurnsEnv
    with pytest.raises(ToolSpecError, match="has no JSON schema"):
        resolve_tools([f"{f}:undocumented"])
    with pytest.raises(ToolSpecError, match="give a built-in name"):
        resolve_tools(["nonexistent_tool"])
    with pytest.raises(ToolSpecError, match="two tools are named 'calculator'"):
        resolve_tools(["calculator", "calculator"])
    check_template_renders_tools(tok, resolve_tools(["calculator"]))
    plain, _ = rl_text_arith.make_splits(20, 0)
    with pytest.raises(TemplateError, match="does not render tools"):
        check_template_renders_tools(rl_text_arith.build_tokenizer(plain), resolve_tools(["calculator"]))


@pytest.fixture(scope="module")
def run_dir(task, tmp_path_factory):
    rows, held, tok = task
    d = tmp_path_factory.mktemp("agentic")
    model = rl_tool_calc.build_model(tok, hidden=32, layers=1, heads=2, seed=0)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    for name, rs in (("train.jsonl", rows), ("eval.jsonl", held)):
        with open(d / name, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rs)
    return d


def _argv(d, *extra):
    return ["--model", str(d / "model"), "--data", str(d / "train.jsonl"), "--prompt-key", "messages",
            "--out", str(d / "out"), "--no-progress", "--report-to", "none", "--max-prompt-tokens", "96",
            "--max-new-tokens", "8", "--overwrite-out", *extra]


def test_cli_refuses_bad_agentic_flags_with_exit_2_before_ray(run_dir, tmp_path, capsys):
    import ray

    was = ray.is_initialized()
    (tmp_path / "e.py").write_text("class E:\n    def reset(self, row):\n        return None\n")
    plain = tmp_path / "plain_model"
    rows, _ = rl_text_arith.make_splits(20, 0)
    ptok = rl_text_arith.build_tokenizer(rows)
    rl_text_arith.build_model(ptok, hidden=32, layers=1, heads=2).save_pretrained(plain)
    ptok.save_pretrained(plain)
    cases = [(_argv(run_dir, "--env", f"{tmp_path / 'e.py'}:E"), "--env .*has no step"),
             (_argv(run_dir, "--reward", "math_answer", "--tools", f"{tmp_path / 'e.py'}:E"), "--tools: tool .*e.py:E. has no JSON schema"),
             (_argv(run_dir, "--reward", "math_answer", "--max-turns", "2"), "--max-turns limits multi-turn episodes"),
             (_argv(run_dir, "--env", "echo_turns", "--max-turns", "0"), "--max-turns must be a positive integer"),
             (_argv(run_dir, "--env", "echo_turns", "--tool-timeout-s", "-1"), "--tool-timeout-s must be"),
             (["--model", str(plain), *_argv(run_dir, "--reward", "math_answer", "--tools", "calculator",
                                              "--max-prompt-tokens", "64")[2:]],
              "--tools: the tokenizer's chat template does not render tools")]
    for argv, why in cases:
        assert train.cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert __import__("re").search(why, err), (why, err)
    assert train.cli(_argv(run_dir)) == 2
    assert "an --env whose rewards train" in capsys.readouterr().err
    assert ray.is_initialized() == was  # nothing started


def test_train_with_an_env_and_tools_runs_end_to_end(run_dir, ray_driver):
    out = run_dir / "out"
    summary = train.main(_argv(run_dir, "--env", "echo_turns", "--tools", "calculator", "--max-turns", "2",
                               "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--lr", "1e-3", "--kl-coef", "0", "--eval-data", str(run_dir / "eval.jsonl"),
                               "--eval-limit", "2", "--xla-cache", str(run_dir / "xla")))
    assert summary["steps"] == 1
    step = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][0]
    assert step["episodes"] == 4 and step["episode_turns"] >= 4 and "tool_parse_failure_rate" in step
    assert "reward/env_reward" in step and step["response_tokens"] <= step["assistant_tokens"] + step[
        "observation_tokens"]
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["samples"] == 2 and evals[0]["accuracy"] is not None
