"""Whole-slice placement on top of ``ray.util.tpu.SlicePlacementGroup`` (Ray 2.60).

Ray's helper does the two steps a TPU user expects: reserve a slice's head host through its
``TPU-<pod_type>-head`` resource (which yields the slice's name), then place one bundle per host
of *that* slice through the ``ray.io/tpu-slice-name`` label. We add: ``STRICT_SPREAD`` (one
bundle per host), a ``ray.io/tpu-worker-id`` label per bundle so bundle ``i`` is worker ``i``
(bundle 0 is the head host, the coordinator), one placement group per slice, and a single
timeout over the whole reservation that raises :class:`SlicePlacementTimeout` naming what was
asked for and what the cluster has.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from .discovery import LABEL_POD_TYPE, LABEL_WORKER_ID, SliceInfo, SliceSpec, discover_slices


def connect(cluster, **init_kwargs) -> None:
    """``ray.init(address=...)`` to a cluster we know (never ``"auto"``: the machine may run other clusters).

    ``cluster`` is a GCS address, or a :class:`~ray_integration.LocalHead`, whose auth settings
    (:meth:`~ray_integration.LocalHead.client_env`) this process then takes. A no-op if already
    connected to that address; an error if connected elsewhere.
    """
    import ray

    address = getattr(cluster, "address", cluster)
    if not isinstance(address, str) or not address or address == "auto":
        raise ValueError(f"connect: give the cluster's explicit GCS address or its LocalHead (got {cluster!r})")
    use_auth = getattr(cluster, "use_auth", None)
    if use_auth is not None:
        use_auth()
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if current != address:
            raise RuntimeError(f"connect: this process is already connected to Ray at {current}, not {address}")
        return
    init_kwargs.setdefault("logging_level", "WARNING")
    ray.init(address=address, **init_kwargs)


class SlicePlacementTimeout(TimeoutError):
    """The cluster could not hold the requested slices within the timeout."""


@dataclass
class SliceReservation:
    """Reserved TPU slices: one placement group per slice, bundle ``i`` on worker ``i``."""

    spec: SliceSpec
    num_slices: int
    handle: object  # ray.util.tpu.SlicePlacementGroup
    slice_names: List[str]

    @property
    def placement_groups(self):
        return self.handle.slice_placement_groups

    def placement_group(self, slice_index: int = 0):
        if not 0 <= slice_index < self.num_slices:
            raise IndexError(f"slice_index {slice_index} out of range for {self.num_slices} reserved slice(s)")
        return self.placement_groups[slice_index]

    def bundle_nodes(self, slice_index: int = 0) -> List[str]:
        """Node id (hex) of each bundle of a slice, in bundle (= worker id) order."""
        from ray.util import placement_group_table

        table = placement_group_table(self.placement_group(slice_index))
        b2n = table["bundles_to_node_id"]
        return [b2n[i] for i in range(self.spec.num_hosts)]

    def release(self) -> None:
        """Remove the placement groups (idempotent)."""
        self.handle.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _describe_cluster(spec: SliceSpec) -> str:
    import ray

    try:
        slices = discover_slices()
    except Exception as e:  # the description must never hide the real error
        return f"(could not list slices: {e})"
    same = [s for s in slices.values() if s.spec.pod_type == spec.pod_type]
    parts = [f"{len(same)} {spec.pod_type} slice(s) in the cluster: "
             + (", ".join(f"{s.name} ({len(s.nodes)}/{s.spec.num_hosts} hosts)" for s in same) or "none")]
    others = sorted({s.spec.pod_type for s in slices.values()} - {spec.pod_type})
    if others:
        parts.append(f"other slice types: {others}")
    try:
        parts.append(f"available TPU: {ray.available_resources().get('TPU', 0)}, "
                     f"available {spec.head_resource}: {ray.available_resources().get(spec.head_resource, 0)}")
    except Exception:
        pass
    return "; ".join(parts)


def reserve_slices(spec: Union[SliceSpec, str], num_slices: int = 1, *, timeout_s: Optional[float] = 60.0,
                   resources_per_host: Optional[Dict[str, float]] = None, name: str = "",
                   lifetime: Optional[str] = None) -> SliceReservation:
    """Reserve ``num_slices`` whole slices of ``spec`` (a SliceSpec or an accelerator type like ``"v4-16"``).

    Blocks until every host bundle is placed; raises :class:`SlicePlacementTimeout` after
    ``timeout_s`` seconds (``None``: wait forever), having released whatever it held.
    Each bundle holds the host's ``TPU`` chips and ``resources_per_host`` (default: no CPU, so
    host actors take ``num_cpus=0``).
    """
    import ray
    from ray.util.tpu import SlicePlacementGroup

    if isinstance(spec, str):
        spec = SliceSpec.parse(spec)
    if not isinstance(spec, SliceSpec):
        raise TypeError(f"reserve_slices: spec must be a SliceSpec or an accelerator type, got {type(spec).__name__}")
    if not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"reserve_slices: num_slices must be a positive int, got {num_slices!r}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"reserve_slices: timeout_s must be positive or None, got {timeout_s!r}")
    if not ray.is_initialized():
        raise RuntimeError("reserve_slices: not connected to Ray (call ray_integration.connect(address) first)")

    bundle = {"CPU": 0, **(resources_per_host or {}), "TPU": spec.chips_per_host}
    # Bundle i of every slice must land on that slice's worker i (the slice-name label is added by Ray
    # for multi-host slices). The pod type keeps single-host requests off other kinds of hosts: Ray
    # reserves no slice head for those.
    selectors = [{LABEL_WORKER_ID: str(i), LABEL_POD_TYPE: spec.pod_type}
                 for _ in range(num_slices) for i in range(spec.num_hosts)]
    asked = (f"{num_slices} x {spec.pod_type} (topology {spec.topology}, {spec.num_hosts} host(s) x "
             f"{spec.chips_per_host} chips)")
    start = time.monotonic()
    try:
        handle = SlicePlacementGroup(
            topology=spec.topology, accelerator_version=spec.generation, resources_per_bundle=bundle,
            strategy="STRICT_SPREAD", name=name, lifetime=lifetime, num_slices=num_slices,
            chips_per_vm=spec.chips_per_host, head_reservation_timeout_s=timeout_s,
            bundle_label_selector=selectors, pg_per_slice=True)
    except TimeoutError as e:
        # Ray's message lists raw resources; say what was asked and which slices exist.
        raise SlicePlacementTimeout(
            f"could not reserve {asked} within {timeout_s}s: no free slice head ({spec.head_resource}). "
            f"{_describe_cluster(spec)}") from e

    pgs = handle.slice_placement_groups
    left = None if timeout_s is None else max(0.1, timeout_s - (time.monotonic() - start))
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=left)
    if len(ready) != len(pgs):
        handle.shutdown()
        raise SlicePlacementTimeout(
            f"could not place every host of {asked} within {timeout_s}s "
            f"({'no free host of that type' if spec.num_hosts == 1 else 'slice heads were reserved, but not all of their hosts are free or alive'}). "
            f"{_describe_cluster(spec)}")
    try:
        ray.get(ready)
    except Exception:
        handle.shutdown()
        raise
    names = []
    for pg in pgs:
        names.append(_slice_name_of(pg))
    return SliceReservation(spec=spec, num_slices=num_slices, handle=handle, slice_names=names)


def _slice_name_of(pg) -> str:
    from ray.util import placement_group_table

    from .discovery import LABEL_SLICE_NAME

    node_id = placement_group_table(pg)["bundles_to_node_id"][0]
    for n in ray_nodes():
        if n["NodeID"] == node_id:
            return (n.get("Labels") or {}).get(LABEL_SLICE_NAME, "")
    return ""


def ray_nodes() -> List[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def slice_of(reservation: SliceReservation, slice_index: int = 0) -> SliceInfo:
    """The SliceInfo (hosts by worker id) of a reserved slice."""
    name = reservation.slice_names[slice_index]
    slices = discover_slices()
    if name not in slices:
        raise RuntimeError(f"reserved slice {name!r} is no longer in the cluster")
    return slices[name]
