"""Variable batch per feature (VBE) KeyedJaggedTensors through the unchanged DistributedModelParallel on tpu,
against TorchRec's unsharded EmbeddingBagCollection on CPU (which runs VBE natively: it pools each bag once
and indexes the pooled rows by the inverse indices).

One 2-process spawn on the tpu backend; each rank has its own VBE batch (``stride_per_key_per_rank``:
another batch size per feature, ``inverse_indices`` mapping the full batch to each feature's bags):
* forward of table-wise, row-wise, column-wise and data-parallel SUM tables beside a row-wise MEAN table
  (whose divisor TorchRec also applied to the other sharding types' features: fixed in our sharded EBC);
* one fused-SGD step: the gathered tables equal the CPU model's after torch's SGD on both ranks' batches;
* an inverse index out of range raises an IndexError naming the feature, and a VBE KJT without inverse
  indices a ValueError, before any collective (the group stays in step).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_check, named_checks, run_spawned, tpu_dmp

pytestmark = pytest.mark.timeout(300)

WORLD = 2
LR = 0.1
B = 5  # the full batch of every feature after the inverse indices
FEATURES = ["f_tw", "f_rw", "f_cw", "f_dp", "f_mean"]
ROWS = {"f_tw": 30, "f_rw": 33, "f_cw": 20, "f_dp": 10, "f_mean": 12}


def _tables():
    from torchrec import EmbeddingBagConfig, PoolingType

    return [EmbeddingBagConfig(name="t" + f[1:], embedding_dim=8 if f == "f_cw" else 4, num_embeddings=ROWS[f],
                               feature_names=[f], pooling=PoolingType.MEAN if f == "f_mean" else PoolingType.SUM)
            for f in FEATURES]


def _vbe_batch(seed: int, inverse=None):
    """A VBE KJT: feature i has its own number of (deduplicated) bags; every sample of the batch of B
    points at one of them."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    strides = [int(torch.randint(1, B + 1, (1,), generator=g)) for _ in FEATURES]
    strides[0] = B  # one feature at the full batch
    lengths = torch.cat([torch.randint(0, 4, (s,), generator=g) for s in strides])
    lengths[1] = 0  # an empty bag
    hi = torch.tensor([ROWS[f] for f in FEATURES]).repeat_interleave(torch.tensor(strides)).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * hi).long()
    if inverse is None:
        inverse = torch.stack([torch.randint(0, s, (B,), generator=g) for s in strides])
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths,
                             stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(FEATURES, inverse))


def _close(name, a, b, atol=1e-5):
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=1e-5):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        raise AssertionError(f"{name}: max diff {diff}")


def _worker(rank, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import torchtpu  # noqa: F401

    dist.init_process_group("tpu", rank=rank, world_size=WORLD)
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_wise

    from torchtpu_rec.checkpoint import load_unsharded_state_dict, unsharded_state_dict
    from torchtpu_rec.sharding import TPUEmbeddingBagCollectionSharder

    sharder = TPUEmbeddingBagCollectionSharder(fused_params={"optimizer": "sgd", "learning_rate": LR})
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    batches = [_vbe_batch(200 + r) for r in range(WORLD)]
    mine = batches[rank]
    assert mine.variable_stride_per_key()
    check = named_checks(rank, tmpdir)
    plan = {"t_tw": table_wise(rank=1), "t_rw": row_wise(), "t_cw": column_wise(ranks=[0, 1]),
            "t_dp": data_parallel(), "t_mean": row_wise()}
    dmp = tpu_dmp(EmbeddingBagCollection(tables=_tables(), device=torch.device("meta")), plan, sharder, WORLD)
    load_unsharded_state_dict(dmp, ref_sd)

    def forward():
        out = dmp(mine).wait()
        exp = ref(mine)
        assert out.values().shape == (B, sum(t.embedding_dim for t in _tables())), out.values().shape
        for f in FEATURES:
            _close(f"VBE forward {f}", out[f], exp[f])

    check("vbe_forward_matches_cpu_torchrec", forward)

    def step():
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
            _close(f"after a VBE step {k}", full[k], v)

    check("vbe_fused_sgd_step_matches_cpu_torchrec", step)

    def bad_input():
        from torchrec import KeyedJaggedTensor

        bad = _vbe_batch(300, inverse=torch.zeros(len(FEATURES), B, dtype=torch.long))
        inv = bad.inverse_indices()[1].clone()
        inv[2, 3] = bad.stride_per_key()[2]  # one past f_cw's last bag
        bad = KeyedJaggedTensor(keys=FEATURES, values=bad.values(), lengths=bad.lengths(),
                                stride_per_key_per_rank=bad.stride_per_key_per_rank(), inverse_indices=(FEATURES, inv))
        with pytest.raises(IndexError, match="'f_cw': inverse index .* of sample 3 is out of range"):
            dmp(bad)
        none = KeyedJaggedTensor(keys=FEATURES, values=bad.values(), lengths=bad.lengths(),
                                 stride_per_key_per_rank=bad.stride_per_key_per_rank())
        with pytest.raises(ValueError, match="no inverse_indices"):
            dmp(none)
        dist.barrier()  # raised before any collective: the group is still in step
        dmp(mine).wait()

    check("vbe_bad_inverse_indices_are_named", bad_input)
    dist.barrier()
    dist.destroy_process_group()


CHECKS = ["vbe_forward_matches_cpu_torchrec", "vbe_fused_sgd_step_matches_cpu_torchrec",
          "vbe_bad_inverse_indices_are_named"]


@pytest.fixture(scope="module")
def vbe_job(tmp_path_factory):
    return run_spawned(_worker, WORLD, tmp_path_factory.mktemp("vbe_job"))


@pytest.mark.parametrize("name", CHECKS)
def test_vbe_through_dmp_on_tpu(vbe_job, name):
    assert_check(vbe_job, name, WORLD)
