"""The dynamic-shape bucketing layer: policies, padding helpers, per-bucket compile counts."""

import dataclasses
import itertools
import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchtpu
from torchtpu import metrics
from torchtpu.runtime import modes
from torchtpu.bucketing import (
    BucketOverflowError,
    BucketPolicy,
    RecompileWarning,
    bucket_scope,
    pad_jagged,
    pad_sequences,
    pad_to_bucket,
    set_recompile_warning_threshold,
    split_to_buckets,
)

FAST = settings(max_examples=60, deadline=None)
MODES = modes.MODES


@pytest.fixture(params=MODES)
def mode(request):
    with torchtpu.execution_mode(request.param):
        yield request.param


def overflows():
    return metrics.snapshot()["bucket_overflows"]


# ================================================================ policies
def test_constructors_give_the_documented_buckets():
    assert BucketPolicy.pow2(8, 512).buckets == (8, 16, 32, 64, 128, 256, 512)
    assert BucketPolicy.pow2(1, 100).buckets == (1, 2, 4, 8, 16, 32, 64, 100)
    assert BucketPolicy.pow2(5, 5).buckets == (5,)
    assert BucketPolicy.linear(64, 200).buckets == (64, 128, 192, 200)
    assert BucketPolicy.linear(10, 35, start=5).buckets == (5, 15, 25, 35)
    assert BucketPolicy.explicit([32, 8, 8, 16]).buckets == (8, 16, 32)
    for bad in (lambda: BucketPolicy.pow2(0, 8), lambda: BucketPolicy.pow2(9, 8), lambda: BucketPolicy.explicit([]),
                lambda: BucketPolicy.explicit([0, 4]), lambda: BucketPolicy.linear(0, 8),
                lambda: BucketPolicy.pow2(1, 8, overflow="wrap")):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        BucketPolicy.explicit([1.5])


def test_policies_are_immutable_hashable_and_readable():
    a, b = BucketPolicy.pow2(8, 512), BucketPolicy.explicit([8, 16, 32, 64, 128, 256, 512])
    assert a == b and hash(a) == hash(b)  # same buckets, same behaviour
    assert {a: 1}[b] == 1
    assert a != a.with_overflow("truncate") and a != a.named("seq")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.buckets = (1,)
    r = repr(BucketPolicy.pow2(8, 512, overflow="split", name="seq"))
    assert r.startswith("BucketPolicy.pow2(8, 512, overflow='split', name='seq')") and "[8, 16, 32" in r
    assert "..." in repr(BucketPolicy.linear(1, 100))  # long lists are abbreviated
    assert a.largest == 512 and len(a) == 7 and 64 in a and 65 not in a and list(a)[0] == 8


policies = st.one_of(
    st.builds(lambda lo, span: BucketPolicy.pow2(lo, lo + span), st.integers(1, 64), st.integers(0, 2000)),
    st.builds(lambda step, span: BucketPolicy.linear(step, step + span), st.integers(1, 64), st.integers(0, 2000)),
    st.builds(BucketPolicy.explicit, st.lists(st.integers(1, 3000), min_size=1, max_size=12)),
)


@FAST
@given(policies, st.data())
def test_bucket_is_the_smallest_bucket_at_least_n_and_monotone(policy, data):
    n1 = data.draw(st.integers(0, policy.largest))
    n2 = data.draw(st.integers(n1, policy.largest))
    b1, b2 = policy.bucket(n1), policy.bucket(n2)
    assert b1 >= n1 and b1 in policy.buckets
    assert not any(n1 <= b < b1 for b in policy.buckets), "a smaller bucket would have held n"
    assert b1 <= b2


def _brute_force_padding(sizes, k):
    distinct = sorted({max(1, s) for s in sizes})
    best = None
    for r in range(min(k, len(distinct))):
        for inner in itertools.combinations(distinct[:-1], r):
            cost = BucketPolicy.explicit(list(inner) + [distinct[-1]]).padding(sizes).padded
            best = cost if best is None else min(best, cost)
    return best


@FAST
@given(st.lists(st.integers(0, 60), min_size=1, max_size=30), st.integers(1, 5))
def test_fit_is_optimal(sizes, k):
    p = BucketPolicy.fit(sizes, k)
    assert len(p) <= k and p.largest == max(1, max(sizes))
    assert p.padding(sizes).padded == _brute_force_padding(sizes, k)


@FAST
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300))
def test_fit_never_pads_more_than_pow2_with_the_same_number_of_buckets(sizes):
    p2 = BucketPolicy.pow2(min(sizes), max(sizes))
    fit = BucketPolicy.fit(sizes, len(p2))
    assert len(fit) <= len(p2)
    assert fit.padding(sizes).padded <= p2.padding(sizes).padded


def test_fit_options_and_inputs():
    sizes = [3, 3, 3, 10, 10, 50]
    assert BucketPolicy.fit(sizes, 3).buckets == (3, 10, 50)
    assert BucketPolicy.fit({3: 3, 10: 2, 50: 1}, 3) == BucketPolicy.fit(torch.tensor(sizes), 3)
    assert BucketPolicy.fit(sizes, 2).buckets == (10, 50)  # 3 x 7 padding beats 2 x 40
    m8 = BucketPolicy.fit(sizes, 3, multiple_of=8)
    assert m8.buckets == (8, 16, 56) and all(b % 8 == 0 for b in m8.buckets)
    headroom = BucketPolicy.fit(sizes, 3, max_size=128)
    assert headroom.largest == 128 and headroom.bucket(100) == 128
    with pytest.raises(ValueError, match="below the largest observed"):
        BucketPolicy.fit(sizes, 3, max_size=20)
    with pytest.raises(ValueError):
        BucketPolicy.fit([], 3)
    with pytest.raises(TypeError):
        BucketPolicy.fit([1.5, 2.0], 3)
    with pytest.raises(ValueError):
        BucketPolicy.fit([-1, 2], 3)
    assert "fit(<6 sizes>, 3" in repr(BucketPolicy.fit(sizes, 3))


def test_fit_scales_to_many_distinct_sizes():
    g = torch.Generator().manual_seed(0)
    sizes = torch.clamp(torch.exp(torch.randn(20000, generator=g) + 5).long(), 1, 8192)
    p = BucketPolicy.fit(sizes, 8)
    p2 = BucketPolicy.pow2(1, 8192)
    assert len(p) == 8
    assert p.padding(sizes).overhead < p2.padding(sizes).overhead  # fewer buckets and less padding


def test_overflow_error_names_size_and_largest_bucket():
    p = BucketPolicy.pow2(8, 64)
    with pytest.raises(BucketOverflowError, match=r"size 100 is above the largest bucket 64"):
        p.bucket(100)
    with pytest.raises(ValueError):
        p.bucket(-1)


def test_overflow_truncate_and_split_are_counted():
    t = BucketPolicy.pow2(8, 64, overflow="truncate", name="seqtest")
    before = overflows().get("seqtest:truncate", 0)
    assert t.bucket(100) == 64 and t.bucket(64) == 64
    assert overflows()["seqtest:truncate"] == before + 1
    s = BucketPolicy.pow2(8, 64, overflow="split")
    before = overflows().get("split", 0)
    assert s.bucket(150) == 192  # whole chunks of the largest bucket
    assert overflows()["split"] == before + 1
    assert s.chunks(150) == [(0, 64, 64), (64, 64, 64), (128, 22, 32)]
    assert s.chunks(5) == [(0, 5, 8)]


def test_padding_stats():
    st_ = BucketPolicy.explicit([4, 8]).padding([1, 4, 5, 8])
    assert (st_.real, st_.padded, st_.buckets_used) == (18, 24, {4: 2, 8: 2})
    assert st_.overhead == pytest.approx(24 / 18 - 1)


# ================================================================ padding helpers
@FAST
@given(st.data())
def test_pad_to_bucket_mask_is_exact(data):
    ndim = data.draw(st.integers(1, 3))
    shape = data.draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim))
    dim = data.draw(st.integers(-ndim, ndim - 1))
    side = data.draw(st.sampled_from(["right", "left"]))
    policy = BucketPolicy.explicit(data.draw(st.lists(st.integers(9, 20), min_size=1, max_size=3)))
    x = torch.randn(shape)
    padded, mask = pad_to_bucket(x, dim, policy, value=float("nan"), side=side)
    n, b = x.shape[dim], policy.bucket(x.shape[dim])
    assert padded.shape[dim] == b and mask.shape == (b,) and mask.dtype == torch.bool
    assert int(mask.sum()) == n
    assert mask.tolist() == ([True] * n + [False] * (b - n) if side == "right" else [False] * (b - n) + [True] * n)
    idx = mask.nonzero().reshape(-1)
    torch.testing.assert_close(padded.index_select(dim, idx), x)
    assert padded.index_select(dim, (~mask).nonzero().reshape(-1)).isnan().all()


def test_pad_to_bucket_on_tpu_matches_cpu(mode):
    p = BucketPolicy.pow2(4, 32)
    x = torch.randn(3, 13, 2)
    for dim, side, value in [(1, "right", 0.0), (1, "left", -1.5), (0, "right", 7.0), (-1, "left", 0.0)]:
        pc, mc = pad_to_bucket(x, dim, p, value, side=side)
        pt, mt = pad_to_bucket(x.to("tpu"), dim, p, value, side=side)
        assert pt.device.type == "tpu" and mt.device.type == "tpu"
        torch.testing.assert_close(pt.cpu(), pc)
        assert torch.equal(mt.cpu(), mc)
    ints = torch.arange(5)
    assert torch.equal(pad_to_bucket(ints.to("tpu"), 0, p, -1)[0].cpu(), torch.tensor([0, 1, 2, 3, 4, -1, -1, -1]))


def test_pad_to_bucket_keeps_autograd():
    x = torch.randn(5, requires_grad=True)
    padded, mask = pad_to_bucket(x, 0, BucketPolicy.explicit([8]))
    (padded * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(5.0))


def test_pad_to_bucket_truncates_and_splits():
    x = torch.arange(10)
    t = BucketPolicy.explicit([4, 6], overflow="truncate")
    before = overflows().get("truncated_values", 0)
    assert pad_to_bucket(x, 0, t)[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert pad_to_bucket(x, 0, t, truncation_side="left")[0].tolist() == [4, 5, 6, 7, 8, 9]
    assert overflows()["truncated_values"] == before + 8
    s = BucketPolicy.explicit([4, 6], overflow="split")
    padded, mask = pad_to_bucket(x, 0, s)
    assert padded.shape == (12,) and int(mask.sum()) == 10
    chunks = split_to_buckets(x, 0, s)
    assert [c.tolist() for c, _ in chunks] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert [m.tolist() for _, m in chunks] == [[True] * 6, [True] * 4]
    with pytest.raises(BucketOverflowError):
        pad_to_bucket(x, 0, BucketPolicy.explicit([4, 6]))


def _seqs(lengths, feat=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (n, *feat), generator=g) for n in lengths]


def test_pad_sequences_layout():
    seqs = _seqs([3, 5, 1])
    b = pad_sequences(seqs, BucketPolicy.pow2(4, 16), BucketPolicy.pow2(2, 8), value=-1)
    assert b.values.shape == (4, 8) and b.batch_size == 3 and b.bucket_key == {"batch": 4, "length": 8}
    assert b.lengths.tolist() == [3, 5, 1, 0]
    for i, s in enumerate(seqs):
        assert b.values[i, : len(s)].tolist() == s.tolist() and (b.values[i, len(s):] == -1).all()
        assert b.attention_mask[i].tolist() == [True] * len(s) + [False] * (8 - len(s))
    assert not b.attention_mask[3].any() and (b.values[3] == -1).all()
    left = pad_sequences(seqs, BucketPolicy.pow2(4, 16), padding_side="left")
    assert left.values.shape == (3, 8)
    assert left.values[0, 5:].tolist() == seqs[0].tolist() and left.attention_mask[0].tolist() == [False] * 5 + [True] * 3
    assert pad_sequences([[1, 2], [3]], BucketPolicy.explicit([4])).values.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]
    assert pad_sequences([[1.5], []], BucketPolicy.explicit([2])).values.dtype == torch.float32
    with pytest.raises(ValueError, match="trailing shape"):
        pad_sequences([torch.zeros(2, 3), torch.zeros(2, 4)], BucketPolicy.explicit([4]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_sequences_tpu_matches_cpu(mode, side):
    lp, bp = BucketPolicy.pow2(2, 16), BucketPolicy.pow2(1, 8)
    for feat in [(), (3,)]:
        seqs = _seqs([3, 7, 2, 7, 1], feat)
        ref = pad_sequences(seqs, lp, bp, side, value=-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecompileWarning)  # the device path compiles a pad per raw length
            on_tpu = pad_sequences([s.to("tpu") for s in seqs], lp, bp, side, value=-2)
        moved = pad_sequences(seqs, lp, bp, side, value=-2, device="tpu")  # padded on the host, moved once
        for got in (on_tpu, moved):
            assert got.values.device.type == "tpu" and got.attention_mask.device.type == "tpu"
            assert torch.equal(got.values.cpu(), ref.values)
            assert torch.equal(got.attention_mask.cpu(), ref.attention_mask)
            assert torch.equal(got.lengths.cpu(), ref.lengths) and got.batch_size == ref.batch_size


def test_pad_sequences_overflow():
    seqs = _seqs([3, 9, 5])
    t = pad_sequences(seqs, BucketPolicy.explicit([4, 6], overflow="truncate"),
                      BucketPolicy.explicit([2], overflow="truncate"), truncation_side="left")
    assert t.values.shape == (2, 6) and t.batch_size == 2 and t.lengths.tolist() == [3, 6]
    assert t.values[1].tolist() == seqs[1][-6:].tolist()
    with pytest.raises(BucketOverflowError, match="size 9"):
        pad_sequences(seqs, BucketPolicy.explicit([4, 6]))


def test_pad_jagged_cpu_and_tpu(mode):
    values = torch.arange(10.0).reshape(5, 2)
    lengths = torch.tensor([2, 0, 3])
    ref = pad_jagged(values, lengths, capacity_policy=BucketPolicy.pow2(2, 8), value=-1)
    assert ref.capacity == 8 and ref.num_values == 5 and ref.dropped == 0
    assert ref.mask.tolist() == [True] * 5 + [False] * 3
    assert ref.offsets.tolist() == [0, 2, 2, 5] and ref.lengths.tolist() == [2, 0, 3]
    assert ref.segment_ids.tolist() == [0, 0, 2, 2, 2, 3, 3, 3]
    torch.testing.assert_close(ref.values[:5], values)
    assert (ref.values[5:] == -1).all()
    same = pad_jagged(values, offsets=[0, 2, 2, 5], capacity_policy=BucketPolicy.pow2(2, 8), value=-1)
    assert torch.equal(same.segment_ids, ref.segment_ids)
    for got in (pad_jagged(values.to("tpu"), lengths.to("tpu"), capacity_policy=BucketPolicy.pow2(2, 8), value=-1),
                pad_jagged(values, lengths, capacity_policy=BucketPolicy.pow2(2, 8), value=-1, device="tpu"),
                pad_jagged(values.to("tpu"), lengths, capacity_policy=BucketPolicy.pow2(2, 8), value=-1, device="tpu")):
        for a, b in zip(got, ref):
            if isinstance(a, torch.Tensor):
                assert a.device.type == "tpu"
                assert torch.equal(a.cpu(), b)
            else:
                assert a == b
    # a segment-sum that ignores padding, the way a pooled embedding lookup uses it
    pooled = torch.zeros(4, 2).index_add_(0, ref.segment_ids, ref.values)[:3]
    torch.testing.assert_close(pooled, torch.stack([values[:2].sum(0), torch.zeros(2), values[2:].sum(0)]))


def test_pad_jagged_overflow():
    values = torch.arange(10)
    p = BucketPolicy.explicit([4, 6], name="ids")
    with pytest.raises(BucketOverflowError, match="10 jagged values"):
        pad_jagged(values, [4, 6], capacity_policy=p)
    before = overflows().get("ids:jagged_dropped", 0)
    j = pad_jagged(values, [4, 6], capacity_policy=p, overflow="drop")
    assert j.dropped == 4 and j.num_values == 6 and j.lengths.tolist() == [4, 2] and j.mask.all()
    assert j.values.tolist() == list(range(6))
    assert overflows()["ids:jagged_dropped"] == before + 4
    with pytest.raises(ValueError, match="cover"):
        pad_jagged(values, [4, 5], capacity_policy=p)
    with pytest.raises(ValueError, match="disagree"):
        pad_jagged(values, [4, 6], [0, 4, 9], capacity_policy=p)


# ================================================================ runtime hooks
def test_bucket_scope_keys_nest_and_count():
    with bucket_scope("seq", 64) as k1:
        with bucket_scope(batch=8) as k2:
            with bucket_scope(seq=32) as k3:
                assert metrics.current_bucket_key() == k3
        assert metrics.current_bucket_key() == k1
    assert (k1, k2, k3) == ("seq=64", "seq=64,batch=8", "batch=8,seq=32")
    assert metrics.current_bucket_key() is None
    with pytest.raises(TypeError):
        bucket_scope()
    x = torch.full((3, 11), 0.25, dtype=torch.float64).to("tpu")
    before = metrics.snapshot()
    with bucket_scope(test_scope="a"):
        y = torch.atan2(x, x + 1)  # a fresh key: one executable per op
        y.cpu()
    after = metrics.snapshot()
    misses = after["misses_by_bucket"]["test_scope=a"]
    assert sum(misses.values()) >= 1 and after["compiles_by_bucket"]["test_scope=a"] >= 1
    assert sum(after["cache_misses"].values()) - sum(before["cache_misses"].values()) == sum(misses.values()) - sum(
        before["misses_by_bucket"].get("test_scope=a", {}).values())


def test_recompile_warning_fires_once_naming_the_op():
    metrics.reset()
    set_recompile_warning_threshold(3)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in range(1001, 1007):  # six fresh shapes of one op
                torch.full((n, 3), 0.5, dtype=torch.float64).to("tpu").atan().cpu()
        rec = [w for w in caught if issubclass(w.category, RecompileWarning)]
        assert len(rec) == 1, [str(w.message) for w in rec]
        msg = str(rec[0].message)
        assert "aten::atan" in msg and "BucketPolicy" in msg and "threshold 3" in msg
        assert rec[0].filename == __file__  # points at the user's line
        assert metrics.snapshot()["cache_misses"]["aten::atan"] == 6
    finally:
        set_recompile_warning_threshold(16)


def test_recompile_warning_suggests_a_policy_from_the_shapes_it_saw():
    metrics.reset()
    set_recompile_warning_threshold(4)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (3, 9, 17, 40, 100):
                # shaped like a kernel cache key: (op, ((size, stride, offset), dtype, storage numel), ...)
                key = ("op", ((torch.Size([8, n]), (n, 1), 0), torch.float32, 8 * n),
                       ((torch.Size([4]), (1,), 0), torch.int64, 4), 2.0)
                metrics.record_miss("test::graph", key)
        (w,) = [w for w in caught if issubclass(w.category, RecompileWarning)]
        msg = str(w.message)
        assert "test::graph" in msg and "Dim 1 of input 0 took 5 sizes between 3 and 100" in msg
        assert "BucketPolicy.pow2(2, 100)" in msg
        set_recompile_warning_threshold(None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(50):
                metrics.record_miss("test::other")
        assert not caught
    finally:
        set_recompile_warning_threshold(16)


def _small_step(x, mask):
    y = torch.sin(x * 2.0 + 1.0) * x
    return torch.where(mask[:, None], y, torch.zeros_like(y))


def test_bucketing_bounds_executables_for_random_lengths(mode):
    """50 random lengths through a small tpu computation: one set of executables per bucket, none per length."""
    policy = BucketPolicy.pow2(8, 64)
    rng = random.Random(5)
    lengths = [rng.randint(1, 64) for _ in range(50)]
    assert len(set(lengths)) > 2 * len(policy)
    feat = 5 + MODES.index(mode)  # trailing sizes no other test uses: the executables here are this test's own
    before = metrics.snapshot()
    for i, n in enumerate(lengths):
        x = torch.randn(n, feat, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        padded, mask = pad_to_bucket(x, 0, policy)  # on the host: no device program sees n
        with bucket_scope(test_len=padded.shape[0]):
            out = _small_step(padded.to("tpu"), mask.to("tpu"))
            got = out.cpu()
        if i < 3:
            torch.testing.assert_close(got[:n], _small_step(x, torch.ones(n, dtype=torch.bool)))
            assert (got[n:] == 0).all()
    after = metrics.snapshot()

    def delta(key, field):
        a, b = after[field].get(key, {}), before[field].get(key, {})
        return {op: c - b.get(op, 0) for op, c in a.items() if c - b.get(op, 0)}

    keys = [k for k in after["misses_by_bucket"] if k.startswith("test_len=")]
    assert 1 < len(keys) <= len(policy)
    per_key = [delta(k, "misses_by_bucket") for k in keys]
    assert per_key[0] and all(d == per_key[0] for d in per_key), per_key  # the same executables for every bucket
    total = sum(sum(d.values()) for d in per_key)
    all_misses = sum(after["cache_misses"].values()) - sum(before["cache_misses"].values())
    assert all_misses == total <= len(policy) * sum(per_key[0].values())  # nothing was built outside the buckets
    compiles = [after["compiles_by_bucket"].get(k, 0) - before["compiles_by_bucket"].get(k, 0) for k in keys]
    # XLA compiles per bucket are a constant (the first bucket may also pay a few one-time ones)
    assert min(compiles) >= 1 and max(compiles) - min(compiles) <= 2, compiles
    # without bucketing every new length builds the whole set again: a few lengths already exceed all buckets
    start = sum(metrics.snapshot()["cache_misses"].values())
    raw = [n for n in sorted(set(lengths)) if n not in policy][: len(policy) + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecompileWarning)
        for n in raw:
            x = torch.ones(n, feat, dtype=torch.float64).to("tpu")
            _small_step(x, torch.ones(n, dtype=torch.bool).to("tpu")).cpu()
    assert sum(metrics.snapshot()["cache_misses"].values()) - start > total


# ---------------------------------------------------------------- the compile-storm policy (dispatch/storm.py)
_storm_lib = torch.library.Library("torchtpu_storm_test", "DEF")
_storm_lib.define("twice(Tensor x) -> Tensor")
_storm_lib.impl("twice", lambda x: x * 2, "CPU")
_storm_lib.impl("twice", lambda x: torch.empty_like(x), "Meta")


@pytest.fixture
def storm_op():
    """A fresh op (its own executable cache) with a tpu lowering and a CPU kernel."""
    from torchtpu.dispatch import install, lowering

    if "torchtpu_storm_test::twice.default" not in lowering.LOWERINGS:
        lowering.lower("torchtpu_storm_test::twice")(lambda x: x * 2)
        install.install()
    yield torch.ops.torchtpu_storm_test.twice
    torchtpu.set_shape_storm_policy(None)  # the suite runs with the policy off (tests/conftest.py)


def _twice_on(n, dtype=torch.float32):
    x = torch.arange(n, dtype=dtype)
    got = torch.ops.torchtpu_storm_test.twice(x.to("tpu"))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), x * 2)


def test_storm_policy_stops_compiling_new_small_shapes(storm_op):
    torchtpu.set_shape_storm_policy(executables=3, max_numel=1000, compile_after=2)
    metrics.reset()
    for n in range(1, 41):  # 40 distinct small shapes
        _twice_on(n)
    snap = metrics.snapshot()
    assert snap["cache_misses"]["torchtpu_storm_test::twice"] == 3  # then no more executables
    assert snap["shape_generic_calls"]["torchtpu_storm_test::twice"] == 37
    assert not snap["cpu_fallbacks"]
    _twice_on(20)  # a shape met again is worth its executable
    assert metrics.snapshot()["cache_misses"]["torchtpu_storm_test::twice"] == 4
    _twice_on(2000)  # large tensors always compile
    _twice_on(300, torch.float64)  # so does any op with the CPU fallback off
    torchtpu.set_cpu_fallback(False)
    try:
        _twice_on(301, torch.float64)
    finally:
        torchtpu.set_cpu_fallback(True)
    snap = metrics.snapshot()
    assert snap["cache_misses"]["torchtpu_storm_test::twice"] == 6
    assert snap["shape_generic_calls"]["torchtpu_storm_test::twice"] == 38


def test_storm_policy_leaves_pending_inputs_to_defer_and_fuse(storm_op):
    def pending(n):  # an add whose executable exists: recorded, its result pending
        return torch.arange(n, dtype=torch.float32).to("tpu") + 1

    with torchtpu.execution_mode("defer_and_fuse"):
        for n in (5, 6):
            pending(n).cpu()
    _twice_on(1)
    torchtpu.set_shape_storm_policy(executables=1, max_numel=1000)
    metrics.reset()
    with torchtpu.execution_mode("defer_and_fuse"):
        for n in (5, 6):  # a new shape of a pending input is recorded (running it would flush)
            torch.testing.assert_close(storm_op(pending(n)).cpu(), (torch.arange(n) + 1.0) * 2)
        _twice_on(7)  # a new shape of a concrete input runs shape-generically
    snap = metrics.snapshot()
    assert snap["shape_generic_calls"] == {"torchtpu_storm_test::twice": 1}
    assert snap["cache_misses"]["torchtpu_storm_test::twice"] == 2
    assert "materialize" not in snap["flushes"]


def test_storm_policy_runs_in_place_ops_with_cpu_semantics(storm_op):
    torchtpu.set_shape_storm_policy(executables=1, max_numel=1 << 16, compile_after=100)
    metrics.reset()
    for n in range(3, 13):
        idx = torch.tensor([0, n - 1, 0, 1])
        v = torch.arange(4.0) + n
        want = torch.zeros(n).index_put_((idx,), v, accumulate=True)
        x = torch.zeros(n, device="tpu")
        view = x[1:]  # the base sees the write made through the policy's CPU path
        out = x.index_put_((idx.to("tpu"),), v.to("tpu"), accumulate=True)
        assert out is x
        torch.testing.assert_close(x.cpu(), want)
        torch.testing.assert_close(view.cpu(), want[1:])
    assert metrics.snapshot()["shape_generic_calls"]["aten::index_put_"] >= 9
