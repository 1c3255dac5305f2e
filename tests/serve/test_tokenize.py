"""vLLM's /tokenize and /detokenize on the real server (127.0.0.1): the ids a completion's prompt gets (text with
the BOS rule or without special tokens; chat messages through the template, continue_final_message too), the text
of ids, and 400s naming the field. Answered on the engine thread between steps, so a running generation goes on."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct-exl2"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_tokenize_matches_what_completions_count(http, client):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "The capital of France is"})
    assert r.status_code == 200, r.text
    body = r.json()
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1)
    assert body["count"] == len(body["tokens"]) == completion.usage.prompt_tokens
    assert body["max_model_len"] == 512
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage.prompt_tokens
    begun = CHAT + [{"role": "assistant", "content": "The capital is"}]
    cont = http.post("/tokenize", json={"messages": begun, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()
    text = http.post("/detokenize", json={"tokens": cont["tokens"]}).json()["prompt"]
    assert text.endswith("The capital is")
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == "The capital of France is"


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {}, "body"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "body"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "body"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/detokenize", {"tokens": []}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_bodies_are_400_naming_the_field(http, path, body, field):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.json()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_text_sure_to_exceed_the_context_is_refused_untokenized(http, add_special_tokens):
    """1.5 MB of text against a 512-token context: a 400 naming the limit, answered without tokenizing it (the
    engine thread is not held for seconds), with or without special tokens."""
    r = http.post("/tokenize", json={"prompt": "word " * 300_000, "add_special_tokens": add_special_tokens})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "512" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
