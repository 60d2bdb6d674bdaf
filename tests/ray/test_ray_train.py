"""Ray Train's own TPU path on a simulated TPU host: ``TorchTrainer(..., ScalingConfig(num_workers=2,
use_tpu=True, topology=..., accelerator_type=...))`` with torchtpu's opt-in ``torch_tpu`` stand-in
(``TORCHTPU_TORCH_TPU_COMPAT=1``).

The host is a real node of the session's Ray head started with a v4-8 host's TPU environment
(``start_simulated_slice``): Ray reserves the slice, gives each worker 2 chips, picks the c10d backend
``"tpu_dist"`` and imports ``torch_tpu`` itself; nothing of Ray is replaced.
"""

import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

import ray_integration as ri  # noqa: E402
from helpers import eventually as _eventually  # noqa: E402
from ray_integration import SliceSpec  # noqa: E402

pytestmark = pytest.mark.timeout(600)

COMPAT_ENV = {"TORCHTPU_TORCH_TPU_COMPAT": "1"}


@pytest.fixture(scope="module")
def tpu_host(ray_driver):
    sl = ri.start_simulated_slice(ray_driver, SliceSpec.parse("v4-8"), name="sim-v4-8-train", num_cpus_per_host=2)
    try:
        _eventually(lambda: ri.tpu_capacity().get("TPU-v4-8-head") == 1, what="the simulated host's resources")
        yield sl
    finally:
        ri.stop_simulated_slice(ray_driver, sl)
        _eventually(lambda: not ri.tpu_capacity(), what="the TPU resources to leave")


def _train_fn(config):
    import tempfile

    import torch
    import torch.distributed as dist

    import ray.train
    import ray.train.torch

    device = ray.train.torch.get_device()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = ray.train.get_context().get_world_rank()
    x = torch.full((2, 4), float(rank + 1), device=device)  # each rank its own batch: DDP averages the grads
    loss = model(x).sum()
    loss.backward()
    opt.step()
    import torch_tpu

    weight = model.module.weight.detach().cpu()
    with tempfile.TemporaryDirectory() as d:
        torch.save(model.module.state_dict(), os.path.join(d, "model.pt"))
        ray.train.report(
            {"rank": rank, "device": str(device), "backend": dist.get_backend(), "ddp": type(model).__name__,
             "param_device": str(next(model.parameters()).device), "weight": weight.tolist(),
             "compat": getattr(torch_tpu, "IS_TORCHTPU_COMPAT", False), "world": dist.get_world_size()},
            checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None,
        )


@ray.remote(num_cpus=0, runtime_env={"env_vars": COMPAT_ENV})
def _fit(storage_path):
    # a driver whose job runtime env opts in: Ray Train's controller and workers inherit it
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _train_fn,
        scaling_config=ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x1", accelerator_type="TPU-V4",
                                     resources_per_worker={"TPU": 2, "CPU": 1}),
        run_config=RunConfig(storage_path=storage_path, name="tpu-train"),
    )
    result = trainer.fit()
    return result.metrics, result.checkpoint.path if result.checkpoint else None


def test_torch_trainer_use_tpu_runs_on_tpu(tpu_host, tmp_path):
    import torch

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import this test module
    metrics, ckpt = ray.get(_fit.remote(str(tmp_path)), timeout=540)
    # the reported metrics are rank 0's
    assert metrics["device"] == "tpu" and metrics["param_device"] == "tpu:0", metrics
    assert metrics["backend"] == "tpu_dist" and metrics["world"] == 2, metrics
    assert metrics["ddp"] == "DistributedDataParallel" and metrics["compat"] is True, metrics
    # the step used the mean of both ranks' grads (x = 1 and x = 2): what one process would get on both batches
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 1, bias=False)
    grad = (torch.full((2, 4), 1.0).sum(0) + torch.full((2, 4), 2.0).sum(0)) / 2
    expected = ref.weight.detach() - 0.1 * grad
    assert torch.allclose(torch.tensor(metrics["weight"]), expected, atol=1e-5), (metrics["weight"], expected)
    assert ckpt is not None
    state = torch.load(os.path.join(ckpt, "model.pt"), map_location="cpu")
    assert torch.allclose(state["weight"].cpu(), expected, atol=1e-5)


def test_compat_stands_aside_for_a_real_torch_tpu(tmp_path):
    # a torch_tpu on the path (as Google's package would be) is what `import torch_tpu` gets, opt-in or not
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "torch_tpu" / "__init__.py").write_text("REAL = True\n")
    code = ("import torch, torch_tpu, torchtpu_autoload as a; "
            "print(getattr(torch_tpu, 'REAL', False), a.enable_torch_tpu_compat(), a.torch_tpu_is_compat())")
    env = {**os.environ, **COMPAT_ENV, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(tmp_path)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]
    # without the opt-in nothing serves the name; with it, the stand-in does; a bad value is named
    env["PYTHONPATH"] = os.getcwd()
    for value, expect in (("0", "no"), ("1", "compat")):
        env["TORCHTPU_TORCH_TPU_COMPAT"] = value
        code = ("import torch\ntry:\n import torch_tpu; print('compat' if torch_tpu.IS_TORCHTPU_COMPAT else 'real')\n"
                "except ImportError: print('no')")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expect, (value, out.stdout, out.stderr[-2000:])
    env["TORCHTPU_TORCH_TPU_COMPAT"] = "yes"
    out = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "TORCHTPU_TORCH_TPU_COMPAT='yes'" in out.stderr
