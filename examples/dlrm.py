"""TorchRec's DLRM trained on tpu with DistributedModelParallel across 2 processes.

Synthetic click data with a planted signal: every id of every sparse feature has a hidden score, and
the dense features a hidden weight vector; a click happens with probability
sigmoid(sum of the mean id score per feature + dense . w). DLRM has to learn the id scores into its
embedding tables (sharded onto tpu by TorchRec's planner, taught tpu by torchtpu_rec) and the dense
part (trained data-parallel, DDP on the tpu backend). The held-out AUC rises well above 0.5.

    python examples/dlrm.py --out runs/dlrm            # spawns 2 processes itself
    torchrun --nproc-per-node 2 examples/dlrm.py       # or under a launcher (RANK/WORLD_SIZE set)
    python -m ray_integration head start             # then, through the local head (docs/ray.md):
    python -m ray_integration job submit --working-dir . -- python examples/dlrm.py --out /tmp/dlrm
    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- python examples/dlrm.py

Writes ``metrics.json`` and ``dlrm.png`` (loss and AUC curves) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import warnings

import numpy as np
import torch
import torch.multiprocessing as mp

N_SPARSE = 4


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/dlrm", help="where metrics.json and dlrm.png go")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--rows", type=int, default=1000, help="rows per embedding table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dense", type=int, default=8, help="dense features")
    p.add_argument("--lr", type=float, default=0.05, help="fused Adagrad lr of the tables")
    p.add_argument("--dense-lr", type=float, default=3e-3, help="Adam lr of the dense part")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-auc", type=float, default=0.55,
                   help="exit non-zero if the final held-out AUC is not above this (0 for smoke runs)")
    return p.parse_args(argv)


class ClickData:
    """Synthetic clicks with a planted signal (same hidden truth on every rank, different samples)."""

    def __init__(self, args, rank):
        truth = np.random.default_rng(args.seed)
        self.id_score = truth.normal(0, 1.0, size=(N_SPARSE, args.rows)).astype(np.float32)
        self.w = truth.normal(0, 0.5, size=args.dense).astype(np.float32)
        self.rng = np.random.default_rng(args.seed + 1000 + rank)
        self.args = args

    def batch(self, B):
        from torchrec import KeyedJaggedTensor

        a, rng = self.args, self.rng
        lengths = rng.integers(1, 4, size=(N_SPARSE, B))
        ids = [rng.zipf(1.3, size=int(lengths[f].sum())) % a.rows for f in range(N_SPARSE)]
        logit = np.zeros(B, np.float32)
        for f in range(N_SPARSE):
            seg = np.repeat(np.arange(B), lengths[f])
            logit += np.bincount(seg, weights=self.id_score[f, ids[f]], minlength=B) / lengths[f]
        dense = rng.normal(0, 1, size=(B, a.dense)).astype(np.float32)
        logit = logit + dense @ self.w - 0.5
        label = (rng.random(B) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        kjt = KeyedJaggedTensor(keys=[f"f{f}" for f in range(N_SPARSE)],
                                values=torch.from_numpy(np.concatenate(ids).astype(np.int64)),
                                lengths=torch.from_numpy(lengths.reshape(-1).astype(np.int64)))
        return torch.from_numpy(dense), kjt, torch.from_numpy(label)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC (Mann-Whitney U with average ranks for ties)."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), np.float64)
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i: j + 1] = (i + j) / 2 + 1
        i = j + 1
    r = np.empty_like(ranks)
    r[order] = ranks
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return float((r[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train(rank: int, world: int, args) -> dict:
    t_start = time.time()
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (the tpu device and the "tpu" process-group backend)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM

    from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder, tpu_data_parallel_wrapper
    from torchtpu_rec.sharding.planner import plan_for_tpu

    if not dist.is_initialized():
        dist.init_process_group("tpu", rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    tables = [EmbeddingBagConfig(name=f"t{f}", embedding_dim=args.dim, num_embeddings=args.rows,
                                 feature_names=[f"f{f}"]) for f in range(N_SPARSE)]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=args.dense,
        dense_arch_layer_sizes=[32, args.dim],
        over_arch_layer_sizes=[32, 1],
        dense_device=torch.device("meta"),
    )
    sharder = TPUEmbeddingBagCollectionSharder(
        fused_params={"optimizer": "adagrad", "learning_rate": args.lr, "eps": 1e-8})
    # the planner (taught tpu) decides; the tables are too small to need more than table-wise
    plan = plan_for_tpu(model, [sharder], world_size=world, batch_size=args.batch_size)
    dmp = DistributedModelParallel(model, device=torch.device("tpu"), sharders=[sharder], plan=plan,
                                   data_parallel_wrapper=tpu_data_parallel_wrapper())
    dense_params = [p for p in dmp.parameters() if p.requires_grad and not hasattr(p, "_in_backward_optimizers")]
    # fused: the whole dense Adam step is one tpu executable (per-parameter eager ops cost ~10x more here)
    opt = torch.optim.Adam(dense_params, lr=args.dense_lr, fused=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = ClickData(args, rank)
    eval_batches = [data.batch(args.batch_size) for _ in range(4)]

    def evaluate():
        scores, labels = [], []
        with torch.no_grad():
            for dense, kjt, label in eval_batches:
                scores.append(dmp(dense.to("tpu"), kjt).squeeze(-1).cpu().numpy())
                labels.append(label.numpy())
        both = [None] * world
        dist.all_gather_object(both, (np.concatenate(scores), np.concatenate(labels)))
        return auc(np.concatenate([b[0] for b in both]), np.concatenate([b[1] for b in both]))

    history = {"step": [], "loss": [], "eval_step": [], "auc": []}
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="dlrm on tpu (DMP)", unit="step")
    t0 = time.time()
    setup_s = t0 - t_start  # imports, process group, planner, DMP
    history["eval_step"].append(0)
    history["auc"].append(evaluate())
    for step in range(1, args.steps + 1):
        dense, kjt, label = data.batch(args.batch_size)
        logits = dmp(dense.to("tpu"), kjt).squeeze(-1)
        loss = loss_fn(logits, label.to("tpu"))
        opt.zero_grad()
        loss.backward()  # the tables' Adagrad runs here, in the backward
        opt.step()
        lv = float(loss.item())
        history["step"].append(step)
        history["loss"].append(lv)
        if step % args.eval_every == 0 or step == args.steps:
            history["eval_step"].append(step)
            history["auc"].append(evaluate())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{lv:.3f}", auc=f"{history['auc'][-1]:.3f}")
    if bar is not None:
        bar.close()
    wall = time.time() - t0
    sharding = {name: ps.sharding_type for mod in plan.plan.values() for name, ps in mod.items()}
    # what each process of the DMP held and ran (the evidence that the tables really were sharded over 2)
    mine = {"rank": rank, "pid": os.getpid(), "device": str(next(iter(dense_params)).device),
            "backend": dist.get_backend(), "steps": len(history["step"]),
            "tables": sorted(name for mod in plan.plan.values() for name, ps in mod.items()
                             if any(sh.placement.rank() == rank for sh in ps.sharding_spec.shards))}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    result = {"final_auc": history["auc"][-1], "initial_auc": history["auc"][0],
              "final_loss": float(np.mean(history["loss"][-10:])), "steps": args.steps,
              "batch_size_per_process": args.batch_size, "world_size": world, "setup_s": setup_s, "wall_s": wall,
              "steps_per_s": args.steps / wall, "sharding": sharding, "ranks": ranks,
              "history": history}
    if rank == 0:
        _write(args.out, result)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _write(out, result):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = result["history"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(h["step"], h["loss"], lw=0.8)
    a1.set_xlabel("step")
    a1.set_ylabel("train BCE loss")
    a1.set_title("loss")
    a2.plot(h["eval_step"], h["auc"], marker="o")
    a2.axhline(0.5, color="grey", ls="--", lw=0.8)
    a2.set_xlabel("step")
    a2.set_ylabel("held-out AUC")
    a2.set_title(f"AUC (final {result['final_auc']:.3f})")
    fig.suptitle("TorchRec DLRM on tpu, DMP over 2 processes")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "dlrm.png"), dpi=100)
    print(f"final AUC {result['final_auc']:.3f} (from {result['initial_auc']:.3f}); "
          f"{result['steps_per_s']:.2f} steps/s; wrote {out}/metrics.json and {out}/dlrm.png", flush=True)


def _spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train(rank, world, args)


def main(argv=None):
    args = _args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun or another launcher
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(args.world_size, port, args), nprocs=args.world_size, join=True,
                       start_method="spawn")
    with open(os.path.join(args.out, "metrics.json")) as f:
        res = json.load(f)
    if res["final_auc"] <= args.min_auc:
        sys.exit(f"dlrm: AUC stayed at {res['final_auc']:.3f} (--min-auc {args.min_auc})")


if __name__ == "__main__":
    main()
