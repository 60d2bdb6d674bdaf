"""Criteo-format click data: TorchRec's readers, DLRM's multi-hot layout, and files with a planted signal.

The layouts recommender engineers train DLRM on (Criteo 1TB click logs and what DLRM / MLPerf make of it):

* ``"tsv"``: ``day_<d>`` text files, one sample per line: label, 13 integer features, 26 categorical
  features as hex strings, tab-separated. Read with TorchRec's ``torchrec.datasets.criteo.CriteoIterDataPipe``
  (:func:`tsv_batches` batches it into DLRM's ``Batch``).
* ``"npy"``: TorchRec's preprocessed layout, ``day_<d>_dense.npy`` (float32, log-transformed),
  ``day_<d>_sparse.npy`` (int ids) and ``day_<d>_labels.npy`` (int32), made from the TSV by TorchRec's own
  ``BinaryCriteoUtils.tsv_to_npys`` and read with ``InMemoryBinaryCriteoIterDataPipe``.
* ``"multi_hot"``: MLPerf DLRM-DCNv2's synthetic multi-hot layout: the npy dense and labels plus
  ``day_<d>_sparse_multi_hot.npz`` (uncompressed; ``"<f>.npy"``: an int32 ``(rows, k_f)`` array of ids of
  categorical feature ``f``). TorchRec ships no reader for it (DLRM's reference keeps its own), so
  :class:`MultiHotCriteoDataset` reads it.

:func:`write_criteo_days` writes such files with a planted signal, for examples, tests and benchmarks where
the real logs are not at hand: every id of every categorical feature has a hidden score and the
(log-transformed) integer features a hidden weight vector; a click happens with probability
sigmoid(sum of the scores of a sample's ids + dense . w + bias), so a model that learns the tables beats
AUC 0.5 by a margin that depends only on the data.
"""

from __future__ import annotations

import math
import os
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
    CriteoIterDataPipe,
    InMemoryBinaryCriteoIterDataPipe,
)
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "CAT_FEATURE_COUNT",
    "CriteoFormatError",
    "INT_FEATURE_COUNT",
    "LAYOUTS",
    "MultiHotCriteoDataset",
    "criteo_dataset",
    "day_paths",
    "planted_logits",
    "tsv_batches",
    "write_criteo_days",
]

LAYOUTS = ("tsv", "npy", "multi_hot")


def day_paths(data_dir: str, days: Sequence[int], layout: str) -> dict:
    """The files of ``days`` in ``layout``: ``{"tsv": [...]}`` or ``{"dense": [...], "sparse": [...], "labels": [...]}``."""
    if layout not in LAYOUTS:
        raise ValueError(f"criteo layout must be one of {LAYOUTS}, not {layout!r}")
    if layout == "tsv":
        return {"tsv": [os.path.join(data_dir, f"day_{d}") for d in days]}
    sparse = "sparse_multi_hot.npz" if layout == "multi_hot" else "sparse.npy"
    return {kind: [os.path.join(data_dir, f"day_{d}_{name}") for d in days]
            for kind, name in (("dense", "dense.npy"), ("sparse", sparse), ("labels", "labels.npy"))}


def _multi_hot_extra(num_embeddings: np.ndarray, sizes: Sequence[int], seed: int) -> List[np.ndarray]:
    """Per feature, the k_f - 1 further ids of each id (a fixed function of the id, as in MLPerf's
    synthetic multi-hot data: the bag of an id is always the same): offsets drawn once per feature."""
    rng = np.random.default_rng(seed + 7)
    return [rng.integers(1, max(int(n), 2), size=max(int(k) - 1, 0)) for n, k in zip(num_embeddings, sizes)]


def write_criteo_days(data_dir: str, *, days: int = 2, rows_per_day: int = 4096, num_embeddings=1000,
                      layouts: Sequence[str] = LAYOUTS, multi_hot_sizes: Optional[Sequence[int]] = None,
                      seed: int = 0) -> dict:
    """Write ``days`` days of Criteo-format data with a planted signal into ``data_dir``.

    ``num_embeddings``: rows of each categorical feature's table (an int or 26 ints): ids are in
    ``[0, num_embeddings)``, written as hex strings in the TSV. ``layouts``: which of :data:`LAYOUTS` to
    write (the npy files come from the TSV through TorchRec's ``BinaryCriteoUtils.tsv_to_npys``; the
    multi-hot ids from the npy ones). ``multi_hot_sizes``: ids per sample of each feature in the
    multi-hot layout (default: 1 to 4, cycling). The planted truth goes to ``planted_signal.npz``
    (``score_<f>``: the hidden score of each id of feature f, ``dense_weight``, ``scale``, ``bias``; see
    :func:`planted_logits`). Returns ``{layout: day_paths(...)}``.
    """
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise ValueError(f"unknown criteo layouts {sorted(unknown)} (known: {LAYOUTS})")
    n_emb = np.broadcast_to(np.asarray(num_embeddings, np.int64), (CAT_FEATURE_COUNT,)).copy()
    if (n_emb < 1).any():
        raise ValueError(f"num_embeddings must be >= 1, got {num_embeddings}")
    sizes = list(multi_hot_sizes) if multi_hot_sizes is not None else [1 + f % 4 for f in range(CAT_FEATURE_COUNT)]
    if len(sizes) != CAT_FEATURE_COUNT or min(sizes) < 1:
        raise ValueError(f"multi_hot_sizes: {CAT_FEATURE_COUNT} sizes >= 1 needed, got {sizes}")
    os.makedirs(data_dir, exist_ok=True)
    truth = np.random.default_rng(seed)
    score = [truth.normal(0, 1.0, size=int(n)).astype(np.float32) for n in n_emb]
    w = truth.normal(0, 0.5, size=INT_FEATURE_COUNT).astype(np.float32)
    extra = _multi_hot_extra(n_emb, sizes, seed)
    scale = 1.0 / math.sqrt(CAT_FEATURE_COUNT / 4)  # keeps the logits' spread near 1
    bias = -float(w.sum() * np.log(5.0)) - 0.5
    np.savez(os.path.join(data_dir, "planted_signal.npz"), dense_weight=w, scale=scale, bias=bias,
             **{f"score_{f}": score[f] for f in range(CAT_FEATURE_COUNT)})
    for d in range(days):
        rng = np.random.default_rng(seed + 1000 + d)
        ids = np.stack([(rng.zipf(1.2, rows_per_day) - 1) % n for n in n_emb], axis=1)  # power law
        # counts >= -1 as in Criteo (-1: missing), so tsv_to_npys's log(x - min + 2) is log(x + 3)
        ints = rng.poisson(3.0, size=(rows_per_day, INT_FEATURE_COUNT)) - 1
        ints[0, :] = -1
        logit = scale * sum(score[f][ids[:, f]] for f in range(CAT_FEATURE_COUNT))
        logit = logit + np.log(ints + 3.0).astype(np.float32) @ w + bias
        labels = (rng.random(rows_per_day) < 1 / (1 + np.exp(-logit))).astype(np.int64)
        tsv = os.path.join(data_dir, f"day_{d}")
        with open(tsv, "w") as f:
            for r in range(rows_per_day):
                f.write("\t".join([str(labels[r]), *map(str, ints[r]), *(format(int(i), "08x") for i in ids[r])]))
                f.write("\n")
        if "npy" in layouts or "multi_hot" in layouts:
            p = day_paths(data_dir, [d], "npy")
            BinaryCriteoUtils.tsv_to_npys(tsv, p["dense"][0], p["sparse"][0], p["labels"][0])
        if "multi_hot" in layouts:
            one_hot = np.load(day_paths(data_dir, [d], "npy")["sparse"][0])
            arrays = {}
            for f in range(CAT_FEATURE_COUNT):
                first = one_hot[:, f:f + 1]
                arrays[str(f)] = np.concatenate([first, (first + extra[f][None, :]) % n_emb[f]], axis=1).astype(np.int32)
            np.savez(day_paths(data_dir, [d], "multi_hot")["sparse"][0], **arrays)
        if "tsv" not in layouts:
            os.remove(tsv)
    return {layout: day_paths(data_dir, range(days), layout) for layout in layouts}


def planted_logits(data_dir: str, batch: Batch) -> torch.Tensor:
    """The planted click logit of each sample of ``batch`` (read from ``data_dir/planted_signal.npz``): the
    best any model can do; its AUC is the ceiling of a trained model's. Uses each feature's first id per
    sample (the multi-hot layout's further ids are a function of it)."""
    with np.load(os.path.join(data_dir, "planted_signal.npz")) as truth:
        kjt = batch.sparse_features.to_dict()
        logit = float(truth["scale"]) * sum(
            torch.from_numpy(truth[f"score_{f}"])[kjt[name].values()[kjt[name].offsets()[:-1]].long()]
            for f, name in enumerate(DEFAULT_CAT_NAMES))
        return logit + batch.dense_features @ torch.from_numpy(truth["dense_weight"]) + float(truth["bias"])


def _batch(dense: np.ndarray, sparse: Sequence[np.ndarray], labels: np.ndarray) -> Batch:
    """A DLRM ``Batch``: ``sparse`` is per categorical feature a (B, k) id array (k ids per sample)."""
    B = dense.shape[0]
    lengths = np.concatenate([np.full(B, s.shape[1], np.int32) for s in sparse])
    values = np.concatenate([s.reshape(-1) for s in sparse]).astype(np.int64)
    return Batch(dense_features=torch.from_numpy(np.array(dense, np.float32)),
                 sparse_features=KeyedJaggedTensor(keys=list(DEFAULT_CAT_NAMES), values=torch.from_numpy(values),
                                                   lengths=torch.from_numpy(lengths)),
                 labels=torch.from_numpy(np.array(labels, np.float32).reshape(-1)))


def tsv_batches(paths: Sequence[str], batch_size: int, rank: int = 0, world_size: int = 1,
                num_embeddings=None) -> Iterator[Batch]:
    """DLRM ``Batch`` es of the TSV files ``paths`` read by TorchRec's ``CriteoIterDataPipe``: this rank's
    share of every ``world_size * batch_size`` rows (as ``InMemoryBinaryCriteoIterDataPipe`` splits them),
    the integer features log-transformed as ``tsv_to_npys`` does on Criteo (``log(x + 3)``: counts are >= -1), the
    categorical hex strings parsed and taken modulo ``num_embeddings`` (Criteo's hashing trick).

    A malformed line raises a :class:`CriteoFormatError` naming the file, the line (1-based) and the field; an
    integer feature of -3 or less (outside ``log(x + 3)``'s domain) is such an error, never a NaN."""
    mod = None if num_embeddings is None else np.broadcast_to(np.asarray(num_embeddings, np.int64),
                                                              (CAT_FEATURE_COUNT,))
    rows: list = []
    step = batch_size * world_size
    for path in paths:
        # one file per pipe: TorchRec's reader yields the file's lines in order, so their numbers are known
        for lineno, r in enumerate(CriteoIterDataPipe([path], row_mapper=None), start=1):
            rows.append(_tsv_row(r, path, lineno))
            if len(rows) == step:
                yield _tsv_batch(rows[rank * batch_size:(rank + 1) * batch_size], mod)
                rows = []


class CriteoFormatError(ValueError):
    """A line of a Criteo TSV file that is not a valid sample (the message names file, line and field)."""


_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT


def _tsv_row(r, path: str = "?", lineno: int = 0):
    """(integer features, categorical ids, label) of one split TSV line; missing values are 0."""
    where = f"{path}, line {lineno}"
    if len(r) != _FIELDS:
        raise CriteoFormatError(f"{where}: {len(r)} tab-separated fields, a Criteo sample has {_FIELDS} "
                                f"(label, {INT_FEATURE_COUNT} integer, {CAT_FEATURE_COUNT} categorical)")
    label = r[0] or "0"
    if label not in ("0", "1"):
        raise CriteoFormatError(f"{where}, field 1 (label): {label!r} is not 0 or 1")
    ints = []
    for f, x in enumerate(r[1:1 + INT_FEATURE_COUNT]):
        try:
            v = int(x or "0")
        except ValueError:
            raise CriteoFormatError(
                f"{where}, field {f + 2} ({DEFAULT_INT_NAMES[f]}): {x!r} is not an integer") from None
        if v <= -3:
            raise CriteoFormatError(f"{where}, field {f + 2} ({DEFAULT_INT_NAMES[f]}): {v} is below the domain of "
                                    "the log(x + 3) transform (counts are >= -1)")
        ints.append(v)
    cats = []
    for f, x in enumerate(r[1 + INT_FEATURE_COUNT:]):
        try:
            cats.append(int(x or "0", 16))
        except ValueError:
            raise CriteoFormatError(f"{where}, field {f + 2 + INT_FEATURE_COUNT} ({DEFAULT_CAT_NAMES[f]}): {x!r} is "
                                    "not a hexadecimal id") from None
    return ints, cats, int(label)


def _tsv_batch(rows, mod) -> Batch:
    ints = np.asarray([r[0] for r in rows], np.float32)
    cats = np.asarray([r[1] for r in rows], np.int64)
    if mod is not None:
        cats %= mod
    labels = np.asarray([r[2] for r in rows], np.float32)
    return _batch(np.log(ints + 3.0), [cats[:, f:f + 1] for f in range(CAT_FEATURE_COUNT)], labels)


class MultiHotCriteoDataset(IterableDataset):
    """MLPerf DLRM-DCNv2's multi-hot Criteo layout (``day_<d>_sparse_multi_hot.npz`` next to the npy dense
    and labels): ``Batch`` es of ``batch_size`` samples, this rank's share of every ``world_size *
    batch_size`` consecutive samples, ids taken modulo ``hashes`` when given. The KJT of a batch has
    ``k_f`` ids per sample for feature ``f`` (``multi_hot_sizes``, read from the files)."""

    def __init__(self, dense_paths: Sequence[str], sparse_paths: Sequence[str], labels_paths: Sequence[str],
                 batch_size: int, rank: int = 0, world_size: int = 1, hashes: Optional[Sequence[int]] = None):
        if not (len(dense_paths) == len(sparse_paths) == len(labels_paths)):
            raise ValueError("MultiHotCriteoDataset: as many dense, sparse and labels files are needed")
        self.batch_size, self.rank, self.world_size = int(batch_size), int(rank), int(world_size)
        self.dense = [np.load(p, mmap_mode="r") for p in dense_paths]
        self.labels = [np.load(p, mmap_mode="r") for p in labels_paths]
        self.sparse = []
        for p in sparse_paths:
            with np.load(p) as z:
                missing = [f for f in range(CAT_FEATURE_COUNT) if f"{f}" not in z.files]
                if missing:
                    raise ValueError(f"MultiHotCriteoDataset: {p} has no ids of categorical features {missing}")
                self.sparse.append([z[f"{f}"] for f in range(CAT_FEATURE_COUNT)])
        for d, s in zip(self.dense, self.sparse):
            bad = [f for f, a in enumerate(s) if a.ndim != 2 or a.shape[0] != d.shape[0]]
            if bad:
                raise ValueError(f"MultiHotCriteoDataset: ids of features {bad} do not have one row per sample "
                                 f"({d.shape[0]} samples)")
        self.multi_hot_sizes = [a.shape[1] for a in self.sparse[0]]
        self.hashes = None if hashes is None else np.asarray(hashes, np.int64)
        step = self.batch_size * self.world_size
        self.num_batches = sum(d.shape[0] for d in self.dense) // step

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        step, lo = self.batch_size * self.world_size, self.rank * self.batch_size
        for dense, sparse, labels in zip(self.dense, self.sparse, self.labels):
            for start in range(0, dense.shape[0] - step + 1, step):
                rows = slice(start + lo, start + lo + self.batch_size)
                ids = [a[rows] if self.hashes is None else a[rows] % self.hashes[f] for f, a in enumerate(sparse)]
                yield _batch(np.asarray(dense[rows]), ids, np.asarray(labels[rows]))


def criteo_dataset(data_dir: str, days: Sequence[int], layout: str, batch_size: int, rank: int = 0,
                   world_size: int = 1, num_embeddings=None, stage: str = "train"):
    """An iterable of DLRM ``Batch`` es of ``days`` in ``layout``, read by TorchRec's readers (tsv:
    ``CriteoIterDataPipe``; npy: ``InMemoryBinaryCriteoIterDataPipe``) or :class:`MultiHotCriteoDataset`."""
    paths = day_paths(data_dir, days, layout)
    hashes = None if num_embeddings is None else list(np.broadcast_to(np.asarray(num_embeddings, np.int64),
                                                                      (CAT_FEATURE_COUNT,)))
    if layout == "tsv":
        return _Reiterable(lambda: tsv_batches(paths["tsv"], batch_size, rank, world_size, hashes))
    if layout == "npy":
        return InMemoryBinaryCriteoIterDataPipe(stage, paths["dense"], paths["sparse"], paths["labels"],
                                                batch_size=batch_size, rank=rank, world_size=world_size,
                                                drop_last=True, hashes=hashes)
    return MultiHotCriteoDataset(paths["dense"], paths["sparse"], paths["labels"], batch_size, rank, world_size,
                                 hashes=hashes)


class _Reiterable:
    """A generator function as an iterable that can be iterated again (one pass per epoch)."""

    def __init__(self, make):
        self._make = make

    def __iter__(self):
        return self._make()
