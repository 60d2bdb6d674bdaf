"""Agentic GRPO with nothing downloaded: a small Qwen2-shaped model learns to use a calculator tool.

1. A verifiable multi-turn task: arithmetic word problems with two-digit operands ("Mia has 47 shells.
   She finds 38 more. How many shells does Mia have now?" -> 85), too hard for a tiny model to compute
   but easy with a calculator: the model may call ``calculator`` with a ``<tool_call>{json}</tool_call>``
   block, read the result (a ``tool`` message) and answer in its next turn.
2. A byte-level BPE tokenizer trained on the task's text, with a Hermes-style chat template that renders
   the tools and tool messages, and a randomly initialized ``Qwen2ForCausalLM``, saved as a Hugging Face
   directory.
3. A supervised warm-up on tpu on a mix of conversations: 45% call the calculator and copy its result,
   the rest answer at once with a guess in their own words ("I guess 120."; nearly always wrong). So the
   sampled policy calls the tool on about 40% of the problems and the greedy one on few: GRPO has to
   learn from the rewards that calling the tool pays.
4. GRPO through ``python -m torchtpu_rl.train --tools calculator --max-turns 3 --reward math_answer``:
   episodes run in the rollout workers (tool calls executed in the sandbox), only the assistant's tokens
   carry loss; held-out greedy accuracy before, during and after; ``tool_calc.png`` plots the accuracy
   curve, tool calls per episode and the parse-failure rate.

    python examples/rl_tool_calc.py --out runs/rl_tool_calc
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

# the text example's recipes (its directory is this script's: on sys.path when run as a script)
from rl_text_arith import bpe_tokenizer, save_prepared, sft_on, write_splits
from rl_text_arith import build_model as text_arith_model

NAMES = ["Tom", "Ann", "Sam", "Mia", "Leo", "Zoe", "Max", "Eva", "Ben", "Ivy"]
ITEMS = ["apples", "pens", "books", "cards", "shells", "coins", "stickers", "marbles"]
GAIN = ["buys {b} more", "finds {b} more", "gets {b} more"]
LOSS = ["gives away {b}", "loses {b}", "eats {b}"]
PRONOUN = {"Tom": "He", "Sam": "He", "Leo": "He", "Max": "He", "Ben": "He"}

SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# tool-call markers are ordinary added tokens (as in Qwen2.5): decoding with skip_special_tokens keeps them
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# Hermes style: the tools' names in a system turn, tool results in their own turns, assistant turns end with </s>
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_problem(rng: random.Random, low: int = 10, high: int = 99) -> tuple:
    """(question, expression, answer) with two-digit operands."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    he = PRONOUN.get(name, "She")
    a = rng.randint(low, high)
    if rng.random() < 0.5:
        b = rng.randint(low, high)
        verb, expr, ans = rng.choice(GAIN).format(b=b), f"{a}+{b}", a + b
    else:
        b = rng.randint(low, a)
        verb, expr, ans = rng.choice(LOSS).format(b=b), f"{a}-{b}", a - b
    return f"{name} has {a} {item}. {he} {verb}. How many {item} does {name} have now?", expr, ans


def make_splits(n_train: int, n_eval: int, seed: int = 0) -> tuple:
    """Disjoint train / held-out rows: ``{"messages": [...], "answer": "85", "expression": "47+38"}``."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_eval:
        q, e, a = make_problem(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"messages": [{"role": "user", "content": q}], "answer": str(a), "expression": e})
    return rows[:n_train], rows[n_train:]


def tool_call_text(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def answer_text(answer) -> str:
    return f"The answer is {answer}."


def guess_text(answer) -> str:
    return f"I guess {answer}."


def build_tokenizer(rows, vocab_size: int = 384):
    """The text example's BPE recipe on this task's text; every byte in the base alphabet, so any expression
    the model writes is encodable, and the tool-call markers as ordinary added tokens."""
    from tokenizers import pre_tokenizers

    corpus = []
    for r in rows:
        corpus += [r["messages"][0]["content"], tool_call_text(r["expression"]), answer_text(r["answer"]),
                   guess_text(r["answer"]), "error: tools: calculator"]
    fast = bpe_tokenizer(corpus, vocab_size, SPECIALS, CHAT_TEMPLATE, pre_tokenizers.ByteLevel.alphabet())
    fast.add_tokens(TOOL_TOKENS)
    return fast


def build_model(tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0):
    return text_arith_model(tokenizer, hidden, layers, heads, seed, max_positions=256)


def conversation_tokens(tokenizer, row, use_tool: bool, rng: random.Random) -> tuple:
    """(ids, loss mask) of a warm-up conversation, rendered exactly as the episode runner renders one."""
    from torchtpu_rl.episodes import _Render
    from torchtpu_rl.tools import resolve_tools

    render = _Render(tokenizer, True, resolve_tools(["calculator"]))
    eos = tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(row["messages"], tools=render.tools, tokenize=False,
                                           add_generation_prompt=True)
    ids = render.ids(prompt)
    mask = [False] * len(ids)

    def say(text):
        t = render.ids(text) + [eos]
        ids.extend(t)
        mask.extend([True] * len(t))

    if use_tool:
        say(tool_call_text(row["expression"]))
        obs = render.observation([{"role": "tool", "content": row["answer"]}], eos)
        ids.extend(obs)
        mask.extend([False] * len(obs))
        say(answer_text(row["answer"]))
    else:  # a guess, in its own words: the model learns to answer directly, and (from rewards) that it is wrong
        say(guess_text(rng.randint(0, 198)))
    return ids, mask


def sft(model, tokenizer, rows, steps: int, tool_fraction: float, batch: int = 32, lr: float = 3e-3,
        device: str = "tpu", seed: int = 0, log=print) -> list:
    """Warm-up on whole conversations (a ``tool_fraction`` of them call the calculator), loss on the
    assistant's tokens only."""
    rng = random.Random(seed)
    enc = [conversation_tokens(tokenizer, r, rng.random() < tool_fraction, rng) for r in rows]
    return sft_on(model, tokenizer.pad_token_id, enc, steps, batch=batch, lr=lr, device=device, seed=seed, log=log)


def prepare(out: str, *, n_train: int = 2000, n_eval: int = 200, hidden: int = 64, layers: int = 2,
            sft_steps: int = 500, tool_fraction: float = 0.45, seed: int = 0, device: str = "tpu", log=print) -> dict:
    train, held = make_splits(n_train, n_eval, seed)
    write_splits(out, train, held)
    tokenizer = build_tokenizer(train)
    model = build_model(tokenizer, hidden, layers, seed=seed)
    losses = sft(model, tokenizer, train, sft_steps, tool_fraction, device=device, seed=seed,
                 log=log) if sft_steps else []
    return save_prepared(out, model, tokenizer, losses, device)


def train_command(prep: dict, args) -> list:
    return [sys.executable, "-m", "torchtpu_rl.train", "--model", prep["model"], "--data", prep["train"],
            "--prompt-key", "messages", "--tools", "calculator", "--max-turns", "3", "--reward", "math_answer",
            "--eval-data", prep["eval"], "--eval-limit", str(args.eval_size), "--eval-every", str(args.eval_every),
            "--algo", "grpo", "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
            "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", "1.0", "--lr", str(args.lr), "--kl-coef", str(args.kl_coef),
            "--max-prompt-tokens", "128", "--seed", str(args.seed), "--save-every", str(args.steps),
            "--engine", args.engine, "--report-to", "none", "--out", os.path.join(args.out, "rl"),
            "--overwrite-out", "--xla-cache", args.xla_cache] + (["--no-progress"] if args.no_progress else [])


def plot(out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rows(name):
        path = os.path.join(out, "rl", name)
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    evals, steps = rows("eval.jsonl"), rows("metrics.jsonl")
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    ax[0].plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-")
    ax[0].set_title(f"held-out greedy accuracy ({evals[0]['samples']} problems)")
    ax[0].set_xlabel("step")
    s = [m["step"] for m in steps]
    ax[1].plot(s, [m["tool_calls"] / max(1, m["episodes"]) for m in steps], label="tool calls / episode")
    ax[1].plot(s, [m["turns_per_episode"] for m in steps], label="turns / episode")
    ax[1].set_xlabel("step")
    ax[1].legend()
    ax[1].set_title("tool use (training rollouts)")
    ax[2].plot(s, [m["tool_parse_failure_rate"] for m in steps], color="C3")
    ax[2].set_title("tool-call parse-failure rate")
    ax[2].set_xlabel("step")
    fig.tight_layout()
    path = os.path.join(out, "tool_calc.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="GRPO with a calculator tool on arithmetic word problems, with a small "
                                            "Qwen2-shaped model built here (nothing downloaded)")
    p.add_argument("--out", default="runs/rl_tool_calc")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--tool-fraction", type=float, default=0.45,
                   help="share of warm-up conversations that call the calculator (the rest guess)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--engine", choices=("static", "serving"), default="static")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--xla-cache", default=os.path.join("runs", "xla_cache"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    import torchtpu  # noqa: F401  (the warm-up runs on tpu)

    prep = prepare(args.out, n_train=args.train_size, n_eval=args.eval_size, hidden=args.hidden, layers=args.layers,
                   sft_steps=args.sft_steps, tool_fraction=args.tool_fraction, seed=args.seed)
    prep_s = time.perf_counter() - t0
    print(f"model: {prep['model']} ({prep['parameters'] / 1e3:.0f}k parameters, vocab {prep['vocab']}), "
          f"warm-up {args.sft_steps} steps in {prep_s:.0f} s", flush=True)
    cmd = train_command(prep, args)
    print("$ " + " ".join(cmd), flush=True)
    t1 = time.perf_counter()
    subprocess.run(cmd, check=True)
    rl_s = time.perf_counter() - t1
    with open(os.path.join(args.out, "rl", "eval.jsonl")) as f:
        evals = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(args.out, "rl", "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    summary = {"accuracy_before_rl": evals[0]["accuracy"], "accuracy_after_rl": evals[-1]["accuracy"],
               "accuracy_rise": evals[-1]["accuracy"] - evals[0]["accuracy"],
               "best_accuracy": max(e["accuracy"] for e in evals),
               "eval_curve": [(e["step"], e["accuracy"]) for e in evals],
               "tool_calls_per_episode": [(m["step"], m["tool_calls"] / max(1, m["episodes"])) for m in steps],
               "parse_failure_rate": [(m["step"], m["tool_parse_failure_rate"]) for m in steps],
               "warmup_s": prep_s, "rl_s": rl_s, "wall_s": time.perf_counter() - t0,
               "sft_losses": prep["sft_losses"], "plot": plot(args.out), "config": vars(args)}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"held-out greedy accuracy: {summary['accuracy_before_rl']:.3f} after the warm-up -> "
          f"{summary['accuracy_after_rl']:.3f} after {args.steps} GRPO steps (best {summary['best_accuracy']:.3f}); "
          f"wall time {summary['wall_s']:.0f} s (warm-up {prep_s:.0f} s, RL {rl_s:.0f} s); plot {summary['plot']}")
    return summary


if __name__ == "__main__":
    main()
