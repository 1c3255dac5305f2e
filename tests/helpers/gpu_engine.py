"""An engine on the GPU over a small random EXL2 model (4 layers, hidden 1024, GQA 8 / 2): GPU tests of the
engine's paths that need no real weights, so a device call carries no model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def write_small_model(directory: str | Path, vocab_size: int, seed: int) -> Path:
    """The model's directory (written on the CPU)."""
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    cfg = tiny_config_dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                           num_hidden_layers=4, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2)
    return write_tiny_exl2_model(directory, cfg, seed=seed)


def small_gpu_engine(directory: str | Path, vocab_size: int, seed: int, **settings):
    """Write the model under `directory` and load it with graphs on cuda (LoadSettings fields in `settings`);
    skips the test without a GPU or the compiled library."""
    from exl2_backend import ops
    from exl2_backend.runtime import Engine, LoadSettings

    if not torch.cuda.is_available() or not ops.cuda_enabled():
        pytest.skip("needs a GPU and the compiled kernel library")
    model_dir = write_small_model(directory, vocab_size, seed)
    engine = Engine.load(LoadSettings(model_dir=str(model_dir), device="cuda", **settings))
    assert type(engine.runner).__name__ == "CudaGraphRunner"
    return engine
