"""Device-side index checks (torchtpu/runtime/checks.py): an out-of-range index raises
``DeviceIndexError`` (an ``IndexError``) naming the op and the user line that issued it, at the
next point the host waits, in Strict Eager, DeferAndFuse and torch.compile(backend="tpu");
``TORCHTPU_INDEX_CHECKS=0`` turns the checks off; ``TORCHTPU_LAUNCH_BLOCKING=1`` raises at the op."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchtpu

HERE = os.path.abspath(__file__)


def _line_of(marker: str) -> int:
    """The line of this file that carries ``marker`` (the op whose error is expected to name it)."""
    with open(HERE) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def _embed(ids):
    table = torch.arange(20.0, device="tpu").reshape(10, 2)
    return torch.nn.functional.embedding(ids, table)  # <embedding issued here>


def _gather(x, i):
    return x.gather(0, i) + 1  # <gather issued here>


def _scatter_add(x, i):
    return x.scatter_add(0, i, torch.ones(i.shape, device="tpu"))  # <scatter issued here>


def _index(x, i):
    return x[i] * 2  # <index issued here>


def _index_add(x, i):
    return x.index_add(0, i, torch.ones(i.shape, device="tpu"))  # <index_add issued here>


def _index_select(x, i):
    return x.index_select(0, i)  # <index_select issued here>


CASES = {  # name: (fn, args on tpu, the op named, the marker of the issuing line)
    "embedding": (_embed, lambda: (torch.tensor([1, 12], device="tpu"),), "embedding", "<embedding issued here>"),
    "gather": (_gather, lambda: (torch.zeros(4, device="tpu"), torch.tensor([0, 9], device="tpu")), "gather",
               "<gather issued here>"),
    "scatter_add": (_scatter_add, lambda: (torch.zeros(4, device="tpu"), torch.tensor([4], device="tpu")),
                    "scatter_add", "<scatter issued here>"),
    "index": (_index, lambda: (torch.zeros(4, device="tpu"), torch.tensor([7], device="tpu")), "index",
              "<index issued here>"),
    "index_add": (_index_add, lambda: (torch.zeros(4, device="tpu"), torch.tensor([-1], device="tpu")), "index_add",
                  "<index_add issued here>"),
    "index_select": (_index_select, lambda: (torch.zeros(4, device="tpu"), torch.tensor([4], device="tpu")),
                     "index_select", "<index_select issued here>"),
}
MODES = ["strict_eager", "defer_and_fuse", "compiled"]


def _run_mode(mode, fn, args):
    if mode == "compiled":
        torch._dynamo.reset()
        return torch.compile(fn, backend="tpu")(*args)
    with torchtpu.execution_mode(mode):
        return fn(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_out_of_range_index_raises_at_the_next_host_wait(case, mode):
    fn, make_args, op, marker = CASES[case]
    out = _run_mode(mode, fn, make_args())  # the op itself does not wait for the device
    with pytest.raises(IndexError) as info:
        out.sum().item()
    msg = str(info.value)
    assert isinstance(info.value, torchtpu.DeviceIndexError)
    assert f"aten::{op}" in msg, msg
    assert f"{HERE}:{_line_of(marker)}" in msg, msg
    # reported once: the next read is clean, and the device keeps working
    assert torch.arange(3.0, device="tpu").sum().item() == 3.0


def test_in_range_indices_and_negative_ones_where_pytorch_takes_them():
    x = torch.arange(4.0, device="tpu")
    i = torch.tensor([-1, 0, 3], device="tpu")
    assert x[i].tolist() == [3.0, 0.0, 3.0]
    assert x.take(i).tolist() == [3.0, 0.0, 3.0]
    torch.tpu.synchronize()


def test_synchronize_is_a_wait_point_and_names_the_first_bad_op():
    x = torch.zeros(4, device="tpu")
    x.gather(0, torch.tensor([5], device="tpu"))  # <first bad op>
    x.index_select(0, torch.tensor([6], device="tpu"))
    with pytest.raises(IndexError, match="index 5 is out of bounds") as info:
        torch.tpu.synchronize()
    assert f"{HERE}:{_line_of('<first bad op>')}" in str(info.value)
    torch.tpu.synchronize()  # the later failure went with the first


def test_training_step_backward_through_a_bad_embedding_raises_at_item():
    emb = torch.nn.Embedding(10, 3).to("tpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with torchtpu.execution_mode("defer_and_fuse"):
        loss = emb(torch.tensor([[1, 2], [3, 10]], device="tpu")).pow(2).sum()  # <bad step>
        loss.backward()
        opt.step()
        with pytest.raises(IndexError, match="index out of range in self") as info:
            loss.item()
    assert f"{HERE}:{_line_of('<bad step>')}" in str(info.value)


_CHILD = r"""
import json, sys, traceback
import torch, torchtpu
sys.path.insert(0, {tests!r})
import test_index_checks as m
res = {{}}
for mode in m.MODES:
    for case, (fn, make_args, op, marker) in m.CASES.items():
        args = make_args()
        try:
            out = m._run_mode(mode, fn, args)
        except IndexError as e:
            res[mode + "/" + case] = ["at_op", str(e)]
            continue
        try:
            v = out.float().sum().item()
            res[mode + "/" + case] = ["value", repr(v)]
        except IndexError as e:
            res[mode + "/" + case] = ["at_read", str(e)]
print("RESULT" + json.dumps(res))
"""


def _child(env_extra):
    env = dict(os.environ, **env_extra)
    code = _CHILD.format(tests=os.path.dirname(HERE))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_launch_blocking_raises_at_the_op_itself_in_every_mode():
    res = _child({"TORCHTPU_LAUNCH_BLOCKING": "1"})
    for mode in MODES:
        for case, (_, _, op, marker) in CASES.items():
            how, msg = res[f"{mode}/{case}"]
            assert how == "at_op", (mode, case, how, msg)
            assert f"aten::{op}" in msg and f"{HERE}:{_line_of(marker)}" in msg, (mode, case, msg)


def test_index_checks_off_reads_fill_values_and_raises_nothing():
    res = _child({"TORCHTPU_INDEX_CHECKS": "0"})
    for key, (how, value) in res.items():
        assert how == "value", (key, how, value)
    # gathers read the fill value (NaN for floats), never a valid element
    assert res["strict_eager/embedding"][1] == "nan" and res["compiled/gather"][1] == "nan"
