"""Criteo-format data (torchtpu_rec.criteo): files with a planted signal, read by TorchRec's own readers
(TSV: CriteoIterDataPipe; npy: InMemoryBinaryCriteoIterDataPipe) and by the multi-hot reader (MLPerf
DLRM-DCNv2's layout). One process, no device: the readers feed DMP on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

ROWS = 50
WORLD = 2
B = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from torchtpu_rec.criteo import write_criteo_days

    d = str(tmp_path_factory.mktemp("criteo"))
    sizes = [1 + f % 3 for f in range(26)]
    paths = write_criteo_days(d, days=2, rows_per_day=640, num_embeddings=ROWS, multi_hot_sizes=sizes, seed=3)
    return d, paths, sizes


def _all(layout, d, rank, day=0):
    from torchtpu_rec.criteo import criteo_dataset

    return list(criteo_dataset(d, [day], layout, B, rank, WORLD, num_embeddings=ROWS))


def test_files_in_every_layout(data):
    d, paths, _ = data
    import os

    assert sorted(paths) == ["multi_hot", "npy", "tsv"]
    line = open(paths["tsv"]["tsv"][0]).readline().rstrip("\n").split("\t")
    assert len(line) == 1 + 13 + 26 and line[0] in ("0", "1")
    assert all(len(x) == 8 and int(x, 16) < ROWS for x in line[14:])  # hex ids, as in the click logs
    assert np.load(paths["npy"]["sparse"][0]).shape == (640, 26)
    with np.load(paths["multi_hot"]["sparse"][0]) as z:
        assert sorted(z.files, key=lambda n: int(n.split(".")[0])) == [f"{f}" for f in range(26)]
    assert os.path.exists(os.path.join(d, "planted_signal.npz"))


def test_tsv_and_npy_readers_agree(data):
    d, _, _ = data
    for rank in range(WORLD):
        tsv, npy = _all("tsv", d, rank), _all("npy", d, rank)
        assert len(tsv) == len(npy) == 640 // (B * WORLD)
        for a, b in zip(tsv, npy):
            torch.testing.assert_close(a.dense_features, b.dense_features)
            assert torch.equal(a.labels, b.labels.float())
            assert a.sparse_features.keys() == b.sparse_features.keys()
            assert torch.equal(a.sparse_features.values(), b.sparse_features.values().long())
            assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths().int())
    # the ranks split each world * batch block: together they read every sample once, in order
    labels = np.loadtxt(data[1]["tsv"]["tsv"][0], usecols=0, dtype=np.int64)
    got = torch.stack([torch.cat([b.labels for b in _all("tsv", d, r)]).view(-1, B) for r in range(WORLD)], 1)
    assert torch.equal(got.reshape(-1).long(), torch.from_numpy(labels[: got.numel()]))


def test_multi_hot_reader(data):
    d, _, sizes = data
    one_hot = _all("npy", d, 0)
    multi = _all("multi_hot", d, 0)
    assert len(multi) == len(one_hot)
    seen: dict = {}
    for a, b in zip(one_hot, multi):
        torch.testing.assert_close(a.dense_features, b.dense_features)
        ja, jb = a.sparse_features.to_dict(), b.sparse_features.to_dict()
        for f, name in enumerate(a.sparse_features.keys()):
            assert torch.equal(jb[name].lengths(), torch.full((B,), sizes[f], dtype=torch.int32))
            bags = jb[name].values().view(B, sizes[f])
            assert torch.equal(bags[:, 0], ja[name].values().long())  # the first id is the one-hot id
            assert int(bags.max()) < ROWS
            for bag in bags.tolist():  # a bag is a function of its first id
                assert seen.setdefault((f, bag[0]), bag) == bag


def test_planted_signal(data):
    from torchmetrics.functional.classification import binary_auroc

    from torchtpu_rec.criteo import planted_logits

    d, _, _ = data
    batches = _all("npy", d, 0, day=1) + _all("npy", d, 1, day=1)
    logits = torch.cat([planted_logits(d, b) for b in batches])
    labels = torch.cat([b.labels for b in batches]).long()
    auc = float(binary_auroc(logits, labels))
    assert auc > 0.75, auc  # the signal a model can learn; labels are not noise
    assert 0.2 < labels.float().mean() < 0.8


def test_bad_input(data, tmp_path):
    from torchtpu_rec.criteo import MultiHotCriteoDataset, criteo_dataset, write_criteo_days

    d, paths, _ = data
    with pytest.raises(ValueError, match="layout"):
        criteo_dataset(d, [0], "parquet", B)
    with pytest.raises(ValueError, match="unknown criteo layouts"):
        write_criteo_days(str(tmp_path), layouts=["csv"])
    bad = str(tmp_path / "day_0_sparse_multi_hot.npz")
    with np.load(paths["multi_hot"]["sparse"][0]) as z:
        np.savez(bad, **{k: z[k] for k in z.files if k not in ("3", "7")})
    with pytest.raises(ValueError, match=r"categorical features \[3, 7\]"):
        MultiHotCriteoDataset(paths["multi_hot"]["dense"][:1], [bad], paths["multi_hot"]["labels"][:1], B)


@pytest.mark.parametrize("edit,field,why", [
    (lambda f: f.__setitem__(3, "-3"), "field 4 (int_2)", "below the domain"),
    (lambda f: f.__setitem__(5, "12x"), "field 6 (int_4)", "not an integer"),
    (lambda f: f.__setitem__(20, "zz"), "field 21 (cat_6)", "not a hexadecimal"),
    (lambda f: f.__setitem__(0, "2"), "field 1 (label)", "not 0 or 1"),
    (lambda f: f.pop(), "", "39 tab-separated fields"),
])
def test_tsv_errors_name_file_line_and_field(data, tmp_path, edit, field, why):
    from torchtpu_rec.criteo import CriteoFormatError, tsv_batches

    lines = open(data[1]["tsv"]["tsv"][0]).read().splitlines()[:10]
    fields = lines[6].split("\t")
    edit(fields)
    lines[6] = "\t".join(fields)
    bad = tmp_path / "day_9"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(CriteoFormatError) as e:
        list(tsv_batches([str(bad)], batch_size=4))
    assert f"{bad}, line 7" in str(e.value) and field in str(e.value) and why in str(e.value), str(e.value)


def test_tsv_count_of_minus_two_is_still_in_the_domain(data, tmp_path):
    from torchtpu_rec.criteo import tsv_batches

    lines = open(data[1]["tsv"]["tsv"][0]).read().splitlines()[:4]
    fields = lines[0].split("\t")
    fields[1] = "-2"
    lines[0] = "\t".join(fields)
    (tmp_path / "day_8").write_text("\n".join(lines) + "\n")
    (batch,) = list(tsv_batches([str(tmp_path / "day_8")], batch_size=4))
    assert torch.isfinite(batch.dense_features).all() and float(batch.dense_features[0, 0]) == 0.0  # log(-2 + 3)
