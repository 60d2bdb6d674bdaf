"""random_ops lowerings."""
