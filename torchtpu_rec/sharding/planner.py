"""TorchRec's planner taught ``tpu``: topology, per-chip HBM, the tpu sharders' sharding types.

torchrec 1.8 hard-codes its compute devices (``Topology`` asserts cpu/cuda/mtia; the storage and perf
estimators and the storage reservation count HBM only for ``{"cuda", "mtia"}``). A TPU chip is an
HBM accelerator like those, so:

* :class:`TPUTopology` is a ``Topology`` built with HBM per chip (by TPU generation, or given) and
  answers ``compute_device == "tpu"``: the enumerator asks the sharders for their tpu sharding types
  and kernels, and the plan's placements name ``tpu`` (normalized to ``rank:r/tpu:0`` by the sharders);
* the estimators and the storage reservation see the same topology as an HBM device (their cost
  model for "cuda": HBM storage and bandwidth), through :func:`_hbm_view`;
* :class:`TPUEmbeddingShardingPlanner` wires these together; :func:`plan_for_tpu` is the one-call
  helper (a collective plan: every rank gets rank 0's plan);
* :func:`tpu_sharders` gives this project's sharders for both TorchRec embedding modules
  (``EmbeddingBagCollection`` and ``EmbeddingCollection``), for the planner and for DMP's ``sharders=``.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Dict, List, Optional

import torch.distributed as dist
from torch import nn

from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from .embedding import TPUEmbeddingCollectionSharder
from .embeddingbag import TPUEmbeddingBagCollectionSharder, tpu_placements

# HBM per chip (bytes) by TPU generation (public specs)
TPU_HBM_BYTES = {
    "v4": 32 * 1024**3,
    "v5e": 16 * 1024**3,
    "v5p": 95 * 1024**3,
    "v6e": 32 * 1024**3,
    "v7": 192 * 1024**3,
}
DEFAULT_GENERATION = "v5p"
# SparseCores per chip (DESIGN.md)
SPARSECORES_PER_CHIP = {"v5p": 4, "v6e": 2, "v7": 2}


class TPUTopology(Topology):
    """A torchrec ``Topology`` of ``world_size`` TPU chips (one process per chip).

    ``hbm_cap``: bytes of HBM per chip (default: by ``generation``). ``ddr_cap``: host memory per
    process. ``local_world_size``: chips per host (default: all on one host).
    """

    def __init__(self, world_size: int, generation: str = DEFAULT_GENERATION, hbm_cap: Optional[int] = None,
                 ddr_cap: Optional[int] = None, local_world_size: Optional[int] = None, **kwargs):
        if hbm_cap is None:
            if generation not in TPU_HBM_BYTES:
                raise ValueError(f"TPUTopology: unknown TPU generation '{generation}' "
                                 f"(known: {sorted(TPU_HBM_BYTES)}); pass hbm_cap=")
            hbm_cap = TPU_HBM_BYTES[generation]
        # built as an HBM device (torchrec's only HBM path), then named tpu
        super().__init__(world_size=world_size, compute_device="cuda", hbm_cap=hbm_cap, ddr_cap=ddr_cap,
                         local_world_size=local_world_size, **kwargs)
        self._compute_device = "tpu"
        self.generation = generation


def _hbm_view(topology: Topology) -> Topology:
    """The same topology as torchrec's HBM cost model sees an accelerator (compute_device 'cuda')."""
    view = copy.copy(topology)
    view._compute_device = "cuda"
    return view


class _TPUStorageReservation(HeuristicalStorageReservation):
    def reserve(self, topology, batch_size, module, sharders, constraints=None, **kwargs):
        reserved = super().reserve(_hbm_view(topology), batch_size, module, sharders, constraints, **kwargs)
        reserved._compute_device = topology.compute_device
        return reserved


def _tpu_enumerator(topology, batch_size, constraints) -> EmbeddingEnumerator:
    """TorchRec's enumerator over a tpu topology, its estimators seeing it as an HBM device."""
    hbm = _hbm_view(topology)
    return EmbeddingEnumerator(
        topology=topology, batch_size=batch_size, constraints=constraints,
        estimator=[EmbeddingPerfEstimator(topology=hbm, constraints=constraints),
                   EmbeddingStorageEstimator(topology=hbm, constraints=constraints)])


class TPUEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's EmbeddingShardingPlanner over a :class:`TPUTopology`."""

    def __init__(self, topology: TPUTopology, batch_size: int = 512,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None, **kwargs):
        if topology.compute_device != "tpu":
            raise ValueError("TPUEmbeddingShardingPlanner needs a TPUTopology")
        enumerator = _tpu_enumerator(topology, batch_size, constraints)
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         storage_reservation=_TPUStorageReservation(percentage=0.15),
                         constraints=constraints, **kwargs)


def tpu_sharders(fused_params: Optional[Dict] = None, **kwargs) -> List[ModuleSharder[nn.Module]]:
    """The tpu sharders of both TorchRec embedding modules, sharing ``fused_params``.

    Pass the list to the planner (:func:`plan_for_tpu`) and to ``DistributedModelParallel(sharders=...)``.
    """
    return [TPUEmbeddingBagCollectionSharder(fused_params=fused_params, **kwargs),
            TPUEmbeddingCollectionSharder(fused_params=fused_params, **kwargs)]


def plan_for_tpu(module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
                 world_size: Optional[int] = None, pg: Optional[dist.ProcessGroup] = None,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None, batch_size: int = 512,
                 **topology_kwargs) -> ShardingPlan:
    """A sharding plan for ``module`` on ``world_size`` tpu chips (a collective when ``pg`` is given).

    ``sharders`` default to :func:`tpu_sharders` (EmbeddingBagCollection and EmbeddingCollection).
    """
    sharders = sharders if sharders is not None else tpu_sharders()
    if world_size is None:
        world_size = dist.get_world_size(pg) if dist.is_initialized() else 1
    planner = TPUEmbeddingShardingPlanner(TPUTopology(world_size, **topology_kwargs), batch_size=batch_size,
                                          constraints=constraints)
    plan = _collective_plan(planner, module, sharders, pg) if pg is not None else planner.plan(module, sharders)
    for module_plan in plan.plan.values():
        tpu_placements(module_plan)
    return plan


def _collective_plan(planner, module, sharders, pg) -> ShardingPlan:
    """TorchRec's collective_plan (plan on rank 0, broadcast the plan), except that a planner error on
    rank 0 reaches every rank: TorchRec's own leaves the other ranks waiting in the broadcast."""
    from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result

    def plan_or_error():
        try:
            return planner.plan(module, sharders), None
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            return None, f"{type(e).__name__}: {e}"

    plan, error = invoke_on_rank_and_broadcast_result(pg, 0, plan_or_error)
    if error is not None:
        raise RuntimeError(f"plan_for_tpu: the planner failed on rank 0: {error}")
    return plan


_MARK = "_torchtpu_rec_tpu"


def install() -> None:
    """Teach TorchRec's own ``Topology`` and ``EmbeddingShardingPlanner`` the ``tpu`` device (once), for
    the explicit-planner pattern of TorchRec's examples (torchrec_dlrm's ``dlrm_main.py``):
    ``Topology(..., compute_device="tpu")`` is built as :class:`TPUTopology` is (HBM per chip, default
    generation), and a planner over it gets the tpu enumerator and storage reservation (HBM cost model)
    where its caller gave none, or gave TorchRec's ``HeuristicalStorageReservation`` (its settings kept)."""
    if getattr(Topology.__init__, _MARK, False):
        return
    topology_init = Topology.__init__
    topology_sig = inspect.signature(topology_init)

    @functools.wraps(topology_init)
    def topology_init_tpu(self, *args, **kwargs):
        bound = topology_sig.bind(self, *args, **kwargs)
        a = bound.arguments
        if a.get("compute_device") != "tpu" or isinstance(self, TPUTopology):
            return topology_init(*bound.args, **bound.kwargs)
        a["compute_device"] = "cuda"  # built as an HBM device (torchrec's only HBM path), then named tpu
        if a.get("hbm_cap") is None:
            a["hbm_cap"] = TPU_HBM_BYTES[DEFAULT_GENERATION]
        topology_init(*bound.args, **bound.kwargs)
        self._compute_device = "tpu"

    planner_init = EmbeddingShardingPlanner.__init__
    planner_sig = inspect.signature(planner_init)

    @functools.wraps(planner_init)
    def planner_init_tpu(self, *args, **kwargs):
        bound = planner_sig.bind(self, *args, **kwargs)
        a = bound.arguments
        topology = a.get("topology")
        if topology is not None and topology.compute_device == "tpu" and not isinstance(self, TPUEmbeddingShardingPlanner):
            batch_size = a.get("batch_size") or BATCH_SIZE
            constraints = a.get("constraints")
            if a.get("enumerator") is None:
                a["enumerator"] = _tpu_enumerator(topology, batch_size, constraints)
            reservation = a.get("storage_reservation")
            if reservation is None:
                a["storage_reservation"] = _TPUStorageReservation(
                    percentage=a.get("heuristical_storage_reservation_percentage", 0.15))
            elif type(reservation) is HeuristicalStorageReservation:
                tpu_reservation = copy.copy(reservation)
                tpu_reservation.__class__ = _TPUStorageReservation  # the same settings, the HBM view
                a["storage_reservation"] = tpu_reservation
        planner_init(*bound.args, **bound.kwargs)

    setattr(topology_init_tpu, _MARK, True)
    Topology.__init__ = topology_init_tpu
    EmbeddingShardingPlanner.__init__ = planner_init_tpu
