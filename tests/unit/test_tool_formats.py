"""Tool-call conventions (tokenizer/tool_formats.py, serve/tools.py): which one a chat template asks for, the
grammar of each checked with llguidance against replies tokenized by a real tokenizer that has the marker tokens,
replies read back into calls (whole and streamed, cut at random places), and Mistral's 9-character call ids."""

from __future__ import annotations

import json
import random

import pytest

from exl2_backend.grammar.spec import compile_grammar
from exl2_backend.serve.tools import NamedToolChoice, ToolCallStream, ToolDef, split_tool_calls, tool_grammar
from exl2_backend.tokenizer import Tokenizer
from exl2_backend.tokenizer.tool_formats import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_V11,
    detect_format_name,
    format_from_dict,
    mistral_call_id,
    tool_call_format,
)
from tests.helpers.tool_templates import (
    LLAMA3_TEMPLATE,
    LLAMA31_SINGLE_CALL_TEMPLATE,
    MISTRAL_TEMPLATE,
    MISTRAL_V11_TEMPLATE,
    V11_MARKERS,
    add_marker_tokens,
    set_chat_template,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(PING)]
# a call made earlier, with an OpenAI-style id, and its result
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_8f2b6c1d9e", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_8f2b6c1d9e", "content": "-3C"},
           {"role": "user", "content": "And tomorrow?"}]
VOCAB = 300


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    """A byte-level tokenizer with <|python_tag|> and [TOOL_CALLS] as special tokens: (directory, marker ids)."""
    from exl2_backend.format.random_model import write_byte_tokenizer

    directory = tmp_path_factory.mktemp("tools")
    write_byte_tokenizer(directory, VOCAB - 2)
    return directory, add_marker_tokens(directory)


@pytest.fixture(scope="module")
def vocab(marked):
    from exl2_backend.grammar.vocabulary import Vocabulary

    tok = Tokenizer.from_dir(marked[0])
    return Vocabulary(tok, VOCAB, {tok.eos_token_id}), tok


def test_the_template_says_which_convention(default_model_dir):
    assert detect_format_name(None) == "hermes"
    assert detect_format_name(Tokenizer.from_dir(default_model_dir).chat_template_source) == "hermes"  # no tools
    assert detect_format_name(LLAMA3_TEMPLATE) == "llama3_json"
    assert detect_format_name(MISTRAL_TEMPLATE) == "mistral"
    assert detect_format_name(MISTRAL_V11_TEMPLATE) == "mistral_v11"
    assert detect_format_name("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_format_name("{{ tools | tojson }}") == "hermes"  # tools, no known convention: the fallback


def test_the_tokenizer_gives_the_format_with_its_marker(marked):
    directory, ids = marked
    tok = Tokenizer.from_dir(directory)
    assert tok.tool_call_format() == HERMES  # the byte tokenizer's template knows no tools
    set_chat_template(directory, LLAMA3_TEMPLATE)
    try:
        fmt = Tokenizer.from_dir(directory).tool_call_format()
        assert fmt.name == "llama3_json" and fmt.marker_id == ids["<|python_tag|>"]
        assert Tokenizer.from_dir(directory).tool_call_format("mistral").marker_id == ids["[TOOL_CALLS]"]
        tok = Tokenizer.from_dir(directory)
        tok.chat_template_source = [{"name": "default", "template": "{{ messages }}"},
                                    {"name": "tool_use", "template": MISTRAL_TEMPLATE}]
        assert tok.tool_call_format().name == "mistral"  # transformers' rule: "tool_use" when there are tools
    finally:
        set_chat_template(directory, "{{ messages }}")
    assert format_from_dict(fmt.to_dict()) == fmt and format_from_dict(None) == HERMES
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral, mistral_v11"):
        tool_call_format("xml")


def _accepts(vocab, grammar: dict, reply: str, marker: int | None = None) -> bool:
    import llguidance

    gt, tok = vocab
    matcher = llguidance.LLMatcher(gt.llg, compile_grammar(grammar, gt.llg)[0])
    ids = ([marker] if marker is not None else []) + tok.encode(reply, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_llama3_grammar_admits_exactly_its_replies(vocab, marked):
    tag = marked[1]["<|python_tag|>"]
    fmt = tool_call_format("llama3_json", tag)
    w = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    p = '{"name": "ping", "parameters": {}}'
    required = tool_grammar(TOOLS, "required", True, fmt)
    assert _accepts(vocab, required, w) and _accepts(vocab, required, w + "; " + p)
    assert _accepts(vocab, required, p, marker=tag)  # after <|python_tag|>, as Llama may begin
    assert not _accepts(vocab, required, w.replace("parameters", "arguments"))
    assert not _accepts(vocab, required, '<tool_call>\n' + w + '\n</tool_call>')
    assert not _accepts(vocab, tool_grammar(TOOLS, "required", False, fmt), w + "; " + p)
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    assert _accepts(vocab, auto, w) and _accepts(vocab, auto, "It is cold.")
    assert not _accepts(vocab, auto, "{not a call}") and not _accepts(vocab, auto, ' {"name": "ping"}')
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})
    assert _accepts(vocab, tool_grammar(TOOLS, named, True, fmt), p)
    assert not _accepts(vocab, tool_grammar(TOOLS, named, True, fmt), w)


def test_mistral_grammar_admits_exactly_its_replies(vocab, marked):
    mark = marked[1]["[TOOL_CALLS]"]
    fmt = tool_call_format("mistral", mark)
    w = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    p = '{"name": "ping", "arguments": {}}'
    required = tool_grammar(TOOLS, "required", True, fmt)
    assert _accepts(vocab, required, f"[{w}]", marker=mark) and _accepts(vocab, required, f"[{w}, {p}]", marker=mark)
    assert _accepts(vocab, required, f" [{p}]", marker=mark)  # SentencePiece's "▁[" after the marker
    assert not _accepts(vocab, required, f"[{w}]")  # the marker is required
    assert not _accepts(vocab, tool_grammar(TOOLS, "required", False, fmt), f"[{w}, {p}]", marker=mark)
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    assert _accepts(vocab, auto, "It is warm.") and _accepts(vocab, auto, f"[{p}]", marker=mark)
    assert not _accepts(vocab, auto, "[1, 2]")
    # a vocabulary without the token: the marker's text (encoded in two parts, or this tokenizer would make it
    # the added token)
    import llguidance

    gt, tok = vocab
    text_marker = tool_grammar(TOOLS, "required", True, MISTRAL)
    matcher = llguidance.LLMatcher(gt.llg, compile_grammar(text_marker, gt.llg)[0])
    ids = tok.encode("[TOOL_", add_special_tokens=False) + tok.encode(f"CALLS][{p}]", add_special_tokens=False)
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    assert not _accepts(vocab, text_marker, f"[{p}]")


@pytest.mark.parametrize("fmt, reply", [
    (HERMES, ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "n": {"a": "}]"}}}\n</tool_call>\n'
             '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')),
    (LLAMA3_JSON, ('{"name": "get_weather", "parameters": {"city": "Oslo", "n": {"a": "}]"}}}; '
                  '{"name": "ping", "parameters": {}}')),
    (MISTRAL, (' [{"name": "get_weather", "arguments": {"city": "Oslo", "n": {"a": "}]"}}}, '
              '{"name": "ping", "arguments": {}}]')),
    (MISTRAL_V11, ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "n": {"a": "}]"}}'
                  '[TOOL_CALLS]ping[CALL_ID]a1B2c3D4e[ARGS]{}')),
], ids=["hermes", "llama3_json", "mistral", "mistral_v11"])
def test_replies_read_back_whole_and_streamed(fmt, reply):
    """split_tool_calls reads both calls (the arguments as the model wrote them); ToolCallStream over the reply cut
    at 100 random places gives each call's id and name first and arguments that add up to the same text."""
    content, calls = split_tool_calls(reply, fmt)
    assert content is None
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert want == [("get_weather", '{"city": "Oslo", "n": {"a": "}]"}}'), ("ping", "{}")]
    id_ok = (lambda i: len(i) == 9 and i.isalnum()) if fmt.name.startswith("mistral") else (
        lambda i: i.startswith("call_"))
    assert all(id_ok(c["id"]) for c in calls) and len({c["id"] for c in calls}) == 2
    for trial in range(100):
        rng = random.Random(trial)
        cuts = sorted(rng.sample(range(1, len(reply)), 6))
        stream, got = ToolCallStream(fmt), {}
        for a, b in zip([0, *cuts], [*cuts, len(reply)]):
            for d in stream.feed(reply[a:b]):
                call = got.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": "",
                                                   "id": d.get("id")})
                assert "id" not in d or call["id"] == d["id"]
                call["arguments"] += d["function"]["arguments"]
        assert [(c["name"], c["arguments"]) for c in got.values()] == want, cuts
        assert all(id_ok(c["id"]) for c in got.values())


@pytest.mark.parametrize("fmt, text", [
    (LLAMA3_JSON, "It is cold."), (LLAMA3_JSON, '{"name": "ping", "parameters": {}'),  # cut by max_tokens
    (LLAMA3_JSON, '{"name": 3, "parameters": {}}'), (MISTRAL, "[1, 2]"), (MISTRAL, "Plain text."),
    (HERMES, '<tool_call>\n{"name": "ping", "argum'), (HERMES, "plain"),
    (MISTRAL_V11, "[TOOL_CALLS]ping[ARGS]{"), (MISTRAL_V11, "ping[ARGS]{}"), (MISTRAL_V11, "Plain text."),
    (MISTRAL_V11, "[TOOL_CALLS]ping[ARGS][1]"),
])
def test_what_is_not_calls_stays_text(fmt, text):
    assert split_tool_calls(text, fmt) == (text, [])


@pytest.mark.parametrize("fmt, text, rest", [
    (LLAMA3_JSON, '{"name": "ping", "parameters": {}}; {"name": "pi', '{"name": "pi'),  # the second call cut
    (LLAMA3_JSON, '{"name": "ping", "parameters": {}} trailing', "trailing"),
    (MISTRAL, '[{"name": "ping", "arguments": {}}, {"na', '{"na'),
    (MISTRAL, '[{"name": "ping", "arguments": {}}', None),
    (HERMES, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n{"', '<tool_call>\n{"'),
    (MISTRAL_V11, '[TOOL_CALLS]ping[ARGS]{}[TOOL_CALLS]get_we', "[TOOL_CALLS]get_we"),
])
def test_a_reply_cut_after_a_call_keeps_the_calls_before_the_cut(fmt, text, rest):
    content, calls = split_tool_calls(text, fmt)
    assert [c["function"]["name"] for c in calls] == ["ping"] and content == rest


def test_mistral_marker_text_and_ids():
    p = '{"name": "ping", "arguments": {}}'
    assert split_tool_calls(f"[TOOL_CALLS] [{p}]", MISTRAL)[1][0]["function"]["name"] == "ping"
    assert mistral_call_id("abcDEF123") == "abcDEF123"
    made = mistral_call_id("call_0123456789abcdef01234567")
    assert len(made) == 9 and made.isalnum() and made == mistral_call_id("call_0123456789abcdef01234567")
    assert mistral_call_id("call_x") != mistral_call_id("call_y")


def test_histories_render_in_each_convention(default_model_dir):
    """A call made earlier (with an OpenAI-style id) and its result go back through each template: Llama's as a
    "parameters" object, Mistral's with the id shortened to 9 characters in both the call and the result."""
    tok = Tokenizer.from_dir(default_model_dir)
    tok.chat_template_source = LLAMA3_TEMPLATE
    text = tok.apply_chat_template(HISTORY, tools=[WEATHER])
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text and "ipython: -3C" in text
    assert "Environment: ipython" in text and text.endswith("assistant: ")
    tok.chat_template_source = MISTRAL_TEMPLATE
    text = tok.apply_chat_template(HISTORY, add_generation_prompt=False, tools=[WEATHER])
    short = mistral_call_id("call_8f2b6c1d9e")
    assert f'"id": "{short}"' in text and f'"call_id": "{short}"' in text
    assert text.index("[AVAILABLE_TOOLS]") > text.index("[TOOL_RESULTS]")  # the tools go before the last question
    assert json.loads(text.split("[TOOL_CALLS]")[1].split("</s>")[0].split("[TOOL_RESULTS]")[0]
                      .rsplit("]", 1)[0] + "]")[0]["arguments"] == {"city": "Oslo"}


def _walk(gt, tok, grammar: dict, prefer_high: bool = True) -> list[int]:
    """Take, at each step, the highest (or lowest) id the mask allows, as a model that favours added tokens would;
    every token taken must be one the grammar takes (a mask offering a token it refuses failed the sequence)."""
    import torch

    m, out = gt.matcher(grammar), []
    for _ in range(120):  # bounded: the calls here are under 60 tokens
        if m.stopped:
            return out
        row = torch.zeros(gt.words, dtype=torch.int32)
        m.fill_mask(row)
        allowed = [i for i in range(gt.vocab_size) if (int(row[i // 32]) >> (i % 32)) & 1]
        token = max(allowed) if prefer_high else min(allowed)
        assert m.consume(token), (tok.decode(out), token, m.error[:200])
        out.append(token)
    raise AssertionError("the grammar did not end")


def test_hermes_tags_that_are_added_tokens(tmp_path):
    """A Qwen2.5-style vocabulary has <tool_call> / </tool_call> as added (non-special) tokens. llguidance takes
    them as special tokens, and its mask offered the token where a grammar spells "<tool_call>" although taking it
    failed. The format names the tags as tokens, and masks never offer a special token the grammar refuses."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from exl2_backend.format.random_model import write_byte_tokenizer
    from exl2_backend.grammar.vocabulary import Vocabulary

    write_byte_tokenizer(tmp_path, VOCAB - 2)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=False) for t in ("<tool_call>", "</tool_call>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    gt = Vocabulary(tok, VOCAB, {tok.eos_token_id})
    fmt = tok.tool_call_format()
    ids = (tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>"))
    assert fmt.name == "hermes" and fmt.tag_ids == ids and format_from_dict(fmt.to_dict()) == fmt
    walked = _walk(gt, tok, tool_grammar(TOOLS[1:], "required", False, fmt))
    assert walked[0] == ids[0] and walked[-1] == ids[1]  # the model's own tokens
    text = tok.incremental_decoder()
    reply = "".join(text.push(t) for t in walked) + text.flush()  # the tags stay in the decoded text
    assert split_tool_calls(reply, fmt)[1][0]["function"]["name"] == "ping"
    # spelled as text, the tag cannot be written at all (llguidance offers only the token, and refuses it): the
    # mask is now empty, so the sequence fails with the grammar's message instead of taking a refused token
    import torch

    m = gt.matcher(tool_grammar(TOOLS[1:], "required", False, HERMES))
    row = torch.zeros(gt.words, dtype=torch.int32)
    m.fill_mask(row)
    assert not row.any() and m.allows_nothing()


@pytest.fixture(scope="module")
def v11_vocab(tmp_path_factory):
    """A byte-level tokenizer with Mistral v11's [TOOL_CALLS], [ARGS] and [CALL_ID] as special tokens: (Vocabulary,
    Tokenizer, their ids)."""
    from exl2_backend.format.random_model import write_byte_tokenizer
    from exl2_backend.grammar.vocabulary import Vocabulary

    directory = tmp_path_factory.mktemp("v11")
    write_byte_tokenizer(directory, VOCAB - 3)
    ids = add_marker_tokens(directory, V11_MARKERS)
    set_chat_template(directory, MISTRAL_V11_TEMPLATE)
    tok = Tokenizer.from_dir(directory)
    return Vocabulary(tok, VOCAB, {tok.eos_token_id}), tok, ids


def test_mistral_v11_format_from_the_tokenizer(v11_vocab):
    _, tok, ids = v11_vocab
    fmt = tok.tool_call_format()
    assert fmt.name == "mistral_v11" and fmt.marker_id == ids["[TOOL_CALLS]"] and fmt.args_marker_id == ids["[ARGS]"]
    assert format_from_dict(fmt.to_dict()) == fmt
    # the call tokens stay in the decoded text (other special tokens do not): the reply reads back from it
    decoder = tok.incremental_decoder()
    reply = [ids["[TOOL_CALLS]"], *tok.encode("ping", add_special_tokens=False), ids["[ARGS]"],
             *tok.encode("{}", add_special_tokens=False), tok.eos_token_id]
    text = "".join(decoder.push(t) for t in reply) + decoder.flush()
    assert text == "[TOOL_CALLS]ping[ARGS]{}"
    assert split_tool_calls(text, fmt)[1][0]["function"] == {"name": "ping", "arguments": "{}"}


def test_mistral_v11_grammar_admits_exactly_its_replies(v11_vocab):
    import llguidance

    gt, tok, ids = v11_vocab
    fmt = tok.tool_call_format()

    def accepts(grammar, parts) -> bool:  # parts: token names (markers) and text
        seq = [t for p in parts for t in ([ids[p]] if p in ids else tok.encode(p, add_special_tokens=False))]
        matcher = llguidance.LLMatcher(gt.llg, compile_grammar(grammar, gt.llg)[0])
        return matcher.validate_tokens(seq) == len(seq) and matcher.consume_tokens(seq) and matcher.is_accepting()

    tc, args = "[TOOL_CALLS]", "[ARGS]"
    w, p = [tc, "get_weather", args, '{"city": "Rome"}'], [tc, "ping", args, "{}"]
    required = tool_grammar(TOOLS, "required", True, fmt)
    assert accepts(required, w) and accepts(required, w + p) and accepts(required, p + p)
    assert not accepts(required, ["get_weather", args, '{"city": "Rome"}'])  # the marker is required
    assert not accepts(required, [tc, "get_weather", args, '{"city": "Paris"}'])  # the schema holds
    assert not accepts(required, [tc, "get_time", args, "{}"])  # defined functions only
    assert not accepts(required, [tc, "ping", "[CALL_ID]", "a1B2c3D4e", args, "{}"])  # ids are ours
    assert not accepts(tool_grammar(TOOLS, "required", False, fmt), w + p)
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    assert accepts(auto, ["It is warm."]) and accepts(auto, p) and not accepts(auto, ["It is warm.", *p])
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})
    assert accepts(tool_grammar(TOOLS, named, True, fmt), p) and not accepts(tool_grammar(TOOLS, named, True, fmt), w)
    # the walk a model favouring high ids takes is a valid call, and reads back
    walked = _walk(gt, tok, tool_grammar(TOOLS[1:], "required", False, fmt))
    decoder = tok.incremental_decoder()
    text = "".join(decoder.push(t) for t in walked) + decoder.flush()
    assert walked[0] == ids[tc] and split_tool_calls(text, fmt)[1][0]["function"]["name"] == "ping"


def test_mistral_v11_history_renders_with_nine_character_ids(v11_vocab):
    _, tok, _ = v11_vocab
    text = tok.apply_chat_template(HISTORY, tools=[WEATHER])
    short = mistral_call_id("call_8f2b6c1d9e")
    assert f'[TOOL_CALLS]get_weather[CALL_ID]{short}[ARGS]{{"city": "Oslo"}}' in text
    assert f"[TOOL_RESULTS]{short}[TOOL_CONTENT]-3C" in text


def test_a_template_that_refuses_parallel_calls_gets_one_call_per_reply(marked):
    """Llama 3.1's template raises on a turn holding two calls: the format says so (parallel false), and the grammar
    holds replies to one call even when the request allows several, so every reply renders back in the next turn."""
    directory = marked[0]
    set_chat_template(directory, LLAMA31_SINGLE_CALL_TEMPLATE)
    try:
        tok = Tokenizer.from_dir(directory)
        fmt = tok.tool_call_format()
        assert fmt.name == "llama3_json" and fmt.parallel is False and format_from_dict(fmt.to_dict()) == fmt
        set_chat_template(directory, LLAMA3_TEMPLATE)
        assert Tokenizer.from_dir(directory).tool_call_format().parallel is True
    finally:
        set_chat_template(directory, "{{ messages }}")
    assert tool_grammar(TOOLS, "required", True, fmt) == tool_grammar(TOOLS, "required", False, fmt)
    assert tool_grammar(TOOLS, "required", True, LLAMA3_JSON) != tool_grammar(TOOLS, "required", False, LLAMA3_JSON)
    v11 = tool_call_format("mistral_v11", parallel=False)
    assert "calls: call\n" in tool_grammar(TOOLS, "auto", True, v11)["value"]
