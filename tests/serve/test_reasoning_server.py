"""A reasoning model through the real server (LitServe on 127.0.0.1, the real openai client): a small random model
(CPU) whose template opens a <think> block at the generation prompt, detected as a reasoning model. A Lark
constraint (vLLM's structured_outputs) fixes the reply's shape, thinking then </think> then the answer, so the
split is known: the thinking comes back as `reasoning_content`, the answer as `content`, streamed as
`reasoning_content` deltas then content deltas; include_reasoning false drops the thinking."""

from __future__ import annotations

import re

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


def _ask(client, **kw):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=40,
                                          extra_body={"structured_outputs": SHAPE, **kw.pop("extra", {})}, **kw)


def test_thinking_comes_back_apart(client):
    msg = _ask(client).choices[0].message
    assert re.fullmatch("[a-z]{4} [a-z]{4}", msg.reasoning_content) and re.fullmatch("[a-z]{3}", msg.content)
    # streamed: the thinking in reasoning_content deltas first, then the answer; the same texts
    chunks = [c.choices[0].delta for c in _ask(client, stream=True) if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in chunks)
    answer = "".join(d.content or "" for d in chunks)
    assert (thought, answer) == (msg.reasoning_content, msg.content)
    firsts = [i for i, d in enumerate(chunks) if d.content]
    assert all(not getattr(d, "reasoning_content", None) for d in chunks[firsts[0]:])
    dropped = _ask(client, extra={"include_reasoning": False}).choices[0].message
    assert dropped.content == msg.content and getattr(dropped, "reasoning_content", None) is None


def test_an_earlier_answer_goes_back_without_its_thinking(client):
    """The template drops the thinking of earlier turns; the request is answered in the same shape."""
    first = _ask(client).choices[0].message
    history = ASK + [{"role": "assistant", "content": f"<think>{first.reasoning_content}</think>{first.content}"},
                     {"role": "user", "content": "And then?"}]
    model = client.models.list().data[0].id
    again = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=40,
                                           extra_body={"structured_outputs": SHAPE})
    assert re.fullmatch("[a-z]{3}", again.choices[0].message.content)
