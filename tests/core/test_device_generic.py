"""Device-generic tests written PyTorch's way: generic test classes that
``torch.testing._internal.common_device_type.instantiate_device_type_tests`` instantiates for the
tpu device (PrivateUse1; ``only_for`` names it, so no CPU copy of the class runs), each test
computing the same thing on CPU and comparing. They cover views, indexing, type promotion, shape
ops, reductions and in-place semantics.

``torchtpu`` is imported before ``common_device_type``: that module lists the device types to
instantiate for when it is first imported, and sees PrivateUse1 only if ``tpu`` is registered
(``tests/conftest.py`` imports ``torchtpu`` before any test module).
"""

from __future__ import annotations

import warnings

import torchtpu  # noqa: F401  (registers tpu before common_device_type is imported)
import torch
from torch.testing import make_tensor
from torch.testing._internal.common_device_type import dtypes, instantiate_device_type_tests
from torch.testing._internal.common_utils import TestCase

ONLY_TPU = ("tpu",)


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


class TestViewsParity(TestCase):
    @dtypes(torch.float32, torch.int64, torch.bfloat16)
    def test_view_dtype_aliases_storage(self, device, dtype):
        base = make_tensor((2, 3, 8), dtype=dtype, device="cpu", low=-9, high=9)
        t = base.to(device)
        for new in (torch.uint8, torch.int16, torch.int32, torch.float64, torch.complex64):
            if t.shape[-1] * t.element_size() % new.itemsize:
                continue
            v, ref = t.view(new), base.view(new)
            self.assertEqual(v.shape, ref.shape)
            self.assertEqual(v.stride(), ref.stride())
            self.assertEqual(_storage_ptr(v), _storage_ptr(t))
            self.assertEqual(v.cpu(), ref, exact_dtype=True, equal_nan=True)
        # writes through either side are seen by the other
        v, ref = t.view(torch.uint8), base.view(torch.uint8)
        v[0, 0, :4] = 7
        ref[0, 0, :4] = 7
        self.assertEqual(t.cpu(), base, equal_nan=True)
        t[1].zero_()
        base[1].zero_()
        self.assertEqual(v.cpu(), ref)

    def test_view_dtype_checks(self, device):
        for make, dtype, message in (
            (lambda d: torch.zeros(4, 3, dtype=torch.uint8, device=d), torch.float32,
             r"self.size\(-1\) must be divisible by 4"),
            (lambda d: torch.zeros((), device=d), torch.uint8, r"self.dim\(\) cannot be 0"),
            (lambda d: torch.zeros(8, dtype=torch.uint8, device=d)[1:5], torch.float32,
             r"self.storage_offset\(\) must be divisible by 4"),
            (lambda d: torch.zeros(8, 4, dtype=torch.uint8, device=d).t(), torch.float32,
             r"self.stride\(-1\) must be 1"),
        ):
            with self.assertRaisesRegex(RuntimeError, message):
                make("cpu").view(dtype)
            with self.assertRaisesRegex(RuntimeError, message):
                make(device).view(dtype)

    @dtypes(torch.complex64)
    def test_conj_imag_view(self, device, dtype):
        base = make_tensor((4, 5), dtype=dtype, device="cpu")
        t = base.to(device)
        v = t.conj()
        self.assertTrue(v.is_conj() and v._base is t)
        self.assertEqual(v, base.conj())
        v_imag = v.imag
        self.assertTrue(v_imag.is_neg())
        self.assertEqual(_storage_ptr(v_imag), _storage_ptr(t))
        self.assertEqual(v_imag, base.conj().imag)
        v_imag.add_(1)  # through the negative bit: base's imaginary part goes down by one
        base.conj().imag.add_(1)
        self.assertEqual(t, base)
        self.assertEqual((v * 2).resolve_conj(), base.conj() * 2)

    @dtypes(torch.float32, torch.int64)
    def test_writes_through_views_reach_the_base(self, device, dtype):
        base = make_tensor((4, 6), dtype=dtype, device="cpu", low=-5, high=5)
        t = base.to(device)
        for view in (lambda x: x.t(), lambda x: x.narrow(1, 2, 3), lambda x: x.select(0, 2),
                     lambda x: x.diagonal(), lambda x: x.unfold(1, 2, 2), lambda x: x[1:, ::2],
                     lambda x: x.as_strided((2, 2), (1, 6), 3), lambda x: x.view(2, 12)[1]):
            view(t).mul_(2).add_(1)
            view(base).mul_(2).add_(1)
            self.assertEqual(t, base)
            self.assertEqual(view(t), view(base))

    def test_memory_formats_follow_cpu(self, device):
        base = make_tensor((2, 3, 4, 5), dtype=torch.float32, device="cpu")
        t = base.to(device)
        cl = torch.channels_last
        for fn, same_values in (
            (lambda x: x.to(memory_format=cl), True), (lambda x: x.contiguous(memory_format=cl), True),
            (lambda x: x.clone(memory_format=cl), True), (lambda x: torch.empty_like(x.to(memory_format=cl)), False),
            (lambda x: x.to(memory_format=cl) * 2 + 1, True), (lambda x: torch.relu(x.permute(0, 2, 3, 1)), True),
            (lambda x: x.permute(0, 2, 3, 1).clone(), True),
        ):
            got, want = fn(t), fn(base)
            self.assertEqual(got.stride(), want.stride())
            if same_values:
                self.assertEqual(got, want)

    def test_resize_memory_format(self, device):
        for mf in (torch.channels_last, torch.contiguous_format):
            got = torch.zeros(3, device=device).resize_(2, 3, 4, 5, memory_format=mf)
            want = torch.zeros(3).resize_(2, 3, 4, 5, memory_format=mf)
            self.assertEqual(got.stride(), want.stride())
        src = torch.zeros(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
        got = torch.zeros(1, device=device).resize_as_(src, memory_format=torch.preserve_format)
        self.assertEqual(got.stride(), torch.zeros(1).resize_as_(src.cpu(), memory_format=torch.preserve_format).stride())
        x = torch.arange(6.0, device=device)
        v = x[2:]
        v.resize_(10)  # grows: keeps the offset and the old values
        self.assertEqual(v.storage_offset(), 2)
        self.assertEqual(v[:4], torch.arange(2.0, 6.0))
        with self.assertRaisesRegex(RuntimeError, "required rank 4 tensor to use channels_last format"):
            torch.zeros(2, device=device).resize_(2, 3, 4, memory_format=torch.channels_last)


class TestIndexingParity(TestCase):
    @dtypes(torch.float32, torch.int64, torch.bool)
    def test_advanced_indexing_matches_cpu(self, device, dtype):
        base = make_tensor((5, 6, 7), dtype=dtype, device="cpu")
        t = base.to(device)
        i = torch.tensor([0, 4, -1, 2])
        j = torch.tensor([[1], [3]])
        mask = base.sum(-1) > 0 if dtype != torch.bool else base.any(-1)
        for idx in ((i,), (slice(None), i), (i, slice(1, 4), i), (j, i), (mask,), (..., i), (None, i),
                    (i, None, slice(None), 2), (0, mask[0])):
            dev_idx = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in idx)
            self.assertEqual(t[dev_idx], base[idx])

    @dtypes(torch.float32, torch.int64)
    def test_index_put_accumulates_duplicates(self, device, dtype):
        base = make_tensor((6, 3), dtype=dtype, device="cpu", low=-3, high=3)
        idx = torch.tensor([0, 2, 0, 5, 2])
        vals = make_tensor((5, 3), dtype=dtype, device="cpu", low=-3, high=3)
        t = base.to(device)
        t.index_put_((idx.to(device),), vals.to(device), accumulate=True)
        self.assertEqual(t, base.index_put_((idx,), vals, accumulate=True))
        t[idx.to(device)] = vals[0].to(device)  # broadcast
        base[idx] = vals[0]
        self.assertEqual(t, base)

    def test_uint8_mask_is_deprecated(self, device):
        t = torch.arange(3.0, device=device)
        with self.assertWarnsRegex(UserWarning, "indexing with dtype torch.uint8 is now deprecated"):
            got = t[torch.tensor([1, 0, 1], dtype=torch.uint8, device=device)]
        self.assertEqual(got, torch.tensor([0.0, 2.0]))

    def test_index_errors_are_pytorchs(self, device):
        t = torch.zeros(5, 5, device=device)
        with self.assertRaisesRegex(IndexError, r"shape mismatch: indexing tensors could not be broadcast"):
            t[torch.tensor([0, 1], device=device), torch.tensor([0, 1, 2], device=device)]
        with self.assertRaisesRegex(IndexError, "index is out of bounds for dimension with size 0"):
            torch.zeros(0, 3, device=device)[torch.tensor([0], device=device)]
        with self.assertRaisesRegex(RuntimeError, "shape mismatch: value tensor of shape"):
            t[torch.tensor([True] * 5, device=device)] = torch.ones(2, 5, device=device)
        with self.assertRaisesRegex(IndexError, "index 7 is out of bounds for dimension 0 with size 5"):
            t[torch.tensor([7])]  # a CPU index: its values are on the host, checked as on CPU


class TestTypePromotionParity(TestCase):
    def test_binary_result_types_match_cpu(self, device):
        kinds = (torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.float32, torch.complex64)
        for a in kinds:
            for b in kinds:
                x = make_tensor((3,), dtype=a, device="cpu", low=1, high=4)
                y = make_tensor((3,), dtype=b, device="cpu", low=1, high=4)
                for op in (torch.add, torch.eq):
                    got = op(x.to(device), y.to(device))
                    self.assertEqual(got, op(x, y), exact_dtype=True)
        x = torch.arange(3, device=device)
        for scalar in (2, 2.5, True, 1j):
            self.assertEqual((x * scalar).dtype, (x.cpu() * scalar).dtype)
        self.assertEqual((x * torch.tensor(2.5)).dtype, torch.float32)  # a 0-dim CPU tensor is a scalar

    def test_inplace_cannot_narrow_the_type(self, device):
        for dev in ("cpu", device):
            with self.assertRaisesRegex(RuntimeError, "result type Float can't be cast to the desired output type Long"):
                torch.zeros(2, dtype=torch.long, device=dev).add_(1.5)
        t = torch.zeros(2, device=device)
        t.add_(torch.ones(2, dtype=torch.int64, device=device))
        self.assertEqual(t.dtype, torch.float32)


class TestShapeOpsParity(TestCase):
    @dtypes(torch.float32, torch.int64, torch.bool)
    def test_shape_ops_match_cpu(self, device, dtype):
        base = make_tensor((3, 4, 5), dtype=dtype, device="cpu")
        t = base.to(device)
        for fn in (lambda x: torch.cat([x, x[:1]]), lambda x: torch.stack([x, x], 1), lambda x: x.flip(0, 2),
                   lambda x: x.roll((1, -2), (0, 2)), lambda x: x.repeat(2, 1, 1), lambda x: x.tile((2,)),
                   lambda x: x.movedim(0, -1), lambda x: x.narrow(2, 1, 3), lambda x: torch.atleast_3d(x[0, 0]),
                   lambda x: x.tril(1), lambda x: x.triu(-1), lambda x: x.chunk(3, 2), lambda x: x.split([1, 3], 1),
                   lambda x: x.unflatten(2, (5, 1)), lambda x: x.flatten(1), lambda x: torch.diag_embed(x[0]),
                   lambda x: x.expand(2, 3, 4, 5).contiguous(), lambda x: torch.broadcast_to(x[:, :1], (3, 4, 5))):
            self.assertEqual(fn(t), fn(base))

    def test_shape_errors_are_pytorchs(self, device):
        for fn, error in ((lambda d: torch.cat([torch.zeros(2, 3, device=d), torch.zeros(2, 4, device=d)]),
                           "Sizes of tensors must match except in dimension 0"),
                          (lambda d: torch.zeros(2, 2, device=d).flip(0, 0), "dim 0 appears multiple times"),
                          (lambda d: torch.zeros(6, device=d).view(4, -1), r"shape '\[4, -1\]' is invalid")):
            for dev in ("cpu", device):
                with self.assertRaisesRegex(RuntimeError, error):
                    fn(dev)


class TestReductionsParity(TestCase):
    @dtypes(torch.float32, torch.int64)
    def test_reductions_match_cpu(self, device, dtype):
        base = make_tensor((4, 5, 6), dtype=dtype, device="cpu", low=-4, high=4)
        t = base.to(device)
        fns = [lambda x: x.sum(), lambda x: x.sum((0, 2), keepdim=True), lambda x: x.prod(1),
               lambda x: x.amax(-1), lambda x: x.argmax(1), lambda x: x.max(2), lambda x: x.min(),
               lambda x: x.cumsum(1), lambda x: x.sum(1, dtype=torch.float64), lambda x: x.any(0), lambda x: x.all()]
        if dtype.is_floating_point:
            fns += [lambda x: x.mean(1), lambda x: x.var(0), lambda x: x.std((1, 2), correction=0),
                    lambda x: x.logsumexp(2), lambda x: x.norm(dim=1)]
        for fn in fns:
            self.assertEqual(fn(t), fn(base), exact_dtype=True)

    def test_empty_reductions(self, device):
        e = torch.zeros(0, 3, device=device)
        self.assertEqual(e.sum(0), torch.zeros(3))
        self.assertEqual(e.prod(), torch.tensor(1.0))
        self.assertTrue(e.mean().isnan())
        for dev in ("cpu", device):
            with self.assertRaisesRegex(IndexError, "Expected reduction dim 0 to have non-zero size"):
                torch.zeros(0, 3, device=dev).amax(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.ones(1, device=device).var()
        self.assertTrue(any("degrees of freedom is <= 0" in str(w.message) for w in caught))


class TestInplaceParity(TestCase):
    def test_inplace_updates_views_and_versions(self, device):
        t = torch.zeros(3, 4, device=device)
        v = t[1]
        before = t._version
        v.add_(2)
        self.assertEqual(t[1], torch.full((4,), 2.0))
        self.assertGreater(t._version, before)
        self.assertEqual(v._version, t._version)
        t.mul_(3)
        self.assertEqual(v, torch.full((4,), 6.0))

    def test_out_resize_and_cast_rules(self, device):
        with self.assertWarnsRegex(UserWarning, "An output with one or more elements was resized"):
            out = torch.ones(2, device=device)
            torch.add(torch.ones(3, device=device), 1, out=out)
        self.assertEqual(out, torch.full((3,), 2.0))
        out = torch.ones(0, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an empty out tensor is resized silently
            torch.mul(torch.ones(2, device=device), 3, out=out)
        with self.assertRaisesRegex(RuntimeError, "result type Float can't be cast to the desired output type Long"):
            torch.add(torch.ones(2, device=device), 0.5, out=torch.zeros(2, dtype=torch.long, device=device))

    def test_inplace_on_expanded_tensors(self, device):
        for dev in ("cpu", device):
            with self.assertRaisesRegex(RuntimeError, "unsupported operation: more than one element of the written-to"):
                torch.zeros(1, device=dev).expand(3).add_(1)
        t = torch.zeros(1, 3, device=device)
        with self.assertWarnsRegex(UserWarning, "Use of index_put_ on expanded tensors is deprecated"):
            t.expand(2, 3).index_put_((torch.tensor([0], device=device),), torch.tensor(5.0, device=device))
        self.assertEqual(t, torch.full((1, 3), 5.0))


for _cls in (TestViewsParity, TestIndexingParity, TestTypePromotionParity, TestShapeOpsParity,
             TestReductionsParity, TestInplaceParity):
    instantiate_device_type_tests(_cls, globals(), only_for=ONLY_TPU)
