"""Compiled mode: ``torch.compile(model, backend="tpu")``.

Dynamo captures the program, AOTAutograd splits forward and backward into
functional aten graphs (PyTorch's core aten decompositions, minus the ops this
package lowers directly), and each graph becomes ONE ``jax.jit``: an
interpreter over the graph's nodes that calls, for each aten op, the same
lowering the eager modes use (``dispatch.lowering.LOWERINGS``), so every op
has one source of truth.

One file per concern: ``nodes.py`` (the FX-node lowering table: views and
factories as value ops), ``shapes.py`` and ``padding.py`` (symbolic sizes and
the padding prover), ``executable.py`` (the graph's jitted executable, its
donation and write-back of input mutations), ``dynamo.py`` (the backend).

Dynamic shapes (``dynamic=True``, ``torch._dynamo.mark_dynamic``, or Dynamo's
automatic dynamic shapes): each size symbol is rounded up to a bucket of a
:class:`torchtpu.bucketing.BucketPolicy` (``options={"bucket_policy": ...}``,
default powers of two), inputs are padded, outputs sliced back, and one
executable serves a whole bucket. Padding is only used where a static analysis
of the graph proves the real part of every output unchanged (no reduction,
contraction or softmax over a padded dim; causal attention is fine); any other
dynamic graph compiles per size with one ``RecompileWarning`` saying why.

Training steps: Dynamo breaks ``loss.backward(); opt.step()`` into a forward graph, a
backward graph (run by the autograd engine) and an optimizer graph. With
``torch._dynamo.config.trace_autograd_ops = True`` Dynamo traces ``backward()`` into the
forward's graph instead (two executables, no autograd engine at run time), provided
``zero_grad`` is called outside the compiled function and no tensor with a ``grad_fn``
outlives ``backward()`` (``loss = loss.detach()`` before ``opt.step()``);
``torchtpu_models.training_step(..., mode="traced_backward")`` is that pattern. As for
cuda/xpu, a compiled optimizer on tpu params is made ``capturable`` (step counters on the
device). ``AdamW(fused=True)``: Dynamo graph-breaks on the fused path for every backend, so
its step runs eagerly as one ``_fused_adamw_`` executable.

Metrics: each graph's executables are counted under its own name (``graph_label``:
function, file:line, Dynamo frame id, forward/backward/inference), so the
``RecompileWarning`` fires only when the same graph keeps recompiling.

A graph containing an op with no lowering runs eagerly through its FX
GraphModule on tpu tensors (eager kernels and the CPU fallback handle it), with
one warning naming the op(s); with CPU fallback off it raises instead.
"""

from .dynamo import decompositions, register, tpu_backend
from .executable import compile_graph, graph_label, is_graph_label

__all__ = ["compile_graph", "decompositions", "graph_label", "is_graph_label", "tpu_backend"]

register()
