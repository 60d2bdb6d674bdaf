"""fbgemm's jagged and KJT ops on tpu (torchtpu/jagged.py) against fbgemm on CPU: values and
gradients, the jagged total length bucketed (one program per bucket), bad offsets named, and no
CPU fallback."""

import pytest
import torch

import torchtpu
import torchtpu_rec  # noqa: F401  (installs the fbgemm kernels)
from torchtpu import metrics
from torchtpu.bucketing import BucketPolicy
from torchtpu import jagged

fb = torch.ops.fbgemm
TPU = "tpu"


@pytest.fixture(autouse=True)
def no_fallback():
    before = dict(metrics.snapshot()["cpu_fallbacks"])
    yield
    after = metrics.snapshot()["cpu_fallbacks"]
    grown = {op: n for op, n in after.items() if n != before.get(op, 0)}
    assert not grown, f"ran on the CPU fallback: {grown}"


def _offsets(lengths):
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])


def _tpu(x):
    return [t.to(TPU) for t in x] if isinstance(x, list) else x.to(TPU)


def _close(a, b):
    assert a.device.type == "tpu"
    torch.testing.assert_close(a.cpu(), b)


LENGTHS = [3, 0, 5, 1, 7]  # the last segment is longer than max_length 6: fbgemm cuts it


@pytest.mark.parametrize("inner", [(1,), (4,)])
def test_jagged_to_padded_dense_and_back(inner):
    off = _offsets(LENGTHS)
    values = torch.randn(int(off[-1]), *inner, dtype=torch.float32)
    want = fb.jagged_to_padded_dense(values, [off], [6], -1.5)
    _close(fb.jagged_to_padded_dense(_tpu(values), [_tpu(off)], [6], -1.5), want)
    dense = torch.randn(len(LENGTHS), 6, *inner)
    want_j = fb.dense_to_jagged(dense, [off])[0]
    _close(fb.dense_to_jagged(_tpu(dense), [_tpu(off)])[0], want_j)
    _close(fb.dense_to_jagged(_tpu(dense), [_tpu(off)], int(off[-1]) + 3)[0],
           fb.dense_to_jagged(dense, [off], int(off[-1]) + 3)[0])


def test_two_jagged_dims():
    outer = _offsets([2, 0, 3])  # 3 rows of 2, 0, 3 sub-rows
    inner = _offsets([1, 4, 2, 0, 3])  # 5 sub-rows
    values = torch.randn(int(inner[-1]), 2)
    want = fb.jagged_to_padded_dense(values, [outer, inner], [3, 4], 0.0)
    _close(fb.jagged_to_padded_dense(_tpu(values), [_tpu(outer), _tpu(inner)], [3, 4], 0.0), want)
    dense = torch.randn(3, 3, 4, 2)
    _close(fb.dense_to_jagged(_tpu(dense), [_tpu(outer), _tpu(inner)])[0], fb.dense_to_jagged(dense, [outer, inner])[0])


def test_grads_match_fbgemm():
    off = _offsets(LENGTHS)
    n = int(off[-1])
    values = torch.randn(n, 3)
    dense = torch.randn(len(LENGTHS), 6, 3)
    up = torch.randn(len(LENGTHS), 6, 3)

    def run(dev):
        v = values.to(dev).requires_grad_()
        d = dense.to(dev).requires_grad_()
        o = off.to(dev)
        loss = (fb.jagged_to_padded_dense(v, [o], [6]) * up.to(dev)).sum()
        loss = loss + fb.dense_to_jagged(d, [o])[0].pow(2).sum()
        prod, _ = fb.jagged_dense_elementwise_mul(v, [o], d)
        loss = loss + (prod * 0.5).sum()
        added, _ = fb.jagged_dense_elementwise_add_jagged_output(v, [o], d)
        loss = loss + added.sin().sum()
        loss.backward()
        return loss.detach(), v.grad, d.grad

    for got, want in zip(run(TPU), run("cpu")):
        _close(got, want)


def test_elementwise_ops():
    off = _offsets(LENGTHS)
    x = torch.randn(int(off[-1]), 4)
    y = torch.randn(len(LENGTHS), 6, 4)
    _close(fb.jagged_dense_elementwise_add(_tpu(x), [_tpu(off)], _tpu(y)), fb.jagged_dense_elementwise_add(x, [off], y))
    _close(fb.jagged_dense_elementwise_add_jagged_output(_tpu(x), [_tpu(off)], _tpu(y))[0],
           fb.jagged_dense_elementwise_add_jagged_output(x, [off], y)[0])
    _close(fb.jagged_dense_elementwise_mul(_tpu(x), [_tpu(off)], _tpu(y))[0], fb.jagged_dense_elementwise_mul(x, [off], y)[0])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cumsums(dtype):
    t = torch.tensor([3, 0, 2, 5], dtype=dtype)
    for op in (fb.asynchronous_complete_cumsum, fb.asynchronous_exclusive_cumsum, fb.asynchronous_inclusive_cumsum):
        _close(op(_tpu(t)), op(t))
    t2 = torch.tensor([[1, 2, 3], [4, 0, 6]], dtype=dtype)
    _close(fb.asynchronous_complete_cumsum(_tpu(t2)), fb.asynchronous_complete_cumsum(t2))


def test_segment_sum_csr():
    csr = torch.tensor([0, 1, 1, 4, 5])
    values = torch.randn(12)
    _close(fb.segment_sum_csr(2, _tpu(csr), _tpu(values)), fb.segment_sum_csr(2, csr, values))


def test_permutes_and_expand():
    lengths = torch.tensor([[1, 2, 0], [0, 3, 1], [2, 1, 4]], dtype=torch.int32)
    values = torch.arange(int(lengths.sum())) * 10
    weights = torch.randn(int(lengths.sum()))
    perm = torch.tensor([2, 0, 2], dtype=torch.int32)
    got = fb.permute_2D_sparse_data(_tpu(perm), _tpu(lengths), _tpu(values), _tpu(weights), None)
    want = fb.permute_2D_sparse_data(perm, lengths, values, weights, None)
    for g, w in zip(got, want):
        _close(g, w)
    flat = lengths.reshape(-1)
    perm1 = torch.tensor([8, 0, 4, 4, 1], dtype=torch.int32)
    got = fb.permute_1D_sparse_data(_tpu(perm1), _tpu(flat), _tpu(values), None, None)
    want = fb.permute_1D_sparse_data(perm1, flat, values, None, None)
    _close(got[0], want[0])
    _close(got[1], want[1])
    assert got[2] is None
    in_off = _offsets([2, 3, 1]).int()
    perm2 = torch.tensor([1, 0, 2], dtype=torch.int32)
    out_off = _offsets([3, 2, 1]).int()
    _close(fb.expand_into_jagged_permute(_tpu(perm2), _tpu(in_off), _tpu(out_off), 6),
           fb.expand_into_jagged_permute(perm2, in_off, out_off, 6))


def test_kjt_permute_on_tpu():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c"], values=torch.arange(10), lengths=torch.tensor([1, 2, 0, 3, 2, 2]),
        weights=torch.arange(10.0))
    want = kjt.permute([2, 0])
    got = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=_tpu(kjt.values()), lengths=_tpu(kjt.lengths()),
                                              weights=_tpu(kjt.weights())).permute([2, 0])
    assert got.keys() == want.keys()
    _close(got.values(), want.values())
    _close(got.lengths(), want.lengths())
    _close(got.weights(), want.weights())


def _keyed_select_reference(values, lengths, indices, batch_size, weights=None):
    keys = lengths.shape[0] // batch_size
    segs = list(torch.split(values, lengths.tolist()))
    wsegs = list(torch.split(weights, lengths.tolist())) if weights is not None else None
    order = [k * batch_size + int(i) for k in range(keys) for i in indices]
    out = [torch.cat([segs[s] for s in order]), lengths[order]]
    if weights is not None:
        out.append(torch.cat([wsegs[s] for s in order]))
    return out


def test_keyed_jagged_index_select_dim1():
    # fbgemm's CPU build has no kernel for it (CUDA only): the reference is the definition in torch
    lengths = torch.tensor([1, 2, 0, 3, 2, 1, 1, 0])
    values = torch.randn(int(lengths.sum()))
    weights = torch.randn(int(lengths.sum()))
    offsets = _offsets(lengths.tolist())
    indices = torch.tensor([3, 0, 3, 1])
    got = fb.keyed_jagged_index_select_dim1(_tpu(values), _tpu(lengths), _tpu(offsets), _tpu(indices), 4, _tpu(weights))
    for g, w in zip(got, _keyed_select_reference(values, lengths, indices, 4, weights)):
        _close(g, w)
    got = fb.keyed_jagged_index_select_dim1(_tpu(values), _tpu(lengths), _tpu(offsets), _tpu(indices), 4)
    assert len(got) == 2


def test_total_length_is_bucketed():
    jagged.set_total_length_policy(BucketPolicy.pow2(16, 1 << 20, name="test_jagged"))
    try:
        misses = lambda: metrics.snapshot()["cache_misses"].get("torchtpu_jagged::to_dense", 0)  # noqa: E731
        before = misses()
        outs = []
        for lengths in ([5, 9, 3], [6, 8, 7], [1, 1, 20]):  # totals 17, 21, 22: one bucket (32)
            off = _offsets(lengths)
            values = torch.randn(int(off[-1]), 2)
            outs.append((fb.jagged_to_padded_dense(_tpu(values), [_tpu(off)], [10]),
                         fb.jagged_to_padded_dense(values, [off], [10])))
        for got, want in outs:
            _close(got, want)
        assert misses() - before == 1
    finally:
        jagged.set_total_length_policy(BucketPolicy.pow2(16, 1 << 30, name="jagged_total_length"))


@pytest.mark.parametrize("offsets, problem", [
    ([0, 3, 2, 6], "offsets are not non-decreasing"),
    ([0, 2, 2, 9], "offsets point past the values' length (offset 9)"),
])
def test_bad_offsets_name_the_problem(offsets, problem):
    values = torch.randn(6, 2).to(TPU)
    out = fb.jagged_to_padded_dense(values, [torch.tensor(offsets).to(TPU)], [4])
    with pytest.raises(torchtpu.DeviceIndexError, match="jagged_to_padded_dense") as e:
        out.cpu()
    assert problem in str(e.value)
    dense = torch.randn(3, 4, 2).to(TPU)
    with pytest.raises(torchtpu.DeviceIndexError, match="dense_to_jagged"):
        fb.dense_to_jagged(dense, [torch.tensor(offsets).to(TPU)], 6)[0].cpu()


def test_bad_arguments_are_refused_at_once():
    values = torch.randn(6, 2).to(TPU)
    off = _offsets([2, 4]).to(TPU)
    with pytest.raises(ValueError, match="1 offsets tensors but 2 max_lengths"):
        fb.jagged_to_padded_dense(values, [off], [4, 4])
    with pytest.raises(TypeError, match="offsets must be int32 or int64"):
        fb.jagged_to_padded_dense(values, [off.float()], [4])
    with pytest.raises(TypeError, match="BucketPolicy"):
        jagged.set_total_length_policy(16)


@pytest.mark.parametrize("mode", ["strict_eager", "defer_and_fuse"])
def test_execution_modes(mode):
    off = _offsets(LENGTHS)
    values = torch.randn(int(off[-1]), 3)
    dense = torch.randn(len(LENGTHS), 6, 3)

    def run(dev):
        v = values.to(dev).requires_grad_()
        prod, _ = fb.jagged_dense_elementwise_mul(v, [off.to(dev)], dense.to(dev))
        padded = fb.jagged_to_padded_dense(prod, [off.to(dev)], [6])
        padded.square().sum().backward()
        return padded.detach(), v.grad

    with torchtpu.execution_mode(mode):
        got = run(TPU)
    for g, w in zip(got, run("cpu")):
        _close(g, w)
    with torchtpu.execution_mode(mode):
        bad = fb.jagged_to_padded_dense(values.to(TPU), [torch.tensor([0, 4, 2, 3, 9, 16]).to(TPU)], [6])
    with pytest.raises(torchtpu.DeviceIndexError, match="not non-decreasing"):
        bad.cpu()
