"""torchtpu_rec needs torchrec 1.8 and FBGEMM's CPU build 1.8 (the pair measured with torch 2.13).

torchrec's own metadata asks for the CUDA ``fbgemm-gpu``, so a plain ``pip install torchtpu[rec]`` cannot
bring it in; this check turns a missing or mismatched install into one error that says what to run,
instead of an ImportError or an undefined symbol deep inside torchrec.
"""

from __future__ import annotations

from importlib import metadata

TORCHREC = "1.8"
FBGEMM = "1.8"
FIX = ('pip install "torchtpu[rec]" -c constraints.txt && pip install --no-deps "torchrec==1.8.0" '
       "(what scripts/setup.sh does)")


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check() -> None:
    """Raise an ImportError naming the fix when torchrec or FBGEMM is missing or of another version."""
    problems = []
    rec = _version("torchrec")
    if rec is None:
        problems.append("torchrec is not installed")
    elif not rec.startswith(TORCHREC + "."):
        problems.append(f"torchrec {rec} is installed, torchtpu_rec is built for {TORCHREC}.x")
    fb = _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu")
    if fb is None:
        problems.append("FBGEMM (fbgemm-gpu-cpu) is not installed")
    elif not fb.startswith(FBGEMM + "."):
        problems.append(f"FBGEMM {fb} is installed; torch 2.13 loads only {FBGEMM}.x (others fail with undefined "
                        "symbols)")
    if problems:
        raise ImportError("torchtpu_rec: " + "; ".join(problems) + ". Fix: " + FIX)
