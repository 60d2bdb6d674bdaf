"""Op lowerings, one module per family; importing registers them in the registry."""

from . import (  # noqa: F401
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
)
