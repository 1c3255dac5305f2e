"""Reasoning replies (tokenizer/reasoning.py): the <think> block split from the answer, whole and fed in pieces cut
at random places (the same texts), a reply begun inside the block or cut before it closes, tags split across
pieces, and which models the tokenizer calls reasoning ones (template and vocabulary), tags kept in decoded text;
Magistral's [THINK] ... [/THINK] special tokens the same way, named by id in grammars."""

from __future__ import annotations

import random

import pytest

from exl2_backend.tokenizer import Tokenizer
from exl2_backend.tokenizer.reasoning import ReasoningSplitter, ReasoningTags, continues_inside, split_reasoning
from tests.helpers.tool_templates import (
    MAGISTRAL_TEMPLATE,
    REASONING_TEMPLATE,
    add_marker_tokens,
    add_reasoning_tokens,
    set_chat_template,
)

OPENED = ReasoningTags(prompt_opens=True)
CLOSED = ReasoningTags(prompt_opens=False)


@pytest.mark.parametrize("tags, text, want", [
    (CLOSED, "<think>\nLet me see. 2+2=4.\n</think>\n\nIt is 4.", ("Let me see. 2+2=4.\n", "It is 4.")),
    (OPENED, "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    (OPENED, "Still thinking when max_tokens came", ("Still thinking when max_tokens came", None)),
    (CLOSED, "No thinking, an answer < and </thi", (None, "No thinking, an answer < and </thi")),
    (CLOSED, "  <think>a</think>", ("a", None)),
    (OPENED, "a < b </thinking is not a tag</think> c", ("a < b </thinking is not a tag", "c")),
    (CLOSED, "<thin", (None, "<thin")),  # a cut opening tag is text
])
def test_whole_and_streamed_splits_agree(tags, text, want):
    assert split_reasoning(text, tags) == want
    for trial in range(100):
        rng = random.Random(trial)
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        splitter, parts = ReasoningSplitter(tags), ([], [])
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for i, piece in enumerate(pieces):
            r, c = splitter.feed(piece, final=i == len(pieces) - 1)
            parts[0].append(r)
            parts[1].append(c)
        got = ("".join(parts[0]) or None, "".join(parts[1]) or None)
        assert got == want, cuts


def test_a_held_piece_that_may_be_a_tag():
    splitter = ReasoningSplitter(OPENED)
    assert splitter.feed("x </th") == ("x ", "")  # "</th" may be the closing tag: held
    assert splitter.feed("ink>y") == ("", "y")
    assert ReasoningSplitter(OPENED, inside=False).feed("plain", final=True) == ("", "plain")


def test_thinking_tokens_are_counted():
    tags = ReasoningTags(open_id=7, close_id=8)
    assert tags.token_count([1, 2, 8, 3], inside=True) == 3  # up to the closing tag, itself included
    assert tags.token_count([1, 2, 3], inside=True) == 3  # cut while thinking
    assert tags.token_count([7, 1, 2], inside=False) == 3 and tags.token_count([1, 2], inside=False) == 0


def test_continuing_a_begun_message():
    assert continues_inside(CLOSED, "<think>I was thinking")
    assert not continues_inside(CLOSED, "<think>done</think>The answer")
    assert not continues_inside(CLOSED, "The answer")


def test_which_models_reason(tmp_path, default_model_dir):
    from exl2_backend.format.random_model import write_byte_tokenizer

    assert Tokenizer.from_dir(default_model_dir).reasoning_tags() is None
    assert Tokenizer.from_dir(default_model_dir).reasoning_tags("think") == ReasoningTags(prompt_opens=False)
    write_byte_tokenizer(tmp_path, 298)
    set_chat_template(tmp_path, REASONING_TEMPLATE)
    assert Tokenizer.from_dir(tmp_path).reasoning_tags() is None  # "</think>" is not a token of this vocabulary
    ids = add_reasoning_tokens(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.reasoning_tags() == ReasoningTags(prompt_opens=True, added=True, open_id=ids["<think>"],
                                                 close_id=ids["</think>"])
    assert tok.reasoning_tags("none") is None
    # the tags stay in decoded output, even where a tokenizer marks them special
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("</think>", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert ids["</think>"] not in tok.special_ids
    decoder = tok.incremental_decoder()
    text = "".join(decoder.push(i) for i in tok.encode("a</think>b", add_special_tokens=False)) + decoder.flush()
    assert text == "a</think>b"


def test_a_grammar_behind_the_thinking(tmp_path):
    """grammar/spec.py "reasoning": free text up to </think> (a token text cannot spell), then the constraint; with
    inside false the block is the model's to open, or to skip."""
    import llguidance

    from exl2_backend.format.random_model import write_byte_tokenizer
    from exl2_backend.grammar.spec import compile_grammar, grammar_problem
    from exl2_backend.grammar.vocabulary import Vocabulary

    write_byte_tokenizer(tmp_path, 298)
    ids = add_reasoning_tokens(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    gt = Vocabulary(tok, 300, {tok.eos_token_id})
    schema = {"type": "json_schema", "value": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"]}}

    def accepts(inside: bool, *parts) -> bool:
        spec = dict(schema, reasoning={"open": "<think>", "close": "</think>", "inside": inside})
        assert grammar_problem(spec) is None
        matcher = llguidance.LLMatcher(gt.llg, compile_grammar(spec, gt.llg)[0])
        toks = [t for p in parts for t in ([ids[p]] if p in ids else tok.encode(p, add_special_tokens=False))]
        return matcher.validate_tokens(toks) == len(toks) and matcher.consume_tokens(toks) and matcher.is_accepting()

    assert accepts(True, "So a is 3.\n", "</think>", '\n\n{"a": 3}') and accepts(True, "</think>", '{"a": 3}')
    assert not accepts(True, '{"a": 3}')  # still thinking: the block was never closed
    assert not accepts(True, "x", "</think>", "not json")
    assert accepts(False, '{"a": 3}') and accepts(False, "<think>", "hm", "</think>", '{"a": 3}')
    assert not accepts(False, "hm", "</think>", '{"a": 3}')
    bad = dict(schema, reasoning={"open": "<think>", "close": "think", "inside": True})
    assert "reasoning must be" in grammar_problem(bad)


def test_magistral_thinks_in_its_own_tokens(tmp_path):
    """A template that handles [/THINK] and a vocabulary with [THINK] / [/THINK] as special tokens: those are the
    tags, kept in decoded text, split the same way, and named by id in a grammar's reasoning field."""
    import llguidance

    from exl2_backend.format.random_model import write_byte_tokenizer
    from exl2_backend.grammar.spec import compile_grammar, grammar_problem
    from exl2_backend.grammar.vocabulary import Vocabulary

    write_byte_tokenizer(tmp_path, 298)
    set_chat_template(tmp_path, MAGISTRAL_TEMPLATE)
    assert Tokenizer.from_dir(tmp_path).reasoning_tags() is None  # "[/THINK]" is not a token yet
    ids = add_marker_tokens(tmp_path, ["[THINK]", "[/THINK]"])
    tok = Tokenizer.from_dir(tmp_path)
    tags = tok.reasoning_tags()
    assert tags == ReasoningTags(open="[THINK]", close="[/THINK]", prompt_opens=False, added=True,
                                 open_id=ids["[THINK]"], close_id=ids["[/THINK]"])
    assert tok.reasoning_tags("think") == tags and tok.reasoning_tags("none") is None
    reply = [ids["[THINK]"], *tok.encode("2+2 is 4.", add_special_tokens=False), ids["[/THINK]"],
             *tok.encode("It is 4.", add_special_tokens=False)]
    decoder = tok.incremental_decoder()
    text = "".join(decoder.push(i) for i in reply) + decoder.flush()
    assert text == "[THINK]2+2 is 4.[/THINK]It is 4."
    assert split_reasoning(text, tags) == ("2+2 is 4.", "It is 4.")
    assert tags.token_count(reply, inside=False) == reply.index(ids["[/THINK]"]) + 1
    field = tags.grammar_field(inside=False)
    assert field == {"open": f"<[{ids['[THINK]']}]>", "close": f"<[{ids['[/THINK]']}]>", "inside": False}
    spec = {"type": "json_schema", "value": {"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]}, "reasoning": field}
    assert grammar_problem(spec) is None
    gt = Vocabulary(tok, 300, {tok.eos_token_id})

    def accepts(*parts) -> bool:
        matcher = llguidance.LLMatcher(gt.llg, compile_grammar(spec, gt.llg)[0])
        toks = [t for p in parts for t in ([ids[p]] if p in ids else tok.encode(p, add_special_tokens=False))]
        return matcher.validate_tokens(toks) == len(toks) and matcher.consume_tokens(toks) and matcher.is_accepting()

    assert accepts("[THINK]", "a is 3", "[/THINK]", '{"a": 3}') and accepts('{"a": 3}')
    assert not accepts("[THINK]", "a is 3", "[/THINK]", "no json")
    # "think" on a template that names no tags takes the convention the vocabulary has as tokens
    set_chat_template(tmp_path, "{{ messages }}")
    assert Tokenizer.from_dir(tmp_path).reasoning_tags() is None
    assert Tokenizer.from_dir(tmp_path).reasoning_tags("think").close == "[/THINK]"
