"""Compiled training step (torch.compile backend="tpu") vs strict eager tpu and torch CPU eager.

TinyTransformer (default config), AdamW, whole step (forward, backward, optimizer.step)
inside torch.compile. Prints ms/step for each and the ratios, plus first-call time.
Usage: python benchmarks/bench_compile.py [steps]
"""

from __future__ import annotations

import sys
import time

import torch

import torchtpu
import torchtpu.compile  # noqa: F401
from torchtpu.models import TinyTransformer, TransformerConfig


def make(device):
    torch.manual_seed(0)
    cfg = TransformerConfig()
    model = TinyTransformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len + 1), generator=g)
    x, y = seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)

    def step():
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def timed(step, steps, device):
    t0 = time.perf_counter()
    step().item()
    first = time.perf_counter() - t0
    step().item()  # second call: any remaining graphs (e.g. optimizer state init) compiled
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    if device == "tpu":
        torchtpu.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, first


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    cpu_ms, _ = timed(make("cpu"), steps, "cpu")
    eager_ms, eager_first = timed(make("tpu"), steps, "tpu")
    torch._dynamo.reset()
    comp_ms, comp_first = timed(torch.compile(make("tpu"), backend="tpu"), steps, "tpu")
    print(f"torch CPU eager   {cpu_ms:8.2f} ms/step")
    print(f"tpu strict eager  {eager_ms:8.2f} ms/step (first call {eager_first:.1f} s)")
    print(f"tpu compiled      {comp_ms:8.2f} ms/step (first call incl. compile {comp_first:.1f} s)")
    print(f"compiled / strict eager = {comp_ms / eager_ms:.3f}")
    print(f"compiled / torch CPU eager = {comp_ms / cpu_ms:.3f}")


if __name__ == "__main__":
    main()
