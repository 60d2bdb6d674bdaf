"""foreach lowerings."""
