"""Prompts for RL: the seeded, resumable :class:`PromptDataset`, and text prompts from files.

:class:`PromptDataset` serves ``(prompt_token_ids, metadata)`` items in a seeded order
per epoch with a cursor (its whole state is one int). :func:`load_prompts` makes one from
text:

- a jsonl or parquet file, a ``datasets.Dataset``, or a list of dicts (rows);
- the ``prompt_key`` column holds plain text, or chat messages (a list of
  ``{"role", "content"}`` dicts) rendered with the tokenizer's chat template
  (``add_generation_prompt=True``);
- every other column of a row becomes that prompt's metadata: reward functions
  receive it as keyword arguments (TRL's convention);
- a prompt longer than ``max_prompt_tokens`` (the largest prompt bucket) is skipped and
  counted (``dataset.skipped``), or an error (``on_long_prompt="error"``).

A file that cannot be read, a row without the prompt column or an empty prompt is an
error naming the file, the row and the column.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional, Sequence

import numpy as np

__all__ = ["PromptDataset", "load_prompts", "read_rows"]


class PromptDataset:
    """Prompts with metadata (e.g. the answer), served in a seeded order with a cursor.

    ``items``: a sequence of ``(prompt_token_ids, metadata)``. Epoch ``e`` visits the items in
    the permutation seeded by ``(seed, e)``; the cursor counts prompts served, so
    ``state_dict()`` is one int and resuming continues with the very next prompt.
    ``texts`` (optional): each item's prompt as text (what text reward functions receive);
    ``source``: where the items came from (for messages); ``skipped``: prompts left out when
    the dataset was made (too long).
    """

    def __init__(self, items: Sequence, seed: int = 0, shuffle: bool = True, *, texts: Optional[Sequence[str]] = None,
                 source: str = "", skipped: int = 0):
        items = list(items)
        if not items:
            raise ValueError(f"PromptDataset{f' from {source}' if source else ''}: items is empty")
        for i, it in enumerate(items):
            if not (isinstance(it, (tuple, list)) and len(it) == 2):
                raise TypeError(f"PromptDataset: item {i} must be a (prompt_token_ids, metadata) pair")
            if not isinstance(it[0], (list, tuple)) or not it[0]:
                raise ValueError(f"PromptDataset: item {i} has an empty or non-list prompt")
        if texts is not None:
            texts = list(texts)
            if len(texts) != len(items):
                raise ValueError(f"PromptDataset: {len(texts)} texts for {len(items)} items")
        self.items = items
        self.texts = texts
        self.source = source
        self.skipped = int(skipped)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.cursor = 0
        self._orders: dict = {}

    def __len__(self):
        return len(self.items)

    def _order(self, epoch: int):
        o = self._orders.get(epoch)
        if o is None:
            n = len(self.items)
            o = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n))
            self._orders = {epoch: o}  # one epoch at a time is enough
        return o

    def take(self, n: int) -> list:
        """The next ``n`` items as ``(dataset_index, prompt, metadata)``."""
        out = []
        for _ in range(n):
            e, k = divmod(self.cursor, len(self.items))
            idx = int(self._order(e)[k])
            p, meta = self.items[idx]
            out.append((idx, list(p), meta))
            self.cursor += 1
        return out

    def text(self, index: int) -> Optional[str]:
        """Item ``index``'s prompt text (None for a token-id dataset)."""
        return self.texts[index] if self.texts is not None else None

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"PromptDataset: checkpoint was made with seed {state['seed']}, this dataset has "
                             f"seed {self.seed}")
        self.cursor = int(state["cursor"])


# ------------------------------------------------------------------ reading rows
def _plain(v):
    """A column value as plain Python (what checkpoints and reward functions get)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def read_rows(source) -> tuple:
    """``(rows, name)``: the rows (dicts) of a jsonl / parquet file, a ``datasets.Dataset`` or a
    list of dicts, and a name for messages."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file {path!r} does not exist")
        low = path.lower()
        if low.endswith((".jsonl", ".json")):
            rows = []
            try:
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ValueError(f"data file {path!r} line {n} is not valid JSON ({e.msg}); "
                                             "expected one JSON object per line (jsonl)") from None
                        if not isinstance(row, dict):
                            raise ValueError(f"data file {path!r} line {n} is a JSON {type(row).__name__}, "
                                             "not an object")
                        rows.append(row)
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read data file {path!r}: {e}") from e
            return rows, path
        if low.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                rows = pq.read_table(path).to_pylist()
            except Exception as e:  # noqa: BLE001 - re-raised naming the file
                raise ValueError(f"cannot read data file {path!r} as parquet: {type(e).__name__}: {e}") from e
            return rows, path
        raise ValueError(f"data file {path!r}: unsupported type (use .jsonl or .parquet, or pass a datasets.Dataset)")
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(source, datasets.DatasetDict):
        raise TypeError(f"got a datasets.DatasetDict with splits {list(source)}; pass one split, e.g. ds['train']")
    if datasets is not None and isinstance(source, datasets.Dataset):
        return source.to_list(), f"datasets.Dataset({source.info.dataset_name or 'unnamed'}, {len(source)} rows)"
    if isinstance(source, (list, tuple)) and all(isinstance(r, dict) for r in source):
        return list(source), f"list of {len(source)} rows"
    raise TypeError(f"prompts must come from a .jsonl / .parquet path, a datasets.Dataset or a list of dicts, not "
                    f"{type(source).__name__}")


def _is_chat(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def load_prompts(source, tokenizer, prompt_key: str = "prompt", *, max_prompt_tokens: Optional[int] = None,
                 on_long_prompt: str = "skip", chat_template: Optional[bool] = None, seed: int = 0,
                 shuffle: bool = True, limit: Optional[int] = None, tools: Optional[list] = None) -> PromptDataset:
    """A :class:`PromptDataset` of tokenized text prompts (see the module doc).

    ``chat_template``: None (default) renders chat-message prompts with the tokenizer's chat
    template and tokenizes plain text as it is; True also renders plain text as one user
    message; False refuses chat prompts. ``limit``: keep the first ``limit`` rows. ``tools``: the JSON
    schemas of the run's tools (agentic RL), rendered into chat prompts by the template (``tools=``)."""
    if on_long_prompt not in ("skip", "error"):
        raise ValueError(f"on_long_prompt must be 'skip' or 'error', not {on_long_prompt!r}")
    rows, name = read_rows(source)
    if limit is not None:
        rows = rows[:int(limit)]
    if not rows:
        raise ValueError(f"{name}: no rows")
    if prompt_key not in rows[0]:
        raise KeyError(f"{name}: no column {prompt_key!r} (the prompt column); columns: {sorted(rows[0])}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    items, texts, skipped, longest = [], [], 0, 0
    for r, row in enumerate(rows):
        if prompt_key not in row:
            raise KeyError(f"{name}: row {r} has no column {prompt_key!r} (its columns: {sorted(row)})")
        value = row[prompt_key]
        if _is_chat(value) or (chat_template and isinstance(value, str)):
            if chat_template is False:
                raise ValueError(f"{name}: row {r} column {prompt_key!r} holds chat messages and chat_template=False")
            if not has_template:
                raise ValueError(f"{name}: row {r} column {prompt_key!r} holds chat messages but the tokenizer has "
                                 "no chat template; give plain-text prompts or a tokenizer with one")
            messages = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
            text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has its own specials
        elif isinstance(value, str):
            text = value
            ids = tokenizer(text)["input_ids"]
        else:
            raise TypeError(f"{name}: row {r} column {prompt_key!r} is a {type(value).__name__}, not text or a list of "
                            "{'role', 'content'} messages")
        if not ids:
            raise ValueError(f"{name}: row {r} column {prompt_key!r} is an empty prompt")
        longest = max(longest, len(ids))
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if on_long_prompt == "error":
                raise ValueError(f"{name}: row {r} prompt has {len(ids)} tokens, more than max_prompt_tokens "
                                 f"{max_prompt_tokens} (the largest prompt bucket)")
            skipped += 1
            continue
        meta = {k: _plain(v) for k, v in row.items() if k != prompt_key}
        items.append((list(ids), meta))
        texts.append(text)
    if not items:
        raise ValueError(f"{name}: every one of its {len(rows)} prompts is longer than max_prompt_tokens "
                         f"{max_prompt_tokens} (the longest has {longest} tokens)")
    if skipped:
        warnings.warn(f"{name}: skipped {skipped} of {len(rows)} prompts longer than {max_prompt_tokens} tokens",
                      UserWarning, stacklevel=2)
    return PromptDataset(items, seed=seed, shuffle=shuffle, texts=texts, source=name, skipped=skipped)
