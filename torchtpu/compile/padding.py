"""The padding prover: may a dynamic-shape graph's dynamic dims be padded to a bucket?

Each dim of each value is described by its "atoms": the sizes it is a row-major product of,
outermost first (ints are static; a sympy expression is a dynamic size). Padding a dynamic
atom at its end leaves every real element at the coordinates it has unpadded, and puts the
pad (garbage) in coordinates that only ever meet other garbage -- as long as no op mixes
elements along a dim holding a dynamic atom (a reduction, a contraction, a softmax) and no
reshape splits a dynamic atom. The analysis proves that for the ops it knows, and refuses
(the graph then compiles per size) everything else.
"""

from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree

from ..base.opnames import qualified_name
from .nodes import SDPA, bind_args, node_kind, norm_dim
from .shapes import NotBucketable, is_symbolic, size_expr

aten = torch.ops.aten

# Each dim of each value is described by its "atoms": the sizes it is a row-major product of,
# outermost first (ints are static; a sympy expression is a dynamic size). Padding a dynamic
# atom at its end leaves every real element at the coordinates it has unpadded, and puts the
# pad (garbage) in coordinates that only ever meet other garbage -- as long as no op mixes
# elements along a dim holding a dynamic atom (a reduction, a contraction, a softmax) and no
# reshape splits a dynamic atom. The analysis below proves that for the ops it knows, and
# refuses (the graph then compiles per size) everything else.

def _dyn(atoms) -> bool:
    return any(is_symbolic(a) for a in atoms)


def _shape_atoms(shape, what):
    out = []
    for s in shape:
        e = size_expr(s)
        if not is_symbolic(e):
            out.append(() if e == 1 else (e,))
        elif e.is_Symbol or what == "fresh":
            out.append((e,))
        else:
            raise NotBucketable(f"{what} has a dim of compound dynamic size {e}")
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
        e = size_expr(s)
        if e == 1:
            out.append(())
            continue
        got, p = [], 1
        while not _same_size(p, e):
            if not flat:
                raise NotBucketable(f"{name}: a reshape this analysis cannot follow")
            a = flat.pop(0)
            if not is_symbolic(a) and not is_symbolic(e):
                need = e // p if e % p == 0 else 0
                if need and a > need and a % need == 0:  # split a static atom
                    flat.insert(0, a // need)
                    a = need
                elif not need or need % a:
                    raise NotBucketable(f"{name}: a reshape this analysis cannot follow")
            got.append(a)
            p = p * a
            if not is_symbolic(e) and is_symbolic(p):
                raise NotBucketable(f"{name}: reshape mixes a dynamic dim into a static one")
        out.append(tuple(got))
    if any(a != 1 for a in flat):
        raise NotBucketable(f"{name}: a reshape this analysis cannot follow")
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
                raise NotBucketable(f"{name}: operands with differently built dynamic dims")
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
    return [norm_dim(int(d), ndim) for d in v] if v else list(range(ndim))


def _node_atoms(node, A):
    """Atoms of ``node``'s result(s) (a list of dims, or a list of those for tuple results)."""
    t = node.target
    name = qualified_name(t) if isinstance(t, torch._ops.OpOverload) else str(t)
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
        raise NotBucketable(f"{name} on dynamic tensors")
    args = bind_args(t, node.args, node.kwargs)
    x = at(args[0]) if args else None
    if t in _IDENTITY_OPS:
        return x
    if torch.Tag.pointwise in t.tags:
        ins = [A[a] for a in tensor_args]
        return _broadcast_atoms(ins, val.shape, name)
    if t in _RESHAPE_OPS:
        return _reshape_atoms(x, val.shape, name)
    if t in (aten.permute.default,):
        return [x[norm_dim(d, len(x))] for d in args[1]]
    if t is aten.transpose.int:
        a, b = norm_dim(args[1], len(x)), norm_dim(args[2], len(x))
        y = list(x)
        y[a], y[b] = y[b], y[a]
        return y
    if t is aten.t.default:
        return list(reversed(x)) if len(x) == 2 else x
    if t is aten.unsqueeze.default:
        y = list(x)
        y.insert(norm_dim(args[1], len(x) + 1), ())
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
        d = norm_dim(args[1], len(x))
        if not _dyn(x[d]):
            y = list(x)
            y[d] = _shape_atoms([val.shape[d]], "fresh")[0]
            return y
        start, step = args[2], args[4]
        if not isinstance(start, int) and start is not None or (start or 0) < 0 or len(x[d]) != 1 or step < 1:
            raise NotBucketable(f"{name}: slice of a dynamic dim not from a fixed start")
        y = list(x)
        y[d] = _shape_atoms([val.shape[d]], "fresh")[0]  # the prefix of the result is the real part
        return y
    if t is aten.select.int:
        d = norm_dim(args[1], len(x))
        if _dyn(x[d]) and not (isinstance(args[2], int) and args[2] >= 0):
            raise NotBucketable(f"{name}: select from the end of a dynamic dim")
        return x[:d] + x[d + 1:]
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
        d = norm_dim(args[2] if t is not aten.unbind.int else args[1], len(x))
        if _dyn(x[d]):
            raise NotBucketable(f"{name} along a dynamic dim")
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
        d = norm_dim(args[1], nd)
        if any(_dyn(p[d]) for p in parts):
            raise NotBucketable(f"{name} along a dynamic dim")
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
            raise NotBucketable(f"{name} reduces over a dynamic dim")
        if isinstance(val, torch.Tensor):
            if len(val.shape) == nd:
                return [() if d in dims and len(val.shape) and size_expr(val.shape[d]) == 1 else src[d] for d in range(nd)]
            return [src[d] for d in range(nd) if d not in dims]
        outs = []
        for v in val:
            outs.append([src[d] for d in range(nd) if d not in dims] if len(v.shape) < nd else
                        [() if size_expr(v.shape[d]) == 1 and d in dims else src[d] for d in range(nd)])
        return outs
    if t is aten.cumsum.default:
        return x  # prefix sums of a right-padded dim: the real prefix is unchanged
    if t in _MATMUL:
        ia, ib = _MATMUL[t]
        a, b = at(args[ia]), at(args[ib])
        if _dyn(a[-1]) or _dyn(b[-2]):
            raise NotBucketable(f"{name} contracts over a dynamic dim")
        y = a[:-1] + [b[-1]]
        if t in (aten.addmm.default, aten.baddbmm.default):
            y = _broadcast_atoms([y, at(args[0])], val.shape, name)
        return y
    if t is aten.embedding.default:
        w, idx = at(args[0]), at(args[1])
        if _dyn(w[1]):
            raise NotBucketable(f"{name}: dynamic embedding width")
        return idx + [w[1]]
    if t is aten.native_layer_norm.default:
        k = len(args[1])
        if any(_dyn(a) for a in x[len(x) - k:]):
            raise NotBucketable(f"{name} normalises over a dynamic dim")
        stats = x[:len(x) - k] + [()] * k
        return [x, stats, stats]
    if t is SDPA:
        q, k_, v_ = at(args[0]), at(args[1]), at(args[2])
        causal = args[5]
        if args[3] is not None or not causal or q[-2] != k_[-2] or len(q[-2]) != 1:
            raise NotBucketable(f"{name}: attention over a dynamic key dim needs is_causal=True "
                                 "and equal query/key lengths")
        if any(_dyn(a) for a in (q[-1], k_[-1], v_[-1])) or q[:-2] != k_[:-2] or k_[:-1] != v_[:-1]:
            raise NotBucketable(f"{name}: dynamic head or batch layout this analysis cannot follow")
        outs = [q[:-1] + [v_[-1]], q[:-1]]
        for v in val[2:]:
            outs.append(_shape_atoms(v.shape, "fresh") if isinstance(v, torch.Tensor) else None)
        if _dyn([a for o in outs[2:] if o for d in o for a in d]):
            raise NotBucketable(name)
        return outs
    raise NotBucketable(f"{name} is not known to be padding-safe on dynamic dims")


def pad_unsafe_reason(prog):
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
                if node_kind(n) in ("py", "sym"):
                    A[n] = None
                    continue
                A[n] = _node_atoms(n, A)
            elif n.op == "output":
                for o in pytree.tree_leaves(n.args[0]):
                    if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                        for dim in A[o]:
                            if _dyn(dim[1:]) or (dim and not is_symbolic(dim[0]) and _dyn(dim)):
                                raise NotBucketable(
                                    "an output has a dim merging a static dim outside a dynamic one")
    except NotBucketable as e:
        return str(e)
    return None
