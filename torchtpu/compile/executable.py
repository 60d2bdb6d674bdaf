"""A compiled graph's executable: one FX graph of aten ops as one jitted JAX function.

Runtime: an executable is called with a flat list of arrays. Input mutations
(optimizer steps, buffer updates) stay inside the graph
(``keep_inference_input_mutations``): the executable returns the new values,
each input's old buffer is donated, and the write-back is one storage swap per
input rather than an eager ``copy_`` per tensor.

Dynamic shapes: each size symbol is rounded up to a bucket of a
:class:`torchtpu.bucketing.BucketPolicy`, inputs are padded, outputs sliced
back, and one executable serves a whole bucket, where ``padding.py`` proves
the real part of every output unchanged; any other dynamic graph compiles per
size with one ``RecompileWarning`` saying why.

A graph containing an op with no lowering runs eagerly through its FX
GraphModule on tpu tensors (eager kernels and the CPU fallback handle it), with
one warning naming the op(s); with CPU fallback off it raises instead.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch._guards
from torch.utils import _pytree as pytree

from ..base import dtypes, metrics, tracing
from ..base.memory import is_resource_exhausted, out_of_memory_from
from ..base.opnames import qualified_name, short_name
from ..base.rng import next_key_data
from ..bucketing import BucketPolicy
from ..dispatch import fallback
from ..dispatch.lowering import LOWERINGS
from ..runtime import checks, storage
from ..runtime.modes import execution_mode
from ..runtime.recorder import RECORDER
from .nodes import (
    FUNCTIONAL,
    RUN_AND_SAVE_RNG,
    SYM_OPS,
    bind_args,
    fill_rng_meta,
    is_random,
    key_to_rng_state,
    node_kind,
    op_is_random,
    rng_state_to_key,
    rng_wrapped_op,
    run_out_dtype,
)
from .padding import pad_unsafe_reason
from .shapes import NotBucketable, eval_size, is_symbolic, size_expr, val_shape

aten = torch.ops.aten


class _Entry:
    """Executables of one graph at one set of static inputs (and one bucket)."""

    __slots__ = ("plain", "donating", "static_outs", "checks")

    def __init__(self):
        self.plain = self.donating = None
        self.static_outs = None
        self.checks = ()  # the graph's device-side index checks (runtime/checks.py), set when traced


@functools.lru_cache(maxsize=4096)
def _pad_jit(padded):
    def pad(x):
        return jnp.pad(x, [(0, p - s) for p, s in zip(padded, x.shape)])

    return jax.jit(pad)


@functools.lru_cache(maxsize=4096)
def _prefix_jit(real):
    return jax.jit(lambda x: x[tuple(slice(0, n) for n in real)])


def _arg_array(t):
    """(jax value of tensor argument ``t``, whether it is ``t``'s whole storage buffer)."""
    if t.device.type == "tpu":
        buf = storage.storage_data(t).buf
        if buf.shape == t.shape and t.is_contiguous() and t.storage_offset() == 0 and not (t.is_conj() or t.is_neg()):
            return buf, True
        return storage.logical_value(t), False
    return _input_value(t), False


class GraphProgram:
    """One FX graph as one jitted JAX function of a flat list of arrays (tensor inputs, then
    random keys). Input mutations the graph carries (``copy_`` into a placeholder) are computed
    inside it and written back with one storage swap per input, its old buffer donated."""

    def __init__(self, gm: torch.fx.GraphModule, policy=None, label="compiled graph"):
        self.gm = gm
        self.label = label  # metrics key: one per Dynamo frame and role, so recompiles of THIS graph count
        self.nodes = list(gm.graph.nodes)
        self.phs = [n for n in self.nodes if n.op == "placeholder"]
        self.random_nodes = [n for n in self.nodes if n.op == "call_function" and is_random(n)]
        ph_index = self.ph_pos = {n: i for i, n in enumerate(self.phs)}
        self.mutated = []
        for n in self.nodes:
            if n.op == "call_function" and n.target is aten.copy_.default:
                i = ph_index[n.args[0]]
                if i not in self.mutated:
                    self.mutated.append(i)
        vals = [n.meta.get("val") for n in self.phs]
        self.tensor_idx = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
        self.static_idx = [i for i, v in enumerate(vals) if not isinstance(v, torch.Tensor)]
        pos = {i: k for k, i in enumerate(self.tensor_idx)}
        self.donate_pos = tuple(pos[i] for i in self.mutated if i in pos)
        self._mut_tensor_pos = [pos.get(i) for i in self.mutated]  # position among the tensor arrays
        out = self.nodes[-1].args[0]
        self.out_leaves = pytree.tree_leaves(out) if isinstance(out, (list, tuple)) else [out]
        self.out_info = []
        for o in self.out_leaves:
            v = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if isinstance(v, torch.Tensor):
                self.out_info.append((v.dtype, v.device.type != "tpu", v.device))
            else:
                self.out_info.append(None)
        self._all_tensor_outs = all(info is not None for info in self.out_info)
        # dynamic sizes: each symbol and where its value is read from (a SymInt input or a tensor dim)
        self.sym_sources = {}
        for i, v in enumerate(vals):
            if isinstance(v, torch.SymInt) and is_symbolic(size_expr(v)) and size_expr(v).is_Symbol:
                self.sym_sources.setdefault(size_expr(v), (i, None))
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    e = size_expr(s)
                    if is_symbolic(e) and e.is_Symbol:
                        self.sym_sources.setdefault(e, (i, d))
        self.dynamic = any(
            is_symbolic(size_expr(s)) for v in vals if isinstance(v, torch.Tensor) for s in v.shape
        ) or any(isinstance(v, torch.SymInt) for v in vals)
        self.policy = policy
        self.unsafe = pad_unsafe_reason(self) if self.dynamic else None
        self._entries = {}
        self._warned = False

    # ---- tracing
    def _run(self, flat, statics, env, entry, sites):
        env_nodes = {}
        nt = len(self.tensor_idx)
        tensor_it = iter(flat[:nt])
        keys = flat[nt:]
        ki = 0
        mutations = {}

        def get(a):
            return env_nodes[a] if isinstance(a, torch.fx.Node) else a

        for node in self.nodes:
            op = node.op
            if op == "placeholder":
                i = self.ph_pos[node]
                env_nodes[node] = statics[i] if i in statics else next(tensor_it)
            elif op == "get_attr":
                env_nodes[node] = _constant_value(getattr(self.gm, node.target))
            elif op == "call_function":
                args = pytree.tree_map(get, node.args)
                kwargs = pytree.tree_map(get, node.kwargs)
                kind = node_kind(node)
                if kind == "getitem":
                    env_nodes[node] = args[0][args[1]]
                    continue
                if kind == "py":
                    env_nodes[node] = node.target(*args, **kwargs)
                    continue
                if kind == "sym":
                    env_nodes[node] = SYM_OPS[node.target](*args)
                    continue
                if kind == "copy":
                    dst = node.args[0]
                    dv = node.meta["val"]
                    res = jnp.broadcast_to(jnp.asarray(args[1]).astype(dtypes.to_jax(dv.dtype)),
                                           val_shape(dv, env))
                    env_nodes[node] = env_nodes[dst] = res
                    mutations[self.ph_pos[dst]] = res
                    continue
                if kind == "out_dtype":
                    env_nodes[node] = self._fix(node, run_out_dtype(*args), env)
                    continue
                if kind == "rng":
                    key_data = None
                    if is_random(node):
                        key_data = keys[ki]
                        ki += 1
                    env_nodes[node] = self._run_rng(node, args, kwargs, key_data, env)
                    continue
                vals = bind_args(node.target, args, kwargs)
                kw = {}
                if is_random(node):
                    kw["key"] = jax.random.wrap_key_data(keys[ki])
                    ki += 1
                t = node.target
                sites.op = short_name(t) if isinstance(t, torch._ops.OpOverload) else str(t)
                sites.where = node.meta.get("stack_trace")
                with tracing.named_scope(sites.op):
                    if kind == "view":
                        res = FUNCTIONAL[node.target](functools.partial(_result_type, node, env), *vals, **kw)
                    else:
                        res = LOWERINGS[qualified_name(node.target)].fn(*vals, **kw)
                env_nodes[node] = self._fix(node, res, env)
            elif op == "output":
                outs = [get(o) for o in self.out_leaves]
                entry.static_outs = [None if info is not None else o for o, info in zip(outs, self.out_info)]
                arrays = tuple(o for o, info in zip(outs, self.out_info) if info is not None)
                return arrays, tuple(mutations[i] for i in self.mutated)
            else:
                raise NotImplementedError(f"torchtpu compile: FX node kind {op}")

    def _run_rng(self, node, args, kwargs, key_data, env):
        """An op under activation checkpointing (see nodes.RUN_AND_SAVE_RNG): the forward's
        run_and_save_rng_state returns (state carrying the key it drew, result); the backward's
        run_with_rng_state replays that key."""
        save = node.target is RUN_AND_SAVE_RNG
        inner, inner_args = rng_wrapped_op(node)
        vals = bind_args(inner, args[1:] if save else args[2:], kwargs)
        val = node.meta["val"][1] if save else node.meta["val"]
        state_val = node.meta["val"][0] if save else node.args[0].meta["val"]
        if state_val.dtype != torch.uint8:
            raise NotImplementedError(f"torchtpu compile: an rng state of {state_val.dtype} cannot carry a key")
        state_shape = val_shape(state_val, env)
        kw = {}
        if key_data is not None:
            kw["key"] = jax.random.wrap_key_data(key_data)
            state = key_to_rng_state(key_data, state_shape)
        elif save:
            state = jnp.zeros(state_shape, jnp.uint8)
        elif op_is_random(inner, inner_args, node.kwargs):
            kw["key"] = jax.random.wrap_key_data(rng_state_to_key(args[0]))
        meta = _ValueMeta(val)
        if inner in FUNCTIONAL:
            res = FUNCTIONAL[inner](functools.partial(_result_type, meta, env), *vals, **kw)
        else:
            res = LOWERINGS[qualified_name(inner)].fn(*vals, **kw)
        res = self._fix(meta, res, env)
        return (state, res) if save else res

    @staticmethod
    def _fix(node, res, env):
        """Cast each result to the dtype (and shape) PyTorch's meta gives, as the eager kernel executor does."""
        val = node.meta.get("val")
        if val is None:
            return res
        if isinstance(val, torch.Tensor):
            if isinstance(res, (list, tuple)) and len(res) == 1:
                res = res[0]
            return GraphProgram._fix_leaf(res, val, env)
        if isinstance(val, (list, tuple)):
            return [GraphProgram._fix_leaf(r, v, env) for r, v in zip(res, val)]
        return res

    @staticmethod
    def _fix_leaf(r, v, env):
        if isinstance(v, torch.Tensor) and r is not None:
            o = jnp.asarray(r)
            shape = val_shape(v, env)
            if tuple(o.shape) != shape:
                if o.ndim == 0:
                    o = jnp.broadcast_to(o, shape)
                elif o.size == math.prod(shape):
                    o = o.reshape(shape)
                else:
                    raise NotBucketable(f"a result of shape {tuple(o.shape)} where {shape} was expected")
            return o.astype(dtypes.to_jax(v.dtype))
        return r

    def _entry(self, key, statics, env):
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = _Entry()
            metrics.record_miss(self.label, (len(self.nodes),) + tuple(key))
        return e

    def _jit(self, e, statics, env, donate):
        def fn(*flat):
            with checks.collecting() as sites:
                arrays, muts = self._run(flat, statics, env, e, sites)
            e.checks = tuple(sites.messages)
            return arrays, muts, (sites.output() if sites.results else None)

        if donate:
            e.donating = jax.jit(fn, donate_argnums=self.donate_pos)
            return e.donating
        e.plain = jax.jit(fn)
        return e.plain

    # ---- calling
    def __call__(self, args):
        if RECORDER.pending:  # the graph reads (and may donate) buffers pending work holds
            RECORDER.flush("compiled graph")
        if self.dynamic:
            return self._call_dynamic(args)
        statics = {i: args[i] for i in self.static_idx}
        key = tuple(_static_key(args[i]) for i in self.static_idx)
        return self._execute(args, key, statics, {}, None, None)

    def _execute(self, args, key, statics, env, pad_to, real_env):
        try:
            return self._execute_graph(args, key, statics, env, pad_to, real_env)
        except Exception as exc:
            if is_resource_exhausted(exc):  # the graph's buffers do not fit: CUDA's error type
                raise out_of_memory_from(exc) from exc
            raise

    def _execute_graph(self, args, key, statics, env, pad_to, real_env):
        e = self._entry(key, statics, env)
        pairs = [_arg_array(args[i]) for i in self.tensor_idx]
        arrays = [a for a, _ in pairs]
        if pad_to is not None:
            arrays = [a if a.shape == pad_to[i] else _pad_jit(pad_to[i])(a) for a, i in zip(arrays, self.tensor_idx)]
        # per mutated input: is its array the whole storage buffer (then donate it and swap)?
        mut_whole = [p is not None and pairs[p][1] for p in self._mut_tensor_pos]
        donate = bool(self.donate_pos) and all(w for w, p in zip(mut_whole, self._mut_tensor_pos) if p is not None)
        if donate and len({id(a) for a in arrays}) != len(arrays):  # an array passed twice: not donatable
            ids = collections.Counter(map(id, arrays))
            donate = all(ids[id(arrays[k])] == 1 for k in self.donate_pos)
        fn = (e.donating if donate else e.plain) or self._jit(e, statics, env, donate)
        keys = [next_key_data() for _ in self.random_nodes]
        metrics.record_graph_run(id(fn))
        if fn is e.donating and e.plain is None and e.static_outs is None:
            with warnings.catch_warnings():  # XLA CPU may decline a donation: harmless
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                outs, muts, flags = fn(*arrays, *keys)
        elif tracing.ACTIVE:
            with tracing.annotate("torchtpu " + self.label):
                outs, muts, flags = fn(*arrays, *keys)
        else:
            outs, muts, flags = fn(*arrays, *keys)
        if muts:
            _write_back([args[i] for i in self.mutated], muts, mut_whole)
        if flags is not None:
            checks.note(flags, e.checks)
        if checks.LAUNCH_BLOCKING:
            jax.block_until_ready((outs, muts))
            checks.raise_pending()
        if self._all_tensor_outs and real_env is None:  # the common case: every output a tensor
            return [_wrap_array(o, info) for o, info in zip(outs, self.out_info)]
        res = []
        it = iter(outs)
        for k, info in enumerate(self.out_info):
            if info is None:
                v = self.out_leaves[k].meta.get("val") if isinstance(self.out_leaves[k], torch.fx.Node) else None
                if real_env is not None and isinstance(v, torch.SymInt):
                    res.append(eval_size(size_expr(v), real_env))
                else:
                    res.append(e.static_outs[k])
                continue
            o = next(it)
            if real_env is not None:
                real = val_shape(self.out_leaves[k].meta["val"], real_env)
                if o.shape != real:
                    o = _prefix_jit(real)(o)
            res.append(_wrap_array(o, info))
        return res

    def _call_dynamic(self, args):
        import sympy

        real = {}
        for sym, (i, d) in self.sym_sources.items():
            a = args[i]
            real[sym] = int(a) if d is None else int(a.shape[d])
        bucketed = self.unsafe is None
        if bucketed:
            try:
                bvals = {s: self.policy.bucket(v) for s, v in real.items()}
            except Exception as err:  # above the largest bucket with overflow="error"
                bucketed = False
                self._warn(f"a size is outside the bucket policy ({err})")
            else:
                if any(bvals[s] < real[s] for s in real):  # overflow="truncate": no cutting of graph inputs
                    bucketed = False
        if not bucketed:
            bvals = dict(real)
            if self.unsafe is not None:
                self._warn(self.unsafe)
        real_env = {s: sympy.Integer(v) for s, v in real.items()}
        env = {s: sympy.Integer(v) for s, v in bvals.items()}
        vals = [n.meta.get("val") for n in self.phs]
        statics = {}
        for i in self.static_idx:
            v = vals[i]
            statics[i] = eval_size(size_expr(v), env) if isinstance(v, torch.SymInt) else args[i]
        key = tuple(_static_key(statics[i]) for i in self.static_idx) + tuple(bvals[s] for s in self.sym_sources)
        scope = tuple((str(s), bvals[s]) for s in self.sym_sources)
        with metrics.bucket_scope(scope):
            if not bucketed:
                return self._execute(args, key, statics, env, None, None)
            pad_to = {i: val_shape(vals[i], env) for i in self.tensor_idx}
            try:
                return self._execute(args, key, statics, env, pad_to, real_env)
            except NotBucketable as err:  # found while tracing (e.g. a slice shorter than the bucket)
                self._entries.pop(key, None)
                self.unsafe = str(err)
                self._warn(self.unsafe)
                return self._call_dynamic(args)

    def _warn(self, why):
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"torchtpu compile: a dynamic-shape graph is compiled per size, not per bucket: {why}",
                metrics.RecompileWarning,
                stacklevel=3,
            )


class _ValueMeta:
    """What ``_fix`` and ``_result_type`` read of a node (``meta["val"]``), for an op wrapped in an rng HOP."""

    def __init__(self, val):
        self.meta = {"val": val}


def _result_type(node, env):
    """(shape, jax dtype) of ``node``'s result with the graph's symbols bound to ``env``."""
    v = node.meta["val"]
    return val_shape(v, env), dtypes.to_jax(v.dtype)


def _static_key(v):
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)




def _write_back(targets, values, whole):
    """Store the graph's new values of its mutated inputs (in-place updates made by the graph)."""
    bumped, host = [], []
    for t, v, w in zip(targets, values, whole):
        if t.device.type == "tpu":
            if w:
                storage.storage_data(t).buf = v  # one swap; every view of the storage sees it
            else:
                storage.write_value(t, v)
            bumped.append(t)
        else:
            host.append((t, v))
    if bumped:
        torch._C._increment_version(bumped)  # as an eager in-place op would (autograd's saved-tensor checks)
    if host:
        vals = storage.to_host([v for _, v in host])  # one transfer for all host-side inputs
        with torch.no_grad():
            for (t, _), v in zip(host, vals):
                t.copy_(dtypes.numpy_to_torch(np.asarray(v), t.dtype).reshape(t.shape))


def _wrap_array(o, info):
    dtype, on_cpu, dev = info
    if on_cpu:
        # e.g. an optimizer's CPU step counter: the output lives where PyTorch says
        return dtypes.numpy_to_torch(np.asarray(storage.to_host(o)), dtype).reshape(tuple(o.shape)).to(dev)
    return storage.new_tensor(o.shape, dtype, o)


def _constant_value(t):
    if isinstance(t, torch.Tensor):
        return _input_value(t)
    return t


def _input_value(a):
    if isinstance(a, torch.Tensor):
        if a.device.type == "tpu":
            return storage.logical_value(a)
        # a numpy copy goes straight into the jitted call (no eager jax op; not aliasing the tensor)
        return np.array(dtypes.cpu_tensor_to_numpy(a.detach().contiguous())).reshape(tuple(a.shape))
    return a



_warned_eager: set = set()


def _no_kernel(op) -> bool:
    """True when eager mode would send ``op`` to the CPU fallback (no tpu kernel of any kind)."""
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "PrivateUse1") and not (
            torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        )
    except Exception:
        return True


def graph_label(role="graph") -> str:
    """The metrics name of the graph Dynamo is compiling now: ``compiled graph <fn> (<file>:<line>)
    #<frame> <role>``. Dynamo gives each frame (code object) one frame id and recompiles of it
    keep that id, so executables built under one label are recompiles of the same graph."""
    cid = torch._guards.CompileContext.current_compile_id()
    where = ""
    ctx = torch._guards.TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    co = getattr(env, "co_fields", None) or {}
    if co:
        where = f" {co.get('co_name')} ({os.path.basename(str(co.get('co_filename')))}:{co.get('co_firstlineno')})"
    frame = f" #{cid.frame_id}" if cid is not None and cid.frame_id is not None else ""
    return f"compiled graph{where}{frame} {role}"


def is_graph_label(name: str) -> bool:
    """True for the metrics names of compiled graphs (not the eager-fallback ones)."""
    return name.startswith("compiled graph") and "(eager:" not in name



def compile_graph(gm: torch.fx.GraphModule, example_inputs, policy=None, label=None):
    """FX graph of aten ops -> boxed callable running it as one jitted JAX function."""
    missing = sorted(
        {
            (qualified_name(n.target) if isinstance(n.target, torch._ops.OpOverload) else str(n.target))
            for n in gm.graph.nodes
            if n.op == "call_function" and node_kind(n) is None
        }
    )
    if missing and all(m.startswith("_c10d_functional::") for m in missing):
        return _run_recorded(gm, label or graph_label())
    if missing:
        hard = [m for m, n in _missing_nodes(gm) if _no_kernel(n.target)]
        if hard and not fallback.cpu_fallback_enabled():
            raise NotImplementedError(
                f"torchtpu compile: no tpu lowering for {', '.join(hard)} inside a compiled graph and CPU "
                "fallback is off (torchtpu.set_cpu_fallback(True) runs such graphs eagerly)"
            )
        key = tuple(missing)
        if key not in _warned_eager:
            _warned_eager.add(key)
            warnings.warn(
                f"torchtpu compile: no tpu lowering for {', '.join(missing)}; this graph runs eagerly "
                "op by op (shown once per set of ops).",
                fallback.TPUFallbackWarning,
                stacklevel=2,
            )
        metrics.record_miss("compiled graph (eager: " + ", ".join(missing) + ")")

        _views_as_reshapes(gm)

        def run_eager(args):
            with torch.no_grad():
                out = gm(*args)
            return list(out) if isinstance(out, (list, tuple)) else [out]

        run_eager._boxed_call = True
        return run_eager

    fill_rng_meta(gm)
    prog = GraphProgram(gm, policy or _default_policy(), label or graph_label())

    def run(args):
        out = prog(args)
        args.clear()  # boxed convention: inputs may be freed early
        return out

    run._boxed_call = True
    run.program = prog
    return run


def _views_as_reshapes(gm):
    """Eager kernels may return other (valid) strides than the fake ones the graph was traced
    with, so views that assumed those strides become reshapes."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (aten.view.default, aten._unsafe_view.default):
            n.target = aten.reshape.default
    gm.recompile()


def _run_recorded(gm, label):
    """A graph holding functional collectives (``_c10d_functional``): its ops are recorded by
    DeferAndFuse, collectives included (the distributed backend records them), and flushed at its
    end as one fused XLA program over the group's devices, cached by structure like any fused
    graph: compute and communication in one executable, not one executable per op."""
    _views_as_reshapes(gm)
    metrics.record_miss(label + " (recorded: functional collectives)")

    def run_recorded(args):
        with torch.no_grad(), execution_mode("defer_and_fuse"):
            out = gm(*args)
            args.clear()
            RECORDER.flush("compiled graph")
        return list(out) if isinstance(out, (list, tuple)) else [out]

    run_recorded._boxed_call = True
    return run_recorded


def _default_policy():
    return BucketPolicy.pow2(1, 1 << 16, overflow="split")


def _missing_nodes(gm):
    seen = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and node_kind(n) is None and isinstance(n.target, torch._ops.OpOverload):
            seen.setdefault(qualified_name(n.target), n)
    return list(seen.items())
