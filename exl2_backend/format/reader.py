"""Load a model directory's weights (EXL2 `.q_*` or dense `.weight` linears) and check them against the config."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from exl2_backend.errors import MissingTensorError, ModelFormatError, NonFiniteScaleError, TensorShapeError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.format.safetensors_io import ShardIndex

ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class DenseLinear:
    """An unquantized linear in HF layout."""

    key: str
    weight: torch.Tensor  # fp16 [N, K]
    bias: torch.Tensor | None = None  # fp16 [N]

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


Linear = QTensor | DenseLinear


@dataclass
class LayerWeights:
    input_layernorm: torch.Tensor  # fp16 [H]
    post_attention_layernorm: torch.Tensor  # fp16 [H]
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # fp16 [V, H]
    norm: torch.Tensor  # fp16 [H]
    layers: list[LayerWeights]
    lm_head: Linear | None  # None: tied to embed_tokens


def linear_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(K, N) = (in_features, out_features) of a projection name ("q_proj", ..., "lm_head")."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "lm_head": (h, config.vocab_size),
    }[proj]


def layer_linear_key(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if proj in ATTN_PROJS else 'mlp'}.{proj}"


EMBED_KEY = "model.embed_tokens.weight"
FINAL_NORM_KEY = "model.norm.weight"


def layer_norm_key(layer: int, norm: str) -> str:
    """norm: "input_layernorm" or "post_attention_layernorm"."""
    return f"model.layers.{layer}.{norm}.weight"


def plain_tensor_names(config: ModelConfig) -> list[str]:
    """The unquantized tensors load_weights reads besides the linears: the embedding, the final norm and every
    layer's two norms (`info` lists those a directory lacks from this, so the two never disagree)."""
    return [EMBED_KEY, FINAL_NORM_KEY] + [layer_norm_key(i, norm) for i in range(config.num_hidden_layers)
                                          for norm in ("input_layernorm", "post_attention_layernorm")]


def iter_linear_keys(config: ModelConfig, include_head: bool = True) -> Iterator[tuple[str, str]]:
    """(key, projection name) of every linear in module order; the head ("lm_head") last if asked."""
    for layer in range(config.num_hidden_layers):
        for proj in ATTN_PROJS + MLP_PROJS:
            yield layer_linear_key(layer, proj), proj
    if include_head:
        yield "lm_head", "lm_head"


def load_linear(index: ShardIndex, key: str, proj: str, config: ModelConfig) -> Linear:
    """Read `<key>.q_*` (EXL2) if present, else `<key>.weight` (dense); validate shapes and bias presence."""
    k, n = linear_shape(config, proj)
    want_bias = config.has_bias(proj)
    has_bias = index.has(f"{key}.bias")
    if has_bias != want_bias:
        f = index.file_of(f"{key}.bias") if has_bias else index.model_dir
        raise ModelFormatError(
            f"{config.architecture} {'does not expect' if has_bias else 'expects'} a bias on {proj}",
            path=str(f), tensor=f"{key}.bias")
    if index.has(f"{key}.q_weight"):
        return _load_exl2(index, key, k, n, has_bias)
    if not index.has(f"{key}.weight"):
        raise MissingTensorError(f"neither {key}.q_weight nor {key}.weight found", path=str(index.model_dir),
                                 tensor=f"{key}.weight")
    weight = _float(index, f"{key}.weight", (n, k))
    bias = _float(index, f"{key}.bias", (n,)) if has_bias else None
    return DenseLinear(key, weight, bias)


def _load_exl2(index: ShardIndex, key: str, k: int, n: int, has_bias: bool) -> QTensor:
    t = {name: index.get(f"{key}.{name}") for name in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
    source = str(index.file_of(f"{key}.q_weight"))
    bias = None
    if has_bias:
        bias = index.get(f"{key}.bias")
        if bias.dim() != 1 or bias.numel() not in (n, pad32(n)) or bias.dtype not in _FLOAT_DTYPES:
            raise TensorShapeError(f"{bias.dtype} {tuple(bias.shape)}, expected fp16 ({pad32(n)},)",
                                   path=str(index.file_of(f"{key}.bias")), tensor=f"{key}.bias")
        bias = bias.to(torch.float16)
        if bias.numel() == n and n != pad32(n):
            bias = torch.cat([bias, bias.new_zeros(pad32(n) - n)])
    if t["q_weight"].dim() == 2 and t["q_weight"].shape[1] != pad32(n):
        raise TensorShapeError(f"shape {tuple(t['q_weight'].shape)} has {t['q_weight'].shape[1]} columns, expected "
                               f"pad32(out_features={n}) = {pad32(n)}", path=source, tensor=f"{key}.q_weight")
    qt = QTensor(key=key, out_features=n, bias=bias, source=source, **t)
    qt.validate(in_features=k)
    return qt


def _float(index: ShardIndex, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A floating tensor of exactly `shape`, converted to fp16; NaN / inf refused (a NaN norm weight only showed
    as NaN logits at the first step, a NaN dense weight as finite garbage)."""
    info = index.info(name)
    t = index.get(name)
    if tuple(t.shape) != shape or t.dtype not in _FLOAT_DTYPES:
        raise TensorShapeError(f"{t.dtype} {tuple(t.shape)}, expected a float tensor of shape {shape}",
                               path=str(info.file), tensor=name)
    out = t.to(torch.float16)
    if not torch.isfinite(out).all():
        stored = bool(torch.isfinite(t).all())
        raise NonFiniteScaleError("values overflow fp16" if stored else "holds NaN or infinite values",
                                  path=str(info.file), tensor=name)
    return out


_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")


def check_layer_count(index: ShardIndex, config: ModelConfig) -> None:
    """config.json's num_hidden_layers against the layers the shards hold, before anything loops over layers:
    fewer in the config silently dropped the last layers (wrong output), more (10^9) looped for minutes."""
    names = index.keys()  # every shard's tensor names (headers only)
    present = {int(m.group(1)) for key in names if (m := _LAYER_TENSOR.match(key))}
    n = config.num_hidden_layers
    top = max(present, default=-1)
    if top >= n:
        raise ModelFormatError(f"config.json says num_hidden_layers={n}, but the shards hold tensors of layer "
                               f"{top}", path=str(index.model_dir))
    if top < n - 1:
        raise MissingTensorError(f"config.json says num_hidden_layers={n}, but the shards hold no tensors of "
                                 f"layer {top + 1}" + (f" (layers 0..{top} are there)" if top >= 0 else ""),
                                 path=str(index.model_dir), tensor=f"model.layers.{top + 1}.*")


def load_weights(model_dir: str | Path, config: ModelConfig) -> ModelWeights:
    """Read every tensor the architecture needs from `model_dir`, validated against `config`."""
    index = ShardIndex(model_dir)
    try:
        check_layer_count(index, config)
        h = config.hidden_size
        layers = []
        for layer in range(config.num_hidden_layers):
            lin = {proj: load_linear(index, layer_linear_key(layer, proj), proj, config)
                   for proj in ATTN_PROJS + MLP_PROJS}
            layers.append(LayerWeights(
                input_layernorm=_float(index, layer_norm_key(layer, "input_layernorm"), (h,)),
                post_attention_layernorm=_float(index, layer_norm_key(layer, "post_attention_layernorm"), (h,)),
                **lin,
            ))
        embed = _float(index, EMBED_KEY, (config.vocab_size, h))
        norm = _float(index, FINAL_NORM_KEY, (h,))
        if index.has("lm_head.q_weight") or index.has("lm_head.weight"):
            lm_head = load_linear(index, "lm_head", "lm_head", config)
        elif config.tie_word_embeddings:
            lm_head = None
        else:
            raise MissingTensorError("no lm_head.q_weight or lm_head.weight and tie_word_embeddings is false",
                                     path=str(index.model_dir), tensor="lm_head.weight")
        return ModelWeights(embed_tokens=embed, norm=norm, layers=layers, lm_head=lm_head)
    finally:
        index.close()
