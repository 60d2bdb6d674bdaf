"""Training step time at 4 processes: FSDP2 alone vs 2-D (dp x tp: tensor parallel inside FSDP2).

The test transformer (``torchtpu_models.TinyTransformer(fused_qkv=False)`` of ``--d-model``/``--layers``,
SGD) on tpu, the same global batch of ``4 * --batch`` sequences either way, in the same 4 processes,
timed alternately (``common.time_interleaved``):

* ``fsdp``: ``fully_shard`` per block and at the root over all 4 ranks, ``--batch`` sequences each;
* ``dp_tp``: ``init_device_mesh("tpu", (2, 2), ("dp", "tp"))``, ``parallelize_module`` with
  ``torchtpu_models.block_tp_plan`` (column/row-wise attention and MLP, sequence-parallel norms) over "tp",
  ``fully_shard`` over "dp", ``2 * --batch`` sequences per dp rank.

Reports milliseconds per step (rank 0) and the dp_tp/fsdp ratio.

    python benchmarks/bench_tp.py --out runs/bench_tp.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import early_threads, environment, pin_threads, spawn_ranks, time_interleaved  # noqa: E402

pin_threads(early_threads())

WORLD = 4


def _worker(rank, port, cfg, out_q):
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import torchtpu
    from torchtpu_models import TinyTransformer, block_tp_plan

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def model():
        torch.manual_seed(0)
        return TinyTransformer(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["layers"],
                               n_heads=cfg["heads"], max_seq_len=cfg["seq"], fused_qkv=False).to("tpu")

    fsdp = model()
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    dp_tp = model()
    plan = block_tp_plan(sequence_parallel=True)
    for block in dp_tp.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(dp_tp, mesh=mesh["dp"])

    B, T = cfg["batch"], cfg["seq"]
    tokens = torch.randint(0, cfg["vocab"], (WORLD * B, T + 1), generator=torch.Generator().manual_seed(0))
    dp = mesh["dp"].get_local_rank()
    local = {"fsdp": tokens[rank * B:(rank + 1) * B].to("tpu"),
             "dp_tp": tokens[dp * 2 * B:(dp + 1) * 2 * B].to("tpu")}

    def stepper(name, m):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        x = local[name]

        def step():
            opt.zero_grad()
            logits = m(x[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
            opt.step()
        return step

    res = time_interleaved({"fsdp": stepper("fsdp", fsdp), "dp_tp": stepper("dp_tp", dp_tp)},
                           iters=cfg["iters"], repeats=cfg["repeats"], warmup=2,
                           syncs={"fsdp": torchtpu.synchronize, "dp_tp": torchtpu.synchronize})
    if rank == 0:
        out_q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description="step time: FSDP2 over 4 ranks vs dp x tp (2 x 2) on tpu")
    p.add_argument("--out", default="runs/bench_tp.json")
    p.add_argument("--quick", action="store_true", help="a small model, few steps")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    cfg = dict(vocab=4096, d_model=512, layers=4, heads=8, seq=128, batch=4, iters=3, repeats=5)
    if a.quick:
        cfg.update(vocab=256, d_model=64, layers=2, heads=4, seq=32, batch=2, iters=1, repeats=2)
    res = spawn_ranks(_worker, WORLD, cfg)
    for name in ("fsdp", "dp_tp"):
        print(f"{name:6s} {res[name]['median_us'] / 1e3:8.1f} ms/step")
    print(f"dp_tp/fsdp {res['ratios']['dp_tp/fsdp']:.2f}; load average {os.getloadavg()[0]:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": cfg, "world_size": WORLD, "results": res, "environment": environment(a.threads)},
                  f, indent=1)


if __name__ == "__main__":
    main()
