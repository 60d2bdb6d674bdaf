"""Lookup + fused update throughput of SparseCore tables on tpu vs TorchRec's CPU EBC with fbgemm.

One training step of the embedding layer, both sides doing the same work on the same tables and
batches: a pooled lookup of a KeyedJaggedTensor (B bags per feature, power-law ids with
duplicates), then the backward of a fixed output gradient, which runs the fused optimizer
(row-wise Adagrad by default, DLRM's usual choice) and updates the tables in place.

- **tpu**: ``torchtpu_rec.SparseCoreEmbeddingBagCollection``: host preprocessing of the KJT into
  per-SparseCore buffers, one jitted lookup, one jitted fused update (the kernel TorchRec's sharded
  lookups run too; ``torchtpu.synchronize()`` and a wait on the tables end each timed block).
- **cpu**: torchrec's ``FusedEmbeddingBagCollection`` on CPU: fbgemm's
  ``SplitTableBatchedEmbeddingBagsCodegen`` with the matching exact optimizer.

Both start from the same weights; the lookups are checked equal before timing. Reports ids/s
each and the ratio tpu/cpu of throughputs (> 1: tpu faster), from wall time (the blocks of the
two take turns, the ratio is the median of per-round ratios) and from process CPU time (all
threads of the process: steadier when other jobs load the machine), and the tpu step's parts
(preprocess, lookup, update) timed alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.pin_threads(common.early_threads())

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import torchtpu  # noqa: E402

OPTIMS = {"sgd": ("sgd", "SGD"), "adagrad": ("adagrad", "Adagrad"), "rowwise_adagrad": ("rowwise_adagrad", None)}


def make_batches(num_features, rows, batch, pooling, n, seed, alpha):
    """``n`` KJTs: per bag 1..2*pooling ids (mean ``pooling``), ids power-law (Zipf-like, ``alpha``)."""
    from torchrec import KeyedJaggedTensor

    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lens = g.integers(1, 2 * pooling, size=num_features * batch)
        total = int(lens.sum())
        if alpha > 0:
            ids = (rows * g.power(1.0 / (1.0 + alpha), total)).astype(np.int64)  # dense near 0
            ids = np.minimum(ids, rows - 1)
        else:
            ids = g.integers(0, rows, total)
        out.append(KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(num_features)], values=torch.from_numpy(ids),
            lengths=torch.from_numpy(lens.astype(np.int64))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling", type=int, default=16, help="mean ids per bag")
    ap.add_argument("--alpha", type=float, default=1.0, help="id skew (0: uniform)")
    ap.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(OPTIMS))
    ap.add_argument("--sparsecores", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    ap.add_argument("--iters", type=int, default=5, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small tables and batches, < 60 s")
    ap.add_argument("--out", default="runs/bench_embedding.json")
    args = ap.parse_args()
    if args.quick:
        args.tables, args.rows, args.dim, args.batch, args.pooling = 4, 20_000, 32, 512, 8
        args.iters, args.repeats, args.warmup, args.batches = 3, 4, 1, 2
    torch.set_num_threads(args.threads)

    from torchrec import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    from torchtpu_rec import SparseCoreEmbeddingBagCollection

    configs = [EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{i}",
                                  feature_names=[f"f{i}"]) for i in range(args.tables)]
    kind = args.optimizer
    opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad}[kind]
    kw = {"lr": 0.05} if kind == "sgd" else {"lr": 0.05, "eps": 1e-8}
    torch.manual_seed(0)
    cpu = FusedEmbeddingBagCollection(configs, optimizer_type=opt_cls, optimizer_kwargs=kw,
                                      device=torch.device("cpu"))
    tpu = SparseCoreEmbeddingBagCollection(configs, optimizer=opt_cls, optimizer_kwargs=kw,
                                           num_sparsecores=args.sparsecores)
    sd = cpu.state_dict()
    tpu.load_table_weights({c.name: sd[f"embedding_bags.{c.name}.weight"] for c in configs})

    batches = make_batches(args.tables, args.rows, args.batch, args.pooling, args.batches, 0, args.alpha)
    ids_per_batch = statistics.mean(int(b.values().numel()) for b in batches)
    grad_cpu = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(1)) * 1e-2
    grad_tpu = grad_cpu.to("tpu")

    # same result before timing (fbgemm may order keys differently: compare per key)
    for b in batches[:1]:
        a, c = tpu(b), cpu(b)
        err = max(float((a[k].detach().cpu() - c[k].detach()).abs().max()) for k in a.keys())
        if err > 1e-4:
            raise SystemExit(f"tpu and cpu lookups differ by {err}")

    import jax

    state = {"i": 0}

    def step_tpu():
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        tpu(b).values().backward(grad_tpu)

    def sync_tpu():
        torchtpu.synchronize()
        jax.block_until_ready([torchtpu.to_jax(p) for p in tpu.parameters()])  # the last update ran

    cstate = {"i": 0}

    def step_cpu():
        b = batches[cstate["i"] % len(batches)]
        cstate["i"] += 1
        kt = cpu(b)
        # fbgemm's output keys are in its own order: its gradient is laid out the same way
        kt.values().backward(grad_cpu)

    fns = {"tpu": (step_tpu, sync_tpu), "cpu": (step_cpu, None)}
    t0 = time.perf_counter()
    for name, (fn, sync) in fns.items():
        for _ in range(args.warmup):
            fn()
        if sync:
            sync()
    warm_s = time.perf_counter() - t0
    per = {n: [] for n in fns}
    per_cpu = {n: [] for n in fns}
    for _ in tqdm(range(args.repeats), desc="bench_embedding", unit="repeat"):
        for name, (fn, sync) in fns.items():
            t, c = time.perf_counter(), time.process_time()
            for _ in range(args.iters):
                fn()
            if sync:
                sync()
            per[name].append((time.perf_counter() - t) / args.iters)
            per_cpu[name].append((time.process_time() - c) / args.iters)

    # parts of the tpu step, alone
    b = batches[0]

    def part_pre():
        tpu.preprocess(b)

    batch0 = tpu.preprocess(b)

    # the kernel's executables run asynchronously: block on their outputs (torchtpu.synchronize()
    # only waits for torchtpu's own pending work)
    def part_lookup():
        with torch.no_grad():
            jax.block_until_ready(torchtpu.to_jax(tpu.kernel.lookup(batch0)))

    def part_update():
        tpu.kernel.apply_update(batch0, (grad_tpu,))
        jax.block_until_ready([torchtpu.to_jax(p) for p in tpu.parameters()])

    parts = {}
    for name, fn in (("preprocess", part_pre), ("lookup", part_lookup), ("update", part_update)):
        r = common.time_per_iter(fn, iters=args.iters, repeats=max(3, args.repeats // 2), warmup=1)
        parts[name] = r["median_us"] / 1e3

    # both sides applied the same updates (the tpu side some extra steps for the parts timing)
    med = {n: statistics.median(v) for n, v in per.items()}
    ratio = statistics.median([c / t for t, c in zip(per["tpu"], per["cpu"])])  # throughput tpu / cpu
    med_cpu = {n: statistics.median(v) for n, v in per_cpu.items()}
    ratio_cpu = statistics.median([c / t for t, c in zip(per_cpu["tpu"], per_cpu["cpu"])])
    res = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "ids_per_batch": ids_per_batch,
        "step_ms": {n: v * 1e3 for n, v in med.items()},
        "ids_per_s": {n: ids_per_batch / v for n, v in med.items()},
        "ratio_tpu_over_cpu_throughput": ratio,
        "process_time_step_ms": {n: v * 1e3 for n, v in med_cpu.items()},
        "ratio_tpu_over_cpu_throughput_process_time": ratio_cpu,
        "tpu_parts_ms": parts,
        "warmup_s": warm_s,
        "repeats_ms": {n: [x * 1e3 for x in v] for n, v in per.items()},
        "repeats_process_ms": {n: [x * 1e3 for x in v] for n, v in per_cpu.items()},
        "tpu_counters": tpu.counters.as_dict(),
        "environment": common.environment(args.threads),
    }
    print(f"\n{args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}, "
          f"~{ids_per_batch:.0f} ids/batch, optimizer {kind}, {args.sparsecores} SparseCores")
    print(f"{'':12s}{'step ms':>10s}{'Mids/s':>10s}{'cpu-time ms':>14s}")
    for n in ("tpu", "cpu"):
        print(f"{n:12s}{med[n] * 1e3:10.2f}{ids_per_batch / med[n] / 1e6:10.2f}{med_cpu[n] * 1e3:14.2f}")
    print(f"throughput ratio tpu/cpu: {ratio:.2f}x (wall), {ratio_cpu:.2f}x (process CPU time)")
    print("tpu parts (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    common.write_json(args.out, res)


if __name__ == "__main__":
    main()
