"""Data-parallel training step time on tpu: DDP's bucketed all-reduce overlapping backward, and FSDP2 vs DDP.

``--world`` processes (``benchmarks/common.py`` ``spawn_ranks``), a ``"tpu"`` process group (XLA
collectives), the test transformer (``torchtpu_models.TinyTransformer``) with SGD, each rank its own
``--batch`` sequences. Five set-ups of the same model take turns repeat by repeat (so load from other
jobs falls on all alike), each timed over ``--iters`` steps closed by ``torchtpu.synchronize()``; a
step's time is the slowest rank's:

* ``ddp``: ``DistributedDataParallel(model)`` with its default buckets (a 1 MB first bucket, then
  25 MB; ``--bucket-mb`` sets them): each bucket's all-reduce is dispatched as soon as its
  gradients are ready, while the rest of backward still runs;
* ``ddp_unchecked``: the same with ``TORCHTPU_DIST_CHECK=0`` (no descriptor exchange: one gloo round
  trip less per bucket);
* ``ddp_one_bucket``: ``bucket_cap_mb`` huge: one all-reduce after the whole backward (nothing overlaps);
* ``no_sync``: DDP inside ``no_sync()``: no communication at all (the floor);
* ``fsdp2``: ``fully_shard`` per block and at the root (all-gathers in forward and backward,
  reduce-scatters of the gradients, the optimizer on shards).

Reported: each step time, ``ddp/ddp_unchecked`` (what the exchanges cost), ``ddp/no_sync`` and
``ddp_one_bucket/no_sync`` (the cost of communication with and without overlap), the share of ``ddp_one_bucket``'s communication time that bucketing hides,
``(one_bucket - ddp) / (one_bucket - no_sync)``, and ``fsdp2/ddp``.

    python benchmarks/bench_parallel.py --out runs/bench_parallel.json
    python benchmarks/bench_parallel.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import early_threads, environment, pin_threads, spawn_ranks, write_json  # noqa: E402

SETUPS = ("ddp", "ddp_unchecked", "ddp_one_bucket", "no_sync", "fsdp2")


@contextlib.contextmanager
def _unchecked():
    """Collectives without the tpu backend's descriptor exchange (a gloo round trip per collective,
    docs/distributed.md), through its public switch; read per call, so it covers the autograd thread."""
    old = os.environ.get("TORCHTPU_DIST_CHECK")
    os.environ["TORCHTPU_DIST_CHECK"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCHTPU_DIST_CHECK"]
        else:
            os.environ["TORCHTPU_DIST_CHECK"] = old


def _model(args):
    import torch

    from torchtpu_models import TinyTransformer

    torch.manual_seed(0)  # the same weights in every set-up and on every rank
    return TinyTransformer(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, max_seq_len=args.seq).to("tpu")


def _setups(args):
    """{name: (the module a step calls, the context each step runs in)}."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_kw = {} if args.bucket_mb is None else {"bucket_cap_mb": args.bucket_mb}
    ddp = DDP(_model(args), **ddp_kw)
    unchecked = DDP(_model(args), **ddp_kw)
    one = DDP(_model(args), bucket_cap_mb=1 << 20)
    local = DDP(_model(args), **ddp_kw)
    sharded = _model(args)
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    return {"ddp": (ddp, contextlib.nullcontext), "ddp_unchecked": (unchecked, _unchecked),
            "ddp_one_bucket": (one, contextlib.nullcontext),
            "no_sync": (local, local.no_sync), "fsdp2": (sharded, contextlib.nullcontext)}


def _worker(rank, port, world, args, queue):
    import torch
    import torch.distributed as dist

    import torchtpu
    from torchtpu.distributed import xla_transport_active

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    assert xla_transport_active(), "JAX's multi-process runtime did not come up"
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to("tpu")
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    setups = _setups(args)
    steps = {}
    for name, (module, context) in setups.items():
        opt = torch.optim.SGD(module.parameters(), lr=0.01)

        def step(module=module, context=context, opt=opt):
            opt.zero_grad(set_to_none=True)
            with context():
                inner = module.module if hasattr(module, "module") else module
                logits = module(inputs)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, inner.config.vocab_size),
                                                         targets.reshape(-1))
                loss.backward()
            opt.step()
        steps[name] = step
    for step in steps.values():  # warm-up: compiles; DDP rebuilds its buckets in step 2, step 3 uses them
        for _ in range(3):
            step()
        torchtpu.synchronize()

    per = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            dist.barrier(group=gloo)  # the ranks start each timing together
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            torchtpu.synchronize()
            per[name].append((time.perf_counter() - t0) / args.iters)
    # a step takes as long as its slowest rank
    table = torch.tensor([per[n] for n in SETUPS], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=gloo)
    if rank == 0:
        per = {n: table[i].tolist() for i, n in enumerate(SETUPS)}
        params = sum(p.numel() for p in setups["ddp"][0].parameters())
        queue.put({"per_repeat_s": per, "parameters": params})
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _ratio(per, a, b):
    return statistics.median([x / y for x, y in zip(per[a], per[b])])


def main():
    threads = early_threads()
    pin_threads(threads)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 repeats (a smoke run)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3, help="steps per timing")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default="runs/bench_parallel.json")
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.d_model, args.layers, args.seq, args.batch = 256, 64, 2, 16, 2
        args.bucket_mb = 0.05 if args.bucket_mb is None else args.bucket_mb  # several buckets of a tiny model
        args.repeats, args.iters = 2, 2

    t0 = time.time()
    res = spawn_ranks(_worker, args.world, args.world, args)
    per = res["per_repeat_s"]
    med = {n: statistics.median(per[n]) for n in SETUPS}
    summary = {
        "ddp_over_no_sync": _ratio(per, "ddp", "no_sync"),
        "one_bucket_over_no_sync": _ratio(per, "ddp_one_bucket", "no_sync"),
        "one_bucket_over_ddp": _ratio(per, "ddp_one_bucket", "ddp"),
        "hidden_share": statistics.median(
            [(o - d) / (o - n) if o > n else float("nan")
             for o, d, n in zip(per["ddp_one_bucket"], per["ddp"], per["no_sync"])]),
        "ddp_over_unchecked": _ratio(per, "ddp", "ddp_unchecked"),
        "unchecked_over_no_sync": _ratio(per, "ddp_unchecked", "no_sync"),
        "fsdp2_over_ddp": _ratio(per, "fsdp2", "ddp"),
    }
    cap = "torch's default (1 MB first, then 25 MB)" if args.bucket_mb is None else f"{args.bucket_mb} MB"
    print(f"\n{args.world} processes, {res['parameters'] / 1e6:.2f}M parameters "
          f"({res['parameters'] * 4 / 2**20:.1f} MB of f32 gradients), DDP buckets: {cap}")
    for n in SETUPS:
        print(f"{n:<16}{med[n] * 1e3:>10.1f} ms/step")
    print(" ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    import torch  # noqa: F401  (environment() reads torch and jax versions)

    write_json(args.out, {"benchmark": "parallel", "world": args.world, "quick": args.quick,
                          "config": {k: getattr(args, k) for k in ("vocab", "d_model", "layers", "heads", "seq",
                                                                   "batch", "bucket_mb", "repeats", "iters")},
                          "wall_s": time.time() - t0, "environment": environment(args.threads),
                          "parameters": res["parameters"],
                          "step_s": med, "per_repeat_s": per, "summary": summary})


if __name__ == "__main__":
    main()
