"""Op lowerings, one module per family; importing registers them in the registry."""

from . import core, elementwise  # noqa: F401
