"""Dynamic-shape bucketing: a known, small number of compiled programs for variable-size data.

XLA compiles one program per input shape. Data whose sizes vary per batch
(sequence lengths in RL rollouts, ids per feature in recommender batches) would
compile a new program on almost every step. This module pads those dynamic
dimensions up to a few fixed sizes ("buckets"), carries masks saying which
entries are real, and counts what the runtime compiled per bucket.

- :class:`BucketPolicy`: which sizes exist (``pow2``, ``linear``, ``explicit``,
  or ``fit`` to observed sizes with the least padding) and what happens above
  the largest (``overflow="error" | "truncate" | "split"``).
- :func:`pad_to_bucket`, :func:`pad_sequences`, :func:`pad_jagged`: padding
  helpers written with plain torch ops only, so they behave the same on cpu and
  tpu tensors and in every execution mode.
- :func:`bucket_scope`: tags work with a bucket key; ``torchtpu.metrics.snapshot()``
  then reports ``compiles_by_bucket`` and ``misses_by_bucket``. An op that keeps
  compiling new shapes gets one :class:`RecompileWarning` naming it
  (:func:`set_recompile_warning_threshold`).

Where the padding runs matters for the compile count. Data still on the host
(python lists, cpu tensors: tokenizer or data-loader output) is padded on the
host and moved to the device at its bucketed shape: no device program ever sees
the raw size. A tensor already on tpu has its raw size baked into every program
that reads it, so padding it on the device compiles one small pad program per
raw size; everything downstream of the pad sees bucketed shapes only.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import operator
from typing import Iterable, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .base import metrics
from .base.metrics import RecompileWarning, get_recompile_warning_threshold, set_recompile_warning_threshold
from .runtime.recorder import RECORDER

__all__ = [
    "BucketOverflowError",
    "BucketPolicy",
    "JaggedBatch",
    "PaddedBatch",
    "PaddingStats",
    "RecompileWarning",
    "bucket_scope",
    "get_recompile_warning_threshold",
    "pad_jagged",
    "pad_sequences",
    "pad_to_bucket",
    "set_recompile_warning_threshold",
    "split_to_buckets",
]

OVERFLOW_MODES = ("error", "truncate", "split")


class BucketOverflowError(ValueError):
    """A size is above the largest bucket of a policy whose overflow mode is ``"error"``."""


def _size(n, what="size") -> int:
    try:
        n = operator.index(n)
    except TypeError:
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
            n = int(n.item())
        else:
            raise TypeError(f"{what} must be an integer, not {type(n).__name__}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, not {n}")
    return n


class PaddingStats(NamedTuple):
    """What a policy does to a set of sizes: ``real`` and ``padded`` totals, ``overhead``
    (padded / real - 1), ``buckets_used`` (bucket -> how many sizes landed in it)."""

    real: int
    padded: int
    overhead: float
    buckets_used: dict


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """An immutable, hashable set of allowed sizes for one dynamic dimension.

    ``bucket(n)`` is the smallest bucket >= n. Above the largest bucket,
    ``overflow`` decides: ``"error"`` raises :class:`BucketOverflowError`;
    ``"truncate"`` gives the largest bucket (the padding helpers cut the data
    to it); ``"split"`` gives ``n`` rounded up to whole chunks of the largest
    bucket (see :meth:`chunks` and :func:`split_to_buckets`). Truncations and
    splits are counted in ``torchtpu.metrics.snapshot()["bucket_overflows"]``.

    ``name`` (optional) labels the policy in reprs and overflow counters.
    """

    buckets: tuple
    overflow: str = "error"
    name: Optional[str] = None
    origin: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        try:
            sizes = sorted({_size(b, "bucket") for b in self.buckets})
        except TypeError as e:
            raise TypeError(f"BucketPolicy buckets must be integers: {e}") from None
        if not sizes:
            raise ValueError("BucketPolicy needs at least one bucket")
        if sizes[0] < 1:
            raise ValueError("BucketPolicy buckets must be >= 1")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, not {self.overflow!r}")
        object.__setattr__(self, "buckets", tuple(sizes))
        if not self.origin:
            shown = list(sizes) if len(sizes) <= 8 else f"<{len(sizes)} sizes>"
            object.__setattr__(self, "origin", f"explicit({shown})")

    # ---------------------------------------------------------------- constructors
    @classmethod
    def pow2(cls, min: int = 1, max: int = 1 << 16, *, overflow: str = "error", name=None) -> "BucketPolicy":
        """``min``, the powers of two between, and ``max``: pow2(8, 512) -> 8, 16, ..., 512;
        pow2(1, 100) -> 1, 2, 4, ..., 64, 100. At most 2x padding above ``min``."""
        lo, hi = _size(min, "min"), _size(max, "max")
        if not 1 <= lo <= hi:
            raise ValueError(f"pow2 needs 1 <= min <= max, got min={lo}, max={hi}")
        sizes = [lo] + [1 << k for k in range(hi.bit_length() + 1) if lo < (1 << k) < hi] + [hi]
        return cls(tuple(sizes), overflow, name, f"pow2({lo}, {hi})")

    @classmethod
    def linear(cls, step: int, max: int, *, start: Optional[int] = None, overflow: str = "error",
               name=None) -> "BucketPolicy":
        """``start`` (default ``step``), ``start + step``, ... and ``max`` as the largest."""
        step, hi = _size(step, "step"), _size(max, "max")
        lo = step if start is None else _size(start, "start")
        if step < 1 or not 1 <= lo <= hi:
            raise ValueError(f"linear needs step >= 1 and 1 <= start <= max, got step={step}, start={lo}, max={hi}")
        sizes = list(range(lo, hi, step)) + [hi]
        args = f"{step}, {hi}" + ("" if start is None else f", start={lo}")
        return cls(tuple(sizes), overflow, name, f"linear({args})")

    @classmethod
    def explicit(cls, sizes: Iterable[int], *, overflow: str = "error", name=None) -> "BucketPolicy":
        return cls(tuple(sizes), overflow, name)

    @classmethod
    def fit(cls, observed_sizes, max_buckets: int, *, multiple_of: int = 1, max_size: Optional[int] = None,
            overflow: str = "error", name=None) -> "BucketPolicy":
        """The at most ``max_buckets`` buckets with the least total padding for ``observed_sizes``.

        ``observed_sizes``: an iterable of sizes (one per observed batch/sequence; a tensor or
        array works) or a mapping size -> count. The largest bucket is the largest observed size
        (or ``max_size``, to leave headroom for sizes not seen yet); with ``multiple_of`` every
        bucket is a multiple of it (e.g. 8 or 128 for TPU tiling).

        Exact, not heuristic: an optimal set only ever needs boundaries at observed sizes
        (lowering a bucket to the largest size it holds never adds padding), so this is a
        dynamic program over the sorted distinct sizes m, ``best[t][i]`` = least padding of
        the i smallest sizes with t buckets. The cost of one bucket satisfies the quadrangle
        inequality, so each layer's optimal split points are monotone and are found by
        divide and conquer: O(max_buckets * m log m) time, O(max_buckets * m) memory.
        """
        k = _size(max_buckets, "max_buckets")
        mult = _size(multiple_of, "multiple_of")
        if k < 1 or mult < 1:
            raise ValueError("fit needs max_buckets >= 1 and multiple_of >= 1")
        counts = _observed_counts(observed_sizes)
        if not counts:
            raise ValueError("fit needs at least one observed size")
        # group observations by the candidate bucket they round up to; keep real totals for the cost
        groups: dict = {}
        for size, c in counts.items():
            cand = max(1, -(-size // mult) * mult)
            g = groups.setdefault(cand, [0, 0])
            g[0] += c
            g[1] += c * size
        if max_size is not None:
            top = _size(max_size, "max_size")
            if top < max(counts):
                raise ValueError(f"fit: max_size {top} is below the largest observed size {max(counts)}")
            if top not in groups:
                groups[top] = [0, 0]  # a boundary every solution must use, costing nothing itself
            above = [c for c in groups if c > top]
            if above:
                raise ValueError(f"fit: with multiple_of={mult}, size {max(counts)} rounds up to "
                                 f"{max(above)}, above max_size {top}")
        values = np.array(sorted(groups), dtype=np.float64)
        cnt = np.array([groups[v][0] for v in sorted(groups)], dtype=np.float64)
        tot = np.array([groups[v][1] for v in sorted(groups)], dtype=np.float64)
        chosen = _optimal_boundaries(values, cnt, tot, k)
        sizes = tuple(int(values[i]) for i in chosen)
        args = f"<{sum(counts.values())} sizes>, {k}"
        if mult != 1:
            args += f", multiple_of={mult}"
        if max_size is not None:
            args += f", max_size={max_size}"
        return cls(sizes, overflow, name, f"fit({args})")

    def with_overflow(self, overflow: str) -> "BucketPolicy":
        return dataclasses.replace(self, overflow=overflow)

    def named(self, name: Optional[str]) -> "BucketPolicy":
        return dataclasses.replace(self, name=name)

    # ---------------------------------------------------------------- queries
    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def __len__(self):
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def __contains__(self, n):
        return n in self.buckets

    def bucket(self, n) -> int:
        """The bucket for size ``n``: the smallest bucket >= n (see the class doc above the largest)."""
        return self._bucket(_size(n), count=True)

    def _bucket(self, n: int, count: bool) -> int:
        buckets = self.buckets
        i = bisect.bisect_left(buckets, n)
        if i < len(buckets):
            return buckets[i]
        top = buckets[-1]
        if self.overflow == "error":
            raise BucketOverflowError(
                f"size {n} is above the largest bucket {top} of {self!r}. Raise the largest bucket, "
                "or choose overflow='truncate' (cut to it) or overflow='split' (whole chunks of it)."
            )
        if count:
            metrics.record_overflow(self._label(self.overflow))
        if self.overflow == "truncate":
            return top
        return top * -(-n // top)

    def chunks(self, n) -> list:
        """How ``split`` cuts size ``n``: [(start, length, bucket)], whole chunks of the largest
        bucket then the remainder in its own bucket (a single chunk when n fits)."""
        n = _size(n)
        top = self.largest
        out = []
        start = 0
        while n - start > top:
            out.append((start, top, top))
            start += top
        rest = n - start
        out.append((start, rest, self._bucket(rest, count=False)))
        return out

    def padding(self, sizes) -> PaddingStats:
        """Padding this policy would add to ``sizes`` (iterable or mapping size -> count);
        overflowing sizes follow ``overflow`` (an error raises) and are not counted as overflows."""
        counts = _observed_counts(sizes)
        real = padded = 0
        used: dict = {}
        for n, c in counts.items():
            b = self._bucket(n, count=False)
            kept = min(n, b)
            real += c * kept
            padded += c * b
            used[b] = used.get(b, 0) + c
        overhead = (padded / real - 1.0) if real else 0.0
        return PaddingStats(real, padded, overhead, dict(sorted(used.items())))

    def _label(self, kind):
        return f"{self.name}:{kind}" if self.name else kind

    def __repr__(self):
        b = self.buckets
        shown = ", ".join(map(str, b)) if len(b) <= 8 else (
            ", ".join(map(str, b[:4])) + ", ..., " + ", ".join(map(str, b[-2:])))
        extra = "" if self.overflow == "error" else f", overflow={self.overflow!r}"
        if self.name:
            extra += f", name={self.name!r}"
        # origin is the constructor call, e.g. "pow2(8, 512)": options go inside its parentheses
        return f"BucketPolicy.{self.origin[:-1]}{extra}) -> {len(b)} buckets [{shown}]"


def _observed_counts(observed) -> dict:
    """size -> count from an iterable of sizes, a tensor/array of sizes, or a mapping."""
    if hasattr(observed, "items"):
        out = {}
        for s, c in observed.items():
            s, c = _size(s), _size(c, "count")
            if c:
                out[s] = out.get(s, 0) + c
        return out
    if isinstance(observed, torch.Tensor):
        observed = observed.detach().cpu().numpy()
    arr = np.asarray(observed if isinstance(observed, np.ndarray) else list(observed)).reshape(-1)
    if arr.size == 0:
        return {}
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.bool_)):
        raise TypeError(f"observed sizes must be integers, not {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"observed sizes must be >= 0, got {int(arr.min())}")
    sizes, counts = np.unique(arr, return_counts=True)
    return {int(s): int(c) for s, c in zip(sizes, counts)}


def _optimal_boundaries(values, cnt, tot, k):
    """Indices into ``values`` of the least-padding boundaries (<= k, always including the last).

    Group g holds cnt[g] sizes totalling tot[g] that round up to values[g]. A bucket with
    boundary values[i-1] holding groups j..i-1 costs
    w(j, i) = values[i-1] * (C[i] - C[j]) - (S[i] - S[j]) (C, S: prefix sums of cnt, tot).
    best_t[i] (least padding of the first i groups with at most t buckets) is
    min over j < i of best_{t-1}[j] + w(j, i), with best_t[0] = 0. For a <= b <= c <= d,
    w(a, d) - w(a, c) - (w(b, d) - w(b, c)) = (C[b] - C[a]) * (values[d-1] - values[c-1]) >= 0:
    the quadrangle inequality, so the leftmost optimal j never decreases with i and each
    layer is solved by divide and conquer over i with a shrinking range of j.
    """
    m = len(values)
    k = min(k, m)
    C = np.concatenate([[0.0], np.cumsum(cnt)])
    S = np.concatenate([[0.0], np.cumsum(tot)])
    best = np.concatenate([[0.0], values * C[1:] - S[1:]])  # t = 1: one bucket over groups 0..i-1
    choice = []  # per layer t >= 2: the optimal j for each i
    for _ in range(2, k + 1):
        prev = best
        cur = np.zeros(m + 1)
        arg = np.zeros(m + 1, dtype=np.int64)
        stack = [(1, m, 0, m - 1)]  # iterative: no recursion limit on many distinct sizes
        while stack:
            lo, hi, olo, ohi = stack.pop()
            if lo > hi:
                continue
            mid = (lo + hi) // 2
            j = np.arange(olo, min(mid - 1, ohi) + 1)
            cand = prev[j] + values[mid - 1] * (C[mid] - C[j]) - (S[mid] - S[j])
            p = int(np.argmin(cand))  # leftmost minimum
            best_j = int(j[p])
            cur[mid], arg[mid] = cand[p], best_j
            stack.append((lo, mid - 1, olo, best_j))
            stack.append((mid + 1, hi, best_j, ohi))
        choice.append(arg)
        best = cur
    out = []
    i = m
    for arg in reversed(choice):
        if i == 0:
            break
        out.append(i - 1)
        i = int(arg[i])
    if i > 0:
        out.append(i - 1)
    return sorted(out)


# ---------------------------------------------------------------- scopes and warnings
def bucket_scope(*args, **items):
    """Attribute compiles and executables built in this block to a bucket key.

    ``with bucket_scope("seq", 64):`` or ``with bucket_scope(seq=64, batch=8):``.
    ``torchtpu.metrics.snapshot()["compiles_by_bucket"]["batch=8,seq=64"]`` then counts
    the XLA compiles of the block and ``["misses_by_bucket"][key]`` the executables each
    op built. Scopes nest and are per thread.

    Under DeferAndFuse a scope is a graph boundary: pending work is flushed when the
    scope is entered and when it is left normally, so the fused graph of the block is
    compiled (and counted) under its key, and holds only work of that bucket's shapes.
    """
    if args:
        if len(args) != 2:
            raise TypeError("bucket_scope takes (name, value) or name=value keywords")
        items = {str(args[0]): args[1], **items}
    if not items:
        raise TypeError("bucket_scope needs at least one name=value")
    return _scope(tuple(items.items()))


@contextlib.contextmanager
def _scope(items):
    _flush_pending()
    with metrics.bucket_scope(items) as key:
        yield key
        _flush_pending()  # not on an exception: the pending work stays for the next flush


def _flush_pending():
    if RECORDER.pending:
        RECORDER.flush("bucket_scope")


# ---------------------------------------------------------------- padding helpers
def _norm_dim(dim, ndim):
    if ndim == 0:
        raise ValueError("cannot pad a 0-dim tensor")
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def _check_side(side, what):
    if side not in ("right", "left"):
        raise ValueError(f"{what} must be 'right' or 'left', not {side!r}")


def _pad_dim(t, dim, before, after, value):
    """``t`` with ``before``/``after`` entries of ``value`` added along ``dim`` (one constant_pad_nd)."""
    if before == 0 and after == 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - dim) + [before, after]
    return F.pad(t, pads, value=value)


def _to_device(t, device):
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


def _length_mask(lengths, width, side, device):
    """(len(lengths), width) bool mask of real entries, or (width,) for an int length. Built on the
    host and moved: a device program would compile per length or need the lengths uploaded anyway."""
    lens = torch.as_tensor(lengths, dtype=torch.int64)
    pos = torch.arange(width, dtype=torch.int64)
    if lens.dim():
        lens, pos = lens.reshape(-1, 1), pos.reshape(1, -1)
    mask = pos < lens if side == "right" else pos >= width - lens
    return _to_device(mask, device)


def pad_to_bucket(tensor: torch.Tensor, dim: int, policy: BucketPolicy, value=0, *, side: str = "right",
                  truncation_side: str = "right"):
    """Pad ``tensor`` along ``dim`` up to ``policy.bucket(size)``.

    Returns ``(padded, mask)``: ``mask`` is a 1-D bool tensor of the bucket's length on the
    tensor's device, True at real entries. ``side="left"`` puts the padding first. Under
    ``overflow="truncate"`` a longer tensor is cut to the largest bucket (dropping its end,
    or its start with ``truncation_side="left"``), counted in
    ``metrics.snapshot()["bucket_overflows"]``. ``padded`` is ``tensor`` itself when it
    already has a bucket's size. Plain torch ops: autograd flows through, any device works.
    """
    _check_side(side, "side")
    _check_side(truncation_side, "truncation_side")
    d = _norm_dim(dim, tensor.dim())
    n = tensor.shape[d]
    b = policy.bucket(n)
    if b < n:  # truncate
        tensor = tensor.narrow(d, 0 if truncation_side == "right" else n - b, b)
        metrics.record_overflow(policy._label("truncated_values"), n - b)
        n = b
    pad = b - n
    padded = _pad_dim(tensor, d, pad if side == "left" else 0, pad if side == "right" else 0, value)
    return padded, _length_mask(n, b, side, tensor.device)


def split_to_buckets(tensor: torch.Tensor, dim: int, policy: BucketPolicy, value=0):
    """Cut ``tensor`` along ``dim`` into chunks of the largest bucket and pad the remainder to its
    own bucket: ``[(chunk, mask), ...]``. Every chunk has a bucket's size, so a long input costs
    no new program (``policy.chunks(n)`` gives the plan)."""
    d = _norm_dim(dim, tensor.dim())
    n = tensor.shape[d]
    plan = policy.chunks(n)
    if len(plan) > 1:
        metrics.record_overflow(policy._label("split"))
    out = []
    for start, length, b in plan:
        piece = tensor.narrow(d, start, length)
        out.append((_pad_dim(piece, d, 0, b - length, value), _length_mask(length, b, "right", tensor.device)))
    return out


class PaddedBatch(NamedTuple):
    """A bucketed batch of variable-length sequences.

    ``values``: (bucketed batch, bucketed length, *feature dims); ``attention_mask``:
    (bucketed batch, bucketed length) bool, True at real tokens (rows past ``batch_size``
    are all False); ``lengths``: (bucketed batch,) int64 real lengths (0 for padding rows);
    ``batch_size``: the number of real sequences.
    """

    values: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    batch_size: int

    @property
    def bucket_key(self) -> dict:
        return {"batch": self.values.shape[0], "length": self.values.shape[1]}

    def scope(self):
        """``bucket_scope(batch=..., length=...)`` for this batch's shape."""
        return bucket_scope(**self.bucket_key)


def _is_device_tensor(x):
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _same_device(a, b):
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def pad_sequences(sequences: Sequence, length_policy: BucketPolicy, batch_policy: Optional[BucketPolicy] = None,
                  padding_side: str = "right", value=0, *, truncation_side: str = "right",
                  dtype: Optional[torch.dtype] = None, device=None) -> PaddedBatch:
    """Stack variable-length sequences (1-D, or N-D with equal trailing dims) into one bucketed batch.

    The length dimension becomes ``length_policy.bucket(longest)`` and, with ``batch_policy``,
    the batch dimension ``batch_policy.bucket(len(sequences))`` (extra rows are all padding).
    ``padding_side="left"`` right-aligns each sequence (prompts for generation). Sequences
    longer than the length bucket (``overflow="truncate"``) lose their end, or their start with
    ``truncation_side="left"``; a batch above the largest batch bucket under ``"truncate"``
    keeps its first sequences. Drops are counted in ``metrics.snapshot()["bucket_overflows"]``.

    Host data (lists, cpu tensors) is padded on the host and moved once to ``device`` (default:
    stay on cpu): no device program sees a raw length. Sequences already on tpu are padded
    there (``device`` must then be None or theirs).
    """
    _check_side(padding_side, "padding_side")
    _check_side(truncation_side, "truncation_side")
    seqs = list(sequences)
    if not seqs:
        raise ValueError("pad_sequences needs at least one sequence")
    on_device = [_is_device_tensor(s) for s in seqs]
    if any(on_device) and not all(on_device):
        raise ValueError("pad_sequences: sequences must all be on the host or all on the same device")
    if not any(on_device):
        seqs = [s if isinstance(s, torch.Tensor) else torch.as_tensor(s, dtype=dtype) for s in seqs]
    if dtype is not None:
        seqs = [s if s.dtype == dtype else s.to(dtype) for s in seqs]
    tail = tuple(seqs[0].shape[1:])
    for i, s in enumerate(seqs):
        if s.dim() == 0:
            raise ValueError(f"pad_sequences: sequence {i} is 0-dim; sequences need a length dimension")
        if tuple(s.shape[1:]) != tail:
            raise ValueError(f"pad_sequences: sequence {i} has trailing shape {tuple(s.shape[1:])}, "
                             f"sequence 0 has {tail}")
    # an empty python list becomes a float tensor: only non-empty sequences decide the dtype
    typed = [s for s in seqs if s.numel()] or seqs
    out_dtype = typed[0].dtype
    for s in typed[1:]:
        out_dtype = torch.promote_types(out_dtype, s.dtype)

    # batch dimension
    B = len(seqs)
    Bb = B if batch_policy is None else batch_policy.bucket(B)
    if Bb < B:  # truncate
        metrics.record_overflow(batch_policy._label("dropped_sequences"), B - Bb)
        seqs, B = seqs[:Bb], Bb
    # length dimension
    lens = [s.shape[0] for s in seqs]
    Lb = length_policy.bucket(max(lens))
    kept = [min(n, Lb) for n in lens]
    cut = sum(lens) - sum(kept)
    if cut:
        metrics.record_overflow(length_policy._label("truncated_values"), cut)

    def trimmed(s, n):
        return s if s.shape[0] == n else s.narrow(0, 0 if truncation_side == "right" else s.shape[0] - n, n)

    if any(on_device):
        dev = seqs[0].device
        if device is not None and not _same_device(device, dev):
            raise ValueError(f"pad_sequences: sequences are on {dev}, device={device} differs; move them first")
        rows = []
        for s, n in zip(seqs, kept):
            s = trimmed(s, n)
            if s.dtype != out_dtype:
                s = s.to(out_dtype)
            pad = Lb - n
            # a fresh contiguous row even without padding: stack's program is then keyed by (Bb, Lb) only
            rows.append(_pad_dim(s, 0, pad if padding_side == "left" else 0, pad if padding_side == "right" else 0,
                                 value) if pad else s.clone(memory_format=torch.contiguous_format))
        if Bb > B:
            filler = rows[0].new_full((Lb, *tail), value)
            rows.extend([filler] * (Bb - B))
        values = torch.stack(rows)
        target = dev
    else:
        values = torch.full((Bb, Lb, *tail), value, dtype=out_dtype)
        for i, (s, n) in enumerate(zip(seqs, kept)):
            if n:
                dst = values[i, :n] if padding_side == "right" else values[i, Lb - n:]
                dst.copy_(trimmed(s, n))
        target = device
        values = _to_device(values, target)
    lengths = torch.tensor(kept + [0] * (Bb - B), dtype=torch.int64)
    mask = _length_mask(lengths, Lb, padding_side, target)
    return PaddedBatch(values, mask, _to_device(lengths, target), B)


class JaggedBatch(NamedTuple):
    """Jagged values in a fixed-capacity buffer.

    ``values``: (capacity, *feature dims), the kept values first then padding; ``mask``:
    (capacity,) bool; ``lengths``: (segments,) int64 kept values per segment; ``offsets``:
    (segments + 1,) int64 into ``values``; ``segment_ids``: (capacity,) int64, the segment of
    each slot, ``segments`` for padding (so a segment-sum over ``segments + 1`` outputs and
    dropping the last ignores padding); ``num_values``: kept values; ``dropped``: values
    dropped by overflow.
    """

    values: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    segment_ids: torch.Tensor
    num_values: int
    dropped: int

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    def scope(self):
        return bucket_scope(capacity=self.capacity)


def _host_int_list(x, what):
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex():
            raise TypeError(f"{what} must be integers")
        return [int(v) for v in x.detach().cpu().reshape(-1).tolist()]
    return [int(operator.index(v)) for v in x]


def pad_jagged(values: torch.Tensor, lengths=None, offsets=None, capacity_policy: Optional[BucketPolicy] = None,
               overflow: str = "error", value=0, *, device=None) -> JaggedBatch:
    """Put jagged data (``values`` concatenated over segments, with ``lengths`` or ``offsets``)
    into a buffer of ``capacity_policy.bucket(total)`` slots.

    Above the policy's largest bucket, ``overflow="error"`` raises :class:`BucketOverflowError`
    and ``overflow="drop"`` keeps the first ``largest`` values (later segments lose theirs),
    returns the number dropped and counts it in ``metrics.snapshot()["bucket_overflows"]``.
    Lengths/offsets are read on the host (the capacity depends on them); ``values`` is padded
    where it lives, or on the host and then moved to ``device``.
    """
    if capacity_policy is None:
        raise TypeError("pad_jagged needs a capacity_policy")
    if overflow not in ("error", "drop"):
        raise ValueError(f"pad_jagged overflow must be 'error' or 'drop', not {overflow!r}")
    if values.dim() == 0:
        raise ValueError("pad_jagged: values must have at least one dimension")
    if _is_device_tensor(values):
        if device is not None and not _same_device(device, values.device):
            raise ValueError(f"pad_jagged: values are on {values.device}, device={device} differs; move them first")
        target = values.device
    else:
        target = device
    total = values.shape[0]
    if lengths is None and offsets is None:
        raise ValueError("pad_jagged needs lengths or offsets")
    if lengths is not None:
        lens = _host_int_list(lengths, "lengths")
        if any(n < 0 for n in lens):
            raise ValueError("pad_jagged: lengths must be >= 0")
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        if offsets is not None and _host_int_list(offsets, "offsets") != offs:
            raise ValueError("pad_jagged: lengths and offsets disagree")
    else:
        offs = _host_int_list(offsets, "offsets")
        if not offs or offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError("pad_jagged: offsets must start at 0 and be non-decreasing")
    if offs[-1] != total:
        raise ValueError(f"pad_jagged: lengths/offsets cover {offs[-1]} values, values has {total}")
    nseg = len(offs) - 1

    top = capacity_policy.largest
    if total > top:
        if overflow == "error":
            raise BucketOverflowError(
                f"{total} jagged values are above the largest capacity bucket {top} of {capacity_policy!r}; "
                "raise it, or pass overflow='drop' to keep the first values and count the rest"
            )
        cap = keep = top
        metrics.record_overflow(capacity_policy._label("jagged_dropped"), total - top)
    else:
        cap, keep = capacity_policy._bucket(total, count=False), total
    dropped = total - keep

    kept_offs = torch.tensor([min(o, keep) for o in offs], dtype=torch.int64)
    kept_lens = kept_offs[1:] - kept_offs[:-1]
    seg = torch.repeat_interleave(torch.arange(nseg, dtype=torch.int64), kept_lens)
    seg = torch.cat([seg, torch.full((cap - keep,), nseg, dtype=torch.int64)])
    mask = torch.arange(cap) < keep

    v = values if keep == total else values.narrow(0, 0, keep)
    v = _to_device(_pad_dim(v, 0, 0, cap - keep, value), target)
    mask, kept_lens, kept_offs, seg = (_to_device(x, target) for x in (mask, kept_lens, kept_offs, seg))
    return JaggedBatch(v, mask, kept_lens, kept_offs, seg, keep, dropped)
