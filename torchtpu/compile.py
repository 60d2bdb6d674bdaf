"""Compiled mode: ``torch.compile(model, backend="tpu")``.

Dynamo captures the program, AOTAutograd splits forward and backward into
functional aten graphs (PyTorch's core aten decompositions, minus the ops this
package lowers directly), and each graph becomes ONE ``jax.jit``: an
interpreter over the graph's nodes that calls, for each aten op, the same
lowering the eager modes use (``registry.LOWERINGS``), so every op has one
source of truth. View ops, which are metadata-only kernels in eager mode, are
plain value ops in a functional graph and are written here.

Runtime: an executable is called with a flat list of arrays. Input mutations
(optimizer steps, buffer updates) stay inside the graph
(``keep_inference_input_mutations``): the executable returns the new values,
each input's old buffer is donated, and the write-back is one storage swap per
input rather than an eager ``copy_`` per tensor.

Dynamic shapes (``dynamic=True``, ``torch._dynamo.mark_dynamic``, or Dynamo's
automatic dynamic shapes): each size symbol is rounded up to a bucket of a
:class:`torchtpu.bucketing.BucketPolicy` (``options={"bucket_policy": ...}``,
default powers of two), inputs are padded, outputs sliced back, and one
executable serves a whole bucket. Padding is only used where a static analysis
of the graph proves the real part of every output unchanged (no reduction,
contraction or softmax over a padded dim; causal attention is fine); any other
dynamic graph compiles per size with one ``RecompileWarning`` saying why.

Training steps: Dynamo breaks ``loss.backward(); opt.step()`` into a forward graph, a
backward graph (run by the autograd engine) and an optimizer graph. With
``torch._dynamo.config.trace_autograd_ops = True`` Dynamo traces ``backward()`` into the
forward's graph instead (two executables, no autograd engine at run time), provided
``zero_grad`` is called outside the compiled function and no tensor with a ``grad_fn``
outlives ``backward()`` (``loss = loss.detach()`` before ``opt.step()``);
``torchtpu_models.training_step(..., mode="traced_backward")`` is that pattern. As for
cuda/xpu, a compiled optimizer on tpu params is made ``capturable`` (step counters on the
device). ``AdamW(fused=True)``: Dynamo graph-breaks on the fused path for every backend, so
its step runs eagerly as one ``_fused_adamw_`` executable.

Metrics: each graph's executables are counted under its own name (``graph_label``:
function, file:line, Dynamo frame id, forward/backward/inference), so the
``RecompileWarning`` fires only when the same graph keeps recompiling.

A graph containing an op with no lowering runs eagerly through its FX
GraphModule on tpu tensors (eager kernels and the CPU fallback handle it), with
one warning naming the op(s); with CPU fallback off it raises instead.
"""

from __future__ import annotations

import collections
import functools
import math
import operator
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch._guards
from torch.utils import _pytree as pytree

from . import dtypes, fallback, lazy, metrics, registry, storage
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
    return _val_shape(v, _trace_env), dtypes.to_jax(v.dtype)


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


# random factories: the same distributions as the registry's uniform_/normal_ lowerings, with
# a fresh key per call (a graph input), shape and dtype from the node's FakeTensor
def _rand_factory(lowering, *params):
    def fn(n, *args, key=None):
        shape, dt = _meta_shape_dtype(n)
        return registry.LOWERINGS[lowering].fn(jnp.zeros(shape, dt), *params, None, key=key)

    return fn


_RANDOM_FACTORIES = {
    aten.rand_like.default: _rand_factory("aten::uniform.default", 0.0, 1.0),
    aten.rand.default: _rand_factory("aten::uniform.default", 0.0, 1.0),
    aten.randn_like.default: _rand_factory("aten::normal_functional.default", 0.0, 1.0),
    aten.randn.default: _rand_factory("aten::normal_functional.default", 0.0, 1.0),
}
_VIEWS.update(_RANDOM_FACTORIES)


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
    """The node takes a fresh random key (a graph input)."""
    t = node.target
    if t is _RUN_AND_SAVE_RNG:
        return _op_is_random(node.args[0], node.args[1:], node.kwargs)
    if t is _RUN_WITH_RNG:
        return False  # replays the key its run_and_save_rng_state twin saved
    return _op_is_random(t, node.args, node.kwargs)


def _op_is_random(t, args, kwargs) -> bool:
    if t is _SDPA:
        return _bind(t, args, kwargs)[4] > 0
    if t in _RANDOM_FACTORIES:
        return True
    return (isinstance(t, torch._ops.OpOverload) and t not in _VIEWS and _qualname(t) in registry.LOWERINGS
            and registry.LOWERINGS[_qualname(t)].random)


# Activation checkpointing (torch.utils.checkpoint traced by Dynamo, e.g. Hugging Face's
# gradient_checkpointing) recomputes the forward's random ops in the backward: AOTAutograd wraps
# each as run_and_save_rng_state(op, ...) -> (state, out) in the forward graph and
# run_with_rng_state(state, op, ...) in the backward one. The state tensor is shaped like
# torch.get_rng_state() (uint8); here it carries the op's random key in its first bytes, so the
# recompute draws the same numbers. (Ops tagged random that draw nothing, such as SDPA without
# dropout, save zeros.)
_RUN_AND_SAVE_RNG = torch._prims.rng_prims.run_and_save_rng_state
_RUN_WITH_RNG = torch._prims.rng_prims.run_with_rng_state


class _OpMeta:
    """What the lowerings read of a node (``meta["val"]``), for an op wrapped in an rng HOP."""

    def __init__(self, val):
        self.meta = {"val": val}


def _key_to_rng_state(key_data, state_val, env):
    shape = _val_shape(state_val, env)
    if state_val.dtype != torch.uint8 or math.prod(shape) < 8:
        raise NotImplementedError(f"torchtpu compile: an rng state of {state_val.dtype} {shape} cannot carry a key")
    raw = jax.lax.bitcast_convert_type(jnp.asarray(key_data, jnp.uint32), jnp.uint8).reshape(-1)
    return jnp.zeros(shape, jnp.uint8).reshape(-1).at[:raw.shape[0]].set(raw).reshape(shape)


def _fill_rng_meta(gm) -> None:
    """AOTAutograd leaves its rng HOP nodes without ``meta["val"]``: compute it (the wrapped op on
    the inputs' fake values; the saved state's from the getitem that reads it)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (_RUN_AND_SAVE_RNG, _RUN_WITH_RNG):
            continue
        save = n.target is _RUN_AND_SAVE_RNG
        # the state's fake is sized by a symbol of its own (from_tensor under a shape env) that is no
        # graph input: give it torch.get_rng_state()'s concrete size, so the graph stays static
        holders = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0] if save else [n.args[0]]
        for h in holders:
            v = h.meta.get("val")
            if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
                h.meta["val"] = torch.empty(torch.get_rng_state().shape, dtype=v.dtype)
        if "val" in n.meta:
            continue
        inner = n.args[0] if save else n.args[1]
        args, kwargs = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
                                       (n.args[1:] if save else n.args[2:], n.kwargs))
        mode = torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs)))
        if mode is None:
            continue  # nothing to read shapes from: the lowering sees no meta, as before
        with mode:
            out = inner(*args, **kwargs)
        if save:
            state = next((u.meta.get("val") for u in n.users
                          if u.target is operator.getitem and u.args[1] == 0), None)
            n.meta["val"] = (state, out)
        else:
            n.meta["val"] = out


def _rng_state_to_key(state):
    return jax.lax.bitcast_convert_type(jnp.asarray(state).reshape(-1)[:8].reshape(2, 4), jnp.uint32)


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
    if t is aten.copy_.default:
        # an input mutation AOTAutograd left in the graph (keep_inference_input_mutations)
        return "copy" if node.args[0].op == "placeholder" else None
    if t in _SYM_OPS:
        return "sym"
    if t is _RUN_AND_SAVE_RNG or t is _RUN_WITH_RNG:
        inner = node.args[0] if t is _RUN_AND_SAVE_RNG else node.args[1]
        lowered = isinstance(inner, torch._ops.OpOverload) and (
            inner in _VIEWS or _qualname(inner) in registry.LOWERINGS)
        return "rng" if lowered else None
    if isinstance(t, torch._ops.OpOverload):
        if t in _VIEWS:
            if t in _INT_INDEX_ONLY and not _int_indices(node):
                return None
            return "view"
        if _qualname(t) in registry.LOWERINGS:
            return "lower"
        return None
    if t in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg, operator.truediv,
             operator.mod, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
             torch.sym_max, torch.sym_min, torch.sym_sum):
        return "py"  # symbolic-size arithmetic
    return None


def _to_dtype(x, val):
    if isinstance(val, torch.Tensor):
        return jnp.asarray(x).astype(dtypes.to_jax(val.dtype))
    return x


# ---------------------------------------------------------------- symbolic sizes
class _NotBucketable(Exception):
    """A dynamic graph whose results would change if its dynamic dims were padded."""


def _expr(s):
    """A size as an int or a sympy expression (SymInt)."""
    if isinstance(s, torch.SymInt):
        e = s.node.expr
        return int(e) if e.is_number else e
    return int(s)


def _is_sym(e) -> bool:
    return not isinstance(e, int)


def _eval(e, env) -> int:
    """Value of size ``e`` with the symbols of ``env`` ({sympy.Symbol: sympy.Integer}) substituted."""
    if isinstance(e, int):
        return e
    r = e.xreplace(env)
    if not r.is_number:
        raise _NotBucketable(f"size {e} depends on a symbol that is not a graph input")
    return int(r)


def _val_shape(val, env):
    return tuple(_eval(_expr(s), env) for s in val.shape)


_trace_env: dict = {}  # symbol values of the graph being traced (read by the factory lowerings)


# ---------------------------------------------------------------- pad-safety of a dynamic graph
# Each dim of each value is described by its "atoms": the sizes it is a row-major product of,
# outermost first (ints are static; a sympy expression is a dynamic size). Padding a dynamic
# atom at its end leaves every real element at the coordinates it has unpadded, and puts the
# pad (garbage) in coordinates that only ever meet other garbage -- as long as no op mixes
# elements along a dim holding a dynamic atom (a reduction, a contraction, a softmax) and no
# reshape splits a dynamic atom. The analysis below proves that for the ops it knows, and
# refuses (the graph then compiles per size) everything else.

def _dyn(atoms) -> bool:
    return any(_is_sym(a) for a in atoms)


def _shape_atoms(shape, what):
    out = []
    for s in shape:
        e = _expr(s)
        if not _is_sym(e):
            out.append(() if e == 1 else (e,))
        elif e.is_Symbol or what == "fresh":
            out.append((e,))
        else:
            raise _NotBucketable(f"{what} has a dim of compound dynamic size {e}")
    return out


def _prod(atoms):
    p = 1
    for a in atoms:
        p = p * a
    return p


def _same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    import sympy

    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _reshape_atoms(in_atoms, out_shape, name):
    flat = [a for dim in in_atoms for a in dim if a != 1]
    out = []
    for s in out_shape:
        e = _expr(s)
        if e == 1:
            out.append(())
            continue
        got, p = [], 1
        while not _same_size(p, e):
            if not flat:
                raise _NotBucketable(f"{name}: a reshape this analysis cannot follow")
            a = flat.pop(0)
            if not _is_sym(a) and not _is_sym(e):
                need = e // p if e % p == 0 else 0
                if need and a > need and a % need == 0:  # split a static atom
                    flat.insert(0, a // need)
                    a = need
                elif not need or need % a:
                    raise _NotBucketable(f"{name}: a reshape this analysis cannot follow")
            got.append(a)
            p = p * a
            if not _is_sym(e) and _is_sym(p):
                raise _NotBucketable(f"{name}: reshape mixes a dynamic dim into a static one")
        out.append(tuple(got))
    if any(a != 1 for a in flat):
        raise _NotBucketable(f"{name}: a reshape this analysis cannot follow")
    return out


def _broadcast_atoms(ins, out_shape, name):
    n = len(out_shape)
    out = []
    for k in range(n):
        cands = []
        for a in ins:
            j = k - (n - len(a))
            if j >= 0 and a[j] != ():
                cands.append(a[j])
        if not cands:
            out.append(_shape_atoms([out_shape[k]], "fresh")[0])
            continue
        first = cands[0]
        for c in cands[1:]:
            if c != first and (_dyn(c) or _dyn(first)):
                raise _NotBucketable(f"{name}: operands with differently built dynamic dims")
        out.append(first)
    return out


_IDENTITY_OPS = {
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default, aten.lift_fresh.default,
    aten.copy.default, torch.ops.prims.convert_element_type.default, aten.contiguous.default,
}
_RESHAPE_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default,
                aten._reshape_alias.default}
# reductions / row-wise normalisations: (dims argument position or None for "last"), static dims required
_REDUCE_DIMS = {
    aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten.amax.default: 1, aten.amin.default: 1,
    aten.var.correction: 1, aten.std.correction: 1, aten.logsumexp.default: 1, aten.any.dims: 1,
    aten.max.dim: 1, aten.min.dim: 1, aten.argmax.default: 1, aten.argmin.default: 1, aten.prod.dim_int: 1,
    aten._softmax.default: 1, aten._log_softmax.default: 1, aten.softmax.int: 1, aten.log_softmax.int: 1,
    aten._softmax_backward_data.default: 2, aten._log_softmax_backward_data.default: 2,
}
_MATMUL = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
           aten.baddbmm.default: (1, 2)}


def _dims_arg(v, ndim):
    if v is None:
        return list(range(ndim))
    if isinstance(v, int):
        v = [v]
    v = list(v)
    return [_norm_dim(int(d), ndim) for d in v] if v else list(range(ndim))


def _node_atoms(node, A):
    """Atoms of ``node``'s result(s) (a list of dims, or a list of those for tuple results)."""
    t = node.target
    name = _qualname(t) if isinstance(t, torch._ops.OpOverload) else str(t)
    val = node.meta.get("val")

    def at(a):
        return A.get(a) if isinstance(a, torch.fx.Node) else None

    tensor_args = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                   if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    if not any(_dyn(a) for x in tensor_args for a in (A.get(x) or ())):
        # nothing dynamic flows in: fresh atoms from the result's own (possibly symbolic) shape
        # (factories like full([s0, 4]) or arange(s0) fill their padding with defined values)
        if isinstance(val, torch.Tensor):
            return _shape_atoms(val.shape, "fresh")
        if isinstance(val, (list, tuple)):
            return [_shape_atoms(v.shape, "fresh") if isinstance(v, torch.Tensor) else None for v in val]
        return None
    if t is operator.getitem:
        src = A[node.args[0]]
        return src[node.args[1]]
    if not isinstance(t, torch._ops.OpOverload):
        raise _NotBucketable(f"{name} on dynamic tensors")
    args = _bind(t, node.args, node.kwargs)
    x = at(args[0]) if args else None
    if t in _IDENTITY_OPS:
        return x
    if torch.Tag.pointwise in t.tags:
        ins = [A[a] for a in tensor_args]
        return _broadcast_atoms(ins, val.shape, name)
    if t in _RESHAPE_OPS:
        return _reshape_atoms(x, val.shape, name)
    if t in (aten.permute.default,):
        return [x[_norm_dim(d, len(x))] for d in args[1]]
    if t is aten.transpose.int:
        a, b = _norm_dim(args[1], len(x)), _norm_dim(args[2], len(x))
        y = list(x)
        y[a], y[b] = y[b], y[a]
        return y
    if t is aten.t.default:
        return list(reversed(x)) if len(x) == 2 else x
    if t is aten.unsqueeze.default:
        y = list(x)
        y.insert(_norm_dim(args[1], len(x) + 1), ())
        return y
    if t in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        return _reshape_atoms(x, val.shape, name)
    if t in (aten.expand.default, aten.expand_copy.default):
        lead = len(val.shape) - len(x)
        y = _shape_atoms(val.shape[:lead], "fresh")
        for k, a in enumerate(x):
            y.append(a if a != () else _shape_atoms([val.shape[lead + k]], "fresh")[0])
        return y
    if t is aten.slice.Tensor:
        d = _norm_dim(args[1], len(x))
        if not _dyn(x[d]):
            y = list(x)
            y[d] = _shape_atoms([val.shape[d]], "fresh")[0]
            return y
        start, step = args[2], args[4]
        if not isinstance(start, int) and start is not None or (start or 0) < 0 or len(x[d]) != 1 or step < 1:
            raise _NotBucketable(f"{name}: slice of a dynamic dim not from a fixed start")
        y = list(x)
        y[d] = _shape_atoms([val.shape[d]], "fresh")[0]  # the prefix of the result is the real part
        return y
    if t is aten.select.int:
        d = _norm_dim(args[1], len(x))
        if _dyn(x[d]) and not (isinstance(args[2], int) and args[2] >= 0):
            raise _NotBucketable(f"{name}: select from the end of a dynamic dim")
        return x[:d] + x[d + 1:]
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
        d = _norm_dim(args[2] if t is not aten.unbind.int else args[1], len(x))
        if _dyn(x[d]):
            raise _NotBucketable(f"{name} along a dynamic dim")
        outs = []
        for v in val:
            y = list(x)
            if t is aten.unbind.int:
                y.pop(d)
            else:
                y[d] = _shape_atoms([v.shape[d]], "fresh")[0]
            outs.append(y)
        return outs
    if t is aten.cat.default:
        parts = [A[a] for a in args[0]]
        nd = len(val.shape)
        parts = [p for p in parts if len(p) == nd]
        d = _norm_dim(args[1], nd)
        if any(_dyn(p[d]) for p in parts):
            raise _NotBucketable(f"{name} along a dynamic dim")
        ins = [p[:d] + [()] + p[d + 1:] for p in parts]
        y = _broadcast_atoms(ins, val.shape, name)
        y[d] = _shape_atoms([val.shape[d]], "fresh")[0]
        return y
    if t in _REDUCE_DIMS:
        pos = _REDUCE_DIMS[t]
        src = at(args[pos - 1]) if pos == 2 else x
        nd = len(src)
        dims = _dims_arg(args[pos], nd)
        if any(_dyn(src[d]) for d in dims):
            raise _NotBucketable(f"{name} reduces over a dynamic dim")
        if isinstance(val, torch.Tensor):
            if len(val.shape) == nd:
                return [() if d in dims and len(val.shape) and _expr(val.shape[d]) == 1 else src[d] for d in range(nd)]
            return [src[d] for d in range(nd) if d not in dims]
        outs = []
        for v in val:
            outs.append([src[d] for d in range(nd) if d not in dims] if len(v.shape) < nd else
                        [() if _expr(v.shape[d]) == 1 and d in dims else src[d] for d in range(nd)])
        return outs
    if t is aten.cumsum.default:
        return x  # prefix sums of a right-padded dim: the real prefix is unchanged
    if t in _MATMUL:
        ia, ib = _MATMUL[t]
        a, b = at(args[ia]), at(args[ib])
        if _dyn(a[-1]) or _dyn(b[-2]):
            raise _NotBucketable(f"{name} contracts over a dynamic dim")
        y = a[:-1] + [b[-1]]
        if t in (aten.addmm.default, aten.baddbmm.default):
            y = _broadcast_atoms([y, at(args[0])], val.shape, name)
        return y
    if t is aten.embedding.default:
        w, idx = at(args[0]), at(args[1])
        if _dyn(w[1]):
            raise _NotBucketable(f"{name}: dynamic embedding width")
        return idx + [w[1]]
    if t is aten.native_layer_norm.default:
        k = len(args[1])
        if any(_dyn(a) for a in x[len(x) - k:]):
            raise _NotBucketable(f"{name} normalises over a dynamic dim")
        stats = x[:len(x) - k] + [()] * k
        return [x, stats, stats]
    if t is _SDPA:
        q, k_, v_ = at(args[0]), at(args[1]), at(args[2])
        causal = args[5]
        if args[3] is not None or not causal or q[-2] != k_[-2] or len(q[-2]) != 1:
            raise _NotBucketable(f"{name}: attention over a dynamic key dim needs is_causal=True "
                                 "and equal query/key lengths")
        if any(_dyn(a) for a in (q[-1], k_[-1], v_[-1])) or q[:-2] != k_[:-2] or k_[:-1] != v_[:-1]:
            raise _NotBucketable(f"{name}: dynamic head or batch layout this analysis cannot follow")
        outs = [q[:-1] + [v_[-1]], q[:-1]]
        for v in val[2:]:
            outs.append(_shape_atoms(v.shape, "fresh") if isinstance(v, torch.Tensor) else None)
        if _dyn([a for o in outs[2:] if o for d in o for a in d]):
            raise _NotBucketable(name)
        return outs
    raise _NotBucketable(f"{name} is not known to be padding-safe on dynamic dims")


def _pad_unsafe_reason(prog):
    """None if padding the graph's dynamic dims leaves the real part of every output unchanged,
    else why not (the graph then compiles per size)."""
    if prog.mutated:
        return "it writes into an input (the write-back would need the real size)"
    A = {}
    try:
        for n in prog.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                A[n] = _shape_atoms(v.shape, "an input") if isinstance(v, torch.Tensor) else None
            elif n.op == "get_attr":
                t = getattr(prog.gm, n.target)
                A[n] = _shape_atoms(t.shape, "fresh") if isinstance(t, torch.Tensor) else None
            elif n.op == "call_function":
                if _kind(n) in ("py", "sym"):
                    A[n] = None
                    continue
                A[n] = _node_atoms(n, A)
            elif n.op == "output":
                for o in pytree.tree_leaves(n.args[0]):
                    if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                        for dim in A[o]:
                            if _dyn(dim[1:]) or (dim and not _is_sym(dim[0]) and _dyn(dim)):
                                raise _NotBucketable(
                                    "an output has a dim merging a static dim outside a dynamic one")
    except _NotBucketable as e:
        return str(e)
    return None


# ---------------------------------------------------------------- the runtime
class _Entry:
    """Executables of one graph at one set of static inputs (and one bucket)."""

    __slots__ = ("plain", "donating", "static_outs")

    def __init__(self):
        self.plain = self.donating = None
        self.static_outs = None


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
        if buf.shape == t.shape and t.is_contiguous() and t.storage_offset() == 0:
            return buf, True
        return registry.logical_value(t), False
    return _input_value(t), False


class _GraphProgram:
    """One FX graph as one jitted JAX function of a flat list of arrays (tensor inputs, then
    random keys). Input mutations the graph carries (``copy_`` into a placeholder) are computed
    inside it and written back with one storage swap per input, its old buffer donated."""

    def __init__(self, gm: torch.fx.GraphModule, policy=None, label="compiled graph"):
        self.gm = gm
        self.label = label  # metrics key: one per Dynamo frame and role, so recompiles of THIS graph count
        self.nodes = list(gm.graph.nodes)
        self.phs = [n for n in self.nodes if n.op == "placeholder"]
        self.random_nodes = [n for n in self.nodes if n.op == "call_function" and _is_random(n)]
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
            if isinstance(v, torch.SymInt) and _is_sym(_expr(v)) and _expr(v).is_Symbol:
                self.sym_sources.setdefault(_expr(v), (i, None))
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    e = _expr(s)
                    if _is_sym(e) and e.is_Symbol:
                        self.sym_sources.setdefault(e, (i, d))
        self.dynamic = any(
            _is_sym(_expr(s)) for v in vals if isinstance(v, torch.Tensor) for s in v.shape
        ) or any(isinstance(v, torch.SymInt) for v in vals)
        self.policy = policy
        self.unsafe = _pad_unsafe_reason(self) if self.dynamic else None
        self._entries = {}
        self._warned = False

    # ---- tracing
    def _run(self, flat, statics, env, entry):
        global _trace_env
        _trace_env = env
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
                kind = _kind(node)
                if kind == "getitem":
                    env_nodes[node] = args[0][args[1]]
                    continue
                if kind == "py":
                    env_nodes[node] = node.target(*args, **kwargs)
                    continue
                if kind == "sym":
                    env_nodes[node] = _SYM_OPS[node.target](*args)
                    continue
                if kind == "copy":
                    dst = node.args[0]
                    dv = node.meta["val"]
                    res = jnp.broadcast_to(jnp.asarray(args[1]).astype(dtypes.to_jax(dv.dtype)),
                                           _val_shape(dv, env))
                    env_nodes[node] = env_nodes[dst] = res
                    mutations[self.ph_pos[dst]] = res
                    continue
                if kind == "rng":
                    save = node.target is _RUN_AND_SAVE_RNG
                    inner = node.args[0] if save else node.args[1]
                    vals = _bind(inner, args[1:] if save else args[2:], kwargs)
                    val = node.meta["val"][1] if save else node.meta["val"]
                    state_val = node.meta["val"][0] if save else node.args[0].meta["val"]
                    kw = {}
                    if save and _is_random(node):
                        kd = keys[ki]
                        ki += 1
                        kw["key"] = jax.random.wrap_key_data(kd)
                        state = _key_to_rng_state(kd, state_val, env)
                    elif save:
                        state = jnp.zeros(_val_shape(state_val, env), jnp.uint8)
                    elif _op_is_random(inner, node.args[2:], node.kwargs):
                        kw["key"] = jax.random.wrap_key_data(_rng_state_to_key(args[0]))
                    meta = _OpMeta(val)
                    if inner in _VIEWS:
                        res = _VIEWS[inner](meta, *vals, **kw)
                    else:
                        res = registry.LOWERINGS[_qualname(inner)].fn(*vals, **kw)
                    res = self._fix(meta, res, env)
                    env_nodes[node] = (state, res) if save else res
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
                env_nodes[node] = self._fix(node, res, env)
            elif op == "output":
                outs = [get(o) for o in self.out_leaves]
                entry.static_outs = [None if info is not None else o for o, info in zip(outs, self.out_info)]
                arrays = tuple(o for o, info in zip(outs, self.out_info) if info is not None)
                return arrays, tuple(mutations[i] for i in self.mutated)
            else:
                raise NotImplementedError(f"torchtpu compile: FX node kind {op}")

    @staticmethod
    def _fix(node, res, env):
        """Cast each result to the dtype (and shape) PyTorch's meta gives, as the eager registry does."""
        val = node.meta.get("val")
        if val is None:
            return res
        if isinstance(val, torch.Tensor):
            if isinstance(res, (list, tuple)) and len(res) == 1:
                res = res[0]
            return _GraphProgram._fix_leaf(res, val, env)
        if isinstance(val, (list, tuple)):
            return [_GraphProgram._fix_leaf(r, v, env) for r, v in zip(res, val)]
        return res

    @staticmethod
    def _fix_leaf(r, v, env):
        if isinstance(v, torch.Tensor) and r is not None:
            o = jnp.asarray(r)
            shape = _val_shape(v, env)
            if tuple(o.shape) != shape:
                if o.ndim == 0:
                    o = jnp.broadcast_to(o, shape)
                elif o.size == math.prod(shape):
                    o = o.reshape(shape)
                else:
                    raise _NotBucketable(f"a result of shape {tuple(o.shape)} where {shape} was expected")
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
            return self._run(flat, statics, env, e)

        if donate:
            e.donating = jax.jit(fn, donate_argnums=self.donate_pos)
            return e.donating
        e.plain = jax.jit(fn)
        return e.plain

    # ---- calling
    def __call__(self, args):
        if lazy.pending_count():  # the graph reads (and may donate) buffers pending work holds
            lazy.flush("compiled graph")
        if self.dynamic:
            return self._call_dynamic(args)
        statics = {i: args[i] for i in self.static_idx}
        key = tuple(_static_key(args[i]) for i in self.static_idx)
        return self._execute(args, key, statics, {}, None, None)

    def _execute(self, args, key, statics, env, pad_to, real_env):
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
        if fn is e.donating and e.plain is None and e.static_outs is None:
            with warnings.catch_warnings():  # XLA CPU may decline a donation: harmless
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                outs, muts = fn(*arrays, *keys)
        else:
            outs, muts = fn(*arrays, *keys)
        if muts:
            _write_back([args[i] for i in self.mutated], muts, mut_whole)
        if self._all_tensor_outs and real_env is None:  # the common case: every output a tensor
            return [_wrap_array(o, info) for o, info in zip(outs, self.out_info)]
        res = []
        it = iter(outs)
        for k, info in enumerate(self.out_info):
            if info is None:
                v = self.out_leaves[k].meta.get("val") if isinstance(self.out_leaves[k], torch.fx.Node) else None
                if real_env is not None and isinstance(v, torch.SymInt):
                    res.append(_eval(_expr(v), real_env))
                else:
                    res.append(e.static_outs[k])
                continue
            o = next(it)
            if real_env is not None:
                real = _val_shape(self.out_leaves[k].meta["val"], real_env)
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
            statics[i] = _eval(_expr(v), env) if isinstance(v, torch.SymInt) else args[i]
        key = tuple(_static_key(statics[i]) for i in self.static_idx) + tuple(bvals[s] for s in self.sym_sources)
        scope = tuple((str(s), bvals[s]) for s in self.sym_sources)
        with metrics.bucket_scope(scope):
            if not bucketed:
                return self._execute(args, key, statics, env, None, None)
            pad_to = {i: _val_shape(vals[i], env) for i in self.tensor_idx}
            try:
                return self._execute(args, key, statics, env, pad_to, real_env)
            except _NotBucketable as err:  # found while tracing (e.g. a slice shorter than the bucket)
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


def _static_key(v):
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


_SYM_OPS = {
    aten.sym_size.int: lambda x, d: x.shape[d],
    aten.sym_numel.default: lambda x: x.size,
    aten.sym_stride.int: lambda x, d: storage.contiguous_strides(x.shape)[d],
    aten.sym_storage_offset.default: lambda x: 0,
}


def _write_back(targets, values, whole):
    """Store the graph's new values of its mutated inputs (in-place updates made by the graph)."""
    bumped, host = [], []
    for t, v, w in zip(targets, values, whole):
        if t.device.type == "tpu":
            if w:
                storage.storage_data(t).buf = v  # one swap; every view of the storage sees it
            else:
                from .ops.core import _write_value

                _write_value(t, v)
            bumped.append(t)
        else:
            host.append((t, v))
    if bumped:
        torch._C._increment_version(bumped)  # as an eager in-place op would (autograd's saved-tensor checks)
    if host:
        vals = jax.device_get([v for _, v in host])  # one transfer for all host-side inputs
        with torch.no_grad():
            for (t, _), v in zip(host, vals):
                t.copy_(storage.host_to_cpu_tensor(np.asarray(v), t.dtype).reshape(t.shape))


def _wrap_array(o, info):
    dtype, on_cpu, dev = info
    if on_cpu:
        # e.g. an optimizer's CPU step counter: the output lives where PyTorch says
        return storage.host_to_cpu_tensor(np.asarray(jax.device_get(o)), dtype).reshape(tuple(o.shape)).to(dev)
    return storage.new_tensor(o.shape, dtype, o)


def _constant_value(t):
    if isinstance(t, torch.Tensor):
        return _input_value(t)
    return t


def _input_value(a):
    if isinstance(a, torch.Tensor):
        if a.device.type == "tpu":
            return registry.logical_value(a)
        # a numpy copy goes straight into the jitted call (no eager jax op; not aliasing the tensor)
        return np.array(dtypes.cpu_tensor_to_numpy(a.detach().contiguous())).reshape(tuple(a.shape))
    return a


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

    _fill_rng_meta(gm)
    prog = _GraphProgram(gm, policy or _default_policy(), label or graph_label())

    def run(args):
        out = prog(args)
        args.clear()  # boxed convention: inputs may be freed early
        return out

    run._boxed_call = True
    run.program = prog
    return run


def _default_policy():
    from .bucketing import BucketPolicy

    return BucketPolicy.pow2(1, 1 << 16, overflow="split")


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

    options = dict(kwargs.pop("options", None) or {})
    kwargs.pop("mode", None)
    policy = options.pop("bucket_policy", None)
    if options:
        raise ValueError(f"torchtpu compile: unknown option(s) {sorted(options)}; known: ['bucket_policy']")
    if policy is not None:
        from .bucketing import BucketPolicy

        if not isinstance(policy, BucketPolicy):
            raise TypeError(f"torchtpu compile: options['bucket_policy'] must be a torchtpu.bucketing.BucketPolicy, "
                            f"not {type(policy).__name__}")
    # labels now: the backward may be compiled lazily, outside Dynamo's compile context
    comp = {role: functools.partial(compile_graph, policy=policy, label=graph_label(role))
            for role in ("forward", "backward", "inference")}
    backend = aot_autograd(
        fw_compiler=comp["forward"],
        bw_compiler=comp["backward"],
        inference_compiler=comp["inference"],
        decompositions=decompositions(),
        # optimizer steps and buffer updates stay inside the graph: one executable computes
        # them and the runtime swaps each input's buffer (donated) instead of copying back op by op
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs, **kwargs)


def _skip_runtime_code() -> None:
    """Keep Dynamo out of JAX and of torchtpu's runtime.

    Eager pieces run between graphs (graph breaks, ``loss.backward()``) call
    torchtpu's Python kernels from C++ while Dynamo's frame hook is set; without
    this Dynamo would try to trace jax.numpy inside them. Model code (including
    ``torchtpu_models``) lives outside the package and stays traceable.
    """
    from torch._dynamo import trace_rules

    for name in ("jax", "jaxlib", "torchtpu"):
        trace_rules.add(name)


def _capturable_tpu_optimizers() -> None:
    """Compiled optimizers on tpu keep their step counters on the device, as on cuda/xpu.

    When Dynamo traces ``optimizer.step()`` it sets ``capturable=True`` on param groups whose
    params are all on cuda/xpu and have no state yet, so ``state["step"]`` is created on the
    device. tpu params are left out by that check: their counters would stay CPU tensors,
    which the optimizer graph updates as host outputs, a device-to-host transfer (and a wait
    for the whole executable) per counter and step. This extends the check to tpu.
    """
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:  # a torch without Dynamo's optimizer support: nothing to extend
        return
    orig = getattr(OptimizerVariable, "_set_capturable", None)
    if orig is None or getattr(orig, "_torchtpu", False):
        return

    def _set_capturable(self, tx):
        opt = self.value
        for group in opt.param_groups:
            params = group.get("params", [])
            if ("capturable" in group and params and all(p.device.type == "tpu" for p in params)
                    and not any(p in opt.state for p in params)):
                group["capturable"] = True
        return orig(self, tx)

    _set_capturable._torchtpu = True
    OptimizerVariable._set_capturable = _set_capturable


def register() -> None:
    from torch._dynamo import list_backends, register_backend

    _skip_runtime_code()
    _capturable_tpu_optimizers()
    if "tpu" not in list_backends(exclude_tags=()):
        register_backend(name="tpu")(tpu_backend)


register()
