"""Training proof: the reference models train on tpu exactly as they do on CPU.

Each run builds the model on CPU under a fixed seed, moves a deep copy to the
device, and trains 20 steps on the same pre-generated batches; the tpu losses
must match the CPU losses.

Tolerance. Everything is float32, and XLA and ATen compute the same math with
different kernels (other summation orders in matmuls and reductions, other
exp/log/erf approximations, fused multiply-adds), so each op differs by a few
ulp and training carries those differences forward; AdamW divides by
sqrt(v) + eps, which amplifies small differences rather than damping them. How
far float32 rounding alone moves a given run is measured, not guessed: the
same training is run on CPU in float64, and the CPU float32 losses' distance
from it (a running maximum over the steps so far) is the run's rounding
envelope. The tpu losses may differ from the CPU float32 losses by at most
DRIFT_FACTOR times that envelope (relative, with a floor of DRIFT_FLOOR for the
first steps, where the envelope is ~1e-8). Measured: the largest ratio over
all runs here is 5.3 (transformer, AdamW), so a factor of 20 leaves about 4x
headroom; the floor lets the first steps differ by 2e-6 relative, while a real
bug (a wrong gradient, a missed in-place update, an untied weight) moves the
loss by 1e-4 or more right after the first update.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import torchtpu
from torchtpu_models import DLRMConfig, DLRMStyleMLP, TinyTransformer, TransformerConfig

# See the module docstring for how these were chosen.
DRIFT_FACTOR = 20.0
DRIFT_FLOOR = 1e-7
WEIGHT_FLOOR = 1e-6  # absolute, for weights the envelope barely moves (weights here are ~0.02-1)
STEPS = 20

# Ops that still run through the CPU fallback in these runs. Empty means the
# whole training step (forward, backward, optimizer) runs on tpu lowerings.
KNOWN_FALLBACKS: dict[str, set[str]] = {
    "transformer": set(),
    "dlrm": set(),
}

# learning rates chosen so that 20 steps visibly train both models (memorizing two
# cycled batches): parity of losses that barely move would prove little
OPTIMIZERS = {
    "adamw_foreach": lambda p, sgd_lr: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, foreach=True),
    "adamw_loop": lambda p, sgd_lr: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, foreach=False),
    "sgd_momentum": lambda p, sgd_lr: torch.optim.SGD(p, lr=sgd_lr, momentum=0.9),
}
SGD_LR = {"transformer": 0.1, "dlrm": 0.5}


# ---------------------------------------------------------------- data
def transformer_batches(cfg: TransformerConfig, n, batch=4, seed=1, distinct=2):
    """Periodic token sequences (a block of 8 repeated), ``distinct`` batches cycled."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(distinct):
        block = torch.randint(0, cfg.vocab_size, (batch, 8), generator=g)
        seq = block.repeat(1, cfg.max_seq_len // 8 + 1)[:, : cfg.max_seq_len + 1]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return [out[i % distinct] for i in range(n)]


def dlrm_batches(model: DLRMStyleMLP, n, batch=64, seed=1, distinct=2):
    g = torch.Generator().manual_seed(seed)
    out = [model.make_batch(batch, g) for _ in range(distinct)]
    return [out[i % distinct] for i in range(n)]


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return type(batch)(to_device(b, device) for b in batch)


# ---------------------------------------------------------------- one training run
def train(model, batches, make_opt, device):
    model = copy.deepcopy(model).to(device)
    model.train()
    opt = make_opt(model.parameters())
    losses = []
    for b in batches:
        loss = model.loss(*to_device(b, device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def to_float64(batch):
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    return type(batch)(to_float64(b) for b in batch)


def run_pair(model, batches, make_opt):
    cpu_losses, cpu_model = train(model, batches, make_opt, "cpu")
    ref_losses, ref_model = train(copy.deepcopy(model).double(), [to_float64(b) for b in batches], make_opt, "cpu")
    torchtpu.metrics.reset()
    tpu_losses, tpu_model = train(model, batches, make_opt, "tpu")
    fallbacks = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    return Run(cpu_losses, ref_losses, tpu_losses, cpu_model, ref_model, tpu_model, fallbacks)


class Run:
    def __init__(self, cpu, ref64, tpu, cpu_model, ref_model, tpu_model, fallbacks):
        self.cpu, self.ref64, self.tpu = cpu, ref64, tpu
        self.cpu_model, self.ref_model, self.tpu_model = cpu_model, ref_model, tpu_model
        self.fallbacks = fallbacks


def check(kind, run):
    cpu_losses, tpu_losses, fallbacks = run.cpu, run.tpu, run.fallbacks
    rel = [abs(t - c) / abs(c) for t, c in zip(tpu_losses, cpu_losses)]
    drift = [abs(c - r) / abs(r) for c, r in zip(cpu_losses, run.ref64)]
    envelope = [max(drift[: i + 1]) for i in range(len(drift))]
    allowed = [DRIFT_FACTOR * max(e, DRIFT_FLOOR) for e in envelope]
    print(f"\n{kind}: cpu_fallbacks={fallbacks}")
    print(f"{kind}: cpu losses {cpu_losses[0]:.5f} -> {cpu_losses[-1]:.5f}; tpu-vs-cpu max rel diff "
          f"{max(rel):.2e}; float32 rounding envelope (cpu f32 vs f64) max {max(drift):.2e}")
    assert all(math.isfinite(x) for x in tpu_losses), tpu_losses
    bad = [(i, cpu_losses[i], tpu_losses[i], rel[i], allowed[i]) for i in range(len(rel)) if rel[i] > allowed[i]]
    assert not bad, "tpu losses left the float32 rounding envelope (step, cpu, tpu, rel diff, allowed): " + "; ".join(
        f"({i}, {c:.7f}, {t:.7f}, {r:.1e}, {a:.1e})" for i, c, t, r, a in bad
    )
    # training did something: the last losses are below the first
    assert sum(cpu_losses[-3:]) / 3 < cpu_losses[0]
    # The trained weights agree too, by the same rule per tensor (max abs difference vs
    # the tensor's own float32 envelope). Some weights drift far on CPU alone: a key
    # projection's bias has an exactly-zero gradient (softmax ignores a shift shared by
    # all keys), so AdamW turns its pure rounding noise into lr-sized steps.
    cpu_sd, ref_sd = run.cpu_model.state_dict(), run.ref_model.state_dict()
    for name, p in run.tpu_model.state_dict().items():
        c = cpu_sd[name]
        if not c.is_floating_point():
            assert torch.equal(p.cpu(), c), name
            continue
        diff = (p.cpu() - c).abs().max().item()
        env = (c.double() - ref_sd[name]).abs().max().item()
        assert diff <= DRIFT_FACTOR * max(env, WEIGHT_FLOOR), (
            f"{name}: tpu and cpu weights differ by {diff:.2e}; float32 envelope {env:.2e}"
        )
    unexpected = set(fallbacks) - KNOWN_FALLBACKS[kind]
    assert not unexpected, f"{kind} training fell back to CPU for {sorted(unexpected)} ({fallbacks})"


# ---------------------------------------------------------------- parity tests
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_transformer_matches_cpu(opt_name):
    cfg = TransformerConfig()  # vocab 256, d_model 64, 2 layers, 4 heads, seq 32, RoPE, LayerNorm, GELU, tied
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    batches = transformer_batches(cfg, STEPS)
    run = run_pair(model, batches, lambda p: OPTIMIZERS[opt_name](p, SGD_LR["transformer"]))
    check("transformer", run)


def test_transformer_variant_matches_cpu():
    """The other building blocks: RMSNorm, SiLU, learned positions, untied head."""
    cfg = TransformerConfig(norm="rmsnorm", activation="silu", positions="learned", tie_embeddings=False)
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    batches = transformer_batches(cfg, STEPS)
    run = run_pair(model, batches, lambda p: OPTIMIZERS["adamw_foreach"](p, None))
    check("transformer", run)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_dlrm_matches_cpu(opt_name):
    torch.manual_seed(0)
    model = DLRMStyleMLP(DLRMConfig())
    batches = dlrm_batches(model, STEPS)
    run = run_pair(model, batches, lambda p: OPTIMIZERS[opt_name](p, SGD_LR["dlrm"]))
    check("dlrm", run)


# ---------------------------------------------------------------- model behaviour on tpu
def test_attention_mask_forward_matches_cpu():
    """The Hugging Face call shape with left padding: same logits on tpu and CPU,
    and the real tokens of a left-padded row see exactly what the unpadded row sees."""
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig()).eval()
    ids = torch.randint(0, 256, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # row 1: four pad tokens on the left
    with torch.no_grad():
        cpu = model(ids, attention_mask=mask)
        tpu = copy.deepcopy(model).to("tpu")(ids.to("tpu"), attention_mask=mask.to("tpu"))
        unpadded = model(ids[1:, 4:])
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cpu[1, 4:], unpadded[0], rtol=1e-4, atol=1e-5)
    # an all-ones mask is the same as no mask
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(ids)), model(ids))


def test_dropout_training_on_tpu():
    """dropout > 0: train mode is random (and seed-reproducible), eval mode is not, and the loss falls."""
    cfg = TransformerConfig(dropout=0.1)
    torch.manual_seed(0)
    model = TinyTransformer(cfg).to("tpu")
    x, y = to_device(transformer_batches(cfg, 1)[0], "tpu")  # the parity tests' shapes: cached executables

    model.train()
    torch.manual_seed(123)
    a = model(x)
    b = model(x)
    torch.manual_seed(123)
    a2 = model(x)
    assert not torch.equal(a.cpu(), b.cpu()), "dropout gave the same output twice in train mode"
    torch.testing.assert_close(a.cpu(), a2.cpu(), rtol=0, atol=0)  # reproducible under manual_seed
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).cpu(), model(x).cpu())
    model.train()

    # the parity tests cover foreach; the loop form keeps this test's executables few
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(25):
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    # ln(256) = 5.55 at the start; memorizing one batch with dropout still halves it within 25 steps
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses


def test_tied_weights_stay_tied_on_tpu():
    """Moving to tpu keeps the LM head tied to the embedding (torch's Module.to makes a new
    Parameter per module for cpu -> PrivateUse1, which would train two separate weights)."""
    model = TinyTransformer(TransformerConfig()).to("tpu")
    assert model.lm_head.weight is model.tok_emb.weight
    assert len(list(model.parameters())) == len(list(TinyTransformer(TransformerConfig()).parameters()))
    back = model.to("cpu")
    assert back.lm_head.weight is back.tok_emb.weight


@pytest.mark.parametrize("foreach", [False, True], ids=["adamw_loop", "adamw_foreach"])
def test_training_loop_stops_compiling(foreach):
    """A steady training loop reuses its executables: after the first steps, no XLA compiles.
    (Adam's foreach path passes the per-step bias corrections as a Scalar list: those must be
    traced arguments, not part of the executable's key.)"""
    cfg = TransformerConfig()
    torch.manual_seed(0)
    model = TinyTransformer(cfg).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    batches = [to_device(b, "tpu") for b in transformer_batches(cfg, 6)]
    compiles = []
    for x, y in batches:
        before = torchtpu.metrics.snapshot()["compiles"]
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        compiles.append(torchtpu.metrics.snapshot()["compiles"] - before)
    # step 0 compiles the step; step 1 may add the optimizer's steady-state forms
    assert compiles[2:] == [0] * (len(compiles) - 2), f"XLA compiles per step: {compiles}"
