"""Llama-family transformer assembled from `exl2_backend.ops` (Llama 2/3/3.x, Mistral, Qwen2, SmolLM)."""

from exl2_backend.model.layers import AttentionMetadata  # noqa: F401
from exl2_backend.model.llama import LlamaModel  # noqa: F401
