"""ray_integration against a REAL local Ray cluster (no mocks).

One head for the session (conftest `ray_head`/`ray_driver`), plus a simulated v4-16 slice (two
`ray start` nodes carrying the TPU environment a GKE TPU pod has) for this module. Ray derives
the TPU resources and `ray.io/tpu-*` labels itself, so placement runs exactly as on a real slice.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")

import ray_integration as ri  # noqa: E402
from ray_integration import SliceSpec  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # generous: Ray startup on a loaded 2-core machine is slow

PY = sys.executable


def _eventually(cond, timeout_s=60.0, what="condition"):
    """Ray frees resources and reports deaths asynchronously: poll."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


# --- discovery (no cluster) ---------------------------------------------------------------------

@pytest.mark.parametrize("acc,topo,hosts,chips", [
    ("v4-8", "2x2x1", 1, 4), ("v4-16", "2x2x2", 2, 4), ("v4-32", "2x2x4", 4, 4), ("v4-128", "4x4x4", 16, 4),
    ("v5p-8", "2x2x1", 1, 4), ("v5litepod-16", "4x4", 4, 4), ("v5e-16", "4x4", 4, 4), ("v6e-8", "2x4", 1, 8),
    ("v6e-4", "2x2", 1, 4), ("v6e-1", "1x1", 1, 1), ("v6e-64", "8x8", 16, 4), ("v2-32", "4x4", 4, 4),
    ("tpu7x-16", "2x2x2", 2, 4),
])
def test_slice_spec_parse(acc, topo, hosts, chips):
    s = SliceSpec.parse(acc)
    assert (s.topology, s.num_hosts, s.chips_per_host) == (topo, hosts, chips)
    assert s.num_chips == hosts * chips
    assert s.head_resource == f"TPU-{s.pod_type}-head"


def test_slice_spec_errors_name_the_input():
    for bad, frag in [("v9-16", "v9"), ("v4", "'v4'"), ("v4-15", "15"), ("gpu-8", "gpu-8"), ("v4-24", "24")]:
        with pytest.raises(ValueError, match=frag):
            SliceSpec.parse(bad)
    with pytest.raises(ValueError, match="2x2x1"):
        SliceSpec.parse("v4-16", topology="2x2x1")
    with pytest.raises(TypeError):
        SliceSpec.parse(16)


def test_host_info_from_env():
    env = {"TPU_ACCELERATOR_TYPE": "v4-16", "TPU_WORKER_ID": "1", "TPU_NAME": "my-tpu",
           "TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2", "TPU_TOPOLOGY": "2x2x2"}
    h = ri.HostInfo.from_env(env)
    assert (h.worker_id, h.slice_name, h.hostnames, h.is_head) == (1, "my-tpu", ["10.0.0.1", "10.0.0.2"], False)
    assert h.spec == SliceSpec.parse("v4-16")
    with pytest.raises(ValueError, match="TPU_WORKER_ID=2"):
        ri.HostInfo.from_env({**env, "TPU_WORKER_ID": "2"})
    with pytest.raises(RuntimeError, match="TPU_ACCELERATOR_TYPE"):
        ri.HostInfo.from_env({})


def test_run_dir_too_long_is_refused(tmp_path):
    with pytest.raises(ValueError, match="too long"):
        ri.LocalHead("/tmp/" + "x" * 60)


# --- a simulated slice on the session head ---------------------------------------------------------

@pytest.fixture(scope="module")
def tpu_slice(ray_driver):
    sl = ri.start_simulated_slice(ray_driver, SliceSpec.parse("v4-16"), name="sim-v4-16-a")
    try:
        yield ray_driver, sl
    finally:
        ri.stop_simulated_slice(ray_driver, sl)


def test_simulated_slice_looks_like_a_real_one(tpu_slice):
    head, sl = tpu_slice
    info = ri.discover_slices()[sl.name]
    assert info.complete and info.simulated and info.spec == SliceSpec.parse("v4-16")
    w0, w1 = info.nodes[0], info.nodes[1]
    # Set by Ray's own TPU accelerator manager from the hosts' TPU_* environment:
    assert w0["resources"]["TPU-v4-16-head"] == 1 and "TPU-v4-16-head" not in w1["resources"]
    assert w0["resources"]["TPU"] == 4 and w0["resources"][sl.name] == 1 and w1["resources"][sl.name] == 1
    assert w1["labels"]["ray.io/tpu-worker-id"] == "1" and w1["labels"]["ray.io/tpu-topology"] == "2x2x2"
    assert w0["labels"]["ray.io/accelerator-type"] == "TPU-V4"


def test_placement_whole_slice_head_first(tpu_slice):
    head, sl = tpu_slice
    info = ri.discover_slices()[sl.name]
    with ri.reserve_slices("v4-16", timeout_s=60) as res:
        assert res.slice_names == [sl.name]
        # bundle i is on worker i: bundle 0 on the head host, one bundle per host
        assert res.bundle_nodes(0) == [info.nodes[0]["node_id"], info.nodes[1]["node_id"]]
        _eventually(lambda: ray.available_resources().get("TPU", 0) == 0, what="the slice's TPU to be held")


def test_placement_timeout_is_clear_and_releases(tpu_slice):
    t0 = time.monotonic()
    with pytest.raises(ri.SlicePlacementTimeout, match=r"2 x v4-16.*1 v4-16 slice\(s\) in the cluster"):
        ri.reserve_slices("v4-16", num_slices=2, timeout_s=4)
    with pytest.raises(ri.SlicePlacementTimeout, match="v5p-8"):
        ri.reserve_slices("v5p-8", timeout_s=2)
    assert time.monotonic() - t0 < 60
    # nothing leaked: the one slice that exists can be reserved again
    _eventually(lambda: ray.available_resources().get("TPU", 0) == 8, what="TPU to be released")
    with ri.reserve_slices("v4-16", timeout_s=30) as res:
        assert len(res.placement_groups) == 1


class _Host:
    """A user host class: all-reduces its rank+1 over the group."""

    def __init__(self, scale):
        from ray_integration import current_host

        self.ctx = current_host()
        self.scale = scale

    def allreduce(self):
        import torch
        import torch.distributed as dist

        from ray_integration import current_host

        ctx = current_host()
        t = torch.tensor([float(ctx.rank + 1) * self.scale], device=ctx.device)
        dist.all_reduce(t)
        return {"sum": float(t.cpu()[0]), "rank": ctx.rank, "world": dist.get_world_size(),
                "generation": ctx.generation, "pid": os.getpid()}


def test_host_group_runs_and_recovers(tpu_slice):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import this test module
    head, sl = tpu_slice
    with ri.TPUHostGroup(_Host, "v4-16", args=(2.0,), devices_per_host=2) as group:
        infos = group.host_info()
        assert [i["env"]["TPU_WORKER_ID"] for i in infos] == ["0", "1"]
        assert all(i["env"]["TPU_NAME"] == sl.name and i["env"]["TPU_ACCELERATOR_TYPE"] == "v4-16" for i in infos)
        assert [i["jax_devices"] for i in infos] == [2, 2]
        r1 = group.run("allreduce")
        assert [r["sum"] for r in r1] == [6.0, 6.0] and [r["rank"] for r in r1] == [0, 1]

        ray.kill(group.actors[1], no_restart=True)  # a host dies
        status = _eventually(lambda: (lambda st: st if not st[1].alive else None)(group.health_check(timeout_s=10)),
                             what="the killed host to be reported dead")
        assert [s.alive for s in status] == [True, False]
        with pytest.raises(ri.HostFailure) as ei:
            group.run("allreduce", timeout_s=30)
        assert ei.value.ranks == [1]

        assert group.recover() == [1]
        r2 = group.run("allreduce")
        assert [r["sum"] for r in r2] == [6.0, 6.0] and [r["world"] for r in r2] == [2, 2]
        assert r2[0]["pid"] == r1[0]["pid"] and r2[1]["pid"] != r1[1]["pid"]  # only the dead host restarted
        assert [r["generation"] for r in r2] == [2, 2]
    _eventually(lambda: ray.available_resources().get("TPU", 0) == 8, what="the group to release its slice")


# --- jobs ----------------------------------------------------------------------------------------

JOB_SCRIPT = textwrap.dedent("""
    import os, ray, torch, torchtpu
    ray.init()
    @ray.remote(num_cpus=0)
    def square(x):
        return x * x
    t = (torch.arange(4.0, device="tpu") * 2).sum()
    print("JOB-OK", os.environ["GREETING"], ray.get(square.remote(7)), float(t.cpu()), flush=True)
""")


def _run(cmd, **kw):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kw)


def test_job_submit_via_cli_and_plain_ray(ray_head, tmp_path):
    (tmp_path / "job.py").write_text(JOB_SCRIPT)
    url = ray_head.dashboard_url
    # ours: submits, follows the logs to the end, exit code = job result
    p = _run([PY, "-m", "ray_integration", "job", "submit", "--address", url, "--working-dir", str(tmp_path),
              "--env", "GREETING=hello", "--", "python", "job.py"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "JOB-OK hello 49 12.0" in p.stdout
    job_id = p.stdout.split()[0]
    st = _run([PY, "-m", "ray_integration", "job", "status", "--address", url, "--json", job_id])
    assert json.loads(st.stdout)["status"] == "SUCCEEDED"
    lg = _run([PY, "-m", "ray_integration", "job", "logs", "--address", url, job_id])
    assert "JOB-OK hello 49 12.0" in lg.stdout

    # plain `ray job submit` against the same head, logs read back through our API
    p = _run([os.path.join(os.path.dirname(PY), "ray"), "job", "submit", "--address", url,
              "--submission-id", "plain-ray-job", "--working-dir", str(tmp_path),
              "--runtime-env-json", json.dumps({"env_vars": {"GREETING": "plain"}}), "--", "python", "job.py"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "JOB-OK plain 49 12.0" in p.stdout
    assert ri.jobs.status(url, "plain-ray-job") == "SUCCEEDED"
    assert "JOB-OK plain" in ri.jobs.logs(url, "plain-ray-job")

    # a job that would run forever is stopped
    jid = ri.jobs.submit(url, ["python", "-c", "import time; print('sleeping', flush=True); time.sleep(600)"])
    stop = _run([PY, "-m", "ray_integration", "job", "stop", "--address", url, jid])
    assert stop.returncode == 0, stop.stderr
    assert ri.jobs.wait(url, jid, timeout_s=60) == "STOPPED"


def test_cli_head_start_status_stop(tmp_path_factory):
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="rt_cli_", dir="/tmp")
    base = [PY, "-m", "ray_integration", "--run-dir", run_dir, "head"]
    try:
        p = _run(base + ["start", "--no-dashboard", "--num-cpus", "1", "--json"])
        assert p.returncode == 0, p.stdout + p.stderr
        started = json.loads(p.stdout)
        st = _run(base + ["status", "--json"])
        assert st.returncode == 0 and json.loads(st.stdout)["alive"] and json.loads(st.stdout)["nodes"] == 1
        again = _run(base + ["start", "--no-dashboard"])
        assert again.returncode == 1 and "already running" in again.stderr
        assert _run(base + ["stop"]).returncode == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{started['pid']}"):
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{started['pid']}")
        assert _run(base + ["status"]).returncode == 1
    finally:
        _run(base + ["stop"])
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
