"""The FX-node lowering table of compiled graphs: how each ``call_function`` node of an
AOTAutograd graph is computed inside the graph's one ``jax.jit``.

Most aten ops run their eager lowering (``dispatch.lowering.LOWERINGS``), so every op has one
source of truth. View ops, metadata-only kernels in eager mode, are plain value ops in a
functional graph and are written here (``FUNCTIONAL``), with the factories (shape and dtype
from the node's FakeTensor), SDPA's overrideable overloads, integer advanced indexing and the
symbolic-size ops (``SYM_OPS``).
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import torch
import torch._guards
from torch.utils import _pytree as pytree

from ..base import dtypes
from ..base.opnames import qualified_name
from ..dispatch.lowering import LOWERINGS
from ..ops.indexing import advanced_index, advanced_index_put
from ..runtime import layout

aten = torch.ops.aten


def norm_dim(d, n):
    return d + n if d < 0 else d


def _slice(x, dim=0, start=None, end=None, step=1):
    dim = norm_dim(dim, x.ndim)
    return x[(slice(None),) * dim + (slice(start, end, step),)]


def _select(x, dim, index):
    dim = norm_dim(dim, x.ndim)
    return x[(slice(None),) * dim + (index,)]


def _squeeze(x, dims=None):
    if dims is None:
        dims = range(x.ndim)
    elif isinstance(dims, int):
        dims = [dims]
    keep = tuple(norm_dim(d, max(x.ndim, 1)) for d in dims)
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
    dim = norm_dim(dim, x.ndim)
    idx, acc = [], 0
    for n in sizes[:-1]:
        acc += int(n)
        idx.append(acc)
    return list(jnp.split(x, idx, axis=dim))


def _split(x, split_size, dim=0):
    dim = norm_dim(dim, x.ndim)
    n = x.shape[dim]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if n else [0]
    return _split_sizes(x, sizes, dim)


def _unbind(x, dim=0):
    dim = norm_dim(dim, x.ndim)
    return [_select(x, dim, i) for i in range(x.shape[dim])]


def _as_strided(x, size, stride, storage_offset=None):
    # in a functional graph the base is the (contiguous) value of the input
    return layout.read(x.reshape(-1), (tuple(size), tuple(stride), storage_offset or 0))


def _t(x):
    return x if x.ndim < 2 else jnp.swapaxes(x, 0, 1)


def _full(out, fill):
    shape, dt = out()
    return jnp.full(shape, fill, dt)


# op -> fn(out, *bound_args) computing the node's value, where ``out()`` gives the (shape, jax dtype)
# of the node's result (factories read it). Views are copies here: the graph is functional.
FUNCTIONAL = {
    aten.view.default: lambda out, x, size: x.reshape(tuple(size)),
    aten._unsafe_view.default: lambda out, x, size: x.reshape(tuple(size)),
    aten.reshape.default: lambda out, x, size: x.reshape(tuple(size)),
    aten.view_copy.default: lambda out, x, size: x.reshape(tuple(size)),
    aten._reshape_alias.default: lambda out, x, size, stride: x.reshape(tuple(size)),
    aten.t.default: lambda out, x: _t(x),
    aten.transpose.int: lambda out, x, a, b: jnp.swapaxes(x, a, b),
    aten.permute.default: lambda out, x, dims: jnp.transpose(x, [norm_dim(d, x.ndim) for d in dims]),
    aten.expand.default: lambda out, x, size, implicit=False: _expand(x, size),
    aten.expand_copy.default: lambda out, x, size, implicit=False: _expand(x, size),
    aten.slice.Tensor: lambda out, x, dim=0, start=None, end=None, step=1: _slice(x, dim, start, end, step),
    aten.select.int: lambda out, x, dim, index: _select(x, dim, index),
    aten.squeeze.default: lambda out, x: _squeeze(x),
    aten.squeeze.dim: lambda out, x, dim: _squeeze(x, dim),
    aten.squeeze.dims: lambda out, x, dims: _squeeze(x, dims),
    aten.unsqueeze.default: lambda out, x, dim: jnp.expand_dims(x, dim),
    aten.as_strided.default: lambda out, x, size, stride, off=None: _as_strided(x, size, stride, off),
    aten.alias.default: lambda out, x: x,
    aten.detach.default: lambda out, x: x,
    aten.lift_fresh.default: lambda out, x: x,
    aten.split.Tensor: lambda out, x, s, dim=0: _split(x, s, dim),
    aten.split_with_sizes.default: lambda out, x, s, dim=0: _split_sizes(x, s, dim),
    aten.unbind.int: lambda out, x, dim=0: _unbind(x, dim),
    aten.diagonal.default: lambda out, x, off=0, d1=0, d2=1: jnp.diagonal(
        x, off, norm_dim(d1, x.ndim), norm_dim(d2, x.ndim)
    ),
    # factories: shape and dtype come from the node's FakeTensor
    aten.full.default: lambda out, size, fill, *rest: _full(out, fill),
    aten.zeros.default: lambda out, size, *rest: _full(out, 0),
    aten.ones.default: lambda out, size, *rest: _full(out, 1),
    aten.empty.memory_format: lambda out, size, *rest: _full(out, 0),
    aten.empty_strided.default: lambda out, size, stride, *rest: _full(out, 0),
    aten.full_like.default: lambda out, x, fill, *rest: _full(out, fill),
    aten.zeros_like.default: lambda out, x, *rest: _full(out, 0),
    aten.ones_like.default: lambda out, x, *rest: _full(out, 1),
    aten.empty_like.default: lambda out, x, *rest: _full(out, 0),
    aten.new_zeros.default: lambda out, x, size, *rest: _full(out, 0),
    aten.new_ones.default: lambda out, x, size, *rest: _full(out, 1),
    aten.new_empty.default: lambda out, x, size, *rest: _full(out, 0),
    aten.new_full.default: lambda out, x, size, fill, *rest: _full(out, fill),
    aten.new_empty_strided.default: lambda out, x, size, stride, *rest: _full(out, 0),
}


def _eye(out, *rest):
    shape, dt = out()
    return jnp.eye(shape[0], shape[1], dtype=dt)


FUNCTIONAL[aten.eye.default] = _eye
FUNCTIONAL[aten.eye.m] = _eye


# random factories: the same distributions as the eager uniform_/normal_ lowerings, with
# a fresh key per call (a graph input), shape and dtype from the node's FakeTensor
def _rand_factory(lowering, *params):
    def fn(out, *args, key=None):
        shape, dt = out()
        return LOWERINGS[lowering].fn(jnp.zeros(shape, dt), *params, None, key=key)

    return fn


_RANDOM_FACTORIES = {
    aten.rand_like.default: _rand_factory("aten::uniform.default", 0.0, 1.0),
    aten.rand.default: _rand_factory("aten::uniform.default", 0.0, 1.0),
    aten.randn_like.default: _rand_factory("aten::normal_functional.default", 0.0, 1.0),
    aten.randn.default: _rand_factory("aten::normal_functional.default", 0.0, 1.0),
}
FUNCTIONAL.update(_RANDOM_FACTORIES)


# SDPA on tpu routes to the overload PyTorch reserves for out-of-tree backends; in a graph it
# runs the same torchtpu::sdpa_* lowerings as the eager kernels in ops/nn.py
def _sdpa_fwd(result_type, q, k, v, bias=None, dropout_p=0.0, is_causal=False, debug=False, scale=None, key=None):
    if dropout_p > 0:
        out, lse, seed = LOWERINGS["torchtpu::sdpa_fwd_dropout.default"].fn(
            q, k, v, bias, dropout_p, is_causal, scale, key=key)
    else:
        out, lse, seed = LOWERINGS["torchtpu::sdpa_fwd.default"].fn(q, k, v, bias, is_causal, scale)
    if lse.ndim == 2:  # 3-D (H, L, E) input: PyTorch's lse is (1, H, L)
        lse = lse[None]
    return out, lse, None, None, q.shape[-2], k.shape[-2], seed, jnp.zeros((), jnp.int64), None


def _sdpa_bwd(result_type, grad_out, q, k, v, bias, mask, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset,
              scale=None):
    if q.ndim == 3:
        lse = lse[0]
    gq, gk, gv, gb = LOWERINGS["torchtpu::sdpa_bwd.default"].fn(
        grad_out, q, k, v, bias, lse, seed, dropout_p, is_causal, scale, list(mask))
    gb = None if bias is None or gb.size == 0 else gb
    return tuple(g if m else None for g, m in zip((gq, gk, gv, gb), mask))


# advanced indexing (eager: hand-written kernels that expand masks first); integer indices only, through
# the eager kernels' lowerings (negative indices wrapped, out-of-range ones checked on the device)
FUNCTIONAL[aten.index.Tensor] = lambda out, x, indices: advanced_index(x, indices)
FUNCTIONAL[aten.index_put.default] = lambda out, x, indices, values, accumulate=False: (
    advanced_index_put(x, indices, values, accumulate))
_INT_INDEX_ONLY = (aten.index.Tensor, aten.index_put.default)


def _int_indices(node) -> bool:
    idx = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
    for i in idx:
        v = i.meta.get("val") if isinstance(i, torch.fx.Node) else i
        if isinstance(v, torch.Tensor) and (v.dtype == torch.bool or v.dtype == torch.uint8):
            return False  # a mask's result shape depends on values: eager
    return True


# prims that the decompositions emit
FUNCTIONAL[torch.ops.prims.convert_element_type.default] = lambda out, x, dtype: jnp.asarray(x).astype(dtypes.to_jax(dtype))


SDPA = aten._scaled_dot_product_fused_attention_overrideable.default
FUNCTIONAL[SDPA] = _sdpa_fwd
FUNCTIONAL[aten._scaled_dot_product_fused_attention_overrideable_backward.default] = _sdpa_bwd


def is_random(node) -> bool:
    """The node takes a fresh random key (a graph input)."""
    t = node.target
    if t is RUN_AND_SAVE_RNG:
        return op_is_random(node.args[0], node.args[1:], node.kwargs)
    if t is RUN_WITH_RNG:
        return False  # replays the key its run_and_save_rng_state twin saved
    return op_is_random(t, node.args, node.kwargs)


def op_is_random(t, args, kwargs) -> bool:
    if t is SDPA:
        return bind_args(t, args, kwargs)[4] > 0
    if t in _RANDOM_FACTORIES:
        return True
    return (isinstance(t, torch._ops.OpOverload) and t not in FUNCTIONAL and qualified_name(t) in LOWERINGS
            and LOWERINGS[qualified_name(t)].random)


# Activation checkpointing (torch.utils.checkpoint traced by Dynamo, e.g. Hugging Face's
# gradient_checkpointing) recomputes the forward's random ops in the backward: AOTAutograd wraps
# each as run_and_save_rng_state(op, ...) -> (state, out) in the forward graph and
# run_with_rng_state(state, op, ...) in the backward one. The state tensor is shaped like
# torch.get_rng_state() (uint8); here it carries the op's random key in its first bytes, so the
# recompute draws the same numbers. (Ops tagged random that draw nothing, such as SDPA without
# dropout, save zeros.)
RUN_AND_SAVE_RNG = torch._prims.rng_prims.run_and_save_rng_state
RUN_WITH_RNG = torch._prims.rng_prims.run_with_rng_state


def rng_wrapped_op(node):
    """The op an rng HOP node wraps, and its own arguments."""
    if node.target is RUN_AND_SAVE_RNG:
        return node.args[0], node.args[1:]
    return node.args[1], node.args[2:]


def key_to_rng_state(key_data, shape):
    """A uint8 rng-state array of ``shape`` carrying random key ``key_data`` in its first bytes."""
    if math.prod(shape) < 8:
        raise NotImplementedError(f"torchtpu compile: an rng state of shape {shape} cannot carry a key")
    raw = jax.lax.bitcast_convert_type(jnp.asarray(key_data, jnp.uint32), jnp.uint8).reshape(-1)
    return jnp.zeros(shape, jnp.uint8).reshape(-1).at[:raw.shape[0]].set(raw).reshape(shape)


def rng_state_to_key(state):
    return jax.lax.bitcast_convert_type(jnp.asarray(state).reshape(-1)[:8].reshape(2, 4), jnp.uint32)


def fill_rng_meta(gm) -> None:
    """AOTAutograd leaves its rng HOP nodes without ``meta["val"]``: compute it (the wrapped op on
    the inputs' fake values; the saved state's from the getitem that reads it)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (RUN_AND_SAVE_RNG, RUN_WITH_RNG):
            continue
        save = n.target is RUN_AND_SAVE_RNG
        # the state's fake is sized by a symbol of its own (from_tensor under a shape env) that is no
        # graph input: give it torch.get_rng_state()'s concrete size, so the graph stays static
        holders = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0] if save else [n.args[0]]
        for h in holders:
            v = h.meta.get("val")
            if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
                h.meta["val"] = torch.empty(torch.get_rng_state().shape, dtype=v.dtype)
        if "val" in n.meta:
            continue
        inner, inner_args = rng_wrapped_op(n)
        args, kwargs = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
                                       (inner_args, n.kwargs))
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


def bind_args(op, args, kwargs):
    """All arguments of ``op`` in schema order (defaults filled in), as the kernel executor does."""
    out = list(args)
    for a in op._schema.arguments[len(args):]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        elif a.kwarg_only and a.type.kind() == "OptionalType":
            out.append(None)
        else:
            raise TypeError(f"{qualified_name(op)}: missing argument {a.name!r}")
    return out


OUT_DTYPE = torch.ops.higher_order.out_dtype


def run_out_dtype(op, output_dtype, *operands):
    """The ``out_dtype`` higher-order op (torchao's int8 matmul under torch.compile): ``op`` computed in
    ``output_dtype``; int8 mm -> int32 is one integer dot (``_int_mm``), as in the eager modes."""
    if op is aten.mm.default and output_dtype == torch.int32 and all(x.dtype == jnp.int8 for x in operands):
        return LOWERINGS["aten::_int_mm.default"].fn(*operands)
    out = dtypes.to_jax(output_dtype)
    common = jnp.result_type(*operands, out)
    return LOWERINGS[qualified_name(op)].fn(*bind_args(op, [x.astype(common) for x in operands], {})).astype(out)


def node_kind(node):
    """How a call_function node is executed: 'lower', 'view', 'getitem', 'copy', 'sym', 'rng' (a random op
    under activation checkpointing), 'out_dtype' (that higher-order op around a lowered op), 'py', or None
    (unsupported)."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if t is aten.copy_.default:
        # an input mutation AOTAutograd left in the graph (keep_inference_input_mutations)
        return "copy" if node.args[0].op == "placeholder" else None
    if t in SYM_OPS:
        return "sym"
    if t is OUT_DTYPE:
        inner = node.args[0]
        return "out_dtype" if isinstance(inner, torch._ops.OpOverload) and qualified_name(inner) in LOWERINGS else None
    if t is RUN_AND_SAVE_RNG or t is RUN_WITH_RNG:
        inner, _ = rng_wrapped_op(node)
        lowered = isinstance(inner, torch._ops.OpOverload) and (
            inner in FUNCTIONAL or qualified_name(inner) in LOWERINGS)
        return "rng" if lowered else None
    if isinstance(t, torch._ops.OpOverload):
        if t in FUNCTIONAL:
            if t in _INT_INDEX_ONLY and not _int_indices(node):
                return None
            return "view"
        if qualified_name(t) in LOWERINGS:
            return "lower"
        return None
    if t in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg, operator.truediv,
             operator.mod, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
             torch.sym_max, torch.sym_min, torch.sym_sum):
        return "py"  # symbolic-size arithmetic
    return None



SYM_OPS = {
    aten.sym_size.int: lambda x, d: x.shape[d],
    aten.sym_numel.default: lambda x: x.size,
    aten.sym_stride.int: lambda x, d: layout.contiguous_strides(x.shape)[d],
    aten.sym_storage_offset.default: lambda x: 0,
}

