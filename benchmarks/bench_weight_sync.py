"""Weight sync learner -> rollout worker, and async vs sync RL steps, side by side in one run.

Part 1, weight sync: a sender actor holds a state dict of float32 tpu tensors of a
given total size (a transformer-like mix: a few big matrices and many small
vectors); a receiver actor (another process) gets it as tpu tensors. One sync is
the time from the driver's first control call until the receiver holds every
tensor and has copied them into its model's tensors (what ``RolloutEngine.load_state_dict``
does), for each transport:

- ``object_store``: learner ``publish`` (one object per bucket in Ray's shared
  memory) + one ``update`` call on the receiver;
- ``collective/tpu``: a torch.distributed broadcast of host byte buckets in a
  torchtpu ``tpu`` process group (the default collective form);
- ``collective/tpu-device``: the same group with tpu byte buckets (packed and
  unpacked on the device, staged through the host by the backend);
- ``collective/gloo``: a plain gloo group, host byte buckets.

GB/s = state-dict bytes / sync seconds, compared with this host's memcpy
bandwidth measured in the same run (``numpy.copyto`` of the same number of bytes
into a preallocated buffer, best of 5). The goal is >= 50% of memcpy. Each row
also gives the four phases (median seconds): ``pack`` and ``publish`` on the
sender, ``fetch`` and ``install`` on the receiver (the install is
``weight_sync.install_state_dict`` into the receiver's model: a buffer swap per
tensor), and ``bf16`` rows (``--sync-dtypes float32,bfloat16``) send float32
weights as bfloat16 and report the cast's relative error.

The object store is sized to 2.5x the largest state dict; at 2 GB that is 5 GB of
shared memory beside the sender's and receiver's 2 GB each, which may not fit a
24 GB host running other jobs: ``--sizes`` picks what to measure.

Part 2, async vs sync: the GRPO digit-completion run of examples/rlhf_grpo.py
(learner actor + 1 rollout worker) timed per step in ``mode="sync"`` and
``mode="async"`` (max_staleness 1: the next batch is generated while the learner
trains), in alternating blocks, each after ``--warmup`` untimed steps.

    python benchmarks/bench_weight_sync.py --out runs/bench_weight_sync.json
    python benchmarks/bench_weight_sync.py --quick      # up to 50 MB, fewer steps (< 60 s once compiled)
    python benchmarks/bench_weight_sync.py --sizes 100,500,2000 --sync-dtypes float32,bfloat16 --skip-async
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

THREADS = common.early_threads()
common.pin_threads(THREADS)

import numpy as np  # noqa: E402

MB = 1024 * 1024


def layer_shapes(total_bytes: int) -> list:
    """float32 tensor shapes of a transformer-ish state dict of ~total_bytes: per block a
    (d, 4d) and a (4d, d) matrix, (d, d) x 4, and small vectors."""
    d = 512
    block = [(d, 4 * d), (4 * d, d), (d, d), (d, d), (d, d), (d, d), (d,), (d,), (4 * d,), (d,)]
    per = sum(int(np.prod(s)) for s in block) * 4
    n = max(1, round(total_bytes / per))
    return block * n


class Sender:
    def __init__(self, shapes, bucket_bytes, sync_dtype=None):
        import torch

        import torchtpu  # noqa: F401
        from torchtpu_rl import weight_sync as ws

        g = torch.Generator().manual_seed(0)
        self.sd = {f"t{i}": torch.randn(s, generator=g).to("tpu") for i, s in enumerate(shapes)}
        self.sender = ws.WeightSender(bucket_bytes, sync_dtype=getattr(torch, sync_dtype) if sync_dtype else None)
        self.version = 0

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.sd.values())

    def publish(self):
        self.version += 1
        return self.sender.publish(self.sd, self.version)

    def timings(self):
        return self.sender.last_timings

    def setup(self, init, world, backend):
        from torchtpu_rl import weight_sync as ws

        self.sender.group = ws.CollectiveGroup(backend, init, world, 0)

    def teardown(self):
        self.sender.group.destroy()
        self.sender.group = None

    def broadcast(self):
        self.version += 1
        return self.sender.broadcast(self.sd, self.version)

    def checksums(self):
        from torchtpu_rl import weight_sync as ws

        return ws.tensor_checksums(self.sd)

    def port(self):
        from torchtpu_rl import weight_sync as ws

        return f"tcp://127.0.0.1:{ws.free_port()}"


class Receiver:
    """Receives into tpu tensors, then installs them into its own model (tpu parameters of the
    same shapes) with ``weight_sync.install_state_dict``, as ``RolloutEngine.load_state_dict``
    does: the install is part of the measured sync."""

    def __init__(self, shapes):
        import torch

        import torchtpu  # noqa: F401
        from torchtpu_rl import weight_sync as ws

        self.receiver = ws.WeightReceiver("tpu")
        self.model = torch.nn.Module()
        for i, s in enumerate(shapes):
            self.model.register_parameter(f"t{i}", torch.nn.Parameter(torch.zeros(s, device="tpu"),
                                                                      requires_grad=False))

    def _install(self, tensors):
        import torchtpu
        from torchtpu_rl import weight_sync as ws

        t0 = time.perf_counter()
        how = ws.install_state_dict(self.model, tensors)
        torchtpu.synchronize()
        return {"install_s": time.perf_counter() - t0, **{f"install_{k}": v for k, v in how.items()}}

    def update(self, u):
        tensors = self.receiver.receive(u)
        return {**self.receiver.last_timings, **self._install(tensors)}

    def setup(self, init, world, rank, backend):
        from torchtpu_rl import weight_sync as ws

        self.receiver.group = ws.CollectiveGroup(backend, init, world, rank)

    def teardown(self):
        self.receiver.group.destroy()
        self.receiver.group = None

    def recv(self):
        _, tensors = self.receiver.receive_broadcast()
        return {**self.receiver.last_timings, **self._install(tensors)}

    def checksums(self):
        from torchtpu_rl import weight_sync as ws

        return ws.tensor_checksums(self.model.state_dict())

    def cast_checksums(self):
        """What a bfloat16 sync must give: the receiver's weights, cast to bfloat16 and back."""
        import torch

        from torchtpu_rl import weight_sync as ws

        return ws.tensor_checksums({k: v.to(torch.bfloat16).float() for k, v in self.model.state_dict().items()})


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_sync(sizes_mb, transports, repeats, bucket_mb, sync_dtypes=("float32",)):
    import ray

    S = ray.remote(Sender).options(num_cpus=0)
    R = ray.remote(Receiver).options(num_cpus=0)
    rows = []
    for size in sizes_mb:
        shapes = layer_shapes(size * MB)
        memcpy = None
        for sync_dtype in sync_dtypes:
            s = S.remote(shapes, bucket_mb * MB, None if sync_dtype == "float32" else sync_dtype)
            r = R.remote(shapes)
            nbytes = ray.get(s.nbytes.remote())
            ray.get(r.__ray_ready__.remote())
            if memcpy is None:
                memcpy = memcpy_gbps(nbytes)
            for tr in transports:
                rows.append(_bench_one(s, r, tr, sync_dtype, nbytes, memcpy, repeats, len(shapes)))
            for a in (s, r):
                ray.kill(a)
    return rows


def _bench_one(s, r, tr, sync_dtype, nbytes, memcpy, repeats, n_tensors):
    import ray

    if tr.startswith("collective"):
        backend = tr.split("/")[1]
        init = ray.get(s.port.remote())
        ray.get([s.setup.remote(init, 2, backend), r.setup.remote(init, 2, 1, backend)])

        def one():
            return ray.get([s.broadcast.remote(), r.recv.remote()])[1]
    else:
        def one():
            return ray.get(r.update.remote(ray.get(s.publish.remote())))
    for _ in range(2):  # warm-up: allocations, the store's pre-fault, jit of the device pack/unpack and casts
        one()
    want = ray.get(s.checksums.remote()) if sync_dtype == "float32" else ray.get(r.cast_checksums.remote())
    ok = want == ray.get(r.checksums.remote())
    times, phases = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        recv_t = one()
        times.append(time.perf_counter() - t0)
        phases.append({**ray.get(s.timings.remote()), **recv_t})
    if tr.startswith("collective"):
        ray.get([s.teardown.remote(), r.teardown.remote()])
    med = statistics.median(times)
    name = tr if sync_dtype == "float32" else f"{tr}+{sync_dtype}"
    row = {"size_mb": nbytes / MB, "transport": name, "sync_dtype": sync_dtype, "median_s": med,
           "min_s": min(times), "gbps": nbytes / med / 1e9, "gbps_best": nbytes / min(times) / 1e9,
           "memcpy_gbps": memcpy, "ratio_vs_memcpy": nbytes / med / 1e9 / memcpy, "checksums_equal": ok,
           "tensors": n_tensors, "repeats_s": times,
           # where the time goes (median over repeats): pack, publish (sender), fetch, install (receiver)
           "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0] if k.endswith("_s")},
           "installed": {k: phases[-1][k] for k in ("install_swapped", "install_copied") if k in phases[-1]}}
    if "cast_rel_error" in phases[-1]:
        row["cast_rel_error"] = phases[-1]["cast_rel_error"]
        row["cast_max_abs_error"] = phases[-1]["cast_max_abs_error"]
    err = f"  cast rel.err {row['cast_rel_error']:.1e}" if "cast_rel_error" in row else ""
    print(f"{nbytes / MB:8.1f} MB  {name:27s} {med * 1e3:9.1f} ms  {row['gbps']:6.2f} GB/s  "
          f"memcpy {memcpy:6.2f} GB/s  ratio {row['ratio_vs_memcpy']:5.2f}  checksums {'ok' if ok else 'BAD'}  "
          + " ".join(f"{k} {v * 1e3:.0f}ms" for k, v in row["phases_s"].items()) + err, flush=True)
    return row


def bench_async(steps, warmup):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import rl_common

    from torchtpu_rl.driver import PromptDataset, RLDriver
    from torchtpu_rl.policy import make_policy
    from torchtpu_rl.rollout import SamplingParams
    from torchtpu_rl.topology import make_topology

    pf = functools.partial(make_policy, rl_common.VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, seed=0)
    topo = make_topology(pf, rl_common.PAD, num_rollout_workers=1, algo="grpo",
                         learner_kwargs={"group_size": 8, "lr": 3e-3, "kl_coef": 0.01})
    out = {}
    try:
        # one untimed run first: the actors' first steps compile and fill caches, which no
        # warm-up of a few steps inside the first timed block fully absorbs
        RLDriver(topo, PromptDataset(rl_common.make_items(4), seed=1), rl_common.digit_reward,
                 sampling=SamplingParams(max_new_tokens=4), prompts_per_step=8, group_size=8,
                 mode="async").run(2 * warmup, progress=False)
        for mode in ("sync", "async", "sync", "async"):  # alternate: load from other jobs hits both
            d = RLDriver(topo, PromptDataset(rl_common.make_items(4), seed=0), rl_common.digit_reward,
                         sampling=SamplingParams(max_new_tokens=4), prompts_per_step=8, group_size=8, mode=mode,
                         max_staleness=1)
            d.run(warmup, progress=False)
            t0 = time.perf_counter()
            hist = d.run(steps, progress=False)
            wall = (time.perf_counter() - t0) / steps
            o = out.setdefault(mode, {"step_s": [], "rollout_wait_s": [], "learner_call_s": [], "staleness": []})
            o["step_s"].append(wall)
            o["rollout_wait_s"].append(statistics.mean(h["rollout_wait_s"] for h in hist))
            o["learner_call_s"].append(statistics.mean(h["learner_call_s"] for h in hist))
            o["staleness"].append(max(h["staleness"] for h in hist))
            print(f"{mode:6s} {wall * 1e3:8.1f} ms/step  (rollout wait {o['rollout_wait_s'][-1] * 1e3:.1f} ms, "
                  f"learner {o['learner_call_s'][-1] * 1e3:.1f} ms, max staleness {o['staleness'][-1]})", flush=True)
    finally:
        topo.shutdown()
    out["ratio_async/sync_per_pair"] = [a / s for a, s in zip(out["async"]["step_s"], out["sync"]["step_s"])]
    out["ratio_async/sync"] = statistics.median(out["ratio_async/sync_per_pair"])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="sizes up to 50 MB, fewer repeats and steps")
    p.add_argument("--sizes", default=None, help="comma-separated MB (default 100,500,2000; quick 10,50)")
    p.add_argument("--sync-dtypes", default="float32", help="comma-separated: float32 (as is), bfloat16")
    p.add_argument("--transports", default="object_store,collective/tpu,collective/tpu-device,collective/gloo")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--bucket-mb", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="timed RL steps per mode")
    p.add_argument("--skip-async", action="store_true")
    p.add_argument("--skip-sync-bench", action="store_true", help="only the async vs sync part")
    p.add_argument("--warmup", type=int, default=4, help="untimed RL steps per block (compiles, caches)")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--out", default="runs/bench_weight_sync.json")
    args = p.parse_args()
    sizes = [int(x) for x in (args.sizes or ("10,50" if args.quick else "100,500,2000")).split(",")]
    repeats = args.repeats or (3 if args.quick else 5)
    steps = args.steps or (4 if args.quick else 10)
    store = int(max(sizes) * MB * 2.5) + 100 * MB

    import ray

    from torchtpu_rl.driver import ray_session

    env = None
    with ray_session(num_cpus=2, object_store_memory=store) as head:
        env = common.environment(args.threads)
        print(f"weight sync: sizes {sizes} MB, bucket {args.bucket_mb} MB, {repeats} repeats; "
              f"object store {store // MB} MB; load {env['loadavg_1min']:.1f}", flush=True)
        rows = [] if args.skip_sync_bench else bench_sync(sizes, args.transports.split(","), repeats, args.bucket_mb,
                                                                tuple(args.sync_dtypes.split(",")))
        asyn = None if args.skip_async else bench_async(steps, warmup=args.warmup)
        assert head is None or ray.is_initialized()
    summary = {}
    for tr in dict.fromkeys(r["transport"] for r in rows):
        rs = [r for r in rows if r["transport"] == tr]
        if rs:
            summary[tr] = {"best_ratio_vs_memcpy": max(r["ratio_vs_memcpy"] for r in rs),
                           "ratio_at_largest": rs[-1]["ratio_vs_memcpy"], "gbps_at_largest": rs[-1]["gbps"]}
    if asyn:
        summary["async_vs_sync_step_time"] = asyn["ratio_async/sync"]
    print("summary:", summary)
    common.write_json(args.out, {"environment": env, "bucket_mb": args.bucket_mb, "weight_sync": rows,
                                 "async_vs_sync": asyn, "summary": summary})


if __name__ == "__main__":
    main()
