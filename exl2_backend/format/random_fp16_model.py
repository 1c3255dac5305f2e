"""FP16 Hugging Face directories with random weights at real model shapes: converter input for timing runs.

Random weights make the converter's measurement meaningless, but its wall time is real (same shapes, same
work). Linears have std 1/sqrt(K) (activations stay O(1) through the layers), norms are near 1, the
embedding is unit normal. Tensors are generated one at a time and streamed into shards; `num_layers` cuts
the decoder short (e.g. a few layers of the 8B shape, to time per-layer work and extrapolate).
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl2_backend.format.config import ModelConfig
from exl2_backend.format.random_model import SHAPES, seeded_generator, shape_config_dict, write_byte_tokenizer
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, layer_linear_key, linear_shape
from exl2_backend.format.writer import (
    TensorSpec,
    atomic_output_dir,
    plan_shards,
    shard_file_names,
    write_config,
    write_safetensors,
)


def fp16_config(shape: str | dict, num_layers: int | None = None) -> dict:
    """config.json dict of an FP16 model of `shape` (a SHAPES name or config fields), optionally cut short."""
    cfg = shape_config_dict(shape)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"num_layers must be in 1..{cfg['num_hidden_layers']}, got {num_layers}")
        cfg["num_hidden_layers"] = num_layers
    cfg["torch_dtype"] = "float16"
    return cfg


def _specs(config: ModelConfig) -> list[tuple[TensorSpec, str]]:
    """(spec, kind) in module order; kind picks the generator ("linear", "norm", "embed")."""
    h, v = config.hidden_size, config.vocab_size
    out: list[tuple[TensorSpec, str]] = [(("model.embed_tokens.weight", torch.float16, (v, h)), "embed")]
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}"
        out.append(((f"{pre}.input_layernorm.weight", torch.float16, (h,)), "norm"))
        for proj in ATTN_PROJS + MLP_PROJS:
            if proj == MLP_PROJS[0]:
                out.append(((f"{pre}.post_attention_layernorm.weight", torch.float16, (h,)), "norm"))
            k, n = linear_shape(config, proj)
            out.append(((f"{layer_linear_key(layer, proj)}.weight", torch.float16, (n, k)), "linear"))
            if config.has_bias(proj):
                out.append(((f"{layer_linear_key(layer, proj)}.bias", torch.float16, (n,)), "norm"))
    out.append((("model.norm.weight", torch.float16, (h,)), "norm"))
    if not config.tie_word_embeddings:
        k, n = linear_shape(config, "lm_head")
        out.append((("lm_head.weight", torch.float16, (n, k)), "linear"))
    return out


def _make(spec: TensorSpec, kind: str, seed: int) -> torch.Tensor:
    name, _, shape = spec
    g = seeded_generator(seed, name)
    if kind == "norm":
        return torch.empty(shape).uniform_(0.8, 1.2, generator=g).half()
    t = torch.empty(shape).normal_(0.0, 1.0, generator=g)
    if kind == "linear":
        t /= shape[1] ** 0.5  # [N, K]: std 1/sqrt(K)
    return t.half()


def write_random_fp16_model(out_dir: str | Path, shape: str | dict, num_layers: int | None = None, seed: int = 0,
                            *, shard_mb: float = 4096) -> Path:
    """Write a loadable FP16 HF directory (config.json, sharded safetensors, byte-level tokenizer)."""
    cfg_dict = fp16_config(shape, num_layers)
    config = ModelConfig.from_dict(cfg_dict)
    specs = _specs(config)
    kinds = {spec[0]: kind for spec, kind in specs}
    by_name = {spec[0]: spec for spec, _ in specs}
    shards = plan_shards([spec for spec, _ in specs], shard_mb)
    with atomic_output_dir(out_dir) as tmp:
        bos, eos = write_byte_tokenizer(tmp, config.vocab_size)
        cfg_dict.update(bos_token_id=bos, eos_token_id=eos)
        for fname, shard in zip(shard_file_names(len(shards)), shards):
            write_safetensors(tmp / fname, shard, lambda name: _make(by_name[name], kinds[name], seed))
        write_config(tmp, cfg_dict)
    return Path(out_dir)


__all__ = ["SHAPES", "fp16_config", "write_random_fp16_model"]
