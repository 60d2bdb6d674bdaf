"""indexing lowerings."""
