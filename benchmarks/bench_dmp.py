"""A TorchRec DMP training step on 2 processes: tpu (torchtpu_rec sharders, "tpu" backend) vs TorchRec on CPU.

Same model (TorchRec's DLRM: 4 embedding tables sharded table-wise, fused row-wise Adagrad in the backward,
a small dense part trained with Adam under DDP), same batches, both in one run:

* ``tpu``: ``DistributedModelParallel(device=tpu)`` with ``TPUEmbeddingBagCollectionSharder``,
  process group ``"tpu"``; tables and dense part on tpu (XLA CPU backend here);
* ``cpu``: ``DistributedModelParallel(device=cpu)`` with TorchRec's own ``EmbeddingBagCollectionSharder``
  (fbgemm's CPU TBE kernels), process group ``"gloo"``.

Reports median ms per step (rank 0's timing; a step includes input dist, lookup, output dist,
backward with the fused table update, DDP all-reduce and the dense optimizer) and tpu/cpu.

    python benchmarks/bench_dmp.py --out runs/bench_dmp.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, pin_threads  # noqa: E402

pin_threads(early_threads())

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def _worker(rank, port, device, cfg, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    import numpy as np
    import torch.distributed as dist

    import torchtpu  # noqa: F401
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM

    from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder, tpu_data_parallel_wrapper

    dist.init_process_group("tpu" if device == "tpu" else "gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    T, rows, dim, B = cfg["tables"], cfg["rows"], cfg["dim"], cfg["batch"]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
              for i in range(T)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                 dense_in_features=8, dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 1],
                 dense_device=torch.device("meta"))
    fused = {"optimizer": "rowwise_adagrad", "learning_rate": 0.05, "eps": 1e-8}
    if device == "tpu":
        sharder = TPUEmbeddingBagCollectionSharder(fused_params=fused)
        wrapper = tpu_data_parallel_wrapper()
    else:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

        sharder = EmbeddingBagCollectionSharder(fused_params={**fused, "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
        wrapper = DefaultDataParallelWrapper(static_graph=False)
    per_param = {f"t{i}": table_wise(rank=i % WORLD) for i in range(T)}
    mp_ = construct_module_sharding_plan(model.sparse_arch.embedding_bag_collection, per_param, local_size=WORLD,
                                         world_size=WORLD, device_type=device, sharder=sharder)
    dev = torch.device(device)
    dmp = DistributedModelParallel(model, device=dev, sharders=[sharder],
                                   plan=ShardingPlan({"sparse_arch.embedding_bag_collection": mp_}),
                                   data_parallel_wrapper=wrapper)
    dense_params = [p for p in dmp.parameters() if p.requires_grad and not hasattr(p, "_in_backward_optimizers")]
    opt = torch.optim.Adam(dense_params, lr=1e-3, foreach=False)
    rng = np.random.default_rng(rank)
    batches = []
    for _ in range(4):
        lengths = rng.integers(0, 2 * cfg["ids"], size=T * B)
        vals = rng.integers(0, rows, size=int(lengths.sum()))
        kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(T)], values=torch.from_numpy(vals),
                                lengths=torch.from_numpy(lengths))
        batches.append((torch.randn(B, 8).to(dev), kjt, torch.randint(0, 2, (B,)).float().to(dev)))
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step(i):
        dense, kjt, label = batches[i % len(batches)]
        loss = loss_fn(dmp(dense, kjt).squeeze(-1), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.item())  # a host read: the step is finished

    for i in range(cfg["warmup"]):
        step(i)
    times = []
    for r in range(cfg["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(cfg["iters"]):
            step(i)
        times.append((time.perf_counter() - t0) / cfg["iters"] * 1e3)
    if rank == 0:
        out_q.put({"ms_per_step": statistics.median(times), "ms_all": times})
    dist.barrier()
    dist.destroy_process_group()


def _run(device, cfg):
    ctx = mp.get_context("spawn")
    q = ctx.Manager().Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, device, cfg, q), nprocs=WORLD, join=True, start_method="spawn")
    return q.get()


def main():
    p = argparse.ArgumentParser(description="DMP training step on 2 processes: tpu vs TorchRec CPU")
    p.add_argument("--out", default="runs/bench_dmp.json")
    p.add_argument("--quick", action="store_true", help="small and short (< 60 s on a quiet machine)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    cfg = dict(tables=4, rows=20000, dim=32, batch=512, ids=4, warmup=3, iters=10, repeats=3)
    if a.quick:
        cfg.update(rows=2000, dim=16, batch=128, warmup=2, iters=4, repeats=2)
    from tqdm import tqdm

    res = {}
    for device in tqdm(["tpu", "cpu"], desc="bench_dmp", unit="config"):
        res[device] = _run(device, cfg)
    ratio = res["tpu"]["ms_per_step"] / res["cpu"]["ms_per_step"]
    out = {"config": cfg, "world_size": WORLD, "threads": a.threads, "results": res,
           "tpu_over_cpu_time": ratio, "cpu_over_tpu_speed": 1 / ratio}
    print(f"DMP step ({WORLD} processes, {cfg['tables']} tables x {cfg['rows']} rows x dim {cfg['dim']}, "
          f"batch {cfg['batch']}/process): tpu {res['tpu']['ms_per_step']:.1f} ms, "
          f"torchrec cpu {res['cpu']['ms_per_step']:.1f} ms, tpu/cpu time {ratio:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
