"""One decoder layer (attention + MLP) over prepared linear ops, and the per-step attention metadata."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from exl2_backend import ops
from exl2_backend.model.tp_shard import fold_down_order

# Rope of q and k plus the KV-cache write as one op (ops.rope_kv_write); EXL2_BACKEND_FUSED_ROPE_KV=0 runs the
# three ops apart (same values), for A/B timing.
FUSED_ROPE_KV = os.environ.get("EXL2_BACKEND_FUSED_ROPE_KV", "1") != "0"
# silu_mul folded into the down projection's GEMV (CUDA, small M); EXL2_BACKEND_FUSED_SILU_DOWN=0 for A/B timing.
FUSED_SILU_DOWN = os.environ.get("EXL2_BACKEND_FUSED_SILU_DOWN", "1") != "0"
# rms_norm folded into the GEMV after it (q/k/v, gate/up, head; CUDA TMA GEMV, small M: CudaLinearOp.add_normed);
# EXL2_BACKEND_FUSED_NORM=0 runs add_rms_norm apart (same bits), for A/B timing.
FUSED_NORM = os.environ.get("EXL2_BACKEND_FUSED_NORM", "1") != "0"
# gate/up produce down_proj's input in its stored row order (model/tp_shard.fold_down_order), so down reads its input
# contiguously instead of through q_perm; EXL2_BACKEND_FOLD_DOWN_ORDER=0 keeps the file's order, for A/B timing.
FOLD_DOWN_ORDER = os.environ.get("EXL2_BACKEND_FOLD_DOWN_ORDER", "1") != "0"
# rope_kv_write inside the q/k/v GEMV that produces its input (CudaLinearOp.add_normed_rope_kv: the block writing
# each column block's final values rotates q in place and writes k and v into an fp16 cache), one launch fewer per
# layer; EXL2_BACKEND_ROPE_IN_GEMV=0 runs rope_kv_write apart (same bits), for A/B timing.
ROPE_IN_GEMV = os.environ.get("EXL2_BACKEND_ROPE_IN_GEMV", "1") != "0"


def norm_linear(linear, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(linear(rms_norm(h + residual) * weight) [T, N], h + residual [T, H]); residual None: the norm of h alone,
    and h is the residual stream. One GEMV where the linear normalizes its own input, else add_rms_norm first."""
    if FUSED_NORM and hasattr(linear, "add_normed"):
        fused = linear.add_normed(h, residual, weight, eps)
        if fused is not None:
            return fused
    if residual is None:
        return linear(ops.rms_norm(h, weight, eps)), h
    x, residual = ops.add_rms_norm(h, residual, weight, eps)
    return linear(x), residual


def norm_qkv(layer: DecoderLayer, h: torch.Tensor, residual: torch.Tensor | None, step: StepInputs | None):
    """(qkv [T, (Hq + 2 Hkv) D], h + residual, roped): layer's input norm and q/k/v projection (norm_linear). With
    `step` and an fp16 cache, rope and the KV-cache write run inside the same GEMV where it can (roped True: the q
    columns are rotated and the cache holds this step's k and v; attend must not write them again)."""
    if step is not None and ROPE_IN_GEMV and FUSED_ROPE_KV and FUSED_NORM and hasattr(layer.qkv, "add_normed_rope_kv"):
        cache = step.cache
        if not getattr(cache, "quantized", False):
            k_cache, v_cache = cache.k[layer.index], cache.v[layer.index]  # [P, S, Hkv, D]
            if k_cache.dtype == torch.float16 and h.dtype == torch.float16:
                fused = layer.qkv.add_normed_rope_kv(h, residual, layer.input_norm, layer.eps, step.positions,
                                                     step.inv_freq, k_cache, v_cache, step.meta.slots)
                if fused is not None:
                    return fused[0], fused[1], True
    qkv, residual = norm_linear(layer.qkv, h, residual, layer.input_norm, layer.eps)
    return qkv, residual, False


@dataclass
class StepInputs:
    """What a layer's q/k/v GEMV needs to run rope and the KV-cache write itself (norm_qkv): token positions
    int64 [T], the rope frequencies fp32 [D/2], the paged cache and this step's metadata."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    cache: object
    meta: AttentionMetadata


@dataclass
class AttentionMetadata:
    """Where each query token's K/V goes and what it may attend to, for one forward step.

    block_tables: int32 [B, max_pages], page ids of each sequence (padding entries are never read).
    context_lens: int32 [B], tokens in the cache per sequence *after* this step's tokens are written.
    slots: int64 [B*Tq], cache slot (page * S + offset) of every query token, row-major over [B, Tq].
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor


class DecoderLayer:
    """Pre-norm attention and SwiGLU MLP; q/k/v and gate/up each run as one fused linear op."""

    def __init__(self, index: int, config, lw, device: torch.device, dtype: torch.dtype):
        self.index = index
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.input_norm = lw.input_layernorm.to(device=device, dtype=dtype)
        self.post_norm = lw.post_attention_layernorm.to(device=device, dtype=dtype)
        self.qkv = ops.prepare_linear([lw.q_proj, lw.k_proj, lw.v_proj], device, dtype)
        self.o = ops.prepare_linear([lw.o_proj], device, dtype)
        if FOLD_DOWN_ORDER:
            lw = fold_down_order(lw, device if torch.device(device).type == "cuda" else None)
        self.gate_up = ops.prepare_linear([lw.gate_proj, lw.up_proj], device, dtype)
        self.down = ops.prepare_linear([lw.down_proj], device, dtype)
        self.scale = self.head_dim**-0.5

    def attention(self, qkv, positions, inv_freq, cache, meta: AttentionMetadata, batch: int):
        """qkv [T, (Hq + 2 Hkv) D], the fused q/k/v projection of the normed hidden states, T = B*Tq; returns the
        o_proj output [T, H]."""
        return self.o(self.attend(qkv, positions, inv_freq, cache, meta, batch))

    def attend(self, qkv, positions, inv_freq, cache, meta: AttentionMetadata, batch: int, roped: bool = False):
        """attention() before o_proj: rope, the KV-cache write and attention; returns [T, Hq*D] in qkv's dtype.
        roped: qkv came from norm_qkv with both done (q rotated in place, k and v in the cache)."""
        t = qkv.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split(self.qkv.splits, dim=-1)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D] views
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if getattr(cache, "quantized", False):
            return self._attention_quantized(q, k, v, positions, inv_freq, cache, meta, batch, qkv.dtype)
        k_cache, v_cache = cache.k[self.index], cache.v[self.index]  # [P, S, Hkv, D]
        if not roped:
            q = self._rope_kv_write(q, k, v, positions, inv_freq, k_cache, v_cache, meta.slots)
        q = q.reshape(batch, t // batch, hq, d)  # [B, Tq, Hq, D]
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        return out.reshape(t, hq * d).to(qkv.dtype)  # [T, Hq*D]

    @staticmethod
    def _rope_kv_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots):
        """Rotated q [T, Hq, D] (in place in the QKV output where fused); rotated k and v written into the caches."""
        if FUSED_ROPE_KV and k_cache.dtype == q.dtype:
            # one launch: q rotated in place in the QKV output, rotated k and v written into the cache
            ops.rope_kv_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots)
            return q
        q = ops.apply_rope(q, positions, inv_freq)  # [T, Hq, D]
        k = ops.apply_rope(k, positions, inv_freq)  # [T, Hkv, D]
        ops.kv_cache_write(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slots)
        return q

    def _attention_quantized(self, q, k, v, positions, inv_freq, cache, meta: AttentionMetadata, batch: int, dtype):
        """attend() over a quantized cache (fp8/q8/q6/q4): rope + quantize-on-write in one op, attention reading
        the quantized pages."""
        t = q.shape[0]
        hq, d, i = self.num_heads, self.head_dim, self.index
        kc, ks, vc, vs = cache.k[i], cache.k_scales[i], cache.v[i], cache.v_scales[i]  # codes / scales [P, S, Hkv, *]
        ops.rope_kv_quant_write(q, k, v, positions, inv_freq, kc, ks, vc, vs, meta.slots, cache.k_format,
                                cache.v_format)
        q = q.reshape(batch, t // batch, hq, d)  # [B, Tq, Hq, D]
        out = ops.paged_attention_quant(q, kc, ks, vc, vs, meta.block_tables, meta.context_lens, self.scale,
                                        cache.k_format, cache.v_format)
        return out.reshape(t, hq * d).to(dtype)  # [T, Hq*D]

    def attention_out_mlp(self, attn, residual, nxt: DecoderLayer | None, step: StepInputs | None = None):
        """o_proj, the post-attention norm and the MLP over attn [T, Hq*D] (attend's output) and the residual stream
        [T, H]; with `nxt`, also the next layer's input norm and q/k/v (norm_qkv, given `step`). Returns (qkv of nxt,
        residual, roped) with nxt, else (the MLP output h, residual, False). One persistent GEMV chain where it runs
        (ops/cuda_chain.py), else op by op."""
        if residual is not None and FUSED_NORM and FUSED_SILU_DOWN and hasattr(self.o, "launch"):
            from exl2_backend.ops.cuda_chain import mlp_chain

            chained = mlp_chain(self.o, self.gate_up, self.down, None if nxt is None else nxt.qkv, attn, residual,
                                self.post_norm, None if nxt is None else nxt.input_norm, self.eps)
            if chained is not None:
                return chained[0], chained[1], False
        gate_up, residual = norm_linear(self.gate_up, self.o(attn), residual, self.post_norm, self.eps)
        h = self.mlp(gate_up)
        if nxt is None:
            return h, residual, False
        return norm_qkv(nxt, h, residual, step)

    def mlp(self, gate_up):
        """gate_up [T, 2I] (gate | up, the fused projection of the normed hidden states) -> [T, H]."""
        if hasattr(self.down, "gated") and FUSED_SILU_DOWN:
            return self.down.gated(gate_up)  # CUDA: silu_mul applied inside the down GEMV's input gather
        gate, up = gate_up.split(self.gate_up.splits, dim=-1)  # [T, I] each
        return self.down(ops.silu_mul(gate, up))
