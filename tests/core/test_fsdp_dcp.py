"""Parallel training as PyTorch users write it, on tpu, across real processes (torchtpu/distributed/).

One 2-process job (torch.multiprocessing spawn, a "tpu" default group on XLA collectives) trains the
test transformer (torchtpu_models.TinyTransformer, tiny) with FSDP2 (fully_shard per block and at the
root; f32, and bf16 params with f32 gradient reduction), each against single-process training on the
global batch on CPU, then saves the FSDP2 model and optimizer state with torch.distributed.checkpoint,
and last trains with tensor parallelism alone (torchtpu_models.block_tp_plan over both ranks). The
checkpoint is loaded at world size 1 (this process, unsharded) and at world size 4 (a 4-process job,
below), and training continues from it to the weights of an uninterrupted run.

At world size 4 the model is parallelized TorchTitan's way, on a 2-D mesh: init_device_mesh("tpu",
(2, 2), ("dp", "tp")), parallelize_module with ColwiseParallel/RowwiseParallel on every block's attention
(wq/wk/wv, proj) and MLP (fc, out), SequenceParallel norms and PrepareModuleInput(Output) between them
over "tp" (torchtpu_models.block_tp_plan), fully_shard over "dp". DCP reshards the 2-rank FSDP2
checkpoint onto that layout, and two more steps of dp x tp training match single-process training on
the same global batches.
"""

from __future__ import annotations

import os

import pytest
from helpers import assert_check, named_checks, run_spawned

WORLD = 2
STEPS = 2
LOCAL_BATCH = 2
SEQ = 8


def _config():
    # wq, wk, wv (not one fused qkv): tensor parallelism shards each column-wise into whole heads
    return {"vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2, "max_seq_len": SEQ, "fused_qkv": False}


def _model(seed=0):
    import torch

    from torchtpu_models import TinyTransformer

    torch.manual_seed(seed)
    return TinyTransformer(**_config())


def _batches(world, steps=STEPS):
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 32, (LOCAL_BATCH * world, SEQ + 1), generator=g) for _ in range(steps)]


def _loss(model, tokens):
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _optimizer(params, **kw):
    # SGD with momentum: its state (momentum buffers) is what DCP must carry; Adam's normalized update
    # would turn rounding-level gradient differences near zero into lr-sized weight differences
    import torch

    return torch.optim.SGD(params, lr=0.2, momentum=0.9, **kw)


def _reference(world, with_momentum=False, steps=STEPS):
    """Single process, CPU, the global batch: the weights every parallel run must reach."""
    model = _model()
    opt = _optimizer(model.parameters())
    for tokens in _batches(world, steps):
        opt.zero_grad()
        _loss(model, tokens).backward()
        opt.step()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    if not with_momentum:
        return weights
    return weights, {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()}


def _assert_matches(model, ref, **tol):
    import torch

    sd = model.state_dict()
    for k in ref:
        v = sd[k]
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        torch.testing.assert_close(v.detach().cpu().float(), ref[k].float(), msg=lambda m, k=k: f"{k}: {m}", **tol)


def _worker(rank, port, tmpdir):
    import datetime

    import torch
    import torch.distributed as dist

    import torchtpu  # noqa: F401

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=180))
    check = named_checks(rank, tmpdir)
    ref = _reference(WORLD)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)

    def train(model, params=None):
        opt = _optimizer(params or model.parameters())
        for tokens in _batches(WORLD):
            opt.zero_grad()
            _loss(model, tokens[sl].to("tpu")).backward()
            opt.step()
        return opt

    def fsdp2(mp_policy=None, tol=None):
        from torch.distributed.fsdp import fully_shard

        model = _model().to("tpu")
        kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = train(model)
        _assert_matches(model, ref, **(tol or {"rtol": 1e-4, "atol": 1e-5}))
        return model, opt

    holder = {}

    def fsdp2_f32():
        holder["model"], holder["opt"] = fsdp2()
        for p in holder["model"].parameters():
            assert p.to_local().device.type == "tpu" and p.to_local().shape[0] <= (p.shape[0] + 1) // WORLD
    check("fsdp2_f32", fsdp2_f32)

    def fsdp2_bf16_params_f32_reduce():
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp2(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              tol={"rtol": 5e-2, "atol": 5e-2})
    check("fsdp2_bf16_params_f32_reduce", fsdp2_bf16_params_f32_reduce)

    def dcp_save():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(holder["model"], holder["opt"])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmpdir, "ckpt"))
    check("dcp_save_world2", dcp_save)

    def tp_1d():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from torchtpu_models import block_tp_plan

        mesh = init_device_mesh("tpu", (WORLD,))
        model = _model().to("tpu")
        for block in model.blocks:
            parallelize_module(block, mesh, block_tp_plan(sequence_parallel=False))
        # the parameters outside the plan stay plain tensors: torch's foreach kernels refuse such a mix of
        # DTensors and tensors (on every device), so the per-parameter update
        opt = _optimizer(model.parameters(), foreach=False)
        for tokens in _batches(WORLD):  # tensor parallel only: every rank reads the whole global batch
            opt.zero_grad()
            _loss(model, tokens.to("tpu")).backward()
            opt.step()
        _assert_matches(model, ref, rtol=1e-4, atol=1e-5)
    check("tp_1d", tp_1d)
    dist.barrier()
    dist.destroy_process_group()


WORLD4 = 4


def _worker4(rank, port, tmpdir):
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import torchtpu  # noqa: F401
    from torchtpu_models import block_tp_plan

    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD4,
                            timeout=datetime.timedelta(seconds=300))
    check = named_checks(rank, tmpdir)
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model(seed=1).to("tpu")
    plan = block_tp_plan(sequence_parallel=True)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _optimizer(model.parameters())

    def dcp_load():
        wq = model.blocks[0].attn.wq.weight  # rows split over tp, then over dp
        d = _config()["d_model"]
        assert isinstance(wq, DTensor) and wq.device_mesh.ndim == 2, wq
        assert wq.to_local().device.type == "tpu" and tuple(wq.to_local().shape) == (d // 4, d), wq.to_local().shape
        ln = model.blocks[0].ln1.weight  # sequence parallel: replicated over tp, sharded over dp
        assert isinstance(ln, DTensor) and ln.device_mesh.ndim == 2 and ln.to_local().shape == (d // 2,), ln
        model_sd, optim_sd = get_state_dict(model, opt)  # (initializes the optimizer's state to load into)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(tmpdir, "ckpt"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _assert_matches(model, _reference(WORLD), rtol=1e-4, atol=1e-5)
    check("dcp_load_world4_dp_tp", dcp_load)

    def train_2d():
        # the 2-rank run's next global batches; the two tp ranks of a dp rank read the same rows
        dp = mesh["dp"].get_local_rank()
        for tokens in _batches(WORLD, STEPS + 2)[STEPS:]:
            opt.zero_grad()
            _loss(model, tokens[dp * LOCAL_BATCH:(dp + 1) * LOCAL_BATCH].to("tpu")).backward()
            opt.step()
        _assert_matches(model, _reference(WORLD, steps=STEPS + 2), rtol=1e-4, atol=1e-5)
    check("tp_2d_mesh_training", train_2d)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_dcp")
    return tmp, run_spawned(_worker, WORLD, tmp)


@pytest.fixture(scope="module")
def job4(job):
    """The 4-process job; it reads the checkpoint the 2-process job wrote (in the same directory)."""
    assert_check(job[1], "dcp_save_world2", WORLD)
    return run_spawned(_worker4, WORLD4, job[0])


@pytest.mark.parametrize("name", ["fsdp2_f32", "fsdp2_bf16_params_f32_reduce", "dcp_save_world2", "tp_1d"])
def test_two_processes(job, name):
    assert_check(job[1], name, WORLD)


@pytest.mark.parametrize("name", ["dcp_load_world4_dp_tp", "tp_2d_mesh_training"])
def test_four_processes(job4, name):
    assert_check(job4, name, WORLD4)


def test_dcp_load_at_world_size_1(job):
    """The FSDP2 checkpoint of 2 ranks loads into one unsharded tpu model and optimizer (no process group),
    and training continues from it to the weights of an uninterrupted run."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import torchtpu  # noqa: F401

    assert_check(job[1], "dcp_save_world2", WORLD)
    model = _model(seed=1).to("tpu")
    opt = _optimizer(model.parameters())
    opt.zero_grad()
    _loss(model, _batches(WORLD)[0].to("tpu")).backward()
    opt.step()  # the optimizer has state to be overwritten
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(job[0] / "ckpt"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    weights, momentum = _reference(WORLD, with_momentum=True)
    _assert_matches(model, weights, rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():  # the optimizer state came back too
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].cpu(), momentum[n], rtol=1e-4, atol=1e-5)
    opt.zero_grad()  # and training continues from it to the weights of an uninterrupted run
    _loss(model, _batches(WORLD, STEPS + 1)[STEPS].to("tpu")).backward()
    opt.step()
    _assert_matches(model, _reference(WORLD, steps=STEPS + 1), rtol=1e-4, atol=1e-5)
