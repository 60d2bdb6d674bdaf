"""PyTorch parity of errors and warnings: the same call on CPU and on tpu raises the same exception
type with the same leading message, emits the same warnings, and (when it succeeds) gives the same
value. Shape, dtype and index errors are PyTorch's own, raised before JAX sees the bad input."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torchtpu

# each case: name -> fn(device) building its inputs on ``device`` and calling the op
CASES = {}


def case(name):
    def deco(fn):
        assert name not in CASES, name
        CASES[name] = fn
        return fn

    return deco


def t(data, d, dtype=None):
    return torch.tensor(data, dtype=dtype, device=d)


def z(*shape, d, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=d)


def ar(*shape, d, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, device=d).to(dtype).reshape(shape)


def _setitem(x, idx, v):
    x[idx] = v
    return x


# ---------------------------------------------------------------- advanced indexing
case("index_float_index")(lambda d: z(5, d=d)[t([0.0], d)])
case("index_too_many")(lambda d: z(5, d=d)[t([0], d), t([0], d)])
case("index_shapes_do_not_broadcast")(lambda d: z(5, 5, d=d)[t([0, 1], d), t([0, 1, 2], d)])
case("index_empty_dim")(lambda d: z(0, 3, d=d)[t([0], d)])
case("index_empty_index_of_empty_dim")(lambda d: z(0, 3, d=d)[t([], d, torch.long)])
case("index_mask_shape")(lambda d: z(3, d=d)[t([True, False], d)])
case("index_mask_2d_shape")(lambda d: z(3, 4, d=d)[z(3, 3, d=d, dtype=torch.bool)])
case("index_uint8_mask_deprecated")(lambda d: ar(3, d=d)[t([1, 0, 1], d, torch.uint8)])
case("index_cpu_index_out_of_range")(lambda d: z(3, d=d)[torch.tensor([5])])
case("index_cpu_index_negative_out_of_range")(lambda d: z(3, d=d)[torch.tensor([-4])])
case("index_cpu_index_out_of_range_2nd_dim")(lambda d: z(2, 3, d=d)[:, torch.tensor([3])])
case("index_cpu_index_out_of_range_two_dims")(lambda d: z(2, 3, 4, d=d)[torch.tensor([0]), :, torch.tensor([4])])
case("index_0d_tensor")(lambda d: z(d=d)[t([0], d)])
case("index_int_out_of_range")(lambda d: z(2, 3, d=d)[5])
case("index_negative_step")(lambda d: z(5, d=d)[::-1])
case("index_ok_mixed")(lambda d: ar(3, 4, 5, d=d)[t([0, 2], d), :, t([1, 4], d)])
case("index_ok_mask")(lambda d: ar(3, 4, d=d)[ar(3, 4, d=d) > 5])
case("index_put_value_shape")(lambda d: z(5, d=d).index_put_((t([0, 1], d),), torch.ones(3, device=d)))
case("index_put_accumulate_value_shape")(
    lambda d: z(5, d=d).index_put_((t([0, 1], d),), torch.ones(3, device=d), accumulate=True))
case("index_put_dtype")(lambda d: z(5, d=d).index_put_((t([0, 1], d),), torch.ones(2, device=d, dtype=torch.float64)))
case("index_put_too_many")(lambda d: z(5, d=d).index_put_((t([0], d), t([0], d)), t(1.0, d)))
case("index_put_cpu_index_out_of_range")(lambda d: z(5, d=d).index_put_((torch.tensor([7]),), t(1.0, d)))
case("index_put_expanded_deprecated")(lambda d: z(1, d=d).expand(3).index_put_((t([0], d),), t(1.0, d)))
case("index_put_0d_no_indices")(lambda d: t(1.0, d).index_put_((), t([2.0, 3.0], d)))
case("setitem_mask_value_shape")(lambda d: _setitem(z(5, d=d), t([True, False, True, False, True], d), torch.ones(2, device=d)))
case("setitem_mask_value_dtype")(lambda d: _setitem(z(3, d=d), t([True, False, True], d), torch.ones(2, device=d, dtype=torch.float64)))
case("setitem_slice_value_shape")(lambda d: _setitem(z(5, d=d), slice(0, 2), torch.ones(3, device=d)))
case("setitem_bool_rows_value_shape")(lambda d: _setitem(z(2, 3, d=d), t([True, False], d), torch.ones(2, 3, device=d)))
case("setitem_ok_broadcast")(lambda d: _setitem(z(3, 4, d=d), t([0, 2], d), ar(4, d=d)))
case("index_put_ok_accumulate_dups")(
    lambda d: z(4, d=d).index_put_((t([0, 0, 3], d),), ar(3, d=d), accumulate=True))

# ---------------------------------------------------------------- gathers and scatters
case("index_select_dim")(lambda d: z(5, d=d).index_select(1, t([0], d)))
case("index_select_2d_index")(lambda d: z(5, d=d).index_select(0, t([[0]], d)))
case("index_select_float_index")(lambda d: z(5, d=d).index_select(0, t([0.0], d)))
case("index_select_ok_int32")(lambda d: ar(5, 2, d=d).index_select(0, t([4, 0], d, torch.int32)))
case("gather_index_rank")(lambda d: z(5, d=d).gather(0, t([[0]], d)))
case("gather_index_dtype")(lambda d: z(5, d=d).gather(0, t([0], d, torch.int32)))
case("gather_index_too_large")(lambda d: z(2, 2, d=d).gather(0, torch.zeros(2, 3, dtype=torch.long, device=d)))
case("scatter_index_too_large")(
    lambda d: z(2, 2, d=d).scatter(0, torch.zeros(3, 3, dtype=torch.long, device=d), torch.ones(2, 2, device=d)))
case("scatter_src_dtype")(
    lambda d: z(2, 2, d=d).scatter(0, torch.zeros(2, 2, dtype=torch.long, device=d), torch.ones(2, 2, device=d, dtype=torch.float64)))
case("scatter_add_dim")(lambda d: z(2, 2, d=d).scatter_add(2, t([[0]], d), torch.ones(1, 1, device=d)))
case("take_float_index")(lambda d: z(3, d=d).take(t([0.0], d)))
case("index_add_source_shape")(lambda d: z(3, 2, d=d).index_add(0, t([0], d), torch.ones(2, 2, device=d)))
case("index_copy_index_dtype")(lambda d: z(3, 2, d=d).index_copy(0, t([0], d, torch.int32), torch.ones(1, 2, device=d)))
case("index_fill_dim")(lambda d: z(3, 2, d=d).index_fill(2, t([0], d), 1.0))
case("index_fill_expanded_deprecated")(lambda d: z(1, d=d).expand(3).index_fill_(0, t([0], d), 1.0))
case("masked_fill_mask_dtype")(lambda d: z(3, d=d).masked_fill(t([1, 0, 1], d), 1.0))
case("masked_fill_mask_shape")(lambda d: z(3, d=d).masked_fill(t([True, False], d), 1.0))
case("masked_fill_expanded_deprecated")(lambda d: z(1, d=d).expand(3).masked_fill_(t([True, False, False], d), 1.0))
case("masked_scatter_uint8_mask")(lambda d: z(2, d=d).masked_scatter_(t([1, 0], d, torch.uint8), torch.ones(2, device=d)))
case("masked_select_mask_dtype")(lambda d: z(3, d=d).masked_select(t([1, 0, 1], d)))
case("where_shapes")(lambda d: torch.where(t([True, False], d), z(3, d=d), z(3, d=d)))
case("nonzero_ok")(lambda d: torch.nonzero(ar(2, 3, d=d) % 2))

# ---------------------------------------------------------------- views
case("view_dtype_down")(lambda d: ar(2, 4, d=d).view(torch.uint8))
case("view_dtype_up")(lambda d: ar(2, 8, d=d, dtype=torch.uint8).view(torch.int32))
case("view_dtype_up_last_dim")(lambda d: z(4, 3, d=d, dtype=torch.uint8).view(torch.float32))
case("view_dtype_0d")(lambda d: z(d=d).view(torch.uint8))
case("view_dtype_storage_offset")(lambda d: z(8, d=d, dtype=torch.uint8)[1:5].view(torch.float32))
case("view_dtype_last_stride")(lambda d: z(8, 4, d=d, dtype=torch.uint8).t().view(torch.float32))
case("view_dtype_other_stride")(lambda d: z(4, 6, d=d, dtype=torch.uint8)[:, :4].view(torch.float32))
case("view_dtype_bool_to_uint8")(lambda d: t([True, False, True], d).view(torch.uint8))
case("view_dtype_conj")(lambda d: t([1 + 2j], d).conj().view(torch.float32))
case("view_dtype_float_to_complex")(lambda d: ar(3, 4, d=d).view(torch.complex64))
case("view_bad_shape")(lambda d: z(2, 3, d=d).view(7))
case("view_not_contiguous")(lambda d: z(2, 3, d=d).t().view(6))
case("reshape_bad")(lambda d: z(2, 3, d=d).reshape(4, -1))
case("expand_bad")(lambda d: z(2, 3, d=d).expand(3, 3))
case("permute_dup")(lambda d: z(2, 3, d=d).permute(0, 0))
case("narrow_out_of_range")(lambda d: z(2, 3, d=d).narrow(1, 2, 2))
case("select_out_of_range")(lambda d: z(2, 3, d=d).select(1, 5))
case("squeeze_dim_out_of_range")(lambda d: z(2, 3, d=d).squeeze(3))
case("unsqueeze_dim_out_of_range")(lambda d: z(2, 3, d=d).unsqueeze(4))
case("transpose_dim_out_of_range")(lambda d: z(2, 3, d=d).transpose(0, 2))
case("unflatten_bad")(lambda d: z(6, d=d).unflatten(0, (4, 2)))
case("split_bad_sizes")(lambda d: z(6, d=d).split([2, 2]))
case("chunk_zero")(lambda d: z(6, d=d).chunk(0))
case("diagonal_same_dims")(lambda d: z(2, 2, d=d).diagonal(0, 0, 0))
case("unfold_too_big")(lambda d: z(4, d=d).unfold(0, 5, 1))
case("as_strided_negative_stride")(lambda d: z(4, d=d).as_strided((2,), (-1,)))
case("movedim_dup")(lambda d: z(2, 3, d=d).movedim((0, 0), (0, 1)))
case("view_as_real_not_complex")(lambda d: z(2, d=d).view_as_real())
case("view_as_real_conj")(lambda d: torch.view_as_real(t([1 + 2j], d).conj()))
case("view_as_complex_last_dim")(lambda d: torch.view_as_complex(z(2, 3, d=d)))
case("conj_imag_is_neg_view")(lambda d: t([1 + 2j, 3 - 1j], d).conj().imag)

# ---------------------------------------------------------------- shape ops
case("cat_sizes")(lambda d: torch.cat([z(2, 3, d=d), z(2, 4, d=d)]))
case("cat_dim_out_of_range")(lambda d: torch.cat([z(2, 3, d=d), z(2, 3, d=d)], 2))
case("cat_ranks")(lambda d: torch.cat([z(2, 3, d=d), z(3, d=d)]))
case("stack_sizes")(lambda d: torch.stack([z(2, 3, d=d), z(2, 4, d=d)]))
case("flip_dup")(lambda d: z(2, 2, d=d).flip(0, 0))
case("roll_shifts_dims")(lambda d: z(2, 2, d=d).roll((1, 1), (0,)))
case("repeat_too_few")(lambda d: z(2, 2, d=d).repeat(2))
case("pad_too_negative")(lambda d: torch.nn.functional.pad(z(2, 2, d=d), (-3, 0)))
case("broadcast_to_bad")(lambda d: z(2, 3, d=d).broadcast_to((3, 3)))
case("tril_1d")(lambda d: z(3, d=d).tril())
case("topk_too_big")(lambda d: z(3, d=d).topk(4))

# ---------------------------------------------------------------- reductions
case("sum_dim_out_of_range")(lambda d: z(2, 3, d=d).sum(2))
case("var_no_dof")(lambda d: z(1, d=d).var())
case("std_no_dof_dim")(lambda d: z(2, 3, d=d).std(1, correction=3))
case("var_mean_no_dof_complex")(lambda d: torch.var_mean(z(2, 1, d=d, dtype=torch.complex64), 1))
case("std_mean_no_dof")(lambda d: torch.std_mean(z(1, d=d)))
case("var_ok")(lambda d: ar(2, 3, d=d).var(1))
case("max_empty")(lambda d: z(0, d=d).max())
case("argmax_empty_dim")(lambda d: z(0, 3, d=d).argmax(0))
case("mean_of_long")(lambda d: z(3, d=d, dtype=torch.long).mean())

# ---------------------------------------------------------------- elementwise, out=, dtypes
case("add_shapes")(lambda d: z(2, d=d) + z(3, d=d))
case("add_inplace_result_type")(lambda d: z(2, d=d, dtype=torch.long).add_(1.5))
case("add_inplace_broadcast")(lambda d: z(1, d=d).add_(z(3, d=d)))
case("out_resized_warning")(lambda d: torch.add(ar(3, d=d), 1, out=torch.ones(2, 2, device=d)))
case("out_empty_no_warning")(lambda d: torch.add(ar(3, d=d), 1, out=torch.ones(0, device=d)))
case("out_result_type")(lambda d: torch.add(ar(3, d=d), 1.5, out=torch.ones(3, device=d, dtype=torch.long)))
case("bitwise_float")(lambda d: z(2, d=d) & z(2, d=d))
case("where_uint8_ok_values")(lambda d: torch.where(ar(3, d=d) > 1, ar(3, d=d), -ar(3, d=d)))
case("resize_channels_last_rank")(lambda d: z(2, d=d).resize_(2, 3, 4, memory_format=torch.channels_last))
case("resize_preserve_format")(lambda d: z(2, d=d).resize_(2, 3, 4, 5, memory_format=torch.preserve_format))
case("resize_channels_last_ok")(lambda d: ar(2, d=d).resize_(1, 2, 1, 1, memory_format=torch.channels_last).stride())
case("mm_shapes")(lambda d: z(2, 3, d=d) @ z(2, 3, d=d))
case("matmul_1d_mismatch")(lambda d: z(3, d=d) @ z(4, d=d))


# ---------------------------------------------------------------- the comparison
_IGNORED_WARNINGS = (torchtpu.metrics.RecompileWarning, torchtpu.TPUFallbackWarning)


def _lead(message: str) -> str:
    """The message as compared: its first line, without the C++ location suffix CPU adds."""
    first = str(message).split("\n")[0]
    return re.sub(r" \(Triggered internally at .*\)$", "", first).strip()


def _outcome(fn, device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn(device)
            error = None
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            value, error = None, e
    warned = [_lead(w.message) for w in caught if not issubclass(w.category, _IGNORED_WARNINGS)]
    return value, error, warned


def _to_cpu(v):
    if isinstance(v, torch.Tensor):
        return v.cpu()
    if isinstance(v, (tuple, list)):
        return type(v)(_to_cpu(x) for x in v)
    return v


def compare_with_cpu(fn):
    """Run ``fn`` on CPU and on tpu; assert the same error type and leading message, the same
    warnings and (on success) the same value, dtype and strides."""
    cpu_value, cpu_error, cpu_warned = _outcome(fn, "cpu")
    tpu_value, tpu_error, tpu_warned = _outcome(fn, "tpu")
    if cpu_error is not None:
        assert tpu_error is not None, f"CPU raises {type(cpu_error).__name__}: {cpu_error}; tpu returned {tpu_value!r}"
        assert type(tpu_error) is type(cpu_error) and _lead(tpu_error) == _lead(cpu_error), (
            f"\n  cpu: {type(cpu_error).__name__}: {_lead(cpu_error)}\n  tpu: {type(tpu_error).__name__}: {_lead(tpu_error)}")
    else:
        assert tpu_error is None, f"CPU succeeds; tpu raises {type(tpu_error).__name__}: {tpu_error}"
        got = _to_cpu(tpu_value)
        torch.testing.assert_close(got, cpu_value, rtol=0, atol=0, equal_nan=True)
        if isinstance(tpu_value, torch.Tensor):
            assert tpu_value.device.type == "tpu"
            assert tpu_value.stride() == cpu_value.stride() or tpu_value.numel() <= 1
            assert tpu_value.is_neg() == cpu_value.is_neg() and tpu_value.is_conj() == cpu_value.is_conj()
    assert tpu_warned == cpu_warned, f"\n  cpu warns {cpu_warned}\n  tpu warns {tpu_warned}"


@pytest.mark.parametrize("name", list(CASES))
def test_same_error_warning_and_value_as_cpu(name):
    compare_with_cpu(CASES[name])


# ---------------------------------------------------------------- in-place writes into expanded tensors
case("add_inplace_expanded")(lambda d: z(1, d=d).expand(3).add_(1))
case("copy_into_expanded")(lambda d: z(1, d=d).expand(3).copy_(ar(3, d=d)))
case("index_fill_expanded_values")(lambda d: ar(1, 3, d=d).expand(2, 3).index_fill_(1, t([0], d), -1.0))


# ---------------------------------------------------------------- index values, checked on the device
# (raised at the next host wait, here the .cpu() of the result: PyTorch's message on its first line;
# an IndexError, and a RuntimeError too where CPU raises that)
BOUND_CASES = {
    "take": lambda d: z(3, d=d).take(t([5], d)),
    "take_negative": lambda d: z(3, d=d).take(t([-4], d)),
    "put": lambda d: z(3, d=d).put_(t([3], d), t([1.0], d)),
    "index_select": lambda d: z(3, d=d).index_select(0, t([3], d)),
    "index_select_negative": lambda d: z(3, d=d).index_select(0, t([-1], d)),
    "gather": lambda d: z(3, d=d).gather(0, t([3], d)),
    "scatter": lambda d: z(3, d=d).scatter(0, t([3], d), 1.0),
    "scatter_add": lambda d: z(3, d=d).scatter_add(0, t([3], d), t([1.0], d)),
    "index_add": lambda d: z(3, d=d).index_add(0, t([3], d), t([1.0], d)),
    "index_copy": lambda d: z(3, d=d).index_copy(0, t([3], d), t([1.0], d)),
    "index_fill": lambda d: z(3, d=d).index_fill(0, t([3], d), 1.0),
    "embedding": lambda d: torch.nn.functional.embedding(t([3], d), z(3, 2, d=d)),
    "advanced_index": lambda d: z(2, 3, d=d)[t([0], d), t([3], d)],
    "advanced_index_put": lambda d: z(2, 3, d=d).index_put_((t([2], d),), t(1.0, d)),
    "in_range_ok": lambda d: ar(3, d=d).take(t([-3, 2], d)),
}


@pytest.mark.parametrize("name", list(BOUND_CASES))
def test_device_index_checks_give_cpu_errors(name):
    fn = BOUND_CASES[name]
    cpu_value, cpu_error, _ = _outcome(fn, "cpu")
    tpu_value, tpu_error, _ = _outcome(lambda d: _to_cpu(fn(d)), "tpu")
    if cpu_error is None:
        assert tpu_error is None, tpu_error
        torch.testing.assert_close(tpu_value, cpu_value)
        return
    assert isinstance(tpu_error, torchtpu.DeviceIndexError) and isinstance(tpu_error, type(cpu_error)), tpu_error
    assert _lead(tpu_error) == _lead(cpu_error), f"\n  cpu: {_lead(cpu_error)}\n  tpu: {_lead(tpu_error)}"


# ---------------------------------------------------------------- once-per-process warnings
# PyTorch emits these once per process (TORCH_WARN_ONCE); each runs on tpu first, then on CPU, in a
# fresh process, so neither side has spent its one warning before.
ONCE_CASES = {
    "scatter_reduce_deprecated": "z(2, d=d).scatter(0, t([0], d), torch.ones(1, device=d), reduce='add')",
    "cholesky_deprecated": "torch.cholesky(torch.eye(2, device=d))",
    "triangular_solve_deprecated": "torch.triangular_solve(torch.ones(2, 1, device=d), torch.eye(2, device=d))",
    "copy_complex_to_real": "z(2, d=d).copy_(t([1 + 2j, 3j], d))",
    "where_uint8_condition": "torch.where(t([1, 0], d, torch.uint8), ar(2, d=d), -ar(2, d=d))",
}


def _once_worker(rank, port, tmpdir):
    import sys

    sys.path.insert(0, __import__("os").path.dirname(__file__))
    import test_parity_errors as m
    from helpers import named_checks

    check = named_checks(rank, tmpdir)
    for name, expr in ONCE_CASES.items():
        fn = eval(f"lambda d: {expr}", vars(m))  # noqa: S307 - the expressions above
        check(name, lambda fn=fn: m.compare_with_cpu_tpu_first(fn))


def compare_with_cpu_tpu_first(fn):
    tpu = _outcome(fn, "tpu")
    cpu = _outcome(fn, "cpu")
    assert tpu[2] and tpu[2] == cpu[2], f"cpu warns {cpu[2]}, tpu warns {tpu[2]}"
    torch.testing.assert_close(_to_cpu(tpu[0]), cpu[0], rtol=0, atol=0)


@pytest.fixture(scope="module")
def once_results(tmp_path_factory):
    from helpers import run_spawned

    return run_spawned(_once_worker, 1, tmp_path_factory.mktemp("once"))


@pytest.mark.parametrize("name", list(ONCE_CASES))
def test_once_per_process_warnings_match_cpu(once_results, name):
    from helpers import assert_check

    assert_check(once_results, name, 1)
