"""Importing torchtpu and then what imports torchao (peft, transformers.TrainingArguments) prints none of
the two known harmless third-party log lines; other messages of those loggers still print."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torchao")

CHILD = ("import logging, torchtpu, torchao, peft, transformers; transformers.TrainingArguments; "
         "logging.getLogger('torchao').warning('torchao says something else')")


def _stderr(**env):
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stderr


def test_known_lines_are_filtered_and_nothing_else():
    quiet = _stderr()
    assert "Failed to load" not in quiet and "is an Enum subclass" not in quiet, quiet
    assert "torchao says something else" in quiet
    loud = _stderr(TORCHTPU_SHOW_THIRD_PARTY_WARNINGS="1")
    assert "Failed to load" in loud or "is an Enum subclass" in loud, "the lines the filter hides no longer appear"
