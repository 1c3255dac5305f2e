"""Prefill attention on the GPU: gather a sequence's pages into contiguous K/V and run torch SDPA.

The paged decode kernel is built for a few queries per sequence (decode, verify); a prefill chunk has up
to max_chunk_size queries, which want tensor cores. The backends are pinned to flash / memory-efficient:
torch's cuDNN SDPA builds a new plan for every new key length (architecture.md, measured 2.3 ms of CPU
per call), so it must never be picked implicitly. Same semantics as reference.paged_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def prefill_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """q [B, Tq, Hq, D], caches [P, S, Hkv, D], block_tables [B, max_pages] int32, context_lens [B] int32
    -> [B, Tq, Hq, D]. Query j of sequence b sits at position context_lens[b] - Tq + j (causal)."""
    b_, tq, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    grp = hq // hkv
    out = torch.empty_like(q)
    lens = context_lens.tolist()  # eager prefill only: one host read per chunk is fine
    for b in range(b_):
        n = int(lens[b])
        pages = block_tables[b, : -(-n // s)].long()
        k = k_cache.index_select(0, pages).reshape(-1, hkv, d)[:n]  # [n, Hkv, D]
        v = v_cache.index_select(0, pages).reshape(-1, hkv, d)[:n]
        if grp > 1:
            k = k.repeat_interleave(grp, dim=1)  # [n, Hq, D]
            v = v.repeat_interleave(grp, dim=1)
        qb = q[b].transpose(0, 1)[None]  # [1, Hq, Tq, D]
        kb = k.transpose(0, 1)[None].to(q.dtype)  # [1, Hq, n, D]
        vb = v.transpose(0, 1)[None].to(q.dtype)
        with sdpa_kernel(_BACKENDS):
            if n == tq:
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
            else:
                # Bottom-right aligned causal mask: the chunk follows n - tq cached tokens.
                qpos = torch.arange(n - tq, n, device=q.device)[:, None]  # [Tq, 1]
                mask = torch.arange(n, device=q.device)[None, :] <= qpos  # [Tq, n]
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        out[b] = o[0].transpose(0, 1)
    return out
