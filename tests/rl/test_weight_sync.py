"""Weight sync in one process: the bucket layout, the host and device pack/unpack, install by
buffer swap, the reused receive arenas and the bfloat16 sync option (the transports across
actors are tested in test_rl_ray.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import torchtpu
from torchtpu_rl import weight_sync as ws


def _mixed_state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(37, 19, generator=g),
        "b16": torch.randn(300, generator=g).to(torch.bfloat16),
        "idx": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
        "flag": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(3000, generator=g),  # spans several 4 KiB buckets
    }


def test_bucket_plan_covers_every_byte_once():
    sd = _mixed_state()
    plan = ws.plan_buckets(sd, bucket_bytes=4096)
    assert plan.num_buckets == -(-plan.total_bytes // 4096) > 3
    seen = {s.name: np.zeros(s.nbytes, np.int32) for s in plan.slots}
    for b in range(plan.num_buckets):
        lo, hi = plan.bucket_range(b)
        assert hi - lo == (4096 if b < plan.num_buckets - 1 else plan.total_bytes - lo)
        for i, a, z in plan.segments(b):
            seen[plan.slots[i].name][a:z] += 1
            assert lo <= plan.slots[i].offset + a and plan.slots[i].offset + z <= hi
    assert all((v == 1).all() for v in seen.values())
    assert all(s.offset % ws.ALIGN == 0 for s in plan.slots)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ws.plan_buckets(sd, bucket_bytes=100)
    with pytest.raises(ValueError, match="'w'"):
        plan.check_matches({**sd, "w": torch.zeros(3)})
    with pytest.raises(ValueError, match="sync_dtype"):
        ws.plan_buckets(sd, sync_dtype=torch.float16)


def test_whole_tensor_buckets():
    """The sender's plan cuts only between tensors: every tensor lies in one bucket, a bucket
    is never over bucket_bytes unless it is one tensor; bfloat16 sync halves float32 tensors."""
    sd = _mixed_state()
    plan = ws.plan_buckets(sd, bucket_bytes=4096, whole_tensors=True)
    where = {}
    for b in range(plan.num_buckets):
        lo, hi = plan.bucket_range(b)
        segs = plan.segments(b)
        assert hi - lo <= 4096 or len(segs) == 1
        for i, a, z in segs:
            assert (a, z) == (0, plan.slots[i].nbytes)
            where.setdefault(plan.slots[i].name, []).append(b)
    assert all(len(v) == 1 for k, v in where.items() if k != "empty")
    half = ws.plan_buckets(sd, bucket_bytes=4096, whole_tensors=True, sync_dtype=torch.bfloat16)
    by = {s.name: s for s in half.slots}
    assert by["w"].wire_dtype == torch.bfloat16 and by["w"].nbytes == 37 * 19 * 2
    assert by["idx"].wire_dtype is None and by["b16"].wire_dtype is None  # only float32 is cast
    assert half.fingerprint() != plan.fingerprint()


@pytest.mark.parametrize("where", ["host", "device"])
def test_pack_unpack_round_trip(where):
    """The bytes of every tensor survive the bucket layout: a host receive arena (object store
    / host collective buckets) read as device arrays in place, and the jitted device pack/unpack
    of tpu buckets."""
    sd = {k: v.to("tpu") for k, v in _mixed_state().items()}
    plan = ws.plan_buckets(sd, bucket_bytes=4096)
    if where == "host":
        arena = ws._new_arena(plan.total_bytes)
        assert arena.data_ptr() % ws.ALIGN == 0
        an = arena.numpy()
        tensors = list(sd.values())
        for b in range(plan.num_buckets):
            for i, a, z in plan.segments(b):
                d = plan.slots[i].offset + a
                an[d:d + z - a] = ws.host_bytes(tensors[i])[a:z]
        out = {}
        for s in plan.slots:
            a = ws._slot_array(s, arena[s.offset:s.offset + s.nbytes])
            if a is not None and s.nbytes >= ws.ALIGN:  # made of the arena's memory: no copy
                assert a.unsafe_buffer_pointer() == arena.data_ptr() + s.offset
            out[s.name] = ws._device_tensor(s, a)
    else:
        arrays = [torchtpu.to_jax(t) for t in sd.values()]
        buckets = []
        for b in range(plan.num_buckets):
            idx = sorted({i for i, _, _ in plan.segments(b)})
            buckets.append(ws._pack_fn(plan, b)(*[arrays[i] for i in idx]))
        out = {s.name: torchtpu.from_jax(a, s.dtype) for s, a in zip(plan.slots, ws._unpack_fn(plan)(*buckets))}
    assert ws.tensor_checksums(out) == ws.tensor_checksums(sd)
    assert all(v.device.type == "tpu" for v in out.values())


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                            torch.nn.Linear(8, 11, bias=False))
    m[3].weight = m[0].weight  # tied, as language models tie the embedding and the head
    m.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    return m.to("tpu")


def test_install_swaps_buffers_and_keeps_the_parameters():
    """A tpu parameter that is its whole storage takes the received array (no copy); the
    Parameter objects (what an optimizer or a compiled program holds) stay; tied weights stay
    tied; a view into a shared storage is copied into."""
    m = _model()
    params = {k: id(v) for k, v in m.named_parameters(remove_duplicate=False)}
    new = {k: (v.detach().cpu() * 2 + 1).to(v.dtype).to("tpu") for k, v in m.state_dict().items()}
    how = ws.install_state_dict(m, new)
    assert how["swapped"] >= len(new) - 1 and how["swapped"] + how["copied"] == len(new)
    assert {k: id(v) for k, v in m.named_parameters(remove_duplicate=False)} == params
    assert m[3].weight is m[0].weight
    for k, v in m.state_dict().items():
        assert torch.equal(v.cpu(), new[k].cpu()), k
        if k == "1.weight":
            assert torchtpu.to_jax(v, flat=True) is torchtpu.to_jax(new[k], flat=True)  # the swap itself
    # a view that is not its whole storage: written through, its storage-mates untouched
    big = torch.zeros(2, 8, device="tpu")
    holder = torch.nn.Module()
    holder.register_buffer("row", big[1])
    out = ws.install_state_dict(holder, {"row": torch.ones(8, device="tpu")})
    assert out == {"swapped": 0, "copied": 1} and big.cpu().tolist() == [[0.0] * 8, [1.0] * 8]
    with pytest.raises(KeyError, match="nope"):
        ws.install_state_dict(m, {"nope": torch.zeros(1, device="tpu")})
    with pytest.raises(ValueError, match="'1.bias'"):
        ws.install_state_dict(m, {**new, "1.bias": torch.zeros(3, device="tpu")})
    with pytest.raises(KeyError, match="lacks"):
        ws.install_state_dict(m, {"1.bias": new["1.bias"]})


def test_bfloat16_sync_reports_its_error_and_casts_back():
    m = _model()
    sd = m.state_dict()
    sender = ws.WeightSender(4096, sync_dtype=torch.bfloat16)
    plan = sender.plan(sd)
    views, err = sender._host_views(plan, list(sd.values()))
    assert sum(v.nbytes for v in views) < sum(t.numel() * t.element_size() for t in sd.values()) * 0.6
    w = torch.cat([t.detach().cpu().reshape(-1) for t in sd.values() if t.dtype == torch.float32])
    d = w - w.to(torch.bfloat16).float()
    assert err["cast_max_abs_error"] == pytest.approx(d.abs().max().item(), rel=1e-6)
    assert err["cast_rel_error"] == pytest.approx((d.norm() / w.norm()).item(), rel=1e-4)
    assert 0 < err["cast_rel_error"] < 2**-8
    received = {}
    for s, v in zip(plan.slots, views):
        received[s.name] = ws._device_tensor(s, ws._slot_array(s, ws._as_torch_bytes(v)))
    assert received["1.weight"].dtype == torch.bfloat16
    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    ws.install_state_dict(target, received)
    for k, v in target.state_dict().items():
        assert v.dtype == sd[k].dtype
        torch.testing.assert_close(v.cpu(), sd[k].cpu().to(torch.bfloat16).to(sd[k].dtype), rtol=0, atol=0)


def test_receive_arenas_are_reused_and_never_overwritten_in_use():
    """Two receive arenas alternate; an arena whose arrays are still held (the model uses that
    version) is not written into: a fresh one is made instead."""
    r = ws.WeightReceiver("tpu")
    plan = ws.plan_buckets({"w": torch.zeros(1024)}, 4096, whole_tensors=True)
    a1 = r._take_arena(plan)
    a2 = r._take_arena(plan)
    assert a1 is not a2 and r.arena_allocations == 2
    assert r._take_arena(plan) is a1 and r._take_arena(plan) is a2 and r.arena_allocations == 2
    held = ws._slot_array(plan.slots[0], a1.buf[:4096])
    a1.users = [__import__("weakref").ref(held)]
    a3 = r._take_arena(plan)
    assert a3 is not a1 and r.arena_allocations == 3
    del held


def test_collective_header_is_data_and_a_pickle_is_refused():
    import pickle

    plan = ws.plan_buckets(_mixed_state(), 4096)
    cast = ws.WeightSender(4096, sync_dtype=torch.bfloat16).plan(_mixed_state())
    for p in (plan, cast):
        u = ws.WeightUpdate(11, p, "collective", None, 123.5, {"pack_s": 0.5})
        back = ws.decode_header(ws.encode_header(u))
        assert back.plan == p and back.plan.fingerprint() == p.fingerprint()
        assert (back.version, back.transport, back.sent_at, back.timings) == (11, "collective", 123.5, {"pack_s": 0.5})
    u = ws.WeightUpdate(11, plan, "collective", None, 0.0)
    with pytest.raises(ValueError, match="pickle"):
        ws.decode_header(pickle.dumps(u))

    class Boom:  # what a hostile peer would send: unpickling it would run code
        def __reduce__(self):
            return (os.system, ("touch /tmp/torchtpu_pwned",))

    with pytest.raises(ValueError, match="pickle"):
        ws.decode_header(pickle.dumps(Boom()))
    good = ws.encode_header(u)
    with pytest.raises(ValueError, match="header says"):
        ws.decode_header(good[:-1])
    body = good[len(ws.HEADER_MAGIC) + 4:].replace(b'"float32"', b'"os.system"')
    with pytest.raises(ValueError, match="unknown dtype"):
        ws.decode_header(ws.HEADER_MAGIC + len(body).to_bytes(4, "little") + body)
    with pytest.raises(ValueError, match="object refs"):
        ws.encode_header(ws.WeightUpdate(1, plan, "object_store", [object()]))
