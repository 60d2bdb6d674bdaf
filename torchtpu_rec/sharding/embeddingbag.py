"""Sharding an ``EmbeddingBagCollection`` onto tpu: TorchRec's ShardedEmbeddingBagCollection with tpu kernels.

What changes against TorchRec's own CPU/CUDA path, and why:

* each sharding type (TW, RW, CW, TWRW, DP) is TorchRec's own class, subclassed so that
  ``create_lookup`` returns the tpu lookup (``kernel.TPUGroupedPooledEmbeddingsLookup``) and
  ``create_input_dist`` keeps the sparse features (ids, lengths, weights) on the host: the KJT
  all-to-all (lengths, then ids) runs through the process group on host tensors, the bucketization
  of row-wise sharding runs with fbgemm's CPU ops, and the lookup preprocesses the ids on the host,
  as SparseCore's preprocessing does. The pooled embeddings (tpu tensors) go through the output dist
  (all-to-all / reduce-scatter) on tpu tensors.
* ``ShardedEmbeddingBagCollection.create_embedding_bag_sharding`` (a classmethod, TorchRec's hook for
  this) picks the subclasses; the feature-order permute tensor is kept on the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Type

import torch
from torch.distributed.remote_device import _remote_device
from torch.nn.parallel import DistributedDataParallel

from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchtpu.distributed import agreed_arguments
from torchtpu.runtime.pinned import pinned_hooks_active

from .kernel import TPU_COMPUTE_KERNELS, TPUGroupedPooledEmbeddingsLookup

HOST = torch.device("cpu")

TPU_SHARDING_TYPES = [
    ShardingType.DATA_PARALLEL.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
]


def _is_tpu(device: Optional[torch.device]) -> bool:
    return device is not None and device.type == "tpu"


def tpu_placements(params: Dict[str, ParameterSharding]) -> Dict[str, ParameterSharding]:
    """Point every shard placement at ``tpu:0`` of its rank (in place; returns ``params``).

    TorchRec's plan helpers and planner write ``rank:r/tpu`` for a device type they do not know
    (``rank:r/cuda:r`` for cuda); a process here owns exactly one tpu, ``tpu:0``, and ShardedTensor
    insists the placement device equals the local tensor's device.
    """
    for ps in params.values():
        spec = ps.sharding_spec
        for shard in getattr(spec, "shards", None) or []:
            pl = shard.placement
            if pl is not None and pl.device().type == "tpu":
                shard.placement = _remote_device(f"rank:{pl.rank()}/tpu:0")
    return params


def check_kjt(module: str, configs, features: KeyedJaggedTensor, variable_batch: bool = False) -> None:
    """Refuse, before any collective, a KJT that lacks a feature of ``configs`` (the module's tables), or has a
    variable batch size per feature (VBE) where ``variable_batch`` is False, naming the features and their
    tables. Every rank runs this on its own batch: when all ranks' batches share the fault (one data
    pipeline), every rank raises it."""
    keys = features.keys()
    present = set(keys)
    missing = [(f, c.name) for c in configs for f in c.feature_names if f not in present]
    if missing:
        raise ValueError(
            f"torchtpu_rec: {module}: the KeyedJaggedTensor lacks features "
            f"{', '.join(f'{f!r} (table {t!r})' for f, t in missing)}; it has {list(keys)}. Every feature of a sharded "
            "module must be in every batch (a feature without ids has length 0)")
    if features.variable_stride_per_key() and not variable_batch:
        strides = dict(zip(keys, features.stride_per_key()))
        common = max(set(strides.values()), key=list(strides.values()).count)
        odd = {f: b for f, b in strides.items() if b != common}
        raise NotImplementedError(
            f"torchtpu_rec: {module}: variable batch size per feature (VBE) is not supported on tpu: features "
            f"{odd} have another batch size than the others ({common}); batch sizes per feature: {strides}. "
            "Give every feature the same batch size (stride)")


def expand_variable_batch(module: str, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A VBE KJT (a batch size per feature, ``inverse_indices`` mapping each sample of the full batch to
    its feature's bag) as the plain KJT of the full batch: sample b of feature f gets the ids (and
    weights) of bag ``inverse_indices[f][b]``. On the host, before the input dist.

    Pooled outputs equal TorchRec's VBE outputs (which pool each bag once, then index the pooled rows by
    the inverse indices), and so do the gradients: a bag's rows get the sum of the gradients of the
    samples that share it, either way. What it gives up is VBE's saving (each deduplicated bag is looked
    up once per sample that uses it)."""
    inverse = features.inverse_indices_or_none()
    keys = list(features.keys())
    if inverse is None:
        raise ValueError(f"torchtpu_rec: {module}: the KeyedJaggedTensor has a variable batch size per feature "
                         f"(batch sizes {dict(zip(keys, features.stride_per_key()))}) but no inverse_indices; "
                         "TorchRec needs them to give every sample its feature's bag")
    inv_keys, inv = inverse
    if list(inv_keys) != keys:
        index = {k: i for i, k in enumerate(inv_keys)}
        missing = [k for k in keys if k not in index]
        if missing:
            raise ValueError(f"torchtpu_rec: {module}: inverse_indices lack features {missing} "
                             f"(they name {list(inv_keys)})")
        inv = inv[torch.tensor([index[k] for k in keys])]
    inv = inv.to(HOST).long()
    strides = torch.tensor(features.stride_per_key(), dtype=torch.long)
    if inv.dim() != 2 or inv.shape[0] != len(keys):
        raise ValueError(f"torchtpu_rec: {module}: inverse_indices of shape {tuple(inv.shape)}: want "
                         f"[{len(keys)} features, batch size]")
    bad = (inv < 0) | (inv >= strides[:, None])
    if bool(bad.any()):
        f = int(bad.any(1).nonzero()[0])
        b = int(bad[f].nonzero()[0])
        raise IndexError(f"torchtpu_rec: {module}: feature {keys[f]!r}: inverse index {int(inv[f, b])} of sample "
                         f"{b} is out of range for its batch size {int(strides[f])}")
    lengths = features.lengths().to(HOST).long()
    bag_start = torch.cat([torch.zeros(1, dtype=torch.long), strides.cumsum(0)[:-1]])
    bags = (inv + bag_start[:, None]).reshape(-1)  # each full-batch sample's bag in the flat bag order
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    new_lengths = lengths[bags]
    n = int(new_lengths.sum())
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.long), new_lengths.cumsum(0)[:-1]])
    within = torch.arange(n) - new_offsets.repeat_interleave(new_lengths)
    take = offsets[:-1][bags].repeat_interleave(new_lengths) + within
    weights = features.weights_or_none()
    return KeyedJaggedTensor(keys=keys, values=features.values().to(HOST)[take], lengths=new_lengths,
                             weights=None if weights is None else weights.to(HOST)[take],
                             stride=int(inv.shape[1]))


class _PooledTPUMixin:
    """create_input_dist on the host, create_lookup with tpu kernels."""

    def create_input_dist(self, device: Optional[torch.device] = None):
        return super().create_input_dist(device=HOST)

    def _tpu_grouped_configs(self):
        return self._grouped_embedding_configs

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor=None):
        return TPUGroupedPooledEmbeddingsLookup(
            grouped_configs=self._tpu_grouped_configs(),
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=self._sharding_type_for_lookup,
            env=self._env,
        )


class TPUTwPooledEmbeddingSharding(_PooledTPUMixin, TwPooledEmbeddingSharding):
    _sharding_type_for_lookup = ShardingType.TABLE_WISE


class TPURwPooledEmbeddingSharding(_PooledTPUMixin, RwPooledEmbeddingSharding):
    _sharding_type_for_lookup = ShardingType.ROW_WISE


class TPUCwPooledEmbeddingSharding(_PooledTPUMixin, CwPooledEmbeddingSharding):
    _sharding_type_for_lookup = ShardingType.COLUMN_WISE


class TPUTwRwPooledEmbeddingSharding(_PooledTPUMixin, TwRwPooledEmbeddingSharding):
    _sharding_type_for_lookup = ShardingType.TABLE_ROW_WISE

    def _tpu_grouped_configs(self):
        return self._grouped_embedding_configs_per_rank[self._rank]


class TPUDpPooledEmbeddingSharding(DpPooledEmbeddingSharding):
    """Replicated tables: DENSE tpu kernel, gradients all-reduced by the DDP TorchRec wraps it in."""

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor=None):
        return TPUGroupedPooledEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._env.process_group,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            scale_weight_gradients=False,  # as TorchRec: DDP averages the replicas' gradients
            sharding_type=ShardingType.DATA_PARALLEL,
            env=self._env,
        )


class TPUShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose shards' tables live on tpu."""

    # forward() sends the KJT lengths/ids without the tpu backend's descriptor exchange (their split
    # sizes were just exchanged); False keeps the exchange (benchmarks/bench_dmp.py --before measures it)
    _agreed_kjt_dist = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TorchRec divides the whole output by a per-feature divisor when a MEAN table is row-wise sharded,
        # and sets the divisor to 1 only for the SUM features of row-wise tables: a SUM feature of a
        # table-wise, column-wise or data-parallel table would be divided by its bag sizes (and a MEAN one,
        # already averaged by its kernel, twice). Every feature but the row-wise MEAN ones takes divisor 1.
        by_pooling = self._pooling_type_to_rs_features
        if PoolingType.MEAN.value in by_pooling:
            row_wise_mean = set(by_pooling[PoolingType.MEAN.value])
            by_pooling[PoolingType.SUM.value] = [f for c in self._embedding_bag_configs for f in c.feature_names
                                                 if f not in row_wise_mean]

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        for info in sharding_infos:
            if info.param_sharding.compute_kernel not in TPU_COMPUTE_KERNELS:
                raise ValueError(
                    f"torchtpu_rec: table '{info.embedding_config.name}' has compute kernel "
                    f"'{info.param_sharding.compute_kernel}', not supported on tpu (use one of {TPU_COMPUTE_KERNELS})")
        kw = dict(qcomm_codecs_registry=qcomm_codecs_registry)
        if sharding_type == ShardingType.TABLE_WISE.value:
            return TPUTwPooledEmbeddingSharding(sharding_infos, env, device, **kw)
        if sharding_type == ShardingType.ROW_WISE.value:
            return TPURwPooledEmbeddingSharding(sharding_infos, env, device, **kw)
        if sharding_type == ShardingType.COLUMN_WISE.value:
            return TPUCwPooledEmbeddingSharding(sharding_infos, env, device, permute_embeddings=permute_embeddings, **kw)
        if sharding_type == ShardingType.TABLE_ROW_WISE.value:
            return TPUTwRwPooledEmbeddingSharding(sharding_infos, env, device, **kw)
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return TPUDpPooledEmbeddingSharding(sharding_infos, env, device)
        raise ValueError(f"torchtpu_rec: sharding type '{sharding_type}' is not supported on tpu "
                         f"(supported: {TPU_SHARDING_TYPES})")

    def _apply(self, fn, recurse=True):
        # The sharder placed every tensor of this module on its rank's tpu. DMP's DDP wrap calls
        # .to(device) on the whole model; with tpu's swap-on-conversion, re-wrapping a
        # TableBatchedEmbeddingSlice parameter fails ("detach() returns Tensor"), so this module's
        # tensors stay where they are (sharded modules are not moved by .to(); reshard instead).
        return self

    def init_data_parallel(self) -> None:
        # TorchRec wraps data-parallel lookups in DDP(static_graph=True), whose reducer stages its
        # used-parameter map in pinned host memory: the tpu's C++ hooks provide it (torchtpu.runtime.pinned);
        # without them a plain DDP (same gradients, averaged over the group). device_ids: none for tpu.
        for i, (sharding, lookup) in enumerate(zip(self._embedding_shardings, self._lookups)):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                self._lookups[i] = DistributedDataParallel(
                    module=lookup, device_ids=None, process_group=self._env.process_group,
                    gradient_as_bucket_view=True, broadcast_buffers=True, static_graph=pinned_hooks_active())

    def _create_input_dist(self, input_feature_names: List[str]) -> None:
        # TorchRec puts the feature-order tensor on the compute device; the features stay on the host here.
        device, self._device = self._device, HOST
        try:
            super()._create_input_dist(input_feature_names)
        finally:
            self._device = device

    def _init_mean_pooling_callback(self, input_feature_names, inverse_indices) -> None:
        # the divisor of mean pooling (RW/TWRW) is computed from the host-side lengths
        device, self._device = self._device, HOST
        try:
            super()._init_mean_pooling_callback(input_feature_names, inverse_indices)
        finally:
            self._device = device

    def forward(self, *input, **kwargs):
        # TorchRec's ShardedModule.forward, with the second stage of the KJT all-to-all (lengths, ids,
        # weights; launched when the splits all-to-all is waited on) issued under agreed_arguments():
        # its split sizes are the ones every rank just received from its peers, so the tpu backend's
        # per-collective descriptor exchange could only confirm them (it is one round trip each).
        ctx = self.create_context()
        splits = self.input_dist(ctx, *input, **kwargs)
        with agreed_arguments() if self._agreed_kjt_dist else contextlib.nullcontext():
            tensors = splits.wait()
        return self.compute_and_output_dist(ctx, tensors.wait())

    def input_dist(self, ctx, features):
        check_kjt("EmbeddingBagCollection", self._embedding_bag_configs, features, variable_batch=True)
        if features.values().device.type != "cpu":
            features = features.to(HOST)
        if features.variable_stride_per_key():
            features = expand_variable_batch("EmbeddingBagCollection", features)
        dim_per_key = self._dim_per_key
        if dim_per_key is not None and dim_per_key.device.type != "cpu":
            self._dim_per_key = dim_per_key.cpu()  # used with the host lengths for the mean divisor
        try:
            awaitable = super().input_dist(ctx, features)
        finally:
            self._dim_per_key = dim_per_key
        if getattr(ctx, "divisor", None) is not None and ctx.divisor.device != self._device:
            ctx.divisor = ctx.divisor.to(self._device)  # applied to the pooled (tpu) embeddings
        return awaitable


class TPUSharderMixin:
    """What every tpu sharder shares: the device check and the sharding types and kernels on tpu
    (``tpu_sharding_types``, set by the sharder); other devices keep TorchRec's own answers."""

    tpu_sharding_types: List[str] = []

    def _check_tpu(self, device: Optional[torch.device], torchrec_sharder: str) -> None:
        if not _is_tpu(device):
            raise ValueError(f"{type(self).__name__} shards onto tpu; got device={device} "
                             f"(use torchrec's own {torchrec_sharder} for cpu/cuda)")

    def sharding_types(self, compute_device_type: str) -> List[str]:
        if compute_device_type == "tpu":
            return list(self.tpu_sharding_types)
        return super().sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if compute_device_type == "tpu":
            if sharding_type == ShardingType.DATA_PARALLEL.value:
                return [EmbeddingComputeKernel.DENSE.value]
            return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]
        return super().compute_kernels(sharding_type, compute_device_type)


class TPUEmbeddingBagCollectionSharder(TPUSharderMixin, EmbeddingBagCollectionSharder):
    """Shards ``EmbeddingBagCollection`` onto tpu (DMP with ``device=torch.device("tpu")``).

    ``fused_params`` carries the fused optimizer of FUSED tables (``optimizer``: an fbgemm
    ``EmbOptimType`` or its name: sgd, adagrad, rowwise_adagrad, adam; ``learning_rate``, ``eps``,
    ``beta1``, ``beta2``, ``weight_decay``), as for TorchRec's own sharders; tables given an optimizer
    with ``torchrec.optim.apply_optimizer_in_backward`` use that one.
    """

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None
              ) -> ShardedEmbeddingBagCollection:
        self._check_tpu(device, "EmbeddingBagCollectionSharder")
        return TPUShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=tpu_placements(params), env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite)

    tpu_sharding_types = TPU_SHARDING_TYPES

    @property
    def sharded_module_type(self) -> Type[ShardedEmbeddingBagCollection]:
        return TPUShardedEmbeddingBagCollection
