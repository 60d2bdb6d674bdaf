"""The runtime under Python threads (threading model: docs/architecture.md, "Threads").

Four threads run tpu ops at once, in DeferAndFuse and Strict Eager, reading results back to the host,
writing in place, reading one shared pending tensor, and running ops through the CPU fallback; each
result must equal the same computation on CPU. A bad index must be raised in the thread that issued
it, never in another thread that waits first. The interpreter's thread switch interval is lowered to
a microsecond so that threads interleave inside the runtime's own code (at the default 5 ms the
races this guards against showed up in a few runs in a hundred)."""

from __future__ import annotations

import sys
import threading
import traceback
import warnings

import pytest
import torch

import torchtpu

THREADS = 4
REPEATS = 50

_lib = torch.library.Library("torchtpu_thread_test", "DEF")
_lib.define("cpu_only_affine(Tensor x, float s) -> Tensor")
_lib.impl("cpu_only_affine", lambda x, s: x * s + 1, "CPU")
_CPU_ONLY = torch.ops.torchtpu_thread_test.cpu_only_affine.default


@pytest.fixture
def fast_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _run_threads(target, n=THREADS):
    """Start ``n`` threads on ``target(k)`` at one barrier; returns the tracebacks they raised."""
    barrier = threading.Barrier(n)
    errors: list = []

    def run(k):
        try:
            barrier.wait()
            target(k)
        except BaseException:  # noqa: BLE001 - every failure is reported by the test
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def _program(x, w, s):
    """A small program of views, in-place writes through a view, broadcasting, a matmul and a cast."""
    y = (x @ w).tanh() + s
    y[:, 1:3].mul_(0.5)  # in place through a view
    z = y.t().contiguous() * x.sum(0, keepdim=True)  # broadcasting
    return z.to(torch.float64).cumsum(1)


def test_threads_in_both_modes_agree_with_cpu(fast_switching):
    torch.manual_seed(0)
    w_cpu = torch.randn(6, 6)
    # one tensor every thread reads, left pending in the main thread's DeferAndFuse block
    with torchtpu.execution_mode("defer_and_fuse"):
        w_tpu = w_cpu.to("tpu") * 1.0
    mismatches: list = []

    def work(k):
        mode = "defer_and_fuse" if k % 2 == 0 else "strict_eager"
        g = torch.Generator().manual_seed(k)
        x_cpu = torch.randn(6, 6, generator=g)
        with torchtpu.execution_mode(mode):
            x_tpu = x_cpu.to("tpu")
            for step in range(3):
                out_tpu = _program(x_tpu, w_tpu, float(step))
                out_cpu = _program(x_cpu, w_cpu, float(step))
                if step == 1:  # a host read of a scalar, then a whole tensor
                    if abs(out_tpu.sum().item() - out_cpu.sum().item()) > 1e-3 * (1 + abs(out_cpu.sum().item())):
                        mismatches.append((k, step, "sum"))
                got = out_tpu.cpu()
                if not torch.allclose(got, out_cpu, rtol=1e-4, atol=1e-4):
                    mismatches.append((k, step, (got - out_cpu).abs().max().item()))
                x_tpu.add_(1.0)  # in place into the thread's own input
                x_cpu.add_(1.0)

    for _ in range(REPEATS):
        errors = _run_threads(work)
        assert not errors, errors[0]
        assert not mismatches, mismatches


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def _embed(table, ids):
    return torch.nn.functional.embedding(ids, table)  # <threaded embedding>


@pytest.mark.parametrize("mode", ["strict_eager", "defer_and_fuse"])
def test_bad_index_is_raised_in_its_own_thread(mode, fast_switching):
    """Odd threads look up an index out of range, even ones valid indices; every thread then waits
    on the host at the same moment. Each bad index is raised in the thread that issued it, naming
    its line; the good threads read their correct rows."""
    table_cpu = torch.arange(20.0).reshape(10, 2)
    line = _line_of("<threaded embedding>")
    outcome: dict = {}
    issued = threading.Barrier(THREADS)

    def work(k):
        ids = torch.tensor([k, 10 + k if k % 2 else k + 1])
        with torchtpu.execution_mode(mode):
            out = _embed(table_cpu.to("tpu"), ids.to("tpu"))
            issued.wait()  # every op (bad ones included) is issued before any thread waits
            try:
                got = out.cpu()
            except torchtpu.DeviceIndexError as e:
                outcome[k] = ("raised", str(e))
                return
        outcome[k] = ("ok", got)

    for _ in range(REPEATS):
        outcome.clear()
        errors = _run_threads(work)
        assert not errors, errors[0]
        for k in range(THREADS):
            kind, value = outcome[k]
            if k % 2:
                assert kind == "raised", (k, value)
                assert f"index {10 + k} " in value and f"test_threading.py:{line}" in value, value
            else:
                assert kind == "ok", (k, value)
                torch.testing.assert_close(value, table_cpu[torch.tensor([k, k + 1])])


def test_cpu_fallback_from_threads(fast_switching):
    """An op with no tpu lowering runs through the CPU fallback from several threads at once, beside
    lowered ops under DeferAndFuse."""
    def work(k):
        x_cpu = torch.arange(12.0).reshape(3, 4) + k
        with torchtpu.execution_mode("defer_and_fuse" if k % 2 == 0 else "strict_eager"):
            x = x_cpu.to("tpu") * 2
            y = _CPU_ONLY(x, float(k)) - 1
            torch.testing.assert_close(y.cpu(), x_cpu * 2 * k)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchtpu.TPUFallbackWarning)
        for _ in range(REPEATS // 5):
            errors = _run_threads(work)
            assert not errors, errors[0]
