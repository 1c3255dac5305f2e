"""Structured output through the real server (LitServe + the default model on CPU, 127.0.0.1) and the real openai
client: response_format json_object / json_schema (chat and text completions), the client's `parse` helper with a
pydantic model, vLLM's structured_outputs (json, regex, choice, grammar) through extra_body, streaming, n > 1; a
constraint that does not compile, or two at once, is a 400 naming the field, and the server stays healthy."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct-exl2"
ANN = [{"role": "user", "content": "Return a JSON object with the name and age of Ann, who is 31."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _schema_format(schema=PERSON) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _is_person(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"name", "age"} and isinstance(obj["name"], str) and type(obj["age"]) is int


def test_json_schema_chat_streaming_and_not(client):
    r = client.chat.completions.create(model=MODEL, messages=ANN, temperature=0, max_tokens=60,
                                       response_format=_schema_format())
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and _is_person(text), text
    stream = client.chat.completions.create(model=MODEL, messages=ANN, temperature=0, max_tokens=60, stream=True,
                                            response_format=_schema_format())
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_the_clients_parse_helper_with_a_pydantic_model(client):
    class Person(BaseModel):
        name: str
        age: int

    r = client.chat.completions.parse(model=MODEL, messages=ANN, temperature=0, max_tokens=60, response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.age, int)


def test_json_object_chat_and_completions_with_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=ANN, temperature=0.7, top_p=0.9, seed=3, n=2,
                                       max_tokens=80, response_format={"type": "json_object"})
    assert len(r.choices) == 2
    for choice in r.choices:
        if choice.finish_reason == "stop":  # a sampled object may run to max_tokens; a finished one parses
            assert isinstance(json.loads(choice.message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Ann is 31. As JSON:", temperature=0, max_tokens=60,
                                  extra_body={"response_format": _schema_format()})
    assert r.choices[0].finish_reason == "stop" and _is_person(r.choices[0].text)


@pytest.mark.parametrize("constraint, conforms", [
    ({"regex": r"(yes|no), because [a-z ]{1,30}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", t)),
    ({"choice": ["Paris", "London", "Rome"]}, lambda t: t in ("Paris", "London", "Rome")),
    ({"grammar": 'start: "The answer is " CITY "."\nCITY: "Paris" | "Lyon"'},
     lambda t: t in ("The answer is Paris.", "The answer is Lyon.")),
    ({"json": json.dumps(PERSON)}, _is_person),
])
def test_structured_outputs_extension(client, constraint, conforms):
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=60,
                                       messages=[{"role": "user", "content": "Is Paris the capital of France?"}],
                                       extra_body={"structured_outputs": constraint})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and conforms(text), text


@pytest.mark.parametrize("patch, field, needle", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"response_format": _schema_format({"type": "nonsense"})}, "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": PERSON}}},
     "response_format", "name"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "missing_rule"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "body", "not both"),
])
def test_bad_constraints_are_400_naming_the_field(http, patch, field, needle):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ANN, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and needle in err["message"], err
    assert http.get("/health").status_code == 200
