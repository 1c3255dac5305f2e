"""Tool calls in the model's own convention, end to end on a small random model (CPU) whose tokenizer has the
<|python_tag|> and [TOOL_CALLS] tokens:
- Llama 3.x ("llama3_json"), detected from its chat template, through the real server on 127.0.0.1 and the real
  openai client: forced calls are `{"name", "parameters"}` objects read back into tool_calls, streamed and not, and
  the call with its result renders into the next turn;
- Mistral ("mistral") through the hooks: the grammar the handle's tool_call_format asks for makes the reply the
  [TOOL_CALLS] token and a list, which reads back into calls with 9-character ids;
- Mistral v11+ ("mistral_v11") through the hooks and the real server: [TOOL_CALLS]name[ARGS]{...}, the tokens kept
  in the event text, calls read back whole and streamed.
The random weights say nothing about quality; the grammar decides every token of a forced call here (one function,
its one argument an enum), so the replies are known."""

from __future__ import annotations

import json

import pytest

from tests.helpers.tool_templates import (
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    MISTRAL_V11_TEMPLATE,
    V11_MARKERS,
    add_marker_tokens,
    set_chat_template,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VOCAB = 300
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
                                                "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def _model(directory, template: str, markers=None):
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    # with its byte-level tokenizer (a prompt is a token per byte: a longer context)
    write_tiny_exl2_model(directory, tiny_config_dict(vocab_size=VOCAB, max_position_embeddings=2048), seed=5)
    assert max(add_marker_tokens(directory, *([markers] if markers else [])).values()) < VOCAB
    set_chat_template(directory, template)
    return directory


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    from exl2_backend.serve.server import ServerProcess

    directory = _model(tmp_path_factory.mktemp("llama3") / "m", LLAMA3_TEMPLATE)
    settings = {"model_dir": str(directory), "device": "cpu", "max_seq_len": 2048, "cache_tokens": 8192,
                "max_batch_size": 4, "log_level": "warning"}
    with ServerProcess(settings, startup_timeout=600) as srv:
        yield srv


@pytest.fixture(scope="module")
def llama_client(llama_server):
    from openai import OpenAI

    return OpenAI(base_url=llama_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _forced_call_round_trip(client, max_tokens: int):
    """A call of get_weather forced through the server (greedy, one call), the same streamed (id and name first,
    then the arguments in pieces that add up to the same text), and the call with its result sent back through the
    model's template, whose next turn calls again -> (the call, the streamed deltas)."""
    kw = {"model": client.models.list().data[0].id, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
          "parallel_tool_calls": False, "temperature": 0, "max_tokens": max_tokens}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
    deltas = [d for c in client.chat.completions.create(stream=True, **kw) if c.choices
              for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "-3C"},
                     {"role": "user", "content": "And in Rome?"}]
    again = client.chat.completions.create(**dict(kw, messages=history))
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
    return call, deltas


def test_llama3_calls_through_the_server(llama_client):
    call, deltas = _forced_call_round_trip(llama_client, max_tokens=80)
    assert call.id.startswith("call_") and deltas[0].id.startswith("call_") and len(deltas) > 2


def test_llama3_auto_reads_a_json_reply_as_a_call(llama_client):
    """"auto": the reply is text or calls; if it starts with "{" it is a call (the grammar holds it to one)."""
    r = llama_client.chat.completions.create(model=llama_client.models.list().data[0].id, messages=ASK,
                                             tools=[WEATHER], temperature=0, max_tokens=60)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "get_weather"
    else:
        assert not msg.content.lstrip().startswith("{")


@pytest.fixture(scope="module")
def v11_client(tmp_path_factory):
    from openai import OpenAI

    from exl2_backend.serve.server import ServerProcess

    directory = _model(tmp_path_factory.mktemp("v11") / "m", MISTRAL_V11_TEMPLATE, V11_MARKERS)
    settings = {"model_dir": str(directory), "device": "cpu", "max_seq_len": 2048, "cache_tokens": 8192,
                "max_batch_size": 4, "log_level": "warning"}
    with ServerProcess(settings, startup_timeout=600) as srv:
        yield OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_mistral_v11_calls_through_the_server(v11_client):
    """Mistral v11+ through the real server: a forced call comes back as tool_calls with a 9-character id, streamed
    as deltas whose arguments add up to the same text, and the call with its result renders into the next turn."""
    call, deltas = _forced_call_round_trip(v11_client, max_tokens=60)
    assert len(call.id) == 9 and call.id.isalnum() and len(deltas[0].id) == 9


def _forced_calls(pm, h, fmt, parallel: bool, max_tokens: int) -> list:
    """The events of a reply held to calls of get_weather (greedy, through the hooks), after a history holding an
    earlier call with an OpenAI-style id and its result."""
    from exl2_backend.plugin.types import SequenceRequest, StepBatch
    from exl2_backend.serve.tools import ToolDef, tool_grammar

    grammar = tool_grammar([ToolDef.model_validate(WEATHER)], "required", parallel, fmt)
    earlier = {"id": "call_4d1f", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [earlier]},
                      {"role": "tool", "tool_call_id": "call_4d1f", "content": "20C"},
                      {"role": "user", "content": "And Oslo?"}]
    req = SequenceRequest("m", messages=messages, tools=[WEATHER], grammar=grammar, temperature=0.0,
                          max_new_tokens=max_tokens)
    events = pm.hook.exl2_prefill(handle=h, batch=StepBatch(new=[req]))
    for _ in range(max_tokens):  # bounded
        if events[-1].finished:
            break
        events += pm.hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["m"]))
    return events


def test_mistral_calls_through_the_hooks(tmp_path):
    from exl2_backend.plugin.manager import new_plugin_manager
    from exl2_backend.serve.tools import split_tool_calls
    from exl2_backend.tokenizer.tool_formats import format_from_dict

    directory = _model(tmp_path / "m", MISTRAL_TEMPLATE)
    pm = new_plugin_manager(builtin_fallback=True)
    h = pm.hook.exl2_load(settings={"model_dir": str(directory), "device": "cpu", "max_seq_len": 2048})
    try:
        fmt = format_from_dict(h.tool_call_format())
        assert fmt.name == "mistral" and fmt.marker_id == h.engine.tokenizer.token_to_id("[TOOL_CALLS]")
        assert h.tool_call_format("hermes") == {"name": "hermes", "marker_id": None, "tag_ids": None,
                                                "args_marker_id": None, "parallel": True}
        # an earlier call with an OpenAI-style id renders (the template demands 9 characters)
        events = _forced_calls(pm, h, fmt, parallel=False, max_tokens=80)  # the call is ~45 tokens here
        ids = [t for e in events for t in e.token_ids]
        assert ids[0] == fmt.marker_id and events[-1].finish_reason == "stop"
        content, calls = split_tool_calls("".join(e.text for e in events), fmt)
        assert content is None and calls[0]["function"]["name"] == "get_weather"
        assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    finally:
        pm.hook.exl2_unload(handle=h)


def test_mistral_v11_calls_through_the_hooks(tmp_path):
    """Two forced calls in the v11 convention: each [TOOL_CALLS], the name, [ARGS] and the arguments; the event text
    keeps the three tokens, so it reads back into calls; an earlier call renders with its id shortened."""
    from exl2_backend.plugin.manager import new_plugin_manager
    from exl2_backend.serve.tools import split_tool_calls
    from exl2_backend.tokenizer.tool_formats import format_from_dict

    directory = _model(tmp_path / "m", MISTRAL_V11_TEMPLATE, V11_MARKERS)
    pm = new_plugin_manager(builtin_fallback=True)
    h = pm.hook.exl2_load(settings={"model_dir": str(directory), "device": "cpu", "max_seq_len": 2048})
    try:
        tok = h.engine.tokenizer
        fmt = format_from_dict(h.tool_call_format())
        assert fmt.name == "mistral_v11" and fmt.args_marker_id == tok.token_to_id("[ARGS]")
        events = _forced_calls(pm, h, fmt, parallel=True, max_tokens=60)  # a call is ~30 tokens here
        ids = [t for e in events for t in e.token_ids]
        text = "".join(e.text for e in events)
        assert ids[0] == fmt.marker_id and text.startswith("[TOOL_CALLS]get_weather[ARGS]{")
        content, calls = split_tool_calls(text, fmt)
        assert calls and all(c["function"]["name"] == "get_weather" and len(c["id"]) == 9 for c in calls)
        assert all(json.loads(c["function"]["arguments"])["city"] in ("Oslo", "Rome") for c in calls)
        # max_new_tokens may cut a later call: the calls before the cut stay calls
        assert content is None or events[-1].finish_reason == "length"
    finally:
        pm.hook.exl2_unload(handle=h)
