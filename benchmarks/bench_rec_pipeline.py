"""TorchRec's train pipelines on tpu: does batch i+1's input distribution overlap batch i's compute?

2 processes, TorchRec's DLRM in ``DLRMTrain`` sharded by ``DistributedModelParallel(device=tpu)`` (the
unchanged call: planner, sharders and DDP wrapper chosen by torchtpu_rec; fused Adagrad tables, SGD on the
dense part), the same batches cycled, timed in interleaved blocks (same machine load for all):

* ``base``: ``TrainPipelineBase`` (copy batch i+1 to the device, then forward/backward/step of batch i:
  the input distribution runs inside the forward, nothing overlaps it);
* ``sparse_dist``: ``TrainPipelineSparseDist`` (batch i+1's KJT all-to-alls are issued around batch i's
  forward; its compute is dispatched to XLA asynchronously, so the host-side input dist can run while the
  device computes);
* ``input_dist``: the input distribution of one batch alone (the sharded EBC's ``input_dist`` and both
  awaits; what the pipeline can hide at most).

The overlap is ``(base - sparse_dist) / input_dist``: the share of the input distribution the pipeline hid
(1: all of it; <= 0: none). TorchRec on CPU (fbgemm, gloo) runs the same pipelines alongside with
``--cpu``; ``--compiled`` runs the tpu DMPs with ``compile_dense`` (the dense part as compiled graphs).

    python benchmarks/bench_rec_pipeline.py --out runs/bench_rec_pipeline.json [--quick] [--cpu] [--compiled]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, pin_threads, spawn_ranks  # noqa: E402

pin_threads(early_threads())

import torch  # noqa: E402

WORLD = 2


def _batches(cfg, rank):
    import numpy as np
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    rng = np.random.default_rng(rank)
    out = []
    T, B = cfg["tables"], cfg["batch"]
    for _ in range(4):
        lengths = rng.integers(0, 2 * cfg["ids"], size=T * B)
        vals = rng.integers(0, cfg["rows"], size=int(lengths.sum()))
        kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(T)], values=torch.from_numpy(vals),
                                lengths=torch.from_numpy(lengths))
        out.append(Batch(dense_features=torch.randn(B, 8), sparse_features=kjt,
                         labels=torch.randint(0, 2, (B,)).float()))
    return out


def _dmp(device, cfg, pg):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg["dim"], num_embeddings=cfg["rows"],
                                 feature_names=[f"f{i}"]) for i in range(cfg["tables"])]
    meta = torch.device("meta")
    model = DLRMTrain(DLRM(EmbeddingBagCollection(tables=tables, device=meta), dense_in_features=8,
                           dense_arch_layer_sizes=[64, cfg["dim"]], over_arch_layer_sizes=[64, 1], dense_device=meta))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                                          "learning_rate": 0.05, "eps": 1e-8})
    # both sides the same DDP (without static_graph: the same reducer work)
    dmp = DistributedModelParallel(model, device=torch.device(device), env=ShardingEnv.from_process_group(pg),
                                   sharders=[sharder], data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False))
    if device == "tpu" and cfg.get("compiled"):
        from torchtpu_rec.sharding import compile_dense

        compile_dense(dmp)  # the dense part as compiled graphs: the host is free while they run
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.05))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _worker(rank, port, cfg, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    import torchtpu
    import torchtpu_rec  # noqa: F401  (DistributedModelParallel on tpu)

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    devices = ["tpu"] + (["cpu"] if cfg.get("cpu") else [])
    groups = {"tpu": dist.group.WORLD, "cpu": dist.new_group(backend="gloo") if cfg.get("cpu") else None}
    batches = _batches(cfg, rank)
    runs, data = {}, {}
    for d in devices:
        for kind, cls in (("base", TrainPipelineBase), ("sparse_dist", TrainPipelineSparseDist)):
            dmp, opt = _dmp(d, cfg, groups[d])
            runs[(d, kind)] = cls(dmp, opt, torch.device(d))
            data[(d, kind)] = itertools.cycle(batches)
        runs[(d, "input_dist")] = _dmp(d, cfg, groups[d])[0]

    def sync(d):
        if d == "tpu":
            torchtpu.synchronize()

    def input_dist(d, i):
        ebc = runs[(d, "input_dist")].module.model.sparse_arch.embedding_bag_collection
        kjt = batches[i % len(batches)].sparse_features
        ctx = ebc.create_context()
        ebc.input_dist(ctx, kjt).wait().wait()

    def step(key, i):
        if key[1] == "input_dist":
            input_dist(key[0], i)
        else:
            loss = runs[key].progress(data[key])[0]
            if i == cfg["iters"] - 1:
                float(loss.sum())  # the block's last step has finished

    keys = list(runs)
    for k in keys:
        for i in range(max(cfg["warmup"], len(batches) + 2)):  # every batch's buckets compiled
            step(k, i)
        sync(k[0])
    wall = {k: [] for k in keys}
    for _ in range(cfg["repeats"]):
        for k in keys:
            dist.barrier(groups[k[0]])
            t0 = time.perf_counter()
            for i in range(cfg["iters"]):
                step(k, i)
            sync(k[0])
            wall[k].append((time.perf_counter() - t0) / cfg["iters"] * 1e3)
    res = {f"{d}_{kind}": {"ms_per_step": statistics.median(v), "ms_all": v} for (d, kind), v in wall.items()}
    if rank == 0:
        out_q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _run(cfg):
    return spawn_ranks(_worker, WORLD, cfg)


def main():
    p = argparse.ArgumentParser(description="TorchRec train pipelines on tpu: input-dist overlap")
    p.add_argument("--out", default="runs/bench_rec_pipeline.json")
    p.add_argument("--quick", action="store_true", help="small and short")
    p.add_argument("--cpu", action="store_true", help="also TorchRec on CPU (fbgemm, gloo), interleaved")
    p.add_argument("--compiled", action="store_true", help="tpu DMPs with compile_dense (dense part compiled)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    cfg = dict(tables=8, rows=20000, dim=32, batch=512, ids=4, warmup=3, iters=8, repeats=5, cpu=a.cpu,
               compiled=a.compiled)
    if a.quick:
        cfg.update(tables=4, rows=2000, dim=16, batch=128, iters=4, repeats=3)
    res = _run(cfg)
    out = {"config": cfg, "world_size": WORLD, "results": res, "load_average": os.getloadavg()}
    for d in ("tpu", "cpu") if a.cpu else ("tpu",):
        base, sdd, idist = (res[f"{d}_{k}"]["ms_per_step"] for k in ("base", "sparse_dist", "input_dist"))
        out[f"{d}_overlap"] = (base - sdd) / idist
        out[f"{d}_sparse_dist_over_base"] = sdd / base
        print(f"{d}: TrainPipelineBase {base:.1f} ms/step, TrainPipelineSparseDist {sdd:.1f} ms/step, "
              f"input dist alone {idist:.1f} ms; hidden share of the input dist {out[f'{d}_overlap']:.2f} "
              f"(sparse_dist/base {sdd / base:.2f})")
    print(f"load average {os.getloadavg()[0]:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
