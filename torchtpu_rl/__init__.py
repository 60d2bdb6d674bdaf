"""torchtpu_rl (see issues: not built yet)."""
