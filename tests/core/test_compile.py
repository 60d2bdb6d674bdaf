"""Compiled mode: torch.compile(..., backend="tpu") gives the results of eager mode.

Tolerances: compiled and eager tpu run the same lowerings, but XLA fuses a whole
graph (other summation orders, fused multiply-adds), and AOTAutograd's
decompositions may reorder arithmetic, so float32 results agree to a few ulp,
not bit for bit; training losses over a few steps stay within 1e-5 relative.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo

import torchtpu
import torchtpu.compile  # noqa: F401  (also what Dynamo's entry point for backend="tpu" imports)
from torchtpu_models import TinyTransformer, TransformerConfig, training_step


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torchtpu.set_cpu_fallback(True)


def _fn(x, y):
    h = (x @ y).relu()
    return h.sum(1) + torch.sin(x[:, :3]).t().mean() * torch.tanh(h).max(), h.transpose(0, 1).contiguous()


def test_backend_is_registered():
    assert "tpu" in torch._dynamo.list_backends(exclude_tags=())


def test_function_matches_eager_tpu_and_cpu():
    torch.manual_seed(0)
    x, y = torch.randn(4, 5), torch.randn(5, 3)
    cf = torch.compile(_fn, backend="tpu")
    got = cf(x.to("tpu"), y.to("tpu"))
    eager_tpu = _fn(x.to("tpu"), y.to("tpu"))
    cpu = _fn(x, y)
    for g, e, c in zip(got, eager_tpu, cpu):
        assert g.device.type == "tpu"
        torch.testing.assert_close(g.cpu(), e.cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-6)
    # second call with new values reuses the graph and gives the new result
    x2 = torch.randn(4, 5)
    torch.testing.assert_close(cf(x2.to("tpu"), y.to("tpu"))[0].cpu(), _fn(x2, y)[0], rtol=1e-5, atol=1e-6)


def test_module_forward_and_grads_match_cpu():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    mt = copy.deepcopy(m).to("tpu")
    cm = torch.compile(mt, backend="tpu")
    x = torch.randn(4, 5)
    out = cm(x.to("tpu"))
    ref = m(x)
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    (out * out).sum().backward()
    (ref * ref).sum().backward()
    for pt, pc in zip(mt.parameters(), m.parameters()):
        torch.testing.assert_close(pt.grad.cpu(), pc.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- training
CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
STEPS = 5


def _batch():
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _train(device, mode, make_opt):
    """mode: one of torchtpu_models.TRAINING_STEP_MODES (the benchmark builds its steps the same way)."""
    torch.manual_seed(0)
    model = TinyTransformer(CFG).to(device)
    opt = make_opt(model.parameters())
    x, y = (t.to(device) for t in _batch())
    run = training_step(model, opt, x, y, mode)
    losses = [run().item() for _ in range(STEPS)]
    return losses, model


def _check_params(model, ref_model):
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=n)


def _graph_misses(snap=None):
    """Executables built for compiled graphs (all graphs; metrics keys them per graph)."""
    snap = snap or torchtpu.metrics.snapshot()
    return sum(n for k, n in snap["cache_misses"].items() if torchtpu.compile.is_graph_label(k))


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, foreach=True)


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def _check_losses(got, ref):
    assert got[-1] < got[0], got  # it trained
    for g, r in zip(got, ref):
        assert abs(g - r) <= 1e-5 * abs(r), (got, ref)


def test_transformer_forward_backward_compiled_matches_eager():
    ref, ref_model = _train("cpu", "eager", _adamw)
    got, model = _train("tpu", "fwd_bwd", _adamw)
    _check_losses(got, ref)
    _check_params(model, ref_model)


@pytest.mark.parametrize("make_opt", [_adamw, _sgd], ids=["adamw", "sgd"])
def test_whole_training_step_compiled(make_opt):
    """Forward, backward and optimizer.step() inside torch.compile: parameters are updated in place."""
    ref, ref_model = _train("cpu", "eager", make_opt)
    torchtpu.metrics.reset()
    got, model = _train("tpu", "whole", make_opt)
    _check_losses(got, ref)
    _check_params(model, ref_model)
    snap = torchtpu.metrics.snapshot()
    assert _graph_misses(snap) >= 2  # forward/backward and optimizer graphs
    assert not snap["cpu_fallbacks"], snap["cpu_fallbacks"]


def test_traced_backward_step_is_two_graphs_and_matches_eager():
    """trace_autograd_ops: forward+backward in one graph, the optimizer in another; same losses."""
    ref, ref_model = _train("cpu", "eager", _adamw)
    torchtpu.metrics.reset()
    got, model = _train("tpu", "traced_backward", _adamw)
    _check_losses(got, ref)
    _check_params(model, ref_model)
    roles = sorted(k.rsplit(" ", 1)[1] for k in torchtpu.metrics.snapshot()["cache_misses"]
                   if torchtpu.compile.is_graph_label(k))
    assert "backward" not in roles, roles  # no AOTAutograd backward graph: the backward is traced in
    assert len(roles) == 2, roles


def test_fused_adamw_step_is_correct_under_compile():
    """Dynamo graph-breaks on AdamW(fused=True) (a torch.compiler.disable'd piece of torch.optim, for
    every backend): optimizer.step() runs eagerly as ONE _fused_adamw_ executable (the eager kernel's
    lowering), the rest compiled; results equal eager."""
    ref, _ = _train("cpu", "eager", lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True))
    torchtpu.metrics.reset()
    got, _ = _train("tpu", "whole", lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True))
    _check_losses(got, ref)
    misses = torchtpu.metrics.snapshot()["cache_misses"]
    assert misses["aten::_fused_adamw_"] == 1, misses


def test_recompile_warning_is_per_graph():
    """Many different graphs are not recompiles; one graph recompiled per shape is."""
    torchtpu.metrics.set_recompile_warning_threshold(3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", torchtpu.metrics.RecompileWarning)
            for k in range(6):  # six graphs (one frame each), one executable each
                f = torch.compile(eval(f"lambda x: x * {k + 2} + 1"), backend="tpu")
                assert f(torch.ones(3).to("tpu")).cpu().tolist() == [k + 3.0] * 3
        g = torch.compile(lambda x: x.exp() * 2, backend="tpu", dynamic=False)
        with pytest.warns(torchtpu.metrics.RecompileWarning, match=r"compiled graph <lambda>.*#\d+ inference"):
            for n in range(1, 6):  # the same graph at five shapes
                g(torch.ones(n).to("tpu"))
    finally:
        torchtpu.metrics.set_recompile_warning_threshold(16)


def test_slice_scatter_select_scatter_and_rand_like_in_graph():
    def f(a, b):
        c = a.clone()
        c[:, 1:3] = b  # slice_scatter after functionalization
        c[0] = 7.0  # select_scatter
        r = torch.rand_like(a)
        n = torch.randn_like(a)
        return c * 2, r, n

    a, b = torch.arange(12.0).reshape(3, 4), torch.ones(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.TPUFallbackWarning)  # the graph is lowered
        got, r, n = torch.compile(f, backend="tpu")(a.to("tpu"), b.to("tpu"))
    torch.testing.assert_close(got.cpu(), f(a, b)[0])
    r = r.cpu()
    assert r.shape == a.shape and r.dtype == a.dtype and bool(((r >= 0) & (r < 1)).all()) and r.unique().numel() > 1
    assert n.shape == a.shape and n.cpu().unique().numel() > 1
    torch.testing.assert_close(torch.slice_scatter(a.to("tpu"), b.to("tpu"), 1, 1, 3).cpu(),
                               torch.slice_scatter(a, b, 1, 1, 3))  # the eager kernel too


# ---------------------------------------------------------------- graph breaks, fallback
def test_graph_break_is_correct(capsys):
    def f(x):
        y = x.sin() * 2
        s = y.sum().item()  # host read: graph break
        print("mid", round(s, 3))
        z = y + s
        if s > 0:  # data-dependent control flow on the host value
            z = z * 3
        return z.cos()

    cf = torch.compile(f, backend="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.TPUFallbackWarning)  # every piece is lowered
        for seed in (0, 3):
            torch.manual_seed(seed)
            x = torch.randn(6)
            torch.testing.assert_close(cf(x.to("tpu")).cpu(), f(x), rtol=1e-5, atol=1e-6)
    assert "mid" in capsys.readouterr().out


def test_random_op_in_graph_gets_a_fresh_key_per_call():
    def f(x):
        return torch.nn.functional.dropout(x, p=0.5, training=True)

    cf = torch.compile(f, backend="tpu")
    x = torch.ones(4096).to("tpu")
    a, b = cf(x).cpu(), cf(x).cpu()
    for r in (a, b):
        assert set(r.unique().tolist()) <= {0.0, 2.0}
        assert 0.4 < (r == 0).float().mean().item() < 0.6
    assert not torch.equal(a, b)  # the key is a runtime input, not baked into the executable
    torch.manual_seed(7)
    c = cf(x).cpu()
    torch.manual_seed(7)
    assert torch.equal(cf(x).cpu(), c)  # reproducible under torch.manual_seed


def test_op_without_lowering_warns_once_and_is_correct():
    def f(x):
        return torch.special.bessel_j0(x * 2) + x

    x = torch.randn(5)
    cf = torch.compile(f, backend="tpu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = cf(x.to("tpu"))
        b = cf((x + 1).to("tpu"))
    torch.testing.assert_close(a.cpu(), f(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.cpu(), f(x + 1), rtol=1e-5, atol=1e-6)
    mine = [w for w in rec if "torchtpu compile" in str(w.message)]
    assert len(mine) == 1 and "special_bessel_j0" in str(mine[0].message), [str(w.message) for w in rec]


def test_op_without_lowering_raises_when_fallback_off():
    torchtpu.set_cpu_fallback(False)

    def f(x):
        return torch.special.bessel_j0(x) + 1

    with pytest.raises(Exception, match="special_bessel_j0.*CPU fallback is off"):
        torch.compile(f, backend="tpu")(torch.randn(3).to("tpu"))


def test_compiled_module_state_dict_round_trips():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).to("tpu")
    cm = torch.compile(m, backend="tpu")
    x = torch.randn(3, 4).to("tpu")
    out = cm(x)
    sd = cm.state_dict()
    assert all(k.startswith("_orig_mod.") for k in sd)
    # into a fresh compiled module (same keys) and into a plain CPU module (inner keys)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).to("tpu")
    cm2 = torch.compile(m2, backend="tpu")
    cm2.load_state_dict(sd)
    torch.testing.assert_close(cm2(x).cpu(), out.cpu())
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    cpu.load_state_dict({k: v.cpu() for k, v in cm._orig_mod.state_dict().items()})
    torch.testing.assert_close(cpu(x.cpu()), out.cpu(), rtol=1e-5, atol=1e-6)


def test_dlrm_whole_step_compiled_matches_cpu():
    """Embedding bags, advanced indexing (index / index_put in the backward) and SGD, all in graphs."""
    from torchtpu_models import DLRMConfig, DLRMStyleMLP

    torch.manual_seed(0)
    base = DLRMStyleMLP(DLRMConfig())
    dense, sparse, labels = base.make_batch(32, torch.Generator().manual_seed(1))

    def train(device, compiled):
        m = copy.deepcopy(base).to(device)
        opt = _sgd(m.parameters())
        batch = (dense.to(device), [s.to(device) for s in sparse], labels.to(device))

        def step():
            loss = m.loss(*batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        run = torch.compile(step, backend="tpu") if compiled else step
        return [run().item() for _ in range(STEPS)]

    ref = train("cpu", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.TPUFallbackWarning)  # no graph ran eagerly
        got = train("tpu", True)
    _check_losses(got, ref)


# ---------------------------------------------------------------- input mutations, runtime
def test_input_mutations_are_written_back_in_graph():
    """In-place updates of inputs (contiguous, strided views, cpu tensors) run inside the graph."""

    def f(a, b, c):
        a.add_(1)
        b.mul_(2)
        c.sub_(3)
        return a.sum() + b.sum()

    cf = torch.compile(f, backend="tpu")
    base = torch.arange(12.0).reshape(3, 4)
    a, b, c = base.clone().to("tpu"), base.clone().to("tpu").t(), torch.ones(3)
    ra, rb, rc = base.clone(), base.clone().t(), torch.ones(3)
    for _ in range(2):
        v = a._version
        out = cf(a, b[1:], c)
        ref = f(ra, rb[1:], rc)
        assert out.item() == ref.item()
        assert torch.equal(a.cpu(), ra) and torch.equal(b.cpu(), rb) and torch.equal(c, rc)
        assert a._version > v  # autograd's saved-tensor checks see the write
    # a mutated input sharing its storage with another input is not donated: both read right
    x = torch.zeros(4).to("tpu")
    out = torch.compile(lambda p, q: (p.add_(1), q * 2)[1], backend="tpu")(x, x[:2])
    assert out.cpu().tolist() == [2.0, 2.0] and x.cpu().tolist() == [1.0] * 4


def test_compiled_optimizer_step_has_no_eager_epilogue():
    """AdamW's updates of params and state come out of one executable: a steady compiled
    step runs (almost) no eager tpu ops (the old runtime copied each updated tensor back)."""
    torch.manual_seed(0)
    model = TinyTransformer(CFG).to("tpu")
    opt = _adamw(model.parameters())
    x, y = (t.to("tpu") for t in _batch())
    step = training_step(model, opt, x, y, "whole")
    step(), step()
    torchtpu.metrics.reset()
    for _ in range(3):
        step()
    snap = torchtpu.metrics.snapshot()
    assert snap["cache_hits"] <= 3 * 2, snap  # the backward's ones_like seed, not ~80 copy_ per step
    assert snap["compiles"] == 0, snap


def test_unknown_backend_option_is_refused():
    with pytest.raises(Exception, match="unknown option"):
        torch.compile(lambda x: x + 1, backend="tpu", options={"bucket_polcy": None})(torch.ones(2).to("tpu"))


# ---------------------------------------------------------------- dynamic shapes and buckets
def test_dynamic_sequence_lengths_compile_per_bucket():
    """dynamic=True: lengths 5..64 pad to the default pow2 buckets (8, 16, 32, 64); causal
    attention, layer norm and matmuls never mix pad into real positions, so the logits equal
    the unpadded ones."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=64)
    cpu = TinyTransformer(cfg).eval()
    m = copy.deepcopy(cpu).to("tpu").eval()
    f = torch.compile(m, backend="tpu", dynamic=True)
    torchtpu.metrics.reset()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.metrics.RecompileWarning)
        for T in (5, 7, 12, 16, 17, 30, 33, 64, 41):
            ids = torch.randint(0, 64, (2, T), generator=g)
            out = f(ids.to("tpu"))
            assert out.shape == (2, T, 64)
            torch.testing.assert_close(out.cpu(), cpu(ids), rtol=1e-4, atol=1e-5)
    snap = torchtpu.metrics.snapshot()
    assert _graph_misses(snap) <= 4, snap["cache_misses"]
    assert len(snap["compiles_by_bucket"]) == 4, snap["compiles_by_bucket"]


def test_mark_dynamic_with_policy_option_and_unsafe_graph():
    """mark_dynamic + options={"bucket_policy": ...}; a graph that reduces over the dynamic
    dim is not padded: it compiles per size, with one RecompileWarning, and stays exact."""
    from torchtpu.bucketing import BucketPolicy

    def safe(x):  # prefix sums, a slice from a fixed start, a reduction over the static dim
        return x.cumsum(1)[:, 1:] * 3, x.exp().sum(0)

    def unsafe(x):
        return x.softmax(-1).sum(-1)

    pol = BucketPolicy.explicit([16, 32])
    cs = torch.compile(safe, backend="tpu", options={"bucket_policy": pol})
    cu = torch.compile(unsafe, backend="tpu", options={"bucket_policy": pol})
    sizes = (5, 9, 20, 31)
    torchtpu.metrics.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.metrics.RecompileWarning)
        for n in sizes:
            x = torch.randn(3, n)
            xt = x.to("tpu")
            torch._dynamo.mark_dynamic(xt, 1)
            for got, ref in zip(cs(xt), safe(x)):
                torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert _graph_misses() == 2  # buckets 16 and 32
    torchtpu.metrics.reset()
    with pytest.warns(torchtpu.metrics.RecompileWarning, match="_softmax.*dynamic dim"):
        for n in sizes:
            x = torch.randn(3, n)
            xt = x.to("tpu")
            torch._dynamo.mark_dynamic(xt, 1)
            torch.testing.assert_close(cu(xt).cpu(), unsafe(x), rtol=1e-5, atol=1e-5)
    assert _graph_misses() == len(sizes)
