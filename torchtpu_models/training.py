"""One training step of a model with a ``loss`` method, eager or compiled in one of the ways
``torch.compile`` can capture it."""

from __future__ import annotations

import torch

__all__ = ["TRAINING_STEP_MODES", "training_step"]


# ============================================================== training step
TRAINING_STEP_MODES = ("eager", "whole", "fwd_bwd", "traced_backward")


def training_step(model, optimizer, inputs, targets, mode="eager", backend="tpu"):
    """A zero-argument function running one training step of ``model.loss(inputs, targets)``
    (forward, ``zero_grad(set_to_none=True)``, backward, ``optimizer.step()``) and returning the
    loss. ``mode`` says what ``torch.compile(backend=backend)`` captures:

    - ``"eager"``: nothing;
    - ``"whole"``: the whole step in one compiled function. Dynamo breaks the graph at
      ``zero_grad`` and ``loss.backward()`` and the optimizer: three executables (forward,
      backward via AOTAutograd and the autograd engine, optimizer step);
    - ``"fwd_bwd"``: forward and backward compiled, the optimizer step eager;
    - ``"traced_backward"``: ``torch._dynamo.config.trace_autograd_ops=True`` lets Dynamo trace
      ``loss.backward()`` as ``autograd.grad`` into the forward's graph: two executables (forward
      with backward, optimizer step) and no autograd engine at run time. What Dynamo needs for
      that: ``zero_grad`` outside the compiled function (Dynamo skips it, and the graph break it
      causes loses the rest of the frame), and no tensor with a ``grad_fn`` alive after
      ``backward()`` (``loss = loss.detach()`` before ``optimizer.step()``, whose own graph break
      would otherwise keep it). The returned loss is detached.
    """
    if mode not in TRAINING_STEP_MODES:
        raise ValueError(f"training_step: mode must be one of {TRAINING_STEP_MODES}, not {mode!r}")

    def step():
        loss = model.loss(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    if mode == "eager":
        return step
    import torch._dynamo  # noqa: F401  (config below)

    if mode == "whole":
        return torch.compile(step, backend=backend)
    if mode == "fwd_bwd":
        @torch.compile(backend=backend)
        def fwd_bwd():
            loss = model.loss(inputs, targets)
            loss.backward()
            return loss

        def run():
            optimizer.zero_grad(set_to_none=True)
            loss = fwd_bwd()
            optimizer.step()
            return loss

        return run

    @torch.compile(backend=backend)
    def traced():
        loss = model.loss(inputs, targets)
        loss.backward()
        loss = loss.detach()
        optimizer.step()
        return loss

    def run_traced():
        optimizer.zero_grad(set_to_none=True)
        # the flag is read while Dynamo traces; scoped here so other compiled code is unaffected
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return traced()

    return run_traced
