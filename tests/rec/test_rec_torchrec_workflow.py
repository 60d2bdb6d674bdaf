"""TorchRec as its users run it, on tpu: the unchanged DMP call, dmp.fused_optimizer's state,
torch.distributed.checkpoint of the sharded state into another plan and world size, TrainPipelineSparseDist /
TrainPipelineBase, torchrec.metrics, and the clear errors for a KJT that lacks a feature or has a bad VBE inverse index.

One 2-process spawn on the tpu backend runs every check (each is its own test item below). The model is
TorchRec's DLRM (in DLRMTrain, as TorchRec's DLRM example trains it) with 3 tables built on the meta device.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_check, named_checks, run_spawned, tpu_dmp

pytestmark = pytest.mark.timeout(420)

WORLD = 2
ROWS, DIM, B = 2000, 8, 4
FEATURES = ["f0", "f1", "f2"]
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


def _dlrm(device="meta"):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
              for i, f in enumerate(FEATURES)]
    d = torch.device(device)
    return DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=d), dense_in_features=4,
                          dense_arch_layer_sizes=[DIM], over_arch_layer_sizes=[8, 1], dense_device=d))


def _batch(seed: int):
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * B,), generator=g)
    kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.randint(0, ROWS, (int(lengths.sum()),), generator=g),
                            lengths=lengths)
    return Batch(dense_features=torch.randn(B, 4, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (B,), generator=g).float())


def _close(name, a, b, atol=1e-5):
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=1e-4):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        raise AssertionError(f"{name}: max diff {diff}")


def _step(dmp, opt, batch):
    """One training step of a DLRMTrain DMP (fused tables update in the backward); returns the logits."""
    loss, (_, logits, _) = dmp(batch.to(torch.device("tpu")))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return logits


def _dense_opt(dmp):
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                 lambda params: torch.optim.SGD(params, lr=0.1))


def _full_tables(dmp):
    from torchtpu_rec.checkpoint import unsharded_state_dict

    return {k: v for k, v in unsharded_state_dict(dmp, strip_prefixes=True).items()}


def _worker(rank, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import torchtpu  # noqa: F401
    import torchtpu_rec  # noqa: F401  (teaches DistributedModelParallel the tpu device)

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed import sharding_plan
    from torchrec.distributed.types import ShardingEnv

    from torchtpu_rec.checkpoint import unsharded_fused_optimizer_state
    from torchtpu_rec.sharding import TPU_SHARDING_TYPES, TPUEmbeddingBagCollectionSharder, TPUShardedEmbeddingBagCollection

    # explicit plans of FUSED tables (construct_module_sharding_plan's default kernel is DENSE)
    def table_wise(rank):
        return sharding_plan.table_wise(rank=rank, compute_kernel="fused")

    def row_wise():
        return sharding_plan.row_wise(compute_kernel="fused")

    def column_wise(ranks):
        return sharding_plan.column_wise(ranks=ranks, compute_kernel="fused")

    tpu = torch.device("tpu")
    check = named_checks(rank, tmpdir)
    batches = [_batch(10 * s + rank) for s in range(4)]
    adam = TPUEmbeddingBagCollectionSharder(fused_params={"optimizer": "adam", "learning_rate": 0.05})
    shared = {}

    def unchanged_call():
        dmp = DistributedModelParallel(_dlrm(), device=tpu)  # nothing else, as on GPU
        ddp = dmp._dmp_wrapped_module
        assert isinstance(ddp, DistributedDataParallel) and ddp.static_graph, type(ddp)  # TorchRec's default
        ebc = dmp.module.model.sparse_arch.embedding_bag_collection
        assert isinstance(ebc, TPUShardedEmbeddingBagCollection), type(ebc)
        for name, ps in dmp.plan.plan[EBC_PATH].items():
            assert ps.sharding_type in TPU_SHARDING_TYPES, (name, ps.sharding_type)
            for shard in getattr(ps.sharding_spec, "shards", None) or []:
                assert str(shard.placement.device()) == "tpu:0", shard.placement
        # the same numbers as the unsharded model on the host, with the gathered weights
        ref = _dlrm("cpu")
        ref.load_state_dict(_full_tables(dmp))
        _, (_, logits, _) = dmp(batches[0].to(tpu))
        _, (_, ref_logits, _) = ref(batches[0])
        _close("logits of the unchanged DMP call vs the unsharded model", logits, ref_logits)
        # and it trains: TorchRec's default fused optimizer (SGD, lr 0.01) moves the tables in the backward
        before = _full_tables(dmp)[f"{EBC_PATH}.embedding_bags.t0.weight"]
        _step(dmp, _dense_opt(dmp), batches[1])
        after = _full_tables(dmp)[f"{EBC_PATH}.embedding_bags.t0.weight"]
        assert not torch.equal(before, after), "the tables did not train"

    check("unchanged_dmp_call_picks_tpu_defaults", unchanged_call)

    def torchrec_sharder_and_wrapper():
        # TorchRec's own sharder, as a GPU user passes it: its fused_params reach the tpu kernels
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                                              "learning_rate": 0.2})
        dmp = DistributedModelParallel(_dlrm(), device=tpu, sharders=[sharder])
        assert dmp.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
        state = dmp.fused_optimizer.state_dict()["state"]
        assert {k.rsplit(".", 1)[-1] for v in state.values() for k in v} == {"momentum1"}, state
        # TorchRec's static-graph wrapper given explicitly, as GPU code does, trains a step on tpu (its
        # reducer's used-parameter map is in the tpu's pinned host memory)
        dmp = DistributedModelParallel(_dlrm(), device=tpu, sharders=[sharder],
                                       data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=True))
        assert dmp._dmp_wrapped_module.static_graph
        dense = list(dmp.module.model.over_arch.parameters())
        before = [p.detach().cpu().clone() for p in dense]
        _step(dmp, _dense_opt(dmp), batches[1])
        moved = [not torch.equal(b, p.detach().cpu()) for b, p in zip(before, dense)]
        assert moved and all(moved), moved

    check("torchrec_sharder_and_static_graph_wrapper", torchrec_sharder_and_wrapper)

    def fused_state():
        dmp = tpu_dmp(_dlrm(), {"t0": row_wise(), "t1": table_wise(rank=1), "t2": column_wise(ranks=[0, 1])},
                      adam, WORLD, path=EBC_PATH)
        opt = _dense_opt(dmp)
        for b in batches[:2]:
            _step(dmp, opt, b)
        sd = dmp.fused_optimizer.state_dict()["state"]
        full = unsharded_fused_optimizer_state(dmp, strip_prefixes=True)
        held = [None] * WORLD  # a rank holds the state of the tables it holds shards of, as on GPU
        dist.all_gather_object(held, sorted(sd))
        assert sorted(set().union(*held)) == [f"{EBC_PATH}.embedding_bags.{t}.weight" for t in ("t0", "t1", "t2")], held
        for key, st in sd.items():
            t = key.split(".")[-2]
            assert set(st) == {f"{t}.momentum1", f"{t}.exp_avg_sq", f"{t}.step"}, st.keys()
            assert isinstance(st[f"{t}.momentum1"], ShardedTensor) and int(st[f"{t}.step"]) == 2
            for name, ours in ((f"{t}.momentum1", "exp_avg"), (f"{t}.exp_avg_sq", "exp_avg_sq")):
                for shard in st[name].local_shards():
                    sl = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                    _close(f"{name} shard", shard.tensor, full[key][ours][sl], atol=0)
        # load_state_dict writes the kernel's state in place: save, step on, load back
        saved = {k: {n: ([s.tensor.cpu().clone() for s in v.local_shards()] if isinstance(v, ShardedTensor)
                         else v.clone()) for n, v in st.items()} for k, st in sd.items()}
        _step(dmp, opt, batches[2])
        moved = dmp.fused_optimizer.state_dict()
        for k, st in moved["state"].items():
            for n, v in st.items():
                if isinstance(v, ShardedTensor):
                    for shard, old in zip(v.local_shards(), saved[k][n]):
                        shard.tensor.copy_(old)
                else:
                    v.copy_(saved[k][n])
        dmp.fused_optimizer.load_state_dict(moved)
        back = unsharded_fused_optimizer_state(dmp, strip_prefixes=True)
        for key in full:
            assert int(back[key]["step"]) == 2, back[key]["step"]
            for name in ("exp_avg", "exp_avg_sq"):
                _close(f"reloaded {key} {name}", back[key][name], full[key][name], atol=0)

    check("fused_optimizer_state_dict_load_state_dict", fused_state)

    def dcp_reshard():
        path = os.path.join(tmpdir, "dcp")
        a = tpu_dmp(_dlrm(), {t: table_wise(rank=i % WORLD) for i, t in enumerate(("t0", "t1", "t2"))}, adam, WORLD,
                    path=EBC_PATH)
        opt_a = _dense_opt(a)
        for b in batches[:2]:
            _step(a, opt_a, b)
        dcp.save({"model": a.state_dict(), "optim": a.fused_optimizer.state_dict()}, checkpoint_id=path)
        # every rank wrote only its own shards: its file holds its tables (+ the replicated dense part, once)
        mine = sum(s.tensor.numel() * s.tensor.element_size() for v in a.state_dict().values()
                   if isinstance(v, ShardedTensor) for s in v.local_shards())
        size = os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))  # tables + 2 Adam moments
        assert 3 * mine <= size < 3 * mine + 64 * 1024, (rank, size, mine)
        with torch.no_grad():
            shared["ref_logits"] = a(batches[0].to(tpu))[1][1].cpu()
        shared["ref_tables"] = _full_tables(a)
        b_ = tpu_dmp(_dlrm(), {"t0": row_wise(), "t1": column_wise(ranks=[0, 1]), "t2": row_wise()}, adam, WORLD,
                     path=EBC_PATH)
        state = {"model": b_.state_dict(), "optim": b_.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        b_.fused_optimizer.load_state_dict(state["optim"])
        with torch.no_grad():
            _close("logits after reloading into another plan", b_(batches[0].to(tpu))[1][1], shared["ref_logits"])
        # the run continues exactly: tables and Adam moments (with the step count) came across
        opt_b = _dense_opt(b_)
        opt_b.load_state_dict(opt_a.state_dict())
        _close("next step's logits", _step(b_, opt_b, batches[2]), _step(a, opt_a, batches[2]))
        ta, tb = _full_tables(a), _full_tables(b_)
        for k in ta:
            _close(f"after the next step {k}", tb[k], ta[k])

    check("dcp_save_load_into_another_plan", dcp_reshard)

    def dcp_world_size():
        path = os.path.join(tmpdir, "dcp")
        alone = dist.new_group([0])  # every rank takes part in making the group
        if rank == 0:  # the 2-process checkpoint into a 1-process DMP, and back
            one = DistributedModelParallel(_dlrm(), device=tpu, env=ShardingEnv.from_process_group(alone),
                                           sharders=[adam])
            state = {"model": one.state_dict(), "optim": one.fused_optimizer.state_dict()}
            dcp.load(state, checkpoint_id=path, process_group=alone)
            one.fused_optimizer.load_state_dict(state["optim"])
            with torch.no_grad():
                _close("logits in world size 1", one(batches[0].to(tpu))[1][1], shared["ref_logits"])
            dcp.save({"model": one.state_dict(), "optim": one.fused_optimizer.state_dict()},
                     checkpoint_id=os.path.join(tmpdir, "dcp1"), process_group=alone)
        dist.barrier()
        two = tpu_dmp(_dlrm(), {"t0": column_wise(ranks=[1, 0]), "t1": row_wise(), "t2": table_wise(rank=1)}, adam,
                      WORLD, path=EBC_PATH)
        state = {"model": two.state_dict(), "optim": two.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(tmpdir, "dcp1"))
        full = _full_tables(two)
        for k, v in shared["ref_tables"].items():
            _close(f"world 2 -> 1 -> 2 {k}", full[k], v, atol=0)

    check("dcp_load_into_another_world_size", dcp_world_size)

    def pipelines():
        from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

        from torchtpu_rec.checkpoint import load_unsharded_state_dict

        init = None
        results = {}
        for cls in (TrainPipelineBase, TrainPipelineSparseDist):
            dmp = DistributedModelParallel(_dlrm(), device=tpu, sharders=[adam])
            if init is None:
                init = _full_tables(dmp)
            load_unsharded_state_dict(dmp, init)
            pipe = cls(dmp, _dense_opt(dmp), tpu)
            it = iter(batches)
            losses = []
            for _ in batches:
                loss, logits, labels = pipe.progress(it)
                losses.append(float(loss))
            with pytest.raises(StopIteration):
                pipe.progress(it)
            results[cls.__name__] = (torch.tensor(losses), _full_tables(dmp))
        (la, ta), (lb, tb) = results.values()
        _close("losses of TrainPipelineSparseDist vs TrainPipelineBase", lb, la)
        for k in ta:
            _close(f"{k} after the pipelines", tb[k], ta[k])

    check("train_pipeline_sparse_dist_equals_base", pipelines)

    def rec_metrics():
        from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
        from torchrec.metrics.metrics_config import MetricsConfig, RecMetricDef, RecMetricEnum, RecTaskInfo

        task = RecTaskInfo(name="click", label_name="label", prediction_name="prediction", weight_name="weight")
        config = MetricsConfig(rec_tasks=[task], throughput_metric=None, state_metrics=[],
                               rec_metrics={m: RecMetricDef(rec_task_indices=[0], window_size=4096)
                                            for m in (RecMetricEnum.NE, RecMetricEnum.AUC, RecMetricEnum.CALIBRATION)})
        g = torch.Generator().manual_seed(rank)
        data = []
        for _ in range(3):
            p = torch.rand(64, generator=g)
            data.append({"prediction": p, "label": (torch.rand(64, generator=g) < p).float(),
                         "weight": torch.rand(64, generator=g) + 0.5})
        on_tpu = generate_metric_module(RecMetricModule, config, batch_size=64, world_size=WORLD, my_rank=rank,
                                        state_metrics_mapping={}, device=tpu)
        for d in data:
            on_tpu.update({k: v.to(tpu) for k, v in d.items()})
        got = on_tpu.compute().resolve()  # a collective; rank 0 gets the values, as on GPU
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, data)
        alone = dist.new_group([0], backend="gloo")  # the reference's metrics sync over rank 0 alone
        if rank == 0:
            on_cpu = generate_metric_module(RecMetricModule, config, batch_size=64 * WORLD, world_size=1, my_rank=0,
                                            state_metrics_mapping={}, device=torch.device("cpu"), process_group=alone)
            for step in zip(*everyone):
                on_cpu.update({k: torch.cat([d[k] for d in step]) for k in step[0]})
            want = on_cpu.compute().resolve()
            assert set(got) == set(want) and len(want) >= 3, (sorted(got), sorted(want))
            for k in want:
                _close(k, torch.as_tensor(got[k]).double(), torch.as_tensor(want[k]).double(), atol=1e-5)

    check("rec_metrics_ne_auc_calibration_on_tpu", rec_metrics)

    def compiled_dense():
        from torchtpu_rec.checkpoint import load_unsharded_state_dict
        from torchtpu_rec.sharding import compile_dense

        eager = DistributedModelParallel(_dlrm(), device=tpu, sharders=[adam])
        comp = DistributedModelParallel(_dlrm(), device=tpu, sharders=[adam])
        load_unsharded_state_dict(comp, _full_tables(eager))
        names = compile_dense(comp)
        assert names == [f"_dmp_wrapped_module.module.model.{m}" for m in ("dense_arch", "inter_arch", "over_arch")] + \
            ["_dmp_wrapped_module.module.loss_fn"], names
        opts = (_dense_opt(eager), _dense_opt(comp))
        for b in batches[:2]:
            _close("compiled dense part: logits", _step(comp, opts[1], b), _step(eager, opts[0], b))
        te, tc = _full_tables(eager), _full_tables(comp)
        for k in te:
            _close(f"compiled dense part: {k}", tc[k], te[k])

    check("compile_dense_matches_eager", compiled_dense)

    def bad_kjts():
        from torchrec import KeyedJaggedTensor

        dmp = tpu_dmp(_dlrm(), {t: row_wise() for t in ("t0", "t1", "t2")}, adam, WORLD, path=EBC_PATH)
        ok = batches[0]
        missing = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.zeros(3, dtype=torch.long),
                                    lengths=torch.tensor([1, 0, 1, 0, 0, 1, 0, 0]))
        with pytest.raises(ValueError, match="'f2' \\(table 't2'\\)"):
            dmp(type(ok)(ok.dense_features, missing, ok.labels).to(tpu))
        # VBE runs (tests/rec/test_rec_vbe.py); an inverse index past its feature's batch size is named
        inverse = torch.zeros(3, B, dtype=torch.long)
        inverse[2, 1] = 1  # f2 has one bag
        vbe = KeyedJaggedTensor(keys=FEATURES, values=torch.zeros(9, dtype=torch.long), lengths=torch.ones(9, dtype=torch.long),
                                stride_per_key_per_rank=[[4], [4], [1]], inverse_indices=(FEATURES, inverse))
        with pytest.raises(IndexError, match="'f2': inverse index 1 of sample 1 is out of range for its batch size 1"):
            dmp(type(ok)(ok.dense_features, vbe, ok.labels).to(tpu))
        # raised before any collective: the group is still in step
        dist.barrier()
        dmp(ok.to(tpu))

    check("missing_feature_and_vbe_are_clear_errors", bad_kjts)


CHECKS = [
    "unchanged_dmp_call_picks_tpu_defaults",
    "torchrec_sharder_and_static_graph_wrapper",
    "fused_optimizer_state_dict_load_state_dict",
    "dcp_save_load_into_another_plan",
    "dcp_load_into_another_world_size",
    "train_pipeline_sparse_dist_equals_base",
    "rec_metrics_ne_auc_calibration_on_tpu",
    "compile_dense_matches_eager",
    "missing_feature_and_vbe_are_clear_errors",
]


@pytest.fixture(scope="module")
def workflow_job(tmp_path_factory):
    """The 2-process job, run once; each of its checks is one test item below."""
    return run_spawned(_worker, WORLD, tmp_path_factory.mktemp("workflow_job"))


@pytest.mark.parametrize("name", CHECKS)
def test_torchrec_workflow_on_tpu(workflow_job, name):
    assert_check(workflow_job, name, WORLD)


def test_every_check_is_listed(workflow_job):
    assert set(workflow_job) == set(CHECKS), set(workflow_job) ^ set(CHECKS)
