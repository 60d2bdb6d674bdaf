"""Quantized products on tpu: the int8 / float8 lowerings against PyTorch's CPU kernels, torchao's
``quantize_`` on a tpu model in the three execution modes without CPU fallback, and
``torchtpu.quantization.quantize_`` (whole models, layers left in float, float8 support)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn as nn

import torchtpu
from torchtpu.compile.nodes import run_out_dtype
from torchtpu.dispatch.lowering import LOWERINGS
from helpers import no_fallback, tiny_hf_causal_lm

pytest.importorskip("torchao")
from torchao.quantization import (Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,  # noqa: E402
                                  Int8WeightOnlyConfig)
from torchao.quantization import quantize_ as ao_quantize_  # noqa: E402

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _int8(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)


def _misses(op: str) -> int:
    s = torchtpu.metrics.snapshot()
    return s["cache_misses"].get(op, 0)


# ---------------------------------------------------------------- the lowerings
def test_int_mm_and_int8_mm_match_cpu():
    a, b, c = _int8(16, 64), _int8(64, 24, seed=1), _int8(16, 24, seed=2)
    with no_fallback():
        got = torch._int_mm(a.to("tpu"), b.to("tpu"))
        assert got.dtype == torch.int32
        torch.testing.assert_close(got.cpu(), torch._int_mm(a, b), rtol=0, atol=0)
        # int8 mm / addmm keep int8 (wrapping, as on CPU) but accumulate in int32
        torch.testing.assert_close(torch.mm(a.to("tpu"), b.to("tpu")).cpu(), torch.mm(a, b), rtol=0, atol=0)
        torch.testing.assert_close(torch.addmm(c.to("tpu"), a.to("tpu"), b.to("tpu"), beta=2).cpu(),
                                   torch.addmm(c, a, b, beta=2), rtol=0, atol=0)


def test_quantized_lowerings_are_integer_and_float8_dots():
    """The XLA programs: s8 x s8 -> s32 dots, f8 operands as they are (no widening before the dot)."""
    def dots(fn, *args):
        jaxpr = jax.make_jaxpr(fn)(*args)
        return [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]

    i8 = jnp.ones((4, 8), jnp.int8)
    for fn in (LOWERINGS["aten::_int_mm.default"].fn, LOWERINGS["aten::mm.default"].fn,
               lambda a, b: run_out_dtype(torch.ops.aten.mm.default, torch.int32, a, b)):
        (eq,) = dots(fn, i8, i8.T)
        assert [v.aval.dtype for v in eq.invars] == [jnp.int8, jnp.int8]
        assert eq.params["preferred_element_type"] == jnp.int32
    f8 = jnp.ones((4, 8), jnp.float8_e4m3fn)
    one = jnp.ones((), jnp.float32)
    (eq,) = dots(LOWERINGS["aten::_scaled_mm.default"].fn, f8, f8.T, one, one)
    assert [v.aval.dtype for v in eq.invars] == [jnp.float8_e4m3fn] * 2
    assert eq.params["preferred_element_type"] == jnp.float32


@pytest.mark.parametrize("fp8", F8, ids=str)
def test_scaled_mm_matches_cpu(fp8):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(16, 32, generator=g) * 4).to(fp8)
    b = (torch.randn(32, 32, generator=g) * 4).to(fp8).t()  # column-major, as _scaled_mm wants
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    tensorwise = (torch.tensor(0.5), torch.tensor(2.0))
    rowwise = (torch.rand(16, 1, generator=g) + 0.5, torch.rand(1, 32, generator=g) + 0.5)
    with no_fallback():
        for sa, sb in (tensorwise, rowwise):
            for kw in ({"out_dtype": torch.float32}, {"out_dtype": torch.bfloat16, "bias": bias}):
                if sa.dim() and fp8 is torch.float8_e5m2:
                    continue  # CPU's row-wise kernel takes e4m3 only
                want = torch._scaled_mm(a, b, sa, sb, **kw)
                b_tpu = b.t().to("tpu").t()  # column-major on tpu too
                got = torch._scaled_mm(a.to("tpu"), b_tpu, sa.to("tpu"), sb.to("tpu"),
                                       **{k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
                assert got.dtype == want.dtype
                torch.testing.assert_close(got.cpu().float(), want.float(), rtol=1e-2, atol=1e-2)


def test_weight_int8pack_mm_matches_cpu():
    g = torch.Generator().manual_seed(0)
    x, w, s = torch.randn(8, 64, generator=g), _int8(24, 64), torch.rand(24, generator=g) / 64
    with no_fallback():
        got = torch._weight_int8pack_mm(x.to("tpu"), w.to("tpu"), s.to("tpu"))
    torch.testing.assert_close(got.cpu(), torch._weight_int8pack_mm(x, w, s), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- torchao on a tpu model
SCHEMES = {"int8_weight_only": Int8WeightOnlyConfig, "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
           "fp8_weight_only": Float8WeightOnlyConfig}
TOLERANCE = {"int8_weight_only": 0.02, "int8_dynamic": 0.03, "fp8_weight_only": 0.08}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_torchao_quantize_runs_on_tpu_in_every_mode(scheme):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40))
    x = torch.randn(8, 64)
    with torch.no_grad():
        want = cpu(x)
    model = cpu.to("tpu")
    ao_quantize_(model, SCHEMES[scheme]())
    assert type(model[0].weight).__name__ in ("Int8Tensor", "Float8Tensor")
    assert model[0].weight.qdata.device.type == "tpu"
    before_int_mm = _misses("aten::_int_mm")
    outs = {}
    with no_fallback(), warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.TPUFallbackWarning)  # a compiled graph run eagerly warns
        with torch.no_grad():
            outs["eager"] = model(x.to("tpu")).cpu()
            with torchtpu.execution_mode("defer_and_fuse"):
                outs["defer_and_fuse"] = model(x.to("tpu")).cpu()
            outs["compiled"] = torch.compile(model, backend="tpu")(x.to("tpu")).cpu()
    for mode, got in outs.items():
        rel = float((got - want).norm() / want.norm())
        assert rel < TOLERANCE[scheme], (mode, rel)
    if scheme == "int8_dynamic":  # activations quantized too: the int8 x int8 dot ran as _int_mm
        assert _misses("aten::_int_mm") > before_int_mm
    assert not any(k.startswith("compiled graph (eager") for k in torchtpu.metrics.snapshot()["cache_misses"])


# ---------------------------------------------------------------- torchtpu.quantization.quantize_
def test_quantize_whole_hf_model_keeps_output_layer_and_matches_float():
    cpu = tiny_hf_causal_lm("qwen2", tie_word_embeddings=False)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = cpu(ids).logits
    model = cpu.to("tpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        names = torchtpu.quantization.quantize_(model, "int8_dynamic")
    assert not [w for w in seen if "stay in float" in str(w.message)]  # every layer of a Llama-like model
    assert "lm_head" not in names and "model.layers.0.self_attn.q_proj" in names
    assert len(names) == 7 * 2  # q, k, v, o, gate, up, down per layer
    with no_fallback(), torch.no_grad():
        got = model(ids.to("tpu")).logits.cpu()
    assert float((got - want).norm() / want.norm()) < 0.03


def test_quantize_warns_once_naming_layers_left_in_float():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).to("tpu")
    with pytest.warns(UserWarning, match=r"4 layer\(s\) stay in float: transformer\.h\.0\.attn\.c_attn \(Conv1D\)"):
        names = torchtpu.quantization.quantize_(model, "int8_weight_only")
    assert names == []
    with pytest.raises(ValueError, match="scheme must be one of"):
        torchtpu.quantization.quantize_(model, "int4")


def test_float8_support_is_probed_on_the_backend():
    # XLA's CPU backend runs float8 dots (converted); the probe is what gates fp8_weight_only
    assert torchtpu.quantization.float8_supported() is True
