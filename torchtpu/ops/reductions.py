"""reductions lowerings."""
