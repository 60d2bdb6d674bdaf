"""Weight sync: learner -> rollout workers, versioned, in byte buckets, at memory speed on one host.

The state dict is laid out as ONE flat byte stream (each tensor at a 64-byte
aligned offset, so every tensor can be viewed in place with its own dtype) and
that stream is cut into buckets. A :class:`BucketPlan` is that layout: it is
computed once per model and travels with every update, so the receiver knows
where each tensor lives and can check it against its own model. The sender cuts
buckets at tensor boundaries (``whole_tensors``: a bucket holds whole tensors up
to ``bucket_bytes``, a larger tensor is a bucket of its own), so every tensor
arrives in one piece and can be used where it landed.

Every update carries the learner's ``policy_version``; the rollout worker
installs it only while paused (no generation in flight, KV cache dropped), so
a trajectory is produced by exactly one version.

A sync has four phases, timed on every sync (``last_timings``; the driver puts
them in each step's metrics as ``sync_pack_s`` ... ``sync_install_s``):

- **pack** (sender): each tensor's bytes as a host view (zero-copy on XLA's CPU
  backend, one device -> host read on a TPU), cast first when ``sync_dtype`` asks;
- **publish** (sender): the bytes leave the learner: into Ray's shared memory,
  or onto the collective group's wire;
- **fetch** (receiver): the bytes become device arrays of the receiving process;
- **install** (receiver): the model's tensors take those arrays.

Transports (one control call per sync and receiver, whatever the size):

``object_store`` (default on one host)
    The learner ``ray.put`` s one object per bucket, a list of the bucket's
    tensors' host views: Ray's serializer copies each straight into the shared
    memory of the object store (the one copy of a sync, made by Ray's parallel
    copy). The control call carries a small :class:`WeightUpdate` (version,
    plan, bucket refs). The receiver maps the sealed buckets (zero-copy) and
    makes each tensor a device array *of that memory* (zero-copy through DLPack
    on XLA's CPU backend; a host -> device transfer on a TPU): no receive arena,
    no second copy. Sealed objects are immutable, and an object stays pinned
    while a model's tensors use it, so the store holds at most two versions (the
    installed one and the one in flight): size it to twice the weights. The
    sender pre-faults that much of the store once per plan (a first write into a
    shared-memory page faults; without it the first syncs run several times
    slower than the rest), reported once as ``prefault_s``.

``collective``
    A ``torch.distributed`` process group holding the learner (rank 0) and the
    workers; the learner broadcasts a small header (version + plan) then each
    bucket. ``backend``:

    - ``"tpu"`` (default): torchtpu's ``tpu`` process group, host byte buckets;
    - ``"tpu-device"``: the ``tpu`` group with tpu byte buckets, packed and
      unpacked on the device by one jitted program each (the form for a
      platform whose collectives run device to device);
    - ``"gloo"``: a plain gloo group, host byte buckets.

    Host buckets: a bucket of one tensor is broadcast from the tensor's own
    bytes (no pack copy); smaller tensors are packed into one of two reused
    send buffers. Receivers broadcast straight into a receive arena that is
    allocated once per plan and pre-faulted; two arenas alternate (the model
    uses one version while the next lands in the other one), and an arena is
    reused only when none of the arrays made from it is alive any more.
    :data:`DEFAULT_COLLECTIVE_BACKEND` is the one switch between them.

Install (:func:`install_state_dict`): a tpu parameter that is its own whole
storage takes the received array itself (``torchtpu.assign_jax``: a buffer
swap, no copy; the ``Parameter`` object, and so optimizers and compiled
programs that hold it, stay valid); anything else is copied into.

``sync_dtype=torch.bfloat16`` sends float32 tensors as bfloat16 (half the
bytes); the receiver casts back on install. The sender reports the error that
introduces (``cast_max_abs_error``, ``cast_rel_error``: the largest absolute
difference and ``||w - bf16(w)|| / ||w||`` over every cast tensor).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import time
import warnings
import weakref
from datetime import timedelta
from typing import Mapping, Optional

import jax
import numpy as np
import torch

import torchtpu
from torchtpu.interop import array_from_bytes, bytes_of

__all__ = [
    "ALIGN",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_COLLECTIVE_BACKEND",
    "SYNC_DTYPES",
    "TRANSPORTS",
    "BucketPlan",
    "CollectiveGroup",
    "SyncAborted",
    "TensorSlot",
    "WeightReceiver",
    "WeightSender",
    "WeightUpdate",
    "check_sync_dtype",
    "decode_header",
    "encode_header",
    "host_bytes",
    "install_state_dict",
    "plan_buckets",
    "tensor_checksums",
]

ALIGN = 64  # every tensor starts at a multiple of this in the stream (any dtype's alignment, and XLA's)
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
TRANSPORTS = ("object_store", "collective")
# The backend of the collective transport: "tpu" (torchtpu's torch.distributed backend, host
# byte buckets), "tpu-device" (the same group, tpu byte buckets packed on the device) or "gloo".
COLLECTIVE_BACKENDS = ("tpu", "tpu-device", "gloo")
DEFAULT_COLLECTIVE_BACKEND = "tpu"
# what a float32 tensor may travel as (None: as itself)
SYNC_DTYPES = (None, torch.bfloat16)


class SyncAborted(RuntimeError):
    """A collective sync failed part-way (a member died or left): this process has left the group,
    which must be rebuilt before the next collective sync."""


# ------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of the state dict lives in the flat byte stream."""

    name: str
    dtype: torch.dtype  # the model's dtype
    shape: tuple
    offset: int  # byte offset in the stream (a multiple of ALIGN)
    nbytes: int  # bytes in the stream (of ``wire_dtype``)
    wire_dtype: Optional[torch.dtype] = None  # what the bytes are, when not ``dtype`` (a cast sync)

    @property
    def stream_dtype(self) -> torch.dtype:
        return self.wire_dtype or self.dtype


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The flat byte-stream layout of a state dict, cut into buckets.

    ``starts`` are the buckets' first bytes (bucket ``b`` ends where ``b + 1`` starts, the last
    one at ``total_bytes``); empty means fixed-size buckets of ``bucket_bytes``."""

    slots: tuple
    bucket_bytes: int
    total_bytes: int  # stream length, alignment padding included
    starts: tuple = ()

    @property
    def num_buckets(self) -> int:
        if self.starts:
            return len(self.starts)
        return max(1, math.ceil(self.total_bytes / self.bucket_bytes))

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def bucket_range(self, b: int) -> tuple:
        if self.starts:
            end = self.starts[b + 1] if b + 1 < len(self.starts) else self.total_bytes
            return self.starts[b], end
        start = b * self.bucket_bytes
        return start, min(self.total_bytes, start + self.bucket_bytes)

    def segments(self, b: int) -> list:
        """The pieces of tensors in bucket ``b``: ``(slot_index, start, end)`` with
        ``start``/``end`` byte offsets inside the tensor, in stream order."""
        lo, hi = self.bucket_range(b)
        out = []
        for i, s in enumerate(self.slots):
            a, z = max(lo, s.offset), min(hi, s.offset + s.nbytes)
            if a < z:
                out.append((i, a - s.offset, z - s.offset))
        return out

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.slots:
            h.update(f"{s.name}|{s.dtype}|{s.stream_dtype}|{s.shape}|{s.offset};".encode())
        h.update(f"{self.bucket_bytes}|{self.starts}".encode())
        return h.hexdigest()[:16]

    def check_matches(self, reference: Mapping[str, torch.Tensor], who: str = "receiver") -> None:
        """Raise a ValueError naming the first tensor whose name, dtype or shape differs from
        ``reference`` (the receiving model's state dict)."""
        names = {s.name for s in self.slots}
        for s in self.slots:
            if s.name not in reference:
                raise ValueError(f"weight sync: tensor {s.name!r} of the update is not in the {who}'s model")
            r = reference[s.name]
            if r.dtype != s.dtype or tuple(r.shape) != s.shape:
                raise ValueError(
                    f"weight sync: tensor {s.name!r} is {s.dtype} {list(s.shape)} in the update but "
                    f"{r.dtype} {list(r.shape)} in the {who}'s model")
        missing = [k for k in reference if k not in names]
        if missing:
            raise ValueError(f"weight sync: the update lacks tensor(s) {missing[:5]} of the {who}'s model")


def _check_bucket_bytes(bucket_bytes) -> None:
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes!r}")


def check_sync_dtype(sync_dtype):
    """``sync_dtype`` (a dtype, its name, or None) checked against :data:`SYNC_DTYPES`; returns the dtype."""
    if isinstance(sync_dtype, str):
        sync_dtype = getattr(torch, sync_dtype, sync_dtype)
    if sync_dtype not in SYNC_DTYPES:
        raise ValueError(f"weight sync: sync_dtype must be one of {SYNC_DTYPES} (float32 weights travel as it), "
                         f"got {sync_dtype!r}")
    return sync_dtype


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 whole_tensors: bool = False, sync_dtype: Optional[torch.dtype] = None) -> BucketPlan:
    """Lay ``state_dict`` out as one aligned byte stream cut into buckets of ``bucket_bytes``
    (``whole_tensors``: cut only between tensors; a tensor larger than ``bucket_bytes`` is a bucket
    of its own). ``sync_dtype`` (bfloat16): float32 tensors travel as that dtype."""
    _check_bucket_bytes(bucket_bytes)
    sync_dtype = check_sync_dtype(sync_dtype)
    slots, starts, off = [], [0], 0
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        wire = sync_dtype if (sync_dtype is not None and t.dtype == torch.float32) else None
        n = t.numel() * (wire or t.dtype).itemsize
        if whole_tensors and off > starts[-1] and off + n > starts[-1] + bucket_bytes:
            starts.append(off)
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), off, n, wire))
        off += -(-n // ALIGN) * ALIGN
    return BucketPlan(tuple(slots), bucket_bytes, off, tuple(starts) if whole_tensors else ())


# ------------------------------------------------------------------ host bytes
def host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` as a flat uint8 numpy array: a view where possible (a CPU tensor;
    a contiguous tpu tensor on XLA's CPU backend), otherwise one device -> host copy."""
    t = t.detach()
    if t.device.type == "tpu":
        return _array_bytes(torchtpu.to_jax(t, flat=True))
    if t.device.type != "cpu":
        raise TypeError(f"weight sync: tensors must be on cpu or tpu, got one on {t.device}")
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def _array_bytes(a) -> np.ndarray:
    h = np.asarray(a)
    if h.dtype == np.bool_:
        h = h.view(np.uint8)
    return h.reshape(-1).view(np.uint8)


def tensor_checksums(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """``{name: sha256 of the tensor's bytes, dtype and shape}`` (for verifying a sync)."""
    out = {}
    for name, t in state_dict.items():
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(host_bytes(t).data)
        out[name] = h.hexdigest()
    return out


def _new_arena(nbytes: int) -> torch.Tensor:
    """A host byte tensor whose start is ALIGN-aligned (torch's CPU allocator aligns to 64), with
    every page touched now, so that receiving into it never page-faults."""
    a = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-a.data_ptr()) % ALIGN
    a = a[skip:skip + nbytes]
    a.numpy()[::4096] = 0
    return a


def _as_torch_bytes(u8: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a sealed object-store buffer is read-only; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(u8)


def _slot_array(s: TensorSlot, u8: torch.Tensor):
    """Slot ``s``'s bytes ``u8`` (a host byte tensor) as a device array of its stream dtype and
    shape: zero-copy through DLPack on XLA's CPU backend when aligned, else a transfer."""
    v = u8.view(s.stream_dtype).view(s.shape)
    return jax.dlpack.from_dlpack(v) if v.numel() else None


def _device_tensor(s: TensorSlot, a) -> torch.Tensor:
    if a is None:
        return torch.empty(s.shape, dtype=s.stream_dtype, device="tpu")
    return torchtpu.from_jax(a, s.stream_dtype)


# ------------------------------------------------------------------ updates
@dataclasses.dataclass
class WeightUpdate:
    """The one control message of a sync (small: refs, not bytes)."""

    version: int
    plan: BucketPlan
    transport: str
    refs: list | None = None  # object_store: one ObjectRef per bucket
    sent_at: float = 0.0
    timings: dict = dataclasses.field(default_factory=dict)  # the sender's phases (pack_s, publish_s, ...)


# The collective transport's header on the wire: data, never pickle (a peer of the sync group must not be
# able to run code in another by sending it a header). MAGIC, then the JSON body's length, then the body.
HEADER_MAGIC = b"TTWS\x01"
_HEADER_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024 * 1024


def _dtype_from_name(name) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise ValueError(f"weight sync header: unknown dtype {name!r}")
    return d


def encode_header(update: WeightUpdate) -> bytes:
    """``update`` (a collective one: no object refs) as MAGIC + length + JSON."""
    if update.refs:
        raise ValueError("weight sync header: an update with object refs travels through the object store, "
                         "not the collective header")
    plan = update.plan
    body = {
        "version": int(update.version), "transport": str(update.transport), "sent_at": float(update.sent_at),
        "timings": {str(k): float(v) for k, v in (update.timings or {}).items()},
        "plan": {"bucket_bytes": int(plan.bucket_bytes), "total_bytes": int(plan.total_bytes),
                 "starts": [int(x) for x in plan.starts],
                 "slots": [[s.name, str(s.dtype).removeprefix("torch."), [int(d) for d in s.shape], int(s.offset),
                            int(s.nbytes), None if s.wire_dtype is None else str(s.wire_dtype).removeprefix("torch.")]
                           for s in plan.slots]},
    }
    data = json.dumps(body, separators=(",", ":")).encode()
    return HEADER_MAGIC + _HEADER_LEN.pack(len(data)) + data


def decode_header(payload: bytes) -> WeightUpdate:
    """The :class:`WeightUpdate` in ``payload`` (:func:`encode_header`'s format); anything else, a pickle
    included, is refused with a ValueError."""
    payload = bytes(payload)
    n0 = len(HEADER_MAGIC) + _HEADER_LEN.size
    if not payload.startswith(HEADER_MAGIC) or len(payload) < n0:
        what = "a pickle (refused: a header is data, never code)" if payload[:1] == b"\x80" else \
            f"{len(payload)} bytes starting {payload[:8]!r}"
        raise ValueError(f"weight sync header: not a torchtpu weight-sync header: {what}")
    (n,) = _HEADER_LEN.unpack_from(payload, len(HEADER_MAGIC))
    if n != len(payload) - n0:
        raise ValueError(f"weight sync header: body of {len(payload) - n0} bytes, the header says {n}")
    try:
        body = json.loads(payload[n0:].decode())
        p = body["plan"]
        slots = tuple(TensorSlot(str(name), _dtype_from_name(dt), tuple(int(d) for d in shape), int(off), int(nb),
                                 None if wd is None else _dtype_from_name(wd))
                      for name, dt, shape, off, nb, wd in p["slots"])
        plan = BucketPlan(slots, int(p["bucket_bytes"]), int(p["total_bytes"]), tuple(int(x) for x in p["starts"]))
        return WeightUpdate(int(body["version"]), plan, str(body["transport"]), None, float(body["sent_at"]),
                            {str(k): float(v) for k, v in body.get("timings", {}).items()})
    except ValueError:
        raise
    except (KeyError, TypeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"weight sync header: malformed body ({e!r})") from e


def _cast_with_error(x, dtype):
    import jax.numpy as jnp

    y = x.astype(dtype)
    d = x - y.astype(x.dtype)
    return y, jnp.max(jnp.abs(d)), jnp.sum(d * d), jnp.sum(x * x)


_CAST = {}


class WeightSender:
    """The learner's side: publishes its state dict under a policy version."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, sync_dtype: Optional[torch.dtype] = None):
        _check_bucket_bytes(bucket_bytes)
        self.bucket_bytes = bucket_bytes
        self.sync_dtype = check_sync_dtype(sync_dtype)
        self._plan = None
        self._plan_key = None
        self._send_bufs: list = []
        self._pack_fns: dict = {}
        self._store_checked = False
        self.group: CollectiveGroup | None = None
        self.last_timings: dict = {}

    def plan(self, state_dict) -> BucketPlan:
        key = tuple((k, v.dtype, tuple(v.shape)) for k, v in state_dict.items())
        if key != self._plan_key:
            self._plan = plan_buckets(state_dict, self.bucket_bytes, whole_tensors=True, sync_dtype=self.sync_dtype)
            self._plan_key = key
            self._send_bufs, self._pack_fns, self._store_checked = [], {}, False
        return self._plan

    def _host_views(self, plan: BucketPlan, tensors: list) -> tuple:
        """(the bytes of every tensor of the stream as host views, the cast error)."""
        views, stats = [], []
        for s, t in zip(plan.slots, tensors):
            if s.wire_dtype is None:
                views.append(host_bytes(t))
                continue
            x = torchtpu.to_jax(t.detach(), flat=True) if t.device.type == "tpu" else jax.numpy.asarray(
                t.detach().contiguous().numpy())
            y, *st = _cast_fn(s.wire_dtype)(x)
            views.append(_array_bytes(y))
            stats.append(st)
        return views, _error_summary(stats)

    # -- object store
    def publish(self, state_dict, version: int) -> WeightUpdate:
        """Put the state dict into the object store, one object per bucket (the bucket's tensors)."""
        import ray

        plan = self.plan(state_dict)
        prefault = {}
        if not self._store_checked:  # once per plan, outside the sync's phases
            tf = time.perf_counter()
            self._check_store(plan)
            self._prefault_store(plan)
            prefault = {"prefault_s": time.perf_counter() - tf}
        t0 = time.perf_counter()
        torchtpu.synchronize()
        views, err = self._host_views(plan, list(state_dict.values()))
        t1 = time.perf_counter()
        # pickle-5 writes each view straight into the object's shared memory, 64-byte aligned
        refs = [ray.put([views[i] for i, _, _ in plan.segments(b)]) for b in range(plan.num_buckets)]
        t2 = time.perf_counter()
        self.last_timings = {"pack_s": t1 - t0, "publish_s": t2 - t1, "bytes": plan.payload_bytes, **err, **prefault}
        return WeightUpdate(int(version), plan, "object_store", refs, time.time(), dict(self.last_timings))

    def _check_store(self, plan: BucketPlan) -> None:
        """Warn once per plan when the object store cannot hold two versions (the one the workers
        use stays pinned while the next one is written): Ray would spill to disk at every sync."""
        if self._store_checked:
            return
        import ray

        self._store_checked = True
        store = ray.cluster_resources().get("object_store_memory")
        if store and store < 2 * plan.total_bytes:
            warnings.warn(f"weight sync: the Ray object store holds {store / 2**20:.0f} MiB, less than two versions "
                          f"of the weights ({2 * plan.total_bytes / 2**20:.0f} MiB): syncs will spill to disk; start "
                          f"Ray with a larger object_store_memory", RuntimeWarning, stacklevel=3)

    def _prefault_store(self, plan: BucketPlan) -> None:
        """Touch, in this process, the object-store pages the next syncs will be written into (two
        versions' worth): a first write into a page of the shared memory faults, which otherwise
        makes the first few syncs several times slower than the rest. Once per plan."""
        import ray

        store = ray.cluster_resources().get("object_store_memory") or 0
        n = min(2 * plan.total_bytes, int(store * 0.8)) if store else 2 * plan.total_bytes
        chunk = max(ALIGN, min(plan.bucket_bytes, n))
        zeros = np.zeros(chunk, np.uint8)  # the zero page: reading it costs nothing
        refs = [ray.put(zeros) for _ in range(max(1, n // chunk))]
        del refs  # freed: the store hands these pages to the sync's buckets next

    # -- collective
    def broadcast(self, state_dict, version: int) -> dict:
        """Broadcast header + buckets over the collective group (rank 0 = this learner)."""
        if self.group is None:
            raise RuntimeError("weight sync: the collective transport has no process group "
                               "(call collective_setup on the learner and every worker first)")
        g = self.group
        try:
            return self._broadcast(g, state_dict, version)
        except Exception as e:
            # a member died mid-sync: leaving the group now closes our sockets, which fails the
            # survivors' pending receives at once instead of after the group's timeout
            g.destroy()
            self.group = None
            raise SyncAborted(f"weight sync: collective broadcast of version {version} failed ({type(e).__name__}: "
                              f"{str(e)[:300]}); the learner left the group") from e

    def _broadcast(self, g, state_dict, version: int) -> dict:
        import torch.distributed as dist

        t0 = time.perf_counter()
        torchtpu.synchronize()
        plan = self.plan(state_dict)
        tensors = list(state_dict.values())
        pack = publish = 0.0
        if g.device == "cpu":
            views, err = self._host_views(plan, tensors)
            pack = time.perf_counter() - t0
            g.send_header(WeightUpdate(int(version), plan, "collective", None, time.time()))
            if not self._send_bufs:
                # two buffers, so that one is sent while the next bucket is packed into the other
                n = max((hi - lo for lo, hi in map(plan.bucket_range, range(plan.num_buckets))), default=0)
                self._send_bufs = [_new_arena(min(n, plan.bucket_bytes)) for _ in range(2)]
            work = []
            for b in range(plan.num_buckets):
                segs = plan.segments(b)
                if len(work) >= 2:
                    tw = time.perf_counter()
                    work.pop(0).wait()
                    publish += time.perf_counter() - tw
                tp = time.perf_counter()
                if len(segs) == 1:  # one tensor: sent from its own bytes
                    i = segs[0][0]
                    src = _as_torch_bytes(views[i])
                else:
                    lo, hi = plan.bucket_range(b)
                    src = self._send_bufs[b % 2][: hi - lo]
                    sn = src.numpy()
                    for i, a, z in segs:
                        d = plan.slots[i].offset + a - lo
                        sn[d:d + (z - a)] = views[i][a:z]
                pack += time.perf_counter() - tp
                work.append(dist.broadcast(src, src=0, async_op=True))
            tw = time.perf_counter()
            for w in work:
                w.wait()
            publish += time.perf_counter() - tw
        else:
            g.send_header(WeightUpdate(int(version), plan, "collective", None, time.time()))
            arrays = [torchtpu.to_jax(t.detach()) for t in tensors]
            err = _cast_error([(s.wire_dtype, a) for s, a in zip(plan.slots, arrays) if s.wire_dtype is not None])
            for b in range(plan.num_buckets):
                tp = time.perf_counter()
                fn = self._pack_fns.get(b)
                if fn is None:
                    fn = self._pack_fns[b] = _pack_fn(plan, b)
                idx = sorted({i for i, _, _ in plan.segments(b)})
                bucket = torchtpu.from_jax(fn(*[arrays[i] for i in idx]))
                pack += time.perf_counter() - tp
                tw = time.perf_counter()
                dist.broadcast(bucket, src=0)
                publish += time.perf_counter() - tw
            torchtpu.synchronize()
        self.last_timings = {"pack_s": pack, "publish_s": publish, "broadcast_s": time.perf_counter() - t0,
                             "bytes": plan.payload_bytes, **err}
        return dict(self.last_timings, version=int(version))


def _error_summary(stats: list) -> dict:
    """The cast's error over all cast tensors, from per-tensor (max |d|, sum d^2, sum w^2)."""
    if not stats:
        return {}
    err2, ref2 = sum(float(e) for _, e, _ in stats), sum(float(r) for _, _, r in stats)
    return {"cast_max_abs_error": max(float(m) for m, _, _ in stats),
            "cast_rel_error": math.sqrt(err2 / ref2) if ref2 else 0.0}


def _cast_error(pairs: list) -> dict:
    return _error_summary([_cast_fn(dt)(a.reshape(-1))[1:] for dt, a in pairs])


def _wire_jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return {torch.bfloat16: jnp.bfloat16}[dtype]


def _cast_fn(dtype):
    fn = _CAST.get(dtype)
    if fn is None:
        jd = _wire_jax_dtype(dtype)
        fn = _CAST[dtype] = jax.jit(lambda x: _cast_with_error(x, jd))
    return fn


class _Arena:
    """A reused, pre-faulted receive buffer and weak references to the arrays made from it."""

    def __init__(self, nbytes: int):
        self.buf = _new_arena(nbytes)
        self.users: list = []

    def free(self) -> bool:
        return all(r() is None for r in self.users)


class WeightReceiver:
    """The rollout worker's side: turns an update into a state dict of device tensors."""

    def __init__(self, device: str = "tpu"):
        if device not in ("tpu", "cpu"):
            raise ValueError(f"WeightReceiver device must be 'tpu' or 'cpu', got {device!r}")
        self.device = device
        self.group: CollectiveGroup | None = None
        self._unpack_fns: dict = {}
        self._arenas: list = []  # two _Arena, alternating
        self._arena_key = None
        self._turn = 0
        self.arena_allocations = 0
        self.last_timings: dict = {}

    def receive(self, update: WeightUpdate) -> dict:
        """The tensors of an object-store update, aliasing the sealed buckets in shared memory
        (``update.refs`` are fetched here)."""
        import ray

        if not isinstance(update, WeightUpdate) or update.transport != "object_store":
            raise TypeError(f"weight sync: expected an object_store WeightUpdate, got {update!r:.200}")
        t0 = time.perf_counter()
        plan = update.plan
        buckets = ray.get(list(update.refs))  # maps the buckets, no copy
        out = {}
        for b, views in enumerate(buckets):
            for (i, _, _), u8 in zip(plan.segments(b), views):
                s = plan.slots[i]
                u8 = _as_torch_bytes(u8)
                if self.device == "cpu":
                    out[s.name] = u8.view(s.stream_dtype).view(s.shape)
                else:
                    out[s.name] = _device_tensor(s, _slot_array(s, u8))
        del buckets
        self.last_timings = {"fetch_s": time.perf_counter() - t0, "bytes": plan.payload_bytes}
        return out

    def _take_arena(self, plan: BucketPlan) -> torch.Tensor:
        """The receive arena for this sync: the older of two reused buffers, unless something
        still uses arrays made from it (then a fresh one; the old one lives on with its users)."""
        key = plan.total_bytes
        if key != self._arena_key:
            self._arenas, self._arena_key = [], key
        if len(self._arenas) < 2:
            self._arenas.append(_Arena(plan.total_bytes))
            self.arena_allocations += 1
            self._turn = len(self._arenas) - 1
            return self._arenas[-1]
        self._turn ^= 1  # the arena of the sync before the last one
        arena = self._arenas[self._turn]
        if not arena.free():
            arena = self._arenas[self._turn] = _Arena(plan.total_bytes)
            self.arena_allocations += 1
            return arena
        torchtpu.synchronize()  # nothing dispatched may still read what is overwritten now
        return arena

    def receive_broadcast(self) -> tuple:
        """Receive header + buckets from the collective group. Returns ``(update, tensors)``."""
        if self.group is None:
            raise RuntimeError("weight sync: the collective transport has no process group "
                               "(call collective_setup first)")
        g = self.group
        try:
            return self._receive_broadcast(g)
        except Exception as e:
            g.destroy()
            self.group = None
            raise SyncAborted(f"weight sync: collective receive failed ({type(e).__name__}: {str(e)[:300]}); "
                              f"this worker left the group") from e

    def _receive_broadcast(self, g) -> tuple:
        import torch.distributed as dist

        t0 = time.perf_counter()
        update = g.recv_header()
        plan = update.plan
        if g.device == "cpu":
            arena = self._take_arena(plan)
            work = []
            for b in range(plan.num_buckets):
                lo, hi = plan.bucket_range(b)
                segs = plan.segments(b)
                if len(segs) == 1:  # sent from the tensor's own bytes: exactly its length
                    hi = lo + segs[0][2]
                work.append(dist.broadcast(arena.buf[lo:hi], src=0, async_op=True))
            for w in work:
                w.wait()
            out, arena.users = {}, []
            for s in plan.slots:
                u8 = arena.buf[s.offset:s.offset + s.nbytes]
                if self.device == "cpu":
                    out[s.name] = u8.view(s.stream_dtype).view(s.shape)
                    continue
                a = _slot_array(s, u8)
                if a is not None:
                    arena.users.append(weakref.ref(a))
                out[s.name] = _device_tensor(s, a)
        else:
            buckets = []
            for b in range(plan.num_buckets):
                lo, hi = plan.bucket_range(b)
                buf = torch.empty(hi - lo, dtype=torch.uint8, device="tpu")
                dist.broadcast(buf, src=0)
                buckets.append(torchtpu.to_jax(buf))
            key = plan.fingerprint()
            fn = self._unpack_fns.get(key)
            if fn is None:
                fn = self._unpack_fns[key] = _unpack_fn(plan)
            arrays = fn(*buckets)
            out = {s.name: torchtpu.from_jax(a, s.stream_dtype) for s, a in zip(plan.slots, arrays)}
            if self.device == "cpu":
                out = {k: v.cpu() for k, v in out.items()}
        self.last_timings = {"fetch_s": time.perf_counter() - t0, "bytes": plan.payload_bytes,
                             "arena_allocations": self.arena_allocations}
        return update, out


# ------------------------------------------------------------------ device pack / unpack (tpu buckets)
def _pack_fn(plan: BucketPlan, b: int):
    """A jitted function: the tensors overlapping bucket ``b`` -> that bucket's bytes."""
    import jax.numpy as jnp

    lo, hi = plan.bucket_range(b)
    segs = plan.segments(b)
    idx = sorted({i for i, _, _ in segs})

    def pack(*arrays):
        by_i = dict(zip(idx, arrays))
        parts, pos = [], lo
        for i, a, z in segs:
            s = plan.slots[i]
            start = s.offset + a
            if start > pos:
                parts.append(jnp.zeros((start - pos,), jnp.uint8))
            x = by_i[i]
            if s.wire_dtype is not None:
                x = x.astype(_wire_jax_dtype(s.wire_dtype))
            parts.append(bytes_of(x)[a:z])
            pos = start + (z - a)
        if pos < hi:
            parts.append(jnp.zeros((hi - pos,), jnp.uint8))
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    return jax.jit(pack)


def _unpack_fn(plan: BucketPlan):
    """A jitted function: all buckets' bytes -> every tensor of the plan."""
    import jax.numpy as jnp

    def unpack(*buckets):
        out = []
        for s in plan.slots:
            pieces = []
            for b in range(plan.num_buckets):
                lo, hi = plan.bucket_range(b)
                a, z = max(lo, s.offset), min(hi, s.offset + s.nbytes)
                if a < z:
                    pieces.append(buckets[b][a - lo:z - lo])
            u8 = jnp.concatenate(pieces) if len(pieces) > 1 else (pieces[0] if pieces else jnp.zeros((0,), jnp.uint8))
            n = math.prod(s.shape)
            out.append(array_from_bytes(u8, s.stream_dtype, n).reshape(s.shape))
        return tuple(out)

    return jax.jit(unpack)


# ------------------------------------------------------------------ process group
class CollectiveGroup:
    """This process's membership in the weight-sync process group (the default group).

    Rank 0 is the learner. ``backend`` is one of :data:`COLLECTIVE_BACKENDS`; ``device`` is
    where buckets live (``"tpu"`` for ``"tpu-device"``, else ``"cpu"``). Rebuilding after a membership change
    (a restarted worker) is :meth:`destroy` on the survivors, then a new group on a
    fresh port for everyone.
    """

    def __init__(self, backend: str, init_method: str, world_size: int, rank: int, timeout_s: float = 120.0):
        import torch.distributed as dist

        if backend not in COLLECTIVE_BACKENDS:
            raise ValueError(f"weight sync backend must be one of {COLLECTIVE_BACKENDS}, got {backend!r}")
        pg_backend = "gloo" if backend == "gloo" else "tpu"
        if pg_backend == "tpu":
            import importlib

            importlib.import_module("torchtpu.distributed")  # registers the backend
        from torchtpu.distributed.store import init_process_group_bound

        if dist.is_initialized():
            dist.destroy_process_group()
        # rank 0's store listens on the init method's host only (not every interface)
        init_process_group_bound(pg_backend, init_method, int(world_size), int(rank), timedelta(seconds=timeout_s))
        self.backend = backend
        self.device = "tpu" if backend == "tpu-device" else "cpu"
        self.rank = int(rank)
        self.world_size = int(world_size)

    def destroy(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def send_header(self, update: WeightUpdate) -> None:
        import torch.distributed as dist

        payload = encode_header(update)
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=0)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data.to(self.device), src=0)

    def recv_header(self) -> WeightUpdate:
        import torch.distributed as dist

        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=0)
        size = int(n.item())
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"weight sync header: rank 0 announced {size} bytes (at most {MAX_HEADER_BYTES})")
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=0)
        return decode_header(data.cpu().numpy().tobytes())


def free_port() -> int:
    """A free TCP port on this host (for the group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ install
def install_state_dict(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> dict:
    """Make ``module``'s parameters and buffers hold ``tensors``' values, in place.

    A tpu tensor of the module that is its whole storage takes the received tpu tensor's array
    itself (``torchtpu.assign_jax``: a buffer swap, no copy; cast first when the update travelled
    in another dtype); any other tensor (a view into a shared storage, a CPU module, a CPU
    update) is copied into. The module's tensor objects stay the same, so optimizers, tied
    weights and compiled programs that hold them stay valid. ``strict``: every tensor of the
    module must be updated. Returns ``{"swapped": n, "copied": m}``."""
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers(remove_duplicate=False)))
    for name in tensors:
        if name not in own:
            raise KeyError(f"weight sync: the model has no parameter or buffer named {name!r}")
    if strict:
        missing = [k for k in own if k not in tensors and k in module.state_dict()]
        if missing:
            raise KeyError(f"weight sync: the update lacks {missing[:5]} of the model")
    swapped = copied = 0
    with torch.no_grad():
        for name, t in tensors.items():
            p = own[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"weight sync: {name!r} is {list(p.shape)} in the model but {list(t.shape)} "
                                 f"in the update")
            if p.device.type == "tpu" and t.device.type == "tpu" and t.numel():
                a = torchtpu.to_jax(t, flat=True)
                if a.shape != tuple(t.shape):
                    a = a.reshape(tuple(t.shape))
                torchtpu.assign_jax(p, a)
                if torchtpu.to_jax(p, flat=True) is a:
                    swapped += 1
                    continue
                copied += 1
                continue
            p.copy_(t)
            copied += 1
    return {"swapped": swapped, "copied": copied}
