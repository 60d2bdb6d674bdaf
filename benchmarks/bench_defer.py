"""DeferAndFuse vs Strict Eager (and torch CPU eager) on whole training steps.

For the TinyTransformer and the DLRM-style MLP: step time and peak device
memory per step, measured side by side in one run. Each step is forward,
loss, backward, AdamW step and zero_grad, closed by ``torchtpu.sync()`` on tpu
(which starts the step's fused graph without waiting for it). Steps are timed
as CUDA users time them: K steps back to back, then ``torch.tpu.synchronize()``,
per step = total / K, in every mode alike; the "blocked" figures synchronize
after every step instead (no overlap between steps). Modes take turns in
interleaved repeats. Ratios are what to read: the machines are shared and
absolute times drift. Besides wall time it reports the process's CPU time per
step (all threads: python, the autograd thread and XLA's), which a loaded
machine disturbs far less than wall time.

    python benchmarks/bench_defer.py --out runs/bench_defer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch CPU and XLA CPU share 2 cores
# XLA keeps its default CPU runtime: with --xla_cpu_multi_thread_eigen=false its executions ran
# inline in the dispatching thread (process CPU == wall), which removes the overlap of step N's
# XLA run with step N+1's recording (measured, benchmarks/README.md).

import torch  # noqa: E402
import tqdm  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu_models import DLRMStyleMLP, TinyTransformer  # noqa: E402


def transformer_case(batch, seq):
    torch.manual_seed(0)
    model = TinyTransformer(d_model=128, n_layers=2, n_heads=4, max_seq_len=seq, vocab_size=256)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return model, (lambda m, d: m.loss(d[0], d[1])), (ids[:, :-1], ids[:, 1:])


def dlrm_case(batch, _seq):
    torch.manual_seed(0)
    model = DLRMStyleMLP(table_sizes=(1000, 500, 200), embedding_dim=32, bottom_mlp=(64, 32), top_mlp=(64, 32))
    g = torch.Generator().manual_seed(1)
    dense, sparse, labels = model.make_batch(batch, generator=g)
    return model, (lambda m, d: m.loss(d[0], d[1], d[2])), (dense, sparse, labels)


def _to(x, device):
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x.to(device)


class _Mode:
    """One of the three runtimes with its own copy of the model, optimizer and batch."""

    def __init__(self, name, case, batch, seq):
        self.name = name
        self.device = "cpu" if name == "cpu_eager" else "tpu"
        model, self.loss_fn, data = case(batch, seq)
        self.model = model.to(self.device)
        self.data = _to(data, self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.loss = None
        self.wall, self.cpu, self.blocked_wall, self.blocked_cpu = [], [], [], []
        self.host = []  # CPU of the Python threads alone (see _python_threads_cpu_s)
        self.tids = {threading.get_native_id()}
        self.threads_found = False
        self.peak, self.blocked_peak = [], []
        self.flushes = {}
        self.compiles = 0

    def ctx(self):
        return torchtpu.execution_mode(self.name) if self.device == "tpu" else _Null()

    def step(self, find_threads=False):
        loss = self.loss_fn(self.model, self.data)
        if find_threads:  # a tpu backward runs in the autograd engine's device thread: note it
            loss.register_hook(lambda g: self.tids.add(threading.get_native_id()))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device == "tpu":
            torchtpu.sync()  # the end of a step: starts its fused graph, does not wait for it
        self.loss = loss

    def wait(self):
        if self.device == "tpu":
            torch.tpu.synchronize()

    def _mem_start(self):
        if self.device != "tpu":
            return 0
        torch.tpu.synchronize()
        torch.tpu.reset_peak_memory_stats()
        return torch.tpu.memory_allocated()

    def pipelined(self, k):
        """K steps back to back, then one synchronize: what a training loop costs (per step)."""
        with self.ctx():
            base = self._mem_start()
            m0 = torchtpu.metrics.snapshot()
            t0, c0, h0 = time.perf_counter(), time.process_time(), _python_threads_cpu_s(self.tids)
            for _ in range(k):
                self.step()
            self.wait()
            self.wall.append((time.perf_counter() - t0) / k)
            self.cpu.append((time.process_time() - c0) / k)
            h1 = _python_threads_cpu_s(self.tids)
            if h0 is not None and h1 is not None:
                self.host.append((h1 - h0) / k)
            m1 = torchtpu.metrics.snapshot()
            if self.device == "tpu":
                self.peak.append(torch.tpu.max_memory_allocated() - base)
        self.compiles += m1["compiles"] - m0["compiles"]
        for r, v in m1["flushes"].items():
            if v != m0["flushes"].get(r, 0):
                self.flushes[r] = self.flushes.get(r, 0) + v - m0["flushes"].get(r, 0)

    def blocked(self, k):
        """K steps each followed by a synchronize (no overlap between steps): median per step."""
        with self.ctx():
            walls, cpus = [], []
            for _ in range(k):
                base = self._mem_start()
                t0, c0 = time.perf_counter(), time.process_time()
                self.step(find_threads=not self.threads_found)
                self.wait()
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                if self.device == "tpu":
                    self.blocked_peak.append(torch.tpu.max_memory_allocated() - base)
        self.threads_found = True
        self.blocked_wall.append(statistics.median(walls))
        self.blocked_cpu.append(statistics.median(cpus))

    def summary(self):
        out = {
            "step_s": statistics.median(self.wall),
            "cpu_s": statistics.median(self.cpu),
            "blocked_step_s": statistics.median(self.blocked_wall),
            "blocked_cpu_s": statistics.median(self.blocked_cpu),
            "python_threads_cpu_s": statistics.median(self.host) if self.host else None,
            "repeats_step_s": self.wall,
            "final_loss": float(self.loss.detach().cpu()),
        }
        if self.device == "tpu":
            out.update(peak_bytes=max(self.peak), blocked_peak_bytes=max(self.blocked_peak),
                       compiles_timed=self.compiles, flushes_timed=self.flushes)
        return out


def run_case(case, args):
    modes = [_Mode(n, case, args.batch, args.seq) for n in ("cpu_eager", "strict_eager", "defer_and_fuse")]
    for m in modes:  # warm-up: compiles, the optimizer's state, the graph cache
        m.blocked(args.warmup)
        m.pipelined(2)
        m.wall.clear(), m.cpu.clear(), m.blocked_wall.clear(), m.blocked_cpu.clear(), m.host.clear()
        m.peak.clear(), m.blocked_peak.clear()
        m.flushes, m.compiles = {}, 0
    # interleaved: every repeat runs each mode in turn (order rotated), so load from other
    # jobs falls on all of them alike
    for r in tqdm.trange(args.repeats, desc="repeats", leave=False):
        order = modes[r % 3:] + modes[: r % 3]
        for m in order:
            m.pipelined(args.steps)
        for m in order:
            m.blocked(args.steps)
    by = {m.name: m for m in modes}
    res = {m.name: m.summary() for m in modes}

    def per_repeat(a, b, attr):
        return statistics.median([x / y for x, y in zip(getattr(by[a], attr), getattr(by[b], attr))])

    res["ratios"] = {
        "strict_over_defer_time": per_repeat("strict_eager", "defer_and_fuse", "wall"),
        "strict_over_defer_cpu_time": per_repeat("strict_eager", "defer_and_fuse", "cpu"),
        "defer_over_cpu_time": per_repeat("defer_and_fuse", "cpu_eager", "wall"),
        "defer_over_cpu_cpu_time": per_repeat("defer_and_fuse", "cpu_eager", "cpu"),
        "blocked_strict_over_defer_time": per_repeat("strict_eager", "defer_and_fuse", "blocked_wall"),
        "blocked_strict_over_defer_cpu_time": per_repeat("strict_eager", "defer_and_fuse", "blocked_cpu"),
        "blocked_defer_over_cpu_time": per_repeat("defer_and_fuse", "cpu_eager", "blocked_wall"),
        # on a TPU the device runs XLA beside the host; here XLA shares the host's two cores. The
        # Python threads' CPU per step (recording or dispatching; XLA's threads excluded) is the
        # step time when the device keeps up with the host
        "strict_over_defer_python_threads_cpu": (per_repeat("strict_eager", "defer_and_fuse", "host")
                                                 if by["defer_and_fuse"].host else None),
        "defer_over_strict_peak_memory": res["defer_and_fuse"]["blocked_peak_bytes"]
        / max(1, res["strict_eager"]["blocked_peak_bytes"]),
    }
    return res


def _python_threads_cpu_s(tids):
    """CPU seconds the native threads ``tids`` have run (Linux schedstat), None elsewhere."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block (K)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every mode")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--only", choices=("transformer", "dlrm_mlp"), default=None)
    ap.add_argument("--out", default="runs/bench_defer.json")
    ap.add_argument("--quick", action="store_true", help="3 warm-up steps, 2 repeats of 3 steps (< 60 s)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 3, 2
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    results = {"loadavg_1min_at_start": os.getloadavg()[0],  # above the core count: trust cpu times, not wall
               "steps_per_block": args.steps, "repeats": args.repeats,
               "omp_num_threads": os.environ["OMP_NUM_THREADS"], "xla_flags": os.environ.get("XLA_FLAGS", "")}
    cases = (("transformer", transformer_case), ("dlrm_mlp", dlrm_case))
    for name, case in cases:
        if args.only and name != args.only:
            continue
        r = run_case(case, args)
        results[name] = r
        print(f"\n{name}  (per step: {args.repeats} interleaved repeats of {args.steps} steps, then one synchronize;"
              f" 'blocked': synchronize after every step)")
        for k in ("cpu_eager", "strict_eager", "defer_and_fuse"):
            v = r[k]
            peak = "" if k == "cpu_eager" else f"  peak {v['blocked_peak_bytes'] / 2**20:6.2f} MiB"
            extra = f"  compiles {v['compiles_timed']} flushes {v['flushes_timed']}" if k != "cpu_eager" else ""
            host = v["python_threads_cpu_s"]
            host = "" if host is None else f" ({host * 1e3:.2f} python threads)"
            print(f"  {k:15s} {v['step_s'] * 1e3:8.2f} ms wall {v['cpu_s'] * 1e3:8.2f} ms cpu{host} | blocked "
                  f"{v['blocked_step_s'] * 1e3:8.2f} ms wall {v['blocked_cpu_s'] * 1e3:8.2f} ms cpu"
                  f"{peak}  loss {v['final_loss']:.4f}{extra}")
        for k, v in r["ratios"].items():
            print(f"  {k:40s} " + ("n/a" if v is None else f"{v:6.2f}x"))
    results["loadavg_1min_at_end"] = os.getloadavg()[0]
    print(f"\nload average (1 min): {results['loadavg_1min_at_start']:.2f} at start, {results['loadavg_1min_at_end']:.2f} at end")
    results["metrics"] = torchtpu.metrics.snapshot()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
