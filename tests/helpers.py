"""Helpers shared by test modules (pytest puts tests/ on sys.path)."""

import contextlib

import torchtpu


@contextlib.contextmanager
def no_fallback():
    """CPU fallback off inside the block, and no op may have fallen back in it."""
    before = dict(torchtpu.metrics.snapshot()["cpu_fallbacks"])
    torchtpu.set_cpu_fallback(False)
    try:
        yield
    finally:
        torchtpu.set_cpu_fallback(True)
    assert dict(torchtpu.metrics.snapshot()["cpu_fallbacks"]) == before
