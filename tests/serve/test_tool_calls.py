"""Function calling through the real server (LitServe + the default model on CPU, 127.0.0.1) and the real openai
client: tool_choice "required" and a named function give calls whose arguments follow the function's schema
(finish_reason "tool_calls"), streaming and not; "auto" gives either calls or text; "none" and
parallel_tool_calls false are honoured; the calls and their results go back into the next turn's prompt; bad tool
definitions are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct-exl2"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                  "maxLength": 30}},
                                                        "required": ["city"], "additionalProperties": False}}}


def _check_weather_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_follow_the_schema(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       temperature=0, max_tokens=80, parallel_tool_calls=False)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    assert len(choice0.message.tool_calls) == 1
    if isinstance(choice, dict):
        _check_weather_call(choice0.message.tool_calls[0])
    else:
        assert choice0.message.tool_calls[0].function.name in ("get_weather", "get_time")
        json.loads(choice0.message.tool_calls[0].function.arguments)


def test_streamed_calls_equal_the_collected_ones(client):
    """Streaming sends each call's id and name first, then its arguments in pieces as they are generated; put
    together as a client does, they equal the non-streamed call, and no content goes out."""
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 120,
          "tool_choice": "required", "parallel_tool_calls": False}  # several calls: test_tool_prompt.py
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
        assert d.id is None or d.id == call["id"]  # the id and name come once, with the call's first delta
        call["arguments"] += d.function.arguments or ""
    assert len(deltas) > len(calls)  # the arguments came in pieces
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(w.function.name, w.function.arguments) for w in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_auto_gives_calls_or_text_and_none_gives_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80)
    msg, reason = r.choices[0].message, r.choices[0].finish_reason
    if msg.tool_calls:
        assert reason == "tool_calls"
        _check_weather_call(msg.tool_calls[0])
    else:
        assert reason in ("stop", "length") and msg.content and not msg.content.startswith("<")
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_a_call_and_its_result_go_back_into_the_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert r.choices[0].message.content and r.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("patch, needle", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "nonsense"),
    ({"tool_choice": "required"}, "no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "other"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "not both"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "assistant"),
])
def test_bad_tool_requests_are_400(http, patch, needle):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **patch})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
