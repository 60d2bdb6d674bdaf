"""torchtpu_rec (see issues: not built yet)."""
