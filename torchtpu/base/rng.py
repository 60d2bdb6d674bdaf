"""The tpu random number state: a seed and a counter folded into a JAX key.

Each random op takes the next counter value, so the executable is not
recompiled per call and ``torch.manual_seed`` makes tpu randomness
reproducible.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

_lock = threading.Lock()
_seed = 0
_counter = 0


def manual_seed(seed: int) -> None:
    global _seed, _counter
    with _lock:
        _seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        _counter = 0


def initial_seed() -> int:
    return _seed


def get_state():
    return (_seed, _counter)


def set_state(state):
    global _seed, _counter
    with _lock:
        _seed, _counter = int(state[0]), int(state[1])


def next_key_data(generator=None):
    """uint32[2] key data for the next random op (host side, cheap): from the global stream, or from
    ``generator`` (a ``torch.Generator(device="tpu")``: its seed and offset, the offset advanced)."""
    global _counter
    if generator is not None:
        if generator.device.type != "tpu":
            raise RuntimeError(f"Expected a 'tpu' device type for generator but found '{generator.device.type}'")
        seed = generator.initial_seed()
        c = generator.get_offset()
        generator.set_offset(c + 1)
        return key_data(seed, c)
    with _lock:
        c = _counter
        _counter += 1
    return key_data(_seed, c)


def key_data(seed: int, counter: int):
    """The key of draw ``counter`` of the stream ``seed``: the global stream and a generator seeded
    alike give the same numbers."""
    # threefry key from (seed, counter): mixing done on device by fold_in would cost a
    # dispatch; a host-side splitmix keeps streams independent and reproducible.
    z = (seed * 0x9E3779B97F4A7C15 + counter * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return np.array([z >> 32, z & 0xFFFFFFFF], dtype=np.uint32)


assert jax  # keys are wrapped with jax.random.wrap_key_data inside the executable
