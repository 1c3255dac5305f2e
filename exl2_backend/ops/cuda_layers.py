"""CUDA versions of the non-GEMM ops (csrc/layers/), with the signatures of `ops/reference.py`.

Each op is a `torch.library.custom_op` ("exl2_backend::<name>") over a ctypes call into the compiled library,
launched on `torch.cuda.current_stream()`. No op synchronizes with the host, so all of them can be captured in
a CUDA graph (scratch memory comes from torch's allocator, sized from shapes only). Invalid inputs raise
`InvalidRequestError`; a configuration the kernels do not cover (e.g. head_dim 96, fp32 attention) runs the
reference op instead, with one warning.

Extras beyond the reference signatures, for the model and engine:
  add_rms_norm_(x, residual, weight, eps) -> normed        residual <- x + residual in place
  apply_rope_qk_(q, k, positions, inv_freq)                 q and k (strided views allowed) rotated in place
  rope_kv_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots)   one launch: q rotated in place, rotated
                                                            k and v written into the caches (reference op)
  paged_attention(..., num_splits=0)                        0 = automatic split of the context
  sample_tokens_tensor(logits, uniforms, temperature, probs=None) -> int64 [B]   graph-capturable sampler
  sampling_param_tensors(params, vocab, device), filtered_probs(...), apply_penalties(...)
  direct.<op>                                               the same implementations without the custom-op
                                                            dispatcher (~20-25 us less per eager call)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import types

import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.ops import library, reference
from exl2_backend.ops.host_copy import to_device
from exl2_backend.ops.library import F32, I32, I64, PTR, STREAM
from exl2_backend.ops.reference_sampling import active_filters

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_HALF = (torch.float16, torch.bfloat16)

# C signatures (csrc/layers/*.cu); every function returns an int status.
_SIGNATURES = {
    "exl2_rms_norm": (PTR, I64, PTR, PTR, I64, I64, I64, F32, I32, I32, STREAM),
    "exl2_add_rms_norm": (PTR, I64, PTR, I64, PTR, PTR, I64, PTR, I64, I64, I64, F32, I32, I32, STREAM),
    "exl2_apply_rope": (PTR, I64, I64, PTR, I64, I64, I64, PTR, I64, I64, PTR, I64, I64, I64, PTR, PTR, I64, I64,
                        I32, STREAM),
    "exl2_silu_mul": (PTR, I64, PTR, I64, PTR, I64, I64, I64, I32, STREAM),
    "exl2_embedding": (PTR, PTR, PTR, I64, I64, I64, I32, STREAM),
    "exl2_kv_cache_write": (PTR, I64, I64, PTR, I64, I64, PTR, PTR, PTR, I64, I64, I64, I64, I32, STREAM),
    "exl2_paged_attention": (PTR, I64, I64, I64, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64, I64, I64, I64, I64, I64,
                             I64, I64, I64, I64, F32, I32, PTR, STREAM),
    "exl2_rope_kv_write": (PTR, I64, I64, I64, PTR, I64, I64, PTR, I64, I64, I64, PTR, PTR, PTR, I64, PTR, PTR, I64,
                           I64, I32, STREAM),
    "exl2_sample_tokens": (PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, I64, I64, STREAM),
}

# Paged attention tuning, from the H200 sweep of scripts/bench_attention.py (2026-11-29, GQA 32/8, D=128, B=1):
# 4 CTAs per SM was best at 8k and 32k; splits shorter than 64 keys lost at 2k (33 splits of 64 keys: 649 GB/s,
# 64 of 32: 570); 8 key steps in flight (flags bit 0) gained 4-7% at 8k/32k/B=16 and lost 4% at 512.
# Keys per split at least: short contexts are not cut finer. EXL2_BACKEND_ATTN_MIN_SPLIT overrides it (a measurement
# switch: 16..512, a multiple of 16; at 1k the 8B's decode runs 16 splits of 64 keys, one step per warp, then the
# reduce launch).
_MIN_SPLIT_ENV = os.environ.get("EXL2_BACKEND_ATTN_MIN_SPLIT", "64")
_ATTN_MIN_SPLIT = int(_MIN_SPLIT_ENV) if _MIN_SPLIT_ENV.isdigit() else -1
if not (16 <= _ATTN_MIN_SPLIT <= 512 and _ATTN_MIN_SPLIT % 16 == 0):
    raise ValueError(f"EXL2_BACKEND_ATTN_MIN_SPLIT must be a multiple of 16 in 16..512, got {_MIN_SPLIT_ENV!r}")
# Automatic split: aim for this many CTAs per multiprocessor. The quantized-cache kernel with 8-bit codes (fp8,
# q8, q6's keys; 80 registers, 6 CTAs resident per SM) aims at 6: one full wave at GQA 4. H200 call G3
# (scripts/attention_sweep.py, 8B attention at 32k): q8 68.9 us at 6 against 82.3 at 4; fp16 (96 registers) and
# q4 (128) were best at 4 (72.8 / 58.7 us; at 6: 80.4 / 79.5). EXL2_BACKEND_ATTN_CTAS_PER_SM sets both (sweeps).
_ATTN_CTAS_ENV = os.environ.get("EXL2_BACKEND_ATTN_CTAS_PER_SM")
_ATTN_CTAS_PER_SM = max(1, int(_ATTN_CTAS_ENV or 4))
ATTN_CTAS_PER_SM_8BIT = max(1, int(_ATTN_CTAS_ENV or 6))
_ATTN_FLAGS = 1  # bit 0: 8 key steps in flight per thread instead of 4 (row tiles <= 4)
# Most query rows per CTA tile (4, 8 or 16). A verify step of k = 4 at GQA 4 has 20 rows per kv head: two tiles
# of 16 (168-224 registers) or five of 4 (80-96, each a decode CTA's work, K/V re-read from L2). H200 call H1 of
# 2026-12-03 (scripts/spec_bench.py, 8B, verify cost / decode step at k = 1, 2, 4, 8): cap 16 1.149 / 1.284 /
# 1.387 / 1.809, cap 8 1.149 / 1.256 / 1.284 / 1.638, cap 4 1.125 / 1.202 / 1.279 / 1.661; decode unchanged.
ATTN_MAX_ROW_TILE = int(os.environ.get("EXL2_BACKEND_ATTN_MAX_ROW_TILE", "4"))
if ATTN_MAX_ROW_TILE not in (4, 8, 16):
    raise ValueError(f"EXL2_BACKEND_ATTN_MAX_ROW_TILE must be 4, 8 or 16, got {ATTN_MAX_ROW_TILE}")
_SAMPLE_CHUNK = 2048  # tokens per CTA of the sampling kernel (csrc/layers/sampling.cu CHUNK)
# Split-combine tickets of paged attention and row counters of the sampler: int32 per-device buffers zeroed
# once and left at zero by every launch (the last CTA resets its entry), so no memset runs per call or in a
# captured graph. Attention tickets are opt-in (EXL2_BACKEND_ATTN_TICKETS=1): on the H200 (2026-11-29, 8B shape,
# context 512, graph replay) the one-launch version was ~2 us per layer slower than the separate reduce kernel,
# whose 32 CTAs combine the splits with more parallelism than the one last CTA per kv head. H200 call AL3 of
# 2026-12-04 (spec_bench, 8B at 1k, decode step ms, two runs): the last CTA staging the partials through shared
# memory in chunks of whole splits, in kernels of their own, for this kernel and for the tensor-core one-pass
# kernel the fp16 decode runs: 2.554 / 2.557 and 2.572 / 2.571 against 2.253 / 2.257 (bench at 32k: 220.5
# against 263.0 tok/s). That code is in git history at f3109a9; the fp16 tensor-core kernel takes no tickets.
_TICKETS_NUMEL = 1 << 16
_tickets: dict[tuple[str, torch.device], torch.Tensor] = {}


def _ticket_buffer(device: torch.device, need: int, kind: str = "attn") -> torch.Tensor | None:
    """The per-device zeroed int32 ticket buffer, or None when it would have to be made under graph capture
    (a memset in the graph) or `need` exceeds it: callers then take their path without tickets."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _tickets.get((kind, device))
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        buf = _tickets[(kind, device)] = torch.zeros(_TICKETS_NUMEL, dtype=torch.int32, device=device)
    return buf if need <= buf.numel() else None


def _attn_tickets_enabled() -> bool:
    return os.environ.get("EXL2_BACKEND_ATTN_TICKETS", "0") == "1"


def _attn_row_tile(rows: int) -> int:
    natural = 1 if rows <= 1 else 2 if rows <= 2 else 4 if rows <= 4 else 8 if rows <= 8 else 16
    return min(natural, ATTN_MAX_ROW_TILE)


# fp16 pages through the tensor-core kernel of the quantized caches (csrc/layers/paged_attention_quant_mma.cu:
# row tiles of 8, both products on mma.m16n8k16, its own reduce launch, no tickets) instead of the CUDA-core
# kernel. H200 call K2 of 2026-12-02: the 8B's decode attention at 32k (4 rows per kv head) 59.0 against 55.9 us
# per layer, the 8B decode 223.6 against 227.1 tok/s at 32k; its k = 4 / 8 verify steps (20 / 36 rows) 1.194 /
# 1.465x a decode step against 1.232 / 1.539x, k = 2 (12 rows) 1.222 against 1.209x. So by default ("auto") the
# tensor-core kernel takes fp16 pages from ATTN_FP16_MMA_MIN_ROWS query rows per kv head on;
# EXL2_BACKEND_ATTN_FP16_MMA=1 / 0 always / never (the tests run both).
_FP16_MMA_ENV = os.environ.get("EXL2_BACKEND_ATTN_FP16_MMA", "auto")
ATTN_FP16_MMA: bool | None = None if _FP16_MMA_ENV == "auto" else _FP16_MMA_ENV == "1"
ATTN_FP16_MMA_MIN_ROWS = 16


# The tensor-core kernel's one-pass variant (online softmax, no score buffer; 1: one step of 16 keys in flight
# per warp, 168 registers, 3 CTAs per SM; 2: two steps, 2 CTAs per SM); 0: the two-pass kernel. By default
# ("auto") each cache format takes the variant that won end to end, 8B decode at 32k on the H200 (`exl2-backend
# bench`, tok/s, two-pass / one-pass 1 / one-pass 2; fp16 pages through the tensor-core kernel in the one-pass
# runs): call Q1 of 2026-12-02: fp16 229.3 / 196.1 / 241.4, q8 258.9 / 254.4 / 261.9, q4 263.8 / 269.4 / 263.5;
# call R1: fp8 261.8 / 260.5 / 266.1, q6 255.6 / 262.9 / 263.5. EXL2_BACKEND_ATTN_MMA_ONLINE=0/1/2 sets one for every
# format.
_ONLINE_ENV = os.environ.get("EXL2_BACKEND_ATTN_MMA_ONLINE", "auto")
ATTN_MMA_ONLINE: int | None = None if _ONLINE_ENV == "auto" else int(_ONLINE_ENV)
if ATTN_MMA_ONLINE not in (None, 0, 1, 2):
    raise ValueError(f"EXL2_BACKEND_ATTN_MMA_ONLINE must be auto, 0, 1 or 2, got {_ONLINE_ENV}")
# (K format, V format) -> the automatic variant; "fp16" for fp16 pages.
ATTN_MMA_ONLINE_AUTO = {("fp16", "fp16"): 2, ("int8", "int8"): 2, ("int4", "int4"): 1, ("e4m3", "e4m3"): 2,
                        ("int8", "int4"): 2}


# The staged one-pass kernel (csrc/layers/attn_mma_stage.cuh): each warp copies its next steps into shared memory
# (cp.async) instead of registers, 168 registers, 3 CTAs per SM; the same bits as the register kernels for the same
# splits. EXL2_ATTN_STAGED: "auto" (default) 2 stages for code pages, none for fp16 ones; "0" never; "2" / "3"
# always, with that many stages (passed to the library with each launch: attn_stages). H200 call AE1 of
# 2026-12-03 (`bench`, 8B, tok/s register / staged, two runs alike): 32k q8 288.1 / 298.4, q4 296.2 / 309.7, fp16
# 259.8 / 249.6; 1k q8 409.9 / 406.6, q4 402.4 / 400.8, fp16 418.9 / 412.1. Call AD1 (scripts/attention_sweep.py,
# 8B attention at 32k, 2 stages, us per layer at splits for 2 / 3 / 4 CTAs per SM): fp16 48.86 / 52.39 / 60.56, q8
# 41.92 / 37.22 / 47.55, q4 39.81 / 32.27 / 37.50; so its splits aim at ATTN_STAGED_CTAS_PER_SM per page kind.
ATTN_STAGED = os.environ.get("EXL2_ATTN_STAGED", "auto")
if ATTN_STAGED not in ("auto", "0", "2", "3"):
    raise ValueError(f"EXL2_ATTN_STAGED must be auto, 0, 2 or 3, got {ATTN_STAGED}")
ATTN_STAGED_CTAS_PER_SM = {"fp16": 2, "codes": 3}
# Rows of a verify step (20 per kv head at k = 4 and GQA 4: three row tiles of 8) through the staged kernel with
# up to ATTN_TILES_PER_CTA_MAX row tiles per CTA, whose warps share each key column's ring (one read of the split's
# K and V for all its rows instead of one per tile; 168 registers x 128 threads per tile: one CTA per SM). The
# default for such rows with every page format ("auto" staging takes fp16 pages there too);
# EXL2_BACKEND_ATTN_SHARED_TILES=0 keeps one tile per CTA. H200 call AF2 of 2026-12-03 (spec_bench, 8B at 1k, fp16
# cache, verify / decode step, two runs): k = 2 1.130 / 1.129 against 1.191 / 1.198, k = 4 1.263 / 1.261 against
# 1.325 / 1.330, k = 8 1.670 / 1.669 against 1.736 / 1.747.
ATTN_SHARED_TILES = os.environ.get("EXL2_BACKEND_ATTN_SHARED_TILES", "1") != "0"
ATTN_TILES_PER_CTA_MAX = 3
MMA_ROW_TILE = 8  # query rows per tile of the tensor-core kernels


def attn_stages(k_fmt: str = "fp16", v_fmt: str = "fp16", rows: int = 1) -> int:
    """Shared-memory stages of the one-pass kernel for these page formats and query rows per kv head (0: the
    register kernel): a one-pass variant, and EXL2_ATTN_STAGED "2" / "3", or "auto": 2 for code pages, and for fp16
    pages where row tiles share rings (attn_tiles_per_cta)."""
    if attn_mma_online(k_fmt, v_fmt) == 0:
        return 0
    if ATTN_STAGED == "auto":
        return 2 if k_fmt != "fp16" or (ATTN_SHARED_TILES and rows > MMA_ROW_TILE) else 0
    return int(ATTN_STAGED)


def attn_staged(k_fmt: str = "fp16", v_fmt: str = "fp16", rows: int = 1) -> bool:
    """Whether the staged one-pass kernel runs these page formats and rows (attn_stages)."""
    return attn_stages(k_fmt, v_fmt, rows) > 0


def attn_tiles_per_cta(k_fmt: str = "fp16", v_fmt: str = "fp16", rows: int = 1) -> int:
    """Row tiles of 8 per CTA of the tensor-core kernels: up to ATTN_TILES_PER_CTA_MAX where several tiles run the
    staged kernel with 2 stages (ATTN_SHARED_TILES), else 1."""
    tiles = -(-rows // MMA_ROW_TILE)
    if not ATTN_SHARED_TILES or tiles < 2 or attn_stages(k_fmt, v_fmt, rows) != 2:
        return 1
    return min(ATTN_TILES_PER_CTA_MAX, tiles)


def attn_stage_bits(k_fmt: str = "fp16", v_fmt: str = "fp16", rows: int = 1) -> tuple[int, int]:
    """The library's fields for a tensor-core launch's stages and row tiles per CTA (0 for one tile): flags bits 5-6
    and 7-8 of exl2_paged_attention, use_mma bits 2-3 and 4-5 of exl2_paged_attention_quant."""
    tiles = attn_tiles_per_cta(k_fmt, v_fmt, rows)
    return attn_stages(k_fmt, v_fmt, rows), tiles if tiles > 1 else 0


def attn_mma_ctas(k_fmt: str, v_fmt: str, rows: int, register_ctas: int) -> int:
    """CTAs per SM the split of a tensor-core launch aims at: 1 where row tiles share rings, ATTN_STAGED_CTAS_PER_SM
    (by page kind) for the staged kernel, else `register_ctas` (the register kernel's target)."""
    if attn_tiles_per_cta(k_fmt, v_fmt, rows) > 1:
        return 1
    if attn_staged(k_fmt, v_fmt, rows):
        return ATTN_STAGED_CTAS_PER_SM["fp16" if k_fmt == "fp16" else "codes"]
    return register_ctas


def attn_mma_online(k_fmt: str = "fp16", v_fmt: str = "fp16") -> int:
    """The one-pass variant (0 = two passes) the tensor-core kernel runs for these page formats."""
    if ATTN_MMA_ONLINE is not None:
        return ATTN_MMA_ONLINE
    return ATTN_MMA_ONLINE_AUTO.get((k_fmt, v_fmt), 0)


def _attn_fp16_mma(rows: int) -> bool:
    """fp16 pages through the tensor-core kernel: forced either way by ATTN_FP16_MMA, else whenever the format's
    variant is a one-pass one (the two-pass variant only from ATTN_FP16_MMA_MIN_ROWS rows per kv head on)."""
    if ATTN_FP16_MMA is not None:
        return ATTN_FP16_MMA
    return attn_mma_online() > 0 or rows >= ATTN_FP16_MMA_MIN_ROWS


def attn_mma_variant_code(k_fmt: str = "fp16", v_fmt: str = "fp16") -> int:
    """The C ABI's code of the tensor-core kernel in use: 1 two passes, 2 / 3 one pass (variant 1 / 2)."""
    return 1 + attn_mma_online(k_fmt, v_fmt)


def _attn_flags(rows: int = 1) -> int:
    """The kernel's flags for `rows` query rows per kv head: deeper unroll (bit 0), the row tile cap (bits 1-2:
    16 >> code), the tensor-core kernel (bits 3-4: attn_mma_variant_code(), 0 for the CUDA-core kernel), its
    stages in shared memory (bits 5-6: attn_stages()) and row tiles per CTA (bits 7-8: attn_tiles_per_cta())."""
    flags = _ATTN_FLAGS | {16: 0, 8: 1, 4: 2}[ATTN_MAX_ROW_TILE] << 1
    if not _attn_fp16_mma(rows):
        return flags
    stages, tiles = attn_stage_bits(rows=rows)
    return flags | attn_mma_variant_code() << 3 | stages << 5 | tiles << 7


# The streamed decode attention (csrc/layers/paged_attention_stream.cu; exl2_paged_attention's flags bit 9 for fp16
# pages, exl2_paged_attention_quant's use_mma 64 for code pages): a CTA per split of a sequence takes all its kv
# heads, so each 16-token chunk of K and of V (and of their scales) is one contiguous run of the page, copied by one
# bulk copy into a ~170-192 KB shared-memory ring (one CTA per SM, the splits one wave of the SMs). For decode steps
# (one query per sequence), head_dim 128, 1 / 2 / 4 query heads per kv head, 2 / 4 / 8 kv heads, sm_90+. Written
# because the tensor-core one-pass kernel runs the 8B's fp16 attention at 32k at ~49 us per layer for ~32 us of
# bytes (latency-bound, 12% occupancy; ncu, H200 call AC1 of 2026-12-03), the code pages at 46% (int8) / 28% (int4)
# of the bandwidth (AD1). Off for the shapes below's CUDA-core kernel (slower than the default routes: 81 us per
# layer at 32k, H200 call AP1; EXL2_BACKEND_ATTN_STREAM=1 takes it; keys per split at least ATTN_STREAM_MIN_SPLIT,
# a multiple of 16: EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT).
ATTN_STREAM = os.environ.get("EXL2_BACKEND_ATTN_STREAM", "0") == "1"
_STREAM_MIN_ENV = os.environ.get("EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT", "16")
ATTN_STREAM_MIN_SPLIT = int(_STREAM_MIN_ENV) if _STREAM_MIN_ENV.isdigit() else -1
if not (16 <= ATTN_STREAM_MIN_SPLIT <= 4096 and ATTN_STREAM_MIN_SPLIT % 16 == 0):
    raise ValueError("EXL2_BACKEND_ATTN_STREAM_MIN_SPLIT must be a multiple of 16 in 16..4096, got "
                     f"{_STREAM_MIN_ENV!r}")
# The same bound for more than 8 query rows per kv head (verify steps of k >= 2 on Llama 3's 4 query heads per kv
# head): each split's partials then hold G x Tq rows, and the reduce launch that combines them grows with splits x
# rows, so short contexts are cut coarser. H100 call BC1 of 2026-12-06 (8B at 1k, spec_bench, ms per step, shortest
# split 16 / 32 / 64 keys for every step): decode 2.297 / 2.310 / 2.402; verify k = 1 (8 rows) 2.406 / 2.440 /
# 2.543, k = 2 (12 rows) 2.647 / 2.620 / 2.709, k = 4 (20 rows) 2.947 / 2.883 / 2.989, k = 8 (36 rows) 3.613 /
# 3.614 / 3.649. EXL2_BACKEND_ATTN_STREAM_VERIFY_MIN_SPLIT overrides it (a multiple of 16 up to 4096).
_STREAM_VERIFY_MIN_ENV = os.environ.get("EXL2_BACKEND_ATTN_STREAM_VERIFY_MIN_SPLIT", "32")
ATTN_STREAM_VERIFY_MIN_SPLIT = int(_STREAM_VERIFY_MIN_ENV) if _STREAM_VERIFY_MIN_ENV.isdigit() else -1
if not (16 <= ATTN_STREAM_VERIFY_MIN_SPLIT <= 4096 and ATTN_STREAM_VERIFY_MIN_SPLIT % 16 == 0):
    raise ValueError("EXL2_BACKEND_ATTN_STREAM_VERIFY_MIN_SPLIT must be a multiple of 16 in 16..4096, got "
                     f"{_STREAM_VERIFY_MIN_ENV!r}")
_ATTN_STREAM_FLAG = 1 << 9
# fp16 pages over 8 kv heads (Llama 3 1B / 8B / 70B: 1, 2, 4 or 8 query heads per kv head) run the streamed kernel
# on tensor cores (csrc/layers/paged_attention_stream_mma.cu) by default (ATTN_STREAM_FP16; off with
# EXL2_BACKEND_ATTN_STREAM_FP16=0, or taken with ATTN_STREAM); code pages and other head counts keep their routes.
# H100 call AX1 of 2026-12-06, 8B attention shape, us per call, default route -> this kernel: 1k 8.32 -> 6.67, 8k
# 25.45 -> 18.37, 32k 61.58 -> 53.97 (70B's 64 query heads: 71.85 -> 54.52); bench 8B fp16 decode +4.5% at 1k,
# +11.3% at 32k.
ATTN_STREAM_FP16 = os.environ.get("EXL2_BACKEND_ATTN_STREAM_FP16", "1") != "0"
# Verify steps (Tq > 1, at most 64 query rows per kv head) on the same tensor-core kernel, in tiles of 16 rows
# (grid z), with the causal limit per row; EXL2_BACKEND_ATTN_STREAM_VERIFY=0 goes back. H100 call AY1 of
# 2026-12-06 (8B at 1k, spec_bench, interleaved twice): k = 4 verify 1.316 / 1.318 -> 1.282 / 1.273 of a decode
# step, k = 8 1.660 / 1.643 -> 1.576 / 1.589; its 71 GPU tests passed.
ATTN_STREAM_VERIFY = os.environ.get("EXL2_BACKEND_ATTN_STREAM_VERIFY", "1") != "0"


def _device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def attn_streamed(q_shape, cache_shape, device: torch.device, fp16_pages: bool = True) -> bool:
    """Whether paged attention of these shapes (q [B, Tq, Hq, D], cache [P, S, Hkv, ...]; fp16 or code pages) runs
    the streamed kernel: ATTN_STREAM and the shapes it takes, or ATTN_STREAM_FP16 and its tensor-core shapes."""
    if not (ATTN_STREAM or ATTN_STREAM_FP16):
        return False
    _, tq, hq, d = q_shape
    hkv = cache_shape[2]
    g = hq // hkv
    if d != 128 or tq < 1:
        return False
    if fp16_pages and hkv == 8 and g in (1, 2, 4, 8):  # the tensor-core kernel
        return (tq == 1 or (ATTN_STREAM_VERIFY and g * tq <= 64)) and _sm90(_device_index(device))
    return tq == 1 and ATTN_STREAM and hkv in (2, 4, 8) and g in (1, 2, 4) and _sm90(_device_index(device))


def stream_row_tiles(rows: int) -> int:
    """CTAs per split of the tensor-core streamed kernel: one for up to 8 query rows per kv head (a decode step),
    else one per 16 rows."""
    return 1 if rows <= 8 else -(-rows // 16)


def stream_min_split(rows: int) -> int:
    """The shortest split of the streamed kernels, in keys, for `rows` query rows per kv head (G x Tq):
    ATTN_STREAM_MIN_SPLIT up to 8 rows (a decode step), ATTN_STREAM_VERIFY_MIN_SPLIT past them."""
    return ATTN_STREAM_MIN_SPLIT if rows <= 8 else ATTN_STREAM_VERIFY_MIN_SPLIT


def stream_splits(batch: int, max_context: int, num_sms: int, tiles: int = 1, rows: int = 1) -> int:
    """Splits per sequence of the streamed kernel: one CTA per SM over the batch (and its `tiles` row tiles),
    rounded down so the CTAs are one wave (136 CTAs on 132 SMs would run 4 of them as a second wave, ~1.9x the
    time); none under stream_min_split(rows) keys (a function of shapes only: graph-safe)."""
    return max(1, min(num_sms // max(batch * tiles, 1), math.ceil(max_context / stream_min_split(rows))))


def _attn_keys_max(row_tile: int) -> int:
    return 1024 if row_tile <= 8 else 512


# The op implementations as plain functions: the same code the custom ops run, without the dispatcher's
# ~20-25 us per call, for eager hot paths (prefill); the custom ops are what torch.compile traces.
direct = types.SimpleNamespace()


def _op(name: str, mutates: tuple[str, ...] = ()):
    """Register `fn` as the custom op exl2_backend::<name> and keep the plain function in `direct`."""

    def wrap(fn):
        setattr(direct, fn.__name__, fn)
        return torch.library.custom_op(f"exl2_backend::{name}", fn, mutates_args=mutates)

    return wrap


@functools.cache
def _fn(name: str):
    return library.declare(name, *_SIGNATURES[name])


def _call(name: str, *args) -> None:
    library.check(_fn(name)(*args), name)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_guard(t: torch.Tensor):
    """Launches go to the current device: switch only when the tensor lives on another one."""
    if t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _require(cond: bool, msg: str, field: str | None = None) -> None:
    if not cond:
        raise InvalidRequestError(msg, field=field)


def _check(op: str, name: str, t, *, ndim: int | None = None, dtypes=None, device: torch.device | None = None):
    _require(isinstance(t, torch.Tensor), f"{op}: {name} must be a tensor, got {type(t).__name__}", name)
    _require(t.is_cuda, f"{op}: {name} must be on a CUDA device, got {t.device}", name)
    if ndim is not None:
        _require(t.dim() == ndim, f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}", name)
    if dtypes is not None:
        _require(t.dtype in dtypes, f"{op}: {name} dtype {t.dtype} not in {[str(d) for d in dtypes]}", name)
    if device is not None:
        _require(t.device == device, f"{op}: {name} is on {t.device}, expected {device}", name)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> 2-D [T, H] view (copy only when needed) with a contiguous last dim."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _index_tensor(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return t if t.device == device and t.dtype == dtype else t.to(device=device, dtype=dtype)


def _fallback(op: str, why: str):
    return library.reference_fallback(reference, op, why)


# --- rms_norm ----------------------------------------------------------------------------------------


def _norm_weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check("rms_norm", "weight", weight, ndim=1, device=x.device)
    _require(weight.shape[0] == x.shape[-1], f"rms_norm: weight [{weight.shape[0]}] != hidden {x.shape[-1]}", "weight")
    if weight.dtype not in (x.dtype, torch.float32):
        weight = weight.to(x.dtype)
    return weight.contiguous()


def _norm_launch(x2, res2, weight, out2, resout2, eps):
    with _device_guard(x2):
        if res2 is None:
            _call("exl2_rms_norm", x2.data_ptr(), x2.stride(0), weight.data_ptr(), out2.data_ptr(), out2.stride(0),
                  x2.shape[0], x2.shape[1], float(eps), _DTYPE_CODES[x2.dtype], _DTYPE_CODES[weight.dtype],
                  _stream(x2))
        else:
            _call("exl2_add_rms_norm", x2.data_ptr(), x2.stride(0), res2.data_ptr(), res2.stride(0),
                  weight.data_ptr(), out2.data_ptr(), out2.stride(0), resout2.data_ptr(), resout2.stride(0),
                  x2.shape[0], x2.shape[1], float(eps), _DTYPE_CODES[x2.dtype], _DTYPE_CODES[weight.dtype],
                  _stream(x2))


@_op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in x.dtype (fp32 math)."""
    _check("rms_norm", "x", x)
    if x.dtype not in _HALF:
        return _fallback("rms_norm", f"dtype {x.dtype}")(x, weight, eps)
    weight = _norm_weight(weight, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        _norm_launch(_rows(x), None, weight, out.view(-1, x.shape[-1]), None, eps)
    return out


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_op("add_rms_norm")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual), the sum rounded to x.dtype first (as the reference)."""
    _check("add_rms_norm", "x", x)
    _check("add_rms_norm", "residual", residual, dtypes=(x.dtype,), device=x.device)
    _require(residual.shape == x.shape, f"add_rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}",
             "residual")
    if x.dtype not in _HALF:
        return _fallback("add_rms_norm", f"dtype {x.dtype}")(x, residual, weight, eps)
    weight = _norm_weight(weight, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out)
    if x.numel():
        h = x.shape[-1]
        _norm_launch(_rows(x), _rows(residual), weight, out.view(-1, h), res_out.view(-1, h), eps)
    return out, res_out


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format)


@_op("add_rms_norm_", ("residual",))
def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual <- x + residual (in place, rounded to its dtype); returns rms_norm(residual)."""
    _check("add_rms_norm_", "x", x, dtypes=_HALF)
    _check("add_rms_norm_", "residual", residual, dtypes=(x.dtype,), device=x.device)
    _require(residual.shape == x.shape, f"add_rms_norm_: residual {tuple(residual.shape)} != x {tuple(x.shape)}",
             "residual")
    _require(residual.dim() == 2 and residual.stride(-1) == 1 or residual.is_contiguous(),
             "add_rms_norm_: residual must be contiguous (or 2-D with a contiguous last dim)", "residual")
    weight = _norm_weight(weight, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        h = x.shape[-1]
        res2 = residual.view(-1, h) if residual.dim() != 2 else residual
        _norm_launch(_rows(x), res2, weight, out.view(-1, h), res2, eps)
    return out


@add_rms_norm_.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- rotary embedding --------------------------------------------------------------------------------


def _rope_inputs(op, x, positions, inv_freq):
    _check(op, "x", x, ndim=3, dtypes=_HALF)
    t, _, d = x.shape
    _require(d % 2 == 0 and d <= 1024, f"{op}: head_dim {d} must be even and <= 1024", "x")
    _check(op, "inv_freq", inv_freq, ndim=1)
    _require(inv_freq.shape[0] == d // 2, f"{op}: inv_freq [{inv_freq.shape[0]}] != head_dim / 2 = {d // 2}",
             "inv_freq")
    _require(positions.dim() == 1 and positions.shape[0] == t,
             f"{op}: positions {tuple(positions.shape)} must be [{t}]", "positions")
    pos = _index_tensor(positions, x.device, torch.int64)
    inv = _index_tensor(inv_freq, x.device, torch.float32).contiguous()
    return pos, inv


def _rope_launch(q_in, q_out, k_in, k_out, pos, inv):
    d = q_in.shape[2]
    kin = k_in if k_in is not None else q_in
    kout = k_out if k_out is not None else q_out
    hk = k_in.shape[1] if k_in is not None else 0
    with _device_guard(q_in):
        _call("exl2_apply_rope", q_in.data_ptr(), q_in.stride(0), q_in.stride(1), q_out.data_ptr(), q_out.stride(0),
              q_out.stride(1), q_in.shape[1], kin.data_ptr(), kin.stride(0), kin.stride(1), kout.data_ptr(),
              kout.stride(0), kout.stride(1), hk, pos.data_ptr(), inv.data_ptr(), q_in.shape[0], d,
              _DTYPE_CODES[q_in.dtype], _stream(q_in))


@_op("apply_rope")
def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, Hx, D], positions [T] int64, inv_freq [D/2] fp32 -> [T, Hx, D] (NeoX half rotation)."""
    pos, inv = _rope_inputs("apply_rope", x, positions, inv_freq)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _rope_launch(x, out, None, None, pos, inv)
    return out


@apply_rope.register_fake
def _(x, positions, inv_freq):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_op("apply_rope_qk_", ("q", "k"))
def apply_rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place in one launch; both may be strided views (e.g. slices of
    a fused QKV output) as long as the last dim is contiguous."""
    pos, inv = _rope_inputs("apply_rope_qk_", q, positions, inv_freq)
    _check("apply_rope_qk_", "k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    _require(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2],
             f"apply_rope_qk_: k {tuple(k.shape)} does not match q {tuple(q.shape)}", "k")
    _require(q.stride(-1) == 1 and k.stride(-1) == 1, "apply_rope_qk_: q and k need a contiguous last dim", "q")
    if q.numel():
        _rope_launch(q, q, k, k, pos, inv)


@apply_rope_qk_.register_fake
def _(q, k, positions, inv_freq):
    return None


@_op("rope_kv_write", ("q", "k_cache", "v_cache"))
def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """reference.rope_kv_write in one launch: q [T, Hq, D] rotated in place; k [T, Hkv, D] rotated and v
    copied into the caches [P, S, Hkv, D] at slots [T] (negative or past the cache: skipped). q, k, v may be
    strided views (slices of a fused QKV output) with a contiguous last dim."""
    op = "rope_kv_write"
    _check(op, "q", q, ndim=3)
    _check(op, "k_cache", k_cache, ndim=4, device=q.device)
    _check(op, "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=q.device)
    _require(v_cache.shape == k_cache.shape, f"{op}: v_cache {tuple(v_cache.shape)} != k_cache", "v_cache")
    p, s, hkv, d = k_cache.shape
    t = q.shape[0]
    for name, x in (("k", k), ("v", v)):
        _check(op, name, x, ndim=3, device=q.device)
        _require(tuple(x.shape) == (t, hkv, d), f"{op}: {name} {tuple(x.shape)} must be [{t}, {hkv}, {d}]", name)
    _require(q.shape[2] == d, f"{op}: q head_dim {q.shape[2]} != cache head_dim {d}", "q")
    _require(isinstance(slots, torch.Tensor) and slots.dim() == 1 and slots.shape[0] == t,
             f"{op}: slots must be [{t}]", "slots")
    if not (q.dtype in _HALF and k.dtype == q.dtype and v.dtype == q.dtype and k_cache.dtype == q.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1):
        return _fallback(op, f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}, cache {k_cache.dtype} or layout")(
            q, k, v, positions, inv_freq, k_cache, v_cache, slots)
    pos, inv = _rope_inputs(op, q, positions, inv_freq)
    slots = _index_tensor(slots, q.device, torch.int64).contiguous()
    if t:
        with _device_guard(q):
            _call("exl2_rope_kv_write", q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(),
                  k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), hkv, k_cache.data_ptr(),
                  v_cache.data_ptr(), slots.data_ptr(), p * s, pos.data_ptr(), inv.data_ptr(), t, d,
                  _DTYPE_CODES[q.dtype], _stream(q))


@rope_kv_write.register_fake
def _(q, k, v, positions, inv_freq, k_cache, v_cache, slots):
    return None


# --- silu_mul, embedding, kv_cache_write -------------------------------------------------------------


@_op("silu_mul")
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up in gate.dtype (fp32 math). Row-strided views are fine
    (e.g. the two halves of a fused gate/up output)."""
    _check("silu_mul", "gate", gate)
    _check("silu_mul", "up", up, device=gate.device)
    _require(up.shape == gate.shape, f"silu_mul: up {tuple(up.shape)} != gate {tuple(gate.shape)}", "up")
    if gate.dtype not in _HALF or up.dtype != gate.dtype:
        return _fallback("silu_mul", f"dtypes {gate.dtype}, {up.dtype}")(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        g2, u2 = _rows(gate), _rows(up)
        o2 = out.view(-1, gate.shape[-1])
        with _device_guard(gate):
            _call("exl2_silu_mul", g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), o2.data_ptr(),
                  o2.stride(0), g2.shape[0], g2.shape[1], _DTYPE_CODES[gate.dtype], _stream(gate))
    return out


@silu_mul.register_fake
def _(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@_op("embedding")
def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [T] int64, table [V, H] -> [T, H]. An id outside [0, V) gives a zero row (checking would need a
    host sync; the engine validates ids on the host)."""
    _check("embedding", "table", table, ndim=2)
    _require(isinstance(ids, torch.Tensor) and ids.dim() == 1, "embedding: ids must be a 1-D tensor", "ids")
    if table.dtype not in _HALF:
        return _fallback("embedding", f"dtype {table.dtype}")(ids, table)
    ids = _index_tensor(ids, table.device, torch.int64).contiguous()
    table = table if table.is_contiguous() else table.contiguous()
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    if ids.numel():
        with _device_guard(table):
            _call("exl2_embedding", ids.data_ptr(), table.data_ptr(), out.data_ptr(), ids.shape[0], table.shape[0],
                  table.shape[1], _DTYPE_CODES[table.dtype], _stream(table))
    return out


@embedding.register_fake
def _(ids, table):
    return table.new_empty((ids.shape[0], table.shape[1]))


@_op("kv_cache_write", ("k_cache", "v_cache"))
def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (strided views fine) -> caches [P, S, Hkv, D] at slots [T] (page * S + offset), in
    place. Negative slots (padding tokens) and slots past the cache are skipped."""
    op = "kv_cache_write"
    _check(op, "k_cache", k_cache, ndim=4)
    _check(op, "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=k_cache.device)
    _require(v_cache.shape == k_cache.shape, f"{op}: v_cache {tuple(v_cache.shape)} != k_cache", "v_cache")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), f"{op}: caches must be contiguous", "k_cache")
    p, s, hkv, d = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        _check(op, name, t, ndim=3, device=k_cache.device)
        _require(tuple(t.shape[1:]) == (hkv, d), f"{op}: {name} {tuple(t.shape)} must be [T, {hkv}, {d}]", name)
    _require(v.shape[0] == k.shape[0] and slots.dim() == 1 and slots.shape[0] == k.shape[0],
             f"{op}: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)} disagree on T", "slots")
    if k_cache.element_size() != 2:
        return _fallback(op, f"cache dtype {k_cache.dtype}")(k, v, k_cache, v_cache, slots)
    k = k.to(k_cache.dtype) if k.dtype != k_cache.dtype else k
    v = v.to(k_cache.dtype) if v.dtype != k_cache.dtype else v
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slots = _index_tensor(slots, k_cache.device, torch.int64).contiguous()
    if k.shape[0]:
        with _device_guard(k_cache):
            _call("exl2_kv_cache_write", k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
                  v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k.shape[0], p * s, hkv, d,
                  2, _stream(k_cache))


@kv_cache_write.register_fake
def _(k, v, k_cache, v_cache, slots):
    return None


# --- paged attention ---------------------------------------------------------------------------------


def attention_splits(batch: int, q_len: int, hq: int, hkv: int, max_context: int, num_sms: int,
                     ctas_per_sm: int = _ATTN_CTAS_PER_SM, row_tile: int = 0, tiles_per_cta: int = 1) -> int:
    """Splits of each sequence's context: as many CTAs as one wave of `ctas_per_sm` per SM holds, each split
    within the shared-memory limit of its tile, none pointlessly short. A function of shapes only (graph-safe).
    row_tile: the kernel's rows per tile (0: the CUDA-core kernel's, _attn_row_tile; MMA_ROW_TILE for the
    tensor-core kernels), tiles_per_cta of them per CTA.

    The CTA count rounds down: a kernel whose registers allow exactly `ctas_per_sm` resident CTAs (the
    tensor-core attention kernel: 128 registers, 4) would otherwise run the few CTAs past the wave as a second
    wave of their own (3 per SM with 8 kv heads: 50 splits = 400 CTAs for 396 slots; 49 = 392 fit)."""
    rows = (hq // hkv) * q_len
    rt = row_tile or _attn_row_tile(rows)
    base = batch * hkv * math.ceil(math.ceil(rows / rt) / tiles_per_cta)
    need = math.ceil(max_context / _attn_keys_max(rt))
    want = num_sms * ctas_per_sm // max(base, 1)
    cap = max(1, math.ceil(max_context / _ATTN_MIN_SPLIT))
    return max(need, min(want, cap), 1)


@_op("paged_attention")
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, num_splits: int = 0) -> torch.Tensor:
    """q [B, Tq, Hq, D], caches [P, S, Hkv, D], block_tables [B, max_pages] int32, context_lens [B] int32
    -> [B, Tq, Hq, D]. Query j of sequence b sits at position context_lens[b] - Tq + j (causal). num_splits 0
    picks the split of the context automatically (attention_splits)."""
    op = "paged_attention"
    _check(op, "q", q, ndim=4)
    _check(op, "k_cache", k_cache, ndim=4, device=q.device)
    _check(op, "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=q.device)
    b, tq, hq, d = q.shape
    _, _, hkv, dk = k_cache.shape
    _require(v_cache.shape == k_cache.shape, f"{op}: v_cache {tuple(v_cache.shape)} != k_cache", "v_cache")
    check_attention_args(op, q.shape, hkv, dk, "k_cache", block_tables, context_lens, num_splits)
    why = _attention_kernel_declines(q, k_cache, v_cache)
    if why is not None:
        return _fallback(op, why)(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b == 0 or tq == 0 or hq == 0:
        return out
    q, tables, lens = _attention_inputs(op, q, block_tables, context_lens)
    streamed = attn_streamed(q.shape, k_cache.shape, q.device)
    if streamed:
        rows = (hq // hkv) * tq
        nsplit = num_splits or stream_splits(b, tables.shape[1] * k_cache.shape[1], _num_sms(_device_index(q.device)),
                                             stream_row_tiles(rows), rows)
    else:
        nsplit = _attention_nsplit(q.shape, k_cache.shape, tables.shape[1], q.device, num_splits)
    ws = torch.empty(b * tq * hq * nsplit * (d + 2), dtype=torch.float32, device=q.device) if nsplit > 1 else None
    tickets = None
    if nsplit > 1 and _attn_tickets_enabled() and not streamed:
        tickets = _ticket_buffer(q.device, b * hkv * math.ceil((hq // hkv) * tq / _attn_row_tile((hq // hkv) * tq)))
    _launch_paged_attention(q, k_cache, v_cache, tables, lens, out, ws, nsplit, scale, tickets, streamed)
    return out


def check_attention_args(op: str, q_shape, hkv: int, cache_head_dim: int, cache_field: str, block_tables,
                         context_lens, num_splits: int) -> None:
    """The checks the paged-attention ops (fp16 and code pages) share: q [B, Tq, Hq, D] against the cache's kv heads
    and head_dim, block_tables [B, max_pages], context_lens [B], num_splits >= 0."""
    b, _, hq, d = q_shape
    _require(cache_head_dim == d, f"{op}: cache head_dim {cache_head_dim} != q head_dim {d}", cache_field)
    _require(hkv > 0 and hq % hkv == 0, f"{op}: {hq} query heads not a multiple of {hkv} kv heads", "q")
    _require(isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2 and block_tables.shape[0] == b,
             f"{op}: block_tables must be [{b}, max_pages]", "block_tables")
    _require(isinstance(context_lens, torch.Tensor) and context_lens.dim() == 1 and context_lens.shape[0] == b,
             f"{op}: context_lens must be [{b}]", "context_lens")
    _require(num_splits >= 0, f"{op}: num_splits must be >= 0", "num_splits")


def attention_kernel_declines(q: torch.Tensor, page_size: int) -> str | None:
    """Why the paged-attention kernels (fp16 and code pages alike) do not take a query q [B, Tq, Hq, D] over pages of
    `page_size` tokens, or None where they do: head_dim 64 or 128, fp16, a power-of-two page of at least 16."""
    d = q.shape[3]
    if d not in (64, 128):
        return f"head_dim {d}"
    if q.dtype != torch.float16:
        return f"q dtype {q.dtype}"
    if page_size < 16 or page_size & (page_size - 1):
        return f"page size {page_size}"
    return None


def _attention_kernel_declines(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the fp16 paged-attention kernel does not take these (checked) inputs, or None where it does: the shared
    conditions, then an fp16, contiguous cache."""
    why = attention_kernel_declines(q, k_cache.shape[1])
    if why is None and k_cache.dtype != torch.float16:
        why = f"cache dtype {k_cache.dtype}"
    if why is None and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        why = "non-contiguous cache"
    return why


def _attention_inputs(op: str, q: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q with 16-byte aligned rows (a copy where needed), block_tables and context_lens as int32 on q's device."""
    if q.stride(-1) != 1 or any(st % 8 for st in q.stride()[:3]) or q.data_ptr() % 16:
        q = q.contiguous()
    tables = _index_tensor(block_tables, q.device, torch.int32)
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    lens = _index_tensor(context_lens, q.device, torch.int32).contiguous()
    _require(tables.shape[1] > 0, f"{op}: block_tables has no columns", "block_tables")
    return q, tables, lens


def _attention_nsplit(q_shape, cache_shape, max_pages: int, device: torch.device, num_splits: int = 0) -> int:
    """The splits paged_attention cuts each context into (a function of shapes: graph-safe)."""
    b, tq, hq, _ = q_shape
    _, s, hkv, _ = cache_shape
    max_ctx = max_pages * s
    dev_index = _device_index(device)
    rows = (hq // hkv) * tq
    mma = _attn_fp16_mma(rows)
    ctas = _ATTN_CTAS_PER_SM
    if mma and not _ATTN_CTAS_ENV:
        ctas = attn_mma_ctas("fp16", "fp16", rows, _ATTN_CTAS_PER_SM)
    nsplit = num_splits or attention_splits(b, tq, hq, hkv, max_ctx, _num_sms(dev_index), ctas,
                                            MMA_ROW_TILE if mma else 0, attn_tiles_per_cta(rows=rows) if mma else 1)
    return max(nsplit, math.ceil(max_ctx / _attn_keys_max(_attn_row_tile(rows))))


def _launch_paged_attention(q, k_cache, v_cache, tables, lens, out, ws, nsplit: int, scale: float, tickets,
                            streamed: bool = False) -> None:
    b, tq, hq, d = q.shape
    p, s, hkv, _ = k_cache.shape
    flags = _ATTN_STREAM_FLAG if streamed else _attn_flags((hq // hkv) * tq)
    min_split = stream_min_split((hq // hkv) * tq) if streamed else _ATTN_MIN_SPLIT
    with _device_guard(q):
        _call("exl2_paged_attention", q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k_cache.data_ptr(),
              v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
              ws.data_ptr() if ws is not None else None, b, tq, hq, hkv, d, p, s, tables.shape[1], nsplit,
              min_split, float(scale), flags, tickets.data_ptr() if tickets is not None else None, _stream(q))


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# --- sampling ----------------------------------------------------------------------------------------


@_op("sample_tokens")
def sample_tokens_tensor(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor,
                         probs: torch.Tensor | None = None) -> torch.Tensor:
    """logits, uniforms [B, V] f32, temperature [B] f32 (0 = greedy) -> int64 [B], one kernel, no host sync.
    Rows with T > 0 race argmax p / max(-log(u), 2^-25) over p = softmax(logits / T), or over `probs` when given
    (the output of filtered_probs)."""
    op = "sample_tokens"
    _check(op, "logits", logits, ndim=2, dtypes=(torch.float32,))
    b, v = logits.shape
    _check(op, "uniforms", uniforms, ndim=2, dtypes=(torch.float32,), device=logits.device)
    _check(op, "temperature", temperature, ndim=1, dtypes=(torch.float32,), device=logits.device)
    _require(uniforms.shape == logits.shape, f"{op}: uniforms {tuple(uniforms.shape)} != logits {(b, v)}", "uniforms")
    _require(temperature.shape[0] == b, f"{op}: temperature must be [{b}]", "temperature")
    if probs is not None:
        _check(op, "probs", probs, ndim=2, dtypes=(torch.float32,), device=logits.device)
        _require(probs.shape == logits.shape, f"{op}: probs {tuple(probs.shape)} != logits", "probs")
        probs = probs if probs.stride(1) == 1 else probs.contiguous()
    _require(v > 0, f"{op}: empty vocabulary", "logits")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    launch_sampler(logits, uniforms, temperature, probs, out.data_ptr())
    return out


def launch_sampler(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor,
                   probs: torch.Tensor | None, out_address: int) -> None:
    """The sampler kernel over checked inputs (B >= 1 rows), its int64 [B] tokens written at `out_address`: a
    device tensor's data, or pinned host memory's device address (ops/cuda_decode_io.py)."""
    b, v = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    uniforms = uniforms if uniforms.stride(1) == 1 else uniforms.contiguous()
    temperature = temperature.contiguous()
    nchunk = -(-v // _SAMPLE_CHUNK)
    partials = torch.empty(b * nchunk * 4, dtype=torch.float32, device=logits.device)
    counters = _ticket_buffer(logits.device, b, "sample")  # left at zero by the kernel's last CTA of each row
    if counters is None:
        counters = torch.zeros(b, dtype=torch.int32, device=logits.device)
    with _device_guard(logits):
        _call("exl2_sample_tokens", logits.data_ptr(), logits.stride(0),
              probs.data_ptr() if probs is not None else None, probs.stride(0) if probs is not None else 0,
              uniforms.data_ptr(), uniforms.stride(0), temperature.data_ptr(), partials.data_ptr(),
              counters.data_ptr(), out_address, b, v, _stream(logits))


@sample_tokens_tensor.register_fake
def _(logits, uniforms, temperature, probs=None):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


_zero_temperatures: dict[torch.device, torch.Tensor] = {}
_retired_zeros: list[torch.Tensor] = []  # superseded zero temperatures, kept alive for the graphs using them


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """reference.greedy_tokens on the GPU: logits [B, V] f32 -> int64 [B] on the device (ties to the lowest id, NaN
    the largest, as torch.argmax), no host sync: the sampler kernel with every temperature 0, V / 2048 CTAs per row.
    torch.argmax reduces one row of the 8B's 128k logits in 27 us (H200 call AL1 of 2026-12-04, an engine decode
    step's largest kernel outside its graph). Greedy rows never read their uniforms, so the logits stand in for
    them (the same shape and strides)."""
    _check("greedy_tokens", "logits", logits, ndim=2, dtypes=(torch.float32,))
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    return direct.sample_tokens_tensor(logits, logits, zero_temperatures(logits.device, logits.shape[0]))


def zero_temperatures(device: torch.device, b: int) -> torch.Tensor:
    """f32 [b] zeros on `device` (every row greedy), kept per device unless made under graph capture. A graph
    captured with one holds its address, so a larger one replaces it without freeing it (_retired_zeros): freed,
    its memory could be reused and the graph's rows would sample with nonzero temperatures."""
    zeros = _zero_temperatures.get(device)
    if zeros is None or zeros.numel() < b:
        fresh = torch.zeros(max(b, 64), dtype=torch.float32, device=device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a tensor of the graph's pool is not kept
            if zeros is not None:
                _retired_zeros.append(zeros)
            _zero_temperatures[device] = fresh
        zeros = fresh
    return zeros[:b]


def sampling_param_tensors(params, vocab: int, device) -> dict[str, torch.Tensor]:
    """Per-row parameters as [B] device tensors (temperature, top_k with 0/out-of-range -> vocab, top_p, min_p,
    repetition/frequency/presence penalties), copied without a host sync."""
    rows = [[p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p, p.repetition_penalty,
             p.frequency_penalty, p.presence_penalty] for p in params]
    t = to_device(rows, torch.float32, torch.device(device)).reshape(len(params), 7)
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
    out = {n: t[:, i] for i, n in enumerate(names)}
    out["top_k"] = out["top_k"].long()  # exact: vocab < 2^24
    return out


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, filters: frozenset = frozenset(("top_k", "top_p", "min_p"))) -> torch.Tensor:
    """reference_sampling.sampling_probs for the sampled rows, from [B] device parameter tensors: the same torch
    ops in the same order, so the same bits on the same device (on the GPU the reference sorts the whole row too:
    descending_sort bounds only CPU tensors). Greedy rows are left to the kernel. A filter left out of `filters`
    (no row of the batch uses it; active_filters) is skipped: it would leave every row as it is, so the bits do
    not change, and each costs ~4 passes over [B, V] (a 128k vocabulary)."""
    b, v = logits.shape
    temp, top_k, top_p, min_p = (t.reshape(b, 1) for t in (temperature, top_k, top_p, min_p))
    greedy = temp == 0
    probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, temp), dim=-1)  # [B, V]
    sp, idx = torch.sort(probs, dim=-1, descending=True, stable=True)

    def keep(mask, active):
        kept = torch.where(mask, sp, 0.0)
        return torch.where(active, kept / kept.sum(-1, keepdim=True), sp)

    if "top_k" in filters:
        sp = keep(torch.arange(v, device=logits.device)[None, :] < top_k, top_k < v)  # rank < k
    if "top_p" in filters:
        before = torch.cat((sp.new_zeros(b, 1), torch.cumsum(sp, -1)[:, :-1]), dim=-1)
        sp = keep(before < top_p, top_p < 1.0)
    if "min_p" in filters:
        sp = keep(sp >= min_p * sp[:, :1], min_p > 0.0)
    return torch.zeros_like(sp).scatter_(-1, idx, sp)


def sample_tokens(logits: torch.Tensor, params, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """reference.sample_tokens on the GPU: logits [B, V] f32, params list[SamplingParams], uniforms [B, V] f32 in
    (0, 1] (None: drawn from the global torch RNG) -> int64 [B] on the device, no host sync. Greedy and
    temperature-only batches are one kernel; with EXL2_BACKEND_FUSED_TOP_K=1, rows with a top-k of at most 64 one
    other (ops/cuda_sampling_top_k.py); other top-k/top-p/min-p rows go through filtered_probs (sort) first."""
    _check("sample_tokens", "logits", logits, ndim=2)
    b, v = logits.shape
    _require(len(params) == b, f"sample_tokens: {len(params)} params for {b} rows", "params")
    logits = logits.float()
    if uniforms is None:
        uniforms = 1.0 - torch.rand(b, v, dtype=torch.float32, device=logits.device)
    uniforms = uniforms.to(device=logits.device, dtype=torch.float32)
    from exl2_backend.ops.cuda_sampling_top_k import top_k_kernel_rows

    fused = top_k_kernel_rows(params, v)
    if any(fused):  # rows with a small top-k: one kernel (ops/cuda_sampling_top_k.py); the choice is per row
        if all(f or p.temperature == 0 for f, p in zip(fused, params)):  # greedy rows are its top-1
            return _sample_top_k(logits, uniforms, params)
        return _sample_split(logits, uniforms, params, fused)
    pt = sampling_param_tensors(params, v, logits.device)
    probs = None
    filters = active_filters(params, v)
    if filters:  # the sort-based path
        probs = filtered_probs(logits, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"], filters)
    return direct.sample_tokens_tensor(logits, uniforms, pt["temperature"], probs)


def _sample_top_k(logits: torch.Tensor, uniforms: torch.Tensor, params) -> torch.Tensor:
    from exl2_backend.ops.cuda_sampling_top_k import sample_top_k

    v = logits.shape[1]
    pt = sampling_param_tensors(params, v, logits.device)
    without = any(p.temperature != 0 and not 0 < p.top_k < v for p in params)  # the kernel's histograms needed
    return sample_top_k(logits, uniforms, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"], without)


def _sample_split(logits: torch.Tensor, uniforms: torch.Tensor, params, fused: list[bool]) -> torch.Tensor:
    """A batch whose rows go two ways: the top-k kernel's rows and the others, each sampled apart (no host sync)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for way in (True, False):
        rows = [i for i, f in enumerate(fused) if f == way]
        if not rows:
            continue
        idx = to_device(rows, torch.int64, logits.device)  # [n]
        sub = [params[i] for i in rows]
        sub_logits, sub_uniforms = logits.index_select(0, idx), uniforms.index_select(0, idx)  # [n, V]
        part = _sample_top_k(sub_logits, sub_uniforms, sub) if way else sample_tokens(sub_logits, sub, sub_uniforms)
        out.index_copy_(0, idx, part)
    return out


def apply_penalties(logits, prompt_counts, output_counts, params) -> torch.Tensor:
    """reference_sampling.apply_penalties with the parameters copied without a host sync (same torch ops)."""
    pt = sampling_param_tensors(params, logits.shape[-1], logits.device)
    rp, fp, pp = (pt[n][:, None] for n in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    dev = logits.device
    out = logits.float().clone()
    oc = output_counts.to(device=dev, dtype=torch.float32)
    seen = (prompt_counts.to(dev) > 0) | (oc > 0)
    penalized = torch.where(out > 0, out / rp, out * rp)
    out = torch.where(seen & (rp != 1.0), penalized, out)
    return out - (fp * oc + pp * (oc > 0).float())


__all__ = [
    "add_rms_norm",
    "add_rms_norm_",
    "apply_penalties",
    "apply_rope",
    "apply_rope_qk_",
    "attention_splits",
    "direct",
    "embedding",
    "filtered_probs",
    "greedy_tokens",
    "kv_cache_write",
    "paged_attention",
    "rms_norm",
    "rope_kv_write",
    "sample_tokens",
    "sample_tokens_tensor",
    "sampling_param_tensors",
    "silu_mul",
]
