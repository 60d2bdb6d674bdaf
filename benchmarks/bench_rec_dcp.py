"""Checkpoints of a sharded DMP on tpu: torch.distributed.checkpoint (DCP) vs gathering whole tables.

2 processes, an ``EmbeddingBagCollection`` of ``--tables`` tables sharded table-wise by
``DistributedModelParallel(device=tpu)`` with fused Adagrad (its accumulators are as big as the tables),
after one training step. Timed, alternating, ``--repeats`` times:

* ``dcp``: ``dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()})`` (each rank
  writes its own shards: tables and optimizer state as ShardedTensors) and ``dcp.load`` of it into the same
  tables sharded row-wise (each rank reads the pieces its new shards cover);
* ``gather``: the previous way (``torchtpu_rec.checkpoint``): every rank gathers every whole table and its
  optimizer state onto the host (``unsharded_state_dict`` + ``unsharded_fused_optimizer_state``), rank 0
  ``torch.save`` s them; every rank ``torch.load`` s the file and copies its slices into the row-wise model.

Reports seconds, GB/s (bytes of tables + optimizer state / seconds) and the most bytes of tables one host
process held at once (DCP: its own shards; gather: all of them).

    python benchmarks/bench_rec_dcp.py --out runs/bench_rec_dcp.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, pin_threads, spawn_ranks  # noqa: E402

pin_threads(early_threads())

import torch  # noqa: E402

WORLD = 2


def _worker(rank, port, cfg, workdir, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import sharding_plan
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    import torchtpu
    from torchtpu_rec.checkpoint import (
        load_unsharded_fused_optimizer_state,
        load_unsharded_state_dict,
        unsharded_fused_optimizer_state,
        unsharded_state_dict,
    )
    from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    T, R, D = cfg["tables"], cfg["rows"], cfg["dim"]
    sharder = TPUEmbeddingBagCollectionSharder(fused_params={"optimizer": "adagrad", "learning_rate": 0.05})

    def model(per_table):
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=R, feature_names=[f"f{i}"])
                  for i in range(T)]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        plan = sharding_plan.construct_module_sharding_plan(ebc, {f"t{i}": per_table(i) for i in range(T)},
                                                            local_size=WORLD, world_size=WORLD, device_type="tpu",
                                                            sharder=sharder)
        return DistributedModelParallel(ebc, device=torch.device("tpu"), sharders=[sharder],
                                        plan=ShardingPlan({"": plan}))

    src = model(lambda i: sharding_plan.table_wise(rank=i % WORLD, compute_kernel="fused"))
    dst = model(lambda i: sharding_plan.row_wise(compute_kernel="fused"))
    lengths = torch.full((T * 64,), 2)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(T)], values=torch.randint(0, R, (int(lengths.sum()),)),
                            lengths=lengths)
    src(kjt).wait().values().sum().backward()  # Adagrad state becomes non-zero
    torchtpu.synchronize()
    total = 2 * T * R * D * 4  # tables + Adagrad accumulators
    mine = sum(s.tensor.numel() * s.tensor.element_size() for v in src.state_dict().values()
               if isinstance(v, ShardedTensor) for s in v.local_shards())

    def dcp_round(path):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()}, checkpoint_id=path)
        dist.barrier()
        t1 = time.perf_counter()
        state = {"model": dst.state_dict(), "optim": dst.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        dst.fused_optimizer.load_state_dict(state["optim"])
        torchtpu.synchronize()
        dist.barrier()
        return t1 - t0, time.perf_counter() - t1

    def gather_round(path):
        dist.barrier()
        t0 = time.perf_counter()
        sd, opt = unsharded_state_dict(src), unsharded_fused_optimizer_state(src)
        if rank == 0:
            torch.save({"model": sd, "optim": opt}, path)
        del sd, opt
        dist.barrier()
        t1 = time.perf_counter()
        ck = torch.load(path)
        load_unsharded_state_dict(dst, ck["model"])
        load_unsharded_fused_optimizer_state(dst, ck["optim"])
        torchtpu.synchronize()
        dist.barrier()
        return t1 - t0, time.perf_counter() - t1

    res = {"dcp": {"save_s": [], "load_s": []}, "gather": {"save_s": [], "load_s": []}}
    for r in range(cfg["repeats"] + 1):  # the first round warms up (compiles, file cache)
        for name, fn in (("dcp", dcp_round), ("gather", gather_round)):
            path = os.path.join(workdir, f"{name}_{r}" + (".pt" if name == "gather" else ""))
            save_s, load_s = fn(path)
            if r:
                res[name]["save_s"].append(save_s)
                res[name]["load_s"].append(load_s)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True) if name == "dcp" else os.remove(path)
    # the same tables came back either way
    for k, v in unsharded_state_dict(src).items():
        if not torch.equal(v, unsharded_state_dict(dst)[k]):
            raise SystemExit(f"{k} differs after the reload")
    out = {}
    for name, r in res.items():
        s, lo = statistics.median(r["save_s"]), statistics.median(r["load_s"])
        out[name] = {"save_s": s, "load_s": lo, "save_GB_per_s": total / s / 1e9, "load_GB_per_s": total / lo / 1e9,
                     "all": r}
    out["dcp"]["host_bytes_per_rank"] = mine * 2  # its own table shards and their accumulators
    out["gather"]["host_bytes_per_rank"] = total  # every whole table and accumulator
    out["bytes"] = total
    if rank == 0:
        out_q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description="DCP save/load of a sharded DMP on tpu vs gathering whole tables")
    p.add_argument("--out", default="runs/bench_rec_dcp.json")
    p.add_argument("--quick", action="store_true", help="small tables")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    a = p.parse_args()
    cfg = dict(tables=8, rows=250_000, dim=64, repeats=3)
    if a.quick:
        cfg.update(tables=4, rows=50_000, dim=32, repeats=2)
    workdir = tempfile.mkdtemp(prefix="bench_rec_dcp_", dir=a.dir)
    try:
        res = spawn_ranks(_worker, WORLD, cfg, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = {"config": cfg, "world_size": WORLD, "results": res, "load_average": os.getloadavg()}
    gb = res["bytes"] / 1e9
    for name in ("dcp", "gather"):
        r = res[name]
        print(f"{name:7s} save {r['save_s']:.2f} s ({r['save_GB_per_s']:.2f} GB/s), load {r['load_s']:.2f} s "
              f"({r['load_GB_per_s']:.2f} GB/s); tables+state on one host: {r['host_bytes_per_rank'] / 1e6:.0f} MB")
    print(f"{gb:.2f} GB of tables and Adagrad state over {WORLD} processes; load average {os.getloadavg()[0]:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
