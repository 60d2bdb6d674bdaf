"""SparseCore tables on tpu (torchtpu_rec): specs, stacking, MOD sharding, preprocessing,
lookup and fused-optimizer update against TorchRec / fbgemm on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401  (the tpu device)
from torchtpu import metrics
from torchtpu.bucketing import BucketOverflowError, BucketPolicy

torchrec = pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig  # noqa: E402
from torchrec import KeyedJaggedTensor, PoolingType  # noqa: E402

from torchtpu_rec import (  # noqa: E402
    OptimizerSpec,
    SparseCoreEmbeddingBagCollection,
    SparseCoreEmbeddingCollection,
    TableSpec,
    num_sparsecores,
    physical_rows,
    stack_tables,
)

ATOL = 2e-5


def make_kjt(keys, rows, B, max_len, seed, weighted=False, empty_every=3):
    """A random KJT: feature k draws ids in [0, rows[k]); every ``empty_every``-th bag is empty."""
    g = np.random.default_rng(seed)
    lens, vals = [], []
    for ki, r in enumerate(rows):
        for b in range(B):
            n = 0 if (b + ki) % empty_every == 0 else int(g.integers(1, max_len + 1))
            lens.append(n)
            vals.extend(g.integers(0, r, n).tolist())
    w = torch.tensor(g.uniform(0.2, 2.0, len(vals)), dtype=torch.float32) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=torch.tensor(vals, dtype=torch.int64),
                                               lengths=torch.tensor(lens, dtype=torch.int64), weights=w)


def bag_configs():
    return [
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name="t1", feature_names=["f1", "f2"]),
        EmbeddingBagConfig(num_embeddings=23, embedding_dim=8, name="t2", feature_names=["f3"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(num_embeddings=17, embedding_dim=4, name="t3", feature_names=["f4"]),
    ]


FEATS = ["f1", "f2", "f3", "f4"]
ROWS = [40, 40, 23, 17]


# ---------------------------------------------------------------- specs, stacking, sharding
def test_specs_stacking_and_mod_sharding():
    specs = [TableSpec.from_torchrec(c) for c in bag_configs()]
    assert specs[0].feature_names == ("f1", "f2") and specs[1].pooling == "mean" and specs[2].embedding_dim == 4
    assert TableSpec.from_torchrec(EmbeddingConfig(num_embeddings=5, embedding_dim=2, name="s")).pooling == "none"
    stacks = stack_tables(specs, 4)
    # t1 and t2 share width and optimizer -> one stack; t3 alone
    assert [tuple(t.name for t in s.tables) for s in stacks] == [("t1", "t2"), ("t3",)]
    s0 = stacks[0]
    assert s0.offsets == (0, 40) and s0.rows == 63 and s0.rows_per_core == 16 and s0.physical_rows == 64
    # id i of t2 is stacked row 40 + i -> core (40 + i) % 4, local row (40 + i) // 4
    rows = s0.physical_rows_of("t2")
    g = 40 + np.arange(23)
    np.testing.assert_array_equal(rows, (g % 4) * 16 + g // 4)
    assert len(set(rows.tolist()) | set(s0.physical_rows_of("t1").tolist())) == 63  # a bijection
    np.testing.assert_array_equal(physical_rows(np.arange(6), 2, 3), [0, 3, 1, 4, 2, 5])
    assert len(stack_tables(specs, 4, stack=False)) == 3
    # different optimizers never share a stack
    specs2 = [specs[0], TableSpec("t9", 10, 8, optimizer="adagrad")]
    assert len(stack_tables(specs2, 2)) == 2
    assert num_sparsecores("v5p") == 4 and num_sparsecores("TPU v6e") == 2 and num_sparsecores("v7") == 2
    with pytest.raises(ValueError, match="unknown TPU generation"):
        num_sparsecores("v2")
    assert OptimizerSpec.of(torch.optim.Adagrad, lr=0.5, eps=1e-3) == OptimizerSpec("adagrad", 0.5, 1e-3)
    assert OptimizerSpec.of("exact_row_wise_adagrad").kind == "rowwise_adagrad"
    assert OptimizerSpec.of(torch.optim.Adam, betas=(0.8, 0.9)).beta1 == 0.8
    with pytest.raises(ValueError, match="unsupported"):
        OptimizerSpec.of("lamb")
    with pytest.raises(ValueError, match="num_embeddings"):
        TableSpec("bad", 0, 4)


def test_preprocess_per_core_buffers():
    cfg = [EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t", feature_names=["a", "b"],
                              pooling=PoolingType.MEAN)]
    sc = SparseCoreEmbeddingBagCollection(cfg, is_weighted=True, num_sparsecores=2,
                                          ids_policy=BucketPolicy.pow2(4, 64))
    # B = 2: a = [[3, 4, 3], []], b = [[5], [6, 7]]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([3, 4, 3, 5, 6, 7]), lengths=torch.tensor([3, 0, 1, 2]),
        weights=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    batch = sc.preprocess(kjt)
    buf = batch.buffers[0]
    assert buf.num_segments == 4  # (slot, sample): a0 a1 b0 b1
    # core 0 gets even ids (4, 6), core 1 odd ids (3, 3, 5, 7); capacity = bucket(4) = 4
    assert buf.capacity == 4 and buf.ids_per_core.tolist() == [2, 4]
    assert buf.local_ids[0, :2].tolist() == [2, 3] and buf.sample_ids[0, :2].tolist() == [0, 3]
    assert buf.local_ids[1].tolist() == [1, 1, 2, 3] and buf.sample_ids[1].tolist() == [0, 0, 2, 3]
    assert buf.sample_ids[0, 2:].tolist() == [4, 4] and buf.gains[0, 2:].tolist() == [0, 0]  # padding
    # mean combiner folded into the gains: weight / bag length
    np.testing.assert_allclose(buf.gains[0, :2], [2 / 3, 5 / 2])
    np.testing.assert_allclose(buf.gains[1], [1 / 3, 3 / 3, 4 / 1, 6 / 2])
    assert buf.row_pointers[1].tolist() == [0, 2, 2, 3, 4] and buf.row_pointers[0].tolist() == [0, 1, 1, 1, 2]
    # duplicates share one unique slot
    assert buf.unique_per_core.tolist() == [2, 3]
    assert buf.unique_ids[1, :3].tolist() == [1, 2, 3] and buf.unique_index[1].tolist() == [0, 0, 1, 2]
    assert sc.counters.as_dict()["ids"] == 6


# ---------------------------------------------------------------- forward vs TorchRec
@pytest.mark.parametrize("cores,stack", [(4, True), (2, False), (1, True)])
def test_pooled_forward_matches_torchrec(cores, stack):
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(bag_configs())
    sc = SparseCoreEmbeddingBagCollection.from_torchrec(ref, num_sparsecores=cores, stack=stack)
    assert len(sc.stacks) == (2 if stack else 3)
    for seed, B in ((1, 5), (2, 7)):
        kjt = make_kjt(FEATS, ROWS, B, 4, seed)
        out = sc(kjt)
        exp = ref(kjt)
        assert out.keys() == exp.keys() and out.length_per_key() == exp.length_per_key()
        assert out.values().device.type == "tpu"
        torch.testing.assert_close(out.values().cpu(), exp.values(), atol=ATOL, rtol=1e-5)
        for k in FEATS:
            torch.testing.assert_close(out[k].cpu(), exp[k], atol=ATOL, rtol=1e-5)
    # KJT keys in another order, plus a key no table reads: same result
    kjt = make_kjt(FEATS, ROWS, 5, 4, 3)
    d = kjt.to_dict()
    order = ["f4", "zz", "f2", "f1", "f3"]
    d["zz"] = torchrec.JaggedTensor(values=torch.tensor([10**9, 7]), lengths=torch.tensor([1, 0, 1, 0, 0]))
    shuffled = KeyedJaggedTensor.from_jt_dict({k: d[k] for k in order})
    assert shuffled.keys() == order
    torch.testing.assert_close(sc(shuffled).values().cpu(), ref(kjt).values(), atol=ATOL, rtol=1e-5)
    # empty bags give zero rows
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATS, values=torch.tensor([3]),
                                              lengths=torch.tensor([0, 1, 0, 0, 0, 0, 0, 0]))
    out = sc(kjt).values().cpu()
    torch.testing.assert_close(out, ref(kjt).values(), atol=ATOL, rtol=0)
    assert out[0].abs().sum() == 0


def test_weighted_forward_matches_torchrec():
    torch.manual_seed(1)
    cfg = [EmbeddingBagConfig(num_embeddings=30, embedding_dim=6, name="w1", feature_names=["a"]),
           EmbeddingBagConfig(num_embeddings=12, embedding_dim=6, name="w2", feature_names=["b"])]
    ref = EmbeddingBagCollection(cfg, is_weighted=True)
    sc = SparseCoreEmbeddingBagCollection.from_torchrec(ref, num_sparsecores=2)
    kjt = make_kjt(["a", "b"], [30, 12], 6, 5, 3, weighted=True)
    torch.testing.assert_close(sc(kjt).values().cpu(), ref(kjt).values(), atol=ATOL, rtol=1e-5)
    with pytest.raises(ValueError, match="no weights"):
        sc(make_kjt(["a", "b"], [30, 12], 6, 5, 3, weighted=False))


# ---------------------------------------------------------------- fused optimizers vs fbgemm
class FbgemmTables:
    """fbgemm's fused TBE on CPU (SplitTableBatchedEmbeddingBagsCodegen), one per table (its
    features share it), with the optimizer fused into its backward: the reference of the update."""

    def __init__(self, configs, optim, lr, eps, weights):
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.tbes = {}
        for c in configs:
            mode = PoolingMode.MEAN if c.pooling == PoolingType.MEAN else PoolingMode.SUM
            tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [(c.num_embeddings, c.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                feature_table_map=[0] * len(c.feature_names), optimizer=optim, learning_rate=lr, eps=eps,
                pooling_mode=mode)
            with torch.no_grad():
                tbe.split_embedding_weights()[0].copy_(weights[c.name])
            self.tbes[c.name] = (tbe, list(c.feature_names), c.embedding_dim)

    def __call__(self, kjt):
        d = kjt.to_dict()
        out = {}
        for tbe, feats, dim in self.tbes.values():
            vals = torch.cat([d[f].values() for f in feats])
            lens = torch.cat([d[f].lengths() for f in feats])
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            o = tbe(vals, offs)
            for i, f in enumerate(feats):
                out[f] = o[:, i * dim:(i + 1) * dim]
        return out

    def weight(self, name):
        return self.tbes[name][0].split_embedding_weights()[0].detach().clone()

    def momentum1(self, name):
        return self.tbes[name][0].split_optimizer_states()[0][0].detach().clone()


@pytest.mark.parametrize("kind,fb_name,kwargs", [
    ("sgd", "EXACT_SGD", {"lr": 0.3}),
    ("adagrad", "EXACT_ADAGRAD", {"lr": 0.2, "eps": 1e-3}),
    ("rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD", {"lr": 0.2, "eps": 1e-3}),
])
def test_fused_optimizer_matches_fbgemm(kind, fb_name, kwargs):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fb_opt = getattr(EmbOptimType, fb_name)
    torch.manual_seed(2)
    init = EmbeddingBagCollection(bag_configs())
    # the optimizer is given the way torchrec's FusedEmbeddingBagCollection takes it, or as fbgemm's enum
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": fb_opt}[kind]
    sc = SparseCoreEmbeddingBagCollection.from_torchrec(init, optimizer=opt, optimizer_kwargs=kwargs,
                                                        num_sparsecores=4)
    assert {st.optimizer.kind for st in sc.stacks} == {kind}
    ref = FbgemmTables(bag_configs(), fb_opt, kwargs["lr"], kwargs.get("eps", 1e-8),
                       {n: m.weight for n, m in init.embedding_bags.items()})
    B = 6
    g = torch.Generator().manual_seed(0)
    targets = {k: torch.randn(B, d, generator=g) for k, d in zip(FEATS, (8, 8, 8, 4))}
    for step in range(3):
        kjt = make_kjt(FEATS, ROWS, B, 5, 10 + step)  # duplicates within and across bags
        out_ref, kt = ref(kjt), sc(kjt)
        loss_ref = loss = 0
        for k in FEATS:
            torch.testing.assert_close(kt[k].cpu(), out_ref[k].detach(), atol=1e-5, rtol=1e-5)
            loss_ref = loss_ref + ((out_ref[k] - targets[k]) ** 2).sum()
            loss = loss + ((kt[k] - targets[k].to("tpu")) ** 2).sum()
        loss_ref.backward()
        loss.backward()
    for p in sc.parameters():
        assert p.grad is None  # no table gradient: the update is fused
    got = sc.table_weights()
    states = sc.optimizer_states()
    for name in ("t1", "t2", "t3"):
        torch.testing.assert_close(got[name], ref.weight(name), atol=1e-5, rtol=1e-5)
        if kind != "sgd":
            m = states[name]["momentum1"]
            torch.testing.assert_close(m, ref.momentum1(name).reshape(m.shape), atol=1e-5, rtol=1e-5)


def test_update_reads_tables_again_after_another_update():
    """The fused update takes the rows its lookup read, unless the tables changed in between: two forwards,
    then the backwards in reverse order, equal the same steps one after the other (SGD, a linear loss)."""
    torch.manual_seed(3)
    init = EmbeddingBagCollection(bag_configs())
    a, b = (SparseCoreEmbeddingBagCollection.from_torchrec(init, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
                                                           num_sparsecores=2) for _ in range(2))
    k1, k2 = make_kjt(FEATS, ROWS, 4, 6, 21), make_kjt(FEATS, ROWS, 4, 6, 22)  # rows shared by both batches
    out1, out2 = a(k1).values(), a(k2).values()
    out2.sum().backward()
    out1.mul(2).sum().backward()  # its rows were read before the other update: read again
    b(k1).values().mul(2).sum().backward()
    b(k2).values().sum().backward()
    for name, w in a.table_weights().items():
        torch.testing.assert_close(w, b.table_weights()[name], atol=1e-6, rtol=1e-6)


def test_adam_matches_torch_sparse_adam():
    # fbgemm's CPU build has no ADAM; torch's SparseAdam is the same lazy (rows in the batch) Adam
    # up to where eps sits, which is invisible at eps=1e-8
    torch.manual_seed(3)
    ref = torch.nn.EmbeddingBag(25, 4, mode="sum", sparse=True)
    opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-8)
    cfg = [TableSpec("a", 25, 4, feature_names=["x"], pooling="sum",
                     optimizer=OptimizerSpec("adam", lr=0.05, beta1=0.8, beta2=0.95, eps=1e-8))]
    sc = SparseCoreEmbeddingBagCollection(cfg, num_sparsecores=2)
    sc.load_table_weights({"a": ref.weight})
    for step in range(4):
        kjt = make_kjt(["x"], [25], 5, 4, 30 + step)
        jt = kjt["x"]
        out_ref = ref(jt.values(), jt.offsets()[:-1])
        out = sc(kjt).values()
        torch.testing.assert_close(out.cpu(), out_ref.detach(), atol=1e-5, rtol=1e-5)
        opt.zero_grad()
        (out_ref ** 3).sum().backward()
        opt.step()
        (out ** 3).sum().backward()
    torch.testing.assert_close(sc.table_weights()["a"], ref.weight.detach(), atol=1e-5, rtol=1e-4)
    st = sc.optimizer_states()["a"]
    assert int(st["step"]) == 4
    torch.testing.assert_close(st["exp_avg_sq"], opt.state[ref.weight]["exp_avg_sq"].to_dense(), atol=1e-6,
                               rtol=1e-4)


# ---------------------------------------------------------------- sequence features
def test_sequence_collection_matches_torchrec_and_updates():
    torch.manual_seed(4)
    cfg = [EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="s1", feature_names=["u", "v"]),
           EmbeddingConfig(num_embeddings=9, embedding_dim=4, name="s2", feature_names=["w"])]
    ref = EmbeddingCollection(cfg)
    lr = 0.5
    sc = SparseCoreEmbeddingCollection.from_torchrec(ref, optimizer="sgd", optimizer_kwargs={"lr": lr},
                                                     num_sparsecores=4)
    kjt = make_kjt(["u", "v", "w"], [30, 30, 9], 4, 3, 7)
    d = kjt.to_dict()
    out, exp = sc(KeyedJaggedTensor.from_jt_dict({k: d[k] for k in ("w", "v", "u")})), ref(kjt)
    assert set(out) == set(exp)
    loss = 0
    loss_ref = 0
    for k in exp:
        torch.testing.assert_close(out[k].values().cpu(), exp[k].values(), atol=ATOL, rtol=1e-5)
        assert out[k].lengths().tolist() == exp[k].lengths().tolist()
        c = torch.arange(exp[k].values().numel(), dtype=torch.float32).reshape(exp[k].values().shape) / 10
        loss = loss + (out[k].values() * c.to("tpu")).sum()
        loss_ref = loss_ref + (exp[k].values() * c).sum()
    loss.backward()
    loss_ref.backward()
    got = sc.table_weights()
    for name in ("s1", "s2"):
        w = ref.embeddings[name].weight
        torch.testing.assert_close(got[name], (w - lr * w.grad).detach(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- errors and overflow
def test_bad_ids_name_the_feature():
    sc = SparseCoreEmbeddingBagCollection(bag_configs(), num_sparsecores=2)
    good = make_kjt(FEATS, ROWS, 2, 2, 0)
    vals = good.values().clone()
    f3_start = int(good.length_per_key()[0] + good.length_per_key()[1])
    vals[f3_start] = 23  # t2 has 23 rows
    bad = KeyedJaggedTensor.from_lengths_sync(keys=FEATS, values=vals, lengths=good.lengths())
    with pytest.raises(ValueError, match=r"feature 'f3' has id 23 out of range for table 't2' with 23 rows"):
        sc(bad)
    vals[f3_start] = -1
    with pytest.raises(ValueError, match="feature 'f3' has id -1"):
        sc(KeyedJaggedTensor.from_lengths_sync(keys=FEATS, values=vals, lengths=good.lengths()))
    with pytest.raises(ValueError, match="feature 'f4'.*missing"):
        sc(KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1]),
                                               lengths=torch.tensor([1, 0, 0, 0, 0, 0])))
    with pytest.raises(ValueError, match="pooled tables"):
        SparseCoreEmbeddingBagCollection([TableSpec("s", 4, 2, pooling="none")])


def test_overflow_error_and_drop_counters():
    cfg = [TableSpec("t", 64, 4, feature_names=["a"])]
    policy = BucketPolicy.pow2(2, 4)  # at most 4 ids per core
    ids = torch.tensor([0, 2, 4, 6, 8, 10, 1, 3])  # core 0 (of 2) gets 6 ids, core 1 gets 2
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=ids, lengths=torch.tensor([3, 5]))
    err = SparseCoreEmbeddingBagCollection(cfg, num_sparsecores=2, ids_policy=policy)
    with pytest.raises(BucketOverflowError, match="stacked table 't'.*6 slots"):
        err(kjt)
    metrics.reset()
    drop = SparseCoreEmbeddingBagCollection(cfg, num_sparsecores=2, ids_policy=policy, overflow="drop",
                                            optimizer="sgd", optimizer_kwargs={"lr": 1.0})
    w0 = drop.table_weights()["t"]
    out = drop(kjt).values()
    c = drop.counters.as_dict()
    assert c["ids"] == 8 and c["dropped_ids"] == 2 and c["dropped_unique_ids"] == 0
    assert metrics.snapshot()["bucket_overflows"]["rec:t:dropped_ids"] == 2
    # core 0 keeps its first 4 ids (0 2 4 | 6), drops 8 and 10 (bag 1)
    exp = torch.stack([w0[[0, 2, 4]].sum(0), w0[[6, 1, 3]].sum(0)])
    torch.testing.assert_close(out.cpu(), exp, atol=ATOL, rtol=0)
    out.sum().backward()
    w1 = drop.table_weights()["t"]
    moved = (w1 - w0).abs().sum(1).nonzero().reshape(-1).tolist()
    assert moved == [0, 1, 2, 3, 4, 6]  # the dropped ids got no update
    # unique-ids capacity overflows separately
    uq = SparseCoreEmbeddingBagCollection(cfg, num_sparsecores=1, ids_policy=BucketPolicy.pow2(2, 16),
                                          unique_policy=BucketPolicy.pow2(2, 4), overflow="drop")
    uq(KeyedJaggedTensor.from_lengths_sync(keys=["a"], values=torch.tensor([5, 5, 1, 2, 3, 4, 9]),
                                           lengths=torch.tensor([7])))
    # 6 distinct rows for 4 slots: the lowest rows (1 2 3 4) stay, the ids of rows 5 and 9 go
    assert uq.counters.as_dict()["dropped_unique_ids"] == 3 and uq.counters.as_dict()["dropped_ids"] == 0


# ---------------------------------------------------------------- in place, one program, state I/O
def test_update_in_place_compiles_once_and_state_roundtrip():
    torch.manual_seed(5)
    sc = SparseCoreEmbeddingBagCollection(bag_configs(), num_sparsecores=4, optimizer="rowwise_adagrad",
                                          optimizer_kwargs={"lr": 0.1})
    p = sc.weights[sc.stacks[0].name]
    ptr, alias = p.data_ptr(), p.detach()
    kjts = [make_kjt(FEATS, ROWS, 8, 3, 50 + i) for i in range(3)]
    sc(kjts[0]).values().sum().backward()  # compiles lookup + update for this bucket
    before = alias.cpu()
    metrics.reset()
    for k in kjts[1:]:
        sc(k).values().sum().backward()
    snap = metrics.snapshot()
    assert snap["compiles"] == 0, snap  # same buckets: no new program
    assert p.data_ptr() == ptr and not torch.equal(alias.cpu(), before)  # same storage, new values
    assert sc.counters.as_dict()["batches"] == 3
    # state round trip into a fresh collection gives the same next step
    sc2 = SparseCoreEmbeddingBagCollection(bag_configs(), num_sparsecores=2, optimizer="rowwise_adagrad",
                                           optimizer_kwargs={"lr": 0.1}, stack=False)
    sc2.load_torchrec_state_dict(sc.torchrec_state_dict())
    sc2.load_optimizer_states(sc.optimizer_states())
    k = make_kjt(FEATS, ROWS, 8, 3, 99)
    for m in (sc, sc2):
        m(k).values().pow(2).sum().backward()
    a, b = sc.table_weights(), sc2.table_weights()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6)
    sc.set_learning_rate(0.0)
    w = sc.table_weights()
    sc(k).values().sum().backward()
    assert all(torch.equal(w[n], sc.table_weights()[n]) for n in w)
    with torch.no_grad():  # eval lookups do not update
        sc(k)


# ---------------------------------------------------------------- the shared kernel on a TorchRec group
@pytest.mark.parametrize("fused", [True, False])
def test_group_kernel_on_fbgemm_layout_mixed_dims(fused):
    """TorchRec's sharded lookups run the same kernel on one flat parameter in fbgemm's layout;
    widths 3, 3, 4 (a run of two width-3 tables, then a width-4 table starting at an offset that is
    not a multiple of 4): forward against TorchRec's EBC, then one fused SGD step (or, DENSE, the
    flat table gradient) against torch's autograd."""
    from torchtpu_rec.sharding.kernel import TPUTableBatchedEmbeddings
    from torchtpu_rec.tables import OptimizerSpec as Spec

    torch.manual_seed(6)
    cfg = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="a", feature_names=["x"]),
           EmbeddingBagConfig(num_embeddings=7, embedding_dim=3, name="b", feature_names=["y", "z"]),
           EmbeddingBagConfig(num_embeddings=9, embedding_dim=4, name="c", feature_names=["w"])]
    ref = EmbeddingBagCollection(cfg, is_weighted=True)
    store = TPUTableBatchedEmbeddings([10, 7, 9], [3, 3, 4], [0, 1, 1, 2], ["x", "y", "z", "w"],
                                      torch.device("tpu"), table_names=["a", "b", "c"])
    lr = 0.5
    store.bind(Spec("sgd", lr=lr) if fused else None, fused)
    assert [(s.base, s.rows, s.dim) for s in store.tables.kernel.stacks] == [(0, 17, 3), (51, 9, 4)]
    with torch.no_grad():
        for w, c in zip(store.split_embedding_weights(), cfg):
            w.copy_(ref.embedding_bags[c.name].weight)
    kjt = make_kjt(["x", "y", "z", "w"], [10, 7, 7, 9], 5, 4, 8, weighted=True)
    out = store.tables.run(store.preprocess(kjt))
    exp = ref(kjt).values()
    torch.testing.assert_close(out.cpu(), exp, atol=ATOL, rtol=1e-5)
    c = torch.arange(exp.numel(), dtype=torch.float32).reshape(exp.shape) / 50
    (out * c.to("tpu")).sum().backward()
    (exp * c).sum().backward()
    ref_grad = torch.cat([ref.embedding_bags[n].weight.grad.reshape(-1) for n in ("a", "b", "c")])
    if fused:
        ref_w = torch.cat([ref.embedding_bags[n].weight.detach().reshape(-1) for n in ("a", "b", "c")])
        torch.testing.assert_close(store.weights.detach().cpu(), ref_w - lr * ref_grad, atol=1e-5, rtol=1e-5)
        assert store.weights.grad is None
    else:
        torch.testing.assert_close(store.weights.grad.cpu(), ref_grad, atol=1e-5, rtol=1e-5)
    bad = KeyedJaggedTensor.from_lengths_sync(keys=["x", "y", "z", "w"], values=torch.tensor([1, 7]),
                                              lengths=torch.tensor([1, 0, 0, 0, 0, 1, 0, 0]))
    with pytest.raises(IndexError, match="feature 'z' has id 7"):  # table b has 7 rows
        store.preprocess(bad)
