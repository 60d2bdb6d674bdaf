"""torch.distributed.checkpoint of an FSDP2-sharded model and optimizer: tpu state vs the same state on CPU.

2 processes, one ``"tpu"`` process group (it runs CPU tensors on gloo). The test transformer
(``torchtpu_models.TinyTransformer`` of ``--d-model``/``--layers``) is ``fully_shard`` ed per block and at
the root, once on ``tpu`` and once on ``cpu`` (the same weights), and takes one Adam step, so the optimizer
holds two state tensors per parameter. Timed, alternating, ``--repeats`` times:

* save: ``get_state_dict`` + ``dcp.save`` (each rank writes its own shards of weights and optimizer state);
* load: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` into the same sharded model and optimizer,
  waited for (``torchtpu.synchronize`` on tpu).

Reports seconds and GB/s (bytes of weights + optimizer state / seconds) per device, and the tpu/cpu ratios
of the per-repeat times (median). The reloaded tpu weights are checked against the saved ones.

    python benchmarks/bench_dcp.py --out runs/bench_dcp.json [--quick]
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
from common import early_threads, environment, pin_threads, spawn_ranks  # noqa: E402

pin_threads(early_threads())

WORLD = 2


def _worker(rank, port, cfg, workdir, out_q):
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchtpu
    from torchtpu_models import TinyTransformer

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))

    def sharded(device):
        torch.manual_seed(0)
        model = TinyTransformer(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["layers"],
                                n_heads=cfg["heads"], max_seq_len=16).to(device)
        mesh = init_device_mesh(device, (WORLD,))  # on "cpu" the tpu group hands the tensors to gloo
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, cfg["vocab"], (2, 16), generator=torch.Generator().manual_seed(rank))
        model(tokens.to(device)).float().pow(2).mean().backward()
        opt.step()  # Adam's exp_avg and exp_avg_sq exist now
        return model, opt

    states = {"tpu": sharded("tpu"), "cpu": sharded("cpu")}
    torchtpu.synchronize()
    model = states["tpu"][0]
    # weights + optimizer state (the step counters are scalars: not counted)
    total = sum(p.numel() * p.element_size() for p in model.parameters()) * 3

    def save(device, path):
        m, o = states[device]
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(m, o)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        dist.barrier()
        return time.perf_counter() - t0

    def load(device, path):
        m, o = states[device]
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(m, o)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if device == "tpu":
            torchtpu.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    saved = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    times = {d: {"save_s": [], "load_s": []} for d in states}
    for r in range(cfg["repeats"] + 1):  # the first round warms up (compiles, file cache)
        for device in states:
            path = os.path.join(workdir, f"{device}_{r}")
            s, lo = save(device, path), load(device, path)
            if r:
                times[device]["save_s"].append(s)
                times[device]["load_s"].append(lo)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    for k, v in model.state_dict().items():  # the tpu state came back as it was saved
        if not torch.equal(v.full_tensor().cpu(), saved[k]):
            raise SystemExit(f"{k} differs after the reload")
    out = {"bytes": total, "ratios": {}}
    for device, t in times.items():
        s, lo = statistics.median(t["save_s"]), statistics.median(t["load_s"])
        out[device] = {"save_s": s, "load_s": lo, "save_GB_per_s": total / s / 1e9,
                       "load_GB_per_s": total / lo / 1e9, "all": t}
    for what in ("save_s", "load_s"):
        out["ratios"][f"{what[:-2]} tpu/cpu"] = statistics.median(
            a / b for a, b in zip(times["tpu"][what], times["cpu"][what]))
    if rank == 0:
        out_q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description="DCP save/load GB/s of FSDP2-sharded state: tpu vs cpu tensors")
    p.add_argument("--out", default="runs/bench_dcp.json")
    p.add_argument("--quick", action="store_true", help="a small model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    a = p.parse_args()
    cfg = dict(vocab=8192, d_model=512, layers=8, heads=8, repeats=3)
    if a.quick:
        cfg.update(vocab=512, d_model=64, layers=2, heads=4, repeats=2)
    workdir = tempfile.mkdtemp(prefix="bench_dcp_", dir=a.dir)
    try:
        res = spawn_ranks(_worker, WORLD, cfg, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for device in ("tpu", "cpu"):
        r = res[device]
        print(f"{device}: save {r['save_s']:.3f} s ({r['save_GB_per_s']:.2f} GB/s), "
              f"load {r['load_s']:.3f} s ({r['load_GB_per_s']:.2f} GB/s)")
    print("ratios (time):", {k: round(v, 2) for k, v in res["ratios"].items()})
    print(f"{res['bytes'] / 1e9:.3f} GB of weights and Adam state over {WORLD} processes; "
          f"load average {os.getloadavg()[0]:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": cfg, "world_size": WORLD, "results": res,
                   "environment": environment(a.threads)}, f, indent=1)


if __name__ == "__main__":
    main()
