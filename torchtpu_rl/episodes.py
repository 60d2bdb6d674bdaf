"""Multi-turn episodes on a rollout engine: environments, tool calls, one training row per episode.

A rollout worker given an :class:`EpisodeSpec` runs each request's prompts as episodes
(:class:`EpisodeRunner`): turn after turn, every live episode's conversation so far is the next prompt
(one ``engine.generate`` call per turn for all live episodes; with the serving engine its prefix cache
finds the earlier turns' KV). After each assistant turn:

- with tools, its ``<tool_call>`` blocks are parsed (:func:`~torchtpu_rl.tools.parse_tool_calls`) and run
  in the sandbox (:func:`~torchtpu_rl.sandbox.run_tool`, a thread pool over the turn's calls); their
  results (or why they failed: a parse failure, a raising tool, one killed for time or memory) are
  appended as ``tool`` messages and the model takes another turn;
- otherwise the environment's ``step(completion)`` gives the observation, a reward and ``done``; without
  an environment an answer with no tool call ends the episode;
- limits end an episode after an assistant turn: ``max_turns``, ``max_episode_tokens`` (its tokens after the
  prompt), ``max_episode_seconds`` of wall time, and the engine's context (the next prompt must fit
  ``max_context_tokens``); the reason is recorded (``truncated``).

An episode is one :class:`~torchtpu_rl.protocol.RolloutBatch` row: ``prompt_ids`` the first prompt (with
the environment's ``reset`` message), ``response_ids`` everything after it (assistant turns and
observations), ``response_mask`` the real tokens (attention), ``loss_mask`` the assistant tokens only
(observations and tool results carry no loss), ``logprobs`` each sampled token's rollout log-prob (0 at
observations), and ``episodes`` one record per row (the messages after the prompt, the environment's
reward, turns, tool-call counts) that the rewards read.

Observations are rendered with the tokenizer's chat template (``chat=True``): the text a template puts
after an assistant turn's content closes it (less the stop token the model already produced), then the
observation messages with the generation prompt; without a template they are plain text lines.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from .protocol import EPISODE_STATS, RolloutBatch, SamplingParams
from .sandbox import SandboxLimits, run_tool

__all__ = ["EPISODE_STATS", "EpisodeError", "EpisodeRunner", "EpisodeSpec"]


class EpisodeError(RuntimeError):
    """An environment broke its contract during an episode (raised, or returned the wrong shape)."""


@dataclasses.dataclass
class EpisodeSpec:
    """How a rollout worker runs episodes (picklable: it travels to the workers).

    ``env``: an environment spec for :func:`~torchtpu_rl.environments.resolve_env` (resolved in the
    worker) or None (tools only); ``tools``: :class:`~torchtpu_rl.tools.Tool` objects; ``tokenizer``: the
    policy's (decodes turns, renders observations); ``chat``: render with its chat template."""

    tokenizer: Any
    env: Any = None
    tools: tuple = ()
    max_turns: int = 4
    max_episode_tokens: Optional[int] = None
    max_episode_seconds: Optional[float] = None
    max_context_tokens: Optional[int] = None
    chat: bool = True
    sandbox: SandboxLimits = SandboxLimits()
    tool_threads: int = 4

    def __post_init__(self):
        if self.env is None and not self.tools:
            raise ValueError("EpisodeSpec: give an environment (--env) or tools (--tools)")
        for name in ("max_turns", "max_episode_tokens", "max_context_tokens", "tool_threads"):
            v = getattr(self, name)
            if v is None and name != "max_turns" and name != "tool_threads":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, not {v!r}")
        s = self.max_episode_seconds
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0):
            raise ValueError(f"--max-episode-seconds must be a number > 0, not {s!r}")
        self.tools = tuple(self.tools)


class _Render:
    """Token pieces of a conversation, from the chat template (see the module doc) or as plain text."""

    PROBE_USER = {"role": "user", "content": "u"}
    PROBE_ASSISTANT = {"role": "assistant", "content": "probe-assistant-turn-5c1"}

    def __init__(self, tokenizer, chat: bool, tools: list):
        self.tok = tokenizer
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        self.tools = [t.schema for t in tools] or None
        if self.chat:
            closed = self._text([self.PROBE_USER, self.PROBE_ASSISTANT], False)
            content = self.PROBE_ASSISTANT["content"]
            at = closed.rfind(content)
            if at < 0:
                raise EpisodeError("the chat template drops assistant messages' content; multi-turn episodes "
                                   "need it rendered")
            self.close = closed[at + len(content):]  # what the template writes after an assistant turn's content
            self.closed_probe = closed
            with_gen = self._text([self.PROBE_USER], True)
            self.gen_prompt = with_gen[len(self._text([self.PROBE_USER], False)):]

    def _text(self, messages, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=gen)

    def ids(self, text: str) -> list:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def observation(self, messages: list, stopped_with: Optional[int]) -> list:
        """Tokens after an assistant turn: the turn's close, ``messages``, the next generation prompt."""
        if not self.chat:
            return self.ids("\n" + "\n".join(str(m["content"]) for m in messages) + "\n")
        close = self.close
        if stopped_with is not None:
            stop = self.tok.decode([stopped_with], skip_special_tokens=False)
            if stop and close.startswith(stop):
                close = close[len(stop):]
        full = self._text([self.PROBE_USER, self.PROBE_ASSISTANT, *messages], True)
        if not full.startswith(self.closed_probe):
            raise EpisodeError("the chat template does not render a conversation as a prefix of its continuation "
                               "(it rewrites earlier turns); multi-turn episodes need a prefix-stable template")
        return self.ids(close + full[len(self.closed_probe):])

    def user_after_prompt(self, prompt: list, text: str) -> list:
        """The prompt with one more user message (an environment's ``reset`` message) before the first turn."""
        if not self.chat:
            return list(prompt) + self.ids("\n" + text + "\n")
        gen = self.ids(self.gen_prompt)
        base = list(prompt[:-len(gen)]) if gen and list(prompt[-len(gen):]) == gen else list(prompt)
        two = self._text([self.PROBE_USER, {"role": "user", "content": text}], True)
        one = self._text([self.PROBE_USER], False)
        if not two.startswith(one):
            raise EpisodeError("the chat template does not render a conversation as a prefix of its continuation")
        return base + self.ids(two[len(one):])


@dataclasses.dataclass
class _Episode:
    prompt: list
    env: Any
    t0: float
    resp: list = dataclasses.field(default_factory=list)
    lmask: list = dataclasses.field(default_factory=list)
    lps: list = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list)
    env_reward: Optional[float] = None
    turns: int = 0
    tool_calls: int = 0
    parse_failures: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    done: bool = False
    truncated: Optional[str] = None
    stopped: bool = False
    info: dict = dataclasses.field(default_factory=dict)

    def record(self) -> dict:
        return {"messages": self.messages, "env_reward": self.env_reward, "turns": self.turns,
                "tool_calls": self.tool_calls, "tool_parse_failures": self.parse_failures,
                "tool_errors": self.tool_errors, "truncated": self.truncated, "info": self.info}


class EpisodeRunner:
    """Runs a request's prompts as episodes on an engine (see the module doc)."""

    def __init__(self, spec: EpisodeSpec):
        from .environments import resolve_env

        self.spec = spec
        self.env_cls = resolve_env(spec.env) if spec.env is not None else None
        self.tools = list(spec.tools)
        self.render = _Render(spec.tokenizer, spec.chat, self.tools)
        self.last_stats: dict = {}

    # ------------------------------------------------------------ environment calls, checked
    def _env_step(self, ep: _Episode, text: str):
        try:
            out = ep.env.step(text)
        except Exception as e:  # noqa: BLE001 - re-raised naming the environment
            raise EpisodeError(f"environment {self.env_cls.__name__}.step raised {type(e).__name__}: {e}") from e
        if not isinstance(out, tuple) or len(out) not in (3, 4):
            raise EpisodeError(f"environment {self.env_cls.__name__}.step must return (observation, reward, done) "
                               f"or (observation, reward, done, info), not {out!r}")
        obs, reward, done = out[:3]
        if len(out) == 4 and isinstance(out[3], dict):
            ep.info.update({k: v for k, v in out[3].items() if isinstance(v, (int, float, str, bool))})
        if reward is not None:
            try:
                r = float(reward)
            except (TypeError, ValueError):
                raise EpisodeError(f"environment {self.env_cls.__name__}.step returned reward {reward!r}, not a "
                                   "number or None") from None
            ep.env_reward = r if ep.env_reward is None else ep.env_reward + r
        return self._messages(obs, "user"), bool(done)

    def _messages(self, obs, role: str) -> list:
        if obs is None:
            return []
        if isinstance(obs, str):
            return [{"role": role, "content": obs}]
        if isinstance(obs, dict) and "content" in obs:
            return [{"role": obs.get("role", role), "content": str(obs["content"])}]
        if isinstance(obs, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in obs):
            return [{"role": m.get("role", role), "content": str(m["content"])} for m in obs]
        name = self.env_cls.__name__ if self.env_cls else "environment"
        raise EpisodeError(f"{name}: an observation must be a string, a message dict or a list of them, not {obs!r}")

    # ------------------------------------------------------------ tools
    def _run_tools(self, jobs: list) -> list:
        """``jobs``: (episode, ToolCall) pairs; their outcomes in order, run concurrently in the sandbox."""
        by_name = {t.name: t for t in self.tools}
        lim = self.spec.sandbox

        def one(job):
            _, call = job
            tool = by_name[call.name]
            return run_tool(tool.ref, call.arguments, lim, tool.path, tool.stdlib_only)

        if not jobs:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.spec.tool_threads, len(jobs))) as pool:
            return list(pool.map(one, jobs))

    # ------------------------------------------------------------ the episodes
    def run(self, engine, prompts: list, rows: list, params: SamplingParams, policy_version: int,
            reseed: Optional[Callable[[int], None]] = None) -> RolloutBatch:
        from .tools import parse_tool_calls

        spec, render = self.spec, self.render
        t0 = time.perf_counter()
        rows = list(rows) if rows else [{}] * len(prompts)
        if len(rows) != len(prompts):
            raise ValueError(f"EpisodeRunner.run: {len(rows)} rows for {len(prompts)} prompts")
        eps = []
        for p, row in zip(prompts, rows):
            env = self.env_cls() if self.env_cls is not None else None
            prompt = list(p)
            if env is not None:
                try:
                    first = env.reset(dict(row) if isinstance(row, dict) else {"metadata": row})
                except Exception as e:  # noqa: BLE001
                    raise EpisodeError(f"environment {self.env_cls.__name__}.reset raised {type(e).__name__}: "
                                       f"{e}") from e
                if first is not None:
                    if not isinstance(first, str):
                        raise EpisodeError(f"environment {self.env_cls.__name__}.reset must return a string or "
                                           f"None, not {type(first).__name__}")
                    prompt = render.user_after_prompt(prompt, first)
            eps.append(_Episode(prompt, env, time.perf_counter()))
        engine_totals: dict = {}
        turn = 0
        while True:
            live = [e for e in eps if not e.done]
            if not live:
                break
            if reseed is not None:
                reseed(turn)
            out = engine.generate([e.prompt + e.resp for e in live], params, policy_version=policy_version)
            self._add_engine_stats(engine_totals, getattr(engine, "last_stats", {}) or {})
            turn += 1
            ids, mask, lps = out.response_ids, out.response_mask.bool(), out.logprobs
            jobs, parsed = [], []
            for k, ep in enumerate(live):
                toks = ids[k][mask[k]].tolist()
                ep.resp += toks
                ep.lmask += [True] * len(toks)
                ep.lps += lps[k][mask[k]].tolist()
                ep.turns += 1
                ep.stopped = bool(out.stopped[k])
                text = spec.tokenizer.decode(toks, skip_special_tokens=True)
                msg = {"role": "assistant", "content": text}
                ep.messages.append(msg)
                calls, errors = parse_tool_calls(text, self.tools) if self.tools else ([], [])
                if calls:
                    msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in calls]
                parsed.append((calls, errors, text))
                jobs += [(ep, c) for c in calls]
            outcomes = iter(self._run_tools(jobs))
            for k, ep in enumerate(live):
                calls, errors, text = parsed[k]
                obs = []
                if calls or errors:
                    for c in calls:
                        res = next(outcomes)
                        ep.tool_calls += 1
                        if not res.ok:
                            ep.tool_errors += 1
                            ep.tool_timeouts += res.status == "timeout"
                        obs.append({"role": "tool", "content": res.text if res.ok else f"error: {res.text}"})
                    for err in errors:
                        ep.parse_failures += 1
                        obs.append({"role": "tool", "content": f"error: {err}"})
                    done = False
                elif ep.env is not None:
                    obs, done = self._env_step(ep, text)
                else:
                    done = True  # tools only: an answer without a tool call ends the episode
                ep.done = done
                if done:
                    continue
                stop_tok = ep.resp[-1] if ep.stopped and ep.resp else None
                # no observation but not done: the turn is closed and the model takes another
                obs_ids = render.observation(obs, stop_tok)
                if ep.turns >= spec.max_turns:
                    ep.done, ep.truncated = True, "max_turns"
                elif spec.max_episode_tokens is not None and \
                        len(ep.resp) + len(obs_ids) + params.max_new_tokens > spec.max_episode_tokens:
                    ep.done, ep.truncated = True, "max_episode_tokens"
                elif spec.max_context_tokens is not None and \
                        len(ep.prompt) + len(ep.resp) + len(obs_ids) > spec.max_context_tokens:
                    ep.done, ep.truncated = True, "context"
                elif spec.max_episode_seconds is not None and time.perf_counter() - ep.t0 > spec.max_episode_seconds:
                    ep.done, ep.truncated = True, "max_episode_seconds"
                if ep.done:
                    continue
                ep.messages += obs
                ep.resp += obs_ids
                ep.lmask += [False] * len(obs_ids)
                ep.lps += [0.0] * len(obs_ids)
        batch = self._batch(eps, engine.pad_id, params, policy_version)
        self.last_stats = self._stats(eps, engine_totals, time.perf_counter() - t0)
        return batch

    @staticmethod
    def _add_engine_stats(tot: dict, stats: dict) -> None:
        for k, v in stats.items():
            if not isinstance(v, (int, float)):
                continue
            if k == "row_utilization":  # weighted by the call's decode rows
                rows = stats.get("decode_rows", 0) or 0
                tot["_util_rows"] = tot.get("_util_rows", 0) + rows
                tot["_util_kept"] = tot.get("_util_kept", 0.0) + (v * rows if rows else 0.0)
            elif k.endswith("_peak"):
                tot[k] = max(tot.get(k, 0), v)
            elif k != "tokens_per_s":
                tot[k] = tot.get(k, 0) + v

    def _stats(self, eps: list, engine_totals: dict, seconds: float) -> dict:
        out = {k: v for k, v in engine_totals.items() if not k.startswith("_util")}
        if "_util_rows" in engine_totals:
            rows = engine_totals["_util_rows"]
            out["row_utilization"] = engine_totals["_util_kept"] / rows if rows else float("nan")
        ntok = sum(sum(e.lmask) for e in eps)
        out.update({"seconds": seconds, "response_tokens": ntok, "tokens_per_s": ntok / seconds if seconds else 0.0,
                    "episodes": len(eps), "episode_turns": sum(e.turns for e in eps),
                    "episodes_truncated": sum(e.truncated is not None for e in eps),
                    "tool_calls": sum(e.tool_calls for e in eps),
                    "tool_parse_failures": sum(e.parse_failures for e in eps),
                    "tool_errors": sum(e.tool_errors for e in eps), "tool_timeouts": sum(e.tool_timeouts for e in eps),
                    "assistant_tokens": ntok, "observation_tokens": sum(len(e.lmask) - sum(e.lmask) for e in eps)})
        return out

    @staticmethod
    def _batch(eps: list, pad_id: int, params: SamplingParams, version: int) -> RolloutBatch:
        B = len(eps)
        P = max(len(e.prompt) for e in eps)
        R = max(1, max(len(e.resp) for e in eps))
        prompt_ids = torch.full((B, P), pad_id, dtype=torch.int64)
        prompt_mask = torch.zeros((B, P), dtype=torch.int64)
        resp = torch.full((B, R), pad_id, dtype=torch.int64)
        rmask = torch.zeros((B, R), dtype=torch.bool)
        lmask = torch.zeros((B, R), dtype=torch.bool)
        lps = torch.zeros((B, R), dtype=torch.float32)
        for i, e in enumerate(eps):
            n, m = len(e.prompt), len(e.resp)
            prompt_ids[i, P - n:] = torch.tensor(e.prompt, dtype=torch.int64)
            prompt_mask[i, P - n:] = 1
            if m:
                resp[i, :m] = torch.tensor(e.resp, dtype=torch.int64)
                rmask[i, :m] = True
                lmask[i, :m] = torch.tensor(e.lmask, dtype=torch.bool)
                lps[i, :m] = torch.tensor(e.lps, dtype=torch.float32)
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp, response_mask=rmask,
                            logprobs=lps, policy_version=torch.full((B,), int(version), dtype=torch.int64),
                            stopped=torch.tensor([e.stopped for e in eps], dtype=torch.bool), pad_id=int(pad_id),
                            temperature=float(params.temperature), loss_mask=lmask,
                            episodes=[e.record() for e in eps])
