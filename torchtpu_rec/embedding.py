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

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

import torchtpu
from torchtpu import lazy as _lazy
from torchtpu import metrics
from torchtpu.bucketing import BucketPolicy
from torchtpu.storage import storage_data

from .preprocess import OVERFLOW_MODES, FeatureSlot, PreprocessedBatch, RecCounters, default_policy, preprocess
from .tables import OptimizerSpec, TableSpec, stack_tables
from .tables import num_sparsecores as _num_sparsecores

__all__ = ["SparseCoreEmbeddingBagCollection", "SparseCoreEmbeddingCollection"]


# ---------------------------------------------------------------- JAX kernels
# Gathering 32-bit rows as 64-bit elements halves XLA CPU's per-element gather cost, but the
# bitcast of the table costs a copy of it: worth it only while the table is small (measured: 2x
# faster at 10 MB, slower at 200 MB).
_WIDE_GATHER_MAX_BYTES = 32 << 20


def _gather_rows(table, idx, mode="promise_in_bounds"):
    """``table[idx]`` (rows), indices in bounds (or, with ``mode="fill"``, out of bounds reading 0)."""
    P, D = table.shape
    kw = {"fill_value": 0} if mode == "fill" else {}
    if (table.dtype == jnp.float32 and D % 2 == 0 and P * D * 4 <= _WIDE_GATHER_MAX_BYTES
            and jax.default_backend() == "cpu"):
        u = jax.lax.bitcast_convert_type(table.reshape(P, D // 2, 2), jnp.uint64)
        r = u.at[idx].get(mode=mode, **kw)
        return jax.lax.bitcast_convert_type(r, jnp.float32).reshape(idx.shape[0], D)
    return table.at[idx].get(mode=mode, **kw)


def _lookup_stack(table, phys, seg, gain, S):
    """Gather + weighted segment-sum of one stack: (S, dim) float32."""
    rows = _gather_rows(table, phys).astype(jnp.float32)
    return jax.ops.segment_sum(rows * gain[:, None], seg, num_segments=S + 1)[:S]


def _forward_fn(layout, pooled):
    """The jitted forward of a collection. ``layout``: for pooled outputs, per output key
    (stack, slot); the segments of stack s are slot * B + sample."""

    def fwd(tables, kins, segs, B):
        outs = [_lookup_stack(t, k[0], k[1], k[2], S) for t, k, S in zip(tables, kins, segs)]
        if not pooled:
            return tuple(outs)
        pieces = [_slot_rows(outs[s], slot, B) for s, slot in layout]
        return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]

    return jax.jit(fwd, static_argnums=(2, 3))


def _slot_rows(out, slot, B):
    return jax.lax.slice_in_dim(out, slot * B, (slot + 1) * B, axis=0)


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


def _update_fn(opts, layout_per_stack, pooled):
    """The jitted fused backward + optimizer of a collection.

    ``layout_per_stack[s]``: for pooled outputs, the output column of each slot of stack s."""

    def upd(tables, states, kins, grads, lrs, steps, segs, B):
        new_t, new_s = [], []
        for i, (t, st, k, S) in enumerate(zip(tables, states, kins, segs)):
            phys, seg, gain, uflat, uphys = k
            D = t.shape[1]
            if pooled:
                cols = layout_per_stack[i]
                g = grads[0]
                gseg = jnp.concatenate([jax.lax.slice_in_dim(g, c, c + D, axis=1) for c in cols], axis=0)
            else:
                gseg = grads[i]
            gseg = jnp.concatenate([gseg.astype(jnp.float32), jnp.zeros((1, D), jnp.float32)], axis=0)
            gid = _gather_rows(gseg, seg) * gain[:, None]
            nu = uphys.shape[0]
            G = jax.ops.segment_sum(gid, uflat, num_segments=nu + 1)[:nu]
            # uphys: distinct rows, padding past the end (read as 0, dropped on write)
            w = _gather_rows(t, uphys, mode="fill").astype(jnp.float32)
            srows = tuple(s.at[uphys].get(mode="fill", fill_value=0, unique_indices=True) for s in st)
            w2, s2 = _opt_rows(opts[i], w, G, srows, lrs[i], steps[i])
            new_t.append(t.at[uphys].set(w2.astype(t.dtype), mode="drop", unique_indices=True))
            new_s.append(tuple(s.at[uphys].set(v.astype(s.dtype), mode="drop", unique_indices=True)
                               for s, v in zip(st, s2)))
        return tuple(new_t), tuple(new_s)

    return (jax.jit(upd, static_argnums=(6, 7), donate_argnums=(0, 1)),
            jax.jit(upd, static_argnums=(6, 7)))


# ---------------------------------------------------------------- autograd
class _LookupFunction(torch.autograd.Function):
    """Forward: the collection's lookup. Backward: the fused update, in place; no gradients out."""

    @staticmethod
    def forward(ctx, module, batch, *weights):
        ctx.module, ctx.batch = module, batch
        return module._lookup(batch)

    @staticmethod
    def backward(ctx, *grads):
        ctx.module._apply_update(ctx.batch, grads)
        return (None, None) + (None,) * len(ctx.module._stacks)


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
        # pooled output: (stack, slot) per key; per stack the output column of each of its slots
        col, self._layout = 0, []
        self._cols: list = [[0] * c for c in slot_count]
        for f, d in zip(self._keys, self._lengths_per_key):
            s = self._slots[f]
            self._layout.append((s.stack, s.slot))
            self._cols[s.stack][s.slot] = col
            col += d

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
        self._lrs = [st.optimizer.lr for st in self._stacks]
        self._steps = [0] * len(self._stacks)
        self._owned = [None] * len(self._stacks)  # buffers this module made (safe to donate)
        self._fwd = _forward_fn(tuple(self._layout), self._pooled)
        self._upd_donate, self._upd_copy = _update_fn(tuple(st.optimizer for st in self._stacks),
                                                      tuple(tuple(c) for c in self._cols), self._pooled)
        self._mark_owned()

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

    def embedding_bag_configs(self):
        return list(self._specs)

    def _params(self):
        return [self.weights[st.name] for st in self._stacks]

    def _states(self, i):
        return [getattr(self, n) for n in self._state_names[i]]

    def _mark_owned(self):
        self._owned = [storage_data(p).buf for p in self._params()]

    # ------------------------------------------------------------ forward
    def preprocess(self, features) -> PreprocessedBatch:
        """Host preprocessing of a KeyedJaggedTensor into per-core buffers (done by forward too)."""
        return preprocess(features, self._stacks, self._slots, is_weighted=self._is_weighted, pooled=self._pooled,
                          ids_policy=self.ids_policy, unique_policy=self.unique_policy, overflow=self.overflow,
                          counters=self.counters, check_ids=self.check_ids)

    def _lookup(self, batch: PreprocessedBatch):
        tables = tuple(torchtpu.to_jax(p) for p in self._params())
        segs = tuple(k[2] for k in batch.key[1:])
        with metrics.bucket_scope((("rec_batch", batch.key),)):
            out = self._fwd(tables, tuple(batch.kernel_inputs), segs, batch.batch_size)
        if self._pooled:
            return torchtpu.from_jax(out)
        return tuple(torchtpu.from_jax(o) for o in out)

    def _run(self, features):
        batch = self.preprocess(features)
        params = self._params()
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            out = _LookupFunction.apply(self, batch, *params)
        else:
            out = self._lookup(batch)
        return batch, out

    # ------------------------------------------------------------ fused update
    def _apply_update(self, batch: PreprocessedBatch, grads):
        if _lazy.pending_count():
            _lazy.flush("sparsecore_update")  # pending graphs may read the buffers about to be donated
        params = self._params()
        sds = [storage_data(p) for p in params]
        for p, sd in zip(params, sds):
            if p.storage_offset() != 0 or not p.is_contiguous() or sd.buf.size != p.numel():
                raise RuntimeError(f"torchtpu_rec: table parameter {tuple(p.shape)} no longer owns its whole "
                                   "storage; load weights with load_table_weights()")
        tables = tuple(_shaped(sd.buf, p.shape) for sd, p in zip(sds, params))
        state_sds = [[storage_data(s) for s in self._states(i)] for i in range(len(self._stacks))]
        states = tuple(tuple(_shaped(sd.buf, s.shape) for sd, s in zip(ssd, self._states(i)))
                       for i, ssd in enumerate(state_sds))
        gj = tuple(torchtpu.to_jax(g) for g in grads)
        for i in range(len(self._steps)):
            self._steps[i] += 1
        # numpy scalars-arrays go to the executable directly (jnp.asarray would dispatch ops)
        lrs = np.asarray(self._lrs, np.float32)
        steps = np.asarray(self._steps, np.int32)
        segs = tuple(k[2] for k in batch.key[1:])
        donate = self.donate and all(a is b for a, b in zip(tables, self._owned))
        fn = self._upd_donate if donate else self._upd_copy
        with metrics.bucket_scope((("rec_batch", batch.key),)):
            new_t, new_s = fn(tables, states, tuple(batch.kernel_inputs), gj, lrs, steps, segs, batch.batch_size)
        for sd, b in zip(sds, new_t):
            sd.buf = b
        for ssd, bs in zip(state_sds, new_s):
            for sd, b in zip(ssd, bs):
                sd.buf = b
        self._owned = list(new_t)
        for p in params:  # autograd sees an in-place change (a stale saved weight then errors, not lies)
            torch.autograd.graph.increment_version(p)

    # ------------------------------------------------------------ optimizer knobs
    def set_learning_rate(self, lr: float, table: Optional[str] = None) -> None:
        """Learning rate of every stack, or of the stack holding ``table`` (no recompile)."""
        lr = float(lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"learning rate must be a finite number >= 0, not {lr}")
        for i, st in enumerate(self._stacks):
            if table is None or any(t.name == table for t in st.tables):
                self._lrs[i] = lr
        if table is not None and not any(t.name == table for t in self._specs):
            raise KeyError(f"no table {table!r}")

    def learning_rates(self) -> dict:
        return {st.name: lr for st, lr in zip(self._stacks, self._lrs)}

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
            storage_data(p).buf = jnp.asarray(cur, dtype=_jdtype(self._stacks[i].dtype))
        self._mark_owned()

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
            d["step"] = torch.tensor(self._steps[i])
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
                storage_data(s).buf = jnp.asarray(cur)
            if "step" in d:
                self._steps[i] = int(d["step"])

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


def _shaped(buf, shape):
    shape = tuple(shape)
    return buf if tuple(buf.shape) == shape else buf.reshape(shape)


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
