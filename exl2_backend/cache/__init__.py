"""Paged KV cache storage and the page allocator (architecture decision 5)."""

from exl2_backend.cache.paged import PageAllocator, PagedKVCache, kv_bytes_per_token  # noqa: F401
