"""Bytes a decode step must move, and the HBM read bandwidth measured on this device in the same run.

Roofline tokens/s = measured bandwidth / bytes per token. Bytes per token (batch 1) = every linear's
stored bytes (packed weights, scales, groups, permutation; dense heads at 2 bytes/weight) + norm weights
+ one embedding row + the K/V of the whole context (read) and of the new token (written).
"""

from __future__ import annotations

import torch

from exl2_backend.format.config import ModelConfig
from exl2_backend.format.reader import ModelWeights


def linear_bytes(lin) -> int:
    if hasattr(lin, "q_weight"):
        return lin.storage_bytes()
    n = lin.weight.numel() * 2
    return n + (0 if lin.bias is None else lin.bias.numel() * 2)


def weight_bytes_per_token(config: ModelConfig, weights: ModelWeights) -> int:
    """Weight bytes one batch-1 decode step reads."""
    total = 0
    for lw in weights.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            total += linear_bytes(getattr(lw, name))
        total += (lw.input_layernorm.numel() + lw.post_attention_layernorm.numel()) * 2
    head = weights.lm_head
    total += linear_bytes(head) if head is not None else weights.embed_tokens.numel() * 2
    total += config.hidden_size * 2 * 2  # final norm + one embedding row
    return total


def kv_bytes_per_token_of_context(config: ModelConfig, bytes_per_element: int = 2) -> int:
    """K and V bytes stored per cached token across all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_element


def decode_bytes(config: ModelConfig, weight_bytes: int, context: int, cache_type: str = "fp16") -> int:
    """Bytes of one batch-1 decode step: weights + the cache (codes and scales of `cache_type`) of the context
    read, and of the new token written."""
    from exl2_backend.cache.kv_types import get_cache_type

    kv = get_cache_type(cache_type).bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                                   config.head_dim)
    return weight_bytes + kv * (context + 1)


def measure_read_bandwidth(device: torch.device, gib: float = 4.0, iters: int = 20) -> float:
    """GB/s of a large device reduction (bytes read / median replay time), the read ceiling for ratios."""
    from exl2_backend.bench.timing import graph_time_us

    with torch.cuda.device(device):
        x = torch.randn(int(gib * 2**30) // 2, device=device, dtype=torch.float16)
        us = graph_time_us([lambda: x.sum()], reps=iters)
    return x.numel() * 2 / (us * 1e-6) / 1e9
