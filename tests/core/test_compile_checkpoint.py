"""Activation checkpointing under torch.compile(backend="tpu"): AOTAutograd recomputes a
checkpointed region's random ops in the backward through run_and_save_rng_state /
run_with_rng_state; both run inside the compiled programs and the recompute replays the
forward's draws."""

import warnings

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchtpu


def _no_eager_graphs():
    warnings.simplefilter("error", torchtpu.TPUFallbackWarning)  # a graph run op by op would warn


def test_checkpointed_dropout_recompute_replays_the_forward_mask():
    torch._dynamo.reset()

    def f(x, w):
        y = checkpoint(lambda a: F.dropout(a * w, p=0.5, training=True), x, use_reentrant=False)
        return y, y.sum()

    x = torch.ones(4096).to("tpu")
    w = torch.full((4096,), 3.0).to("tpu").requires_grad_(True)
    with warnings.catch_warnings():
        _no_eager_graphs()
        y, loss = torch.compile(f, backend="tpu")(x, w)
        loss.backward()
    y, g = y.detach().cpu(), w.grad.cpu()
    kept = y != 0
    assert 0.4 < kept.float().mean().item() < 0.6
    # d(sum(mask * x * w / 0.5))/dw = mask * 2: the backward's mask is the forward's
    assert torch.equal(g, kept.float() * 2.0)
    torch._dynamo.reset()


def test_checkpointed_attention_matches_cpu():
    torch._dynamo.reset()

    def f(q, k, v):
        out = checkpoint(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True).tanh(),
                         q, k, v, use_reentrant=False)
        return out.square().sum()

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, 2, 8, 4, generator=g) for _ in range(3)]
    cpu = [t.clone().requires_grad_(True) for t in qkv]
    f(*cpu).backward()
    tpu = [t.to("tpu").requires_grad_(True) for t in qkv]
    with warnings.catch_warnings():
        _no_eager_graphs()
        torch.compile(f, backend="tpu")(*tpu).backward()
    for a, b in zip(tpu, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
