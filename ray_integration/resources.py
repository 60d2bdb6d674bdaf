"""Ray resource requests for processes that each drive TPU chips, on clusters that have them.

On a TPU host Ray offers ``TPU`` (chips on the node) and, on worker 0 of each slice,
``TPU-<pod type>-head``. An actor that asks for ``{"TPU": n}`` gets ``n`` chips, and Ray's own TPU
accelerator manager (``ray._private.accelerators.tpu``) sets the process's ``TPU_VISIBLE_CHIPS`` and,
for one or two chips, ``TPU_CHIPS_PER_HOST_BOUNDS`` / ``TPU_HOST_BOUNDS``: one process per chip,
each JAX seeing only its own chip (torchtpu's model: one ``tpu`` device per process). On a CPU-only
cluster nothing is requested and nothing changes.
"""

from __future__ import annotations

from typing import Dict, Optional


def tpu_capacity() -> Dict[str, float]:
    """The connected cluster's TPU resources: ``TPU`` (all chips) and each ``TPU-<pod>-head``; empty on a
    cluster without TPUs."""
    import ray

    res = ray.cluster_resources()
    return {k: v for k, v in res.items() if k == "TPU" or (k.startswith("TPU-") and k.endswith("-head"))}


def tpu_actor_options(chips: int = 1, *, slice_head: bool = False,
                      capacity: Optional[Dict[str, float]] = None) -> dict:
    """``.options()`` for an actor that drives ``chips`` TPU chips: ``{"resources": {"TPU": chips}}``
    (plus one ``TPU-<pod>-head``, placing it on worker 0 of a slice, with ``slice_head``) when the
    cluster offers TPUs, else ``{}``. Ray sets the actor's ``TPU_VISIBLE_CHIPS`` and process bounds."""
    if not isinstance(chips, int) or chips < 1:
        raise ValueError(f"tpu_actor_options: chips must be a positive int, got {chips!r}")
    cap = tpu_capacity() if capacity is None else capacity
    if not cap.get("TPU"):
        return {}
    resources: Dict[str, float] = {"TPU": chips}
    if slice_head:
        heads = sorted(k for k in cap if k != "TPU")
        if heads:
            resources[heads[0]] = 1
    return {"resources": resources}


def require_tpu_chips(needed: int, what: str, capacity: Optional[Dict[str, float]] = None) -> None:
    """Refuse, naming ``what``, a plan that asks a TPU cluster for more chips than it has (its actors
    would wait forever for resources that never free up)."""
    cap = tpu_capacity() if capacity is None else capacity
    have = cap.get("TPU", 0)
    if have and needed > have:
        raise ValueError(f"{what} needs {needed} TPU chips (one process per chip) but the Ray cluster has "
                         f"{int(have)}: use fewer processes or add TPU hosts")
