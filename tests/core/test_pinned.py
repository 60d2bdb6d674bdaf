"""Pinned host memory of the tpu (torchtpu/runtime/pinned.py, torchtpu/csrc/pinned_hooks.cpp).

The C++ PrivateUse1 hooks give ``pin_memory()`` / ``empty(..., pin_memory=True)`` an allocator of
their own and ``is_pinned()`` its answer; DDP's static_graph and find_unused_parameters rely on
both (their training parity is in test_distributed.py). Without the hooks (no compiler, or
``TORCHTPU_PINNED_HOOKS=0``) the Python hooks keep everything else working.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import torch

from torchtpu.runtime import pinned


def test_hooks_are_built_and_active():
    # scripts/setup.sh builds them; a machine with g++ and ninja must have them
    assert os.path.exists(pinned.library_path()), "run scripts/setup.sh (it builds torchtpu/csrc/pinned_hooks.cpp)"
    assert pinned.pinned_hooks_active()


def test_pinned_blocks():
    before = pinned.stats()
    c = torch.arange(6.0).reshape(2, 3)
    p = c.pin_memory()
    assert p.device.type == "cpu" and torch.equal(p, c) and p.data_ptr() != c.data_ptr()
    assert p.is_pinned() and not c.is_pinned()
    assert p[1:].is_pinned()  # an address inside a block
    e = torch.empty(5, 7, pin_memory=True)
    z = torch.zeros(3, dtype=torch.bfloat16, pin_memory=True)
    assert e.is_pinned() and z.is_pinned() and not torch.empty(5, 7).is_pinned()
    s = pinned.stats()
    assert s["blocks"] == before["blocks"] + 3 and s["allocations"] == before["allocations"] + 3
    assert s["bytes"] >= before["bytes"] + 3 * 4096  # whole pages: mlock never shares one between blocks
    torch.testing.assert_close(p.to("tpu", non_blocking=True).cpu(), c)
    del p, e, z
    after = pinned.stats()
    assert (after["blocks"], after["bytes"], after["locked_bytes"]) == (
        before["blocks"], before["bytes"], before["locked_bytes"])


def test_page_locking_stays_within_rlimit_memlock():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = float("inf") if soft == resource.RLIM_INFINITY else soft
    size = 64 << 20 if limit == float("inf") else int(limit) + (1 << 20)
    big = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    s = pinned.stats()
    assert big.is_pinned() and s["locked_bytes"] <= limit
    if limit == float("inf"):
        assert s["locked_bytes"] >= size
    del big


def test_dataloader_pin_memory():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
                                         pin_memory=True)
    batches = [b[0] for b in loader]
    assert all(b.is_pinned() for b in batches)
    torch.testing.assert_close(torch.cat([b.to("tpu", non_blocking=True) for b in batches]).cpu(), torch.arange(8.0))


_WITHOUT_HOOKS = r"""
import datetime, socket
import torch, torch.distributed as dist, torch.nn as nn
import torchtpu
from torchtpu.runtime import pinned

assert not pinned.pinned_hooks_active()
c = torch.arange(4.0)
p = c.pin_memory()  # the ordinary copy pin_memory promises
assert torch.equal(p, c) and p.data_ptr() != c.data_ptr() and not p.is_pinned()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1).to("tpu"), static_graph=True)
try:
    model(torch.ones(2, 3, device="tpu")).sum().backward()
except NotImplementedError as e:
    assert "getPinnedMemoryAllocator" in str(e), e
else:
    raise AssertionError("DDP(static_graph=True) without pinned memory must fail in its backward")
dist.destroy_process_group()
print("OK")
"""


def test_without_cpp_hooks():
    env = dict(os.environ, TORCHTPU_PINNED_HOOKS="0")
    r = subprocess.run([sys.executable, "-c", _WITHOUT_HOOKS], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_pin_memory_of_any_layout_and_the_device_check():
    t = torch.arange(24.0).reshape(4, 6).t()  # dense, not contiguous: its strides are kept
    p = t.pin_memory()
    assert p.is_pinned() and p.stride() == t.stride() and torch.equal(p, t)
    for odd in (t[:, ::2], torch.arange(3.0).expand(4, 3), torch.empty(0)):
        q = odd.pin_memory()
        assert q.is_pinned() and torch.equal(q, odd)
    for bad, match in (("tpu:1", "device index 1"), ("cpu", "accelerator is tpu")):
        try:
            t.pin_memory(bad)
        except RuntimeError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"pin_memory({bad!r}) must raise")
