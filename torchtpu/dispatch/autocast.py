"""Autocast on tpu: PyTorch's CUDA cast policy, for the ``AutocastPrivateUse1`` key.

torch 2.13 registers C++ autocast kernels for CUDA, CPU, XPU, MPS, ... but none for a
Python PrivateUse1 backend, and no fallthrough either: every op under
``torch.autocast("tpu")`` failed. ``install()`` registers the fallthrough (ops without a
policy run as they are) and one kernel per op of CUDA's policy (ATen's
``autocast_mode.h``): ``LOWER`` ops take their floating inputs in the autocast dtype,
``FP32`` ops in float32, ``FP32_SET_OPT_DTYPE`` ops get ``dtype=float32`` when none is
given, ``norm`` without a dtype is redispatched with one, ``PROMOTE`` ops run in the
widest floating dtype of their inputs. float64 tensors, non-floating tensors and CPU
tensors are left alone, as CUDA leaves them. The kernels sit above autograd, so the casts
are recorded and a matmul saves its bfloat16 inputs for backward.

The tpu default is bfloat16 (as torch_xla and TorchTPU have it); float16 is allowed.
ATen keeps the default per thread and starts every thread at float16 for PrivateUse1, so
``torch.get_autocast_dtype`` / ``torch.set_autocast_dtype`` are wrapped to start each
thread at bfloat16 for tpu. Like CUDA's, casts of float32 leaf parameters are cached
inside an autocast region and the cache is dropped when the outermost region exits
(``torch.clear_autocast_cache`` clears this cache too).
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..base.opnames import op_from_name

aten = torch.ops.aten

DEFAULT_DTYPE = torch.bfloat16
_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_KEYSET = torch._C.DispatchKeySet(_KEY)

# CUDA's policy (ATen autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP and cudnn's convolutions are
# CUDA-only; AT_FORALL_FP32; AT_FORALL_FP32_SET_OPT_DTYPE; AT_FORALL_PROMOTE). A bare name is the
# default overload, as ATen registers it.
LOWER = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# norm without a dtype -> the overload that takes one (fp32_append_dtype)
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")


# ---------------------------------------------------------------- the per-thread default dtype
_thread = threading.local()
_get_autocast_dtype = torch.get_autocast_dtype
_set_autocast_dtype = torch.set_autocast_dtype


def _thread_default() -> None:
    if not getattr(_thread, "ready", False):
        _thread.ready = True
        _set_autocast_dtype("tpu", DEFAULT_DTYPE)


def get_autocast_dtype(device_type):
    if device_type == "tpu":
        _thread_default()
    return _get_autocast_dtype(device_type)


def set_autocast_dtype(device_type, dtype):
    if device_type == "tpu":
        _thread.ready = True  # the thread's own choice stands
    return _set_autocast_dtype(device_type, dtype)


get_autocast_dtype.__doc__ = _get_autocast_dtype.__doc__
set_autocast_dtype.__doc__ = _set_autocast_dtype.__doc__


# ---------------------------------------------------------------- casts
_cache: dict = {}  # id(float32 leaf) -> (weakref to it, its version, its cast)
_cache_lock = threading.Lock()
_clear_autocast_cache = torch.clear_autocast_cache


def clear_autocast_cache() -> None:
    _clear_autocast_cache()
    with _cache_lock:
        _cache.clear()


clear_autocast_cache.__doc__ = _clear_autocast_cache.__doc__


def _eligible(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "tpu" and t.is_floating_point()
            and t.dtype is not torch.float64)


def _cast(t, dtype, lower):
    if not _eligible(t) or t.dtype is dtype:
        return t
    # cast float32 parameters once per region, as CUDA does (the leaves a forward reuses)
    if (dtype is lower and t.dtype is torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
            and torch.is_autocast_cache_enabled()):
        key = id(t)
        with _cache_lock:
            hit = _cache.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        out = t.to(dtype)
        with _cache_lock:
            _cache[key] = (weakref.ref(t), t._version, out)
        return out
    return t.to(dtype)


def _cast_all(dtype, lower, args, kwargs):
    def one(v):
        if isinstance(v, torch.Tensor):
            return _cast(v, dtype, lower)
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return [_cast(x, dtype, lower) for x in v]
        return v

    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}


def _widest(lower, args, kwargs) -> torch.dtype:
    """CUDA's ``promote_type``: float32 if any eligible input is float32, else the autocast dtype."""
    out = lower
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if _eligible(t):
                if t.dtype is torch.float32:
                    return torch.float32
                if t.dtype is not lower:
                    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return out


# ---------------------------------------------------------------- kernels
def _lower_kernel(op):
    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("tpu")
        args, kwargs = _cast_all(lower, lower, args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            return op(*args, **kwargs)

    return kernel


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        args, kwargs = _cast_all(torch.float32, torch.get_autocast_dtype("tpu"), args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            return op(*args, **kwargs)

    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("tpu")
        args, kwargs = _cast_all(_widest(lower, args, kwargs), lower, args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            return op(*args, **kwargs)

    return kernel


def _set_opt_dtype_kernel(op):
    names = [a.name for a in op._schema.arguments]
    pos = names.index("dtype")
    kwarg_only = op._schema.arguments[pos].kwarg_only

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if args and _eligible(args[0]):
                if not kwarg_only and len(args) > pos:
                    if args[pos] is None:
                        args = (*args[:pos], torch.float32, *args[pos + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _append_dtype_kernel(target):
    def kernel(self, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            return target(self, *args, **kwargs, dtype=torch.float32 if _eligible(self) else self.dtype)

    return kernel


def _bce_banned(*args, **kwargs):
    raise RuntimeError(_BCE_BANNED)


_LIBS: list = []
_installed = False


def install() -> None:
    """Register the fallthrough and CUDA's policy for ``AutocastPrivateUse1`` (once); make bfloat16
    the tpu default of this and every later thread."""
    global _installed
    if _installed:
        return
    _installed = True
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    _LIBS.extend((fallthrough, lib))
    table = [(n, _lower_kernel) for n in LOWER] + [(n, _fp32_kernel) for n in FP32] + [
        (n, _set_opt_dtype_kernel) for n in FP32_SET_OPT_DTYPE] + [(n, _promote_kernel) for n in PROMOTE]
    for name, make in table:
        try:
            op = op_from_name(name)
        except (AttributeError, RuntimeError):
            continue  # not in this torch build
        lib.impl(op, make(op), "AutocastPrivateUse1")
    for name, target in FP32_APPEND_DTYPE.items():
        lib.impl(op_from_name(name), _append_dtype_kernel(op_from_name(target)), "AutocastPrivateUse1")
    lib.impl(aten.binary_cross_entropy.default, _bce_banned, "AutocastPrivateUse1")
    torch.get_autocast_dtype = get_autocast_dtype
    torch.set_autocast_dtype = set_autocast_dtype
    torch.clear_autocast_cache = clear_autocast_cache
    _thread_default()
