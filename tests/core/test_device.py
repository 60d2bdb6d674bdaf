"""The ``tpu`` device API: torch.device, factories, moves, torch.tpu, torch.accelerator,
and the clear errors for bad input (device indices, mixed devices, dtypes, numpy)."""

import gc
import io
import re

import pytest
import torch

import torchtpu

INDEX_ERR = re.escape("device index 1 is not available")
MIXED = "Expected all tensors to be on the same device, but found at least two devices, tpu:0 and cpu!"


def _same(t, ref):
    assert t.device.type == "tpu"
    torch.testing.assert_close(t.cpu(), ref, rtol=0, atol=0)


# ---------------------------------------------------------------- device objects and moves
def test_torch_device():
    d = torch.device("tpu")
    assert d.type == "tpu" and d.index is None
    assert torch.device("tpu:0") == torch.device("tpu", 0)
    t = torch.ones(2, device=d)
    assert t.device == torch.device("tpu", 0)
    assert t.is_tpu and not torch.ones(2).is_tpu


def test_to_and_back():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for spelling in ("tpu", "tpu:0", torch.device("tpu"), torch.device("tpu", 0)):
        _same(x.to(spelling), x)
    _same(x.tpu(), x)
    _same(x.tpu(0), x)
    _same(x.to(device="tpu", dtype=torch.float64), x.double())
    assert x.to("tpu").to("tpu").device.type == "tpu"


@pytest.mark.parametrize(
    "make, ref",
    [
        (lambda d: torch.zeros(2, 3, device=d), torch.zeros(2, 3)),
        (lambda d: torch.ones(4, dtype=torch.int64, device=d), torch.ones(4, dtype=torch.int64)),
        (lambda d: torch.full((2, 2), 3.5, device=d), torch.full((2, 2), 3.5)),
        (lambda d: torch.arange(5, device=d), torch.arange(5)),
        (lambda d: torch.arange(1, 10, 3, dtype=torch.float32, device=d), torch.arange(1, 10, 3, dtype=torch.float32)),
        (lambda d: torch.tensor([[1, 2], [3, 4]], device=d), torch.tensor([[1, 2], [3, 4]])),
        (lambda d: torch.tensor(2.5, device=d), torch.tensor(2.5)),
        (lambda d: torch.eye(3, device=d), torch.eye(3)),
        (lambda d: torch.zeros_like(torch.ones(3), device=d), torch.zeros(3)),
    ],
)
def test_factories(make, ref):
    _same(make("tpu"), ref)


def test_factory_dtype_follows_python_scalar_type():
    # 3, 3.0 and True compare (and hash) equal; the dtypes they give must not be mixed up
    for _ in range(2):
        assert torch.arange(3, device="tpu").dtype == torch.int64
        assert torch.arange(3.0, device="tpu").dtype == torch.float32
        assert torch.full((2,), 1, device="tpu").dtype == torch.int64
        assert torch.full((2,), 1.0, device="tpu").dtype == torch.float32
        assert torch.full((2,), True, device="tpu").dtype == torch.bool


def test_empty_and_random_factories():
    e = torch.empty(3, 4, device="tpu")
    assert e.device.type == "tpu" and e.shape == (3, 4) and e.dtype == torch.float32
    torch.manual_seed(0)
    r = torch.randn(1000, device="tpu")
    assert r.device.type == "tpu" and r.shape == (1000,)
    assert abs(r.mean().item()) < 0.2 and 0.8 < r.std().item() < 1.2
    torch.manual_seed(0)
    torch.testing.assert_close(torch.randn(1000, device="tpu").cpu(), r.cpu(), rtol=0, atol=0)


def test_module_tpu():
    m = torch.nn.Linear(3, 2)
    ref = m(torch.ones(1, 3))
    assert m.tpu() is m
    assert all(p.device.type == "tpu" for p in m.parameters())
    torch.testing.assert_close(m(torch.ones(1, 3, device="tpu")).cpu(), ref)
    m2 = torch.nn.Linear(3, 2).to("tpu:0")
    assert m2.weight.device == torch.device("tpu", 0)


# ---------------------------------------------------------------- torch.tpu
class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_module_to_keeps_tied_weights_and_parameter_objects():
    m = _TiedLM()
    weight = m.emb.weight
    opt = torch.optim.SGD(m.parameters(), lr=0.5)  # built before the move, as on cuda
    m.to("tpu")
    assert m.head.weight is m.emb.weight is weight and weight.device.type == "tpu"
    assert len(list(m.parameters())) == 1
    before = weight.detach().cpu().clone()
    m.head(m.emb(torch.tensor([1, 2], device="tpu"))).sum().backward()
    opt.step()
    assert not torch.equal(weight.detach().cpu(), before)  # the optimizer updated the moved weight
    m.half()
    assert m.head.weight is m.emb.weight and weight.dtype == torch.float16
    m.cpu()
    assert m.head.weight is m.emb.weight and weight.device.type == "cpu"
    assert torch.__future__.get_swap_module_params_on_conversion() is False  # restored


def test_cpu_module_conversion_is_torch_default():
    m = _TiedLM()
    m.double()  # cpu -> cpu keeps torch's own behaviour (set .data), tying intact either way
    assert m.head.weight is m.emb.weight and m.emb.weight.dtype == torch.float64


def test_torch_tpu_basics():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() == 1
    assert torch.tpu.current_device() == 0
    for d in (0, "tpu", "tpu:0", torch.device("tpu", 0)):
        torch.tpu.set_device(d)
        with torch.tpu.device(d):
            pass
    x = torch.ones(64, 64, device="tpu") @ torch.ones(64, 64, device="tpu")
    torch.tpu.synchronize()
    torch.tpu.synchronize("tpu:0")
    assert torchtpu.to_jax(x).is_ready()
    assert torch.tpu.get_device_name()


def test_torch_tpu_streams(tmp_path):
    """One in-order queue: current/default stream, stream contexts, events; what torch.distributed.checkpoint's
    writer and TorchRec's train pipelines ask of an accelerator's device module."""
    s = torch.tpu.current_stream()
    assert s == torch.tpu.default_stream() == torch.tpu.Stream() and s.device == torch.device("tpu", 0)
    x = torch.arange(6.0, device="tpu")
    with torch.tpu.stream(s):
        y = x * 2
    ev = torch.tpu.Event()
    ev.record(s)
    s.wait_event(ev)
    ev.synchronize()
    s.synchronize()
    assert ev.query() and s.query()
    _same(y, torch.arange(6.0) * 2)
    with pytest.raises(TypeError, match="torch.tpu.Stream"):
        torch.tpu.stream(object())
    with pytest.raises(RuntimeError, match=INDEX_ERR):
        torch.tpu.current_stream(1)
    # torch.distributed.checkpoint writes tpu tensors through the device's stream (no process group)
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": y}, checkpoint_id=str(tmp_path), no_dist=True)
    back = {"w": torch.zeros(6, device="tpu")}
    dcp.load(back, checkpoint_id=str(tmp_path), no_dist=True)
    _same(back["w"], torch.arange(6.0) * 2)


def test_torch_tpu_manual_seed():
    torch.tpu.manual_seed(123)
    a = torch.rand(16, device="tpu").cpu()
    b = torch.rand(16, device="tpu").cpu()
    assert not torch.equal(a, b)
    torch.tpu.manual_seed_all(123)
    torch.testing.assert_close(torch.rand(16, device="tpu").cpu(), a, rtol=0, atol=0)
    torch.manual_seed(7)  # torch.manual_seed seeds the tpu too
    c = torch.randn(8, device="tpu").cpu()
    torch.manual_seed(7)
    torch.testing.assert_close(torch.randn(8, device="tpu").cpu(), c, rtol=0, atol=0)


def test_memory_figures():
    gc.collect()
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    t = torch.empty(1000, device="tpu")
    assert torch.tpu.memory_allocated() == base + 4000
    u = torch.empty(250, dtype=torch.float64, device="tpu")
    assert torch.tpu.memory_allocated() == base + 6000
    assert torch.tpu.max_memory_allocated() == base + 6000
    v = t[10:20]  # a view allocates nothing
    assert torch.tpu.memory_allocated() == base + 6000
    del t, v
    gc.collect()
    assert torch.tpu.memory_allocated() == base + 2000
    assert torch.tpu.max_memory_allocated() == base + 6000
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base + 2000
    del u
    gc.collect()
    assert torch.tpu.memory_allocated() == base
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base


# ---------------------------------------------------------------- torch.accelerator
def test_accelerator():
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 1
    assert torch.accelerator.current_device_index() == 0
    x = torch.ones(64, 64, device="tpu") * 3
    torch.accelerator.synchronize()
    torch.accelerator.synchronize("tpu:0")
    torch.accelerator.synchronize(0)
    assert torchtpu.to_jax(x).is_ready()
    torch.accelerator.set_device_index(0)
    with torch.accelerator.device_index(0):
        assert torch.accelerator.current_device_index() == 0


def test_accelerator_memory():
    gc.collect()
    base = torch.accelerator.memory_allocated()
    assert base == torch.tpu.memory_allocated()
    t = torch.empty(512, device="tpu")
    assert torch.accelerator.memory_allocated() == base + 2048
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == base + 2048
    assert torch.accelerator.memory_reserved() >= 0
    torch.accelerator.empty_cache()
    free, total = torch.accelerator.get_memory_info()
    assert 0 <= free <= total and total > 0
    del t


# ---------------------------------------------------------------- tpu:1 is refused everywhere
_INDEX_CASES = {
    "zeros": lambda: torch.zeros(2, device="tpu:1"),
    "ones": lambda: torch.ones(2, device="tpu:1"),
    "full": lambda: torch.full((2,), 1.0, device="tpu:1"),
    "arange": lambda: torch.arange(3, device="tpu:1"),
    "empty": lambda: torch.empty(2, device="tpu:1"),
    "tensor": lambda: torch.tensor([1.0], device="tpu:1"),
    "randn": lambda: torch.randn(2, device="tpu:1"),
    "rand": lambda: torch.rand(2, device=torch.device("tpu", 1)),
    "randint": lambda: torch.randint(0, 5, (2,), device="tpu:1"),
    "eye": lambda: torch.eye(2, device="tpu:1"),
    "zeros_like": lambda: torch.zeros_like(torch.ones(2), device="tpu:1"),
    "new_zeros": lambda: torch.ones(2, device="tpu").new_zeros(2, device="tpu:1"),
    "cpu_to": lambda: torch.ones(2).to("tpu:1"),
    "cpu_to_device": lambda: torch.ones(2).to(torch.device("tpu", 1)),
    "tpu_to": lambda: torch.ones(2, device="tpu").to("tpu:1"),
    "tensor_tpu": lambda: torch.ones(2).tpu(1),
    "module_to": lambda: torch.nn.Linear(2, 2).to("tpu:1"),
    "module_tpu": lambda: torch.nn.Linear(2, 2).tpu(1),
    "set_device": lambda: torch.tpu.set_device(1),
    "set_device_str": lambda: torch.tpu.set_device("tpu:1"),
    "device_ctx": lambda: torch.tpu.device(1),
    "device_ctx_str": lambda: torch.tpu.device("tpu:1"),
    "synchronize": lambda: torch.tpu.synchronize(1),
    "memory_allocated": lambda: torch.tpu.memory_allocated("tpu:1"),
    "acc_set_index": lambda: torch.accelerator.set_device_index(1),
    "acc_device_index": lambda: torch.accelerator.device_index(1).__enter__(),
    "acc_synchronize": lambda: torch.accelerator.synchronize(1),
    "acc_memory": lambda: torch.accelerator.memory_allocated(1),
    "untyped_storage": lambda: torch.UntypedStorage(4, device="tpu:1"),
}


@pytest.mark.parametrize("case", sorted(_INDEX_CASES))
def test_device_index_1_is_refused(case):
    with pytest.raises(RuntimeError, match=INDEX_ERR):
        _INDEX_CASES[case]()
    # nothing was silently switched
    assert torch.accelerator.current_device_index() == 0
    assert torch.tpu.current_device() == 0


def test_load_onto_tpu_1_is_refused():
    f = io.BytesIO()
    torch.save(torch.ones(2, device="tpu"), f)
    f.seek(0)
    with pytest.raises(RuntimeError, match="device_count"):
        torch.load(f, map_location="tpu:1")


# ---------------------------------------------------------------- mixed devices
_MIXED_CASES = {
    "add": lambda a, c: a + c,
    "radd": lambda a, c: c + a,
    "mul_": lambda a, c: a.mul_(c),
    "cat": lambda a, c: torch.cat([a, c]),
    "where": lambda a, c: torch.where(a > 0, a, c),
    "matmul": lambda a, c: a.view(1, 3) @ c.view(3, 1),
    "linear": lambda a, c: torch.nn.functional.linear(a, c.view(1, 3)),
    "cpu_module_tpu_input": lambda a, c: torch.nn.Linear(3, 1)(a),
}


@pytest.mark.parametrize("case", sorted(_MIXED_CASES))
def test_mixed_devices_error(case):
    a = torch.ones(3, device="tpu")
    c = torch.ones(3)
    with pytest.raises(RuntimeError, match=re.escape(MIXED)):
        _MIXED_CASES[case](a, c)


def test_mixed_devices_error_on_the_cpu_fallback():
    # an op with no tpu kernel runs on CPU: it must still refuse what cuda would refuse
    lib = torch.library.Library("tpudevtest", "FRAGMENT")
    lib.define("mix(Tensor a, Tensor b) -> Tensor")
    lib.impl("mix", lambda a, b: a * 2 + b, "CPU")
    a = torch.ones(3, device="tpu")
    _same(torch.ops.tpudevtest.mix(a, a), torch.full((3,), 3.0))
    _same(torch.ops.tpudevtest.mix(a, torch.tensor(1.0)), torch.full((3,), 3.0))  # 0-dim: a scalar
    with pytest.raises(RuntimeError, match=re.escape(MIXED)):
        torch.ops.tpudevtest.mix(a, torch.ones(3))


def test_zero_dim_cpu_tensor_is_a_scalar():
    a = torch.arange(3.0, device="tpu")
    _same(a * torch.tensor(2.0), torch.arange(3.0) * 2)
    _same(torch.tensor(1.0) + a, torch.arange(3.0) + 1)
    _same(a.add_(torch.tensor(1)), torch.arange(3.0) + 1)


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: torch.zeros(2, dtype=torch.complex32, device="tpu"), "complex32"),
        (lambda: torch.empty(2, dtype=torch.quint8, device="tpu"), "quint8"),
        (lambda: torch.ones(2, device="tpu").to(torch.complex32), "complex32"),
        (lambda: torch.zeros(2, dtype=torch.complex32).to("tpu"), "complex32"),
        (lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8).to("tpu"), "quint8"),
        (lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8).tpu(), "qint8"),
        (lambda: torch.ones(2, dtype=torch.float16, device="tpu").view(torch.complex32), "complex32"),
        (lambda: torch.ones(2, device="tpu").chalf(), "complex32"),
        (lambda: torch.quantize_per_tensor(torch.ones(2, device="tpu"), 0.1, 0, torch.qint8), "qint8"),
        (lambda: torch.empty(2, dtype=torch.qint32, device="tpu"), "qint32"),
    ],
)
def test_unsupported_dtype_error(make, name):
    with pytest.raises((TypeError, RuntimeError), match=rf"dtype torch\.{name} is not supported on tpu"):
        make()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2fnuz, torch.float8_e8m0fnu])
def test_float8_dtypes_round_trip(dtype):
    x = torch.tensor([0.5, 1.0, 2.0, 4.0]).to(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype
    assert torch.equal(t.cpu().view(torch.uint8), x.view(torch.uint8))
    assert torch.equal((t.float() * 2).cpu(), x.float() * 2)


def test_numpy_says_cpu_first():
    t = torch.ones(2, device="tpu")
    with pytest.raises(TypeError, match=r"Tensor\.cpu\(\)"):
        t.numpy()
    assert (t.cpu().numpy() == 1).all()
