"""What each KV cache type costs per token, and how much context fits a VRAM budget (for `info` and `bench`).

max context = (VRAM budget - weights - reserve) / cache bytes per token, where the reserve stands for
activations, scratch and the CUDA context. Bytes per token count the K and V codes and their fp16 scales over
all layers (an fp16 cache: 2 bytes per element). No torch here.
"""

from __future__ import annotations

from exl2_backend.cache.kv_types import CACHE_TYPES

GIB = 1024**3
DEFAULT_RESERVE_BYTES = 1 * GIB


def cache_type_table(num_layers: int, num_kv_heads: int, head_dim: int, *, weights_bytes: int = 0,
                     vram_bytes: int | None = None, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
                     context: int | None = None) -> list[dict]:
    """One row per cache type: name, k/v formats, bytes_per_token, ratio_vs_fp16, and with `context` the cache
    bytes at that context, with `vram_bytes` the max_context that fits. A type the model cannot use (head_dim
    not a multiple of 32 for quantized types) gets supported=False."""
    fp16 = CACHE_TYPES["fp16"].bytes_per_token(num_layers, num_kv_heads, head_dim)
    free = None if vram_bytes is None else max(int(vram_bytes) - int(weights_bytes) - int(reserve_bytes), 0)
    rows = []
    for name, ct in CACHE_TYPES.items():
        bpt = ct.bytes_per_token(num_layers, num_kv_heads, head_dim)
        row = {"cache_type": name, "k_format": ct.k.name, "v_format": ct.v.name, "bytes_per_token": bpt,
               "ratio_vs_fp16": bpt / fp16 if fp16 else 0.0,
               "supported": not ct.quantized or head_dim % 32 == 0}
        if context is not None:
            row["bytes_at_context"] = bpt * int(context)
        if free is not None:
            row["max_context"] = free // bpt if bpt else 0
        rows.append(row)
    return rows
