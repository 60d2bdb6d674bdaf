"""Checkpoint files: private, fsync'd and atomic (torchtpu_rl.checkpoint.atomic_save), and a writer
SIGKILLed in the middle of a save leaves the last complete checkpoint to resume from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from torchtpu_rl.checkpoint import atomic_save

pytestmark = pytest.mark.timeout(300)


def _tmp_files(d):
    return sorted(f for f in os.listdir(d) if ".tmp." in f)


def test_atomic_save_is_private_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "ck" / "state.pt"
    atomic_save({"w": torch.arange(6.0)}, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert torch.equal(torch.load(path)["w"], torch.arange(6.0))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save({"w": torch.zeros(3), "bad": Unpicklable()}, path)
    assert _tmp_files(path.parent) == []  # the torn temporary file went with the failure
    assert torch.equal(torch.load(path)["w"], torch.arange(6.0))  # the previous checkpoint is untouched


WRITER = textwrap.dedent("""
    import sys, torch
    from torchtpu_rl.checkpoint import atomic_save
    path = sys.argv[1]
    big = torch.randn(16 * 1024 * 1024 // 4)  # 16 MB: a save takes long enough to be killed inside it
    for step in range(1, 1000):
        print("writing", step, flush=True)
        atomic_save({"step": step, "w": big + step}, path)
        print("saved", step, flush=True)
""")


def test_writer_killed_mid_checkpoint_resumes_from_the_last_complete_one(tmp_path):
    path = tmp_path / "run" / "ckpt.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    saved = 0
    try:
        for line in w.stdout:
            kind, step = line.split()
            if kind == "saved":
                saved = int(step)
            if kind == "writing" and int(step) == 3:
                os.kill(w.pid, signal.SIGKILL)  # inside the third save
                break
    finally:
        w.kill()
        w.wait()
    assert saved == 2
    # the file under the real name is a complete checkpoint: the 2nd, or the 3rd if it finished first
    state = torch.load(path)
    assert state["step"] in (2, 3)
    # resume: the next save succeeds and takes away what the killed writer left behind
    atomic_save({"step": state["step"] + 1, "w": state["w"]}, path)
    assert _tmp_files(path.parent) == []
    assert torch.load(path)["step"] == state["step"] + 1
