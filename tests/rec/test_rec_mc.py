"""Managed collisions on tpu: TorchRec's ManagedCollisionEmbeddingBagCollection (MCH modules with LFU
eviction) through the unchanged DistributedModelParallel, against the same model sharded by TorchRec's own
sharders on CPU (gloo) over the same 2 processes.

Fused SGD on both; a third model, on tpu with fused row-wise Adagrad (an eviction resets the evicted rows'
accumulators; fbgemm's CPU build cannot), must remap the same. Each of 4 training steps feeds raw ids from a range much larger than the tables (so the modules insert,
count and evict); per step, on every rank:
* the remapped ids equal TorchRec CPU's (same eviction decisions);
* the pooled embeddings equal the gathered tpu tables (after the forward's evictions re-initialized their
  rows) looked up with those remapped ids, and no op falls back to the CPU in the tpu forward/backward.
The remapping runs on the host (torchtpu_rec/sharding/mc.py), as the ids do.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_check, named_checks, run_spawned

pytestmark = pytest.mark.timeout(300)

WORLD = 2
ROWS = {"t0": 16, "t1": 12}  # zch sizes (rows), split over the 2 ranks row-wise
RAW_RANGE = 400


def _model(device):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    tables = [EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=n, feature_names=["f" + t[1:]])
              for t, n in ROWS.items()]
    mcms = {t: MCHManagedCollisionModule(zch_size=n, device=device, eviction_interval=2,
                                         eviction_policy=DistanceLFU_EvictionPolicy(), input_hash_size=RAW_RANGE)
            for t, n in ROWS.items()}
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, device=device),
        ManagedCollisionCollection(managed_collision_modules=mcms, embedding_configs=tables),
        return_remapped_features=True)


def _batch(seed):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * 4,), generator=g)
    # a few hot ids (kept by LFU) and many cold ones (evicted)
    hot = torch.tensor([7, 21, 150, 333])
    n = int(lengths.sum())
    values = torch.where(torch.rand(n, generator=g) < 0.5, hot[torch.randint(0, 4, (n,), generator=g)],
                         torch.randint(0, RAW_RANGE, (n,), generator=g))
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def _worker(rank, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import torchtpu

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    gloo = dist.new_group(backend="gloo")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchtpu_rec.checkpoint import unsharded_state_dict
    from torchtpu_rec.sharding.mc import tpu_mc_ebc_sharder

    check = named_checks(rank, tmpdir)

    def dmp_for(device, sharder, pg):
        module = _model(torch.device("meta"))
        plan = construct_module_sharding_plan(module, {t: row_wise(compute_kernel="fused") for t in ROWS},
                                              local_size=WORLD, world_size=WORLD, device_type=device,
                                              sharder=sharder)
        return DistributedModelParallel(module, device=torch.device(device), sharders=[sharder],
                                        env=ShardingEnv.from_process_group(pg), plan=ShardingPlan({"": plan}))

    tpu_dmp = dmp_for("tpu", tpu_mc_ebc_sharder({"optimizer": "sgd", "learning_rate": 0.1}), dist.group.WORLD)
    cpu_dmp = dmp_for("cpu", ManagedCollisionEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}), gloo)
    # row-wise Adagrad: evictions reset the evicted rows' accumulators (fbgemm's CPU build lacks that op,
    # so TorchRec on CPU cannot run this one; its remapping must still equal the SGD models')
    ada_dmp = dmp_for("tpu", tpu_mc_ebc_sharder({"optimizer": "rowwise_adagrad", "learning_rate": 0.1}),
                      dist.group.WORLD)

    def steps():
        before = dict(torchtpu.metrics.snapshot()["cpu_fallbacks"])
        for step in range(4):
            kjt = _batch(100 * step + rank)
            out, remapped = tpu_dmp(kjt)
            # after the forward (an eviction re-initializes the evicted rows in it), before the backward's
            # fused update
            tables = {k.split(".")[-2]: v.cpu() for k, v in unsharded_state_dict(tpu_dmp).items()
                      if k.endswith(".weight")}
            ref_out, ref_remapped = cpu_dmp(kjt)
            ada_out, ada_remapped = ada_dmp(kjt)
            for f in ("f0", "f1"):
                assert torch.equal(ada_remapped[f].values().cpu(), ref_remapped[f].values()), f"step {step} {f}: adagrad"
            for f, t in (("f0", "t0"), ("f1", "t1")):
                got, want = remapped[f], ref_remapped[f]
                assert torch.equal(got.values().cpu(), want.values()), \
                    f"step {step} {f}: remapped {got.values().tolist()} vs TorchRec CPU {want.values().tolist()}"
                assert torch.equal(got.lengths().cpu(), want.lengths())
                assert int(got.values().max()) < ROWS[t]
                pooled = torch.nn.functional.embedding_bag(want.values(), tables[t], want.offsets()[:-1],
                                                           mode="sum", include_last_offset=False)
                torch.testing.assert_close(out[f].detach().cpu(), pooled, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"step {step} {f}: {m}")
            (out.values() ** 2).sum().backward()
            (ref_out.values() ** 2).sum().backward()
            (ada_out.values() ** 2).sum().backward()
        assert dict(torchtpu.metrics.snapshot()["cpu_fallbacks"]) == before

    check("mc_ebc_remaps_as_torchrec_cpu", steps)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mc_job(tmp_path_factory):
    return run_spawned(_worker, WORLD, tmp_path_factory.mktemp("mc_job"))


def test_mc_ebc_through_dmp_on_tpu(mc_job):
    assert_check(mc_job, "mc_ebc_remaps_as_torchrec_cpu", WORLD)
