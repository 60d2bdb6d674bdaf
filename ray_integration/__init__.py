"""ray_integration: TPU hosts as Ray actors, whole-slice placement, job submission (docs/ray.md)."""

from . import jobs
from .cluster import (DEFAULT_OBJECT_STORE_MEMORY, DEFAULT_RUN_DIR, LocalHead, NodeProcess, SimulatedSlice,
                      local_head, start_simulated_slice, stop_simulated_slice)
from .discovery import HostInfo, SliceInfo, SliceSpec, alive_nodes, discover_slices
from .host_group import HostContext, HostFailure, HostStatus, TPUHostGroup, current_host, default_backend
from .placement import SlicePlacementTimeout, SliceReservation, connect, reserve_slices
from .resources import require_tpu_chips, tpu_actor_options, tpu_capacity

__all__ = [
    "jobs",
    "DEFAULT_OBJECT_STORE_MEMORY", "DEFAULT_RUN_DIR", "LocalHead", "NodeProcess", "SimulatedSlice", "alive_nodes",
    "local_head", "start_simulated_slice", "stop_simulated_slice",
    "HostInfo", "SliceInfo", "SliceSpec", "discover_slices",
    "HostContext", "HostFailure", "HostStatus", "TPUHostGroup", "current_host", "default_backend",
    "SlicePlacementTimeout", "SliceReservation", "connect", "reserve_slices",
    "require_tpu_chips", "tpu_actor_options", "tpu_capacity",
]
