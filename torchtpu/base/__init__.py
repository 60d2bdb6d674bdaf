"""The base layer: dtypes, random keys, metrics counters, memory accounting, op names and
"which frame is user code". It imports nothing else of torchtpu."""
