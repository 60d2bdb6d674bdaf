"""TorchRec DistributedModelParallel on tpu for EmbeddingCollection (sequence features), and checkpoints with
fused-optimizer state.

One 2-process spawn on the `tpu` backend runs all checks (each process pays the torch+jax+torchrec import
once); each check's failure is reported with its name:
* an EmbeddingCollection with a table of every sharding type TorchRec offers for it (TW, RW, CW with
  fused optimizers, DP with DDP) and a table-row-wise one (one host: runs as RW): forward against the unsharded CPU EmbeddingCollection (values and
  lengths per feature, with empty sequences and a feature empty on a whole rank), then a few steps of
  fused SGD and of fused Adagrad against the unsharded model trained by torch's SGD / Adagrad
  (gathered tables and the next forward);
* DMP of a model holding an EBC and an EC, planned by the tpu planner with `tpu_sharders()`;
* checkpoints with fused-optimizer state (Adam moments and step, Adagrad accumulators; EC and EBC):
  gathered from one sharding, loaded into another, one more step == the uninterrupted run;
* an out-of-range id raises an error naming its feature.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_check, expect_owner_index_error, named_checks, run_spawned, tpu_dmp

pytestmark = pytest.mark.timeout(300)

WORLD = 2
DIM = 8
FEATURES = ["f_tw", "f_rw", "f_cw", "f_dp", "f_tw0", "f_twrw"]
ROWS = {"f_tw": 40, "f_rw": 33, "f_cw": 20, "f_dp": 10, "f_tw0": 12, "f_twrw": 25}


def _ec_tables():
    from torchrec import EmbeddingConfig

    return [EmbeddingConfig(name="t" + f[1:], embedding_dim=DIM, num_embeddings=ROWS[f], feature_names=[f])
            for f in FEATURES]


def _ebc_tables():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="b_tw", embedding_dim=4, num_embeddings=30, feature_names=["g_tw"]),
            EmbeddingBagConfig(name="b_rw", embedding_dim=4, num_embeddings=25, feature_names=["g_rw"])]


def _kjt(seed: int, keys, rows, B: int = 4, empty_feature=None):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=g)
    lengths[0] = 0  # an empty sequence
    if empty_feature is not None:  # a feature with no ids at all in this batch
        i = keys.index(empty_feature)
        lengths[i * B:(i + 1) * B] = 0
    hi = torch.tensor([rows[k] for k in keys]).repeat_interleave(B).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * hi).long()
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths)


def _close(name, a, b, atol=1e-5):
    a = a.detach().cpu()
    b = b.detach().cpu()
    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=1e-5):
        diff = (a - b).abs().max().item() if a.shape == b.shape and a.numel() else f"shapes {a.shape} vs {b.shape}"
        raise AssertionError(f"{name}: max diff {diff}")


def _seq_loss(out, keys):
    # a non-linear loss, different per feature, so the optimizers' states matter
    return sum(((out[k].values() * (i + 1)) ** 2).sum() * 0.5 for i, k in enumerate(keys))


def _worker(rank, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (registers the tpu device and backend)

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise as _cw
    from torchrec.distributed.sharding_plan import data_parallel
    from torchrec.distributed.sharding_plan import row_wise as _rw
    from torchrec.distributed.sharding_plan import table_row_wise as _twrw
    from torchrec.distributed.sharding_plan import table_wise as _tw
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    # sharded tables take the FUSED kernel (optimizer in the backward; TorchRec's helpers default to DENSE)
    def table_wise(**kw):
        return _tw(compute_kernel="fused", **kw)

    def row_wise(**kw):
        return _rw(compute_kernel="fused", **kw)

    def column_wise(**kw):
        return _cw(compute_kernel="fused", **kw)

    def table_row_wise(**kw):
        gen = _twrw(**kw)  # no compute_kernel argument: DENSE unless the parameter has an in-backward optimizer

        def fused(*args, **kwargs):
            ps = gen(*args, **kwargs)
            ps.compute_kernel = "fused"
            return ps

        return fused

    from torchtpu_rec.checkpoint import (
        load_unsharded_fused_optimizer_state,
        load_unsharded_state_dict,
        unsharded_fused_optimizer_state,
        unsharded_state_dict,
    )
    from torchtpu_rec.sharding import TPUEmbeddingCollectionSharder, tpu_data_parallel_wrapper, tpu_sharders
    from torchtpu_rec.sharding.planner import plan_for_tpu

    check = named_checks(rank, tmpdir)

    def ec_dmp(per_table, fused_params, tables=None):
        sharder = TPUEmbeddingCollectionSharder(fused_params=fused_params)
        ec = EmbeddingCollection(tables=tables or _ec_tables(), device=torch.device("meta"))
        return tpu_dmp(ec, per_table, sharder, WORLD)

    torch.manual_seed(0)
    ref0 = EmbeddingCollection(tables=_ec_tables(), device=torch.device("cpu"))
    ref_sd = {k: v.clone() for k, v in ref0.state_dict().items()}
    # rank 1 sends no f_cw ids at all
    batches = [[_kjt(100 * s + r, FEATURES, ROWS, empty_feature="f_cw" if r == 1 else None)
                for r in range(WORLD)] for s in range(3)]
    mixed = {"t_tw": table_wise(rank=1), "t_rw": row_wise(), "t_cw": column_wise(ranks=[0, 1]),
             "t_dp": data_parallel(), "t_tw0": table_wise(rank=0), "t_twrw": table_row_wise(host_index=0)}

    def train_against_reference(opt_name, lr, steps):
        fused = {"optimizer": opt_name, "learning_rate": lr}
        if opt_name == "adagrad":
            fused["eps"] = 1e-10
        dmp = ec_dmp(mixed, fused)
        load_unsharded_state_dict(dmp, ref_sd)
        ref = EmbeddingCollection(tables=_ec_tables(), device=torch.device("cpu"))
        ref.load_state_dict(ref_sd)
        make = (lambda ps: torch.optim.SGD(ps, lr=lr)) if opt_name == "sgd" else \
            (lambda ps: torch.optim.Adagrad(ps, lr=lr, eps=1e-10))
        ref_opt = make(ref.parameters())
        # the DP table (DDP); fused tables are updated in the backward
        dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        assert [tuple(p.shape) for p in dense] == [(ROWS["f_dp"], DIM)], [tuple(p.shape) for p in dense]
        dense_opt = make(dense)
        from torchtpu import metrics

        fallbacks0 = dict(metrics.snapshot()["cpu_fallbacks"])
        for s in range(steps):
            mine = batches[s][rank]
            out = dmp(mine).wait()
            exp = ref(mine)
            for f in FEATURES:
                _close(f"{opt_name} step {s} forward {f} values", out[f].values(), exp[f].values())
                assert torch.equal(out[f].lengths().cpu(), exp[f].lengths()), f"{f} lengths"
            _seq_loss(out, FEATURES).backward()
            dense_opt.step()
            dense_opt.zero_grad()
            ref_opt.zero_grad()
            # DMP averages gradients over ranks (TorchRec's gradient division, DDP for the DP table)
            (sum(_seq_loss(ref(b[r]), FEATURES) for r, b in [(r, batches[s]) for r in range(WORLD)])
             / WORLD).backward()
            ref_opt.step()
        fallbacks = {k: v for k, v in metrics.snapshot()["cpu_fallbacks"].items() if v != fallbacks0.get(k, 0)}
        assert not fallbacks, f"ops fell back to the CPU in the sharded EC's forward/backward: {fallbacks}"
        full = unsharded_state_dict(dmp, strip_prefixes=True)
        for k, v in ref.state_dict().items():
            _close(f"{opt_name} after {steps} steps {k}", full[k], v, atol=1e-4)
        out = dmp(batches[0][rank]).wait()
        exp = ref(batches[0][rank])
        for f in FEATURES:
            _close(f"{opt_name} forward after steps {f}", out[f].values(), exp[f].values(), atol=1e-4)

    check("ec_forward_and_fused_sgd_all_sharding_types", lambda: train_against_reference("sgd", 0.05, 2))
    check("ec_fused_adagrad_all_sharding_types", lambda: train_against_reference("adagrad", 0.1, 2))

    def ebc_and_ec_planned():
        class Both(torch.nn.Module):
            def __init__(self, device):
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=_ebc_tables(), device=device)
                self.ec = EmbeddingCollection(tables=_ec_tables(), device=device)

            def forward(self, kb, ks):
                return self.ebc(kb), self.ec(ks)

        torch.manual_seed(1)
        ref = Both(torch.device("cpu"))
        sharders = tpu_sharders(fused_params={"optimizer": "sgd", "learning_rate": 0.1})
        meta = Both(torch.device("meta"))
        plan = plan_for_tpu(meta, sharders, world_size=WORLD)  # deterministic: same plan on every rank
        assert set(plan.plan) == {"ebc", "ec"}, list(plan.plan)
        for module_plan in plan.plan.values():
            for ps in module_plan.values():
                for shard in getattr(ps.sharding_spec, "shards", None) or []:
                    assert str(shard.placement.device()) == "tpu:0", shard.placement
        dmp = DistributedModelParallel(meta, device=torch.device("tpu"), sharders=sharders, plan=plan,
                                       data_parallel_wrapper=tpu_data_parallel_wrapper())
        from torchtpu_rec.sharding import TPUShardedEmbeddingBagCollection, TPUShardedEmbeddingCollection

        kinds = {type(m).__name__ for m in dmp.modules()}
        assert {TPUShardedEmbeddingBagCollection.__name__, TPUShardedEmbeddingCollection.__name__} <= kinds, kinds
        load_unsharded_state_dict(dmp, ref.state_dict())
        kb = _kjt(7 + rank, ["g_tw", "g_rw"], {"g_tw": 30, "g_rw": 25})
        ks = _kjt(9 + rank, FEATURES, ROWS)
        pooled, seq = dmp(kb, ks)
        pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
        seq = seq.wait() if hasattr(seq, "wait") else seq
        epooled, eseq = ref(kb, ks)
        for k in ["g_tw", "g_rw"]:
            _close(f"planned EBC {k}", pooled[k], epooled[k])
        for f in FEATURES:
            _close(f"planned EC {f}", seq[f].values(), eseq[f].values())

    check("ebc_and_ec_planned_by_tpu_planner", ebc_and_ec_planned)

    def resume_with_fused_state():
        # Adam (moments + step count) on the EC, Adagrad on an EBC: 2 steps in sharding A, checkpoint
        # (tables and fused-optimizer state), load into sharding B, 1 more step == 3 uninterrupted steps in A
        keep = ["f_rw", "f_cw", "f_tw0"]
        tables = [t for t in _ec_tables() if t.feature_names[0] in keep]
        keys = [f for f in FEATURES if f in keep]
        sd0 = {k: v for k, v in ref_sd.items() if any(f"t{f[1:]}." in k for f in keep)}
        a_plan = {"t_rw": row_wise(), "t_cw": column_wise(ranks=[0, 1]), "t_tw0": table_wise(rank=0)}
        b_plan = {"t_rw": table_row_wise(host_index=0), "t_cw": table_wise(rank=1), "t_tw0": column_wise(ranks=[1, 0])}
        adam = {"optimizer": "adam", "learning_rate": 0.05}
        bats = [_kjt(500 + 10 * s + rank, keys, ROWS) for s in range(3)]

        def step(model, kjt):
            _seq_loss(model(kjt).wait(), keys).backward()

        a = ec_dmp(a_plan, adam, tables)
        load_unsharded_state_dict(a, sd0)
        step(a, bats[0])
        step(a, bats[1])
        ckpt = unsharded_state_dict(a)
        opt = unsharded_fused_optimizer_state(a)
        some = unsharded_fused_optimizer_state(a, strip_prefixes=True)["embeddings.t_rw.weight"]
        assert some["optimizer"] == "adam" and int(some["step"]) == 2, (some["optimizer"], some["step"])
        assert tuple(some["exp_avg"].shape) == (ROWS["f_rw"], DIM), some["exp_avg"].shape
        # moments were gathered (a fresh Adam at step 1 would move the rows very differently at step 3)
        assert some["exp_avg"].abs().sum() > 0 and some["exp_avg_sq"].abs().sum() > 0
        path = os.path.join(tmpdir, "ec_ckpt.pt")
        if rank == 0:
            torch.save({"model": ckpt, "fused_optimizer": opt}, path)
        dist.barrier()
        step(a, bats[2])
        b = ec_dmp(b_plan, adam, tables)
        saved = torch.load(path)
        load_unsharded_state_dict(b, saved["model"])
        load_unsharded_fused_optimizer_state(b, saved["fused_optimizer"])
        # the state round-trips exactly through the other sharding
        back = unsharded_fused_optimizer_state(b)
        for k, st in saved["fused_optimizer"].items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor):
                    _close(f"fused state round trip {k} {name}", back[k][name], v, atol=0)
        step(b, bats[2])
        fa = unsharded_state_dict(a, strip_prefixes=True)
        fb = unsharded_state_dict(b, strip_prefixes=True)
        for k in fa:
            _close(f"EC resumed (adam) vs uninterrupted {k}", fb[k], fa[k], atol=1e-6)

        # EBC with fused Adagrad: TW -> RW
        from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder

        sharder = TPUEmbeddingBagCollectionSharder(fused_params={"optimizer": "adagrad", "learning_rate": 0.1})

        def ebc_dmp(per_table):
            return tpu_dmp(EmbeddingBagCollection(tables=_ebc_tables(), device=torch.device("meta")),
                           per_table, sharder, WORLD)

        torch.manual_seed(2)
        ebc_sd = EmbeddingBagCollection(tables=_ebc_tables(), device=torch.device("cpu")).state_dict()
        gk = ["g_tw", "g_rw"]
        gb = [_kjt(700 + 10 * s + rank, gk, {"g_tw": 30, "g_rw": 25}) for s in range(3)]

        def bstep(model, kjt):
            out = model(kjt).wait()
            sum(((out[k] * (i + 1)) ** 2).sum() for i, k in enumerate(gk)).backward()

        ea = ebc_dmp({"b_tw": table_wise(rank=0), "b_rw": table_wise(rank=1)})
        load_unsharded_state_dict(ea, ebc_sd)
        bstep(ea, gb[0])
        bstep(ea, gb[1])
        eck, eopt = unsharded_state_dict(ea), unsharded_fused_optimizer_state(ea, strip_prefixes=True)
        assert eopt["embedding_bags.b_tw.weight"]["optimizer"] == "adagrad"
        bstep(ea, gb[2])
        eb = ebc_dmp({"b_tw": row_wise(), "b_rw": column_wise(ranks=[0, 1])})
        load_unsharded_state_dict(eb, eck)
        load_unsharded_fused_optimizer_state(eb, eopt)
        bstep(eb, gb[2])
        fa = unsharded_state_dict(ea, strip_prefixes=True)
        fb = unsharded_state_dict(eb, strip_prefixes=True)
        for k in fa:
            _close(f"EBC resumed (adagrad) vs uninterrupted {k}", fb[k], fa[k], atol=1e-6)

    check("checkpoint_with_fused_optimizer_state_resumes_exactly", resume_with_fused_state)

    def out_of_range():
        from torchrec import KeyedJaggedTensor

        dmp = ec_dmp({t.name: table_wise(rank=1) for t in _ec_tables()} | {"t_dp": data_parallel()},
                     {"optimizer": "sgd", "learning_rate": 0.1})
        b = _kjt(11, FEATURES, ROWS)
        values = b.values().clone()
        i = int(b.lengths()[:4 * FEATURES.index("f_rw")].sum())  # first id of f_rw
        assert int(b.lengths()[4:8].sum()) > 0
        values[i] = 10_000
        kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=b.lengths())
        expect_owner_index_error(lambda: dmp(kjt).wait(), rank, owner=1, feature="f_rw")

    # last: the rank that raises leaves the group out of step
    check("out_of_range_id_names_feature", out_of_range)


CHECKS = [
    "ec_forward_and_fused_sgd_all_sharding_types",
    "ec_fused_adagrad_all_sharding_types",
    "ebc_and_ec_planned_by_tpu_planner",
    "checkpoint_with_fused_optimizer_state_resumes_exactly",
    "out_of_range_id_names_feature",
]


@pytest.fixture(scope="module")
def ec_job(tmp_path_factory):
    """The 2-process job, run once; each of its checks is one test item below."""
    return run_spawned(_worker, WORLD, tmp_path_factory.mktemp("ec_job"))


@pytest.mark.parametrize("name", CHECKS)
def test_ec_dmp_on_tpu(ec_job, name):
    assert_check(ec_job, name, WORLD)


def test_every_check_is_listed(ec_job):
    assert set(ec_job) == set(CHECKS), set(ec_job) ^ set(CHECKS)
