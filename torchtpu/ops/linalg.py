"""Matrix products and linear algebra.

Products take XLA's dot with the precision ``torch.get_float32_matmul_precision()``
asks for ("highest" by default, as on CPU: on a TPU a float32 dot otherwise
runs in one bfloat16 pass) and accumulate bfloat16/float16 in float32, as
ATen's CPU kernels do.

Factorizations follow LAPACK's conventions that PyTorch exposes: LU pivots are
1-based ``int32`` row swaps (``getrf``'s ``ipiv``), ``info`` is 0 on success and
the 1-based index of the failing pivot / minor otherwise, so the host-side
checks of ``torch.linalg.*`` (``_linalg_check_errors``) raise exactly where
PyTorch raises. Only the lower (or upper, as asked) triangle of a Hermitian
input is read, as LAPACK does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch._C import DispatchKey
from torch._higher_order_ops.out_dtype import out_dtype, out_dtype_fallback

from ..base.frames import warn_once_at_user_line
from ..dispatch.lowering import impl, lower

_LOW = (jnp.bfloat16, jnp.float16)
_NARROW_INT = (jnp.int8, jnp.uint8, jnp.int16)


def matmul_precision():
    """XLA dot precision for float32 from PyTorch's global setting (read when an
    executable is traced, so set it before the first call of a shape)."""
    p = torch.get_float32_matmul_precision()
    if p == "highest":
        return lax.Precision.HIGHEST
    if p == "high":
        return lax.Precision.HIGH
    return lax.Precision.DEFAULT


def _dot_kwargs(a):
    kw = {"precision": matmul_precision()}
    if a.dtype in _LOW:
        kw["preferred_element_type"] = jnp.float32
    return kw


def mm(a, b):
    """``a @ b`` (batched by leading dims) with PyTorch's precision and accumulation."""
    if a.dtype == jnp.bool_:
        return jnp.matmul(a.astype(jnp.int32), b.astype(jnp.int32)) != 0
    if a.dtype in _NARROW_INT:
        # an integer dot accumulating in int32 (the MXU's int8 path); wrapping back to the narrow type
        # gives CPU's result, which is the same sum modulo 2**bits
        return jnp.matmul(a, b, preferred_element_type=jnp.int32).astype(a.dtype)
    return jnp.matmul(a, b, **_dot_kwargs(a))


def einsum(spec, *ops):
    return jnp.einsum(spec, *ops, **_dot_kwargs(ops[0]))


def _axpby(beta, c, alpha, p):
    """``beta * c + alpha * p`` where beta == 0 ignores ``c`` (nan/inf included), as PyTorch does."""
    if jnp.issubdtype(p.dtype, jnp.integer):  # PyTorch casts the scalars to the integer type
        alpha, beta = int(alpha), int(beta)
    if alpha != 1:
        p = p * alpha
    if beta == 0:
        return jnp.broadcast_to(p, jnp.broadcast_shapes(p.shape, c.shape))
    c = c.astype(p.dtype)
    return p + (c if beta == 1 else beta * c)


# ---------------------------------------------------------------- products
@lower("mm", "bmm")
def _mm(a, b):
    return mm(a, b)


# ------------------------------------------- quantized products (torchao's int8 / float8 linears)
@lower("_int_mm")
def _int_mm(a, b):
    """int8 x int8 -> int32: one integer dot with int32 accumulation."""
    return lax.dot(a, b, preferred_element_type=jnp.int32)


def _out_dtype_on_tpu(op, output_dtype, *args):
    """The ``out_dtype`` higher-order op (torchao's ``safe_int_mm``): int8 mm -> int32 is ``_int_mm``
    on tpu, as on CUDA (torch's dense kernel would widen both operands to int32 first)."""
    if (op is torch.ops.aten.mm.default and output_dtype == torch.int32 and len(args) == 2
            and all(a.dtype == torch.int8 for a in args)):
        return torch._int_mm(*args)
    return out_dtype_fallback(op, output_dtype, *args)


out_dtype.py_impl(DispatchKey.PrivateUse1)(_out_dtype_on_tpu)


@lower("_weight_int8pack_mm")
def _weight_int8pack_mm(x, w, scales):
    """``x @ w.T * scales`` with ``w`` (N, K) int8 per-output-channel: the int8 -> float convert sits
    inside the dot's fusion, so the weight is read from memory as int8."""
    y = lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), **_dot_kwargs(x))
    return y * scales.astype(y.dtype)


@lower("_scaled_mm")
def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """float8 (or int8) ``a @ b`` accumulated in float32 (int32), scaled by tensor-wise or row-wise
    ``scale_a`` (M, 1) / ``scale_b`` (1, N), plus ``bias``; the dot takes XLA's float8 types as they are."""
    acc_type = jnp.int32 if jnp.issubdtype(a.dtype, jnp.integer) else jnp.float32
    y = lax.dot(a, b, preferred_element_type=acc_type).astype(jnp.float32)
    y = y * scale_a.astype(jnp.float32) * scale_b.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y


@lower("mv")
def _mv(a, v):
    return mm(a, v)


@lower("dot")
def _dot(a, b):
    return jnp.sum(a * b) if a.dtype == jnp.bool_ else mm(a, b)


@lower("vdot")
def _vdot(a, b):
    return mm(jnp.conj(a), b)


@lower("addmm", "baddbmm", static=("beta", "alpha"))
def _addmm(c, a, b, beta=1, alpha=1):
    return _axpby(beta, c, alpha, mm(a, b))


@lower("addmv", static=("beta", "alpha"))
def _addmv(c, a, v, beta=1, alpha=1):
    return _axpby(beta, c, alpha, mm(a, v))


@lower("addbmm", static=("beta", "alpha"))
def _addbmm(c, a, b, beta=1, alpha=1):
    return _axpby(beta, c, alpha, einsum("bij,bjk->ik", a, b))


@lower("addr", static=("beta", "alpha"))
def _addr(c, u, v, beta=1, alpha=1):
    p = jnp.logical_and(u[:, None], v[None, :]) if u.dtype == jnp.bool_ else u[:, None] * v[None, :]
    if c.dtype == jnp.bool_:
        # PyTorch: beta/alpha act as booleans for bool tensors
        return jnp.logical_or(jnp.logical_and(c, bool(beta)), jnp.logical_and(p, bool(alpha)))
    return _axpby(beta, c, alpha, p)


@lower("_addmm_activation", static=("beta", "alpha"))
def _addmm_activation(c, a, b, beta=1, alpha=1, use_gelu=False):
    r = _axpby(beta, c, alpha, mm(a, b))
    return jax.nn.gelu(r, approximate=False) if use_gelu else jnp.maximum(r, 0)


@lower("linalg_cross")
def _cross(a, b, dim=-1):
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.cross(jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape), axis=dim)


# ---------------------------------------------------------------- helpers
def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _bcast_batch(a, b):
    """Broadcast the batch (all but the last two) dims of two matrices."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _tri_solve(a, b, *, lower, left=True, transpose=False, conj=False, unit=False):
    a, b = _bcast_batch(a, b)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=transpose,
                                       conjugate_a=conj, unit_diagonal=unit)


def _first_failure(bad):
    """LAPACK ``info``: 1-based index of the first True along the last axis, else 0."""
    if bad.shape[-1] == 0 or bad.size == 0:  # argmax has nothing to search
        return jnp.zeros(bad.shape[:-1], jnp.int32)
    idx = jnp.argmax(bad, axis=-1)
    return jnp.where(jnp.any(bad, axis=-1), idx + 1, 0).astype(jnp.int32)


def _lu(a):
    """(lu, 0-based ipiv, permutation): ``a[..., perm, :] == L @ U``."""
    return lax.linalg.lu(a)


def _lu_solve(lu, perm, b, trans=0):
    """Solve ``op(A) x = b`` for A = LU factored with row permutation ``perm``
    (``A[perm] = L U``); trans 0: A, 1: A^T, 2: A^H. ``b`` is (..., n, k)."""
    lu, b = _bcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    if trans == 0:
        x = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        x = lax.linalg.triangular_solve(lu, x, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, x, left_side=True, lower=False)
    conj = trans == 2
    # A^T = U^T L^T P: solve U^T y = b, L^T z = y, then x[perm] = z
    y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=conj)
    z = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=conj,
                                    unit_diagonal=True)
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inv[..., :, None], axis=-2)


def _perm_from_pivots(pivots1, m):
    """1-based LAPACK ipiv (..., k) -> row permutation (..., m)."""
    return lax.linalg.lu_pivots_to_permutation(pivots1.astype(jnp.int32) - 1, m)


def _pivot_parity(ipiv0):
    k = ipiv0.shape[-1]
    swaps = jnp.sum(ipiv0 != jnp.arange(k, dtype=ipiv0.dtype), axis=-1)
    return 1 - 2 * (swaps % 2)


def _empty(dtype):
    return jnp.zeros((0,), dtype)


# ---------------------------------------------------------------- factorizations
@lower("linalg_cholesky_ex")
def _cholesky_ex(a, upper=False, check_errors=False):
    # LAPACK potrf reads one triangle only: for upper=True the factor U of A = U^H U
    # comes from the lower factor of A^H (A's upper triangle)
    src = _mH(a) if upper else a
    l = lax.linalg.cholesky(src, symmetrize_input=False)
    l = jnp.tril(l)
    diag = jnp.diagonal(l, axis1=-2, axis2=-1)
    info = _first_failure(~jnp.isfinite(diag) | (jnp.real(diag) <= 0))
    out = _mH(l) if upper else l
    return out, info


_CHOLESKY_DEPRECATED = (
    "torch.cholesky is deprecated in favor of torch.linalg.cholesky and will be removed in a future PyTorch "
    "release.\nL = torch.cholesky(A)\nshould be replaced with\nL = torch.linalg.cholesky(A)\nand\n"
    "U = torch.cholesky(A, upper=True)\nshould be replaced with\nU = torch.linalg.cholesky(A).mH\n"
    "This transform will produce equivalent results for all valid (symmetric positive definite) inputs.")
_TRIANGULAR_SOLVE_DEPRECATED = (
    "torch.triangular_solve is deprecated in favor of torch.linalg.solve_triangularand will be removed in a "
    "future PyTorch release.\ntorch.linalg.solve_triangular has its arguments reversed and does not return a "
    "copy of one of the inputs.\nX = torch.triangular_solve(B, A).solution\nshould be replaced with\n"
    "X = torch.linalg.solve_triangular(A, B).")


@lower("cholesky", warn=lambda *a, inplace=False: warn_once_at_user_line(_CHOLESKY_DEPRECATED))
def _cholesky(a, upper=False):
    return _cholesky_ex(a, upper)[0]


@lower("linalg_inv_ex")
def _inv_ex(a, check_errors=False):
    n = a.shape[-1]
    lu, _, perm = _lu(a)
    info = _first_failure(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape)
    return _lu_solve(lu, perm, eye), info


def _is_vector_rhs(a, b):
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))


@lower("_linalg_solve_ex")
def _solve_ex(a, b, left=True, check_errors=False):
    lu, ipiv, perm = _lu(a)
    info = _first_failure(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)
    vector = _is_vector_rhs(a, b)
    rhs = b[..., None] if vector else b
    if left:
        x = _lu_solve(lu, perm, rhs, 0)
    else:
        # X A = B  <=>  A^T X^T = B^T
        x = _mT(_lu_solve(lu, perm, _mT(rhs), 1))
    if vector:
        x = x[..., 0]
    return x, lu, ipiv + 1, info


@lower("linalg_lu_factor_ex")
def _lu_factor_ex(a, pivot=True, check_errors=False):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on tpu")
    lu, ipiv, _ = _lu(a)
    k = min(a.shape[-2], a.shape[-1])
    info = _first_failure(jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k] == 0)
    return lu, ipiv + 1, info


def _unpack(lu, perm, m, n):
    k = min(m, n)
    l = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    u = jnp.triu(lu[..., :k, :])
    # A = P L U with A[perm] = L U: P[perm[i], i] = 1
    p = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2)
    return p, l, u


@lower("linalg_lu")
def _linalg_lu(a, pivot=True):
    if not pivot:
        raise RuntimeError("linalg.lu: LU without pivoting is not implemented on tpu")
    lu, _, perm = _lu(a)
    return _unpack(lu, perm, a.shape[-2], a.shape[-1])


@lower("lu_unpack")
def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2], lu.shape[-1]
    perm = _perm_from_pivots(pivots, m)
    p, l, u = _unpack(lu, perm, m, n)
    if not unpack_data:
        l = u = _empty(lu.dtype)
    if not unpack_pivots:
        p = _empty(lu.dtype)
    return p, l, u


@lower("linalg_lu_solve")
def _linalg_lu_solve(lu, pivots, b, left=True, adjoint=False):
    perm = _perm_from_pivots(pivots, lu.shape[-1])
    if left:
        return _lu_solve(lu, perm, b, 2 if adjoint else 0)
    if adjoint:
        # X A^H = B  <=>  A X^H = B^H
        return _mH(_lu_solve(lu, perm, _mH(b), 0))
    # X A = B  <=>  A^T X^T = B^T
    return _mT(_lu_solve(lu, perm, _mT(b), 1))


# ATen factors A^H instead of A when A is contiguous and real (det(A^T) = det(A),
# and the transpose is the F-contiguous layout LAPACK wants); the backward of
# det/slogdet reads the factors accordingly. The kernels below make the same
# choice from the tensor's strides and hand the (view) to one lowering.
_LIB = torch.library.Library("torchtpu", "FRAGMENT")
_LIB.define("lu_det(Tensor A) -> (Tensor, Tensor, Tensor)")
_LIB.define("lu_slogdet(Tensor A) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.impl("lu_det", lambda a: torch.ops.aten._linalg_det(a), "Meta")
_LIB.impl("lu_slogdet", lambda a: torch.ops.aten._linalg_slogdet(a), "Meta")


def _factored(a):
    return a.mH if a.is_contiguous() and not a.is_complex() else a


@impl("_linalg_det")
def _linalg_det(a):
    return torch.ops.torchtpu.lu_det(_factored(a))


@impl("_linalg_slogdet")
def _linalg_slogdet(a):
    return torch.ops.torchtpu.lu_slogdet(_factored(a))


@lower("torchtpu::lu_det")
def _det(a):
    lu, ipiv, _ = _lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    det = jnp.prod(diag, axis=-1) * _pivot_parity(ipiv).astype(a.dtype)
    return det, lu, ipiv + 1


@lower("torchtpu::lu_slogdet")
def _slogdet(a):
    lu, ipiv, _ = _lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    absd = jnp.abs(diag)
    parity = _pivot_parity(ipiv).astype(a.dtype)
    if jnp.iscomplexobj(a):
        phase = jnp.prod(jnp.where(absd == 0, 0, diag / jnp.where(absd == 0, 1, absd)), axis=-1)
        sign = phase * parity
    else:
        sign = jnp.prod(jnp.sign(diag), axis=-1) * parity
    logabs = jnp.sum(jnp.log(absd), axis=-1)
    return sign, logabs, lu, ipiv + 1


@lower("_linalg_eigh")
def _eigh(a, UPLO="L", compute_v=True):
    lower_ = UPLO.upper() == "L"
    v, w = lax.linalg.eigh(a, lower=lower_, symmetrize_input=False)
    if not compute_v:
        return w, _empty(a.dtype)
    return w, v


@lower("_linalg_svd")
def _svd(a, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        s = jnp.linalg.svd(a, compute_uv=False)
        return _empty(a.dtype), s, _empty(a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return u, s, vh


@lower("linalg_qr")
def _qr(a, mode="reduced"):
    if mode == "r":
        return _empty(a.dtype), jnp.linalg.qr(a, mode="r")
    q, r = jnp.linalg.qr(a, mode=mode)
    return q, r


@lower("triangular_solve", warn=lambda *a, inplace=False: warn_once_at_user_line(_TRIANGULAR_SOLVE_DEPRECATED))
def _triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    x = _tri_solve(a, b, lower=not upper, transpose=transpose, unit=unitriangular)
    batch = x.shape[:-2]
    return x, jnp.broadcast_to(a, batch + a.shape[-2:])


@lower("linalg_solve_triangular")
def _solve_triangular(a, b, upper, left=True, unitriangular=False):
    return _tri_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@lower("_cholesky_solve_helper")
def _cholesky_solve(b, a, upper):
    # A = L L^H (or U^H U): two triangular solves
    if upper:
        y = _tri_solve(a, b, lower=False, transpose=True, conj=True)
        return _tri_solve(a, y, lower=False)
    y = _tri_solve(a, b, lower=True)
    return _tri_solve(a, y, lower=True, transpose=True, conj=True)


@lower("cholesky_inverse")
def _cholesky_inverse(a, upper=False):
    n = a.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape)
    return _cholesky_solve(eye, a, upper)


@lower("linalg_matrix_exp")
def _matrix_exp(a):
    return jax.scipy.linalg.expm(a)


# ---------------------------------------------------------------- Householder (LAPACK's geqrf form)
@lower("geqrf")
def _geqrf(a):
    h, tau = jnp.linalg.qr(a, mode="raw")  # LAPACK's geqrf, its reflectors transposed
    return _mT(h), tau


@lower("linalg_householder_product")
def _householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


@lower("ormqr", static=("left", "transpose"))
def _ormqr(a, tau, c, left=True, transpose=False):
    return lax.linalg.ormqr(a, tau, c, left=left, transpose=transpose)
