"""nn, linalg and foreach lowerings against PyTorch's CPU kernels.

Each case runs forward and backward (``torch.autograd.grad``) on CPU and on
tpu with the CPU fallback switched off, so a missing lowering fails instead of
silently running on CPU, and checks that the aten ops the case is about were
dispatched to the device (``expect=``): a lowering that PyTorch routes around
would pass a value comparison while proving nothing.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchtpu
from helpers import no_fallback
from torchtpu.dispatch import install
from torchtpu.dispatch.lowering import LOWERINGS

TPU = "tpu"


# ---------------------------------------------------------------- harness
class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(f"{func._schema.name}.{func._overloadname}".replace("aten::", ""))
        return func(*args, **(kwargs or {}))


def _lowered(op):
    qual = "aten::" + op if "::" not in op else op
    return qual in LOWERINGS or install.installed(qual)


def host(t):
    return t.cpu()


class K:
    """An input that never requires grad (class weights, targets)."""

    def __init__(self, t):
        self.t = t


def _to(x, device, grad):
    if isinstance(x, K):
        return x.t.detach().clone().to(device)
    if isinstance(x, torch.Tensor):
        y = x.detach().clone().to(device)
        return y.requires_grad_(grad and (x.is_floating_point() or x.is_complex()))
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device, grad) for v in x)
    return x


def _leaves(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return []


def check(fn, *inputs, grad=True, atol=1e-5, rtol=1.3e-5, expect=(), grad_atol=None, grad_rtol=None):
    """Run ``fn`` on CPU and tpu copies of ``inputs``; compare outputs and input gradients."""
    cpu_in = _to(list(inputs), "cpu", grad)
    tpu_in = _to(list(inputs), TPU, grad)
    out_c = fn(*cpu_in)
    log = _OpLog()
    with no_fallback(), log:
        out_t = fn(*tpu_in)
    oc, ot = _leaves(out_c), _leaves(out_t)
    assert len(oc) == len(ot)
    for a, b in zip(ot, oc):
        assert a.device.type == TPU
        torch.testing.assert_close(host(a), b, atol=atol, rtol=rtol, equal_nan=True)
    if grad:
        req_c = [x for x in _leaves(cpu_in) if x.requires_grad]
        req_t = [x for x in _leaves(tpu_in) if x.requires_grad]
        diff = [(c, t) for c, t in zip(oc, ot) if c.requires_grad and c.is_floating_point()]
        if req_c and diff:
            gens = [torch.randn_like(c) for c, _ in diff]
            gc = torch.autograd.grad([c for c, _ in diff], req_c, gens, allow_unused=True)
            with no_fallback(), log:
                gt = torch.autograd.grad([t for _, t in diff], req_t, [g.to(TPU) for g in gens], allow_unused=True)
            for a, b in zip(gt, gc):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(host(a), b, atol=grad_atol or atol * 10, rtol=grad_rtol or rtol * 10)
    for op in expect:
        assert op in log.ops, f"{op} was not dispatched (saw {sorted(log.ops)})"
        assert _lowered(op), f"{op} has no tpu lowering"
    return out_t


def R(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ================================================================ softmax, norms
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_log_softmax(dim):
    x = R(4, 5, 6)
    check(lambda x: F.softmax(x, dim), x, expect=["_softmax.default", "_softmax_backward_data.default"])
    check(lambda x: F.log_softmax(x, dim), x,
          expect=["_log_softmax.default", "_log_softmax_backward_data.default"])


def test_softmax_bfloat16_and_half_to_float():
    x = R(3, 7).bfloat16()
    check(lambda x: F.softmax(x, -1), x, grad=False, atol=1e-2, rtol=1e-2)
    # half_to_float (CUDA's fused path; CPU refuses it): float32 result of the float16 input
    h = R(3, 7).half()
    with no_fallback():
        out = torch._softmax(h.to(TPU), -1, True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), h.float().softmax(-1))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine):
    x = R(2, 3, 4, 5)
    if affine:
        check(lambda x, w, b: F.layer_norm(x, (4, 5), w, b, 1e-5), x, R(4, 5), R(4, 5),
              expect=["native_layer_norm.default", "native_layer_norm_backward.default"])
    else:
        check(lambda x: F.layer_norm(x, (5,)), x, expect=["native_layer_norm.default"])


def test_rms_norm_uses_fused_kernel():
    check(lambda x, w: F.rms_norm(x, (6,), w, 1e-6), R(3, 4, 6), R(6),
          expect=["_fused_rms_norm.default", "_fused_rms_norm_backward.default"])
    check(lambda x: F.rms_norm(x, (4, 6)), R(3, 4, 6))


def test_batch_norm_train_updates_running_stats_and_eval():
    x = R(8, 3, 5, 4)
    bn_c = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        bn_c.weight.uniform_(0.5, 1.5)
        bn_c.bias.normal_()
    bn_t = copy.deepcopy(bn_c).to(TPU)
    for _ in range(2):
        xc = x.clone().requires_grad_()
        xt = x.to(TPU).requires_grad_()
        with no_fallback():
            yt = bn_t(xt)
        yc = bn_c(xc)
        torch.testing.assert_close(yt.cpu(), yc, atol=1e-5, rtol=1e-5)
        g = torch.randn_like(yc)
        gc = torch.autograd.grad(yc, [xc, bn_c.weight, bn_c.bias], g)
        with no_fallback():
            gt = torch.autograd.grad(yt, [xt, bn_t.weight, bn_t.bias], g.to(TPU))
        for a, b in zip(gt, gc):
            torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bn_t.running_mean.cpu(), bn_c.running_mean)
    torch.testing.assert_close(bn_t.running_var.cpu(), bn_c.running_var)
    assert int(bn_t.num_batches_tracked.cpu()) == 2
    bn_c.eval()
    bn_t.eval()
    check(lambda x: bn_t(x) if x.device.type == TPU else bn_c(x), x,
          expect=["native_batch_norm.default", "native_batch_norm_backward.default"])


def test_batch_norm_functional_without_running_stats():
    check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), R(6, 4, 3), R(4), R(4),
          expect=["native_batch_norm.default", "native_batch_norm_backward.default"])


def test_group_norm():
    check(lambda x, w, b: F.group_norm(x, 2, w, b), R(3, 6, 4, 5), R(6), R(6),
          expect=["native_group_norm.default", "native_group_norm_backward.default"])
    check(lambda x: F.group_norm(x, 3), R(2, 6, 7))


# ================================================================ activations
ACTS = {
    "gelu": (lambda x: F.gelu(x), "gelu_backward.default"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_backward.default"),
    "silu": (F.silu, "silu_backward.default"),
    "relu": (F.relu, "threshold_backward.default"),
    "sigmoid": (torch.sigmoid, "sigmoid_backward.default"),
    "tanh": (torch.tanh, "tanh_backward.default"),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), "leaky_relu_backward.default"),
    "elu": (lambda x: F.elu(x, 0.7), "elu_backward.default"),
    "selu": (F.selu, "elu_backward.default"),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 0.5), "hardtanh_backward.default"),
    "softplus": (lambda x: F.softplus(x, beta=2, threshold=3), "softplus_backward.default"),
    "hardswish": (F.hardswish, "hardswish_backward.default"),
    "hardsigmoid": (F.hardsigmoid, "hardsigmoid_backward.default"),
    "mish": (F.mish, "mish_backward.default"),
    "logsigmoid": (F.logsigmoid, "log_sigmoid_backward.default"),
    "glu": (lambda x: F.glu(x, -1), "glu_backward.default"),
}


@pytest.mark.parametrize("name", list(ACTS))
def test_activation_backward(name):
    fn, op = ACTS[name]
    x = R(5, 8) * 3
    check(fn, x, expect=[op])


def test_prelu():
    check(lambda x, w: F.prelu(x, w), R(4, 3, 5), R(3), expect=["_prelu_kernel_backward.default"])


# ================================================================ embeddings
def test_embedding_backward_padding_and_freq():
    idx = torch.tensor([[1, 2, 2, 0], [4, 2, 9, 1]])
    check(lambda w, i: F.embedding(i, w), R(10, 3), idx, expect=["embedding_dense_backward.default"])
    check(lambda w, i: F.embedding(i, w, padding_idx=2, scale_grad_by_freq=True), R(10, 3), idx)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mode):
    w = R(12, 4)
    ids = torch.tensor([1, 3, 3, 7, 0, 11, 5, 2])
    offsets = torch.tensor([0, 3, 3, 6])  # bag 1 is empty
    check(lambda w, i, o: F.embedding_bag(i, w, o, mode=mode), w, ids, offsets,
          expect=["_embedding_bag.default", "_embedding_bag_backward.default"])
    check(lambda w, i: F.embedding_bag(i, w, mode=mode, padding_idx=3), w, ids.view(2, 4))


def test_embedding_bag_per_sample_weights_and_last_offset():
    w, ids = R(9, 3), torch.tensor([0, 4, 4, 8, 2])
    check(lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p, include_last_offset=True),
          w, ids, torch.tensor([0, 2, 5]), R(5), expect=["_embedding_bag_per_sample_weights_backward.default"])


# ================================================================ losses
def test_cross_entropy_variants():
    x, t = R(6, 5), torch.tensor([0, 4, 1, -100, 2, 2])
    ops = ["nll_loss_forward.default", "nll_loss_backward.default"]
    check(lambda x, t: F.cross_entropy(x, t), x, t, expect=ops)
    check(lambda x, t, w: F.cross_entropy(x, t, weight=w, reduction="sum"), x, t, K(R(5).abs()))
    check(lambda x, t, w: F.cross_entropy(x, t, weight=w), x, t, K(R(5).abs()))
    check(lambda x, t: F.cross_entropy(x, t, reduction="none"), x, t)
    check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), x, t)
    check(lambda x: F.cross_entropy(x, x.detach().softmax(-1)), x)  # probability targets
    check(lambda x, t: F.cross_entropy(x, t), R(5), torch.tensor(3))  # unbatched


def test_cross_entropy_2d():
    x, t = R(2, 4, 3, 5), torch.randint(0, 4, (2, 3, 5))
    t[0, 0, 0] = -100
    check(lambda x, t: F.cross_entropy(x, t), x, t,
          expect=["nll_loss2d_forward.default", "nll_loss2d_backward.default"])
    check(lambda x, t: F.cross_entropy(x, t, reduction="none"), x, t)


def test_nll_loss_out_of_range_target_is_nan_not_a_value():
    x = R(3, 4).log_softmax(-1).to(TPU)
    with no_fallback():
        loss = F.nll_loss(x, torch.tensor([0, 7, 1]).to(TPU))
    assert math.isnan(loss.item())


LOSSES = {
    "mse": (lambda x, t: F.mse_loss(x, t), ["mse_loss.default", "mse_loss_backward.default"]),
    "mse_sum": (lambda x, t: F.mse_loss(x, t, reduction="sum"), []),
    "mse_none": (lambda x, t: F.mse_loss(x, t, reduction="none"), []),
    "smooth_l1": (lambda x, t: F.smooth_l1_loss(x, t, beta=0.5), ["smooth_l1_loss_backward.default"]),
    "smooth_l1_b0": (lambda x, t: F.smooth_l1_loss(x, t, beta=0.0, reduction="sum"), []),
    "huber": (lambda x, t: F.huber_loss(x, t, delta=0.7), ["huber_loss_backward.default"]),
    "soft_margin": (lambda x, t: F.soft_margin_loss(x, t.detach().sign()), ["soft_margin_loss.default"]),
    "bce_logits": (lambda x, t: F.binary_cross_entropy_with_logits(x, t.sigmoid()),
                   ["binary_cross_entropy_with_logits.default"]),
    "bce_logits_pos": (lambda x, t: F.binary_cross_entropy_with_logits(
        x, t.sigmoid(), weight=torch.full_like(x, 0.3), pos_weight=torch.full_like(x, 2.0)), []),
    "bce": (lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid()),
            ["binary_cross_entropy.default", "binary_cross_entropy_backward.default"]),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses(name):
    fn, ops = LOSSES[name]
    check(fn, R(4, 6) * 2, R(4, 6) * 2, expect=ops)


# ================================================================ convolution
CONVS = {
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), (2, 4, 9, 8), (6, 4, 3, 3), 6),
    "conv2d_groups_dilation": (lambda x, w, b: F.conv2d(x, w, b, padding=(2, 1), dilation=2, groups=2),
                               (2, 4, 9, 8), (6, 2, 3, 2), 6),
    "conv1d_nobias": (lambda x, w, b: F.conv1d(x, w, None, stride=3), (2, 3, 11), (5, 3, 4), None),
    "conv3d": (lambda x, w, b: F.conv3d(x, w, b, padding=1), (1, 2, 4, 5, 4), (3, 2, 3, 3, 3), 3),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
                         (2, 4, 5, 6), (4, 3, 3, 3), 3),
    "conv_transpose2d_groups": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(1, 2), groups=2, dilation=2),
                                (2, 4, 5, 6), (4, 3, 3, 2), 6),
    "conv_transpose1d": (lambda x, w, b: F.conv_transpose1d(x, w, b, stride=3, padding=2), (2, 3, 7), (3, 2, 5), 2),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_convolution(name):
    fn, xs, ws, nb = CONVS[name]
    b = R(nb) if nb else None
    check(fn, R(*xs), R(*ws), b, atol=1e-4, rtol=1e-4,
          expect=["convolution.default", "convolution_backward.default"])


def test_conv2d_unbatched():
    check(lambda x, w: F.conv2d(x, w, padding="same"), R(3, 6, 6), R(2, 3, 3, 3), atol=1e-4, rtol=1e-4)


# ================================================================ pooling, upsampling
@pytest.mark.parametrize("kw", [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=2, stride=1, dilation=2, padding=1),
])
def test_max_pool2d(kw):
    x = R(2, 3, 9, 8)
    out = check(lambda x: F.max_pool2d(x, return_indices=True, **kw), x,
                expect=["max_pool2d_with_indices.default", "max_pool2d_with_indices_backward.default"])
    assert out[1].dtype == torch.int64


@pytest.mark.parametrize("kw", [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=2, divisor_override=3),
])
def test_avg_pool2d(kw):
    check(lambda x: F.avg_pool2d(x, **kw), R(2, 3, 9, 8), expect=["avg_pool2d.default", "avg_pool2d_backward.default"])


@pytest.mark.parametrize("size", [(1, 1), (3, 5), (4, 4), (7, 3)])
def test_adaptive_avg_pool2d(size):
    # (1, 1) is a mean in PyTorch's composite; the others reach the kernel
    ops = [] if size == (1, 1) else ["_adaptive_avg_pool2d.default", "_adaptive_avg_pool2d_backward.default"]
    check(lambda x: F.adaptive_avg_pool2d(x, size), R(2, 3, 8, 7), expect=ops)


POOLS_ND = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2, 1, ceil_mode=True), (2, 3, 10), []),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), (2, 3, 10), []),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2, padding=1, dilation=(1, 2, 1)), (1, 2, 5, 6, 4),
                   ["max_pool3d_with_indices.default", "max_pool3d_with_indices_backward.default"]),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True), (1, 2, 5, 6, 4),
                   ["avg_pool3d.default", "avg_pool3d_backward.default"]),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, (2, 4, 3)), (1, 2, 5, 6, 4),
                            ["_adaptive_avg_pool3d.default", "_adaptive_avg_pool3d_backward.default"]),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 4), (2, 3, 9), []),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True), (2, 3, 9, 7),
                            ["adaptive_max_pool2d.default", "adaptive_max_pool2d_backward.default"]),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x, 4), (2, 3, 9), []),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, 2), (1, 2, 5, 3, 4),
                            ["adaptive_max_pool3d.default", "adaptive_max_pool3d_backward.default"]),
    "reflection_pad2d": (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), (2, 3, 5, 4),
                         ["reflection_pad2d.default", "reflection_pad2d_backward.default"]),
    "replication_pad2d": (lambda x: F.pad(x, (1, 2, 2, 0), mode="replicate"), (2, 3, 5, 4),
                          ["replication_pad2d.default", "replication_pad2d_backward.default"]),
    "replication_pad1d": (lambda x: F.pad(x, (3, 1), mode="replicate"), (2, 3, 5), []),
    "reflection_pad3d": (lambda x: F.pad(x, (1, 1, 2, 0, 1, 2), mode="reflect"), (1, 2, 3, 4, 5), []),
}


@pytest.mark.parametrize("name", list(POOLS_ND))
def test_pooling_and_padding_nd(name):
    fn, shape, ops = POOLS_ND[name]
    check(fn, R(*shape), expect=ops)


@pytest.mark.parametrize("kw", [
    dict(scale_factor=2, mode="nearest"),
    dict(size=(7, 5), mode="nearest"),
    dict(size=(7, 5), mode="nearest-exact"),
    dict(scale_factor=1.7, mode="nearest"),
    dict(scale_factor=2, mode="bilinear"),
    dict(size=(9, 4), mode="bilinear", align_corners=True),
    dict(size=(3, 11), mode="bilinear", align_corners=False),
    dict(scale_factor=(0.6, 1.3), mode="bilinear"),
    dict(size=(8, 4), mode="bicubic"),
    dict(size=(11, 9), mode="bicubic", align_corners=True),
])
def test_interpolate_2d(kw):
    check(lambda x: F.interpolate(x, **kw), R(2, 3, 5, 6), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [
    dict(scale_factor=3, mode="nearest"),
    dict(size=7, mode="nearest-exact"),
    dict(size=9, mode="linear"),
    dict(size=4, mode="linear", align_corners=True),
])
def test_interpolate_1d(kw):
    check(lambda x: F.interpolate(x, **kw), R(2, 3, 6))


@pytest.mark.parametrize("kw", [dict(size=(3, 5, 4), mode="nearest"), dict(scale_factor=1.5, mode="trilinear")])
def test_interpolate_3d(kw):
    check(lambda x: F.interpolate(x, **kw), R(1, 2, 4, 3, 5), atol=1e-5, rtol=1e-4)


def test_safe_softmax_rows_of_minus_inf_give_zero():
    x = R(3, 5)
    x[1] = -math.inf
    check(lambda x: torch.ops.aten._safe_softmax(x, -1), x, grad=False, expect=["_safe_softmax.default"])


BF16 = {
    "layer_norm": (lambda x, w: F.layer_norm(x, (8,), w), [(4, 8), (8,)]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (8,), w), [(4, 8), (8,)]),
    "linear_gelu": (lambda x, w: F.gelu(F.linear(x, w)), [(4, 8), (6, 8)]),
    "conv2d": (lambda x, w: F.conv2d(x, w, padding=1), [(2, 3, 6, 6), (4, 3, 3, 3)]),
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.arange(4, device=x.device) % 8), [(4, 8)]),
    "softmax": (lambda x: F.softmax(x, -1), [(4, 8)]),
}


@pytest.mark.parametrize("name", list(BF16))
def test_bfloat16_forward_backward(name):
    """Half-precision inputs: computed in float32 and rounded once, as ATen's CPU kernels do."""
    fn, shapes = BF16[name]
    out = check(fn, *[R(*s).bfloat16() for s in shapes], atol=2e-2, rtol=2e-2)
    assert _leaves(out)[0].dtype == torch.bfloat16


# ================================================================ recurrent, distances
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_rnn_fused_cells(kind):
    """nn.LSTM / nn.GRU off the CPU run ATen's fused cells (no CPU kernel: compared
    with the CPU's own, unfused cell math)."""
    torch.manual_seed(0)
    rnn_c = getattr(torch.nn, kind)(4, 6, num_layers=2)
    rnn_t = copy.deepcopy(rnn_c).to(TPU)
    x = R(5, 3, 4)
    xc, xt = x.clone().requires_grad_(), x.to(TPU).requires_grad_()
    out_c = rnn_c(xc)[0]
    log = _OpLog()
    with no_fallback(), log:
        out_t = rnn_t(xt)[0]
    torch.testing.assert_close(out_t.cpu(), out_c, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out_c)
    params_c, params_t = list(rnn_c.parameters()), list(rnn_t.parameters())
    gc = torch.autograd.grad(out_c, [xc] + params_c, g)
    with no_fallback(), log:
        gt = torch.autograd.grad(out_t, [xt] + params_t, g.to(TPU))
    for a, b in zip(gt, gc):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-4)
    op = "_thnn_fused_lstm_cell.default" if kind == "LSTM" else "_thnn_fused_gru_cell.default"
    assert op in log.ops, sorted(log.ops)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf")])
def test_cdist(p):
    x1, x2 = R(2, 5, 3), R(2, 4, 3)
    x2[0, 1] = x1[0, 2]  # a zero distance: its gradient is 0, not NaN
    check(lambda a, b: torch.cdist(a, b, p), x1, x2, expect=["_cdist_forward.default", "_cdist_backward.default"])
    check(lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"), R(30, 3), R(4, 3), atol=1e-4,
          rtol=1e-4)


def test_embedding_max_norm_renormalizes_rows_in_place():
    w = R(6, 3) * 3
    idx = torch.tensor([1, 4, 4])
    wt = w.to(TPU)
    out_c = F.embedding(idx, w, max_norm=1.0)
    with no_fallback():
        out_t = F.embedding(idx.to(TPU), wt, max_norm=1.0)
    torch.testing.assert_close(out_t.cpu(), out_c)
    torch.testing.assert_close(wt.cpu(), w, atol=1e-6, rtol=1e-6)  # rows 1 and 4 renormalized in place


# ================================================================ dropout
def test_dropout_fraction_scale_and_backward():
    x = torch.ones(200, 500)
    xt = x.to(TPU).requires_grad_()
    with no_fallback():
        y = F.dropout(xt, p=0.3, training=True)
        (g,) = torch.autograd.grad(y, xt, torch.ones_like(y))
    yc = y.detach().cpu()
    kept = (yc != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.01
    assert torch.allclose(yc[yc != 0], torch.tensor(1 / 0.7))
    torch.testing.assert_close(g.cpu(), yc)  # d(x * mask / (1-p))/dx = mask / (1-p) = y for x = 1
    with no_fallback():
        assert torch.equal(F.dropout(xt, p=0.3, training=False).detach().cpu(), x)


# ================================================================ attention
def _sdpa(**kw):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


SDPA_OPS = ["_scaled_dot_product_fused_attention_overrideable.default",
            "_scaled_dot_product_fused_attention_overrideable_backward.default"]


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(scale=0.3), dict(is_causal=True, scale=2.0)])
def test_sdpa(kw):
    q, k, v = R(2, 3, 7, 8), R(2, 3, 5, 8), R(2, 3, 5, 6)
    if kw.get("is_causal"):
        k, v = R(2, 3, 7, 8), R(2, 3, 7, 6)
    check(_sdpa(**kw), q, k, v, atol=1e-5, rtol=1e-4, expect=SDPA_OPS)


def test_sdpa_masks():
    q, k, v = R(2, 3, 6, 4), R(2, 3, 6, 4), R(2, 3, 6, 4)
    bool_mask = torch.rand(2, 1, 6, 6) > 0.4
    bool_mask[..., 0] = True
    check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, bool_mask, rtol=1e-4)
    # a float bias that requires grad gets its gradient
    check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, R(6, 6), rtol=1e-4,
          expect=SDPA_OPS)
    # a row with every key masked gives 0 (PyTorch's _safe_softmax), not NaN
    full = torch.ones(6, 6, dtype=torch.bool)
    full[2] = False
    out = check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, full, rtol=1e-4)
    assert torch.equal(out[:, :, 2].detach().cpu(), torch.zeros(2, 3, 4))


def test_sdpa_gqa_and_3d():
    q, k, v = R(2, 6, 5, 4), R(2, 2, 5, 4), R(2, 2, 5, 4)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), q, k, v,
          rtol=1e-4, expect=SDPA_OPS)
    check(_sdpa(), R(3, 5, 4), R(3, 6, 4), R(3, 6, 4), rtol=1e-4)


def test_sdpa_dropout_matches_math_with_the_same_mask():
    """Dropout inside attention: recover the dropped-out probabilities by using
    v = identity, then check the values and the gradients against PyTorch's math
    reference given that very mask."""
    S, p = 6, 0.4
    q, k = R(2, 2, S, S), R(2, 2, S, S)
    v = torch.eye(S).expand(2, 2, S, S).contiguous()
    qt, kt, vt = (x.to(TPU).requires_grad_() for x in (q, k, v))
    torch.manual_seed(5)
    with no_fallback():
        out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True)
    torch.manual_seed(5)
    with no_fallback():
        again = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True)
    assert torch.equal(out.detach().cpu(), again.detach().cpu())
    probs = out.detach().cpu()  # = dropout(softmax) @ I
    keep = probs != 0
    qc, kc, vc = (x.clone().requires_grad_() for x in (q, k, v))
    ref = torch.ops.aten._scaled_dot_product_attention_math(qc, kc, vc, None, p, True, keep)[0]
    torch.testing.assert_close(probs, ref.detach(), atol=1e-5, rtol=1e-4)
    g = torch.randn_like(ref)
    gc = torch.autograd.grad(ref, (qc, kc, vc), g)
    with no_fallback():
        gt = torch.autograd.grad(out, (qt, kt, vt), g.to(TPU))
    for a, b in zip(gt, gc):
        torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)


def test_sdpa_inference_mode_and_bfloat16():
    q = R(1, 2, 4, 8)
    with torch.inference_mode():
        out = F.scaled_dot_product_attention(q.to(TPU), q.to(TPU), q.to(TPU), is_causal=True)
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    qb = q.bfloat16()
    check(_sdpa(is_causal=True), qb, qb, qb, grad=False, atol=2e-2, rtol=2e-2)


# ================================================================ linear algebra: products
PRODUCTS = {
    "mm": (lambda a, b: a @ b, [(5, 3), (3, 4)], ["mm.default"]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(2, 5, 3), (2, 3, 4)], ["bmm.default"]),
    "matmul_bcast": (lambda a, b: a @ b, [(2, 1, 5, 3), (4, 3, 2)], []),
    "mv": (lambda a, b: a @ b, [(5, 3), (3,)], ["mv.default"]),
    "dot": (lambda a, b: a @ b, [(7,), (7,)], ["dot.default"]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), [(4,), (5, 3), (3, 4)], ["addmm.default"]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), [(2, 5, 4), (2, 5, 3), (2, 3, 4)],
                ["baddbmm.default"]),
    "addbmm": (lambda c, a, b: torch.addbmm(c, a, b, beta=2), [(5, 4), (3, 5, 2), (3, 2, 4)], ["addbmm.default"]),
    "addmv": (lambda c, a, b: torch.addmv(c, a, b), [(5,), (5, 3), (3,)], ["addmv.default"]),
    "addr": (lambda c, a, b: torch.addr(c, a, b, beta=0.3), [(5, 3), (5,), (3,)], ["addr.default"]),
    "outer": (lambda a, b: torch.outer(a, b), [(5,), (3,)], []),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(2, 3, 5), (4, 5), (4,)], ["addmm.default"]),
    "einsum": (lambda a, b: torch.einsum("bij,bkj->bik", a, b), [(2, 3, 4), (2, 5, 4)], []),
    "cross": (lambda a, b: torch.linalg.cross(a, b), [(4, 3), (1, 3)], ["linalg_cross.default"]),
}


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_products(name):
    fn, shapes, ops = PRODUCTS[name]
    check(fn, *[R(*s) for s in shapes], atol=1e-5, rtol=1e-5, expect=ops)


def test_addmm_beta_zero_ignores_nan():
    c = torch.full((3, 2), float("nan"))
    check(lambda c, a, b: torch.addmm(c, a, b, beta=0), c, R(3, 4), R(4, 2), grad=False)


def test_matmul_int_and_bfloat16():
    a, b = torch.randint(-5, 5, (4, 3)), torch.randint(-5, 5, (3, 2))
    check(lambda a, b: a @ b, a, b, grad=False)
    check(lambda a, b: a @ b, R(8, 16).bfloat16(), R(16, 4).bfloat16(), grad=False, atol=1e-2, rtol=1e-2)


# ================================================================ linear algebra: factorizations
def _spd(n, batch=()):
    a = R(*batch, n, n, dtype=torch.float64)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


def _wellcond(n, batch=()):
    return R(*batch, n, n, dtype=torch.float64) + 3 * torch.eye(n, dtype=torch.float64)


LINALG = {
    "cholesky": (lambda a: torch.linalg.cholesky(a), [_spd(4, (2,))], ["linalg_cholesky_ex.default"]),
    "cholesky_upper": (lambda a: torch.linalg.cholesky(a, upper=True), [_spd(3)], []),
    "inv": (lambda a: torch.linalg.inv(a), [_wellcond(4, (2,))], ["linalg_inv_ex.default"]),
    "solve": (lambda a, b: torch.linalg.solve(a, b), [_wellcond(4, (3,)), R(3, 4, 2, dtype=torch.float64)],
              ["_linalg_solve_ex.default", "linalg_lu_solve.default"]),
    "solve_vector": (lambda a, b: torch.linalg.solve(a, b), [_wellcond(4, (3,)), R(3, 4, dtype=torch.float64)], []),
    "solve_right": (lambda a, b: torch.linalg.solve(a, b, left=False),
                    [_wellcond(3), R(2, 5, 3, dtype=torch.float64)], []),
    "det": (lambda a: torch.linalg.det(a), [_wellcond(4, (2,))], ["_linalg_det.default"]),
    "det_fcontig": (lambda a: torch.linalg.det(a.mT), [_wellcond(4, (2,))], []),
    "slogdet": (lambda a: torch.linalg.slogdet(a), [_wellcond(4, (2,)) - 6 * torch.eye(4)],
                ["_linalg_slogdet.default"]),
    "logdet": (lambda a: torch.logdet(a), [_spd(3)], []),
    "triangular_solve": (lambda b, a: torch.triangular_solve(b, a.triu(), upper=True)[0],
                         [R(2, 4, 3, dtype=torch.float64), _wellcond(4)], ["triangular_solve.default"]),
    "triangular_solve_T": (lambda b, a: torch.triangular_solve(b, a.tril(), upper=False, transpose=True)[0],
                           [R(4, 2, dtype=torch.float64), _wellcond(4)], []),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a.tril(), b, upper=False, left=False),
                         [_wellcond(3), R(2, 4, 3, dtype=torch.float64)], ["linalg_solve_triangular.default"]),
    "solve_triangular_unit": (lambda a, b: torch.linalg.solve_triangular(a.triu(), b, upper=True,
                                                                       unitriangular=True),
                              [_wellcond(3), R(3, 2, dtype=torch.float64)], []),
    "lu_factor": (lambda a: torch.linalg.lu_factor(a), [_wellcond(4, (2,))], ["linalg_lu_factor_ex.default"]),
    "lu": (lambda a: torch.linalg.lu(a), [R(5, 3, dtype=torch.float64)], ["linalg_lu.default"]),
    "lu_wide": (lambda a: torch.linalg.lu(a), [R(2, 3, 5, dtype=torch.float64)], []),
    "lu_solve": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
                 [_wellcond(4), R(4, 3, dtype=torch.float64)], []),
    "lu_solve_adjoint_right": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False,
                                                                  adjoint=True),
                               [_wellcond(4), R(3, 4, dtype=torch.float64)], []),
    "lu_unpack": (lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)), [_wellcond(4, (2,))],
                  ["lu_unpack.default"]),
    "cholesky_solve": (lambda b, a: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
                       [R(4, 2, dtype=torch.float64), _spd(4)], []),  # -> _cholesky_solve_helper
    "cholesky_inverse": (lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), [_spd(4)],
                         ["cholesky_inverse.default"]),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a), [R(2, 3, 3, dtype=torch.float64) * 0.5],
                   ["linalg_matrix_exp.default"]),
    "qr": (lambda a: torch.linalg.qr(a), [R(5, 3, dtype=torch.float64)], ["linalg_qr.default"]),
    "qr_wide_complete": (lambda a: torch.linalg.qr(a, mode="complete"), [R(2, 3, 4, dtype=torch.float64)], []),
    "eigvalsh": (lambda a: torch.linalg.eigvalsh(a), [_spd(4, (2,))], ["_linalg_eigh.default"]),
    "svdvals": (lambda a: torch.linalg.svdvals(a), [R(2, 5, 3, dtype=torch.float64)], ["_linalg_svd.default"]),
    # sign-invariant uses of the vectors
    "eigh_proj": (lambda a: (lambda w, v: (v * w.unsqueeze(-2)) @ v.mT)(*torch.linalg.eigh(a)), [_spd(4)], []),
    "svd_recon": (lambda a: (lambda u, s, vh: (u * s.unsqueeze(-2)) @ vh)(*torch.linalg.svd(a, full_matrices=False)),
                  [R(5, 3, dtype=torch.float64)], []),
    "pinv": (lambda a: torch.linalg.pinv(a), [R(4, 3, dtype=torch.float64)], []),
}


# QR's backward takes ``diagonal(...).real`` and scales it in place: that needs
# ``real`` to be the alias PyTorch's composite returns for real dtypes, not a copy
_REAL_IS_A_COPY = "aten::real.default" in LOWERINGS


@pytest.mark.parametrize("name", list(LINALG))
def test_linalg(name):
    if name == "qr" and _REAL_IS_A_COPY:
        pytest.xfail("elementwise.py lowers the CompositeImplicit aten::real (a copy, not a view)")
    fn, args, ops = LINALG[name]
    check(fn, *args, atol=1e-8, rtol=1e-7, expect=ops)


def test_linalg_float32_and_svd_vectors_up_to_sign():
    a = R(6, 4)
    check(lambda a: torch.linalg.inv(a.mT @ a + torch.eye(4, device=a.device)), a, atol=1e-5, rtol=1e-4)
    # modes with no gradient: values only
    check(lambda a: torch.linalg.qr(a, mode="complete"), R(5, 3, dtype=torch.float64), grad=False, atol=1e-10)
    check(lambda a: torch.linalg.qr(a, mode="r")[1], R(5, 3, dtype=torch.float64), grad=False, atol=1e-10)
    with no_fallback():
        u, s, vh = torch.linalg.svd(a.to(TPU), full_matrices=True)
    uc, sc, vhc = torch.linalg.svd(a, full_matrices=True)
    torch.testing.assert_close(s.cpu(), sc, atol=1e-5, rtol=1e-5)
    assert u.shape == (6, 6) and vh.shape == (4, 4)
    torch.testing.assert_close(u.cpu()[:, :4].abs(), uc[:, :4].abs(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vh.cpu().abs(), vhc.abs(), atol=1e-4, rtol=1e-4)


def test_linalg_errors_are_raised():
    not_pd = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        torch.linalg.cholesky(not_pd.to(TPU))
    l, info = torch.linalg.cholesky_ex(not_pd.to(TPU))
    assert int(info.cpu()) > 0
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        torch.linalg.inv(singular.to(TPU))
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.solve(singular.to(TPU), torch.ones(2).to(TPU))
    sign, logabs = torch.linalg.slogdet(singular.to(TPU))
    assert sign.item() == 0 and logabs.item() == -math.inf
    assert torch.linalg.det(singular.to(TPU)).item() == 0


# ================================================================ foreach
def _lists(dtype=torch.float32):
    shapes = [(3, 4), (5,), (), (2, 3, 2)]
    return [R(*s, dtype=dtype) for s in shapes]


def _pos(xs):
    return [x.abs() + 0.5 for x in xs]


FOREACH = {  # name -> (fn, number of list arguments, the overload it exercises)
    "add_list": (lambda a, b: torch._foreach_add(a, b, alpha=0.5), 2, "_foreach_add.List"),
    "add_scalar": (lambda a: torch._foreach_add(a, 2.5), 1, "_foreach_add.Scalar"),
    "add_scalarlist": (lambda a: torch._foreach_add(a, [1.0, 2.0, -1, 0.5]), 1, "_foreach_add.ScalarList"),
    "add_tensor": (lambda a: torch._foreach_add(a, torch.tensor(0.25), alpha=2), 1, "_foreach_add.Tensor"),
    "sub_list": (lambda a, b: torch._foreach_sub(a, b), 2, "_foreach_sub.List"),
    "mul_list": (lambda a, b: torch._foreach_mul(a, b), 2, "_foreach_mul.List"),
    "mul_scalarlist": (lambda a: torch._foreach_mul(a, [1.0, 2.0, 3.0, 4.0]), 1, "_foreach_mul.ScalarList"),
    "mul_tensor": (lambda a: torch._foreach_mul(a, torch.tensor(3.0)), 1, "_foreach_mul.Tensor"),
    "div_list": (lambda a, b: torch._foreach_div(a, _pos(b)), 2, "_foreach_div.List"),
    "div_scalarlist": (lambda a: torch._foreach_div(a, [1.5, 2.0, 3.0, 4.0]), 1, "_foreach_div.ScalarList"),
    "maximum": (lambda a, b: torch._foreach_maximum(a, b), 2, "_foreach_maximum.List"),
    "minimum_scalar": (lambda a: torch._foreach_minimum(a, 0.1), 1, "_foreach_minimum.Scalar"),
    "clamp_min_scalarlist": (lambda a: torch._foreach_clamp_min(a, [0.0, -1.0, 0.5, 0.2]), 1,
                             "_foreach_clamp_min.ScalarList"),
    "clamp_max_list": (lambda a, b: torch._foreach_clamp_max(a, b), 2, "_foreach_clamp_max.List"),
    "pow_scalar": (lambda a: torch._foreach_pow(a, 2), 1, "_foreach_pow.Scalar"),
    "pow_list": (lambda a, b: torch._foreach_pow(_pos(a), b), 2, "_foreach_pow.List"),
    "pow_scalar_and_tensor": (lambda a: torch._foreach_pow(2.0, a), 1, "_foreach_pow.ScalarAndTensor"),
    "sqrt": (lambda a: torch._foreach_sqrt(_pos(a)), 1, "_foreach_sqrt.default"),
    "exp_neg_sign": (lambda a: torch._foreach_exp(torch._foreach_neg(torch._foreach_sign(a))), 1,
                     "_foreach_exp.default"),
    "reciprocal": (lambda a: torch._foreach_reciprocal(_pos(a)), 1, "_foreach_reciprocal.default"),
    "lerp_scalar": (lambda a, b: torch._foreach_lerp(a, b, 0.3), 2, "_foreach_lerp.Scalar"),
    "lerp_list": (lambda a, b: torch._foreach_lerp(a, b, _pos(b)), 2, "_foreach_lerp.List"),
    "addcmul_scalar": (lambda a, b: torch._foreach_addcmul(a, b, b, value=0.5), 2, "_foreach_addcmul.Scalar"),
    "addcdiv_scalarlist": (lambda a, b: torch._foreach_addcdiv(a, b, _pos(a), [0.1, 0.2, 0.3, 0.4]), 2,
                           "_foreach_addcdiv.ScalarList"),
    "addcdiv_tensor": (lambda a, b: torch._foreach_addcdiv(a, b, _pos(a), torch.tensor([0.1, 0.2, 0.3, 0.4])), 2,
                       "_foreach_addcdiv.Tensor"),
    "norm": (lambda a: torch._foreach_norm(a), 1, "_foreach_norm.Scalar"),
    "norm_inf": (lambda a: torch._foreach_norm(a, float("inf")), 1, "_foreach_norm.Scalar"),
    "max": (lambda a: torch._foreach_max(a), 1, "_foreach_max.default"),
}


@pytest.mark.parametrize("name", list(FOREACH))
def test_foreach_functional(name):
    fn, nargs, op = FOREACH[name]
    out = check(fn, *[_lists() for _ in range(nargs)], grad=False, atol=1e-5, rtol=1e-5, expect=[op])
    assert isinstance(out, (list, tuple)) and all(t.device.type == TPU for t in out)


INPLACE = {
    "add_": (lambda a, b: torch._foreach_add_(a, b, alpha=2), "_foreach_add_.List"),
    "mul_scalar_": (lambda a, b: torch._foreach_mul_(a, 0.5), "_foreach_mul_.Scalar"),
    "div_scalarlist_": (lambda a, b: torch._foreach_div_(a, [2.0, 3.0, 4.0, 5.0]), "_foreach_div_.ScalarList"),
    "addcdiv_scalarlist_": (lambda a, b: torch._foreach_addcdiv_(a, b, _pos(b), [0.1, 0.2, 0.3, 0.4]),
                            "_foreach_addcdiv_.ScalarList"),
    "lerp_": (lambda a, b: torch._foreach_lerp_(a, b, 0.9), "_foreach_lerp_.Scalar"),
    "sqrt_": (lambda a, b: torch._foreach_sqrt_(_pos(a)), "_foreach_sqrt_.default"),
    "zero_": (lambda a, b: torch._foreach_zero_(a), "_foreach_zero_.default"),
    "copy_": (lambda a, b: torch._foreach_copy_(a, b), "_foreach_copy_.default"),
}


def _views(base):
    return [base[:12].view(3, 4), base[12:17], base[20], base[24:36].view(2, 3, 2)]


@pytest.mark.parametrize("name", list(INPLACE))
def test_foreach_inplace(name):
    """In-place forms (derived by the installer) write each tensor, including a
    strided view of a larger tensor, and are one lowered op."""
    fn, op = INPLACE[name]
    a_cpu, b_cpu = _lists(), _lists()
    a_cpu[1] = R(3, 10)[1, ::2]  # a strided view: the write goes through to its base
    base_cpu = a_cpu[1]._base
    a_tpu = [x.to(TPU) for x in a_cpu]
    base_tpu = base_cpu.to(TPU)
    a_tpu[1] = base_tpu[1, ::2]
    fn(a_cpu, b_cpu)
    log = _OpLog()
    with no_fallback(), log:
        fn(a_tpu, [x.to(TPU) for x in b_cpu])
    for x, y in zip(a_tpu, a_cpu):
        torch.testing.assert_close(host(x), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(base_tpu.cpu(), base_cpu, atol=1e-5, rtol=1e-5)
    assert op in log.ops and _lowered(op), log.ops


def test_foreach_inplace_entries_sharing_one_storage():
    # the entries are written in turn (FSDP2's copy-in, DDP bucket views, flat params)
    base = R(40)
    base_t = base.to(TPU)
    torch._foreach_add_(_views(base), 1.0)
    with no_fallback():
        torch._foreach_add_(_views(base_t), 1.0)
    torch.testing.assert_close(base_t.cpu(), base)


def test_foreach_mixed_dtypes_promote_like_pytorch():
    a = [torch.arange(4), torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)]
    out = check(lambda a: torch._foreach_div(a, 3), a, grad=False, atol=1e-2, rtol=1e-2)
    assert [t.dtype for t in out] == [torch.float32, torch.float64, torch.bfloat16]
    out = check(lambda a: torch._foreach_add(a, 1), a, grad=False, atol=1e-2, rtol=1e-2)
    assert out[0].dtype == torch.int64


# ================================================================ optimizers end to end
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, idx):
        return self.out(F.gelu(self.fc(self.ln(self.emb(idx))))).mean(1)


OPTIMIZERS = {
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_loop": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_amsgrad_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "adam_fused_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, amsgrad=True, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_nesterov_loop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                   foreach=False),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, fused=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_match_cpu(name):
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    net_c = _Net()
    net_t = copy.deepcopy(net_c).to(TPU)
    opt_c, opt_t = make(net_c.parameters()), make(net_t.parameters())
    idx = torch.randint(0, 20, (6, 3))
    y = torch.randint(0, 5, (6,))
    idx_t, y_t = idx.to(TPU), y.to(TPU)
    log = _OpLog()
    for _ in range(4):
        loss_c = F.cross_entropy(net_c(idx), y)
        opt_c.zero_grad()
        loss_c.backward()
        opt_c.step()
        with no_fallback():
            loss_t = F.cross_entropy(net_t(idx_t), y_t)
            opt_t.zero_grad()
            loss_t.backward()
            with log:
                opt_t.step()
        torch.testing.assert_close(loss_t.item(), loss_c.item(), atol=1e-5, rtol=1e-5)
    for (n, pc), pt in zip(net_c.named_parameters(), net_t.parameters()):
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    if "fused" in name:
        assert any(op.startswith("_fused_") for op in log.ops), log.ops
    elif "foreach" in name or name == "sgd_momentum":
        assert any(op.startswith("_foreach_") for op in log.ops), log.ops


def test_adamw_foreach_does_not_recompile_per_step():
    """The per-step bias corrections reach ``_foreach_*.ScalarList`` as traced values."""
    net = _Net().to(TPU)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
    idx, y = torch.randint(0, 20, (6, 3)).to(TPU), torch.randint(0, 5, (6,)).to(TPU)

    def step():
        loss = F.cross_entropy(net(idx), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    before = dict(torchtpu.metrics.snapshot()["cache_misses"])
    for _ in range(3):
        step()
    after = dict(torchtpu.metrics.snapshot()["cache_misses"])
    assert after == before, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
