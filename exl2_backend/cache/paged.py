"""Paged KV cache: fixed-size pages of K/V per layer, and a refcounted free-list allocator.

A sequence owns a list of pages (its block table); token t of the sequence lives in page
`block_table[t // S]` at offset `t % S`, i.e. cache slot `page * S + offset` (what `ops.kv_cache_write` takes).
"""

from __future__ import annotations

from collections import Counter

import torch

from exl2_backend.cache.kv_types import GROUP, get_cache_type
from exl2_backend.errors import CapacityError, Exl2Error


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16,
                       cache_type: str = "fp16") -> int:
    """Bytes of K+V cache one token occupies across all layers (codes and scales for quantized types; an
    fp16-type cache stores `dtype` elements, fp32 on CPU)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return get_cache_type(cache_type).bytes_per_token(num_layers, num_kv_heads, head_dim, elem)


class PagedKVCache:
    """K/V storage per layer. fp16 type: `k[layer]`, `v[layer]` each `[P, S, Hkv, D]` of `dtype`. Quantized types
    (fp8, q8, q6, q4): `k[layer]` / `v[layer]` hold uint8 codes `[P, S, Hkv, D * bits / 8]` and
    `k_scales[layer]` / `v_scales[layer]` fp16 `[P, S, Hkv, D / 32]` (ops/reference_kvquant.py)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu", cache_type: str = "fp16"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PagedKVCache needs num_pages >= 1 and page_size >= 1 (got {num_pages}, {page_size})")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.cache_type = get_cache_type(cache_type)
        self.cache_type.check_head_dim(head_dim)
        self.quantized = self.cache_type.quantized
        self.k_format = self.cache_type.k.name  # "fp16" | "e4m3" | "int8" | "int4"
        self.v_format = self.cache_type.v.name
        if not self.quantized:
            shape = (num_pages, page_size, num_kv_heads, head_dim)
            self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.k_scales = self.v_scales = None
            return
        rows = (num_pages, page_size, num_kv_heads)
        kb, vb = self.cache_type.k.code_bytes(head_dim), self.cache_type.v.code_bytes(head_dim)
        sshape = (*rows, head_dim // GROUP)
        self.k = [torch.zeros((*rows, kb), dtype=torch.uint8, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros((*rows, vb), dtype=torch.uint8, device=self.device) for _ in range(num_layers)]
        self.k_scales = [torch.zeros(sshape, dtype=torch.float16, device=self.device) for _ in range(num_layers)]
        self.v_scales = [torch.zeros(sshape, dtype=torch.float16, device=self.device) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.cache_type.name)

    def total_bytes(self) -> int:
        return self.bytes_per_token() * self.num_tokens

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (all `[P, S, ...]`), e.g. for page copies."""
        out = self.k + self.v
        if self.quantized:
            out += self.k_scales + self.v_scales
        return out

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy the contents (codes and scales alike) of pages `src` into pages `dst`, every layer."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} source pages but {len(dst)} destinations")
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for t in self.tensors():
            t.index_copy_(0, d, t.index_select(0, s))


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
