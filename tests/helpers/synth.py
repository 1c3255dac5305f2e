"""Synthetic EXL2 tensors, configs and tiny model directories for tests across the project."""

from __future__ import annotations

from pathlib import Path

import torch

from exl2_backend.format.build import build_qtensor
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, QuantOption
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.format.random_model import write_byte_tokenizer
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, layer_linear_key, linear_shape
from exl2_backend.format.writer import make_quantization_config, qtensor_tensors, write_model_dir
from exl2_backend.quant.rtn import quantize_rtn

# Per layer (cycled): attention / MLP option indices chosen so a 2-layer model covers widths 2,3,4,5,6,8.
_LAYER_OPTIONS = [(0, 11), (10, 4), (17, 14), (6, 2)]


def random_qtensor(key: str, k: int, n: int, option_str: str, seed: int, bias: bool = False) -> QTensor:
    """A valid QTensor with random values, codes, scale maxima in [0.005, 0.05] and a random invperm."""
    g = torch.Generator().manual_seed(seed)
    option = QuantOption.parse(option_str)
    layout = option.group_layout(k)
    np_ = pad32(n)
    qvalues = torch.empty(k, np_, dtype=torch.int32)  # [K, Np]
    row = 0
    for bits, rows in layout:
        qvalues[row : row + rows] = torch.randint(0, 1 << bits, (rows, np_), generator=g, dtype=torch.int32)
        qvalues[row : row + rows, n:] = 1 << (bits - 1)  # padding columns decode to 0
        row += rows
    codes = torch.randint(0, 16, (len(layout), np_), generator=g, dtype=torch.int32)  # [G, Np]
    codes[:, n:] = 0
    scale_max = (torch.rand(len(layout), generator=g) * 0.045 + 0.005).half()  # [G]
    invperm = torch.randperm(k, generator=g)  # [K]
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    return build_qtensor(key, qvalues, codes, scale_max, layout, invperm, n, bias=b)


def tiny_config_dict(arch: str = "LlamaForCausalLM", **overrides) -> dict:
    """An HF config.json dict for a 2-layer model: hidden 128, 4/2 heads of 32, inter 256, vocab 300 (Np 320)."""
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}.get(arch)
    d = {
        "architectures": [arch], "model_type": model_type, "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": 290, "eos_token_id": 291, "hidden_act": "silu", "torch_dtype": "float16",
    }
    d.update(overrides)
    return d


def llama3_attention_config_dict(**overrides) -> dict:
    """A 2-layer model with Llama 3's attention geometry (head_dim 128, 8 kv heads; 2 query heads each), hidden
    2048, vocab 2048: the shapes the tensor-core decode attention kernels take."""
    return tiny_config_dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=8,
                            num_hidden_layers=2, vocab_size=2048, bos_token_id=1, eos_token_id=2,
                            max_position_embeddings=1024, **overrides)


def _fp16_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random HF-layout fp16 weights (std ~ 1/sqrt(K) for linears) in module order."""
    g = torch.Generator().manual_seed(seed)
    h, v = config.hidden_size, config.vocab_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(v, h, generator=g).half()}

    def linear(key: str, proj: str) -> None:
        k, n = linear_shape(config, proj)
        out[f"{key}.weight"] = (torch.randn(n, k, generator=g) / k**0.5).half()  # [N, K]
        if config.has_bias(proj):
            out[f"{key}.bias"] = (torch.randn(n, generator=g) * 0.1).half()

    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}"
        out[f"{pre}.input_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).half()
        for proj in ATTN_PROJS:
            linear(layer_linear_key(layer, proj), proj)
        out[f"{pre}.post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).half()
        for proj in MLP_PROJS:
            linear(layer_linear_key(layer, proj), proj)
    out["model.norm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).half()
    if not config.tie_word_embeddings:
        linear("lm_head", "lm_head")
    return out


def _tokenizer(dir_: Path, config_dict: dict) -> None:
    if config_dict.get("vocab_size", 0) >= 258:
        write_byte_tokenizer(dir_, config_dict["vocab_size"])


def write_tiny_fp16_model(dir_: str | Path, config_dict: dict, seed: int = 0) -> Path:
    """An HF-layout FP16 directory (config.json, model.safetensors-like shard, tokenizer when vocab >= 258)."""
    config = ModelConfig.from_dict(config_dict)
    write_model_dir(dir_, config_dict, _fp16_tensors(config, seed))
    _tokenizer(Path(dir_), config_dict)
    return Path(dir_)


def write_tiny_exl2_model(dir_: str | Path, config_dict: dict, seed: int = 0, head_bits: int = 6,
                          shard_mb: float = 8192) -> Path:
    """The fp16 weights of `write_tiny_fp16_model` (same seed) quantized with quantize_rtn, act-order perms.

    Layers cycle through option pairs covering every bit width; q/k/v and gate/up share a permutation like
    the converter's output. The head is stored quantized even when embeddings are tied.
    """
    config = ModelConfig.from_dict(config_dict)
    dense = _fp16_tensors(config, seed)
    g = torch.Generator().manual_seed(seed + 1)
    out: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    for name, t in dense.items():
        if not name.endswith(".weight") or t.dim() != 2 or name == "model.embed_tokens.weight":
            if not name.endswith(".bias"):
                out[name] = t
            continue
        key = name[: -len(".weight")]
        proj = key.rsplit(".", 1)[-1]
        if proj == "lm_head":
            option = HEAD_OPTIONS[head_bits]
        else:
            layer = int(key.split(".")[2])
            ai, mi = _LAYER_OPTIONS[layer % len(_LAYER_OPTIONS)]
            option = (ATTENTION_OPTIONS[ai][ATTN_PROJS.index(proj)] if proj in ATTN_PROJS
                      else MLP_OPTIONS[mi][MLP_PROJS.index(proj)])
        k = t.shape[1]
        share = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
        pkey = key.replace(proj, share)
        if pkey not in perms:
            perms[pkey] = torch.randperm(k, generator=g)
        qt = quantize_rtn(key, t, option, perm=perms[pkey], bias=dense.get(f"{key}.bias"))
        out.update(qtensor_tensors(qt))
    if config.tie_word_embeddings:  # converter behaviour: quantized copy of the embedding as the head
        qt = quantize_rtn("lm_head", dense["model.embed_tokens.weight"], HEAD_OPTIONS[head_bits])
        out.update(qtensor_tensors(qt))
    write_model_dir(dir_, config_dict, out, shard_mb=shard_mb,
                    quantization_config=make_quantization_config(4.0, head_bits, {"dataset": "(synthetic)"}))
    _tokenizer(Path(dir_), config_dict)
    return Path(dir_)
