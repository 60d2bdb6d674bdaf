"""CUDA idioms on tpu with torch.cuda's semantics, and Google TorchTPU's environment variables."""

import os
import subprocess
import sys

import pytest
import torch

import torchtpu


def test_event_elapsed_time():
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record()
    x = torch.randn(64, 64, device="tpu")
    (x @ x).sum()
    end.record()
    ms = start.elapsed_time(end)
    assert isinstance(ms, float) and ms >= 0.0
    assert end.query()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        torch.tpu.Event().elapsed_time(end)
    with pytest.raises(RuntimeError, match="must be recorded"):
        torch.tpu.Event(enable_timing=True).elapsed_time(end)
    # the stream's own record_event gives the same kind of event
    assert isinstance(torch.tpu.current_stream().record_event(), torch.tpu.Event)


def test_rng_state_all_round_trips():
    states = torch.tpu.get_rng_state_all()
    assert len(states) == torch.tpu.device_count() == 1
    a = torch.randn(4, device="tpu").cpu()
    torch.tpu.set_rng_state_all(states)
    torch.testing.assert_close(torch.randn(4, device="tpu").cpu(), a)


def test_device_capability_is_a_pair_of_ints():
    cap = torch.tpu.get_device_capability()
    assert isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(c, int) for c in cap)
    if torch.tpu.get_device_properties().platform == "cpu":
        assert cap == (0, 0)


def test_memory_summary_reports_allocations():
    keep = torch.ones(1 << 20, device="tpu")  # 4 MiB
    s = torch.tpu.memory_summary()
    assert "Allocated memory" in s and "device ID 0" in s
    assert torch.tpu.memory_stats()["allocated_bytes.all.current"] >= keep.numel() * 4


def test_per_process_memory_fraction_caps_allocations():
    assert torch.tpu.get_per_process_memory_fraction() == 1.0
    _, total = torch.tpu.mem_get_info()
    try:
        torch.tpu.set_per_process_memory_fraction(0.0)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            torch.empty(1024, device="tpu")
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
    torch.empty(1024, device="tpu")
    with pytest.raises(ValueError):
        torch.tpu.set_per_process_memory_fraction(1.5)
    with pytest.raises(TypeError):
        torch.tpu.set_per_process_memory_fraction(1)
    assert total > 0


def _child(code, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("TORCHTPU_EXECUTION_MODE", "TORCHTPU_LAUNCH_BLOCKING")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", "import torch, torchtpu\n" + code], env=e, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_torchtpu_environment_variables_are_honoured():
    code = ("from torchtpu.runtime import checks\n"
            "print(torchtpu.get_execution_mode(), checks.LAUNCH_BLOCKING)")
    assert _child(code) == "strict_eager False"
    assert _child(code, TORCH_TPU_DEFER_AND_FUSE="1", TPU_LAUNCH_BLOCKING="1") == "defer_and_fuse True"
    # ours wins where both name the same setting
    assert _child(code, TORCH_TPU_DEFER_AND_FUSE="1", TORCHTPU_EXECUTION_MODE="strict_eager",
                  TPU_LAUNCH_BLOCKING="1", TORCHTPU_LAUNCH_BLOCKING="0") == "strict_eager False"


def test_tpu_dist_is_the_tpu_backend():
    import torch.distributed as dist

    assert {"tpu", "tpu_dist"} <= set(dist.Backend.backend_list)
    assert torchtpu.distributed.backend.ALIAS == "tpu_dist"
