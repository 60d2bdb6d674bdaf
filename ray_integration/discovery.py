"""What a TPU host and a Ray cluster say about TPU slices.

A TPU VM (GCE) or GKE/KubeRay pod carries its identity in the environment:
``TPU_ACCELERATOR_TYPE`` (the pod type, e.g. ``v4-16``), ``TPU_WORKER_ID`` (this host's index
in the slice), ``TPU_NAME`` (the slice's unique name), ``TPU_WORKER_HOSTNAMES`` (all hosts,
comma-separated, in worker-id order) and ``TPU_TOPOLOGY`` (e.g. ``2x2x2``). Ray turns these into
the ``TPU`` resource (chips on the node), ``TPU-<pod_type>-head`` on worker 0, a ``<TPU_NAME>``
resource on every host, and the node labels ``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``,
``ray.io/tpu-topology`` and ``ray.io/tpu-pod-type`` (Ray 2.60 names; see
``ray._private.accelerators.tpu``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from ray._private.accelerators import tpu as _raytpu

# Node label keys Ray 2.60 sets on TPU hosts (ray._raylet.RAY_NODE_TPU_*_KEY).
LABEL_SLICE_NAME = "ray.io/tpu-slice-name"
LABEL_WORKER_ID = "ray.io/tpu-worker-id"
LABEL_TOPOLOGY = "ray.io/tpu-topology"
LABEL_POD_TYPE = "ray.io/tpu-pod-type"
LABEL_ACCELERATOR_TYPE = "ray.io/accelerator-type"
# Our own label on nodes that only pretend to be TPU hosts (see cluster.start_simulated_slice).
SIMULATED_LABEL = "torchtpu.io/simulated-tpu"

ENV_VARS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_NAME", "TPU_WORKER_HOSTNAMES", "TPU_TOPOLOGY")

# User-facing aliases for generation names Ray spells differently.
_GENERATION_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v6": "v6e", "v7": "v7x"}


def _default_topology(generation: str, chips: int, what: str) -> str:
    """Google's default topology for a slice of ``chips`` chips (the one `gcloud` creates)."""
    if chips == 1 and generation in ("v5litepod", "v6e"):
        return "1x1"
    if chips < 4 or chips & (chips - 1):
        raise ValueError(f"{what}: {chips} chips is not a TPU slice size (expected 4, 8, 16, ... chips)")
    three_d = generation in ("v4", "v5p", "v7x")
    dims = [2, 2, 1] if three_d else [2, 2]
    while dims[0] * dims[1] * (dims[2] if three_d else 1) < chips:
        # Grow the last of the smallest dimensions: 2x2x1 -> 2x2x2 -> 2x2x4 -> 2x4x4 -> 4x4x4; 2x2 -> 2x4 -> 4x4.
        m = min(dims)
        i = len(dims) - 1 - dims[::-1].index(m)
        dims[i] *= 2
    return "x".join(map(str, dims))


@dataclass(frozen=True)
class SliceSpec:
    """Shape of one TPU slice: pod type (``v4-16``), generation, topology, hosts, chips per host."""

    pod_type: str
    generation: str
    topology: str
    num_hosts: int
    chips_per_host: int

    @property
    def num_chips(self) -> int:
        return _raytpu.get_num_chips_from_topology(self.topology)

    @property
    def cores_per_chip(self) -> int:
        return _raytpu.get_tpu_cores_per_chip(self.generation)

    @property
    def head_resource(self) -> str:
        """Ray resource present only on worker 0 of each slice of this pod type."""
        return f"TPU-{self.pod_type}-head"

    @property
    def ray_accelerator_type(self) -> str:
        """Ray's accelerator-type name for this generation (``TPU-V4``)."""
        return f"TPU-{self.generation.upper()}"

    @classmethod
    def parse(cls, accelerator_type: str, topology: Optional[str] = None,
              chips_per_host: Optional[int] = None) -> "SliceSpec":
        """From a GCP accelerator type: ``v4-16``, ``v5p-8``, ``v5litepod-16`` (alias ``v5e-16``), ``v6e-8``.

        The number is TensorCores for v2/v3/v4/v5p/v7x (2 per chip) and chips for v5e/v6e.
        ``topology`` defaults to what GCP provisions for that size; ``chips_per_host`` to
        Ray's rule (4, or all chips on single-host v5e/v6e).
        """
        what = f"accelerator type {accelerator_type!r}"
        if not isinstance(accelerator_type, str):
            raise TypeError(f"{what}: expected a string like 'v4-16'")
        s = _raytpu.normalize_tpu_accelerator_type(accelerator_type)
        m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", s)
        if not m:
            raise ValueError(f"{what}: expected '<generation>-<size>' such as 'v4-16', 'v5litepod-16', 'v6e-8'")
        generation = _GENERATION_ALIASES.get(m.group(1), m.group(1))
        if generation not in _raytpu.VALID_TPU_TYPES:
            raise ValueError(f"{what}: unknown TPU generation {m.group(1)!r}; known: {list(_raytpu.VALID_TPU_TYPES)}")
        size = int(m.group(2))
        cores_per_chip = _raytpu.get_tpu_cores_per_chip(generation)
        if size <= 0 or size % cores_per_chip:
            raise ValueError(f"{what}: size {size} is not a whole number of {generation} chips "
                             f"({cores_per_chip} TensorCores per chip)")
        chips = size // cores_per_chip
        pod_type = f"{generation}-{size}"
        if topology is None:
            topology = _default_topology(generation, chips, what)
        else:
            topology = str(topology).strip().lower()
            if not re.fullmatch(r"\d+(x\d+){1,2}", topology):
                raise ValueError(f"{what}: topology {topology!r} is not of the form AxB or AxBxC")
            if _raytpu.get_num_chips_from_topology(topology) != chips:
                raise ValueError(f"{what}: topology {topology!r} has "
                                 f"{_raytpu.get_num_chips_from_topology(topology)} chips, but {pod_type} has {chips}")
        if topology not in _raytpu.VALID_TPU_TOPOLOGY[generation]:
            raise ValueError(f"{what}: topology {topology!r} is not a valid {generation} topology "
                             f"(valid: {sorted(_raytpu.VALID_TPU_TOPOLOGY[generation])})")
        if chips_per_host is None:
            chips_per_host = _raytpu.get_chips_per_host(topology, generation)
        if not isinstance(chips_per_host, int) or chips_per_host not in _raytpu.TPU_VALID_CHIP_OPTIONS:
            raise ValueError(f"{what}: chips_per_host={chips_per_host!r} must be one of "
                             f"{_raytpu.TPU_VALID_CHIP_OPTIONS}")
        chips_per_host = min(chips_per_host, chips)
        if chips % chips_per_host:
            raise ValueError(f"{what}: {chips} chips do not split into hosts of {chips_per_host}")
        return cls(pod_type=pod_type, generation=generation, topology=topology,
                   num_hosts=chips // chips_per_host, chips_per_host=chips_per_host)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "SliceSpec":
        """The slice this host belongs to, from ``TPU_ACCELERATOR_TYPE`` (and ``TPU_TOPOLOGY``)."""
        env = os.environ if environ is None else environ
        acc = env.get("TPU_ACCELERATOR_TYPE")
        if not acc:
            raise RuntimeError("TPU_ACCELERATOR_TYPE is not set: this process is not on a TPU host "
                               "(or the host's environment was not passed on)")
        return cls.parse(acc, topology=env.get("TPU_TOPOLOGY") or None)


@dataclass(frozen=True)
class HostInfo:
    """This host's place in its slice, from the TPU environment variables."""

    spec: SliceSpec
    worker_id: int
    slice_name: Optional[str]
    hostnames: List[str] = field(default_factory=list)

    @property
    def is_head(self) -> bool:
        return self.worker_id == 0

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "HostInfo":
        env = os.environ if environ is None else environ
        spec = SliceSpec.from_env(env)
        wid = env.get("TPU_WORKER_ID")
        if wid is None or not wid.strip().isdigit():
            raise ValueError(f"TPU_WORKER_ID={wid!r}: expected a non-negative integer")
        worker_id = int(wid)
        if worker_id >= spec.num_hosts:
            raise ValueError(f"TPU_WORKER_ID={worker_id} is out of range for {spec.pod_type} "
                             f"({spec.num_hosts} hosts)")
        hostnames = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        if hostnames and len(hostnames) != spec.num_hosts:
            raise ValueError(f"TPU_WORKER_HOSTNAMES lists {len(hostnames)} hosts, but {spec.pod_type} "
                             f"has {spec.num_hosts}")
        return cls(spec=spec, worker_id=worker_id, slice_name=env.get("TPU_NAME") or None, hostnames=hostnames)


@dataclass
class SliceInfo:
    """A TPU slice as the Ray cluster sees it: its hosts (Ray nodes) by worker id."""

    name: str
    spec: SliceSpec
    nodes: Dict[int, dict]  # worker id -> node dict (node_id, address, labels, resources)
    simulated: bool = False

    @property
    def complete(self) -> bool:
        """All hosts present, worker 0 carrying the head resource."""
        return (sorted(self.nodes) == list(range(self.spec.num_hosts))
                and self.nodes[0]["resources"].get(self.spec.head_resource, 0) >= 1)


def _node_dict(n: dict) -> dict:
    # Accept both ray.nodes() dicts and cluster.alive_nodes() dicts.
    if "NodeID" in n:
        return {"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"), "labels": dict(n.get("Labels") or {}),
                "resources": dict(n.get("Resources") or {}), "alive": n.get("Alive", True)}
    return {**n, "alive": n.get("alive", True)}


def slices_from_nodes(nodes: List[dict]) -> Dict[str, SliceInfo]:
    """Group Ray nodes into TPU slices by their ``ray.io/tpu-*`` labels."""
    out: Dict[str, SliceInfo] = {}
    for raw in nodes:
        n = _node_dict(raw)
        lab = n["labels"]
        if not n["alive"] or LABEL_SLICE_NAME not in lab or LABEL_POD_TYPE not in lab:
            continue
        name = lab[LABEL_SLICE_NAME]
        if name not in out:
            try:
                spec = SliceSpec.parse(lab[LABEL_POD_TYPE], topology=lab.get(LABEL_TOPOLOGY) or None,
                                       chips_per_host=int(n["resources"].get("TPU", 0)) or None)
            except ValueError:
                continue
            out[name] = SliceInfo(name=name, spec=spec, nodes={}, simulated=lab.get(SIMULATED_LABEL) == "true")
        out[name].nodes[int(lab.get(LABEL_WORKER_ID, -1))] = n
    return out


def alive_nodes(address: str, timeout_s: float = 10.0) -> List[dict]:
    """Alive nodes of the cluster at GCS ``address``, read from the GCS (no driver needed)."""
    from ray._raylet import GcsClient
    from ray.core.generated import gcs_pb2

    client = GcsClient(address=address)
    out = []
    for node_id, info in client.get_all_node_info(timeout=timeout_s).items():
        if info.state != gcs_pb2.GcsNodeInfo.ALIVE:
            continue
        out.append({
            "node_id": info.node_id.hex(),
            "address": info.node_manager_address,
            "labels": dict(info.labels),
            "resources": dict(info.resources_total),
        })
    return out


def discover_slices(address: Optional[str] = None) -> Dict[str, SliceInfo]:
    """TPU slices of the connected Ray cluster (``ray.nodes()``), or of the GCS at ``address``."""
    if address is not None:
        return slices_from_nodes(alive_nodes(address))
    import ray

    if not ray.is_initialized():
        raise RuntimeError("discover_slices: call ray.init(address=...) first or pass address=")
    return slices_from_nodes(ray.nodes())
