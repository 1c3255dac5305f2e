"""PageAllocator bookkeeping and PagedKVCache shapes/sizes."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.cache import PageAllocator, PagedKVCache, kv_bytes_per_token
from exl2_backend.errors import CapacityError, Exl2Error


def test_allocate_free_roundtrip():
    a = PageAllocator(8)
    assert a.num_free == 8
    p1 = a.allocate(3)
    p2 = a.allocate(5)
    assert a.num_free == 0
    assert sorted(p1 + p2) == list(range(8))  # distinct pages, all handed out
    assert p1 == [0, 1, 2]  # low ids first
    a.free(p1)
    assert a.num_free == 3
    assert sorted(a.allocate(3)) == [0, 1, 2]
    a.free(list(range(8)))
    assert a.num_free == 8


def test_allocate_short_raises_and_takes_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(CapacityError, match="1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1
    assert a.allocate(0) == []


def test_double_free_detected():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(Exl2Error, match="double free"):
        a.free(pages[:1])
    with pytest.raises(Exl2Error, match="double free"):
        a.free([3])  # never allocated
    p = a.allocate(1)
    with pytest.raises(Exl2Error, match="double free"):
        a.free(p + p)  # twice in one call
    assert a.refcount(p[0]) == 1  # the failed call changed nothing


def test_refcount_sharing():
    a = PageAllocator(2)
    p = a.allocate(1)
    a.share(p)
    assert a.refcount(p[0]) == 2
    a.free(p)
    assert a.num_free == 1  # still held once
    a.free(p)
    assert a.num_free == 2
    with pytest.raises(Exl2Error):
        a.share(p)


def test_cache_shapes_and_bytes():
    c = PagedKVCache(num_layers=3, num_pages=5, page_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert len(c.k) == len(c.v) == 3
    assert c.k[0].shape == (5, 16, 2, 8) and c.k[0].dtype == torch.float16
    assert c.num_tokens == 80
    assert c.bytes_per_token() == 2 * 3 * 2 * 8 * 2 == kv_bytes_per_token(3, 2, 8, torch.float16)
    assert c.total_bytes() == sum(t.numel() * t.element_size() for t in c.k + c.v)
    with pytest.raises(ValueError):
        PagedKVCache(1, 0, 16, 1, 8)
