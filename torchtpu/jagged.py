"""fbgemm's jagged and KJT ops on tpu: the ops TorchRec's KeyedJaggedTensor machinery and
generative recommenders (HSTU) call, lowered to XLA instead of the CPU fallback.

A jagged tensor is ``values`` (rows concatenated over segments) with ``offsets`` (one tensor
per jagged dim). Every program here is a gather: dense positions look up their jagged row, and
jagged rows look up their dense position through ``searchsorted`` on the offsets, so no op
scatters and none reads the offsets on the host unless its output size depends on them (the
permutes and selects without a ``*_lengths_sum`` read one number).

The jagged total length varies per batch: the values are padded to a bucket of
:func:`total_length_policy` (``torchtpu.bucketing``, pow2 by default) before the program runs,
so each op compiles once per bucket, not once per length; outputs of the jagged length are
sliced back (a view). The padding runs as a small pad program per raw length, as
``bucketing`` describes for tensors already on the device.

Offsets are checked on the device (``runtime/checks``), raised at the next host wait naming the
op: segments of negative length (offsets not non-decreasing) and offsets past the values'
length, never a silently wrong row.

Importing this module imports ``fbgemm_gpu`` (which defines the ops), so ``torchtpu`` does not
import it; ``torchtpu_rec`` does, then installs these kernels (``dispatch.install.install()``).
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (defines the fbgemm:: ops lowered here)
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from .bucketing import BucketPolicy
from .dispatch.kernel import Kernel
from .dispatch.lowering import Lowering, impl, lower
from .runtime.checks import check_index

fbgemm = torch.ops.fbgemm
_I64 = jnp.int64
_NO_LIMIT = 1 << 62

_POLICY = [BucketPolicy.pow2(16, 1 << 30, name="jagged_total_length")]


def total_length_policy() -> BucketPolicy:
    """The bucket policy of the jagged total length (values rows) of every op here."""
    return _POLICY[0]


def set_total_length_policy(policy: BucketPolicy) -> None:
    """Bucket the jagged total length with ``policy`` (fewer buckets: fewer compiles, more padding)."""
    if not isinstance(policy, BucketPolicy):
        raise TypeError(f"set_total_length_policy needs a torchtpu.bucketing.BucketPolicy, not {type(policy).__name__}")
    _POLICY[0] = policy


# ---------------------------------------------------------------- the bucketed programs
# Private ops (own schemas, no CPU kernel): the extra ``total`` argument is the real jagged length
# the checks compare against; ``rows`` is the bucketed length of a jagged output.
_LIB = torch.library.Library("torchtpu_jagged", "DEF")
for _schema in (
    "to_dense(Tensor values, Tensor[] offsets, int[] max_lengths, float padding_value, Scalar total) -> Tensor",
    "to_jagged(Tensor dense, Tensor[] offsets, int rows, Scalar total) -> Tensor",
    "dense_add(Tensor values, Tensor[] offsets, Tensor dense, Scalar total) -> Tensor",
    "jagged_add(Tensor values, Tensor[] offsets, Tensor dense, Scalar total) -> Tensor",
    "jagged_mul(Tensor values, Tensor[] offsets, Tensor dense, Scalar total) -> Tensor",
    "jagged_mul_backward(Tensor grad, Tensor[] offsets, Tensor dense, Tensor values, Scalar total) -> (Tensor, Tensor)",
    "segment_sum_csr(int batch_size, Tensor offsets, Tensor values, Scalar total) -> Tensor",
    "expand(Tensor starts, Tensor offsets, int rows, Scalar total) -> Tensor",
    "gather_rows(Tensor values, Tensor index, Scalar total) -> Tensor",
):
    _LIB.define(_schema)
_ops = torch.ops.torchtpu_jagged


def _check_offsets(offsets, total, what):
    """Device checks of jagged ``offsets`` (int64) against ``total`` rows."""
    check_index(offsets[1:] - offsets[:-1], _NO_LIMIT,
                f"{what}: offsets are not non-decreasing (a segment of length {{value}})")
    check_index(offsets, total + 1, f"{what}: offsets point past the values' length (offset {{value}})")


def _dense_index(offsets, max_lengths):
    """For each dense position [B, L1, ..., Lk]: its jagged row and whether it is a real element."""
    idx = jnp.arange(offsets[0].shape[0] - 1, dtype=_I64)
    valid = jnp.ones(idx.shape, bool)
    for off, width in zip(offsets, max_lengths):
        start = off[idx]
        length = off[idx + 1] - start
        i = jnp.arange(width, dtype=_I64)
        valid = valid[..., None] & (i < length[..., None])
        idx = jnp.where(valid, start[..., None] + i, 0)
    return idx, valid


def _jagged_index(offsets, rows, max_lengths):
    """For each jagged row (``rows`` of them, padded): its dense coordinates and whether it is real
    (inside the last offset and inside the dense widths; fbgemm drops what a width cuts off)."""
    pos = jnp.arange(rows, dtype=_I64)
    valid = pos < offsets[-1][-1]
    coords = []
    for off, width in zip(reversed(offsets), reversed(max_lengths)):
        parent = jnp.clip(jnp.searchsorted(off, pos, side="right") - 1, 0, off.shape[0] - 2)
        i = pos - off[parent]
        valid = valid & (i < width)
        coords.append(jnp.where(valid, i, 0))
        pos = parent
    coords.append(pos)
    return tuple(reversed(coords)), valid


def _mask(valid, x):
    return valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim))


def _i64(offsets):
    return [o.astype(_I64) for o in offsets]


def _to_dense(values, offsets, max_lengths, padding_value, total):
    offsets = _i64(offsets)
    for o in offsets:
        _check_offsets(o, total if o is offsets[-1] else _NO_LIMIT, "jagged_to_padded_dense")
    idx, valid = _dense_index(offsets, max_lengths)
    out = jnp.take(values, idx, axis=0, mode="fill", fill_value=0)
    return jnp.where(_mask(valid, out), out, jnp.asarray(padding_value, values.dtype))


def _gather_dense(dense, offsets, rows, what, total):
    offsets = _i64(offsets)
    for o in offsets:
        _check_offsets(o, total if o is offsets[-1] else _NO_LIMIT, what)
    widths = dense.shape[1:1 + len(offsets)]
    coords, valid = _jagged_index(offsets, rows, widths)
    out = dense[coords]
    return jnp.where(_mask(valid, out), out, jnp.zeros((), dense.dtype))


def _to_jagged(dense, offsets, rows, total):
    return _gather_dense(dense, offsets, rows, "dense_to_jagged", total)


def _dense_add(values, offsets, dense, total):
    max_lengths = dense.shape[1:1 + len(offsets)]
    return dense + _to_dense(values, offsets, max_lengths, 0.0, total).astype(dense.dtype)


def _jagged_add(values, offsets, dense, total):
    return values + _gather_dense(dense, offsets, values.shape[0], "jagged_dense_elementwise_add", total)


def _jagged_mul(values, offsets, dense, total):
    return values * _gather_dense(dense, offsets, values.shape[0], "jagged_dense_elementwise_mul", total)


def _jagged_mul_backward(grad, offsets, dense, values, total):
    grad_values = grad * _gather_dense(dense, offsets, grad.shape[0], "jagged_dense_elementwise_mul", total)
    grad_dense = _to_dense(grad * values, offsets, dense.shape[1:1 + len(offsets)], 0.0, total)
    return grad_values, grad_dense.astype(dense.dtype)


def _segment_sum_csr(batch_size, csr, values, total):
    bounds = csr.astype(_I64) * batch_size
    _check_offsets(bounds, total, "segment_sum_csr")
    pos = jnp.arange(values.shape[0], dtype=_I64)
    seg = jnp.searchsorted(bounds, pos, side="right") - 1
    valid = (pos >= bounds[0]) & (pos < bounds[-1])
    nseg = bounds.shape[0] - 1
    kept = jnp.where(valid, values, jnp.zeros((), values.dtype))
    return jnp.zeros((nseg,), values.dtype).at[jnp.clip(seg, 0, nseg - 1)].add(kept)


def _expand(starts, offsets, rows, total):
    """Row ``p`` of output segment ``s`` (``offsets``) reads input row ``starts[s] + p - offsets[s]``."""
    offsets = offsets.astype(_I64)
    _check_offsets(offsets, total, "expand_into_jagged_permute")
    pos = jnp.arange(rows, dtype=_I64)
    seg = jnp.clip(jnp.searchsorted(offsets, pos, side="right") - 1, 0, offsets.shape[0] - 2)
    src = starts.astype(_I64)[seg] + pos - offsets[seg]
    return jnp.where(pos < offsets[-1], src, 0).astype(starts.dtype)


def _gather_rows(values, index, total):
    check_index(index, total, "jagged permute/select: the lengths point past the values' length (row {value})")
    return jnp.take(values, index.astype(_I64), axis=0, mode="fill", fill_value=0)


def _kernel(name, fn, static):
    return Kernel(getattr(_ops, name).default, Lowering(f"torchtpu_jagged::{name}", fn, static=static))


# ``total`` is traced (a bucket's program serves every length in it); the rest is static
_TO_DENSE = _kernel("to_dense", _to_dense, ("max_lengths", "padding_value"))
_TO_JAGGED = _kernel("to_jagged", _to_jagged, ("rows",))
_DENSE_ADD = _kernel("dense_add", _dense_add, ())
_JAGGED_ADD = _kernel("jagged_add", _jagged_add, ())
_JAGGED_MUL = _kernel("jagged_mul", _jagged_mul, ())
_JAGGED_MUL_BACKWARD = _kernel("jagged_mul_backward", _jagged_mul_backward, ())
_SEGMENT_SUM_CSR = _kernel("segment_sum_csr", _segment_sum_csr, ("batch_size",))
_EXPAND = _kernel("expand", _expand, ("rows",))
_GATHER_ROWS = _kernel("gather_rows", _gather_rows, ())


# ---------------------------------------------------------------- bucketing
def _bucket(n: int) -> int:
    return _POLICY[0].bucket(max(int(n), 1))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, rows - t.shape[0]])


def _bucketed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its rows (the jagged total length) padded to their bucket."""
    return _pad_rows(t, _bucket(t.shape[0]))


def _check_values(values, what):
    if values.dim() == 0:
        raise ValueError(f"{what}: values must have at least one dimension (the jagged rows)")


def _check_offsets_list(offsets, what, device):
    """The offsets, checked, on ``device`` (TorchRec's host-side input dists leave a KJT's offsets on the
    CPU beside tpu values: they are copied in, as a CUDA user would have them already)."""
    if not offsets:
        raise ValueError(f"{what}: needs at least one offsets tensor")
    for o in offsets:
        if o.dim() != 1:
            raise ValueError(f"{what}: offsets must be 1-D, got shape {list(o.shape)}")
        if o.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what}: offsets must be int32 or int64, not {o.dtype}")
    return [o.to(device) for o in offsets]


# ---------------------------------------------------------------- the fbgemm ops
@impl("fbgemm::jagged_to_padded_dense_forward")
def _jagged_to_padded_dense_forward(values, offsets, max_lengths, padding_value=0.0):
    _check_values(values, "jagged_to_padded_dense")
    offsets = _check_offsets_list(offsets, "jagged_to_padded_dense", values.device)
    if len(max_lengths) != len(offsets):
        raise ValueError(f"jagged_to_padded_dense: {len(offsets)} offsets tensors but {len(max_lengths)} max_lengths")
    return _TO_DENSE(_bucketed(values), offsets, [int(n) for n in max_lengths], float(padding_value),
                     values.shape[0])


def _jagged_rows(dense, offsets, total_L, what):
    """``dense`` gathered at ``total_L`` jagged rows (read from the offsets when None)."""
    offsets = _check_offsets_list(offsets, what, dense.device)
    if dense.dim() < len(offsets) + 1:
        raise ValueError(f"{what}: dense of shape {list(dense.shape)} has fewer than {len(offsets) + 1} dims")
    if total_L is None:
        total_L = int(offsets[-1][-1].item())  # the output size depends on it (fbgemm reads it too)
    total_L = int(total_L)
    rows = _bucket(total_L)
    return _TO_JAGGED(dense, offsets, rows, total_L)[:total_L]


@impl("fbgemm::dense_to_jagged_forward")
def _dense_to_jagged_forward(dense, x_offsets, total_L=None):
    return _jagged_rows(dense, x_offsets, total_L, "dense_to_jagged")


@impl("fbgemm::jagged_to_padded_dense_backward")
def _jagged_to_padded_dense_backward(grad_output, offsets, total_L):
    return _jagged_rows(grad_output, offsets, total_L, "jagged_to_padded_dense_backward")


@impl("fbgemm::jagged_dense_elementwise_add")
def _jagged_dense_elementwise_add(x_values, x_offsets, y):
    _check_values(x_values, "jagged_dense_elementwise_add")
    x_offsets = _check_offsets_list(x_offsets, "jagged_dense_elementwise_add", x_values.device)
    return _DENSE_ADD(_bucketed(x_values), x_offsets, y, x_values.shape[0])


def _jagged_output(kernel, x_values, x_offsets, y, what):
    _check_values(x_values, what)
    x_offsets = _check_offsets_list(x_offsets, what, x_values.device)
    n = x_values.shape[0]
    return kernel(_bucketed(x_values), x_offsets, y, n)[:n]


@impl("fbgemm::jagged_dense_elementwise_add_jagged_output")
def _jagged_dense_elementwise_add_jagged_output(x_values, x_offsets, y):
    out = _jagged_output(_JAGGED_ADD, x_values, x_offsets, y, "jagged_dense_elementwise_add")
    return out, list(x_offsets)


@impl("fbgemm::jagged_dense_elementwise_mul_forward")
def _jagged_dense_elementwise_mul_forward(x_values, x_offsets, y):
    return _jagged_output(_JAGGED_MUL, x_values, x_offsets, y, "jagged_dense_elementwise_mul")


@impl("fbgemm::jagged_dense_elementwise_mul_backward")
def _jagged_dense_elementwise_mul_backward(grad_output, x_offsets, y, x_values):
    x_offsets = _check_offsets_list(x_offsets, "jagged_dense_elementwise_mul", grad_output.device)
    n = x_values.shape[0]
    grad_values, grad_dense = _JAGGED_MUL_BACKWARD(_bucketed(grad_output), x_offsets, y, _bucketed(x_values), n)
    return grad_values[:n], grad_dense


@lower("fbgemm::asynchronous_complete_cumsum")
def _asynchronous_complete_cumsum(t):
    zero = jnp.zeros(t.shape[:-1] + (1,), t.dtype)
    return jnp.concatenate([zero, jnp.cumsum(t, axis=-1, dtype=t.dtype)], axis=-1)


@lower("fbgemm::asynchronous_exclusive_cumsum")
def _asynchronous_exclusive_cumsum(t):
    return jnp.cumsum(t, axis=-1, dtype=t.dtype) - t


@lower("fbgemm::asynchronous_inclusive_cumsum")
def _asynchronous_inclusive_cumsum(t):
    return jnp.cumsum(t, axis=-1, dtype=t.dtype)


@impl("fbgemm::segment_sum_csr")
def _segment_sum_csr_impl(batch_size, csr_seg, values):
    if csr_seg.dim() != 1 or csr_seg.shape[0] < 1:
        raise ValueError(f"segment_sum_csr: csr_seg must be 1-D and non-empty, got shape {list(csr_seg.shape)}")
    return _SEGMENT_SUM_CSR(int(batch_size), csr_seg, _bucketed(values), values.shape[0])


@impl("fbgemm::expand_into_jagged_permute")
def _expand_into_jagged_permute(permute, input_offset, output_offset, output_size):
    output_size = int(output_size)
    starts = _take(input_offset, permute, input_offset.shape[0] - 1, "expand_into_jagged_permute")
    return _EXPAND(starts, output_offset, _bucket(output_size), output_size)[:output_size]


def _take(t, index, n, what):
    """``t[index]`` with ``index`` checked against ``n`` segments (a feature permutation, a batch index)."""
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what}: the permutation/indices must be int32 or int64, not {index.dtype}")
    return t[:n].index_select(0, index)


def _permute_sparse(permute, lengths, values, weights, permuted_lengths_sum, what):
    """Segments of ``values`` (one per entry of ``lengths``' first dim) in ``permute``'s order."""
    nseg = lengths.shape[0]
    permuted_lengths = _take(lengths, permute, nseg, what)
    seg_lengths = lengths if lengths.dim() == 1 else lengths.sum(dim=tuple(range(1, lengths.dim())))
    out_lengths = seg_lengths.index_select(0, permute.long())
    in_off = fbgemm.asynchronous_complete_cumsum(seg_lengths.long())
    out_off = fbgemm.asynchronous_complete_cumsum(out_lengths.long())
    total = int(out_off[-1].item()) if permuted_lengths_sum is None else int(permuted_lengths_sum)
    rows = _bucket(total)
    src = _EXPAND(in_off.index_select(0, permute.long()), out_off, rows, total)
    n = values.shape[0]
    out_values = _GATHER_ROWS(values, src, n)[:total]
    out_weights = None if weights is None else _GATHER_ROWS(weights, src, n)[:total]
    return permuted_lengths, out_values, out_weights


@impl("fbgemm::permute_2D_sparse_data")
def _permute_2D_sparse_data(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    if lengths.dim() != 2:
        raise ValueError(f"permute_2D_sparse_data: lengths must be 2-D [features, batch], got {list(lengths.shape)}")
    return _permute_sparse(permute, lengths, values, weights, permuted_lengths_sum, "permute_2D_sparse_data")


@impl("fbgemm::permute_1D_sparse_data")
def _permute_1D_sparse_data(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    if lengths.dim() != 1:
        raise ValueError(f"permute_1D_sparse_data: lengths must be 1-D, got {list(lengths.shape)}")
    return _permute_sparse(permute, lengths, values, weights, permuted_lengths_sum, "permute_1D_sparse_data")


@impl("fbgemm::keyed_jagged_index_select_dim1")
def _keyed_jagged_index_select_dim1(values, lengths, offsets, indices, batch_size, weights=None,
                                    selected_lengths_sum=None):
    what = "keyed_jagged_index_select_dim1"
    batch_size = int(batch_size)
    if batch_size <= 0 or lengths.shape[0] % batch_size:
        raise ValueError(f"{what}: {lengths.shape[0]} lengths are not a whole number of batches of {batch_size}")
    keys = lengths.shape[0] // batch_size
    # output segment s = (key k, position j) reads input segment k * batch_size + indices[j]
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what}: indices must be int32 or int64, not {indices.dtype}")
    sel = (torch.arange(keys, device=indices.device).unsqueeze(1) * batch_size
           + _take(torch.arange(batch_size, device=indices.device), indices, batch_size, what).unsqueeze(0)).reshape(-1)
    out_lengths = lengths.index_select(0, sel)
    out_off = fbgemm.asynchronous_complete_cumsum(out_lengths.long())
    total = int(out_off[-1].item()) if selected_lengths_sum is None else int(selected_lengths_sum)
    src = _EXPAND(offsets.long().index_select(0, sel), out_off, _bucket(total), total)
    out = [_GATHER_ROWS(values, src, values.shape[0])[:total], out_lengths]
    if weights is not None:
        out.append(_GATHER_ROWS(weights, src, values.shape[0])[:total])
    return out
