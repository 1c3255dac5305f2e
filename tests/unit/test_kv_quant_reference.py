"""Reference codecs of the quantized KV cache (ops/reference_kvquant.py): exact codes where the format defines
them, round-trip error bounds per format, packing, rotation, edge values, and bytes per token per cache type.

Bounds (per 32-element group, s = the stored fp16 scale):
  int8: every rotated element is rounded to the nearest multiple of s (no clamping can occur, since
  s >= absmax / qmax up to fp16 rounding), so the group's L2 error is <= sqrt(32) * s / 2 (the rotation is
  orthonormal), plus fp32 rounding. int4 searches its scale among absmax / (7, 7.5, ..., 10) for the smallest
  error, so its error is at most that bound for s = absmax / 7.
  e4m3: |x - x'| <= 2^-4 |x| (3 mantissa bits, round to nearest) or <= 2^-10 s in the subnormal range.
"""

from __future__ import annotations

import math

import pytest
import torch

from exl2_backend.cache import PagedKVCache, kv_bytes_per_token
from exl2_backend.cache.budget import cache_type_table
from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES, FORMATS, KVFormat, get_cache_type
from exl2_backend.errors import ConfigError
from exl2_backend.ops import reference
from exl2_backend.ops import reference_kvquant as R
from tests.helpers.tolerances import assert_exact

FMTS = ("e4m3", "int8", "int4")


def kv_like(shape, seed=0, outliers=True) -> torch.Tensor:
    """Gaussian values with a few large channels, like post-RoPE keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:
        x[..., 3] *= 12
        x[..., 70 % shape[-1]] *= 6
    return x


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def test_fwht32_is_the_normalized_sylvester_hadamard_and_self_inverse():
    eye = torch.eye(64)
    h = R.fwht32(eye)  # rows: transforms of unit vectors, block-diagonal with two 32x32 blocks
    want = torch.block_diag(sylvester(32), sylvester(32)) / math.sqrt(32)
    torch.testing.assert_close(h, want, atol=1e-7, rtol=0)
    x = kv_like((100, 128))
    torch.testing.assert_close(R.fwht32(R.fwht32(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(R.fwht32(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_codes_exact(fmt):
    """Rows built as rotate(codes * s) quantize back to exactly those codes and that scale."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(1)
    c = torch.randint(-f.qmax, f.qmax + 1, (50, 3, 4, 32), generator=g)  # [T, H, G, 32]
    c[..., 0] = f.qmax  # absmax = qmax * s in every group
    s = 0.25
    x = R.fwht32((c.float() * s).reshape(50, 3, 128))
    codes, scales = R.quantize(x, fmt)
    assert_exact(scales, torch.full((50, 3, 4), s, dtype=torch.float16), "scales")
    want = (c + f.qmax + 1).to(torch.uint8).reshape(50, 3, 128)
    assert_exact(R.unpack_codes(codes, fmt), want, "codes")
    torch.testing.assert_close(R.dequantize(codes, scales, fmt), x, atol=1e-5, rtol=0)


def test_int4_packing_order():
    """Byte j holds element 2j in its low nibble and 2j + 1 in its high nibble (rotated order)."""
    c = torch.tensor([7, -7, 1, 0] + [0] * 28)  # codes in the rotated domain, s = 1
    x = R.fwht32(c.float()[None])
    codes, scales = R.quantize(x, "int4")
    assert scales.item() == 1.0
    assert codes[0, :2].tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | ((0 + 8) << 4)]
    assert codes.shape == (1, 16)


def test_e4m3_codes_are_the_torch_cast_of_the_scaled_group():
    x = kv_like((40, 2, 64), seed=2)
    codes, scales = R.quantize(x, "e4m3")
    g = x.reshape(40, 2, 2, 32)
    amax = g.abs().amax(-1)
    want_scales = (amax / 448).half()
    assert_exact(scales, want_scales, "scales")
    want = (g / want_scales.float()[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert_exact(codes, want.reshape(40, 2, 64), "codes")
    assert FORMATS["e4m3"].rotated is False


@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_bounds(fmt):
    x = kv_like((300, 4, 128), seed=3)
    codes, scales = R.quantize(x, fmt)
    y = R.dequantize(codes, scales, fmt)
    s = scales.float()[..., None]  # [T, H, G, 1]
    err = (y - x).reshape(300, 4, 4, 32)
    if fmt == "e4m3":
        bound = torch.maximum(x.reshape(300, 4, 4, 32).abs() * 2**-4, s * 2**-10) * (1 + 1e-5) + 1e-6
        assert bool((err.abs() <= bound).all()), float((err.abs() - bound).max())
    else:
        if fmt == "int4":  # the bound of the first candidate, absmax / 7
            s = (R.fwht32(x).reshape(300, 4, 4, 32).abs().amax(-1, keepdim=True) / 7).half().float()
        bound = math.sqrt(32) * s[..., 0] / 2 * (1 + 1e-4) + 1e-5
        assert bool((err.norm(dim=-1) <= bound).all()), float((err.norm(dim=-1) - bound).max())


def test_int4_scale_search_never_loses_and_gains_overall():
    """The chosen divisor's group error is <= that of absmax / 7 (ties keep 7), and clearly lower in total."""
    x = kv_like((400, 4, 128), seed=9)
    plain = KVFormat("int4", 4, 3, 7, True)  # single divisor 7
    y = R.fwht32(x).reshape(400, 4, 4, 32)

    def group_err(fmt):
        out = R.fwht32(R.dequantize(*R.quantize(x, fmt), fmt)).reshape(400, 4, 4, 32)  # rotated domain
        return (out - y).pow(2).sum(-1)

    searched, single = group_err("int4"), group_err(plain)
    assert bool((searched <= single * (1 + 1e-4) + 1e-10).all())
    assert float(searched.sum()) < 0.9 * float(single.sum())
    _, scales = R.quantize(x, "int4")
    amax = y.abs().amax(-1)
    ratios = {round(float(r), 1) for r in (amax / scales.float()).flatten()[:2000]}
    assert len(ratios) > 3  # several divisors are in use


def test_relative_error_ordering():
    """On Gaussian rows with outlier channels: int8 < e4m3 < int4, each within its budget."""
    x = kv_like((500, 8, 128), seed=4)
    rel = {}
    for fmt in FMTS:
        y = R.dequantize(*R.quantize(x, fmt), fmt)
        rel[fmt] = float((y - x).norm() / x.norm())
    assert rel["int8"] < 0.006 and rel["e4m3"] < 0.03 and rel["int4"] < 0.12, rel
    assert rel["int8"] < rel["e4m3"] < rel["int4"], rel


def test_rotation_helps_int4_with_outliers():
    """The Hadamard rotation is what makes 4 bits work on rows with an outlier channel."""
    x = kv_like((500, 8, 128), seed=5)
    plain = KVFormat("int4", 4, 3, 7, False)
    err_rot = (R.dequantize(*R.quantize(x, "int4"), "int4") - x).norm()
    err_plain = (R.dequantize(*R.quantize(x, plain), plain) - x).norm()
    assert err_rot < 0.8 * err_plain, (float(err_rot), float(err_plain))


@pytest.mark.parametrize("fmt", FMTS)
def test_zero_and_extreme_groups(fmt):
    x = torch.zeros(3, 64)
    x[1, 32:] = 1e8  # fp32 inputs beyond fp16: the scale saturates at 65504, values clamp, nothing is NaN
    x[2, :32] = 1e-9  # scale underflows to 0: stored as zeros
    codes, scales = R.quantize(x, fmt)
    y = R.dequantize(codes, scales, fmt)
    assert bool(torch.isfinite(y).all())
    assert scales[0].tolist() == [0.0, 0.0] and scales[2, 0].item() == 0.0
    assert bool((y[0] == 0).all()) and bool((y[2, :32] == 0).all())
    assert scales[1, 1].item() == 65504.0
    zero_code = 0 if fmt == "e4m3" else FORMATS[fmt].qmax + 1
    assert bool((R.unpack_codes(codes, fmt)[0] == zero_code).all())


def test_quantize_accepts_fp16_input_like_fp32():
    x = kv_like((20, 2, 64), seed=6).half()
    for fmt in FMTS:
        a = R.quantize(x, fmt)
        b = R.quantize(x.float(), fmt)
        assert_exact(a[0], b[0], fmt)
        assert_exact(a[1], b[1], fmt)


def _cache_and_writes(ct: str, lens=(5, 37), page=16, hkv=2, d=64, seed=7):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 8, page, hkv, d, torch.float32, "cpu", ct)
    tables = torch.tensor([[6, 2, 0, 0], [1, 7, 4, 3]], dtype=torch.int32)
    kv = []
    for b, n in enumerate(lens):
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        pos = torch.arange(n)
        slots = tables[b].long()[pos // page] * page + pos % page
        R.kv_quant_write(k, v, cache.k[0], cache.k_scales[0], cache.v[0], cache.v_scales[0], slots,
                         cache.k_format, cache.v_format)
        kv.append((k, v))
    return cache, tables, torch.tensor(lens, dtype=torch.int32), kv


def test_kv_quant_write_places_codes_at_slots_and_skips_negative_slots():
    cache, _tables, _lens, kv = _cache_and_writes("q6")
    k, v = kv[1]
    kc, ks = R.quantize(k[20], "int8")  # sequence 1, position 20: page tables[1][1] = 7, offset 4
    assert_exact(cache.k[0][7, 4], kc, "k codes")
    assert_exact(cache.k_scales[0][7, 4], ks, "k scales")
    vc, vs = R.quantize(v[20], "int4")
    assert_exact(cache.v[0][7, 4], vc, "v codes")
    assert_exact(cache.v_scales[0][7, 4], vs, "v scales")
    before = [t.clone() for t in cache.tensors()]
    x = torch.randn(2, 2, 64)
    R.kv_quant_write(x, x, cache.k[0], cache.k_scales[0], cache.v[0], cache.v_scales[0], torch.tensor([-1, -5]),
                     "int8", "int4")
    for a, b in zip(before, cache.tensors()):
        assert_exact(a, b, "negative slots write nothing")


@pytest.mark.parametrize("ct,tol", [("fp8", 0.05), ("q8", 0.015), ("q6", 0.15), ("q4", 0.2)])
def test_attention_over_quantized_pages_is_close_to_exact_attention(ct, tol):
    """Relative error of attention over each cache type vs fp32 attention over the unquantized K/V."""
    cache, tables, lens, kv = _cache_and_writes(ct)
    q = torch.randn(2, 3, 4, 64)
    out = R.paged_attention_quant(q, cache.k[0], cache.k_scales[0], cache.v[0], cache.v_scales[0], tables, lens,
                                  0.125, cache.k_format, cache.v_format)
    exact = PagedKVCache(1, 8, 16, 2, 64, torch.float32, "cpu", "fp16")
    for b, (k, v) in enumerate(kv):
        pos = torch.arange(k.shape[0])
        slots = tables[b].long()[pos // 16] * 16 + pos % 16
        reference.kv_cache_write(k, v, exact.k[0], exact.v[0], slots)
    want = reference.paged_attention(q, exact.k[0], exact.v[0], tables, lens, 0.125)
    rel = float((out - want).norm() / want.norm())
    assert rel < tol, rel


def test_rope_kv_quant_write_equals_the_ops_apart():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(6, h, 64, generator=g) for h in (4, 2, 2))
    pos = torch.tensor([0, 1, 2, 50, 51, 300])
    inv = reference.rope_inv_freq(64, 10000.0)
    slots = torch.arange(6) + 3
    a = PagedKVCache(1, 2, 16, 2, 64, torch.float32, "cpu", "q4")
    b = PagedKVCache(1, 2, 16, 2, 64, torch.float32, "cpu", "q4")
    q1 = q.clone()
    R.rope_kv_quant_write(q1, k, v, pos, inv, a.k[0], a.k_scales[0], a.v[0], a.v_scales[0], slots, "int4", "int4")
    assert_exact(q1, reference.apply_rope(q, pos, inv), "q rotated in place")
    R.kv_quant_write(reference.apply_rope(k, pos, inv), v, b.k[0], b.k_scales[0], b.v[0], b.v_scales[0], slots,
                     "int4", "int4")
    for x, y in zip(a.tensors(), b.tensors()):
        assert_exact(x, y, "cache")


def test_gather_dequantized_reads_only_the_pages_in_use():
    cache, tables, lens, _ = _cache_and_writes("q8")
    tables = tables.clone()
    tables[0, 1:] = -1  # sequence 0 (5 tokens) uses only its first page; garbage past it is never touched
    k, _v, remap = R.gather_dequantized(cache.k[0], cache.k_scales[0], cache.v[0], cache.v_scales[0], tables, lens,
                                       "int8", "int8")
    assert k.shape[0] == 4  # pages 6 | 1, 7, 4 (sequence 1 has 37 tokens: 3 pages)
    for b, n in enumerate(lens.tolist()):
        for i in range(-(-n // 16)):
            page = int(tables[b, i])
            want = R.dequantize(cache.k[0][page], cache.k_scales[0][page], "int8")
            assert_exact(k[int(remap[b, i])], want, f"page {page}")


def test_paged_cache_types_shapes_bytes_and_page_copy():
    for name in CACHE_TYPE_NAMES:
        ct = get_cache_type(name)
        c = PagedKVCache(2, 4, 16, 2, 64, torch.float16, "cpu", name)
        assert c.quantized == ct.quantized
        assert c.bytes_per_token() == kv_bytes_per_token(2, 2, 64, torch.float16, name)
        stored = sum(t[0, 0].numel() * t.element_size() for t in c.tensors())  # one slot of every tensor
        assert stored == c.bytes_per_token()
    c = PagedKVCache(1, 4, 16, 2, 64, torch.float16, "cpu", "q4")
    for t in c.tensors():
        t[1].copy_(torch.arange(t[1].numel()).reshape(t[1].shape).to(t.dtype))
    c.copy_pages([1], [3])
    for t in c.tensors():
        assert_exact(t[3], t[1], "copied page")
    with pytest.raises(ConfigError, match="multiple of 32"):
        PagedKVCache(1, 4, 16, 2, 48, torch.float16, "cpu", "q8")
    with pytest.raises(ConfigError, match="cache_type must be one of"):
        get_cache_type("q3")


def test_bytes_per_token_targets_llama3_8b():
    """32 layers, 8 KV heads of 128: fp16 128 KiB/token; 8-bit types 53%, q6 41%, q4 28% (scales included)."""
    rows = {r["cache_type"]: r for r in cache_type_table(32, 8, 128, weights_bytes=5 << 30, vram_bytes=24 << 30,
                                                          reserve_bytes=1 << 30)}
    assert rows["fp16"]["bytes_per_token"] == 131072
    assert rows["q8"]["ratio_vs_fp16"] == rows["fp8"]["ratio_vs_fp16"] == 8.5 / 16
    assert rows["q6"]["ratio_vs_fp16"] == 6.5 / 16
    assert rows["q4"]["ratio_vs_fp16"] == 4.5 / 16
    assert rows["fp16"]["max_context"] == (18 << 30) // 131072
    assert rows["q4"]["max_context"] == (18 << 30) // 36864


def test_settings_accept_every_cache_type():
    from exl2_backend.runtime import LoadSettings

    for name in CACHE_TYPE_NAMES:
        assert LoadSettings(cache_type=name.upper()).cache_type == name
    with pytest.raises(ValueError, match="cache_type must be one of"):
        LoadSettings(cache_type="int3")


def test_dequantized_pages_view_selects_pages_through_the_dispatch():
    """ops/attention_prefill_quant.DequantizedPages (the prefill path's stand-in for an fp16 cache) dequantizes
    exactly the selected pages, in order, through dispatch.dequantize_pages (the reference on the CPU)."""
    from exl2_backend.ops import dispatch
    from exl2_backend.ops.attention_prefill_quant import DequantizedPages

    g = torch.Generator().manual_seed(7)
    codes, scales = R.quantize(torch.randn(5, 16, 2, 64, generator=g), "int4")  # [P, S, Hkv, 32], [P, S, Hkv, 2]
    pages = torch.tensor([4, 0, 4, 2])
    want = R.dequantize(codes, scales, "int4")[pages].half()
    assert_exact(dispatch.dequantize_pages(codes, scales, pages, "int4", torch.float16), want, "dispatch")
    view = DequantizedPages(codes, scales, "int4", torch.float16)
    assert view.shape == (5, 16, 2, 64)
    assert_exact(view.index_select(0, pages), want, "view")
    with pytest.raises(ValueError, match="dim 0"):
        view.index_select(1, pages)
