"""DeferAndFuse: ops are recorded as pending nodes and fused into one XLA
computation when a value is needed.

Each kernel call (dispatch/kernel.py) under this mode appends a ``Node`` (the
op's already-built executable plus its inputs) and hands back tensors whose
buffers are ``LazyBuf``s with known shape and dtype. A flush traces every
pending node into one function whose outputs are only the buffers that live
tensors still hold — dead intermediates are never materialized — and runs it
through a jit cached by graph structure, so a steady loop compiles once.

All of that state lives on one :class:`Recorder` (``RECORDER``). Its surface:
``record`` (the kernel path), ``adopt`` (a storage was handed a pending
buffer), ``flush(reason)``, ``materialize(buf, reason)``, ``wait_all``,
``explain``; ``pending`` and ``in_flight`` are read-only views; the counters
are in ``torchtpu.metrics``.

Flush triggers, each calling ``flush(reason)`` from its own place:
``host_read`` (runtime/storage.py: .item(), .cpu(), .tolist(), printing,
bool(t)), ``sync`` (torchtpu.sync, runtime/modes.synchronize), ``mode_switch``
(runtime/modes), ``loop`` and ``size_cap`` (here, in ``record``), ``backward``
(the end of a backward pass that recorded ops), ``materialize`` (a concrete
buffer was needed by code outside the op path: storage.StorageData.buf),
``collective`` (the distributed backend, before a collective it does not record),
``group_change`` (here: a recorded collective of another group than the pending graph's),
``bucket_scope`` (bucketing),
``compiled graph`` (a compiled graph reads pending buffers).

Collectives: the distributed backend records a collective with ``record(...,
collective=(group, descriptor))``. The pending graph then runs over the group's devices:
``group`` provides ``spmd(fn, avals)`` (the graph function wrapped in ``shard_map``),
``to_global``/``to_local`` (this rank's arrays as shards of global arrays and back) and
``agree(descriptors, signature)`` (the one exchange per graph, see ``flush``). This layer
imports nothing of the distributed package.

Flushes are asynchronous: ``flush`` dispatches the fused executable and
returns (JAX dispatch does not wait), so the next step's recording overlaps
this step's XLA run, as with CUDA kernel launches. At most ``max_in_flight``
flushes run ahead of Python; a host read or ``synchronize`` waits. An error
XLA raises while running a fused graph (at dispatch, or later when its results
are waited for) names the user lines that recorded the graph's ops.
"""

from __future__ import annotations

import collections
import os
import random as _random
import sys
import threading
import warnings
import weakref
import zlib

import jax
import numpy as np
from jax._src.array import ArrayImpl  # the concrete array type: a type check needs no backend

from ..base import metrics, tracing
from ..base.frames import user_site
from ..base.memory import MEMORY, is_resource_exhausted, out_of_memory_from

_weakref = weakref.ref


class LazyBuf:
    """A pending flat buffer: output ``index`` of ``node`` (``value`` once computed)."""

    __slots__ = ("node", "index", "numel", "value", "__weakref__")

    def __init__(self, node, index, numel):
        self.node = node
        self.index = index
        self.numel = numel
        self.value = None


def is_lazy(b) -> bool:
    return type(b) is LazyBuf


class Node:
    """A recorded op: ``spec`` is (fn, inputs as pending (node, output) pairs or external slots)."""

    __slots__ = ("spec", "pos", "name", "site", "token")

    def __init__(self, spec, pos, name, site, token):
        self.spec = spec
        self.pos = pos
        self.name = name
        self.site = site
        self.token = token


# ``Node.pos`` of a node no longer pending: its graph failed (LOST), or ran without this buffer among
# its outputs (RAN: no storage held it when the graph ran)
LOST = -1
RAN = -2

_NAME_CRC: dict = {}  # op name -> its crc32 (graph signatures compared across processes)

_LOST = ("torchtpu DeferAndFuse: this tensor's value was never computed: the fused graph that was to "
         "compute it failed (that error named the lines that recorded it). Compute it again from its inputs.")

# repeating-sequence detection over op tokens: prefix hashes mod a Mersenne prime
_P = (1 << 61) - 1
_B = 1_000_003
_tokens: dict = {}


def token_of(entry) -> int:
    """A random 60-bit token naming one executable in the loop detector's hashes."""
    t = _tokens.get(id(entry))
    if t is None:
        t = _random.getrandbits(60) + 1
        _tokens[id(entry)] = t
    return t


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default) not in ("0", "false", "False", "")


class Recorder:
    """The DeferAndFuse state of this process: the pending graph, its loop detector, the fused
    graphs in flight and the cache of compiled fused graphs.

    Settings (attributes, read when used): ``max_pending`` (``TORCHTPU_MAX_PENDING_OPS``, a
    size cap), ``min_loop_period`` (``TORCHTPU_MIN_LOOP_PERIOD``, the shortest op sequence taken
    as a loop body), ``max_in_flight`` (``TORCHTPU_MAX_IN_FLIGHT``, dispatched graphs not yet
    waited for), ``flush_after_backward`` (``TORCHTPU_FLUSH_AFTER_BACKWARD``)."""

    __slots__ = ("lock", "pending", "_ext", "_ext_slot", "_owners", "_watched", "_graph_cache", "_inflight",
                 "_prefix", "_pow", "_last_pos", "_period", "_bw_task", "max_pending", "min_loop_period", "max_in_flight",
                 "flush_after_backward", "_group", "_descs", "_cpos")

    def __init__(self):
        self.lock = threading.RLock()
        self.pending: list[Node] = []
        self._ext: list = []  # concrete inputs of the pending graph, in slot order
        # id(buffer) -> its slot: a tensor buffer read by several ops is ONE input (fewer arguments,
        # and an old parameter read by the forward and the optimizer can still be donated)
        self._ext_slot: dict = {}
        self._owners: list = []  # weakrefs to storages that were handed a LazyBuf
        self._watched: list = []  # pending buffers no storage holds that the next flush must compute
        self._graph_cache: dict = {}
        # fused graphs dispatched but not yet waited for: (weakrefs to their results, their nodes). The
        # bound keeps Python from queueing unbounded work (and memory) ahead of XLA; 2 lets step N+1
        # record while step N runs.
        self._inflight: collections.deque = collections.deque()
        self._prefix = [0]
        self._pow = [1]
        self._last_pos: dict = {}
        self._period = None  # (length, hash) of the detected loop body
        self._bw_task = -2  # the graph task whose end already has a flush queued
        # collectives of the pending graph: their group (one per graph), descriptors and node positions
        self._group = None
        self._descs: list = []
        self._cpos: list = []
        self.max_pending = int(os.environ.get("TORCHTPU_MAX_PENDING_OPS", "4096"))
        self.min_loop_period = int(os.environ.get("TORCHTPU_MIN_LOOP_PERIOD", "32"))
        self.max_in_flight = max(1, int(os.environ.get("TORCHTPU_MAX_IN_FLIGHT", "2")))
        # Flush when a backward pass that recorded ops ends: XLA runs forward+backward while Python
        # records the optimizer. Off by default: on the transformer step it did not lower CPU time and
        # raised the peak slightly (benchmarks/README.md, bench_defer.py).
        self.flush_after_backward = _env_flag("TORCHTPU_FLUSH_AFTER_BACKWARD", "0")

    # ------------------------------------------------------------ read-only views
    @property
    def in_flight(self) -> int:
        """Fused graphs dispatched and not yet waited for."""
        return len(self._inflight)

    def graph_cache_entries(self) -> list:
        """``(key, compiled executable)`` of every cached fused graph (for tools and benchmarks)."""
        return [(k, v[0]) for k, v in self._graph_cache.items()]

    # ------------------------------------------------------------ recording
    def record(self, fn, bufs, dyn, out_numels, name, token, collective=None):
        """Append a node; returns its pending output buffers.

        ``bufs`` are tensor buffers (one input slot per distinct array, so an array read
        twice is one argument); ``dyn`` are scalars, always their own slot: equal python
        scalars share a cached array, and which ones happen to be equal must not
        change the graph's structure from step to step.

        ``collective`` is ``(group, descriptor)`` for a collective (the distributed backend):
        ``fn`` then runs on this rank's blocks inside the group's SPMD program, and the whole
        graph becomes one program over the group's devices (see ``CollectiveGroup``)."""
        site = user_site(1)
        if self.flush_after_backward:
            self._note_backward()
        if collective is not None and self._group is not None and self._group is not collective[0]:
            self.flush("group_change")  # one graph runs over one group's devices
        with self.lock:
            if collective is not None:
                self._group = collective[0]
                self._descs.append(collective[1])
                self._cpos.append(len(self.pending))
            ins = []
            add = ins.append
            ext = self._ext
            slots = self._ext_slot
            for x in bufs:
                if type(x) is LazyBuf:
                    if x.value is None:
                        pos = x.node.pos
                        if pos < 0:
                            raise RuntimeError(_LOST)
                        add((pos, x.index))
                        continue
                    x = x.value
                slot = slots.get(id(x))
                if slot is None:
                    slot = slots[id(x)] = len(ext)  # _ext keeps x alive, so its id stays its own
                    ext.append(x)
                add(slot)
            for x in dyn:
                add(len(ext))
                ext.append(x)
            pending = self.pending
            n = len(pending)
            node = Node((fn, tuple(ins)), n, name, site, token)
            pending.append(node)
            n += 1
            prefix = self._prefix
            prefix.append((prefix[-1] * _B + token) % _P)
            if len(self._pow) <= n:
                self._pow.append(self._pow[-1] * _B % _P)
            outs = [LazyBuf(node, i, m) for i, m in enumerate(out_numels)]
            reason = self._flush_reason(n, token)
        if reason is not None:
            self.flush(reason, keep=outs)
        return outs

    def adopt(self, sd) -> None:
        """Storage ``sd`` now holds a pending buffer: a flush computes it if ``sd`` is still alive."""
        with self.lock:  # (a flush swaps the list: an append racing it would be lost)
            self._owners.append(_weakref(sd))

    def watch(self, buf: LazyBuf) -> None:
        """Pending buffer ``buf`` (a device-side check's result, runtime/checks.py) is an output of
        the next flush though no storage holds it."""
        with self.lock:
            self._watched.append(buf)

    def _note_backward(self):
        """Inside a backward pass (the autograd engine's thread), queue one flush for its end."""
        import torch  # only the optional backward trigger needs torch here

        gt = torch._C._current_graph_task_id()
        if gt != -1 and gt != self._bw_task:
            self._bw_task = gt
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.flush("backward"))

    def _hash(self, i, j):
        """Hash of tokens [i, j) from the prefix table."""
        return (self._prefix[j] - self._prefix[i] * self._pow[j - i]) % _P

    def _flush_reason(self, n, token):
        period = self._period
        if period is not None and n == period[0]:
            if self._hash(0, n) == period[1]:
                return "loop"
            self._period = None  # the loop changed shape
        prev = self._last_pos.get(token)
        self._last_pos[token] = n
        if prev is not None:
            p = n - prev
            if p < self.min_loop_period:  # a short cycle: take the multiple of it that is long enough
                p *= -(-self.min_loop_period // p)
            if n >= 2 * p and self._hash(n - p, n) == self._hash(n - 2 * p, n - p):
                self._period = (p, self._hash(n - p, n))
                return "loop"
        if n >= self.max_pending:
            return "size_cap"
        return None

    # ------------------------------------------------------------ flushing
    def materialize(self, buf: LazyBuf, reason: str):
        """The concrete value of pending buffer ``buf`` (flushing the pending graph if needed)."""
        if buf.value is None:
            with self.lock:  # (another thread's flush may compute it meanwhile)
                if buf.value is None:
                    if buf.node.pos < 0:
                        raise RuntimeError(_LOST)
                    self.flush(reason, keep=[buf])
                    if buf.value is None:
                        raise RuntimeError(_LOST)
        return buf.value

    def flush(self, reason: str, keep=()) -> None:
        """Run every pending node as one fused computation.

        Outputs are the pending buffers still held by a live storage, plus ``keep``.

        A graph holding collectives first agrees with the other ranks of its group
        (``group.agree``, one small exchange per graph): if another rank's graph holds only
        the first ``k`` of this rank's collectives (it flushed earlier, say for a host read
        only it makes), the nodes before this rank's collective ``k`` run now and the rest in
        a next round, until nothing is pending. On a mismatch, what was recorded before the
        first differing collective still runs; that collective and what was recorded after it
        are dropped (reading their results raises), and the error is raised on every rank.
        """
        with self.lock:
            while self.pending:
                upto, k, error = len(self.pending), len(self._descs), None
                if self._group is not None:
                    k, error, same = self._group.agree(self._descs, self._signature())
                    if not same and k > 1:
                        # the ranks' programs differ in other ops: XLA may order their collectives
                        # differently, so this round's program holds one collective (a mismatch
                        # further on is found again by a later round)
                        k, error = 1, None
                    if k < len(self._descs):
                        upto = self._cpos[k]
                        node = self.pending[upto]
                        if error is not None and node.site is not None:
                            error.add_note(f"torchtpu DeferAndFuse: this rank recorded that collective ({node.name}) "
                                           f"at {node.site[0]}:{node.site[1]}")
                if upto:
                    self._run(reason, keep, upto, k)
                if error is not None:
                    self._drop_pending()
                    raise error

    def _signature(self) -> int:
        """A hash of the pending graph's program: op names, how their inputs connect, the inputs'
        shapes and dtypes and which are donated. Equal on ranks whose XLA programs are the same
        (python hashes of ints and tuples are not salted; names and dtypes enter as numbers)."""
        names = _NAME_CRC
        sig = []
        for n in self.pending:
            c = names.get(n.name)
            if c is None:
                c = names[n.name] = zlib.crc32(n.name.encode())
            sig.append((c, n.spec[1]))
        ext = self._ext
        avals = tuple((getattr(a, "shape", None), np.dtype(a.dtype).num if hasattr(a, "dtype") else type(a) is float,
                       getattr(a, "weak_type", None)) for a in ext)
        return hash((tuple(sig), avals, _donatable(ext))) & ((1 << 62) - 1)

    def _drop_pending(self) -> None:
        """Forget the pending graph: its results will never exist (a later use raises)."""
        for n in self.pending:
            n.pos = -1
        self.pending, self._ext, self._owners, self._watched = [], [], [], []
        self._ext_slot.clear()
        self._prefix[:] = [0]
        self._last_pos.clear()
        self._group, self._descs, self._cpos = None, [], []

    def _run(self, reason, keep, upto, k) -> None:
        """Run pending nodes ``[0, upto)`` (holding the first ``k`` collectives) as one fused
        computation; the nodes after stay pending."""
        nodes, owners, ext, watched = self.pending, self._owners, self._ext, self._watched
        group, descs, cpos = self._group, self._descs, self._cpos
        rest = nodes[upto:]
        nodes = nodes[:upto]
        self.pending, self._owners, self._ext, self._watched = [], [], [], []
        self._ext_slot.clear()
        self._prefix[:] = [0]
        self._last_pos.clear()
        self._group, self._descs, self._cpos = None, [], []
        metrics.record_flush(reason)
        live_sds = []
        seen_sd = set()
        for r in owners:
            sd = r()
            if sd is not None and id(sd) not in seen_sd and type(sd.raw_buf) is LazyBuf:
                seen_sd.add(id(sd))
                live_sds.append(sd)
        live = []
        seen = set()
        for b in [sd.raw_buf for sd in live_sds] + list(keep) + watched:
            # (a buffer of a failed earlier graph, pos -1, is not this graph's: it raises on use)
            if b.value is None and id(b) not in seen and 0 <= b.node.pos < upto:
                seen.add(id(b))
                live.append(b)
        if rest:
            rest_ext, late = self._rebase(nodes, rest, ext, live)
            self._owners = [r for r in owners if r() is not None and type(r().raw_buf) is LazyBuf]
            self._watched = [b for b in watched if b.value is None and b.node is not None and b.node.pos >= 0
                             and b not in live]
            self._descs, self._cpos = descs[k:], [p - upto for p in cpos[k:]]
            self._group = group if self._descs else None
        spec = tuple(n.spec for n in nodes)
        outs = tuple((b.node.pos, b.index) for b in live)
        donate = _donatable(ext)
        # the buffers' own shapes and types too: an executable takes exactly the avals it was built
        # for (a python number and the cached device scalar of one are the same abstract value)
        avals = tuple([(a.shape, a.dtype, a.weak_type) if type(a) is _ARRAY
                       else _PY_AVALS.get(type(a)) or (type(a), getattr(a, "shape", None),
                                                       getattr(a, "dtype", None))
                       for a in ext])
        key = (spec, outs, donate, avals, (group, tuple(cpos[:k])) if k else None)
        try:
            if k:  # one SPMD program over the group's devices: each input this rank's shard of a global array
                ext = [group.to_global(a, v[1]) for a, v in zip(ext, avals)]
            hit = self._graph_cache.get(key)
            if hit is None:
                site = next((n.site for n in nodes if n.site is not None), None)
                where = f"{site[0]}:{site[1]}" if site else "unknown"
                metrics.record_miss(f"fused graph from {where}")
                graph = _make_graph_fn(spec, outs, nodes, cpos[:k])
                if k:
                    graph = group.spmd(graph, tuple((a[0], a[2]) for a in avals))
                with warnings.catch_warnings():
                    # XLA may decline a donation (e.g. no output of that shape): harmless
                    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                    jitted = jax.jit(graph, donate_argnums=donate)
                    compiled = jitted.lower(*ext).compile()
                hit = (compiled, _transient_bytes(compiled))
                self._graph_cache[key] = hit
            fused, transient = hit
            metrics.record_graph_run(id(fused))
            # the device also holds this graph's temporaries and outputs while it runs
            MEMORY.note_transient(transient)
            if tracing.ACTIVE:
                with tracing.annotate("torchtpu fused graph"):
                    results = fused(*ext)
            else:
                results = fused(*ext)  # returns once dispatched: XLA runs it while Python goes on
            if k:
                results = [group.to_local(r) for r in results]
            del ext
        except Exception as e:
            for n in nodes:  # their outputs will never exist: a later use raises instead of reading garbage
                n.pos = -1
            self._drop_pending()
            if is_resource_exhausted(e):
                oom = out_of_memory_from(e)
                _annotate(oom, nodes)
                raise oom from e
            _annotate(e, nodes)
            raise
        for b, v in zip(live, results):
            b.value = v
            b.node = None
        for n in nodes:
            # a pending buffer of these nodes that was not an output has no value now: reading it must
            # raise, never take a position in the next graph (the same numbers name other nodes there)
            n.pos = RAN
        for sd in live_sds:
            b = sd.raw_buf
            if b.value is not None:
                sd.buf = b.value
        if rest:
            for j, b in late:
                rest_ext[j] = b.value
            self._ext = rest_ext
        self._inflight.append(([_weakref(v) for v in results], nodes))
        while len(self._inflight) > self.max_in_flight:
            _wait(self._inflight.popleft())

    def _rebase(self, nodes, rest, ext, live):
        """Make nodes ``rest`` (those after ``nodes``, the part about to run) the pending graph:
        positions shifted, inputs from ``nodes`` turned into external slots, which outputs the
        part gains (appended to ``live``) fill once it has run. Returns the new external slots and
        the ``(slot, output)`` pairs to fill."""
        upto = len(nodes)
        new_ext: list = []
        slot_of: dict = {}  # an old external slot or a (position, index) in ``nodes`` -> its new slot
        late = []
        for n in rest:
            ins = []
            for i in n.spec[1]:
                if type(i) is not int and i[0] >= upto:
                    ins.append((i[0] - upto, i[1]))
                    continue
                j = slot_of.get(i)
                if j is None:
                    j = slot_of[i] = len(new_ext)
                    if type(i) is int:
                        new_ext.append(ext[i])  # (also keeps the part from donating it)
                        self._ext_slot[id(ext[i])] = j
                    else:
                        new_ext.append(None)
                        out = LazyBuf(nodes[i[0]], i[1], -1)
                        late.append((j, out))
                        live.append(out)
                ins.append(j)
            n.spec = (n.spec[0], tuple(ins))
        for n in rest:
            n.pos -= upto
            self.pending.append(n)
            self._prefix.append((self._prefix[-1] * _B + n.token) % _P)
        while len(self._pow) <= len(self.pending):
            self._pow.append(self._pow[-1] * _B % _P)
        return new_ext, late

    def wait_all(self) -> None:
        """Wait for every dispatched fused graph (``synchronize`` calls this; a host read waits
        only on its own buffer).

        On an error the remaining flights are dropped: their buffers carry the error too."""
        with self.lock:
            try:
                while self._inflight:
                    _wait(self._inflight.popleft())
            finally:
                self._inflight.clear()

    def explain(self, e: BaseException) -> None:
        """Add the recording lines to an error a blocking read hit, if a fused graph still in
        flight is what failed (a read waits on its own buffer, which may be that graph's output)."""
        with self.lock:
            flights = list(self._inflight)
        for refs, nodes in flights:
            a = _live_output(refs)
            if a is None:
                continue
            try:
                a.block_until_ready()
            except Exception:
                _annotate(e, nodes)
                return

    def clear_cache(self) -> None:
        self._graph_cache.clear()


def _wait(flight) -> None:
    """Block until one dispatched fused graph has run; its runtime error, if any, is raised
    here with the lines that recorded its ops. All outputs of one execution become ready
    together, so one live (not donated onward) output is enough to wait on."""
    refs, nodes = flight
    a = _live_output(refs)
    if a is not None:
        try:
            a.block_until_ready()
        except Exception as e:
            _annotate(e, nodes)
            raise


def _live_output(refs):
    """One output of a dispatched graph that is still alive and not donated onward, or None."""
    for r in refs:
        a = r()
        if a is not None and not a.is_deleted():
            return a
    return None


def _transient_bytes(compiled) -> int:
    """Bytes a run of ``compiled`` needs beyond its (already counted) inputs: XLA's own
    buffer assignment of temporaries and outputs, less outputs written into donated inputs."""
    try:
        m = compiled.memory_analysis()
        return max(0, int(m.temp_size_in_bytes) + int(m.output_size_in_bytes) - int(m.alias_size_in_bytes))
    except Exception:  # a backend without memory analysis: only materialized buffers are counted
        return 0


def _donatable(ext):
    """Slots whose buffer nothing else holds: an old parameter or optimizer state
    replaced by this flush. Donating them lets XLA write the new values in place,
    so a training step does not hold two copies."""
    counts: dict = {}
    for a in ext:
        counts[id(a)] = counts.get(id(a), 0) + 1
    out = []
    for i in range(len(ext)):
        a = ext[i]
        # references: the ext list, this loop's variable, getrefcount's argument
        if counts[id(a)] == 1 and type(a) is _ARRAY and sys.getrefcount(a) <= 3 and a.size > 0:
            out.append(i)
    return tuple(out)


# Neither needs a device: JAX's backend must stay uninitialized at import, so that
# init_process_group("tpu") can still bring up JAX's multi-process runtime (distributed/runtime.py).
_ARRAY = ArrayImpl
# the abstract value jit gives a python number of each type (the kernel path passes numbers met
# once as themselves)
_PY_AVALS = {t: (z.shape, z.dtype, z.weak_type) for t, z in
             ((t, jax.eval_shape(lambda t=t: jax.numpy.asarray(t(0)))) for t in (bool, int, float, complex))}


def _make_graph_fn(spec, outs, nodes, collectives=()):
    """The traced function of a graph. ``collectives`` (node positions) run in recording order:
    each one's inputs wait for the previous one's results, so that XLA cannot order (or overlap)
    a graph's collectives differently on different ranks, whose programs may differ in other ops."""
    names = [(n.name, n.site) for n in nodes]
    ordered = frozenset(collectives)

    def graph(*ext):
        env = []
        prev = None
        for pos, ((fn, ins), (name, site)) in enumerate(zip(spec, names)):
            args = [ext[i] if type(i) is int else env[i[0]][i[1]] for i in ins]
            if pos in ordered:
                if prev is not None:
                    args, _ = jax.lax.optimization_barrier((args, prev))
                prev = None
            try:
                with tracing.named_scope(name):
                    env.append(fn(*args))
            except Exception as e:
                _add_site_note(e, name, site)
                raise
            if pos in ordered:
                prev = env[-1]
        return [env[i][j] for i, j in outs]

    return graph


def _add_site_note(e, name, site):
    if getattr(e, "_torchtpu_site", False):
        return
    e._torchtpu_site = True
    where = f"{site[0]}:{site[1]} in {site[2]}" if site else "an unknown line"
    e.add_note(f"torchtpu DeferAndFuse: the failing op {name} was recorded at {where}")


def _annotate(e, nodes):
    """Note on an error XLA raised while running (not tracing) a fused graph: which op failed
    inside one executable is not known, so name the user lines that recorded its ops."""
    if getattr(e, "_torchtpu_site", False) or not nodes:
        return
    e._torchtpu_site = True
    lines: dict = {}
    for n in nodes:
        if n.site is not None:
            lines.setdefault((n.site[0], n.site[1]), []).append(n.name)
    shown = [f"{f}:{ln} ({', '.join(dict.fromkeys(names))})" for (f, ln), names in list(lines.items())[-8:]]
    more = f" (last {len(shown)} of {len(lines)} lines)" if len(lines) > len(shown) else ""
    e.add_note(f"torchtpu DeferAndFuse: failed while running {len(nodes)} fused ops recorded at{more}: "
               + "; ".join(shown))


RECORDER = Recorder()
