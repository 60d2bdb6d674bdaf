"""Neural-network ops: softmax, normalizations, activation backwards, losses,
embeddings, convolution, pooling, upsampling, dropout and attention.

Every forward op that autograd differentiates through a dedicated backward op
(``native_layer_norm`` -> ``native_layer_norm_backward``, ...) has both
lowered here, so a training step stays on the device. bfloat16/float16 inputs
are computed in float32 and rounded once at the end, as ATen's CPU kernels do.

Checks that PyTorch makes on values (a class index out of range, an embedding
index out of range) cannot raise inside a compiled XLA program: such entries
give NaN instead of a silently clamped, plausible-looking number.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.scipy.special import erf

from ..base import dtypes
from ..dispatch.lowering import impl, lower
from ..runtime.checks import check_index
from .linalg import einsum, matmul_precision

aten = torch.ops.aten
_LOW = (jnp.bfloat16, jnp.float16)


def _acc(x):
    """Compute dtype: float32 for half types, unchanged otherwise."""
    return x.astype(jnp.float32) if x.dtype in _LOW else x


def _fl(x):
    """A floating compute dtype for any input."""
    if x.dtype in _LOW:
        return x.astype(jnp.float32)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


def _meta_filled(opname):
    """PyTorch's meta of ``opname`` with outputs it leaves undefined (a backward's
    masked-out gradients) given as empty tensors: the kernel executor's outputs are all
    tensors. Autograd reads only the gradients it asked for."""
    pkt, _, ov = opname.partition(".")
    op = getattr(getattr(aten, pkt), ov or "default")

    def meta(*args, **kwargs):
        out = op(*args, **kwargs)
        ref = next(a for a in args if isinstance(a, torch.Tensor))
        return tuple(torch.empty((0,), dtype=ref.dtype, device="meta") if o is None else o for o in out)

    return meta


def _filled(*outs):
    """Lowering-side twin of ``_meta_filled``: None -> an empty array."""
    return tuple(jnp.zeros((0,), jnp.float32) if o is None else o for o in outs)


def _reduce(loss, reduction):
    """PyTorch's reduction enum: 0 none, 1 mean, 2 sum."""
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _grad_scale(grad, shape, reduction):
    """Gradient of a reduced loss w.r.t. each element, broadcast to ``shape``."""
    g = _acc(grad)
    if reduction == 1 and math.prod(shape):
        g = g / math.prod(shape)
    return jnp.broadcast_to(g, shape)


# ================================================================ softmax
@lower("_softmax")
def _softmax(x, dim, half_to_float):
    if x.ndim == 0:
        return jnp.ones_like(_acc(x))
    return jax.nn.softmax(_acc(x), axis=dim)


@lower("_log_softmax")
def _log_softmax(x, dim, half_to_float):
    if x.ndim == 0:
        return jnp.zeros_like(_acc(x))
    return jax.nn.log_softmax(_acc(x), axis=dim)


@lower("_softmax_backward_data")
def _softmax_backward(grad, out, dim, input_dtype):
    g, y = _acc(grad), _acc(out)
    if y.ndim == 0:
        return jnp.zeros_like(g)
    gy = g * y
    return gy - y * jnp.sum(gy, axis=dim, keepdims=True)


@lower("_log_softmax_backward_data")
def _log_softmax_backward(grad, out, dim, input_dtype):
    g, y = _acc(grad), _acc(out)
    if y.ndim == 0:
        return jnp.zeros_like(g)
    return g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)


@lower("_safe_softmax")
def _safe_softmax(x, dim, dtype=None):
    """Softmax whose rows of all -inf give 0 instead of NaN (SDPA's math path)."""
    xf = _acc(x) if dtype is None else x.astype(dtypes.to_jax(dtype))
    if xf.ndim == 0:
        return jnp.where(jnp.isneginf(xf), 0.0, 1.0).astype(xf.dtype)
    out = jax.nn.softmax(xf, axis=dim)
    masked = jnp.all(jnp.isneginf(xf), axis=dim, keepdims=True)
    return jnp.where(masked, 0.0, out)


# ================================================================ layer norm / rms norm
def _norm_axes(x, normalized_shape):
    k = len(normalized_shape)
    return tuple(range(x.ndim - k, x.ndim))


def _layer_norm_meta(x, normalized_shape, weight, bias, eps):
    # ATen's CPU kernel keeps mean/rstd in the input's dtype unless the parameters' dtype
    # differs (mixed precision); its meta kernel always says float for reduced precision
    y, mean, rstd = aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)
    params = [p for p in (weight, bias) if p is not None]
    if all(p.dtype == x.dtype for p in params):
        mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    return y, mean, rstd


@lower("native_layer_norm", meta=_layer_norm_meta)
def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = _norm_axes(x, normalized_shape)
    xf = _acc(x)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    xc = xf - mean
    var = jnp.mean(jnp.square(xc), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = xc * rstd
    if weight is not None:
        y = y * _acc(weight)
    if bias is not None:
        y = y + _acc(bias)
    return y, mean, rstd


def _weighted_row_mean(a, wf, axes):
    """mean(a * wf) over the normalized ``axes`` (the trailing ones), keepdims. With a weight it
    is a dot with the weight, not a multiply-reduce of the broadcast weight (see the norm
    backwards below)."""
    if wf is None:
        return jnp.mean(a, axis=axes, keepdims=True)
    n = math.prod(a.shape[i] for i in axes)
    s = jnp.tensordot(a, wf, axes=len(axes), precision=lax.Precision.HIGHEST)
    return (s / n).reshape(s.shape + (1,) * len(axes))


@lower("native_layer_norm_backward", meta=_meta_filled("native_layer_norm_backward"))
def _layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = _norm_axes(x, normalized_shape)
    batch_axes = tuple(range(x.ndim - len(axes)))
    g = _acc(grad_out)
    xf = _acc(x)
    mean, rstd = _acc(mean), _acc(rstd)
    xhat = (xf - mean) * rstd
    # Every product reduced here includes grad_out, and the weight enters the row sums through a
    # dot rather than broadcast: in a fused DeferAndFuse step XLA materializes the operands of a
    # multiply-reduce (with broadcasts expanded), and an operand made of forward values only (xhat,
    # the broadcast weight) was computed during the forward and held, one activation-sized buffer
    # per norm, until the backward.
    gx = g * xhat
    dx = dw = db = None
    if output_mask[0]:
        wf = _acc(weight) if weight is not None else None
        gw = g * wf if wf is not None else g
        dx = rstd * (gw - _weighted_row_mean(g, wf, axes) - xhat * _weighted_row_mean(gx, wf, axes))
    if output_mask[1] and weight is not None:
        dw = jnp.sum(gx, axis=batch_axes)
    if output_mask[2] and bias is not None:
        db = jnp.sum(g, axis=batch_axes)
    return _filled(dx, dw, db)


def _rms_eps(x, eps):
    return float(jnp.finfo(x.dtype).eps) if eps is None else eps


@lower("_fused_rms_norm")
def _rms_norm(x, normalized_shape, weight, eps):
    axes = _norm_axes(x, normalized_shape)
    xf = _acc(x)
    rstd = lax.rsqrt(jnp.mean(jnp.square(xf), axis=axes, keepdims=True) + _rms_eps(x, eps))
    y = xf * rstd
    if weight is not None:
        y = y * _acc(weight)
    return y, rstd


@lower("_fused_rms_norm_backward", meta=_meta_filled("_fused_rms_norm_backward"))
def _rms_norm_backward(grad_out, x, normalized_shape, rstd, weight, output_mask):
    axes = _norm_axes(x, normalized_shape)
    batch_axes = tuple(range(x.ndim - len(axes)))
    g = _acc(grad_out)
    xhat = _acc(x) * _acc(rstd)
    gx = g * xhat  # as in the layer norm backward: reduced products include grad_out
    dx = dw = None
    if output_mask[0]:
        wf = _acc(weight) if weight is not None else None
        gw = g * wf if wf is not None else g
        dx = _acc(rstd) * (gw - xhat * _weighted_row_mean(gx, wf, axes))
    if output_mask[1] and weight is not None:
        dw = jnp.sum(gx, axis=batch_axes)
    return _filled(dx, dw)


# ================================================================ batch norm
def _bn_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _bn_apply(xf, mean, invstd, weight, bias):
    shp = _bn_shape(xf)
    y = (xf - mean.reshape(shp)) * invstd.reshape(shp)
    if weight is not None:
        y = y * _acc(weight).reshape(shp)
    if bias is not None:
        y = y + _acc(bias).reshape(shp)
    return y


def _bn_train(x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch statistics; running stats updated with the unbiased variance."""
    xf = _acc(x)
    axes = _bn_axes(x)
    n = x.size // x.shape[1] if x.shape[1] else 0
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - mean.reshape(_bn_shape(x))), axis=axes)
    invstd = lax.rsqrt(var + eps)
    y = _bn_apply(xf, mean, invstd, weight, bias)
    new_rm = new_rv = None
    if running_mean is not None:
        new_rm = (1 - momentum) * _acc(running_mean) + momentum * mean
    if running_var is not None:
        unbiased = var * (n / (n - 1)) if n > 1 else var
        new_rv = (1 - momentum) * _acc(running_var) + momentum * unbiased
    return y, mean, invstd, new_rm, new_rv


def _bn_eval_stats(running_mean, running_var, eps):
    """The (mean, invstd) an eval-mode batch norm reports: the running statistics'."""
    return _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)


def _bn_eval(x, weight, bias, running_mean, running_var, eps):
    xf = _acc(x)
    invstd = lax.rsqrt(_acc(running_var) + eps)
    return _bn_apply(xf, _acc(running_mean), invstd, weight, bias)


@lower("_native_batch_norm_legit_functional")
def _bn_legit_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        y, mean, invstd, rm, rv = _bn_train(x, weight, bias, running_mean, running_var, momentum, eps)
        return y, mean, invstd, rm, rv
    y = _bn_eval(x, weight, bias, running_mean, running_var, eps)
    mean, invstd = _bn_eval_stats(running_mean, running_var, eps)
    return y, mean, invstd, running_mean, running_var


@lower("_native_batch_norm_legit.no_stats")
def _bn_legit_no_stats(x, weight, bias, training, momentum, eps):
    y, mean, invstd, _, _ = _bn_train(x, weight, bias, None, None, momentum, eps)
    return y, mean, invstd


@lower("_native_batch_norm_legit_no_training")
def _bn_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    y = _bn_eval(x, weight, bias, running_mean, running_var, eps)
    return (y,) + _bn_eval_stats(running_mean, running_var, eps)


@lower("_batch_norm_with_update_functional")
def _bn_with_update_functional(x, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, invstd, rm, rv = _bn_train(x, weight, bias, running_mean, running_var, momentum, eps)
    return y, mean, invstd, jnp.zeros((0,), jnp.uint8), rm, rv


@lower("_batch_norm_no_update")
def _bn_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:
        y, mean, invstd, _, _ = _bn_train(x, weight, bias, None, None, momentum, eps)
        return y, mean, invstd, jnp.zeros((0,), jnp.uint8)
    y = _bn_eval(x, weight, bias, running_mean, running_var, eps)
    return (y,) + _bn_eval_stats(running_mean, running_var, eps) + (jnp.zeros((0,), jnp.uint8),)


def _copy_stats(running_mean, running_var, new_rm, new_rv):
    # the running statistics are updated in place, as ATen's kernels do
    if running_mean is not None:
        running_mean.copy_(new_rm)
    if running_var is not None:
        running_var.copy_(new_rv)


def _cpu_saved_stats(x, weight, mean, invstd, training):
    """The saved statistics as ATen's CPU kernel reports them: empty in eval mode, and in the
    input's dtype unless the parameters' dtype differs from it (mixed precision keeps float)."""
    if not training:
        return x.new_empty((0,)), x.new_empty((0,))
    dt = x.dtype if weight is None or weight.dtype == x.dtype else mean.dtype
    return mean.to(dt), invstd.to(dt)


@impl("native_batch_norm")
def _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    y, mean, invstd = _native_batch_norm_stats(x, weight, bias, running_mean, running_var, training, momentum, eps)
    return (y,) + _cpu_saved_stats(x, weight, mean, invstd, training)


def _native_batch_norm_stats(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        if running_mean is None and running_var is None:
            return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)
        if running_mean is None or running_var is None:
            raise RuntimeError("torchtpu: batch_norm needs both running_mean and running_var, or neither")
        y, mean, invstd, rm, rv = aten._native_batch_norm_legit_functional(
            x, weight, bias, running_mean, running_var, True, momentum, eps)
        _copy_stats(running_mean, running_var, rm, rv)
        return y, mean, invstd
    if running_mean is None or running_var is None:
        raise RuntimeError("running_mean and running_var must be defined in evaluation mode")
    return aten._native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps)


@impl("_native_batch_norm_legit")
def _native_batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)


@impl("_batch_norm_with_update")
def _batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, invstd, reserve, rm, rv = aten._batch_norm_with_update_functional(
        x, weight, bias, running_mean, running_var, momentum, eps)
    _copy_stats(running_mean, running_var, rm, rv)
    return (y,) + _cpu_saved_stats(x, weight, mean, invstd, True) + (reserve,)


def _bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    g = _acc(grad_out)
    xf = _acc(x)
    axes = _bn_axes(x)
    shp = _bn_shape(x)
    if train:
        mean, invstd = _acc(save_mean), _acc(save_invstd)
    else:
        mean, invstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
    w = _acc(weight) if weight is not None else jnp.ones((x.shape[1],), xf.dtype)
    xhat = (xf - mean.reshape(shp)) * invstd.reshape(shp)
    sum_g = jnp.sum(g, axis=axes)
    sum_gx = jnp.sum(g * xhat, axis=axes)
    dx = dw = db = None
    if output_mask[0]:
        scale = (w * invstd).reshape(shp)
        if train:
            n = x.size // x.shape[1]
            dx = scale * (g - (sum_g / n).reshape(shp) - xhat * (sum_gx / n).reshape(shp))
        else:
            dx = g * scale
    if output_mask[1]:
        dw = sum_gx
    if output_mask[2]:
        db = sum_g
    return _filled(dx, dw, db)


@lower("native_batch_norm_backward", meta=_meta_filled("native_batch_norm_backward"))
def _native_bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                        output_mask):
    return _bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                        output_mask)


@lower("batch_norm_backward", meta=_meta_filled("batch_norm_backward"))
def _batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_var, update, eps,
                         output_mask, reserve):
    return _bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask)


# ================================================================ group norm
@lower("native_group_norm")
def _group_norm(x, weight, bias, N, C, HxW, group, eps):
    xf = _acc(x).reshape(N, group, -1)
    mean = jnp.mean(xf, axis=-1)
    var = jnp.mean(jnp.square(xf - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    y = ((xf - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    if weight is not None:
        y = y * _acc(weight)[None, :, None]
    if bias is not None:
        y = y + _acc(bias)[None, :, None]
    return y.reshape(x.shape), mean, rstd


@lower("native_group_norm_backward", meta=_meta_filled("native_group_norm_backward"))
def _group_norm_backward(grad_out, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    g = _acc(grad_out).reshape(N, C, -1)
    xf = _acc(x).reshape(N, group, -1)
    mean, rstd = _acc(mean), _acc(rstd)
    xhat = ((xf - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    dx = dw = db = None
    if output_mask[0]:
        gw = g * _acc(weight)[None, :, None] if weight is not None else g
        gw = gw.reshape(N, group, -1)
        xh = xhat.reshape(N, group, -1)
        dx = rstd[..., None] * (gw - jnp.mean(gw, axis=-1, keepdims=True)
                                - xh * jnp.mean(gw * xh, axis=-1, keepdims=True))
        dx = dx.reshape(x.shape)
    if output_mask[1]:
        dw = jnp.sum(g * xhat, axis=(0, 2))
    if output_mask[2]:
        db = jnp.sum(g, axis=(0, 2))
    return _filled(dx, dw, db)


# ================================================================ activation backwards
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@lower("gelu_backward")
def _gelu_backward(grad, x, approximate="none"):
    g, xf = _acc(grad), _acc(x)
    if approximate == "tanh":
        kappa = 0.044715
        inner = _SQRT_2_OVER_PI * (xf + kappa * xf * xf * xf)
        t = jnp.tanh(inner)
        left_d = 0.5 * (1 + t)
        right_d = 0.5 * xf * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * kappa * xf * xf)
        return g * (left_d + right_d)
    cdf = 0.5 * (1 + erf(xf / math.sqrt(2.0)))
    pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * xf * xf)
    return g * (cdf + xf * pdf)


@lower("silu_backward")
def _silu_backward(grad, x):
    g, xf = _acc(grad), _acc(x)
    s = jax.nn.sigmoid(xf)
    return g * s * (1 + xf * (1 - s))


@lower("threshold_backward")
def _threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


@lower("sigmoid_backward")
def _sigmoid_backward(grad, y):
    return grad * (1 - jnp.conj(y)) * jnp.conj(y)


@lower("tanh_backward")
def _tanh_backward(grad, y):
    return grad * (1 - jnp.conj(y) * jnp.conj(y))


@lower("leaky_relu_backward")
def _leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@lower("elu_backward")
def _elu_backward(grad, alpha, scale, input_scale, is_result, x):
    if is_result:
        neg = grad * input_scale * (x + alpha * scale)
    else:
        neg = grad * input_scale * alpha * scale * jnp.exp(_fl(x) * input_scale)
    return jnp.where(x <= 0, neg, grad * scale)


@lower("hardtanh_backward")
def _hardtanh_backward(grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros((), grad.dtype), grad)


@lower("softplus_backward")
def _softplus_backward(grad, x, beta, threshold):
    z = jnp.exp(_acc(x) * beta)
    return jnp.where(x * beta > threshold, _acc(grad), _acc(grad) * z / (z + 1))


@lower("hardswish_backward")
def _hardswish_backward(grad, x):
    g, xf = _acc(grad), _acc(x)
    return jnp.where(xf < -3, 0.0, jnp.where(xf <= 3, g * (xf / 3 + 0.5), g))


@lower("hardsigmoid_backward")
def _hardsigmoid_backward(grad, x):
    return jnp.where((x > -3) & (x < 3), _acc(grad) / 6, 0.0)


@lower("mish_backward")
def _mish_backward(grad, x):
    g, xf = _acc(grad), _acc(x)
    tsp = jnp.tanh(jax.nn.softplus(xf))
    return g * (tsp + xf * jax.nn.sigmoid(xf) * (1 - tsp * tsp))


@lower("log_sigmoid_forward")
def _log_sigmoid_forward(x):
    xf = _acc(x)
    return -jax.nn.softplus(-xf), jnp.exp(-jnp.abs(xf))


@lower("log_sigmoid_backward")
def _log_sigmoid_backward(grad, x, buffer):
    # recomputed from x: the buffer's contents differ between ATen backends
    g, xf = _acc(grad), _acc(x)
    return g * jax.nn.sigmoid(-xf)


@lower("glu_backward")
def _glu_backward(grad, x, dim):
    a, b = jnp.split(_acc(x), 2, axis=dim)
    g = _acc(grad)
    sb = jax.nn.sigmoid(b)
    return jnp.concatenate([g * sb, g * a * sb * (1 - sb)], axis=dim)


@lower("_prelu_kernel")
def _prelu_kernel(x, weight):
    return jnp.where(x > 0, x, x * weight)


@lower("_prelu_kernel_backward")
def _prelu_kernel_backward(grad, x, weight):
    # both gradients in the broadcast shape: autograd sums the weight's back to its shape
    gx = jnp.where(x > 0, grad, grad * weight)
    gw = jnp.where(x > 0, 0, grad * x)
    shape = jnp.broadcast_shapes(x.shape, weight.shape)
    return jnp.broadcast_to(gx, shape), jnp.broadcast_to(gw, shape)


# ================================================================ embeddings
# (``embedding`` itself is lowered in indexing.py)
def _checked_rows(indices, n):
    """Indices outside [0, n) become n, which ``jnp.take`` fills with NaN (or
    the integer minimum): an error shows in the value instead of a wrapped row."""
    return jnp.where((indices < 0) | (indices >= n), n, indices)


@lower("embedding_dense_backward")
def _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    d = grad.shape[-1]
    idx = indices.reshape(-1)
    g = _acc(grad).reshape(-1, d)
    if scale_grad_by_freq:
        counts = jax.ops.segment_sum(jnp.ones_like(idx, dtype=g.dtype), idx, num_segments=num_weights)
        g = g / jnp.take(counts, idx, mode="clip")[:, None]
    if padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], 0, g)
    return jax.ops.segment_sum(g, idx, num_segments=num_weights)


def _offset2bag(indices, offsets, include_last_offset):
    nb = offsets.shape[0] - (1 if include_last_offset else 0)
    pos = jnp.arange(indices.shape[0], dtype=offsets.dtype)
    bag = jnp.searchsorted(offsets, pos, side="right") - 1
    return jnp.clip(bag, 0, max(nb - 1, 0)), nb


def _embedding_bag_impl(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                        include_last_offset, padding_idx):
    n, d = weight.shape
    bag, nb = _offset2bag(indices, offsets, include_last_offset)
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    if include_last_offset:
        # indices past the last offset belong to no bag
        valid = valid & (jnp.arange(indices.shape[0]) < offsets[-1])
    check_index(indices, n, "embedding_bag: input takes value {value} which is not in the valid range [0, {size})")
    rows = jnp.take(weight, _checked_rows(indices, n), axis=0, mode="fill")
    wf = _acc(rows)
    counts = jax.ops.segment_sum(valid.astype(jnp.int64), bag, num_segments=nb)
    # bag_size has one entry per offset (a trailing 0 with include_last_offset), as in ATen
    bag_size = jnp.pad(counts, (0, offsets.shape[0] - nb))
    if mode == 2:  # max
        neg = jnp.full_like(wf, -jnp.inf)
        vals = jnp.where(valid[:, None], wf, neg)
        out = jax.ops.segment_max(vals, bag, num_segments=nb)
        is_max = (vals == out[bag]) & valid[:, None]
        cand = jnp.where(is_max, indices[:, None], jnp.iinfo(jnp.int64).max)
        max_idx = jax.ops.segment_min(cand, bag, num_segments=nb)
        empty = (counts == 0)[:, None]
        out = jnp.where(empty, 0, out)
        max_idx = jnp.where(empty, 0, max_idx).astype(jnp.int64)
        return out, bag.astype(jnp.int64), bag_size, max_idx
    if per_sample_weights is not None:
        wf = wf * _acc(per_sample_weights)[:, None]
    wf = jnp.where(valid[:, None], wf, 0)
    out = jax.ops.segment_sum(wf, bag, num_segments=nb)
    if mode == 1:
        out = out / jnp.maximum(counts, 1)[:, None].astype(out.dtype)
    return out, bag.astype(jnp.int64), bag_size, jnp.zeros((0,), jnp.int64)


lower("_embedding_bag")(_embedding_bag_impl)
lower("_embedding_bag_forward_only")(_embedding_bag_impl)


@lower("_embedding_bag_dense_backward")
def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    g = _acc(grad)
    d = g.shape[-1]
    valid = indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)
    if mode == 2:
        flat = maximum_indices.reshape(-1)
        gm = g.reshape(-1, d)
        cols = jnp.broadcast_to(jnp.arange(d), gm.shape).reshape(-1)
        nonempty = jnp.repeat(bag_size > 0, d)
        out = jnp.zeros((num_weights, d), g.dtype)
        return out.at[flat, cols].add(jnp.where(nonempty, gm.reshape(-1), 0), mode="drop")
    rows = jnp.take(g, offset2bag, axis=0)
    if mode == 1:
        rows = rows / jnp.maximum(jnp.take(bag_size, offset2bag), 1)[:, None].astype(rows.dtype)
    if per_sample_weights is not None:
        rows = rows * _acc(per_sample_weights)[:, None]
    if scale_grad_by_freq:
        counts = jax.ops.segment_sum(valid.astype(g.dtype), indices, num_segments=num_weights)
        rows = rows / jnp.maximum(jnp.take(counts, indices, mode="clip"), 1)[:, None]
    rows = jnp.where(valid[:, None], rows, 0)
    return jax.ops.segment_sum(rows, indices, num_segments=num_weights)


@lower("_embedding_bag_backward")
def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:
        raise NotImplementedError("torchtpu: sparse gradients (EmbeddingBag(sparse=True)) are not supported on tpu")
    return _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                         scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lower("_embedding_bag_per_sample_weights_backward")
def _embedding_bag_psw_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    rows = jnp.take(weight, _checked_rows(indices, weight.shape[0]), axis=0, mode="fill")
    g = jnp.take(grad, offset2bag, axis=0)
    out = jnp.sum(_acc(g) * _acc(rows), axis=-1)
    if padding_idx >= 0:
        out = jnp.where(indices == padding_idx, 0, out)
    return out


# ================================================================ losses
def _nll_parts(x, target, weight, ignore_index):
    """Per-element picked log-prob, weights, and validity for class axis 1
    (or 0 for an unbatched (C,) input)."""
    unbatched = x.ndim == 1
    if unbatched:
        x, target = x[None], target[None]
    c = x.shape[1]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < c)
    t = jnp.where(valid & in_range, target, 0)
    picked = jnp.take_along_axis(_acc(x), t[:, None], axis=1)[:, 0]
    w = _acc(weight)[t] if weight is not None else jnp.ones(t.shape, _acc(x).dtype)
    w = jnp.where(valid, w, 0)
    # a class index out of range is an error in PyTorch: NaN here, never a clamped value
    picked = jnp.where(valid & ~in_range, jnp.nan, picked)
    return picked, w, t, valid, unbatched


def _nll_forward(x, target, weight, reduction, ignore_index):
    picked, w, _, _, unbatched = _nll_parts(x, target, weight, ignore_index)
    losses = -picked * w
    total = jnp.sum(w)
    if reduction == 0:
        return (losses[0] if unbatched else losses), jnp.zeros((), losses.dtype)
    if reduction == 1:
        return jnp.sum(losses) / total, total
    return jnp.sum(losses), total


def _nll_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    _, w, t, _, unbatched = _nll_parts(x, target, weight, ignore_index)
    g = _acc(grad)
    if reduction == 0:
        g = g.reshape(w.shape) if not unbatched else g.reshape(1)
        coef = -w * g
    elif reduction == 1:
        coef = -w * g / _acc(total_weight)
    else:
        coef = -w * g
    xs = x[None] if unbatched else x
    onehot = jax.nn.one_hot(t, xs.shape[1], axis=1, dtype=coef.dtype)
    coef = coef.reshape(coef.shape[:1] + (1,) + coef.shape[1:])
    out = onehot * coef
    return out[0] if unbatched else out


lower("nll_loss_forward", "nll_loss2d_forward")(_nll_forward)
lower("nll_loss_backward", "nll_loss2d_backward")(_nll_backward)


@lower("mse_loss")
def _mse_loss(x, target, reduction=1):
    return _reduce(jnp.square(_acc(x) - _acc(target)), reduction)


@lower("mse_loss_backward")
def _mse_loss_backward(grad, x, target, reduction):
    d = _acc(x) - _acc(target)
    return 2 * d * _grad_scale(grad, d.shape, reduction)


@lower("binary_cross_entropy")
def _bce(x, target, weight=None, reduction=1):
    xf, t = _acc(x), _acc(target)
    # PyTorch clamps each log at -100 so that a saturated probability gives a finite loss
    loss = -(t * jnp.maximum(jnp.log(xf), -100) + (1 - t) * jnp.maximum(jnp.log1p(-xf), -100))
    if weight is not None:
        loss = loss * _acc(weight)
    return _reduce(loss, reduction)


@lower("binary_cross_entropy_backward")
def _bce_backward(grad, x, target, weight=None, reduction=1):
    xf, t = _acc(x), _acc(target)
    g = _grad_scale(grad, jnp.broadcast_shapes(xf.shape, t.shape), reduction)
    out = g * (xf - t) / jnp.maximum((1 - xf) * xf, 1e-12)
    if weight is not None:
        out = out * _acc(weight)
    return out


@lower("binary_cross_entropy_with_logits")
def _bce_logits(x, target, weight=None, pos_weight=None, reduction=1):
    xf, t = _acc(x), _acc(target)
    softplus_neg = jnp.log1p(jnp.exp(-jnp.abs(xf))) + jnp.maximum(-xf, 0)  # log(1 + exp(-x))
    if pos_weight is not None:
        log_w = (_acc(pos_weight) - 1) * t + 1
        loss = (1 - t) * xf + log_w * softplus_neg
    else:
        loss = (1 - t) * xf + softplus_neg
    if weight is not None:
        loss = loss * _acc(weight)
    return _reduce(loss, reduction)


@lower("smooth_l1_loss")
def _smooth_l1(x, target, reduction=1, beta=1.0):
    z = jnp.abs(_acc(x) - _acc(target))
    loss = z if beta == 0 else jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)
    return _reduce(loss, reduction)


@lower("smooth_l1_loss_backward")
def _smooth_l1_backward(grad, x, target, reduction, beta):
    d = _acc(x) - _acc(target)
    g = _grad_scale(grad, d.shape, reduction)
    if beta == 0:
        return g * jnp.sign(d)
    return jnp.where(d < -beta, -g, jnp.where(d > beta, g, g * d / beta))


@lower("huber_loss")
def _huber(x, target, reduction=1, delta=1.0):
    z = jnp.abs(_acc(x) - _acc(target))
    return _reduce(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)), reduction)


@lower("huber_loss_backward")
def _huber_backward(grad, x, target, reduction, delta):
    d = _acc(x) - _acc(target)
    g = _grad_scale(grad, d.shape, reduction)
    return jnp.where(d < -delta, -g * delta, jnp.where(d > delta, g * delta, g * d))


@lower("soft_margin_loss")
def _soft_margin(x, target, reduction=1):
    return _reduce(jax.nn.softplus(-_acc(target) * _acc(x)), reduction)


@lower("soft_margin_loss_backward")
def _soft_margin_backward(grad, x, target, reduction):
    xf, t = _acc(x), _acc(target)
    g = _grad_scale(grad, xf.shape, reduction)
    return g * (-t) * jax.nn.sigmoid(-t * xf)


# ================================================================ convolution
def _conv_dn(nd):
    spatial = "DHW"[-nd:] if nd <= 3 else None
    return ("NC" + spatial, "OI" + spatial, "NC" + spatial)


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    """N-d convolution (or its transpose) in PyTorch's NC... / OI... layouts."""
    nd = x.ndim - 2
    dn = _conv_dn(nd)
    kw = {"precision": matmul_precision()}
    if x.dtype in _LOW:
        kw["preferred_element_type"] = jnp.float32
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    if not transposed:
        return lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=dn, feature_group_count=groups, **kw)
    # transposed: weight is (Cin, Cout/groups, k...); the gradient of a strided conv
    # w.r.t. its input = a conv of the lhs-dilated input with the flipped kernel
    cin = w.shape[0]
    cout_g = w.shape[1]
    k = w.shape[2:]
    wt = w.reshape((groups, cin // groups, cout_g) + k)
    wt = jnp.swapaxes(wt, 1, 2).reshape((groups * cout_g, cin // groups) + k)
    wt = jnp.flip(wt, axis=tuple(range(2, 2 + nd)))
    pads = []
    for i in range(nd):
        lo = dilation[i] * (k[i] - 1) - padding[i]
        pads.append((lo, lo + output_padding[i]))
    return lax.conv_general_dilated(
        x, wt, window_strides=[1] * nd, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=dn, feature_group_count=groups, **kw)


def _conv_unbatched(x, w, *args):
    # PyTorch accepts an unbatched (C, spatial...) input
    if x.ndim == w.ndim - 1:
        return _conv(x[None], w, *args)[0]
    return _conv(x, w, *args)


def _convolution_fwd(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv_unbatched(x, w, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + _acc(bias).reshape((-1,) + (1,) * (w.ndim - 2))
    return out


def _check_conv_bias(w, bias, transposed, groups):
    """CPU's check of the bias' shape, which PyTorch's meta kernel leaves out (a 0-dim bias broadcast)."""
    if bias is None:
        return
    n = w.shape[1] * groups if transposed else w.shape[0]
    if bias.dim() != 1 or bias.shape[0] != n:
        given = f"Given transposed=1, weight of size {list(w.shape)}" if transposed else f"Given weight of size {list(w.shape)}"
        raise RuntimeError(f"{given}, expected bias to be 1-dimensional with {n} elements, but got bias of size "
                           f"{list(bias.shape)} instead")


def _convolution_meta(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    _check_conv_bias(w, bias, transposed, groups)
    return aten.convolution.default(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


def _convolution_full_meta(x, w, bias, stride, padding, dilation, transposed, output_padding, groups, *flags):
    _check_conv_bias(w, bias, transposed, groups)
    return aten._convolution.default(x, w, bias, stride, padding, dilation, transposed, output_padding, groups,
                                     *flags)


lower("convolution", "convolution_overrideable", meta=_convolution_meta)(_convolution_fwd)


@lower("_convolution", meta=_convolution_full_meta)
def _convolution_full(x, w, bias, stride, padding, dilation, transposed, output_padding, groups, benchmark,
                      deterministic, cudnn_enabled, allow_tf32):
    return _convolution_fwd(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


def _conv_backward(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                   output_mask):
    def f(x_, w_):
        return _conv_unbatched(x_, w_, stride, padding, dilation, transposed, output_padding, groups)

    out, vjp = jax.vjp(f, x, w)
    gx, gw = vjp(grad_out.astype(out.dtype))
    gb = None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_out.ndim)) if grad_out.ndim == w.ndim else tuple(range(1, grad_out.ndim))
        gb = jnp.sum(_acc(grad_out), axis=axes)
    return _filled(gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


@lower("convolution_backward", meta=_meta_filled("convolution_backward"))
def _convolution_backward(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask):
    return _conv_backward(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask)


@lower("convolution_backward_overrideable", meta=_meta_filled("convolution_backward_overrideable"))
def _convolution_backward_overrideable(grad_out, x, w, stride, padding, dilation, transposed, output_padding,
                                       groups, output_mask):
    return _conv_backward(grad_out, x, w, None, stride, padding, dilation, transposed, output_padding, groups,
                          output_mask)


# ================================================================ pooling
def _tuple(v, n):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _pool_out_size(size, k, s, p, d, ceil_mode):
    eff = d * (k - 1) + 1
    num = size + 2 * p - eff
    out = (-(-num // s) if ceil_mode else num // s) + 1
    # the last window must start inside the input or the left padding
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    k = _tuple(kernel_size, nd)
    s = _tuple(stride, nd) if stride else k
    p = _tuple(padding, nd)
    d = _tuple(dilation, nd)
    sizes = x.shape[-nd:]
    outs = [_pool_out_size(sizes[i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(nd)]
    return k, s, p, d, outs


def _gather_windows(x, positions, valids):
    """Windows of the trailing len(positions) axes of ``x``.

    positions[i]: (out_i, k_i) input indices along spatial axis i (any values),
    valids[i]: which of them are real. Returns the windows (..., out..., prod(k))
    with invalid entries at the dtype's lowest value, and the flat spatial index
    (out..., prod(k)) of every window element.
    """
    nd = len(positions)
    sizes = x.shape[-nd:]
    lead = x.ndim - nd
    for i, pos in enumerate(positions):
        axis = lead + 2 * i  # earlier axes have become (out, k) pairs
        o, k = pos.shape
        x = jnp.take(x, np.clip(pos, 0, sizes[i] - 1).reshape(-1), axis=axis)
        x = x.reshape(x.shape[:axis] + (o, k) + x.shape[axis + 1:])
    # (..., o1, k1, o2, k2, ...) -> (..., o1, o2, ..., k1, k2, ...)
    perm = list(range(lead)) + [lead + 2 * i for i in range(nd)] + [lead + 2 * i + 1 for i in range(nd)]
    x = jnp.transpose(x, perm)
    outs = [p.shape[0] for p in positions]
    ks = [p.shape[1] for p in positions]
    x = x.reshape(x.shape[:lead] + tuple(outs) + (math.prod(ks),))
    valid = np.ones((), bool)
    flat = np.zeros((), np.int64)
    for i, (pos, ok) in enumerate(zip(positions, valids)):
        # broadcast (o_i, k_i) into the (o..., k...) grid
        shape = [1] * (2 * nd)
        shape[i], shape[nd + i] = pos.shape
        valid = valid & ok.reshape(shape)
        flat = flat * sizes[i] + np.clip(pos, 0, sizes[i] - 1).reshape(shape)
    valid = valid.reshape(tuple(outs) + (-1,))
    flat = flat.reshape(tuple(outs) + (-1,))
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    return jnp.where(valid, x, jnp.asarray(lowest, x.dtype)), flat


def _argmax_windows(win, flat):
    """Max of each window and its flat input index; NaN wins, as in ATen's kernels."""
    if jnp.issubdtype(win.dtype, jnp.floating):
        isnan = jnp.isnan(win)
        arg = jnp.where(jnp.any(isnan, -1), jnp.argmax(isnan, -1), jnp.argmax(win, -1))
    else:
        arg = jnp.argmax(win, -1)
    out = jnp.take_along_axis(win, arg[..., None], -1)[..., 0]
    idx = jnp.take_along_axis(jnp.broadcast_to(flat, win.shape), arg[..., None], -1)[..., 0]
    return out, idx.astype(jnp.int64)


def _max_pool(nd):
    def fwd(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        k, s, p, d, outs = _pool_geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
        sizes = x.shape[-nd:]
        positions = [np.arange(outs[i])[:, None] * s[i] - p[i] + np.arange(k[i])[None, :] * d[i] for i in range(nd)]
        valids = [(pos >= 0) & (pos < sizes[i]) for i, pos in enumerate(positions)]
        return _argmax_windows(*_gather_windows(x, positions, valids))

    return fwd


def _scatter_back(grad, x, indices, nd):
    """Gradient of a max-type pooling: each output's gradient added at its argmax."""
    sizes = x.shape[-nd:]
    lead = x.shape[:-nd]
    n_out = math.prod(grad.shape[-nd:])
    g = _acc(grad).reshape((-1, n_out))
    idx = indices.reshape(g.shape)
    planes = jnp.arange(g.shape[0])[:, None]
    out = jnp.zeros((g.shape[0], math.prod(sizes)), g.dtype)
    return out.at[planes, idx].add(g, mode="drop").reshape(lead + tuple(sizes))


def _max_pool_backward(nd):
    def bwd(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _scatter_back(grad, x, indices, nd)

    return bwd


# (max_pool1d_with_indices is a PyTorch composite over the 2-d op)
for _nd in (2, 3):
    lower(f"max_pool{_nd}d_with_indices")(_max_pool(_nd))
    lower(f"max_pool{_nd}d_with_indices_backward")(_max_pool_backward(_nd))


def _avg_pool_fwd(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k, s, p, _, outs = _pool_geometry(x, nd, kernel_size, stride, padding, 1, ceil_mode)
    sizes = x.shape[-nd:]
    xf = _fl(x)
    lead = x.ndim - nd
    # pad enough on the high side for ceil_mode windows
    pads = [(0, 0, 0)] * lead + [(p[i], max((outs[i] - 1) * s[i] + k[i] - sizes[i] - p[i], 0), 0) for i in range(nd)]
    xp = lax.pad(xf, np.zeros((), xf.dtype), pads)
    # a literal zero init makes this the differentiable reduce_window_sum
    sums = lax.reduce_window(xp, np.zeros((), xf.dtype), lax.add, (1,) * lead + tuple(k), (1,) * lead + tuple(s),
                             "VALID")
    sums = sums[(Ellipsis,) + tuple(slice(0, o) for o in outs)]
    if divisor_override:
        return sums / divisor_override
    # ATen: each window clipped to the padded input (count_include_pad) or to the input
    cnt = np.ones((), np.float64)
    for i in range(nd):
        st = np.arange(outs[i]) * s[i] - p[i]
        en = np.minimum(st + k[i], sizes[i] + p[i])
        c = (en - st) if count_include_pad else (np.minimum(en, sizes[i]) - np.maximum(st, 0))
        shape = [1] * nd
        shape[i] = outs[i]
        cnt = cnt * c.reshape(shape)
    return sums / jnp.asarray(cnt, xf.dtype)


def _avg_pool(nd):
    def fwd(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
        return _avg_pool_fwd(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

    def bwd(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        out, vjp = jax.vjp(lambda v: _avg_pool_fwd(v, nd, kernel_size, stride, padding, ceil_mode,
                                                   count_include_pad, divisor_override), _fl(x))
        return vjp(_fl(grad).astype(out.dtype))[0]

    return fwd, bwd


for _nd in (2, 3):
    _f, _b = _avg_pool(_nd)
    lower(f"avg_pool{_nd}d")(_f)
    lower(f"avg_pool{_nd}d_backward")(_b)


def _adaptive_bins(n_in, n_out):
    """ATen's adaptive bins: [floor(i*n_in/n_out), ceil((i+1)*n_in/n_out))."""
    i = np.arange(n_out)
    return (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)


def _adaptive_matrix(n_in, n_out):
    start, end = _adaptive_bins(n_in, n_out)
    j = np.arange(n_in)
    m = ((j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])).astype(np.float64)
    return m / (end - start)[:, None]


def _adaptive_avg(nd):
    def fwd(x, output_size):
        outs = _tuple(output_size, nd)
        sizes = x.shape[-nd:]
        return _resample(x, [_adaptive_matrix(sizes[i], outs[i]) for i in range(nd)])

    def bwd(grad, x):
        out, vjp = jax.vjp(lambda v: fwd(v, grad.shape[-nd:]), _fl(x))
        return vjp(_fl(grad).astype(out.dtype))[0]

    return fwd, bwd


def _adaptive_max(nd):
    def fwd(x, output_size):
        outs = _tuple(output_size, nd)
        sizes = x.shape[-nd:]
        positions, valids = [], []
        for i in range(nd):
            start, end = _adaptive_bins(sizes[i], outs[i])
            kmax = int((end - start).max())
            pos = start[:, None] + np.arange(kmax)[None, :]
            positions.append(pos)
            valids.append(pos < end[:, None])
        return _argmax_windows(*_gather_windows(x, positions, valids))

    def bwd(grad, x, indices):
        return _scatter_back(grad, x, indices, nd)

    return fwd, bwd


for _nd in (2, 3):
    _f, _b = _adaptive_avg(_nd)
    lower(f"_adaptive_avg_pool{_nd}d")(_f)
    lower(f"_adaptive_avg_pool{_nd}d_backward")(_b)
    _f, _b = _adaptive_max(_nd)
    lower(f"adaptive_max_pool{_nd}d")(_f)
    lower(f"adaptive_max_pool{_nd}d_backward")(_b)


# ================================================================ padding
def _pad_widths(x, padding):
    """PyTorch's pad list (last dim first, (low, high) pairs) as jnp.pad widths."""
    n = len(padding) // 2
    widths = [(0, 0)] * (x.ndim - n)
    for i in reversed(range(n)):
        widths.append((padding[2 * i], padding[2 * i + 1]))
    return widths


def _pad_family(kind, nd):
    mode = {"reflection": "reflect", "replication": "edge"}[kind]

    def fwd(x, padding):
        widths = _pad_widths(x, padding)
        if kind == "replication":
            # output j of each padded axis reads input clamp(j - low, 0, n - 1): negative widths
            # (cropping) included, even past the other side's edge
            for axis, ((lo, hi), n) in enumerate(zip(widths, x.shape)):
                if lo or hi:
                    x = jnp.take(x, jnp.clip(jnp.arange(n + lo + hi) - lo, 0, n - 1), axis=axis)
            return x
        # a negative width crops that side; the other side reflects about its own edge
        crop = tuple(slice(max(0, -lo), n - max(0, -hi)) for (lo, hi), n in zip(widths, x.shape))
        return jnp.pad(x[crop], [(max(0, lo), max(0, hi)) for lo, hi in widths], mode=mode)

    def bwd(grad, x, padding):
        out, vjp = jax.vjp(lambda v: fwd(v, padding), _fl(x))
        return vjp(_fl(grad).astype(out.dtype))[0]

    lower(f"{kind}_pad{nd}d")(fwd)
    lower(f"{kind}_pad{nd}d_backward")(bwd)


for _kind in ("reflection", "replication"):
    for _nd in (1, 2, 3):
        _pad_family(_kind, _nd)


# ================================================================ upsampling
# Each spatial axis is resampled on its own: nearest modes gather source indices,
# linear and cubic modes contract with a small (out, in) weight matrix built on the
# host with ATen's index arithmetic. Backward is the transpose (a VJP of the same,
# linear, function).
def _src_scale(n_out, n_in, align_corners, scale):
    """ATen's area_pixel_compute_scale."""
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return (1.0 / scale) if scale else n_in / n_out


def _nearest_index(n_out, n_in, scale, exact=False):
    # ATen: src = floor(dst * s) (nearest-exact: floor((dst + 0.5) * s)) in float32,
    # s = 1/scale_factor when given, else in/out
    s = np.float32((1.0 / scale) if scale else n_in / n_out)
    dst = np.arange(n_out, dtype=np.float32)
    src = np.floor((dst + np.float32(0.5)) * s) if exact else np.floor(dst * s)
    return np.minimum(src.astype(np.int64), n_in - 1)


def _linear_matrix(n_out, n_in, align_corners, scale):
    s = _src_scale(n_out, n_in, align_corners, scale)
    dst = np.arange(n_out, dtype=np.float64)
    src = dst * s if align_corners else np.maximum((dst + 0.5) * s - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    l1 = src - i0
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), i0), 1.0 - l1)
    np.add.at(m, (np.arange(n_out), i1), l1)
    return m


def _cubic_matrix(n_out, n_in, align_corners, scale, a=-0.75):
    """ATen's bicubic taps (Keys kernel, A = -0.75), borders clamped."""
    s = _src_scale(n_out, n_in, align_corners, scale)
    dst = np.arange(n_out, dtype=np.float64)
    src = dst * s if align_corners else (dst + 0.5) * s - 0.5
    i = np.floor(src).astype(np.int64)
    t = src - i

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    m = np.zeros((n_out, n_in))
    rows = np.arange(n_out)
    for k, w in zip(range(-1, 3), (far(t + 1), near(t), near(1 - t), far(2 - t))):
        np.add.at(m, (rows, np.clip(i + k, 0, n_in - 1)), w)
    return m


def _resample(x, mats):
    """Contract the trailing len(mats) axes of x with the (out, in) matrices."""
    xf = _fl(x)
    nd = len(mats)
    for k, m in enumerate(mats):
        axis = xf.ndim - nd + k
        y = jnp.tensordot(jnp.asarray(m, xf.dtype), xf, axes=([1], [axis]), precision=matmul_precision())
        xf = jnp.moveaxis(y, 0, axis)
    return xf


def _upsample_nearest(x, output_size, scales, exact=False):
    nd = len(output_size)
    for k, (n_out, sc) in enumerate(zip(output_size, scales)):
        axis = x.ndim - nd + k
        x = jnp.take(x, _nearest_index(n_out, x.shape[axis], sc, exact), axis=axis)
    return x


def _upsample_interp(x, output_size, align_corners, scales, cubic=False):
    nd = len(output_size)
    make = _cubic_matrix if cubic else _linear_matrix
    mats = [make(n_out, x.shape[x.ndim - nd + k], align_corners, sc)
            for k, (n_out, sc) in enumerate(zip(output_size, scales))]
    return _resample(x, mats)


def _backward_of(forward):
    def backward(grad, input_size):
        x0 = jnp.zeros(tuple(input_size), _fl(grad).dtype)
        out, vjp = jax.vjp(forward, x0)
        return vjp(_fl(grad).astype(out.dtype))[0]

    return backward


def _nearest_family(nd, exact):
    prefix = "_upsample_nearest_exact" if exact else "upsample_nearest"
    name = f"{prefix}{nd}d"

    def fwd(x, output_size, *scales):
        return _upsample_nearest(x, output_size, (list(scales) + [None] * nd)[:nd], exact)

    def bwd(grad, output_size, input_size, *scales):
        sc = (list(scales) + [None] * nd)[:nd]
        return _backward_of(lambda v: _upsample_nearest(v, output_size, sc, exact))(grad, input_size)

    lower(name)(fwd)
    lower(name + "_backward")(bwd)


def _interp_family(name, nd, cubic=False):
    def fwd(x, output_size, align_corners, *scales):
        return _upsample_interp(x, output_size, align_corners, (list(scales) + [None] * nd)[:nd], cubic)

    def bwd(grad, output_size, input_size, align_corners, *scales):
        sc = (list(scales) + [None] * nd)[:nd]
        return _backward_of(lambda v: _upsample_interp(v, output_size, align_corners, sc, cubic))(grad, input_size)

    lower(name)(fwd)
    lower(name + "_backward")(bwd)


for _nd in (1, 2, 3):
    _nearest_family(_nd, exact=False)
    _nearest_family(_nd, exact=True)
_interp_family("upsample_linear1d", 1)
_interp_family("upsample_bilinear2d", 2)
_interp_family("upsample_trilinear3d", 3)
_interp_family("upsample_bicubic2d", 2, cubic=True)


# ================================================================ dropout
@lower("native_dropout", random=True)
def _native_dropout(x, p, train, key=None):
    if train is False or p == 0:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p >= 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    scale = 1.0 / (1.0 - p)
    return jnp.where(keep, _acc(x) * scale, 0), keep


@lower("native_dropout_backward")
def _native_dropout_backward(grad, mask, scale):
    return jnp.where(mask, _acc(grad) * scale, 0)


# ================================================================ recurrent cells
# nn.LSTM / nn.GRU on a non-CPU device run their cells through these fused ops
# (CUDA kernels in ATen, no CPU kernel): gates are (B, 4H) / (B, 3H) matmul
# results; the workspace saves the activated gates for the backward.
def _cell_gates(input_gates, hidden_gates, input_bias, hidden_bias):
    ig, hg = _acc(input_gates), _acc(hidden_gates)
    if input_bias is not None:
        ig = ig + _acc(input_bias)
    if hidden_bias is not None:
        hg = hg + _acc(hidden_bias)
    return ig, hg


@lower("_thnn_fused_lstm_cell")
def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    ig, hg = _cell_gates(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(ig + hg, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _acc(cx) + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=-1)


def _lstm_bwd_meta(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    return (torch.empty_like(workspace), torch.empty_like(cx),
            workspace.new_empty(workspace.shape[-1:] if has_bias else (0,)))


@lower("_thnn_fused_lstm_cell_backward_impl", meta=_lstm_bwd_meta)
def _lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(_acc(workspace), 4, axis=-1)
    cyf = _acc(cy)
    ghy = _acc(grad_hy) if grad_hy is not None else jnp.zeros_like(cyf)
    gcy = _acc(grad_cy) if grad_cy is not None else jnp.zeros_like(cyf)
    tc = jnp.tanh(cyf)
    gc = ghy * o * (1 - tc * tc) + gcy
    grad_gates = jnp.concatenate([gc * g * i * (1 - i), gc * _acc(cx) * f * (1 - f), gc * i * (1 - g * g),
                                  ghy * tc * o * (1 - o)], axis=-1)
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias else jnp.zeros((0,), grad_gates.dtype)
    return grad_gates, gc * f, grad_bias


def _gru_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    h = hx.shape[-1]
    return torch.empty_like(hx), hx.new_empty(hx.shape[:-1] + (5 * h,))


@lower("_thnn_fused_gru_cell", meta=_gru_meta)
def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig, hg = _cell_gates(input_gates, hidden_gates, input_bias, hidden_bias)
    ir, ii, in_ = jnp.split(ig, 3, axis=-1)
    hr, hi, hn = jnp.split(hg, 3, axis=-1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(ii + hi)
    n = jnp.tanh(in_ + r * hn)
    hxf = _acc(hx)
    hy = n + z * (hxf - n)
    return hy, jnp.concatenate([r, z, n, hxf, hn], axis=-1)


def _gru_bwd_meta(grad_hy, workspace, has_bias):
    h = grad_hy.shape[-1]
    gates = grad_hy.new_empty(grad_hy.shape[:-1] + (3 * h,))
    bias = grad_hy.new_empty((3 * h,) if has_bias else (0,))
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, torch.empty_like(bias)


@lower("_thnn_fused_gru_cell_backward", meta=_gru_bwd_meta)
def _gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(_acc(workspace), 5, axis=-1)
    g = _acc(grad_hy)
    gn = g * (1 - z) * (1 - n * n)
    gz = g * (hx - n) * z * (1 - z)
    gr = gn * hn * r * (1 - r)
    grad_input = jnp.concatenate([gr, gz, gn], axis=-1)
    grad_hidden = jnp.concatenate([gr, gz, gn * r], axis=-1)
    if has_bias:
        bi, bh = jnp.sum(grad_input, axis=0), jnp.sum(grad_hidden, axis=0)
    else:
        bi = bh = jnp.zeros((0,), g.dtype)
    return grad_input, grad_hidden, g * z, bi, bh


# ================================================================ distances, renorm
def _cdist_use_mm(p, compute_mode, P, R):
    # ATen: the matmul form (|x|^2 + |y|^2 - 2 x.y) for p = 2 when asked or when large
    if p != 2:
        return False
    if compute_mode == 1:
        return True
    if compute_mode == 2:
        return False
    return P > 25 or R > 25


@lower("_cdist_forward")
def _cdist_forward(x1, x2, p, compute_mode=None):
    a, b = _acc(x1), _acc(x2)
    if _cdist_use_mm(p, compute_mode, a.shape[-2], b.shape[-2]):
        aa = jnp.sum(a * a, -1)[..., :, None]
        bb = jnp.sum(b * b, -1)[..., None, :]
        ab = einsum("...pm,...rm->...pr", a, b)
        return jnp.sqrt(jnp.maximum(aa + bb - 2 * ab, 0))
    d = jnp.abs(a[..., :, None, :] - b[..., None, :, :])
    if p == 0:
        return jnp.sum(d != 0, -1).astype(a.dtype)
    if p == math.inf:
        return jnp.max(d, -1)
    if p == 1:
        return jnp.sum(d, -1)
    if p == 2:
        return jnp.sqrt(jnp.sum(d * d, -1))
    return jnp.sum(d ** p, -1) ** (1.0 / p)


@lower("_pdist_forward", static=("p",))
def _pdist_forward(x, p=2.0):
    # the distances of rows i < j, in that order: cdist's direct form on the pairs
    n = x.shape[0]
    i, j = np.triu_indices(n, k=1)
    a = _acc(x)
    d = jnp.abs(a[i] - a[j])
    if p == 0:
        return jnp.sum(d != 0, -1).astype(a.dtype)
    if p == math.inf:
        return jnp.max(d, -1, initial=0)
    if p == 1:
        return jnp.sum(d, -1)
    if p == 2:
        return jnp.sqrt(jnp.sum(d * d, -1))
    return jnp.sum(d ** p, -1) ** (1.0 / p)


@lower("_cdist_backward")
def _cdist_backward(grad, x1, x2, p, cdist):
    # ATen's formula per pair, 0 where the distance is 0; summed over x2's rows
    diff = _acc(x1)[..., :, None, :] - _acc(x2)[..., None, :, :]
    g = _acc(grad)[..., None]
    dist = _acc(cdist)[..., None]
    if p == 0:
        return jnp.zeros_like(_acc(x1))
    if p == 1:
        per = g * jnp.sign(diff)
    elif p == math.inf:
        per = g * jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p == 2:
        per = g * diff / jnp.where(dist == 0, 1, dist)
    else:
        safe = jnp.where(dist == 0, 1, dist)
        per = g * diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1)
        if p < 2:
            per = jnp.where(diff == 0, 0, per)
    per = jnp.where(dist == 0, 0, per)
    return jnp.sum(per, axis=-2)


@lower("embedding_renorm")
def _embedding_renorm(weight, indices, max_norm, norm_type):
    rows = jnp.zeros((weight.shape[0],), bool).at[indices.reshape(-1)].set(True, mode="drop")
    w = _acc(weight)
    norms = jnp.sum(jnp.abs(w) ** norm_type, axis=-1) ** (1.0 / norm_type)
    scale = jnp.where(rows & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return w * scale[:, None]


# ================================================================ attention
# F.scaled_dot_product_attention on a PrivateUse1 tensor takes PyTorch's "math"
# decomposition (a dozen ops, the (L, S) score matrix materialized twice) since
# the backend choice is a C++ stub a Python backend cannot fill. For tpu tensors
# the op is routed instead to ``_scaled_dot_product_fused_attention_overrideable``,
# the overload PyTorch reserves for out-of-tree backends, whose autograd formula
# calls its ``_backward``: one XLA program forward, one backward. Dropout's mask
# is regenerated in the backward from the key carried in ``philox_seed``.
_DEF = torch.library.Library("torchtpu", "FRAGMENT")
_DEF.define("sdpa_fwd(Tensor q, Tensor k, Tensor v, Tensor? bias, bool is_causal, float? scale) "
            "-> (Tensor, Tensor, Tensor)")
_DEF.define("sdpa_fwd_dropout(Tensor q, Tensor k, Tensor v, Tensor? bias, float dropout_p, bool is_causal, "
            "float? scale) -> (Tensor, Tensor, Tensor)")
_DEF.define("sdpa_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor lse, Tensor seed, "
            "float dropout_p, bool is_causal, float? scale, bool[4] mask) -> (Tensor, Tensor, Tensor, Tensor)")


def _sdpa_meta_fwd(q, k, v, bias, *rest):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse, q.new_empty((), dtype=torch.int64)


def _sdpa_meta_bwd(grad_out, q, k, v, bias, lse, seed, dropout_p, is_causal, scale, mask):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape) if bias is not None and mask[3] else q.new_empty((0,)))


_DEF.impl("sdpa_fwd", _sdpa_meta_fwd, "Meta")
_DEF.impl("sdpa_fwd_dropout", _sdpa_meta_fwd, "Meta")
_DEF.impl("sdpa_bwd", _sdpa_meta_bwd, "Meta")


def _key_to_seed(key):
    d = jax.random.key_data(key).astype(jnp.uint64)
    return lax.bitcast_convert_type((d[0] << 32) | d[1], jnp.int64)


def _seed_to_key(seed):
    u = lax.bitcast_convert_type(seed, jnp.uint64)
    return jax.random.wrap_key_data(jnp.stack([(u >> 32).astype(jnp.uint32), (u & 0xFFFFFFFF).astype(jnp.uint32)]))


def _attention(q, k, v, bias, is_causal, scale, dropout_p, key):
    """Output and log-sum-exp of softmax(q k^T * scale + bias) v (computed in float32
    for half inputs); rows with every key masked give 0, as PyTorch's _safe_softmax."""
    qf, kf, vf = _acc(q), _acc(k), _acc(v)
    hq, hk = qf.shape[-3] if qf.ndim >= 3 else 1, kf.shape[-3] if kf.ndim >= 3 else 1
    if qf.ndim >= 3 and hq != hk:  # grouped-query attention: each kv head serves hq/hk query heads
        kf = jnp.repeat(kf, hq // hk, axis=-3)
        vf = jnp.repeat(vf, hq // vf.shape[-3], axis=-3)
    L, S = qf.shape[-2], kf.shape[-2]
    sc = (1.0 / math.sqrt(qf.shape[-1])) if scale is None else scale
    s = einsum("...le,...se->...ls", qf, kf) * sc
    if bias is not None:
        if bias.dtype == jnp.bool_:
            s = jnp.where(bias, s, -jnp.inf)
        else:
            s = s + _acc(bias)
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones((L, S), jnp.bool_)), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom == 0, 1, denom)
    lse = (jnp.log(denom) + m)[..., 0]
    if dropout_p > 0:
        keep = jax.random.bernoulli(key, 1.0 - dropout_p, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_p), 0)
    out = einsum("...ls,...sd->...ld", p, vf)
    return out, lse


@lower("torchtpu::sdpa_fwd")
def _sdpa_fwd(q, k, v, bias, is_causal, scale):
    out, lse = _attention(q, k, v, bias, is_causal, scale, 0.0, None)
    return out, lse, jnp.zeros((), jnp.int64)


@lower("torchtpu::sdpa_fwd_dropout", random=True)
def _sdpa_fwd_dropout(q, k, v, bias, dropout_p, is_causal, scale, key=None):
    out, lse = _attention(q, k, v, bias, is_causal, scale, dropout_p, key)
    return out, lse, _key_to_seed(key)


def _unbroadcast(x, shape):
    """Sum ``x`` down to ``shape`` (the gradient of a broadcast)."""
    lead = x.ndim - len(shape)
    if lead:
        x = x.sum(axis=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=dims, keepdims=True) if dims else x


def _attention_bwd(grad_out, q, k, v, bias, is_causal, scale, dropout_p, key, diff_bias):
    """Gradients of ``_attention``'s output w.r.t. q, k, v (and a float bias), the probabilities
    recomputed from q and k rather than saved, as flash attention's backward does.

    Written out rather than as ``jax.vjp`` of the forward for the fused DeferAndFuse step: there
    XLA merged (CSE) the replayed forward with the real one and so held every layer's score, exp
    and probability matrices from the forward to the backward (3 x 512 KiB per layer of the
    benchmark transformer), and a recomputation that depends on q and k only would still be
    scheduled early and held. Here the scores come out of one product with grad_out (below), so
    they exist only while this layer's backward runs. The backward works on the transposed
    (S, L) scores, k q^T."""
    qf, kf, vf, g = _acc(q), _acc(k), _acc(v), _acc(grad_out)
    hq = qf.shape[-3] if qf.ndim >= 3 else 1
    rk = hq // kf.shape[-3] if qf.ndim >= 3 else 1
    rv = hq // vf.shape[-3] if qf.ndim >= 3 else 1
    if rk > 1:  # grouped-query attention, as the forward: each kv head serves hq/hk query heads
        kf = jnp.repeat(kf, rk, axis=-3)
    if rv > 1:
        vf = jnp.repeat(vf, rv, axis=-3)
    L, S = qf.shape[-2], kf.shape[-2]
    sc = (1.0 / math.sqrt(qf.shape[-1])) if scale is None else scale
    if qf.shape == g.shape:
        # the scores as one product with (q; grad_out) stacked: they then depend on grad_out, so
        # XLA cannot schedule them (and hold them) ahead of this layer's backward. The other half,
        # k dO^T, is not needed: one more (S, L) product, cheap next to the memory it saves.
        st = einsum("...se,n...le->n...sl", kf, jnp.stack([qf, g]))[0] * sc
    else:
        st = einsum("...se,...le->...sl", kf, qf) * sc
    shape = st.shape[:-2] + (L, S)  # the forward's score shape (the dropout mask's too)
    if bias is not None:
        b = bias.reshape((1,) * (2 - bias.ndim) + bias.shape) if bias.ndim < 2 else bias
        shape = jnp.broadcast_shapes(shape, b.shape)
        bt = jnp.swapaxes(b, -1, -2)
        st = jnp.where(bt, st, -jnp.inf) if bias.dtype == jnp.bool_ else st + _acc(bt)
    if is_causal:
        st = jnp.where(jnp.tril(jnp.ones((L, S), jnp.bool_)).T, st, -jnp.inf)
    # the probabilities exactly as the forward computes them (max, exp, sum per query; a query
    # whose keys are all masked gets 0): exp(s - lse) would be cheaper but loses precision
    # (measured: 3.5e-4 relative gradient error on OpInfo samples with large scores, 2e-6 this way)
    m = jnp.max(st, axis=-2, keepdims=True)
    e = jnp.exp(st - jnp.where(jnp.isfinite(m), m, 0))
    denom = jnp.sum(e, axis=-2, keepdims=True)
    pt = e / jnp.where(denom == 0, 1, denom)
    if dropout_p > 0:
        keep = jnp.swapaxes(jax.random.bernoulli(key, 1.0 - dropout_p, shape), -1, -2)
        pdt = jnp.where(keep, pt / (1.0 - dropout_p), 0)
    else:
        pdt = pt
    gv = einsum("...sl,...ld->...sd", pdt, g)
    dpt = einsum("...sd,...ld->...sl", vf, g)
    if dropout_p > 0:
        dpt = jnp.where(keep, dpt / (1.0 - dropout_p), 0)
    dst = pt * (dpt - jnp.sum(dpt * pt, axis=-2, keepdims=True))  # softmax backward, per query l
    gq = einsum("...sl,...se->...le", dst, kf) * sc
    gk = einsum("...sl,...le->...se", dst, qf) * sc
    gq = _unbroadcast(gq, qf.shape)
    if rk > 1:
        gk = gk.reshape(gk.shape[:-3] + (gk.shape[-3] // rk, rk) + gk.shape[-2:]).sum(axis=-3)
    if rv > 1:
        gv = gv.reshape(gv.shape[:-3] + (gv.shape[-3] // rv, rv) + gv.shape[-2:]).sum(axis=-3)
    gk, gv = _unbroadcast(gk, k.shape), _unbroadcast(gv, v.shape)
    gb = _unbroadcast(jnp.swapaxes(dst, -1, -2), bias.shape) if diff_bias else jnp.zeros((0,), gq.dtype)
    return gq, gk, gv, gb


@lower("torchtpu::sdpa_bwd")
def _sdpa_bwd(grad_out, q, k, v, bias, lse, seed, dropout_p, is_causal, scale, mask):
    key = _seed_to_key(seed) if dropout_p > 0 else None
    diff_bias = bias is not None and mask[3] and bias.dtype != jnp.bool_
    return _attention_bwd(grad_out, q, k, v, bias, is_causal, scale, dropout_p, key, diff_bias)


def _none_if_empty(t):
    return None if t is None or t.numel() == 0 else t


_OFFSET = []


def _zero_offset():
    """The (unused) philox offset output: one shared, never-written zero tensor."""
    if not _OFFSET:
        _OFFSET.append(torch.zeros((), dtype=torch.int64, device="tpu"))
    return _OFFSET[0]


@impl("_scaled_dot_product_fused_attention_overrideable")
def _sdpa_overrideable(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                       scale=None):
    if dropout_p > 0:
        out, lse, seed = torch.ops.torchtpu.sdpa_fwd_dropout(q, k, v, attn_bias, dropout_p, is_causal, scale)
    else:
        out, lse, seed = torch.ops.torchtpu.sdpa_fwd(q, k, v, attn_bias, is_causal, scale)
    if lse.dim() == 2:  # 3-D (H, L, E) input: PyTorch's lse is (1, H, L)
        lse = lse.unsqueeze(0)
    return out, lse, None, None, q.shape[-2], k.shape[-2], seed, _zero_offset(), None


@impl("_scaled_dot_product_fused_attention_overrideable_backward")
def _sdpa_overrideable_backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                                cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                scale=None):
    lse = logsumexp.squeeze(0) if q.dim() == 3 else logsumexp
    gq, gk, gv, gb = torch.ops.torchtpu.sdpa_bwd(grad_out, q, k, v, attn_bias, lse, philox_seed, dropout_p,
                                                 is_causal, scale, list(grad_input_mask))
    m = grad_input_mask
    return (gq if m[0] else None, gk if m[1] else None, gv if m[2] else None,
            _none_if_empty(gb) if m[3] else None)


def _sdpa_route(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not q.dtype == k.dtype == v.dtype:
        # CPU's refusal, in its words (the math path would promote): its kernel on zero twins
        twin = [None if t is None else torch.zeros((), dtype=t.dtype).expand(t.shape) for t in (q, k, v, attn_mask)]
        aten.scaled_dot_product_attention(*twin[:3], twin[3], dropout_p, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)
    fused = (q.dim() in (3, 4) and q.dim() == k.dim() == v.dim() and q.device.type == "tpu"
             and not (is_causal and attn_mask is not None)
             and q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point)
    if fused and q.dim() >= 3:
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if hq != hk or hq != hv:
            fused = enable_gqa and hq % hk == 0 and hq % hv == 0
    if not fused:
        # PyTorch's own reference (with its checks and error messages)
        return aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise RuntimeError(
            f"Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{attn_mask.dtype} and  query.dtype: {q.dtype} instead.")
    return aten._scaled_dot_product_fused_attention_overrideable(
        q, k, v, attn_mask, dropout_p, is_causal, False, scale=scale)[0]


_ROUTE = torch.library.Library("aten", "IMPL")
_ROUTE.impl("scaled_dot_product_attention", _sdpa_route, "AutogradPrivateUse1")
