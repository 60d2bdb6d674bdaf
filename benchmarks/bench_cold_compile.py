"""Where a cold first compiled training step spends its time, against the jitted JAX twin's first step.

One fresh process, persistent compilation cache off (``TORCHTPU_CACHE_DIR=0``): the benchmark
transformer (bench_compile's default config) as ``torch.compile(backend="tpu")`` training step
(``torchtpu_models.training_step``, ``--mode``) and ``benchmarks/jax_transformer.py``'s ``JaxTrainer``.
The compiled first step is split into Dynamo (bytecode tracing, guards), AOTAutograd (joint graph,
partitioning, decompositions: inside the backend call), JAX tracing of our FX interpreter
(jaxpr), lowering to StableHLO, and XLA's compile, from torch's and JAX's own timers.

    python benchmarks/bench_cold_compile.py --out runs/bench_cold_compile.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TORCHTPU_CACHE_DIR"] = "0"  # cold: nothing loaded from an earlier run
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.pin_threads(1)

import jax  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402
from jax_transformer import JaxTrainer  # noqa: E402
from torchtpu_models import TinyTransformer, TransformerConfig, training_step  # noqa: E402

_jax_s = {"trace": 0.0, "lower": 0.0, "xla": 0.0}
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "xla"}


def _on_duration(event, duration, **kw):
    if event in _EVENTS:
        _jax_s[_EVENTS[event]] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="whole", help="training_step mode (whole, traced_backward)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="runs/bench_cold_compile.json")
    args = p.parse_args()
    cfg = TransformerConfig()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    torch.manual_seed(0)
    jt = JaxTrainer(TinyTransformer(cfg), x, y, lr=1e-3, weight_decay=0.01)
    for k in _jax_s:
        _jax_s[k] = 0.0
    t0 = time.perf_counter()
    float(jt.step())
    jax_first = time.perf_counter() - t0
    jax_parts = dict(_jax_s)

    torch.manual_seed(0)
    model = TinyTransformer(cfg).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    step = training_step(model, opt, x.to("tpu"), y.to("tpu"), args.mode)
    for k in _jax_s:
        _jax_s[k] = 0.0
    from torch._dynamo.utils import compilation_time_metrics

    compilation_time_metrics.clear()
    t0 = time.perf_counter()
    step().item()
    first = time.perf_counter() - t0
    parts = dict(_jax_s)
    ctm = {k: sum(v) for k, v in compilation_time_metrics.items()}
    dynamo_total = ctm.get("_compile.compile_inner", 0.0)
    backend = ctm.get("OutputGraph.call_user_compiler", 0.0)  # AOTAutograd + our compile_graph (no JAX work:
    # a graph is traced, lowered and compiled by JAX at its first call, after Dynamo returns)
    breakdown = {
        "dynamo (tracing, guards)": dynamo_total - backend,
        "aot autograd + backend": backend,
        "jax trace (our FX interpreter)": parts["trace"],
        "lowering to StableHLO": parts["lower"],
        "xla compile": parts["xla"],
    }
    breakdown["other (eager ops, python)"] = first - sum(breakdown.values())
    print(f"cold first step: compiled ({args.mode}) {first:.2f} s, jax twin {jax_first:.2f} s "
          f"(ratio {first / jax_first:.2f}x)")
    for k, v in breakdown.items():
        print(f"  {k:<32} {v:6.2f} s")
    print(f"  jax twin: trace {jax_parts['trace']:.2f} s, lower {jax_parts['lower']:.2f} s, "
          f"xla {jax_parts['xla']:.2f} s")
    top = sorted(ctm.items(), key=lambda kv: -kv[1])[:8]
    print("  torch compile timers: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    common.write_json(args.out, {"benchmark": "cold_compile", "config": vars(args), "env": common.environment(1),
                                 "compiled_first_s": first, "jax_first_s": jax_first,
                                 "ratio": first / jax_first, "breakdown_s": breakdown, "jax_breakdown_s": jax_parts,
                                 "torch_compile_timers_s": ctm})


if __name__ == "__main__":
    main()
