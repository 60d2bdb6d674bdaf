"""First step cold vs warm: the persistent compilation cache (on by default) across fresh processes.

Each workload runs twice in fresh processes sharing one new cache directory: the first (cold) compiles
everything and fills the cache, the second (warm) loads it. Reported: the first step's seconds in each,
their ratio, and the second process's new XLA compiles (0 when everything came from the cache).

Workloads:
  * ``transformer-<mode>``: the benchmark transformer's training step (TinyTransformer, d_model 128,
    2 layers; AdamW) in Strict Eager, DeferAndFuse and torch.compile(backend="tpu");
  * ``dlrm-<mode>``: the DLRM-style model (8 EmbeddingBag tables) the same way;
  * ``rlhf``: the RLHF demo (``examples/rlhf_grpo.py``, learner and rollout actors on a local Ray
    head; its own ``first_step_s``, which includes the actors' compiles);
  * ``dlrm-example``: TorchRec's DLRM-DCNv2 example (``examples/dlrm.py``, 2 processes; the time to
    its first training step is not reported by the example, so its whole wall time is).

    python benchmarks/bench_cold_start.py --out runs/bench_cold_start.json
    python benchmarks/bench_cold_start.py --quick        # transformer and dlrm in the three modes only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("strict_eager", "defer_and_fuse", "compiled")


def child(model, mode):
    common.pin_threads(1)
    t_import = time.perf_counter()
    import torch

    import torchtpu
    from torchtpu_models import DLRMConfig, DLRMStyleMLP, TinyTransformer, TransformerConfig

    import_s = time.perf_counter() - t_import
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model == "transformer":
        m = TinyTransformer(TransformerConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=64))
        ids = torch.randint(0, 256, (8, 65), generator=g)
        batch = [ids[:, :-1].contiguous(), ids[:, 1:].contiguous()]
    else:
        cfg = DLRMConfig(table_sizes=(1000,) * 8, embedding_dim=16)
        m = DLRMStyleMLP(cfg)
        batch = [torch.randn(128, cfg.num_dense, generator=g),
                 [torch.randint(0, n, (128, 4), generator=g) for n in cfg.table_sizes],
                 torch.randint(0, 2, (128,), generator=g).float()]
    t0 = time.perf_counter()
    m = m.to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    data = [[t.to("tpu") for t in x] if isinstance(x, list) else x.to("tpu") for x in batch]
    loss_fn = torch.compile(m.loss, backend="tpu") if mode == "compiled" else m.loss
    with torchtpu.execution_mode("strict_eager" if mode == "compiled" else mode):
        loss = loss_fn(*data)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    first = time.perf_counter() - t0
    c = torchtpu.metrics.snapshot()["cache"]
    print("RESULT" + json.dumps({"first_step_s": first, "import_s": import_s, "xla_compiles": c["xla_compiles"],
                                 "hits": c["hits"], "compile_s": c["compile_s"], "load_s": c["load_s"]}))


def run_inline(model, mode, cache):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, mode], env=env,
                         capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
    res["wall_s"] = wall
    return res


def run_rlhf(cache, workdir, quick_args):
    out = os.path.join(workdir, f"rlhf_{time.time_ns()}")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "rlhf_grpo.py"), "--out", out, "--steps", "2",
           "--xla-cache", cache, "--no-progress"] + quick_args
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=dict(os.environ, TORCHTPU_CACHE_DIR=cache), capture_output=True, text=True,
                       timeout=3600, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    with open(os.path.join(out, "metrics.json")) as f:
        summary = json.load(f)["summary"]
    return {"first_step_s": summary["first_step_s"], "wall_s": wall}


def run_dlrm_example(cache, workdir):
    out = os.path.join(workdir, f"dlrm_{time.time_ns()}")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "dlrm.py"), "--out", out, "--steps", "1",
           "--eval-every", "1000", "--min-auc", "0"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=dict(os.environ, TORCHTPU_CACHE_DIR=cache), capture_output=True, text=True,
                       timeout=3600, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return {"first_step_s": None, "wall_s": wall}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="only the in-process workloads")
    p.add_argument("--workloads", default=None, help="comma-separated subset")
    p.add_argument("--out", default="runs/bench_cold_start.json")
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    names = [f"{m}-{mode}" for m in ("transformer", "dlrm") for mode in MODES]
    if not args.quick:
        names += ["rlhf", "dlrm-example"]
    if args.workloads:
        names = args.workloads.split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_cold_start_") as work:
        for name in names:
            cache = os.path.join(work, f"cache_{name}")
            runs = []
            for _ in ("cold", "warm"):
                if name == "rlhf":
                    runs.append(run_rlhf(cache, work, []))
                elif name == "dlrm-example":
                    runs.append(run_dlrm_example(cache, work))
                else:
                    model, mode = name.split("-", 1)
                    runs.append(run_inline(model, mode, cache))
            cold, warm = runs
            key = "first_step_s" if cold.get("first_step_s") is not None else "wall_s"
            results[name] = {"cold": cold, "warm": warm, "measure": key, "cold_over_warm": cold[key] / warm[key]}
            extra = f"; warm new XLA compiles {warm['xla_compiles']}" if "xla_compiles" in warm else ""
            print(f"  {name:<28} {key} cold {cold[key]:7.2f} s  warm {warm[key]:7.2f} s  "
                  f"({cold[key] / warm[key]:.1f}x){extra}", flush=True)
    common.write_json(args.out, {"benchmark": "cold_start", "env": common.environment(1), "results": results})


if __name__ == "__main__":
    main()
