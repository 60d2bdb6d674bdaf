"""Sharded checkpoints of DMP models on tpu: gather to unsharded CPU tensors, load back into any sharding.

``unsharded_state_dict(model)`` turns every ``ShardedTensor`` of ``model.state_dict()`` (embedding tables
sharded table-, row-, column- or table-row-wise) into the full table on the host, gathered from all
ranks of the process group; plain tensors (dense layers, data-parallel tables) are copied to the host.
The result is what an unsharded model's ``state_dict()`` holds (DMP's ``_dmp_wrapped_module.`` /
DDP ``module.`` prefixes are kept as the sharded model names them, so the dict loads back into a
model built the same way), and ``torch.save`` writes it as is.

``load_unsharded_state_dict(model, state_dict)`` copies such a dict into a (possibly differently)
sharded model: each rank takes the slice of every table that its local shards cover.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()


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
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, local, group=group)
    else:
        gathered = [local]
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
