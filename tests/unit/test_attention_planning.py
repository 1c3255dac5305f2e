"""The decode attention's launch planning on the host (ops/cuda_layers.py, ops/cuda_kvquant.py): row tiles and
their cap, the flags word, the automatic context split and the CTAs per SM it aims at by cache format. Plain
Python: runs without a GPU."""

from __future__ import annotations

import math
import os

import pytest
import torch

from exl2_backend.ops import cuda_kvquant, cuda_layers


@pytest.mark.parametrize("rows,natural", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (128, 16)])
@pytest.mark.parametrize("cap", [4, 8, 16])
def test_row_tile_is_the_natural_tile_up_to_the_cap(monkeypatch, rows, natural, cap):
    monkeypatch.setattr(cuda_layers, "ATTN_MAX_ROW_TILE", cap)
    assert cuda_layers._attn_row_tile(rows) == min(natural, cap)
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", None)
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", 0)  # the CUDA-core kernel for one row: no bits 3-4
    assert cuda_layers._attn_flags() == cuda_layers._ATTN_FLAGS | {16: 0, 8: 2, 4: 4}[cap]


@pytest.mark.parametrize("setting,rows,mma", [(None, 4, False), (None, 12, False), (None, 16, True), (None, 36, True),
                                              (True, 4, True), (False, 36, False)])
def test_fp16_pages_take_the_tensor_core_kernel_from_16_rows(monkeypatch, setting, rows, mma):
    """Decode (4 rows per kv head at GQA 4) stays on the CUDA-core kernel, verify steps of k >= 3 take the
    tensor-core one (flags bits 3-4), unless EXL2_BACKEND_ATTN_FP16_MMA forces either."""
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", setting)
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", 0)
    assert (cuda_layers._attn_flags(rows) >> 3 & 3) == (1 if mma else 0)


@pytest.mark.parametrize("online,code,ctas", [(0, 1, 4), (1, 2, 3), (2, 3, 2)])
def test_one_pass_variants_have_their_codes_and_cta_targets(monkeypatch, online, code, ctas):
    monkeypatch.setattr(cuda_layers, "ATTN_STAGED", "0")  # the register kernels' targets
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", online)
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", True)
    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", True)
    monkeypatch.setattr(cuda_kvquant, "_ATTN_CTAS_ENV", None)
    assert cuda_layers.attn_mma_variant_code() == code
    assert (cuda_layers._attn_flags(4) >> 3 & 3) == code
    assert cuda_kvquant.quant_attention_ctas("int8", "int8") == ctas


@pytest.mark.parametrize("pair,code,ctas", [
    (("int8", "int8"), 3, 2), (("int4", "int4"), 2, 3), (("e4m3", "e4m3"), 3, 2), (("int8", "int4"), 3, 2),
    (("int4", "int8"), 1, 4)])
def test_each_cache_format_takes_its_measured_variant_by_default(monkeypatch, pair, code, ctas):
    """ATTN_MMA_ONLINE "auto": one pass with two key steps for fp16, fp8, q8 and q6 pages, one step for q4; a pair
    no cache type uses keeps the two-pass kernel. (CTA targets of the register kernels: code pages run the staged
    kernel by default, test_staged_kernel_splits_aim_at_its_measured_ctas.)"""
    monkeypatch.setattr(cuda_layers, "ATTN_STAGED", "0")
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", None)
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", None)
    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", True)
    monkeypatch.setattr(cuda_kvquant, "_ATTN_CTAS_ENV", None)
    assert cuda_layers.attn_mma_variant_code(*pair) == code
    assert cuda_kvquant.quant_attention_ctas(*pair) == ctas
    assert (cuda_layers._attn_flags(4) >> 3 & 3) == 3  # fp16 pages: one pass, two steps, from a decode's 4 rows


@pytest.mark.parametrize("ctx", [64, 1024, 4096, 32768, 131072])
@pytest.mark.parametrize("tq,hq,hkv", [(1, 32, 8), (5, 32, 8), (32, 32, 8), (1, 9, 3)])
@pytest.mark.parametrize("ctas", [4, 6])
def test_splits_cover_the_context_within_the_tile_limit(ctx, tq, hq, hkv, ctas):
    """Enough splits that no split holds more keys than the tile's shared memory takes; no more than the
    CTA target asks for, nor splits shorter than the minimum."""
    sms = 132
    n = cuda_layers.attention_splits(1, tq, hq, hkv, ctx, sms, ctas)
    rt = cuda_layers._attn_row_tile((hq // hkv) * tq)
    need = math.ceil(ctx / cuda_layers._attn_keys_max(rt))
    assert n >= need
    tiles = hkv * math.ceil((hq // hkv) * tq / rt)
    assert n == need or n <= max(1, sms * ctas // tiles, math.ceil(ctx / cuda_layers._ATTN_MIN_SPLIT))
    assert n == need or n == 1 or n * tiles <= sms * ctas  # never past one wave unless the tile limit asks


@pytest.mark.parametrize("ctas,splits", [(3, 49), (4, 66), (6, 99), (8, 132)])
def test_splits_fill_exactly_one_wave_at_32k(ctas, splits):
    """8B decode shape (8 kv heads, one tile each) on 132 SMs: the most splits whose CTAs fit one wave."""
    assert cuda_layers.attention_splits(1, 1, 32, 8, 32768, 132, ctas) == splits


def test_8bit_cache_formats_aim_at_more_ctas_per_sm_in_the_cuda_core_kernel(monkeypatch):
    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", False)
    assert cuda_kvquant.quant_attention_ctas("int8", "int8") == cuda_layers.ATTN_CTAS_PER_SM_8BIT
    assert cuda_kvquant.quant_attention_ctas("e4m3", "e4m3") == cuda_layers.ATTN_CTAS_PER_SM_8BIT
    assert cuda_kvquant.quant_attention_ctas("int8", "int4") == cuda_layers.ATTN_CTAS_PER_SM_8BIT  # q6
    assert cuda_kvquant.quant_attention_ctas("int4", "int4") == cuda_layers._ATTN_CTAS_PER_SM
    q8 = cuda_layers.attention_splits(1, 1, 32, 8, 32768, 132, cuda_kvquant.quant_attention_ctas("int8", "int8"))
    q4 = cuda_layers.attention_splits(1, 1, 32, 8, 32768, 132, cuda_kvquant.quant_attention_ctas("int4", "int4"))
    assert (q8, q4) == (99, 66)  # one full wave of 6 / 4 CTAs per SM on 132 SMs (8 kv heads)


def test_tensor_core_kernel_aims_at_four_ctas_per_sm_for_every_format(monkeypatch):
    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", True)
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", 0)
    for pair in (("int8", "int8"), ("e4m3", "e4m3"), ("int8", "int4"), ("int4", "int4")):
        assert cuda_kvquant.quant_attention_ctas(*pair) == cuda_layers._ATTN_CTAS_PER_SM
    ctas = cuda_kvquant.quant_attention_ctas("int8", "int8")
    assert cuda_layers.attention_splits(1, 1, 32, 8, 32768, 132, ctas) == 66


@pytest.mark.parametrize("mode", ["auto", "0", "2", "3"])
def test_staged_kernel_splits_aim_at_its_measured_ctas(monkeypatch, mode):
    """EXL2_ATTN_STAGED (cuda_layers.ATTN_STAGED, mirroring the C library's staged_stages): "auto" stages code
    pages only, "0" nothing, "2" / "3" every one-pass launch. Staged launches' splits aim at ATTN_STAGED_CTAS_PER_SM
    (fp16 pages 2, codes 3, as AD1 measured them best) instead of 4 - variant (codes) and 4 (fp16 pages); the
    two-pass kernel and an explicit EXL2_BACKEND_ATTN_CTAS_PER_SM keep theirs."""
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", None)
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", None)
    monkeypatch.setattr(cuda_layers, "ATTN_STAGED", mode)
    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", True)
    monkeypatch.setattr(cuda_kvquant, "_ATTN_CTAS_ENV", None)
    monkeypatch.setattr(cuda_layers, "_ATTN_CTAS_ENV", None)
    monkeypatch.setattr(cuda_layers, "_num_sms", lambda index: 132)
    staged = mode in ("2", "3")  # fp16 pages
    codes_staged = mode != "0"
    assert cuda_layers.attn_staged() is staged
    for pair in (("int8", "int8"), ("e4m3", "e4m3"), ("int8", "int4"), ("int4", "int4")):
        assert cuda_layers.attn_staged(*pair) is codes_staged
    assert cuda_layers.attn_staged("int4", "int8") is False  # no cache type: the two-pass kernel
    assert cuda_kvquant.quant_attention_ctas("int8", "int8") == (3 if codes_staged else 2)
    assert cuda_kvquant.quant_attention_ctas("int4", "int4") == 3
    assert cuda_kvquant.quant_attention_ctas("int4", "int8") == 4
    cpu = torch.device("cpu", 0)
    want = cuda_layers.attention_splits(1, 1, 32, 8, 128 * 256, 132, 2 if staged else 4)
    assert cuda_layers._attention_nsplit((1, 1, 32, 128), (200, 256, 8, 128), 128, cpu) == want
    monkeypatch.setattr(cuda_layers, "_ATTN_CTAS_ENV", "4")
    assert cuda_layers._attention_nsplit((1, 1, 32, 128), (200, 256, 8, 128), 128, cpu) == \
        cuda_layers.attention_splits(1, 1, 32, 8, 128 * 256, 132, 4)


@pytest.mark.parametrize("var,attr,value,ok", [
    *[("EXL2_BACKEND_ATTN_MIN_SPLIT", "_ATTN_MIN_SPLIT", v, ok) for v, ok in (
        ("64", True), ("128", True), ("16", True), ("8", False), ("100", False), ("1024", False), ("x", False))],
    # the streamed kernel's: a multiple of its 16-token chunk up to 4096
    *[("EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT", "ATTN_STREAM_MIN_SPLIT", v, ok) for v, ok in (
        ("16", True), ("1024", True), ("4096", True), ("8", False), ("100", False), ("8192", False), ("x", False))],
    *[("EXL2_BACKEND_ATTN_STREAM_VERIFY_MIN_SPLIT", "ATTN_STREAM_VERIFY_MIN_SPLIT", v, ok) for v, ok in (
        ("16", True), ("48", True), ("4096", True), ("0", False), ("40", False), ("8192", False), ("x", False))],
])
def test_min_split_override_is_checked(var, attr, value, ok):
    """EXL2_BACKEND_ATTN_MIN_SPLIT, EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT and ..._STREAM_VERIFY_MIN_SPLIT (read at
    import: a subprocess) set the shortest split the planning cuts, or fail the import with a ValueError naming the
    variable."""
    import subprocess
    import sys

    env = {**os.environ, var: value}
    code = f"from exl2_backend.ops import cuda_layers; print(cuda_layers.{attr})"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    if ok:
        assert r.returncode == 0 and r.stdout.strip() == value, r.stderr
    else:
        assert r.returncode != 0 and var in r.stderr


@pytest.mark.parametrize("rows,tiles", [(1, 1), (4, 1), (8, 1), (9, 2), (16, 2), (20, 3), (36, 3), (128, 3)])
@pytest.mark.parametrize("shared", [True, False])
def test_verify_rows_share_rings_in_tiles_of_up_to_three(monkeypatch, rows, tiles, shared):
    """More than 8 query rows per kv head (a verify step's) run the staged kernel with up to three row tiles per CTA
    (ATTN_SHARED_TILES): "auto" staging takes fp16 pages there too; the launch codes carry stages and tiles; the CTA
    target is one per SM and the split counts tiles per CTA. Off, or with 3 stages, one tile per CTA."""
    monkeypatch.setattr(cuda_layers, "ATTN_MMA_ONLINE", None)
    monkeypatch.setattr(cuda_layers, "ATTN_FP16_MMA", None)
    monkeypatch.setattr(cuda_layers, "ATTN_STAGED", "auto")
    monkeypatch.setattr(cuda_layers, "ATTN_SHARED_TILES", shared)
    monkeypatch.setattr(cuda_kvquant, "ATTN_QUANT_MMA", True)
    monkeypatch.setattr(cuda_kvquant, "_ATTN_CTAS_ENV", None)
    monkeypatch.setattr(cuda_layers, "_ATTN_CTAS_ENV", None)
    want = tiles if shared else 1
    assert cuda_layers.attn_tiles_per_cta(rows=rows) == want
    assert cuda_layers.attn_tiles_per_cta("int8", "int8", rows) == want
    assert cuda_layers.attn_stages(rows=rows) == (2 if want > 1 else 0)  # fp16 pages
    assert cuda_layers.attn_stages("int4", "int4", rows) == 2
    flags = cuda_layers._attn_flags(rows)
    assert (flags >> 5 & 3, flags >> 7 & 3) == ((2, want) if want > 1 else (0, 0))
    code = cuda_kvquant._quant_kernel_code("int8", "int8", rows)
    assert (code & 3, code >> 2 & 3, code >> 4) == (3, 2, want if want > 1 else 0)
    assert cuda_kvquant.quant_attention_ctas("int8", "int8", rows) == (1 if want > 1 else 3)
    monkeypatch.setattr(cuda_layers, "ATTN_STAGED", "3")
    assert cuda_layers.attn_tiles_per_cta(rows=rows) == 1


def test_splits_count_the_tensor_core_tiles_and_tiles_per_cta():
    """A k = 4 verify of the 8B (20 rows per kv head): the CUDA-core planning counted five tiles of 4 (six splits for
    two CTAs per SM); the tensor-core kernel runs three tiles of 8 (eleven splits fill the wave), and three tiles per
    CTA at one CTA per SM sixteen (the most 1k keys take at 64 keys per split)."""
    assert cuda_layers.attention_splits(1, 5, 32, 8, 1024, 132, 2) == 6
    assert cuda_layers.attention_splits(1, 5, 32, 8, 1024, 132, 2, cuda_layers.MMA_ROW_TILE) == 11
    assert cuda_layers.attention_splits(1, 5, 32, 8, 1024, 132, 1, cuda_layers.MMA_ROW_TILE, 3) == 16
    assert cuda_layers.attention_splits(1, 1, 32, 8, 1024, 132, 2, cuda_layers.MMA_ROW_TILE) == 16  # decode alike


@pytest.mark.parametrize("batch,max_context,min_split,want", [
    (1, 32768, 16, 132),  # one CTA per SM
    (1, 1024, 16, 64),  # no split under 16 keys
    (1, 1024, 64, 16),
    (4, 32768, 16, 33),  # the SMs shared over the batch
    (8, 32768, 16, 16),  # rounded down: 17 splits would be 136 CTAs, a second wave on 132 SMs
    (5, 32768, 16, 26),
    (200, 32768, 16, 1),
    (1, 5, 16, 1),
])
def test_streamed_kernel_splits(monkeypatch, batch, max_context, min_split, want):
    """The streamed fp16 decode kernel (ATTN_STREAM): one wave of one CTA per SM over the batch, splits of at least
    ATTN_STREAM_MIN_SPLIT keys; its flags word is bit 9 alone."""
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_MIN_SPLIT", min_split)
    assert cuda_layers.stream_splits(batch, max_context, 132) == want
    assert cuda_layers._ATTN_STREAM_FLAG == 512


def test_streamed_kernel_defaults(monkeypatch):
    """The CUDA-core streamed kernel is off by default (EXL2_BACKEND_ATTN_STREAM=1 turns it on), the tensor-core one
    for fp16 pages on (EXL2_BACKEND_ATTN_STREAM_FP16=0 turns it off), with verify rows
    (EXL2_BACKEND_ATTN_STREAM_VERIFY=0 turns those off); both kernels off, no shape takes either."""
    assert cuda_layers.ATTN_STREAM == (os.environ.get("EXL2_BACKEND_ATTN_STREAM") == "1")
    assert cuda_layers.ATTN_STREAM_FP16 == (os.environ.get("EXL2_BACKEND_ATTN_STREAM_FP16") != "0")
    assert cuda_layers.ATTN_STREAM_VERIFY == (os.environ.get("EXL2_BACKEND_ATTN_STREAM_VERIFY") != "0")
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM", False)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_FP16", False)
    assert not cuda_layers.attn_streamed((1, 1, 32, 128), (1, 256, 8, 128), torch.device("cpu"))


@pytest.mark.parametrize("stream,fp16_only", [(True, False), (False, True)])
def test_streamed_kernel_shapes(monkeypatch, stream, fp16_only):
    """Which decode shapes the streamed kernel takes: fp16 pages over 8 kv heads with 1 / 2 / 4 / 8 query heads per kv
    head on its tensor-core kernel (with ATTN_STREAM or ATTN_STREAM_FP16 alone); with ATTN_STREAM also 2 / 4 / 8
    kv heads of 1 / 2 / 4 query heads each on the CUDA-core kernel, for fp16 and code pages. Without
    ATTN_STREAM_VERIFY never verify rows; never head_dim 64 or pre-sm_90 devices."""
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM", stream)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_FP16", fp16_only)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_VERIFY", False)
    monkeypatch.setattr(cuda_layers, "_sm90", lambda index: True)
    dev = torch.device("cuda", 0)

    def takes(hq, hkv, tq=1, d=128, fp16_pages=True):
        return cuda_layers.attn_streamed((1, tq, hq, d), (1, 256, hkv, d), dev, fp16_pages=fp16_pages)

    for hq in (8, 16, 32, 64):  # Llama 3 1B / 8B (32 / 8), 70B (64 / 8)
        assert takes(hq, 8)
    assert not takes(128, 8) and not takes(32, 8, tq=5) and not takes(32, 8, d=64)
    assert takes(16, 4) == stream and takes(8, 2) == stream and takes(32, 8, fp16_pages=False) == stream
    assert not takes(32, 4) and not takes(64, 8, fp16_pages=False)  # 8 per kv head: the tensor-core kernel's only
    monkeypatch.setattr(cuda_layers, "_sm90", lambda index: False)
    assert not takes(32, 8)


@pytest.mark.parametrize("verify", [False, True])
def test_streamed_verify_rows(monkeypatch, verify):
    """Verify steps take the tensor-core streamed kernel only with ATTN_STREAM_VERIFY, fp16 pages over 8 kv heads and
    at most 64 query rows per kv head; its row tiles (one CTA per 16 rows, one for a decode step's <= 8) divide the
    SMs with the batch."""
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM", False)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_FP16", True)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_VERIFY", verify)
    monkeypatch.setattr(cuda_layers, "_sm90", lambda index: True)
    dev = torch.device("cuda", 0)
    for tq, hq, want in ((5, 32, verify), (16, 32, verify), (17, 32, False), (8, 64, verify), (9, 64, False)):
        assert cuda_layers.attn_streamed((1, tq, hq, 128), (1, 256, 8, 128), dev) == want, (tq, hq)
    assert not cuda_layers.attn_streamed((1, 5, 16, 128), (1, 256, 4, 128), dev)
    assert not cuda_layers.attn_streamed((1, 5, 32, 128), (1, 256, 8, 128), dev, fp16_pages=False)
    assert [cuda_layers.stream_row_tiles(r) for r in (1, 8, 9, 16, 20, 64)] == [1, 1, 1, 1, 2, 4]
    assert cuda_layers.stream_splits(1, 32768, 132, tiles=2) == 66
    assert cuda_layers.stream_splits(3, 32768, 132, tiles=2) == 22
    # past 8 rows per kv head (a verify step) the contexts are cut coarser (defaults 16 and 32 keys a split)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_MIN_SPLIT", 16)
    monkeypatch.setattr(cuda_layers, "ATTN_STREAM_VERIFY_MIN_SPLIT", 32)
    assert [cuda_layers.stream_min_split(r) for r in (1, 4, 8, 9, 20, 64)] == [16, 16, 16, 32, 32, 32]
    assert cuda_layers.stream_splits(1, 1088, 132, tiles=1, rows=4) == 68
    assert cuda_layers.stream_splits(1, 1088, 132, tiles=2, rows=20) == 34
    assert cuda_layers.stream_splits(1, 32768, 132, tiles=2, rows=20) == 66


@pytest.mark.parametrize("head_dim,dtype,page,why", [
    (128, torch.float16, 16, None), (64, torch.float16, 256, None),
    (96, torch.float16, 16, "head_dim 96"), (128, torch.bfloat16, 16, "q dtype torch.bfloat16"),
    (128, torch.float16, 8, "page size 8"), (128, torch.float16, 24, "page size 24")])
def test_both_attention_ops_decline_the_same_queries(head_dim, dtype, page, why):
    """The conditions the fp16 and code-page kernels share (cuda_layers.attention_kernel_declines, which
    cuda_kvquant.paged_attention_quant asks too); the fp16 op then also needs an fp16, contiguous cache."""
    q = torch.zeros(1, 1, 8, head_dim, dtype=dtype)
    assert cuda_layers.attention_kernel_declines(q, page) == why
    cache = torch.zeros(2, page, 2, head_dim, dtype=torch.float16)
    assert cuda_layers._attention_kernel_declines(q, cache, cache) == why


def test_fp16_attention_declines_a_cache_it_cannot_read():
    q = torch.zeros(1, 1, 8, 128, dtype=torch.float16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.float16)
    assert cuda_layers._attention_kernel_declines(q, cache.float(), cache.float()) == "cache dtype torch.float32"
    strided = torch.zeros(2, 16, 4, 128, dtype=torch.float16)[:, :, ::2]
    assert cuda_layers._attention_kernel_declines(q, strided, strided) == "non-contiguous cache"
