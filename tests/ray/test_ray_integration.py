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
from helpers import eventually as _eventually, listening_sockets  # noqa: E402
from ray_integration import SliceSpec  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # generous: Ray startup on a loaded 2-core machine is slow

PY = sys.executable


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


def test_job_entrypoint_resources_place_the_driver_on_a_tpu_host(tpu_slice):
    ray_head, sl = tpu_slice
    # the job succeeds only where the driver runs on a host of the slice (its TPU_NAME is the slice's)
    check = f"import os, sys; sys.exit(0 if os.environ.get('TPU_NAME') == {sl.name!r} else 3)"
    p = _run([PY, "-m", "ray_integration", "job", "submit", "--run-dir", str(ray_head.run_dir),
              "--entrypoint-resources", '{"TPU": 4}', "--", "python", "-c", check])
    assert p.returncode == 0, p.stdout + p.stderr
    p = _run([PY, "-m", "ray_integration", "job", "submit", "--run-dir", str(ray_head.run_dir), "--", "python", "-c",
              check])
    assert p.returncode == 1, "without --entrypoint-resources the driver runs on the head, not on a TPU host"


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


def _run(cmd, env=None, **kw):
    """A CLI call in a fresh process with our environment less any Ray auth setting (this process is a
    client of the session head); ``env`` adds to it (a head's ``client_env()``)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**base, **(env or {})}, **kw)


def test_job_submit_via_cli_and_plain_ray(ray_head, tmp_path):
    (tmp_path / "job.py").write_text(JOB_SCRIPT)
    url = ray_head.dashboard_url
    # ours: submits, follows the logs to the end, exit code = job result
    p = _run([PY, "-m", "ray_integration", "job", "submit", "--address", url, "--working-dir", str(tmp_path),
              "--env", "GREETING=hello", "--entrypoint-num-cpus", "1", "--", "python", "job.py"],
             env=ray_head.client_env())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "JOB-OK hello 49 12.0" in p.stdout
    job_id = p.stdout.split()[0]
    # options after the subcommand; the token from the head's run dir (no client env)
    st = _run([PY, "-m", "ray_integration", "job", "status", "--run-dir", str(ray_head.run_dir), "--json", job_id])
    assert json.loads(st.stdout)["status"] == "SUCCEEDED", st.stderr
    lg = _run([PY, "-m", "ray_integration", "job", "logs", "--address", url, job_id], env=ray_head.client_env())
    assert "JOB-OK hello 49 12.0" in lg.stdout
    ls = _run([PY, "-m", "ray_integration", "job", "list", "--address", url, "--json",
               "--token-file", str(ray_head.token_path)])
    assert job_id in {j["submission_id"] for j in json.loads(ls.stdout)}, ls.stderr
    for res, why in [("{TPU: 4}", "not valid JSON"), ('{"CPU": 1}', "--entrypoint-num-cpus"), ('{"TPU": -1}', "non-neg")]:
        bad = _run([PY, "-m", "ray_integration", "job", "submit", "--address", url, "--entrypoint-resources", res,
                    "--", "true"], env=ray_head.client_env())
        assert bad.returncode != 0 and why in bad.stderr, bad.stderr

    # plain `ray job submit` against the same head, logs read back through our API
    p = _run([os.path.join(os.path.dirname(PY), "ray"), "job", "submit", "--address", url,
              "--submission-id", "plain-ray-job", "--working-dir", str(tmp_path),
              "--runtime-env-json", json.dumps({"env_vars": {"GREETING": "plain"}}), "--", "python", "job.py"],
             env=ray_head.client_env())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "JOB-OK plain 49 12.0" in p.stdout
    assert ri.jobs.status(url, "plain-ray-job") == "SUCCEEDED"
    assert "JOB-OK plain" in ri.jobs.logs(url, "plain-ray-job")

    # a job that would run forever is stopped
    jid = ri.jobs.submit(url, ["python", "-c", "import time; print('sleeping', flush=True); time.sleep(600)"])
    stop = _run([PY, "-m", "ray_integration", "job", "stop", "--address", url, jid], env=ray_head.client_env())
    assert stop.returncode == 0, stop.stderr
    assert ri.jobs.wait(url, jid, timeout_s=60) == "STOPPED"


def _stale_record(run_dir, pid: int) -> None:
    """A head.json as a head that died long ago left it, its pid since reused by an unrelated process."""
    rec = {"pid": pid, "address": "127.0.0.1:1", "dashboard_url": None, "run_dir": run_dir, "bind": "127.0.0.1",
           "auth": "token", "num_cpus": 1, "object_store_memory": 80 * 1024**2, "ports": {},
           "head": {"pid": pid, "tag": "head-0badf00d", "log_path": "/dev/null",
                    "identity": {"pid": pid, "start_time": 1, "cmdline": ["ray", "start", "--head"]}},
           "nodes": []}
    with open(os.path.join(run_dir, "head.json"), "w") as f:
        json.dump(rec, f)


def test_cli_head_start_status_stop(tmp_path_factory):
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="rt_cli_", dir="/tmp")
    head = [PY, "-m", "ray_integration", "head"]
    # a bystander in its own session (pgid == pid): what the old `head stop` SIGKILLed via a stale record
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        _stale_record(run_dir, bystander.pid)
        p = _run(head + ["stop", "--run-dir", run_dir])
        assert p.returncode == 0, p.stderr
        assert "another process (left alone)" in p.stdout and "stale head record" in p.stdout, p.stdout
        assert bystander.poll() is None, "head stop killed a process it did not start"
        assert not os.path.exists(os.path.join(run_dir, "head.json"))

        # a stale record does not block `head start` (options after the subcommand)
        _stale_record(run_dir, bystander.pid)
        p = _run(head + ["start", "--run-dir", run_dir, "--no-dashboard", "--num-cpus", "1", "--json"])
        assert p.returncode == 0, p.stdout + p.stderr
        assert "left alone" in p.stderr and bystander.poll() is None
        started = json.loads(p.stdout)
        assert started["auth"] == "token" and started["token_file"] == os.path.join(run_dir, "auth_token")
        assert started["client_env"].startswith("RAY_AUTH_MODE=token")
        assert os.stat(started["token_file"]).st_mode & 0o777 == 0o600
        assert os.stat(run_dir).st_mode & 0o777 == 0o700
        assert os.stat(os.path.join(run_dir, "head.json")).st_mode & 0o777 == 0o600
        st = _run(head + ["status", "--run-dir", run_dir, "--json"])
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["alive"] and json.loads(st.stdout)["nodes"] == 1
        again = _run(head + ["start", "--run-dir", run_dir, "--no-dashboard"])
        assert again.returncode == 1 and "already running" in again.stderr
        p = _run(head + ["stop", "--run-dir", run_dir])
        assert p.returncode == 0 and f"stopped its leader pid {started['pid']}" in p.stdout, p.stdout + p.stderr
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.path.exists(f"/proc/{started['pid']}"):
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{started['pid']}")
        assert _run(head + ["status", "--run-dir", run_dir]).returncode == 1
        assert bystander.poll() is None
    finally:
        _run(head + ["stop", "--run-dir", run_dir])
        bystander.kill()
        bystander.wait()
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


# --- network exposure ----------------------------------------------------------------------------

def _job_api(url: str, token=None, submit=False):
    """What ``url`` (a Ray job API path) answers: ``(status, JSON body or None)``; ``(None, None)`` if it is
    not an HTTP server. ``submit``: POST a harmless job (``true``)."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps({"entrypoint": "true"}).encode() if submit else None
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if submit else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            body = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, None
    except Exception:  # noqa: BLE001 - not an HTTP server (gRPC), or it closed on us
        return None, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None  # e.g. the Prometheus metrics exporter: answers any path with its metrics text


def _is_job_api_answer(body) -> bool:
    return isinstance(body, list) or (isinstance(body, dict) and ("submission_id" in body or "job_id" in body))


def test_head_listens_as_documented_and_refuses_clients_without_its_token(ray_head):
    from ray_integration.cluster import _tagged_processes

    assert ray_head.auth == "token"
    assert os.stat(ray_head.token_path).st_mode & 0o777 == 0o600
    assert os.stat(ray_head.run_dir).st_mode & 0o777 == 0o700
    socks = listening_sockets(_tagged_processes(ray_head.head.tag))
    assert socks, "no listening socket found for the head's processes"
    # the dashboard (Ray's job API) on loopback only
    dash = [a for a, port in socks if port == ray_head.dashboard_port]
    assert dash and all(a == "127.0.0.1" for a in dash), socks
    # no server of the cluster, on any address it listens on, lists or takes a job without the token
    http = 0
    for addr, port in socks:
        host = "127.0.0.1" if addr in ("0.0.0.0", "::") else (f"[{addr}]" if ":" in addr else addr)
        for path in ("/api/jobs/", "/api/job_agent/jobs/"):
            for submit in (False, True):
                code, body = _job_api(f"http://{host}:{port}{path}", submit=submit)
                assert not _is_job_api_answer(body), f"{addr}:{port}{path} answered {code} {body} without the token"
                http += code is not None
    assert http, "no HTTP server answered at all (the scan would prove nothing)"
    # the same requests with the token work (the scan can see a job API when there is one)
    assert _is_job_api_answer(_job_api(f"{ray_head.dashboard_url}/api/jobs/", ray_head.token())[1])
    assert _job_api(f"{ray_head.dashboard_url}/api/jobs/", "0" * 64)[0] == 403


def test_auth_modes_are_checked():
    with pytest.raises(ValueError, match="auth mode"):
        ri.LocalHead("/tmp/rt_badauth", auth="none")
    with pytest.warns(RuntimeWarning, match="WITHOUT token authentication"):
        ri.cluster.resolve_auth("disabled")


def test_a_head_removes_the_private_run_dir_it_made():
    import uuid

    run_dir = f"/tmp/rt_own{uuid.uuid4().hex[:6]}"  # what torchtpu_rl's ray_session makes (rt_rl*)
    with ri.local_head(run_dir, num_cpus=1, include_dashboard=False) as head:
        assert os.stat(run_dir).st_mode & 0o777 == 0o700
        assert os.stat(head.token_path).st_mode & 0o777 == 0o600
        # Ray's own temp dir inside it is world-writable (Ray's choice), unreachable through the private parent
        assert os.path.isdir(os.path.join(run_dir, "r"))
    assert not os.path.exists(run_dir)
