"""The ``tpu`` torch.distributed backend (torchtpu/distributed.py), across real processes.

Each collective on tpu tensors through a ``"tpu"`` group is checked against the
same collective on CPU tensors through a ``"gloo"`` group of the same ranks
(where gloo has no such collective, e.g. ReduceOp.AVG or the list form of
all_to_all, against gloo's equivalent).

Processes are expensive here (each imports torch + jax + torchtpu), so a few
jobs run many checks each and report per-check results to a JSON file:

* a 2-process job started with ``torch.multiprocessing`` (spawn): every
  collective, async Work, functional collectives, DeferAndFuse flush, CPU
  tensors through the tpu group, subgroups, DDP parity, DeviceMesh, and the
  failure cases (mismatched shapes, mismatched collectives, a rank that never
  joins) with a short group timeout;
* a 4-process job started by ``torchrun`` (env:// init): all_reduce, uneven
  all_to_all, two disjoint subgroups, then a rank that dies: the others must
  get an error within the (short) timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import pytest

HERE = os.path.abspath(__file__)
SHORT = datetime.timedelta(seconds=3)  # the timeout the failure checks run under
LONG = datetime.timedelta(seconds=180)  # the main groups' timeout: generous, the machine is shared


# =====================================================================================================================
# worker side (runs in the launched processes)
# =====================================================================================================================
class _Checks:
    """Runs named checks, recording "ok" or the traceback (one failing check must not stop the rest)."""

    def __init__(self, rank):
        self.rank = rank
        self.results = {}

    def __call__(self, name, fn):
        t0 = time.perf_counter()
        try:
            fn()
            self.results[name] = {"ok": True, "s": round(time.perf_counter() - t0, 3)}
        except Exception:  # noqa: BLE001 - reported to the test
            self.results[name] = {"ok": False, "error": traceback.format_exc()}

    def dump(self, path):
        with open(path, "w") as f:
            json.dump(self.results, f)


def _close(a, b, **kw):
    import torch

    a = a.cpu() if isinstance(a, torch.Tensor) else a
    b = b.cpu() if isinstance(b, torch.Tensor) else b
    torch.testing.assert_close(a, b, **kw)


def _collective_checks(c, rank, world, gloo):
    """Every collective on tpu tensors vs. gloo on CPU tensors (both groups span all ranks)."""
    import torch
    import torch.distributed as dist

    dev = "tpu"
    R = dist.ReduceOp

    def data(shape, dtype=torch.float32, salt=0):
        g = torch.Generator().manual_seed(1000 * rank + salt)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        return torch.randint(-5, 6, shape, generator=g).to(dtype)

    def all_reduce(op, dtype):
        def check():
            x = data((3, 5), dtype, salt=int(op))
            if op == R.PRODUCT and dtype.is_floating_point:
                x = x.abs() + 0.5
            t = x.to(dev)
            dist.all_reduce(t, op=op)
            ref = x.clone()
            if op == R.AVG:  # gloo has no AVG: SUM, then divide as NCCL does
                dist.all_reduce(ref, op=R.SUM, group=gloo)
                ref = ref / world if dtype.is_floating_point else torch.div(ref, world, rounding_mode="trunc")
            else:
                dist.all_reduce(ref, op=op, group=gloo)
            assert t.device.type == "tpu"
            _close(t, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
        return check

    for op in (R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT):
        c(f"all_reduce_{op.name}_float32", all_reduce(op, torch.float32))
    for op in (R.SUM, R.MAX, R.BOR):
        c(f"all_reduce_{op.name}_int64", all_reduce(op, torch.int64))
    c("all_reduce_SUM_bfloat16", all_reduce(R.SUM, torch.bfloat16))

    def all_reduce_bool():
        x = data((6,), torch.bool)
        t = x.to(dev)
        dist.all_reduce(t, op=R.SUM)  # logical or
        ref = x.to(torch.uint8)
        dist.all_reduce(ref, op=R.MAX, group=gloo)
        _close(t, ref.bool())
    c("all_reduce_bool", all_reduce_bool)

    def all_reduce_view():
        # a strided view: the result must land in the viewed elements of the base tensor only
        base = data((4, 3)).to(dev)
        before = base.cpu()
        col = base[:, 1]
        dist.all_reduce(col)
        ref = before[:, 1].contiguous()
        dist.all_reduce(ref, group=gloo)
        expect = before.clone()
        expect[:, 1] = ref
        _close(base, expect)
    c("all_reduce_strided_view", all_reduce_view)

    def broadcast():
        for src in range(world):
            x = data((2, 7), salt=src)
            t = x.to(dev)
            dist.broadcast(t, src=src)
            ref = x.clone()
            dist.broadcast(ref, src=src, group=gloo)
            _close(t, ref)
    c("broadcast", broadcast)

    def broadcast_complex():
        x = torch.complex(data((4,)), data((4,), salt=1))
        t = x.to(dev)
        dist.broadcast(t, src=1)
        ref = torch.view_as_real(x).clone()
        dist.broadcast(ref, src=1, group=gloo)
        _close(t, torch.view_as_complex(ref))
    c("broadcast_complex64", broadcast_complex)

    def all_gather():
        x = data((2, 3))
        outs = [torch.empty(2, 3, device=dev) for _ in range(world)]
        dist.all_gather(outs, x.to(dev))
        refs = [torch.empty(2, 3) for _ in range(world)]
        dist.all_gather(refs, x, group=gloo)
        for o, r in zip(outs, refs):
            _close(o, r)
    c("all_gather", all_gather)

    def all_gather_into_tensor():
        x = data((3,), torch.int32)
        out = torch.empty(world * 3, dtype=torch.int32, device=dev)
        dist.all_gather_into_tensor(out, x.to(dev))
        ref = torch.empty(world * 3, dtype=torch.int32)
        dist.all_gather_into_tensor(ref, x, group=gloo)
        _close(out, ref)
    c("all_gather_into_tensor", all_gather_into_tensor)

    def reduce_scatter_tensor():
        for op in (R.SUM, R.AVG, R.MAX):
            x = data((world * 4,), salt=int(op))
            out = torch.empty(4, device=dev)
            dist.reduce_scatter_tensor(out, x.to(dev), op=op)
            full = x.clone()  # gloo: the same reduction, then this rank's chunk
            dist.all_reduce(full, op=R.SUM if op == R.AVG else op, group=gloo)
            if op == R.AVG:
                full = full / world
            _close(out, full[rank * 4:(rank + 1) * 4])
    c("reduce_scatter_tensor", reduce_scatter_tensor)

    def reduce_scatter_list():
        xs = [data((2, 2), salt=i) for i in range(world)]
        out = torch.empty(2, 2, device=dev)
        dist.reduce_scatter(out, [x.to(dev) for x in xs])
        ref = torch.stack(xs)
        dist.all_reduce(ref, group=gloo)
        _close(out, ref[rank])
    c("reduce_scatter_list", reduce_scatter_list)

    def all_to_all_single_even():
        x = data((world * 2, 3))
        out = torch.empty(world * 2, 3, device=dev)
        dist.all_to_all_single(out, x.to(dev))
        ref = torch.empty(world * 2, 3)
        dist.all_to_all_single(ref, x, group=gloo)
        _close(out, ref)
    c("all_to_all_single_even", all_to_all_single_even)

    def all_to_all_single_uneven():
        # rank r sends (r + j + 1) rows to rank j, one of them empty
        send = [(rank + j + 1) % 3 for j in range(world)]
        recv = [(i + rank + 1) % 3 for i in range(world)]
        x = data((sum(send), 2), torch.int64)
        out = torch.empty(sum(recv), 2, dtype=torch.int64, device=dev)
        dist.all_to_all_single(out, x.to(dev), recv, send)
        ref = torch.empty(sum(recv), 2, dtype=torch.int64)
        dist.all_to_all_single(ref, x, recv, send, group=gloo)
        _close(out, ref)
    c("all_to_all_single_uneven", all_to_all_single_uneven)

    def all_to_all_list():
        ins = [data((j + 1,), salt=j) for j in range(world)]  # rank r sends j+1 elements to j
        outs = [torch.empty(rank + 1, device=dev) for _ in range(world)]
        dist.all_to_all(outs, [x.to(dev) for x in ins])
        # gloo has no list all_to_all: the same exchange as all_to_all_single on the packed inputs
        ref = torch.empty(world * (rank + 1))
        dist.all_to_all_single(ref, torch.cat(ins), [rank + 1] * world, [j + 1 for j in range(world)], group=gloo)
        _close(torch.cat([o.cpu() for o in outs]), ref)
    c("all_to_all_list", all_to_all_list)

    def gather_scatter_reduce():
        x = data((5,))
        dst = world - 1
        gl = [torch.empty(5, device=dev) for _ in range(world)] if rank == dst else None
        dist.gather(x.to(dev), gl, dst=dst)
        rl = [torch.empty(5) for _ in range(world)] if rank == dst else None
        dist.gather(x, rl, dst=dst, group=gloo)
        if rank == dst:
            for a, b in zip(gl, rl):
                _close(a, b)
        chunks = [data((3,), salt=10 + i) for i in range(world)]
        out = torch.empty(3, device=dev)
        dist.scatter(out, [ch.to(dev) for ch in chunks] if rank == 0 else None, src=0)
        ref = torch.empty(3)
        dist.scatter(ref, chunks if rank == 0 else None, src=0, group=gloo)
        _close(out, ref)
        t = x.to(dev)
        dist.reduce(t, dst=0, op=R.SUM)
        r = x.clone()
        dist.reduce(r, dst=0, op=R.SUM, group=gloo)
        if rank == 0:
            _close(t, r)
        else:
            _close(t, x)  # non-roots keep their input, as with NCCL's in-place reduce
    c("gather_scatter_reduce", gather_scatter_reduce)

    def barrier():
        dist.barrier()
    c("barrier", barrier)

    def send_recv():
        x = data((4,), torch.float64)
        peer = 1 - rank if world == 2 else None
        if peer is None:
            return
        if rank == 0:
            dist.send(x.to(dev), dst=1)
            got = torch.empty(4, dtype=torch.float64, device=dev)
            dist.recv(got, src=1)
            assert got.device.type == "tpu"
            expected = torch.empty(4, dtype=torch.float64)
            dist.recv(expected, src=1, group=gloo)
            _close(got, expected)
        else:
            got = torch.empty(4, dtype=torch.float64, device=dev)
            dist.recv(got, src=0)
            dist.send(x.to(dev), dst=0)
            dist.send(x, dst=0, group=gloo)
            # rank 0's data, regenerated: generators are seeded by rank
            g = torch.Generator().manual_seed(0)
            _close(got, torch.randn((4,), generator=g).to(torch.float64))
        # isend / irecv with Work handles
        buf = torch.empty(3, device=dev)
        if rank == 0:
            w = dist.isend(torch.tensor([1.0, 2.0, 3.0], device=dev), dst=1)
        else:
            w = dist.irecv(buf, src=0)
        w.wait()
        if rank == 1:
            _close(buf, torch.tensor([1.0, 2.0, 3.0]))
    c("send_recv", send_recv)

    def async_work():
        x = data((6,))
        t = x.to(dev)
        w = dist.all_reduce(t, async_op=True)
        out = torch.empty(world * 6, device=dev)
        w2 = dist.all_gather_into_tensor(out, x.to(dev), async_op=True)
        assert w.wait() and w2.wait()
        assert w.is_completed() and w.is_success()
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        _close(t, ref)
        ref2 = torch.empty(world * 6)
        dist.all_gather_into_tensor(ref2, x, group=gloo)
        _close(out, ref2)
        fut = dist.all_reduce(t, async_op=True).get_future()
        ref3 = ref.clone()
        dist.all_reduce(ref3, group=gloo)
        _close(fut.wait()[0], ref3)
    c("async_work", async_work)

    def cpu_through_tpu_group():
        # the default group is "tpu": CPU tensors sent through it must keep working
        x = data((5,))
        t = x.clone()
        dist.all_reduce(t)
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        _close(t, ref)
        outs = [torch.empty(5) for _ in range(world)]
        dist.all_gather(outs, x)
        refs = [torch.empty(5) for _ in range(world)]
        dist.all_gather(refs, x, group=gloo)
        for a, b in zip(outs, refs):
            _close(a, b)
        a = x.clone()
        dist.all_reduce(a, op=R.AVG)  # gloo itself refuses AVG; through the tpu group it works
        _close(a, ref / world)
    c("cpu_tensors_through_tpu_group", cpu_through_tpu_group)

    def functional():
        import torch.distributed._functional_collectives as fc

        pg = dist.group.WORLD
        x = data((4, 2))
        y = fc.all_reduce(x.to(dev), "sum", pg)
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        _close(fc.wait_tensor(y), ref)
        g = fc.all_gather_tensor(x.to(dev), 0, pg)
        refs = torch.empty(world * 4, 2)
        dist.all_gather_into_tensor(refs, x, group=gloo)
        _close(fc.wait_tensor(g), refs)
        s = fc.reduce_scatter_tensor(x.repeat(world, 1).to(dev), "sum", 0, pg)
        full = x.repeat(world, 1)
        dist.all_reduce(full, group=gloo)
        _close(fc.wait_tensor(s), full[rank * 4:(rank + 1) * 4])
        send = [rank + 1] * world
        recv = [i + 1 for i in range(world)]
        z = data((sum(send), 3))
        a2a = fc.all_to_all_single(z.to(dev), recv, send, pg)
        ref_a2a = torch.empty(sum(recv), 3)
        dist.all_to_all_single(ref_a2a, z, recv, send, group=gloo)
        _close(fc.wait_tensor(a2a), ref_a2a)
        # the raw ops that compiled graphs and DTensor emit
        raw = torch.ops._c10d_functional.all_reduce(x.to(dev), "avg", pg.group_name)
        raw = torch.ops._c10d_functional.wait_tensor(raw)
        _close(raw, ref / world)
    c("functional_collectives", functional)

    def xla_transport():
        # tpu tensors move as XLA programs: not one byte through host memory (the counter covers
        # .cpu(), .to("tpu"), host staging and the CPU fallback); host_staged() takes the old route
        import torchtpu
        from torchtpu.distributed import host_staged, xla_transport_active

        assert xla_transport_active()
        x = data((64,))
        t, g = x.to(dev), x.to(dev)
        out = torch.empty(world * 64, device=dev)
        rs = torch.empty(64 // world, device=dev)
        send = [rank + 1] * world
        recv = [i + 1 for i in range(world)]
        a2a_in = data((sum(send), 2)).to(dev)
        a2a_out = torch.empty(sum(recv), 2, device=dev)
        p2p = torch.full((5,), float(rank), device=dev)
        torchtpu.sync()
        moved = {}
        for name, call in [("all_reduce", lambda: dist.all_reduce(t)),
                           ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, g)),
                           ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs, g)),
                           ("broadcast", lambda: dist.broadcast(g, src=0)),
                           ("all_to_all_single", lambda: dist.all_to_all_single(a2a_out, a2a_in, recv, send)),
                           ("send/recv", lambda: (dist.send if rank == 0 else dist.recv)(p2p, 1 - rank))]:
            before = torchtpu.metrics.snapshot()["host_transfer_bytes"]
            if name != "send/recv" or rank < 2:
                call()
            torchtpu.sync()
            moved[name] = torchtpu.metrics.snapshot()["host_transfer_bytes"] - before
        assert not any(moved.values()), f"collectives staged bytes through host: {moved}"
        _close(p2p, torch.zeros(5))
        before = torchtpu.metrics.snapshot()["host_transfer_bytes"]
        staged = x.to(dev)
        with host_staged():
            dist.all_reduce(staged)
        moved = torchtpu.metrics.snapshot()["host_transfer_bytes"] - before
        assert moved >= 2 * x.numel() * 4, moved  # out to host and back
        _close(staged, t)
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        _close(t, ref)
    c("xla_transport_no_host_bytes", xla_transport)

    def defer_and_fuse():
        import torchtpu

        torchtpu.metrics.reset()
        x = data((8,))
        with torchtpu.execution_mode("defer_and_fuse"):
            t = x.to(dev) * 2 + 1  # pending: a collective that is not recorded must flush it first
            with torchtpu.distributed.host_staged():
                dist.all_reduce(t)
            u = t * 3
            v = u.cpu()
        flushes = torchtpu.metrics.snapshot()["flushes"]
        ref = x * 2 + 1
        dist.all_reduce(ref, group=gloo)
        _close(v, ref * 3)
        assert flushes.get("collective", 0) >= 1, flushes
    c("defer_and_fuse_flush", defer_and_fuse)


def _defer_collective_checks(c, rank, world, gloo):
    """Under DeferAndFuse, collectives on tpu tensors are recorded into the pending graph (one SPMD
    program over the group's devices) instead of flushing it."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import torchtpu
    from torchtpu.runtime.recorder import RECORDER

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4, 6, generator=g) + rank for _ in range(3)]
    ys = [torch.randn(4, 1, generator=g) for _ in range(3)]

    def snap():
        m = torchtpu.metrics.snapshot()
        return dict(m["flushes"]), m["host_transfer_bytes"]

    def train(ddp, mode):
        """Three SGD steps; grads averaged by hand (all_reduce AVG) or by DDP. Returns the weights
        and what the deferred steps did (flush reasons, host bytes, collectives seen pending)."""
        model = make().to("tpu")
        if ddp:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [(x.to("tpu"), y.to("tpu")) for x, y in zip(xs, ys)]
        torchtpu.sync()
        f0, _ = snap()
        seen = 0
        with torchtpu.execution_mode(mode):
            for i, (x, y) in enumerate(data):
                if i == len(data) - 1:  # (DDP's second forward rebuilds its buckets through host memory)
                    _, h0 = snap()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if not ddp:
                    for p in model.parameters():
                        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                seen += sum(n.name.startswith("c10d::") for n in RECORDER.pending)
                opt.step()
            torchtpu.sync()
        f1, h1 = snap()
        flushes = {k: f1.get(k, 0) - f0.get(k, 0) for k in f1 if f1.get(k, 0) != f0.get(k, 0)}
        return [p.detach().cpu() for p in model.parameters()], flushes, h1 - h0, seen

    def check(ddp):
        def run():
            eager, _, _, _ = train(ddp, "strict_eager")
            fused, flushes, host_bytes, seen = train(ddp, "defer_and_fuse")
            assert "collective" not in flushes, flushes
            assert seen > 0, "no collective was ever pending: none was recorded"
            assert host_bytes == 0, f"{host_bytes} bytes went through host memory"
            for a, b in zip(eager, fused):
                _close(b, a, rtol=1e-5, atol=1e-6)
        return run
    c("defer_records_all_reduce_train_step", check(False))
    c("defer_records_ddp_train_step", check(True))

    def data_movement():
        # recorded collectives against gloo on CPU tensors; async works; a host read on one rank only
        # in the middle (rank 0's graph then holds fewer collectives than rank 1's)
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (rank + 1)
        ref_ag = torch.empty(4 * world, 3)
        dist.all_gather_into_tensor(ref_ag, x, group=gloo)
        ref_rs = torch.empty(2, 3)
        dist.reduce_scatter_tensor(ref_rs, x, group=gloo)
        ref_b = x.clone()
        dist.broadcast(ref_b, src=1, group=gloo)
        xt = x.to("tpu")
        torchtpu.sync()
        f0, _ = snap()
        with torchtpu.execution_mode("defer_and_fuse"):
            t = xt * 1
            ag = torch.empty(4 * world, 3, device="tpu")
            w = dist.all_gather_into_tensor(ag, t, async_op=True)
            w.wait()
            if rank == 0:
                _close(ag.cpu(), ref_ag)  # rank 0 alone flushes here
            rs = torch.empty(2, 3, device="tpu")
            dist.reduce_scatter_tensor(rs, t)
            b = t.clone()
            dist.broadcast(b, src=1)
            outs = [torch.empty(3, device="tpu") for _ in range(world)]
            dist.all_gather(outs, t[1])  # a strided view in, list out
            col = torch.zeros(4, 2, device="tpu")
            dist.all_reduce(col[:, 1])  # a strided view lands in place
            torchtpu.sync()
        f1, _ = snap()
        _close(ag, ref_ag)
        _close(rs, ref_rs)
        _close(b, ref_b)
        for r, o in enumerate(outs):
            _close(o, x[1] / (rank + 1) * (r + 1))
        assert f1.get("collective", 0) == f0.get("collective", 0), (f0, f1)
    c("defer_records_data_movement", data_movement)

    def mismatch():
        pg = dist.group.WORLD
        with torchtpu.execution_mode("defer_and_fuse"):
            before = torch.ones(3, device="tpu") * 5 + rank  # recorded before the bad collective: kept
            a = torch.ones(4 + rank, device="tpu")
            dist.all_reduce(a)
            n0 = pg.descriptor_exchanges
            try:
                a.cpu()
            except RuntimeError as e:
                msg = str(e)
            else:
                raise AssertionError("a mismatched collective sequence ran")
            assert "collective #1" in msg and "4 elements" in msg and "5 elements" in msg, msg
            assert pg.descriptor_exchanges == n0 + 1  # one (count, hash) exchange, then the lists
            _close(before, torch.full((3,), 5.0 + rank))
            try:
                a.cpu()
            except RuntimeError as e:
                assert "never computed" in str(e), e
            else:
                raise AssertionError("a dropped collective's result was readable")
        t = torch.ones(2, device="tpu")
        dist.all_reduce(t)  # the group still works
        _close(t, torch.full((2,), float(world)))
    c("defer_mismatch_raises_on_every_rank", mismatch)

    def compiled_functional():
        import warnings

        import torch.distributed._functional_collectives as funcol

        pg = dist.group.WORLD

        def step(x):
            a = funcol.all_reduce(torch.tanh(x) * 2, "sum", pg)
            b = funcol.all_gather_tensor(x + 1, 0, pg)
            r = funcol.reduce_scatter_tensor(x * x, "sum", 0, pg)
            return a.sum(0), b * 3, r - 1

        compiled = torch.compile(step, backend="tpu")
        x = (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 10 * (rank + 1)).to("tpu")
        want = step(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error", torchtpu.TPUFallbackWarning)
            compiled(x)  # compiles
            f0, n0 = snap()[0], pg.descriptor_exchanges
            got = compiled(x)
            f1 = snap()[0]
        assert pg.descriptor_exchanges == n0 + 1, "the graph's three collectives were not one program"
        assert f1.get("compiled graph", 0) == f0.get("compiled graph", 0) + 1 and \
            f1.get("collective", 0) == f0.get("collective", 0), (f0, f1)
        for g_, w_ in zip(got, want):
            _close(g_, w_)
    c("compiled_functional_collectives_one_program", compiled_functional)


def _failure_checks(c, rank, world, dev="tpu"):
    """Mismatched calls must raise on every rank; a rank that never joins gives a timeout error."""
    import torch
    import torch.distributed as dist

    def shape_mismatch():
        t = torch.ones(4 if rank == 0 else 6, device=dev)
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            assert "mismatched collective" in str(e) and "4 elements" in str(e) and "6 elements" in str(e), e
        else:
            raise AssertionError("a shape mismatch went through")
        t = torch.ones(4, device=dev)  # the group is still usable afterwards
        dist.all_reduce(t)
        _close(t, torch.full((4,), float(world)))
    c("mismatch_shape", shape_mismatch)

    def op_mismatch():
        t = torch.ones(4, device=dev)
        try:
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        except RuntimeError as e:
            assert "all_reduce" in str(e) and "broadcast" in str(e), e
        else:
            raise AssertionError("different collectives on the ranks went through")
    c("mismatch_collective", op_mismatch)

    def dtype_mismatch():
        t = torch.ones(4, device=dev, dtype=torch.float32 if rank == 0 else torch.float64)
        try:
            dist.broadcast(t, src=0)
        except RuntimeError as e:
            assert "float32" in str(e) and "float64" in str(e), e
        else:
            raise AssertionError("a dtype mismatch went through")
    c("mismatch_dtype", dtype_mismatch)

    def splits_mismatch():
        # rank 0 expects 2 rows from rank 1, rank 1 sends 1
        x = torch.zeros(2, 2, device=dev)
        out = torch.zeros(3 if rank == 0 else 2, 2, device=dev)
        send, recv = ([1, 1], [1, 2]) if rank == 0 else ([1, 1], [1, 1])
        try:
            dist.all_to_all_single(out, x, recv, send)
        except RuntimeError as e:
            assert "all_to_all_single" in str(e), e
        else:
            raise AssertionError("inconsistent all_to_all splits went through")
    c("mismatch_all_to_all_splits", splits_mismatch)

    def recv_size_mismatch():
        if rank == 0:
            dist.send(torch.ones(5, device=dev), dst=1)
        elif rank == 1:
            try:
                dist.recv(torch.empty(3, device=dev), src=0)
            except RuntimeError as e:
                assert "5 elements" in str(e), e
            else:
                raise AssertionError("a receive of the wrong size went through")
        dist.barrier()
    c("mismatch_recv_size", recv_size_mismatch)

    def agreed_arguments():
        # inside agreed_arguments() an all_to_all whose splits the ranks already exchanged skips the
        # descriptor exchange (one round trip); outside, every collective is checked again
        from torchtpu.distributed import agreed_arguments

        pg = dist.group.WORLD
        counts = torch.tensor([rank + 1, 2], device=dev)  # rank r sends r+1 rows to rank 0, 2 to rank 1
        got = torch.empty(world, dtype=counts.dtype, device=dev)
        dist.all_to_all_single(got, counts)  # checked: the split exchange itself
        send = counts.tolist()
        recv = got.tolist()
        x = torch.arange(sum(send), dtype=torch.float32, device=dev) + 100 * rank
        out = torch.empty(sum(recv), device=dev)
        n0 = pg.descriptor_exchanges
        with agreed_arguments():
            dist.all_to_all_single(out, x, recv, send)
            assert pg.descriptor_exchanges == n0, "agreed_arguments() still exchanged a descriptor"
            try:  # a local argument error still raises (on every rank here: all pass the same bad splits)
                dist.all_to_all_single(out, x, [1] * world, [1] * world)
            except (ValueError, RuntimeError) as e:
                assert "split" in str(e), e
            else:
                raise AssertionError("bad splits went through under agreed_arguments()")
        want = torch.cat([torch.arange(sum([r + 1, 2]), dtype=torch.float32)[(rank and r + 1): (rank and r + 1)
                          + [r + 1, 2][rank]] + 100 * r for r in range(world)])
        _close(out, want)
        dist.all_reduce(torch.ones(1, device=dev))
        assert pg.descriptor_exchanges == n0 + 1, "the collective after agreed_arguments() was not checked"
    c("agreed_arguments_skip_exchange", agreed_arguments)

    def rank_never_joins():
        # a short-timeout group; the last rank does not take part in the collective
        g = dist.new_group(list(range(world)), timeout=SHORT, backend="tpu")
        dist.barrier()
        if rank == world - 1:
            time.sleep(SHORT.total_seconds() + 2)
        else:
            t0 = time.perf_counter()
            try:
                dist.all_reduce(torch.ones(2), group=g)
            except RuntimeError:
                took = time.perf_counter() - t0
                assert took < SHORT.total_seconds() + 15, f"error came after {took:.1f}s"
            else:
                raise AssertionError("a collective without all ranks completed")
    c("rank_never_joins_times_out", rank_never_joins)


def _ddp_check(c, rank, world):
    """DDP on tpu trains to the weights single-process training reaches on the global batch."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def ddp():
        g = torch.Generator().manual_seed(123)
        xs = [torch.randn(4 * world, 6, generator=g) for _ in range(3)]
        ys = [torch.randn(4 * world, 1, generator=g) for _ in range(3)]
        single = make()  # reference: one process, the whole global batch, CPU
        opt = torch.optim.SGD(single.parameters(), lr=0.1)
        for x, y in zip(xs, ys):
            opt.zero_grad()
            nn.functional.mse_loss(single(x), y).backward()
            opt.step()
        model = nn.parallel.DistributedDataParallel(make().to("tpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in zip(xs, ys):
            sl = slice(4 * rank, 4 * (rank + 1))
            opt.zero_grad()
            nn.functional.mse_loss(model(x[sl].to("tpu")), y[sl].to("tpu")).backward()
            opt.step()
        for p, q in zip(model.module.parameters(), single.parameters()):
            assert p.device.type == "tpu"
            _close(p, q, rtol=1e-4, atol=1e-5)
    c("ddp_parity", ddp)

    # The test transformer, with an auxiliary head that the step given decides to use: DDP's
    # static_graph and find_unused_parameters keep a used-parameter map in pinned host memory
    # (the tpu's C++ hooks, torchtpu/runtime/pinned.py).
    class WithAuxHead(nn.Module):
        def __init__(self):
            super().__init__()
            from torchtpu_models import TinyTransformer

            torch.manual_seed(0)
            self.lm = TinyTransformer(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
            self.aux = nn.Linear(32, 1)

        def forward(self, tokens, use_aux):
            logits = self.lm(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
            return loss + self.aux(logits).pow(2).mean() if use_aux else loss

    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 32, (2 * world, 9), generator=g) for _ in range(2)]

    def train(model, aux_steps, ddp_model=None):
        # SGD with momentum: a head left unused on a step must keep grad None (no momentum step), as
        # in one process; a zero gradient would still move it
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        for step, tokens in enumerate(batches):
            opt.zero_grad()
            if ddp_model is None:
                model(tokens, step in aux_steps).backward()
            else:
                ddp_model(tokens[2 * rank:2 * (rank + 1)].to("tpu"), step in aux_steps).backward()
            opt.step()
        return model

    def ddp_transformer(aux_steps, **ddp_kwargs):
        from torchtpu.runtime import pinned

        assert pinned.pinned_hooks_active(), "the tpu's C++ hooks are not built: run scripts/setup.sh"
        ref = train(WithAuxHead(), aux_steps).state_dict()
        model = WithAuxHead().to("tpu")
        train(model, aux_steps, nn.parallel.DistributedDataParallel(model, **ddp_kwargs))
        for k, v in model.state_dict().items():
            _close(v, ref[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")

    # static graph: the same parameters every step (the head on every step); the second step runs
    # the buckets static_graph rebuilt from the first
    c("ddp_static_graph_transformer", lambda: ddp_transformer({0, 1}, static_graph=True))
    # the head used on step 0 and not on step 1: DDP must find it unused (else its backward waits for
    # a gradient that never comes) and leave its gradient None on every rank
    c("ddp_find_unused_parameters_transformer", lambda: ddp_transformer({0}, find_unused_parameters=True))


def _mesh_check(c, rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    def mesh():
        m = init_device_mesh("tpu", (world,), mesh_dim_names=("dp",))
        assert m.device_type == "tpu" and m.size() == world
        m2 = DeviceMesh("tpu", list(range(world)))
        t = torch.full((2,), float(rank), device="tpu")
        dist.all_reduce(t, group=m2.get_group())
        _close(t, torch.full((2,), float(sum(range(world)))))
    c("device_mesh", mesh)

    def dtensor():
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        m = init_device_mesh("tpu", (world,))
        full = torch.arange(4 * world * 3, dtype=torch.float32).reshape(4 * world, 3)
        d = distribute_tensor(full.to("tpu"), m, [Shard(0)])
        assert d.to_local().shape == (4, 3)
        r = d.redistribute(m, [Replicate()]).to_local()  # an all_gather over the tpu group
        _close(r, full)
        s = (d * 2).sum()  # a partial sum reduced with all_reduce
        _close(s.full_tensor(), (full * 2).sum())
    c("dtensor", dtensor)


def _sharded_tensor_check(c, rank, world):
    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

    def empty_on_a_rank():
        # rows on rank 0 only: rank 1 holds no shard, and its ShardedTensor still reports the tpu
        md = ShardMetadata([0, 0], [4, 2], "rank:0/tpu:0")
        glob = ShardedTensorMetadata([md], torch.Size([4, 2]), TensorProperties(dtype=torch.float32))
        local = [Shard(torch.ones(4, 2, device="tpu"), md)] if rank == 0 else []
        st = ShardedTensor._init_from_local_shards_and_global_metadata(local, glob)
        _eq(st.device, torch.device("tpu", 0))
    c("sharded_tensor_device_without_local_shards", empty_on_a_rank)


def _main_job(rank, world, port, out_dir):
    """The 2-process job (started with torch.multiprocessing spawn)."""
    import torch
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (registers the tpu device and backend)

    c = _Checks(rank)
    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=LONG)
    try:
        c("backend_name", lambda: _eq(dist.get_backend(), "tpu"))
        gloo = dist.new_group(backend="gloo", timeout=LONG)
        _collective_checks(c, rank, world, gloo)
        _defer_collective_checks(c, rank, world, gloo)
        sub = dist.new_group([0, 1], backend="tpu", timeout=LONG)

        def subgroup():
            t = torch.full((3,), float(rank + 1), device="tpu")
            dist.all_reduce(t, group=sub)
            _close(t, torch.full((3,), 3.0))
        c("new_group", subgroup)
        _ddp_check(c, rank, world)
        _mesh_check(c, rank, world)
        _sharded_tensor_check(c, rank, world)
        _failure_checks(c, rank, world)
    finally:
        c.dump(os.path.join(out_dir, f"main_{rank}.json"))
        _exit_last_on_rank0(rank, [os.path.join(out_dir, f"main_{r}.json") for r in range(world)])


def _exit_last_on_rank0(rank, paths):
    """``os._exit(0)`` (no destroy: a short group still holds an op that timed out), rank 0 after the
    others wrote ``paths``: rank 0 hosts JAX's multi-process coordinator, and a process that loses
    it without JAX's shutdown barrier (which os._exit skips) is aborted by JAX."""
    if rank == 0:
        deadline = time.time() + 120
        while not all(os.path.exists(p) for p in paths) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
    os._exit(0)


def _eq(a, b):
    assert a == b, (a, b)


def _torchrun_job(out_dir):
    """4 processes launched by torchrun (env:// init from the launcher's variables): collectives,
    disjoint subgroups, then a rank dies and the others must get an error within the timeout."""
    import torch
    import torch.distributed as dist

    import torchtpu  # noqa: F401

    dist.init_process_group(timeout=LONG)  # no backend named: torch picks the accelerator's, "tpu"
    rank, world = dist.get_rank(), dist.get_world_size()
    out_path = os.path.join(out_dir, f"four_{rank}.json")
    c = _Checks(rank)
    gloo = dist.new_group(backend="gloo", timeout=LONG)

    def env_init():
        # torch names a group made without a backend "undefined"; what serves it is the tpu group
        assert type(dist.group.WORLD).__name__ == "ProcessGroupTPU" and dist.get_backend_config() == "tpu:tpu"
        assert world == 4
        assert int(os.environ["LOCAL_RANK"]) == rank
        b = torch.full((2,), float(rank), device="tpu")
        dist.broadcast(b, src=world - 1)
        _close(b, torch.full((2,), float(world - 1)))
    c("torchrun_env_init", env_init)

    def ar():
        x = torch.arange(6, dtype=torch.float32) * (rank + 1)
        t = x.to("tpu")
        dist.all_reduce(t)
        dist.all_reduce(x, group=gloo)
        _close(t, x)
    c("all_reduce_4", ar)

    def a2a():
        send = [(rank * 2 + j) % 4 for j in range(world)]
        recv = [(i * 2 + rank) % 4 for i in range(world)]
        x = torch.arange(sum(send) * 2, dtype=torch.int64).reshape(-1, 2) + 100 * rank
        out = torch.empty(sum(recv), 2, dtype=torch.int64, device="tpu")
        dist.all_to_all_single(out, x.to("tpu"), recv, send)
        ref = torch.empty(sum(recv), 2, dtype=torch.int64)
        dist.all_to_all_single(ref, x, recv, send, group=gloo)
        _close(out, ref)
    c("all_to_all_single_uneven_4", a2a)

    def subgroups():
        g01 = dist.new_group([0, 1], backend="tpu", timeout=LONG)
        g23 = dist.new_group([2, 3], backend="tpu", timeout=LONG)
        mine = g01 if rank < 2 else g23
        t = torch.full((2,), float(rank), device="tpu")
        dist.all_reduce(t, group=mine)
        _close(t, torch.full((2,), 1.0 if rank < 2 else 5.0))
        outs = [torch.empty(1, device="tpu") for _ in range(2)]
        dist.all_gather(outs, torch.tensor([float(rank)], device="tpu"), group=mine)
        _close(torch.cat([o.cpu() for o in outs]), torch.tensor([0.0, 1.0]) + (0 if rank < 2 else 2))
    c("new_group_disjoint", subgroups)

    short = dist.new_group(backend="tpu", timeout=SHORT)
    dist.barrier(group=gloo)
    if rank == world - 1:
        c.dump(out_path)
        # dies without a word (exit status 0, so that torchrun lets the others finish their check)
        os._exit(0)

    def dead_peer():
        time.sleep(1.0)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(3, device="tpu"), group=short)
        except RuntimeError:
            took = time.perf_counter() - t0
            assert took < SHORT.total_seconds() + 15, f"error came after {took:.1f}s"
        else:
            raise AssertionError("a collective with a dead rank completed")
    c("dead_rank_errors", dead_peer)
    c.dump(out_path)
    _exit_last_on_rank0(rank, [os.path.join(out_dir, f"four_{r}.json") for r in range(world)])


# =====================================================================================================================
# test side
# =====================================================================================================================
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(paths):
    out = {}
    for p in paths:
        assert os.path.exists(p), f"a worker wrote no results ({p})"
        with open(p) as f:
            out[p] = json.load(f)
    return out


def _failures(results):
    bad = []
    for path, checks in results.items():
        for name, r in checks.items():
            if not r["ok"]:
                bad.append(f"{os.path.basename(path)} {name}:\n{r['error']}")
    return bad


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("dist_main"))
    ctx = mp.start_processes(_main_job, args=(2, _free_port(), out), nprocs=2, join=False, start_method="spawn")
    deadline = time.time() + 600
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-process job did not finish in 600 s")
    return _load([os.path.join(out, f"main_{r}.json") for r in range(2)])


MAIN_CHECKS = [
    "backend_name",
    *[f"all_reduce_{op}_float32" for op in ("SUM", "AVG", "MIN", "MAX", "PRODUCT")],
    "all_reduce_SUM_int64", "all_reduce_MAX_int64", "all_reduce_BOR_int64", "all_reduce_SUM_bfloat16",
    "all_reduce_bool", "all_reduce_strided_view", "broadcast", "broadcast_complex64", "all_gather",
    "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter_list", "all_to_all_single_even",
    "all_to_all_single_uneven", "all_to_all_list", "gather_scatter_reduce", "barrier", "send_recv", "async_work",
    "cpu_tensors_through_tpu_group", "functional_collectives", "xla_transport_no_host_bytes", "defer_and_fuse_flush",
    "defer_records_all_reduce_train_step", "defer_records_ddp_train_step", "defer_records_data_movement",
    "defer_mismatch_raises_on_every_rank", "compiled_functional_collectives_one_program", "new_group", "ddp_parity",
    "ddp_static_graph_transformer", "ddp_find_unused_parameters_transformer",
    "device_mesh", "dtensor", "sharded_tensor_device_without_local_shards", "mismatch_shape", "mismatch_collective", "mismatch_dtype",
    "mismatch_all_to_all_splits", "mismatch_recv_size", "agreed_arguments_skip_exchange",
    "rank_never_joins_times_out",
]


@pytest.mark.parametrize("name", MAIN_CHECKS)
def test_two_processes(main_job, name):
    for path, checks in main_job.items():
        assert name in checks, f"{os.path.basename(path)} did not run {name}"
        r = checks[name]
        assert r["ok"], f"{os.path.basename(path)}:\n{r['error']}"


def test_every_main_check_is_listed(main_job):
    ran = set().union(*[set(c) for c in main_job.values()])
    assert ran == set(MAIN_CHECKS), ran ^ set(MAIN_CHECKS)


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", HERE,
           "--torchrun", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return _load([str(out / f"four_{r}.json") for r in range(4)])


# the last rank exits before the dead-rank check (it is the rank that dies)
TORCHRUN_CHECKS = {"torchrun_env_init": 4, "all_reduce_4": 4, "all_to_all_single_uneven_4": 4,
                   "new_group_disjoint": 4, "dead_rank_errors": 3}


@pytest.mark.parametrize("name", sorted(TORCHRUN_CHECKS))
def test_torchrun_four_processes(torchrun_job, name):
    ranks = sorted(torchrun_job)[: TORCHRUN_CHECKS[name]]
    for path in ranks:
        checks = torchrun_job[path]
        assert name in checks, f"{os.path.basename(path)} did not run {name}"
        assert checks[name]["ok"], f"{os.path.basename(path)}:\n{checks[name]['error']}"


def test_jax_startup_failure_names_coordinator():
    """init_process_group("tpu") brings up JAX's multi-process runtime; when that cannot start (no
    coordinator at the address), the error says which address, within the group's timeout."""
    port = _free_port()  # nothing listens there
    code = (
        "import datetime, os\n"
        "import torch.distributed as dist\n"
        "import torchtpu\n"
        "try:\n"
        "    dist.init_process_group('tpu', store=dist.HashStore(), rank=1, world_size=2,\n"
        "                            timeout=datetime.timedelta(seconds=2))\n"
        "except RuntimeError as e:\n"
        "    print('ERROR:', e)\n")
    env = dict(os.environ, TORCHTPU_JAX_COORDINATOR=f"127.0.0.1:{port}")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR:" in proc.stdout and f"coordinator 127.0.0.1:{port}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert time.perf_counter() - t0 < 60


def test_registered_backend():
    import torch.distributed as dist

    import torchtpu  # noqa: F401

    assert "tpu" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu"
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # CPU-only programs are untouched
    assert set(dist.Backend.backend_capability["tpu"]) == {"tpu", "cpu"}


if __name__ == "__main__" and sys.argv[1:2] == ["--torchrun"]:
    _torchrun_job(sys.argv[2])
