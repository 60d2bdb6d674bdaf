"""Host-side preprocessing: a TorchRec ``KeyedJaggedTensor`` -> fixed-size per-SparseCore buffers.

For each stacked table (see :mod:`torchtpu_rec.tables`) the ids of its features
are mapped to stacked rows, split MOD the core count, sorted by (core, output
segment) and written into per-core buffers of a fixed capacity, as SparseCore's
CSR-wrapped COO input:

- ``row_pointers`` ``(n, S + 1)``: per core, where each output segment's ids start;
- ``local_ids`` ``(n, cap)``: row on the core; ``sample_ids`` ``(n, cap)``: output
  segment (``S`` for padding); ``gains`` ``(n, cap)``: per-id weight, with the
  ``mean`` combiner's ``1 / bag length`` folded in (0 for padding);
- ``unique_ids`` ``(n, ucap)``: the distinct local rows of each core (-1 padding) and
  ``unique_index`` ``(n, cap)``: each id's slot among them (``ucap`` padding): the fused
  update sums duplicate ids' gradients into one row update.

An output segment is ``slot * batch + sample`` for pooled features (``slot``: the
feature's place in the stack) and the id's position for sequence features.

Capacities (``cap``: ids per core, ``ucap``: unique ids per core) are buckets of a
``torchtpu.bucketing.BucketPolicy``, so the device programs compile once per bucket.
Above the largest bucket, ``overflow="error"`` raises :class:`~torchtpu.bucketing.BucketOverflowError`
and ``overflow="drop"`` keeps each core's first ids (in (segment, position) order) and, over
the unique-ids capacity, each core's lowest rows; it drops the rest (their lookups count as 0
and they get no update) and counts them (:class:`RecCounters`, and
``torchtpu.metrics.snapshot()["bucket_overflows"]["rec:<stack>:dropped_ids"]``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence

import numpy as np

from torchtpu import metrics
from torchtpu.bucketing import BucketOverflowError, BucketPolicy

from .tables import StackedTable

__all__ = [
    "CoreBuffers",
    "IdOutOfRangeError",
    "FeatureSlot",
    "PreprocessedBatch",
    "RecCounters",
    "default_policy",
    "kjt_arrays",
    "preprocess",
]

OVERFLOW_MODES = ("error", "drop")


class IdOutOfRangeError(IndexError, ValueError):
    """An id outside its table (or table shard): the message names the feature and the table."""


def default_policy(name: str = "rec_ids", largest: int = 1 << 20) -> BucketPolicy:
    """Four buckets per octave (multiples of 64) from 64 to ``largest`` ids per core: at most ~19%
    padding (the lookup's cost grows with the padded size), a handful of programs for a steady
    input distribution."""
    sizes = {min(largest, -(-int(64 * 2 ** (k / 4)) // 64) * 64) for k in range(4 * 20)}
    return BucketPolicy.explicit(sorted(s for s in sizes if s <= largest) + [largest], name=name)


@dataclasses.dataclass
class RecCounters:
    """Running totals of what preprocessing saw and dropped (``as_dict()`` for a snapshot)."""

    batches: int = 0
    ids: int = 0
    dropped_ids: int = 0  # over the ids-per-core capacity
    dropped_unique_ids: int = 0  # ids whose row was over the unique-ids-per-core capacity
    padded_slots: int = 0  # capacity slots carrying no id
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict:
        with self._lock:
            return {k: getattr(self, k) for k in ("batches", "ids", "dropped_ids", "dropped_unique_ids",
                                                  "padded_slots")}

    def add(self, **kw):
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + int(v))

    def reset(self):
        with self._lock:
            self.batches = self.ids = self.dropped_ids = self.dropped_unique_ids = self.padded_slots = 0


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    """Where feature ``feature`` goes: stack ``stack``, table ``table`` (stack row ``row_offset``),
    slot ``slot`` within the stack's features, ``num_embeddings`` rows, ``mean`` combiner or not."""

    feature: str
    stack: int
    table: str
    row_offset: int
    slot: int
    num_embeddings: int
    mean: bool


@dataclasses.dataclass
class CoreBuffers:
    """The fixed-size per-core buffers of one stacked table for one batch (numpy, host).

    Held flat, the way the device kernels take them (``kernel_arrays()``); the per-core
    ``(n, cap)`` views (``local_ids``, ``sample_ids``, ``gains``, ``unique_ids``,
    ``unique_index``, ``row_pointers``) are derived on access.
    """

    num_cores: int
    rows_per_core: int
    capacity: int  # ids per core
    unique_capacity: int  # distinct rows per core
    num_segments: int  # S
    phys: np.ndarray  # (n * cap,) int32 physical row per slot (padding: the core's row 0, gain 0)
    seg: np.ndarray  # (n * cap,) int32 output segment per slot (S: padding)
    gain: np.ndarray  # (n * cap,) float32 (0: padding)
    uflat: np.ndarray  # (n * cap,) int32 flat unique slot per id (n * ucap: padding)
    uphys: np.ndarray  # (n * ucap,) int32 physical row per unique slot (>= n * rows_per_core: padding)
    ids_per_core: np.ndarray  # (n,) ids kept per core
    unique_per_core: np.ndarray  # (n,) distinct rows kept per core
    dropped_ids: int
    dropped_unique_ids: int

    def _cores(self):
        return np.arange(self.num_cores, dtype=np.int64)[:, None]

    @property
    def local_ids(self) -> np.ndarray:  # (n, cap); padding 0
        return (self.phys.reshape(self.num_cores, -1) - self._cores() * self.rows_per_core).astype(np.int32)

    @property
    def sample_ids(self) -> np.ndarray:  # (n, cap); padding S
        return self.seg.reshape(self.num_cores, -1)

    @property
    def gains(self) -> np.ndarray:  # (n, cap); padding 0
        return self.gain.reshape(self.num_cores, -1)

    @property
    def unique_ids(self) -> np.ndarray:  # (n, ucap) local rows; padding -1
        u = self.uphys.reshape(self.num_cores, -1).astype(np.int64)
        return np.where(u < self.num_cores * self.rows_per_core, u - self._cores() * self.rows_per_core,
                        -1).astype(np.int32)

    @property
    def unique_index(self) -> np.ndarray:  # (n, cap) slot among the core's unique rows; padding ucap
        u = self.uflat.reshape(self.num_cores, -1).astype(np.int64)
        ucap = self.unique_capacity
        return np.where(u < self.num_cores * ucap, u - self._cores() * ucap, ucap).astype(np.int32)

    @property
    def row_pointers(self) -> np.ndarray:
        """(n, S + 1): per core, the CSR start of each output segment among its ids."""
        n, S = self.num_cores, self.num_segments
        sid = self.sample_ids.astype(np.int64)
        real = sid < S
        per = np.bincount((self._cores() * S + sid)[real], minlength=n * S).reshape(n, S)
        rp = np.zeros((n, S + 1), np.int64)
        np.cumsum(per, axis=1, out=rp[:, 1:])
        return rp

    def kernel_arrays(self) -> tuple:
        """(physical row per id, segment per id, gain per id, flat unique slot per id, physical row
        per unique slot): what the device kernels take."""
        return self.phys, self.seg, self.gain, self.uflat, self.uphys


@dataclasses.dataclass
class PreprocessedBatch:
    """One batch for one collection: per stack :class:`CoreBuffers`, plus what the outputs need."""

    batch_size: int
    buffers: list  # per stack
    kernel_inputs: list  # per stack: kernel_arrays()
    # sequence features: feature -> (stack, first segment, number of ids, lengths (cpu tensor))
    sequence_layout: dict
    key: tuple  # hashable shape key: (batch, per stack (cap, ucap, S))
    device_inputs: Optional[tuple] = None  # kernel_inputs on the device, once uploaded (lookup and update share them)
    # (table buffers, rows of the unique slots) as the training lookup read them: the fused update of this
    # batch takes the rows from here while the buffers are still the tables' (no second read)
    looked_up: Optional[tuple] = None


def kjt_arrays(kjt) -> tuple:
    """(keys, values int64, lengths int64, weights float32 or None, stride) of a KJT, on the host."""
    if kjt.variable_stride_per_key():
        raise ValueError("torchtpu_rec: KeyedJaggedTensor with variable stride per key is not supported")
    keys = list(kjt.keys())
    vals = kjt.values()
    lens = kjt.lengths()
    w = kjt.weights_or_none()

    def host(t, dtype):
        if t.device.type != "cpu":
            t = t.cpu()
        return t.detach().numpy().astype(dtype, copy=False)

    return keys, host(vals, np.int64), host(lens, np.int64), (None if w is None else host(w, np.float32)), \
        int(kjt.stride())


def _capacity(policy: BucketPolicy, need: int, overflow: str, what: str):
    """(capacity, overflowed) for ``need`` entries under ``policy``."""
    top = policy.largest
    if need <= top:
        return policy.bucket(max(need, 1)), False
    if overflow == "error":
        raise BucketOverflowError(
            f"torchtpu_rec: {what} needs {need} slots per SparseCore, above the largest bucket {top} of "
            f"{policy!r}. Raise the policy's largest bucket or pass overflow='drop' to drop and count the rest.")
    return top, True


def preprocess(kjt, stacks: Sequence[StackedTable], slots: dict, *, is_weighted: bool, pooled: bool,
               ids_policy: BucketPolicy, unique_policy: BucketPolicy, overflow: str = "error",
               counters: Optional[RecCounters] = None, check_ids: bool = True) -> PreprocessedBatch:
    """Turn ``kjt`` into per-core buffers for ``stacks`` (``slots``: feature -> :class:`FeatureSlot`, or a
    sequence of them, where a feature named twice takes the KJT's keys of that name in order)."""
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, not {overflow!r}")
    keys, values, lengths, weights, B = kjt_arrays(kjt)
    if is_weighted and weights is None and pooled:
        raise ValueError("torchtpu_rec: this collection is weighted (is_weighted=True) but the "
                         "KeyedJaggedTensor has no weights")
    if not is_weighted:
        weights = None
    if lengths.shape[0] != len(keys) * B:
        raise ValueError(f"torchtpu_rec: KeyedJaggedTensor has {lengths.shape[0]} lengths for {len(keys)} keys "
                         f"x stride {B}")
    total = int(lengths.sum())
    if total != values.shape[0] or (lengths.size and lengths.min() < 0):
        raise ValueError(f"torchtpu_rec: KeyedJaggedTensor lengths (sum {total}) do not describe its "
                         f"{values.shape[0]} values")

    buffers, kin, seq_layout, key = [], [], {}, [B]
    plan = _plan(tuple(keys), slots, len(stacks))
    F = len(keys)
    # per value, its key's table row offset / rows / stack, and its segment: one np.repeat of a small
    # per-key or per-bag array each (no per-value gathers or divisions)
    len_per_key = lengths.reshape(F, B).sum(1) if B else np.zeros(F, np.int64)
    if check_ids and values.size:
        bad = (values < 0) | (values >= np.repeat(plan.rows, len_per_key))
        if bad.any():
            i = int(np.argmax(bad))
            k = int(np.searchsorted(np.cumsum(len_per_key), i, side="right"))
            sl = plan.slot_of[k]
            raise IdOutOfRangeError(f"torchtpu_rec: feature {keys[k]!r} has id {int(values[i])} out of range for "
                                    f"table {sl.table!r} with {sl.num_embeddings} rows")
    gids = values + np.repeat(plan.row_offset, len_per_key) if plan.any_offset else values
    if pooled:
        seg = np.repeat((plan.slot[:, None] * B + np.arange(B, dtype=np.int64)).reshape(-1), lengths)
        if weights is not None:
            gain = weights.astype(np.float32, copy=True)
        else:
            gain = np.ones(values.shape[0], np.float32)
        if plan.any_mean:
            div = np.where(np.repeat(plan.mean, B), np.maximum(lengths, 1), 1).astype(np.float32)
            gain /= np.repeat(div, lengths)
    else:
        # the ids of a stack's features one after the other, in slot order
        key_start = np.zeros(F + 1, np.int64)
        np.cumsum(len_per_key, out=key_start[1:])
        base = np.zeros(F, np.int64)
        for si in range(len(stacks)):
            acc = 0
            for k in plan.stack_keys[si]:
                base[k] = acc
                acc += int(len_per_key[k])
                seq_layout[keys[k]] = (si, int(base[k]), int(len_per_key[k]), lengths[k * B:(k + 1) * B])
        seg = np.repeat(base - key_start[:-1], len_per_key) + np.arange(values.shape[0], dtype=np.int64)
        gain = np.ones(values.shape[0], np.float32)
    stack_v = None if plan.single else np.repeat(plan.stack, len_per_key)

    tot_ids = tot_drop = tot_udrop = tot_pad = 0
    for si, st in enumerate(stacks):
        if plan.single:
            g_s, seg_s, gain_s = gids, seg, gain
        else:
            m = stack_v == si
            g_s, seg_s, gain_s = gids[m], seg[m], gain[m]
        if not plan.sorted[si]:  # the KJT's key order is not the stack's slot order
            o = np.argsort(seg_s, kind="stable")
            g_s, seg_s, gain_s = g_s[o], seg_s[o], gain_s[o]
        nfeat = len(plan.stack_keys[si])
        if pooled:
            S = nfeat * B
        else:
            total = int(g_s.shape[0])
            S = ids_policy.bucket(max(total, 1)) if total <= ids_policy.largest else \
                -(-total // ids_policy.largest) * ids_policy.largest
        buf = _core_buffers(g_s, seg_s, gain_s, S, st.num_cores, st.rows_per_core, ids_policy, unique_policy,
                            overflow, st.name)
        buffers.append(buf)
        kin.append(buf.kernel_arrays())
        key.append((buf.capacity, buf.unique_capacity, S))
        tot_ids += int(g_s.shape[0])
        tot_drop += buf.dropped_ids
        tot_udrop += buf.dropped_unique_ids
        tot_pad += buf.phys.size - int(buf.ids_per_core.sum())
        if buf.dropped_ids:
            metrics.record_overflow(f"rec:{st.name}:dropped_ids", buf.dropped_ids)
        if buf.dropped_unique_ids:
            metrics.record_overflow(f"rec:{st.name}:dropped_unique_ids", buf.dropped_unique_ids)
    if counters is not None:
        counters.add(batches=1, ids=tot_ids, dropped_ids=tot_drop, dropped_unique_ids=tot_udrop,
                     padded_slots=tot_pad)
    return PreprocessedBatch(B, buffers, kin, seq_layout, tuple(key))


class _Plan:
    """Per KJT key order: each key's stack, slot, row offset, rows and combiner, as arrays."""

    def __init__(self, keys, slot_list, nstacks):
        by_feature: dict = {}
        for s in slot_list:
            by_feature.setdefault(s.feature, []).append(s)
        key_count: dict = {}
        for f in keys:
            key_count[f] = key_count.get(f, 0) + 1
        for f, ss in by_feature.items():
            if key_count.get(f, 0) < len(ss):
                s = ss[key_count.get(f, 0)]
                raise ValueError(f"torchtpu_rec: feature {s.feature!r} (table {s.table!r}) is missing from the "
                                 f"KeyedJaggedTensor (keys: {list(keys)})")
        F = len(keys)
        big = np.iinfo(np.int64).max
        self.stack = np.full(F, -1, np.int64)
        self.slot = np.zeros(F, np.int64)
        self.row_offset = np.zeros(F, np.int64)
        self.rows = np.full(F, big, np.int64)  # keys no table reads: never out of range
        self.mean = np.zeros(F, bool)
        self.stack_keys = [[] for _ in range(nstacks)]
        self.slot_of: list = [None] * F
        seen: dict = {}
        for k, f in enumerate(keys):
            ss = by_feature.get(f, ())
            n = seen.get(f, 0)
            seen[f] = n + 1
            if n >= len(ss):
                continue
            s = self.slot_of[k] = ss[n]
            self.stack[k], self.slot[k], self.row_offset[k] = s.stack, s.slot, s.row_offset
            self.rows[k], self.mean[k] = s.num_embeddings, s.mean
            self.stack_keys[s.stack].append(k)
        self.any_mean = bool(self.mean.any())
        self.any_offset = bool(self.row_offset.any())
        # the KJT's keys of a stack in its slot order: segments come out sorted, no sort needed
        self.sorted = [all(self.slot[a] < self.slot[b] for a, b in zip(ks, ks[1:])) for ks in self.stack_keys]
        for si in range(nstacks):
            self.stack_keys[si].sort(key=lambda k: self.slot[k])
        self.single = nstacks == 1 and len(slot_list) == F


_plans: dict = {}


def _plan(keys, slots, nstacks) -> _Plan:
    """The cached :class:`_Plan` of a KJT key order for ``slots`` (a collection's own dict / list:
    cached by identity, hashing the slots every batch costs more than the rest of the plan)."""
    ck = (keys, id(slots), nstacks)
    hit = _plans.get(ck)
    if hit is not None and hit[0] is slots:
        return hit[1]
    p = _Plan(keys, tuple(slots.values()) if isinstance(slots, dict) else tuple(slots), nstacks)
    if len(_plans) > 256:
        _plans.clear()
    _plans[ck] = (slots, p)
    return p


def _stable_order_by_core(core, n):
    """Stable order of ``core`` values (radix sort on small ints: O(N))."""
    small = core.astype(np.uint8 if n <= 256 else np.uint16 if n <= 65536 else np.int64)
    return np.argsort(small, kind="stable")


def _unique_inverse(phys, P):
    """(sorted distinct values of ``phys`` in [0, P), index of each element among them)."""
    if P <= 16 * max(phys.shape[0], 1):  # a bitmap over the rows beats sorting
        mark = np.zeros(P, bool)
        mark[phys] = True
        uniq = np.flatnonzero(mark)
        where = np.empty(P, np.int32)  # only the rows in uniq are read back
        where[uniq] = np.arange(uniq.shape[0], dtype=np.int32)
        return uniq, where[phys]
    return np.unique(phys, return_inverse=True)


def _per_core(bounds, policy, overflow, what):
    """(count per core, capacity, first index of each entry's core repeated per entry) for entries sorted
    by core with core ``c`` at ``[bounds[c], bounds[c + 1])``."""
    counts = np.diff(bounds)
    cap, _ = _capacity(policy, int(counts.max()) if counts.size else 0, overflow, what)
    return counts, cap, np.repeat(bounds[:-1], counts)


def _core_buffers(gids, seg, gain, S, n, rpc, ids_policy, unique_policy, overflow, stack_name) -> CoreBuffers:
    """``seg`` must be non-decreasing (it is: features in slot order, bags in order)."""
    if n & (n - 1) == 0:  # power of two: bit ops instead of int64 division
        core, local = gids & (n - 1), gids >> (n.bit_length() - 1)
    else:
        core, local = gids % n, gids // n
    # by core, stable: each core's ids stay in segment order, each bag in its ids' order
    # (the same summation order as TorchRec)
    if n > 1:
        order = _stable_order_by_core(core, n)
        core, local, seg, gain = core[order], local[order], seg[order], gain[order]
    cores = np.arange(n + 1, dtype=np.int64)
    N = core.shape[0]
    counts, cap, first = _per_core(np.searchsorted(core, cores), ids_policy, overflow,
                                   f"stacked table {stack_name!r}")
    pos = np.arange(N) - first
    dropped = 0
    if counts.size and counts.max() > cap:
        keep = pos < cap
        dropped = int(N - keep.sum())
        core, local, seg, gain, pos = core[keep], local[keep], seg[keep], gain[keep], pos[keep]

    # distinct rows per core, in (core, row) order
    P = n * rpc
    phys = core * rpc + local
    uniq, inv = _unique_inverse(phys, P)
    ucounts, ucap, ufirst = _per_core(np.searchsorted(uniq, cores * rpc), unique_policy, overflow,
                                      f"stacked table {stack_name!r} (unique ids)")
    upos_u = np.arange(uniq.shape[0]) - ufirst
    uslot_u = (uniq // rpc) * ucap + upos_u  # flat unique slot of each distinct row
    dropped_u = 0
    ukeep_u = None
    if ucounts.size and ucounts.max() > ucap:
        ukeep_u = upos_u < ucap
        ukeep = ukeep_u[inv]
        dropped_u = int((~ukeep).sum())
        core, local, seg, gain, phys = core[ukeep], local[ukeep], seg[ukeep], gain[ukeep], phys[ukeep]
        inv = inv[ukeep]
        # holes: recompute each kept id's slot in its core
        pos = np.arange(core.shape[0]) - np.repeat(np.searchsorted(core, cores)[:-1], np.bincount(core, minlength=n))
    counts_kept = np.diff(np.searchsorted(core, cores))

    slot = core * cap + pos
    phys_f = np.repeat((cores[:-1] * rpc).astype(np.int32), cap)  # padding reads its core's row 0 with gain 0
    phys_f[slot] = phys
    seg_f = np.full(n * cap, S, np.int32)
    seg_f[slot] = seg
    gain_f = np.zeros(n * cap, np.float32)
    gain_f[slot] = gain
    uflat = np.full(n * cap, n * ucap, np.int32)
    uflat[slot] = uslot_u[inv]
    # padding unique slots point past the table, each at a distinct row (so scatters may assume
    # unique indices) and are dropped by them
    uphys = np.arange(P, P + n * ucap, dtype=np.int64).astype(np.int32)
    if ukeep_u is None:
        uphys[uslot_u] = uniq
    else:
        uphys[uslot_u[ukeep_u]] = uniq[ukeep_u]
    return CoreBuffers(n, rpc, cap, ucap, S, phys_f, seg_f, gain_f, uflat, uphys, counts_kept,
                       np.minimum(ucounts, ucap), dropped, dropped_u)
