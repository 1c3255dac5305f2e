"""kv_cache_write and paged_attention against SDPA on contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from exl2_backend import ops
from exl2_backend.ops import reference
from tests.helpers.tolerances import assert_close, assert_close_rel, assert_exact


def build_paged(lens, hkv, d, page, dtype, seed, spare_pages=7):
    """Random K/V per sequence written through kv_cache_write into randomly assigned, non-contiguous pages.
    Returns (k_cache, v_cache, block_tables, context_lens, [(k [L, Hkv, D], v)])."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    num_pages = sum(need) + spare_pages
    k_cache = torch.full((num_pages, page, hkv, d), float("nan"), dtype=dtype)  # NaN: reading junk shows up
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(need) + 2
    tables = torch.full((len(lens), max_pages), -1, dtype=torch.int32)  # unused entries: garbage
    tables[:, -1] = 10**6
    kv = []
    for b, n in enumerate(lens):
        pages = [order.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(n, hkv, d, generator=g).to(dtype)
        v = torch.randn(n, hkv, d, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = torch.tensor(pages, dtype=torch.int64)[pos // page] * page + pos % page
        cut = torch.randint(0, n + 1, (1,), generator=g).item()  # write in two chunks, like prefill + decode
        ops.kv_cache_write(k[:cut], v[:cut], k_cache, v_cache, slots[:cut])
        ops.kv_cache_write(k[cut:], v[cut:], k_cache, v_cache, slots[cut:])
        kv.append((k, v))
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), kv


def sdpa_reference(q, kv, lens, scale, dtype):
    """Per sequence SDPA in `dtype` with K/V expanded for GQA and the absolute-position causal mask."""
    _bsz, tq, hq, _d = q.shape
    out = []
    for b, (k, v) in enumerate(kv):
        n, grp = lens[b], hq // k.shape[1]
        kk = k.to(dtype).repeat_interleave(grp, dim=1).transpose(0, 1)[None]  # [1, Hq, n, D]
        vv = v.to(dtype).repeat_interleave(grp, dim=1).transpose(0, 1)[None]
        qq = q[b].to(dtype).transpose(0, 1)[None]  # [1, Hq, Tq, D]
        mask = torch.arange(n)[None, :] <= (torch.arange(tq) + n - tq)[:, None]  # [Tq, n]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
        out.append(o[0].transpose(0, 1))  # [Tq, Hq, D]
    return torch.stack(out)


CASES = [  # (lens, tq, hq, hkv, d)
    ((1, 15, 16), 1, 9, 3, 64),
    ((17, 100, 1), 1, 32, 8, 128),
    ((15, 16, 17), 5, 9, 3, 128),
    ((100, 5, 33), 5, 32, 8, 64),
    ((16,), 16, 4, 4, 64),  # whole-prompt prefill, MHA
]


@torch.inference_mode()
@pytest.mark.parametrize("lens,tq,hq,hkv,d", CASES)
def test_paged_attention_matches_sdpa_fp32(lens, tq, hq, hkv, d):
    k_cache, v_cache, tables, ctx, kv = build_paged(lens, hkv, d, 16, torch.float32, seed=sum(lens) + tq)
    q = torch.randn(len(lens), tq, hq, d)
    scale = 1 / math.sqrt(d)
    got = ops.paged_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert_close(got, sdpa_reference(q, kv, lens, scale, torch.float64), dtype=torch.float32)


@torch.inference_mode()
@pytest.mark.parametrize("lens,tq,hq,hkv,d", CASES[1:4])
def test_paged_attention_fp16_error_bound(lens, tq, hq, hkv, d):
    k_cache, v_cache, tables, ctx, kv = build_paged(lens, hkv, d, 16, torch.float16, seed=7)
    q = torch.randn(len(lens), tq, hq, d).half()
    got = reference.paged_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    assert got.dtype == torch.float16
    ref = sdpa_reference(q, kv, lens, 0.1, torch.float32)
    same = sdpa_reference(q, kv, lens, 0.1, torch.float16)
    assert_close_rel(got, ref, same)


@torch.inference_mode()
def test_paged_attention_scale_and_page_size():
    lens = (3, 10)
    k_cache, v_cache, tables, ctx, kv = build_paged(lens, 2, 64, 4, torch.float32, seed=3)  # page size 4
    q = torch.randn(2, 2, 6, 64)
    got = reference.paged_attention(q, k_cache, v_cache, tables, ctx, 0.37)
    assert_close(got, sdpa_reference(q, kv, lens, 0.37, torch.float64), dtype=torch.float32)


@torch.inference_mode()
def test_query_without_visible_keys_is_zero():
    k_cache, v_cache, tables, ctx, kv = build_paged((2,), 1, 64, 16, torch.float32, seed=4)
    q = torch.randn(1, 3, 2, 64)  # query 0 sits at position -1
    got = reference.paged_attention(q, k_cache, v_cache, tables, ctx, 0.125)
    assert (got[0, 0] == 0).all()
    assert_close(got[:, 1:], sdpa_reference(q[:, 1:], kv, (2,), 0.125, torch.float64), dtype=torch.float32)


def test_kv_cache_write_scatter():
    p, s, hkv, d = 5, 4, 2, 8
    k_cache, v_cache = torch.zeros(p, s, hkv, d).half(), torch.zeros(p, s, hkv, d).half()
    slots = torch.tensor([13, 0, 7, 19, -1], dtype=torch.int64)  # -1: padding token, skipped
    k, v = torch.randn(5, hkv, d).half(), torch.randn(5, hkv, d).half()
    reference.kv_cache_write(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // s, slot % s], want_v[slot // s, slot % s] = k[t], v[t]
    assert_exact(k_cache, want_k)
    assert_exact(v_cache, want_v)
    # fp32 input into an fp16 cache is cast
    reference.kv_cache_write(k.float()[:1], v.float()[:1], k_cache, v_cache, slots[:1])
    assert_exact(k_cache[3, 1], k[0])
