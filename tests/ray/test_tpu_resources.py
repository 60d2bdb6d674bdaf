"""TPU resource requests on a simulated TPU host: a real node of the session's local Ray head started
with the TPU environment of a v4-8 host (``start_simulated_slice``), so Ray itself offers
``{"TPU": 4, "TPU-v4-8-head": 1}`` and sets each process's ``TPU_VISIBLE_CHIPS`` and bounds."""


import pytest

ray = pytest.importorskip("ray")

import ray_integration as ri  # noqa: E402
from helpers import eventually as _eventually  # noqa: E402
from ray_integration import SliceSpec  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tpu_host(ray_driver):
    assert ri.tpu_capacity() == {}  # the session head alone: CPU only
    assert ri.tpu_actor_options(2, slice_head=True) == {}  # nothing requested, nothing changes
    sl = ri.start_simulated_slice(ray_driver, SliceSpec.parse("v4-8"), name="sim-v4-8-res")
    try:
        _eventually(lambda: ri.tpu_capacity().get("TPU-v4-8-head") == 1, what="the simulated host's resources")
        yield sl
    finally:
        ri.stop_simulated_slice(ray_driver, sl)
        # later tests share the head: they must see a CPU-only cluster again
        _eventually(lambda: not ri.tpu_capacity(), what="the TPU resources to leave")


@ray.remote
class _Chip:
    def env(self):
        import os

        return {k: os.environ.get(k) for k in ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS",
                                               "TPU_HOST_BOUNDS", "TPU_ACCELERATOR_TYPE")}


def test_one_process_per_chip_as_ray_sets_it(tpu_host):
    cap = ri.tpu_capacity()
    assert cap["TPU"] == 4 and cap["TPU-v4-8-head"] == 1
    head = ri.tpu_actor_options(slice_head=True)
    assert head == {"resources": {"TPU": 1, "TPU-v4-8-head": 1}}
    actors = [_Chip.options(num_cpus=0, **head).remote()]
    actors += [_Chip.options(num_cpus=0, **ri.tpu_actor_options()).remote() for _ in range(3)]
    envs = ray.get([a.env.remote() for a in actors], timeout=300)
    try:
        assert sorted(e["TPU_VISIBLE_CHIPS"] for e in envs) == ["0", "1", "2", "3"]
        assert all(e["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1" and e["TPU_HOST_BOUNDS"] == "1,1,1" for e in envs)
        assert all(e["TPU_ACCELERATOR_TYPE"] == "v4-8" for e in envs), envs  # on the TPU host
        # every chip is taken: a fifth one-chip actor would wait; the head resource is taken too
        assert ray.available_resources().get("TPU", 0) == 0
    finally:
        for a in actors:
            ray.kill(a)
    two = _Chip.options(num_cpus=0, **ri.tpu_actor_options(2)).remote()
    try:
        e = ray.get(two.env.remote(), timeout=300)
        assert len(e["TPU_VISIBLE_CHIPS"].split(",")) == 2 and e["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,2,1"
    finally:
        ray.kill(two)


def test_rl_topology_asks_for_a_chip_per_process(tpu_host):
    from torchtpu_rl.topology import make_topology

    # 1 learner + 4 rollout workers do not fit on 4 chips: refused before any actor starts (no hang)
    with pytest.raises(ValueError, match="needs 5 TPU chips .* has 4"):
        make_topology(lambda: None, 0, num_rollout_workers=4)
    with pytest.raises(ValueError, match="chips must be a positive int"):
        ri.tpu_actor_options(0)
