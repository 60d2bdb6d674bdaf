"""The ``tpu`` torch.distributed backend (a package, one module per concern).

* ``backend.py``: the c10d process group (``ProcessGroupTPU``): descriptor exchange, Work objects,
  which transport serves a call, gloo for CPU tensors and host staging;
* ``runtime.py``: JAX's multi-process runtime, brought up by ``init_process_group("tpu")`` on the
  group's own rendezvous, and the JAX device of each rank;
* ``store.py``: the group's c10d store listening on the group's address only (never every interface);
* ``xla.py``: collectives on tpu tensors as XLA programs over the participating processes' devices.
"""

from .backend import BACKEND_NAME, ProcessGroupTPU, agreed_arguments, host_staged, register
from .runtime import xla_transport_active

__all__ = ["BACKEND_NAME", "ProcessGroupTPU", "agreed_arguments", "host_staged", "register",
           "xla_transport_active"]
