"""OpenAI's Responses API (POST /v1/responses) through the real server (LitServe + the default model on CPU,
127.0.0.1) and the real openai client: text replies equal the chat completion of the same conversation, streamed
events add up to the same output, max_output_tokens marks the response incomplete, function calls come back as
function_call items and go back in as input items, text.format constrains the answer, stored responses continue
through previous_response_id (and are read, listed and deleted), and what this server cannot do is a 400 naming the
field."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct-exl2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_reply_equals_the_chat_completion(client):
    r = client.responses.create(model=MODEL, instructions="Answer briefly.", input="What is the capital of France?",
                                temperature=0, max_output_tokens=24)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [o.type for o in r.output] == ["message"] and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.store is True and r.instructions == "Answer briefly." and r.previous_response_id is None


def test_streamed_events_add_up_to_the_response(client):
    kw = {"model": MODEL, "input": [{"role": "user", "content": "Name three colors."}], "temperature": 0,
          "max_output_tokens": 20}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert done.text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    order = [k for k in kinds if k.startswith(("response.output_item", "response.content_part"))]
    assert order == ["response.output_item.added", "response.content_part.added", "response.content_part.done",
                     "response.output_item.done"]


def test_max_output_tokens_leaves_it_incomplete(client):
    for stream in (False, True):
        r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=5, stream=stream)
        r = list(r)[-1].response if stream else r
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete" and r.usage.output_tokens == 5


def test_function_calls_out_and_back_in(client):
    first = client.responses.create(model=MODEL, input="What is the weather like in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=60)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"} and call.call_id
    streamed = list(client.responses.create(stream=True, model=MODEL, input="What is the weather like in Paris?",
                                            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_output_tokens=60))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments == next(e.arguments for e in streamed
                                          if e.type == "response.function_call_arguments.done")
    second = client.responses.create(model=MODEL, temperature=0, max_output_tokens=20, tools=[WEATHER], input=[
        {"role": "user", "content": "What is the weather like in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}], tool_choice="none")
    assert second.output_text and second.output[0].type == "message"


def test_text_format_holds_the_answer(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Make up a person.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("patch, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),  # never stored
    ({"conversation": "conv_1"}, "conversation"),  # never made
    ({"conversation": {"name": "x"}}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"truncation": "middle"}, "truncation"),
    ({"input": "x" * 3000}, "input"),  # longer than the served context (512)
])
def test_what_cannot_be_done_is_400_naming_the_field(http, patch, param):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **patch})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_stream_closed_early_frees_its_sequence(server, http):
    """A client that leaves a Responses stream after a few deltas: the sequence is cancelled and its pages come
    back, far short of its 400 tokens."""
    import httpx

    from tests.serve.test_openai_server import metrics, wait_idle

    before = metrics(http)
    body = {"model": MODEL, "input": "Tell me a long story.", "temperature": 0.8, "max_output_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as c, c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():  # bounded: closed after three text deltas
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                break
    after = wait_idle(http, before)
    generated = (after["exl2_backend_generation_tokens_total"]
                 - before.get("exl2_backend_generation_tokens_total", 0))
    assert generated < 200, f"{generated} tokens: the sequence ran on after the client left"


def test_previous_response_id_continues_the_conversation(client):
    """A chained response answers as the chat completion of the whole conversation would: the previous input and
    output before the new input, the new instructions only (the old ones do not carry over)."""
    first = client.responses.create(model=MODEL, instructions="Be terse.", input="My name is Ada. Say hello.",
                                    temperature=0, max_output_tokens=16)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, instructions="Answer briefly.",
                                     input="What is my name?", temperature=0, max_output_tokens=16)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    # streamed, the same; and the streamed response is stored too
    events = list(client.responses.create(stream=True, model=MODEL, previous_response_id=first.id,
                                          instructions="Answer briefly.", input="What is my name?", temperature=0,
                                          max_output_tokens=16))
    final = events[-1].response
    assert final.output_text == second.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_function_call_answered_through_previous_response_id(client):
    """The call stays in the stored conversation: only its output goes in the next request."""
    first = client.responses.create(model=MODEL, input="What is the weather like in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=60)
    (call,) = [o for o in first.output if o.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=[WEATHER],
                                      tool_choice="none", temperature=0, max_output_tokens=20)
    whole = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", temperature=0,
                                    max_output_tokens=20, input=[
                                        {"role": "user", "content": "What is the weather like in Paris?"},
                                        {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                         "arguments": call.arguments}, output])
    assert chained.output_text == whole.output_text and chained.usage.input_tokens == whole.usage.input_tokens


def test_stored_responses_are_read_listed_and_deleted(client, http):
    import openai

    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi."},
                                                    {"role": "assistant", "content": "Hello!"},
                                                    {"role": "user", "content": "Name a fruit."}],
                                temperature=0, max_output_tokens=8)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.store is True
    items = client.responses.input_items.list(r.id)  # newest first, each with an id
    assert [i.content[0].text for i in items.data] == ["Name a fruit.", "Hello!", "Hi."]
    assert all(i.id.startswith("msg_") for i in items.data)
    page = http.get(f"/v1/responses/{r.id}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["Hi.", "Hello!"] and page["has_more"] is True
    rest = http.get(f"/v1/responses/{r.id}/input_items", params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Name a fruit."] and rest["has_more"] is False
    for limit in (0, "x", 101):
        bad = http.get(f"/v1/responses/{r.id}/input_items", params={"limit": limit})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    bad = http.get(f"/v1/responses/{r.id}/input_items", params={"order": "up"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "order"
    bad = http.get(f"/v1/responses/{r.id}/input_items", params={"after": "msg_none"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    assert bad.json()["error"]["message"] == "no input item 'msg_none' in this response"
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    gone = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": r.id})
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"
    assert http.delete(f"/v1/responses/{r.id}").status_code == 404
    unstored = client.responses.create(model=MODEL, input="Hi.", store=False, max_output_tokens=4)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_truncation_auto_drops_the_oldest_turns(client, http):
    """A chain longer than the served context (512): a 400 naming the input, or with truncation "auto" the reply to
    the newest turn alone (the older one dropped); the stored conversation keeps both."""
    long = "word " * 300  # ~300 tokens: one turn fits, two do not
    first = client.responses.create(model=MODEL, input="Remember: " + long, max_output_tokens=8, temperature=0)
    kw = {"model": MODEL, "previous_response_id": first.id, "input": "Now: " + long, "max_output_tokens": 8,
          "temperature": 0}
    refused = http.post("/v1/responses", json=kw)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    cut = client.responses.create(truncation="auto", **kw)
    alone = client.responses.create(model=MODEL, input="Now: " + long, max_output_tokens=8, temperature=0)
    assert cut.truncation == "auto" and cut.output_text == alone.output_text
    assert cut.usage.input_tokens == alone.usage.input_tokens
    assert len(client.responses.input_items.list(cut.id).data) == 1  # its own input; the chain is stored whole


def test_a_conversation_carries_the_turns(client, http):
    """The Conversations API: a conversation made with an item, continued by two responses (each appends its input
    and output), read, listed, an item fetched and deleted, metadata updated, then deleted."""
    import openai

    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    first = client.responses.create(model=MODEL, conversation=conv.id, input="Say hello.", temperature=0,
                                    max_output_tokens=8)
    assert first.conversation.id == conv.id
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Say hello."}])
    assert first.output_text == chat.choices[0].message.content
    second = client.responses.create(model=MODEL, conversation={"id": conv.id}, input="What is my name?",
                                     temperature=0, max_output_tokens=8, store=False)
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 5 and items[2].content[0].text == first.output_text
    assert items[4].content[0].text == second.output_text  # appended although the response was not stored
    got = http.get(f"/v1/conversations/{conv.id}/items/{items[1].id}").json()
    assert got["content"][0]["text"] == "Say hello."
    client.conversations.items.delete(items[1].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id).data) == 4
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    assert added.data[0].id.startswith("msg_")
    assert client.conversations.update(conv.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    both = http.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": conv.id,
                                            "previous_response_id": first.id})
    assert both.status_code == 400 and both.json()["error"]["param"] == "conversation"
    bad = http.post(f"/v1/conversations/{conv.id}/items", json={"items": [{"type": "web_search_call"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "items.0.type"
    bad = http.get(f"/v1/conversations/{conv.id}/items", params={"after": "msg_none"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "no item 'msg_none' in this conversation"
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    assert http.get(f"/v1/conversations/{conv.id}/items").status_code == 404
