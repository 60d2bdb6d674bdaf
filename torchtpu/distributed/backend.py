"""The ``tpu`` torch.distributed backend.

``torch.distributed.init_process_group("tpu", ...)`` runs collectives on tpu
tensors across processes; results land in the caller's own tensors, as with
NCCL on CUDA.

Transport: one tpu device per process (DESIGN.md). The default group's
creation also starts JAX's multi-process runtime (``runtime.py``), so a
collective on tpu tensors runs as one XLA program over the group's devices
(``xla.py``) and its result lands in the SAME tpu tensors (in place): nothing
is copied to host memory. CPU tensors sent through a ``tpu`` group go to gloo
(in place), so a default group made with ``"tpu"`` serves both devices; object
collectives are CPU tensors too. Where JAX's multi-process runtime could not
start (JAX ran before ``init_process_group``, ``TORCHTPU_DIST_TRANSPORT=host``)
and inside ``host_staged()``, tpu tensors take the host-staged route instead:
copied to host, reduced by gloo, copied back (counted in
``torchtpu.metrics.snapshot()["host_transfer_bytes"]``).

Safety: before every collective the ranks exchange a small descriptor (the
collective, dtype, element counts, root, reduce op, split sizes). A rank that
called a different collective, or passed a different shape, makes every rank
raise a ``RuntimeError`` that says which rank passed what, instead of gloo
hanging or producing a wrong result. A rank that died makes gloo raise within
the group's timeout. ``TORCHTPU_DIST_CHECK=0`` skips the descriptor exchange
(one small allgather per collective) everywhere; ``agreed_arguments()`` skips
it for the collectives one thread issues inside it, for callers whose
arguments were already exchanged by an earlier (checked) collective, e.g. a
KeyedJaggedTensor's lengths/ids all-to-alls whose split sizes came from the
splits all-to-all just before.

Implemented in Python as a ``torch.distributed.ProcessGroup`` subclass (torch
2.13 cannot subclass ``c10d.Backend`` from Python); C++ callers (DDP's reducer,
the ``_c10d_functional`` ops behind functional collectives and DTensor) reach
its methods through the ProcessGroup trampoline. The wrapped gloo backend is
also registered as the group's CPU backend, which is where the group's name
lives.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist

from ..base import dtypes, metrics
from ..runtime import storage
from ..runtime.modes import deferring
from ..runtime.recorder import RECORDER, LazyBuf, token_of
from . import runtime as _runtime
from .xla import GroupMesh

BACKEND_NAME = "tpu"
_C = torch._C._distributed_c10d
_RedOp = dist.ReduceOp
_RT = dist.ReduceOp.RedOpType
_MAGIC = 0x7470755F  # "tpu_"
_HDR = 8  # fixed descriptor fields before the per-peer counts


_local = threading.local()


def _checks_enabled() -> bool:
    return os.environ.get("TORCHTPU_DIST_CHECK", "1") != "0" and not getattr(_local, "agreed", 0)


@contextlib.contextmanager
def host_staged():
    """Collectives this thread issues inside move tpu tensors through host memory and gloo (the
    route taken without JAX's multi-process runtime), not as XLA programs: for comparisons
    (benchmarks/bench_collectives.py) and for tests of that route."""
    _local.staged = getattr(_local, "staged", 0) + 1
    try:
        yield
    finally:
        _local.staged -= 1


@contextlib.contextmanager
def agreed_arguments():
    """Collectives this thread issues inside skip the descriptor exchange (one round trip each).

    Only for calls whose arguments every rank derived from data the ranks already exchanged
    through a checked collective (split sizes received from the peers, say): then the ranks
    cannot disagree about the call, and the exchange would only add latency. A mismatch
    inside is no longer diagnosed (gloo may hang until the group's timeout instead); a local
    argument error still raises on the rank that made it.
    """
    _local.agreed = getattr(_local, "agreed", 0) + 1
    try:
        yield
    finally:
        _local.agreed -= 1


# ---------------------------------------------------------------- descriptors
_OPS = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
        "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "gather", "scatter", "reduce",
        "barrier", "all_reduce_coalesced", "all_gather_coalesced", "fused_graph"]
_OPCODE = {n: i + 1 for i, n in enumerate(_OPS)}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
           torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_REDOP_NAMES = {int(v): k for k, v in _RT.__members__.items()}


def _dtype_code(dt) -> int:
    return _DTYPE_CODE.get(dt, 99)


def _dtype_name(code) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else f"dtype#{code}"


def _redop(opts_op) -> int:
    return int(opts_op.op) if hasattr(opts_op, "op") else int(opts_op)


def _describe(row, world) -> str:
    """Human text of one rank's descriptor row (for mismatch errors)."""
    if row[0] != _MAGIC:
        return "an unknown call"
    op = _OPS[row[1] - 1] if 0 < row[1] <= len(_OPS) else f"op#{row[1]}"
    if row[7]:
        return f"{op} with invalid arguments (see that rank's error)"
    if op == "fused_graph":
        return f"a DeferAndFuse graph holding {row[3]} collectives"
    parts = []
    if op != "barrier":
        parts.append(_dtype_name(row[2]))
    if op in ("all_to_all_single", "all_to_all"):
        parts.append(f"send counts {list(row[_HDR:_HDR + world])}, recv counts {list(row[_HDR + world:])}")
    elif op != "barrier":
        parts.append(f"{row[3]} elements")
    if op in ("broadcast", "gather", "scatter", "reduce"):
        parts.append(f"root {row[4]}")
    if op in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced"):
        parts.append(_REDOP_NAMES.get(row[5], f"op#{row[5]}"))
    if row[6]:
        parts.append(f"{row[6]} tensors")
    return f"{op}({', '.join(parts)})"


# ---------------------------------------------------------------- host staging
def _flush() -> None:
    """Pending DeferAndFuse work must run before its values can be sent (trigger 'collective')."""
    if RECORDER.pending:
        RECORDER.flush("collective")


def _is_tpu(t) -> bool:
    return t.device.type == "tpu"


def _np_to_torch(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over ``arr``'s memory (no copy; bfloat16/float8 through a same-width int view)."""
    return dtypes.numpy_view_as_torch(arr, dtype)


def _host_in(t: torch.Tensor, writable: bool = True) -> torch.Tensor:
    """A contiguous host tensor holding ``t``'s value for gloo (CPU tensors: ``t`` itself when dense).

    ``writable=False`` is for inputs gloo only reads: on XLA's CPU backend the
    host view of the device buffer then costs no copy. The view keeps the jax
    array alive (numpy's base), so it cannot be freed or donated meanwhile.
    """
    if _is_tpu(t):
        value = storage.logical_value(t)
        metrics.record_host_transfer(value.nbytes)
        arr = np.asarray(value)  # the device->host transfer (a view on the CPU backend)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if writable and not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return _np_to_torch(arr, t.dtype).reshape(t.shape)
    return t if t.is_contiguous() else t.contiguous()  # gloo needs dense memory; written back after


def _host_out(t: torch.Tensor) -> torch.Tensor:
    """A host buffer for results that will land in ``t`` (its old value is not needed)."""
    if _is_tpu(t) or not t.is_contiguous():
        return torch.empty(t.shape, dtype=t.dtype)
    return t


def _write_back(pairs) -> None:
    """Put host results into their tpu tensors, in place (the caller's tensor objects hold them).

    The host buffers are private to the collective and never written again, so
    the device may adopt them without a copy (DLPack on XLA's CPU backend).
    """
    dev = None
    for t, h in pairs:
        if t is h:
            continue
        if _is_tpu(t):
            if dev is None:
                dev = jax.local_devices()[0]
            storage.write_value(t, _to_device(h.reshape(t.shape), dev))
        else:
            with torch.no_grad():
                t.copy_(h)


def _to_device(h: torch.Tensor, dev):
    """A jax array on ``dev`` with host tensor ``h``'s value (``h`` must not change afterwards)."""
    want = np.dtype(dtypes.to_jax(h.dtype))
    metrics.record_host_transfer(h.numel() * h.element_size())
    try:
        # zero-copy where the memory is already the device's (CPU backend): a fresh copy of a
        # large buffer costs as much as the gloo transfer itself here
        y = jax.dlpack.from_dlpack(h)
    except Exception:  # noqa: BLE001 - a dtype or layout DLPack does not take: copy instead
        y = None
    if y is None or y.dtype != want or tuple(y.shape) != tuple(h.shape):
        return jax.device_put(dtypes.cpu_tensor_to_numpy(h), dev)
    if dev not in y.devices():
        y = jax.device_put(y, dev)
    return y


def _land(t: torch.Tensor, value) -> None:
    """Put the flat jax array ``value`` (an XLA collective's result) into tpu tensor ``t``, in place."""
    storage.write_value(t, value.reshape(t.shape))


def _xla_op(redop: int) -> str:
    """The reduce op's name in ``xla.py`` (validated by ``_reduce_plan`` first)."""
    name = _REDOP_NAMES[redop].lower()
    return "prod" if name == "product" else name


# gloo reduces these dtypes natively; others go through a wider type
_GLOO_REDUCE = {torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.uint8,
                torch.int32, torch.int64}


class _Work(dist.Work):
    """An in-flight collective: gloo works plus the copy of results into tpu tensors.

    ``wait()`` waits for gloo and then writes results back in the waiting
    thread. ``get_future()`` (DDP's reducer, comm hooks) completes the work
    first and hands back a completed future of the output tensors.
    """

    def __init__(self, works, finish=None, result=None, source_rank=None):
        super().__init__()
        self._works = works
        self._finish = finish
        self._result = result if result is not None else []
        self._source = source_rank
        self._done = False
        self._exc = None
        self._lock = threading.Lock()

    def _complete(self, timeout=None):
        with self._lock:
            if not self._done:
                try:
                    for w in self._works:
                        if timeout is None:
                            w.wait()
                        else:
                            w.wait(timeout)
                    if self._finish is not None:
                        self._finish()
                except BaseException as e:  # noqa: BLE001 - re-raised to every waiter
                    self._exc = e
                self._done = True
                self._works = []
                self._finish = None
        if self._exc is not None:
            raise self._exc

    def wait(self, timeout=None):
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(milliseconds=timeout) if timeout > 0 else None
        elif isinstance(timeout, datetime.timedelta) and timeout.total_seconds() <= 0:
            timeout = None
        self._complete(timeout)
        return True

    def is_completed(self):
        if not self._done and all(w.is_completed() for w in self._works):
            try:
                self._complete()
            except Exception:  # noqa: BLE001 - reported by wait()/exception()
                pass
        return self._done

    def is_success(self):
        return self.is_completed() and self._exc is None

    def exception(self):
        return self._exc

    def source_rank(self):
        if self._source is None:
            raise RuntimeError("torchtpu distributed: source_rank() is only available for recv from any source")
        self._complete()
        return self._source()

    def result(self):
        self._complete()
        return self._result

    def get_future(self):
        fut = torch.futures.Future()
        try:
            self._complete()
            fut.set_result(self._result)
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    def synchronize(self):
        self._complete()


class ProcessGroupTPU(dist.ProcessGroup):
    """The ``tpu`` process group: collectives on tpu (and CPU) tensors over gloo host buffers."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks=None):
        super().__init__(rank, size)
        if not global_ranks:  # the default group: JAX's multi-process runtime comes up with it
            global_ranks = list(range(size))
            _runtime.start(store, rank, size, timeout.total_seconds())
        self.global_ranks = list(global_ranks)
        # the XLA transport: this group's ranks as a mesh of their processes' devices
        self._mesh = GroupMesh(_runtime.rank_devices(self.global_ranks), rank) \
            if _runtime.xla_transport_active() else None
        self._pair_meshes = {}
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # the group's name (and _get_backend("cpu")) live in a registered backend
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._rank = rank
        self._size = size
        self._timeout = timeout
        # descriptor exchange + launch must not interleave between threads (ranks would pair them differently)
        self._lock = threading.RLock()
        self.descriptor_exchanges = 0  # how many collectives were checked (agreed_arguments() skips some)
        self._graph_group = _GraphGroup(self) if self._mesh is not None else None

    # -------------------------------------------------------------- identity
    def getBackendName(self):
        return BACKEND_NAME

    def __repr__(self):
        return f"ProcessGroupTPU(rank={self._rank}, size={self._size})"

    # -------------------------------------------------------------- transport
    def _use_xla(self, tensors) -> bool:
        """Does this call run as an XLA program (tpu tensors, the XLA transport on, not host_staged())?"""
        return self._mesh is not None and not getattr(_local, "staged", 0) and all(_is_tpu(t) for t in tensors)

    def _send_payload(self, src: int, dst: int, local):
        """A point-to-point payload from group rank ``src`` to ``dst``: a ppermute on the mesh of the two
        ranks' devices (in rank order, whichever way the bytes go); both ranks call it."""
        pair = (min(src, dst), max(src, dst))
        if pair not in self._pair_meshes:
            devs = self._mesh.devices
            self._pair_meshes[pair] = GroupMesh([devs[pair[0]], devs[pair[1]]], pair.index(self._rank))
        return self._pair_meshes[pair].run("permute", local, ((pair.index(src), pair.index(dst)),))

    def _widest(self, rows, send, recv) -> int:
        """The largest all_to_all chunk any rank sends (from the descriptor table, else one exchange)."""
        w = self._size
        if rows is not None:
            return max(max(r[_HDR:_HDR + 2 * w]) for r in rows)
        m = torch.tensor([max(max(send), max(recv))], dtype=torch.int64)
        self._gloo.allreduce([m], self._max_opts()).wait()
        return int(m.item())

    @staticmethod
    def _max_opts():
        o = _C.AllreduceOptions()
        o.reduceOp = _RedOp(_RT.MAX)
        return o

    def _zeros(self, n: int, dtype: torch.dtype):
        """A flat jax zero block on this rank's device (made there: no host transfer)."""
        return jnp.zeros((n,), dtypes.to_jax(dtype), device=self._mesh.device)

    # -------------------------------------------------------------- agreement
    def _agree(self, op, dtype=None, numel=0, root=0, redop=0, count=0, send=None, recv=None, error=None):
        """Exchange descriptors; raise on every rank if the ranks' calls do not match.

        ``error`` is a local argument error: the descriptor marks it so that the
        other ranks fail too (a rank that raised alone would leave its peers
        waiting for the timeout).
        """
        if not _checks_enabled():
            if error is not None:
                raise error
            return None
        self.descriptor_exchanges += 1
        w = self._size
        rows = self._exchange(self._descriptor(op, dtype, numel, root, redop, count, send, recv, error))
        if error is not None:
            raise error
        bad = [r for r in range(w) if rows[r][7]]
        if bad:
            raise RuntimeError(
                f"torchtpu distributed: {op} failed because rank(s) {bad} of this group passed invalid "
                f"arguments ({_describe(rows[bad[0]], w)})")
        pairwise = op in ("all_to_all_single", "all_to_all")
        common = slice(0, _HDR) if not pairwise else slice(0, 3)
        ref = rows[0][common]
        mismatch = [r for r in range(w) if rows[r][common] != ref]
        if not mismatch and pairwise:
            for i in range(w):
                for j in range(w):
                    if rows[i][_HDR + j] != rows[j][_HDR + w + i]:
                        mismatch.append(i if i != self._rank else j)
                        break
                if mismatch:
                    break
        if mismatch:
            calls = "; ".join(f"rank {r}: {_describe(rows[r], w)}" for r in range(w))
            raise RuntimeError(
                f"torchtpu distributed: mismatched collective across the ranks of group "
                f"{self._name_or_default()} (this is rank {self._rank}): {calls}")
        return rows

    def _descriptor(self, op, dtype=None, numel=0, root=0, redop=0, count=0, send=None, recv=None, error=None):
        """One call's descriptor row: (magic, op, dtype, elements, root, reduce op, tensors, error flag,
        send counts, recv counts)."""
        w = self._size
        return ((_MAGIC, _OPCODE[op], _dtype_code(dtype) if dtype is not None else 0, int(numel), int(root),
                 int(redop), int(count), 1 if error is not None else 0)
                + (tuple(int(x) for x in send) + tuple(int(x) for x in recv) if send is not None else (0,) * (2 * w)))

    def _exchange(self, flat) -> list:
        """Every rank's int64 row ``flat`` (all the same length), through the group's gloo."""
        row = torch.tensor(flat, dtype=torch.int64)
        table = torch.empty(self._size * row.numel(), dtype=torch.int64)
        self._gloo._allgather_base(table, row).wait()
        return table.view(self._size, -1).tolist()

    def _agree_graph(self, descs, signature):
        """The descriptor exchange of a DeferAndFuse graph holding collectives ``descs`` (this rank's,
        in recording order) and of structure ``signature``: one exchange of (count, hash, signature);
        only if the ranks' collectives differ, a second one of the whole lists. Returns ``(k, error,
        same)``: run the first ``k`` collectives now (a rank whose graph holds more keeps the rest
        pending: another rank flushed earlier); ``error`` is the mismatch to raise, on every rank,
        once those ran; ``same``: every rank's graph has this structure."""
        w = self._size
        with self._lock:
            self.descriptor_exchanges += 1
            head = self._descriptor("fused_graph", numel=len(descs), root=hash(tuple(descs)) & ((1 << 62) - 1),
                                    redop=signature)
            rows = self._exchange(head)
            if any(r[:2] != [_MAGIC, _OPCODE["fused_graph"]] or r[7] for r in rows):
                calls = "; ".join(f"rank {r}: {_describe(rows[r], w)}" for r in range(w))
                return 0, RuntimeError(f"torchtpu distributed: mismatched collective across the ranks of group "
                                       f"{self._name_or_default()} (this is rank {self._rank}): {calls}"), False
            same = all(r[5] == rows[0][5] for r in rows)
            if all(r[:5] == rows[0][:5] for r in rows):
                return len(descs), None, same
            counts = [r[3] for r in rows]
            width = len(head)
            pad = (0,) * width
            mine = [x for d in descs for x in d] + list(pad) * (max(counts) - len(descs))
            lists = [[tuple(r[i * width:(i + 1) * width]) for i in range(counts[q])]
                     for q, r in enumerate(self._exchange(mine))]
        for i in range(min(counts)):
            if any(lst[i] != lists[0][i] for lst in lists):
                calls = "; ".join(f"rank {r}: {_describe(lists[r][i], w)}" for r in range(w))
                return i, RuntimeError(
                    f"torchtpu distributed: mismatched collective sequence under DeferAndFuse across the ranks of "
                    f"group {self._name_or_default()} (this is rank {self._rank}): collective #{i + 1} of the "
                    f"graph differs: {calls}. What was recorded before it ran; it and what was recorded after it "
                    f"were dropped."), False
        return min(counts), None, False

    # -------------------------------------------------------------- recording under DeferAndFuse
    def _recording(self, tensors) -> bool:
        """Is this collective recorded into the pending DeferAndFuse graph (XLA transport, tpu tensors,
        none empty) rather than run now?"""
        return deferring() and self._use_xla(tensors) and all(t.numel() for t in tensors)

    def _record(self, desc, kind, static, inputs, outputs):
        """Record collective ``kind`` of ``inputs`` (flattened, concatenated) into the pending graph;
        its result, split in order, lands in ``outputs``."""
        bufs = [_pending_flat(t) for t in inputs]
        in_sizes = tuple(t.numel() for t in inputs)
        out_sizes = tuple(t.numel() for t in outputs)
        mesh = self._mesh
        fn = mesh.graph_fn((kind, static, in_sizes, out_sizes),
                           lambda: _collective_fn(mesh.body(kind, *static), len(in_sizes), out_sizes))
        name = f"c10d::{_OPS[desc[1] - 1]}"
        outs = RECORDER.record(fn, bufs, (), list(out_sizes), name, token_of(fn), collective=(self._graph_group, desc))
        for b in outs:
            # computed whichever results stay alive: every rank's program must hold the collective
            RECORDER.watch(b)
        for t, b in zip(outputs, outs):
            _land_pending(t, b)
        return _Work([], None, list(outputs))

    def _name_or_default(self):
        try:
            return repr(self.group_name)
        except RuntimeError:
            return "<unnamed>"

    @staticmethod
    def _gloo_timeout(opts, gopts):
        gopts.timeout = opts.timeout
        return gopts

    # -------------------------------------------------------------- reductions
    def _reduce_plan(self, dtype, redop, what):
        """(gloo op, host dtype to reduce in, post-step) for ``redop`` on ``dtype``."""
        if redop == int(_RT.PREMUL_SUM):
            raise ValueError(f"torchtpu distributed: {what} does not support ReduceOp.PREMUL_SUM")
        if redop in (int(_RT.BAND), int(_RT.BOR), int(_RT.BXOR)):
            if dtype.is_floating_point or dtype.is_complex:
                raise ValueError(f"torchtpu distributed: {what}: bitwise ReduceOp on {dtype} is not defined")
            return _RedOp(getattr(_RT, _REDOP_NAMES[redop])), dtype if dtype != torch.bool else torch.uint8, None
        avg = redop == int(_RT.AVG)
        gop = _RT.SUM if avg else getattr(_RT, _REDOP_NAMES[redop])
        work_dtype = dtype
        if dtype == torch.bool:
            # logical: sum/max -> any, product/min -> all (NCCL's semantics on bool)
            gop = {_RT.SUM: _RT.MAX, _RT.PRODUCT: _RT.MIN}.get(gop, gop)
            work_dtype = torch.uint8
        elif dtype.is_complex:
            if gop != _RT.SUM:
                raise ValueError(f"torchtpu distributed: {what}: ReduceOp.{_REDOP_NAMES[redop]} is not defined "
                                 f"for complex tensors ({dtype})")
        elif dtype not in _GLOO_REDUCE:
            work_dtype = torch.float64 if dtype.is_floating_point else torch.int64
        return _RedOp(gop), work_dtype, avg

    @staticmethod
    def _to_work(h, work_dtype):
        if h.dtype.is_complex:
            return torch.view_as_real(h)
        if h.dtype != work_dtype:
            return h.to(work_dtype)
        return h

    def _post(self, h, w, avg, n):
        """Result of the reduction back in ``h``'s dtype (AVG divides by the group size)."""
        if h.dtype.is_complex:
            if avg:
                w.div_(n)
            return  # w is a view of h
        if avg:
            if w.dtype.is_floating_point:
                w.div_(n)
            else:
                w.copy_(torch.div(w, n, rounding_mode="trunc"))
        if w.dtype != h.dtype or w.data_ptr() != h.data_ptr():  # w was a converted copy
            h.copy_(w.reshape(h.shape))

    def allreduce(self, tensors, opts=None):
        opts = opts or _C.AllreduceOptions()
        return self._allreduce_impl(tensors, opts, "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or _C.AllreduceCoalescedOptions()
        return self._allreduce_impl(tensors, opts, "all_reduce_coalesced")

    def _allreduce_impl(self, tensors, opts, op):
        redop = _redop(opts.reduceOp)
        with self._lock:
            error = None
            try:
                if not tensors:
                    raise ValueError(f"torchtpu distributed: {op} got no tensors")
                dtype = tensors[0].dtype
                for t in tensors:
                    if t.dtype != dtype:
                        raise TypeError(f"torchtpu distributed: {op}: all tensors must share one dtype "
                                        f"({dtype} and {t.dtype} given)")
                gop, work_dtype, avg = self._reduce_plan(dtype, redop, op)
            except (TypeError, ValueError) as e:
                error, dtype = e, None
            if error is None and self._recording(tensors):
                desc = self._descriptor(op, dtype, sum(t.numel() for t in tensors), redop=redop, count=len(tensors))
                return self._record(desc, "reduce", (_xla_op(redop),), tensors, tensors)
            _flush()
            self._agree(op, dtype, sum(t.numel() for t in tensors), redop=redop, count=len(tensors), error=error)
            if self._use_xla(tensors):
                flats = [storage.flat_value(t) for t in tensors]
                out = self._mesh.run("reduce", flats[0] if len(flats) == 1 else jnp.concatenate(flats),
                                     _xla_op(redop))
                off = 0
                for t in tensors:
                    _land(t, out if len(tensors) == 1 else out[off:off + t.numel()])
                    off += t.numel()
                return _Work([], None, list(tensors))
            hosts = [_host_in(t) for t in tensors]
            # one flat buffer: a single gloo collective whatever the number of tensors
            flat = torch.cat([self._to_work(h, work_dtype).reshape(-1) for h in hosts]) if len(hosts) > 1 \
                else self._to_work(hosts[0], work_dtype).reshape(-1)
            gopts = self._gloo_timeout(opts, _C.AllreduceOptions())
            gopts.reduceOp = gop
            work = self._gloo.allreduce([flat], gopts)

            def finish():
                off = 0
                for t, h in zip(tensors, hosts):
                    wv = self._to_work(h, work_dtype)
                    n = wv.numel()
                    piece = flat[off:off + n].view(wv.shape)
                    off += n
                    if piece.data_ptr() != wv.data_ptr():
                        wv.copy_(piece)
                    self._post(h, wv, avg, self._size)
                _write_back(zip(tensors, hosts))

            return _Work([work], finish, list(tensors))

    def reduce(self, tensors, opts=None):
        opts = opts or _C.ReduceOptions()
        redop = _redop(opts.reduceOp)
        root = opts.rootRank
        with self._lock:
            _flush()
            t = tensors[0]
            error = None
            try:
                gop, work_dtype, avg = self._reduce_plan(t.dtype, redop, "reduce")
            except (TypeError, ValueError) as e:
                error = e
            self._agree("reduce", t.dtype, t.numel(), root=root, redop=redop, error=error)
            if self._use_xla([t]):
                out = self._mesh.run("reduce", storage.flat_value(t), _xla_op(redop))
                if self._rank == root:
                    _land(t, out)
                return _Work([], None, [t])
            h = _host_in(t)
            wv = self._to_work(h, work_dtype)
            buf = wv if wv.is_contiguous() and wv.data_ptr() == h.data_ptr() else wv.contiguous()
            gopts = self._gloo_timeout(opts, _C.ReduceOptions())
            gopts.reduceOp = gop
            gopts.rootRank = root
            gopts.rootTensor = 0
            work = self._gloo.reduce([buf], gopts)

            def finish():
                if self._rank == root:
                    if buf is not wv:
                        wv.copy_(buf)
                    self._post(h, wv, avg, self._size)
                    _write_back([(t, h)])

            return _Work([work], finish, [t])

    # -------------------------------------------------------------- data movement
    def broadcast(self, tensors, opts=None):
        opts = opts or _C.BroadcastOptions()
        root = opts.rootRank
        with self._lock:
            t = tensors[0]
            if self._recording([t]):
                return self._record(self._descriptor("broadcast", t.dtype, t.numel(), root=root), "broadcast",
                                    (root,), [t], [t])
            _flush()
            self._agree("broadcast", t.dtype, t.numel(), root=root)
            if self._use_xla([t]):
                out = self._mesh.run("broadcast", storage.flat_value(t), root)
                if self._rank != root:
                    _land(t, out)
                return _Work([], None, [t])
            h = _host_in(t, writable=False) if self._rank == root else _host_out(t)
            gopts = self._gloo_timeout(opts, _C.BroadcastOptions())
            gopts.rootRank = root
            gopts.rootTensor = 0
            work = self._gloo.broadcast([_bytes_flat(h)], gopts)
            finish = None if self._rank == root else (lambda: _write_back([(t, h)]))
            return _Work([work], finish, [t])

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or _C.AllgatherOptions()
        with self._lock:
            t = inputs[0]
            outs = output_lists[0]
            error = None
            if len(outs) != self._size:
                error = ValueError(f"torchtpu distributed: all_gather: tensor_list has {len(outs)} tensors, "
                                   f"the group has {self._size} ranks")
            elif any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
                error = ValueError("torchtpu distributed: all_gather: every output tensor must have the "
                                   f"input's size and dtype ({list(t.shape)}, {t.dtype})")
            if error is None and self._recording([t, *outs]):
                self._record(self._descriptor("all_gather", t.dtype, t.numel()), "all_gather", (), [t], outs)
                return _Work([], None, [outs])
            _flush()
            self._agree("all_gather", t.dtype, t.numel(), error=error)
            if self._use_xla([t, *outs]):
                res = self._mesh.run("all_gather", storage.flat_value(t))
                k = t.numel()
                for r, o in enumerate(outs):
                    _land(o, res[r * k:(r + 1) * k])
                return _Work([], None, [outs])
            h = _host_in(t, writable=False)
            flat = torch.empty((self._size,) + tuple(h.shape), dtype=h.dtype)
            work = self._gloo._allgather_base(_bytes_flat(flat), _bytes_flat(h),
                                              self._gloo_timeout(opts, _C.AllgatherOptions()))

            def finish():
                _write_back([(o, flat[r]) for r, o in enumerate(outs)])

            return _Work([work], finish, [outs])

    def _allgather_base(self, output, input, opts=None):
        opts = opts or _C.AllgatherOptions()
        with self._lock:
            error = None
            if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
                error = ValueError(
                    f"torchtpu distributed: all_gather_into_tensor: output has {output.numel()} elements of "
                    f"{output.dtype}, expected {self._size} x {input.numel()} of {input.dtype}")
            if error is None and self._recording([input, output]):
                return self._record(self._descriptor("all_gather_into_tensor", input.dtype, input.numel()),
                                    "all_gather", (), [input], [output])
            _flush()
            self._agree("all_gather_into_tensor", input.dtype, input.numel(), error=error)
            if self._use_xla([input, output]):
                _land(output, self._mesh.run("all_gather", storage.flat_value(input)))
                return _Work([], None, [output])
            h = _host_in(input, writable=False)
            o = _host_out(output)
            work = self._gloo._allgather_base(_bytes_flat(o), _bytes_flat(h),
                                              self._gloo_timeout(opts, _C.AllgatherOptions()))
            return _Work([work], lambda: _write_back([(output, o)]), [output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Work(works, None, list(outputs))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        works = [self.allgather([outs], [i], opts) for outs, i in zip(output_lists, inputs)]
        return _Work(works, None, output_lists)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or _C.ReduceScatterOptions()
        return self._reduce_scatter_impl(output, input, opts, "reduce_scatter_tensor")

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or _C.ReduceScatterOptions()
        output = outputs[0]
        inputs = input_lists[0]
        error = None
        if len(inputs) != self._size:
            error = ValueError(f"torchtpu distributed: reduce_scatter: input_list has {len(inputs)} tensors, "
                               f"the group has {self._size} ranks")
        elif any(i.numel() != output.numel() or i.device != output.device for i in inputs):
            error = ValueError("torchtpu distributed: reduce_scatter: every input must have the output's "
                               f"device and number of elements ({output.device}, {output.numel()})")
        if error is not None:
            with self._lock:
                _flush()
                self._agree("reduce_scatter", output.dtype, output.numel(), redop=_redop(opts.reduceOp), error=error)
        stacked = torch.cat([i.reshape(-1) for i in inputs])  # on the inputs' device (one tpu op)
        return self._reduce_scatter_impl(output, stacked, opts, "reduce_scatter")

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Work(works, None, list(outputs))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def _reduce_scatter_impl(self, output, input, opts, op):
        redop = _redop(opts.reduceOp)
        with self._lock:
            error = None
            gop = work_dtype = avg = None
            try:
                if input.numel() != output.numel() * self._size or input.dtype != output.dtype:
                    raise ValueError(
                        f"torchtpu distributed: {op}: input has {input.numel()} elements of {input.dtype}, "
                        f"expected {self._size} x {output.numel()} of {output.dtype}")
                gop, work_dtype, avg = self._reduce_plan(output.dtype, redop, op)
            except (TypeError, ValueError) as e:
                error = e
            if error is None and self._recording([input, output]):
                return self._record(self._descriptor(op, output.dtype, output.numel(), redop=redop), "reduce_scatter",
                                    (_xla_op(redop),), [input], [output])
            _flush()
            self._agree(op, output.dtype, output.numel(), redop=redop, error=error)
            if self._use_xla([input, output]):
                _land(output, self._mesh.run("reduce_scatter", storage.flat_value(input), _xla_op(redop)))
                return _Work([], None, [output])
            h = _host_in(input)
            wv = self._to_work(h, work_dtype).reshape(-1)
            o = _host_out(output)
            ov = self._to_work(o, work_dtype).reshape(-1)
            # ov is a view of o unless a dtype conversion made a copy (then _post copies back)
            gbuf = ov if ov.is_contiguous() else torch.empty_like(ov)
            gopts = self._gloo_timeout(opts, _C.ReduceScatterOptions())
            gopts.reduceOp = gop
            work = self._gloo._reduce_scatter_base(gbuf, wv.contiguous(), gopts)

            def finish():
                if gbuf is not ov:
                    ov.copy_(gbuf)
                self._post(o, ov, avg, self._size)
                _write_back([(output, o)])

            return _Work([work], finish, [output])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or _C.AllToAllOptions()
        with self._lock:
            w = self._size
            out_splits = list(output_split_sizes or [])
            in_splits = list(input_split_sizes or [])
            error = None
            row_in = _row_numel(input)
            row_out = _row_numel(output)
            try:
                if input.dtype != output.dtype:
                    raise TypeError(f"torchtpu distributed: all_to_all_single: input is {input.dtype}, "
                                    f"output is {output.dtype}")
                in_splits = _check_splits(in_splits, input, w, "input_split_sizes")
                out_splits = _check_splits(out_splits, output, w, "output_split_sizes")
            except (TypeError, ValueError) as e:
                error = e
                in_splits = [0] * w
                out_splits = [0] * w
            send = [s * row_in for s in in_splits]
            recv = [s * row_out for s in out_splits]
            if error is None and len(set(send)) == 1 and set(recv) == set(send) and self._recording([input, output]):
                # even splits (uneven ones need the widest chunk of any rank: flushed and run as below)
                return self._record(self._descriptor("all_to_all_single", input.dtype, send=send, recv=recv),
                                    "all_to_all", (), [input], [output])
            _flush()
            rows = self._agree("all_to_all_single", input.dtype, send=send, recv=recv, error=error)
            if self._use_xla([input, output]):
                _land(output, self._mesh.all_to_all(storage.flat_value(input), send, recv,
                                                    self._widest(rows, send, recv)))
                return _Work([], None, [output])
            h = _host_in(input, writable=False)
            o = _host_out(output)
            hb = _bytes_rows(h)
            ob = _bytes_rows(o)
            work = self._gloo.alltoall_base(ob, hb, list(out_splits), list(in_splits),
                                            self._gloo_timeout(opts, _C.AllToAllOptions()))
            return _Work([work], lambda: _write_back([(output, o)]), [output])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or _C.AllToAllOptions()
        with self._lock:
            _flush()
            w = self._size
            error = None
            dtype = inputs[0].dtype if inputs else None
            if len(inputs) != w or len(outputs) != w:
                error = ValueError(f"torchtpu distributed: all_to_all: needs {w} input and {w} output tensors, "
                                   f"got {len(inputs)} and {len(outputs)}")
            elif any(t.dtype != dtype for t in list(inputs) + list(outputs)):
                error = TypeError("torchtpu distributed: all_to_all: every tensor must share one dtype")
            send = [t.numel() for t in inputs] if error is None else [0] * w
            recv = [t.numel() for t in outputs] if error is None else [0] * w
            rows = self._agree("all_to_all", dtype, send=send, recv=recv, count=w, error=error)
            if self._use_xla([*inputs, *outputs]):
                local = jnp.concatenate([storage.flat_value(t) for t in inputs]) if sum(send) else \
                    self._zeros(0, dtype)
                res = self._mesh.all_to_all(local, send, recv, self._widest(rows, send, recv))
                off = 0
                for t, n in zip(outputs, recv):
                    _land(t, res[off:off + n])
                    off += n
                return _Work([], None, list(outputs))
            # one flat exchange: inputs packed in rank order, outputs unpacked likewise
            hin = torch.cat([_host_in(t, writable=False).reshape(-1) for t in inputs]) if sum(send) else \
                torch.empty(0, dtype=dtype)
            hout = torch.empty(sum(recv), dtype=dtype)
            work = self._gloo.alltoall_base(_bytes_flat(hout).reshape(-1, dtype.itemsize),
                                            _bytes_flat(hin).reshape(-1, dtype.itemsize), recv, send,
                                            self._gloo_timeout(opts, _C.AllToAllOptions()))

            def finish():
                offs = [sum(recv[:i]) for i in range(w)]
                _write_back([(t, hout[o:o + n]) for t, o, n in zip(outputs, offs, recv)])

            return _Work([work], finish, list(outputs))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or _C.GatherOptions()
        root = opts.rootRank
        with self._lock:
            _flush()
            t = inputs[0]
            error = None
            outs = output_lists[0] if output_lists else []
            if self._rank == root and (len(outs) != self._size or
                                       any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs)):
                error = ValueError(f"torchtpu distributed: gather: the root needs gather_list of {self._size} "
                                   f"tensors of {t.numel()} {t.dtype} elements")
            self._agree("gather", t.dtype, t.numel(), root=root, error=error)
            if self._use_xla([t, *outs]):
                res = self._mesh.run("all_gather", storage.flat_value(t))
                if self._rank == root:
                    k = t.numel()
                    for r, o in enumerate(outs):
                        _land(o, res[r * k:(r + 1) * k])
                return _Work([], None, [outs] if self._rank == root else [])
            h = _host_in(t, writable=False)
            gopts = self._gloo_timeout(opts, _C.GatherOptions())
            gopts.rootRank = root
            if self._rank == root:
                houts = [torch.empty(h.numel(), dtype=h.dtype) for _ in outs]
                work = self._gloo.gather([[_bytes_flat(x) for x in houts]], [_bytes_flat(h)], gopts)

                def finish():
                    _write_back(list(zip(outs, houts)))

                return _Work([work], finish, [outs])
            work = self._gloo.gather([], [_bytes_flat(h)], gopts)
            return _Work([work], None, [])

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or _C.ScatterOptions()
        root = opts.rootRank
        with self._lock:
            _flush()
            t = outputs[0]
            error = None
            ins = input_lists[0] if input_lists else []
            if self._rank == root and (len(ins) != self._size or
                                       any(i.numel() != t.numel() or i.dtype != t.dtype for i in ins)):
                error = ValueError(f"torchtpu distributed: scatter: the root needs scatter_list of {self._size} "
                                   f"tensors of {t.numel()} {t.dtype} elements")
            self._agree("scatter", t.dtype, t.numel(), root=root, error=error)
            if self._use_xla([t, *ins]):
                local = jnp.concatenate([storage.flat_value(i) for i in ins]) if self._rank == root else \
                    self._zeros(self._size * t.numel(), t.dtype)
                _land(t, self._mesh.run("scatter", local, root))
                return _Work([], None, [t])
            o = _host_out(t)
            gopts = self._gloo_timeout(opts, _C.ScatterOptions())
            gopts.rootRank = root
            if self._rank == root:
                hins = [_host_in(i, writable=False) for i in ins]
                work = self._gloo.scatter([_bytes_flat(o)], [[_bytes_flat(x) for x in hins]], gopts)
            else:
                work = self._gloo.scatter([_bytes_flat(o)], [], gopts)
            return _Work([work], lambda: _write_back([(t, o)]), [t])

    def barrier(self, opts=None):
        opts = opts or _C.BarrierOptions()
        with self._lock:
            _flush()
            self._agree("barrier")
            gopts = _C.BarrierOptions()
            gopts.timeout = opts.timeout
            work = self._gloo.barrier(gopts)
            return _Work([work], None, [])

    # -------------------------------------------------------------- point to point
    # A header (dtype, element count, route) goes before every payload over gloo, so that a receive
    # into a buffer of another size or dtype fails with a clear error, and the receiver takes the
    # payload the way the sender sent it (an XLA ppermute for a tpu tensor, gloo for a CPU one)
    # whatever its own tensor's device.
    def send(self, tensors, dst, tag=0):
        with self._lock:
            _flush()
            t = tensors[0]
            on_xla = self._use_xla([t])
            hdr = torch.tensor([_MAGIC, _dtype_code(t.dtype), t.numel(), int(on_xla)], dtype=torch.int64)
            w1 = self._gloo.send([hdr], dst, tag)
            if on_xla:
                self._send_payload(self._rank, dst, storage.flat_value(t))
                return _Work([w1], None, [t])
            h = _host_in(t, writable=False)
            w2 = self._gloo.send([_bytes_flat(h)], dst, tag)
            return _Work([w1, w2], None, [t])

    def recv(self, tensors, src, tag=0):
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._recv(tensors, None, tag)

    def _recv(self, tensors, src, tag):
        with self._lock:
            _flush()
            t = tensors[0]
            hdr = torch.zeros(4, dtype=torch.int64)
            if src is None:
                hw = self._gloo.recv_anysource([hdr], tag)
                hw.wait()
                src = hw.source_rank()
            else:
                self._gloo.recv([hdr], src, tag).wait()
            magic, code, numel, on_xla = hdr.tolist()
            if magic != _MAGIC or code != _dtype_code(t.dtype) or numel != t.numel():
                # take the payload off the wire so the sender completes, then fail here
                if magic == _MAGIC and 0 < code <= len(_DTYPES):
                    if on_xla:
                        self._send_payload(src, self._rank, self._zeros(numel, _DTYPES[code - 1]))
                    else:
                        scratch = torch.empty(numel * _DTYPES[code - 1].itemsize, dtype=torch.uint8)
                        self._gloo.recv([scratch], src, tag).wait()
                raise RuntimeError(
                    f"torchtpu distributed: recv from rank {src} (tag {tag}) got {numel} elements of "
                    f"{_dtype_name(code)}, but the receive tensor holds {t.numel()} elements of {t.dtype}")
            source = src
            if on_xla:
                got = self._send_payload(src, self._rank, self._zeros(t.numel(), t.dtype))
                if _is_tpu(t):
                    _land(t, got)
                else:  # a CPU receive tensor of a tpu send
                    with torch.no_grad():
                        t.copy_(dtypes.numpy_to_torch(np.asarray(storage.to_host(got)), t.dtype).reshape(t.shape))
                return _Work([], None, [t], source_rank=lambda: source)
            o = _host_out(t)
            work = self._gloo.recv([_bytes_flat(o)], src, tag)
            return _Work([work], lambda: _write_back([(t, o)]), [t], source_rank=lambda: source)


class _GraphGroup:
    """What the DeferAndFuse recorder needs of a group whose collectives it records (see
    ``Recorder.record``): the group's SPMD wrapping (``xla.GroupMesh``) and the per-graph exchange."""

    __slots__ = ("spmd", "to_global", "to_local", "agree")

    def __init__(self, pg: ProcessGroupTPU):
        self.spmd = pg._mesh.spmd
        self.to_global = pg._mesh.to_global
        self.to_local = pg._mesh.to_local
        self.agree = pg._agree_graph


def _collective_fn(body, n_in: int, out_sizes: tuple):
    """A recorded collective's node function: its flat inputs concatenated, ``body`` over the group,
    the result split into ``out_sizes`` pieces."""
    offs = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def collective(*blocks):
        y = body(blocks[0] if n_in == 1 else jnp.concatenate(blocks))
        if len(out_sizes) == 1:
            return [y]
        return [y[o:o + n] for o, n in zip(offs, out_sizes)]

    return collective


def _pending_flat(t: torch.Tensor):
    """``t``'s elements as one flat (possibly pending) buffer for a recorded collective: its storage's
    own buffer when ``t`` covers it, else the buffer of a recorded contiguous copy."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    sd = storage.storage_data(t)
    if sd.dtype is not t.dtype:
        sd.retype(t.dtype)
    buf = sd.raw_buf if sd.raw_buf is not None else sd.buf
    n = buf.numel if type(buf) is LazyBuf else buf.size
    if t.storage_offset() == 0 and n == t.numel() and t.is_contiguous():
        return buf
    with torch.no_grad():
        return _pending_flat(t.clone(memory_format=torch.contiguous_format))


def _land_pending(t: torch.Tensor, buf) -> None:
    """Put pending flat buffer ``buf`` (a recorded collective's result) into tpu tensor ``t``, in place."""
    sd = storage.storage_data(t)
    if (t.storage_offset() == 0 and t.is_contiguous() and not (t.is_conj() or t.is_neg()) and sd.dtype is t.dtype
            and sd.nbytes == t.numel() * t.element_size()):
        sd.buf = buf
        return
    with torch.no_grad():
        t.copy_(storage.new_tensor(tuple(t.shape), t.dtype, buf))


def _row_numel(t: torch.Tensor) -> int:
    if t.dim() == 0:
        return 1
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def _check_splits(splits, t, w, name):
    if not splits:
        if t.dim() == 0 or t.shape[0] % w:
            raise ValueError(f"torchtpu distributed: all_to_all_single: dim 0 of size "
                             f"{t.shape[0] if t.dim() else 0} is not divisible by the group size {w}; "
                             f"pass {name}")
        return [t.shape[0] // w] * w
    if len(splits) != w:
        raise ValueError(f"torchtpu distributed: all_to_all_single: {name} has {len(splits)} entries, "
                         f"the group has {w} ranks")
    if any(s < 0 for s in splits) or sum(splits) != (t.shape[0] if t.dim() else 1):
        raise ValueError(f"torchtpu distributed: all_to_all_single: {name} {list(splits)} must be non-negative "
                         f"and sum to dim 0 ({t.shape[0] if t.dim() else 1})")
    return [int(s) for s in splits]


def _bytes_flat(h: torch.Tensor) -> torch.Tensor:
    """Contiguous ``h`` as flat uint8 (gloo moves bytes; any dtype works, bool and complex included)."""
    h = h.reshape(-1)
    if h.dtype == torch.uint8:
        return h
    return h.view(torch.uint8)


def _bytes_rows(h: torch.Tensor) -> torch.Tensor:
    """Contiguous ``h`` as uint8 rows of dim 0 (all_to_all splits count rows)."""
    if h.dim() == 0:
        h = h.reshape(1)
    rows = h.reshape(h.shape[0], math.prod(h.shape[1:]))  # -1 fails on 0 rows
    if rows.dtype == torch.uint8:
        return rows
    return rows.view(torch.uint8)


# ---------------------------------------------------------------- registration
def _install_sharded_tensor_device() -> None:
    """``ShardedTensor.device`` on a rank that holds none of its shards: torch answers cpu for a gloo group
    and ``torch.cuda.current_device()`` for any other backend (an error without CUDA); on a tpu group the
    answer is the tpu. torch.distributed.checkpoint asks it of every ShardedTensor it loads (e.g. a
    table-wise sharded table on the ranks that do not hold it). Other groups keep torch's answers."""
    from torch.distributed._shard.sharded_tensor import custom_sharded_op_impl

    @custom_sharded_op_impl(torch.Tensor.device.__get__)
    def sharded_tensor_device(types, args=(), kwargs=None, pg=None):
        st = args[0]
        if st.local_shards():
            return st.local_shards()[0].tensor.device
        backend = pg._get_backend_name() if pg is not None else None
        if backend == BACKEND_NAME or isinstance(pg, ProcessGroupTPU):
            return torch.device("tpu", 0)
        if backend == "gloo":
            return torch.device("cpu")
        return torch.device(torch.cuda.current_device())


def _create(opts, backend_options=None):
    return ProcessGroupTPU(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                           list(opts.global_ranks_in_group))


_registered = False


ALIAS = "tpu_dist"  # Google TorchTPU's name for its c10d backend (Ray Train's ScalingConfig(use_tpu=True) asks for it)


def register() -> None:
    """Register the ``tpu`` backend (and its alias ``tpu_dist``) with torch.distributed (idempotent).

    Registered for devices ``tpu`` and ``cpu``: a group made with ``"tpu"``
    serves both (CPU tensors go straight to gloo).
    """
    global _registered
    if _registered or not dist.is_available():
        return
    for name in (BACKEND_NAME, ALIAS):
        if name not in dist.Backend.backend_list:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=["tpu", "cpu"])
    _install_sharded_tensor_device()
    _registered = True


__all__ = ["BACKEND_NAME", "ProcessGroupTPU", "agreed_arguments", "host_staged", "register"]
