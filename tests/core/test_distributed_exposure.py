"""What a process group exposes on the network: rank 0's c10d store and JAX's coordinator listen on the
group's address only (read from /proc/net/tcp{,6}), and the weight-sync header crosses the group as data."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from helpers import listening_sockets, run_spawned

pytestmark = pytest.mark.timeout(600)


def _group_worker(rank, port, tmpdir):
    import torch

    from torchtpu.distributed import runtime
    from torchtpu_rl import weight_sync as ws

    g = ws.CollectiveGroup("tpu", f"tcp://127.0.0.1:{port}", 2, rank, timeout_s=120)
    plan = ws.plan_buckets({"w": torch.zeros(3, 5), "h": torch.zeros(7, dtype=torch.bfloat16)}, 4096)
    out = {}
    if rank == 0:
        out["sockets"] = listening_sockets([os.getpid()])
        out["coordinator"] = runtime.coordinator_address()
        g.send_header(ws.WeightUpdate(7, plan, "collective", None, 1.5, {"pack_s": 0.25}))
    else:
        u = g.recv_header()
        out["update"] = [u.version, u.plan.fingerprint(), u.transport, u.timings]
    out["fingerprint"] = plan.fingerprint()
    import torch.distributed as dist

    dist.barrier()
    g.destroy()
    pathlib.Path(tmpdir, f"out_{rank}.json").write_text(json.dumps(out))


def test_store_and_coordinator_listen_on_the_group_address_only(tmp_path):
    run_spawned(_group_worker, 2, tmp_path)
    r0 = json.loads((tmp_path / "out_0.json").read_text())
    r1 = json.loads((tmp_path / "out_1.json").read_text())
    socks = [tuple(s) for s in r0["sockets"]]
    assert socks, "rank 0 listens on nothing? (the store at least must be there)"
    wild = [s for s in socks if s[0] in ("0.0.0.0", "::")]
    assert not wild, f"rank 0 listens on every interface: {wild} (all: {socks})"
    coord_port = int(r0["coordinator"].rsplit(":", 1)[1])
    assert ("127.0.0.1", coord_port) in socks, (r0["coordinator"], socks)
    # the header arrived whole, as data
    assert r1["update"] == [7, r0["fingerprint"], "collective", {"pack_s": 0.25}]
