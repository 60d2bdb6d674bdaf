"""Shared test set-up: small, import-time only.

Tests run on XLA's CPU backend here (the same code runs on a TPU host). The
machine is shared: keep XLA/BLAS to one thread unless a test asks otherwise;
subprocesses started by tests inherit this.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite compiles thousands of small XLA programs; LLVM's -O0 codegen compiles them
# ~2.5x faster and computes the same values (benchmarks and examples keep the default).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402,F401  (registers the tpu device before any test module runs)


@pytest.fixture
def metrics():
    """``torchtpu.metrics``, reset before the test (for tests that count compiles or fallbacks)."""
    torchtpu.metrics.reset()
    return torchtpu.metrics


@pytest.fixture
def tpu():
    return torch.device("tpu")
