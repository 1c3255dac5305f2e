"""Sampled rows with a small top-k, or with top-p / min-p and no top-k, on the GPU in one kernel
(csrc/layers/sampling_top_k.cu, sample_nucleus.cuh), where the torch filter path (cuda_layers.filtered_probs)
sorts the whole vocabulary and runs ~20 kernels: 154 us of GPU time for top-k 50 + top-p 0.9 on one 128k row
(H200, scripts/filter_cost.py --profile, 2026-12-05), a sampled token at 1.11x a greedy one.

Rows with a top-k of at most 64: the row's top k tokens from per-chunk candidates, top-p and min-p applied inside
them, and the exponential race. Rows without a top-k: the same when the kept tokens are among the row's best 64
(a peaked distribution), else the chunks' histograms over bins of 1/32 nat find the top-p boundary's bin, whose
tokens alone are sorted. Rows with a top-k above 64 keep the torch path.

`top_k_kernel_rows` says which rows it takes (vocabularies up to 131,072 tokens); the choice is per row, so a
row's token does not depend on the rows beside it. On by default; EXL2_BACKEND_FUSED_TOP_K=0 sends every filtered
row through the torch path (the tests compare both)."""

from __future__ import annotations

import functools
import os

import torch

from exl2_backend.ops import library
from exl2_backend.ops.cuda_layers import _check, _device_guard, _require, _stream, _ticket_buffer
from exl2_backend.ops.library import I64, PTR, STREAM

TOP_K_KERNEL_MAX = 64  # csrc/layers/sampling_top_k.cu KMAX
TOP_K_KERNEL_MAX_VOCAB = 131072  # CHUNK * MAX_CHUNKS there
_CHUNK, _SLOT, _HIST = 2048, TOP_K_KERNEL_MAX + 2, 6657  # sample_nucleus.cuh CHUNK, SLOT, HIST (uint64 words)
_ROWS_PER_LAUNCH = 8  # rows per launch: rows without a top-k take ~3.4 MB of workspace each at a 128k vocabulary
FUSED_TOP_K = os.environ.get("EXL2_BACKEND_FUSED_TOP_K", "1") == "1"

_SIGNATURE = (PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, I64, STREAM)


@functools.cache
def _kernel():
    return library.declare("exl2_sample_top_k", *_SIGNATURE)


def top_k_kernel_rows(params, vocab: int) -> list[bool]:
    """Per row (host-side parameters): whether the kernel samples it. Sampled rows with a top-k of at most 64, or
    with none and top-p or min-p on (temperature-only rows take the plain sampler kernel)."""
    if not FUSED_TOP_K or vocab > TOP_K_KERNEL_MAX_VOCAB:
        return [False] * len(params)
    return [p.temperature != 0 and (0 < p.top_k <= TOP_K_KERNEL_MAX and p.top_k < vocab
                                    or not 0 < p.top_k < vocab and (p.top_p < 1.0 or p.min_p > 0.0))
            for p in params]


@torch.library.custom_op("exl2_backend::sample_top_k", mutates_args=())
def sample_top_k(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, without_top_k: bool = True) -> torch.Tensor:
    """logits, uniforms [B, V] f32 (V <= 131072), temperature [B] f32 (0: greedy), top_k [B] int64 (1..64 for
    sampled rows, above 64 for none: sampling_param_tensors gives V), top_p, min_p [B] f32 -> int64 [B] tokens (-1
    for a row whose logits hold a NaN or +inf), one kernel per 8 rows, no host sync."""
    op = "sample_top_k"
    _check(op, "logits", logits, ndim=2, dtypes=(torch.float32,))
    b, v = logits.shape
    _require(0 < v <= TOP_K_KERNEL_MAX_VOCAB, f"{op}: vocabulary {v} outside 1..{TOP_K_KERNEL_MAX_VOCAB}", "logits")
    _check(op, "uniforms", uniforms, ndim=2, dtypes=(torch.float32,), device=logits.device)
    _require(uniforms.shape == logits.shape, f"{op}: uniforms {tuple(uniforms.shape)} != logits {(b, v)}", "uniforms")
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)):
        _check(op, name, t, ndim=1, dtypes=(dtype,), device=logits.device)
        _require(t.shape[0] == b, f"{op}: {name} must be [{b}]", name)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    uniforms = uniforms if uniforms.stride(1) == 1 else uniforms.contiguous()
    nchunk = -(-v // _CHUNK)
    rows = min(b, _ROWS_PER_LAUNCH)
    cand = torch.empty(rows * nchunk * _SLOT, dtype=torch.int64, device=logits.device)
    # without_top_k False: the caller knows no sampled row lacks a top-k (rows above 64 would then keep the top 64),
    # so the histogram workspace (~3.4 MB a row at 128k) is not allocated
    hist = torch.empty(rows * nchunk * _HIST if without_top_k else 0, dtype=torch.int64, device=logits.device)
    counters = _ticket_buffer(logits.device, rows, "sample_top_k")  # left at zero by each row's last CTA
    if counters is None:
        counters = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    # Contiguous copies held until the launch: a temporary freed inside the argument list goes back to the caching
    # allocator, and the next one's copy may overwrite it before the kernel reads it (AW1 of 2026-12-05: the
    # parameters of sampling_param_tensors are strided views, and temperature read min_p's values).
    temperature, top_k, top_p, min_p = (t.contiguous() for t in (temperature, top_k, top_p, min_p))
    with _device_guard(logits):
        for r0 in range(0, b, rows):  # blocks of rows: the workspace stays under ~28 MB at a 128k vocabulary
            n = min(rows, b - r0)
            library.check(_kernel()(
                logits[r0].data_ptr(), logits.stride(0), uniforms[r0].data_ptr(), uniforms.stride(0),
                temperature[r0].data_ptr(), top_k[r0].data_ptr(), top_p[r0].data_ptr(), min_p[r0].data_ptr(),
                cand.data_ptr(), hist.data_ptr() if without_top_k else None, counters.data_ptr(), out[r0].data_ptr(),
                n, v, _stream(logits)), op)
    return out


@sample_top_k.register_fake
def _(logits, uniforms, temperature, top_k, top_p, min_p, without_top_k=True):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)
