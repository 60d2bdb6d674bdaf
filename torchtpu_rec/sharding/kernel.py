"""The compute kernel of one shard on tpu: TorchRec's lookup modules, with the tables on tpu.

TorchRec's shardings build one ``GroupedPooledEmbeddingsLookup`` (EmbeddingBagCollection) or
``GroupedEmbeddingsLookup`` (EmbeddingCollection) per sharding type and rank, which instantiates one
"batched" kernel per group of tables (``_create_embedding_kernel``, keyed on the compute kernel). Those
kernels are fbgemm TBEs, which run on CPU/CUDA/MTIA only. The subclasses here override that one factory
method and return :class:`TPUBatchedEmbeddingBag` / :class:`TPUBatchedEmbedding`, which keep the group's
tables in ONE flat tpu parameter (fbgemm's own layout, so TorchRec's ``TableBatchedEmbeddingSlice``,
state_dict and ShardedTensor machinery work unchanged) and run the SparseCore collections' kernel
(:class:`torchtpu_rec.embedding.GroupKernel`) on it:

* the ids arrive as host tensors (the input dist keeps the KJT on the host, where SparseCore's
  preprocessing also runs); :func:`torchtpu_rec.preprocess.preprocess` turns them into fixed-size
  (bucketed) buffers, so a training loop compiles a handful of executables, not one per batch;
  each run of same-width tables of the flat parameter is one stack (one core: no MOD split);
* forward = gather rows + (weighted) segment sum (pooled) or plain gather (sequence);
* backward = for the FUSED kernel, the optimizer update (SGD / Adagrad / row-wise Adagrad / Adam)
  applied to the table in place, as SparseCore and fbgemm do, and no gradient handed to autograd;
  for the DENSE kernel, the dense gradient of the flat table (trained by any torch optimizer).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import torchtpu
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.distributed.utils import append_prefix
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..embedding import GroupKernel, KernelTables, StackLayout
from ..preprocess import FeatureSlot, PreprocessedBatch, RecCounters, default_policy, preprocess
from ..tables import OptimizerSpec, StackedTable, TableSpec

TPU_COMPUTE_KERNELS = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value)

# ids of one group on one rank per batch: one core, so the buckets go higher than SparseCore's
_DMP_IDS_POLICY = default_policy("rec_dmp_ids", largest=1 << 26)

_OPT_NAMES = {
    "sgd": "sgd", "exact_sgd": "sgd",
    "adagrad": "adagrad", "exact_adagrad": "adagrad",
    "rowwise_adagrad": "rowwise_adagrad", "exact_rowwise_adagrad": "rowwise_adagrad",
    "adam": "adam",
}


def _optimizer_spec(fused_params: Dict[str, Any]) -> OptimizerSpec:
    """TorchRec's ``fused_params`` (``optimizer``: fbgemm ``EmbOptimType`` or a name,
    ``learning_rate``, ``eps``, ``beta1``/``beta2``, ``weight_decay``) -> an OptimizerSpec."""
    opt = fused_params.get("optimizer", "sgd")
    name = getattr(opt, "name", None) or str(opt)
    name = name.split(".")[-1].lower()
    if name not in _OPT_NAMES:
        raise ValueError(f"torchtpu_rec: fused optimizer '{name}' is not supported on tpu "
                         f"(supported: {sorted(set(_OPT_NAMES))})")
    kind = _OPT_NAMES[name]
    return OptimizerSpec(kind, lr=float(fused_params.get("learning_rate", 0.01)),
                         eps=float(fused_params.get("eps", 1e-8 if kind == "adam" else 1e-10)),
                         beta1=float(fused_params.get("beta1", 0.9)), beta2=float(fused_params.get("beta2", 0.999)),
                         weight_decay=float(fused_params.get("weight_decay", 0.0)))


# ----------------------------------------------------------------------------------------------------
# the table store (what fbgemm's TBE "emb_module" is for TorchRec's kernels)
# ----------------------------------------------------------------------------------------------------

class TPUTableBatchedEmbeddings(nn.Module):
    """The tables of one group in one flat tpu parameter ``weights`` (fbgemm's layout), with the
    group's :class:`~torchtpu_rec.embedding.GroupKernel` (``bind`` attaches it to the parameter)."""

    def __init__(self, local_rows: List[int], local_cols: List[int], feature_table_map: List[int],
                 feature_names: List[str], device: torch.device, dtype: torch.dtype = torch.float32,
                 table_names: Optional[List[str]] = None, pooled: bool = True, mean: bool = False):
        super().__init__()
        self.embedding_specs = list(zip(local_rows, local_cols))
        sizes = [r * c for r, c in self.embedding_specs]
        self.weights_physical_offsets = [int(x) for x in np.cumsum([0] + sizes[:-1])] if sizes else []
        self.feature_table_map = list(feature_table_map)
        self.feature_names = list(feature_names)
        total = int(sum(sizes))
        self.weights = nn.Parameter(torch.zeros(total, dtype=dtype, device=device))
        self.pooled = pooled
        self.counters = RecCounters()
        names = list(table_names) if table_names is not None else [f"table{i}" for i in range(len(sizes))]
        self._table_names = names
        self._mean = mean
        self._stacks: List[StackedTable] = []
        self._table_stack: List[Tuple[int, int]] = []  # per table: (stack, row offset in it)
        self.tables: Optional[KernelTables] = None
        self._states: List[List[torch.Tensor]] = []

    def _build_stacks(self, optimizer: OptimizerSpec) -> List[StackLayout]:
        """One stack per run of consecutive same-width tables (rows contiguous in the flat layout)."""
        layouts, self._stacks, self._table_stack = [], [], []
        run: List[int] = []

        def close():
            if not run:
                return
            dim = self.embedding_specs[run[0]][1]
            specs, offs, acc = [], [], 0
            for t in run:
                rows = self.embedding_specs[t][0]
                specs.append(TableSpec(f"{self._table_names[t]}#{t}", max(rows, 1), dim,
                                       pooling="mean" if self._mean else ("sum" if self.pooled else "none")))
                self._table_stack.append((len(self._stacks), acc))
                offs.append(acc)
                acc += rows
            self._stacks.append(StackedTable(specs[0].name, tuple(specs), tuple(offs), dim, optimizer,
                                             self.weights.dtype, 1))
            layouts.append(StackLayout(0, self.weights_physical_offsets[run[0]], acc, dim, optimizer))
            run.clear()

        for t, (_, dim) in enumerate(self.embedding_specs):
            if run and self.embedding_specs[run[-1]][1] != dim:
                close()
            run.append(t)
        close()
        # features in their order; slot = place among the features of the same stack
        self._slots: List[FeatureSlot] = []
        per_stack = [0] * len(self._stacks)
        self._out_slots = []
        for f, t in zip(self.feature_names, self.feature_table_map):
            si, off = self._table_stack[t]
            self._slots.append(FeatureSlot(f, si, self._table_names[t], off, per_stack[si],
                                           self.embedding_specs[t][0], self._mean))
            self._out_slots.append((si, per_stack[si]))
            per_stack[si] += 1
        return layouts

    def bind(self, optimizer: Optional[OptimizerSpec], fused: bool, init_accumulator: float = 0.0) -> None:
        """Build the group's kernel and its optimizer state (``optimizer`` None: DENSE)."""
        layouts = self._build_stacks(optimizer or OptimizerSpec())
        kernel = GroupKernel(layouts, self.pooled, self._out_slots if self.pooled else ())
        self._fused = fused
        self._states = []
        for shapes, st in zip(kernel.state_shapes() if fused else [{}] * len(layouts), layouts):
            init = init_accumulator if st.optimizer.kind in ("adagrad", "rowwise_adagrad") else 0.0
            self._states.append([torchtpu.from_jax(jnp.full(shape, init, jnp.float32)) for shape in shapes.values()])
        self.tables = KernelTables(kernel, lambda: [self.weights], lambda: self._states, fused=fused)

    def reset_embedding_weight_momentum(self, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                                        logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor) -> None:
        """fbgemm's TBE method that managed collisions call when they evict ids: the optimizer state of the
        evicted rows restarts (TorchRec re-initializes their weights itself). As fbgemm: only row-wise
        Adagrad's accumulator is reset; a table without a fused optimizer raises."""
        if not getattr(self, "_fused", False):
            raise NotImplementedError("torchtpu_rec: resetting the optimizer state of evicted rows needs a fused "
                                      f"optimizer (tables {self._table_names} have none)")
        offsets = pruned_indices_offsets.cpu().tolist()
        for k, t in enumerate(logical_table_ids.cpu().tolist()):
            si, row0 = self._table_stack[t]
            if self._stacks[si].optimizer.kind != "rowwise_adagrad":
                continue
            rows = pruned_indices[offsets[k]:offsets[k + 1]].cpu().long()
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.embedding_specs[t][0]):
                raise IndexError(f"torchtpu_rec: table {self._table_names[t]!r}: evicted rows {rows.tolist()} "
                                 f"out of its {self.embedding_specs[t][0]} rows")
            with torch.no_grad():
                for state in self._states[si]:
                    state[(rows + row0).to(state.device)] = 0.0

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return [self.weights.detach()[o: o + r * c].view(r, c)
                for o, (r, c) in zip(self.weights_physical_offsets, self.embedding_specs)]

    def preprocess(self, features: KeyedJaggedTensor) -> PreprocessedBatch:
        """The KJT's ids as the kernel's fixed-size buffers (an id out of its table shard raises
        :class:`~torchtpu_rec.preprocess.IdOutOfRangeError`, an ``IndexError`` naming the feature)."""
        if features.variable_stride_per_key():
            raise NotImplementedError("torchtpu_rec: variable batch size per feature (VBE) is not supported on tpu")
        weighted = self.pooled and features.weights_or_none() is not None
        return preprocess(features, self._stacks, self._slots, is_weighted=weighted, pooled=self.pooled,
                          ids_policy=_DMP_IDS_POLICY, unique_policy=_DMP_IDS_POLICY, overflow="error",
                          counters=self.counters)

    def feature_dims(self) -> Tuple[int, ...]:
        return tuple(self.embedding_specs[t][1] for t in self.feature_table_map)


def _table_slices(store: TPUTableBatchedEmbeddings, config: GroupedEmbeddingConfig,
                  table_name_to_count: Dict[str, int]) -> Dict[str, TableBatchedEmbeddingSlice]:
    out = {}
    counts = dict(table_name_to_count)
    for t_idx, (rows, dim) in enumerate(store.embedding_specs):
        name = config.embedding_tables[t_idx].name
        if name not in counts:
            continue
        n = counts.pop(name)
        off = store.weights_physical_offsets[t_idx]
        out[name] = TableBatchedEmbeddingSlice(data=store.weights, start_offset=off,
                                               end_offset=off + n * rows * dim, num_embeddings=-1,
                                               embedding_dim=dim)
    return out


def _state_metadata(table, state: torch.Tensor) -> Tuple[Dict, ShardedTensorMetadata]:
    """(table shard metadata -> state shard metadata, the state's global metadata) of one optimizer state
    of a sharded table: a state shaped like the table is sharded like it; a per-row state (row-wise
    Adagrad) is sharded over rows, and a column-sharded table's per-row states sit side by side (one row
    block per column shard, in column order: each shard keeps its own accumulators), as in TorchRec."""
    glob = table.global_metadata
    props = TensorProperties(dtype=state.dtype, layout=state.layout, requires_grad=False)
    shards = glob.shards_metadata
    if state.dim() == 2:
        mapping = {m: ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), m.placement) for m in shards}
        return mapping, ShardedTensorMetadata(list(mapping.values()), glob.size, props)
    column_sharded = table.local_cols != table.embedding_dim
    if column_sharded:
        shards = sorted(shards, key=lambda m: m.shard_offsets[1])
    mapping = {}
    for i, m in enumerate(shards):
        offset = i * m.shard_sizes[0] if column_sharded else m.shard_offsets[0]
        mapping[m] = ShardMetadata([offset], [m.shard_sizes[0]], m.placement)
    rows = glob.size[0] * (len(shards) if column_sharded else 1)
    return mapping, ShardedTensorMetadata(list(mapping.values()), torch.Size([rows]), props)


def _fused_state(config: GroupedEmbeddingConfig, store: "TPUTableBatchedEmbeddings", pg) -> Dict[str, Dict]:
    """Per table name, its fused-optimizer state as TorchRec's fbgemm kernels expose it: ``<table>.momentum1``
    (Adagrad / row-wise Adagrad accumulators, Adam's first moment), ``<table>.exp_avg_sq`` (Adam), as
    ShardedTensors whose local shards are views of the kernel's state (loading one writes the kernel's
    state in place); Adam adds ``<table>.step`` (the host step count of the table's stack)."""
    per_table: Dict[str, list] = {}
    for t, table in enumerate(config.embedding_tables):
        stack, row_off = store._table_stack[t]
        rows = store.embedding_specs[t][0]
        opt = store._stacks[stack].optimizer
        names = list(opt.state_shapes(1, 1))
        views = [s[row_off: row_off + rows] for s in store._states[stack]]
        per_table.setdefault(table.name, []).append((table, names, views, stack))
    out: Dict[str, Dict] = {}
    for name, shards in per_table.items():
        table, names, _, stack = shards[0]
        state: Dict = {}
        if table.global_metadata is None or table.local_metadata is None:
            continue
        for k, sname in enumerate(names):
            mapping, glob = _state_metadata(table, shards[0][2][k])
            local = [Shard(views[k], mapping[tb.local_metadata]) for tb, _, views, _ in shards]
            key = "momentum1" if k == 0 else sname  # TorchRec's names (the first state is "momentum1")
            state[f"{name}.{key}"] = ShardedTensor._init_from_local_shards_and_global_metadata(
                local, glob, process_group=pg)
        if store._stacks[stack].optimizer.kind == "adam":
            state[f"{name}.step"] = store.tables.steps[stack: stack + 1]
        out[name] = state
    return out


class TPUFusedOptimizer(KeyedOptimizer):
    """TorchRec's view of a fused kernel's optimizer: the state lives with the kernel (see
    :func:`_fused_state`; ``state_dict()`` / ``load_state_dict()`` read and write it in place), step() is
    a no-op (the update happened in the backward) apart from taking the lr of its param group, and
    zero_grad() has nothing to clear."""

    def __init__(self, params: Dict[str, torch.Tensor], fused: KernelTables, state_by_table: Dict[str, Dict]):
        self._fused = fused
        state = {p: dict(state_by_table.get(key[: -len(".weight")], {})) for key, p in params.items()}
        super().__init__(params, state, [{"params": list(params.values()), "lr": fused.lr}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def step(self, closure: Any = None) -> None:
        # apply lr changes made by schedulers through param_groups
        self._fused.lr = float(self.param_groups[0]["lr"])

    def post_load_state_dict(self) -> None:
        self.step()  # a loaded param group's lr


class _TPUKernelMixin:
    """Shared setup of the pooled and sequence kernels."""

    def _setup_tpu(self, config: GroupedEmbeddingConfig, device: Optional[torch.device], pooled: bool,
                   mean: bool = False) -> None:
        device = device if device is not None else torch.device("tpu")
        if device.type not in ("tpu", "meta"):
            raise ValueError(f"torchtpu_rec: the tpu kernel needs a tpu device, got {device}")
        names = [f for t in config.embedding_tables for f in t.feature_names]
        self._emb_module = TPUTableBatchedEmbeddings(self._local_rows, self._local_cols, self._feature_table_map,
                                                     names, device, table_names=[t.name for t in config.embedding_tables],
                                                     pooled=pooled, mean=mean)
        self._param_per_table = _table_slices(self._emb_module, config, self.table_name_to_count)
        kernel = config.compute_kernel
        self._fused: Optional[KernelTables] = None
        if kernel not in (EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.DENSE):
            raise ValueError(f"torchtpu_rec: compute kernel '{kernel.value}' is not supported on tpu "
                             f"(use one of {TPU_COMPUTE_KERNELS})")
        fused = kernel == EmbeddingComputeKernel.FUSED
        fp = dict(config.fused_params or {})
        if device.type != "meta":
            self._emb_module.bind(_optimizer_spec(fp) if fused else None, fused,
                                  float(fp.get("initial_accumulator_value", 0.0)))
        if fused:
            self._fused = self._emb_module.tables
            self._emb_module.weights.requires_grad_(True)
            params = {}
            for t in config.embedding_tables:
                params[f"{t.name}.weight"] = self._param_per_table[t.name]
            self._fused_optimizer = TPUFusedOptimizer(params, self._fused,
                                                      _fused_state(config, self._emb_module, self._pg))
            for p in self._param_per_table.values():
                p._in_backward_optimizers = [self._fused_optimizer]  # noqa: SLF001 (TorchRec's convention)
        if device.type != "meta":
            self.init_parameters()

    @property
    def emb_module(self) -> TPUTableBatchedEmbeddings:
        return self._emb_module

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        if self._fused is None:
            raise AttributeError("fused_optimizer: this tpu kernel is DENSE (trained by the model's optimizer)")
        return self._fused_optimizer

    def init_parameters(self) -> None:
        # uniform(init_min, init_max) per table, drawn on the host then written once
        with torch.no_grad():
            for rows, dim, lo, hi, param in zip(self._local_rows, self._local_cols, self._weight_init_mins,
                                                self._weight_init_maxs, self.split_embedding_weights()):
                param.copy_(torch.empty(rows, dim).uniform_(lo, hi))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        if self._fused is not None:
            # fused tables are trained in the backward: the model's optimizer must not see them
            yield from ()
            return
        combined = "/".join(c.name for c in self._config.embedding_tables)
        yield append_prefix(prefix, f"{combined}.weight"), self._emb_module.weights

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from ()


class TPUBatchedEmbeddingBag(_TPUKernelMixin, BaseBatchedEmbeddingBag[torch.Tensor]):
    """Pooled lookup of one group of tables (one shard's tables of one sharding type) on tpu."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None) -> None:
        super().__init__(config, pg, device, sharding_type)
        self._mean = self._pooling.name == "MEAN"
        self._setup_tpu(config, device, pooled=True, mean=self._mean)

    def forward(self, features: KeyedJaggedTensor, vbe_output=None, vbe_output_offsets=None) -> torch.Tensor:
        store = self._emb_module
        if not store.feature_dims():
            return torch.empty(features.stride(), 0, device=store.weights.device)
        return store.tables.run(store.preprocess(features))


class TPUBatchedEmbedding(_TPUKernelMixin, BaseBatchedEmbedding[torch.Tensor]):
    """Sequence (unpooled) lookup of one group of tables on tpu: one row per id."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(config, pg, device)
        self._setup_tpu(config, device, pooled=False)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        store = self._emb_module
        dims = store.feature_dims()
        if len(set(dims)) > 1:
            raise ValueError("torchtpu_rec: tables of one EmbeddingCollection group must share embedding_dim")
        if not dims:
            return torch.empty(0, 0, device=store.weights.device)
        batch = store.preprocess(features)
        outs = store.tables.run(batch)  # per stack (segments, dim): one stack, all tables of one width
        keys = list(features.keys())
        n = int(features.values().numel())
        if keys == store.feature_names:  # the KJT's features in the group's order: ids in segment order
            return outs[0].narrow(0, 0, n)
        pieces = []
        for k in keys:
            if k in batch.sequence_layout:
                si, start, count, _ = batch.sequence_layout[k]
                pieces.append(outs[si].narrow(0, start, count))
        return torch.cat(pieces) if pieces else outs[0].narrow(0, 0, 0)


class TPUBatchedFusedEmbeddingBag(TPUBatchedEmbeddingBag, FusedOptimizerModule):
    """A FUSED pooled kernel: TorchRec collects its ``fused_optimizer`` into ``dmp.fused_optimizer``."""


class TPUBatchedFusedEmbedding(TPUBatchedEmbedding, FusedOptimizerModule):
    """A FUSED sequence kernel: TorchRec collects its ``fused_optimizer`` into ``dmp.fused_optimizer``."""


def _check_kernel(config: GroupedEmbeddingConfig) -> None:
    if config.compute_kernel.value not in TPU_COMPUTE_KERNELS:
        raise ValueError(f"torchtpu_rec: compute kernel '{config.compute_kernel.value}' of tables "
                         f"{[t.name for t in config.embedding_tables]} is not supported on tpu "
                         f"(use one of {TPU_COMPUTE_KERNELS})")


class TPUGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup with tpu kernels instead of fbgemm TBEs."""

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        _check_kernel(config)
        cls = TPUBatchedFusedEmbeddingBag if config.compute_kernel == EmbeddingComputeKernel.FUSED else \
            TPUBatchedEmbeddingBag
        return cls(config=config, pg=pg, device=device, sharding_type=sharding_type)


class TPUGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """TorchRec's sequence lookup with tpu kernels instead of fbgemm TBEs."""

    def _create_embedding_kernel(self, config, pg, device, env=None):
        _check_kernel(config)
        cls = TPUBatchedFusedEmbedding if config.compute_kernel == EmbeddingComputeKernel.FUSED else TPUBatchedEmbedding
        return cls(config=config, pg=pg, device=device)
