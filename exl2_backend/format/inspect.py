"""Summarize a model directory without loading its weights: bpw per linear and layer, sizes, memory estimates.

Only headers and the small q_groups tensors are read, so this is instant even for a 70B directory.
Used by the CLI `info` command.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.reader import (
    ATTN_PROJS,
    MLP_PROJS,
    check_layer_count,
    iter_linear_keys,
    linear_shape,
    plain_tensor_names,
)
from exl2_backend.format.safetensors_io import ShardIndex


def _meta(index: ShardIndex, name: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(index.info(name).shape, dtype=dtype, device="meta")  # shape only, no data


def describe_linear(index: ShardIndex, key: str, config: ModelConfig, proj: str) -> dict:
    """{"format", "in_features", "out_features", "bpw", "bits": {width: rows}} for one linear."""
    k, n = linear_shape(config, proj)
    if index.has(f"{key}.q_weight"):
        qt = QTensor(
            key=key, q_weight=_meta(index, f"{key}.q_weight", torch.int32),
            q_scale=_meta(index, f"{key}.q_scale", torch.int32),
            q_scale_max=_meta(index, f"{key}.q_scale_max", torch.float16),
            q_groups=index.get(f"{key}.q_groups"), q_invperm=_meta(index, f"{key}.q_invperm", torch.int32),
            out_features=n, bias=_meta(index, f"{key}.bias", torch.float16) if index.has(f"{key}.bias") else None,
            source=str(index.file_of(f"{key}.q_weight")),
        )
        if qt.q_weight.dim() != 2:  # (meta tensors: the loader's full validation needs the data)
            raise TensorShapeError(f"shape {tuple(qt.q_weight.shape)} is not 2-D", path=qt.source,
                                   tensor=f"{key}.q_weight")
        rows: Counter[int] = Counter()
        for g in qt.groups:
            rows[g.bits] += g.rows
        return {"format": "exl2", "in_features": k, "out_features": n, "padded_out_features": qt.padded_out_features,
                "bpw": qt.bits_per_weight(), "bits": dict(sorted(rows.items(), reverse=True))}
    if index.has(f"{key}.weight"):
        dtype = index.info(f"{key}.weight").dtype
        width = {"F32": 32, "F16": 16, "BF16": 16}.get(dtype, 16)
        return {"format": dtype.lower(), "in_features": k, "out_features": n, "padded_out_features": n,
                "bpw": float(width), "bits": {width: k}}
    return {"format": "missing", "in_features": k, "out_features": n, "padded_out_features": n, "bpw": 0.0, "bits": {}}


def describe_model(model_dir: str | Path) -> dict:
    """A JSON-able summary of a model directory (see the keys below)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    index = ShardIndex(model_dir)
    check_layer_count(index, config)
    linears = {key: describe_linear(index, key, config, proj) for key, proj in iter_linear_keys(config, True)}
    head = linears.pop("lm_head")
    tied = head["format"] == "missing"

    layers, dec_bits, dec_numel = [], 0.0, 0
    for layer in range(config.num_hidden_layers):
        weights: Counter[int] = Counter()
        bits = numel = 0.0
        for proj in ATTN_PROJS + MLP_PROJS:
            d = linears[f"model.layers.{layer}.{'self_attn' if proj in ATTN_PROJS else 'mlp'}.{proj}"]
            size = d["in_features"] * d["padded_out_features"]
            bits += d["bpw"] * size
            numel += size
            for width, rows in d["bits"].items():
                weights[width] += rows * d["padded_out_features"]
        total = sum(weights.values()) or 1
        layers.append({"index": layer, "bpw": bits / numel,
                       "bit_histogram": {w: c / total for w, c in sorted(weights.items(), reverse=True)}})
        dec_bits += bits
        dec_numel += numel

    # what a load needs and this directory lacks (the head may be tied; a layer's norms and linears may not)
    missing = [name for name in plain_tensor_names(config) if not index.has(name)]
    missing += [f"{key} (q_weight or weight)" for key, d in linears.items() if d["format"] == "missing"]
    if tied and not config.tie_word_embeddings:  # load_weights' rule: no head is only fine when it is tied
        missing.append("lm_head (q_weight or weight; tie_word_embeddings is false)")
    tensor_bytes = sum(info.nbytes for info in index.infos())
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # K+V, fp16
    h, v = config.hidden_size, config.vocab_size
    decoder_params = sum(d["in_features"] * d["out_features"] for d in linears.values())
    decoder_params += config.num_hidden_layers * 2 * h  # two norms per layer
    files = [{"name": f.name, "bytes": f.stat().st_size} for f in index.files]
    index.close()
    quant = config.quantization or {}
    return {
        "model_dir": str(model_dir),
        "architecture": config.architecture,
        "num_layers": config.num_hidden_layers,
        "hidden_size": h,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": v,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else config.rope_scaling.__dict__,
        "tie_word_embeddings": config.tie_word_embeddings,
        "sampling_defaults": dict(config.generation_defaults),  # generation_config.json's: for requests without them
        "linears": linears,
        "layers": layers,
        "decoder_bpw": dec_bits / dec_numel if dec_numel else 0.0,  # format doc c: head and embeddings excluded
        "head": {"tied": tied, **head},
        "head_bits": quant.get("head_bits"),
        "target_bits": quant.get("bits"),
        "quantization_config": config.quantization,
        "files": files,
        "file_bytes": sum(f["bytes"] for f in files),
        "parameters": {"embedding": v * h, "decoder": decoder_params, "final_norm": h,
                       "head": 0 if tied else h * v,
                       "total": v * h + decoder_params + h + (0 if tied else h * v)},
        "memory": {"weights_bytes": tensor_bytes, "kv_cache_bytes_per_token": kv_per_token},
        "missing_tensors": missing,  # non-empty: the directory will not load
    }
