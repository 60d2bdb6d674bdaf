"""Collectives on tpu tensors as XLA programs over the participating processes' devices.

A group's ranks are a 1-D mesh of their processes' devices (one per process, in group-rank order;
a subgroup or a DeviceMesh dimension is a sub-mesh). Each process holds its flat buffer; the buffers
together are one global array sharded over the mesh (``jax.make_array_from_single_device_arrays``,
no copy), and one ``jax.shard_map`` program (psum, all_gather, psum_scatter, all_to_all, ppermute)
returns this process's shard of the result. The bytes move device to device (XLA's CPU collectives
over gloo here; ICI/DCN on TPU) and never through host memory.

Programs are cached per (mesh, collective, static arguments); jit caches them per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax.lax import _convert_element_type  # the one way to give a traced value back its weak type
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "ranks"

# how each reduce op combines the rows of a gathered (n, k) block, where there is no XLA collective for it
_ROW_REDUCE = {
    "prod": lambda g: jnp.prod(g, axis=0, dtype=g.dtype),
    "band": lambda g: functools.reduce(jnp.bitwise_and, list(g)),
    "bor": lambda g: functools.reduce(jnp.bitwise_or, list(g)),
    "bxor": lambda g: functools.reduce(jnp.bitwise_xor, list(g)),
    "any": lambda g: jnp.any(g, axis=0),
    "all": lambda g: jnp.all(g, axis=0),
    "min": lambda g: jnp.min(g, axis=0),
    "max": lambda g: jnp.max(g, axis=0),
}
_BOOL_OP = {"sum": "any", "avg": "any", "max": "any", "bor": "any", "prod": "all", "min": "all", "band": "all",
            "bxor": "bxor"}
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _reduce(b, op: str, n: int):
    """The reduction ``op`` of block ``b`` over the mesh axis (inside shard_map)."""
    if b.dtype == jnp.bool_:
        return _ROW_REDUCE[_BOOL_OP[op]](lax.all_gather(b, AXIS))
    if op in ("sum", "avg"):
        if jnp.iscomplexobj(b):
            r = lax.complex(lax.psum(b.real, AXIS), lax.psum(b.imag, AXIS))
        else:
            r = lax.psum(b, AXIS)
        if op == "avg":
            r = r / n if jnp.issubdtype(b.dtype, jnp.inexact) else lax.div(r, jnp.asarray(n, r.dtype))
        return r.astype(b.dtype)
    if op == "max":
        return lax.pmax(b, AXIS)
    if op == "min":
        return lax.pmin(b, AXIS)
    return _ROW_REDUCE[op](lax.all_gather(b, AXIS))


def _exact_select(b, keep):
    """``b`` where ``keep`` else zero, as unsigned bits: a psum of one such block and zeros is exact
    (NaN payloads and -0.0 survive, which a float sum would not keep)."""
    if b.dtype == jnp.bool_:
        return jnp.where(keep, b.astype(jnp.uint8), 0), lambda u: u.astype(jnp.bool_)
    u = lax.bitcast_convert_type(b, _UINT[b.dtype.itemsize])
    return jnp.where(keep, u, 0), lambda v: lax.bitcast_convert_type(v, b.dtype)


def _body(kind: str, static: tuple, n: int):
    if kind == "reduce":
        (op,) = static
        return lambda b: _reduce(b, op, n)
    if kind == "all_gather":
        return lambda b: lax.all_gather(b, AXIS, tiled=True)
    if kind == "reduce_scatter":
        (op,) = static

        def reduce_scatter(b):
            m = b.shape[0] // n
            if op in ("sum", "avg") and b.dtype != jnp.bool_ and not jnp.iscomplexobj(b):
                r = lax.psum_scatter(b, AXIS, scatter_dimension=0, tiled=True)
                if op == "avg":
                    r = r / n if jnp.issubdtype(b.dtype, jnp.inexact) else lax.div(r, jnp.asarray(n, r.dtype))
                return r.astype(b.dtype)
            return lax.dynamic_slice_in_dim(_reduce(b, op, n), lax.axis_index(AXIS) * m, m)
        return reduce_scatter
    if kind == "all_to_all":
        return lambda b: lax.all_to_all(b.reshape(n, -1), AXIS, 0, 0, tiled=True).reshape(-1)
    if kind == "broadcast":
        (root,) = static

        def broadcast(b):
            if jnp.iscomplexobj(b):
                return lax.all_gather(b, AXIS).reshape(n, -1)[root]
            bits, back = _exact_select(b, lax.axis_index(AXIS) == root)
            return back(lax.psum(bits, AXIS))
        return broadcast
    if kind == "scatter":
        (root,) = static  # every rank's block is n chunks; only the root's are real
        return lambda b: lax.all_to_all(b.reshape(n, -1), AXIS, 0, 0, tiled=True)[root]
    if kind == "permute":
        (pairs,) = static
        return lambda b: lax.ppermute(b, AXIS, pairs)
    raise ValueError(f"torchtpu distributed: no XLA program for {kind}")


@functools.cache
def _program(mesh: Mesh, kind: str, static: tuple):
    body = _body(kind, static, mesh.devices.size)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


class GroupMesh:
    """A group's ranks as a 1-D mesh of their processes' devices; runs collective programs on it.

    Besides running one collective (``run``), it is what a DeferAndFuse graph holding collectives
    runs over (runtime/recorder.py): ``body`` gives a collective's per-rank function for such a
    graph, ``spmd`` wraps a whole graph function in ``shard_map`` over the mesh, and ``to_global``
    / ``to_local`` turn this rank's arrays into its shard of a global array and back (no copies)."""

    def __init__(self, devices, rank: int):
        self.devices = tuple(devices)
        self.size = len(self.devices)
        self.rank = rank
        self.device = self.devices[rank]
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self._sharding = NamedSharding(self.mesh, P(AXIS))
        self._fns: dict = {}

    def body(self, kind: str, *static):
        """Collective ``kind``'s function of this rank's flat block, for use inside ``spmd``."""
        return _body(kind, static, self.size)

    def graph_fn(self, key, make):
        """One function object per ``key`` (a DeferAndFuse graph's cache key holds its nodes'
        functions: the same collective must bring the same function every step)."""
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = make()
        return fn

    def spmd(self, fn, avals):
        """``fn`` of this rank's arrays (shapes and weak types ``avals``) as a function of the global
        arrays ``to_global`` makes, returning global arrays (``to_local`` gives back this rank's part)."""
        def per_rank(*blocks):
            args = []
            for b, (shape, weak) in zip(blocks, avals):
                if b.shape != shape:
                    b = b.reshape(shape)
                args.append(_convert_element_type(b, weak_type=True) if weak else b)
            return [o.reshape(1) if o.ndim == 0 else o for o in fn(*args)]

        return jax.shard_map(per_rank, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False)

    def to_global(self, x, dtype):
        """This rank's array (or python number) ``x`` as its shard of a global array over the mesh."""
        if not isinstance(x, jax.Array):
            x = jax.device_put(np.full((1,), x, dtype), self.device)
        elif x.ndim == 0:
            x = x.reshape(1)
        if self.device not in x.devices():
            x = jax.device_put(x, self.device)
        return jax.make_array_from_single_device_arrays((self.size * x.shape[0],) + x.shape[1:], self._sharding,
                                                        [x])

    @staticmethod
    def to_local(g):
        """This rank's shard of global array ``g``."""
        return g.addressable_shards[0].data

    def run(self, kind: str, local, *static):
        """This rank's flat result of collective ``kind`` on its flat block ``local`` (a jax array)."""
        if local.ndim != 1:
            local = local.reshape(-1)
        if local.size == 0 and kind != "all_to_all":
            return jnp.zeros((0,), local.dtype) if kind != "all_gather" else local
        if self.device not in local.devices():
            local = jax.device_put(local, self.device)
        glob = jax.make_array_from_single_device_arrays((self.size * local.shape[0],), self._sharding, [local])
        out = _program(self.mesh, kind, static)(glob)
        return out.addressable_shards[0].data

    def all_to_all(self, local, send, recv, widest: int):
        """Uneven all_to_all of flat ``local``: ``send[j]`` elements to rank j, ``recv[i]`` from rank i.

        Every chunk is padded to one width (``widest``, the largest chunk any rank of the group sends,
        rounded up to a power of two so that changing splits reuse a few programs), exchanged, and
        unpacked on the device."""
        local = local.reshape(-1)
        if len(set(send)) == 1 and set(recv) == set(send):  # even splits: no padding to undo
            return self.run("all_to_all", local)
        widest = max(widest, 1)
        width = 1 << (widest - 1).bit_length()
        packed = _pack(local, np.asarray(send, np.int64), width)
        out = self.run("all_to_all", packed)
        return _unpack(out, np.asarray(recv, np.int64), int(sum(recv)), width)


@functools.partial(jax.jit, static_argnums=(2,))
def _pack(x, send, width):
    """(n * width,) with chunk j = the ``send[j]`` elements of flat ``x`` after those of chunks < j."""
    offs = jnp.cumsum(send) - send
    i = jnp.arange(width)
    valid = i[None, :] < send[:, None]
    if x.size == 0:
        return jnp.zeros((send.shape[0] * width,), x.dtype)
    idx = jnp.clip(offs[:, None] + i[None, :], 0, x.size - 1)
    return jnp.where(valid, x[idx], jnp.zeros((), x.dtype)).reshape(-1)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _unpack(y, recv, total, width):
    """The first ``recv[i]`` elements of each padded chunk i of ``y``, concatenated (``total`` of them)."""
    if total == 0:
        return jnp.zeros((0,), y.dtype)
    ends = jnp.cumsum(recv)
    p = jnp.arange(total)
    row = jnp.searchsorted(ends, p, side="right")
    col = p - (ends - recv)[row]
    return y.reshape(recv.shape[0], width)[row, col]
