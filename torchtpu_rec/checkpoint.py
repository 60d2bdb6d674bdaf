"""Sharded checkpoints of DMP models on tpu: gather to unsharded CPU tensors, load back into any sharding.

``unsharded_state_dict(model)`` turns every ``ShardedTensor`` of ``model.state_dict()`` (embedding tables
sharded table-, row-, column- or table-row-wise) into the full table on the host, gathered from all
ranks of the process group; plain tensors (dense layers, data-parallel tables) are copied to the host.
The result is what an unsharded model's ``state_dict()`` holds (DMP's ``_dmp_wrapped_module.`` /
DDP ``module.`` prefixes are kept as the sharded model names them, so the dict loads back into a
model built the same way), and ``torch.save`` writes it as is.

``load_unsharded_state_dict(model, state_dict)`` copies such a dict into a (possibly differently)
sharded model: each rank takes the slice of every table that its local shards cover.

``unsharded_fused_optimizer_state(model)`` / ``load_unsharded_fused_optimizer_state(model, state)`` do the
same for the state of the fused table optimizers (the tpu kernels of ``torchtpu_rec.sharding`` update
FUSED tables inside the backward, so their Adagrad accumulators / Adam moments and step count live with
the kernel, not with a torch optimizer): per table, full-size CPU tensors shaped like the table, so a run
resumed in another sharding continues exactly.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()


def _gather_from_ranks(local, group) -> list:
    """Every rank's ``local`` (a picklable host object), in rank order; a collective."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return [local]
    gathered = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    return gathered


def _slices(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def unsharded_state_dict(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None,
                         strip_prefixes: bool = False) -> Dict[str, torch.Tensor]:
    """Full, unsharded CPU copy of ``model.state_dict()``; a collective: call it on every rank.

    ``strip_prefixes=True`` drops DMP/DDP wrapper prefixes (``_dmp_wrapped_module.``, ``module.``),
    giving the names of the plain (unsharded) model.
    """
    sd = model.state_dict()
    local: Dict[str, list] = {}
    for key, v in sd.items():
        if isinstance(v, ShardedTensor):
            local[key] = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in v.local_shards()]
    gathered = _gather_from_ranks(local, group)
    out: Dict[str, torch.Tensor] = {}
    for key, v in sd.items():
        name = _strip(key) if strip_prefixes else key
        if isinstance(v, ShardedTensor):
            full = torch.empty(tuple(v.size()), dtype=v.dtype)
            covered = 0
            for rank_shards in gathered:
                for offsets, t in rank_shards.get(key, []):
                    full[_slices(offsets, t.shape)] = t
                    covered += t.numel()
            if covered < full.numel():
                raise RuntimeError(f"unsharded_state_dict: shards of '{key}' cover {covered} of {full.numel()} "
                                   "elements (a rank did not take part?)")
            out[name] = full
        elif DTensor and isinstance(v, DTensor):
            out[name] = v.full_tensor().detach().cpu()
        elif isinstance(v, torch.Tensor):
            out[name] = v.detach().cpu().clone()
        else:
            out[name] = v
    return out


def _strip(key: str) -> str:
    for p in ("_dmp_wrapped_module.", "module."):
        while key.startswith(p):
            key = key[len(p):]
        key = key.replace("." + p, ".")
    return key


def load_unsharded_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor],
                              strict: bool = True) -> None:
    """Copy full (unsharded) tensors into ``model``'s parameters/buffers, whatever their sharding.

    Keys may carry the DMP/DDP wrapper prefixes or not. No communication: every rank reads the
    slices its own shards cover, so every rank must be given the same full dict.
    """
    sd = model.state_dict()
    by_stripped = {_strip(k): k for k in state_dict}
    missing = []
    with torch.no_grad():
        for key, dst in sd.items():
            src_key = key if key in state_dict else by_stripped.get(_strip(key))
            if src_key is None:
                missing.append(key)
                continue
            src = state_dict[src_key]
            if isinstance(dst, ShardedTensor):
                if tuple(src.shape) != tuple(dst.size()):
                    raise ValueError(f"load_unsharded_state_dict: '{key}' has shape {tuple(src.shape)} in the "
                                     f"checkpoint but {tuple(dst.size())} in the model")
                for s in dst.local_shards():
                    piece = src[_slices(s.metadata.shard_offsets, s.metadata.shard_sizes)]
                    s.tensor.copy_(piece.to(s.tensor.device, s.tensor.dtype))
            elif DTensor and isinstance(dst, DTensor):
                raise NotImplementedError(f"load_unsharded_state_dict: DTensor entry '{key}' (output_dtensor) "
                                          "is not supported; shard with ShardedTensor state dicts")
            elif isinstance(dst, torch.Tensor):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"load_unsharded_state_dict: '{key}' has shape {tuple(src.shape)} in the "
                                     f"checkpoint but {tuple(dst.shape)} in the model")
                dst.copy_(src.to(dst.device, dst.dtype))
    if strict and missing:
        raise KeyError(f"load_unsharded_state_dict: no checkpoint entry for {missing}")


# ----------------------------------------------------------------------------------------------------
# fused-optimizer state
# ----------------------------------------------------------------------------------------------------
#
# A FUSED tpu kernel (torchtpu_rec.sharding.kernel) keeps its tables in one flat parameter, cut into
# stacks of same-width tables; each stack has its optimizer-state tensors (tpu, rows of the stack first:
# per element ``(rows, dim)`` or per row ``(rows,)``) and a step count. The helpers below are the one
# place that reads that layout.


class _TableState:
    """The fused-optimizer state of one table shard on this rank."""

    def __init__(self, key, table, store, t):
        self.key, self.table = key, table
        self.stack, self.row_off = store._table_stack[t]  # noqa: SLF001 (kernel layout, see above)
        self.rows, self.cols = store.embedding_specs[t]
        opt = store._stacks[self.stack].optimizer  # noqa: SLF001
        self.kind = opt.kind
        self.names = list(opt.state_shapes(1, self.cols).keys())  # the order of the kernel's state tensors
        self.tensors = store._states[self.stack]  # noqa: SLF001
        self.kernel_tables = store.tables
        if len(self.names) != len(self.tensors):
            raise RuntimeError(f"fused optimizer state of table '{table.name}': {len(self.tensors)} tensors for "
                               f"state names {self.names}")

    @property
    def step(self) -> int:
        return int(self.kernel_tables.steps[self.stack])

    def read(self) -> Dict[str, torch.Tensor]:
        return {n: s[self.row_off: self.row_off + self.rows].cpu().float() for n, s in zip(self.names, self.tensors)}

    def write(self, name: str, value: torch.Tensor) -> None:
        dst = self.tensors[self.names.index(name)]
        with torch.no_grad():
            dst[self.row_off: self.row_off + self.rows].copy_(value.to(dst.device, dst.dtype))

    def set_step(self, step: int) -> None:
        self.kernel_tables.steps[self.stack] = int(step)


def _fused_tables(model: torch.nn.Module) -> Iterator[_TableState]:
    """The FUSED table shards of ``model`` on this rank, named by their ``state_dict`` weight key."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    for prefix, module in model.named_modules():
        if isinstance(module, ShardedEmbeddingCollection):
            attr = "embeddings"
        elif isinstance(module, ShardedEmbeddingBagCollection):
            attr = "embedding_bags"
        else:
            continue
        for lookup in module._lookups:  # noqa: SLF001 (TorchRec's sharded modules keep them there)
            while isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            for kernel in getattr(lookup, "_emb_modules", []):
                if getattr(kernel, "_fused", None) is None:
                    continue  # DENSE kernel: trained (and checkpointed) by the user's torch optimizer
                store = kernel.emb_module
                for t, table in enumerate(kernel._config.embedding_tables):  # noqa: SLF001
                    name = f"{attr}.{table.name}.weight"
                    yield _TableState(f"{prefix}.{name}" if prefix else name, table, store, t)


def _shard_geometry(table) -> Tuple[List[int], List[int], List[int]]:
    full = [table.num_embeddings, table.embedding_dim]
    md = table.local_metadata
    if md is None:
        return [0, 0], [table.local_rows, table.local_cols], full
    return list(md.shard_offsets), list(md.shard_sizes), full


def _per_row(x: torch.Tensor) -> bool:
    return x.dim() == 1


def unsharded_fused_optimizer_state(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None,
                                    strip_prefixes: bool = False) -> Dict[str, Dict[str, Any]]:
    """Full, unsharded CPU copy of the fused table optimizers' state; a collective: call it on every rank.

    Returns ``{weight key: {"optimizer": name, "step": tensor, <state name>: tensor}}``, keyed like the
    tables in :func:`unsharded_state_dict`; the state tensors are shaped like the table (``momentum1`` of
    Adagrad, ``exp_avg``/``exp_avg_sq`` of Adam) or hold one value per row (``momentum1`` of row-wise
    Adagrad). Tables trained by a torch optimizer (DENSE kernel, data-parallel) are not included: that
    optimizer's own ``state_dict()`` holds their state.
    """
    local: Dict[str, list] = {}
    for ts in _fused_tables(model):
        offsets, sizes, full = _shard_geometry(ts.table)
        arrays = ts.read()
        for name, a in arrays.items():
            if _per_row(a) and sizes[1] != full[1]:
                raise NotImplementedError(
                    f"unsharded_fused_optimizer_state: table '{ts.table.name}' is column-sharded and trained with "
                    "row-wise Adagrad: its accumulators (one per row and column shard) have no unsharded form")
        local.setdefault(ts.key, []).append((offsets, sizes, full, ts.kind, ts.step, arrays))
    gathered = _gather_from_ranks(local, group)
    out: Dict[str, Dict[str, Any]] = {}
    covered: Dict[str, int] = {}
    numel: Dict[str, int] = {}
    for rank_state in gathered:
        for key, shards in rank_state.items():
            for offsets, sizes, full, kind, step, arrays in shards:
                entry = out.get(key)
                if entry is None:
                    entry = out[key] = {"optimizer": kind, "step": torch.tensor(0, dtype=torch.int64)}
                    numel[key] = full[0] * full[1]
                    for name, a in arrays.items():
                        entry[name] = torch.zeros(full[:1] if _per_row(a) else full, dtype=torch.float32)
                    covered[key] = 0
                if entry["optimizer"] != kind:
                    raise RuntimeError(f"unsharded_fused_optimizer_state: shards of '{key}' use different "
                                       f"optimizers ({entry['optimizer']} and {kind})")
                # a table's shards normally step together; a shard that saw no backward lags: keep the largest
                entry["step"] = torch.tensor(max(int(entry["step"]), step), dtype=torch.int64)
                for name, a in arrays.items():
                    if _per_row(a):
                        entry[name][offsets[0]: offsets[0] + sizes[0]] = a
                    else:
                        entry[name][_slices(offsets, sizes)] = a
                covered[key] += sizes[0] * sizes[1]
    for key, n in covered.items():
        total = numel[key]
        if n < total:
            raise RuntimeError(f"unsharded_fused_optimizer_state: shards of '{key}' cover {n} of {total} elements "
                               "(a rank did not take part?)")
    if strip_prefixes:
        out = {_strip(k): v for k, v in out.items()}
    return out


def load_unsharded_fused_optimizer_state(model: torch.nn.Module, state: Mapping[str, Mapping[str, Any]],
                                         strict: bool = True) -> None:
    """Copy fused-optimizer state from :func:`unsharded_fused_optimizer_state` into ``model``, whatever its
    sharding. No communication: every rank reads the slices its own shards cover.

    The model's tables must use the same fused optimizer as the checkpoint (hyper-parameters such as the
    learning rate come from the model's ``fused_params``). A stack of tables that share one kernel
    takes the largest step count of its tables in the checkpoint.
    """
    by_stripped = {_strip(k): k for k in state}
    steps: Dict[Tuple[int, int], Tuple[_TableState, int]] = {}
    missing = []
    for ts in _fused_tables(model):
        src_key = ts.key if ts.key in state else by_stripped.get(_strip(ts.key))
        if src_key is None:
            missing.append(ts.key)
            continue
        entry = state[src_key]
        if entry["optimizer"] != ts.kind:
            raise ValueError(f"load_unsharded_fused_optimizer_state: table '{ts.table.name}' ({ts.key}) is trained "
                             f"with fused {ts.kind} but the checkpoint holds {entry['optimizer']} state")
        offsets, sizes, full = _shard_geometry(ts.table)
        for name, cur in ts.read().items():
            if name not in entry:
                raise KeyError(f"load_unsharded_fused_optimizer_state: '{ts.key}' has no '{name}' in the checkpoint")
            src = torch.as_tensor(entry[name])
            want = (full[0],) if _per_row(cur) else tuple(full)
            if tuple(src.shape) != want:
                raise ValueError(f"load_unsharded_fused_optimizer_state: '{name}' of '{ts.key}' has shape "
                                 f"{tuple(src.shape)} in the checkpoint but the table needs {want}")
            if _per_row(cur):
                if sizes[1] != full[1]:
                    raise NotImplementedError(
                        f"load_unsharded_fused_optimizer_state: table '{ts.table.name}' is column-sharded and "
                        "trained with row-wise Adagrad (one accumulator per row and column shard)")
                ts.write(name, src[offsets[0]: offsets[0] + sizes[0]])
            else:
                ts.write(name, src[_slices(offsets, sizes)])
        k = (id(ts.kernel_tables), ts.stack)
        steps[k] = (ts, max(steps.get(k, (ts, 0))[1], int(entry["step"])))
    if strict and missing:
        raise KeyError(f"load_unsharded_fused_optimizer_state: no checkpoint entry for {missing}")
    for ts, step in steps.values():
        ts.set_step(step)
