"""TinyTransformer and an AdamW step written directly in JAX: the executor's limit.

The benchmarks compare torchtpu's compiled training step with this one: the same
model (``torchtpu_models.TinyTransformer`` semantics: pre-norm blocks, fused qkv,
rotary or learned positions, causal attention, GELU/SiLU MLP, tied embeddings), the
same loss (mean next-token cross entropy) and PyTorch's AdamW update, as ONE
``jax.jit`` whose parameters and optimizer state are donated, so XLA updates them
in place. Weights are copied from a torch model, so both start identical and their
losses can be compared step by step. Benchmarks only: nothing in ``torchtpu``
imports this.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def params_from_torch(model) -> dict:
    """name -> jax array of every parameter of a (cpu) TinyTransformer (tied weights once)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = jnp.asarray(p.detach().cpu().numpy())
    for name, b in model.named_buffers():  # rope tables
        out[name] = jnp.asarray(b.detach().cpu().numpy())
    return out


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def _rms_norm(x, w, eps=1e-6):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(params, input_ids, cfg):
    """Logits (B, T, vocab) of ``input_ids`` (B, T), as TinyTransformer.forward without a mask."""
    B, T = input_ids.shape
    C, H = cfg.d_model, cfg.n_heads
    hd = C // H

    def norm(x, pre):
        if cfg.norm == "rmsnorm":
            return _rms_norm(x, params[pre + ".weight"])
        return _layer_norm(x, params[pre + ".weight"], params[pre + ".bias"])

    def linear(x, pre, bias=True):
        y = x @ params[pre + ".weight"].T
        return y + params[pre + ".bias"] if bias else y

    x = params["tok_emb.weight"][input_ids]
    if cfg.positions == "learned":
        x = x + params["pos_emb.weight"][:T]
        cos = sin = None
    else:
        cos, sin = params["rope_cos"][:T], params["rope_sin"][:T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(cfg.n_layers):
        pre = f"blocks.{i}."
        h = norm(x, pre + "ln1")
        q, k, v = jnp.split(linear(h, pre + "attn.qkv"), 3, axis=-1)
        q, k, v = (a.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        if cos is not None:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hd)
        s = jnp.where(causal, s, -jnp.inf)
        y = jax.nn.softmax(s, axis=-1) @ v
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + linear(y, pre + "attn.proj")
        h = norm(x, pre + "ln2")
        h = linear(h, pre + "mlp.fc")
        h = jax.nn.gelu(h, approximate=False) if cfg.activation == "gelu" else jax.nn.silu(h)
        x = x + linear(h, pre + "mlp.out")
    x = norm(x, "ln_f")
    w_out = params["tok_emb.weight"] if cfg.tie_embeddings else params["lm_head.weight"]
    return x @ w_out.T


def loss_fn(params, input_ids, targets, cfg):
    logits = forward(params, input_ids, cfg)
    logp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
    return -jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=-1).mean()


def adamw_init(params):
    trainable = {k: v for k, v in params.items() if k not in ("rope_cos", "rope_sin")}
    zeros = {k: jnp.zeros_like(v) for k, v in trainable.items()}
    return {"step": jnp.zeros((), jnp.float32), "m": zeros, "v": {k: jnp.zeros_like(v) for k, v in trainable.items()}}


def make_train_step(cfg, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """One jitted function (params, opt_state, x, y) -> (params, opt_state, loss): forward,
    backward and torch.optim.AdamW's update, params and state donated."""
    b1, b2 = betas

    def step(params, opt, x, y):
        frozen = {k: params[k] for k in ("rope_cos", "rope_sin") if k in params}
        train = {k: v for k, v in params.items() if k not in frozen}
        loss, grads = jax.value_and_grad(lambda p: loss_fn({**p, **frozen}, x, y, cfg))(train)
        t = opt["step"] + 1
        bc1 = 1 - b1 ** t
        bc2 = 1 - b2 ** t
        new_p, new_m, new_v = {}, {}, {}
        for k, p in train.items():
            g = grads[k]
            p = p * (1 - lr * weight_decay)
            m = b1 * opt["m"][k] + (1 - b1) * g
            v = b2 * opt["v"][k] + (1 - b2) * g * g
            denom = jnp.sqrt(v) / jnp.sqrt(bc2) + eps
            new_p[k] = p - (lr / bc1) * m / denom
            new_m[k], new_v[k] = m, v
        return {**new_p, **frozen}, {"step": t, "m": new_m, "v": new_v}, loss

    return jax.jit(step, donate_argnums=(0, 1))


class JaxTrainer:
    """Holds the JAX state of a TinyTransformer copied from ``model``; ``step()`` runs one
    training step on the fixed batch and returns the loss (a jax scalar, not synced)."""

    def __init__(self, model, x, y, lr=1e-3, weight_decay=0.01):
        self.cfg = model.config
        self.params = params_from_torch(model)
        self.opt = adamw_init(self.params)
        self.x = jnp.asarray(np.asarray(x.cpu()))
        self.y = jnp.asarray(np.asarray(y.cpu()))
        self._step = make_train_step(self.cfg, lr=lr, weight_decay=weight_decay)

    def step(self):
        self.params, self.opt, loss = self._step(self.params, self.opt, self.x, self.y)
        return loss

    def sync(self):
        jax.block_until_ready(self.params)
