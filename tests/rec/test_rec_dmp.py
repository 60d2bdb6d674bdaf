"""TorchRec DistributedModelParallel on tpu: every sharding type against the unsharded EBC, on the tpu backend.

One 2-process spawn runs all checks (each process pays the torch+jax+torchrec import once):
forward and one optimizer step for table-wise, row-wise, column-wise, table-row-wise (fused SGD) and
data-parallel (dense, DDP) tables of one EBC; the planner's tpu plan; a TW-sharded checkpoint loaded
into an RW-sharded model; an out-of-range id. Each check's failure is reported with its name.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_check, expect_owner_index_error, named_checks, run_spawned, tpu_dmp

pytestmark = pytest.mark.timeout(300)

WORLD = 2
LR = 0.1
FEATURES = ["f_tw", "f_rw", "f_cw", "f_twrw", "f_dp", "f_mean"]


def _tables():
    from torchrec import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(name="t_tw", embedding_dim=8, num_embeddings=40, feature_names=["f_tw"]),
        EmbeddingBagConfig(name="t_rw", embedding_dim=4, num_embeddings=33, feature_names=["f_rw"]),
        EmbeddingBagConfig(name="t_cw", embedding_dim=8, num_embeddings=20, feature_names=["f_cw"]),
        EmbeddingBagConfig(name="t_twrw", embedding_dim=4, num_embeddings=25, feature_names=["f_twrw"]),
        EmbeddingBagConfig(name="t_dp", embedding_dim=4, num_embeddings=10, feature_names=["f_dp"]),
        EmbeddingBagConfig(name="t_mean", embedding_dim=4, num_embeddings=12, feature_names=["f_mean"],
                           pooling=PoolingType.MEAN),
    ]


def _batch(seed: int, B: int = 4):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    rows = {t.feature_names[0]: t.num_embeddings for t in _tables()}
    lengths = torch.randint(0, 4, (len(FEATURES) * B,), generator=g)
    lengths[0] = 0  # an empty bag
    hi = torch.tensor([rows[f] for f in FEATURES]).repeat_interleave(B).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * hi).long()
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)


def _close(name, a, b, atol=1e-5):
    a = a.detach().cpu()
    b = b.detach().cpu()
    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=1e-5):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {a.shape} vs {b.shape}"
        raise AssertionError(f"{name}: max diff {diff}")


def _worker(rank, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (registers the tpu device and backend)

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import (
        column_wise,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )

    from torchtpu_rec.checkpoint import load_unsharded_state_dict, unsharded_state_dict
    from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder
    from torchtpu_rec.sharding.planner import plan_for_tpu

    sharder = TPUEmbeddingBagCollectionSharder(fused_params={"optimizer": "sgd", "learning_rate": LR})
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    batches = [_batch(100 + r) for r in range(WORLD)]
    mine = batches[rank]
    check = named_checks(rank, tmpdir)

    def dmp_for(per_param):
        return tpu_dmp(EmbeddingBagCollection(tables=_tables(), device=torch.device("meta")), per_param, sharder, WORLD)

    mixed = {
        "t_tw": table_wise(rank=1),
        "t_rw": row_wise(),
        "t_cw": column_wise(ranks=[0, 1]),
        "t_twrw": table_row_wise(host_index=0),
        "t_dp": data_parallel(),
        "t_mean": table_wise(rank=0),
    }
    dmp = dmp_for(mixed)
    load_unsharded_state_dict(dmp, ref_sd)

    def forward():
        out = dmp(mine).wait()
        exp = ref(mine)
        for f in FEATURES:
            _close(f"forward {f}", out[f], exp[f])

    check("forward_all_sharding_types", forward)

    def step():
        # fused SGD updates TW/RW/CW/TWRW tables in the backward; the DP table (DDP) takes the torch SGD
        out = dmp(mine).wait()
        loss = sum((out[f] * (i + 1)).sum() for i, f in enumerate(FEATURES))
        loss.backward()
        dense = [p for p in dmp.parameters() if p.requires_grad and p.grad is not None]
        torch.optim.SGD(dense, lr=LR).step()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        ref_loss = sum((ref(b)[f] * (i + 1)).sum() for b in batches for i, f in enumerate(FEATURES))
        (ref_loss / WORLD).backward()  # DMP averages gradients over ranks, as DDP does
        ref_opt.step()
        full = unsharded_state_dict(dmp, strip_prefixes=True)
        for k, v in ref.state_dict().items():
            _close(f"after step {k}", full[k], v)
        out2 = dmp(mine).wait()
        exp2 = ref(mine)
        for f in FEATURES:
            _close(f"forward after step {f}", out2[f], exp2[f])

    check("optimizer_step_all_sharding_types", step)

    def planner():
        ebc = EmbeddingBagCollection(tables=_tables(), device=torch.device("meta"))
        cons = {"t_rw": ParameterConstraints(sharding_types=["row_wise"]),
                "t_cw": ParameterConstraints(sharding_types=["column_wise"]),
                "t_dp": ParameterConstraints(sharding_types=["data_parallel"])}
        plan = plan_for_tpu(ebc, [sharder], world_size=WORLD, constraints=cons)  # same plan on every rank
        types = {name: ps.sharding_type for name, ps in plan.plan[""].items()}
        assert types["t_rw"] == "row_wise" and types["t_dp"] == "data_parallel", types
        for ps in plan.plan[""].values():
            for shard in getattr(ps.sharding_spec, "shards", None) or []:
                assert str(shard.placement.device()) == "tpu:0", shard.placement
        # the collective form: TorchRec's collective_plan plans on rank 0 and broadcasts the plan as an
        # object (broadcast_object_list) over the tpu group; every rank gets rank 0's plan
        cplan = plan_for_tpu(ebc, [sharder], pg=dist.group.WORLD, constraints=cons)
        ctypes = {name: ps.sharding_type for name, ps in cplan.plan[""].items()}
        assert ctypes == types, (ctypes, types)
        both = [None] * WORLD
        dist.all_gather_object(both, repr(sorted((n, str(ps.ranks)) for n, ps in cplan.plan[""].items())))
        assert both[0] == both[1], both
        # HBM limits: tables that do not fit a chip make the planner fail
        try:
            plan_for_tpu(ebc, [sharder], world_size=WORLD, hbm_cap=1000)
        except Exception as e:  # torchrec's PlannerError
            assert "hbm" in str(e).lower(), str(e)
        else:
            raise AssertionError("a 1000-byte HBM cap did not make the planner fail")
        # the collective form of that failure raises on every rank, not only on rank 0 (TorchRec's own
        # collective_plan left the other ranks waiting in the broadcast)
        try:
            plan_for_tpu(ebc, [sharder], pg=dist.group.WORLD, hbm_cap=1000)
        except RuntimeError as e:
            assert "failed on rank 0" in str(e) and "hbm" in str(e).lower(), str(e)
        else:
            raise AssertionError("a 1000-byte HBM cap did not make the collective planner fail")

    check("planner_plan", planner)

    def checkpoint():
        tw = dmp_for({t.name: table_wise(rank=i % WORLD) for i, t in enumerate(_tables())})
        load_unsharded_state_dict(tw, ref.state_dict())
        path = os.path.join(tmpdir, "ckpt.pt")
        sd = unsharded_state_dict(tw)
        if rank == 0:
            torch.save(sd, path)
        dist.barrier()
        rw = dmp_for({t.name: row_wise() for t in _tables()})
        load_unsharded_state_dict(rw, torch.load(path))
        a = tw(mine).wait()
        b = rw(mine).wait()
        for f in FEATURES:
            _close(f"TW vs RW after reload {f}", a[f], b[f])
        # and the gathered tables equal the ones that went in
        back = unsharded_state_dict(rw, strip_prefixes=True)
        for k, v in ref.state_dict().items():
            _close(f"round trip {k}", back[k], v, atol=0)

    check("checkpoint_tw_to_rw", checkpoint)

    def out_of_range():
        from torchrec import KeyedJaggedTensor

        b = _batch(7)
        assert FEATURES[0] == "f_tw" and int(b.lengths()[:4].sum()) > 0
        values = b.values().clone()
        values[0] = 10_000  # an id of f_tw; only rank 1 owns t_tw, the id reaches it through the a2a
        kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=b.lengths())
        expect_owner_index_error(lambda: dmp(kjt).wait(), rank, owner=1, feature="f_tw")

    # last: the rank that raises leaves the group out of step
    check("out_of_range_id_names_feature", out_of_range)


CHECKS = [
    "forward_all_sharding_types",
    "optimizer_step_all_sharding_types",
    "planner_plan",
    "checkpoint_tw_to_rw",
    "out_of_range_id_names_feature",
]


@pytest.fixture(scope="module")
def dmp_job(tmp_path_factory):
    """The 2-process job, run once; each of its checks is one test item below."""
    return run_spawned(_worker, WORLD, tmp_path_factory.mktemp("dmp_job"))


@pytest.mark.parametrize("name", CHECKS)
def test_dmp_on_tpu(dmp_job, name):
    assert_check(dmp_job, name, WORLD)


def test_every_check_is_listed(dmp_job):
    assert set(dmp_job) == set(CHECKS), set(dmp_job) ^ set(CHECKS)
