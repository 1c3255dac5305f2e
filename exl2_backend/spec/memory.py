"""Memory check for a draft model loaded beside an already loaded target (`Engine(model, ...)`): its weights
and both KV caches must fit in what is free, or InsufficientMemoryError (naming the parts) is raised before the
draft is allocated. `Engine.load` plans the whole load, draft included, before anything is allocated
(plan/vram.py `plan_load` reads `settings.draft_model`).

Weights are counted as their safetensors file sizes (what gets copied to the device, within a few %); the KV
cache as one full-length sequence (max_seq_len tokens, or cache_tokens when given) for each model, the least
an engine can run with. A fixed workspace margin covers activations, logits and CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl2_backend.cache import kv_bytes_per_token
from exl2_backend.errors import InsufficientMemoryError
from exl2_backend.runtime.settings import DEFAULT_MAX_SEQ_LEN

WORKSPACE_BYTES = 1 << 30  # activations, logits, graph pools of both models


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of a model directory's safetensors shards."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def kv_bytes(config, cache_type: str = "fp16") -> int:
    """KV cache bytes per token of a model on a GPU (fp16 activations) at `cache_type`."""
    return kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float16,
                              cache_type)


def min_cache_tokens(settings, config) -> int:
    """Tokens of KV cache the engine needs at least: cache_tokens when given, else one full-length sequence."""
    if settings.cache_tokens is not None:
        return int(settings.cache_tokens)
    return int(settings.max_seq_len or min(int(config.max_position_embeddings), DEFAULT_MAX_SEQ_LEN))


def check_fits(parts: dict[str, int], free_bytes: int, device) -> None:
    """Raise InsufficientMemoryError when the parts (name -> bytes) plus the workspace exceed free_bytes."""
    need = sum(parts.values()) + WORKSPACE_BYTES
    if need <= free_bytes:
        return
    listing = ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in parts.items())
    raise InsufficientMemoryError(
        f"speculative decoding needs {need / 2**30:.2f} GiB on {device} ({listing}, workspace "
        f"{WORKSPACE_BYTES / 2**30:.2f} GiB) but {free_bytes / 2**30:.2f} GiB are free; use a smaller draft model, "
        "lower max_seq_len / cache_tokens, or drop draft_model (n-gram drafting needs no memory)",
        field="draft_model")


def plan_draft(settings, target_config, draft_config, draft_dir, free_bytes: int, *,
               target_dir: str | Path | None = None) -> None:
    """Check that the draft (and, when target_dir is given, the not yet loaded target) fits with one
    full-length KV cache for each model in free_bytes."""
    tokens = min_cache_tokens(settings, target_config)
    parts = {}
    if target_dir is not None:
        parts["target weights"] = weight_bytes(target_dir)
    parts["draft weights"] = weight_bytes(draft_dir)
    parts["target KV cache"] = tokens * kv_bytes(target_config, settings.cache_type)
    parts["draft KV cache"] = tokens * kv_bytes(draft_config, settings.cache_type)
    check_fits(parts, free_bytes, settings.device)

