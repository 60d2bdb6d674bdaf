"""TorchRec on tpu: sharders, lookups and planner helpers (see docs/rec.md)."""

from .embeddingbag import (
    TPU_SHARDING_TYPES,
    TPUEmbeddingBagCollectionSharder,
    TPUShardedEmbeddingBagCollection,
)
from .embeddingbag import tpu_placements
from .embedding import (
    TPU_SEQUENCE_SHARDING_TYPES,
    TPUEmbeddingCollectionSharder,
    TPUShardedEmbeddingCollection,
)
from .kernel import TPU_COMPUTE_KERNELS, TPUBatchedEmbedding, TPUBatchedEmbeddingBag


def tpu_sharders(fused_params=None, **kwargs):
    """The tpu sharders of EmbeddingBagCollection and EmbeddingCollection (see planner.tpu_sharders)."""
    from .planner import tpu_sharders as _tpu_sharders

    return _tpu_sharders(fused_params, **kwargs)


def tpu_data_parallel_wrapper(**ddp_kwargs):
    """DMP's ``data_parallel_wrapper`` for tpu: DDP of the dense part without ``static_graph``.

    TorchRec's default wrapper builds DDP(static_graph=True), whose reducer asks the PrivateUse1
    hooks for a pinned host allocator that a Python backend cannot provide (torch 2.13).
    """
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    return DefaultDataParallelWrapper(static_graph=False, ddp_kwargs=ddp_kwargs or None)


__all__ = [
    "tpu_data_parallel_wrapper",
    "tpu_placements",
    "TPU_COMPUTE_KERNELS",
    "TPU_SHARDING_TYPES",
    "TPUBatchedEmbedding",
    "TPUBatchedEmbeddingBag",
    "TPUEmbeddingBagCollectionSharder",
    "TPUEmbeddingCollectionSharder",
    "TPU_SEQUENCE_SHARDING_TYPES",
    "TPUShardedEmbeddingCollection",
    "tpu_sharders",
    "TPUShardedEmbeddingBagCollection",
]
