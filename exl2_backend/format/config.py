"""config.json -> ModelConfig: the architecture facts the loader and model need, validated up front."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exl2_backend.errors import ConfigError, ModelDirectoryError, UnsupportedModelError
from exl2_backend.format.generation_defaults import generation_defaults

log = logging.getLogger("exl2_backend")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_REQUIRED = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size",
             "rms_norm_eps")
_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0  # Llama's historical default, used only when no RoPE key exists at all


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `linear` uses factor; `llama3` uses all fields."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v carry biases (and o too, except for Qwen2: see has_bias)
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    quantization: dict | None
    raw: dict = field(repr=False)
    # sampling defaults from generation_config.json (format/generation_defaults.py): {request field: value}
    generation_defaults: dict = field(default_factory=dict, repr=False)

    def has_bias(self, proj: str) -> bool:
        """Whether linear `proj` ("q_proj", ..., "down_proj", "lm_head") carries a bias in this architecture."""
        if proj in ("q_proj", "k_proj", "v_proj"):
            return self.attention_bias
        if proj == "o_proj":
            return self.attention_bias and self.architecture != "Qwen2ForCausalLM"  # Qwen2: q/k/v only
        if proj in ("gate_proj", "up_proj", "down_proj"):
            return self.mlp_bias
        return False

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read <path>/config.json, plus the EOS list and sampling defaults of generation_config.json when
        present."""
        d = Path(path)
        if not d.is_dir():
            raise ModelDirectoryError("model directory does not exist", path=str(d))
        cfg_path = d / "config.json"
        if not cfg_path.exists() and not cfg_path.is_symlink():
            raise ModelDirectoryError("no config.json in the model directory", path=str(cfg_path))
        raw = _read_json(cfg_path)
        gen_path = d / "generation_config.json"
        # optional, but a directory or dead link in its place is an error (the tokenizer refuses it too), not a
        # silently lost EOS id
        gen = _read_json(gen_path) if gen_path.exists() or gen_path.is_symlink() else {}
        if not isinstance(gen, dict):
            raise ConfigError("generation_config.json must be a JSON object", path=str(gen_path))
        cfg = cls.from_dict(raw, path=str(cfg_path))
        extra = _eos_tuple(gen.get("eos_token_id"), str(gen_path))
        eos = cfg.eos_token_ids + tuple(e for e in extra if e not in cfg.eos_token_ids)
        bos = cfg.bos_token_id if cfg.bos_token_id is not None else _opt_int(gen, "bos_token_id", str(gen_path))
        eos = _in_vocab(eos, "eos_token_id", cfg.vocab_size, str(d))
        if bos is not None and not _in_vocab((bos,), "bos_token_id", cfg.vocab_size, str(d)):
            bos = None
        return replace(cfg, eos_token_ids=eos, bos_token_id=bos,
                       generation_defaults=generation_defaults(gen, str(gen_path)))

    @classmethod
    def from_dict(cls, d: dict, path: str | None = None) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError("config must be a JSON object", path=path)
        arch = _architecture(d, path)
        for name in _REQUIRED:
            if d.get(name) is None:
                raise ConfigError(f"required field {name!r} is missing", field=name, path=path)
        hidden = _pos_int(d, "hidden_size", path)
        heads = _pos_int(d, "num_attention_heads", path)
        kv_heads = _pos_int(d, "num_key_value_heads", path) if d.get("num_key_value_heads") is not None else heads
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
                              field="num_key_value_heads", path=path)
        if d.get("head_dim") is not None:
            head_dim = _pos_int(d, "head_dim", path)
        elif hidden % heads:
            raise ConfigError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; set head_dim",
                              field="head_dim", path=path)
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(f"head_dim={head_dim} must be even for RoPE", field="head_dim", path=path)
        vocab = _pos_int(d, "vocab_size", path)
        eps = d["rms_norm_eps"]
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
            raise ConfigError(f"rms_norm_eps={eps!r} must be a number in (0, 1)", field="rms_norm_eps", path=path)
        pad = _opt_int(d, "pad_token_id", path)
        if pad is not None and not (0 <= pad < vocab):
            raise ConfigError(f"pad_token_id={pad} is outside the vocabulary (size {vocab})",
                              field="pad_token_id", path=path)
        theta, scaling = _rope(d, path)
        if theta <= 1:  # inv_freq = theta^(-2i/d): a base of 1 or less gives no rotation, or infinities
            raise ConfigError(f"rope_theta={theta!r} must be greater than 1", field="rope_theta", path=path)
        qwen2 = arch == "Qwen2ForCausalLM"
        quant = d.get("quantization_config")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_hidden_layers=_pos_int(d, "num_hidden_layers", path),
            intermediate_size=_pos_int(d, "intermediate_size", path),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=float(eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_pos_int(d, "max_position_embeddings", path)
            if d.get("max_position_embeddings") is not None else 2048,
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False, path),
            attention_bias=True if qwen2 else _bool(d, "attention_bias", False, path),
            mlp_bias=False if qwen2 else _bool(d, "mlp_bias", False, path),
            bos_token_id=_opt_int(d, "bos_token_id", path),
            eos_token_ids=_eos_tuple(d.get("eos_token_id"), path),
            pad_token_id=pad,
            quantization=quant if isinstance(quant, dict) else None,
            raw=d,
        )


def _read_json(p: Path) -> Any:
    if not p.is_file():
        raise ConfigError(f"{p.name} is not a regular file", path=str(p))
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"invalid JSON: {e}", path=str(p)) from e
    except OSError as e:
        raise ConfigError(f"cannot read: {e}", path=str(p)) from e


def _architecture(d: dict, path: str | None) -> str:
    archs = d.get("architectures")
    if archs is None:
        arch = _MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            raise UnsupportedModelError(
                f"config has no 'architectures' entry and model_type {d.get('model_type')!r} is unknown; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}", field="architectures", path=path)
        return arch
    if not isinstance(archs, list) or len(archs) != 1:
        raise ConfigError(f"'architectures' must list exactly one name, got {archs!r}", field="architectures",
                          path=path)
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {archs[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            field="architectures", path=path)
    return archs[0]


def _pos_int(d: dict, name: str, path: str | None) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name}={v!r} must be a positive integer", field=name, path=path)
    return v


def _opt_int(d: dict, name: str, path: str | None) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name}={v!r} must be a non-negative integer", field=name, path=path)
    return v


def _bool(d: dict, name: str, default: bool, path: str | None) -> bool:
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{name}={v!r} must be true or false", field=name, path=path)
    return v


def _eos_tuple(v: Any, path: str | None) -> tuple[int, ...]:
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    for e in items:
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ConfigError(f"eos_token_id {v!r} must be an int or a list of ints", field="eos_token_id", path=path)
    return tuple(dict.fromkeys(items))


def _in_vocab(ids: tuple[int, ...], name: str, vocab: int, path: str | None) -> tuple[int, ...]:
    """The ids inside the vocabulary; the others are dropped with a warning (an EOS outside it can never be
    sampled, a BOS outside it would be an invalid prompt token)."""
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        log.warning("exl2_backend: %s %s outside the vocabulary (size %d) ignored (%s)", name, bad, vocab, path)
    return tuple(i for i in ids if 0 <= i < vocab)


def _number(v: Any, name: str, path: str | None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name}={v!r} must be a positive number", field=name, path=path)
    return float(v)


def _rope(d: dict, path: str | None) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from `rope_theta`/`rope_scaling` or transformers-5 `rope_parameters`.

    transformers 5 moves the base into rope_parameters and leaves top-level rope_theta empty; tools that
    then default to 10000 silently run the model with the wrong positions. So 10000 is used only when no
    RoPE base key exists at all (old Llama configs); an empty or missing base anywhere else is an error.
    """
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError("rope_parameters must be an object", field="rope_parameters", path=path)
    top = d.get("rope_theta")
    if params is not None:
        if params.get("rope_theta") is None:
            if top is None:
                raise ConfigError("rope_parameters has no rope_theta and there is no top-level rope_theta; "
                                  "cannot determine the RoPE base", field="rope_parameters.rope_theta", path=path)
            theta = _number(top, "rope_theta", path)
        else:
            theta = _number(params["rope_theta"], "rope_parameters.rope_theta", path)
            if top is not None and _number(top, "rope_theta", path) != theta:
                raise ConfigError(f"rope_theta={top} disagrees with rope_parameters.rope_theta={theta}",
                                  field="rope_theta", path=path)
    elif "rope_theta" in d:
        if top is None:
            raise ConfigError("rope_theta is empty; cannot determine the RoPE base", field="rope_theta", path=path)
        theta = _number(top, "rope_theta", path)
    else:
        theta = DEFAULT_ROPE_THETA

    scaling_src, name = d.get("rope_scaling"), "rope_scaling"
    if params is not None and (params.get("rope_type") or params.get("type")) not in (None, "default"):
        scaling_src, name = params, "rope_parameters"
    return theta, _scaling(scaling_src, name, path)


def _scaling(s: Any, name: str, path: str | None) -> RopeScaling | None:
    if s is None:
        return None
    if not isinstance(s, dict):
        raise ConfigError(f"{name} must be an object or null", field=name, path=path)
    kind = s.get("rope_type", s.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported; supported: {', '.join(_ROPE_TYPES)}",
                                    field=f"{name}.rope_type", path=path)
    factor = _number(s.get("factor"), f"{name}.factor", path)
    if kind == "linear":
        return RopeScaling("linear", factor)
    orig = s.get("original_max_position_embeddings")
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ConfigError(f"{name}.original_max_position_embeddings={orig!r} must be a positive integer",
                          field=f"{name}.original_max_position_embeddings", path=path)
    low = _number(s.get("low_freq_factor"), f"{name}.low_freq_factor", path)
    high = _number(s.get("high_freq_factor"), f"{name}.high_freq_factor", path)
    if not 0 < low < high:  # the smoothing band divides by high - low
        raise ConfigError(f"{name}: low_freq_factor={low} must be positive and below high_freq_factor={high}",
                          field=f"{name}.low_freq_factor", path=path)
    return RopeScaling("llama3", factor, low_freq_factor=low, high_freq_factor=high,
                       original_max_position_embeddings=orig)
