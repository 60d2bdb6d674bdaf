"""Op lowerings, one module per family; importing fills the lowering table (dispatch/lowering.py).
PyTorch's decompositions for the ops still without a kernel are installed by ``decomp``."""

from . import (  # noqa: F401
    amp,
    core,
    decomp,
    elementwise,
    foreach,
    indexing,
    linalg,
    nn,
    random_ops,
    reductions,
    shape,
    special,
)
