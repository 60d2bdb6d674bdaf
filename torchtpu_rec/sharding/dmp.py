"""``DistributedModelParallel(model, device=torch.device("tpu"))`` with nothing else: the tpu defaults.

TorchRec's DMP fills in what its caller leaves out inside ``__init__``, with choices that only hold for
cpu/cuda/mtia and no per-device hook: ``get_default_sharders()`` (fbgemm TBE kernels), a planner over
``Topology(compute_device=...)`` (which asserts cpu/cuda/mtia). So ``import torchtpu_rec`` wraps
``DistributedModelParallel.__init__`` once (:func:`install`): for a tpu ``device`` it fills in

* ``sharders``: :func:`~torchtpu_rec.sharding.tpu_sharders` (fused SGD at lr 0.01 without
  ``fused_params``, fbgemm's default); TorchRec's own ``EmbeddingBagCollectionSharder`` /
  ``EmbeddingCollectionSharder`` given explicitly become the tpu sharders with the same ``fused_params``;
* ``plan``: :func:`~torchtpu_rec.sharding.planner.plan_for_tpu` over the DMP's process group (TorchRec's
  planner taught tpu; a planner error reaches every rank);
* ``data_parallel_wrapper``: TorchRec's own ``DefaultDataParallelWrapper()`` (DDP with ``static_graph=True``)
  stays, as its reducer's pinned host memory comes from the tpu's C++ hooks (torchtpu.runtime.pinned);
  where they are not built, :func:`~torchtpu_rec.sharding.tpu_data_parallel_wrapper` instead, and an
  explicit static-graph wrapper is refused with a clear error instead of failing in the first backward.

Arguments given explicitly are kept; other devices go to TorchRec untouched.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, List, Optional

import torch
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from torchtpu.runtime.pinned import pinned_hooks_active

_MARK = "_torchtpu_rec_defaults"


def _tpu_sharder(sharder):
    """TorchRec's own EBC/EC sharder -> the tpu one with the same fused_params; others as given."""
    from .embedding import TPUEmbeddingCollectionSharder
    from .embeddingbag import TPUEmbeddingBagCollectionSharder

    kw = dict(fused_params=sharder.fused_params, qcomm_codecs_registry=sharder.qcomm_codecs_registry)
    if type(sharder) is EmbeddingBagCollectionSharder:
        return TPUEmbeddingBagCollectionSharder(**kw)
    if type(sharder) is EmbeddingCollectionSharder:
        return TPUEmbeddingCollectionSharder(**kw)
    return sharder


def tpu_data_parallel_wrapper(**ddp_kwargs) -> DefaultDataParallelWrapper:
    """DMP's ``data_parallel_wrapper`` without ``static_graph`` (plain DDP of the dense part).

    The default on tpu where the tpu's C++ hooks are not built: TorchRec's default wrapper builds
    DDP(static_graph=True), whose reducer asks them for pinned host memory (see torchtpu.runtime.pinned).
    """
    return DefaultDataParallelWrapper(static_graph=False, ddp_kwargs=ddp_kwargs or None)


def tpu_arguments(module: torch.nn.Module, env: Optional[ShardingEnv], plan, sharders: Optional[List],
                  data_parallel_wrapper) -> tuple:
    """(env, plan, sharders, data_parallel_wrapper) for a DMP on tpu, missing ones filled in."""
    import torch.distributed as dist

    from .planner import plan_for_tpu, tpu_sharders

    if env is None:
        pg = dist.GroupMember.WORLD
        if pg is None:
            raise RuntimeError("DistributedModelParallel on tpu: the process group is not initialized "
                               "(torch.distributed.init_process_group('tpu'))")
        env = ShardingEnv.from_process_group(pg)
    sharders = tpu_sharders() if sharders is None else [_tpu_sharder(s) for s in sharders]
    # with the tpu's C++ hooks (pinned memory) TorchRec's default wrapper (None) and any other run unchanged
    if not pinned_hooks_active():
        if data_parallel_wrapper is None:
            data_parallel_wrapper = tpu_data_parallel_wrapper()
        elif type(data_parallel_wrapper) is DefaultDataParallelWrapper and data_parallel_wrapper._static_graph:  # noqa: SLF001
            raise ValueError(
                "DistributedModelParallel on tpu: DefaultDataParallelWrapper(static_graph=True) builds a DDP whose "
                "reducer needs pinned host memory, and the tpu's C++ hooks that provide it are not built "
                "(scripts/setup.sh builds them; torchtpu.runtime.pinned); leave data_parallel_wrapper out or pass "
                "torchtpu_rec.sharding.tpu_data_parallel_wrapper()")
    if plan is None:
        world = env.world_size
        plan = plan_for_tpu(module, sharders, world_size=world, pg=env.process_group,
                            local_world_size=get_local_size(world))
    return env, plan, sharders, data_parallel_wrapper


def compile_dense(model: torch.nn.Module, **compile_kwargs) -> List[str]:
    """Compile the dense part of a DMP model on tpu in place: every largest submodule that holds no sharded
    module (DLRM's dense, interaction and over arches, a loss) runs as ``torch.compile(backend="tpu")``
    graphs (forward and backward one XLA executable each) instead of one executable per op; the sharded
    modules and the code around them stay eager. Returns the compiled submodules' names.
    ``compile_kwargs`` go to ``nn.Module.compile`` (``backend`` defaults to "tpu")."""
    from torchrec.distributed.types import ShardedModule

    compile_kwargs.setdefault("backend", "tpu")
    sharded = [m for m in model.modules() if isinstance(m, ShardedModule)]
    compiled: List[str] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, ShardedModule):
                continue
            if any(s is m for s in sharded for m in child.modules()):
                visit(child, path)
            else:
                child.compile(**compile_kwargs)
                compiled.append(path)

    visit(model, "")
    return compiled


def install() -> None:
    """Wrap ``DistributedModelParallel.__init__`` so that a tpu ``device`` gets the tpu defaults (once)."""
    init = DistributedModelParallel.__init__
    if getattr(init, _MARK, False):
        return

    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any):
        bound = signature.bind(self, *args, **kwargs)
        a = bound.arguments
        device = a.get("device")
        if isinstance(device, str):
            a["device"] = device = torch.device(device)
        if device is not None and device.type == "tpu":
            a["env"], a["plan"], a["sharders"], a["data_parallel_wrapper"] = tpu_arguments(
                a["module"], a.get("env"), a.get("plan"), a.get("sharders"), a.get("data_parallel_wrapper"))
        init(*bound.args, **bound.kwargs)

    setattr(__init__, _MARK, True)
    DistributedModelParallel.__init__ = __init__
