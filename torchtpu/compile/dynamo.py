"""The Dynamo glue of ``torch.compile(backend="tpu")``: the backend function (AOTAutograd
with our decompositions and executables), graph labels for the metrics, and the two
adjustments Dynamo needs to run beside torchtpu (keep out of runtime code; capturable
optimizers on tpu)."""

from __future__ import annotations

import functools

import torch

from ..base.opnames import qualified_name
from ..bucketing import BucketPolicy
from ..dispatch.lowering import LOWERINGS
from .executable import compile_graph, graph_label
from .nodes import FUNCTIONAL


_DECOMPS = None


def decompositions():
    """PyTorch's core aten decompositions, minus the ops that have a tpu lowering of their own."""
    global _DECOMPS
    if _DECOMPS is None:
        from torch._decomp import core_aten_decompositions

        table = dict(core_aten_decompositions())
        for op in list(table):
            if isinstance(op, torch._ops.OpOverload) and (qualified_name(op) in LOWERINGS or op in FUNCTIONAL):
                del table[op]
        _DECOMPS = table
    return _DECOMPS


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The ``"tpu"`` Dynamo backend: AOTAutograd forward/backward graphs -> one ``jax.jit`` each."""
    from torch._dynamo.backends.common import aot_autograd

    options = dict(kwargs.pop("options", None) or {})
    kwargs.pop("mode", None)
    policy = options.pop("bucket_policy", None)
    if options:
        raise ValueError(f"torchtpu compile: unknown option(s) {sorted(options)}; known: ['bucket_policy']")
    if policy is not None:
        if not isinstance(policy, BucketPolicy):
            raise TypeError(f"torchtpu compile: options['bucket_policy'] must be a torchtpu.bucketing.BucketPolicy, "
                            f"not {type(policy).__name__}")
    # labels now: the backward may be compiled lazily, outside Dynamo's compile context
    comp = {role: functools.partial(compile_graph, policy=policy, label=graph_label(role))
            for role in ("forward", "backward", "inference")}
    backend = aot_autograd(
        fw_compiler=comp["forward"],
        bw_compiler=comp["backward"],
        inference_compiler=comp["inference"],
        decompositions=decompositions(),
        # optimizer steps and buffer updates stay inside the graph: one executable computes
        # them and the runtime swaps each input's buffer (donated) instead of copying back op by op
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs, **kwargs)


def _skip_runtime_code() -> None:
    """Keep Dynamo out of JAX and of torchtpu's runtime.

    Eager pieces run between graphs (graph breaks, ``loss.backward()``) call
    torchtpu's Python kernels from C++ while Dynamo's frame hook is set; without
    this Dynamo would try to trace jax.numpy inside them. Model code (including
    ``torchtpu_models``) lives outside the package and stays traceable.
    """
    from torch._dynamo import trace_rules

    for name in ("jax", "jaxlib", "torchtpu"):
        trace_rules.add(name)


def _capturable_tpu_optimizers() -> None:
    """Compiled optimizers on tpu keep their step counters on the device, as on cuda/xpu.

    When Dynamo traces ``optimizer.step()`` it sets ``capturable=True`` on param groups whose
    params are all on cuda/xpu and have no state yet, so ``state["step"]`` is created on the
    device. tpu params are left out by that check: their counters would stay CPU tensors,
    which the optimizer graph updates as host outputs, a device-to-host transfer (and a wait
    for the whole executable) per counter and step. This extends the check to tpu.
    """
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:  # a torch without Dynamo's optimizer support: nothing to extend
        return
    orig = getattr(OptimizerVariable, "_set_capturable", None)
    if orig is None or getattr(orig, "_torchtpu", False):
        return

    def _set_capturable(self, tx):
        opt = self.value
        for group in opt.param_groups:
            params = group.get("params", [])
            if ("capturable" in group and params and all(p.device.type == "tpu" for p in params)
                    and not any(p in opt.state for p in params)):
                group["capturable"] = True
        return orig(self, tx)

    _set_capturable._torchtpu = True
    OptimizerVariable._set_capturable = _set_capturable


def register() -> None:
    from torch._dynamo import list_backends, register_backend

    _skip_runtime_code()
    _capturable_tpu_optimizers()
    if "tpu" not in list_backends(exclude_tags=()):
        register_backend(name="tpu")(tpu_backend)


register()
