"""Weight sync: learner -> rollout workers, versioned, in fixed-size byte buckets.

The state dict is laid out as ONE flat byte stream (each tensor at a 64-byte
aligned offset, so every tensor can be viewed in place with its own dtype) and
that stream is cut into buckets of exactly ``bucket_bytes`` (the last one is
shorter; a tensor may span buckets). A :class:`BucketPlan` is that layout: it
is computed once per model and travels with every update, so the receiver knows
where each tensor lives and can check it against its own model.

Every update carries the learner's ``policy_version``; the rollout worker
installs it only while paused (no generation in flight, KV cache dropped), so
a trajectory is produced by exactly one version.

Transports (one control call per sync and receiver, whatever the size):

``object_store`` (default on one host)
    The learner ``ray.put`` s one object per bucket; the bucket object holds
    the bucket's tensor segments, which Ray's pickle-5 serializer writes
    back to back into shared memory: the only copy on the send side (a
    device -> host read of each tensor is zero-copy on XLA's CPU backend, a
    DMA on a TPU). The control call carries a small :class:`WeightUpdate`
    (version, plan, bucket refs); the receiver reads the buckets out of shared
    memory (zero-copy) into one host arena laid out like the stream (the only
    copy on the receive side) and makes its device tensors from the arena
    through DLPack (zero-copy on XLA's CPU backend, one host -> device transfer
    on a TPU).

``collective``
    A ``torch.distributed`` process group holding the learner (rank 0) and the
    workers; the learner broadcasts a small header (version + plan) then each
    bucket. ``backend``:

    - ``"tpu"`` (default): torchtpu's ``tpu`` process group, host byte buckets
      (received straight into the arena, no extra copy). Across processes the
      ``tpu`` backend moves bytes through host buffers anyway, and it sends CPU
      tensors without staging, so host buckets are its fastest form here;
    - ``"tpu-device"``: the ``tpu`` group with tpu byte buckets, packed and
      unpacked on the device by one jitted program each (the form for a
      platform whose collectives run device to device);
    - ``"gloo"``: a plain gloo group, host byte buckets.

    :data:`DEFAULT_COLLECTIVE_BACKEND` is the one switch between them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
import time
from datetime import timedelta
from typing import Mapping

import jax
import numpy as np
import torch

import torchtpu
from torchtpu.interop import array_from_bytes, bytes_of

__all__ = [
    "ALIGN",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_COLLECTIVE_BACKEND",
    "TRANSPORTS",
    "BucketPlan",
    "CollectiveGroup",
    "TensorSlot",
    "WeightReceiver",
    "WeightSender",
    "WeightUpdate",
    "host_bytes",
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


# ------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of the state dict lives in the flat byte stream."""

    name: str
    dtype: torch.dtype
    shape: tuple
    offset: int  # byte offset in the stream (a multiple of ALIGN)
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The flat byte-stream layout of a state dict, cut into fixed-size buckets."""

    slots: tuple
    bucket_bytes: int
    total_bytes: int  # stream length, alignment padding included

    @property
    def num_buckets(self) -> int:
        return max(1, math.ceil(self.total_bytes / self.bucket_bytes))

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def bucket_range(self, b: int) -> tuple:
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
            h.update(f"{s.name}|{s.dtype}|{s.shape}|{s.offset};".encode())
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


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketPlan:
    """Lay ``state_dict`` out as one aligned byte stream cut into ``bucket_bytes`` buckets."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes!r}")
    slots, off = [], 0
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        n = t.numel() * t.element_size()
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), off, n))
        off += -(-n // ALIGN) * ALIGN
    return BucketPlan(tuple(slots), bucket_bytes, off)


# ------------------------------------------------------------------ host bytes
def host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` as a flat uint8 numpy array: a view where possible (a CPU tensor;
    a contiguous tpu tensor on XLA's CPU backend), otherwise one device -> host copy."""
    t = t.detach()
    if t.device.type == "tpu":
        a = np.asarray(torchtpu.to_jax(t, flat=True))
        if a.dtype == np.bool_:
            a = a.view(np.uint8)
        return a.reshape(-1).view(np.uint8)
    if t.device.type != "cpu":
        raise TypeError(f"weight sync: tensors must be on cpu or tpu, got one on {t.device}")
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def tensor_checksums(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """``{name: sha256 of the tensor's bytes, dtype and shape}`` (for verifying a sync)."""
    out = {}
    for name, t in state_dict.items():
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(host_bytes(t).data)
        out[name] = h.hexdigest()
    return out


def _new_arena(nbytes: int) -> torch.Tensor:
    """A fresh host byte tensor whose start is ALIGN-aligned (torch's CPU allocator aligns to 64)."""
    a = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-a.data_ptr()) % ALIGN
    return a[skip:skip + nbytes]


def _tensors_from_arena(plan: BucketPlan, arena: torch.Tensor, device: str) -> dict:
    """Per-tensor views of the arena, as tpu tensors (zero-copy through DLPack on XLA's CPU
    backend; a host -> device transfer elsewhere) or as CPU tensors."""
    out = {}
    for s in plan.slots:
        v = arena[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
        if device == "cpu":
            out[s.name] = v
        elif v.numel():
            out[s.name] = torchtpu.from_jax(jax.dlpack.from_dlpack(v), s.dtype)
        else:
            out[s.name] = torch.empty(s.shape, dtype=s.dtype, device="tpu")
    return out


# ------------------------------------------------------------------ updates
@dataclasses.dataclass
class WeightUpdate:
    """The one control message of a sync (small: refs, not bytes)."""

    version: int
    plan: BucketPlan
    transport: str
    refs: list | None = None  # object_store: one ObjectRef per bucket
    sent_at: float = 0.0


class WeightSender:
    """The learner's side: publishes its state dict under a policy version."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self._plan = None
        self._plan_key = None
        self._send_bufs: list = []
        self._pack_fns: dict = {}
        self.group: CollectiveGroup | None = None
        self.last_timings: dict = {}

    def plan(self, state_dict) -> BucketPlan:
        key = tuple((k, v.dtype, tuple(v.shape)) for k, v in state_dict.items())
        if key != self._plan_key:
            self._plan, self._plan_key = plan_buckets(state_dict, self.bucket_bytes), key
            self._send_bufs = []
        return self._plan

    # -- object store
    def publish(self, state_dict, version: int) -> WeightUpdate:
        """Put the state dict into the object store, one object per bucket."""
        import ray

        t0 = time.perf_counter()
        torchtpu.synchronize()
        plan = self.plan(state_dict)
        tensors = list(state_dict.values())
        host = {}
        refs = []
        for b in range(plan.num_buckets):
            segs = []
            for i, a, z in plan.segments(b):
                if i not in host:
                    host[i] = host_bytes(tensors[i])
                segs.append(host[i][a:z])
            refs.append(ray.put(segs))  # pickle-5 writes the segments back to back into shared memory
        self.last_timings = {"publish_s": time.perf_counter() - t0, "bytes": plan.payload_bytes}
        return WeightUpdate(int(version), plan, "object_store", refs, time.time())

    # -- collective
    def broadcast(self, state_dict, version: int) -> dict:
        """Broadcast header + buckets over the collective group (rank 0 = this learner)."""
        if self.group is None:
            raise RuntimeError("weight sync: the collective transport has no process group "
                               "(call collective_setup on the learner and every worker first)")
        t0 = time.perf_counter()
        torchtpu.synchronize()
        plan = self.plan(state_dict)
        g = self.group
        g.send_header(WeightUpdate(int(version), plan, "collective", None, time.time()))
        tensors = list(state_dict.values())
        if g.device == "cpu":
            host = {}
            if not self._send_bufs:
                # two buffers so that an asynchronous backend can send one while the other fills
                self._send_bufs = [torch.empty(plan.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
            work = []
            for b in range(plan.num_buckets):
                lo, hi = plan.bucket_range(b)
                buf = self._send_bufs[b % 2][: hi - lo]
                if len(work) >= 2:
                    work.pop(0).wait()
                bn = buf.numpy()
                for i, a, z in plan.segments(b):
                    if i not in host:
                        host[i] = host_bytes(tensors[i])
                    d = plan.slots[i].offset + a - lo
                    bn[d:d + (z - a)] = host[i][a:z]
                work.append(torch.distributed.broadcast(buf, src=0, async_op=True))
            for w in work:
                w.wait()
        else:
            arrays = [torchtpu.to_jax(t.detach()) for t in tensors]
            for b in range(plan.num_buckets):
                fn = self._pack_fns.get(b)
                if fn is None:
                    fn = self._pack_fns[b] = _pack_fn(plan, b)
                idx = sorted({i for i, _, _ in plan.segments(b)})
                bucket = torchtpu.from_jax(fn(*[arrays[i] for i in idx]))
                torch.distributed.broadcast(bucket, src=0)
            torchtpu.synchronize()
        self.last_timings = {"broadcast_s": time.perf_counter() - t0, "bytes": plan.payload_bytes}
        return dict(self.last_timings, version=int(version))


class WeightReceiver:
    """The rollout worker's side: turns an update into a state dict of fresh tensors."""

    def __init__(self, device: str = "tpu"):
        if device not in ("tpu", "cpu"):
            raise ValueError(f"WeightReceiver device must be 'tpu' or 'cpu', got {device!r}")
        self.device = device
        self.group: CollectiveGroup | None = None
        self._unpack_fns: dict = {}
        self.last_timings: dict = {}

    def receive(self, update: WeightUpdate) -> dict:
        """The tensors of an object-store update (``update.refs`` are fetched here)."""
        import ray

        if not isinstance(update, WeightUpdate) or update.transport != "object_store":
            raise TypeError(f"weight sync: expected an object_store WeightUpdate, got {update!r:.200}")
        t0 = time.perf_counter()
        plan = update.plan
        arena = _new_arena(plan.total_bytes)
        an = arena.numpy()
        # fetch a few buckets at a time: the arena is the only full copy on this side
        refs = list(update.refs)
        for b0 in range(0, len(refs), 4):
            got = ray.get(refs[b0:b0 + 4])
            for k, segs in enumerate(got):
                b = b0 + k
                for (i, a, z), seg in zip(plan.segments(b), segs):
                    d = plan.slots[i].offset + a
                    an[d:d + (z - a)] = seg
            del got
        t1 = time.perf_counter()
        out = _tensors_from_arena(plan, arena, self.device)
        self.last_timings = {"fetch_copy_s": t1 - t0, "install_views_s": time.perf_counter() - t1,
                             "bytes": plan.payload_bytes}
        return out

    def receive_broadcast(self) -> tuple:
        """Receive header + buckets from the collective group. Returns ``(update, tensors)``."""
        if self.group is None:
            raise RuntimeError("weight sync: the collective transport has no process group "
                               "(call collective_setup first)")
        t0 = time.perf_counter()
        g = self.group
        update = g.recv_header()
        plan = update.plan
        if g.device == "cpu":
            arena = _new_arena(plan.total_bytes)
            work = []
            for b in range(plan.num_buckets):
                lo, hi = plan.bucket_range(b)
                work.append(torch.distributed.broadcast(arena[lo:hi], src=0, async_op=True))
            for w in work:
                w.wait()
            out = _tensors_from_arena(plan, arena, self.device)
        else:
            buckets = []
            for b in range(plan.num_buckets):
                lo, hi = plan.bucket_range(b)
                buf = torch.empty(hi - lo, dtype=torch.uint8, device="tpu")
                torch.distributed.broadcast(buf, src=0)
                buckets.append(torchtpu.to_jax(buf))
            key = plan.fingerprint() + str(plan.bucket_bytes)
            fn = self._unpack_fns.get(key)
            if fn is None:
                fn = self._unpack_fns[key] = _unpack_fn(plan)
            arrays = fn(*buckets)
            out = {s.name: torchtpu.from_jax(a, s.dtype) for s, a in zip(plan.slots, arrays)}
            if self.device == "cpu":
                out = {k: v.cpu() for k, v in out.items()}
        self.last_timings = {"broadcast_s": time.perf_counter() - t0, "bytes": plan.payload_bytes}
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
            start = plan.slots[i].offset + a
            if start > pos:
                parts.append(jnp.zeros((start - pos,), jnp.uint8))
            parts.append(bytes_of(by_i[i])[a:z])
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
            for b in range(s.offset // plan.bucket_bytes, (s.offset + max(s.nbytes, 1) - 1) // plan.bucket_bytes + 1):
                lo, hi = plan.bucket_range(b)
                a, z = max(lo, s.offset), min(hi, s.offset + s.nbytes)
                if a < z:
                    pieces.append(buckets[b][a - lo:z - lo])
            u8 = jnp.concatenate(pieces) if len(pieces) > 1 else (pieces[0] if pieces else jnp.zeros((0,), jnp.uint8))
            n = math.prod(s.shape)
            out.append(array_from_bytes(u8, s.dtype, n).reshape(s.shape))
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
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(backend=pg_backend, init_method=init_method, world_size=int(world_size),
                                rank=int(rank), timeout=timedelta(seconds=timeout_s))
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

        payload = pickle.dumps(update)
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=0)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data.to(self.device), src=0)

    def recv_header(self) -> WeightUpdate:
        import torch.distributed as dist

        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=0)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=0)
        return pickle.loads(data.cpu().numpy().tobytes())


def free_port() -> int:
    """A free TCP port on this host (for the group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_state_dict(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make ``module``'s parameters and buffers *be* ``tensors`` (no copy): ``p.data = t`` keeps
    every Parameter object (and anything that refers to it) and swaps its storage."""
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers(remove_duplicate=False)))
    for name, t in tensors.items():
        p = own.get(name)
        if p is None:
            raise KeyError(f"weight sync: the model has no parameter or buffer named {name!r}")
        if p.dtype != t.dtype or p.shape != t.shape or p.device.type != t.device.type:
            raise ValueError(f"weight sync: {name!r} is {p.dtype} {list(p.shape)} on {p.device} in the "
                             f"model but {t.dtype} {list(t.shape)} on {t.device} in the update")
        with torch.no_grad():
            p.data = t

