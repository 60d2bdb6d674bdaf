"""A missing or mismatched torchrec / FBGEMM is one ImportError that names the fix."""

from __future__ import annotations

import pytest

from torchtpu_rec import _requirements


def test_installed_stack_passes():
    _requirements.check()


@pytest.mark.parametrize("versions,msg", [
    ({"torchrec": None}, "torchrec is not installed"),
    ({"torchrec": "1.9.0"}, "torchrec 1.9.0 is installed"),
    ({"fbgemm-gpu-cpu": None, "fbgemm-gpu": None}, "FBGEMM (fbgemm-gpu-cpu) is not installed"),
    ({"fbgemm-gpu-cpu": "1.9.0"}, "FBGEMM 1.9.0 is installed"),
])
def test_missing_or_mismatched_names_the_fix(monkeypatch, versions, msg):
    real = _requirements._version
    monkeypatch.setattr(_requirements, "_version", lambda d: versions[d] if d in versions else real(d))
    with pytest.raises(ImportError) as e:
        _requirements.check()
    assert msg in str(e.value) and "--no-deps" in str(e.value) and "torchrec==1.8.0" in str(e.value)
