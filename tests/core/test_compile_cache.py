"""The persistent compilation cache (torchtpu/base/xla_cache.py), on by default: a second fresh
process running the same steps in all three modes makes zero new XLA compilations; the cache
statistics and report in torchtpu.metrics; TORCHTPU_CACHE_DIR moves or disables it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchtpu
from torchtpu.base import xla_cache

_CHILD = r"""
import json
import torch, torchtpu
from torchtpu_models import TinyTransformer, TransformerConfig

torch.manual_seed(0)
m = TinyTransformer(TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)).to("tpu")
opt = torch.optim.SGD(m.parameters(), lr=0.1)
ids = torch.randint(0, 32, (2, 9))
x, y = ids[:, :-1].to("tpu"), ids[:, 1:].to("tpu")
losses = []
for mode in ("strict_eager", "defer_and_fuse", "compiled"):
    step = torch.compile(m.loss, backend="tpu") if mode == "compiled" else m.loss
    with torchtpu.execution_mode("strict_eager" if mode == "compiled" else mode):
        for _ in range(2):
            loss = step(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            torchtpu.metrics.mark_step()
print("RESULT" + json.dumps({"cache": torchtpu.metrics.snapshot()["cache"], "losses": losses,
                             "report": torchtpu.metrics.report()}))
"""


def _child(cache_dir):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_a_second_fresh_process_compiles_nothing(tmp_path):
    cold = _child(str(tmp_path))
    c = cold["cache"]
    assert c["persistent_dir"] == str(tmp_path)
    assert c["xla_compiles"] > 10 and c["compile_s"] > 0 and c["hits"] == 0
    assert any(k.startswith("fused graph from") for k in c["compile_s_by_graph"])
    assert any(k.startswith("compiled graph") for k in c["compile_s_by_graph"])
    # DeferAndFuse and compiled steps run one or two graphs each (per-op kernels are not graphs)
    assert c["unique_graphs_per_step"][:2] == [0, 0] and all(1 <= n <= 3 for n in c["unique_graphs_per_step"][2:])

    warm = _child(str(tmp_path))
    w = warm["cache"]
    assert w["xla_compiles"] == 0, warm["report"]
    assert w["hits"] == w["requests"] == c["requests"] and w["hit_rate"] == 1.0
    assert w["load_s"] > 0 and w["compile_s"] == 0
    assert warm["losses"] == cold["losses"]  # the loaded executables compute the same values
    assert "persistent cache: " in warm["report"] and "100.0%" in warm["report"]


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHTPU_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert xla_cache.default_cache_dir() == os.path.join(str(tmp_path), "torchtpu", "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert xla_cache.default_cache_dir() == os.path.join(str(tmp_path), "home", ".cache", "torchtpu", "xla")
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "moved"))
    assert xla_cache.default_cache_dir() == str(tmp_path / "moved")
    for off in ("", "0"):
        monkeypatch.setenv("TORCHTPU_CACHE_DIR", off)
        assert xla_cache.default_cache_dir() is None


def test_tests_use_a_session_cache_not_the_users():
    d = torchtpu.metrics.snapshot()["cache"]["persistent_dir"]
    assert d is not None and os.path.basename(d).startswith("torchtpu_test_xla_")
    assert not d.startswith(os.path.expanduser("~/.cache"))


def test_report_in_process(metrics):
    (torch.arange(5.0, device="tpu") * 3).sum().item()
    metrics.mark_step()
    text = metrics.report()
    assert "persistent cache:" in text and "new XLA compiles:" in text and "unique graphs per step" in text
    c = metrics.snapshot()["cache"]
    assert c["executable_lookups"] >= 2 and c["unique_graphs_per_step"] == [0]


_CAPPED_CHILD = r"""
import torch, torchtpu
for n in range(1, 41):  # 40 distinct executables (one shape each)
    (torch.arange(float(n), device="tpu") * 3 + 1).sum().item()
"""


def _dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def test_cache_is_private_and_capped_least_recently_used_first(tmp_path):
    uncapped, capped = tmp_path / "all", tmp_path / "capped"
    for d, cap in ((uncapped, "-1"), (capped, "64K")):
        env = dict(os.environ, TORCHTPU_CACHE_DIR=str(d), TORCHTPU_CACHE_MAX_SIZE=cap)
        out = subprocess.run([sys.executable, "-c", _CAPPED_CHILD], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert os.stat(d).st_mode & 0o777 == 0o700
    full = _dir_bytes(uncapped)
    assert full > 64 * 1024, f"the uncapped cache holds only {full} bytes: the cap would not be exercised"
    def entries(d):  # the executables (JAX keeps an access-time file and a lock beside them)
        return [f for f in os.listdir(d) if not f.endswith(("-atime", ".lock"))]

    kept = entries(capped)
    assert sum(os.path.getsize(capped / f) for f in kept) <= 64 * 1024
    assert 0 < len(kept) < len(entries(uncapped))


def test_cache_size_setting_is_checked(monkeypatch):
    assert xla_cache.parse_size("512M") == 512 * 1024**2 and xla_cache.parse_size("-1") == -1
    monkeypatch.setenv("TORCHTPU_CACHE_MAX_SIZE", "lots")
    with pytest.raises(ValueError, match="TORCHTPU_CACHE_MAX_SIZE='lots'"):
        xla_cache.default_max_size()
    monkeypatch.delenv("TORCHTPU_CACHE_MAX_SIZE")
    assert xla_cache.default_max_size() == xla_cache.DEFAULT_MAX_SIZE


_STATS_CHILD = r"""
import json, torch, torchtpu
(torch.arange(6.0, device="tpu") * 5).sum().item()
print("RESULT" + json.dumps(torchtpu.cache_stats()))
"""


def test_torchtpu_cache_root_names_and_cache_stats(monkeypatch, tmp_path):
    # Google TorchTPU's tier-3 root is our cache directory (public name over internal; ours over both)
    for k in ("TORCHTPU_CACHE_DIR", *xla_cache.TORCHTPU_CACHE_ROOT_NAMES):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT", str(tmp_path / "internal"))
    assert xla_cache.default_cache_dir() == str(tmp_path / "internal")
    monkeypatch.setenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", str(tmp_path / "tier3"))
    assert xla_cache.default_cache_dir() == str(tmp_path / "tier3")
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "ours"))
    assert xla_cache.default_cache_dir() == str(tmp_path / "ours")
    monkeypatch.delenv("TORCHTPU_CACHE_DIR")
    monkeypatch.setenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "gs://bucket/cache")
    with pytest.raises(ValueError, match="TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT='gs://bucket/cache'.*local"):
        xla_cache.default_cache_dir()
    # a fresh process given only TorchTPU's name caches there, and cache_stats() counts it: cold, then warm
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHTPU_CACHE_DIR", *xla_cache.TORCHTPU_CACHE_ROOT_NAMES)}
    env["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] = str(tmp_path / "tier3")
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _STATS_CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):]))
    cold, warm = runs
    assert cold["dir"] == warm["dir"] == str(tmp_path / "tier3")
    assert cold["entries"] > 0 and cold["bytes"] > 0 and cold["hits"] == 0 and cold["misses"] == cold["requests"] > 0
    assert warm["entries"] == cold["entries"] and warm["hits"] == warm["requests"] == cold["requests"]
    assert warm["misses"] == 0 and warm["hit_rate"] == 1.0 and warm["max_bytes"] == xla_cache.DEFAULT_MAX_SIZE
    # in this process: the session's cache
    s = torchtpu.cache_stats()
    assert s["dir"] == torchtpu.metrics.snapshot()["cache"]["persistent_dir"] and s["entries"] >= 0
