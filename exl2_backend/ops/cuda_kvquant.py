"""CUDA versions of the quantized KV cache ops (csrc/layers/kv_quant.cu, csrc/layers/paged_attention_quant.cu),
with the signatures of `ops/reference_kvquant.py`. Custom ops ("exl2_backend::<name>") with fake impls, launched
on the current stream without host syncs, so the decode step stays capturable in a CUDA graph. Invalid inputs
raise `InvalidRequestError`; configurations the kernels do not cover (head_dim other than 64/128 in attention,
fp32 activations, non-contiguous caches) run the reference op instead, with one warning.

  kv_quant_write(k, v, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt)
  rope_kv_quant_write(q, k, v, positions, inv_freq, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt)
  paged_attention_quant(q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale, k_fmt, v_fmt,
                        num_splits=0)
  dequantize_pages(codes, scales, pages, fmt, dtype)  (csrc/layers/kv_dequant.cu; see KV_DEQUANT_KERNEL)
"""

from __future__ import annotations

import functools
import math
import os

import torch

from exl2_backend.cache.kv_types import FORMATS, GROUP
from exl2_backend.ops import cuda_layers, library, reference_kvquant
from exl2_backend.ops.cuda_layers import (
    _ATTN_CTAS_ENV,
    _ATTN_CTAS_PER_SM,
    _ATTN_MIN_SPLIT,
    _DTYPE_CODES,
    _HALF,
    ATTN_CTAS_PER_SM_8BIT,
    _attention_inputs,
    _attn_keys_max,
    _attn_row_tile,
    _check,
    _device_guard,
    _device_index,
    _index_tensor,
    _num_sms,
    _op,
    _require,
    _rope_inputs,
    _stream,
    attention_splits,
    check_attention_args,
)
from exl2_backend.ops.library import F32, I32, I64, PTR, STREAM

_SIGNATURES = {
    "exl2_kv_quant_write": (PTR, I64, I64, I64, PTR, I64, I64, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, I64, PTR,
                            PTR, I64, I64, I32, I32, I32, STREAM),
    "exl2_paged_attention_quant": (PTR, I64, I64, I64, PTR, PTR, PTR, PTR, I32, I32, PTR, I64, PTR, PTR, PTR, I64, I64,
                                   I64, I64, I64, I64, I64, I64, I64, I64, F32, I32, I32, STREAM),
    "exl2_kv_dequant_pages": (PTR, PTR, I32, PTR, I64, I64, I64, I64, I64, PTR, I32, STREAM),
}
_QUANT_FORMATS = ("e4m3", "int8", "int4")
_PAIRS = {("e4m3", "e4m3"), ("int8", "int8"), ("int8", "int4"), ("int4", "int4")}  # the pairs the kernels build


# The tensor-core attention kernel (csrc/layers/paged_attention_quant_mma.cu: row tiles of 8, both products on
# mma.m16n8k16, 128 registers -> 4 CTAs per SM) instead of the CUDA-core one (row tiles up to
# cuda_layers.ATTN_MAX_ROW_TILE, a lane's share of each key's dot products). EXL2_BACKEND_ATTN_QUANT_MMA=0 selects
# the CUDA-core kernel; the tests run both.
ATTN_QUANT_MMA = os.environ.get("EXL2_BACKEND_ATTN_QUANT_MMA", "1") != "0"


def quant_attention_ctas(k_fmt: str, v_fmt: str, rows: int = 1) -> int:
    """CTAs per SM the automatic split aims at for `rows` query rows per kv head (unless
    EXL2_BACKEND_ATTN_CTAS_PER_SM sets it). The tensor-core kernel: 4 with two passes (128 registers), 3 / 2 for the
    one-pass variants in registers, cuda_layers.ATTN_STAGED_CTAS_PER_SM["codes"] staged, 1 with row tiles sharing
    rings (cuda_layers.attn_tiles_per_cta). The CUDA-core kernel: 8-bit codes in either cache run the 80-register
    variant (6 resident per SM), 4-bit ones the 128-register one (4); see cuda_layers.ATTN_CTAS_PER_SM_8BIT."""
    if ATTN_QUANT_MMA:
        online = cuda_layers.attn_mma_online(k_fmt, v_fmt)
        if _ATTN_CTAS_ENV or not online:
            return _ATTN_CTAS_PER_SM
        return cuda_layers.attn_mma_ctas(k_fmt, v_fmt, rows, 4 - online)
    return ATTN_CTAS_PER_SM_8BIT if {"int8", "e4m3"} & {k_fmt, v_fmt} else _ATTN_CTAS_PER_SM


_STREAM_CODE = 64  # exl2_paged_attention_quant's use_mma for the streamed kernel (alone)


def _quant_kernel_code(k_fmt: str, v_fmt: str, rows: int) -> int:
    """exl2_paged_attention_quant's use_mma for `rows` query rows per kv head: the tensor-core kernel's code (bits
    0-1, 0 for the CUDA-core kernel), its stages in shared memory (bits 2-3) and row tiles per CTA (bits 4-5)."""
    if not ATTN_QUANT_MMA:
        return 0
    stages, tiles = cuda_layers.attn_stage_bits(k_fmt, v_fmt, rows)
    return cuda_layers.attn_mma_variant_code(k_fmt, v_fmt) | stages << 2 | tiles << 4


@functools.cache
def _fn(name: str):
    return library.declare(name, *_SIGNATURES[name])


def _call(name: str, *args) -> None:
    library.check(_fn(name)(*args), name)


def _fallback(op: str, why: str):
    return library.reference_fallback(reference_kvquant, op, why)


def _cache_pair(op: str, name: str, codes, scales, fmt: str, device=None) -> tuple[int, int, int, int]:
    """Validate one code/scale cache pair; -> (P, S, Hkv, D)."""
    _require(fmt in _QUANT_FORMATS, f"{op}: {name} format {fmt!r} is not one of {_QUANT_FORMATS}", f"{name}_fmt")
    _check(op, f"{name}_codes", codes, ndim=4, dtypes=(torch.uint8,), device=device)
    _check(op, f"{name}_scales", scales, ndim=4, dtypes=(torch.float16,), device=codes.device)
    p, s, hkv, g = scales.shape
    d = g * GROUP
    want = (p, s, hkv, FORMATS[fmt].code_bytes(d))
    _require(tuple(codes.shape) == want, f"{op}: {name}_codes {tuple(codes.shape)} must be {want} for {fmt} with "
             f"scales {tuple(scales.shape)}", f"{name}_codes")
    _require(codes.is_contiguous() and scales.is_contiguous(), f"{op}: {name} caches must be contiguous",
             f"{name}_codes")
    return p, s, hkv, d


def _caches(op, k_codes, k_scales, v_codes, v_scales, k_fmt, v_fmt, device=None):
    shape = _cache_pair(op, "k", k_codes, k_scales, k_fmt, device)
    _require(_cache_pair(op, "v", v_codes, v_scales, v_fmt, k_codes.device) == shape,
             f"{op}: v cache shape disagrees with k cache", "v_scales")
    _require((k_fmt, v_fmt) in _PAIRS, f"{op}: format pair ({k_fmt}, {v_fmt}) is not built (pairs: {sorted(_PAIRS)})",
             "k_fmt")
    return shape


# --- quantize on write ------------------------------------------------------------------------------------


def _write_launch(q, k, v, positions, inv_freq, k_codes, k_scales, v_codes, v_scales, slots, num_slots, k_fmt,
                  v_fmt):
    t, hkv, d = k.shape
    with _device_guard(k_codes):
        _call("exl2_kv_quant_write", q.data_ptr() if q is not None else None, q.stride(0) if q is not None else 0,
              q.stride(1) if q is not None else 0, q.shape[1] if q is not None else 0, k.data_ptr(), k.stride(0),
              k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), hkv, k_codes.data_ptr(), k_scales.data_ptr(),
              v_codes.data_ptr(), v_scales.data_ptr(), slots.data_ptr(), num_slots,
              positions.data_ptr() if positions is not None else None,
              inv_freq.data_ptr() if inv_freq is not None else None, t, d, FORMATS[k_fmt].abi, FORMATS[v_fmt].abi,
              _DTYPE_CODES[k.dtype], _stream(k_codes))


def _write_inputs(op, k, v, slots, k_codes, shape):
    _p, _s, hkv, d = shape
    for name, x in (("k", k), ("v", v)):
        _check(op, name, x, ndim=3, device=k_codes.device)
        _require(tuple(x.shape[1:]) == (hkv, d), f"{op}: {name} {tuple(x.shape)} must be [T, {hkv}, {d}]", name)
    _require(v.shape[0] == k.shape[0] and isinstance(slots, torch.Tensor) and slots.dim() == 1
             and slots.shape[0] == k.shape[0],
             f"{op}: k {tuple(k.shape)}, v {tuple(v.shape)}, slots disagree on T", "slots")
    return (k.dtype in _HALF and v.dtype == k.dtype and k.stride(-1) == 1 and v.stride(-1) == 1)


@_op("kv_quant_write", ("k_codes", "k_scales", "v_codes", "v_scales"))
def kv_quant_write(k: torch.Tensor, v: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                   v_codes: torch.Tensor, v_scales: torch.Tensor, slots: torch.Tensor, k_fmt: str, v_fmt: str) -> None:
    """k, v [T, Hkv, D] (strided views fine) quantized into the caches at slots [T] (page * S + offset), in place.
    Negative slots and slots past the cache are skipped."""
    op = "kv_quant_write"
    shape = _caches(op, k_codes, k_scales, v_codes, v_scales, k_fmt, v_fmt)
    if not _write_inputs(op, k, v, slots, k_codes, shape):
        return _fallback(op, f"dtypes k {k.dtype}, v {v.dtype} or layout")(
            k, v, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt)
    slots = _index_tensor(slots, k_codes.device, torch.int64).contiguous()
    if k.shape[0]:
        _write_launch(None, k, v, None, None, k_codes, k_scales, v_codes, v_scales, slots, shape[0] * shape[1],
                      k_fmt, v_fmt)


@kv_quant_write.register_fake
def _(k, v, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt):
    return None


@_op("rope_kv_quant_write", ("q", "k_codes", "k_scales", "v_codes", "v_scales"))
def rope_kv_quant_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        inv_freq: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes: torch.Tensor,
                        v_scales: torch.Tensor, slots: torch.Tensor, k_fmt: str, v_fmt: str) -> None:
    """One launch: q [T, Hq, D] rotated in place (RoPE); k rotated (rounded to its dtype, as apply_rope) and v
    quantized into the caches at slots [T]. q, k, v may be strided views with a contiguous last dim."""
    op = "rope_kv_quant_write"
    shape = _caches(op, k_codes, k_scales, v_codes, v_scales, k_fmt, v_fmt)
    _check(op, "q", q, ndim=3, device=k_codes.device)
    _require(q.shape[0] == k.shape[0] and q.shape[2] == shape[3],
             f"{op}: q {tuple(q.shape)} does not match k {tuple(k.shape)}", "q")
    if not (_write_inputs(op, k, v, slots, k_codes, shape) and q.dtype == k.dtype and q.stride(-1) == 1):
        return _fallback(op, f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype} or layout")(
            q, k, v, positions, inv_freq, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt)
    pos, inv = _rope_inputs(op, q, positions, inv_freq)
    slots = _index_tensor(slots, k_codes.device, torch.int64).contiguous()
    if k.shape[0]:
        _write_launch(q, k, v, pos, inv, k_codes, k_scales, v_codes, v_scales, slots, shape[0] * shape[1], k_fmt,
                      v_fmt)


@rope_kv_quant_write.register_fake
def _(q, k, v, positions, inv_freq, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt):
    return None


# --- attention over quantized pages ------------------------------------------------------------------------


@_op("paged_attention_quant")
def paged_attention_quant(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes: torch.Tensor,
                          v_scales: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                          k_fmt: str, v_fmt: str, num_splits: int = 0) -> torch.Tensor:
    """q [B, Tq, Hq, D] fp16, quantized caches -> [B, Tq, Hq, D]; semantics of reference.paged_attention (query j
    of sequence b at position context_lens[b] - Tq + j, causal, GQA by head groups). num_splits 0 = automatic."""
    op = "paged_attention_quant"
    _check(op, "q", q, ndim=4)
    p, s, hkv, d = _caches(op, k_codes, k_scales, v_codes, v_scales, k_fmt, v_fmt, device=q.device)
    b, tq, hq, _ = q.shape
    check_attention_args(op, q.shape, hkv, d, "q", block_tables, context_lens, num_splits)
    why = cuda_layers.attention_kernel_declines(q, s)
    if why is not None:
        return _fallback(op, why)(q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale, k_fmt,
                                  v_fmt)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b == 0 or tq == 0 or hq == 0:
        return out
    q, tables, lens = _attention_inputs(op, q, block_tables, context_lens)
    max_pages = tables.shape[1]
    max_ctx = max_pages * s
    dev_index = _device_index(q.device)
    rows = (hq // hkv) * tq
    streamed = cuda_layers.attn_streamed(q.shape, (p, s, hkv, d), q.device, fp16_pages=False)
    if streamed:  # cuda_layers.ATTN_STREAM: one CTA per split for all kv heads (paged_attention_stream.cu)
        nsplit = num_splits or cuda_layers.stream_splits(b, max_ctx, _num_sms(dev_index), rows=rows)
        code, min_split = _STREAM_CODE, cuda_layers.stream_min_split(rows)
    else:
        tiled = ATTN_QUANT_MMA  # the tensor-core kernel's row tiles of 8, some per CTA
        nsplit = num_splits or attention_splits(b, tq, hq, hkv, max_ctx, _num_sms(dev_index),
                                                quant_attention_ctas(k_fmt, v_fmt, rows),
                                                cuda_layers.MMA_ROW_TILE if tiled else 0,
                                                cuda_layers.attn_tiles_per_cta(k_fmt, v_fmt, rows) if tiled else 1)
        nsplit = max(nsplit, math.ceil(max_ctx / _attn_keys_max(_attn_row_tile(rows))))
        code, min_split = _quant_kernel_code(k_fmt, v_fmt, rows), _ATTN_MIN_SPLIT
    ws = torch.empty(b * tq * hq * nsplit * (d + 2), dtype=torch.float32, device=q.device) if nsplit > 1 else None
    with _device_guard(q):
        _call("exl2_paged_attention_quant", q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k_codes.data_ptr(),
              k_scales.data_ptr(), v_codes.data_ptr(), v_scales.data_ptr(), FORMATS[k_fmt].abi, FORMATS[v_fmt].abi,
              tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
              ws.data_ptr() if ws is not None else None, b, tq, hq, hkv, d, p, s, max_pages, nsplit, min_split,
              float(scale), cuda_layers.ATTN_MAX_ROW_TILE, code, _stream(q))
    return out


@paged_attention_quant.register_fake
def _(q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale, k_fmt, v_fmt, num_splits=0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# Prefill chunks over a quantized history dequantize the key blocks they read (ops/attention_prefill_quant.py) in
# one kernel (csrc/layers/kv_dequant.cu, bit-identical to the reference) instead of torch ops. H200 call L1 of
# 2026-12-02, 8B shape, 2k-token prefill tok/s, torch ops -> kernel: q8 14,081 -> 15,714 at 1k context and 9,446 ->
# 10,252 at 32k; q4 13,315 -> 16,439 and 9,577 -> 10,079. EXL2_BACKEND_KV_DEQUANT_KERNEL=0 goes back.
KV_DEQUANT_KERNEL = os.environ.get("EXL2_BACKEND_KV_DEQUANT_KERNEL", "1") != "0"


def dequantize_pages(codes: torch.Tensor, scales: torch.Tensor, pages: torch.Tensor, fmt: str,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """reference_kvquant.dequantize_pages (pages [U] of one cache -> [U, S, Hkv, D] in `dtype`), bit for bit; the
    kernel for fp16 / bf16 outputs of contiguous caches when KV_DEQUANT_KERNEL is on."""
    if not (KV_DEQUANT_KERNEL and dtype in _HALF and codes.is_cuda and codes.is_contiguous()
            and scales.is_contiguous() and scales.dtype == torch.float16 and fmt in _QUANT_FORMATS):
        return reference_kvquant.dequantize_pages(codes, scales, pages.to(codes.device, torch.long), fmt, dtype)
    p, s, hkv, g = scales.shape
    _require(codes.shape[:3] == scales.shape[:3] and codes.shape[3] == FORMATS[fmt].code_bytes(g * GROUP),
             f"dequantize_pages: codes {tuple(codes.shape)} do not match scales {tuple(scales.shape)} ({fmt})",
             "codes")
    pages = _index_tensor(pages, codes.device, torch.int64).contiguous()
    out = torch.empty(pages.shape[0], s, hkv, g * GROUP, dtype=dtype, device=codes.device)
    if out.numel():
        with _device_guard(codes):
            _call("exl2_kv_dequant_pages", codes.data_ptr(), scales.data_ptr(), FORMATS[fmt].abi, pages.data_ptr(),
                  pages.shape[0], p, s, hkv, g * GROUP, out.data_ptr(), _DTYPE_CODES[dtype], _stream(codes))
    return out


__all__ = ["dequantize_pages", "kv_quant_write", "paged_attention_quant", "rope_kv_quant_write"]
