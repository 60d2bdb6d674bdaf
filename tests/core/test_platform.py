"""Platform selection and reporting (torchtpu/base/platform.py) on XLA's CPU backend:
TORCHTPU_PLATFORM, torch.tpu.get_device_name / get_device_properties, and the one
warning when an accelerator runtime is installed but the device fell back to CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torchtpu  # noqa: F401


def test_reporting_on_the_cpu_backend_chosen_on_purpose():
    assert os.environ["TORCHTPU_PLATFORM"] == "cpu"  # tests/conftest.py
    assert torch.tpu.is_available()
    name = torch.tpu.get_device_name()
    assert name.startswith("XLA CPU") and name == torch.tpu.get_device_name(0)
    p = torch.tpu.get_device_properties("tpu:0")
    assert p.platform == "cpu" and p.name == name and p.local_device_count >= 1 and p.process_index == 0
    assert p.total_memory == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert torch.tpu.mem_get_info()[1] == p.total_memory
    with pytest.raises(RuntimeError, match="device index 1 is not available"):
        torch.tpu.get_device_properties(1)


def _python(code, env_extra, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "TORCHTPU_PLATFORM"}
    env.update(env_extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)


def test_fell_back_to_cpu_with_an_accelerator_runtime_installed_warns_once(tmp_path):
    # libtpu's distribution metadata on the path, as `pip install torchtpu[tpu]` leaves it on a
    # machine without a TPU (JAX finds no TPU, the device is XLA's CPU backend)
    meta = tmp_path / "libtpu-0.0.42.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: libtpu\nVersion: 0.0.42.1\n")
    code = ("import torch, torchtpu; x = torch.ones(2, device='tpu') + 1; "
            "print('RESULT', torch.tpu.is_available(), torch.tpu.get_device_properties().platform, x.sum().item())")
    out = _python(code, {}, str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("RESULT", 1)[1].split() == ["True", "cpu", "4.0"]
    warned = [ln for ln in out.stderr.splitlines() if "support is installed but no such device" in ln]
    assert len(warned) == 1 and "tpu support" in warned[0], out.stderr[-2000:]
    # nothing installed: no warning (this process also runs with the persistent compilation cache off)
    out = _python(code + "; print('CACHE', torchtpu.metrics.snapshot()['cache']['persistent_dir'])",
                  {"TORCHTPU_CACHE_DIR": "0"})
    assert out.returncode == 0 and "support is installed" not in out.stderr
    assert out.stdout.split("CACHE", 1)[1].split() == ["None"]


@pytest.mark.parametrize("value, message", [
    ("tpu", "TORCHTPU_PLATFORM=tpu, but JAX cannot start that platform"),
    ("quantum", "TORCHTPU_PLATFORM='quantum': choose tpu, cuda or cpu"),
])
def test_a_platform_that_cannot_start_fails_at_import_naming_the_setting(value, message):
    out = _python("import torchtpu", {"TORCHTPU_PLATFORM": value})
    assert out.returncode != 0 and "PlatformError" in out.stderr and message in out.stderr, out.stderr[-2000:]
