"""The sampling defaults a model ships in generation_config.json (format/generation_defaults.py): which keys count,
the typed errors for bad values at load, and how a request's left-out fields take them (serve/schemas.py)."""

from __future__ import annotations

import json

import pytest

from exl2_backend.errors import ConfigError
from exl2_backend.format.generation_defaults import generation_defaults
from exl2_backend.serve.schemas import API_SAMPLING_DEFAULTS, ChatCompletionRequest, CompletionRequest

LLAMA31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6,
           "top_p": 0.9, "transformers_version": "4.42.3"}
QWEN25 = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
          "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_the_keys_a_model_ships():
    assert generation_defaults(LLAMA31) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults(QWEN25) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert generation_defaults({"bos_token_id": 1, "eos_token_id": 2}) == {}
    assert generation_defaults({"top_k": -1, "min_p": 0.05, "max_new_tokens": 512, "temperature": None}) == {
        "top_k": 0, "min_p": 0.05, "max_new_tokens": 512}
    assert generation_defaults({"temperature": 1}) == {"temperature": 1.0}


@pytest.mark.parametrize("key, value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0),
                                        ("repetition_penalty", 0.0), ("top_k", -2), ("top_k", 2.5),
                                        ("max_new_tokens", 0), ("temperature", "0.7"), ("top_p", True),
                                        ("temperature", float("nan"))])
def test_a_bad_value_is_a_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError) as exc:
        generation_defaults({key: value}, "/m/generation_config.json")
    assert key in str(exc.value) and exc.value.field == key


def test_the_model_config_reads_them_at_load(tmp_path):
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.inspect import describe_model
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=1)
    assert ModelConfig.from_dir(d).generation_defaults == {}
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9}))
    assert ModelConfig.from_dir(d).generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert describe_model(d)["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.9}  # what `info` shows
    (d / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ConfigError, match="top_p"):
        ModelConfig.from_dir(d)


def test_left_out_fields_take_the_model_defaults_then_the_apis():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64}
    ask = [{"role": "user", "content": "hi"}]
    fields = ChatCompletionRequest(messages=ask).sampling_fields(defaults)
    assert (fields["temperature"], fields["top_p"], fields["top_k"], fields["min_p"], fields["repetition_penalty"]) \
        == (0.6, 0.9, 20, 0.0, 1.0)
    fields = ChatCompletionRequest(messages=ask, temperature=0.0, top_p=1.0, top_k=0).sampling_fields(defaults)
    assert (fields["temperature"], fields["top_p"], fields["top_k"]) == (0.0, 1.0, 0)  # given: the request's
    plain = CompletionRequest(prompt="hi").sampling_fields(None)
    assert {k: plain[k] for k in API_SAMPLING_DEFAULTS} == API_SAMPLING_DEFAULTS
