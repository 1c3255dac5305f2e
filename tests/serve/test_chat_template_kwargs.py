"""chat_template_kwargs (vLLM's request field; hook API 1.6) through the real server (LitServe on 127.0.0.1, the real
openai client): extra variables reach the chat template in a chat completion, /tokenize and the Responses API
(reasoning effort as `reasoning_effort`), names the renderer sets itself are refused with 400s naming the field, and
a reasoning model whose template opens the thinking block refuses them (where its reply begins is learned once)."""

from __future__ import annotations

import pytest

from tests.helpers.tool_templates import REASONING_TEMPLATE, add_reasoning_tokens, set_chat_template

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# a template in the Llama 3.1 manner: a date line when date_string is given, an effort line for reasoning_effort
TEMPLATE = ("{{ bos_token }}{% if date_string is defined %}date: {{ date_string }}\n{% endif %}"
            "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
ASK = [{"role": "user", "content": "hi"}]


def _server(tmp_path_factory, name: str, template: str, reasoning: bool = False):
    from exl2_backend.serve.server import ServerProcess
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    directory = tmp_path_factory.mktemp(name) / "m"
    write_tiny_exl2_model(directory, tiny_config_dict(vocab_size=300), seed=3)
    if reasoning:
        add_reasoning_tokens(directory)
    set_chat_template(directory, template)
    settings = {"model_dir": str(directory), "device": "cpu", "max_seq_len": 512, "cache_tokens": 4096,
                "max_batch_size": 4, "log_level": "warning"}
    return ServerProcess(settings, startup_timeout=600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _server(tmp_path_factory, "kwargs", TEMPLATE) as srv:
        yield srv


def _tokenized(http, **body) -> tuple[int, str]:
    r = http.post("/tokenize", json={"messages": ASK, **body})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    return len(ids), http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_variables_reach_the_template(server):
    import httpx
    from openai import OpenAI

    http = httpx.Client(base_url=server.base_url, timeout=120)
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    plain_n, plain = _tokenized(http)
    dated_n, dated = _tokenized(http, chat_template_kwargs={"date_string": "26 Jul 2024"})
    assert "date:" not in plain and "date: 26 Jul 2024\nuser: hi" in dated and dated_n > plain_n
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"date_string": "26 Jul 2024"}})
    assert chat.usage.prompt_tokens == dated_n
    effort_n, effort = _tokenized(http, chat_template_kwargs={"reasoning_effort": "low"})
    assert "effort: low" in effort
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, reasoning_effort="low")
    assert chat.usage.prompt_tokens == effort_n
    resp = client.responses.create(model=model, input="hi", max_output_tokens=1, reasoning={"effort": "low"})
    assert resp.usage.input_tokens == effort_n


@pytest.mark.parametrize("kwargs, says", [
    ({"messages": []}, "set by the server"),
    ({"add_generation_prompt": False}, "set by the server"),
    ({"bos_token": "x"}, "set by the server"),
    ({"not-a-name": 1}, "identifiers"),
    ([1, 2], "dictionary"),
    ({f"v{i}": i for i in range(33)}, "at most 32"),
])
def test_bad_variables_are_refused(server, kwargs, says):
    import httpx

    for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 1}), ("/tokenize", {"messages": ASK})):
        r = httpx.post(server.base_url + path, json={**body, "chat_template_kwargs": kwargs}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "chat_template_kwargs" and says in error["message"], (path, error)


def test_a_template_that_opens_the_thinking_block_refuses_them(tmp_path_factory):
    import httpx

    with _server(tmp_path_factory, "kwargs_reasoning", REASONING_TEMPLATE, reasoning=True) as srv:
        body = {"messages": ASK, "max_tokens": 1}
        r = httpx.post(srv.base_url + "/v1/chat/completions",
                       json={**body, "chat_template_kwargs": {"enable_thinking": False}}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        ok = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "reasoning_effort": "low"}, timeout=120)
        assert ok.status_code == 200, ok.text  # the effort is simply not passed to such a template
