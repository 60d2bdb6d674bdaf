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
from .mc import TPUManagedCollisionCollectionSharder, tpu_mc_ebc_sharder
from . import dmp as _dmp
from .dmp import compile_dense, tpu_data_parallel_wrapper
from . import planner as _planner
from .planner import tpu_sharders

_dmp.install()  # DistributedModelParallel(model, device=torch.device("tpu")) gets the tpu defaults
_planner.install()  # Topology(compute_device="tpu") and TorchRec's planner over it

__all__ = [
    "compile_dense",
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
    "tpu_mc_ebc_sharder",
    "TPUManagedCollisionCollectionSharder",
    "TPUShardedEmbeddingBagCollection",
]
