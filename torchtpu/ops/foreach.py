"""``_foreach_*`` ops: one XLA executable over every tensor of the lists.

PyTorch's optimizers take the foreach path on tpu by default; on a backend
without these kernels each ``_foreach_add_`` would run as one op per tensor.
Here each is a single lowering over the whole list, so an AdamW step is a
handful of executables whatever the number of parameters. Element semantics
(type promotion, integer division, ...) are those of the single-tensor
lowerings, looked up in the lowering table, so the two cannot drift apart; the
kernel executor casts each output to PyTorch's dtype. In-place forms
(``_foreach_add_``) are derived by the installer.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ..dispatch.lowering import LOWERINGS, lower

aten = torch.ops.aten


def _ew(name):
    """The lowering of single-tensor aten op ``name`` (looked up when traced)."""
    qual = f"aten::{name}" if "." in name else f"aten::{name}.default"

    def f(*args):
        low = LOWERINGS.get(qual)
        if low is None:
            raise NotImplementedError(f"torchtpu: _foreach op needs a lowering of {qual}")
        return low.fn(*args)

    return f


# the installer derives in-place kernels from the aten packets it can see: load them
_ALL = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
               if n.startswith(("aten::_foreach_", "aten::_fused_sgd", "aten::_fused_adam"))})
for _n in _ALL:
    getattr(aten, _n)


# ---------------------------------------------------------------- unary
_UNARY = ("abs acos asin atan ceil cos cosh erf erfc exp expm1 floor frac lgamma log log10 log1p log2 neg "
          "reciprocal round rsqrt sigmoid sign sin sinh sqrt tan tanh trunc").split()


def _unary(name):
    fn = _ew(name)
    return lambda xs: [fn(x) for x in xs]


for _n in _UNARY:
    lower(f"_foreach_{_n}")(_unary(_n))


@lower("_foreach_zero")
def _zero(xs):
    return [jnp.zeros_like(x) for x in xs]


@lower("_foreach_clone")
def _clone(xs):
    return list(xs)


@lower("_foreach_copy", allow_cpu=True)
def _copy(xs, src, non_blocking=False):
    return [jnp.broadcast_to(s.astype(x.dtype), x.shape) for x, s in zip(xs, src)]


# ---------------------------------------------------------------- binary
def _check_len(a, b):
    if len(a) != len(b):
        raise RuntimeError(f"Tensor lists must have the same number of tensors, got {len(a)} and {len(b)}")


def _with_alpha(fn):
    return lambda x, y, alpha=1: fn(x, y, alpha)


_BIN = {  # name -> (tensor-tensor op, tensor-scalar op)
    "add": (_ew("add.Tensor"), _ew("add.Tensor")),
    "sub": (_ew("sub.Tensor"), _ew("sub.Tensor")),
    "mul": (_ew("mul.Tensor"), _ew("mul.Tensor")),
    "div": (_ew("div.Tensor"), _ew("div.Tensor")),
    "maximum": (_ew("maximum"), _ew("clamp_min")),
    "minimum": (_ew("minimum"), _ew("clamp_max")),
    "clamp_min": (_ew("clamp_min.Tensor"), _ew("clamp_min")),
    "clamp_max": (_ew("clamp_max.Tensor"), _ew("clamp_max")),
}


def _list_op(tt, has_alpha):
    if has_alpha:
        def f(xs, ys, alpha=1):
            _check_len(xs, ys)
            return [tt(x, y, alpha) for x, y in zip(xs, ys)]
    else:
        def f(xs, ys):
            _check_len(xs, ys)
            return [tt(x, y) for x, y in zip(xs, ys)]
    return f


def _scalar_op(ts):
    return lambda xs, s: [ts(x, s) for x in xs]


def _scalarlist_op(ts):
    def f(xs, scalars):
        _check_len(xs, scalars)
        return [ts(x, s) for x, s in zip(xs, scalars)]

    return f


def _tensor_op(tt, has_alpha):
    if has_alpha:
        return lambda xs, other, alpha=1: [tt(x, other, alpha) for x in xs]
    return lambda xs, other: [tt(x, other) for x in xs]


for _n, (_tt, _ts) in _BIN.items():
    _packet = getattr(aten, f"_foreach_{_n}")
    _ovs = _packet.overloads()
    if "List" in _ovs:
        _alpha = any(a.name == "alpha" for a in _packet.List._schema.arguments)
        lower(f"_foreach_{_n}.List")(_list_op(_tt, _alpha))
    if "Scalar" in _ovs:
        lower(f"_foreach_{_n}.Scalar")(_scalar_op(_ts))
    if "ScalarList" in _ovs:
        lower(f"_foreach_{_n}.ScalarList")(_scalarlist_op(_ts))
    if "Tensor" in _ovs:
        _alpha = any(a.name == "alpha" for a in _packet.Tensor._schema.arguments)
        lower(f"_foreach_{_n}.Tensor")(_tensor_op(_tt, _alpha))


# ---------------------------------------------------------------- pow
_pow_tt = _ew("pow.Tensor_Tensor")
_pow_ts = _ew("pow.Tensor_Scalar")
_pow_st = _ew("pow.Scalar")


@lower("_foreach_pow.List")
def _pow_list(xs, exps):
    _check_len(xs, exps)
    return [_pow_tt(x, e) for x, e in zip(xs, exps)]


# the single-tensor lowering specializes on the exponent (x**2 -> x*x), so it is static here too
@lower("_foreach_pow.Scalar", static=("exponent",))
def _pow_scalar(xs, exponent):
    return [_pow_ts(x, exponent) for x in xs]


@lower("_foreach_pow.ScalarList")
def _pow_scalarlist(xs, exps):
    _check_len(xs, exps)
    return [_pow_ts(x, e) for x, e in zip(xs, exps)]


@lower("_foreach_pow.ScalarAndTensor")
def _pow_scalar_and_tensor(base, exps):
    return [_pow_st(base, e) for e in exps]


# ---------------------------------------------------------------- ternary
_lerp = _ew("lerp.Tensor")
_addcmul = _ew("addcmul")
_addcdiv = _ew("addcdiv")


@lower("_foreach_lerp.List")
def _lerp_list(xs, ends, weights):
    _check_len(xs, ends)
    _check_len(xs, weights)
    return [_lerp(x, e, w) for x, e, w in zip(xs, ends, weights)]


@lower("_foreach_lerp.Scalar")
def _lerp_scalar(xs, ends, weight):
    _check_len(xs, ends)
    return [_lerp(x, e, weight) for x, e in zip(xs, ends)]


@lower("_foreach_lerp.ScalarList")
def _lerp_scalarlist(xs, ends, weights):
    _check_len(xs, ends)
    _check_len(xs, weights)
    return [_lerp(x, e, w) for x, e, w in zip(xs, ends, weights)]


def _addc(fn):
    def scalar(xs, t1, t2, value=1):
        _check_len(xs, t1)
        _check_len(xs, t2)
        return [fn(x, a, b, value) for x, a, b in zip(xs, t1, t2)]

    def scalarlist(xs, t1, t2, scalars):
        _check_len(xs, t1)
        _check_len(xs, t2)
        _check_len(xs, scalars)
        return [fn(x, a, b, s) for x, a, b, s in zip(xs, t1, t2, scalars)]

    def tensor(xs, t1, t2, scalars):
        # one scalar per list element, given as a 1-D tensor (usually on the CPU)
        _check_len(xs, t1)
        _check_len(xs, t2)
        if scalars.ndim != 1 or scalars.shape[0] != len(xs):
            raise RuntimeError(f"Expected {len(xs)} scalars in a 1-D tensor, got shape {tuple(scalars.shape)}")
        return [fn(x, a, b, scalars[i]) for i, (x, a, b) in enumerate(zip(xs, t1, t2))]

    return scalar, scalarlist, tensor


def _addc_tensor_meta(name):
    # PyTorch's meta of the .Tensor overload insists on a CPU ``scalars`` tensor, which
    # the kernel executor hands to meta kernels as a meta tensor: the .Scalar overload's
    # meta gives the same outputs
    scalar_op = getattr(aten, f"_foreach_{name}").Scalar
    return lambda xs, t1, t2, scalars: scalar_op(xs, t1, t2)


for _n, _fn in (("addcmul", _addcmul), ("addcdiv", _addcdiv)):
    _s, _sl, _t = _addc(_fn)
    lower(f"_foreach_{_n}.Scalar")(_s)
    lower(f"_foreach_{_n}.ScalarList")(_sl)
    lower(f"_foreach_{_n}.Tensor", allow_cpu=True, meta=_addc_tensor_meta(_n))(_t)


# ---------------------------------------------------------------- reductions
_vector_norm = _ew("linalg_vector_norm")


@lower("_foreach_norm.Scalar", static=("ord",))
def _norm(xs, ord=2, dtype=None):
    return [_vector_norm(x, ord, None, False, dtype) for x in xs]


@lower("_foreach_max")
def _max(xs):
    return [jnp.max(x) for x in xs]


@lower("_foreach_powsum.Scalar", static=("ord",))
def _powsum(xs, ord=2, dtype=None):
    out = []
    for x in xs:
        v = jnp.abs(x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x)
        out.append(jnp.sum(v if ord == 1 else v ** ord))
    return out


# ---------------------------------------------------------------- fused optimizers (fused=True)
# One executable per optimizer step. The hyperparameters are python floats in
# these schemas, so a new learning rate (a scheduler) is a new executable: the
# ``.tensor_lr`` overloads take it as a tensor instead.
def _unscale(grads, grad_scale):
    if grad_scale is None:
        return list(grads)
    return [g / grad_scale.astype(g.dtype) for g in grads]


def _skip_if_inf(found_inf, new, old):
    """Keep the old values everywhere when ``found_inf`` (AMP's overflow flag) is set."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) != 0
    return [jnp.where(skip, o, n) for n, o in zip(new, old)]


def _adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
               amsgrad, maximize, grad_scale, found_inf, decoupled):
    grads_u = _unscale(grads, grad_scale)
    new_p, new_m, new_v, new_vmax = [], [], [], []
    for i, (p, g, m, v) in enumerate(zip(params, grads_u, exp_avgs, exp_avg_sqs)):
        acc = jnp.float32 if p.dtype in (jnp.bfloat16, jnp.float16) else p.dtype
        pf, gf, mf, vf = p.astype(acc), g.astype(acc), m.astype(acc), v.astype(acc)
        if maximize:
            gf = -gf
        if weight_decay != 0:
            if decoupled:
                pf = pf * (1 - lr * weight_decay)
            else:
                gf = gf + weight_decay * pf
        mf = mf + (gf - mf) * (1 - beta1)
        vf = beta2 * vf + (1 - beta2) * gf * gf
        step = steps[i].astype(acc)
        bc1 = 1 - jnp.power(jnp.asarray(beta1, acc), step)
        bc2_sqrt = jnp.sqrt(1 - jnp.power(jnp.asarray(beta2, acc), step))
        if amsgrad:
            vmax = jnp.maximum(max_exp_avg_sqs[i].astype(acc), vf)
            new_vmax.append(vmax)
            denom = jnp.sqrt(vmax) / bc2_sqrt + eps
        else:
            denom = jnp.sqrt(vf) / bc2_sqrt + eps
        pf = pf - (lr / bc1) * mf / denom
        new_p.append(pf)
        new_m.append(mf)
        new_v.append(vf)
    out = (
        _skip_if_inf(found_inf, new_p, params),
        _skip_if_inf(found_inf, grads_u, grads),
        _skip_if_inf(found_inf, new_m, exp_avgs),
        _skip_if_inf(found_inf, new_v, exp_avg_sqs),
        _skip_if_inf(found_inf, new_vmax, max_exp_avg_sqs) if amsgrad else list(max_exp_avg_sqs),
    )
    return out


def _make_adam(decoupled):
    def fused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
              weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        if isinstance(lr, jnp.ndarray) or hasattr(lr, "dtype"):
            lr = jnp.reshape(lr, ())
        return _adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                          weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled)

    return fused


lower("_fused_adam", "_fused_adam.tensor_lr", allow_cpu=True)(_make_adam(False))
lower("_fused_adamw", "_fused_adamw.tensor_lr", allow_cpu=True)(_make_adam(True))


def _fused_sgd(params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov, maximize,
               is_first_step, grad_scale=None, found_inf=None):
    if hasattr(lr, "dtype"):
        lr = jnp.reshape(lr, ())
    grads_u = _unscale(grads, grad_scale)
    new_p, new_buf = [], []
    for i, (p, g) in enumerate(zip(params, grads_u)):
        acc = jnp.float32 if p.dtype in (jnp.bfloat16, jnp.float16) else p.dtype
        pf, gf = p.astype(acc), g.astype(acc)
        if maximize:
            gf = -gf
        if weight_decay != 0:
            gf = gf + weight_decay * pf
        if momentum != 0:
            if is_first_step:
                buf = gf
            else:
                buf = momentum * momentum_buffer_list[i].astype(acc) + (1 - dampening) * gf
            new_buf.append(buf)
            gf = gf + momentum * buf if nesterov else buf
        new_p.append(pf - lr * gf)
    return (
        _skip_if_inf(found_inf, new_p, params),
        _skip_if_inf(found_inf, grads_u, grads),
        _skip_if_inf(found_inf, new_buf, momentum_buffer_list) if momentum != 0 else list(momentum_buffer_list),
    )


def _fused_sgd_meta(params, grads, momentum_buffer_list, *args, **kwargs):
    # ``_fused_sgd_`` has no Meta kernel in PyTorch: the outputs mirror the inputs
    like = lambda ts: [torch.empty_like(t, device="meta") for t in ts]  # noqa: E731
    return like(params), like(grads), like(momentum_buffer_list)


lower("_fused_sgd", "_fused_sgd.tensor_lr", allow_cpu=True, meta=_fused_sgd_meta)(_fused_sgd)
