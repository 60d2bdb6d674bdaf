"""Sharding an ``EmbeddingCollection`` (sequence, un-pooled features) onto tpu.

The same plan as embeddingbag.py, for TorchRec's sequence shardings:

* each sharding type TorchRec 1.8 offers for ``EmbeddingCollection`` (TW, RW, CW, DP) is TorchRec's own
  class, subclassed so that ``create_lookup``
  returns the tpu sequence lookup (``kernel.TPUGroupedEmbeddingsLookup``: plain gather, fused optimizer
  in the backward) and ``create_input_dist`` keeps the ids on the host (KJT all-to-all of lengths and
  ids through the process group on host tensors; RW bucketization with fbgemm's CPU ops);
* the output dist (:class:`TPUSequenceEmbeddingsAllToAll`) moves the looked-up rows (tpu tensors)
  back to the ranks that own the samples: the row permutation that TorchRec does with fbgemm's
  ``permute_2D_sparse_data`` is computed on the host from the host lengths and applied on tpu as one
  ``index_select``; the rows cross ranks in one ``all_to_all_single`` on the ``tpu`` group, and the
  backward is the reverse exchange and the inverse permutation (an ``index_add``);
* ``ShardedEmbeddingCollection.create_embedding_sharding`` (TorchRec's classmethod hook) picks the
  subclasses; the feature-order permute tensor stays on the host.
* table-row-wise: TorchRec 1.8 has no sequence TWRW sharding. Within one host TWRW splits a table's
  rows over that host's ranks exactly as RW splits them over the world (same block sizes), so a TWRW
  table whose host group is the whole process group (one host) runs as the RW sharding above; a TWRW
  plan over several hosts raises ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import (
    Awaitable,
    NoWait,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchtpu.runtime.pinned import pinned_hooks_active

from .embeddingbag import HOST, TPUSharderMixin, check_kjt, tpu_placements
from .kernel import TPU_COMPUTE_KERNELS, TPUGroupedEmbeddingsLookup

TPU_SEQUENCE_SHARDING_TYPES = [
    ShardingType.DATA_PARALLEL.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,  # one host only (see the module docstring)
]


def _check_single_host_twrw(sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv) -> None:
    world = env.world_size
    for info in sharding_infos:
        shards = info.param_sharding.sharding_spec.shards
        ranks = sorted(s.placement.rank() for s in shards)
        rows = sorted((s.shard_offsets[0], s.shard_sizes[0]) for s in shards)
        full_width = all(s.shard_offsets[1] == 0 and s.shard_sizes[1] == info.embedding_config.embedding_dim
                         for s in shards)
        if ranks != list(range(world)) or not full_width or len(rows) != world:
            raise NotImplementedError(
                f"torchtpu_rec: table '{info.embedding_config.name}' is table-row-wise over ranks {ranks} of {world}: "
                "EmbeddingCollection on tpu supports table-row-wise only when the table's host group is the whole "
                "process group (one host); use row_wise or table_wise")


# ----------------------------------------------------------------------------------------------------
# output dist: sequence rows back to the ranks that own the samples
# ----------------------------------------------------------------------------------------------------

def _send_order(lengths: torch.Tensor, world: int) -> np.ndarray:
    """Row order of this rank's lookup output, grouped by destination rank.

    The lookup emits rows feature-major over the features this rank serves and, within a feature,
    in the order of the samples received from each source rank (``lengths``: [local_features,
    world * batch_per_rank], as the input dist left them). The all-to-all needs them grouped by the
    rank that owns the samples, and inside that group feature-major again (what the receiving
    rank's KJT lengths describe).
    """
    F = lengths.shape[0]
    if F == 0 or lengths.numel() == 0:  # this rank serves no feature of this sharding
        return np.zeros(0, np.int64)
    lens = lengths.reshape(F, world, -1).numpy().astype(np.int64)  # [F, R, b]
    per_block = lens.sum(axis=2)  # rows of (feature f, source rank r)
    starts = np.concatenate([[0], np.cumsum(per_block.reshape(-1))[:-1]]).reshape(F, world)
    order = [np.arange(starts[f, r], starts[f, r] + per_block[f, r], dtype=np.int64)
             for r in range(world) for f in range(F)]
    return np.concatenate(order) if order else np.zeros(0, np.int64)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, perm, in_rows, out_rows, pg):
        D = rows.shape[1]
        send = rows.index_select(0, perm) if perm is not None else rows
        out = rows.new_empty((sum(out_rows), D))
        dist.all_to_all_single(out, send.contiguous(), output_split_sizes=list(out_rows),
                               input_split_sizes=list(in_rows), group=pg)
        ctx.perm, ctx.in_rows, ctx.out_rows, ctx.pg, ctx.n = perm, in_rows, out_rows, pg, rows.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        D = grad.shape[1]
        back = grad.new_empty((sum(ctx.in_rows), D))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=list(ctx.in_rows),
                               input_split_sizes=list(ctx.out_rows), group=ctx.pg)
        if get_gradient_division():  # as TorchRec's sequence all-to-all: gradients averaged over ranks
            back = back / dist.get_world_size(ctx.pg)
        if ctx.perm is not None:
            back = back.new_zeros((ctx.n, D)).index_add_(0, ctx.perm, back)
        return back, None, None, None, None


class TPUSequenceEmbeddingsAllToAll(BaseEmbeddingDist[SequenceShardingContext, torch.Tensor, torch.Tensor]):
    """Output dist of TW/RW/CW sequence shardings on tpu (all-to-all of the looked-up rows).

    ``unbucketize``: RW only; the rows come back in bucketized order and are put back in the
    order of the input KJT with TorchRec's unbucketize permutation.
    """

    def __init__(self, pg: dist.ProcessGroup, device: torch.device, unbucketize: bool = False) -> None:
        super().__init__()
        self._pg = pg
        self._device = device
        self._unbucketize = unbucketize

    def forward(self, local_embs: torch.Tensor,
                sharding_ctx: Optional[SequenceShardingContext] = None) -> Awaitable[torch.Tensor]:
        assert sharding_ctx is not None
        world = self._pg.size()
        lengths = sharding_ctx.lengths_after_input_dist
        if lengths.device.type != "cpu":
            lengths = lengths.cpu()
        if sharding_ctx.batch_size_per_rank is not None and len(set(sharding_ctx.batch_size_per_rank)) > 1:
            raise NotImplementedError("torchtpu_rec: variable batch size across ranks is not supported for "
                                      "EmbeddingCollection on tpu")
        # rows this rank sends to each rank, and receives from each (ids of the KJT all-to-all)
        in_rows = [int(x) for x in sharding_ctx.output_splits]
        out_rows = [int(x) for x in sharding_ctx.input_splits]
        if world == 1:
            out = local_embs
        else:
            order = _send_order(lengths, world)
            identity = order.size == 0 or bool((order == np.arange(order.size)).all())
            perm = None if identity else torch.from_numpy(order).to(local_embs.device)
            out = _SeqAllToAll.apply(local_embs, perm, in_rows, out_rows, self._pg)
        if self._unbucketize and sharding_ctx.unbucketize_permute_tensor is not None:
            idx = sharding_ctx.unbucketize_permute_tensor
            out = out.index_select(0, idx.to(out.device))
        return NoWait(out)


# ----------------------------------------------------------------------------------------------------
# the shardings
# ----------------------------------------------------------------------------------------------------

class _SequenceTPUMixin:
    """create_input_dist on the host, create_lookup with tpu kernels, a tpu output dist."""

    _unbucketize = False

    def create_input_dist(self, device: Optional[torch.device] = None):
        return super().create_input_dist(device=HOST)

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor=None):
        return TPUGroupedEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
        )

    def create_output_dist(self, device: Optional[torch.device] = None):
        return TPUSequenceEmbeddingsAllToAll(self._pg, device if device is not None else self._device,
                                             unbucketize=self._unbucketize)


class TPUTwSequenceEmbeddingSharding(_SequenceTPUMixin, TwSequenceEmbeddingSharding):
    pass


class TPURwSequenceEmbeddingSharding(_SequenceTPUMixin, RwSequenceEmbeddingSharding):
    _unbucketize = True


class TPUCwSequenceEmbeddingSharding(_SequenceTPUMixin, CwSequenceEmbeddingSharding):
    pass


class TPUDpSequenceEmbeddingSharding(DpSequenceEmbeddingSharding):
    """Replicated tables: DENSE tpu kernel, gradients all-reduced by the DDP the sharded module wraps it in."""

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor=None):
        return TPUGroupedEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._env.process_group,
            device=device if device is not None else self._device,
            env=self._env,
        )


class TPUShardedEmbeddingCollection(ShardedEmbeddingCollection):
    """ShardedEmbeddingCollection whose shards' tables live on tpu."""

    @classmethod
    def create_embedding_sharding(
        cls,
        sharding_type: str,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        for info in sharding_infos:
            if info.param_sharding.compute_kernel not in TPU_COMPUTE_KERNELS:
                raise ValueError(
                    f"torchtpu_rec: table '{info.embedding_config.name}' has compute kernel "
                    f"'{info.param_sharding.compute_kernel}', not supported on tpu (use one of {TPU_COMPUTE_KERNELS})")
        kw = dict(sharding_infos=sharding_infos, env=env, device=device)
        if sharding_type == ShardingType.TABLE_WISE.value:
            return TPUTwSequenceEmbeddingSharding(qcomm_codecs_registry=qcomm_codecs_registry, **kw)
        if sharding_type == ShardingType.ROW_WISE.value:
            return TPURwSequenceEmbeddingSharding(qcomm_codecs_registry=qcomm_codecs_registry, **kw)
        if sharding_type == ShardingType.TABLE_ROW_WISE.value:
            _check_single_host_twrw(sharding_infos, env)  # then it is row-wise over the whole group
            return TPURwSequenceEmbeddingSharding(qcomm_codecs_registry=qcomm_codecs_registry, **kw)
        if sharding_type == ShardingType.COLUMN_WISE.value:
            return TPUCwSequenceEmbeddingSharding(qcomm_codecs_registry=qcomm_codecs_registry, **kw)
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return TPUDpSequenceEmbeddingSharding(**kw)
        raise ValueError(f"torchtpu_rec: sharding type '{sharding_type}' is not supported for "
                         f"EmbeddingCollection on tpu (supported: {TPU_SEQUENCE_SHARDING_TYPES})")

    def _apply(self, fn, recurse=True):
        # as TPUShardedEmbeddingBagCollection: the sharder placed every tensor; DMP's .to(device) must
        # not re-wrap the TableBatchedEmbeddingSlice parameters
        return self

    def init_data_parallel(self) -> None:
        # as TorchRec (DDP with static_graph) where the tpu's C++ hooks give its reducer pinned host memory
        for i, (sharding, lookup) in enumerate(zip(self._sharding_type_to_sharding.values(), self._lookups)):
            if isinstance(sharding, DpSequenceEmbeddingSharding):
                self._lookups[i] = DistributedDataParallel(
                    module=lookup, device_ids=None, process_group=self._env.process_group,
                    gradient_as_bucket_view=True, broadcast_buffers=True, static_graph=pinned_hooks_active())

    def _create_input_dist(self, input_feature_names: List[str], ctx=None) -> None:
        # the feature-order tensor goes with the features, which stay on the host
        device, self._device = self._device, HOST
        try:
            super()._create_input_dist(input_feature_names, ctx)
        finally:
            self._device = device

    def input_dist(self, ctx, features):
        check_kjt("EmbeddingCollection", self._embedding_configs, features)
        if features.values().device.type != "cpu":
            features = features.to(HOST)
        return super().input_dist(ctx, features)


class TPUEmbeddingCollectionSharder(TPUSharderMixin, EmbeddingCollectionSharder):
    """Shards ``EmbeddingCollection`` onto tpu (DMP with ``device=torch.device("tpu")``).

    ``fused_params`` as for :class:`TPUEmbeddingBagCollectionSharder` (fused optimizer of FUSED tables:
    sgd, adagrad, rowwise_adagrad, adam and their hyper-parameters).
    """

    def shard(self, module: EmbeddingCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> ShardedEmbeddingCollection:
        self._check_tpu(device, "EmbeddingCollectionSharder")
        if self._use_index_dedup:
            raise NotImplementedError("TPUEmbeddingCollectionSharder: use_index_dedup is not supported on tpu")
        return TPUShardedEmbeddingCollection(
            module, tpu_placements(params), env, self.fused_params, device,
            qcomm_codecs_registry=self.qcomm_codecs_registry, use_index_dedup=False, module_fqn=module_fqn)

    tpu_sharding_types = TPU_SEQUENCE_SHARDING_TYPES

    @property
    def sharded_module_type(self) -> Type[ShardedEmbeddingCollection]:
        return TPUShardedEmbeddingCollection
