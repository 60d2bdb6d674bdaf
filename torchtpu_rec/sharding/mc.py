"""Managed collisions (TorchRec's ``ManagedCollisionEmbeddingBagCollection``: MCH remapping of raw ids onto
a table's rows, with eviction) on tpu: the remapping runs on the host, where the ids already are.

The sharded EBC keeps the KJT on the host through its input dist (the kernel's preprocessing reads the ids
there), so the managed-collision modules, which remap those ids before the lookup, live on the host too:
their sorted raw-id and remap buffers, the eviction counters, and the searchsorted / sort of each batch.
The tables and the lookup stay on tpu (``TPUEmbeddingBagCollectionSharder``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder, ShardedManagedCollisionCollection

from .embeddingbag import HOST, TPUEmbeddingBagCollectionSharder


class _HostManagedCollisionCollection(ShardedManagedCollisionCollection):
    def _apply(self, fn, recurse=True):
        # DMP moves the model to tpu after sharding; the remap buffers stay with the host ids
        return self


class TPUManagedCollisionCollectionSharder(ManagedCollisionCollectionSharder):
    """TorchRec's MCC sharder with the managed-collision modules on the host."""

    def shard(self, module, params, env, embedding_shardings, device: Optional[torch.device] = None,
              use_index_dedup: bool = False):
        return _HostManagedCollisionCollection(module, params, env=env, device=HOST,
                                               embedding_shardings=embedding_shardings,
                                               use_index_dedup=use_index_dedup)


def tpu_mc_ebc_sharder(fused_params: Optional[Dict[str, Any]] = None) -> ManagedCollisionEmbeddingBagCollectionSharder:
    """TorchRec's ``ManagedCollisionEmbeddingBagCollectionSharder`` with tpu tables and host remapping."""
    return ManagedCollisionEmbeddingBagCollectionSharder(
        ebc_sharder=TPUEmbeddingBagCollectionSharder(fused_params=fused_params),
        mc_sharder=TPUManagedCollisionCollectionSharder())
