"""The pure-JAX twin of bench_dmp.py's DLRM step: what XLA itself does with the same step, one process.

Same model as TorchRec's ``DLRM`` in bench_dmp.py (``tables`` sum-pooled tables of ``rows`` x ``dim``; dense
arch 8 -> 64 -> dim with ReLU after each layer; the pairwise-dot interaction of the dense output and the
pooled embeddings, concatenated with the dense output; over arch -> 64 (ReLU) -> 1), the same loss
(BCE with logits), the same optimizers (fbgemm's exact row-wise Adagrad on the rows the batch touched,
lr 0.05, eps 1e-8; Adam lr 1e-3 on the dense part) and the same batches (ids drawn as bench_dmp.py's
rank 0 draws them). The whole step is ONE ``jax.jit`` with the tables, the Adagrad state and the dense
state donated (XLA updates them in place):

* lookup: gather of the touched rows + ``segment_sum`` into (feature, sample) bags;
* backward: the gradient of the gathered rows only (never a dense table gradient);
* row-wise Adagrad: the row gradients summed per unique id (``jnp.unique`` with a static size), the
  accumulator ``+= mean(g^2)`` and ``w -= lr g / (sqrt(acc) + eps)`` scattered to those rows.

The ids of a batch are padded on the host to a power-of-two bucket (padding ids have weight 0), as our
lookup pads them, so the twin compiles once per bucket. Each timed step includes the host-to-device copy
of the batch and a host read of the loss, as bench_dmp.py's step does (``loss.item()``).

    python benchmarks/bench_rec_jax_twin.py --config '{"tables": 4, ...}'   # prints one JSON line

bench_dmp.py runs it in its own process (``--twin``): JAX code slows down in a process where torchtpu has
turned on ``jax_enable_x64``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, pin_threads  # noqa: E402

pin_threads(early_threads())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

DENSE_IN = 8
LR_TABLE, EPS_TABLE = 0.05, 1e-8
LR_DENSE, BETAS, EPS_DENSE = 1e-3, (0.9, 0.999), 1e-8


def _linear(key, fan_in, fan_out):
    bound = 1 / np.sqrt(fan_in)  # torch.nn.Linear's default init
    kw, kb = jax.random.split(key)
    return {"w": jax.random.uniform(kw, (fan_in, fan_out), jnp.float32, -bound, bound),
            "b": jax.random.uniform(kb, (fan_out,), jnp.float32, -bound, bound)}


def init(cfg, seed=0):
    T, rows, dim = cfg["tables"], cfg["rows"], cfg["dim"]
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    n_pairs = (T + 1) * T // 2
    dense = {"bottom0": _linear(keys[0], DENSE_IN, 64), "bottom1": _linear(keys[1], 64, dim),
             "over0": _linear(keys[2], dim + n_pairs, 64), "over1": _linear(keys[3], 64, 1)}
    # torchrec's default table init: uniform(-sqrt(1/rows), sqrt(1/rows)); T tables stacked, one row space
    bound = np.sqrt(1 / rows)
    tables = jax.random.uniform(keys[4], (T * rows, dim), jnp.float32, -bound, bound)
    adam = {"m": jax.tree.map(jnp.zeros_like, dense), "v": jax.tree.map(jnp.zeros_like, dense),
            "step": jnp.zeros((), jnp.float32)}
    return {"tables": tables, "acc": jnp.zeros((T * rows,), jnp.float32), "dense": dense, "adam": adam}


def _forward(dense, pooled, x):
    """DLRM's dense arch, interaction and over arch; ``pooled`` [B, T, dim]."""
    h = jax.nn.relu(x @ dense["bottom0"]["w"] + dense["bottom0"]["b"])
    h = jax.nn.relu(h @ dense["bottom1"]["w"] + dense["bottom1"]["b"])
    feats = jnp.concatenate([h[:, None], pooled], axis=1)  # [B, T+1, dim]
    inter = jnp.einsum("bid,bjd->bij", feats, feats)
    i, j = np.triu_indices(feats.shape[1], k=1)
    z = jnp.concatenate([h, inter[:, i, j]], axis=1)
    z = jax.nn.relu(z @ dense["over0"]["w"] + dense["over0"]["b"])
    return (z @ dense["over1"]["w"] + dense["over1"]["b"])[:, 0]


def make_step(cfg):
    T, B = cfg["tables"], cfg["batch"]

    def step(state, x, label, ids, bags, weights):
        rows = state["tables"][ids] * weights[:, None]  # the touched rows only

        def loss_fn(dense, rows):
            pooled = jax.ops.segment_sum(rows, bags, num_segments=T * B + 1)[: T * B]
            logits = _forward(dense, pooled.reshape(T, B, -1).transpose(1, 0, 2), x)
            return jnp.mean(jnp.maximum(logits, 0) - logits * label + jnp.log1p(jnp.exp(-jnp.abs(logits))))

        loss, (g_dense, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["dense"], rows)
        g_rows = g_rows * weights[:, None]
        # row-wise Adagrad on the unique touched rows (padding slots: a zero gradient, no change)
        uniq, inverse = jnp.unique(ids, size=ids.shape[0], fill_value=0, return_inverse=True)
        g = jax.ops.segment_sum(g_rows, inverse.reshape(-1), num_segments=ids.shape[0])
        acc = state["acc"].at[uniq].add(jnp.mean(g * g, axis=1))
        tables = state["tables"].at[uniq].add(-LR_TABLE * g / (jnp.sqrt(acc[uniq])[:, None] + EPS_TABLE))
        # Adam on the dense part (torch.optim.Adam's update)
        adam = state["adam"]
        t = adam["step"] + 1
        m = jax.tree.map(lambda m, g: BETAS[0] * m + (1 - BETAS[0]) * g, adam["m"], g_dense)
        v = jax.tree.map(lambda v, g: BETAS[1] * v + (1 - BETAS[1]) * g * g, adam["v"], g_dense)
        c1, c2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
        dense = jax.tree.map(lambda p, m, v: p - LR_DENSE * (m / c1) / (jnp.sqrt(v / c2) + EPS_DENSE),
                             state["dense"], m, v)
        return {"tables": tables, "acc": acc, "dense": dense, "adam": {"m": m, "v": v, "step": t}}, loss

    return jax.jit(step, donate_argnums=(0,))


def batches(cfg, rank=0, n=4):
    """bench_dmp.py's batches of ``rank`` (the same id draws), as padded host arrays."""
    T, rows, B = cfg["tables"], cfg["rows"], cfg["batch"]
    rng = np.random.default_rng(rank)  # the ids: bench_dmp.py's draws
    dense_rng = np.random.default_rng(1000 + rank)  # bench_dmp.py draws these from torch's generator
    out = []
    for _ in range(n):
        lengths = rng.integers(0, 2 * cfg["ids"], size=T * B)
        vals = rng.integers(0, rows, size=int(lengths.sum()))
        feature = np.repeat(np.arange(T * B) // B, lengths)
        total = len(vals)
        pad = max(64, 1 << int(np.ceil(np.log2(max(total, 1)))))
        ids = np.zeros(pad, np.int32)
        ids[:total] = vals + feature * rows  # the stacked tables' row space
        bags = np.full(pad, T * B, np.int32)  # padding ids go to a bag that is dropped
        bags[:total] = np.repeat(np.arange(T * B), lengths)
        weights = np.zeros(pad, np.float32)
        weights[:total] = 1
        x = dense_rng.standard_normal((B, DENSE_IN)).astype(np.float32)
        label = dense_rng.integers(0, 2, B).astype(np.float32)
        out.append((x, label, ids, bags, weights))
    return out


def run(cfg) -> dict:
    step = make_step(cfg)
    state = init(cfg)
    data = batches(cfg)

    def one(state, i):
        state, loss = step(state, *(jnp.asarray(a) for a in data[i % len(data)]))
        return state, float(loss)

    t0 = time.perf_counter()
    state, _ = one(state, 0)
    first_s = time.perf_counter() - t0
    for i in range(1, max(cfg["warmup"], len(data))):
        state, _ = one(state, i)
    wall, cpu, losses = [], [], []
    for _ in range(cfg["repeats"]):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(cfg["iters"]):
            state, loss = one(state, i)
        wall.append((time.perf_counter() - t0) / cfg["iters"] * 1e3)
        cpu.append((time.process_time() - c0) / cfg["iters"] * 1e3)
        losses.append(loss)
    if not all(np.isfinite(losses)):
        raise RuntimeError(f"JAX twin: non-finite loss {losses}")
    return {"ms_per_step": statistics.median(wall), "cpu_ms_per_step": statistics.median(cpu), "ms_all": wall,
            "cpu_ms_all": cpu, "first_step_s": first_s, "last_loss": losses[-1]}


def main():
    p = argparse.ArgumentParser(description="pure-JAX twin of bench_dmp.py's DLRM step (one process)")
    p.add_argument("--config", required=True, help="bench_dmp.py's config, as JSON")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    print(json.dumps(run(json.loads(a.config))))


if __name__ == "__main__":
    main()
