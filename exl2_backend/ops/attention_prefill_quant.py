"""Prefill attention over a quantized KV cache on the GPU: `attention_prefill.prefill_attention` run on views of
the quantized caches that dequantize the pages it gathers, and only those.

The decode kernel reads quantized pages directly; a prefill chunk has up to max_chunk_size queries per
sequence, where tensor-core SDPA wins. prefill_attention reads a cache only through `shape` and
`index_select(0, pages)` (one key block of one sequence at a time), so the fp16 copies made here are bounded by
its key block, never by the context or the cache size.
"""

from __future__ import annotations

import torch

from exl2_backend.cache.kv_types import GROUP
from exl2_backend.ops.attention_prefill import prefill_attention


class DequantizedPages:
    """Read-only stand-in for an fp16 cache tensor [P, S, Hkv, D] over quantized pages (codes uint8
    [P, S, Hkv, D * bits / 8], scales fp16 [P, S, Hkv, D / 32]): `index_select(0, pages)` dequantizes those pages."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype):
        p, s, hkv, g = scales.shape
        self.codes, self.scales, self.fmt = codes, scales, fmt
        self.shape = torch.Size((p, s, hkv, g * GROUP))
        self.dtype = dtype
        self.device = codes.device

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError("DequantizedPages only selects pages (dim 0)")
        from exl2_backend.ops import dispatch

        return dispatch.dequantize_pages(self.codes, self.scales, index.long(), self.fmt, self.dtype)  # [n, S, Hkv, D]


def prefill_attention_quant(q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale: float,
                            k_fmt: str, v_fmt: str) -> torch.Tensor:
    """q [B, Tq, Hq, D], quantized caches (ops/reference_kvquant.py layout) -> [B, Tq, Hq, D]; the semantics of
    reference.paged_attention."""
    k = DequantizedPages(k_codes, k_scales, k_fmt, q.dtype)
    v = DequantizedPages(v_codes, v_scales, v_fmt, q.dtype)
    return prefill_attention(q, k, v, block_tables, context_lens, scale)
