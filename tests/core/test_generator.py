"""``torch.Generator(device="tpu")`` with ``torch.cuda``'s generator semantics: its own stream, set by
``manual_seed``, saved and restored by ``get_state``/``set_state``, taken by every random op's
``generator=`` (factories and in-place fills), in Strict Eager and DeferAndFuse.

Needs the C++ hooks (``torchtpu/csrc``, built by ``scripts/setup.sh``): torch asks them for
new generators. Without a build those tests are skipped; one checks the error a process without the
hooks gets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torchtpu
from helpers import no_fallback
from torchtpu.runtime import pinned

needs_hooks = pytest.mark.skipif(not pinned.pinned_hooks_active(), reason="the C++ hooks are not built")

TPU = "tpu"

# every random op with a generator= argument, drawing from g
DRAWS = {
    "randn": lambda g: torch.randn(64, device=TPU, generator=g),
    "rand": lambda g: torch.rand(8, 8, device=TPU, dtype=torch.float64, generator=g),
    "randint": lambda g: torch.randint(-5, 1000, (64,), device=TPU, generator=g),
    "randperm": lambda g: torch.randperm(50, device=TPU, generator=g),
    "normal_": lambda g: torch.empty(64, device=TPU).normal_(1.0, 2.0, generator=g),
    "uniform_": lambda g: torch.empty(64, device=TPU).uniform_(-3, 3, generator=g),
    "bernoulli_": lambda g: torch.empty(64, device=TPU).bernoulli_(0.3, generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((64,), 0.5, device=TPU), generator=g),
    "exponential_": lambda g: torch.empty(64, device=TPU).exponential_(2.0, generator=g),
    "random_": lambda g: torch.empty(64, device=TPU, dtype=torch.int32).random_(0, 100, generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(4, 30, device=TPU), 10, generator=g),
    "normal_tensor": lambda g: torch.normal(torch.zeros(64, device=TPU), torch.ones(64, device=TPU), generator=g),
}


@needs_hooks
def test_generator_object_as_torch_cuda_has_it():
    g = torch.Generator(device=TPU)
    assert g.device == torch.device("tpu", 0)
    assert g.initial_seed() == torch.Generator().initial_seed()  # torch's default seed, as CUDA's new generators
    assert g.manual_seed(5) is g and g.initial_seed() == 5
    state = g.get_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    s = g.seed()  # a nondeterministic seed, returned and set
    assert g.initial_seed() == s
    g.set_state(state)
    assert g.initial_seed() == 5 and g.get_offset() == 0
    assert torch.Generator(device="tpu:0").device == torch.device("tpu", 0)
    with pytest.raises(RuntimeError, match="one device per process"):
        torch.Generator(device="tpu:1")
    with pytest.raises(RuntimeError, match="wrong size"):
        g.set_state(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="ByteTensor"):
        g.set_state(torch.zeros(16, dtype=torch.int32))
    gc = g.clone_state()
    assert gc.initial_seed() == 5 and gc.get_offset() == g.get_offset()


@needs_hooks
@pytest.mark.parametrize("mode", ["strict_eager", "defer_and_fuse"])
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_own_stream_reproducible_and_independent_of_the_global_one(name, mode):
    draw = DRAWS[name]
    g = torch.Generator(device=TPU)
    with no_fallback(), torchtpu.execution_mode(mode):
        g.manual_seed(1234)
        torch.manual_seed(0)
        a1, a2 = draw(g).cpu(), draw(g).cpu()
        torch.manual_seed(99)  # the global stream moves: g's numbers do not
        torch.randn(10, device=TPU)
        g.manual_seed(1234)
        b1, b2 = draw(g).cpu(), draw(g).cpu()
        assert torch.equal(a1, b1) and torch.equal(a2, b2)
        assert not torch.equal(a1, a2)  # each draw advances the stream
        state = g.get_state()
        c1 = draw(g).cpu()
        g.set_state(state)  # restored: the same next draw
        assert torch.equal(draw(g).cpu(), c1)
        g.manual_seed(4321)
        assert not torch.equal(draw(g).cpu(), a1)


@needs_hooks
def test_two_generators_and_the_global_stream():
    g1, g2 = torch.Generator(device=TPU).manual_seed(7), torch.Generator(device=TPU).manual_seed(7)
    x1 = torch.randn(100, device=TPU, generator=g1).cpu()
    assert torch.equal(torch.randn(100, device=TPU, generator=g2).cpu(), x1)  # the same seed, the same stream
    torch.manual_seed(7)  # a generator seeded like the global stream draws what it draws (as CUDA's do)
    assert torch.equal(torch.randn(100, device=TPU).cpu(), x1)
    torch.manual_seed(7)
    torch.randn(100, device=TPU, generator=g1)  # drawing from g1 leaves the global stream where it was
    assert torch.equal(torch.randn(100, device=TPU).cpu(), x1)
    assert g1.get_offset() == 2 and g2.get_offset() == 1
    # distribution: a generator's stream is a proper one
    z = torch.randn(200_000, device=TPU, generator=g1).cpu()
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01


@needs_hooks
def test_generator_of_another_device_is_refused():
    # CUDA: "Expected a 'cuda' device type for generator but found 'cpu'"
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        torch.randn(4, device=TPU, generator=torch.Generator())
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
        torch.randn(4, generator=torch.Generator(device=TPU))


def test_without_the_hooks_the_error_names_the_missing_hook():
    # torch's own NotImplementedError (torch asks only C++ hooks for generators); the random ops still run
    env = {**os.environ, "TORCHTPU_PINNED_HOOKS": "0"}
    code = ("import torch, torchtpu\nassert not torchtpu.runtime.pinned.pinned_hooks_active()\n"
            "print(torch.randn(2, device='tpu').shape)\ntorch.Generator(device='tpu')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "torch.Size([2])", out.stderr[-2000:]
    assert out.returncode != 0 and "getNewGenerator" in out.stderr, out.stderr[-2000:]


@needs_hooks
def test_default_generator_is_the_global_stream():
    # torch.cuda.default_generators[i] is the stream torch.manual_seed seeds and random ops without generator= use
    (g,) = torch.tpu.default_generators
    assert g.device == torch.device("tpu", 0) and torch.tpu.default_generators[0] is g
    torch.manual_seed(7)
    assert g.initial_seed() == 7 and g.get_offset() == 0
    a = torch.randn(16, device=TPU).cpu()
    assert g.get_offset() == 1 and torch.tpu.get_rng_state().tolist() == [7, 1]
    g.manual_seed(7)  # seeding the default generator is seeding the global stream
    assert torch.equal(torch.randn(16, device=TPU).cpu(), a)
    state = g.get_state()
    b = torch.randn(16, device=TPU).cpu()
    g.set_state(state)
    assert torch.equal(torch.randn(16, device=TPU).cpu(), b)
    torch.tpu.set_rng_state(torch.tensor([7, 1]))
    assert g.get_offset() == 1 and torch.equal(torch.randn(16, device=TPU).cpu(), b)
    with torch.random.fork_rng(device_type="tpu"):  # torch's own fork saves and restores it
        torch.randn(16, device=TPU)
    assert g.get_offset() == 2
    # passing it explicitly draws from the same stream
    g.manual_seed(7)
    assert torch.equal(torch.randn(16, device=TPU, generator=g).cpu(), a)


@needs_hooks
def test_generator_inside_a_compiled_graph():
    def noisy(x, gen):
        return x + torch.randn(x.shape, device=x.device, generator=gen)

    def dropped(x):
        return torch.nn.functional.dropout(x, 0.5, training=True)

    compiled, compiled_dropout = torch.compile(noisy, backend="tpu"), torch.compile(dropped, backend="tpu")
    x = torch.zeros(64, device=TPU)
    g = torch.Generator(device=TPU)
    g.manual_seed(3)
    eager = [noisy(x, g).cpu() for _ in range(2)]
    g.manual_seed(3)
    got = [compiled(x, g).cpu() for _ in range(2)]
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])  # the same stream as eager
    assert not torch.equal(got[0], got[1]) and g.get_offset() == 2  # each call advances it
    torchtpu.metrics.reset()
    g.manual_seed(3)
    assert torch.equal(compiled(x, g).cpu(), eager[0])  # reseeding replays it, with no recompile
    assert torchtpu.metrics.snapshot()["compiles"] == 0
    # the default stream inside a graph: torch.manual_seed replays it, each call draws anew
    torch.manual_seed(11)
    d1, d2 = compiled_dropout(torch.ones(256, device=TPU)).cpu(), compiled_dropout(torch.ones(256, device=TPU)).cpu()
    torch.manual_seed(11)
    assert torch.equal(compiled_dropout(torch.ones(256, device=TPU)).cpu(), d1)
    assert not torch.equal(d1, d2) and set(d1.unique().tolist()) == {0.0, 2.0}
