"""examples/dlrm.py submitted as a Ray job (plain Ray's job SDK) to a real local Ray head.

The session head of tests/conftest.py (`ray_head`, with the job dashboard) runs the example as the
job's entrypoint with a short config; the job spawns its own 2 DMP processes on the tpu backend, which
train TorchRec's DLRM-DCNv2 from Criteo-format npy files the example writes. The test waits for SUCCEEDED
and reads what the job wrote: metrics.json (torchrec.metrics' AUC, NE and calibration, both ranks of the
DMP, their shards of the tables) and the PNG plot.
"""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("torchrec")

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dlrm_example_via_ray_job_submit(ray_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from ray_integration.jobs import DEFAULT_EXCLUDES

    out = tmp_path / "dlrm"
    client = JobSubmissionClient(ray_head.dashboard_url)
    # what `ray job submit --working-dir . -- python examples/dlrm.py ...` sends (docs/rec.md)
    job_id = client.submit_job(
        entrypoint=f"python examples/dlrm.py --out {out} --steps 8 --eval-every 4 --rows 100 "
                   "--batch-size 128 --min-auc 0.55",
        runtime_env={"working_dir": ROOT, "excludes": DEFAULT_EXCLUDES + ["tests", "benchmarks", "docs"]},
    )
    deadline = time.monotonic() + 420
    status = client.get_job_status(job_id)
    while status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"job {job_id} still {status} after 420 s; logs:\n{client.get_job_logs(job_id)[-4000:]}")
        time.sleep(1.0)
        status = client.get_job_status(job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, f"job {job_id} {status}:\n{logs[-6000:]}"
    assert "final AUC" in logs, logs[-3000:]

    m = json.loads((out / "metrics.json").read_text())
    assert m["model"] == "dcn" and m["layout"] == "npy"
    # the held-out AUC (torchrec.metrics) was measured before and after training, and rose (planted signal)
    assert len(m["history"]["auc"]) == 3 and m["history"]["eval_step"] == [0, 4, 8]
    assert 0.4 < m["initial_auc"] < 0.6 and m["final_auc"] > 0.55, (m["initial_auc"], m["final_auc"])
    assert 0 < m["final_ne"] < 1.2 and 0 < m["final_calibration"] < 3, (m["final_ne"], m["final_calibration"])
    assert m["steps"] == 8 and len(m["history"]["loss"]) == 8
    # the 2-process DMP ran: both ranks on the tpu backend, each holding shards of the 26 Criteo tables
    assert m["world_size"] == 2 and [r["rank"] for r in m["ranks"]] == [0, 1]
    assert len({r["pid"] for r in m["ranks"]}) == 2
    assert all(r["backend"] == "tpu" and r["device"].startswith("tpu") and r["steps"] == 8 for r in m["ranks"])
    assert sorted(m["sharding"]) == sorted(f"t_cat_{i}" for i in range(26))
    sharded = {t for t, kind in m["sharding"].items() if kind != "data_parallel"}
    assert {t for r in m["ranks"] for t in r["tables"]} == sharded and sharded
    assert all(r["tables"] for r in m["ranks"])  # the planner spread the tables over both processes
    png = (out / "dlrm.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
