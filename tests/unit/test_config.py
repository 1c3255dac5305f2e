"""config.json parsing: architectures, required fields, RoPE spellings (incl. the transformers-5 trap), EOS lists."""

from __future__ import annotations

import json

import pytest

from exl2_backend.errors import ConfigError, ModelDirectoryError, UnsupportedModelError
from exl2_backend.format.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from tests.helpers.synth import tiny_config_dict

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def test_tiny_llama_defaults():
    d = tiny_config_dict()
    del d["max_position_embeddings"], d["num_key_value_heads"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.head_dim == 32 and cfg.num_key_value_heads == 4
    assert cfg.max_position_embeddings == 2048
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (291,) and cfg.bos_token_id == 290 and cfg.pad_token_id is None
    assert not cfg.attention_bias and not any(cfg.has_bias(p) for p in ("q_proj", "o_proj", "down_proj", "lm_head"))
    assert cfg.quantization is None and cfg.raw is d


def test_llama3_rope_scaling_and_eos_list():
    d = tiny_config_dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, eos_token_id=[128001, 128009, 128001])
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_ids == (128001, 128009)


def test_transformers5_rope_parameters():
    d = tiny_config_dict(rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})
    del d["rope_theta"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"
    d = tiny_config_dict(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, rope_theta=None)
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_rope_base_that_cannot_be_determined_is_refused():
    d = tiny_config_dict(rope_parameters={"rope_type": "default"})
    del d["rope_theta"]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert e.value.field == "rope_parameters.rope_theta"
    with pytest.raises(ConfigError) as e:  # the key is there but empty: not the same as an old config
        ModelConfig.from_dict(tiny_config_dict(rope_theta=None))
    assert e.value.field == "rope_theta"
    with pytest.raises(ConfigError):
        ModelConfig.from_dict(tiny_config_dict(rope_theta=10000.0, rope_parameters={"rope_theta": 500000.0}))


def test_linear_and_unsupported_rope_scaling():
    cfg = ModelConfig.from_dict(tiny_config_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == RopeScaling("linear", 2.0)
    assert ModelConfig.from_dict(tiny_config_dict(rope_scaling={"rope_type": "default"})).rope_scaling is None
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dict(tiny_config_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert "llama3" in str(e.value)
    with pytest.raises(ConfigError):
        ModelConfig.from_dict(tiny_config_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}))


def test_qwen2_implies_qkv_bias_only():
    cfg = ModelConfig.from_dict(tiny_config_dict("Qwen2ForCausalLM"))
    assert cfg.attention_bias
    assert [cfg.has_bias(p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj")] == [True] * 3 + [False] * 2
    llama = ModelConfig.from_dict(tiny_config_dict(attention_bias=True, mlp_bias=True))
    assert all(llama.has_bias(p) for p in ("q_proj", "o_proj", "gate_proj", "down_proj"))


def test_mistral_and_model_type_fallback():
    assert ModelConfig.from_dict(tiny_config_dict("MistralForCausalLM")).architecture == "MistralForCausalLM"
    d = tiny_config_dict()
    del d["architectures"]
    assert ModelConfig.from_dict(d).architecture == "LlamaForCausalLM"


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dict(tiny_config_dict("GPT2LMHeadModel"), path="/m/config.json")
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)
    assert "/m/config.json" in str(e.value)


@pytest.mark.parametrize("name", ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                  "vocab_size", "rms_norm_eps"])
def test_missing_required_field(name):
    d = tiny_config_dict()
    del d[name]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d, path="/x/config.json")
    assert e.value.field == name and name in str(e.value) and "/x/config.json" in str(e.value)


@pytest.mark.parametrize("overrides,field", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": -128}, "hidden_size"),
    ({"pad_token_id": 300}, "pad_token_id"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    ({"hidden_size": 130}, "head_dim"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"architectures": ["LlamaForCausalLM", "X"]}, "architectures"),
])
def test_invalid_values(overrides, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(tiny_config_dict(**overrides))
    assert e.value.field == field


def test_from_dir_merges_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict(eos_token_id=291, bos_token_id=None)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [291, 295], "bos_token_id": 290}))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.eos_token_ids == (291, 295) and cfg.bos_token_id == 290


def test_from_dir_errors(tmp_path):
    with pytest.raises(ModelDirectoryError):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(ModelDirectoryError) as e:
        ModelConfig.from_dir(tmp_path)
    assert "config.json" in str(e.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
