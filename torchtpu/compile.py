"""Compiled mode: ``torch.compile(model, backend="tpu")``.

Dynamo captures the program, AOTAutograd splits forward and backward into
functional aten graphs (PyTorch's core aten decompositions, minus the ops this
package lowers directly), and each graph becomes ONE ``jax.jit``: an
interpreter over the graph's nodes that calls, for each aten op, the same
lowering the eager modes use (``registry.LOWERINGS``), so every op has one
source of truth. View ops, which are metadata-only kernels in eager mode, are
plain value ops in a functional graph and are written here.

A graph containing an op with no lowering runs eagerly through its FX
GraphModule on tpu tensors (eager kernels and the CPU fallback handle it), with
one warning naming the op(s); with CPU fallback off it raises instead.
Input mutations (optimizer steps, buffers) come back from AOTAutograd as extra
outputs that its runtime wrapper copies into the inputs eagerly.
"""

from __future__ import annotations

import operator
import warnings

import jax
import jax.numpy as jnp
import torch
from torch.utils import _pytree as pytree

from . import dtypes, fallback, metrics, registry, storage
from .random import next_key_data

aten = torch.ops.aten

__all__ = ["tpu_backend", "decompositions"]


# ---------------------------------------------------------------- view and factory ops
def _norm_dim(d, n):
    return d + n if d < 0 else d


def _slice(x, dim=0, start=None, end=None, step=1):
    dim = _norm_dim(dim, x.ndim)
    return x[(slice(None),) * dim + (slice(start, end, step),)]


def _select(x, dim, index):
    dim = _norm_dim(dim, x.ndim)
    return x[(slice(None),) * dim + (index,)]


def _squeeze(x, dims=None):
    if dims is None:
        dims = range(x.ndim)
    elif isinstance(dims, int):
        dims = [dims]
    keep = tuple(_norm_dim(d, max(x.ndim, 1)) for d in dims)
    axes = tuple(d for d in keep if d < x.ndim and x.shape[d] == 1)
    return jnp.squeeze(x, axes) if axes else x


def _expand(x, size, implicit=False):
    n = len(size)
    shape = list(size)
    lead = n - x.ndim
    for i in range(n):
        if shape[i] == -1:
            shape[i] = x.shape[i - lead]
    return jnp.broadcast_to(x, tuple(shape))


def _split_sizes(x, sizes, dim=0):
    dim = _norm_dim(dim, x.ndim)
    idx, acc = [], 0
    for n in sizes[:-1]:
        acc += int(n)
        idx.append(acc)
    return list(jnp.split(x, idx, axis=dim))


def _split(x, split_size, dim=0):
    dim = _norm_dim(dim, x.ndim)
    n = x.shape[dim]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if n else [0]
    return _split_sizes(x, sizes, dim)


def _unbind(x, dim=0):
    dim = _norm_dim(dim, x.ndim)
    return [_select(x, dim, i) for i in range(x.shape[dim])]


def _as_strided(x, size, stride, storage_offset=None):
    # in a functional graph the base is the (contiguous) value of the input
    return storage.read(x.reshape(-1), (tuple(size), tuple(stride), storage_offset or 0))


def _t(x):
    return x if x.ndim < 2 else jnp.swapaxes(x, 0, 1)


def _meta_shape_dtype(node):
    v = node.meta["val"]
    return tuple(int(s) for s in v.shape), dtypes.to_jax(v.dtype)


def _full(node, fill):
    shape, dt = _meta_shape_dtype(node)
    return jnp.full(shape, fill, dt)


# op -> fn(node, *bound_args) computing the value; views are copies here (functional graph)
_VIEWS = {
    aten.view.default: lambda n, x, size: x.reshape(tuple(size)),
    aten._unsafe_view.default: lambda n, x, size: x.reshape(tuple(size)),
    aten.reshape.default: lambda n, x, size: x.reshape(tuple(size)),
    aten.view_copy.default: lambda n, x, size: x.reshape(tuple(size)),
    aten._reshape_alias.default: lambda n, x, size, stride: x.reshape(tuple(size)),
    aten.t.default: lambda n, x: _t(x),
    aten.transpose.int: lambda n, x, a, b: jnp.swapaxes(x, a, b),
    aten.permute.default: lambda n, x, dims: jnp.transpose(x, [_norm_dim(d, x.ndim) for d in dims]),
    aten.expand.default: lambda n, x, size, implicit=False: _expand(x, size),
    aten.expand_copy.default: lambda n, x, size, implicit=False: _expand(x, size),
    aten.slice.Tensor: lambda n, x, dim=0, start=None, end=None, step=1: _slice(x, dim, start, end, step),
    aten.select.int: lambda n, x, dim, index: _select(x, dim, index),
    aten.squeeze.default: lambda n, x: _squeeze(x),
    aten.squeeze.dim: lambda n, x, dim: _squeeze(x, dim),
    aten.squeeze.dims: lambda n, x, dims: _squeeze(x, dims),
    aten.unsqueeze.default: lambda n, x, dim: jnp.expand_dims(x, dim),
    aten.as_strided.default: lambda n, x, size, stride, off=None: _as_strided(x, size, stride, off),
    aten.alias.default: lambda n, x: x,
    aten.detach.default: lambda n, x: x,
    aten.lift_fresh.default: lambda n, x: x,
    aten.split.Tensor: lambda n, x, s, dim=0: _split(x, s, dim),
    aten.split_with_sizes.default: lambda n, x, s, dim=0: _split_sizes(x, s, dim),
    aten.unbind.int: lambda n, x, dim=0: _unbind(x, dim),
    aten.diagonal.default: lambda n, x, off=0, d1=0, d2=1: jnp.diagonal(
        x, off, _norm_dim(d1, x.ndim), _norm_dim(d2, x.ndim)
    ),
    # factories: shape and dtype come from the node's FakeTensor
    aten.full.default: lambda n, size, fill, *rest: _full(n, fill),
    aten.zeros.default: lambda n, size, *rest: _full(n, 0),
    aten.ones.default: lambda n, size, *rest: _full(n, 1),
    aten.empty.memory_format: lambda n, size, *rest: _full(n, 0),
    aten.empty_strided.default: lambda n, size, stride, *rest: _full(n, 0),
    aten.full_like.default: lambda n, x, fill, *rest: _full(n, fill),
    aten.zeros_like.default: lambda n, x, *rest: _full(n, 0),
    aten.ones_like.default: lambda n, x, *rest: _full(n, 1),
    aten.empty_like.default: lambda n, x, *rest: _full(n, 0),
    aten.new_zeros.default: lambda n, x, size, *rest: _full(n, 0),
    aten.new_ones.default: lambda n, x, size, *rest: _full(n, 1),
    aten.new_empty.default: lambda n, x, size, *rest: _full(n, 0),
    aten.new_full.default: lambda n, x, size, fill, *rest: _full(n, fill),
    aten.new_empty_strided.default: lambda n, x, size, stride, *rest: _full(n, 0),
}


def _eye(n, *rest):
    shape, dt = _meta_shape_dtype(n)
    return jnp.eye(shape[0], shape[1], dtype=dt)


_VIEWS[aten.eye.default] = _eye
_VIEWS[aten.eye.m] = _eye


# SDPA on tpu routes to the overload PyTorch reserves for out-of-tree backends; in a graph it
# runs the same torchtpu::sdpa_* lowerings as the eager kernels in ops/nn.py
def _sdpa_fwd(n, q, k, v, bias=None, dropout_p=0.0, is_causal=False, debug=False, scale=None, key=None):
    if dropout_p > 0:
        out, lse, seed = registry.LOWERINGS["torchtpu::sdpa_fwd_dropout.default"].fn(
            q, k, v, bias, dropout_p, is_causal, scale, key=key)
    else:
        out, lse, seed = registry.LOWERINGS["torchtpu::sdpa_fwd.default"].fn(q, k, v, bias, is_causal, scale)
    if lse.ndim == 2:  # 3-D (H, L, E) input: PyTorch's lse is (1, H, L)
        lse = lse[None]
    return out, lse, None, None, q.shape[-2], k.shape[-2], seed, jnp.zeros((), jnp.int64), None


def _sdpa_bwd(n, grad_out, q, k, v, bias, mask, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset,
              scale=None):
    if q.ndim == 3:
        lse = lse[0]
    gq, gk, gv, gb = registry.LOWERINGS["torchtpu::sdpa_bwd.default"].fn(
        grad_out, q, k, v, bias, lse, seed, dropout_p, is_causal, scale, list(mask))
    gb = None if bias is None or gb.size == 0 else gb
    return tuple(g if m else None for g, m in zip((gq, gk, gv, gb), mask))


# advanced indexing (eager: hand-written kernels); integer indices only, as numpy's rules are torch's
def _index_tuple(indices):
    return tuple(slice(None) if i is None else i for i in indices)


_VIEWS[aten.index.Tensor] = lambda n, x, indices: x[_index_tuple(indices)]
_VIEWS[aten.index_put.default] = lambda n, x, indices, values, accumulate=False: (
    x.at[_index_tuple(indices)].add(values) if accumulate else x.at[_index_tuple(indices)].set(values)
)
_INT_INDEX_ONLY = (aten.index.Tensor, aten.index_put.default)


def _int_indices(node) -> bool:
    idx = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
    for i in idx:
        v = i.meta.get("val") if isinstance(i, torch.fx.Node) else i
        if isinstance(v, torch.Tensor) and (v.dtype == torch.bool or v.dtype == torch.uint8):
            return False  # a mask's result shape depends on values: eager
    return True


# prims that the decompositions emit
_VIEWS[torch.ops.prims.convert_element_type.default] = lambda n, x, dtype: jnp.asarray(x).astype(dtypes.to_jax(dtype))


_SDPA = aten._scaled_dot_product_fused_attention_overrideable.default
_VIEWS[_SDPA] = _sdpa_fwd
_VIEWS[aten._scaled_dot_product_fused_attention_overrideable_backward.default] = _sdpa_bwd


def _is_random(node) -> bool:
    t = node.target
    if t is _SDPA:
        return _bind(t, node.args, node.kwargs)[4] > 0
    return _kind(node) == "lower" and registry.LOWERINGS[_qualname(t)].random


def _qualname(op) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def _bind(op, args, kwargs):
    """All arguments of ``op`` in schema order (defaults filled in), as the registry does."""
    out = list(args)
    for a in op._schema.arguments[len(args):]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        elif a.kwarg_only and a.type.kind() == "OptionalType":
            out.append(None)
        else:
            raise TypeError(f"{_qualname(op)}: missing argument {a.name!r}")
    return out


def _kind(node):
    """How a call_function node is executed: 'lower', 'view', 'getitem', 'py', or None (unsupported)."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        if t in _VIEWS:
            if t in _INT_INDEX_ONLY and not _int_indices(node):
                return None
            return "view"
        if _qualname(t) in registry.LOWERINGS:
            return "lower"
        return None
    if t in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg):
        return "py"  # symbolic-size arithmetic
    return None


def _to_dtype(x, val):
    if isinstance(val, torch.Tensor):
        return jnp.asarray(x).astype(dtypes.to_jax(val.dtype))
    return x


class _GraphProgram:
    """One FX graph as one jitted JAX function over its tensor inputs and random keys."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.random_nodes = [n for n in self.nodes if n.op == "call_function" and _is_random(n)]
        self._jit = jax.jit(self._run)

    def _run(self, inputs, keys):
        env = {}
        it = iter(inputs)
        ki = 0

        def get(a):
            return env[a] if isinstance(a, torch.fx.Node) else a

        for node in self.nodes:
            op = node.op
            if op == "placeholder":
                env[node] = next(it)
            elif op == "get_attr":
                t = getattr(self.gm, node.target)
                env[node] = _constant_value(t)
            elif op == "call_function":
                args = pytree.tree_map(get, node.args)
                kwargs = pytree.tree_map(get, node.kwargs)
                kind = _kind(node)
                if kind == "getitem":
                    env[node] = args[0][args[1]]
                    continue
                if kind == "py":
                    env[node] = node.target(*args, **kwargs)
                    continue
                vals = _bind(node.target, args, kwargs)
                kw = {}
                if _is_random(node):
                    kw["key"] = jax.random.wrap_key_data(keys[ki])
                    ki += 1
                if kind == "view":
                    res = _VIEWS[node.target](node, *vals, **kw)
                else:
                    res = registry.LOWERINGS[_qualname(node.target)].fn(*vals, **kw)
                env[node] = self._fix(node, res)
            elif op == "output":
                outs = pytree.tree_map(get, node.args[0])
                return list(outs) if isinstance(outs, (list, tuple)) else [outs]
            else:
                raise NotImplementedError(f"torchtpu compile: FX node kind {op}")

    @staticmethod
    def _fix(node, res):
        """Cast each result to the dtype (and shape) PyTorch's meta gives, as the eager registry does."""
        val = node.meta.get("val")
        if val is None:
            return res
        if isinstance(val, torch.Tensor):
            if isinstance(res, (list, tuple)) and len(res) == 1:
                res = res[0]
            o = jnp.asarray(res)
            shape = tuple(val.shape)
            if all(isinstance(s, int) for s in shape) and tuple(o.shape) != shape:
                o = jnp.broadcast_to(o, shape) if o.ndim == 0 else o.reshape(shape)
            return o.astype(dtypes.to_jax(val.dtype))
        if isinstance(val, (list, tuple)):
            return [_GraphProgram._fix_leaf(r, v) for r, v in zip(res, val)]
        return res

    @staticmethod
    def _fix_leaf(r, v):
        if isinstance(v, torch.Tensor) and r is not None:
            o = jnp.asarray(r)
            shape = tuple(v.shape)
            if all(isinstance(s, int) for s in shape) and tuple(o.shape) != shape:
                o = jnp.broadcast_to(o, shape) if o.ndim == 0 else o.reshape(shape)
            return o.astype(dtypes.to_jax(v.dtype))
        return r

    def __call__(self, args):
        inputs = [_input_value(a) for a in args]
        keys = [next_key_data() for _ in self.random_nodes]
        outs = self._jit(inputs, keys)
        out_node = self.nodes[-1]
        vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in pytree.tree_leaves(out_node.args[0])]
        return [_wrap_output(o, v) for o, v in zip(outs, vals)]


def _constant_value(t):
    if isinstance(t, torch.Tensor):
        return _input_value(t)
    return t


def _input_value(a):
    if isinstance(a, torch.Tensor):
        if a.device.type == "tpu":
            return registry.logical_value(a)
        return jnp.asarray(dtypes.cpu_tensor_to_numpy(a.detach().contiguous())).reshape(tuple(a.shape))
    return a


def _wrap_output(o, val):
    if o is None or not hasattr(o, "shape"):
        return o
    if isinstance(val, torch.Tensor):
        shape = tuple(val.shape)
        if tuple(o.shape) != shape and all(isinstance(s, int) for s in shape):
            o = o.reshape(shape)
    if isinstance(val, torch.Tensor) and val.device.type != "tpu":
        # e.g. an optimizer's CPU step counter: the output lives where PyTorch says
        return storage.host_to_cpu_tensor(jax.device_get(o), val.dtype).reshape(tuple(o.shape)).to(val.device)
    dt = val.dtype if isinstance(val, torch.Tensor) else None
    return registry.from_jax_array(o, dt)


# ---------------------------------------------------------------- the backend
_warned_eager: set = set()


def _no_kernel(op) -> bool:
    """True when eager mode would send ``op`` to the CPU fallback (no tpu kernel of any kind)."""
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "PrivateUse1") and not (
            torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        )
    except Exception:
        return True


def compile_graph(gm: torch.fx.GraphModule, example_inputs):
    """FX graph of aten ops -> boxed callable running it as one jitted JAX function."""
    missing = sorted(
        {
            (_qualname(n.target) if isinstance(n.target, torch._ops.OpOverload) else str(n.target))
            for n in gm.graph.nodes
            if n.op == "call_function" and _kind(n) is None
        }
    )
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

        # eager kernels may return other (valid) strides than the fake ones the graph was
        # traced with, so views that assumed those strides become reshapes
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in (aten.view.default, aten._unsafe_view.default):
                n.target = aten.reshape.default
        gm.recompile()

        def run_eager(args):
            with torch.no_grad():
                out = gm(*args)
            return list(out) if isinstance(out, (list, tuple)) else [out]

        run_eager._boxed_call = True
        return run_eager

    prog = _GraphProgram(gm)
    metrics.record_miss("compiled graph", (len(prog.nodes),))

    def run(args):
        out = prog(args)
        args.clear()  # boxed convention: inputs may be freed early
        return out

    run._boxed_call = True
    return run


def _missing_nodes(gm):
    seen = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and _kind(n) is None and isinstance(n.target, torch._ops.OpOverload):
            seen.setdefault(_qualname(n.target), n)
    return list(seen.items())


_DECOMPS = None


def decompositions():
    """PyTorch's core aten decompositions, minus the ops that have a tpu lowering of their own."""
    global _DECOMPS
    if _DECOMPS is None:
        from torch._decomp import core_aten_decompositions

        table = dict(core_aten_decompositions())
        for op in list(table):
            if isinstance(op, torch._ops.OpOverload) and (_qualname(op) in registry.LOWERINGS or op in _VIEWS):
                del table[op]
        _DECOMPS = table
    return _DECOMPS


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The ``"tpu"`` Dynamo backend: AOTAutograd forward/backward graphs -> one ``jax.jit`` each."""
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(
        fw_compiler=compile_graph,
        bw_compiler=compile_graph,
        inference_compiler=compile_graph,
        decompositions=decompositions(),
    )
    return backend(gm, example_inputs, **kwargs)


def _skip_runtime_code() -> None:
    """Keep Dynamo out of JAX and of torchtpu's runtime.

    Eager pieces run between graphs (graph breaks, ``loss.backward()``) call
    torchtpu's Python kernels from C++ while Dynamo's frame hook is set; without
    this Dynamo would try to trace jax.numpy inside them. ``torchtpu.models`` stays
    traceable: it is user-level model code.
    """
    import pkgutil

    from torch._dynamo import trace_rules

    import torchtpu

    names = ["jax", "jaxlib"]
    for m in pkgutil.iter_modules(torchtpu.__path__):
        if m.name != "models":
            names.append(f"torchtpu.{m.name}")
    for name in names:
        trace_rules.add(name)


def register() -> None:
    from torch._dynamo import list_backends, register_backend

    _skip_runtime_code()
    if "tpu" not in list_backends(exclude_tags=()):
        register_backend(name="tpu")(tpu_backend)


register()
