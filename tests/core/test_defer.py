"""DeferAndFuse: same answers as Strict Eager, flush triggers, graph caching, memory, errors."""

import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchtpu
from torchtpu import metrics
from torchtpu.runtime.recorder import RECORDER


@pytest.fixture
def defer():
    with torchtpu.execution_mode("defer_and_fuse"):
        yield


def flushes():
    return metrics.snapshot()["flushes"]


def test_ops_are_recorded_not_run(defer):
    a = torch.arange(6.0).reshape(2, 3).to("tpu")
    before = len(RECORDER.pending)
    b = (a * 2 + 1).t()
    b[0].mul_(10)
    assert len(RECORDER.pending) == before + 3
    expected = (torch.arange(6.0).reshape(2, 3) * 2 + 1).t()
    expected[0].mul_(10)
    torch.testing.assert_close(b.cpu(), expected)
    assert len(RECORDER.pending) == 0


@pytest.mark.parametrize(
    "read,reason",
    [
        (lambda t: t.sum().item(), "host_read"),
        (lambda t: t.cpu(), "host_read"),
        (lambda t: t.tolist(), "host_read"),
        (lambda t: repr(t), "host_read"),
        (lambda t: bool((t > 100).any()), "host_read"),
        (lambda t: torchtpu.sync(), "sync"),
        (lambda t: torch.tpu.synchronize(), "sync"),
    ],
)
def test_flush_triggers_are_counted_by_reason(defer, read, reason):
    t = torch.ones(4).to("tpu") * 3
    before = flushes().get(reason, 0)
    read(t)
    assert flushes().get(reason, 0) >= before + 1  # printing reads several values
    assert len(RECORDER.pending) == 0


def test_data_dependent_control_flow_flushes(defer):
    t = torch.ones(3).to("tpu") * 2
    before = flushes().get("host_read", 0)
    if (t.sum() > 5).item():
        t = t + 1
    assert flushes()["host_read"] == before + 1
    torch.testing.assert_close(t.cpu(), torch.full((3,), 3.0))


def test_mode_switch_flushes():
    with torchtpu.execution_mode("defer_and_fuse"):
        t = torch.ones(3).to("tpu") + 1
        before = flushes().get("mode_switch", 0)
    assert flushes()["mode_switch"] == before + 1
    assert len(RECORDER.pending) == 0
    torch.testing.assert_close(t.cpu(), torch.full((3,), 2.0))


def test_size_cap_flushes(defer, monkeypatch):
    monkeypatch.setattr(RECORDER, "max_pending", 10)
    t = torch.ones(3).to("tpu")
    before = flushes().get("size_cap", 0)
    for _ in range(25):
        t = t + 1
    assert flushes().get("size_cap", 0) == before + 2
    torch.testing.assert_close(t.cpu(), torch.full((3,), 26.0))


def _step(w, x):
    """One 'training step' without host reads: ~20 different ops, the same every step."""
    h = torch.tanh(x * w)
    h = torch.sigmoid(h + 1) * torch.exp(-h.abs())
    g = (h * h).sum(0) + h.mean(0)
    g = torch.where(g > 0, g, g * 0.1).clamp(-1, 1)
    w.sub_(g * 0.01)
    w.mul_(0.999)
    w.add_(torch.sin(w) * 0.001)
    x = x + 0.001 * torch.cos(x)
    return x.neg().neg()


def test_repeating_loop_flushes_once_per_iteration_and_stops_compiling(defer, monkeypatch):
    monkeypatch.setattr(RECORDER, "min_loop_period", 16)  # this toy step has ~27 ops
    w = torch.ones(8).to("tpu")
    x = torch.linspace(-1, 1, 32).reshape(4, 8).to("tpu")
    for _ in range(4):  # warm-up: detection needs two iterations, and the first loop flush is longer
        x = _step(w, x)
    start = metrics.snapshot()
    for _ in range(8):
        x = _step(w, x)
    end = metrics.snapshot()
    loop_flushes = end["flushes"].get("loop", 0) - start["flushes"].get("loop", 0)
    assert loop_flushes == 8
    assert end["compiles"] == start["compiles"], "a steady loop must hit the graph cache"
    # and the numbers are Strict Eager's
    got = w.cpu()
    with torchtpu.execution_mode("strict_eager"):
        w2 = torch.ones(8).to("tpu")
        x2 = torch.linspace(-1, 1, 32).reshape(4, 8).to("tpu")
        for _ in range(12):
            x2 = _step(w2, x2)
    torch.testing.assert_close(got, w2.cpu())


def test_dead_intermediates_are_not_materialized_and_peak_memory_is_lower():
    n = 1 << 16  # 256 KiB per float32 tensor

    def chain():
        x = torch.ones(n).to("tpu")
        torchtpu.sync()
        torch.tpu.reset_peak_memory_stats()
        base = torch.tpu.memory_allocated()
        ys = [x]
        for i in range(8):
            ys.append(torch.exp(ys[-1] * 0.5))  # every intermediate stays referenced by the list
        out = ys[-1]
        del ys
        out.cpu()
        return torch.tpu.max_memory_allocated() - base

    strict_peak = chain()
    with torchtpu.execution_mode("defer_and_fuse"):
        defer_peak = chain()
    assert defer_peak < strict_peak
    assert defer_peak <= 2 * 4 * n  # only the result (plus at most one buffer) ever exists


def test_same_seed_same_numbers_in_both_modes():
    torch.manual_seed(123)
    a = (torch.rand(5, device="tpu") * 2).cpu()
    with torchtpu.execution_mode("defer_and_fuse"):
        torch.manual_seed(123)
        b = (torch.rand(5, device="tpu") * 2).cpu()
    torch.testing.assert_close(a, b)


def test_user_errors_raise_at_the_recording_line(defer):
    a = torch.ones(3).to("tpu")
    b = torch.ones(4).to("tpu")
    with pytest.raises(RuntimeError) as info:
        a + b  # noqa: B018  (this line must be in the traceback)
    frames = traceback.extract_tb(info.tb)
    assert any(f.filename == __file__ and "a + b" in (f.line or "") for f in frames)


_lib = torch.library.Library("torchtpu_defer_test", "DEF")
_lib.define("explode(Tensor x) -> Tensor")
_lib.impl("explode", lambda x: torch.empty_like(x), "Meta")


def _explode_lowering(x):
    raise ValueError("lowering refuses this input")


def test_lowering_errors_raise_at_the_recording_line(defer):
    from torchtpu.dispatch import install, lowering

    lowering.lower("torchtpu_defer_test::explode")(_explode_lowering)
    install.install()
    x = torch.ones(2).to("tpu")
    with pytest.raises(ValueError, match="refuses") as info:
        torch.ops.torchtpu_defer_test.explode(x)  # recorded here: the error must point here
    frames = traceback.extract_tb(info.tb)
    assert any(f.filename == __file__ and "explode(x)" in (f.line or "") for f in frames)
    # the failed op left nothing behind: later work still runs
    torch.testing.assert_close((x + 1).cpu(), torch.full((2,), 2.0))


# ---------------------------------------------------------------- property test: same results in both modes
_UNARY = [torch.tanh, torch.neg, torch.abs, torch.sigmoid, lambda t: t * 0.5 + 1]
_SCALAR_INPLACE = ["add_", "mul_", "sub_"]

step = st.one_of(
    st.tuples(st.just("unary"), st.integers(0, 20), st.integers(0, len(_UNARY) - 1)),
    st.tuples(st.just("binary"), st.integers(0, 20), st.integers(0, 20)),
    st.tuples(st.just("view"), st.integers(0, 20), st.integers(0, 3)),
    st.tuples(st.just("inplace"), st.integers(0, 20), st.integers(0, 2), st.floats(-2, 2, width=32)),
    st.tuples(st.just("copy"), st.integers(0, 20), st.integers(0, 20)),
    st.tuples(st.just("read"), st.integers(0, 20)),
)


def _run(program, mode):
    torchtpu.set_execution_mode(mode)
    try:
        g = torch.Generator().manual_seed(0)
        ts = [torch.randn(4, 6, generator=g).to("tpu"), torch.randn(4, 6, generator=g).to("tpu")]
        for s in program:
            kind = s[0]
            a = ts[s[1] % len(ts)]
            if kind == "unary":
                ts.append(_UNARY[s[2]](a))
            elif kind == "binary":
                b = ts[s[2] % len(ts)]
                if a.shape == b.shape:
                    ts.append(a * b - a)
            elif kind == "view":
                v = [lambda t: t.t() if t.dim() <= 2 else t.transpose(0, -1), lambda t: t[1:], lambda t: t.reshape(-1) if t.is_contiguous() else t,
                     lambda t: t.unsqueeze(0)][s[2]](a)
                ts.append(v)
            elif kind == "inplace":
                getattr(a, _SCALAR_INPLACE[s[2]])(float(s[3]))
            elif kind == "copy":
                b = ts[s[2] % len(ts)]
                if a.shape == b.shape and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
                    a.copy_(b)
            elif kind == "read":
                a.cpu()
        return [t.cpu() for t in ts]
    finally:
        torchtpu.set_execution_mode("strict_eager")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=14))
def test_random_programs_give_identical_results_in_both_modes(program):
    strict = _run(program, "strict_eager")
    deferred = _run(program, "defer_and_fuse")
    assert len(strict) == len(deferred)
    for a, b in zip(strict, deferred):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("model_name", ["transformer", "dlrm"])
def test_training_matches_cpu_under_defer_and_fuse(model_name):
    import copy

    from torchtpu_models import DLRMStyleMLP, TinyTransformer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model_name == "transformer":
        cpu_model = TinyTransformer(d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
        ids = torch.randint(0, 256, (4, 17), generator=g)
        batch = (ids[:, :-1], ids[:, 1:])
    else:
        cpu_model = DLRMStyleMLP()
        batch = cpu_model.make_batch(16, generator=g)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")

    def to_tpu(x):
        return [to_tpu(v) for v in x] if isinstance(x, (list, tuple)) else x.to("tpu")

    tpu_batch = to_tpu(batch)
    losses = {}
    for name, model, data in (("cpu", cpu_model, batch), ("tpu", tpu_model, tpu_batch)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        with torchtpu.execution_mode("defer_and_fuse") if name == "tpu" else _nullcontext():
            for _ in range(6):
                loss = model.loss(*data)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        losses[name] = out
    torch.testing.assert_close(torch.tensor(losses["tpu"]), torch.tensor(losses["cpu"]), rtol=1e-4, atol=1e-5)
    assert losses["tpu"][-1] < losses["tpu"][0]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_transformer_step_peaks_lower_than_strict_eager():
    """The issue's memory claim on a training step: the fused step graph's XLA temporaries (the
    saved activations, what eager holds too) stay below Strict Eager's peak of live tensors."""
    from torchtpu_models import TinyTransformer

    def peak_above_step_start(mode):
        torch.manual_seed(0)
        model = TinyTransformer(d_model=64, n_layers=2, n_heads=4, max_seq_len=32).to("tpu")
        ids = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1)).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with torchtpu.execution_mode(mode):
            for _ in range(3):  # the last step is a steady one (optimizer state exists)
                torch.tpu.synchronize()
                torch.tpu.reset_peak_memory_stats()
                base = torch.tpu.memory_allocated()
                model.loss(ids[:, :-1], ids[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
                torchtpu.sync()
                torch.tpu.synchronize()
        return torch.tpu.max_memory_allocated() - base

    strict, defer = peak_above_step_start("strict_eager"), peak_above_step_start("defer_and_fuse")
    assert defer < 0.95 * strict, (defer, strict)


def test_transformer_loop_is_one_fused_graph_per_step_including_backward():
    """Backward runs in the autograd engine's own thread: it must record too (not run strict
    and force a flush of the forward), and the steady loop flushes once per step without compiling."""
    from torchtpu_models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(d_model=32, n_layers=1, n_heads=2, max_seq_len=16).to("tpu")
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with torchtpu.execution_mode("defer_and_fuse"):
        for _ in range(4):  # warm-up: the loop is found in step 3, its steady graph compiles in step 4
            step()
        start = metrics.snapshot()
        for _ in range(8):
            loss = step()
        end = metrics.snapshot()
    grew = {k: v - start["flushes"].get(k, 0) for k, v in end["flushes"].items() if v != start["flushes"].get(k, 0)}
    assert grew == {"loop": 8}, grew  # no "materialize" flush: backward was recorded, not run
    assert end["compiles"] == start["compiles"]
    assert torch.isfinite(loss.cpu())


# ---------------------------------------------------------------- asynchronous flushes
def _mlp_steps(mode, steps, sync_each):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))
    model = model.to("tpu")
    x, y = x.to("tpu"), y.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with torchtpu.execution_mode(mode):
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())  # no host read inside the loop
            if sync_each:
                torchtpu.sync()
                assert RECORDER.in_flight <= RECORDER.max_in_flight
        torch.tpu.synchronize()
        assert RECORDER.in_flight == 0
        return [p.cpu() for p in model.parameters()], torch.stack(losses).cpu()


@pytest.mark.parametrize("sync_each", [True, False])
def test_chained_steps_without_host_reads_match_strict_eager(sync_each, monkeypatch):
    """sync() returns once the step's graph is dispatched; the next step records (and donates
    the parameters the running graph is still writing) before it finishes."""
    monkeypatch.setattr(RECORDER, "min_loop_period", 8)
    before = flushes()
    params_d, losses_d = _mlp_steps("defer_and_fuse", 8, sync_each)
    after = flushes()
    reason = "sync" if sync_each else "loop"
    assert after.get(reason, 0) - before.get(reason, 0) >= 6
    params_s, losses_s = _mlp_steps("strict_eager", 8, sync_each)
    torch.testing.assert_close(losses_d, losses_s, rtol=1e-5, atol=1e-6)
    for a, b in zip(params_d, params_s):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


_lib.define("host_check(Tensor x) -> Tensor")
_lib.impl("host_check", lambda x: torch.empty_like(x), "Meta")


def _host_check_lowering(x):
    """Fails while the executable RUNS (a host callback), not while it is traced."""
    import jax
    import numpy as np

    def check(v):
        if np.any(v < 0):
            raise ValueError("host_check: negative input")
        return v

    return jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_runtime_error_of_a_dispatched_graph_names_the_recording_line(defer):
    from torchtpu.dispatch import install, lowering

    lowering.lower("torchtpu_defer_test::host_check")(_host_check_lowering)
    install.install()
    x = torch.ones(3).to("tpu")
    ok = torch.ops.torchtpu_defer_test.host_check(x * 2)
    torchtpu.sync()
    torch.testing.assert_close(ok.cpu(), torch.full((3,), 2.0))
    bad = torch.ops.torchtpu_defer_test.host_check(x - 5)  # recorded here: the error must name this line
    line = traceback.extract_stack()[-1].lineno - 1
    with pytest.raises(Exception, match="negative input") as info:
        torchtpu.sync()  # dispatches (XLA may raise here or when the result is waited for)
        bad.cpu()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"{__file__}:{line}" in notes, notes
    assert "host_check" in notes
    # the failed graph's result is not read as garbage later: using it raises (the clear "never
    # computed" error if the graph failed at dispatch, the graph's own error if it failed while running)
    with pytest.raises(Exception, match="never computed|negative input"):
        (bad + 1).cpu()
    # nothing is left in flight and later work runs
    torch.tpu.synchronize()
    torch.testing.assert_close((x + 1).cpu(), torch.full((3,), 2.0))


def test_flush_after_backward_is_its_own_counted_trigger(monkeypatch):
    monkeypatch.setattr(RECORDER, "flush_after_backward", True)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    lin.zero_grad()
    (lin(x) ** 2).sum().backward()
    want = lin.weight.grad.clone()
    lin_t = torch.nn.Linear(4, 3).to("tpu")
    with torch.no_grad():
        lin_t.weight.copy_(lin.weight.to("tpu"))
        lin_t.bias.copy_(lin.bias.to("tpu"))
    with torchtpu.execution_mode("defer_and_fuse"):
        before = flushes().get("backward", 0)
        loss = (lin_t(x.to("tpu")) ** 2).sum()
        assert flushes().get("backward", 0) == before
        loss.backward()
        assert flushes().get("backward", 0) == before + 1
        assert len(RECORDER.pending) == 0  # forward and backward went out as one graph
        lin_t.weight.data.mul_(1.0)  # the optimizer part records after it
        assert len(RECORDER.pending) == 1
        torch.testing.assert_close(lin_t.weight.grad.cpu(), want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(RECORDER, "flush_after_backward", False)
    with torchtpu.execution_mode("defer_and_fuse"):
        before = flushes().get("backward", 0)
        (lin_t(x.to("tpu")) ** 2).sum().backward()
        assert flushes().get("backward", 0) == before
