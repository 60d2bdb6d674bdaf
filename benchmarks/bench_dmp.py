"""A TorchRec DMP training step on 1 or 2 processes: tpu (torchtpu_rec sharders, "tpu" backend) vs TorchRec on
CPU and vs the pure-JAX twin of the same step (bench_rec_jax_twin.py).

Same model (TorchRec's DLRM: 4 embedding tables sharded table-wise, fused row-wise Adagrad in the backward,
a small dense part trained with Adam under DDP), same batches, both in one run:

* ``tpu``: ``DistributedModelParallel(device=tpu)`` with ``TPUEmbeddingBagCollectionSharder``,
  process group ``"tpu"``; tables and dense part on tpu (XLA CPU backend here);
* ``tpu_compiled``: the same, with ``torchtpu_rec.sharding.compile_dense(dmp)``: the dense, interaction and
  over arches run as compiled graphs instead of op by op;
* ``cpu``: ``DistributedModelParallel(device=cpu)`` with TorchRec's own ``EmbeddingBagCollectionSharder``
  (fbgemm's CPU TBE kernels), over a gloo group of the same processes;
* ``tpu_before`` (``--before``): the tpu step with per-parameter eager Adam and the descriptor exchange
  before the KJT lengths/ids all-to-alls (the previous state), for a before/after from the same run.

* ``jax_twin`` (``--twin``): the same model, batches (rank 0's) and optimizers written directly in JAX as
  one ``jax.jit`` (bench_rec_jax_twin.py), in its own process after the others: XLA's own limit for this
  step on the same backend. At ``--world 2`` the twin is one process with rank 0's batch: a per-process
  figure (the DMP step also pays the all-to-alls and DDP's all-reduce, which the twin has none of).

The torch models live in the same ``--world`` processes and are timed in interleaved blocks, so they see
the same machine load. Reports the median block's ms per step, wall and process CPU time (rank 0; a
step includes input dist, lookup, output dist, backward with the fused table update, DDP all-reduce,
the dense optimizer and ``loss.item()``) and tpu/cpu ratios of both.

    python benchmarks/bench_dmp.py --out runs/bench_dmp.json [--world 1|2] [--twin] [--quick] [--before] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, pin_threads, spawn_ranks  # noqa: E402

pin_threads(early_threads())

import torch  # noqa: E402

WORLD = 2  # --world sets it (in each spawned process too: it travels in the config)


def _build(variant, cfg, rank, pg):
    """DLRM under DMP for ``variant`` (tpu, cpu, tpu_before) over ``pg``; returns (dmp, dense optimizer, batches)."""
    device = "cpu" if variant == "cpu" else "tpu"
    import numpy as np
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder

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
    else:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        sharder = EmbeddingBagCollectionSharder(fused_params={**fused, "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    # both sides: DDP of the dense part without static_graph (the same reducer work)
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    wrapper = DefaultDataParallelWrapper(static_graph=cfg.get("static_graph", False))
    # FUSED tables on both sides (construct_module_sharding_plan's default kernel is DENSE)
    per_param = {f"t{i}": table_wise(rank=i % WORLD, compute_kernel="fused") for i in range(T)}
    mp_ = construct_module_sharding_plan(model.sparse_arch.embedding_bag_collection, per_param, local_size=WORLD,
                                         world_size=WORLD, device_type=device, sharder=sharder)
    dev = torch.device(device)
    dmp = DistributedModelParallel(model, device=dev, sharders=[sharder], env=ShardingEnv.from_process_group(pg),
                                   plan=ShardingPlan({"sparse_arch.embedding_bag_collection": mp_}),
                                   data_parallel_wrapper=wrapper)
    dense_params = [p for p in dmp.parameters() if p.requires_grad and not hasattr(p, "_in_backward_optimizers")]
    if variant == "tpu_compiled":
        from torchtpu_rec.sharding import compile_dense

        compile_dense(dmp)  # the dense, interaction and over arches as compiled graphs
    if variant == "tpu_before":
        # the previous state: per-parameter eager Adam, a descriptor exchange before every KJT all-to-all
        opt = torch.optim.Adam(dense_params, lr=1e-3, foreach=False)
        for m in dmp.modules():
            if hasattr(m, "_agreed_kjt_dist"):
                m._agreed_kjt_dist = False
    else:
        # fused Adam on both sides: one kernel (CPU) / one executable (tpu) for the whole dense step
        opt = torch.optim.Adam(dense_params, lr=1e-3, fused=True)
    rng = np.random.default_rng(rank)
    batches = []
    for _ in range(4):
        lengths = rng.integers(0, 2 * cfg["ids"], size=T * B)
        vals = rng.integers(0, rows, size=int(lengths.sum()))
        kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(T)], values=torch.from_numpy(vals),
                                lengths=torch.from_numpy(lengths))
        batches.append((torch.randn(B, 8).to(dev), kjt, torch.randint(0, 2, (B,)).float().to(dev)))
    return dmp, opt, batches


def _worker(rank, port, cfg, out_q):
    global WORLD
    WORLD = cfg["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    import torch.distributed as dist

    import torchtpu  # noqa: F401

    # the default group is "tpu" (the tpu side's collectives); TorchRec's CPU side runs over its own gloo group
    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    devices = DEVICES + (("tpu_before",) if cfg.get("before") else ())
    groups = {"tpu": dist.group.WORLD, "tpu_compiled": dist.group.WORLD, "tpu_before": dist.group.WORLD,
              "cpu": dist.new_group(backend="gloo")}
    models = {d: _build(d, cfg, rank, groups[d]) for d in devices}
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step(device, i):
        dmp, opt, batches = models[device]
        dense, kjt, label = batches[i % len(batches)]
        loss = loss_fn(dmp(dense, kjt).squeeze(-1), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.item())  # a host read: the step is finished

    for d in devices:
        # every batch at least once: a batch with more ids than any before it compiles the tpu lookup
        # for a larger (power-of-two) bucket, which must not land in a timed block
        for i in range(max(cfg["warmup"], len(models[d][2]))):
            step(d, i)
    wall = {d: [] for d in devices}
    cpu = {d: [] for d in devices}
    for r in range(cfg["repeats"]):  # interleaved: tpu block, cpu block, tpu block, ...
        for d in devices:
            dist.barrier(groups[d])
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(cfg["iters"]):
                step(d, i)
            wall[d].append((time.perf_counter() - t0) / cfg["iters"] * 1e3)
            cpu[d].append((time.process_time() - c0) / cfg["iters"] * 1e3)
    res = {d: {"ms_per_step": statistics.median(wall[d]), "cpu_ms_per_step": statistics.median(cpu[d]),
               "ms_all": wall[d], "cpu_ms_all": cpu[d]} for d in devices}
    if cfg.get("profile"):
        # rank 0's tpu step in parts (forward = input dist + lookup + output dist + dense forward), then a
        # cProfile of the same steps
        import cProfile
        import io
        import pstats

        dmp, opt, batches = models["tpu"]
        parts = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "loss.item": 0.0}
        n = cfg["iters"]
        for i in range(n):
            dense, kjt, label = batches[i % len(batches)]
            t0 = time.perf_counter()
            loss = loss_fn(dmp(dense, kjt).squeeze(-1), label)
            t1 = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            float(loss.item())
            t4 = time.perf_counter()
            for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[k] += dt / n * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for i in range(n):
            step("tpu", i)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
        res["profile"] = {"tpu_parts_ms": parts, "cprofile_top": s.getvalue()}
    if rank == 0:
        out_q.put(res)
    dist.barrier()
    dist.destroy_process_group()


DEVICES = ("tpu", "tpu_compiled", "cpu")


def _run(cfg):
    return spawn_ranks(_worker, cfg["world"], cfg)


def _run_twin(cfg, threads):
    """bench_rec_jax_twin.py in its own process (no torchtpu there: x64 stays off)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, "bench_rec_jax_twin.py"), "--config", json.dumps(cfg),
                          "--threads", str(threads)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description="DMP training step: tpu vs TorchRec CPU and the pure-JAX twin")
    p.add_argument("--out", default="runs/bench_dmp.json")
    p.add_argument("--quick", action="store_true", help="small and short (< 60 s on a quiet machine)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", action="store_true",
                   help="also run the previous tpu step (per-parameter Adam, checked KJT all-to-alls), interleaved")
    p.add_argument("--profile", action="store_true", help="also time the parts of rank 0's tpu step and cProfile it")
    p.add_argument("--world", type=int, default=2, choices=(1, 2), help="processes of the DMP steps")
    p.add_argument("--twin", action="store_true", help="also run the pure-JAX twin (bench_rec_jax_twin.py)")
    a = p.parse_args()
    cfg = dict(tables=4, rows=20000, dim=32, batch=512, ids=4, warmup=3, iters=10, repeats=4, world=a.world)
    if a.quick:
        cfg.update(rows=2000, dim=16, batch=128, warmup=2, iters=4, repeats=3)
    if a.profile:
        cfg["profile"] = True
    if a.before:
        cfg["before"] = True
    global WORLD
    WORLD = a.world
    res = _run(cfg)
    if a.twin:
        res["jax_twin"] = _run_twin(cfg, a.threads)
    prof = res.pop("profile", None)
    ratio = res["tpu"]["ms_per_step"] / res["cpu"]["ms_per_step"]
    cpu_ratio = res["tpu"]["cpu_ms_per_step"] / res["cpu"]["cpu_ms_per_step"]
    out = {"config": cfg, "world_size": WORLD, "threads": a.threads, "results": res,
           "tpu_over_cpu_time": ratio, "tpu_over_cpu_process_cpu_time": cpu_ratio,
           "cpu_over_tpu_speed": 1 / ratio, "load_average": os.getloadavg()}
    print(f"DMP step ({WORLD} processes, {cfg['tables']} tables x {cfg['rows']} rows x dim {cfg['dim']}, "
          f"batch {cfg['batch']}/process; {cfg['repeats']} interleaved repeats of {cfg['iters']} steps): "
          f"tpu {res['tpu']['ms_per_step']:.1f} ms ({res['tpu']['cpu_ms_per_step']:.1f} ms CPU), "
          f"torchrec cpu {res['cpu']['ms_per_step']:.1f} ms ({res['cpu']['cpu_ms_per_step']:.1f} ms CPU); "
          f"tpu/cpu wall {ratio:.2f}, process CPU {cpu_ratio:.2f}; load average {os.getloadavg()[0]:.1f}")
    c = res["tpu_compiled"]
    out["tpu_compiled_over_cpu_time"] = c["ms_per_step"] / res["cpu"]["ms_per_step"]
    out["tpu_compiled_over_cpu_process_cpu_time"] = c["cpu_ms_per_step"] / res["cpu"]["cpu_ms_per_step"]
    print(f"dense part compiled (compile_dense): tpu {c['ms_per_step']:.1f} ms ({c['cpu_ms_per_step']:.1f} ms CPU); "
          f"tpu_compiled/cpu wall {out['tpu_compiled_over_cpu_time']:.2f}, "
          f"process CPU {out['tpu_compiled_over_cpu_process_cpu_time']:.2f}")
    if "jax_twin" in res:
        j = res["jax_twin"]
        for d in ("tpu", "tpu_compiled", "cpu"):
            out[f"{d}_over_jax_twin_time"] = res[d]["ms_per_step"] / j["ms_per_step"]
            out[f"{d}_over_jax_twin_process_cpu_time"] = res[d]["cpu_ms_per_step"] / j["cpu_ms_per_step"]
        print(f"pure-JAX twin (one jax.jit, own process{', rank 0 batch only' if WORLD > 1 else ''}): "
              f"{j['ms_per_step']:.1f} ms ({j['cpu_ms_per_step']:.1f} ms CPU), first step {j['first_step_s']:.1f} s; "
              + "; ".join(f"{d}/twin wall {out[f'{d}_over_jax_twin_time']:.2f}, process CPU "
                          f"{out[f'{d}_over_jax_twin_process_cpu_time']:.2f}" for d in ("tpu", "tpu_compiled", "cpu")))
    if "tpu_before" in res:
        b = res["tpu_before"]
        out["tpu_before_over_cpu_time"] = b["ms_per_step"] / res["cpu"]["ms_per_step"]
        out["tpu_before_over_cpu_process_cpu_time"] = b["cpu_ms_per_step"] / res["cpu"]["cpu_ms_per_step"]
        out["tpu_before_over_tpu_time"] = b["ms_per_step"] / res["tpu"]["ms_per_step"]
        print(f"before (per-parameter Adam, checked KJT all-to-alls): tpu {b['ms_per_step']:.1f} ms "
              f"({b['cpu_ms_per_step']:.1f} ms CPU); tpu_before/cpu wall {out['tpu_before_over_cpu_time']:.2f}, "
              f"process CPU {out['tpu_before_over_cpu_process_cpu_time']:.2f}; "
              f"tpu_before/tpu wall {out['tpu_before_over_tpu_time']:.2f}")
    if prof is not None:
        out["profile"] = prof
        print("tpu step parts (rank 0, ms):", {k: round(v, 2) for k, v in prof["tpu_parts_ms"].items()})
        print(prof["cprofile_top"])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
