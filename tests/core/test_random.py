"""tpu randomness: reproducible under torch.manual_seed, right distributions,
factories and in-place fills all on the device (CPU fallback switched off)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from helpers import no_fallback

TPU = "tpu"
N = 200_000  # samples for distribution checks: standard errors ~ 1/sqrt(N) ~ 0.002


def host(t):
    return t.cpu()


# every way to draw random numbers on tpu, each a function of nothing
DRAWS = {
    "randn": lambda: torch.randn(64, device=TPU),
    "rand": lambda: torch.rand(8, 8, device=TPU, dtype=torch.float64),
    "randint": lambda: torch.randint(-5, 1000, (64,), device=TPU),
    "randperm": lambda: torch.randperm(50, device=TPU),
    "normal_": lambda: torch.empty(64, device=TPU).normal_(1.0, 2.0),
    "uniform_": lambda: torch.empty(64, device=TPU).uniform_(-3, 3),
    "bernoulli_p": lambda: torch.empty(64, device=TPU).bernoulli_(0.3),
    "bernoulli_tensor": lambda: torch.bernoulli(torch.full((64,), 0.5, device=TPU)),
    "exponential_": lambda: torch.empty(64, device=TPU).exponential_(2.0),
    "cauchy_": lambda: torch.empty(64, device=TPU).cauchy_(),
    "geometric_": lambda: torch.empty(64, device=TPU).geometric_(0.2),
    "log_normal_": lambda: torch.empty(64, device=TPU).log_normal_(),
    "random_": lambda: torch.empty(64, device=TPU, dtype=torch.int32).random_(),
    "multinomial": lambda: torch.multinomial(torch.ones(4, 30, device=TPU), 10),
    "dropout": lambda: F.dropout(torch.ones(64, device=TPU), 0.5, training=True),
    "normal_tensor": lambda: torch.normal(torch.zeros(64, device=TPU), torch.ones(64, device=TPU)),
    "randn_like": lambda: torch.randn_like(torch.zeros(64, device=TPU)),
}


@pytest.mark.parametrize("name", list(DRAWS))
def test_same_seed_same_numbers_other_seed_other_numbers(name):
    draw = DRAWS[name]
    with no_fallback():
        torch.manual_seed(1234)
        a, b = host(draw()), host(draw())
        torch.manual_seed(1234)
        a2, b2 = host(draw()), host(draw())
        torch.manual_seed(99)
        c = host(draw())
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, b), "two calls gave the same numbers"
    assert not torch.equal(a, c), "another seed gave the same numbers"


def test_tpu_manual_seed_and_device_factories():
    torch.tpu.manual_seed(7)
    a = torch.randn(16, device=TPU)
    torch.tpu.manual_seed(7)
    assert torch.equal(host(a), host(torch.randn(16, device=TPU)))
    with no_fallback():
        for t, dt in [(torch.randn(3, 4, device=TPU, dtype=torch.bfloat16), torch.bfloat16),
                      (torch.rand(5, device=TPU, dtype=torch.float64), torch.float64),
                      (torch.randint(3, (7,), device=TPU, dtype=torch.int32), torch.int32),
                      (torch.randperm(9, device=TPU, dtype=torch.int16), torch.int16),
                      (torch.randint_like(torch.zeros(4, device=TPU), 10), torch.float32)]:
            assert t.device.type == TPU and t.dtype == dt
    # a CPU generator is refused, as CUDA refuses one (tests/core/test_generator.py: tpu generators)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        torch.randn(5, device=TPU, generator=g)


def _moments(t):
    t = host(t).double()
    return t.mean().item(), t.std().item()


def test_continuous_distributions():
    with no_fallback():
        torch.manual_seed(0)
        m, s = _moments(torch.randn(N, device=TPU))
        assert abs(m) < 0.01 and abs(s - 1) < 0.01
        m, s = _moments(torch.empty(N, device=TPU).normal_(3.0, 0.5))
        assert abs(m - 3) < 0.005 and abs(s - 0.5) < 0.005
        u = host(torch.empty(N, device=TPU).uniform_(-2, 6))
        assert u.min() >= -2 and u.max() < 6
        assert abs(u.mean() - 2) < 0.03 and abs(u.std() - 8 / math.sqrt(12)) < 0.02
        u = host(torch.rand(N, device=TPU, dtype=torch.bfloat16))
        assert u.min() >= 0 and u.max() < 1  # rounding to bfloat16 never reaches the upper bound
        m, s = _moments(torch.empty(N, device=TPU).exponential_(4.0))
        assert abs(m - 0.25) < 0.005 and abs(s - 0.25) < 0.005
        c = host(torch.empty(N, device=TPU).cauchy_(1.0, 2.0))
        assert abs(c.median() - 1.0) < 0.05
        q1, q3 = c.quantile(torch.tensor([0.25, 0.75]))  # quartiles of Cauchy(1, 2): 1 -/+ 2
        assert abs(q1 + 1) < 0.1 and abs(q3 - 3) < 0.1
        ln = host(torch.empty(N, device=TPU).log_normal_(0.5, 0.25)).log()
        assert abs(ln.mean() - 0.5) < 0.005 and abs(ln.std() - 0.25) < 0.005
        m, s = _moments(torch.normal(torch.full((N,), 2.0, device=TPU), torch.full((N,), 3.0, device=TPU)))
        assert abs(m - 2) < 0.03 and abs(s - 3) < 0.03
        m, s = _moments(torch.normal(-1.0, torch.full((N,), 0.1, device=TPU)))
        assert abs(m + 1) < 0.002 and abs(s - 0.1) < 0.002
        m, _ = _moments(torch._standard_gamma(torch.full((N,), 3.0, device=TPU)))
        assert abs(m - 3) < 0.03
        m, _ = _moments(torch.poisson(torch.full((N,), 4.0, device=TPU)))
        assert abs(m - 4) < 0.03


def test_discrete_distributions():
    with no_fallback():
        torch.manual_seed(0)
        r = host(torch.randint(-3, 7, (N,), device=TPU))
        assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 6
        counts = torch.bincount(r + 3).double() / N
        assert (counts - 0.1).abs().max() < 0.01
        b = host(torch.empty(N, device=TPU).bernoulli_(0.3))
        assert set(b.unique().tolist()) == {0.0, 1.0} and abs(b.mean() - 0.3) < 0.005
        p = torch.linspace(0, 1, N).to(TPU)
        b = host(torch.bernoulli(p))
        assert abs(b[: N // 2].mean() - 0.25) < 0.01 and abs(b[N // 2:].mean() - 0.75) < 0.01
        g = host(torch.empty(N, device=TPU).geometric_(0.25))
        assert g.min() >= 1 and abs(g.mean() - 4) < 0.05 and torch.equal(g, g.round())
        x = host(torch.empty(N, device=TPU, dtype=torch.int16).random_(10, 20))
        assert x.dtype == torch.int16 and x.min() == 10 and x.max() == 19
        x = host(torch.empty(N, device=TPU).random_(5))
        assert x.min() == 0 and x.max() == 4 and torch.equal(x, x.round())
        x = host(torch.empty(N, device=TPU).random_())  # float32: integers in [0, 2^24]
        assert x.min() >= 0 and x.max() <= 2 ** 24 and x.max() > 2 ** 23
        x = host(torch.empty(1000, device=TPU, dtype=torch.bool).random_())
        assert 300 < x.sum() < 700
        x = host(torch.empty(N, device=TPU, dtype=torch.int64).random_(-(2 ** 40), None))
        assert x.min() >= -(2 ** 40) and x.max() > 2 ** 62  # to=None: up to the dtype's maximum
        perm = host(torch.randperm(1000, device=TPU))
        assert torch.equal(perm.sort().values, torch.arange(1000))


def test_multinomial():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 1.0, 1.0]])
    with no_fallback():
        torch.manual_seed(0)
        draws = host(torch.multinomial(probs.to(TPU), 20_000, replacement=True))
        assert draws.shape == (2, 20_000) and draws.dtype == torch.int64
        freq0 = torch.bincount(draws[0], minlength=4).double() / 20_000
        freq1 = torch.bincount(draws[1], minlength=4).double() / 20_000
        assert freq0[1] == 0  # a zero-probability category is never drawn
        assert (freq0 - torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)).abs().max() < 0.015
        assert (freq1 - 0.25).abs().max() < 0.015
        # without replacement: distinct categories, zero probability never drawn while others remain
        picks = host(torch.multinomial(probs.to(TPU).expand(500, 2, 4).reshape(1000, 4), 3))
        assert all(len(set(row.tolist())) == 3 for row in picks)
        assert not (picks[::2] == 1).any()
        # the most probable category is drawn first most often
        first = torch.bincount(picks[::2, 0], minlength=4).double() / 500
        assert first.argmax() == 2 and abs(first[2] - 0.6) < 0.07


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_expected_fraction_and_scales(p):
    x = torch.ones(400, 500, device=TPU)
    with no_fallback():
        torch.manual_seed(3)
        y = host(F.dropout(x, p, training=True))
        m = torch.nn.Dropout(p).to(TPU)
        m.eval()
        assert torch.equal(host(m(x)), torch.ones(400, 500))
    kept = (y != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.005
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - p)))


def test_feature_dropout_zeroes_whole_channels():
    x = torch.ones(64, 32, 5, 5, device=TPU)
    with no_fallback():
        torch.manual_seed(1)
        y = host(F.dropout2d(x, 0.5, training=True))
    per_channel = y.flatten(2)
    assert ((per_channel == 0).all(-1) | (per_channel == 2).all(-1)).all()
    assert abs((per_channel[..., 0] == 0).double().mean() - 0.5) < 0.05


def test_invalid_parameters_raise():
    t = torch.empty(4, device=TPU)
    with pytest.raises(RuntimeError, match="std >= 0"):
        t.normal_(0, -1)
    with pytest.raises(RuntimeError, match="from"):
        t.random_(5, 5)
    with pytest.raises(RuntimeError, match="p to be in"):
        t.geometric_(1.5)
