"""GGUF (llama.cpp) -> Hugging Face FP16 directory, for Llama-architecture files with a byte-level BPE vocab.

Weights: every tensor is dequantized with `gguf.quants.dequantize` (fp32), renamed to HF keys, and stored as
FP16. llama.cpp's converter reorders the rows of `attn_q`/`attn_k` within each head, from HF's half-split
RoPE layout (first half of a head's rows = real parts) to its interleaved one (real, imag, real, imag...):
per head, row `2*i + j` of the GGUF tensor is HF row `j * D/2 + i` (j in {0, 1}). `_unpermute` inverts that.

Tokenizer: `tokenizer.ggml.tokens` are already spelled in GPT-2's byte alphabet and `merges` are
"left right" strings, so a `tokenizers` BPE model plus ByteLevel pre-tokenizer/decoder rebuilds it. Control
tokens (token_type 3) become special added tokens so they are matched whole in text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exl2_backend.errors import DefaultModelError

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer names whose split is "each digit alone, then GPT-2's regex" (llama-vocab.cpp).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_heads)`: interleaved RoPE rows -> HF half-split rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """HF key of a llama.cpp tensor name: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise DefaultModelError(f"GGUF tensor {gguf_name!r} has no Llama equivalent")


def _fields(reader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _shortest_float(value: float) -> float:
    # GGUF stores fp32; its shortest decimal (1e-05, not 9.99999974e-06) is what the source config held.
    return float(str(np.float32(value)))


def read_gguf(gguf_path: str | Path, progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Metadata and HF-named FP16 tensors of a Llama GGUF file."""
    import gguf
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise DefaultModelError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise DefaultModelError(f"GGUF architecture {arch!r} is not supported (only 'llama'): {gguf_path}")
    n_head, n_kv = meta["llama.attention.head_count"], meta.get("llama.attention.head_count_kv")
    n_kv = n_head if n_kv is None else n_kv
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress, leave=False):
        # Dequantized arrays come out in numpy order ([rows=out, cols=in]); GGUF's `shape` lists dims reversed.
        # np.array copies: F32 tensors come back as views of the read-only memory map.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        tensors[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.float16)
    return meta, tensors


def hf_config(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """config.json for `LlamaForCausalLM`, checked against the tensor shapes."""
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    vocab, emb_dim = tensors["model.embed_tokens.weight"].shape
    head_dim = int(meta.get("llama.rope.dimension_count", hidden // n_head))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]), "num_attention_heads": n_head,
        "num_key_value_heads": n_kv, "head_dim": head_dim, "vocab_size": int(vocab),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _shortest_float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _shortest_float(meta.get("llama.rope.freq_base", 10000.0)), "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float16",
    }
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.layers.0.self_attn.q_proj.weight": (n_head * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (n_kv * head_dim, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, config["intermediate_size"]),
    }
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise DefaultModelError(f"GGUF tensor {key} has shape {tuple(tensors[key].shape)}, expected {shape}")
    if emb_dim != hidden or sum(k.endswith("input_layernorm.weight") for k in tensors) != config["num_hidden_layers"]:
        raise DefaultModelError("GGUF tensors do not match its metadata (hidden size / layer count)")
    return config


def build_tokenizer(meta: dict[str, Any]):
    """A `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise DefaultModelError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} unsupported (only 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
                                          trim_offsets=True, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED])
    return tok


def tokenizer_files(meta: dict[str, Any]) -> dict[str, Any]:
    """Contents of tokenizer_config.json and generation_config.json."""
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    types = meta.get("tokenizer.ggml.token_type") or []
    decoder = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for i, ty in enumerate(types) if ty == _TOKEN_CONTROL}
    tok_config = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": decoder, "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"), "unk_token": name("unknown_token_id"),
        "clean_up_tokenization_spaces": False, "model_max_length": int(meta.get("llama.context_length", 2048)),
        "tokenizer_class": "GPT2Tokenizer", "chat_template": meta.get("tokenizer.chat_template"),
    }
    gen_config = {key: meta.get(f"tokenizer.ggml.{src}") for key, src in
                  (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                   ("pad_token_id", "padding_token_id"))}
    return {"tokenizer_config.json": tok_config, "generation_config.json": gen_config}


def gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write an FP16 HF Llama directory (config, safetensors, tokenizer files) from a GGUF file."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta, tensors = read_gguf(gguf_path, progress=progress)
    config = hf_config(meta, tensors)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)  # save_file creates it owner-only
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    for name, content in tokenizer_files(meta).items():
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return out_dir
