"""Pointwise ops. Result dtypes come from PyTorch's meta kernels (dispatch/kernel.py), so
lowerings here compute values and leave type promotion to the kernel executor."""

from __future__ import annotations

import jax
import torch
import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from ..base.frames import warn_at_user_line, warn_once_at_user_line
from ..dispatch.lowering import lower
from ..runtime import layout as _layout


def _float(x):
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


# ---------------------------------------------------------------- unary
_UNARY = {
    "abs": jnp.abs,
    "neg": jnp.negative,
    "_conj_physical": jnp.conj,  # conj_physical is CompositeImplicit; this is its kernel
    "exp": lambda x: jnp.exp(_float(x)),
    "exp2": lambda x: jnp.exp2(_float(x)),
    "expm1": lambda x: jnp.expm1(_float(x)),
    "log": lambda x: jnp.log(_float(x)),
    "log2": lambda x: jnp.log2(_float(x)),
    "log10": lambda x: jnp.log10(_float(x)),
    "log1p": lambda x: jnp.log1p(_float(x)),
    "sqrt": lambda x: jnp.sqrt(_float(x)),
    "rsqrt": lambda x: lax.rsqrt(_float(x)),
    "sin": lambda x: jnp.sin(_float(x)),
    "cos": lambda x: jnp.cos(_float(x)),
    "tan": lambda x: jnp.tan(_float(x)),
    "asin": lambda x: jnp.arcsin(_float(x)),
    "acos": lambda x: jnp.arccos(_float(x)),
    "atan": lambda x: jnp.arctan(_float(x)),
    "sinh": lambda x: jnp.sinh(_float(x)),
    "cosh": lambda x: jnp.cosh(_float(x)),
    "tanh": lambda x: jnp.tanh(_float(x)),
    "asinh": lambda x: jnp.arcsinh(_float(x)),
    "acosh": lambda x: jnp.arccosh(_float(x)),
    "atanh": lambda x: jnp.arctanh(_float(x)),
    "sigmoid": lambda x: jax.nn.sigmoid(_float(x)),
    "erf": lambda x: jsp.erf(_float(x)),
    "erfc": lambda x: jsp.erfc(_float(x)),
    "erfinv": lambda x: jsp.erfinv(_float(x)),
    "lgamma": lambda x: jsp.gammaln(_float(x)),
    # PyTorch: digamma(+-0) = -+inf (jax gives nan)
    "digamma": lambda x: _digamma(_float(x)),
    "reciprocal": lambda x: 1 / _float(x),
    "floor": lambda x: jnp.floor(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
    "ceil": lambda x: jnp.ceil(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
    "trunc": lambda x: jnp.trunc(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
    "frac": lambda x: x - jnp.trunc(x),
    "round": lambda x: jnp.round(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
    "sign": lambda x: x if x.dtype == jnp.bool_ else jnp.sign(x),
    "sgn": lambda x: x if x.dtype == jnp.bool_ else jnp.sign(x),
    "signbit": jnp.signbit,
    "bitwise_not": lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.bitwise_not(x),
    "logical_not": jnp.logical_not,
    "isnan": jnp.isnan,
    "isinf": jnp.isinf,
    "isposinf": jnp.isposinf,
    "isneginf": jnp.isneginf,
    "relu": lambda x: jnp.maximum(x, 0).astype(x.dtype),
    "silu": lambda x: jax.nn.silu(x),
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    "hardsigmoid": lambda x: jax.nn.hard_sigmoid(x),
    "hardswish": lambda x: jax.nn.hard_swish(x),
    "deg2rad": lambda x: jnp.deg2rad(_float(x)),
    "rad2deg": lambda x: jnp.rad2deg(_float(x)),
    "i0": lambda x: jnp.i0(_float(x)),
    "sinc": lambda x: jnp.sinc(_float(x)),
    "angle": lambda x: jnp.angle(x) if jnp.iscomplexobj(x) else jnp.where(jnp.isnan(_float(x)), _float(x), jnp.where(x < 0, jnp.pi, 0.0)),
    "clone": lambda x: x,
    "alias_copy": lambda x: x,
    "detach_copy": lambda x: x,
    "lift_fresh_copy": lambda x: x,
    "special_entr": lambda x: _entr(_float(x)),
    "special_i0e": lambda x: jsp.i0e(_float(x)),
    "special_i1": lambda x: jsp.i1(_float(x)),
    "special_i1e": lambda x: jsp.i1e(_float(x)),
    "special_ndtri": lambda x: jsp.ndtri(_float(x)),
    "special_log_ndtr": lambda x: jsp.log_ndtr(_float(x)),
    "special_modified_bessel_i0": lambda x: jnp.i0(_float(x)),
    "special_modified_bessel_i1": lambda x: jsp.i1(_float(x)),
    "special_spherical_bessel_j0": lambda x: _spherical_j0(_float(x)),
}


def _up(x):
    """float32 compute for bfloat16/float16 (PyTorch's CPU kernels do the same)."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _digamma(x):
    return jnp.where(x == 0, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x), jsp.digamma(x))


def _entr(x):
    return jnp.where(x > 0, -x * jnp.log(jnp.where(x > 0, x, 1)), jnp.where(x == 0, 0.0, -jnp.inf)).astype(x.dtype)


def _spherical_j0(x):
    safe = jnp.where(x == 0, 1, x)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


def _unary(fn):
    return lambda x, *rest, **kw: fn(x)


for _name, _fn in _UNARY.items():
    lower(_name)(_unary(_fn))

@lower("round.decimals", static=("decimals",))
def _round_dec(x, decimals=0):
    return jnp.round(x, decimals)


@lower("logit", static=("eps",))
def _logit(x, eps=None):
    x = _float(x)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lower("nan_to_num", static=("nan", "posinf", "neginf"))
def _nan_to_num(x, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


@lower("gelu", static=("approximate",))
def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=(approximate == "tanh"))


@lower("leaky_relu")
def _leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lower("elu")
def _elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, (jnp.exp(x * input_scale) - 1) * alpha * scale)


@lower("softplus")
def _softplus(x, beta=1, threshold=20):
    bx = x * beta
    return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta)


@lower("hardtanh")
def _hardtanh(x, min_val=-1, max_val=1):
    return jnp.clip(x, min_val, max_val)


@lower("threshold")
def _threshold(x, threshold, value):
    return jnp.where(x > threshold, x, value)


@lower("celu")
def _celu(x, alpha=1.0):
    return jnp.where(x > 0, x, alpha * (jnp.exp(x / alpha) - 1))


@lower("glu", static=("dim",))
def _glu(x, dim=-1):
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lower("fill.Scalar")
def _fill_scalar(x, value):
    return jnp.full(x.shape, value, x.dtype)


@lower("fill.Tensor")
def _fill_tensor(x, value):
    return jnp.broadcast_to(value.astype(x.dtype), x.shape)


@lower("zero")
def _zero(x):
    return jnp.zeros_like(x)


# ---------------------------------------------------------------- binary
_FULL_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def _promote_pair(a, b):
    """Compute in a common dtype; the kernel executor casts the result to PyTorch's.

    As in PyTorch, a 0-dim float operand (a Python scalar) does not widen a dimensioned
    float32/float64 tensor: ``x_f32 * 0.9`` computes in float32, not float64 and back
    (half types keep the wider compute, like PyTorch's float32 opmath)."""
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    if a.dtype != b.dtype:
        if a.ndim and not b.ndim and a.dtype in _FULL_FLOATS and jnp.issubdtype(b.dtype, jnp.floating):
            return a, b.astype(a.dtype)
        if b.ndim and not a.ndim and b.dtype in _FULL_FLOATS and jnp.issubdtype(a.dtype, jnp.floating):
            return a.astype(b.dtype), b
        dt = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(dt), b.astype(dt)
    return a, b


def _binary(fn):
    def f(a, b):
        return fn(*_promote_pair(a, b))

    return f


def _div_true(a, b):
    a, b = _promote_pair(a, b)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return a / b


def _floor_divide(a, b):
    a, b = _promote_pair(a, b)
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.floor_divide(a, b)
    if a.dtype == jnp.bool_:
        return jnp.floor_divide(a.astype(jnp.int8), b.astype(jnp.int8)).astype(jnp.bool_)
    # PyTorch's div_floor_floating, in float32 for bfloat16/float16 (as its CPU kernel):
    # floor(a / b) on the rounded quotient is off by one near integers
    dt = a.dtype
    a, b = _up(a), _up(b)
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floordiv = jnp.floor(div)
    floordiv = jnp.where(div - floordiv > 0.5, floordiv + 1, floordiv)
    out = jnp.where(div != 0, floordiv, jnp.copysign(jnp.zeros_like(div), a / b))
    out = jnp.where(b == 0, a / b, out)
    return out.astype(dt)


def _remainder(a, b):
    a, b = _promote_pair(a, b)
    return jnp.remainder(a, b)


def _fmod(a, b):
    a, b = _promote_pair(a, b)
    return jnp.fmod(a, b)


_BINARY = {
    "mul": jnp.multiply,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "fmax": jnp.fmax,
    "fmin": jnp.fmin,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "logical_xor": jnp.logical_xor,
    "atan2": lambda a, b: jnp.arctan2(_float(a), _float(b)),
    "hypot": jnp.hypot,
    "copysign": lambda a, b: jnp.copysign(_float(a), _float(b)),
    "nextafter": jnp.nextafter,
    "xlogy": lambda a, b: jsp.xlogy(_float(a), _float(b)),
    "special_xlog1py": lambda a, b: jsp.xlog1py(_float(a), _float(b)),
    "logaddexp": lambda a, b: jnp.logaddexp(_float(a), _float(b)),
    "logaddexp2": lambda a, b: jnp.logaddexp2(_float(a), _float(b)),
    "heaviside": lambda a, b: jnp.where(a == 0, b, (a > 0).astype(a.dtype)),
    # in float32 for bfloat16/float16: exp2 of a bfloat16 exponent is off by percents
    "ldexp": lambda a, b: _up(_float(a)) * jnp.exp2(_up(_float(b))),
    "igamma": lambda a, b: jsp.gammainc(_float(a), _float(b)),
    "igammac": lambda a, b: jsp.gammaincc(_float(a), _float(b)),
}


def _bitwise(fn, logical):
    def f(a, b):
        a, b = _promote_pair(a, b)
        return logical(a, b) if a.dtype == jnp.bool_ else fn(a, b)

    return f


_BINARY["bitwise_and"] = _bitwise(jnp.bitwise_and, jnp.logical_and)
_BINARY["bitwise_or"] = _bitwise(jnp.bitwise_or, jnp.logical_or)
_BINARY["bitwise_xor"] = _bitwise(jnp.bitwise_xor, jnp.logical_xor)
_BINARY["bitwise_left_shift"] = _binary(jnp.left_shift)
_BINARY["bitwise_right_shift"] = _binary(jnp.right_shift)
_BINARY["__lshift__"] = _binary(jnp.left_shift)
_BINARY["__rshift__"] = _binary(jnp.right_shift)

for _name, _fn in _BINARY.items():
    wrapped = _binary(_fn) if not _name.startswith("bitwise") else _fn
    for _ov in ("Tensor", "Scalar"):
        try:
            import torch

            _pkt = getattr(torch.ops.aten, _name)
            if _ov in _pkt.overloads():
                lower(f"{_name}.{_ov}")(wrapped)
            elif _ov == "Tensor" and "default" in _pkt.overloads():
                lower(f"{_name}.default")(wrapped)
        except AttributeError:
            pass

lower("complex")(lambda re, im: lax.complex(*jnp.broadcast_arrays(re, im)))
lower("polar")(lambda r, theta: lax.complex(*jnp.broadcast_arrays(r * jnp.cos(theta), r * jnp.sin(theta))))
lower("div.Tensor", "div.Scalar")(_div_true)
lower("floor_divide.default", "floor_divide.Scalar")(_floor_divide)
lower("remainder.Tensor", "remainder.Scalar")(_remainder)
lower("remainder.Scalar_Tensor")(_remainder)
lower("fmod.Tensor", "fmod.Scalar")(_fmod)


@lower("div.Tensor_mode", "div.Scalar_mode", static=("rounding_mode",))
def _div_mode(a, b, rounding_mode=None):
    if rounding_mode is None:
        return _div_true(a, b)
    a, b = _promote_pair(a, b)
    if rounding_mode == "trunc":
        if jnp.issubdtype(a.dtype, jnp.integer):
            a, b = jnp.broadcast_arrays(a, b)  # lax.div does not broadcast
            q = lax.div(a, jnp.where(b == 0, 1, b))
            return q
        return jnp.trunc(a / b)
    return _floor_divide(a, b)


@lower("add.Tensor", "add.Scalar")
def _add(a, b, alpha=1):
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha == 1):
        b = b * alpha
    a, b = _promote_pair(a, b)
    if a.dtype == jnp.bool_:
        return jnp.logical_or(a, b)
    return a + b


@lower("sub.Tensor", "sub.Scalar")
def _sub(a, b, alpha=1):
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha == 1):
        b = b * alpha
    a, b = _promote_pair(a, b)
    return a - b


@lower("rsub.Tensor", "rsub.Scalar")
def _rsub(a, b, alpha=1):
    return _sub(b, a, alpha)


def _int_pow(a, b):
    """Integer power with PyTorch's rule for negative exponents (1, +-1, else 0)."""
    neg = b < 0
    p = jnp.power(a, jnp.where(neg, 0, b))
    odd = (b % 2) != 0
    r_neg = jnp.where(a == 1, 1, jnp.where(a == -1, jnp.where(odd, -1, 1), 0)).astype(a.dtype)
    return jnp.where(neg, r_neg, p)


@lower("pow.Tensor_Tensor")
def _pow_tt(a, b):
    a, b = _promote_pair(a, b)
    if jnp.issubdtype(a.dtype, jnp.integer):
        return _int_pow(a, b)
    return jnp.power(a, b)


@lower("pow.Tensor_Scalar", static=("exponent",))
def _pow_ts(a, exponent):
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.int64)  # square(bool) = pow(bool, 2): lax.integer_pow rejects bool
    if isinstance(exponent, int) and not isinstance(exponent, bool) and exponent >= 0:
        return lax.integer_pow(a, exponent) if exponent < 64 else jnp.power(a, exponent)
    if isinstance(exponent, float) and jnp.issubdtype(a.dtype, jnp.integer):
        a = a.astype(jnp.float32)
    if exponent == 0.5:
        return jnp.sqrt(a)
    return jnp.power(a, jnp.asarray(exponent, dtype=a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else exponent)


@lower("pow.Scalar")
def _pow_st(a, b):
    a, b = _promote_pair(a, b)
    if jnp.issubdtype(a.dtype, jnp.integer):
        return _int_pow(a, b)
    return jnp.power(a, b)


@lower("gcd")
def _gcd(a, b):
    return jnp.gcd(*_promote_pair(a, b))


@lower("lcm")
def _lcm(a, b):
    return jnp.lcm(*_promote_pair(a, b))


@lower("frexp.Tensor")
def _frexp(x):
    m, e = jnp.frexp(x)
    return m, e.astype(jnp.int32)


@lower("clamp")
def _clamp(x, min=None, max=None):
    if min is not None:
        x = jnp.maximum(x, jnp.asarray(min, x.dtype) if not jnp.issubdtype(jnp.asarray(min).dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.floating) else min)
    if max is not None:
        x = jnp.minimum(x, jnp.asarray(max, x.dtype) if not jnp.issubdtype(jnp.asarray(max).dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.floating) else max)
    return x


@lower("clamp.Tensor")
def _clamp_t(x, min=None, max=None):
    if min is not None:
        x, m = _promote_pair(x, min)
        x = jnp.maximum(x, m)
    if max is not None:
        x, m = _promote_pair(x, max)
        x = jnp.minimum(x, m)
    return x


@lower("clamp_min")
def _clamp_min(x, min):
    return _clamp(x, min=min)


@lower("clamp_max")
def _clamp_max(x, max):
    return _clamp(x, max=max)


@lower("clamp_min.Tensor")
def _clamp_min_t(x, min):
    return _clamp_t(x, min=min)


@lower("clamp_max.Tensor")
def _clamp_max_t(x, max):
    return _clamp_t(x, max=max)


_WHERE_UINT8 = ("where received a uint8 condition tensor. This behavior is deprecated and will be removed in a "
                "future version of PyTorch. Use a boolean condition instead.")


def _where_meta(cond, a, b):
    # CPU takes a uint8 condition as bool, once with a deprecation warning (the meta kernel refuses it)
    if cond.dtype == torch.uint8:
        warn_once_at_user_line(_WHERE_UINT8)
        cond = cond.to(torch.bool)
    return torch.ops.aten.where.self(cond, a, b)


@lower("where.self", meta=_where_meta)
def _where(cond, a, b):
    a, b = _promote_pair(a, b)
    return jnp.where(cond, a, b)


@lower("lerp.Scalar", "lerp.Tensor")
def _lerp(a, b, w):
    return a + w * (b - a)


@lower("addcmul")
def _addcmul(x, t1, t2, value=1):
    return x + value * t1 * t2


@lower("addcdiv")
def _addcdiv(x, t1, t2, value=1):
    return x + value * t1 / t2


def _masked_fill_expanded(x, *args, inplace=False):
    if inplace and _layout.has_internal_overlap(x.shape, x.stride()):
        warn_at_user_line("Use of masked_fill_ on expanded tensors is deprecated. Please clone() the tensor before "
                          "performing this operation. This also applies to advanced indexing e.g. tensor[mask] = scalar")


@lower("masked_fill.Scalar", warn=_masked_fill_expanded)
def _masked_fill_s(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


@lower("masked_fill.Tensor", warn=_masked_fill_expanded)
def _masked_fill_t(x, mask, value):
    return jnp.where(mask, value.astype(x.dtype), x)
