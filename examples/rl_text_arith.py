"""GRPO on text with nothing downloaded: a small Qwen2-shaped model learns arithmetic word problems.

1. Generates a verifiable text task: one-step word problems with a numeric answer
   ("Mia has 7 shells. She finds 5 more. How many shells does Mia have now?" -> 12),
   a training split and a held-out split of different problems (jsonl, chat messages +
   ``answer`` column).
2. Trains a small byte-level BPE tokenizer on that corpus with ``tokenizers`` (with a chat
   template), builds a small randomly initialized ``Qwen2ForCausalLM``, and saves both as a
   Hugging Face directory.
3. Supervised warm-up on tpu (``--sft-steps``, short on purpose): the model learns the answer
   format and a little arithmetic, so GRPO starts from a low but non-zero accuracy.
4. GRPO through ``python -m torchtpu_rl.train`` with the built-in ``math_answer`` reward
   (1 when the completion's final number is the answer), held-out greedy accuracy before,
   during and after.

    python examples/rl_text_arith.py --out runs/rl_text_arith

The same training command works on a real checkpoint (see README.md); this script prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

NAMES = ["Tom", "Ann", "Sam", "Mia", "Leo", "Zoe", "Max", "Eva", "Ben", "Ivy"]
ITEMS = ["apples", "pens", "books", "cards", "shells", "coins", "stickers", "marbles"]
GAIN = [("buys {b} more", "has"), ("finds {b} more", "has"), ("gets {b} more", "has")]
LOSS = [("gives away {b}", "has"), ("loses {b}", "has"), ("eats {b}", "has")]
PRONOUN = {"Tom": "He", "Sam": "He", "Leo": "He", "Max": "He", "Ben": "He"}

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
# one user turn, then the assistant's turn; the completion ends with </s>
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                 "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_problem(rng: random.Random, max_operand: int = 9) -> tuple:
    """(question, answer): a + b or a - b with operands up to ``max_operand`` and a non-negative result."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    he = PRONOUN.get(name, "She")
    a = rng.randint(0, max_operand)
    if rng.random() < 0.5:
        b = rng.randint(0, max_operand)
        verb = rng.choice(GAIN)[0].format(b=b)
        ans = a + b
    else:
        b = rng.randint(0, a)
        verb = rng.choice(LOSS)[0].format(b=b)
        ans = a - b
    q = f"{name} has {a} {item}. {he} {verb}. How many {item} does {name} have now?"
    return q, ans


def make_splits(n_train: int, n_eval: int, seed: int = 0, max_operand: int = 9) -> tuple:
    """Disjoint train / held-out rows: ``{"messages": [...], "answer": "12"}``."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_eval:
        q, a = make_problem(rng, max_operand)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"messages": [{"role": "user", "content": q}], "answer": str(a)})
    return rows[:n_train], rows[n_train:]


def completion_text(answer) -> str:
    return f"The answer is {answer}."


def bpe_tokenizer(corpus, vocab_size: int, specials=None, chat_template: str = None, initial_alphabet=()):
    """A byte-level BPE tokenizer trained on ``corpus``, with ``specials`` and the chat template, as a
    ``transformers`` fast tokenizer (shared with the tool example)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # digits stay single tokens: numbers are read digit by digit, as most LLM tokenizers do
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials or SPECIALS,
                                  initial_alphabet=list(initial_alphabet))
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   chat_template=chat_template or CHAT_TEMPLATE)


def build_tokenizer(rows, vocab_size: int = 192):
    """The task's tokenizer, trained on its prompts and completions."""
    return bpe_tokenizer([r["messages"][0]["content"] + " " + completion_text(r["answer"]) for r in rows], vocab_size)


def build_model(tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                max_positions: int = 128):
    """A small randomly initialized Qwen2ForCausalLM for ``tokenizer``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg)


def sft(model, tokenizer, rows, steps: int, batch: int = 32, lr: float = 3e-3, device: str = "tpu", seed: int = 0,
        log=print) -> list:
    """Supervised warm-up on the completions (prompt tokens masked out of the loss)."""
    enc = []
    for r in rows:
        prompt = tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion_text(r["answer"]) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        enc.append((p + c, [False] * len(p) + [True] * len(c)))
    return sft_on(model, tokenizer.pad_token_id, enc, steps, batch=batch, lr=lr, device=device, seed=seed, log=log)


def sft_on(model, pad_id: int, enc, steps: int, batch: int = 32, lr: float = 3e-3, device: str = "tpu",
           seed: int = 0, log=print) -> list:
    """Supervised steps on ``enc``, a list of (token ids, loss mask), padded to one (batch, length) shape so the
    compiled step is built once. Returns ``[(step, loss)]`` every 25 steps."""
    import torch

    L = max(len(i) for i, _ in enc)
    ids = torch.full((len(enc), L), pad_id, dtype=torch.int64)
    labels = torch.full((len(enc), L), -100, dtype=torch.int64)
    mask = torch.zeros((len(enc), L), dtype=torch.int64)
    for k, (i, m) in enumerate(enc):
        ids[k, :len(i)] = torch.tensor(i)
        mask[k, :len(i)] = 1
        labels[k, :len(i)] = torch.where(torch.tensor(m), torch.tensor(i), torch.tensor(-100))
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def loss_fn(ids, mask, labels):
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    loss_c = torch.compile(loss_fn, backend="tpu") if device == "tpu" else loss_fn
    g = torch.Generator().manual_seed(seed)
    losses = []
    for s in range(steps):
        idx = torch.randint(0, len(enc), (batch,), generator=g)
        loss = loss_c(ids[idx].to(device), mask[idx].to(device), labels[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if s % 25 == 0 or s == steps - 1:
            losses.append((s, float(loss.detach().cpu())))
            log(f"sft step {s}: loss {losses[-1][1]:.3f}")
    return losses


def write_jsonl(path: str, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def prepare(out: str, *, n_train: int = 2000, n_eval: int = 200, max_operand: int = 9, hidden: int = 64,
            layers: int = 2, sft_steps: int = 100, sft_lr: float = 3e-3, seed: int = 0, device: str = "tpu",
            log=print) -> dict:
    """Data, tokenizer, model (+ warm-up) in ``out``: ``data/train.jsonl``, ``data/eval.jsonl``, ``model/``."""
    train, held = make_splits(n_train, n_eval, seed, max_operand)
    write_splits(out, train, held)
    tokenizer = build_tokenizer(train)
    model = build_model(tokenizer, hidden, layers, seed=seed)
    losses = sft(model, tokenizer, train, sft_steps, lr=sft_lr, device=device, seed=seed, log=log) if sft_steps else []
    return save_prepared(out, model, tokenizer, losses, device)


def write_splits(out: str, train, held) -> None:
    """``out/data/train.jsonl`` and ``out/data/eval.jsonl``."""
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    write_jsonl(os.path.join(out, "data", "train.jsonl"), train)
    write_jsonl(os.path.join(out, "data", "eval.jsonl"), held)


def save_prepared(out: str, model, tokenizer, sft_losses, device: str) -> dict:
    """The warmed-up model and tokenizer as a Hugging Face directory ``out/model``, and what ``prepare``
    returns: the paths, the vocabulary and parameter counts, the warm-up losses."""
    from torchtpu_rl import hf

    model_dir = os.path.join(out, "model")
    if device != "cpu":
        hf.save_hf(model, tokenizer, model_dir)
    else:
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return {"model": model_dir, "train": os.path.join(out, "data", "train.jsonl"),
            "eval": os.path.join(out, "data", "eval.jsonl"), "vocab": len(tokenizer), "sft_losses": sft_losses,
            "parameters": sum(p.numel() for p in model.parameters())}


def train_command(prep: dict, args) -> list:
    """The ``python -m torchtpu_rl.train`` command line of the RL stage."""
    return [sys.executable, "-m", "torchtpu_rl.train", "--model", prep["model"], "--data", prep["train"],
            "--prompt-key", "messages", "--reward", "math_answer", "--eval-data", prep["eval"],
            "--eval-every", str(args.eval_every), "--algo", "grpo", "--steps", str(args.steps),
            "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--temperature", "1.0", "--lr", str(args.lr),
            "--kl-coef", str(args.kl_coef), "--rollout-workers", str(args.workers), "--mode", args.mode,
            "--max-prompt-tokens", "64", "--seed", str(args.seed), "--save-every", str(args.steps),
            "--out", os.path.join(args.out, "rl"), "--xla-cache", args.xla_cache] + (
                ["--no-progress"] if args.no_progress else []) + (
                # int8/fp8 rollouts: truncated importance sampling (token, 2.0) comes with them
                ["--rollout-quantization", args.rollout_quantization]
                if getattr(args, "rollout_quantization", "none") != "none" else []) + (
                ["--lora-rank", str(args.lora_rank)] if getattr(args, "lora_rank", 0) else [])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="GRPO on arithmetic word problems with a small Qwen2-shaped model "
                                            "built here (nothing downloaded)")
    p.add_argument("--out", default="runs/rl_text_arith")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=250, help="supervised warm-up steps (0: none)")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-quantization", choices=("none", "int8", "int8_weight_only", "fp8"), default="none")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters (all linear layers) of this rank")
    p.add_argument("--xla-cache", default=os.path.join("runs", "xla_cache"))
    p.add_argument("--data-only", action="store_true", help="write the task's jsonl files and stop (e.g. to train "
                                                             "a real checkpoint on them, see README.md)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.data_only:
        train, held = make_splits(args.train_size, args.eval_size, args.seed)
        os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
        write_jsonl(os.path.join(args.out, "data", "train.jsonl"), train)
        write_jsonl(os.path.join(args.out, "data", "eval.jsonl"), held)
        print(f"wrote {args.out}/data/train.jsonl ({len(train)} rows) and eval.jsonl ({len(held)} rows)")
        return {}
    import torchtpu  # noqa: F401  (the warm-up runs on tpu)

    prep = prepare(args.out, n_train=args.train_size, n_eval=args.eval_size, hidden=args.hidden, layers=args.layers,
                   sft_steps=args.sft_steps, seed=args.seed)
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
    summary = {"accuracy_before_rl": evals[0]["accuracy"], "accuracy_after_rl": evals[-1]["accuracy"],
               "best_accuracy": max(e["accuracy"] for e in evals),
               "eval_curve": [(e["step"], e["accuracy"]) for e in evals], "warmup_s": prep_s, "rl_s": rl_s,
               "wall_s": time.perf_counter() - t0, "sft_losses": prep["sft_losses"], "config": vars(args)}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"held-out greedy accuracy: {summary['accuracy_before_rl']:.3f} after the warm-up -> "
          f"{summary['accuracy_after_rl']:.3f} after {args.steps} GRPO steps (best {summary['best_accuracy']:.3f}); "
          f"wall time {summary['wall_s']:.0f} s (warm-up {prep_s:.0f} s, RL {rl_s:.0f} s); outputs in {args.out}/rl")
    return summary


if __name__ == "__main__":
    main()
