"""SparseCore-style embedding collections on tpu: lookup and fused-optimizer update in JAX.

:class:`SparseCoreEmbeddingBagCollection` (pooled, like TorchRec's
``EmbeddingBagCollection``: KJT in, ``KeyedTensor`` out) and
:class:`SparseCoreEmbeddingCollection` (sequence, like ``EmbeddingCollection``:
KJT in, ``dict`` of ``JaggedTensor`` out).

Each stacked table (:mod:`torchtpu_rec.tables`) is one tpu ``nn.Parameter`` of
shape ``(num_cores * rows_per_core, dim)`` in the MOD-sharded layout. A batch is
preprocessed on the host into fixed-size per-core buffers
(:mod:`torchtpu_rec.preprocess`); the forward is ONE jitted JAX function for the
whole collection (gather + weighted segment-sum per stack, then the output
layout). As in fbgemm's fused TBE and on SparseCore, there is no table gradient:
the backward is ONE jitted JAX function that sums the gradients of duplicate ids
per row, applies the optimizer (SGD, Adagrad, row-wise Adagrad, Adam) to the
rows in the batch and scatters them back; the new table (and optimizer state)
replaces the buffer of the same tpu storage, donating the old buffer, so the
parameter tensor, its views and ``.detach()`` s all see the update. The
parameters have ``requires_grad=True`` only so that the backward runs; their
``.grad`` stays None, so a dense optimizer over ``model.parameters()`` skips them.

Note: a ``jax.Array`` taken with ``torchtpu.to_jax(weight)`` before an update is
donated by it (reading it raises "Array has been deleted"): take it again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

import torchtpu
from torchtpu import metrics
from torchtpu.bucketing import BucketPolicy

from .preprocess import OVERFLOW_MODES, FeatureSlot, PreprocessedBatch, RecCounters, default_policy, preprocess
from .tables import OptimizerSpec, TableSpec, stack_tables
from .tables import num_sparsecores as _num_sparsecores

__all__ = ["GroupKernel", "KernelTables", "SparseCoreEmbeddingBagCollection", "SparseCoreEmbeddingCollection",
           "StackLayout"]


# ---------------------------------------------------------------- the kernel (JAX)
# ONE lookup/update kernel serves the SparseCore collections below and TorchRec's grouped lookups
# (torchtpu_rec.sharding.kernel). Its unit is a *group*: a few table buffers (1-D views of tpu
# storages) holding *stacks* (same-width runs of tables, rows ``[base, base + rows * dim)`` of
# one buffer). A SparseCore collection has one buffer per stack (MOD-sharded rows); a TorchRec
# group has one flat buffer in fbgemm's layout, with a stack per run of same-width tables.
# Per stack and batch the inputs are preprocess.py's per-core buffers (physical row, segment and
# gain per id; unique slot per id; physical row per unique slot).

# Gathering 32-bit rows as 64-bit elements halves XLA CPU's per-element gather cost, but the
# bitcast of the table costs a copy of it: worth it only while the table is small (measured: 2x
# faster at 10 MB, slower at 200 MB).
_WIDE_GATHER_MAX_BYTES = 32 << 20
# The fused update takes the rows the training lookup read (one table read per batch instead of two) while
# those rows fit well in cache; past that, reading them again inside the update, where XLA fuses the gather
# into the optimizer's arithmetic, is cheaper than keeping them (measured on XLA CPU, 32 MB L3: a lookup +
# update step 20% faster with 2 MB of rows, 20% slower with 56 MB).
_KEEP_ROWS_MAX_BYTES = 16 << 20
_G = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS  # XLA's own semantics: gathers clamp, scatters drop


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """Where one stack lives: elements ``[base, base + rows * dim)`` of table buffer ``buffer``,
    row-major; ``optimizer``: its fused optimizer."""

    buffer: int
    base: int
    rows: int
    dim: int
    optimizer: OptimizerSpec


def _wide_ok(table):
    return (table.dtype == jnp.float32 and table.shape[-1] % 2 == 0
            and table.size * 4 <= _WIDE_GATHER_MAX_BYTES and jax.default_backend() == "cpu")


def _gather_rows(table, idx, wide=True):
    """``table[idx]`` (rows of a 2-D table; indices clamp into bounds)."""
    n, D = table.shape
    if wide and _wide_ok(table):
        u = jax.lax.bitcast_convert_type(table.reshape(n, D // 2, 2), jnp.uint64)
        return jax.lax.bitcast_convert_type(u.at[idx].get(mode=_G), jnp.float32).reshape(idx.shape[0], D)
    return table.at[idx].get(mode=_G)


def _windows(buf, start, d):
    """Rows ``buf[start[i] : start[i] + d]`` of 1-D ``buf`` (starts clamp into bounds)."""
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,))
    return jax.lax.gather(buf, start[:, None], dn, slice_sizes=(d,), mode=_G)


def _row_index(st: StackLayout, rows, nrows, unit):
    """Index of each physical row of stack ``st`` in a buffer of ``nrows`` units of ``unit``
    elements (a row is ``dim // unit`` units); rows past the stack (unique-slot padding) map past
    the buffer's end, each to its own index, so a scatter drops them and never touches another stack."""
    dt = jnp.int64 if nrows + rows.shape[0] + st.base + st.rows * st.dim >= 2 ** 31 else jnp.int32
    r = rows.astype(dt)
    return jnp.where(r < st.rows, st.base // unit + r * (st.dim // unit), nrows + (r - st.rows))


def _as_rows(st: StackLayout, buf):
    """The 1-D buffer as a (rows, dim) table when the stack's rows tile it, else None."""
    if st.base % st.dim == 0 and buf.size % st.dim == 0:
        return buf.reshape(-1, st.dim)
    return None


def _stack_gather(buf, st: StackLayout, rows, wide=True):
    """Rows ``rows`` of stack ``st`` (past the stack: clamped reads) from 1-D ``buf``: (k, dim)."""
    table = _as_rows(st, buf)
    if table is not None:
        return _gather_rows(table, _row_index(st, rows, table.shape[0], st.dim), wide)
    return _windows(buf, _row_index(st, rows, buf.size, 1), st.dim)


def _stack_set(buf, st: StackLayout, rows, values):
    """``buf`` with rows ``rows`` of stack ``st`` set to ``values`` (rows past the stack dropped)."""
    values = values.astype(buf.dtype)
    table = _as_rows(st, buf)
    if table is not None:
        idx = _row_index(st, rows, table.shape[0], st.dim)
        return table.at[idx].set(values, mode="drop", unique_indices=True).reshape(-1)
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter(buf, _row_index(st, rows, buf.size, 1)[:, None], values, dn, unique_indices=True,
                           mode=_G)


def _opt_rows(opt: OptimizerSpec, w, g, st, lr, step):
    """fbgemm's exact optimizers on the gathered rows ``w`` with summed gradients ``g``."""
    if opt.kind != "adam" and opt.weight_decay:
        g = g + opt.weight_decay * w
    if opt.kind == "sgd":
        return w - lr * g, ()
    if opt.kind == "adagrad":
        m = st[0] + g * g
        return w - lr * g / (jnp.sqrt(m) + opt.eps), (m,)
    if opt.kind == "rowwise_adagrad":
        m = st[0] + jnp.mean(g * g, axis=1)
        return w - lr * g / (jnp.sqrt(m) + opt.eps)[:, None], (m,)
    b1, b2 = opt.beta1, opt.beta2
    m1 = b1 * st[0] + (1 - b1) * g
    m2 = b2 * st[1] + (1 - b2) * g * g
    t = step.astype(jnp.float32)
    m1h = m1 / (1 - b1 ** t)
    m2h = m2 / (1 - b2 ** t)
    upd = m1h / (jnp.sqrt(m2h) + opt.eps) + opt.weight_decay * w
    return w - lr * upd, (m1, m2)


class GroupKernel:
    """The jitted lookup / fused update / table gradient of one group (see the comment above).

    ``stacks``: :class:`StackLayout` s. ``pooled``: pooled (one output ``(B, sum of dims)``, key
    ``k`` from stack ``out_slots[k][0]``, slot ``out_slots[k][1]``) or sequence (one ``(S, dim)``
    output per stack). ``inputs`` of a batch: per stack ``(phys, seg, gain, uflat, uphys)``
    (:meth:`~torchtpu_rec.preprocess.CoreBuffers.kernel_arrays`); ``segs``: per stack its number
    of segments S; ``B``: the batch size.

    - ``lookup(bufs, inputs, segs, B)``: gather + weighted segment-sum (pooled) or gather (sequence);
    - ``update(bufs, states, inputs, grads, lrs, steps, segs, B)`` (donating ``bufs`` and ``states``)
      and ``update_copy`` (not donating): the backward fused with the optimizer: per stack the
      gradients of duplicate ids are summed per distinct row, the optimizer updates those rows and
      they are scattered back; returns the new buffers and states (same shapes);
    - ``grad(bufs, inputs, grads, segs, B)``: the dense gradient of each buffer (no optimizer).
    """

    def __init__(self, stacks: Sequence[StackLayout], pooled: bool, out_slots: Sequence = ()):
        self.stacks = tuple(stacks)
        self.pooled = bool(pooled)
        self.out_slots = tuple(tuple(s) for s in out_slots)
        cols: list = [dict() for _ in self.stacks]
        c = 0
        for s, slot in self.out_slots:
            cols[s][slot] = c
            c += self.stacks[s].dim
        self._cols = [tuple(d[k] for k in sorted(d)) for d in cols]
        self.lookup = jax.jit(functools.partial(self._lookup, save=False), static_argnums=(2, 3))
        self.lookup_saving = jax.jit(functools.partial(self._lookup, save=True), static_argnums=(2, 3))
        self.update = jax.jit(self._update, static_argnums=(6, 7), donate_argnums=(0, 1))
        self.update_copy = jax.jit(self._update, static_argnums=(6, 7))
        self.grad = jax.jit(self._grad, static_argnums=(3, 4))

    def state_shapes(self) -> list:
        """Per stack: optimizer state name -> shape."""
        return [st.optimizer.state_shapes(st.rows, st.dim) for st in self.stacks]

    # -- pieces
    def _lookup(self, bufs, inputs, segs, B, save):
        """Each distinct row is read from the table once (the batch's unique slots), then expanded to the ids
        from that small block; with ``save`` the block comes back too, for the fused update of the same
        batch (its rows need not be read from the table again)."""
        flat = [b.reshape(-1) for b in bufs]
        outs, blocks = [], []
        for st, ins, S in zip(self.stacks, inputs, segs):
            seg, gain, uflat, uphys = ins[1], ins[2], ins[3], ins[4]
            block = _stack_gather(flat[st.buffer], st, uphys).astype(jnp.float32)  # (U, dim)
            blocks.append(block)
            rows = block.at[uflat].get(mode="fill", fill_value=0)  # padding ids: past the block, 0
            if self.pooled:
                rows = rows * gain[:, None]
            # sequence: one id per segment (gain 1); padding goes to the dropped segment S
            outs.append(jax.ops.segment_sum(rows, seg, num_segments=S + 1, mode=_G)[:S])
        if self.pooled:
            pieces = [jax.lax.slice_in_dim(outs[s], slot * B, (slot + 1) * B, axis=0) for s, slot in self.out_slots]
            out = jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
        else:
            out = tuple(outs)
        return (out, tuple(blocks)) if save else out

    def _row_grads(self, i, ins, grads, S):
        """The gradient of stack ``i`` summed per unique slot: (U, dim)."""
        st = self.stacks[i]
        phys, seg, gain, uflat, uphys = ins
        D = st.dim
        if self.pooled and not self._cols[i]:  # a stack no feature reads
            gseg = jnp.zeros((S, D), jnp.float32)
        elif self.pooled:
            g = grads[0]
            gseg = jnp.concatenate([jax.lax.slice_in_dim(g, c, c + D, axis=1) for c in self._cols[i]], axis=0)
        else:
            gseg = grads[i]
        gseg = jnp.concatenate([gseg.astype(jnp.float32), jnp.zeros((1, D), jnp.float32)], axis=0)
        gid = gseg.at[seg].get(mode=_G)  # plain gather: fuses with the gain multiply (no u64 intermediate)
        gid = gid * gain[:, None]
        nu = uphys.shape[0]
        return jax.ops.segment_sum(gid, uflat, num_segments=nu + 1, mode=_G)[:nu]

    def _update(self, bufs, states, inputs, grads, lrs, steps, segs, B, blocks=None):
        """``blocks``: the rows of the batch's unique slots as the lookup read them (``lookup_saving``), when
        the tables have not changed since; else they are read again."""
        shapes = [b.shape for b in bufs]
        flat = [b.reshape(-1) for b in bufs]
        new_s = []
        for i, (st, sts, ins, S) in enumerate(zip(self.stacks, states, inputs, segs)):
            G = self._row_grads(i, ins, grads, S)
            uphys = ins[4]
            buf = flat[st.buffer]
            if blocks is not None:
                w = blocks[i]
            else:  # padding: clamped reads, dropped below; a plain gather fuses into the optimizer's arithmetic
                w = _stack_gather(buf, st, uphys, wide=False).astype(jnp.float32)
            srows = tuple(s.at[uphys].get(mode="fill", fill_value=0, unique_indices=True) for s in sts)
            w2, s2 = _opt_rows(st.optimizer, w, G, srows, lrs[i], steps[i])
            flat[st.buffer] = _stack_set(buf, st, uphys, w2)
            new_s.append(tuple(s.at[uphys].set(v.astype(s.dtype), mode="drop", unique_indices=True)
                               for s, v in zip(sts, s2)))
        return tuple(f.reshape(sh) for f, sh in zip(flat, shapes)), tuple(new_s)

    def _grad(self, bufs, inputs, grads, segs, B):
        flat = [jnp.zeros((b.size,), b.dtype) for b in bufs]
        for i, (st, ins, S) in enumerate(zip(self.stacks, inputs, segs)):
            G = self._row_grads(i, ins, grads, S)
            f = flat[st.buffer]
            flat[st.buffer] = _stack_set(f, st, ins[4], G)
        return tuple(f.reshape(b.shape) for f, b in zip(flat, bufs))


# ---------------------------------------------------------------- the kernel (torch side)
class KernelTables:
    """A :class:`GroupKernel` bound to tpu tensors: ``params()`` gives the table tensors (one per
    buffer, each owning its whole storage), ``states()`` per stack the optimizer-state tensors.

    ``run(batch)`` is the autograd-aware lookup. With ``fused`` its backward applies the update to
    the tables in place (the new buffers replace the storages' buffers, donating the old ones when
    this object made them), and hands no gradient to autograd; otherwise the backward returns the
    tables' dense gradients. ``lrs`` (per stack; :attr:`lr` sets all) and ``steps`` are host
    values, so changing them does not recompile.
    """

    def __init__(self, kernel: GroupKernel, params: Callable[[], list], states: Callable[[], list],
                 fused: bool = True, donate: bool = True):
        self.kernel = kernel
        self.params = params
        self.states = states
        self.fused = fused
        self.donate = donate
        self.lrs = [st.optimizer.lr for st in kernel.stacks]
        # per stack, on the host: optimizer state dicts hold views of it (loading one sets the count)
        self.steps = torch.zeros(len(kernel.stacks), dtype=torch.int64)
        self._owned: list = []
        self.mark_owned()

    @property
    def lr(self) -> float:
        return self.lrs[0] if self.lrs else 0.0

    @lr.setter
    def lr(self, value: float) -> None:
        self.lrs = [float(value)] * len(self.lrs)

    def mark_owned(self):
        """Record the current buffers as this object's own (loaded or made here: safe to donate)."""
        self._owned = [torchtpu.to_jax(p) for p in self.params()]

    @staticmethod
    def device_inputs(batch: PreprocessedBatch):
        """The batch's kernel inputs for the executables. On an accelerator they are uploaded once (lookup
        and update share them); on XLA's CPU backend the numpy arrays go to the executables as they are
        (jit's C++ path takes host arrays for less than ``jax.device_put`` costs in Python: ~1 ms of a
        ~5 ms lookup + update at the quick size)."""
        if batch.device_inputs is None:
            if jax.default_backend() == "cpu":
                batch.device_inputs = tuple(tuple(a) for a in batch.kernel_inputs)
            else:
                batch.device_inputs = jax.device_put(tuple(batch.kernel_inputs))
        return batch.device_inputs

    @staticmethod
    def _segs(batch):
        return tuple(k[2] for k in batch.key[1:])

    def lookup(self, batch: PreprocessedBatch, keep_rows: bool = False):
        """The forward outputs as tpu tensors (no autograd). ``keep_rows``: keep the rows read for the fused
        update of this batch (:meth:`apply_update`) if they are small (``_KEEP_ROWS_MAX_BYTES``)."""
        bufs = tuple(torchtpu.to_jax(p) for p in self.params())
        if keep_rows:
            keep_rows = sum(ins[4].shape[0] * st.dim * 4 for ins, st in zip(batch.kernel_inputs, self.kernel.stacks)) \
                <= _KEEP_ROWS_MAX_BYTES
        with metrics.bucket_scope((("rec_batch", batch.key),)):
            if keep_rows:
                out, blocks = self.kernel.lookup_saving(bufs, self.device_inputs(batch), self._segs(batch),
                                                        batch.batch_size)
                batch.looked_up = (bufs, blocks)
            else:
                out = self.kernel.lookup(bufs, self.device_inputs(batch), self._segs(batch), batch.batch_size)
        if self.kernel.pooled:
            return torchtpu.from_jax(out)
        return tuple(torchtpu.from_jax(o) for o in out)

    def run(self, batch: PreprocessedBatch):
        params = self.params()
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return _KernelFunction.apply(self, batch, *params)
        return self.lookup(batch)

    def _checked_params(self):
        params = self.params()
        for p in params:
            if p.storage_offset() != 0 or not p.is_contiguous() or p.untyped_storage().nbytes() != p.nbytes:
                raise RuntimeError(f"torchtpu_rec: table parameter {tuple(p.shape)} no longer owns its whole "
                                   "storage; load weights through the module's loaders")
        return params

    def apply_update(self, batch: PreprocessedBatch, grads) -> None:
        """The fused backward: update tables and optimizer states in place."""
        torchtpu.sync()  # pending graphs may read the buffers about to be donated
        params = self._checked_params()
        bufs = tuple(torchtpu.to_jax(p) for p in params)
        st_t = self.states()
        states = tuple(tuple(torchtpu.to_jax(s) for s in ss) for ss in st_t)
        gj = tuple(torchtpu.to_jax(g) for g in grads)
        self.steps += 1
        # numpy arrays go to the executable directly (jnp.asarray would dispatch ops)
        lrs = np.asarray(self.lrs, np.float32)
        steps = self.steps.numpy().astype(np.int32)
        donate = self.donate and len(bufs) == len(self._owned) and all(a is b for a, b in zip(bufs, self._owned))
        fn = self.kernel.update if donate else self.kernel.update_copy
        # the rows the forward read, unless the tables changed since (another update, a load)
        looked_up, batch.looked_up = batch.looked_up, None
        blocks = looked_up[1] if looked_up is not None and all(a is b for a, b in zip(looked_up[0], bufs)) else None
        with metrics.bucket_scope((("rec_batch", batch.key),)):
            new_t, new_s = fn(bufs, states, self.device_inputs(batch), gj, lrs, steps, self._segs(batch),
                              batch.batch_size, blocks)
        for p, b in zip(params, new_t):
            torchtpu.assign_jax(p, b)
        for ss, bs in zip(st_t, new_s):
            for s, b in zip(ss, bs):
                torchtpu.assign_jax(s, b)
        self._owned = list(new_t)
        for p in params:  # autograd sees an in-place change (a stale saved weight then errors, not lies)
            torch.autograd.graph.increment_version(p)

    def dense_grads(self, batch: PreprocessedBatch, grads) -> list:
        params = self.params()
        bufs = tuple(torchtpu.to_jax(p) for p in params)
        gj = tuple(torchtpu.to_jax(g) for g in grads)
        out = self.kernel.grad(bufs, self.device_inputs(batch), gj, self._segs(batch), batch.batch_size)
        return [torchtpu.from_jax(o.reshape(-1)).view(p.shape) for o, p in zip(out, params)]


class _KernelFunction(torch.autograd.Function):
    """Forward: the group's lookup. Backward: the fused update in place (no gradients out), or the
    dense table gradients."""

    @staticmethod
    def forward(ctx, tables, batch, *weights):
        ctx.tables, ctx.batch = tables, batch
        return tables.lookup(batch, keep_rows=tables.fused)

    @staticmethod
    def backward(ctx, *grads):
        tables = ctx.tables
        grads = tuple(g.contiguous() for g in grads)
        if tables.fused:
            tables.apply_update(ctx.batch, grads)
            return (None, None) + (None,) * len(tables.params())
        return (None, None) + tuple(tables.dense_grads(ctx.batch, grads))


# ---------------------------------------------------------------- modules
def _as_specs(tables, pooled_module):
    specs = []
    for t in tables:
        if not isinstance(t, TableSpec):
            t = TableSpec.from_torchrec(t)
        if t.pooled != pooled_module:
            what = "EmbeddingBagCollection needs pooled tables (sum/mean)" if pooled_module else \
                "EmbeddingCollection needs sequence tables (pooling 'none')"
            raise ValueError(f"table {t.name!r}: SparseCore{what}, got pooling {t.pooling!r}")
        specs.append(t)
    if not specs:
        raise ValueError("a SparseCore collection needs at least one table")
    return specs


class _SparseCoreCollection(nn.Module):
    _pooled = True

    def __init__(self, tables: Sequence, is_weighted: bool = False, device=None, *, optimizer=None,
                 optimizer_kwargs: Optional[dict] = None, num_sparsecores: Optional[int] = None,
                 stack: bool = True, ids_policy: Optional[BucketPolicy] = None,
                 unique_policy: Optional[BucketPolicy] = None, overflow: str = "error", check_ids: bool = True,
                 donate: bool = True, init_weights: bool = True):
        super().__init__()
        if device is not None and torch.device(device).type != "tpu":
            raise ValueError(f"SparseCore collections live on tpu, not {device}")
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, not {overflow!r}")
        self._specs = _as_specs(tables, self._pooled)
        self._is_weighted = bool(is_weighted)
        self._optimizer = OptimizerSpec.of(optimizer, **(optimizer_kwargs or {}))
        n = num_sparsecores if num_sparsecores is not None else _num_sparsecores()
        if isinstance(n, str):
            n = _num_sparsecores(n)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_sparsecores must be a positive integer or a TPU generation, not {n!r}")
        self.num_sparsecores = n
        self._stacks: list = stack_tables(self._specs, self.num_sparsecores, self._optimizer, stack)
        self.ids_policy = ids_policy or default_policy("rec_ids")
        self.unique_policy = unique_policy or self.ids_policy
        self.overflow = overflow
        self.check_ids = check_ids
        self.donate = donate
        self.counters = RecCounters()

        # feature -> slot; output keys in TorchRec's order (tables in order, then their features)
        self._slots: dict = {}
        self._keys: list = []
        self._lengths_per_key: list = []
        slot_count = [0] * len(self._stacks)
        table_stack = {t.name: (si, st) for si, st in enumerate(self._stacks) for t in st.tables}
        for t in self._specs:
            si, st = table_stack[t.name]
            for f in t.feature_names:
                if f in self._slots:
                    raise ValueError(f"feature {f!r} is looked up by two tables ({self._slots[f].table!r}, "
                                     f"{t.name!r}); TorchRec needs distinct feature names")
                self._slots[f] = FeatureSlot(f, si, t.name, st.offset_of(t.name), slot_count[si],
                                             t.num_embeddings, t.pooling == "mean")
                slot_count[si] += 1
                self._keys.append(f)
                self._lengths_per_key.append(t.embedding_dim)
        # pooled output: (stack, slot) per key
        self._layout = [(self._slots[f].stack, self._slots[f].slot) for f in self._keys]

        self.weights = nn.ParameterDict()
        self._state_names: list = []
        for st in self._stacks:
            w = np.zeros((st.physical_rows, st.dim), np.float32)
            if init_weights:
                for t in st.tables:
                    lo, hi = t.init_bounds()
                    w[st.physical_rows_of(t.name)] = torch.empty(t.num_embeddings, st.dim).uniform_(lo, hi).numpy()
            p = nn.Parameter(torchtpu.from_jax(jnp.asarray(w, dtype=_jdtype(st.dtype))), requires_grad=True)
            self.weights[st.name] = p
            names = []
            for sname, shape in st.optimizer.state_shapes(st.physical_rows, st.dim).items():
                bname = f"{st.name}__{sname}"
                self.register_buffer(bname, torchtpu.from_jax(jnp.zeros(shape, jnp.float32)), persistent=False)
                names.append(bname)
            self._state_names.append(names)
        # one buffer per stack (its MOD-sharded rows)
        kernel = GroupKernel([StackLayout(i, 0, st.physical_rows, st.dim, st.optimizer)
                              for i, st in enumerate(self._stacks)], self._pooled, self._layout)
        self._kernel = KernelTables(kernel, self._params, lambda: [self._states(i) for i in range(len(self._stacks))],
                                    fused=True, donate=donate)

    # ------------------------------------------------------------ introspection
    @property
    def stacks(self) -> list:
        """The :class:`~torchtpu_rec.tables.StackedTable` s (one parameter each, same order)."""
        return list(self._stacks)

    @property
    def tables(self) -> list:
        return list(self._specs)

    @property
    def feature_names(self) -> list:
        return list(self._keys)

    @property
    def kernel(self) -> KernelTables:
        """The lookup/update kernel of the collection (:class:`KernelTables`)."""
        return self._kernel

    def embedding_bag_configs(self):
        return list(self._specs)

    def _params(self):
        return [self.weights[st.name] for st in self._stacks]

    def _states(self, i):
        return [getattr(self, n) for n in self._state_names[i]]

    # ------------------------------------------------------------ forward
    def preprocess(self, features) -> PreprocessedBatch:
        """Host preprocessing of a KeyedJaggedTensor into per-core buffers (done by forward too)."""
        return preprocess(features, self._stacks, self._slots, is_weighted=self._is_weighted, pooled=self._pooled,
                          ids_policy=self.ids_policy, unique_policy=self.unique_policy, overflow=self.overflow,
                          counters=self.counters, check_ids=self.check_ids)

    def _run(self, features):
        batch = self.preprocess(features)
        return batch, self._kernel.run(batch)

    # ------------------------------------------------------------ optimizer knobs
    def set_learning_rate(self, lr: float, table: Optional[str] = None) -> None:
        """Learning rate of every stack, or of the stack holding ``table`` (no recompile)."""
        lr = float(lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"learning rate must be a finite number >= 0, not {lr}")
        for i, st in enumerate(self._stacks):
            if table is None or any(t.name == table for t in st.tables):
                self._kernel.lrs[i] = lr
        if table is not None and not any(t.name == table for t in self._specs):
            raise KeyError(f"no table {table!r}")

    def learning_rates(self) -> dict:
        return {st.name: lr for st, lr in zip(self._stacks, self._kernel.lrs)}

    # ------------------------------------------------------------ weights / states on the host
    def _locate(self, name):
        for i, st in enumerate(self._stacks):
            for t in st.tables:
                if t.name == name:
                    return i, st, t
        raise KeyError(f"no table {name!r} in this collection (tables: {[t.name for t in self._specs]})")

    def table_weights(self) -> dict:
        """table name -> its weight (num_embeddings, dim) as a CPU tensor, rows in id order."""
        out = {}
        host = {}
        for t in self._specs:
            i, st, _ = self._locate(t.name)
            if i not in host:
                host[i] = np.asarray(jax.device_get(torchtpu.to_jax(self._params()[i]))).astype(np.float32)
            out[t.name] = torch.from_numpy(host[i][st.physical_rows_of(t.name)].copy()).to(t.dtype)
        return out

    def load_table_weights(self, weights: dict) -> None:
        """Set tables from ``{name: (num_embeddings, dim) tensor}`` (any device; rows in id order)."""
        per_stack: dict = {}
        for name, w in weights.items():
            i, st, t = self._locate(name)
            w = torch.as_tensor(w).detach()
            if tuple(w.shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(f"table {name!r}: weight shape {tuple(w.shape)} != "
                                 f"{(t.num_embeddings, t.embedding_dim)}")
            per_stack.setdefault(i, []).append((st, t, w.cpu().float().numpy()))
        for i, items in per_stack.items():
            p = self._params()[i]
            cur = np.array(jax.device_get(torchtpu.to_jax(p)), dtype=np.float32)
            for st, t, w in items:
                cur[st.physical_rows_of(t.name)] = w
            torchtpu.assign_jax(p, jnp.asarray(cur, dtype=_jdtype(self._stacks[i].dtype)))
        self._kernel.mark_owned()

    def optimizer_states(self) -> dict:
        """table name -> {state name: CPU tensor} (rows in id order; per-row states are 1-D), plus
        the step count under ``"step"``."""
        out = {}
        for t in self._specs:
            i, st, _ = self._locate(t.name)
            rows = st.physical_rows_of(t.name)
            d = {}
            for bname, s in zip(self._state_names[i], self._states(i)):
                arr = np.asarray(jax.device_get(torchtpu.to_jax(s)))
                d[bname.split("__", 1)[1]] = torch.from_numpy(arr[rows].copy())
            d["step"] = self._kernel.steps[i].clone()
            out[t.name] = d
        return out

    def load_optimizer_states(self, states: dict) -> None:
        """Inverse of :meth:`optimizer_states` (tables not named keep their state)."""
        for name, d in states.items():
            i, st, t = self._locate(name)
            rows = st.physical_rows_of(name)
            for bname, s in zip(self._state_names[i], self._states(i)):
                key = bname.split("__", 1)[1]
                if key not in d:
                    raise KeyError(f"table {name!r}: optimizer state {key!r} missing")
                v = torch.as_tensor(d[key]).detach().cpu().float().numpy()
                cur = np.array(jax.device_get(torchtpu.to_jax(s)), dtype=np.float32)
                if v.shape != cur[rows].shape:
                    raise ValueError(f"table {name!r}: state {key!r} shape {v.shape} != {cur[rows].shape}")
                cur[rows] = v
                torchtpu.assign_jax(s, jnp.asarray(cur))
            if "step" in d:
                self._kernel.steps[i] = int(d["step"])

    # TorchRec-style checkpoint keys ("embedding_bags.<table>.weight" / "embeddings.<table>.weight")
    def torchrec_state_dict(self) -> dict:
        prefix = "embedding_bags" if self._pooled else "embeddings"
        return {f"{prefix}.{k}.weight": v for k, v in self.table_weights().items()}

    def load_torchrec_state_dict(self, sd: dict) -> None:
        prefix = "embedding_bags." if self._pooled else "embeddings."
        w = {}
        for k, v in sd.items():
            if k.startswith(prefix) and k.endswith(".weight"):
                w[k[len(prefix):-len(".weight")]] = v
        missing = {t.name for t in self._specs} - set(w)
        if missing:
            raise KeyError(f"state_dict lacks tables {sorted(missing)}")
        self.load_table_weights(w)

    @classmethod
    def from_torchrec(cls, module, **kwargs):
        """A SparseCore collection with the tables and weights of a TorchRec EmbeddingBagCollection /
        EmbeddingCollection (``kwargs``: optimizer, optimizer_kwargs, num_sparsecores, ...)."""
        if cls._pooled:
            configs = module.embedding_bag_configs()
            weighted = getattr(module, "_is_weighted", False)
            kwargs.setdefault("is_weighted", weighted)
            mods = module.embedding_bags
        else:
            configs = module.embedding_configs()
            mods = module.embeddings
        new = cls(configs, **kwargs)
        new.load_table_weights({c.name: mods[c.name].weight for c in configs})
        return new

    def extra_repr(self) -> str:
        return (f"tables={[t.name for t in self._specs]}, stacks={len(self._stacks)}, "
                f"num_sparsecores={self.num_sparsecores}, overflow={self.overflow!r}")


def _jdtype(dtype):
    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[dtype]


class SparseCoreEmbeddingBagCollection(_SparseCoreCollection):
    """Pooled embedding tables on tpu, shaped like TorchRec's ``EmbeddingBagCollection``.

    ``tables``: TorchRec ``EmbeddingBagConfig`` s or :class:`~torchtpu_rec.tables.TableSpec` s.
    ``forward(kjt)`` returns a ``KeyedTensor`` (batch, sum of dims) on tpu, keys in TorchRec's order.
    ``optimizer`` / ``optimizer_kwargs``: the fused optimizer of tables that name none
    (``torch.optim.Adagrad, {"lr": 0.1}``, ``"rowwise_adagrad"``, an fbgemm ``EmbOptimType``, or an
    :class:`~torchtpu_rec.tables.OptimizerSpec`). ``num_sparsecores``: cores per chip (int or a
    generation "v5p"/"v6e"/"v7"; default: see :func:`~torchtpu_rec.tables.num_sparsecores`).
    ``stack``: stack same-width tables. ``ids_policy`` / ``unique_policy``: capacities of ids and
    unique ids per core; ``overflow``: "error" or "drop" (counted in ``self.counters``).
    """

    _pooled = True

    def forward(self, features):
        from torchrec.sparse.jagged_tensor import KeyedTensor

        _, out = self._run(features)
        return KeyedTensor(keys=list(self._keys), length_per_key=list(self._lengths_per_key), values=out)


class SparseCoreEmbeddingCollection(_SparseCoreCollection):
    """Sequence embedding tables on tpu, shaped like TorchRec's ``EmbeddingCollection``:
    ``forward(kjt)`` returns ``{feature: JaggedTensor}`` whose values (ids, dim) are on tpu (views of
    one buffer per stack) and whose lengths are the input's (host) lengths."""

    _pooled = False

    def __init__(self, tables: Sequence, device=None, **kwargs):
        kwargs.pop("is_weighted", None)
        super().__init__(tables, False, device, **kwargs)

    def embedding_configs(self):
        return list(self._specs)

    def forward(self, features):
        from torchrec.sparse.jagged_tensor import JaggedTensor

        batch, outs = self._run(features)
        res = {}
        for f in self._keys:
            si, start, count, lens = batch.sequence_layout[f]
            res[f] = JaggedTensor(values=outs[si].narrow(0, start, count), lengths=torch.from_numpy(lens.copy()))
        return res
