"""Random number ops.

Each lowering is ``random=True``: the kernel executor hands it a fresh JAX key per
call, drawn from ``torchtpu/base/rng.py`` (seed + counter), so ``torch.manual_seed``
makes tpu randomness reproducible and an executable is never recompiled for a
new key. The streams are JAX's (threefry), not ATen's: the same seed gives
other numbers than on CPU, with the same distributions.

Factories (``torch.randn(..., device="tpu")``, ``rand``, ``randint``, the
``*_like`` forms) are CompositeExplicitAutograd in PyTorch: they allocate with
``empty`` and fill with the in-place op below, so they need no kernel of their
own. In-place forms are derived by the installer from the functional lowering
where PyTorch has one with the same overload name (``uniform_`` from
``uniform``); the others (``normal_``, ``bernoulli_.float``) fill a fresh value
and copy it in (a buffer swap for a contiguous tensor).

``generator=None`` draws from the process's stream, seeded by ``torch.manual_seed`` /
``torch.tpu.manual_seed``; a ``torch.Generator(device="tpu")`` (the C++ hooks, ``csrc/``) is a
stream of its own: the kernel executor takes the key from its seed and offset instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..dispatch.lowering import impl, lower
from ..runtime.device import check_device

aten = torch.ops.aten

# the installer derives in-place kernels from the aten packets it can see: load them
for _name in ("uniform_", "bernoulli_", "random_", "exponential_", "cauchy_", "geometric_", "log_normal_"):
    getattr(aten, _name)


def _float_dtype(x):
    """Sample in float32 for half types (rounded once at the end), else the tensor's own float."""
    if x.dtype in (jnp.bfloat16, jnp.float16) or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.float32 if x.dtype != jnp.float64 else jnp.float64
    return x.dtype


# ---------------------------------------------------------------- normal
@lower("normal_functional", random=True)
def _normal_functional(x, mean=0.0, std=1.0, generator=None, key=None):
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    dt = _float_dtype(x)
    return mean + std * jax.random.normal(key, x.shape, dt)


@impl("normal_")
def _normal_(self, mean=0.0, std=1.0, generator=None):
    self.copy_(aten.normal_functional(self, mean, std, generator=generator))
    return self


def _normal_tensor(key, mean, std):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dt = jnp.result_type(mean, std)
    dt = jnp.float32 if dt in (jnp.bfloat16, jnp.float16) or not jnp.issubdtype(dt, jnp.floating) else dt
    return mean + std * jax.random.normal(key, shape, dt)


@lower("normal.Tensor_float", random=True)
def _normal_tf(mean, std=1.0, generator=None, key=None):
    return _normal_tensor(key, mean, std)


@lower("normal.float_Tensor", random=True)
def _normal_ft(mean, std, generator=None, key=None):
    return _normal_tensor(key, mean, std)


@lower("normal.Tensor_Tensor", random=True)
def _normal_tt(mean, std, generator=None, key=None):
    return _normal_tensor(key, mean, std)


@lower("log_normal", random=True)
def _log_normal(x, mean=1.0, std=2.0, generator=None, key=None):
    if std <= 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={std}")
    return jnp.exp(mean + std * jax.random.normal(key, x.shape, _float_dtype(x)))


# ---------------------------------------------------------------- uniform family
@lower("uniform", random=True)
def _uniform(x, from_=0.0, to=1.0, generator=None, key=None):
    if from_ > to:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={from_} > to={to}")
    dt = _float_dtype(x)
    u = jax.random.uniform(key, x.shape, dt, minval=from_, maxval=to)
    if x.dtype in (jnp.bfloat16, jnp.float16) and to > from_:
        # rounding to the narrow type must not produce ``to`` itself
        u = u.astype(x.dtype)
        u = jnp.where(u.astype(dt) >= to, jnp.nextafter(jnp.asarray(to, x.dtype), jnp.asarray(from_, x.dtype)), u)
    return u


@lower("exponential", random=True)
def _exponential(x, lambd=1.0, generator=None, key=None):
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return jax.random.exponential(key, x.shape, _float_dtype(x)) / lambd


@lower("cauchy", random=True)
def _cauchy(x, median=0.0, sigma=1.0, generator=None, key=None):
    if sigma <= 0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={sigma}")
    return median + sigma * jax.random.cauchy(key, x.shape, _float_dtype(x))


@lower("geometric", random=True)
def _geometric(x, p, generator=None, key=None):
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    dt = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    u = jax.random.uniform(key, x.shape, dt, minval=jnp.finfo(dt).tiny, maxval=1.0)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p))


# ---------------------------------------------------------------- bernoulli
def _bernoulli(key, p, shape):
    pf = jnp.asarray(p)
    pf = pf.astype(jnp.float32) if pf.dtype != jnp.float64 else pf
    return jax.random.uniform(key, shape, pf.dtype) < pf


@lower("bernoulli", random=True)
def _bernoulli_self(x, generator=None, key=None):
    return _bernoulli(key, x, x.shape)


@lower("bernoulli.p", random=True)
def _bernoulli_p(x, p, generator=None, key=None):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return _bernoulli(key, p, x.shape)


@lower("bernoulli.Tensor", random=True)
def _bernoulli_t(x, p, generator=None, key=None):
    return _bernoulli(key, jnp.broadcast_to(p, x.shape), x.shape)


@impl("bernoulli_.float")
def _bernoulli_float_(self, p=0.5, generator=None):
    self.copy_(aten.bernoulli.p(self, p, generator=generator))
    return self


# ---------------------------------------------------------------- integers
def _int_range_max(dtype):
    """Largest value ``random_()`` draws for ``dtype``: 2^mantissa for floats."""
    if dtype == jnp.bool_:
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** (jnp.finfo(dtype).nmant + 1)
    return int(jnp.iinfo(dtype).max)


def _randint(key, shape, lo, hi_inclusive, dtype):
    """Uniform integers in [lo, hi_inclusive], exact for the whole int64 range."""
    span = hi_inclusive - lo + 1
    if span <= 2 ** 62:
        v = jax.random.randint(key, shape, 0, span, jnp.int64) + lo
    else:
        # wider than randint's int64 bound: uniform 64-bit words modulo the span (bias < 2^-1)
        bits = jax.random.bits(key, shape, jnp.uint64)
        v = (bits % jnp.uint64(span)).astype(jnp.int64) + jnp.int64(lo) if span < 2 ** 64 else \
            jax.lax.bitcast_convert_type(bits, jnp.int64)
    if dtype == jnp.bool_:
        return v != 0
    return v.astype(dtype)


@lower("random.from", random=True)
def _random_from(x, from_, to=None, generator=None, key=None):
    if to is None:
        hi = _int_range_max(x.dtype)
    else:
        if from_ >= to:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={from_} >= to={to}")
        hi = to - 1
    return _randint(key, x.shape, from_, hi, x.dtype)


@lower("random.to", random=True)
def _random_to(x, to, generator=None, key=None):
    if to <= 0:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from=0 >= to={to}")
    return _randint(key, x.shape, 0, to - 1, x.dtype)


@lower("random", random=True)
def _random(x, generator=None, key=None):
    return _randint(key, x.shape, 0, _int_range_max(x.dtype), x.dtype)


# ---------------------------------------------------------------- permutations, categorical, gamma
# c10::ScalarType order: a schema default (``dtype=4``) reaches kernels as that int
_SCALAR_TYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                 torch.float64, torch.complex32, torch.complex64, torch.complex128, torch.bool)


def _as_dtype(dtype, default):
    if dtype is None:
        return default
    if isinstance(dtype, int):
        return torch.bfloat16 if dtype == 15 else _SCALAR_TYPES[dtype]
    return dtype


def _randperm_meta(n, dtype=torch.int64, layout=None, device=None, pin_memory=None, generator=None):
    return torch.empty((n,), dtype=_as_dtype(dtype, torch.int64), device="meta")


@lower("randperm", random=True, meta=_randperm_meta)
def _randperm(n, dtype=torch.int64, layout=None, device=None, pin_memory=None, key=None):
    check_device(device)
    return jax.random.permutation(key, n)


@lower("randperm.generator", random=True,
       meta=lambda n, generator=None, dtype=torch.int64, layout=None, device=None, pin_memory=None:
       _randperm_meta(n, dtype))
def _randperm_g(n, generator=None, dtype=torch.int64, layout=None, device=None, pin_memory=None, key=None):
    return _randperm(n, dtype, layout, device, pin_memory, key=key)


@lower("multinomial", random=True)
def _multinomial(probs, num_samples, replacement=False, generator=None, key=None):
    p = probs.astype(jnp.float64 if probs.dtype == jnp.float64 else jnp.float32)
    logits = jnp.log(p)  # log 0 = -inf: a zero-probability category is never drawn
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + p.shape[:-1])
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    # without replacement: the top num_samples of log p + Gumbel noise (Gumbel-top-k)
    g = logits + jax.random.gumbel(key, p.shape, p.dtype)
    _, idx = jax.lax.top_k(g, num_samples)
    return idx.astype(jnp.int64)


@lower("_standard_gamma", random=True)
def _standard_gamma(alpha, generator=None, key=None):
    a = alpha.astype(_float_dtype(alpha))
    return jax.random.gamma(key, a, a.shape, a.dtype)


@lower("poisson", random=True)
def _poisson(rate, generator=None, key=None):
    return jax.random.poisson(key, rate, rate.shape).astype(rate.dtype)


@lower("binomial", random=True)
def _binomial(count, prob, generator=None, key=None):
    shape = jnp.broadcast_shapes(count.shape, prob.shape)
    return jax.random.binomial(key, count, prob, shape)



# ---------------------------------------------------------------- rrelu
@impl("rrelu_with_noise")
def _rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """PyTorch's randomized leaky ReLU: in training each non-positive element takes a slope drawn
    from U(lower, upper), recorded in ``noise`` (1 elsewhere) for the backward; else the mean slope."""
    if not training:
        return aten.leaky_relu.default(self, (lower + upper) / 2)
    slopes = aten.where.self(self <= 0, aten.uniform.default(self, lower, upper, generator=generator),
                             torch.ones((), dtype=self.dtype, device=self.device))
    noise.copy_(slopes)
    return self * slopes
