"""Helpers shared by test modules (pytest puts tests/ on sys.path)."""

import contextlib

import torchtpu


@contextlib.contextmanager
def no_fallback():
    """CPU fallback off inside the block, and no op may have fallen back in it."""
    before = dict(torchtpu.metrics.snapshot()["cpu_fallbacks"])
    torchtpu.set_cpu_fallback(False)
    try:
        yield
    finally:
        torchtpu.set_cpu_fallback(True)
    assert dict(torchtpu.metrics.snapshot()["cpu_fallbacks"]) == before


def free_port() -> int:
    """A free TCP port on localhost (for a spawned process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(worker, nprocs: int, tmpdir) -> None:
    """Run ``worker(rank, port, tmpdir, failures)`` in ``nprocs`` spawned processes; fail with every
    rank's tracebacks that the workers appended to ``failures``."""
    import torch.multiprocessing as mp

    with mp.get_context("spawn").Manager() as manager:
        failures = manager.list()
        mp.start_processes(worker, args=(free_port(), str(tmpdir), failures), nprocs=nprocs, join=True,
                           start_method="spawn")
        errors = list(failures)
    assert not errors, "\n\n".join(errors)


def named_checks(rank: int, failures):
    """``(check, results)`` for a spawned worker: ``check(name, fn)`` runs ``fn``, records its time in
    ``results`` and a failure's traceback in ``failures``, so later checks still run.
    ``REC_TEST_ONLY=a,b`` runs only the named checks; ``REC_TEST_VERBOSE=1`` prints each as it passes."""
    import os
    import time
    import traceback

    results = []

    def check(name, fn):
        only = os.environ.get("REC_TEST_ONLY")
        if only and name not in only.split(","):
            return
        t0, c0 = time.time(), time.process_time()
        try:
            fn()
            results.append(f"{name} ({time.time() - t0:.1f}s, cpu {time.process_time() - c0:.1f}s)")
            if os.environ.get("REC_TEST_VERBOSE"):
                print(rank, results[-1], flush=True)
        except Exception:
            failures.append(f"rank {rank} {name}:\n{traceback.format_exc()}")

    return check, results


def expect_owner_index_error(run, rank: int, owner: int, feature: str) -> None:
    """``run()`` feeds a DMP an out-of-range id of ``feature``: the rank owning its table must raise an
    IndexError naming the feature; the other rank may see its output all-to-all lose its peer."""
    try:
        run()
    except IndexError as e:
        if rank == owner:
            assert feature in str(e), str(e)
        return
    except RuntimeError:
        if rank != owner:  # the owner's error leaves the other rank's output all-to-all without a peer
            return
        raise
    if rank == owner:
        raise AssertionError(f"an out-of-range id of {feature} did not raise on rank {owner}, which owns its table")


def tpu_dmp(module, per_param, sharder, world: int):
    """``module`` (built on the meta device) sharded on tpu by DMP with the per-parameter plan
    ``per_param`` (``construct_module_sharding_plan``'s form) over ``world`` ranks of one host."""
    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from torchtpu_rec.sharding import tpu_data_parallel_wrapper

    plan = construct_module_sharding_plan(module, per_param, local_size=world, world_size=world,
                                          device_type="tpu", sharder=sharder)
    return DistributedModelParallel(module, device=torch.device("tpu"), sharders=[sharder],
                                    plan=ShardingPlan({"": plan}), data_parallel_wrapper=tpu_data_parallel_wrapper())
