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

# The compile-storm policy (torchtpu/dispatch/storm.py) would run new small shapes of an op through
# PyTorch's CPU kernel once the op has many executables, which the whole suite in one process reaches
# for common ops: tests check the lowerings, so it is off here unless a test turns it on.
os.environ.setdefault("TORCHTPU_STORM_EXECUTABLES", "0")
# XLA's CPU backend on purpose (no fallback warning); TORCHTPU_PLATFORM=cuda or tpu runs the tests on an
# accelerator
os.environ.setdefault("TORCHTPU_PLATFORM", "cpu")

# The persistent compilation cache (on by default, in the user's ~/.cache) goes to a directory of this
# session, shared by the processes the tests start and removed at the end.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_XLA_CACHE = tempfile.mkdtemp(prefix="torchtpu_test_xla_")
os.environ["TORCHTPU_CACHE_DIR"] = _XLA_CACHE
atexit.register(shutil.rmtree, _XLA_CACHE, True)

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


# --- Ray ---
# (section owned by ray_integration; see docs/ray.md.) One local Ray head for the whole session, started on
# first use: tests that need Ray take `ray_head` (addresses only) or `ray_driver` (this process connected).


@pytest.fixture(scope="session")
def ray_head():
    """A local Ray head for the session: yields a ``ray_integration.LocalHead``.

    ``.address`` is the GCS address (``ray.init(address=...)``), ``.dashboard_url`` the job server
    (``ray job submit --address``/``JobSubmissionClient``), ``.run_dir`` its RAY_TMPDIR. 4 logical CPUs,
    80 MB object store, token auth as by default (``.client_env()`` for subprocesses); only the processes it
    started are stopped at the end.
    """
    import shutil
    import tempfile

    from ray_integration import local_head

    run_dir = tempfile.mkdtemp(prefix="rt_", dir="/tmp")  # short: Ray's unix sockets live under it
    try:
        with local_head(run_dir, num_cpus=4, object_store_memory=80 * 1024**2) as head:
            yield head
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_driver(ray_head):
    """This test process connected to ``ray_head`` as a Ray driver (``ray.init`` once per session)."""
    import ray

    from ray_integration import connect

    connect(ray_head)  # takes the head's auth token (RAY_AUTH_MODE/RAY_AUTH_TOKEN_PATH) into this process
    try:
        yield ray_head
    finally:
        ray.shutdown()
