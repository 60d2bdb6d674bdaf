"""The kernel executor: one ``Kernel`` per installed aten op overload.

Each call becomes one cached XLA executable keyed by (op, input layouts and
dtypes, static arguments, python scalar types). Output shapes and dtypes are
taken from PyTorch's own meta kernels on the first call of a key, so type
promotion and shape errors are exactly PyTorch's, and the lowering's result is
checked (shape) and cast (dtype) against them. Under DeferAndFuse the
executable is recorded (runtime/recorder.py) instead of run.
"""

from __future__ import annotations

import math
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import torch
from torch.utils import _pytree as pytree

from ..base import dtypes, metrics, tracing
from ..base.memory import check_allocation, is_resource_exhausted, out_of_memory_from
from ..base.opnames import short_name
from ..base.rng import next_key_data as _next_key_data
from ..base.frames import WARN_COUNT, user_site
from ..runtime import checks
from ..runtime import layout as _layout
from ..runtime.modes import deferring
from ..runtime.recorder import RAN, RECORDER, LazyBuf, token_of
from ..runtime.storage import new_output, new_tensor, storage_data, to_device
from . import storm
from .lowering import Lowering

aten = torch.ops.aten

# ---------------------------------------------------------------- argument kinds
_T, _OT, _TL, _OTL, _SCALAR, _STATIC, _SCALARS, _GEN = range(8)


def _arg_kind(arg):
    t = arg.type
    s = str(t)
    if s == "Tensor":
        return _T
    if s == "Optional[Tensor]":
        return _OT
    if s == "List[Tensor]":
        return _TL
    if s == "List[Optional[Tensor]]":
        return _OTL
    if s in ("number", "Optional[number]"):
        return _SCALAR
    if s == "List[number]":
        return _SCALARS  # e.g. the optimizers' per-parameter bias corrections: traced, not baked in
    if s == "Optional[Generator]":
        return _GEN  # not in the cache key (one executable for every generator): it picks the op's key data
    return _STATIC


def _freeze(v):
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if type(v) in (bool, int, float):
        return (type(v), v)  # 3, 3.0 and True hash alike but give different dtypes
    return v


MIXED_DEVICE = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"


def _is_meta_leaf(x):
    # (shape, dtype), or (shape, dtype, strides) when PyTorch's meta lays the output out otherwise
    # than contiguously (channels_last, a permuted input's layout kept by an elementwise op)
    return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[1], torch.dtype)


def _meta_leaf(t):
    shape = tuple(t.shape)
    stride = t.stride()
    if _layout.is_contiguous(shape, stride) or not t.numel() or not _layout.is_dense(shape, stride):
        return (shape, t.dtype)
    return (shape, t.dtype, stride)


class _Entry:
    """One compiled form of a kernel: the jitted function and how to wrap its outputs."""

    __slots__ = ("fn", "out_meta", "single", "flat", "treedef", "out_numels", "token", "checks", "out_layouts")

    def __init__(self, fn, out_meta, out_numels):
        self.fn = fn
        # the device-side index checks ``fn`` makes (runtime/checks.py), known once it is traced: their
        # results are its last output
        self.checks = None
        self.out_meta = out_meta
        self.single = _is_meta_leaf(out_meta)
        # a plain tuple or list of tensors (a foreach op's results): built directly, no pytree
        self.flat = (type(out_meta) if type(out_meta) in (tuple, list) and all(map(_is_meta_leaf, out_meta))
                     else None)
        self.treedef = (None if out_meta is None or self.single or self.flat
                        else pytree.tree_flatten(out_meta, is_leaf=_is_meta_leaf))
        self.out_numels = out_numels  # flat length of each output buffer (for pending buffers)
        self.token = token_of(self)
        # (size, strides, byte size, dtype) of each output of a single or flat result, worked out once
        leaves = (out_meta,) if self.single else (out_meta if self.flat else ())
        self.out_layouts = tuple(_out_layout(m) for m in leaves)


def _out_layout(m):
    size, dt = tuple(m[0]), m[1]
    if len(m) > 2:
        stride = tuple(m[2])
        numel = _layout.storage_numel(size, stride, 0)
    else:
        stride, numel = _layout.contiguous(size)
    return (size, stride, numel * dt.itemsize, dt)


class Kernel:
    """The PrivateUse1 kernel of one aten op overload, backed by a lowering.

    ``functional`` is set for derived in-place kernels (``add_`` runs ``add``'s
    lowering and writes the result into ``self``).
    """

    def __init__(self, op: torch._ops.OpOverload, lowering: Lowering, functional=None):
        self.op = op
        schema = op._schema
        self.name = short_name(op)
        self.lowering = lowering
        self.functional = functional or op
        self.inplace = functional is not None
        self.warn = lowering.warn
        self.args = list(schema.arguments)
        self.nargs = len(self.args)
        self.npos = sum(1 for a in self.args if not a.kwarg_only)
        self.names = [a.name for a in self.args]
        self.defaults = [a.default_value if a.has_default_value() else _NoDefault for a in self.args]
        kinds = [_arg_kind(a) for a in self.args]
        for i, a in enumerate(self.args):
            if kinds[i] in (_SCALAR, _SCALARS) and a.name in lowering.static:
                kinds[i] = _STATIC
        self.kinds = tuple(kinds)
        self.kind_items = tuple(enumerate(self.kinds))
        # arguments written by this op (in-place self, or Tensor(a!)[] lists)
        self.mutated = [i for i, a in enumerate(self.args) if a.alias_info is not None and a.alias_info.is_write]
        self.n_returns = len(schema.returns)
        # the written arguments an in-place op returns (_amp_update_scale_ writes two, returns one)
        ret_sets = [r.alias_info.before_set for r in schema.returns if r.alias_info is not None]
        self.returned = [i for i in self.mutated if self.args[i].alias_info.before_set in ret_sets] or self.mutated
        # written tensor lists (_foreach_copy_'s self): elements over one storage must be written in turn
        self.mutated_lists = [i for i in self.mutated if self.kinds[i] in (_TL, _OTL)] if not self.n_returns else []
        # defaults of the trailing arguments a positional call may leave out: _tails[k] completes a
        # call with k arguments (None where one of them has no default)
        self._tails = [None] * (self.nargs + 1)
        for k in range(self.nargs + 1):
            rest = self.defaults[k:]
            if all(d is not _NoDefault for d in rest):
                self._tails[k] = tuple(rest)
        self.cache: dict = {}
        self.lock = threading.RLock()
        # ops whose CPU kernel refuses any two operand dtypes that differ (integers too)
        self.strict_dtypes = self.functional._schema.name in _SAME_DTYPE_OPS
        self.type_checked: set = set()  # dtype signatures CPU's kernel accepted (_check_type_rules)
        self.any_dtypes = self.functional._schema.name in _ANY_DTYPES

    def _lists_alias(self, vals) -> bool:
        """Do two written list elements share a storage (views of one buffer, as FSDP2's copy-in writes)?
        One executable would compute each from the old buffer, and the last write would win."""
        seen = set()
        for i in self.mutated_lists:
            for t in vals[i]:
                if t is not None:
                    s = id(t.untyped_storage())
                    if s in seen:
                        return True
                    seen.add(s)
        return False

    def _element_by_element(self, vals):
        """The call split into one call per list position, run in order (each sees the previous writes)."""
        n = len(vals[self.mutated_lists[0]])
        for j in range(n):
            self(*[v[j:j + 1] if kind in (_TL, _OTL, _SCALARS) and len(v) == n else v
                   for v, kind in zip(vals, self.kinds)])

    # ---------------------------------------------------------------- binding
    def bind(self, args, kwargs):
        vals = list(args)
        for i in range(len(vals), self.nargs):
            name = self.names[i]
            if name in kwargs:
                vals.append(kwargs[name])
            else:
                d = self.defaults[i]
                if d is _NoDefault:
                    raise TypeError(f"{self.name}: missing argument '{name}'")
                vals.append(d)
        return vals

    # ---------------------------------------------------------------- call
    def __call__(self, *args, **kwargs):
        if tracing.ACTIVE:  # a torchtpu.profiler trace: the dispatch is an event named for the op
            with tracing.annotate(self.name):
                return self._call(args, kwargs)
        if not deferring():  # (the Strict Eager hit path: one frame fewer)
            return self._dispatch(args, kwargs, False)
        return self._call(args, kwargs)

    def _call(self, args, kwargs):
        if deferring():
            # the whole call under the recorder's lock (threading model: docs/architecture.md): the
            # buffers read for the key are the ones recorded, and the outputs are held by their
            # storages before another thread's flush decides which pending buffers are live
            with _RECORDER_LOCK:
                return self._dispatch(args, kwargs, True)
        return self._dispatch(args, kwargs, False)

    def _dispatch(self, args, kwargs, defer):
        if kwargs:
            vals = self.bind(args, kwargs)
        else:
            tail = self._tails[len(args)] if len(args) <= self.nargs else None
            vals = args + tail if tail is not None else self.bind(args, kwargs)
        if self.mutated_lists and self._lists_alias(vals):
            return self._element_by_element(vals)
        key = [self.name]  # the cache is this kernel's own: the name only labels the key (cheap to hash)
        bufs = []
        dyn = []
        append_key = key.append
        tkey = self._tensor_key
        generator = None
        for i, kind in self.kind_items:
            v = vals[i]
            if kind == _T:
                append_key(tkey(v, bufs, dyn))
            elif kind == _STATIC:
                append_key(_freeze(v))
            elif kind == _SCALAR:
                if v is None:
                    append_key(None)
                else:
                    append_key(type(v))
                    dyn.append(_scalar_array(v))
            elif kind == _OT:
                append_key(None if v is None else tkey(v, bufs, dyn))
            elif kind == _SCALARS:
                append_key(tuple(type(x) for x in v))
                dyn.extend(_scalar_array(x) for x in v)
            elif kind == _GEN:
                append_key(None)
                generator = v
            else:  # tensor lists
                append_key(tuple([None if x is None else tkey(x, bufs, dyn) for x in v]))
        if not defer:
            for b in bufs:
                if type(b) is LazyBuf:
                    bufs = self._concrete(bufs, args, kwargs)
                    if bufs is None:
                        return self._dispatch(args, kwargs, False)
                    break
        if self.lowering.random:
            dyn.append(_next_key_data(generator))
        key = tuple(key)
        entry = self.cache.get(key)
        if entry is None and storm.POLICY.executables is not None and len(self.cache) >= storm.POLICY.executables:
            # under DeferAndFuse only with nothing pending: the host copies would flush the graph
            numel = -1 if RECORDER.pending else sum(b.numel if type(b) is LazyBuf else b.size for b in bufs)
            if numel >= 0 and storm.run_shape_generic(self, key, numel):
                return storm.run(self, vals)  # CPU's kernel makes CPU's checks and warnings
        warned = False
        if self.warn is not None:
            n = WARN_COUNT[0]
            self.warn(*vals, inplace=self.inplace)
            warned = WARN_COUNT[0] != n
        if entry is None:
            entry = self._build(key, vals, len(bufs), warned)
            metrics.record_miss(self.name, key)
            built = True
        else:
            _record_hit()
            built = False
        if defer:
            if entry.checks is None:  # built by the eager path, which traced it
                self._trace(entry, vals, key)
            if entry.checks:
                outs = _record(entry.fn, bufs, dyn, entry.out_numels + [2 * len(entry.checks)], self.name,
                               entry.token)
                checks.note(outs.pop(), entry.checks, self.name, user_site(1))
            else:
                outs = _record(entry.fn, bufs, dyn, entry.out_numels, self.name, entry.token)
            if checks.LAUNCH_BLOCKING:
                RECORDER.flush("launch_blocking", keep=outs)
                RECORDER.wait_all()
                checks.raise_pending()
        else:
            try:
                outs = entry.fn(*bufs, *dyn)
            except Exception as e:
                if is_resource_exhausted(e):
                    raise out_of_memory_from(e) from e
                if built:  # traced just now: an input PyTorch's meta let through reached the lowering
                    self.cache.pop(key, None)
                    self._raise_cpu_error(vals, dtype_errors=True)
                raise
            if entry.checks:
                checks.note(outs[-1], entry.checks, self.name, user_site(1))
                outs = outs[:-1]
            if checks.LAUNCH_BLOCKING:
                jax.block_until_ready(outs)
                checks.raise_pending()
        return self._wrap(vals, outs, entry)

    def _concrete(self, bufs, args, kwargs):
        """``bufs`` with pending buffers (work recorded in another context: a DeferAndFuse block,
        another thread) computed, or None when one was replaced in its storage meanwhile by another
        thread (then the call reads its tensors again)."""
        with _RECORDER_LOCK:
            RECORDER.flush("materialize")
            out = []
            for b in bufs:
                if type(b) is LazyBuf:
                    if b.value is None:
                        if b.node.pos == RAN:  # no storage held it when its graph ran: read again
                            return None
                        b = RECORDER.materialize(b, "materialize")  # (raises if its graph failed)
                    else:
                        b = b.value
                out.append(b)
            return out

    def _tensor_key(self, t, bufs, dyn):
        # fast path, a tpu tensor: only tpu storages carry ``_tpu`` (CPU tensors and python
        # numbers raise AttributeError and take the general path below)
        try:
            sd = t.untyped_storage()._tpu
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            pass
        else:
            dt = t.dtype
            if sd.dtype is not dt:
                sd.retype(dt)
            buf = sd.raw_buf
            if buf is None:  # a released storage (resize_(0)) used again
                buf = sd.buf
            bufs.append(buf)
            k = ((t.shape, t.stride(), t.storage_offset()), dt, buf.numel if type(buf) is LazyBuf else buf.size)
            # a lazy conj()/neg view: the executable applies the bits (only complex tensors carry the conj bit)
            if t.is_neg() or (dt.is_complex and t.is_conj()):
                return k + (_layout.math_bits(t),)
            return k
        return self._other_key(t, bufs, dyn)

    def _other_key(self, t, bufs, dyn):
        if not isinstance(t, torch.Tensor):
            # a wrapped python number (``x + 1``) arrives unwrapped
            dyn.append(_scalar_array(t))
            return ("num", type(t))
        if t.device.type != "tpu":
            if t.dim() == 0 and not t.requires_grad:
                # a 0-dim CPU tensor is a scalar operand, as PyTorch allows for cuda
                dyn.append(jnp.asarray(dtypes.cpu_tensor_to_numpy(t)))
                return ("cpu0", t.dtype)
            if self.lowering.allow_cpu:
                arr = to_device(dtypes.cpu_tensor_to_numpy(t.contiguous()))
                bufs.append(arr)
                return ((tuple(t.shape), _layout.contiguous_strides(tuple(t.shape)), 0), t.dtype, arr.size)
            raise RuntimeError(MIXED_DEVICE.format("tpu:0", t.device))
        sd = storage_data(t)
        buf = sd.raw_buf if sd.raw_buf is not None else sd.buf
        bufs.append(buf)
        n = buf.numel if type(buf) is LazyBuf else buf.size
        k = ((t.shape, t.stride(), t.storage_offset()), t.dtype, n)
        bits = _layout.math_bits(t)
        return k if bits is None else k + (bits,)

    # ---------------------------------------------------------------- building an executable
    def _meta_args(self, vals, cpu_scalars=True):
        def to_meta(t):
            if isinstance(t, torch.Tensor):
                if cpu_scalars and t.device.type == "cpu" and t.dim() == 0:
                    return t
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, torch.device) and t.type == "tpu":
                return _META_DEVICE  # factories: shapes from meta, never re-entering this kernel
            return t

        margs = []
        for i, v in enumerate(vals):
            if self.kinds[i] in (_TL, _OTL):
                margs.append([to_meta(x) for x in v])
            elif self.kinds[i] == _GEN:
                margs.append(None)  # shapes do not depend on it, and PyTorch's refs refuse generators
            else:
                margs.append(to_meta(v))
        return margs

    def _has_cpu_scalar(self, vals):
        for i, v in enumerate(vals):
            for t in (v if self.kinds[i] in (_TL, _OTL) else (v,)):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0:
                    return True
        return False

    def _build(self, key, vals, nbufs, warned=False):
        with self.lock:
            entry = self.cache.get(key)
            if entry is not None:
                return entry
            out_meta = self._compute_meta(vals)
            if not warned and not self.any_dtypes:  # (CPU's kernel would warn what the op's warn hook warned)
                self._check_type_rules(vals)
            inner = self._make_inner(key, vals, out_meta)
            if out_meta is None and not self.inplace:
                # no meta kernel: take shapes from abstract evaluation of the lowering
                avals = _avals_of(vals, key, self.kinds, self.lowering.random)
                try:
                    shaped = jax.eval_shape(inner, *avals)
                except Exception:
                    self._raise_cpu_error(vals)
                    raise
                out_meta = pytree.tree_map(lambda a: (tuple(a.shape), dtypes.to_torch(a.dtype)), shaped)

            def flat(*xs):
                with checks.collecting() as sites, tracing.named_scope(self.name):
                    leaves = tuple(pytree.tree_leaves(inner(*xs)))
                entry.checks = tuple(sites.messages)
                return leaves + (sites.output(),) if sites.results else leaves

            if self.inplace:
                numels = []
                for i in self.mutated:
                    k = key[1 + i]
                    numels.extend(x[2] for x in (k if self.kinds[i] in (_TL, _OTL) else (k,)))
            else:
                leaves = pytree.tree_leaves(out_meta, is_leaf=_is_meta_leaf)
                numels = [math.prod(m[0]) for m in leaves]
                # refused here, not by XLA (which aborts on an overflowing size)
                check_allocation(sum(n * m[1].itemsize for n, m in zip(numels, leaves)))
            entry = _Entry(jax.jit(flat), out_meta, numels)
            if deferring():
                # trace now, so a lowering error surfaces at the user's line, not at the flush
                self._trace(entry, vals, key)
            self.cache[key] = entry
            return entry

    def _trace(self, entry, vals, key):
        try:
            jax.eval_shape(entry.fn, *_avals_of(vals, key, self.kinds, self.lowering.random))
        except Exception:
            self._raise_cpu_error(vals)
            raise

    def _compute_meta(self, vals):
        """Output (shape, dtype[, strides]) tree from PyTorch's meta kernel (None if there is none)."""
        def run_meta(margs):
            pos = margs[: self.npos]
            kw = {self.names[i]: margs[i] for i in range(self.npos, len(margs))}
            if self.lowering.meta is not None:
                return self.lowering.meta(*pos, **kw)
            # for in-place ops this validates shapes and casts the way PyTorch does
            return self.op(*pos, **kw)

        try:
            try:
                out = run_meta(self._meta_args(vals))
            except RuntimeError:
                # a CPU 0-dim operand stays on CPU for meta (as device kernels take it), but some of
                # PyTorch's Python references refuse the mix (copysign): as a meta 0-dim tensor it
                # promotes the same way
                if not self._has_cpu_scalar(vals):
                    raise
                out = run_meta(self._meta_args(vals, cpu_scalars=False))
        except Exception as e:
            msg = str(e).lower()
            if isinstance(e, (NotImplementedError, RuntimeError)) and "meta" in msg and (
                    "not implemented" in msg or "could not run" in msg or "no fake impl or meta kernel" in msg):
                return None
            # PyTorch's meta kernels check what CPU checks, but some word it differently or raise
            # another type: the user gets CPU's own error (CPU's missing dtype too, when meta's
            # error is about types: leaky_relu of a Long tensor)
            self._raise_cpu_error(vals, dtype_errors=bool(_TYPE_ERROR.search(msg)))
            raise
        if self.inplace:
            self._check_overlap(vals)
            return None
        return pytree.tree_map(lambda t: _meta_leaf(t) if isinstance(t, torch.Tensor) else t, out)

    def _check_overlap(self, vals):
        """CPU refuses most in-place writes into a tensor whose elements share memory (an expanded
        one); PyTorch's meta kernels cannot see it (meta tensors have no memory)."""
        if short_name(self.functional) in _OVERLAP_WRITES_ALLOWED:
            return
        for i in self.mutated:
            for t in (vals[i] if self.kinds[i] in (_TL, _OTL) else (vals[i],)):
                if isinstance(t, torch.Tensor):
                    check_no_internal_overlap(t)

    def _mixed_dtypes(self, vals) -> bool:
        """Do the tensor operands mix dtypes where CPU may refuse it: two floating (or complex)
        dtypes, or for a same-dtype op (``_SAME_DTYPE_OPS``) any two dtypes?"""
        seen = set()
        for i, kind in self.kind_items:
            if kind in (_T, _OT):
                ts = (vals[i],)
            elif kind in (_TL, _OTL):
                ts = vals[i]
            else:
                continue
            for t in ts:
                if isinstance(t, torch.Tensor) and (t.dim() or t.device.type == "tpu"):
                    if self.strict_dtypes or t.is_floating_point() or t.is_complex():
                        seen.add(t.dtype)
        return len(seen) > 1

    def _unusual_dtypes(self, vals) -> bool:
        """Is an operand that is not an index or a mask boolean, integer or complex?"""
        for i, kind in self.kind_items:
            if kind not in (_T, _OT, _TL, _OTL) or self.names[i] in _INDEX_ARGS:
                continue
            for t in (vals[i] if kind in (_TL, _OTL) else (vals[i],)):
                if isinstance(t, torch.Tensor) and not t.is_floating_point():
                    return True
        return False

    def _dtype_signature(self, vals):
        sig = []
        for i, kind in self.kind_items:
            v = vals[i]
            if kind in (_TL, _OTL):
                sig.append(tuple(None if x is None else x.dtype for x in v))
            elif isinstance(v, torch.Tensor):
                sig.append(v.dtype)
            elif kind in (_SCALAR, _OT):
                sig.append(type(v))
        return tuple(sig)

    def _check_type_rules(self, vals) -> None:
        """PyTorch's meta kernels let through dtypes CPU refuses (mm of float32 x float64, std of an
        integer tensor, a float result written in place into an int tensor): CPU's kernel on zero twins
        says whether the call breaks a type rule, for a mixed-dtype call at every new key, else once per
        op and dtype signature (small calls only: the twins are computed). Only errors about types are
        raised, never those zeros cause (a singular matrix, a zero divisor) or a CPU kernel's own gaps."""
        mixed = self._mixed_dtypes(vals)
        sig = None
        if not mixed:
            # a call of one floating dtype breaks no type rule (and CPU's kernel could warn what the
            # user never sees on CPU: a nested op's C++ warnings reach the user however caught)
            if not self._unusual_dtypes(vals):
                return
            sig = self._dtype_signature(vals)
            if sig in self.type_checked:
                return
        limit = None if mixed and self.strict_dtypes else (_CPU_ERROR_MAX_NUMEL if mixed else _TYPE_CHECK_MAX_NUMEL)
        if self.lowering.random:  # the twin must not draw from the CPU generator
            with torch.random.fork_rng(devices=[]):
                ran = self._raise_cpu_error(vals, reads_expanded=True, max_numel=limit, type_errors_only=True)
        else:
            ran = self._raise_cpu_error(vals, reads_expanded=True, max_numel=limit, type_errors_only=True)
        if ran and sig is not None:
            self.type_checked.add(sig)

    def _raise_cpu_error(self, vals, dtype_errors=False, reads_expanded=False, max_numel=-1,
                         type_errors_only=False):
        """Raise the error PyTorch's CPU kernel gives for this call's shapes, dtypes and arguments
        (inputs zero-filled), if it gives one: the bad input is the user's, and the error must be
        the one they would get on CPU. Returns if CPU accepts the call (the error is torchtpu's).
        CPU's "not implemented for <dtype>" replaces only an error of the lowering
        (``dtype_errors``), never a shape error of PyTorch's meta kernel."""
        cpu = []
        numel = 0
        for i, v in enumerate(vals):
            # ``reads_expanded``: inputs the op only reads are one zero expanded (no memory)
            twin = _cpu_zeros if not reads_expanded or i in self.mutated else _cpu_zeros_expanded
            if self.kinds[i] in (_TL, _OTL):
                v = [twin(x) for x in v]
                numel += sum(x.numel() for x in v if isinstance(x, torch.Tensor))
            elif self.kinds[i] == _GEN:
                v = None  # CPU's kernel refuses a tpu generator; the twin draws from CPU's (forked) one
            else:
                v = twin(v)
                numel += v.numel() if isinstance(v, torch.Tensor) else 0
            cpu.append(v)
        if max_numel == -1:
            max_numel = _CPU_ERROR_MAX_NUMEL
        if max_numel is not None and numel > max_numel:
            return False
        if type_errors_only:
            try:
                with warnings.catch_warnings():  # the call may be legal: tpu's own kernel warns
                    warnings.simplefilter("ignore")
                    self.op(*cpu[: self.npos], **{self.names[i]: cpu[i] for i in range(self.npos, len(cpu))})
            except Exception as e:  # noqa: BLE001 - only errors about types are the user's here
                msg = str(e)
                if ("Could not run" in msg or "not implemented for" in msg or "CPU" in msg
                        or not _TYPE_ERROR.search(msg)):
                    return True
                raise e.with_traceback(None) from None
            return True
        try:
            # (the warnings CPU emits on its way to the error reach the user, as they would on CPU)
            self.op(*cpu[: self.npos], **{self.names[i]: cpu[i] for i in range(self.npos, len(cpu))})
        except NotImplementedError as e:
            if "Could not run" in str(e) or not dtype_errors:
                return True  # no CPU kernel, or CPU lacks the dtype: it says nothing about the shapes meta refused
            raise e.with_traceback(None) from None
        except Exception as e:
            raise e.with_traceback(None) from None
        return True

    def _make_inner(self, key, vals, out_meta):
        """The traced function: flat buffers and dynamic scalars -> outputs (or new buffers)."""
        kinds = self.kinds
        lowering = self.lowering
        mutated = self.mutated
        inplace = self.inplace
        name = self.name
        statics = [v if kinds[i] == _STATIC else None for i, v in enumerate(vals)]
        nbufs = sum(_nbufs(key[1 + i], kind) for i, kind in enumerate(kinds))

        def inner(*flat):
            bufs = flat[:nbufs]
            bi = iter(bufs)
            di = iter(flat[nbufs:])

            def read_tensor(k):
                if k[0] in _NOBUF:
                    return jnp.asarray(next(di))
                v = _layout.read(next(bi), k[0])
                return v if len(k) == 3 else _layout.apply_math_bits(v, k[3])

            args = []
            for i, kind in enumerate(kinds):
                k = key[1 + i]
                if kind == _T:
                    args.append(read_tensor(k))
                elif kind == _OT:
                    args.append(None if k is None else read_tensor(k))
                elif kind in (_TL, _OTL):
                    args.append([None if x is None else read_tensor(x) for x in k])
                elif kind == _SCALAR:
                    args.append(None if k is None else next(di))
                elif kind == _SCALARS:
                    args.append([next(di) for _ in k])
                else:
                    args.append(statics[i])
            kw = {}
            if lowering.random:
                kw["key"] = jax.random.wrap_key_data(next(di))
            out = lowering.fn(*args, **kw)
            flat_out = pytree.tree_leaves(out)
            if inplace:
                return _write_mutated(name, key, kinds, mutated, bufs, flat_out)
            if out_meta is None:
                return out
            metas = pytree.tree_leaves(out_meta, is_leaf=_is_meta_leaf)
            if len(metas) != len(flat_out):
                raise RuntimeError(
                    f"torchtpu lowering of {name} returned {len(flat_out)} outputs, PyTorch's meta gives {len(metas)}"
                )
            fixed = []
            for o, m in zip(flat_out, metas):
                shape, dt = m[0], m[1]
                o = jnp.asarray(o)
                if tuple(o.shape) != tuple(shape):
                    if o.ndim == 0:
                        o = jnp.broadcast_to(o, shape)
                    elif o.size == math.prod(shape):
                        o = o.reshape(shape)
                    else:
                        raise RuntimeError(
                            f"torchtpu lowering of {name} returned shape {tuple(o.shape)}, "
                            f"PyTorch's meta gives {tuple(shape)}"
                        )
                o = _layout.cast(o, dtypes.to_jax(dt))
                if len(m) > 2:  # a non-contiguous dense layout: the buffer holds the elements in its order
                    o = _layout.to_physical(o, m[2])
                fixed.append(o)
            return fixed

        return inner

    # ---------------------------------------------------------------- results
    def _wrap(self, vals, outs, entry):
        if self.inplace:
            # the mutated tensors' storages were looked up (and their dtypes checked) for the key
            it = iter(outs)
            for i in self.mutated:
                v = vals[i]
                # the new buffer holds the written tensor's dtype (another input over the same
                # storage, a view(dtype), may have retyped it since the key was built)
                if self.kinds[i] in (_TL, _OTL):
                    for t in v:
                        sd = t.untyped_storage()._tpu
                        sd.buf = next(it)
                        sd.dtype = t.dtype
                else:
                    sd = v.untyped_storage()._tpu
                    sd.buf = next(it)
                    sd.dtype = v.dtype
            if self.n_returns == 0:
                return None
            rets = [vals[i] for i in self.returned]
            return rets[0] if len(rets) == 1 else tuple(rets)
        if entry.single:
            return new_output(*entry.out_layouts[0], outs[0])
        if entry.flat is not None:
            tensors = [new_output(*m, o) for m, o in zip(entry.out_layouts, outs)]
            return tensors if entry.flat is list else tuple(tensors)
        leaves, treedef = entry.treedef
        tensors = [new_tensor(*m[:2], o, *m[2:]) for m, o in zip(leaves, outs)]
        return pytree.tree_unflatten(tensors, treedef)


_scalar_cache: dict = {}
_scalar_seen: dict = {}  # keys of values met once and not (yet) converted


def _scalar_array(v):
    """Python number ``v`` as a jit argument: a cached weakly typed device scalar once the value
    has been met before, else ``v`` itself. jit takes a python number as the same abstract value
    (one executable for both), converting it in C++ for a few microseconds, where ``jnp.asarray``
    costs ~50 us; values that change every step (an optimizer's bias corrections) are never
    worth converting, while repeated ones (alpha=1, a learning rate) are, once."""
    tv = type(v)
    # floats by bit pattern: -0.0 == 0.0 and nan != nan must not share or miss entries
    key = (tv, v.hex() if tv is float else (repr(v) if tv is complex else v))
    a = _scalar_cache.get(key)
    if a is None:
        if key not in _scalar_seen:
            if len(_scalar_seen) >= 8192:  # bounded: most are one-off values
                _scalar_seen.clear()
            _scalar_seen[key] = None
            return v
        a = jax.device_put(v)  # weakly typed like jnp.asarray(v), without compiling a staging program
        if len(_scalar_cache) >= 8192:
            _scalar_cache.clear()
        _scalar_cache[key] = a
    return a


def _nbufs(k, kind):
    if kind == _T:
        return 0 if k[0] in _NOBUF else 1
    if kind == _OT:
        return 0 if k is None or k[0] in _NOBUF else 1
    if kind in (_TL, _OTL):
        return sum(1 for x in k if x is not None and x[0] not in _NOBUF)
    return 0


def _avals_of(vals, key, kinds, random=False):
    """ShapeDtypeStructs for the flat arguments of a kernel's traced function."""
    bufs, dyn = [], []

    def add(k):
        if k[0] in _NOBUF:
            return
        bufs.append(jax.ShapeDtypeStruct((k[2],), dtypes.to_jax(k[1])))

    for i, kind in enumerate(kinds):
        k = key[1 + i]
        if kind == _T:
            add(k)
        elif kind == _OT and k is not None:
            add(k)
        elif kind in (_TL, _OTL):
            for x in k:
                if x is not None:
                    add(x)
    for i, kind in enumerate(kinds):
        v = vals[i]
        k = key[1 + i]
        if kind in (_T, _OT) and k is not None and k[0] in _NOBUF:
            dyn.append(v.item() if isinstance(v, torch.Tensor) else v)
        elif kind in (_TL, _OTL):
            dyn.extend(x.item() if isinstance(x, torch.Tensor) else x for x, kk in zip(v, k) if kk is not None and kk[0] in _NOBUF)
        elif kind == _SCALAR and v is not None:
            dyn.append(v)
        elif kind == _SCALARS:
            dyn.extend(v)
    if random:
        dyn.append(jax.ShapeDtypeStruct((2,), jnp.uint32))
    return bufs + dyn


def _write_mutated(name, key, kinds, mutated, bufs, flat_out):
    """New flat buffers for the mutated arguments of an in-place op (traced)."""
    new_bufs = []
    pos = 0
    for i in mutated:
        k = key[1 + i]
        if kinds[i] in (_TL, _OTL):
            targets = [(kk, _buffer_index(key, kinds, i, j)) for j, kk in enumerate(k)]
        else:
            targets = [(k, _buffer_index(key, kinds, i, None))]
        for kk, bidx in targets:
            value = jnp.asarray(flat_out[pos])
            if len(kk) > 3:  # written through a conj()/neg view: store what reads give back as value
                value = _layout.apply_math_bits(_layout.cast(value, bufs[bidx].dtype), kk[3])
            size = tuple(kk[0][0])
            if jnp.broadcast_shapes(value.shape, size) != size:
                raise RuntimeError(
                    f"output with shape {list(size)} doesn't match the broadcast shape "
                    f"{list(jnp.broadcast_shapes(value.shape, size))}"
                )
            new_bufs.append(_layout.write(bufs[bidx], kk[0], value))
            pos += 1
    return new_bufs


def _buffer_index(key, kinds, arg_i, list_pos):
    """Index into the flat buffer list of argument ``arg_i`` (element ``list_pos`` of a list)."""
    idx = 0
    for i, kind in enumerate(kinds):
        k = key[1 + i]
        if i == arg_i:
            if list_pos is None:
                return idx
            return idx + sum(1 for x in k[:list_pos] if x is not None and x[0] not in _NOBUF)
        if kind == _T:
            idx += 0 if k[0] in _NOBUF else 1
        elif kind == _OT:
            idx += 0 if k is None or k[0] in _NOBUF else 1
        elif kind in (_TL, _OTL):
            idx += sum(1 for x in k if x is not None and x[0] not in _NOBUF)
    raise AssertionError


_NOBUF = ("cpu0", "num")
# in-place ops CPU lets write into an expanded tensor (the scatters warn: see ops/indexing.py)
_OVERLAP_WRITES_ALLOWED = frozenset({
    "aten::fill.Scalar", "aten::fill.Tensor", "aten::zero", "aten::masked_fill.Scalar", "aten::masked_fill.Tensor",
    "aten::index_fill.int_Scalar", "aten::index_fill.int_Tensor", "aten::index_put", "aten::_index_put_impl",
    "aten::tril", "aten::triu",
})
_CPU_ERROR_MAX_NUMEL = 1 << 24  # zero-filled CPU twins larger than this are not worth an error message
# conversions: every pair of dtypes is legal (and CPU's kernel warns about complex -> real)
_ANY_DTYPES = frozenset({"aten::_to_copy", "aten::copy", "aten::clone", "aten::lift_fresh_copy", "aten::_copy_from"})
_INDEX_ARGS = frozenset({"index", "indices", "mask", "target", "offsets", "condition", "lengths", "per_sample_weights",
                         "counts", "sorted_sequence", "boundaries", "repeats", "weight_indices"})
_TYPE_CHECK_MAX_NUMEL = 1 << 16  # a same-dtype call's type check computes its twins: small calls only
# what an error about types says (errors zeros cause, singular matrices or zero divisors, say none of it)
_TYPE_ERROR = re.compile(r"dtype|\btypes?\b|bool|complex|integer|floating|\blong\b|\bint\b|\bfloat\b|half|"
                         r"bfloat16|double", re.IGNORECASE)


def check_no_internal_overlap(t: torch.Tensor) -> None:
    """PyTorch's refusal to write into a tensor whose elements share memory (an expanded one)."""
    if _layout.has_internal_overlap(t.shape, t.stride()):
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers to a single "
            "memory location. Please clone() the tensor before performing the operation.")


def _cpu_zeros_expanded(v):
    """A CPU twin of tpu tensor ``v`` that holds one zero, expanded to ``v``'s shape. Small tensors get
    real zeros with ``v``'s strides: CPU kernels check the layout of small operands (``_scaled_mm``'s
    row-wise scales must be contiguous), and those cost nothing to allocate."""
    if isinstance(v, torch.Tensor) and v.device.type != "cpu" and v.numel() > _EXPAND_TWIN_MIN_NUMEL:
        return torch.zeros((), dtype=v.dtype).expand(v.shape)
    return _cpu_zeros(v)


_EXPAND_TWIN_MIN_NUMEL = 1 << 16


# ops whose CPU kernels require all operands of one dtype (matrix products, convolutions, attention):
# refused when any two differ, integer operands included
_SAME_DTYPE_OPS = frozenset(f"aten::{n}" for n in (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "dot", "vdot", "linalg_cross", "cross",
    "convolution", "_convolution", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention", "_addmm_activation",
))


def _cpu_zeros(v):
    """A zero-filled CPU twin of tensor ``v`` (same shape, strides, dtype); a tpu device becomes cpu."""
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu":
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).zero_()
    if isinstance(v, torch.device) and v.type == "tpu":
        return torch.device("cpu")
    return v
_record = RECORDER.record
_RECORDER_LOCK = RECORDER.lock
_record_hit = metrics.record_hit
_META_DEVICE = torch.device("meta")


class _NoDefaultType:
    def __repr__(self):
        return "<no default>"


_NoDefault = _NoDefaultType()


