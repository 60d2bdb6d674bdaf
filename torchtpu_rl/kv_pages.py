"""A paged KV cache for Hugging Face causal LMs, for :class:`~torchtpu_rl.serving.ServingEngine`.

KV memory is one pool of fixed-size pages per attention layer, ``(pages * page_size, kv_heads,
head_dim)``; a sequence owns a block table (the list of its pages, position ``p`` lives in page
``table[p // page_size]`` at offset ``p % page_size``). The host side (:class:`PageAllocator`,
:class:`PrefixCache`) is plain Python bookkeeping: reference-counted pages, so the ``n`` samples
of one request share their prompt's pages, and a prefix cache of full token blocks with LRU
eviction. The device side (:class:`PagedCache`) is a ``transformers`` :class:`~transformers.Cache`
plugged into the model's own attention: each forward writes its new keys/values through a flat
slot index (``index_copy_``) and reads every row's pages through its block table (``index_select``
of a ``(rows, pages bucket * page_size)`` index), so a program's shapes are fixed by (rows bucket,
tokens bucket, pages bucket) only; on tpu both lower to XLA scatter/gather.

Page 0 is scratch: padding rows and padding tokens write there and masked reads point there, so no
index is ever out of range and no real page is ever touched by padding.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

__all__ = ["PageAllocator", "PagedCache", "PrefixCache", "copy_slots", "kv_bytes_per_token"]

SCRATCH_PAGE = 0


def _kv_shape(model):
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layer_types, _ = get_layer_types_and_kwargs(cfg)
    return list(layer_types), kv_heads, head_dim


def kv_bytes_per_token(model, dtype=None) -> int:
    """Bytes of keys and values one token holds over every attention layer of ``model``."""
    layer_types, kv_heads, head_dim = _kv_shape(model)
    dtype = dtype or next(model.parameters()).dtype
    return 2 * len(layer_types) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Reference-counted pages ``1 .. num_pages`` (page 0 is the scratch page, never handed out)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PageAllocator: num_pages and page_size must be >= 1, not {num_pages}, {page_size}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._free = collections.deque(range(1, num_pages + 1))
        self._refs = [0] * (num_pages + 1)
        self.peak = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self) -> Optional[int]:
        """A fresh page (reference count 1), or None when none is free."""
        if not self._free:
            return None
        p = self._free.popleft()
        self._refs[p] = 1
        self.peak = max(self.peak, self.used)
        return p

    def incref(self, page: int) -> None:
        if self._refs[page] < 1:
            raise RuntimeError(f"PageAllocator: page {page} is not allocated")
        self._refs[page] += 1

    def decref(self, page: int) -> None:
        r = self._refs[page] - 1
        if r < 0:
            raise RuntimeError(f"PageAllocator: page {page} freed twice")
        self._refs[page] = r
        if r == 0:
            self._free.append(page)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def reset_peak(self) -> None:
        self.peak = self.used


class PrefixCache:
    """Pages of full token blocks seen before, keyed by the whole prefix up to and including the
    block (a chain of ``(parent key, block tokens)``: exact, no hash collisions), and copies of whole
    prompts' last blocks (so a later sample of a prompt recomputes only its last token). The cache holds
    one reference to each page; an entry whose page nobody else holds can be evicted, least
    recently used first (a parent is kept more recent than its children, so a chain is evicted from
    its tail and a cached block is always reachable)."""

    def __init__(self, allocator: PageAllocator):
        self.alloc = allocator
        self._entries: "collections.OrderedDict[tuple, int]" = collections.OrderedDict()
        self.hits = 0  # blocks found
        self.hit_tokens = 0

    def __len__(self):
        return len(self._entries)

    def _keys(self, tokens, blocks):
        ps, key = self.alloc.page_size, None
        for i in range(blocks):
            key = (key, tuple(tokens[i * ps:(i + 1) * ps]))
            yield key

    def lookup(self, tokens, max_blocks: int) -> list:
        """Pages of the longest cached prefix of ``tokens`` (at most ``max_blocks`` blocks), each
        with a new reference for the caller."""
        pages, keys = [], []
        for key in self._keys(tokens, max_blocks):
            p = self._entries.get(key)
            if p is None:
                break
            pages.append(p)
            keys.append(key)
        for key in reversed(keys):  # parents end most recent: tails are evicted first
            self._entries.move_to_end(key)
        for p in pages:
            self.alloc.incref(p)
        self.hits += len(pages)
        self.hit_tokens += len(pages) * self.alloc.page_size
        return pages

    def insert(self, tokens, pages) -> None:
        """Remember the full blocks of ``tokens`` held in ``pages`` (a sequence's block table)."""
        blocks = min(len(tokens) // self.alloc.page_size, len(pages))
        keys = list(self._keys(tokens, blocks))
        for key, p in zip(keys, pages):
            if key not in self._entries:
                self._entries[key] = p
                self.alloc.incref(p)
        for key in reversed(keys):
            self._entries.move_to_end(key)

    def insert_tail(self, tokens, page: int) -> bool:
        """Remember ``page``, a copy of the page holding ``tokens``' last (partial or full) block, taking
        over the caller's reference; False (the reference stays the caller's) when it is already cached."""
        full = (len(tokens) - 1) // self.alloc.page_size
        key = self._tail_key(tokens, full)
        if key in self._entries:
            return False
        self._entries[key] = page
        return True

    def lookup_tail(self, tokens, full: int) -> Optional[int]:
        """The cached copy of ``tokens``' last block (after its ``full`` full blocks), or None. The page
        stays the cache's: the caller copies it (its own copy-on-write page)."""
        key = self._tail_key(tokens, full)
        p = self._entries.get(key)
        if p is not None:
            self._entries.move_to_end(key)
        return p

    def _tail_key(self, tokens, full):
        parent = None
        for parent in self._keys(tokens, full):
            pass
        return ("tail", parent, tuple(tokens[full * self.alloc.page_size:]))

    def evict_one(self) -> bool:
        """Free the least recently used page only the cache holds; False when there is none."""
        for key, p in self._entries.items():
            if self.alloc.refs(p) == 1:
                del self._entries[key]
                self.alloc.decref(p)
                return True
        return False

    def clear(self) -> None:
        for p in self._entries.values():
            self.alloc.decref(p)
        self._entries.clear()


class _PagedLayer(CacheLayerMixin):
    """One attention layer's page pool; ``update`` writes the new tokens, returns every row's pages."""

    is_compileable = True

    def __init__(self, keys, values, owner, sliding: bool, layer_idx: int):
        super().__init__()
        self.keys, self.values = keys, values  # (pages * page_size, kv_heads, head_dim)
        self.owner = owner
        self.is_sliding = sliding
        self.layer_idx = layer_idx
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Preallocated (allocated inside a compiled step the pools would become program outputs)."""

    def update(self, key_states, value_states, *args, **kwargs):
        B, H, T, E = key_states.shape
        if H != self.keys.shape[1] or E != self.keys.shape[2]:
            raise ValueError(f"PagedCache layer {self.layer_idx}: the model produced keys of shape "
                             f"{tuple(key_states.shape)}, the pool holds (slots, heads, head_dim) = "
                             f"{tuple(self.keys.shape)}")
        o = self.owner
        self.keys.index_copy_(0, o.write_index, key_states.transpose(1, 2).reshape(B * T, H, E).to(self.dtype))
        self.values.index_copy_(0, o.write_index, value_states.transpose(1, 2).reshape(B * T, H, E).to(self.dtype))
        S = o.read_index.shape[1]
        flat = o.read_index.reshape(-1)
        k = self.keys.index_select(0, flat).reshape(B, S, H, E).transpose(1, 2)
        v = self.values.index_select(0, flat).reshape(B, S, H, E).transpose(1, 2)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.read_index.shape[1], 0

    def get_seq_length(self):
        return 0  # positions and masks are always passed in; nothing is derived from the cache

    def get_max_length(self) -> int:
        return self.keys.shape[0]


class PagedCache(Cache):
    """Page pools of every attention layer of ``model``: ``num_pages`` pages (plus the scratch page)
    of ``page_size`` tokens, on ``device`` in ``dtype`` (default: the model's parameters').

    Before each forward, :meth:`set_indices` gives the flat slots the new tokens go to
    (``(rows * tokens,)``) and the slots each row reads (``(rows, pages bucket * page_size)``, in
    position order: read column ``j`` is the row's position ``j``)."""

    def __init__(self, model, num_pages: int, page_size: int, device=None, dtype=None):
        layer_types, kv_heads, head_dim = _kv_shape(model)
        ref = next(model.parameters())
        device = ref.device if device is None else torch.device(device)
        dtype = ref.dtype if dtype is None else dtype
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        shape = ((num_pages + 1) * page_size, kv_heads, head_dim)
        self.layer_types = layer_types
        self.write_index = torch.zeros(1, dtype=torch.int64, device=device)
        self.read_index = torch.zeros((1, page_size), dtype=torch.int64, device=device)
        self._pool_shape, self._dtype, self._device = shape, dtype, device
        layers = [_PagedLayer(torch.zeros(shape, dtype=dtype, device=device),
                              torch.zeros(shape, dtype=dtype, device=device), self,
                              kind == "sliding_attention", i)
                  for i, kind in enumerate(layer_types)]
        super().__init__(layers=layers)
        self.nbytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in self.layers)

    @property
    def allocated(self) -> bool:
        return self.layers[0].keys is not None

    def release(self) -> int:
        """Drop every layer's page pools (their device memory goes back to the allocator once nothing
        else holds them); returns the bytes dropped. :meth:`allocate` makes fresh (zeroed) ones."""
        if not self.allocated:
            return 0
        for layer in self.layers:
            layer.keys = layer.values = None
        return self.nbytes

    def allocate(self) -> None:
        """Fresh zeroed pools of the original shape, dtype and device (after :meth:`release`)."""
        if self.allocated:
            return
        for layer in self.layers:
            layer.keys = torch.zeros(self._pool_shape, dtype=self._dtype, device=self._device)
            layer.values = torch.zeros(self._pool_shape, dtype=self._dtype, device=self._device)

    def set_indices(self, write_index, read_index) -> None:
        self.write_index, self.read_index = write_index, read_index

    def page_slots(self, src, dst, pages: Optional[int] = None) -> torch.Tensor:
        """(2, pages * page_size) host int64: the slots of pages ``src`` (row 0) and ``dst`` (row 1), padded
        to ``pages`` pages with scratch -> scratch (a copy that changes nothing), for :func:`copy_slots`."""
        pages = len(src) if pages is None else pages
        if len(src) != len(dst) or len(src) > pages:
            raise ValueError(f"PagedCache.page_slots: {len(src)} sources, {len(dst)} destinations, {pages} pages")
        pad = [SCRATCH_PAGE] * (pages - len(src))
        ids = torch.tensor([list(src) + pad, list(dst) + pad], dtype=torch.int64)
        return (ids[:, :, None] * self.page_size + torch.arange(self.page_size)).reshape(2, -1)

    def copy_pages(self, src, dst) -> None:
        """Copy whole pages ``src`` -> ``dst`` (lists of page ids) in every layer: the copy-on-write of a
        shared partial page (eagerly; the engine runs :func:`copy_slots` as one program)."""
        if src:
            copy_slots(self, self.page_slots(src, dst).to(self.layers[0].keys.device))


def copy_slots(cache: PagedCache, slots) -> None:
    """Copy KV slot ``slots[0, i]`` to ``slots[1, i]`` in every layer of ``cache`` (all sources read before
    any destination is written; no slot may be both)."""
    for layer in cache.layers:
        layer.keys.index_copy_(0, slots[1], layer.keys.index_select(0, slots[0]))
        layer.values.index_copy_(0, slots[1], layer.values.index_select(0, slots[0]))
