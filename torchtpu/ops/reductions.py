"""Reductions and scans: sum, mean, prod, amax/amin, max/min, argmax/argmin,
var/std, logsumexp, norms, all/any, count_nonzero, equal, cumsum/cumprod/cummax/
cummin, logcumsumexp, median/nanmedian/kthvalue/mode, segment_reduce, bincount,
histogram/histogramdd, hash_tensor, and the FFT primitives (_fft_r2c/c2c/c2r).

Result dtypes and shapes come from PyTorch's meta kernels (the kernel executor casts),
so these compute values; reduced-precision floats (bfloat16, float16) are
accumulated in float32 as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import builtins
import functools
import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..base import dtypes
from ..base.frames import warn_at_user_line
from ..dispatch.lowering import impl, lower
from ..runtime import storage
from ..runtime.storage import logical_value


# ---------------------------------------------------------------- helpers
def _axes(x, dim):
    """Normalized reduction axes; ``None`` or ``[]`` mean every dim (PyTorch's rule)."""
    if dim is None:
        return tuple(range(x.ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(x.ndim))
    if x.ndim == 0:
        return ()  # dim 0 / -1 of a 0-d tensor reduces nothing
    return tuple(sorted({d % x.ndim for d in dim}))


def _axis(x, dim):
    """A single normalized dim (0-d tensors accept 0 and -1); out of range is PyTorch's IndexError,
    never a silent wrap-around."""
    n = max(x.ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return 0 if x.ndim == 0 else dim % x.ndim


def _is_low_float(dt):
    return dt in (jnp.bfloat16, jnp.float16)


def _acc(x):
    """Accumulation dtype: float32 for bfloat16/float16 (as PyTorch's CPU kernels)."""
    return x.astype(jnp.float32) if _is_low_float(x.dtype) else x


def _is_int(x):
    return jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_


def _cast_in(x, dtype, int_to_long=True):
    """Input cast for sum/prod-like ops: ``dtype=`` if given, integers/bools to int64."""
    if dtype is not None:
        return x.astype(dtypes.to_jax(dtype))
    if int_to_long and _is_int(x):
        return x.astype(jnp.int64)
    return x


def _float(x):
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


# ---------------------------------------------------------------- sum / mean / prod
@lower("sum.default")
def _sum_all(x, dtype=None):
    return jnp.sum(_acc(_cast_in(x, dtype)))


@lower("sum.dim_IntList", static=())
def _sum(x, dim, keepdim=False, dtype=None):
    return jnp.sum(_acc(_cast_in(x, dtype)), axis=_axes(x, dim), keepdims=keepdim)


@lower("nansum")
def _nansum(x, dim=None, keepdim=False, dtype=None):
    x = _acc(_cast_in(x, dtype))
    if jnp.issubdtype(x.dtype, jnp.inexact):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return jnp.sum(x, axis=_axes(x, dim), keepdims=keepdim)


@lower("mean.default")
def _mean_all(x, dtype=None):
    return jnp.mean(_acc(_cast_in(x, dtype, int_to_long=False)))


@lower("mean.dim")
def _mean(x, dim, keepdim=False, dtype=None):
    x = _acc(_cast_in(x, dtype, int_to_long=False))
    return jnp.mean(x, axis=_axes(x, dim), keepdims=keepdim)


@lower("prod.default")
def _prod_all(x, dtype=None):
    return jnp.prod(_acc(_cast_in(x, dtype)))


@lower("prod.dim_int")
def _prod(x, dim, keepdim=False, dtype=None):
    x = _acc(_cast_in(x, dtype))
    return jnp.prod(x, axis=_axes(x, [dim]), keepdims=keepdim)


# ---------------------------------------------------------------- max / min family
@lower("amax")
def _amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@lower("amin")
def _amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


@lower("max.default")
def _max_all(x):
    return jnp.max(x)


@lower("min.default")
def _min_all(x):
    return jnp.min(x)


def _arg_extreme(x, axis, largest):
    """Index of the first max (min) along ``axis``; a NaN wins, first NaN first (PyTorch's rule)."""
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        nan = jnp.isnan(x)
        ext = jnp.max(x, axis=axis, keepdims=True) if largest else jnp.min(x, axis=axis, keepdims=True)
        hit = nan | (x == ext)
        # if a NaN exists in the slice, only NaNs count
        any_nan = jnp.any(nan, axis=axis, keepdims=True)
        hit = jnp.where(any_nan, nan, hit)
    else:
        ext = jnp.max(x, axis=axis, keepdims=True) if largest else jnp.min(x, axis=axis, keepdims=True)
        hit = x == ext
    return jnp.argmax(hit, axis=axis).astype(jnp.int64)


@lower("max.dim", static=("dim", "keepdim"))
def _max_dim(x, dim, keepdim=False):
    ax = _axis(x, dim)
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    return jnp.max(x, axis=ax, keepdims=keepdim), _keep(_arg_extreme(x, ax, True), ax, keepdim)


@lower("min.dim", static=("dim", "keepdim"))
def _min_dim(x, dim, keepdim=False):
    ax = _axis(x, dim)
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    return jnp.min(x, axis=ax, keepdims=keepdim), _keep(_arg_extreme(x, ax, False), ax, keepdim)


def _keep(idx, ax, keepdim):
    return jnp.expand_dims(idx, ax) if keepdim else idx


@lower("argmax")
def _argmax(x, dim=None, keepdim=False):
    if dim is None:
        r = _arg_extreme(x.reshape(-1), 0, True)
        return r.reshape((1,) * x.ndim) if keepdim else r
    ax = _axis(x, dim)
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    return _keep(_arg_extreme(x, ax, True), ax, keepdim)


@lower("argmin")
def _argmin(x, dim=None, keepdim=False):
    if dim is None:
        r = _arg_extreme(x.reshape(-1), 0, False)
        return r.reshape((1,) * x.ndim) if keepdim else r
    ax = _axis(x, dim)
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    return _keep(_arg_extreme(x, ax, False), ax, keepdim)


@lower("aminmax")
def _aminmax(x, dim=None, keepdim=False):
    if dim is None:
        mn, mx = jnp.min(x), jnp.max(x)
        if keepdim:
            mn, mx = mn.reshape((1,) * x.ndim), mx.reshape((1,) * x.ndim)
        return mn, mx
    ax = (_axis(x, dim),) if x.ndim else ()
    return jnp.min(x, axis=ax, keepdims=keepdim), jnp.max(x, axis=ax, keepdims=keepdim)


# ---------------------------------------------------------------- variance / std
def _var_impl(x, dim, correction, keepdim):
    x = _acc(_float(x))
    axes = _axes(x, dim)
    n = math.prod(x.shape[a] for a in axes) if axes else 1
    c = 1 if correction is None else correction
    mean = jnp.mean(x, axis=axes, keepdims=True)
    d = x - mean
    if jnp.iscomplexobj(d):
        sq = jnp.real(d * jnp.conj(d))
    else:
        sq = d * d
    # PyTorch divides by max(0, N - correction): inf / nan when it is <= 0
    denom = max(0, n - c)
    s = jnp.sum(sq, axis=axes, keepdims=keepdim)
    return s / jnp.asarray(denom, s.dtype), jnp.squeeze(mean, axes) if not keepdim else mean


def _dof_warning(fname):
    """PyTorch's per-call warning when ``correction`` leaves no degrees of freedom."""
    message = (f"{fname}(): degrees of freedom is <= 0. Correction should be strictly less than the reduction "
               "factor (input numel divided by output numel).")

    def warn(x, dim=None, correction=None, keepdim=False, inplace=False):
        dims = range(x.dim()) if not dim else [d % max(x.dim(), 1) for d in dim]
        out_numel = math.prod(n for d, n in enumerate(x.shape) if d not in dims)
        factor = x.numel() // out_numel if out_numel else 0
        if factor - (1 if correction is None else correction) <= 0:
            for _ in range(2 if x.is_complex() else 1):  # CPU reduces real and imaginary parts apart
                warn_at_user_line(message)

    return warn


@lower("var.correction", static=("correction",), warn=_dof_warning("var"))
def _var(x, dim=None, correction=None, keepdim=False):
    return _var_impl(x, dim, correction, keepdim)[0]


@lower("std.correction", static=("correction",), warn=_dof_warning("std"))
def _std(x, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var_impl(x, dim, correction, keepdim)[0])


@lower("var_mean.correction", static=("correction",), warn=_dof_warning("var_mean"))
def _var_mean(x, dim=None, correction=None, keepdim=False):
    return _var_impl(x, dim, correction, keepdim)


@lower("std_mean.correction", static=("correction",), warn=_dof_warning("std_mean"))
def _std_mean(x, dim=None, correction=None, keepdim=False):
    v, m = _var_impl(x, dim, correction, keepdim)
    return jnp.sqrt(v), m


# ---------------------------------------------------------------- logsumexp / norms
@lower("logsumexp")
def _logsumexp(x, dim, keepdim=False):
    x = _acc(_float(x))
    axes = _axes(x, dim)
    if not axes:
        return x
    m = jnp.max(x, axis=axes, keepdims=True, initial=-jnp.inf)  # (initial: an empty slice gives -inf)
    # an all -inf (or +inf) slice must not produce inf - inf = nan
    m = jnp.where(jnp.isinf(m), jnp.zeros_like(m), lax.stop_gradient(m))
    s = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return s if keepdim else jnp.squeeze(s, axes)


def _vector_norm(x, ord, axes, keepdim):
    x = _acc(x)
    a = jnp.abs(x)
    if jnp.iscomplexobj(a):
        a = jnp.real(a)
    ordf = float(ord)
    if ordf == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ordf == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ordf == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    if ordf == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ordf == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.power(jnp.sum(jnp.power(a, ordf), axis=axes, keepdims=keepdim), 1.0 / ordf)


@lower("linalg_vector_norm", static=("ord",))
def _linalg_vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.astype(dtypes.to_jax(dtype))
    return _vector_norm(x, ord, _axes(x, dim), keepdim)


@lower("norm.Scalar", static=("p",))
def _norm_scalar(x, p=2):
    return _vector_norm(x, 2 if p is None else p, _axes(x, None), False)


@lower("norm.ScalarOpt_dtype", static=("p",))
def _norm_scalar_dtype(x, p, dtype):
    x = x.astype(dtypes.to_jax(dtype))
    return _vector_norm(x, 2 if p is None else p, _axes(x, None), False)


@lower("norm.ScalarOpt_dim", static=("p",))
def _norm_dim(x, p, dim, keepdim=False):
    return _vector_norm(x, 2 if p is None else p, _axes(x, dim), keepdim)


@lower("norm.ScalarOpt_dim_dtype", static=("p",))
def _norm_dim_dtype(x, p, dim, keepdim, dtype):
    x = x.astype(dtypes.to_jax(dtype))
    return _vector_norm(x, 2 if p is None else p, _axes(x, dim), keepdim)


# ---------------------------------------------------------------- all / any / count_nonzero
def _truthy(x):
    return x if x.dtype == jnp.bool_ else x != 0


def _lower_bool_reduction(name, jfn):
    """all / any: the whole tensor, one dim, or a dim list (None = all), as bool."""
    lower(f"{name}.default")(lambda x: jfn(_truthy(x)))
    lower(f"{name}.dim")(lambda x, dim, keepdim=False: jfn(_truthy(x), axis=_axes(x, [dim]), keepdims=keepdim))
    lower(f"{name}.dims")(lambda x, dim=None, keepdim=False: jfn(_truthy(x), axis=_axes(x, dim), keepdims=keepdim))


_lower_bool_reduction("all", jnp.all)
_lower_bool_reduction("any", jnp.any)


@lower("count_nonzero.dim_IntList")
def _count_nonzero(x, dim):
    return jnp.sum(_truthy(x).astype(jnp.int64), axis=_axes(x, dim))


@lower("count_nonzero.default")
def _count_nonzero_opt(x, dim=None):
    return jnp.sum(_truthy(x).astype(jnp.int64), axis=_axes(x, None if dim is None else [dim]))


# ---------------------------------------------------------------- scans
@lower("cumsum")
def _cumsum(x, dim, dtype=None):
    x = _cast_in(x, dtype)
    if x.ndim == 0:
        return x
    return jnp.cumsum(_acc(x), axis=_axis(x, dim))


@lower("cumprod")
def _cumprod(x, dim, dtype=None):
    x = _cast_in(x, dtype)
    if x.ndim == 0:
        return x
    return jnp.cumprod(_acc(x), axis=_axis(x, dim))


@lower("logcumsumexp")
def _logcumsumexp(x, dim):
    x = _acc(_float(x))
    if x.ndim == 0:
        return x
    ax = _axis(x, dim)

    def combine(a, b):
        m = jnp.maximum(a, b)
        mn = jnp.minimum(a, b)
        # both -inf (or equal infinities) must give that value, not nan
        safe = jnp.where(jnp.isinf(m) & (m == mn), m, m + jnp.log1p(jnp.exp(mn - m)))
        return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.nan, safe)

    return lax.associative_scan(combine, x, axis=ax)


def _cum_extreme(x, dim, largest):
    """(values, indices) of cummax/cummin with PyTorch's CPU tie and NaN rules:
    a later equal element takes over, and every NaN takes over."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    ax = _axis(x, dim)
    shape = [1] * x.ndim
    shape[ax] = x.shape[ax]
    idx = jnp.broadcast_to(jnp.arange(x.shape[ax], dtype=jnp.int64).reshape(shape), x.shape)
    floating = jnp.issubdtype(x.dtype, jnp.inexact)

    def combine(a, b):
        av, ai = a
        bv, bi = b
        better = (bv >= av) if largest else (bv <= av)
        if floating:
            take_b = jnp.isnan(bv) | (~jnp.isnan(av) & better)
        else:
            take_b = better
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    return lax.associative_scan(combine, (x, idx), axis=ax)


@lower("cummax", static=("dim",))
def _cummax(x, dim):
    return _cum_extreme(x, dim, True)


@lower("cummin", static=("dim",))
def _cummin(x, dim):
    return _cum_extreme(x, dim, False)


# ---------------------------------------------------------------- order statistics
def sort_keys(x, descending):
    """Sort keys that give PyTorch's order with a stable ``lax.sort``: NaN is the largest
    value, -0.0 == 0.0, and descending order keeps equal elements in input order."""
    if x.dtype == jnp.bool_:
        k = x.astype(jnp.int8)
        return [(-k) if descending else k]
    if jnp.issubdtype(x.dtype, jnp.integer):
        return [jnp.bitwise_not(x) if descending else x]
    nan = jnp.isnan(x)
    k = jnp.where(x == 0, jnp.zeros((), x.dtype), x)  # -0.0 -> 0.0
    k = jnp.where(nan, jnp.zeros((), x.dtype), k)
    if descending:
        kd = jnp.where(k == 0, jnp.zeros((), x.dtype), -k)
        return [(~nan).astype(jnp.int8), kd]
    return [nan.astype(jnp.int8), k]


def stable_sort(x, axis, descending):
    """(sorted values, int64 indices) along ``axis``, stable, in PyTorch's order."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    keys = sort_keys(x, descending)
    out = lax.sort((*keys, x, idx), dimension=axis, is_stable=True, num_keys=len(keys))
    return out[-2], out[-1]


def _kth_smallest(x, axis, k0):
    """(value, index) of the ``k0``-th (0-based) smallest element along ``axis`` (NaN largest)."""
    v, i = stable_sort(x, axis, False)
    return jnp.take(v, k0, axis=axis), jnp.take(i, k0, axis=axis)


@lower("kthvalue", static=("k", "dim", "keepdim"))
def _kthvalue(x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    ax = _axis(x, dim)
    v, i = _kth_smallest(x, ax, k - 1)
    return (jnp.expand_dims(v, ax), jnp.expand_dims(i, ax)) if keepdim else (v, i)


def _median_along(x, ax, ignore_nan):
    n = x.shape[ax]
    v, i = stable_sort(x, ax, False)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        nan = jnp.isnan(x)
        cnt = jnp.sum(~nan, axis=ax, keepdims=True)
        if ignore_nan:
            # lower median of the non-NaN values (NaNs sort last); all-NaN gives NaN
            pos = jnp.maximum(cnt - 1, 0) // 2
        else:
            pos = jnp.full_like(cnt, (n - 1) // 2)
        mv = jnp.take_along_axis(v, pos, axis=ax)
        mi = jnp.take_along_axis(i, pos, axis=ax)
        if not ignore_nan:
            # any NaN: the median is NaN, at the first NaN's index
            any_nan = jnp.any(nan, axis=ax, keepdims=True)
            first_nan = jnp.argmax(nan, axis=ax, keepdims=True).astype(jnp.int64)
            mv = jnp.where(any_nan, jnp.nan, mv).astype(x.dtype)
            mi = jnp.where(any_nan, first_nan, mi)
        return jnp.squeeze(mv, ax), jnp.squeeze(mi, ax)
    pos = (n - 1) // 2
    return jnp.take(v, pos, axis=ax), jnp.take(i, pos, axis=ax)


@lower("median.default")
def _median_all(x):
    return _median_along(x.reshape(-1), 0, False)[0]


@lower("nanmedian.default")
def _nanmedian_all(x):
    return _median_along(x.reshape(-1), 0, True)[0]


@lower("median.dim", static=("dim", "keepdim"))
def _median_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    ax = _axis(x, dim)
    v, i = _median_along(x, ax, False)
    return (jnp.expand_dims(v, ax), jnp.expand_dims(i, ax)) if keepdim else (v, i)


@lower("nanmedian.dim", static=("dim", "keepdim"))
def _nanmedian_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    ax = _axis(x, dim)
    v, i = _median_along(x, ax, True)
    return (jnp.expand_dims(v, ax), jnp.expand_dims(i, ax)) if keepdim else (v, i)


@lower("mode", static=("dim", "keepdim"))
def _mode(x, dim=-1, keepdim=False):
    """Most frequent value along ``dim``; ties between counts go to the smallest value,
    and the index is the last occurrence of that value (PyTorch's CPU rule)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    ax = _axis(x, dim)
    xm = jnp.moveaxis(x, ax, -1)
    n = xm.shape[-1]
    if n == 0:
        raise RuntimeError("mode(): Expected reduction dim to have non-zero size.")
    v, _ = stable_sort(xm, xm.ndim - 1, False)
    # equal neighbours (NaN equal to NaN, as a sort-based count sees them)
    same = (v[..., 1:] == v[..., :-1])
    if jnp.issubdtype(v.dtype, jnp.inexact):
        same = same | (jnp.isnan(v[..., 1:]) & jnp.isnan(v[..., :-1]))
    start = jnp.concatenate([jnp.ones(v.shape[:-1] + (1,), bool), ~same], axis=-1)
    run_id = jnp.cumsum(start, axis=-1) - 1
    counts = jax.vmap(lambda r: jnp.bincount(r, length=n), in_axes=0)(run_id.reshape(-1, n)).reshape(v.shape)
    run_count = jnp.take_along_axis(counts, run_id, axis=-1)
    best = jnp.argmax(run_count, axis=-1)  # first run with the highest count: the smallest value
    val = jnp.take_along_axis(v, best[..., None], axis=-1)[..., 0]
    eq = (xm == val[..., None])
    if jnp.issubdtype(xm.dtype, jnp.inexact):
        eq = eq | (jnp.isnan(xm) & jnp.isnan(val)[..., None])
    last = n - 1 - jnp.argmax(eq[..., ::-1], axis=-1)
    idx = last.astype(jnp.int64)
    if keepdim:
        return jnp.expand_dims(val, ax), jnp.expand_dims(idx, ax)
    return val, idx


# ---------------------------------------------------------------- equal (returns a python bool)
@functools.lru_cache(maxsize=None)
def _all_equal_fn():
    return jax.jit(lambda a, b: jnp.all(a == b))


@impl("equal")
def _equal(self, other):
    if other.device.type != self.device.type:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{self.device} and {other.device}!"
        )
    if self.shape != other.shape:
        return False
    if self.numel() == 0:
        return True
    return bool(_all_equal_fn()(logical_value(self), logical_value(other)))


# ---------------------------------------------------------------- segment_reduce
@lower("segment_reduce", static=("reduce", "axis", "unsafe", "initial"))
def _segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Reduce consecutive segments of ``data`` along ``axis`` (segment sizes from
    ``lengths`` or ``offsets``, batched over the dims before ``axis``)."""
    if lengths is None:
        if offsets is None:
            raise RuntimeError("segment_reduce: either lengths or offsets must be defined")
        lengths = jnp.diff(offsets, axis=-1)
    ax = axis % data.ndim
    n = data.shape[ax]
    lead = data.shape[:ax]
    trail = data.shape[ax + 1:]
    nseg = lengths.shape[-1]
    b = math.prod(lead)
    d = _acc(data).reshape((b, n, math.prod(trail)))
    lens = lengths.reshape((b, nseg)).astype(jnp.int64)
    ends = jnp.cumsum(lens, axis=-1)
    ids = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(n), side="right"))(ends)
    seg = {"sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum, "max": jax.ops.segment_max,
           "min": jax.ops.segment_min, "prod": jax.ops.segment_prod}.get(reduce)
    if seg is None:
        raise RuntimeError(f"segment_reduce: unsupported reduction {reduce}")
    r = jax.vmap(lambda x, i: seg(x, i, num_segments=nseg))(d, ids)  # (b, nseg, t)
    empty = lens[..., None] == 0
    if reduce == "mean":
        r = (r if initial is None else r + initial) / lens[..., None].astype(r.dtype)
    elif initial is not None:
        r = {"sum": lambda: r + initial, "prod": lambda: r * initial,
             "max": lambda: jnp.maximum(r, initial), "min": lambda: jnp.minimum(r, initial)}[reduce]()
    if initial is not None:
        # an empty segment is the initial value itself
        r = jnp.where(empty, jnp.asarray(initial, r.dtype), r)
    return r.reshape(lead + (nseg,) + trail)


# ---------------------------------------------------------------- bincount (output length read on the host)
@functools.lru_cache(maxsize=None)
def _bincount_fn(length, weighted):
    if weighted:
        return jax.jit(lambda x, w: jnp.bincount(x, w, length=length))
    return jax.jit(lambda x: jnp.bincount(x, length=length))


@functools.lru_cache(maxsize=None)
def _minmax_fn():
    return jax.jit(lambda x: jnp.stack([jnp.min(x), jnp.max(x)]))


@impl("bincount")
def _bincount(self, weights=None, minlength=0):
    if self.dim() != 1 or self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and weights.shape != self.shape:
        raise RuntimeError("weights should be 1-d and have the same length as input")
    x = logical_value(self)
    length = minlength
    if self.numel():
        lo, hi = (int(v) for v in storage.to_host(_minmax_fn()(x)))
        if lo < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        length = max(hi + 1, minlength)
    if weights is None:
        out_dtype = torch.int64
        r = _bincount_fn(length, False)(x)
    else:
        # PyTorch's result dtype for these weights (double for float weights)
        out_dtype = torch.bincount(torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=weights.dtype)).dtype
        r = _bincount_fn(length, True)(x, logical_value(weights).astype(dtypes.to_jax(out_dtype)))
    return storage.new_tensor((length,), out_dtype, r.astype(dtypes.to_jax(out_dtype)))


# ---------------------------------------------------------------- histogram
def _torch_linspace(start, end, steps, dtype):
    """PyTorch's CPU linspace formula (from both ends towards the middle), so bin edges
    match CPU's to the bit and values on an edge land in the same bin."""
    i = jnp.arange(steps)
    step = (end - start) / jnp.asarray(max(steps - 1, 1), dtype)
    lo = start + step * i.astype(dtype)
    hi = end - step * (steps - 1 - i).astype(dtype)
    return jnp.where(i < steps // 2, lo, hi).astype(dtype)


def _histogram_counts(x, edges, weight, density):
    """Counts of ``x`` in the bins ``edges`` (last bin closed; outside values ignored)."""
    nb = edges.shape[0] - 1
    v = x.reshape(-1)
    pos = jnp.searchsorted(edges, v, side="right") - 1
    pos = jnp.where(v == edges[-1], nb - 1, pos)  # the right edge belongs to the last bin
    inside = (v >= edges[0]) & (v <= edges[-1])
    w = jnp.ones_like(v) if weight is None else weight.reshape(-1).astype(v.dtype)
    w = jnp.where(inside, w, jnp.zeros((), v.dtype))
    hist = jnp.zeros((nb,), v.dtype).at[jnp.clip(pos, 0, nb - 1)].add(w)
    if density:
        hist = hist / (jnp.sum(hist) * (edges[1:] - edges[:-1]))
    return hist


def _histogram_meta(x, bins=100, range=None, weight=None, density=False):
    # PyTorch has no meta kernel for histogram: its output shapes are (bins,), (bins + 1,)
    nb = bins if isinstance(bins, int) else bins.shape[0] - 1
    return (torch.empty((nb,), dtype=x.dtype, device="meta"), torch.empty((nb + 1,), dtype=x.dtype, device="meta"))


@lower("histogram.bin_ct", static=("bins", "range", "density"), meta=_histogram_meta)
def _histogram_bin_ct(x, bins=100, range=None, weight=None, density=False):
    dt = x.dtype
    if range is not None:
        lo, hi = jnp.asarray(range[0], dt), jnp.asarray(range[1], dt)
    elif x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    else:
        lo, hi = jnp.asarray(0, dt), jnp.asarray(1, dt)
    same = lo == hi  # an empty range widens by 0.5 on each side, as PyTorch does
    lo = jnp.where(same, lo - 0.5, lo)
    hi = jnp.where(same, hi + 0.5, hi)
    edges = _torch_linspace(lo, hi, bins + 1, dt)
    return _histogram_counts(x, edges, weight, density), edges


@lower("histogram.bins_tensor", static=("density",), meta=_histogram_meta)
def _histogram_bins(x, bins, weight=None, density=False):
    return _histogram_counts(x, bins.astype(x.dtype), weight, density), bins


# ---------------------------------------------------------------- spectral (FFT)
# PyTorch's normalization codes: 0 none, 1 by 1/sqrt(n), 2 by 1/n
def _fft_scale(y, n, normalization):
    if normalization == 1:
        return y / jnp.sqrt(jnp.asarray(n, jnp.float64)).astype(y.real.dtype)
    if normalization == 2:
        return y / jnp.asarray(n, y.real.dtype)
    return y


def _complex_of(x):
    return x if jnp.iscomplexobj(x) else x.astype(jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64)


@lower("_fft_r2c", static=("dim", "normalization", "onesided"))
def _fft_r2c(x, dim, normalization, onesided):
    axes = tuple(d % x.ndim for d in dim)
    n = math.prod(x.shape[a] for a in axes)
    y = jnp.fft.rfftn(x, axes=axes) if onesided else jnp.fft.fftn(_complex_of(x), axes=axes)
    return _fft_scale(y, n, normalization)


@lower("_fft_c2c", static=("dim", "normalization", "forward"))
def _fft_c2c(x, dim, normalization, forward):
    axes = tuple(d % x.ndim for d in dim)
    n = math.prod(x.shape[a] for a in axes)
    # norm="forward" leaves the inverse transform unscaled: PyTorch scales separately
    y = jnp.fft.fftn(x, axes=axes, norm="backward") if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    return _fft_scale(y, n, normalization)


@lower("_fft_c2r", static=("dim", "normalization", "last_dim_size"))
def _fft_c2r(x, dim, normalization, last_dim_size):
    axes = tuple(d % x.ndim for d in dim)
    s = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    y = jnp.fft.irfftn(x, s=s, axes=axes, norm="forward")
    return _fft_scale(y, math.prod(s), normalization)


def _bin_position(v, edges):
    nb = edges.shape[0] - 1
    pos = jnp.searchsorted(edges, v, side="right") - 1
    pos = jnp.where(v == edges[-1], nb - 1, pos)
    return jnp.clip(pos, 0, nb - 1), (v >= edges[0]) & (v <= edges[-1])


def _histogramdd_edges(x, bins, rng):
    pts = x.reshape((-1, x.shape[-1]))
    dt = x.dtype
    edges = []
    for d in builtins.range(pts.shape[1]):
        if rng is not None:
            lo, hi = jnp.asarray(rng[2 * d], dt), jnp.asarray(rng[2 * d + 1], dt)
        elif pts.shape[0]:
            lo, hi = jnp.min(pts[:, d]), jnp.max(pts[:, d])
        else:
            lo, hi = jnp.asarray(0, dt), jnp.asarray(1, dt)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        edges.append(_torch_linspace(lo, hi, bins[d] + 1, dt))
    return edges


def _histogramdd_counts(x, edges, weight, density):
    pts = x.reshape((-1, x.shape[-1]))
    nbs = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((pts.shape[0],), jnp.int64)
    inside = jnp.ones((pts.shape[0],), bool)
    for d, e in enumerate(edges):
        pos, ok = _bin_position(pts[:, d], e.astype(pts.dtype))
        flat = flat * nbs[d] + pos
        inside = inside & ok
    w = jnp.ones((pts.shape[0],), pts.dtype) if weight is None else weight.reshape(-1).astype(pts.dtype)
    hist = jnp.zeros((math.prod(nbs),), pts.dtype).at[flat].add(jnp.where(inside, w, jnp.zeros((), pts.dtype)))
    hist = hist.reshape(nbs)
    if density:
        vol = jnp.ones(nbs, pts.dtype)
        for d, e in enumerate(edges):
            shape = [1] * len(nbs)
            shape[d] = nbs[d]
            vol = vol * (e[1:] - e[:-1]).astype(pts.dtype).reshape(shape)
        hist = hist / (jnp.sum(hist) * vol)
    return hist


def _histogramdd_edges_meta(x, bins, range=None, weight=None, density=False):
    return [torch.empty((b + 1,), dtype=x.dtype, device="meta") for b in bins]


def _histogramdd_cts_meta(x, bins, range=None, weight=None, density=False):
    nbs = [b if isinstance(b, int) else b.shape[0] - 1 for b in bins]
    return torch.empty(nbs, dtype=x.dtype, device="meta")


@lower("_histogramdd_bin_edges", static=("bins", "range", "density"), meta=_histogramdd_edges_meta)
def _histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return _histogramdd_edges(x, bins, range)


@lower("_histogramdd_from_bin_cts", static=("bins", "range", "density"), meta=_histogramdd_cts_meta)
def _histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    return _histogramdd_counts(x, _histogramdd_edges(x, bins, range), weight, density)


@lower("_histogramdd_from_bin_tensors", static=("density",), meta=_histogramdd_cts_meta)
def _histogramdd_from_bin_tensors(x, bins, weight=None, density=False):
    return _histogramdd_counts(x, bins, weight, density)


# ---------------------------------------------------------------- hash_tensor
@lower("hash_tensor", static=("dim", "keepdim", "mode"))
def _hash_tensor(x, dim=(), keepdim=False, mode=0):
    """XOR of the elements' 64-bit patterns (floats widened to float64, integers to
    int64), reduced over ``dim`` (all dims when empty), as PyTorch's mode 0."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor: unsupported mode {mode}")
    wide = x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.int64)
    bits = lax.bitcast_convert_type(wide, jnp.uint64)
    axes = _axes(x, dim)
    r = lax.reduce(bits, jnp.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        r = jnp.expand_dims(r, axes)
    return r
