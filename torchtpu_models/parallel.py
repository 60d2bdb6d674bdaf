"""How :class:`TinyTransformer` is split for tensor parallelism, the way TorchTitan splits its models:
a ``parallelize_module`` plan for one block. Plain PyTorch (``torch.distributed.tensor.parallel``)."""

from __future__ import annotations

__all__ = ["block_tp_plan"]


def block_tp_plan(sequence_parallel: bool = True) -> dict:
    """The plan of one ``TinyTransformer`` block (built with ``fused_qkv=False``) for
    ``parallelize_module(block, tp_mesh, plan)``: ``ColwiseParallel`` on the attention's ``wq``/``wk``/``wv``
    (each rank holds whole heads) and the MLP's ``fc``, ``RowwiseParallel`` on ``proj`` and ``out``.

    With ``sequence_parallel``, between those regions the residual stream is split along the sequence:
    the norms run on their part (``SequenceParallel``), it is gathered before attention and the MLP
    (``PrepareModuleInput``), and the row-wise outputs are reduce-scattered back onto it; the block takes
    and returns the whole sequence, so the rest of the model is untouched."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "mlp.fc": ColwiseParallel()}
    if not sequence_parallel:
        return {**plan, "attn.proj": RowwiseParallel(), "mlp.out": RowwiseParallel()}
    seq, whole = Shard(1), Replicate()
    # Block.forward(x, cos, sin, attn_mask) calls attn(x, cos, sin, attn_mask, cache, cache_position)
    return {
        **plan,
        "": PrepareModuleInputOutput(input_layouts=(whole, None, None, None),
                                     desired_input_layouts=(seq, None, None, None), use_local_input=True,
                                     output_layouts=seq, desired_output_layouts=whole),
        "ln1": SequenceParallel(), "ln2": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(seq,) + (None,) * 5, desired_input_layouts=(whole,) + (None,) * 5),
        "attn.proj": RowwiseParallel(output_layouts=seq),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        "mlp.out": RowwiseParallel(output_layouts=seq),
    }
