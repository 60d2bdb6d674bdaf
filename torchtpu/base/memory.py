"""Memory accounting of device buffers: what ``torch.tpu.memory_allocated`` and the peak report."""

from __future__ import annotations

import threading


class MemoryStats:
    """Bytes of live device buffers, counted per storage."""

    def __init__(self):
        self.lock = threading.Lock()
        self.allocated = 0
        self.peak = 0
        self.num_storages = 0

    def add(self, n):
        with self.lock:
            self.allocated += n
            self.num_storages += 1
            if self.allocated > self.peak:
                self.peak = self.allocated

    def note_transient(self, n):
        """``n`` bytes held only for a moment on top of what is allocated (a fused graph's
        temporaries while it runs): they count toward the peak, not the allocation."""
        with self.lock:
            if self.allocated + n > self.peak:
                self.peak = self.allocated + n

    def sub(self, n):
        with self.lock:
            self.allocated -= n
            self.num_storages -= 1

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.allocated

    def snapshot(self) -> tuple[int, int, int]:
        """(allocated, peak, number of storages), read together."""
        with self.lock:
            return self.allocated, self.peak, self.num_storages


MEMORY = MemoryStats()
