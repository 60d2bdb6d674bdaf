"""Shared helpers of the benchmarks: thread pinning, timing, JSON output.

Thread pinning must happen before torch or jax is imported, so every benchmark
calls :func:`pin_threads` first thing, from the ``--threads`` argument
(default 1):

* torch CPU: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and ``torch.set_num_threads``;
* XLA CPU: with one thread, ``--xla_cpu_multi_thread_eigen=false`` in
  ``XLA_FLAGS`` keeps XLA's kernels on the calling thread; with more, XLA's own
  pool (sized to the machine) is left as is.

One thread is the default because it compares the two runtimes doing the same
work on the same core: the numbers then measure dispatch and kernels, not how
well each side parallelises a tiny op, and they stay stable on a machine
shared with other jobs. ``--threads 2`` measures what a user gets from both
cores.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time


def early_threads(argv=None, default=1) -> int:
    """Read ``--threads N`` from argv before argparse runs (imports depend on it)."""
    argv = sys.argv[1:] if argv is None else argv
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return default


def pin_threads(n: int) -> None:
    """Pin torch's and XLA's CPU threads (call before importing torch or jax)."""
    if "torch" in sys.modules or "jax" in sys.modules:
        raise RuntimeError("pin_threads must run before torch and jax are imported")
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    if n == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()


def time_per_iter(fn, *, iters: int, repeats: int, warmup: int, sync=None) -> dict:
    """Microseconds per call of ``fn``: ``repeats`` timings of ``iters`` calls each
    (``sync`` runs once at the end of every repeat, inside the timing, so asynchronous
    work is paid for). Returns the median, min and all repeats."""
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if sync is not None:
            sync()
        per.append((time.perf_counter() - t0) / iters * 1e6)
    return {"median_us": statistics.median(per), "min_us": min(per), "repeats_us": per}


def time_interleaved(fns: dict, *, iters: int, repeats: int, warmup: int, syncs: dict | None = None) -> dict:
    """Like :func:`time_per_iter` for several functions at once, taking turns: repeat r
    times each function in turn, so load from other jobs falls on all of them alike.
    Returns per name the median/min/repeats, and ``ratios[a/b]``: the median over
    repeats of the per-repeat ratio (more stable than a ratio of medians)."""
    syncs = syncs or {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        if syncs.get(name):
            syncs[name]()
    per = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync = syncs.get(name)
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            if sync is not None:
                sync()
            per[name].append((time.perf_counter() - t0) / iters * 1e6)
    out = {name: {"median_us": statistics.median(v), "min_us": min(v), "repeats_us": v} for name, v in per.items()}
    names = list(fns)
    out["ratios"] = {
        f"{a}/{b}": statistics.median([x / y for x, y in zip(per[a], per[b])])
        for a in names for b in names if a != b
    }
    return out


def environment(threads: int) -> dict:
    import jax
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "torch_num_threads": torch.get_num_threads(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # the machine may be shared: the load at the start says how much to trust the figures
        "loadavg_1min": os.getloadavg()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_json(path: str, data: dict) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")


def spawn_ranks(worker, nprocs: int, *args):
    """Run ``worker(rank, port, *args, queue)`` in ``nprocs`` spawned processes (``port``: a free
    rendezvous port on this host) and return the first thing a rank put on ``queue``."""
    import socket

    import torch.multiprocessing as mp  # here, not at the top: pin_threads runs before torch loads

    queue = mp.get_context("spawn").Manager().Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, *args, queue), nprocs=nprocs, join=True, start_method="spawn")
    return queue.get()


def tiny_qwen2(args):
    """The benchmarks' Hugging Face policy: a Qwen2 of ``args.vocab``/``hidden``/``layers``/``heads``/
    ``kv_heads``, seeded, in eval mode (the same weights in every process)."""
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
