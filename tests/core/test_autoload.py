"""``import torch`` alone: torch's ``torch.backends`` entry point (torchtpu_autoload) in fresh interpreters.

The entry point is in the installed metadata once ``pip install -e .`` ran (scripts/setup.sh); where this
checkout's metadata is not installed (a venv made from another checkout), the test puts a dist-info
declaring the same entry point on the child's path, so torch's own autoload finds and calls it.
"""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = [str(ROOT)]
    declared = [e.value for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "tpu"]
    if "torchtpu_autoload:load" not in declared:
        d = tmp_path_factory.mktemp("ep") / "torchtpu_autoload_entrypoint-0.dist-info"
        d.mkdir()
        (d / "METADATA").write_text("Metadata-Version: 2.1\nName: torchtpu-autoload-entrypoint\nVersion: 0\n")
        (d / "entry_points.txt").write_text("[torch.backends]\ntpu = torchtpu_autoload:load\n")
        path.insert(0, str(d.parent))
    e = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    e["PYTHONPATH"] = os.pathsep.join(path + [e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def _run(code, env, timeout=300):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=str(ROOT / "tests"))
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_import_torch_alone_gives_the_device_lazily(env):
    _run("""
        import sys
        import torch
        # nothing heavy yet: no JAX, no torchtpu
        assert "jax" not in sys.modules and "torchtpu" not in sys.modules, sorted(m for m in sys.modules if "jax" in m)
        assert torch._C._get_privateuse1_backend_name() == "tpu"
        x = torch.ones(2, device="tpu")  # the first op imports torchtpu, then runs
        assert "torchtpu" in sys.modules and x.device.type == "tpu"
        torch.testing.assert_close((x * 3).cpu(), torch.full((2,), 3.0))
        assert torch.tpu.device_count() == 1 and torch.tpu.is_available()
        y = torch.arange(4.0).to("tpu")
        assert y.sum().item() == 6.0
        f = torch.compile(lambda a: a.sin() + 1, backend="tpu")
        torch.testing.assert_close(f(y).cpu(), torch.arange(4.0).sin() + 1)
    """, env)


def test_torch_tpu_and_copy_to_tpu_as_first_use(env):
    _run("""
        import sys
        import torch
        assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]  # imports torchtpu
        assert "torchtpu" in sys.modules
    """, env)
    _run("""
        import torch
        t = torch.randn(3, 3)
        torch.testing.assert_close(t.to("tpu").cpu(), t)  # a copy onto tpu as the first op
        import torchtpu  # an explicit import after the lazy one is the same module
        assert torchtpu.device() == torch.device("tpu", 0)
    """, env)


def test_explicit_import_after_autoload(env):
    _run("""
        import torch
        import torchtpu
        with torch.autocast("tpu"):
            assert (torch.ones(2, 2, device="tpu") @ torch.ones(2, 2, device="tpu")).dtype == torch.bfloat16
    """, env)


def test_c10d_backends_tpu_and_tpu_dist(env):
    _run("""
        import os, sys
        import torch
        import torch.distributed as dist
        assert {"tpu", "tpu_dist"} <= set(dist.Backend.backend_list)
        assert "jax" not in sys.modules
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("tpu_dist", rank=0, world_size=1)
        t = torch.ones(3, device="tpu")
        dist.all_reduce(t)
        torch.testing.assert_close(t.cpu(), torch.ones(3))
        dist.destroy_process_group()
    """, dict(env, PORT=str(_free_port())))


def test_autoload_off(env):
    out = _run("""
        import sys
        import torch
        assert "torchtpu_autoload" not in sys.modules and not hasattr(torch, "tpu")
        try:
            torch.device("tpu")
        except RuntimeError:
            print("refused")
    """, dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert "refused" in out


@pytest.mark.timeout(600)
def test_torchrec_learns_tpu_on_import(env):
    pytest.importorskip("torchrec")
    _run("""
        import os, sys
        import torch, torchrec
        assert "torchtpu_rec" in sys.modules  # registered when torchrec was imported
        import torch.distributed as dist
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed.model_parallel import DistributedModelParallel
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("tpu", rank=0, world_size=1)
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=16, feature_names=["f0"])]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        dmp = DistributedModelParallel(ebc, device=torch.device("tpu"))  # unchanged, as on GPU
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([1, 2, 3]),
                                                  lengths=torch.tensor([2, 1]))
        out = dmp(kjt.to(torch.device("tpu"))).wait()
        assert out["f0"].shape == (2, 8) and out["f0"].device.type == "tpu"
        dist.destroy_process_group()
    """, dict(env, PORT=str(_free_port())), timeout=600)


@pytest.mark.timeout(600)
def test_torchrec_explicit_planner_with_tpu_topology(env):
    # torchrec_dlrm's dlrm_main.py pattern, with only `import torch, torchrec`
    pytest.importorskip("torchrec")
    _run("""
        import os
        import torch, torchrec
        import torch.distributed as dist
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed.comm import get_local_size
        from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("tpu", rank=0, world_size=1)
        device = torch.device("tpu")
        topology = Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                            compute_device=device.type)
        assert topology.compute_device == "tpu" and topology.devices[0].storage.hbm > 0  # HBM per chip
        assert Topology(world_size=1, compute_device="cpu").compute_device == "cpu"  # others untouched
        try:
            Topology(world_size=1, compute_device="xpu")
            raise SystemExit("an unknown device was accepted")
        except AssertionError as e:
            assert "unsupported compute device xpu" in str(e)
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=16, feature_names=["f0"]),
                  EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=32, feature_names=["f1"])]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=4,
                                           storage_reservation=HeuristicalStorageReservation(percentage=0.05))
        assert type(planner._storage_reservation).__name__ == "_TPUStorageReservation"
        assert planner._storage_reservation._percentage == 0.05  # the caller's settings kept
        plan = planner.collective_plan(ebc, get_default_sharders(), dist.GroupMember.WORLD)
        assert all(str(s.placement).endswith("/tpu") or "tpu" in str(s.placement)
                   for p in plan.plan[""].values() for s in p.sharding_spec.shards)
        dmp = DistributedModelParallel(module=ebc, device=device, plan=plan)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]),
                                                  lengths=torch.tensor([2, 1, 0, 1]))
        out = dmp(kjt.to(device)).wait()
        assert out["f0"].shape == (2, 8) and out["f1"].shape == (2, 4) and out["f0"].device.type == "tpu"
        dist.destroy_process_group()
    """, dict(env, PORT=str(_free_port())), timeout=600)


def _free_port():
    from helpers import free_port

    return free_port()
