"""examples/dlrm.py takes torchrec_dlrm's (dlrm_main.py) flag names beside its own: parsed to the same
settings, checked as dlrm_main.py checks them, and a short run with only torchrec_dlrm's names trains."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchrec")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm.py")


def _example():
    spec = importlib.util.spec_from_file_location("dlrm_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torchrec_dlrm_names_mean_ours():
    ex = _example()
    per = ",".join(str(100 + f) for f in range(26))
    a = ex._args(["--embedding_dim", "8", "--num_embeddings_per_feature", per, "--dense_arch_layer_sizes", "32,8",
                  "--over_arch_layer_sizes", "16,1", "--batch_size", "32", "--learning_rate", "0.1",
                  "--interaction_type", "original", "--limit_train_batches", "5", "--limit_val_batches", "2",
                  "--in_memory_binary_criteo_path", "/data/criteo"])
    assert (a.dim, a.batch_size, a.lr, a.model, a.steps, a.eval_batches) == (8, 32, 0.1, "dlrm", 5, 2)
    assert a.table_rows == [100 + f for f in range(26)]
    assert (a.dense_arch_layer_sizes, a.over_arch_layer_sizes) == ([32, 8], [16, 1])
    assert (a.data_dir, a.layout) == ("/data/criteo", "npy")
    ours = ex._args(["--dim", "8", "--batch-size", "32", "--lr", "0.1", "--model", "dlrm", "--rows", "7"])
    assert (ours.dim, ours.batch_size, ours.lr, ours.model, ours.table_rows) == (8, 32, 0.1, "dlrm", [7] * 26)
    assert ex._args(["--interaction_type", "dcn", "--dcn_num_layers", "2"]).model == "dcn"
    assert ex._args(["--interaction_type", "projection"]).model == "projection"


@pytest.mark.parametrize("argv,msg", [
    (["--embedding_dim", "8", "--dense_arch_layer_sizes", "32,16"], "must equal the embedding dim 8"),
    (["--over_arch_layer_sizes", "16,2"], "last size must be 1"),
    (["--num_embeddings_per_feature", "10,20"], "2 values"),
    (["--dense_arch_layer_sizes", "32,x"], "comma-separated integers"),
    (["--batch_size", "0"], "must be positive"),
    (["--interaction_type", "cross"], "invalid choice"),
    (["--embedding_dim", "8", "--interaction_type", "projection", "--interaction_branch1_layer_sizes", "16,12"],
     "multiple of the embedding dim"),
])
def test_bad_flags_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit):
        _example()._args(argv)
    assert msg in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_a_run_with_torchrec_dlrm_flags_trains(tmp_path):
    out = tmp_path / "run"
    per = ",".join(str(40 + 3 * f) for f in range(26))
    p = subprocess.run([sys.executable, EXAMPLE, "--out", str(out), "--interaction_type", "projection",
                        "--embedding_dim", "8", "--num_embeddings_per_feature", per, "--dense_arch_layer_sizes",
                        "16,8", "--over_arch_layer_sizes", "16,1", "--interaction_branch1_layer_sizes", "16,32",
                        "--interaction_branch2_layer_sizes", "16,32", "--batch_size", "64", "--learning_rate", "0.05",
                        "--limit_train_batches", "4", "--eval-every", "2", "--limit_val_batches", "1",
                        "--min-auc", "0"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "metrics.json").read_text())
    assert res["model"] == "projection" and res["steps"] == 4 and 0.0 <= res["final_auc"] <= 1.0
