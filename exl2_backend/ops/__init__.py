"""One Python entry per op, dispatched to the CUDA library when it is loaded and the tensors are on a GPU,
to the pure-torch reference otherwise (architecture decision 1: the CUDA path is an accelerator, never a
different behaviour). See docs/internals.md for the signatures."""

from __future__ import annotations

from exl2_backend.ops.dispatch import (  # noqa: F401
    LinearOp,
    add_rms_norm,
    apply_rope,
    cuda_enabled,
    dense_linear,
    embedding,
    exl2_dequant,
    exl2_gemm,
    greedy_tokens,
    kv_cache_write,
    kv_quant_write,
    paged_attention,
    paged_attention_quant,
    prepare_linear,
    rms_norm,
    rope_inv_freq,
    rope_kv_quant_write,
    rope_kv_write,
    silu_mul,
)
