"""decomp lowerings."""
