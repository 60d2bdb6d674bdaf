"""Sequence packing for the learner: sequences end to end in fixed-size rows, attention kept per sequence.

A padded micro-batch spends its forward on padding: with long-tailed response lengths most of a
``rows x longest`` block is pad. Packed, each sequence's real tokens (prompt and response, the
columns where the attention mask is set) are laid end to end into rows of ``row_len`` tokens
(first-fit decreasing), each token keeps its own position (counted from its sequence's start, as
the padded layout's ``cumsum(mask) - 1``), and a block-diagonal causal mask keeps every token to
its own sequence. So each token sees exactly what it saw padded: the log-probs are the padded
ones (up to float reassociation), and they are gathered back into the padded layout, where the
loss runs unchanged (every ``loss_type`` and aggregation).

The row count is bucketed to a power of two so that the device sees few shapes. Models: a Hugging
Face causal LM gets the mask as a 4-d additive float mask (``(rows, 1, L, L)``: transformers uses a
4-d mask as given, for the eager and the sdpa attention) with ``position_ids``; the project's
:class:`~torchtpu_models.TinyTransformer` takes a 4-d boolean mask and ``position_ids``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from .policy import _entropy, get_logits, is_hf_model, token_logprobs

__all__ = ["Packing", "pack_rows", "pow2_rows", "packed_attention_mask", "packed_logprobs", "plan_rows"]


def plan_rows(lengths: list, row_len: int) -> list:
    """Sequences (by their token counts ``lengths``) placed in rows of ``row_len`` tokens, first-fit
    decreasing: a list of rows, each a list of sequence indices in placement order."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > row_len:
            raise ValueError(f"plan_rows: sequence {i} has {n} tokens, more than a packed row's {row_len}")
        for r, f in enumerate(free):
            if n <= f:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row_len - n)
    return rows


class Packing(NamedTuple):
    """One micro-batch packed (device tensors).

    ``ids``/``position_ids``/``segments`` (rows, row_len): the packed tokens, each one's position in its
    sequence, and its sequence number + 1 (0: padding). ``index`` (B, L): for each position of the padded
    micro-batch, where its token sits in the flattened packed rows; ``valid`` (B, L): whether the padded
    position holds a real token (the others read 0)."""

    ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor


def pack_rows(ids: torch.Tensor, attention_mask: torch.Tensor, row_len: int, pad_id: int = 0,
              rows_bucket=None, n_real: Optional[int] = None, device=None) -> Packing:
    """Pack the first ``n_real`` rows (default: all) of a padded micro-batch ``ids``/``attention_mask``
    (B, L) (host tensors) into rows of ``row_len``; the packed row count is ``rows_bucket(count)`` (a
    callable, e.g. the next power of two; default: as many as needed). Rows past ``n_real`` (a
    micro-batch's filler rows) are not packed: their positions read as padding."""
    if ids.shape != attention_mask.shape or ids.dim() != 2:
        raise ValueError(f"pack_rows: ids {tuple(ids.shape)} and attention_mask {tuple(attention_mask.shape)} must "
                         "be the same (rows, length) shape")
    B, L = ids.shape
    n_real = B if n_real is None else n_real
    am = attention_mask.bool()
    cols = [am[i].nonzero().flatten() for i in range(n_real)]
    plan = plan_rows([int(c.numel()) for c in cols], row_len)
    n_rows = len(plan) if rows_bucket is None else max(len(plan), int(rows_bucket(len(plan))))
    p_ids = torch.full((n_rows, row_len), pad_id, dtype=torch.int64)
    p_pos = torch.zeros((n_rows, row_len), dtype=torch.int64)
    p_seg = torch.zeros((n_rows, row_len), dtype=torch.int64)
    index = torch.zeros((B, L), dtype=torch.int64)
    valid = torch.zeros((B, L), dtype=torch.bool)
    for r, seqs in enumerate(plan):
        at = 0
        for i in seqs:
            c = cols[i]
            n = int(c.numel())
            p_ids[r, at:at + n] = ids[i, c]
            p_pos[r, at:at + n] = torch.arange(n)
            p_seg[r, at:at + n] = i + 1
            index[i, c] = r * row_len + at + torch.arange(n)
            valid[i, c] = True
            at += n
    dev = device if device is not None else ids.device
    return Packing(*(t.to(dev) for t in (p_ids, p_pos, p_seg, index, valid)))


def pow2_rows(n: int) -> int:
    """The packed row count's bucket: the next power of two."""
    return 1 << (max(n, 1) - 1).bit_length()


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """(rows, 1, L, L) boolean: query t sees key s when both are in the same sequence and s <= t;
    every query sees itself (a padding query never has every key masked, which gives NaN)."""
    L = segments.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    eye = torch.eye(L, dtype=torch.bool, device=segments.device)
    return ((same & causal & (segments[:, None, :] > 0)) | eye)[:, None]


def _packed_logits(model: nn.Module, pack: Packing) -> torch.Tensor:
    mask = packed_attention_mask(pack.segments)
    if is_hf_model(model):
        dtype = next(model.parameters()).dtype
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        out = model(pack.ids, attention_mask=bias, position_ids=pack.position_ids, use_cache=False)
    else:
        out = model(pack.ids, attention_mask=mask, position_ids=pack.position_ids)
    return get_logits(out)


def packed_logprobs(model: nn.Module, pack: Packing, response_mask: torch.Tensor, temperature: float = 1.0,
                    return_entropy: bool = False):
    """:func:`~torchtpu_rl.policy.sequence_logprobs` of the padded micro-batch that ``pack`` packs, from one
    forward over the packed rows: (B, L) log-probs (and entropies) in the padded layout, 0 outside
    ``response_mask`` (B, L)."""
    logits = _packed_logits(model, pack)
    # position j predicts token j + 1 of the same row; a sequence's first token (a prompt token, never
    # scored) is the only one whose predecessor belongs to another sequence
    next_ids = torch.roll(pack.ids, -1, 1)
    lp = torch.roll(token_logprobs(logits, next_ids, temperature), 1, 1)
    m = response_mask.to(lp.dtype) * pack.valid.to(lp.dtype)
    out = lp.reshape(-1)[pack.index.reshape(-1)].reshape(pack.index.shape) * m
    if not return_entropy:
        return out
    ent = torch.roll(_entropy(logits / (temperature or 1.0)), 1, 1)
    return out, ent.reshape(-1)[pack.index.reshape(-1)].reshape(pack.index.shape) * m
