"""The C++ part of the Strict Eager hit path (runtime/native.py, csrc/fast_dispatch.cpp) against the
Python path it replaces: the tensors they make are alike in everything torch and torchtpu look at,
and a program of views, in-place writes through views, broadcasting, casts and indexing gives the
same values on both paths (``TORCHTPU_FAST_DISPATCH=0`` selects the Python path) as on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.runtime import native, storage

needs_build = pytest.mark.skipif(native.MODULE is None, reason="the C++ fast path is not built (scripts/setup.sh) "
                                 "or TORCHTPU_FAST_DISPATCH=0")


def _made_both_ways(monkeypatch, size, stride, dtype):
    from torchtpu.base import dtypes

    numel = storage._layout.storage_numel(size, stride, 0)
    buf = storage.to_device(dtypes.cpu_tensor_to_numpy(torch.arange(numel).to(dtype)))
    nbytes = buf.size * dtype.itemsize
    native_t = storage.new_output(size, stride, nbytes, dtype, buf)
    monkeypatch.setattr(storage, "_native_make_tensor", None)
    python_t = storage.new_output(size, stride, nbytes, dtype, buf)
    return native_t, python_t


@needs_build
@pytest.mark.parametrize("size,stride,dtype", [((3, 4), (4, 1), torch.float32), ((2, 3), (1, 2), torch.int64),
                                               ((), (), torch.bfloat16), ((0, 5), (5, 1), torch.float32)])
def test_native_tensor_is_the_python_one(monkeypatch, size, stride, dtype):
    a, b = _made_both_ways(monkeypatch, size, stride, dtype)
    for t in (a, b):
        assert t.device == torch.device("tpu", 0) and t.dtype == dtype
        assert tuple(t.shape) == size and t.stride() == stride and t.storage_offset() == 0
    assert torch._C._dispatch_keys(a) == torch._C._dispatch_keys(b)
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # distinct fake addresses
    assert (a.is_leaf, a.requires_grad, a._version, a.is_contiguous()) == (b.is_leaf, b.requires_grad, b._version,
                                                                        b.is_contiguous())
    torch.testing.assert_close(a.cpu(), b.cpu())
    if a.numel() and dtype.is_floating_point:  # views alias the storage; the version counter is shared
        v = a.view(-1)[1:]
        v.add_(1)
        assert a._version == v._version == 1
        torch.testing.assert_close(a.cpu().reshape(-1)[1:], b.cpu().reshape(-1)[1:] + 1)
        a.requires_grad_(True)
        (a * a).sum().backward()
        torch.testing.assert_close(a.grad.cpu(), 2 * a.detach().cpu())


_PROGRAM = r"""
import json, torch, torchtpu
from torchtpu.runtime import native
g = torch.Generator().manual_seed(0)
def run(dev):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)).to(dev)
    idx = torch.tensor([4, 0, 2]).to(dev)
    y = x.t()[1:4] * 2 + x[:3, :5].t().sum(1)     # views, broadcasting
    y[:, ::2].add_(1)                               # in place through a strided view
    z = y.to(torch.float64).exp().to(torch.bfloat16).float()  # casts
    w = x.index_select(0, idx) + x[idx, 1:2]         # indexing
    out = torch.empty(3, 6, device=dev)
    torch.mul(w, 3, out=out)                         # out=
    return [t.cpu().tolist() for t in (y, z, w, out)]
print(json.dumps({"active": native.active(), "tpu": run("tpu"), "cpu": run("cpu")}))
"""


@pytest.mark.parametrize("fast", ["0", "1"])
def test_both_paths_agree_with_cpu(fast):
    if fast == "1" and native.MODULE is None:
        pytest.skip("the C++ fast path is not built")
    env = dict(os.environ, TORCHTPU_FAST_DISPATCH=fast)
    res = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["active"] is (fast == "1")
    for got, want in zip(data["tpu"], data["cpu"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-2, atol=1e-2)
