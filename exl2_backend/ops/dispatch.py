"""Dispatch of every op: CUDA library when loaded and the inputs live on a GPU, reference otherwise.

`exl2_backend.ops.cuda` implements the accelerated versions under the same names; an op it does not (yet)
provide falls back to the reference for CUDA tensors too, so partial kernel coverage never changes behaviour.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from exl2_backend.ops import library, reference, reference_kvquant

log = logging.getLogger("exl2_backend")


@functools.cache
def _cuda_module():
    if os.environ.get("EXL2_BACKEND_DISABLE_CUDA") == "1" or not torch.cuda.is_available():
        return None
    if not library.available():
        log.warning("exl2_backend: running on reference ops on the GPU (%s)", library.load_error())
        return None
    from exl2_backend.ops import cuda

    return cuda


def cuda_enabled() -> bool:
    """True when the compiled library is loaded and a GPU is present."""
    return _cuda_module() is not None


def _cuda_impl(mod, name: str) -> Callable:
    """The CUDA module's op `name`: its plain implementation where eager calls may skip the dispatcher
    (library.direct_calls), else the custom op."""
    if library.direct_calls():
        fn = getattr(getattr(mod, "direct", None), name, None)
        if fn is not None:
            return fn
    return getattr(mod, name)


def _pick(name: str, tensor: torch.Tensor, fallback=reference) -> Callable:
    """The CUDA op `name` for a GPU tensor when the library has it, else the `fallback` module's reference."""
    if tensor.is_cuda:
        mod = _cuda_module()
        if mod is not None and hasattr(mod, name):
            return _cuda_impl(mod, name)
    return getattr(fallback, name)


def exl2_dequant(qt):
    return _pick("exl2_dequant", qt.q_weight)(qt)


def exl2_gemm(x, qt):
    return _pick("exl2_gemm", x)(x, qt)


def dense_linear(x, weight, bias=None):
    return _pick("dense_linear", x)(x, weight, bias)


def rms_norm(x, weight, eps):
    return _pick("rms_norm", x)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return _pick("add_rms_norm", x)(x, residual, weight, eps)


def rope_inv_freq(head_dim, rope_theta, scaling=None):
    return reference.rope_inv_freq(head_dim, rope_theta, scaling)


def apply_rope(x, positions, inv_freq):
    return _pick("apply_rope", x)(x, positions, inv_freq)


def silu_mul(gate, up):
    return _pick("silu_mul", gate)(gate, up)


def embedding(ids, table):
    return _pick("embedding", table)(ids, table)


def greedy_tokens(logits):
    """logits [B, V] -> int64 [B] argmax per row on the logits' device (ties to the lowest id, NaN the largest)."""
    return _pick("greedy_tokens", logits)(logits)


def sample_tokens(logits, params, uniforms):
    """logits [B, V] f32, params list[SamplingParams], uniforms [B, V] f32 in (0, 1] on the logits' device ->
    int64 [B] on that device; on the GPU the sampler kernel (after filtered_probs' sort for top-k/p and min-p
    rows), with no host sync."""
    return _pick("sample_tokens", logits)(logits, params, uniforms)


def apply_penalties(logits, prompt_counts, output_counts, params):
    """logits [B, V] f32, counts [B, V] on the logits' device -> penalized f32 [B, V]; on the GPU without a host
    sync (its parameters go through pinned memory)."""
    return _pick("apply_penalties", logits)(logits, prompt_counts, output_counts, params)


def kv_cache_write(k, v, k_cache, v_cache, slots):
    return _pick("kv_cache_write", k)(k, v, k_cache, v_cache, slots)


def rope_kv_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots):
    return _pick("rope_kv_write", q)(q, k, v, positions, inv_freq, k_cache, v_cache, slots)


# Above this many queries per sequence a step is a prefill chunk: tensor-core SDPA beats the decode kernel. 32
# since 2026-12-02 (H200, call F2): a 32-token suffix over a 4k cached prefix took 22.9 ms to its first token with
# the decode kernel against 61.2 ms with the blocked SDPA path. EXL2_BACKEND_DECODE_ATTN_MAX_Q (1..64) moves it.
DECODE_KERNEL_MAX_QUERIES = min(max(int(os.environ.get("EXL2_BACKEND_DECODE_ATTN_MAX_Q", "32")), 1), 64)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    if q.is_cuda and q.shape[1] > DECODE_KERNEL_MAX_QUERIES:
        from exl2_backend.ops.attention_prefill import prefill_attention

        return prefill_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _pick("paged_attention", q)(q, k_cache, v_cache, block_tables, context_lens, scale)


# --- quantized KV cache (cache types fp8, q8, q6, q4; ops/reference_kvquant.py) ---------------------------


def _pick_kvquant(name: str, tensor: torch.Tensor) -> Callable:
    return _pick(name, tensor, reference_kvquant)


def kv_quant_write(k, v, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt):
    return _pick_kvquant("kv_quant_write", k_codes)(k, v, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt)


def rope_kv_quant_write(q, k, v, positions, inv_freq, k_codes, k_scales, v_codes, v_scales, slots, k_fmt, v_fmt):
    return _pick_kvquant("rope_kv_quant_write", k_codes)(q, k, v, positions, inv_freq, k_codes, k_scales, v_codes,
                                                          v_scales, slots, k_fmt, v_fmt)


def dequantize_pages(codes, scales, pages, fmt, dtype=torch.float32):
    return _pick_kvquant("dequantize_pages", codes)(codes, scales, pages, fmt, dtype)


def paged_attention_quant(q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale, k_fmt, v_fmt):
    args = (q, k_codes, k_scales, v_codes, v_scales, block_tables, context_lens, scale, k_fmt, v_fmt)
    if q.is_cuda and q.shape[1] > DECODE_KERNEL_MAX_QUERIES:
        from exl2_backend.ops.attention_prefill_quant import prefill_attention_quant

        return prefill_attention_quant(*args)
    return _pick_kvquant("paged_attention_quant", q)(*args)


LinearOp = reference.LinearOp


def prepare_linear(linears, device, dtype=torch.float16):
    """One op for one or several linears that share an input (outputs concatenated). See internals.md."""
    device = torch.device(device)
    if device.type == "cuda":
        mod = _cuda_module()
        if mod is not None and hasattr(mod, "prepare_linear"):
            return mod.prepare_linear(linears, device, dtype)
    return reference.prepare_linear(linears, device, dtype)
