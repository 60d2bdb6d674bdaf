"""The cost of the device-side index checks: training steps with ``TORCHTPU_INDEX_CHECKS`` on vs off.

The setting is read at import, so each (model, mode, on/off) runs in its own child process, on and off
alternating over ``--rounds`` rounds. Each child times its tpu step against the same step on torch CPU
eager in alternating blocks; the reported cost is the median over rounds of
(tpu/cpu with checks on) / (tpu/cpu with checks off), so load from other jobs cancels out.

Models: the benchmark transformer (TinyTransformer, its embedding lookup checked) and the DLRM-style
model (``DLRMStyleMLP``: an ``nn.EmbeddingBag`` per table and the interaction's advanced indexing
checked), each in Strict Eager, DeferAndFuse and ``torch.compile(backend="tpu")`` (forward and backward
compiled, the optimizer eager).

    python benchmarks/bench_index_checks.py --out runs/bench_index_checks.json
    python benchmarks/bench_index_checks.py --quick            # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MODES = ("strict_eager", "defer_and_fuse", "compiled")
MODELS = ("transformer", "dlrm")


def child(args):
    common.pin_threads(1)
    import torch

    import torchtpu
    from torchtpu_models import DLRMConfig, DLRMStyleMLP, TinyTransformer, TransformerConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if args.model == "transformer":
        cfg = TransformerConfig(vocab_size=256, d_model=args.d_model, n_layers=2, n_heads=4, max_seq_len=64)
        model = TinyTransformer(cfg)
        ids = torch.randint(0, 256, (8, 65), generator=g)
        batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    else:
        cfg = DLRMConfig(table_sizes=(1000,) * 8, embedding_dim=16)
        model = DLRMStyleMLP(cfg)
        b = 128
        batch = (torch.randn(b, cfg.num_dense, generator=g),
                 [torch.randint(0, n, (b, 4), generator=g) for n in cfg.table_sizes],
                 torch.randint(0, 2, (b,), generator=g).float())

    def runner(device, mode):
        m = __import__("copy").deepcopy(model).to(device)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        data = [[t.to(device) for t in x] if isinstance(x, list) else x.to(device) for x in batch]
        loss_fn = torch.compile(m.loss, backend="tpu") if mode == "compiled" else m.loss

        def step():
            loss = loss_fn(*data)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device == "tpu":
                torchtpu.synchronize()
            return loss

        return step

    cpu = runner("cpu", None)
    mode = "strict_eager" if args.mode == "compiled" else args.mode
    with torchtpu.execution_mode(mode):
        tpu = runner("tpu", args.mode)
        for _ in range(args.warmup):
            tpu()
            cpu()
        cpu_t, tpu_t = [], []
        for _ in range(args.repeats):
            for fn, out in ((cpu, cpu_t), (tpu, tpu_t)):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                out.append((time.perf_counter() - t0) / args.steps * 1e3)
    ratio = statistics.median([t / c for c, t in zip(cpu_t, tpu_t)])
    print("RESULT" + json.dumps({"cpu_ms": statistics.median(cpu_t), "tpu_ms": statistics.median(tpu_t),
                                 "tpu_over_cpu": ratio}))


def run_child(args, model, mode, checks):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--mode", mode,
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--d-model", str(args.d_model)]
    env = dict(os.environ, TORCHTPU_INDEX_CHECKS="1" if checks else "0")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {mode} checks={checks} failed:\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="transformer", choices=MODELS)
    p.add_argument("--mode", default="strict_eager", choices=MODES)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=3, help="on/off child pairs per (model, mode)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per device in a child")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="1 round, 2 blocks of 3 steps, d_model 64")
    p.add_argument("--out", default="runs/bench_index_checks.json")
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.rounds, args.steps, args.repeats, args.warmup, args.d_model = 1, 3, 2, 2, 64
    results = {}
    print(f"device-side index checks on vs off ({args.rounds} rounds; ratios of tpu/cpu, on over off)")
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            rounds = []
            for _ in range(args.rounds):
                on = run_child(args, model, mode, True)
                off = run_child(args, model, mode, False)
                rounds.append({"on": on, "off": off, "cost": on["tpu_over_cpu"] / off["tpu_over_cpu"]})
            cost = statistics.median(r["cost"] for r in rounds)
            on_ms = statistics.median(r["on"]["tpu_ms"] for r in rounds)
            off_ms = statistics.median(r["off"]["tpu_ms"] for r in rounds)
            results[f"{model}/{mode}"] = {"cost_on_over_off": cost, "tpu_ms_on": on_ms, "tpu_ms_off": off_ms,
                                          "rounds": rounds}
            print(f"  {model:<12} {mode:<15} on {on_ms:8.2f} ms  off {off_ms:8.2f} ms  on/off {cost:5.3f}x")
    common.write_json(args.out, {"benchmark": "index_checks", "config": vars(args),
                                 "env": common.environment(1), "results": results})


if __name__ == "__main__":
    main()
