"""torchtpu.profiler.profile: a JAX profiler trace (TensorBoard's xplane.pb and a Perfetto trace) whose
events carry the torch op names of eager ops, and name fused (DeferAndFuse) and compiled graphs."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

import torchtpu


def _event_names(path):
    with gzip.open(path) as f:
        trace = json.load(f)
    return {e.get("name") for e in trace["traceEvents"] if isinstance(e, dict)}


def test_trace_names_tpu_ops_and_graphs(tmp_path):
    x = torch.randn(8, 8, device="tpu")
    table = torch.randn(10, 4, device="tpu")
    ids = torch.tensor([1, 3], device="tpu")
    compiled = torch.compile(lambda a: torch.relu(a @ a).sum(), backend="tpu")
    compiled(x)  # compiled (and Dynamo's work done) before the trace
    with torchtpu.profiler.profile(str(tmp_path), perfetto=True):
        (x @ x).sum().item()
        torch.nn.functional.embedding(ids, table).cpu()
        with torchtpu.execution_mode("defer_and_fuse"):
            (torch.tanh(x) * 2).sum().item()
        compiled(x).item()
    files = torchtpu.profiler.trace_files(str(tmp_path))
    assert any(f.endswith(".xplane.pb") for f in files), files
    names = _event_names(next(f for f in files if f.endswith(".trace.json.gz")))
    assert {"aten::mm", "aten::sum", "aten::embedding", "torchtpu fused graph"} <= names, sorted(names)[:80]
    assert any(n.startswith("torchtpu compiled graph") for n in names if n), sorted(names)[:80]
    xplane = open(next(f for f in files if f.endswith(".xplane.pb")), "rb").read()
    assert b"aten::mm" in xplane  # what TensorBoard's profile plugin reads


def test_profiles_do_not_nest(tmp_path):
    with torchtpu.profiler.profile(str(tmp_path / "a")):
        with pytest.raises(RuntimeError, match="already being recorded"):
            with torchtpu.profiler.profile(str(tmp_path / "b")):
                pass
