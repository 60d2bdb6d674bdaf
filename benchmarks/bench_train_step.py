"""TinyTransformer training step: tpu (an execution mode) vs torch CPU eager,
measured side by side in one run.

A step is forward + cross-entropy loss, zero_grad, backward and an AdamW step
(``--foreach``: torch's default per device, or forced on/off),
on d_model 128, 2 layers, 4 heads, seq 64, batch 8, vocab 256 by default. The
tpu step ends with ``torchtpu.synchronize()`` (timed), so all of its device
work is paid for. Both devices start from the same weights and data.

The machine may be shared, so the two devices are timed in alternating blocks
(``--repeats`` blocks of ``--steps`` steps each) and the median block is
reported; the first (compiling) tpu step is reported on its own.

    python benchmarks/bench_train_step.py --out runs/bench_train_step.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

THREADS = common.early_threads()
common.pin_threads(THREADS)

import torch  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu_models import TinyTransformer, TransformerConfig  # noqa: E402

torch.set_num_threads(THREADS)


class Runner:
    def __init__(self, model, batch, device, sync, foreach):
        self.model = copy.deepcopy(model).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=foreach)
        self.x, self.y = (t.to(device) for t in batch)
        self.sync = sync
        self.losses = []

    def step(self):
        loss = self.model.loss(self.x, self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.sync is not None:
            self.sync()
        return loss

    def block(self, steps):
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
        dt = (time.perf_counter() - t0) / steps
        self.losses.append(loss.item())  # outside the timing
        return dt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per device (alternating)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per device (tpu: compiles)")
    p.add_argument("--mode", default="strict_eager", help="tpu execution mode")
    p.add_argument("--foreach", default="default", choices=["default", "on", "off"],
                   help="AdamW's foreach flag (default: torch's choice per device: on for tpu, off for cpu)")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads for torch and XLA (default 1)")
    p.add_argument("--out", default="runs/bench_train_step.json")
    args = p.parse_args()

    cfg = TransformerConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.heads, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

    foreach = {"default": None, "on": True, "off": False}[args.foreach]
    cpu = Runner(model, batch, "cpu", None, foreach)
    torchtpu.metrics.reset()
    with torchtpu.execution_mode(args.mode):
        tpu = Runner(model, batch, "tpu", torchtpu.synchronize, foreach)
        t0 = time.perf_counter()
        first_loss = tpu.step().item()
        first_step_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            tpu.step()
        first_cpu_loss = cpu.step().item()
        for _ in range(args.warmup - 1):
            cpu.step()
        cpu_t, tpu_t = [], []
        compiles_before = torchtpu.metrics.snapshot()["compiles"]
        for _ in range(args.repeats):
            cpu_t.append(cpu.block(args.steps))
            tpu_t.append(tpu.block(args.steps))
    snap = torchtpu.metrics.snapshot()
    timed_compiles = snap["compiles"] - compiles_before  # should be 0: a steady loop reuses its executables

    c, t = statistics.median(cpu_t) * 1e3, statistics.median(tpu_t) * 1e3
    ratio = statistics.median([y / x for x, y in zip(cpu_t, tpu_t)])  # per block pair: load hits both
    print(f"TinyTransformer step (d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, {model.num_parameters()} params), AdamW, threads={THREADS}")
    print(f"  torch cpu eager      {c:9.2f} ms/step")
    print(f"  tpu {args.mode:<16} {t:9.2f} ms/step   (first step incl. compiles: {first_step_s:.2f} s)")
    print(f"  ratio tpu/cpu        {ratio:9.2f}x   (median over adjacent block pairs)")
    print(f"  first-step loss cpu {first_cpu_loss:.5f} tpu {first_loss:.5f}; "
          f"last cpu {cpu.losses[-1]:.5f} tpu {tpu.losses[-1]:.5f}")
    print(f"  compiles {snap['compiles']} ({timed_compiles} during the timed steps), "
          f"cpu_fallbacks {snap['cpu_fallbacks'] or 'none'}")

    common.write_json(args.out, {
        "benchmark": "train_step",
        "config": vars(args),
        "params": model.num_parameters(),
        "env": common.environment(THREADS),
        "cpu_ms_per_step": c,
        "tpu_ms_per_step": t,
        "ratio_tpu_over_cpu": ratio,
        "cpu_blocks_ms": [x * 1e3 for x in cpu_t],
        "tpu_blocks_ms": [x * 1e3 for x in tpu_t],
        "tpu_first_step_s": first_step_s,
        "first_loss": {"cpu": first_cpu_loss, "tpu": first_loss},
        "last_loss": {"cpu": cpu.losses[-1], "tpu": tpu.losses[-1]},
        "compiles": snap["compiles"],
        "compiles_during_timed_steps": timed_compiles,
        "cpu_fallbacks": snap["cpu_fallbacks"],
    })


if __name__ == "__main__":
    main()
