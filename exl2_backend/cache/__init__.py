"""Paged KV cache storage and the page allocator (architecture decision 5); cache storage types (kv_types).

The torch-based names load on first use, so `exl2_backend.cache.kv_types` (cache type facts for the CLI and
settings) imports without torch."""

__all__ = ["PageAllocator", "PagedKVCache", "kv_bytes_per_token"]
_LAZY = frozenset(__all__)


def __getattr__(name: str):
    if name in _LAZY:
        from exl2_backend.cache import paged

        return getattr(paged, name)
    raise AttributeError(f"module 'exl2_backend.cache' has no attribute {name!r}")

