"""The model's sampling defaults (generation_config.json; hook API 1.8 `generation_defaults()`) through the real
server (LitServe on 127.0.0.1, the real openai client): with `--generation-config auto` (the default) a request that
leaves temperature and max_tokens out gets the model's (here greedy and 5 tokens), a request that gives them its
own, and a Responses API response says the sampling it ran with; with `none` the OpenAI API's (temperature 1)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GEN = {"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5}


def _server(tmp_path_factory, mode: str):
    from exl2_backend.serve.server import ServerProcess
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    directory = write_tiny_exl2_model(tmp_path_factory.mktemp(f"gen_{mode}") / "m", tiny_config_dict(), seed=5)
    (directory / "generation_config.json").write_text(json.dumps(GEN))
    settings = {"model_dir": str(directory), "device": "cpu", "max_seq_len": 256, "cache_tokens": 2048,
                "max_batch_size": 2, "log_level": "warning", "generation_config": mode}
    return ServerProcess(settings, startup_timeout=600)


def _client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def _complete(client, model, **kw):
    r = client.completions.create(model=model, prompt="hello there", extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].text, r.usage.completion_tokens


def test_left_out_fields_take_the_models_defaults(tmp_path_factory):
    with _server(tmp_path_factory, "auto") as server:
        client, model = _client(server)
        text, n = _complete(client, model, seed=1)  # no temperature, no max_tokens: greedy, 5 tokens
        assert n == 5
        assert (text, n) == _complete(client, model, temperature=0.0, max_tokens=5, seed=2)
        assert _complete(client, model, max_tokens=3)[1] == 3  # given: the request's own
        sampled = {_complete(client, model, temperature=1.0, seed=s)[0] for s in range(6)}
        assert len(sampled) > 1  # temperature given: sampled, not the model's greedy default
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
        response = client.responses.create(model=model, input="hi", max_output_tokens=4)
        assert (response.temperature, response.top_p) == (0.0, 1.0)  # the sampling it ran with: the model's, the API's
        response = client.responses.create(model=model, input="hi", max_output_tokens=4, temperature=0.5)
        assert response.temperature == 0.5


def test_none_keeps_the_apis_defaults(tmp_path_factory):
    with _server(tmp_path_factory, "none") as server:
        client, model = _client(server)
        got = _complete(client, model, seed=3, max_tokens=8)
        assert got == _complete(client, model, seed=3, max_tokens=8, temperature=1.0)  # the API's temperature 1
