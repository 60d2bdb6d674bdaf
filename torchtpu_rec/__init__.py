"""torchtpu_rec: TorchRec embedding tables on TPU SparseCore.

- :mod:`torchtpu_rec.tables`: :class:`TableSpec`, :class:`OptimizerSpec`, stacking, MOD row sharding.
- :mod:`torchtpu_rec.preprocess`: KeyedJaggedTensor -> fixed-size per-SparseCore buffers.
- :mod:`torchtpu_rec.embedding`: :class:`SparseCoreEmbeddingBagCollection` (pooled, KJT -> KeyedTensor)
  and :class:`SparseCoreEmbeddingCollection` (sequence, KJT -> dict of JaggedTensor), with the
  optimizer fused into the backward (the tables update in place; no table gradient); and the ONE
  lookup/update kernel (:class:`GroupKernel`, bound to tpu tensors by :class:`KernelTables`) that
  they and TorchRec's sharded lookups (:mod:`torchtpu_rec.sharding.kernel`) run.
"""

from __future__ import annotations

from . import _requirements

_requirements.check()  # torchrec / FBGEMM missing or mismatched: one ImportError naming the fix

import torchtpu  # noqa: E402,F401  (registers the tpu device)
from torchtpu.dispatch import install as _install  # noqa: E402
from torchtpu import jagged as _jagged  # noqa: E402,F401  (fbgemm's jagged/KJT ops on tpu)

_install.install()  # the kernels of the fbgemm ops just added to the lowering table

from .embedding import (
    GroupKernel,
    KernelTables,
    SparseCoreEmbeddingBagCollection,
    SparseCoreEmbeddingCollection,
    StackLayout,
)
from .preprocess import CoreBuffers, IdOutOfRangeError, PreprocessedBatch, RecCounters, default_policy
from .tables import (
    OPTIMIZERS,
    SPARSECORES_PER_CHIP,
    OptimizerSpec,
    StackedTable,
    TableSpec,
    num_sparsecores,
    physical_rows,
    stack_tables,
)

from . import sharding  # noqa: E402  (teaches TorchRec's DistributedModelParallel the tpu device)

__all__ = [
    "OPTIMIZERS",
    "SPARSECORES_PER_CHIP",
    "CoreBuffers",
    "GroupKernel",
    "IdOutOfRangeError",
    "KernelTables",
    "OptimizerSpec",
    "PreprocessedBatch",
    "RecCounters",
    "SparseCoreEmbeddingBagCollection",
    "SparseCoreEmbeddingCollection",
    "StackLayout",
    "StackedTable",
    "TableSpec",
    "default_policy",
    "num_sparsecores",
    "physical_rows",
    "stack_tables",
]
