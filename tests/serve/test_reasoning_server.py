"""A reasoning model through the real server (LitServe on 127.0.0.1, the real openai client): a small random model
(CPU) whose template opens a <think> block at the generation prompt, detected as a reasoning model. Logit biases
make the random model's replies known: thinking comes back as `reasoning_content` (streamed as its deltas),
include_reasoning false drops it, and a JSON response format holds the answer after the thinking."""

from __future__ import annotations

import pytest

from tests.helpers.tool_templates import REASONING_TEMPLATE, add_reasoning_tokens, set_chat_template

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# llguidance takes an added token spelled <...> as a special token, named in Lark as itself
SHAPE = {"grammar": "start: /[a-z]{4} [a-z]{4}/ </think> /[a-z]{3}/"}
ASK = [{"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    from exl2_backend.serve.server import ServerProcess
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    directory = tmp_path_factory.mktemp("reasoning") / "m"
    write_tiny_exl2_model(directory, tiny_config_dict(vocab_size=300), seed=7)
    add_reasoning_tokens(directory)
    set_chat_template(directory, REASONING_TEMPLATE)
    settings = {"model_dir": str(directory), "device": "cpu", "max_seq_len": 512, "cache_tokens": 4096,
                "max_batch_size": 4, "log_level": "warning"}
    with ServerProcess(settings, startup_timeout=600) as srv:
        yield OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _token(client, text: str) -> int:
    import httpx

    root = str(client.base_url).rstrip("/").removesuffix("/v1")  # /tokenize is not under /v1
    (token,) = httpx.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token


def _think_in_as(client, **kw):
    """A reply cut while it thinks: a +100 bias makes this random model write "a" six times."""
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=6,
                                          logit_bias={str(_token(client, "a")): 100}, **kw)


def test_thinking_comes_back_apart(client):
    r = _think_in_as(client)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("aaaaaa", None, "length")
    assert r.usage.completion_tokens_details.reasoning_tokens == 6  # every token was thinking
    chunks = [c.choices[0].delta for c in _think_in_as(client, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == "aaaaaa"
    assert not any(d.content for d in chunks)
    dropped = _think_in_as(client, extra_body={"include_reasoning": False}).choices[0].message
    assert getattr(dropped, "reasoning_content", None) is None and dropped.content is None


def test_an_earlier_answer_goes_back_without_its_thinking(client):
    """The template drops the thinking of earlier turns (the request renders and is answered)."""
    model = client.models.list().data[0].id
    history = ASK + [{"role": "assistant", "content": "<think>aaaa</think>Because."},
                     {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=3,
                                           logit_bias={str(_token(client, "a")): 100})
    assert again.choices[0].message.reasoning_content == "aaa"


def test_a_json_answer_after_the_thinking(client):
    """response_format json_schema on a reasoning model: the constraint holds the answer, after the thinking (a
    +100 bias on </think> makes this random model close the block at once; the schema then fixes the answer)."""
    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=40,
                                       logit_bias={str(_token(client, "</think>")): 100},
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "r", "schema": schema}})
    msg = r.choices[0].message
    assert msg.content == '{"ok": true}' and msg.reasoning_content is None and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == 1  # the closing tag


def test_thinking_as_a_reasoning_item_in_the_responses_api(client):
    model = client.models.list().data[0].id
    bias = {"logit_bias": {str(_token(client, "a")): 100}}  # the chat extension, through extra_body
    r = client.responses.create(model=model, input="Why?", max_output_tokens=6, temperature=0, extra_body=bias)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text == "aaaaaa"
    assert r.usage.output_tokens_details.reasoning_tokens == 6
    events = list(client.responses.create(model=model, input="Why?", max_output_tokens=6, temperature=0,
                                          extra_body=bias, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "aaaaaa"
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 6


def test_magistral_thinking_through_the_hooks(tmp_path):
    """Magistral's [THINK] / [/THINK] special tokens through the hooks: the handle names them as the reasoning tags,
    a grammar behind the thinking names them by id, and the reply's text (the tags kept) splits into thinking and
    answer."""
    from exl2_backend.plugin.manager import new_plugin_manager
    from exl2_backend.plugin.types import SequenceRequest, StepBatch
    from exl2_backend.tokenizer.reasoning import ReasoningTags, split_reasoning
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model
    from tests.helpers.tool_templates import MAGISTRAL_TEMPLATE, add_marker_tokens

    directory = tmp_path / "m"
    write_tiny_exl2_model(directory, tiny_config_dict(vocab_size=300), seed=7)
    ids = add_marker_tokens(directory, ["[THINK]", "[/THINK]"])
    set_chat_template(directory, MAGISTRAL_TEMPLATE)
    pm = new_plugin_manager(builtin_fallback=True)
    h = pm.hook.exl2_load(settings={"model_dir": str(directory), "device": "cpu", "max_seq_len": 512})
    try:
        tags = ReasoningTags.from_dict(h.reasoning_tags())
        assert (tags.open, tags.close, tags.prompt_opens) == ("[THINK]", "[/THINK]", False)
        grammar = {"type": "lark", "value": f"start: <[{ids['[THINK]']}]> /[a-z]{{4}}/ <[{ids['[/THINK]']}]> "
                                            "/[a-z]{3}/"}
        req = SequenceRequest("m", messages=ASK, grammar=grammar, temperature=0.0, max_new_tokens=20)
        events = pm.hook.exl2_prefill(handle=h, batch=StepBatch(new=[req]))
        for _ in range(20):  # bounded: the reply is at most 9 tokens of this byte-level vocabulary
            if events[-1].finished:
                break
            events += pm.hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["m"]))
        text = "".join(e.text for e in events)
        thinking, answer = split_reasoning(text, tags)
        assert text.startswith("[THINK]") and len(thinking) == 4 and len(answer) == 3, text
    finally:
        pm.hook.exl2_unload(handle=h)
