"""torch.autocast("tpu"): CUDA's cast policy per op, bfloat16 by default, in every execution mode;
GradScaler("tpu") on the device."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from helpers import no_fallback

BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _rand(*shape, dtype=torch.float32, positive=False, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    t = torch.randn(*shape, generator=g, dtype=dtype)
    return t.abs() + 0.5 if positive else t


# (name, policy, op, CPU inputs): the policy is CUDA's category of the op (dispatch/autocast.py)
CASES = [
    ("mm", "lower", torch.mm, lambda: (_rand(4, 3), _rand(3, 5))),
    ("matmul", "lower", torch.matmul, lambda: (_rand(2, 4, 3), _rand(3, 5))),
    ("@ 2-D", "lower", lambda a, b: a @ b, lambda: (_rand(4, 3), _rand(3, 2))),
    ("bmm", "lower", torch.bmm, lambda: (_rand(2, 4, 3), _rand(2, 3, 5))),
    ("addmm", "lower", torch.addmm, lambda: (_rand(5), _rand(4, 3), _rand(3, 5))),
    ("baddbmm", "lower", torch.baddbmm, lambda: (_rand(2, 4, 5), _rand(2, 4, 3), _rand(2, 3, 5))),
    ("addbmm", "lower", torch.addbmm, lambda: (_rand(4, 5), _rand(2, 4, 3), _rand(2, 3, 5))),
    ("mv", "lower", torch.mv, lambda: (_rand(4, 3), _rand(3))),
    ("addmv", "lower", torch.addmv, lambda: (_rand(4), _rand(4, 3), _rand(3))),
    ("addr", "lower", torch.addr, lambda: (_rand(4, 3), _rand(4), _rand(3))),
    ("linear", "lower", F.linear, lambda: (_rand(4, 3), _rand(5, 3), _rand(5))),
    ("einsum", "lower", lambda a, b: torch.einsum("ij,jk->ik", a, b), lambda: (_rand(4, 3), _rand(3, 2))),
    ("conv1d", "lower", F.conv1d, lambda: (_rand(1, 2, 8), _rand(3, 2, 3))),
    ("conv2d", "lower", F.conv2d, lambda: (_rand(1, 2, 6, 6), _rand(3, 2, 3, 3), _rand(3))),
    ("conv_transpose1d", "lower", F.conv_transpose1d, lambda: (_rand(1, 2, 5), _rand(2, 3, 3))),
    ("prelu", "lower", F.prelu, lambda: (_rand(2, 3), _rand(1))),
    ("sdpa", "lower", F.scaled_dot_product_attention, lambda: (_rand(1, 2, 4, 8), _rand(1, 2, 4, 8),
                                                                _rand(1, 2, 4, 8))),
    ("linalg_vecdot", "lower", torch.linalg.vecdot, lambda: (_rand(4, 3), _rand(4, 3))),
    ("exp", "fp32", torch.exp, lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("log", "fp32", torch.log, lambda: (_rand(4, 3, dtype=torch.bfloat16, positive=True),)),
    ("rsqrt", "fp32", torch.rsqrt, lambda: (_rand(4, 3, dtype=torch.bfloat16, positive=True),)),
    ("pow", "fp32", torch.pow, lambda: (_rand(4, 3, dtype=torch.bfloat16, positive=True), 2.5)),
    ("softplus", "fp32", F.softplus, lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("layer_norm", "fp32", lambda x, w, b: F.layer_norm(x, (3,), w, b),
     lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(3, dtype=torch.bfloat16), _rand(3))),
    ("rms_norm", "fp32", lambda x, w: F.rms_norm(x, (3,), w), lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(3))),
    ("group_norm", "fp32", lambda x: F.group_norm(x, 2), lambda: (_rand(2, 4, 3, dtype=torch.bfloat16),)),
    ("mse_loss", "fp32", F.mse_loss, lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(4, 3))),
    ("l1_loss", "fp32", F.l1_loss, lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(4, 3))),
    ("nll_loss", "fp32", F.nll_loss, lambda: (_rand(4, 3, dtype=torch.bfloat16), torch.tensor([0, 2, 1, 1]))),
    ("bce_with_logits", "fp32", F.binary_cross_entropy_with_logits,
     lambda: (_rand(4, 3, dtype=torch.bfloat16), torch.rand(4, 3, generator=torch.Generator().manual_seed(1)))),
    ("cosine_similarity", "fp32", F.cosine_similarity, lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(4, 3))),
    ("logsumexp", "fp32", lambda x: torch.logsumexp(x, 1), lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("cdist", "fp32", torch.cdist, lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(2, 3))),
    ("softmax", "fp32_set_opt_dtype", lambda x: torch.softmax(x, -1), lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("log_softmax", "fp32_set_opt_dtype", lambda x: F.log_softmax(x, -1),
     lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("sum", "fp32_set_opt_dtype", torch.sum, lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("sum dim", "fp32_set_opt_dtype", lambda x: x.sum(1), lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("cumsum", "fp32_set_opt_dtype", lambda x: torch.cumsum(x, 0), lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("prod", "fp32_set_opt_dtype", torch.prod, lambda: (_rand(2, 3, dtype=torch.bfloat16),)),
    ("vector_norm", "fp32_set_opt_dtype", torch.linalg.vector_norm, lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("norm", "fp32_append_dtype", torch.norm, lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("norm dim", "fp32_append_dtype", lambda x: torch.norm(x, 2, 1), lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("addcmul", "promote", torch.addcmul, lambda: (_rand(4, 3), _rand(4, 3, dtype=torch.bfloat16), _rand(4, 3))),
    ("addcdiv", "promote", torch.addcdiv,
     lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(4, 3, dtype=torch.bfloat16),
              _rand(4, 3, dtype=torch.bfloat16, positive=True))),
    ("atan2", "promote", torch.atan2, lambda: (_rand(4, 3, dtype=torch.bfloat16), _rand(4, 3))),
    ("dot", "promote", torch.dot, lambda: (_rand(3), _rand(3, dtype=torch.bfloat16))),
    # aten::cross is the policy's op (torch.linalg.cross is linalg_cross, which CUDA does not autocast)
    ("cross", "promote", lambda a, b: torch.cross(a, b, dim=1), lambda: (_rand(4, 3), _rand(4, 3, dtype=torch.bfloat16))),
    ("scatter_add", "promote", lambda x, s: x.scatter_add(0, torch.tensor([[0, 1, 0]]).to(x.device), s),
     lambda: (_rand(2, 3, dtype=torch.bfloat16), _rand(1, 3))),
    ("add (no policy)", "none", torch.add, lambda: (_rand(4, 3), _rand(4, 3, dtype=torch.bfloat16))),
    ("relu (no policy)", "none", F.relu, lambda: (_rand(4, 3, dtype=torch.bfloat16),)),
    ("float64 mm", "lower", torch.mm, lambda: (_rand(4, 3, dtype=torch.float64), _rand(3, 2, dtype=torch.float64))),
]
# ops CPU's own autocast puts in the same category as CUDA's: its output dtypes must be ours
SAME_ON_CPU = {"mm", "matmul", "@ 2-D", "bmm", "addmm", "baddbmm", "addbmm", "linear", "conv1d", "conv2d",
               "conv_transpose1d", "prelu", "sdpa", "linalg_vecdot", "mse_loss", "l1_loss", "nll_loss",
               "bce_with_logits", "cdist", "add (no policy)", "relu (no policy)", "float64 mm", "prod"}


def _policy_inputs(policy, args, low):
    """The inputs CUDA's policy hands the op (what a CPU reference without autocast must be given)."""
    floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64]
    if policy == "lower":
        to = low
    elif policy == "fp32":
        to = torch.float32
    elif policy == "promote":
        to = torch.float32 if any(a.dtype == torch.float32 for a in floating) else low
    else:
        return args
    return tuple(a.to(to) if any(a is f for f in floating) else a for a in args)


def _ref_kwargs(policy, name, args):
    first = args[0]
    eligible = first.is_floating_point() and first.dtype != torch.float64
    if policy in ("fp32_set_opt_dtype", "fp32_append_dtype") and eligible:
        return {"dtype": torch.float32}
    return {}


def _to_tpu(args):
    return tuple(a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args)


def _ref(name, policy, op, args, low):
    """The op on CPU, without autocast, on the inputs CUDA's policy gives it."""
    kw = _ref_kwargs(policy, name, args)
    if kw and name in ("softmax", "log_softmax", "sum dim", "cumsum", "norm dim"):
        # the fp32 flag goes to the underlying aten call: run the op on float32 inputs instead, which
        # computes in float32 and gives float32 out, as dtype=float32 does
        return op(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
    if kw:
        return op(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
    return op(*_policy_inputs(policy, args, low))


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,policy,op,make", CASES, ids=[c[0] for c in CASES])
def test_op_follows_cuda_policy(name, policy, op, make, low):
    # a case's bfloat16 inputs stand for "the autocast dtype" (CUDA refuses to promote bf16 with fp16)
    args = tuple(a.to(low) if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in make())
    expected = _ref(name, policy, op, args, low)
    with no_fallback(), torch.autocast("tpu", dtype=low):
        got = op(*_to_tpu(args))
    assert got.dtype == expected.dtype, name
    torch.testing.assert_close(got.cpu().float(), expected.float(), **BF16_TOL)


@pytest.mark.parametrize("name,policy,op,make", [c for c in CASES if c[0] in SAME_ON_CPU],
                         ids=[c[0] for c in CASES if c[0] in SAME_ON_CPU])
def test_dtypes_equal_cpu_autocast(name, policy, op, make):
    args = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = op(*args)
    with torch.autocast("tpu"):  # bfloat16 by default
        got = op(*_to_tpu(args))
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.cpu().float(), expected.float(), **BF16_TOL)


def test_default_dtype_is_bfloat16_in_every_thread():
    seen = {}

    def run():
        seen["default"] = torch.get_autocast_dtype("tpu")
        with torch.autocast("tpu"):
            seen["mm"] = (torch.ones(2, 2, device="tpu") @ torch.ones(2, 2, device="tpu")).dtype

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == {"default": torch.bfloat16, "mm": torch.bfloat16}
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16


def test_set_autocast_dtype_is_the_threads_choice():
    seen = {}

    def run():
        torch.set_autocast_dtype("tpu", torch.float16)
        seen["dtype"] = torch.get_autocast_dtype("tpu")

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["dtype"] == torch.float16
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16


def test_cpu_tensors_and_disabled_regions_are_left_alone():
    a = torch.randn(3, 3)
    with torch.autocast("tpu"):
        assert (a @ a).dtype == torch.float32  # CPU autocast is not on
        with torch.autocast("tpu", enabled=False):
            x = torch.randn(3, 3, device="tpu")
            assert (x @ x).dtype == torch.float32


def test_binary_cross_entropy_is_refused_as_on_cuda():
    p = torch.rand(4, device="tpu")
    with torch.autocast("tpu"), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)


def test_training_step_grads_are_float32_and_match_cpu():
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    dev = copy.deepcopy(cpu).to("tpu")
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_cpu = F.cross_entropy(cpu(x), y)
    loss_cpu.backward()
    with no_fallback():
        with torch.autocast("tpu"):
            out = dev(x.to("tpu"))
            assert out.dtype == torch.bfloat16
            loss = F.cross_entropy(out, y.to("tpu"))
        loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.cpu(), loss_cpu, **BF16_TOL)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert pd.grad.dtype == torch.float32
        torch.testing.assert_close(pd.grad.cpu(), pc.grad, rtol=5e-2, atol=5e-2)


def test_weight_cast_cache_sees_in_place_updates():
    w = torch.nn.Parameter(torch.ones(3, 3, device="tpu"))
    x = torch.ones(2, 3, device="tpu")
    with torch.autocast("tpu"):
        first = (x @ w).float().cpu()
        with torch.no_grad():
            w.mul_(2)
        second = (x @ w).float().cpu()
    torch.testing.assert_close(second, 2 * first)


def _model_and_input():
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to("tpu")
    return m, torch.randn(3, 8, device="tpu")


def _forward(m, x):
    h = m(x)
    return h, torch.softmax(h, -1), torch.exp(h)


def test_defer_and_fuse_and_compiled_graphs_cast_alike():
    m, x = _model_and_input()
    with torch.autocast("tpu"):
        eager = _forward(m, x)
    assert [t.dtype for t in eager] == [torch.bfloat16, torch.float32, torch.float32]
    with no_fallback():
        with torchtpu.execution_mode("defer_and_fuse"), torch.autocast("tpu"):
            deferred = [t.cpu() for t in _forward(m, x)]

        def inner(x):
            with torch.autocast("tpu"):
                return _forward(m, x)

        compiled_inside = torch.compile(inner, backend="tpu")(x)
        cm = torch.compile(lambda x: _forward(m, x), backend="tpu")
        with torch.autocast("tpu"):
            compiled_outside = cm(x)
    for got in (deferred, compiled_inside, compiled_outside):
        assert [t.dtype for t in got] == [t.dtype for t in eager]
        for a, b in zip(got, eager):
            torch.testing.assert_close(a.cpu(), b.cpu())


def _scaler_run(device, steps):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    scales = []
    for x in steps:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(x.to(device)).float().sum()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        opt.zero_grad()
        scales.append(sc.get_scale())
    return scales, [p.detach().cpu() for p in m.parameters()]


def test_grad_scaler_runs_on_tpu_like_cpu():
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(4, 3, generator=g) for _ in range(3)]
    steps.insert(1, torch.full((4, 3), float("inf")))  # a step with overflowing gradients is skipped
    cpu_scales, cpu_params = _scaler_run("cpu", steps)
    with no_fallback():
        scales, params = _scaler_run("tpu", steps)
    assert scales == cpu_scales
    assert cpu_scales[1] == cpu_scales[0] / 2  # backed off on the inf step
    for a, b in zip(params, cpu_params):
        torch.testing.assert_close(a, b, **BF16_TOL)


def test_grad_scaler_unscale_in_float16_grads():
    grads = [torch.tensor([1.0, 2.0], dtype=torch.float16, device="tpu"), torch.tensor([4.0], device="tpu")]
    found = torch.zeros(1, device="tpu")
    with no_fallback():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor([0.5], device="tpu"))
    assert found.item() == 0.0
    assert grads[0].dtype == torch.float16 and grads[0].tolist() == [0.5, 1.0] and grads[1].tolist() == [2.0]
    grads[1].fill_(float("nan"))
    with no_fallback():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor([1.0], device="tpu"))
    assert found.item() == 1.0
