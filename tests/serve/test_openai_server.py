"""The OpenAI-compatible server end to end: a real LitServe server on 127.0.0.1 (tests/serve/conftest.py) with
the default model on CPU, driven by the official `openai` client and by raw HTTP where the client hides
details (status codes, headers, SSE lines)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct-exl2"
MAX_SEQ_LEN = 512  # tests/serve/conftest.py SERVER_SETTINGS
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def metrics(http) -> dict[str, float]:
    """Prometheus samples as {name{label=value,...}: value} (model label dropped)."""
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(http, baseline: dict, timeout: float = 120.0) -> dict:
    """Poll /metrics until no sequence runs and the KV cache is back at `baseline`."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if (m["exl2_backend_active_sequences"] == 0 and m["exl2_backend_queue_length"] == 0
                and m["exl2_backend_kv_pages_free"] == baseline["exl2_backend_kv_pages_free"]
                and m["exl2_backend_kv_free_tokens"] == baseline["exl2_backend_kv_free_tokens"]):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not return to idle: {m}")
        time.sleep(0.25)


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- basics ---------------------------------------------------------------------------------------------------


def test_health_and_models(http, client):
    assert http.get("/health").status_code == 200
    r = http.get("/v1/chat/completions")  # wrong method: 405 in the OpenAI error shape
    assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"]
    r = http.post("/v1/nothing-here", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_SEQ_LEN


def test_unknown_model_is_404_naming_the_served_one(client, http):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE, max_tokens=2)
    assert MODEL in str(ei.value) and "gpt-4o" in str(ei.value)
    r = http.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and MODEL in r.json()["error"]["message"]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.model == MODEL and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens < 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_reports_the_prefix_cache_hit(client):
    """usage.prompt_tokens_details.cached_tokens: a repeated long prompt's full KV pages (256 tokens here) come from
    the prefix cache, counted in the response, streamed or not."""
    story = "Once upon a time there was a small robot who lived in a lighthouse by the sea. " * 16
    kw = {"model": MODEL, "messages": [{"role": "user", "content": story + "Who lived there?"}], "max_tokens": 2,
          "temperature": 0}
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 256
    assert again.usage.prompt_tokens_details.cached_tokens == 256
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_continue_final_message_continues_the_assistants_reply(client, http):
    """vLLM's add_generation_prompt / continue_final_message: the prompt ends inside the assistant message the client
    began, so the reply continues it (prompt tokens: the rendering cut after that text, its end-of-turn dropped)."""
    begun = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    kw = {"model": MODEL, "messages": begun, "temperature": 0, "max_tokens": 4}
    r = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False,
                                                         "continue_final_message": True})
    assert "Paris" in r.choices[0].message.content
    new_turn = client.chat.completions.create(**kw)  # the default: a new assistant turn after the begun one
    assert new_turn.usage.prompt_tokens > r.usage.prompt_tokens
    bad = http.post("/v1/chat/completions", json={**kw, "continue_final_message": True})
    assert bad.status_code == 400 and "add_generation_prompt" in bad.json()["error"]["message"]


def test_min_tokens_holds_the_end_back(client, http):
    """min_tokens (vLLM's extension): a reply that would end at once runs to min_tokens; min_tokens past max_tokens
    is a 400 naming it."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Say only: hi"}], "temperature": 0}
    short = client.chat.completions.create(**kw, max_tokens=40)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    held = client.chat.completions.create(**kw, max_tokens=12, extra_body={"min_tokens": 12})
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 12
    r = http.post("/v1/chat/completions", json={**kw, "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]


def test_stream_without_include_usage_has_no_usage_chunk(http):
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1]) and all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_finish_reason_length(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_completions_streaming_and_not(client):
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert plain.id.startswith("cmpl-") and plain.object == "text_completion" and plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 5
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], temperature=0, max_tokens=2)  # token ids
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 2


def test_a_batch_of_prompts_gives_n_choices_each(client):
    """A text completion's prompt may be a batch (texts or token-id lists): choice p * n + j is prompt p's j-th,
    each as that prompt alone would give it; usage counts every prompt once; streamed choices match."""
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    kw = {"model": MODEL, "temperature": 0, "max_tokens": 4}
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, echo=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: prompts[i] + alone[i].choices[0].text for i in range(2)}
    ids = client.completions.create(prompt=[[504, 3458, 282], [33, 30, 34]], **kw)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6


def test_logprobs_chat_and_completions(client):
    """logprobs / top_logprobs (chat) and logprobs (completions): one entry per generated token (the EOS
    included), the tokens' text making up the reply, alternatives most likely first; greedy picks the most likely
    token; streaming reports the same entries as the plain response; no logprobs unless asked."""
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    joined = "".join(e.token for e in content)  # the EOS that ended the reply counts as a token and has its entry
    assert joined in (r.choices[0].message.content, r.choices[0].message.content + "<|im_end|>")
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None

    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(1 <= len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in
               zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices_streaming_and_not(client, http):
    """n > 1: one engine sequence per choice (seeded seed + index, so choices differ and repeat), indexed
    choices, the prompt counted once in usage; streaming interleaves the choices' chunks, each with its index,
    and gives the same texts; every page comes back."""
    before = metrics(http)
    kw = {"model": MODEL, "messages": FRANCE, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3,
          "logprobs": True}
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seeded: deterministic here, and three draws at T = 1 differ
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.prompt_tokens == client.chat.completions.create(**{**kw, "n": 1}).usage.prompt_tokens
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == texts  # repeats
    streamed = {0: "", 1: "", 2: ""}
    finishes, usage = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts and sorted(finishes) == [0, 1, 2]
    assert usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, n=2)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text  # greedy: the same
    wait_idle(http, before)


def test_n_choices_stream_closed_early_frees_every_choice(server, http):
    """A client that closes an n = 4 stream after a few chunks: all four sequences are cancelled, so every page
    comes back with far fewer than their 4 x 300 tokens generated."""
    before = metrics(http)
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0.8, "max_tokens": 300, "ignore_eos": True, "n": 4,
            "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as c, c.stream("POST", "/v1/chat/completions",
                                                                          json=body) as r:
        assert r.status_code == 200
        seen = set()
        for line in r.iter_lines():  # bounded: closed after the first content chunk of every choice
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["delta"].get("content"):
                    seen.add(choice["index"])
            if len(seen) == 4:
                break
    after = wait_idle(http, before)
    generated = (after["exl2_backend_generation_tokens_total"]
                 - before.get("exl2_backend_generation_tokens_total", 0))
    assert generated < 4 * 300 / 2, f"{generated} tokens: the choices ran on after the client left"


def test_logit_bias_forces_and_bans_tokens(client):
    """logit_bias {"id": +100} makes every token that one, in chat and text completions, sampled or greedy; a
    token forced in one request and banned (-100) in the next never appears there."""
    def tokens(**kw) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, logprobs=0, **kw)
        return r.choices[0].logprobs.tokens

    forced = tokens(temperature=0, logit_bias={"1000": 100})
    assert len(forced) == 3 and len(set(forced)) == 1
    assert tokens(temperature=0.9, seed=1, logit_bias={"1000": 100}) == forced
    other = tokens(temperature=0, logit_bias={"1000": -100, "1001": 100})
    assert len(set(other)) == 1 and other[0] != forced[0]
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, temperature=0, logprobs=True,
                                       logit_bias={"1000": 100})
    assert [e.token for e in r.choices[0].logprobs.content] == forced[:2]


def test_echo_returns_the_prompt_and_its_logprobs(client, http):
    """Text completions' echo: the prompt before the completion, streamed first too; with logprobs, every prompt
    token's entry (the first one's logprob and alternatives null, as the legacy API) before the completion's,
    the way lm-evaluation-harness scores a continuation (echo, logprobs=1, max_tokens=1)."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert text.startswith(prompt) and len(lp.tokens) == n_prompt + 1
    assert "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    paris = lp.token_logprobs[n_prompt - 1]  # " Paris" after "The capital of France is"
    assert -5 < paris < 0
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == text
    ids = http.post("/v1/completions", json={"model": MODEL, "prompt": [504, 3575, 282], "max_tokens": 2,
                                             "temperature": 0, "echo": True}).json()
    tail = http.post("/v1/completions", json={"model": MODEL, "prompt": [504, 3575, 282], "max_tokens": 2,
                                              "temperature": 0}).json()["choices"][0]["text"]
    assert ids["choices"][0]["text"].endswith(tail) and len(ids["choices"][0]["text"]) > len(tail)


def test_stop_strings(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    assert " Paris" in full.choices[0].message.content
    head = full.choices[0].message.content.split(" Paris")[0]
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16, stop=[" Paris"])
    assert r.choices[0].message.content == head and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16,
                                                 stop=" Paris", stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == head  # nothing of the stop string leaked while it was forming
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_and_sampler_fields(client):
    kw = {"model": MODEL, "messages": FRANCE, "temperature": 0.9, "top_p": 0.95, "max_tokens": 8, "seed": 1234,
          "frequency_penalty": 0.2, "presence_penalty": 0.1,
          "extra_body": {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.05}}
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.id != b.id


# --- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("patch, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": "abc"}, "seed"),
    ({"stream": "yes please"}, "stream"),
    ({"stream": "yes"}, "stream"),  # JSON types as JSON has them: lax coercion once took these
    ({"stream": 1}, "stream"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"stream_options": {"include_usage": "y"}, "stream": True}, "stream_options"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"stop_token_ids": [10**12]}, "stop_token_ids"),  # outside the vocabulary: it could never stop anything
    ({"frobnicate": True}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as the OpenAI API
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # outside the vocabulary: refused at admission
])
def test_bad_chat_request_names_the_field(http, patch, field):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and field in err["message"]


def test_bad_completion_request_and_body(http, client):
    for prompt in (["a", 3], [[1, -2]], [[]], ["a", ""], []):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), (prompt, r.text)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "def f():", "suffix": "\n"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]  # SmolLM2 has no FIM tokens
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "suffix": "\n"})
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 33, "n": 2})
    assert r.status_code == 400 and "sequences per request" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "logprobs": 6})  # the legacy limit is 5
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=FRANCE, n=17)
    assert "choices per request" in str(ei.value)


def test_text_that_is_not_unicode_is_400_and_harms_nobody(http, client):
    """JSON may escape half of a surrogate pair (an emoji cut by a client's string slice): 400 naming the field,
    before the engine; the server stays healthy (such a body once killed its engine for every user)."""
    cases = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \ud83d"}]}, "messages.0.content"),
             ("/v1/completions", {"prompt": "\ud800x", "stream": True}, "prompt"),
             ("/v1/chat/completions", {"messages": FRANCE, "stop": ["ok", "\udfff"]}, "stop.1"))
    for path, fields, param in cases:
        body = json.dumps({"model": MODEL, "max_tokens": 2, **fields})  # ASCII: the surrogate as a \\u escape
        r = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "lone surrogate" in err["message"], err
    assert http.get("/health").status_code == 200
    out = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4, temperature=0)
    assert out.choices[0].message.content


def test_prompt_longer_than_context_is_400_naming_the_limit(http):
    long = "hello " * (MAX_SEQ_LEN + 50)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert f"max_seq_len={MAX_SEQ_LEN}" in err["message"]
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_max_tokens_past_the_context_is_400_and_no_max_tokens_runs_to_the_context(http):
    """An explicit max_tokens that the context cannot hold beside the prompt is refused, as OpenAI and vLLM do
    (not silently cut short); without max_tokens the completion may run to the end of the context."""
    for path, fields, key in (("/v1/chat/completions", {"messages": FRANCE}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": FRANCE}, "max_completion_tokens"),
                              ("/v1/completions", {"prompt": "The capital of France is"}, "max_tokens")):
        r = http.post(path, json={"model": MODEL, key: MAX_SEQ_LEN, **fields})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
        assert f"max_seq_len={MAX_SEQ_LEN}" in err["message"] and "in the completion" in err["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello " * (MAX_SEQ_LEN - 8),
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_huge_prompt_is_refused_without_tokenizing_and_oversized_body_is_413(http):
    """A prompt sure to exceed the context (more bytes than max_seq_len tokens can stand for) is refused from its
    byte count: a 9 MB prompt once held the engine thread for 8 s of tokenization. Bodies past max_payload_mb
    (2 MB here) get 413 before they are parsed."""
    big = "hello " * 250_000  # 1.5 MB
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"] and err["param"] == "prompt"
    assert time.monotonic() - t0 < 60  # bounded loop guard, not a timing assertion: the refusal came back
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (3 << 20), "max_tokens": 2})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
    assert http.get("/health").status_code == 200


# --- concurrency, disconnects, capacity -----------------------------------------------------------------------


def test_16_concurrent_streams_are_batched(server, http):
    before = metrics(http)
    max_tokens = 6

    async def one(ac, i):
        chunks = []
        stream = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a word that rhymes with {i}."}],
            temperature=0, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
        async for c in stream:
            chunks.append(c)
        return chunks

    async def main():
        ac = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(16)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert len({r[0].id for r in results}) == 16
    for chunks in results:
        assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= max_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
            ["stop"], ["length"])
    after = wait_idle(http, before)
    tokens = sum(r[-1].usage.completion_tokens for r in results)
    steps = (after["exl2_backend_steps_total{kind=decode}"] + after["exl2_backend_steps_total{kind=prefill}"]
             - before.get("exl2_backend_steps_total{kind=decode}", 0)
             - before.get("exl2_backend_steps_total{kind=prefill}", 0))
    assert steps < tokens / 2, f"{tokens} tokens took {steps} engine steps: the streams were not batched"


def test_disconnect_releases_pages_and_full_server_says_503(server, http):
    """16 long streams fill every batch slot; a 17th request gets 503 + Retry-After; closing the 16 client
    connections cancels them, and the KV cache returns to its starting state long before 16 x 200 tokens."""
    before = metrics(http)
    body = {"model": MODEL, "temperature": 0, "max_tokens": 200, "stream": True, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as ac:
            streams = []
            for i in range(16):
                req = ac.build_request("POST", "/v1/chat/completions",
                                       json={**body, "messages": [{"role": "user", "content": f"Count to {i + 50}."}]})
                streams.append(ac.send(req, stream=True))
            responses = await asyncio.gather(*streams)
            for r in responses:  # the first line arrives once the sequence holds its pages
                assert r.status_code == 200
                line = await r.aiter_lines().__anext__()
                assert line.startswith("data: ")
            mid = metrics(http)
            assert mid["exl2_backend_active_sequences"] == 16
            assert mid["exl2_backend_kv_free_tokens"] < before["exl2_backend_kv_free_tokens"]
            full = await ac.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 2})
            for r in responses:
                await r.aclose()  # client disconnect mid-stream
            return full

    full = asyncio.run(main())
    assert full.status_code == 503, full.text
    assert int(full.headers["retry-after"]) >= 1 and full.json()["error"]["code"] == "queue_full"
    after = wait_idle(http, before)
    generated = after["exl2_backend_generation_tokens_total"] - before["exl2_backend_generation_tokens_total"]
    assert generated < 16 * 100, "cancelled streams kept generating"
    assert after["exl2_backend_requests_total{outcome=cancelled}"] - before.get(
        "exl2_backend_requests_total{outcome=cancelled}", 0) == 16
    assert after["exl2_backend_rejected_total{reason=queue_full}"] >= 1


def test_metrics_exposition(http):
    text = http.get("/metrics").text
    for name in ("exl2_backend_queue_length", "exl2_backend_active_sequences", "exl2_backend_kv_pages_free",
                 "exl2_backend_kv_pages_total", "exl2_backend_tokens_per_second", "exl2_backend_healthy",
                 "exl2_backend_generation_tokens_total", "exl2_backend_requests_total",
                 "exl2_backend_decode_lookahead_steps_total"):
        assert f"\n{name}" in text or text.startswith(name) or f"# TYPE {name}" in text, name
    m = metrics(http)
    assert m["exl2_backend_healthy"] == 1 and m["exl2_backend_kv_pages_total"] > 0


def test_non_streaming_client_timeout_cancels_generation(http, server):
    """A client that gives up on a non-streaming request (closing its connection) frees the sequence too."""
    before = metrics(http)
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.base_url, timeout=1.5) as impatient:
        impatient.post("/v1/chat/completions", json=body)
    after = wait_idle(http, before)
    generated = after["exl2_backend_generation_tokens_total"] - before["exl2_backend_generation_tokens_total"]
    assert generated < 400, "the abandoned request ran to completion"
    assert after["exl2_backend_requests_total{outcome=cancelled}"] == before.get(
        "exl2_backend_requests_total{outcome=cancelled}", 0) + 1
