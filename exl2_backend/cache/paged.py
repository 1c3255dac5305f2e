"""Paged KV cache: fixed-size pages of K/V per layer, and a refcounted free-list allocator.

A sequence owns a list of pages (its block table); token t of the sequence lives in page
`block_table[t // S]` at offset `t % S`, i.e. cache slot `page * S + offset` (what `ops.kv_cache_write` takes).
"""

from __future__ import annotations

from collections import Counter

import torch

from exl2_backend.errors import CapacityError, Exl2Error


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K+V cache one token occupies across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * elem


class PagedKVCache:
    """K/V storage: `k[layer]`, `v[layer]` each `[P, S, Hkv, D]`."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PagedKVCache needs num_pages >= 1 and page_size >= 1 (got {num_pages}, {page_size})")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def total_bytes(self) -> int:
        return self.bytes_per_token() * self.num_tokens


class PageAllocator:
    """Free list of page ids with refcounts (refcount > 1 once prefix caching shares pages)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests and dumps readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1 each). Raises CapacityError, taking nothing, when fewer are free."""
        if n < 0:
            raise ValueError(f"allocate(n) needs n >= 0, got {n}")
        if n > len(self._free):
            raise CapacityError(f"KV cache full: {n} pages requested, {len(self._free)} of {self.num_pages} free; "
                                "retry after other sequences finish, or load with a larger cache_tokens")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one reference to pages already allocated (prefix sharing)."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise Exl2Error(f"page {p} is not allocated and cannot be shared")
        for p in pages:
            self._refcount[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference of each page; a page returns to the free list at refcount 0.

        A page freed more often than it was allocated raises (a double free is an engine bug)."""
        for p, n in Counter(pages).items():
            if not 0 <= p < self.num_pages or self._refcount[p] < n:
                raise Exl2Error(f"double free of KV page {p} (not allocated, or freed more often than held)")
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refcount[page]
