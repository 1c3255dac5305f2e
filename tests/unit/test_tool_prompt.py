"""Tools in chat prompts and replies (tokenizer/tool_prompt.py, serve/tools.py): the Hermes rendering for templates
without tools, the transformers convention for templates with them (arguments as objects), calls read back from a
reply, and the grammar for each tool_choice checked against replies with llguidance and the real tokenizer."""

from __future__ import annotations

import json

import pytest

from exl2_backend.grammar.spec import compile_grammar
from exl2_backend.serve.tools import NamedToolChoice, ToolDef, split_tool_calls, tool_grammar
from exl2_backend.tokenizer import Tokenizer
from exl2_backend.tokenizer.tool_prompt import hermes_messages, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c1", "content": "-3C"}]
# a template that takes tools, in the style of tool-trained models (written for this test)
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "\n{% endfor %}")


def test_hermes_messages_carry_tools_calls_and_results():
    out = hermes_messages(HISTORY, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n-3C\n</tool_response>"
    assert hermes_messages(HISTORY[1:2], [WEATHER])[0]["role"] == "system"  # inserted when there is none


def test_template_messages_turn_arguments_into_objects():
    out = template_messages(HISTORY)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the input is not changed
    broken = dict(CALL, function={"name": "f", "arguments": "{not json"})
    assert template_messages([{"role": "assistant", "content": "", "tool_calls": [broken]}])[0]["tool_calls"][0] \
        == broken


def test_a_template_with_tools_gets_them_as_variables(default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    tok.chat_template_source = TOOL_TEMPLATE
    text = tok.apply_chat_template(HISTORY, add_generation_prompt=False, tools=[WEATHER])
    assert text.startswith("TOOLS:[") and '[call get_weather {"city": "Oslo"}]' in text and "tool:-3C" in text


def test_the_default_template_gets_the_hermes_form(default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    text = tok.apply_chat_template(HISTORY, tools=[WEATHER])
    assert "<tools>" in text and "<tool_call>" in text and "<tool_response>" in text
    assert tok.apply_chat_template(HISTORY[1:2]) == tok.apply_chat_template(HISTORY[1:2], tools=None)


def test_split_tool_calls():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = split_tool_calls(one + "\n" + one.replace("Oslo", "Rome"))
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Oslo", "Rome"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert split_tool_calls("plain text") == ("plain text", [])
    cut = '<tool_call>\n{"name": "get_weather", "argum'  # max_tokens cut the call: text, no calls
    assert split_tool_calls(cut) == (cut, [])
    bad = '<tool_call>\n{"name": 3}\n</tool_call>'
    assert split_tool_calls(bad) == (bad, [])


def _accepts(grammar: dict, text: str, gt, tok) -> bool:
    import llguidance

    m = llguidance.LLMatcher(gt.llg, compile_grammar(grammar, gt.llg)[0])
    ids = tok.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


@pytest.fixture(scope="module")
def vocab(default_model_dir):
    from exl2_backend.grammar.vocabulary import Vocabulary

    tok = Tokenizer.from_dir(default_model_dir)
    return Vocabulary(tok, 49152, {2}), tok


def test_tool_grammars_admit_exactly_their_replies(vocab):
    gt, tok = vocab
    tools = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(NOARGS)]
    w = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    p = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})
    cases = [
        ("auto", True, {w: True, p: True, w + "\n" + p: True, "It is sunny.": True, "<b>hi</b>": False}),
        ("required", True, {w: True, w + "\n" + p: True, "It is sunny.": False}),
        ("required", False, {w: True, w + "\n" + p: False}),
        (named, True, {p: True, w: False, p + "\n" + p: False}),
    ]
    for choice, parallel, replies in cases:
        grammar = tool_grammar(tools, choice, parallel)
        for reply, ok in replies.items():
            assert _accepts(grammar, reply, gt, tok) is ok, (choice, parallel, reply)
    bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>'
    assert not _accepts(tool_grammar(tools, "required", True), bad_args, gt, tok)
    assert tool_grammar(tools, "none", True) is None


def test_continue_final_message_cuts_after_the_last_content(default_model_dir):
    from exl2_backend.errors import TokenizerError

    tok = Tokenizer.from_dir(default_model_dir)
    begun = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    text = tok.apply_chat_template(begun, False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe color is")
    assert tok.apply_chat_template(begun, False).startswith(text)  # the same rendering, cut
    with pytest.raises(TokenizerError, match="add_generation_prompt"):
        tok.apply_chat_template(begun, True, continue_final_message=True)
    with pytest.raises(TokenizerError, match="no content"):
        tok.apply_chat_template(begun[:1] + [{"role": "assistant", "content": ""}], False,
                                continue_final_message=True)


def test_streamed_call_deltas_add_up_to_the_parsed_calls():
    """ToolCallStream over a reply of two calls cut at random places (200 ways): each call's first delta has its
    index, id, type and name; its arguments, put together, are the text split_tool_calls reads, byte for byte."""
    import random

    from exl2_backend.serve.tools import ToolCallStream

    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo \\u00e9}", "n": {"a": [1, 2]}}}\n'
             '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in split_tool_calls(reply)[1]]
    assert want[0][1] == '{"city": "Oslo \\u00e9}", "n": {"a": [1, 2]}}' and want[1] == ("ping", "{}")
    for trial in range(200):
        rng = random.Random(trial)
        cuts = sorted(rng.sample(range(1, len(reply)), rng.randint(0, 30)))
        stream, calls = ToolCallStream(), {}
        for a, b in zip([0, *cuts], [*cuts, len(reply)]):
            for d in stream.feed(reply[a:b]):
                if d["index"] not in calls:
                    assert d["type"] == "function" and d["id"].startswith("call_")
                    calls[d["index"]] = [d["function"]["name"], ""]
                calls[d["index"]][1] += d["function"]["arguments"]
        assert [tuple(c) for c in calls.values()] == want and stream.calls == 2
