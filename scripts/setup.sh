#!/usr/bin/env bash
# Creates .venv (project-local) and installs torchtpu, every extra the suite needs, at the tested versions
# (constraints.txt; pyproject.toml has the compatible ranges).
# Idempotent: skips the install when pyproject.toml has not changed since the last one.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.torchtpu-installed
want=$(sha256sum pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
# the tpu's C++ PrivateUse1 hooks (pinned host memory for DDP's static graph, pin_memory()):
# torchtpu/runtime/pinned.py; a no-op when built. Without a compiler torchtpu still works, without them.
build_hooks() {
  .venv/bin/python -c "from torchtpu.runtime import pinned; pinned.build()" \
    || echo "setup.sh: torchtpu's C++ hooks did not build (g++ and ninja needed): no pinned memory, no DDP static_graph" >&2
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  build_hooks
  exit 0
fi
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip setuptools wheel
# torch first, exactly pinned: a looser spec resolves to a multi-GB CUDA build
pip install -q "torch==2.13.0"
pip install -q -c constraints.txt -e ".[test,rl,rec,ray]"
# torchrec's metadata asks for the CUDA fbgemm-gpu; its real needs are the [rec] extra
pip install -q -c constraints.txt --no-deps "torchrec==1.8.0"
.venv/bin/python -c "import torch, jax, torchrec, ray, torchtpu; assert torch.__version__.startswith('2.13.0')"
# every requirement met but one: torchrec's unversioned "fbgemm-gpu", which on PyPI is the CUDA build;
# the CPU build it needs here is "fbgemm-gpu-cpu" (same module, another distribution name). Anything else fails.
check=$(pip check 2>&1 || true)
others=$(printf '%s\n' "$check" | grep -v -e '^No broken requirements found' -e '^torchrec [0-9.]* requires fbgemm-gpu, which is not installed' -e '^$' || true)
if [ -n "$others" ]; then
  echo "setup.sh: pip check found broken requirements:" >&2
  echo "$others" >&2
  exit 1
fi
build_hooks
echo "$want" > "$stamp"
