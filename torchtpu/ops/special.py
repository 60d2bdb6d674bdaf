"""Special functions of torch.special without a JAX twin of the same conventions: polygamma,
Hurwitz zeta, erfcx, and the orthogonal polynomials (Chebyshev T/U/V/W and their shifted forms,
Hermite H/He, Laguerre L, Legendre P).

A polynomial takes its degree ``n`` per element (a tensor or a scalar): its three-term recurrence
runs in one XLA while loop up to the largest degree, every element keeping the value at its own.
PyTorch's conventions are kept at the edges: ``n < 0`` gives 0, the closed values at x = +-1 (x = 0
and 1 for the shifted forms), the trigonometric closed forms PyTorch switches to for high degrees
inside (-1, 1), and NaN for Hermite degrees above PyTorch's limit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from ..dispatch.lowering import lower


def _float_pair(x, n):
    """``x`` and ``n`` as arrays of the computing float type, and ``n`` as int64 degrees."""
    x, n = jnp.asarray(x), jnp.asarray(n)
    dt = jnp.result_type(x, n)
    if not jnp.issubdtype(dt, jnp.inexact):
        dt = jnp.float32
    x = x.astype(dt)
    nf = n.astype(dt)
    # PyTorch casts the degree to int64 (NaN and inf as -1 for Hermite, which reads them as "none")
    deg = jnp.where(jnp.isfinite(nf), jnp.trunc(nf), -1).astype(jnp.int64)
    x, deg = jnp.broadcast_arrays(x, deg)
    return x, deg


def _recurrence(deg, p0, p1, step):
    """P_deg per element, with P_0 = p0, P_1 = p1 and P_k = step(k, P_{k-1}, P_{k-2})."""
    top = jnp.max(deg, initial=1)

    def body(carry):
        k, prev, cur = carry
        nxt = step(k.astype(cur.dtype), cur, prev)
        more = k <= deg
        return k + 1, jnp.where(more, cur, prev), jnp.where(more, nxt, cur)

    _, _, cur = lax.while_loop(lambda c: c[0] <= top, body, (jnp.asarray(2, jnp.int64), p0, p1))
    return jnp.where(deg == 0, p0, cur)


def _odd(deg):
    return deg % 2 == 1


def _finish(value, deg, edges):
    """Apply the closed edge values ``edges`` (list of (mask, value), first wins) and n < 0 -> 0."""
    for mask, edge in reversed(edges):
        value = jnp.where(mask, edge, value)
    return jnp.where(deg < 0, jnp.zeros_like(value), value)


def _sign_by_parity(deg, v):
    return jnp.where(_odd(deg), -v, v)


def _cheb_t(x, deg, shifted=False):
    y = x + x - 1 if shifted else x
    n = deg.astype(x.dtype)
    value = _recurrence(deg, jnp.ones_like(y), y, lambda k, cur, prev: (y + y) * cur - prev)
    value = jnp.where((deg > 6) & (jnp.abs(y) < 1), jnp.cos(n * jnp.arccos(y)), value)
    hi, lo = (x == 1, x == 0) if shifted else (y == 1, y == -1)
    return _finish(value, deg, [(hi, jnp.ones_like(y)), (lo, _sign_by_parity(deg, jnp.ones_like(y)))])


def _cheb_u(x, deg, shifted=False):
    y = x + x - 1 if shifted else x
    n = deg.astype(x.dtype)
    value = _recurrence(deg, jnp.ones_like(y), y + y, lambda k, cur, prev: (y + y) * cur - prev)
    t = jnp.arccos(y)
    closed = jnp.where(jnp.sin(t) != 0, jnp.sin((n + 1) * t) / jnp.sin(t), (n + 1) * jnp.cos((n + 1) * t) / y)
    value = jnp.where((deg > (6 if shifted else 8)) & (jnp.abs(y) < 1), closed, value)
    hi, lo = (x == 1, x == 0) if shifted else (y == 1, y == -1)
    return _finish(value, deg, [(hi, n + 1), (lo, _sign_by_parity(deg, n + 1))])


def _cheb_v(x, deg, shifted=False):
    y = x + x - 1 if shifted else x
    n = deg.astype(x.dtype)
    value = _recurrence(deg, jnp.ones_like(y), y + y - 1, lambda k, cur, prev: (y + y) * cur - prev)
    t = jnp.arccos(y)
    edge = _sign_by_parity(deg, n + n + 1)
    closed = jnp.where(jnp.sin(t / 2) != 1, jnp.cos((n + 0.5) * t) / jnp.cos(t / 2), edge)
    value = jnp.where((deg > (6 if shifted else 8)) & (jnp.abs(y) < 1), closed, value)
    hi, lo = (x == 1, x == 0) if shifted else (y == 1, y == -1)
    return _finish(value, deg, [(hi, jnp.ones_like(y)), (lo, edge)])


def _cheb_w(x, deg, shifted=False):
    y = x + x - 1 if shifted else x
    n = deg.astype(x.dtype)
    value = _recurrence(deg, jnp.ones_like(y), y + y + 1, lambda k, cur, prev: (y + y) * cur - prev)
    t = jnp.arccos(y)
    parity = _sign_by_parity(deg, jnp.ones_like(y))
    at_cos_one = jnp.where(y > 0, n + n + 1, parity) if not shifted else parity
    closed = jnp.where(jnp.cos(t / 2) != 1, jnp.sin((n + 0.5) * t) / jnp.sin(t / 2), at_cos_one)
    value = jnp.where((deg > (4 if shifted else 8)) & (jnp.abs(y) < 1), closed, value)
    hi, lo = (x == 1, x == 0) if shifted else (y == 1, y == -1)
    return _finish(value, deg, [(hi, n + n + 1), (lo, parity)])


def _hermite_limit(x):
    return 128 if x.dtype == jnp.float32 else 512


def _hermite_h(x, deg):
    value = _recurrence(deg, jnp.ones_like(x), x + x, lambda k, cur, prev: (x + x) * cur - 2 * (k - 1) * prev)
    value = jnp.where(deg > _hermite_limit(x), jnp.nan, value)
    return _finish(value, deg, [])


def _hermite_he(x, deg):
    value = _recurrence(deg, jnp.ones_like(x), x, lambda k, cur, prev: x * cur - (k - 1) * prev)
    value = jnp.where(deg > _hermite_limit(x), jnp.nan, value)
    return _finish(value, deg, [])


def _laguerre_l(x, deg):
    value = _recurrence(deg, jnp.ones_like(x), 1 - x,
                        lambda k, cur, prev: ((2 * (k - 1) + 1 - x) * cur - (k - 1) * prev) / k)
    return _finish(value, deg, [(x == 0, jnp.ones_like(x))])


def _legendre_p(x, deg):
    value = _recurrence(deg, jnp.ones_like(x), x, lambda k, cur, prev: ((2 * k - 1) * x * cur - (k - 1) * prev) / k)
    return _finish(value, deg, [(x == 1, jnp.ones_like(x)), (x == -1, _sign_by_parity(deg, jnp.ones_like(x)))])


_POLYNOMIALS = {
    "chebyshev_polynomial_t": _cheb_t,
    "chebyshev_polynomial_u": _cheb_u,
    "chebyshev_polynomial_v": _cheb_v,
    "chebyshev_polynomial_w": _cheb_w,
    "shifted_chebyshev_polynomial_t": lambda x, d: _cheb_t(x, d, shifted=True),
    "shifted_chebyshev_polynomial_u": lambda x, d: _cheb_u(x, d, shifted=True),
    "shifted_chebyshev_polynomial_v": lambda x, d: _cheb_v(x, d, shifted=True),
    "shifted_chebyshev_polynomial_w": lambda x, d: _cheb_w(x, d, shifted=True),
    "hermite_polynomial_h": _hermite_h,
    "hermite_polynomial_he": _hermite_he,
    "laguerre_polynomial_l": _laguerre_l,
    "legendre_polynomial_p": _legendre_p,
}


def _polynomial(fn):
    return lambda x, n: fn(*_float_pair(x, n))


for _name, _fn in _POLYNOMIALS.items():
    lower(f"special_{_name}.default", f"special_{_name}.x_scalar", f"special_{_name}.n_scalar")(_polynomial(_fn))


# ---------------------------------------------------------------- zeta, polygamma, erfcx
def _zeta(x, q):
    """Hurwitz zeta with PyTorch's values off its domain: inf at x == 1 and at poles q = 0, -1, ...;
    NaN for x < 1 and for a non-integer x at q < 0."""
    x, q = jnp.broadcast_arrays(*(jnp.asarray(v) for v in (x, q)))
    dt = jnp.result_type(x, q)
    if not jnp.issubdtype(dt, jnp.inexact):
        dt = jnp.float32
    x, q = x.astype(dt), q.astype(dt)
    inf = jnp.full_like(x, jnp.inf)
    nan = jnp.full_like(x, jnp.nan)
    pole = (q <= 0) & (q == jnp.floor(q))
    value = jnp.where(q > 0, jsp.zeta(x, jnp.where(q > 0, q, 1)), _zeta_negative_q(x, jnp.where(pole, -0.5, q)))
    value = jnp.where((q <= 0) & (x != jnp.floor(x)), nan, value)
    value = jnp.where(pole, inf, value)
    value = jnp.where(x < 1, nan, value)
    return jnp.where(x == 1, inf, value)


def _zeta_negative_q(x, q):
    """zeta(x, q) for q < 0: the terms (q + j)^-x for j < m = ceil(-q), then zeta(x, q + m), q + m > 0
    (jax's zeta itself goes wrong below q ~ -7)."""
    m = jnp.ceil(-jnp.minimum(q, 0))
    top = jnp.max(m, initial=0)

    def body(carry):
        j, acc = carry
        return j + 1, acc + jnp.where(j < m, jnp.power(q + j, -x), 0)

    _, head = lax.while_loop(lambda c: c[0] < top, body, (jnp.zeros((), q.dtype), jnp.zeros_like(q)))
    return head + jsp.zeta(x, q + m)


lower("special_zeta.default", "special_zeta.self_scalar", "special_zeta.other_scalar")(_zeta)


def _trigamma(x):
    """PyTorch's trigamma: reflection below 1/2, six recurrence steps, then the asymptotic series."""
    reflect = x < 0.5
    s = jnp.sin(jnp.pi * x)
    head = jnp.where(reflect, -(jnp.pi * jnp.pi) / (s * s), 0)
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        head = head + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    total = head + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -total, total)


@lower("polygamma", "special_polygamma", static=("n",))
def _polygamma(n, x):
    # float32 for integers and for bfloat16/float16, as PyTorch's CPU kernel computes them
    x = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.inexact) or x.dtype.itemsize < 4 else x
    if n == 0:
        return jnp.where(x == 0, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x), jsp.digamma(x))
    if n == 1:
        return _trigamma(x)
    sign = 1.0 if n % 2 else -1.0
    return sign * math.exp(math.lgamma(n + 1.0)) * _zeta(jnp.full_like(x, n + 1), x)


lower("special_erfcx")(lambda x: jsp.erfcx(x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)))
