"""ray_integration (see issues: not built yet)."""
