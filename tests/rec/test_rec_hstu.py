"""HSTU and SASRec (torchtpu_rec/hstu.py) on tpu against the same modules on CPU: forward values and every
parameter's gradient (item table included), with no CPU fallback; the attention length is a bucket and a
second batch in the same buckets compiles nothing; and examples/hstu.py run as a user runs it, in a fresh
process with small flags (HSTU only, evaluated in the training batch's buckets)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import no_fallback

import torchtpu_rec  # noqa: F401  (fbgemm's jagged ops on tpu)
from torchtpu.bucketing import BucketPolicy
from torchtpu_rec.hstu import HSTU, SASRec

pytestmark = pytest.mark.timeout(300)

ITEMS = 50
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _batch(lengths, seed):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    total = int(lengths.sum())
    items = torch.randint(1, ITEMS, (total,), generator=g)
    # increasing timestamps per sequence, with gaps over several log buckets
    stamps = torch.randint(0, 5000, (total,), generator=g).cumsum(0)
    targets = torch.randint(0, ITEMS, (total,), generator=g)
    return KeyedJaggedTensor(keys=["item"], values=items, lengths=lengths), stamps, targets


def _model(cls):
    torch.manual_seed(0)
    model = cls(ITEMS, dim=16, heads=2, blocks=2, max_len=16,
                length_policy=BucketPolicy.pow2(4, 16, name="test_hstu_length"))
    with torch.no_grad():  # non-zero relative biases, so their gradients and their effect are checked
        for name, p in model.named_parameters():
            if name.endswith(("bias.position", "bias.time")):
                p.normal_(0, 0.3)
    return model


def _step(model, kjt, stamps, targets, device):
    logits = model(kjt.to(device), stamps.to(device))
    loss = torch.nn.functional.cross_entropy(logits, targets.to(device))
    loss.backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cls", [HSTU, SASRec])
def test_tpu_matches_cpu_values_and_grads(cls, tpu):
    cpu_model = _model(cls)
    tpu_model = copy.deepcopy(cpu_model).to(tpu)
    kjt, stamps, targets = _batch([5, 1, 9, 3], seed=1)  # longest 9: attention length bucket 16
    want, want_grads = _step(cpu_model, kjt, stamps, targets, "cpu")
    with no_fallback():
        got, got_grads = _step(tpu_model, kjt, stamps, targets, tpu)
        got = got.cpu()
    assert got.shape == want.shape == (kjt.values().numel(), ITEMS)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        assert g is not None and got_grads[name] is not None, name
        assert got_grads[name].device.type == "tpu", name
        torch.testing.assert_close(got_grads[name].cpu(), g, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    if cls is HSTU:  # the relative biases take part: their gradients are not zero
        assert float(want_grads["blocks.0.bias.position"].abs().sum()) > 0
        assert float(want_grads["blocks.0.bias.time"].abs().sum()) > 0


def test_same_buckets_compile_once(tpu, metrics):
    model = _model(HSTU).to(tpu)
    kjt, stamps, targets = _batch([5, 1, 9, 3], seed=2)
    _step(model, kjt, stamps, targets, tpu)[0].cpu()
    compiles = metrics.snapshot()["compiles"]
    # other lengths, the same total (18) and attention bucket (longest 10 -> 16); fresh gradients, as
    # optimizer.zero_grad() leaves them
    model.zero_grad(set_to_none=True)
    kjt, stamps, targets = _batch([10, 2, 3, 3], seed=4)
    logits, _ = _step(model, kjt, stamps, targets, tpu)
    logits.cpu()
    assert metrics.snapshot()["compiles"] == compiles


def test_attention_length_is_the_bucket_of_the_longest(tpu):
    # a sequence longer than max_length is cut there (its later rows see only the first max_length rows):
    # the rows within the bucket are the same as with a bucket holding the whole batch
    model = _model(HSTU).to(tpu)
    kjt, stamps, _ = _batch([3, 2], seed=4)
    with torch.no_grad():
        auto = model(kjt.to(tpu), stamps.to(tpu)).cpu()  # bucket 4
        wide = model(kjt.to(tpu), stamps.to(tpu), max_length=16).cpu()
    torch.testing.assert_close(auto, wide, atol=1e-5, rtol=1e-5)


def test_example_runs_as_a_user_runs_it(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MASTER_PORT": str(20000 + os.getpid() % 20000)}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "hstu.py"), "--out", str(out),
                           "--steps", "3", "--users", "40", "--items", "60", "--max-len", "12",
                           "--batch-size", "16", "--eval-batch-size", "16", "--models", "hstu"],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    # SASRec is left to the tpu-vs-CPU test above: its compiles would double this run's time
    assert set(metrics["summary"]) == {"hstu", "chance_hr@10"}
    for name in ("hstu",):
        r = metrics["results"][name]
        assert len(r["loss"]) == 3 and all(0 < x < 20 for x in r["loss"]), r["loss"]
        assert 0 <= r["ndcg@10"] <= r["hr@10"] <= 1
    assert (out / "hstu.png").stat().st_size > 1000
    assert (out / "ratings.dat").exists()


def test_example_refuses_bad_flags(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "hstu.py"), "--out", str(tmp_path),
                           "--min-len", "2"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 2 and "--min-len" in proc.stderr
