"""The storage model, the op lowering table and kernels, and the CPU fallback."""

import warnings

import pytest
import torch

import torchtpu
from torchtpu import metrics


def tpu(x):
    return x.to("tpu")


def test_views_share_storage_and_strides_are_real():
    a = tpu(torch.arange(12.0).reshape(3, 4))
    t = a.t()
    assert t.stride() == (1, 4) and not t.is_contiguous()
    assert t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    s = a[1, 1:]
    assert s.storage_offset() == 5
    torch.testing.assert_close(s.cpu(), torch.tensor([5.0, 6.0, 7.0]))
    torch.testing.assert_close(t.cpu(), torch.arange(12.0).reshape(3, 4).t())


def test_inplace_through_view_is_seen_by_base_and_reverse():
    base = tpu(torch.zeros(3, 4))
    view = base[:, 1]
    view.add_(5)
    expected = torch.zeros(3, 4)
    expected[:, 1] += 5
    torch.testing.assert_close(base.cpu(), expected)
    base.mul_(2)
    torch.testing.assert_close(view.cpu(), torch.full((3,), 10.0))
    # transposed view written in place
    base.t()[2].fill_(-1)
    expected = expected * 2
    expected.t()[2].fill_(-1)
    torch.testing.assert_close(base.cpu(), expected)


def test_version_counter_bumps():
    a = tpu(torch.zeros(4))
    v = a[1:]
    before = a._version
    v.add_(1)
    assert a._version == before + 1 and v._version == a._version


def test_autograd_through_views_and_inplace_matches_cpu():
    def f(x):
        y = x * 2
        z = y.clone()
        z[1].mul_(3)
        z.t()[0].add_(1)
        return (z * z).sum()

    x = torch.randn(4, 3, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    f(x).backward()
    f(xt).backward()
    assert xt.grad.device.type == "tpu"
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16, torch.float16]
)
def test_dtypes_are_kept_exactly(dtype):
    src = (torch.arange(6) % 2 == 0) if dtype == torch.bool else torch.arange(6).to(dtype)
    t = tpu(src)
    assert t.dtype == dtype
    assert t.cpu().dtype == dtype
    torch.testing.assert_close(t.cpu(), src)
    if dtype != torch.bool:
        r = t + t
        assert r.dtype == dtype
        torch.testing.assert_close(r.cpu(), src + src)


def test_int64_values_beyond_int32_survive():
    big = torch.tensor([2**40 + 3, -(2**50)], dtype=torch.int64)
    torch.testing.assert_close((tpu(big) + 1).cpu(), big + 1)


def test_type_promotion_is_pytorchs():
    i = tpu(torch.arange(4))
    assert (i * 0.5).dtype == torch.float32
    assert (i / 2).dtype == torch.float32
    assert (i + True).dtype == torch.int64
    f16 = tpu(torch.ones(3, dtype=torch.float16))
    assert (f16 + tpu(torch.ones(3))).dtype == torch.float32
    assert (f16 * 2.5).dtype == torch.float16


def test_shape_errors_are_pytorchs():
    with pytest.raises(RuntimeError, match="broadcast|must match the size"):
        tpu(torch.ones(3)) + tpu(torch.ones(4))


def test_mixed_device_error_matches_cuda_message():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*tpu:0 and cpu"):
        tpu(torch.ones(3)) + torch.ones(3)
    # a 0-dim cpu tensor is a scalar operand
    torch.testing.assert_close((tpu(torch.ones(3)) + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))


def test_executables_are_cached_per_shape():
    a = tpu(torch.randn(5, 7))
    b = tpu(torch.randn(5, 7))
    torch.atan2(a, b)
    before = metrics.snapshot()
    for _ in range(5):
        torch.atan2(a, b)
    after = metrics.snapshot()
    assert after["cache_misses"].get("aten::atan2", 0) == before["cache_misses"].get("aten::atan2", 0)
    assert after["cache_hits"] >= before["cache_hits"] + 5
    torch.atan2(tpu(torch.randn(2, 3)), tpu(torch.randn(2, 3)))
    assert metrics.snapshot()["cache_misses"]["aten::atan2"] == after["cache_misses"]["aten::atan2"] + 1


def test_scalar_values_do_not_recompile():
    a = tpu(torch.randn(6))
    a * 0.25
    misses = metrics.snapshot()["cache_misses"].get("aten::mul.Tensor", 0)
    for s in (0.5, 1.5, -3.0, 7.25):
        torch.testing.assert_close((a * s).cpu(), a.cpu() * s)
    assert metrics.snapshot()["cache_misses"].get("aten::mul.Tensor", 0) == misses


def test_negative_zero_and_nan_scalars():
    a = tpu(torch.ones(2))
    assert torch.signbit((a * -0.0).cpu()).all()
    assert not torch.signbit((a * 0.0).cpu()).any()
    assert torch.isnan((a * float("nan")).cpu()).all()


# Ops that only have a CPU kernel: the fallback path is what runs them on tpu.
_lib = torch.library.Library("torchtpu_test", "DEF")
_lib.define("cpu_only_scale(Tensor x, float s) -> Tensor")
_lib.define("cpu_only_scale_(Tensor(a!) x, float s) -> Tensor(a!)")
_lib.impl("cpu_only_scale", lambda x, s: x * s, "CPU")


def _scale_(x, s):
    x.mul_(s)
    return x


_lib.impl("cpu_only_scale_", _scale_, "CPU")
_OP = torch.ops.torchtpu_test.cpu_only_scale.default
_OP_INPLACE = torch.ops.torchtpu_test.cpu_only_scale_.default


def test_cpu_fallback_warns_once_counts_and_can_be_disabled():
    x = tpu(torch.randn(4, 3))
    before = metrics.snapshot()["cpu_fallbacks"].get("torchtpu_test::cpu_only_scale", 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r1 = _OP(x, 2.0)
        r2 = _OP(x, 3.0)
    fallback_warnings = [m for m in w if issubclass(m.category, torchtpu.TPUFallbackWarning)]
    assert len(fallback_warnings) == 1 and "torchtpu_test::cpu_only_scale" in str(fallback_warnings[0].message)
    assert r1.device.type == "tpu"
    torch.testing.assert_close(r1.cpu(), x.cpu() * 2)
    torch.testing.assert_close(r2.cpu(), x.cpu() * 3)
    assert metrics.snapshot()["cpu_fallbacks"]["torchtpu_test::cpu_only_scale"] == before + 2
    torchtpu.set_cpu_fallback(False)
    try:
        with pytest.raises(NotImplementedError, match="torchtpu_test::cpu_only_scale"):
            _OP(x, 2.0)
    finally:
        torchtpu.set_cpu_fallback(True)


def test_fallback_writes_back_inplace_results_through_views():
    src = torch.randn(4, 5)
    t = tpu(src.clone())
    view = t[1:3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _OP_INPLACE(view, 10.0)
    assert out is view
    expected = src.clone()
    expected[1:3] *= 10
    torch.testing.assert_close(t.cpu(), expected)


def test_execution_mode_api():
    assert torchtpu.get_execution_mode() == "strict_eager"
    with torchtpu.execution_mode("defer_and_fuse"):
        assert torchtpu.get_execution_mode() == "defer_and_fuse"
    assert torchtpu.get_execution_mode() == "strict_eager"
    with pytest.raises(ValueError, match="unknown execution mode 'fast'"):
        torchtpu.set_execution_mode("fast")


def test_execution_mode_env_var(tmp_path):
    import subprocess
    import sys

    code = "import torchtpu; print(torchtpu.get_execution_mode())"
    env = {"TORCHTPU_EXECUTION_MODE": "defer_and_fuse", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "defer_and_fuse", out.stderr


def test_import_freezes_the_import_time_objects_unless_turned_off():
    import gc
    import os
    import subprocess
    import sys

    if os.environ.get("TORCHTPU_GC_FREEZE", "1") not in ("0", "false", "False", ""):
        assert gc.get_freeze_count() > 100_000  # torch's and JAX's objects, out of full GC passes
    code = "import gc, torchtpu; print(gc.get_freeze_count())"
    env = {"TORCHTPU_GC_FREEZE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "0", out.stderr


def test_to_jax_from_jax_roundtrip_without_copy():
    import jax.numpy as jnp

    a = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    t = torchtpu.from_jax(a)
    assert t.device.type == "tpu" and t.shape == (2, 3) and t.dtype == torch.float32
    back = torchtpu.to_jax(t)
    assert back.unsafe_buffer_pointer() == a.unsafe_buffer_pointer()
    torch.testing.assert_close(t.cpu(), torch.arange(6.0).reshape(2, 3))
