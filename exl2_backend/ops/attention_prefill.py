"""Prefill attention on the GPU: a chunk of queries against its own keys and the cached history, in blocks.

The paged decode kernel is built for a few queries per sequence (decode, verify); a prefill chunk has up to
max_chunk_size queries, which want tensor cores (flash attention). Memory is bounded by the chunk, not by
the context: the chunk first attends causally to its own Tq keys, then to the history in blocks of at most
`key_block` keys gathered from their pages, and the partial results are merged with their log-sum-exps
(the flash-decoding combine). Scratch per sequence: the gathered pages of one block, the GQA-expanded K/V
of the chunk itself, and a few [Hq, Tq, D] buffers (runtime/scratch.py counts them). No mask tensor is ever
built: the self block is plain causal and history blocks are fully visible.

History blocks fold the query heads of a KV-head group into the query length ([Hkv, G*Tq, D] against
[Hkv, Kb, D]), so GQA needs no expanded copy of the history. The attention calls are torch's flash op
(returns the log-sum-exp), then the memory-efficient op, then a plain fp32 matmul version (CPU tests, or
shapes neither kernel takes); torch's cuDNN SDPA is never reached (architecture.md: its per-key-length
planning costs milliseconds of CPU). Same semantics as reference.paged_attention.
"""

from __future__ import annotations

import logging

import torch

from exl2_backend.errors import InvalidRequestError

log = logging.getLogger("exl2_backend")

KEY_BLOCK = 8192  # history keys per attention call; bounds the gathered K/V of one block


def _attend_math(q, k, v, causal: bool, scale: float):
    """q [1, H, Lq, D], k/v [1, H, Lk, D] -> (out [1, H, Lq, D] in q.dtype, lse [1, H, Lq] f32)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [1, H, Lq, Lk]
    if causal:  # Lq == Lk: query i sees keys <= i
        lq = q.shape[2]
        s = s.masked_fill(torch.ones(lq, lq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype), lse


def _attend_flash(q, k, v, causal: bool, scale: float):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _attend_efficient(q, k, v, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                      scale=scale)[:2]
    return out, lse[..., : q.shape[2]]  # lse may be padded along the query length


_KERNELS = {"flash": _attend_flash, "efficient": _attend_efficient, "math": _attend_math}
_failed: set[tuple[str, torch.dtype, int]] = set()  # (kernel, dtype, head_dim) that raised once


def _attend(q, k, v, causal: bool, scale: float):
    """The first kernel that takes these inputs: flash, memory-efficient, fp32 math (CPU: math only)."""
    names = ("flash", "efficient", "math") if q.is_cuda else ("math",)
    for name in names:
        key = (name, q.dtype, q.shape[-1])
        if name != "math" and key in _failed:
            continue
        try:
            return _KERNELS[name](q, k, v, causal, scale)
        except RuntimeError as exc:
            if name == "math":
                raise
            _failed.add(key)
            log.warning("exl2_backend: prefill attention: %s kernel unavailable for %s, D=%d (%s); trying the next",
                        name, q.dtype, q.shape[-1], str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    raise AssertionError("unreachable")


def _gather(k_cache, v_cache, table_row, start: int, end: int):
    """Keys/values of positions [start, end) of one sequence -> k, v [end - start, Hkv, D] (copies of the
    pages covering them: at most end - start + 2 * S slots are read)."""
    s, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    first, last = start // s, -(-end // s)
    pages = table_row[first:last].long()
    off = start - first * s
    k = k_cache.index_select(0, pages).reshape(-1, hkv, d)[off : off + end - start]
    v = v_cache.index_select(0, pages).reshape(-1, hkv, d)[off : off + end - start]
    return k, v


def _merge_(acc, acc_lse, o, lse) -> None:
    """acc [H, Tq, D] f32, acc_lse [H, Tq] f32 <- the softmax-weighted union with (o [H, Tq, D], lse [H, Tq])."""
    m = torch.maximum(acc_lse, lse)
    wa, wb = torch.exp(acc_lse - m), torch.exp(lse - m)  # [H, Tq]
    den = wa + wb
    acc.mul_((wa / den).unsqueeze(-1)).add_(o.float().mul_((wb / den).unsqueeze(-1)))
    acc_lse.copy_(m + torch.log(den))


def _one_sequence(q, k_cache, v_cache, table_row, n: int, scale: float, key_block: int) -> torch.Tensor:
    """q [Tq, Hq, D] of one sequence whose chunk ends at position n -> [Tq, Hq, D]."""
    tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    grp = hq // hkv
    hist = n - tq
    # 1. the chunk against its own keys: causal, K/V expanded to the query heads (Tq rows: chunk-sized)
    k, v = _gather(k_cache, v_cache, table_row, hist, n)  # [Tq, Hkv, D]
    if grp > 1:
        k, v = k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1)  # [Tq, Hq, D]
    qh = q.transpose(0, 1)[None]  # [1, Hq, Tq, D]
    o, lse = _attend(qh, k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype), True, scale)
    del k, v
    if hist <= 0:
        return o[0].transpose(0, 1)
    acc, acc_lse = o[0].float(), lse[0].float().clone()  # [Hq, Tq, D], [Hq, Tq]
    del o, lse
    # 2. the history in blocks, all keys visible; query heads of a group folded into the query length
    qf = q.reshape(tq, hkv, grp, d).permute(1, 2, 0, 3).reshape(1, hkv, grp * tq, d)  # [1, Hkv, G*Tq, D]
    for k0 in range(0, hist, key_block):
        k, v = _gather(k_cache, v_cache, table_row, k0, min(hist, k0 + key_block))  # [Kb, Hkv, D]
        o, lse = _attend(qf, k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype), False, scale)
        del k, v
        _merge_(acc, acc_lse, o.reshape(hq, tq, d), lse.reshape(hq, tq).float())
        del o, lse
    return acc.transpose(0, 1)


def prefill_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                      key_block: int = KEY_BLOCK) -> torch.Tensor:
    """q [B, Tq, Hq, D], caches [P, S, Hkv, D], block_tables [B, max_pages] int32, context_lens [B] int32
    -> [B, Tq, Hq, D]. Query j of sequence b sits at position context_lens[b] - Tq + j (causal)."""
    b_, tq = q.shape[:2]
    if key_block < 1:
        raise InvalidRequestError(f"key_block must be >= 1, got {key_block}", field="key_block")
    out = torch.empty_like(q)
    lens = context_lens.tolist()  # eager prefill only: one host read per chunk is fine
    for b in range(b_):
        n = int(lens[b])
        if n < tq:
            raise InvalidRequestError(f"context_lens[{b}] = {n} is shorter than the chunk ({tq} queries)",
                                      field="context_lens")
        out[b] = _one_sequence(q[b], k_cache, v_cache, block_tables[b], n, scale, key_block).to(q.dtype)
    return out
