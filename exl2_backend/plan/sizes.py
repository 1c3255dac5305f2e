"""What every tensor of a model will occupy on a device, known before anything is loaded.

A `ModelDesc` lists each linear's shape and group layout (`LinearDesc`), read from the safetensors headers
plus the tiny q_groups tensors (`describe_dir`), or from the random-model generator's choices
(`describe_random`). The bytes a linear takes once prepared depend on the backend:

- "packed" (CUDA library): `ops/cuda_quant.pack_qtensor`'s layout -- width runs padded to 64-row chunks,
  packed words, on-disk scale codes, fp32 maxima, a per-chunk group map, the uint16 gather map, lane-layout
  fp16 scales, the bias and the kept q_invperm (`packed_bytes` mirrors it; a test holds the two together).
- "dense": the reference LinearOp's dequantized `[K, N]` matrix, fp32 on the CPU, fp16 on a GPU without the
  library (also what dense FP16 linears take on every backend).

Sizes are rounded up to the CUDA caching allocator's 512-byte blocks, so they compare with
`torch.cuda.memory_allocated`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from exl2_backend.format.config import ModelConfig
from exl2_backend.format.qtensor import pad32, parse_groups
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, check_layer_count, layer_linear_key, linear_shape
from exl2_backend.format.safetensors_io import ShardIndex

CHUNK_ROWS = 64  # ops/cuda_quant._CHUNK: rows of one packed chunk
BLOCK = 512  # CUDA caching allocator granularity


def _round(n: int) -> int:
    return -(-n // BLOCK) * BLOCK if n else 0


@dataclass(frozen=True)
class LinearDesc:
    """Shape and storage of one linear. groups: ((bits, rows), ...) in stored order; empty for a dense linear."""

    key: str
    in_features: int  # K
    out_features: int  # N
    groups: tuple[tuple[int, int], ...] = ()
    bias: bool = False
    invperm_itemsize: int = 4

    @property
    def quantized(self) -> bool:
        return bool(self.groups)

    @property
    def padded_out_features(self) -> int:
        return pad32(self.out_features) if self.quantized else self.out_features

    def disk_bytes(self) -> int:
        """Bytes of the stored tensors (QTensor.storage_bytes, or the fp16 weight and bias)."""
        if not self.quantized:
            return 2 * self.out_features * (self.in_features + int(self.bias))
        np_, g = self.padded_out_features, len(self.groups)
        words = sum(rows * bits // 32 for bits, rows in self.groups) * np_
        return 4 * words + 4 * g * np_ // 8 + 2 * g + 2 * 2 * g + self.invperm_itemsize * self.in_features + (
            2 * np_ if self.bias else 0)

    def packed_bytes(self) -> int:
        """Device bytes of `pack_qtensor`'s layout (ops/cuda_quant.py) for this linear."""
        np_, g, k = self.padded_out_features, len(self.groups), self.in_features
        runs: list[list[int]] = []  # [bits, rows]
        for bits, rows in self.groups:
            if runs and runs[-1][0] == bits:
                runs[-1][1] += rows
            else:
                runs.append([bits, rows])
        prows = [(bits, -(-rows // CHUNK_ROWS) * CHUNK_ROWS) for bits, rows in runs]
        words = sum(prow * bits // 32 * np_ for bits, prow in prows)
        kpad = sum(prow for _, prow in prows)
        chunks = kpad // CHUNK_ROWS
        parts = [4 * words, 4 * g * np_ // 8, 4 * g, 4 * chunks, 2 * kpad, self.invperm_itemsize * k, 2 * g * np_]
        if self.bias:
            parts.append(2 * np_)
        return sum(_round(p) for p in parts)

    def dense_bytes(self, itemsize: int) -> int:
        """Bytes of the dequantized [K, N] weight (and bias) that the reference LinearOp keeps."""
        return _round(itemsize * self.in_features * self.out_features) + (
            _round(itemsize * self.out_features) if self.bias else 0)

    def device_bytes(self, backend: str, itemsize: int) -> int:
        if backend == "packed" and self.quantized:
            return self.packed_bytes()
        return self.dense_bytes(itemsize)

    # --- parts, for tensor parallelism (model/tp_shard.py splits the real tensors the same way) -----------

    def column_part(self, n: int) -> LinearDesc:
        """`n` of the output columns (same rows)."""
        return replace(self, out_features=n)

    def row_part(self, g0: int, g1: int, with_bias: bool) -> LinearDesc:
        """Groups [g0, g1) (quantized), or rows g0..g1 (dense); the part's invperm is int32."""
        if not self.quantized:
            return replace(self, in_features=g1 - g0, bias=self.bias and with_bias)
        rows = sum(r for _, r in self.groups[g0:g1])
        return replace(self, in_features=rows, groups=self.groups[g0:g1], bias=self.bias and with_bias,
                       invperm_itemsize=4)


@dataclass(frozen=True)
class ModelDesc:
    """Every linear of a model (layers in module order) plus the dense tensors' shapes."""

    config: ModelConfig
    layers: tuple[dict[str, LinearDesc], ...]  # proj name -> desc, per layer
    head: LinearDesc | None  # None: tied to the embedding
    source: str = ""

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    def embed_bytes(self, itemsize: int) -> int:
        return _round(itemsize * self.config.vocab_size * self.hidden)

    def norm_bytes(self, itemsize: int) -> int:
        return _round(itemsize * self.hidden)

    def layer_bytes(self, i: int, backend: str, itemsize: int) -> int:
        """One decoder layer: its seven linears and two norms."""
        return sum(d.device_bytes(backend, itemsize) for d in self.layers[i].values()) + 2 * self.norm_bytes(itemsize)

    def head_bytes(self, backend: str, itemsize: int) -> int:
        """Final norm + head (0 extra for a tied head on the embedding's device)."""
        head = 0 if self.head is None else self.head.device_bytes(backend, itemsize)
        return self.norm_bytes(itemsize) + head

    def kv_bytes_per_token_layer(self, elem_bytes: float) -> float:
        """K and V of one token in one layer."""
        return 2 * self.config.num_key_value_heads * self.config.head_dim * elem_bytes

    def disk_bytes(self) -> int:
        lin = sum(d.disk_bytes() for layer in self.layers for d in layer.values())
        lin += self.head.disk_bytes() if self.head is not None else 0
        return lin + 2 * self.config.vocab_size * self.hidden + 2 * self.hidden * (2 * len(self.layers) + 1)


def _linear_from_index(index: ShardIndex, key: str, proj: str, config: ModelConfig) -> LinearDesc | None:
    k, n = linear_shape(config, proj)
    if index.has(f"{key}.q_weight"):
        qrows = index.info(f"{key}.q_weight").shape[0]
        groups = parse_groups(index.get(f"{key}.q_groups"), qrows, key=key, path=str(index.file_of(f"{key}.q_weight")))
        itemsize = 2 if index.info(f"{key}.q_invperm").dtype == "I16" else 4
        return LinearDesc(key, k, n, tuple((g.bits, g.rows) for g in groups), index.has(f"{key}.bias"), itemsize)
    if index.has(f"{key}.weight"):
        return LinearDesc(key, k, n, (), index.has(f"{key}.bias"))
    return None


def describe_dir(model_dir: str | Path) -> ModelDesc:
    """Read config.json, the headers and the q_groups tensors (a few bytes each) of a model directory."""
    config = ModelConfig.from_dir(model_dir)
    with ShardIndex(model_dir) as index:
        check_layer_count(index, config)
        layers = []
        for i in range(config.num_hidden_layers):
            layer = {}
            for proj in ATTN_PROJS + MLP_PROJS:
                key = layer_linear_key(i, proj)
                d = _linear_from_index(index, key, proj, config)
                if d is None:  # the loader names the missing tensor; the plan just assumes fp16
                    k, n = linear_shape(config, proj)
                    d = LinearDesc(key, k, n, (), config.has_bias(proj))
                layer[proj] = d
            layers.append(layer)
        head = _linear_from_index(index, "lm_head", "lm_head", config)
    if head is None and not config.tie_word_embeddings:
        k, n = linear_shape(config, "lm_head")
        head = LinearDesc("lm_head", k, n)
    return ModelDesc(config, tuple(layers), head, str(model_dir))


def describe_random(shape: str | dict, bpw: float = 4.0, head_bits: int = 6) -> ModelDesc:
    """The ModelDesc of `format.random_model.write_random_exl2_model(shape, bpw, head_bits)` (or of its
    in-memory twin in bench/random_weights.py), without generating anything."""
    from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS
    from exl2_backend.format.random_model import choose_options, shape_config_dict

    config = ModelConfig.from_dict(shape_config_dict(shape))
    layers = []
    for i, (ai, mi) in enumerate(choose_options(config, bpw)):
        layer = {}
        for projs, opts in ((ATTN_PROJS, ATTENTION_OPTIONS[ai]), (MLP_PROJS, MLP_OPTIONS[mi])):
            for proj, opt in zip(projs, opts):
                k, n = linear_shape(config, proj)
                layer[proj] = LinearDesc(layer_linear_key(i, proj), k, n, tuple(opt.group_layout(k)),
                                         config.has_bias(proj))
        layers.append(layer)
    k, n = linear_shape(config, "lm_head")
    head = LinearDesc("lm_head", k, n, tuple(HEAD_OPTIONS[head_bits].group_layout(k)))
    return ModelDesc(config, tuple(layers), head, f"random:{shape}@{bpw}")


def elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gb(n: float) -> float:
    return n / 1e9
