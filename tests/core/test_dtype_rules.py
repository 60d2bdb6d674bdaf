"""PyTorch's type rules on tpu (issue 33): mismatched dtypes, shapes and devices raise what CPU raises.

The named cases are the findings (mm, 2-D ``@``, ``F.linear``, ``addmm``, ``mv`` downcast silently on tpu
where CPU raises); the property test draws ~100 ops with random wrong dtypes, shapes and devices and checks
that tpu raises the exception type CPU raises for the same call (and, where CPU accepts it, gives CPU's
dtype and shape) and that the interpreter and the device survive every call. Where CPU's kernel lacks a
dtype ("... not implemented for 'Bool'", "Sort does not support complex dtypes on CPU", "mixed dtype (CPU)"),
tpu may compute it, as cuda does: that is a missing CPU kernel, not a rule.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import torchtpu

FLOAT_PAIRS = [(torch.float32, torch.float64), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
               (torch.float32, torch.int64)]


@pytest.mark.parametrize("a_dt,b_dt", FLOAT_PAIRS, ids=[f"{a}-{b}" for a, b in FLOAT_PAIRS])
@pytest.mark.parametrize("name,fn,shapes", [
    ("mm", torch.mm, ((3, 4), (4, 2))),
    ("@ 2-D", lambda a, b: a @ b, ((3, 4), (4, 2))),
    ("@ 3-D", lambda a, b: a @ b, ((2, 3, 4), (2, 4, 2))),
    ("linear", F.linear, ((3, 4), (2, 4))),
    ("addmm", lambda a, b: torch.addmm(a[:, :1], a, b), ((3, 4), (4, 2))),
    ("addmm self", lambda a, b: torch.addmm(b, a, a.t()[:, :2]), ((3, 4), (3, 2))),
    ("mv", torch.mv, ((3, 4), (4,))),
    ("bmm", torch.bmm, ((2, 3, 4), (2, 4, 2))),
    ("dot", torch.dot, ((4,), (4,))),
    ("addmv", lambda a, b: torch.addmv(b[:3], a, b), ((3, 4), (4,))),
    ("sdpa", lambda a, b: F.scaled_dot_product_attention(a, b, b), ((1, 2, 3, 4), (1, 2, 3, 4))),
])
def test_mismatched_dtypes_raise_as_on_cpu(name, fn, shapes, a_dt, b_dt):
    a = torch.ones(shapes[0]).to(a_dt)
    b = torch.ones(shapes[1]).to(b_dt)
    with pytest.raises(RuntimeError) as cpu:
        fn(a, b)
    with pytest.raises(RuntimeError) as tpu:
        fn(a.to("tpu"), b.to("tpu"))
    assert str(tpu.value) == str(cpu.value)


def test_mismatched_dtypes_raise_under_defer_and_fuse():
    a, b = torch.ones(3, 4, device="tpu"), torch.ones(4, 2, device="tpu", dtype=torch.float64)
    with torchtpu.execution_mode("defer_and_fuse"):
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.mm(a, b)
        torch.testing.assert_close((a @ b.float()).cpu(), torch.full((3, 2), 4.0))


# ---------------------------------------------------------------- the property test
def _idx(x):
    return torch.zeros(2, dtype=torch.int64, device=x.device)


# (name, function of the tensors, how many tensors, the shapes a valid call would use, whether putting one
# operand on CPU must be refused: indexing ops take CPU indices)
OPS = []


def op(name, n, shapes, fn, device_rule=True):
    OPS.append((name, fn, n, shapes, device_rule))


S = (3, 4)
for _name in ("abs neg exp log sin cos sqrt rsqrt sigmoid tanh floor ceil round trunc sign reciprocal erf "
              "expm1 log1p frac isnan isinf isfinite logical_not bitwise_not square angle").split():
    op(_name, 1, (S,), getattr(torch, _name))
for _name in ("add sub mul div floor_divide remainder fmod pow maximum minimum atan2 eq ne lt ge logical_and "
              "logical_or logical_xor bitwise_and bitwise_or bitwise_xor hypot copysign fmax fmin "
              "nextafter xlogy heaviside").split():
    op(_name, 2, (S, S), getattr(torch, _name))
for _name in ("relu gelu silu softplus elu leaky_relu hardtanh hardswish mish relu6 logsigmoid").split():
    op(_name, 1, (S,), getattr(F, _name))
op("mm", 2, ((3, 4), (4, 2)), torch.mm)
op("bmm", 2, ((2, 3, 4), (2, 4, 2)), torch.bmm)
op("matmul", 2, ((2, 3, 4), (4, 2)), torch.matmul)
op("@", 2, ((3, 4), (4, 2)), lambda a, b: a @ b)
op("mv", 2, ((3, 4), (4,)), torch.mv)
op("dot", 2, ((4,), (4,)), torch.dot)
op("vdot", 2, ((4,), (4,)), torch.vdot)
op("outer", 2, ((3,), (4,)), torch.outer)
op("inner", 2, ((3, 4), (2, 4)), torch.inner)
op("kron", 2, ((2, 2), (2, 3)), torch.kron)
op("cross", 2, ((2, 3), (2, 3)), torch.linalg.cross)
op("addmm", 3, ((3, 2), (3, 4), (4, 2)), torch.addmm)
op("baddbmm", 3, ((2, 3, 2), (2, 3, 4), (2, 4, 2)), torch.baddbmm)
op("addbmm", 3, ((3, 2), (2, 3, 4), (2, 4, 2)), torch.addbmm)
op("addmv", 3, ((3,), (3, 4), (4,)), torch.addmv)
op("addr", 3, ((3, 4), (3,), (4,)), torch.addr)
op("linear", 3, ((3, 4), (2, 4), (2,)), F.linear)
op("bilinear", 4, ((3, 4), (3, 2), (5, 4, 2), (5,)), F.bilinear)
op("einsum", 2, ((3, 4), (4, 2)), lambda a, b: torch.einsum("ij,jk->ik", a, b))
op("tensordot", 2, ((3, 4), (4, 2)), lambda a, b: torch.tensordot(a, b, 1))
op("addcmul", 3, (S, S, S), torch.addcmul)
op("addcdiv", 3, (S, S, S), torch.addcdiv)
op("lerp", 3, (S, S, S), torch.lerp)
op("where", 3, (S, S, S), lambda c, a, b: torch.where(c.bool(), a, b), device_rule=False)
op("clamp", 3, (S, S, S), lambda x, lo, hi: torch.clamp(x, lo, hi))
for _name in ("sum mean prod amax amin argmax argmin std var logsumexp all any nansum count_nonzero").split():
    _f = getattr(torch, _name)
    op(_name, 1, (S,), (lambda f: (lambda x: f(x, 1)) if f is not torch.count_nonzero else f)(_f))
op("norm", 1, (S,), torch.linalg.vector_norm)
op("cumsum", 1, (S,), lambda x: torch.cumsum(x, 0))
op("cumprod", 1, (S,), lambda x: torch.cumprod(x, 1))
op("max dim", 1, (S,), lambda x: torch.max(x, 1))
op("sort", 1, (S,), lambda x: torch.sort(x, 1))
op("topk", 1, (S,), lambda x: torch.topk(x, 2))
op("softmax", 1, (S,), lambda x: torch.softmax(x, -1))
op("log_softmax", 1, (S,), lambda x: F.log_softmax(x, -1))
op("layer_norm", 3, (S, (4,), (4,)), lambda x, w, b: F.layer_norm(x, (4,), w, b))
op("group_norm", 3, ((2, 4, 3), (4,), (4,)), lambda x, w, b: F.group_norm(x, 2, w, b))
op("batch_norm", 3, (S, (4,), (4,)), lambda x, m, v: F.batch_norm(x, m, v))
op("conv1d", 3, ((1, 2, 6), (3, 2, 3), (3,)), F.conv1d)
op("conv2d", 2, ((1, 2, 5, 5), (3, 2, 3, 3)), F.conv2d)
op("max_pool1d", 1, ((1, 2, 6),), lambda x: F.max_pool1d(x, 2))
op("avg_pool2d", 1, ((1, 2, 4, 4),), lambda x: F.avg_pool2d(x, 2))
op("sdpa", 3, ((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)), F.scaled_dot_product_attention)
op("mse_loss", 2, (S, S), F.mse_loss)
op("l1_loss", 2, (S, S), F.l1_loss)
op("bce_with_logits", 2, (S, S), F.binary_cross_entropy_with_logits)
op("cross_entropy probs", 2, (S, S), F.cross_entropy)
op("cosine_similarity", 2, (S, S), F.cosine_similarity)
op("cat", 2, (S, S), lambda a, b: torch.cat([a, b]))
op("stack", 2, (S, S), lambda a, b: torch.stack([a, b]))
op("reshape", 1, (S,), lambda x: x.reshape(2, 6))
op("transpose", 1, (S,), lambda x: x.transpose(0, 1).contiguous())
op("flip", 1, (S,), lambda x: torch.flip(x, (0,)))
op("roll", 1, (S,), lambda x: torch.roll(x, 1, 1))
op("repeat", 1, (S,), lambda x: x.repeat(2, 1))
op("tril", 1, (S,), torch.tril)
op("diag", 1, ((3,),), torch.diag)
op("pad", 1, (S,), lambda x: F.pad(x, (1, 2)))
op("index_select", 1, (S,), lambda x: torch.index_select(x, 0, _idx(x)))
op("gather", 1, (S,), lambda x: torch.gather(x, 1, _idx(x).reshape(1, 2)))
op("index_add", 2, (S, (2, 4)), lambda x, s: x.index_add(0, _idx(x), s))
op("scatter", 2, (S, (1, 4)), lambda x, s: x.scatter(0, torch.zeros(1, 4, dtype=torch.int64, device=x.device), s))
op("scatter_add", 2, (S, (1, 4)),
   lambda x, s: x.scatter_add(0, torch.zeros(1, 4, dtype=torch.int64, device=x.device), s))
op("masked_fill", 2, (S, S), lambda x, m: x.masked_fill(m.bool(), 1.0), device_rule=False)
op("index_put", 2, (S, (2, 4)), lambda x, v: x.index_put((_idx(x),), v))
op("embedding", 1, (S,), lambda w: F.embedding(_idx(w), w))
op("copy_", 2, (S, S), lambda a, b: a.clone().copy_(b), device_rule=False)  # copies across devices
op("add_", 2, (S, S), lambda a, b: a.clone().add_(b))
op("mul_", 2, (S, S), lambda a, b: a.clone().mul_(b))
op("addmm_", 3, ((3, 2), (3, 4), (4, 2)), lambda s, a, b: s.clone().addmm_(a, b))
op("clone", 1, (S,), torch.clone)
op("to float", 1, (S,), lambda x: x.to(torch.float32))
op("searchsorted", 2, ((4,), (3,)), lambda s, v: torch.searchsorted(torch.sort(s).values, v))

# ops that refuse a CPU 0-dim operand beside a tpu one, as they do for cuda (None: at any position): the
# losses, cosine_similarity and kron reshape or broadcast before they dispatch (the CPU scalar becomes a CPU
# tensor with dims), inner checks its operands' device type first, index_put takes only CPU indices
_CPU_SCALAR_REFUSED = {"mse_loss": None, "l1_loss": None, "cosine_similarity": None, "kron": None,
                       "inner": None, "index_put": {0}, "sdpa": None}

DTYPES = [torch.float32, torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16,
          torch.int64, torch.int32, torch.bool, torch.complex64]


def _make(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) if shape else torch.randn((), generator=g)
    if dtype.is_complex:
        t = torch.complex(t, t.flip(-1) if t.dim() else t)
    elif dtype == torch.bool:
        t = t > 0
    elif not dtype.is_floating_point:
        t = (t.abs() * 2).floor() % 2 + 1  # 1 or 2: valid divisors (CPU checks integer division by zero, cuda does not)
    return t.to(dtype).to(device)


@st.composite
def calls(draw):
    name, fn, n, shapes, device_rule = draw(st.sampled_from(OPS))
    args = []
    for i in range(n):
        shape = shapes[i] if draw(st.booleans()) or draw(st.booleans()) else tuple(
            draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        device = "cpu" if device_rule and draw(st.integers(0, 9)) == 0 else "tpu"
        args.append((shape, dtype, device))
    return name, fn, args, draw(st.integers(0, 2**16))


def _run(fn, tensors):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(*tensors)
            leaves = [x.cpu() for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]  # host wait:
            # device-side errors surface here
        return None, leaves
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return e, None


def _dtype_gap(e) -> bool:
    """CPU's kernel lacks this dtype or dtype mix (tpu may have it, as cuda does): not a type rule."""
    return e is not None and any(w in str(e) for w in ("not implemented for", "Could not run", "CPU"))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(calls())
def test_tpu_raises_what_cpu_raises(call):
    name, fn, spec, seed = call
    tensors = [_make(s, d, dev, seed + i) for i, (s, d, dev) in enumerate(spec)]
    cpu_err, cpu_out = _run(fn, [t.cpu() for t in tensors])
    tpu_err, tpu_out = _run(fn, tensors)
    refused = _CPU_SCALAR_REFUSED.get(name, ())
    cpu_operand = [t.device.type == "cpu" and (t.dim() or refused is None or i in refused)
                   for i, t in enumerate(tensors)]
    mixed = any(cpu_operand) and any(t.device.type == "tpu" for t in tensors)
    where = f"{name}{[(tuple(s), str(d).split('.')[1], dev) for s, d, dev in spec]}"
    if mixed:  # a CPU operand of a tpu op: refused, as cuda refuses it
        assert tpu_err is not None, f"{where}: a CPU operand was accepted"
        # (with a bad shape as well, either error is right: the device check or the shape check may come first)
        assert isinstance(tpu_err, RuntimeError) or cpu_err is not None, (
            f"{where}: {type(tpu_err).__name__}: {tpu_err}")
        return
    if cpu_err is not None:
        if tpu_err is None:
            # (CPU checks integer division by zero, a bool False divisor too; cuda does not)
            assert _dtype_gap(cpu_err) or "ZeroDivisionError" in str(cpu_err), f"{where}: CPU raises {type(cpu_err).__name__}: {cpu_err}, tpu accepts"
            return
        # (where CPU lacks a dtype tpu has, tpu goes on and may meet another error of the call first)
        assert type(tpu_err) is type(cpu_err) or _dtype_gap(cpu_err), (
            f"{where}: CPU raises {type(cpu_err).__name__}: {cpu_err}\ntpu raises {type(tpu_err).__name__}: {tpu_err}")
        return
    if tpu_err is not None and all(t.numel() == 0 for t in tensors):
        # CPU's kernel never runs on empty inputs, so it skips its own dtype check; tpu may refuse a dtype
        # CPU's kernel lacks (softmax of bool) there too
        one = [torch.ones([max(d, 1) for d in t.shape], dtype=t.dtype) for t in tensors]
        if _dtype_gap(_run(fn, one)[0]):
            return
    assert tpu_err is None, f"{where}: CPU accepts, tpu raises {type(tpu_err).__name__}: {tpu_err}"
    assert [(t.dtype, t.shape) for t in tpu_out] == [(t.dtype, t.shape) for t in cpu_out], where


def test_device_works_after_the_fuzz():
    torch.testing.assert_close((torch.ones(3, device="tpu") * 2).cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("call", [lambda x: torch.sort(x, 2), lambda x: torch.topk(x, 1, dim=5),
                                  lambda x: torch.cumsum(x, 4), lambda x: torch.argmax(x, 2),
                                  lambda x: torch.sort(x[0], 1)], ids=["sort", "topk", "cumsum", "argmax", "sort0d"])
def test_dim_out_of_range_raises_cpu_index_error(call):
    """A dim outside [-ndim, ndim) is PyTorch's IndexError on tpu too (it wrapped around silently)."""
    x = torch.ones(3)
    with pytest.raises(IndexError) as cpu:
        call(x)
    with pytest.raises(IndexError) as tpu:
        call(x.to("tpu"))
    assert str(tpu.value) == str(cpu.value)
