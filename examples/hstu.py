"""HSTU, a generative recommender, trained on tpu against a SASRec baseline on the same data.

The data: a MovieLens-format ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``) written locally with a
planted signal: each user's next movie is mostly the successor of the previous one along a hidden chain of
movies, two steps along it after a long pause (so the time gaps carry signal too), otherwise a random movie.
Each user's last movie is held out (leave-one-out); the models learn next-item prediction on the rest and
are scored by HR@10 and NDCG@10 on the held-out movie, ranked among all movies.

Both models take the item sequences as a TorchRec KeyedJaggedTensor (feature ``"item"``); their item tables
(``EmbeddingCollection``) are sharded by TorchRec's unchanged ``DistributedModelParallel(model,
device=torch.device("tpu"))`` with a fused row-wise Adagrad, the dense part trained by Adam. Each batch is
bucketed on the host (``torchtpu.bucketing``): its jagged total length is padded to a bucket with a filler
sequence, and the attention length is the bucket of the longest real sequence, so the step compiles once
per bucket pair.

    python examples/hstu.py --out runs/hstu            # ~2-3 minutes on 2 CPU cores (XLA's CPU backend)
    python examples/hstu.py --steps 400 --users 4000 --out runs/hstu_long

Writes ``metrics.json`` and ``hstu.png`` (training loss, HR@10 and NDCG@10 of both models) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np


def write_movielens(path: str, users: int, items: int, min_len: int, max_len: int, seed: int,
                    follow: float = 0.8, long_gap_s: int = 3 * 86400) -> None:
    """A MovieLens-1M-format ratings.dat with the planted chain signal (movie ids 1..items)."""
    rng = np.random.default_rng(seed)
    chain = rng.permutation(items) + 1
    successor = np.empty(items + 1, np.int64)
    successor[chain] = np.roll(chain, -1)
    with open(path, "w") as f:
        for user in range(1, users + 1):
            t = 978300000 + int(rng.integers(0, 10**7))
            movie = int(rng.integers(1, items + 1))
            for _ in range(int(rng.integers(min_len, max_len + 1))):
                f.write(f"{user}::{movie}::{int(rng.integers(1, 6))}::{t}\n")
                gap = int(rng.exponential(86400))
                t += gap
                if rng.random() < follow:
                    movie = int(successor[movie])
                    if gap > long_gap_s:
                        movie = int(successor[movie])
                else:
                    movie = int(rng.integers(1, items + 1))


def read_movielens(path: str):
    """Per user, (movie ids, timestamps) in time order."""
    with open(path, encoding="utf-8") as f:
        rows = np.array([line.split("::") for line in f.read().split()], np.int64)
    order = np.lexsort((rows[:, 3], rows[:, 0]))
    rows = rows[order]
    users, starts = np.unique(rows[:, 0], return_index=True)
    bounds = list(starts) + [len(rows)]
    return [(rows[a:b, 1], rows[a:b, 3]) for a, b in zip(bounds[:-1], bounds[1:])]


def make_batch(seqs, total_policy, length_policy, train: bool):
    """A KeyedJaggedTensor batch: inputs (all but the last item when training, all but the held-out one
    when evaluating), next-item targets per row (-100 where none), and the attention length. A filler
    sequence pads the total length to its bucket (its rows have no target)."""
    import torch
    from torchrec import KeyedJaggedTensor

    inputs, stamps, targets, lengths = [], [], [], []
    for items, ts in seqs:
        items, ts = items[:-1], ts[:-1]  # the held-out item is never an input
        # training: every row predicts the next item; evaluation: the last row predicts the held-out one
        x, tgt = (items[:-1], items[1:]) if train else (items, np.full(len(items), -100))
        inputs.append(x)
        stamps.append(ts[: len(x)])
        targets.append(tgt)
        lengths.append(len(x))
    total = sum(lengths)
    filler = total_policy.bucket(total + 1) - total  # >= 1: every sequence non-empty
    inputs.append(np.zeros(filler, np.int64))
    stamps.append(np.zeros(filler, np.int64))
    targets.append(np.full(filler, -100))
    lengths.append(filler)
    n = length_policy.bucket(max(lengths[:-1]))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["item"], values=torch.from_numpy(np.concatenate(inputs)),
                                              lengths=torch.tensor(lengths))
    return kjt, torch.from_numpy(np.concatenate(stamps)), torch.from_numpy(np.concatenate(targets)), n


def evaluate(model, seqs, total_policy, length_policy, tpu, batch_size: int, k: int = 10):
    """HR@k and NDCG@k of the held-out item, ranked among all items, from the last input row."""
    import torch

    hits, ndcg = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(seqs), batch_size):
            chunk = seqs[i:i + batch_size]
            kjt, ts, _, n = make_batch(chunk, total_policy, length_policy, train=False)
            logits = model(kjt.to(tpu), ts.to(tpu), n)
            last = kjt.offsets()[1:len(chunk) + 1] - 1
            scores = logits[last.to(tpu)].cpu()
            scores[:, 0] = -float("inf")  # id 0 is padding, never a movie
            target = torch.tensor([int(items[-1]) for items, _ in chunk])
            rank = (scores > scores.gather(1, target[:, None])).sum(1)
            hits.append((rank < k).float())
            ndcg.append(torch.where(rank < k, 1.0 / torch.log2(rank.float() + 2), torch.zeros(())))
    model.train()
    return float(torch.cat(hits).mean()), float(torch.cat(ndcg).mean())


def train(name, model, seqs, eval_seqs, args, total_policy, length_policy, tpu):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                       "learning_rate": args.table_lr, "eps": 1e-8})
    dmp = DistributedModelParallel(model, device=tpu, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=args.lr))
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    rng = np.random.default_rng(args.seed)
    losses, t0 = [], time.time()
    for step in range(args.steps):
        chunk = [seqs[j] for j in rng.choice(len(seqs), args.batch_size, replace=False)]
        kjt, ts, targets, n = make_batch(chunk, total_policy, length_policy, train=True)
        logits = dmp(kjt.to(tpu), ts.to(tpu), n)
        loss = torch.nn.functional.cross_entropy(logits, targets.to(tpu), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"{name} step {step:4d} loss {losses[-1]:.3f} ({time.time() - t0:.0f}s)", flush=True)
    wall = time.time() - t0
    hr, ndcg = evaluate(dmp, eval_seqs, total_policy, length_policy, tpu, args.eval_batch_size)
    print(f"{name}: HR@10 {hr:.3f} NDCG@10 {ndcg:.3f} ({args.steps / wall:.1f} steps/s)", flush=True)
    return {"loss": losses, "hr@10": hr, "ndcg@10": ndcg, "train_s": wall, "steps_per_s": args.steps / wall}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in results.items():
        a.plot(r["loss"], label=name)
    a.set_xlabel("step")
    a.set_ylabel("next-item cross-entropy")
    a.legend()
    names = list(results)
    x = np.arange(len(names))
    b.bar(x - 0.2, [results[m]["hr@10"] for m in names], 0.4, label="HR@10")
    b.bar(x + 0.2, [results[m]["ndcg@10"] for m in names], 0.4, label="NDCG@10")
    b.set_xticks(x, names)
    b.legend()
    b.set_title("held-out next movie (leave-one-out)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/hstu")
    p.add_argument("--users", type=int, default=800)
    p.add_argument("--items", type=int, default=300)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=40)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch-size", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--table-lr", type=float, default=0.05)
    p.add_argument("--models", default="hstu,sasrec")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("users", "items", "steps", "batch_size", "eval_batch_size", "dim", "heads", "blocks"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 3 <= args.min_len <= args.max_len:
        p.error("need 3 <= --min-len <= --max-len (one item held out, one target at least)")
    if args.batch_size > args.users:
        p.error("--batch-size is larger than --users")
    models = args.models.split(",")
    if not models or any(m not in ("hstu", "sasrec") for m in models):
        p.error("--models is a comma-separated subset of hstu,sasrec")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))

    import torch
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (the tpu device and the "tpu" process-group backend)
    import torchtpu_rec  # noqa: F401  (DMP on tpu; fbgemm's jagged ops on tpu)
    from torchtpu.bucketing import BucketPolicy
    from torchtpu_rec.hstu import HSTU, SASRec, item_collection

    ratings = os.path.join(args.out, "ratings.dat")
    write_movielens(ratings, args.users, args.items, args.min_len + 1, args.max_len + 1, args.seed)
    seqs = read_movielens(ratings)
    if not dist.is_initialized():
        dist.init_process_group("tpu", rank=0, world_size=1)
    tpu = torch.device("tpu")
    total_policy = BucketPolicy.pow2(64, 1 << 20, name="hstu_batch_rows")
    length_policy = BucketPolicy.pow2(8, 1 << 12, name="hstu_sequence_length")
    max_len = length_policy.bucket(args.max_len)
    results = {}
    for name in models:
        torch.manual_seed(args.seed)
        cls = HSTU if name == "hstu" else SASRec
        model = cls(args.items + 1, dim=args.dim, heads=args.heads, blocks=args.blocks, max_len=max_len,
                    embeddings=item_collection(args.items + 1, args.dim, device=torch.device("meta")),
                    length_policy=length_policy)
        results[name] = train(name, model, seqs, seqs, args, total_policy, length_policy, tpu)
    dist.destroy_process_group()
    summary = {m: {k: v for k, v in r.items() if k != "loss"} for m, r in results.items()}
    summary["chance_hr@10"] = 10 / args.items
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "summary": summary}, f, indent=1)
    plot(results, os.path.join(args.out, "hstu.png"))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
