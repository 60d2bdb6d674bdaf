"""The tpu random number state: a seed and a counter folded into a JAX key.

Each random op takes the next counter value, so the executable is not
recompiled per call and ``torch.manual_seed`` makes tpu randomness
reproducible.

With the C++ hooks built (runtime/pinned.py), the seed and the counter live in the hooks' default
tpu generator (``torch.tpu.default_generators[0]``, its ``initial_seed()`` and ``get_offset()``),
so seeding or reading that generator is seeding or reading this stream, as on CUDA; without them
they live here.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

_lock = threading.Lock()
_seed = 0
_counter = 0
_default = None  # the default tpu torch.Generator, once the C++ hooks provide one


def use_default_generator(generator) -> None:
    """Keep the global stream in ``generator`` (the hooks' default one) from now on, where it is."""
    global _default
    with _lock:
        generator.manual_seed(_seed)
        generator.set_offset(_counter)
        _default = generator


def default_generator():
    """The default tpu ``torch.Generator`` (None without the C++ hooks)."""
    return _default


def manual_seed(seed: int) -> None:
    global _seed, _counter
    with _lock:
        if _default is not None:
            _default.manual_seed(int(seed) & 0xFFFFFFFFFFFFFFFF)  # its offset restarts at 0
            return
        _seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        _counter = 0


def initial_seed() -> int:
    return _default.initial_seed() if _default is not None else _seed


def get_state():
    if _default is not None:
        with _lock:
            return (_default.initial_seed(), _default.get_offset())
    return (_seed, _counter)


def set_state(state):
    global _seed, _counter
    with _lock:
        if _default is not None:
            _default.manual_seed(int(state[0]))
            _default.set_offset(int(state[1]))
            return
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
        if _default is not None:
            c = _default.get_offset()
            _default.set_offset(c + 1)
            return key_data(_default.initial_seed(), c)
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
