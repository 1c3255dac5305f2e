"""Constrained output (GenerationParams.grammar, exl2_backend/grammar/) on the real default model (SmolLM2-135M,
CPU) with the real tokenizer and llguidance: every grammar type's output conforms, greedy and sampled; a greedy
constrained token is the argmax of the raw logits over what the grammar allows at that step; speculation (n-gram,
draft model, host drafts) keeps greedy constrained output identical; bad grammars are refused at admission and
leak nothing."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.grammar.spec import compile_grammar
from exl2_backend.model import LlamaModel
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams
from exl2_backend.tokenizer import Tokenizer
from tests.engine.test_engine import run
from tests.engine.test_logprobs import _recording

SETTINGS = {"device": "cpu", "max_seq_len": 512, "cache_tokens": 4096, "page_size": 16}
GREEDY = SamplingParams.greedy()
# bounded, so a small model's greedy output cannot repeat "dog" forever inside the grammar
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
REGEX = r"(yes|no), because [a-z ]{1,40}\."
LARK = 'start: "Answer: " NUMBER " " UNIT\nNUMBER: /[0-9]{1,3}/\nUNIT: "km" | "miles"'
GRAMMARS = {
    "json_object": ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"type": "json_schema", "value": PERSON}, lambda t: _is_person(json.loads(t))),
    "json_schema_text": ({"type": "json_schema", "value": json.dumps(PERSON)}, lambda t: _is_person(json.loads(t))),
    "regex": ({"type": "regex", "value": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "lark": ({"type": "lark", "value": LARK}, lambda t: re.fullmatch(r"Answer: [0-9]{1,3} (km|miles)", t) is not None),
    "choice": ({"type": "choice", "value": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
}


def _is_person(obj) -> bool:
    return (set(obj) == {"name", "age", "pets"} and isinstance(obj["name"], str) and type(obj["age"]) is int
            and all(p in ("cat", "dog") for p in obj["pets"]))


@pytest.fixture(scope="module")
def smol(default_model_dir):
    model = LlamaModel.from_dir(default_model_dir, "cpu")
    tok = Tokenizer.from_dir(default_model_dir)
    return model, tok, Engine(model, tok, LoadSettings(**SETTINGS))


def _prompt(tok, text="Return a JSON object with the name and age of Ann, who is 31.") -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


def _generate(engine, ids, params, sid="g"):
    """(text, tokens, last event) of one sequence run to its end."""
    engine.add_sequence(sid, ids, params)
    events = engine.prefill([sid])
    while not events[0].token_ids and not events[0].finished:
        events = engine.prefill([sid])
    tokens, text = list(events[0].token_ids), events[0].text
    while not events[0].finished:
        events = engine.decode([sid])
        tokens += events[0].token_ids
        text += events[0].text
    engine.release(sid)
    engine.assert_no_leaks()
    return text, tokens, events[0]


SAMPLED = SamplingParams(temperature=0.7, top_k=20, seed=5)


@pytest.mark.parametrize("name", list(GRAMMARS))
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_output_conforms_and_ends_when_complete(smol, name, sampling):
    _, tok, engine = smol
    grammar, conforms = GRAMMARS[name]
    # ignore_eos: the sequence still ends as soon as the grammar is complete
    text, tokens, last = _generate(engine, _prompt(tok), GenerationParams(sampling=sampling, max_new_tokens=120,
                                                                          grammar=grammar, ignore_eos=True))
    assert last.finish_reason == "stop" and last.error is None, (text, last)
    assert conforms(text), text
    assert tok.decode(tokens) == text


def test_greedy_token_is_the_argmax_over_what_the_grammar_allows(smol):
    """Reference: at each step the allowed set from a fresh llguidance matcher replayed over the tokens so far (its
    byte bitmask, unpacked with numpy) and the raw logits the runner returned. The constrained greedy token must be
    the allowed token with the largest logit, and the unconstrained argmax must differ at least once (the mask did
    something)."""
    import llguidance

    model, tok, _ = smol
    engine = Engine(model, tok, LoadSettings(**SETTINGS))
    seen = _recording(engine)
    grammar = {"type": "json_schema", "value": PERSON}
    _, tokens, _ = _generate(engine, _prompt(tok), GenerationParams(sampling=GREEDY, max_new_tokens=60,
                                                                    grammar=grammar))
    gt = engine.vocabulary()
    text, _ = compile_grammar(grammar, gt.llg)
    v = model.vocab_size
    differs = 0
    for step, token in enumerate(tokens):
        logits = seen[step][-1] if seen[step].dim() == 2 else seen[step][0, -1]  # [V]
        m = llguidance.LLMatcher(gt.llg, text)
        assert m.consume_tokens(tokens[:step])
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:v]
        allowed = torch.from_numpy(bits.astype(bool))  # [V]
        best = int(torch.where(allowed, logits, float("-inf")).argmax())
        assert token == best, (step, token, best)
        differs += int(logits.argmax()) != token
    assert differs > 0


def test_logprobs_stay_raw_under_a_grammar(smol):
    _, tok, engine = smol
    _, tokens, _ = _generate(engine, _prompt(tok), GenerationParams(sampling=GREEDY, max_new_tokens=8, logprobs=2,
                                                                    grammar={"type": "json_object"}))
    engine.add_sequence("l", _prompt(tok), GenerationParams(sampling=GREEDY, max_new_tokens=1, logprobs=2,
                                                            grammar={"type": "json_object"}))
    ev = engine.prefill(["l"])[0]
    engine.release("l")
    lp = ev.logprobs[0]
    assert lp.token_id == tokens[0] and lp.logprob <= 0
    assert lp.top[0][1] >= lp.logprob  # the raw distribution's top token may be one the grammar forbids


def test_a_constrained_sequence_leaves_its_batch_mates_unchanged(smol):
    """A batch that holds a constrained sequence samples eagerly: a plain greedy sequence beside it decodes the same
    tokens as alone."""
    _, tok, engine = smol
    plain = GenerationParams(sampling=GREEDY, max_new_tokens=12, ignore_eos=True)
    alone = run(engine, ["p"], [_prompt(tok)], plain)["p"]
    engine.add_sequence("c", _prompt(tok), GenerationParams(sampling=GREEDY, max_new_tokens=12,
                                                            grammar={"type": "json_object"}))
    engine.add_sequence("p", _prompt(tok), plain)
    out = {"c": [], "p": []}
    for ev in engine.prefill(["c", "p"]):
        out[ev.seq_id] += ev.token_ids
    live = [s for s in ("c", "p") if not engine.seqs[s].finished]
    while live:
        for ev in engine.decode(live):
            out[ev.seq_id] += ev.token_ids
        live = [s for s in live if not engine.seqs[s].finished]
    engine.release("c")
    engine.release("p")
    engine.assert_no_leaks()
    assert out["p"] == alone and tok.decode(out["c"]).startswith("{")


def test_length_cut_is_length(smol):
    _, tok, engine = smol
    text, tokens, last = _generate(engine, _prompt(tok), GenerationParams(sampling=GREEDY, max_new_tokens=5,
                                                                          grammar={"type": "json_schema",
                                                                                   "value": PERSON}))
    assert last.finish_reason == "length" and len(tokens) == 5 and text.startswith("{")


@pytest.mark.parametrize("mode", ["ngram", "draft_model"])
def test_speculation_keeps_greedy_constrained_output(smol, default_fp16_dir, mode):
    model, tok, plain_engine = smol
    prompts = [_prompt(tok), _prompt(tok, "Copy this JSON exactly: {\"name\": \"Bo\", \"age\": 4, \"pets\": []}")]
    params = GenerationParams(sampling=GREEDY, max_new_tokens=48, grammar={"type": "json_schema", "value": PERSON})
    plain = run(plain_engine, ["a", "b"], prompts, params)
    kw = {"ngram": True} if mode == "ngram" else {"draft_model": default_fp16_dir}
    spec = Engine(model, tok, LoadSettings(**SETTINGS, **kw))
    assert run(spec, ["a", "b"], prompts, params) == plain
    assert spec.stats()["spec_accepted_tokens"] > 0


def test_host_drafts_outside_the_grammar_are_rejected(smol):
    """Drafts the grammar forbids never reach the output: verify keeps the constrained greedy tokens."""
    _, tok, engine = smol
    params = GenerationParams(sampling=GREEDY, max_new_tokens=16, grammar={"type": "choice", "value": ["blue"]})
    want, _, _ = _generate(engine, _prompt(tok), params)
    engine.add_sequence("v", _prompt(tok), params)
    ev = engine.prefill(["v"])[0]
    text, bad = ev.text, tok.encode("red", add_special_tokens=False)
    while not ev.finished:
        ev = engine.verify(["v"], {"v": bad})[0]
        text += ev.text
    engine.release("v")
    engine.assert_no_leaks()
    assert text == want == "blue"


@pytest.mark.parametrize("grammar, needle", [
    ({"type": "json_schema", "value": {"type": "nonsense"}}, "nonsense"),
    ({"type": "json_schema", "value": "{not json"}, "grammar"),
    ({"type": "regex", "value": "[a-"}, "regex"),
    ({"type": "lark", "value": "start: undefined_rule"}, "undefined_rule"),
])
def test_grammar_that_does_not_compile_is_refused_and_leaks_nothing(smol, grammar, needle):
    _, tok, engine = smol
    with pytest.raises(InvalidRequestError) as ei:
        engine.add_sequence("bad", _prompt(tok), GenerationParams(grammar=grammar))
    assert ei.value.field == "grammar" and needle in str(ei.value)
    assert "bad" not in engine.seqs
    engine.assert_no_leaks()


@pytest.mark.parametrize("grammar", [
    {"type": "xml"}, {"type": "json_object", "value": 3}, {"type": "regex", "value": ""},
    {"type": "choice", "value": []}, {"type": "choice", "value": ["a", 3]}, {"type": "json_schema", "value": 5}, "json",
    {"type": "regex", "pattern": "x"},
])
def test_malformed_grammar_is_refused_by_the_params(grammar):
    with pytest.raises(InvalidRequestError) as ei:
        GenerationParams(grammar=grammar)
    assert ei.value.field == "grammar"


def test_engine_without_tokenizer_refuses_a_grammar():
    from tests.engine.test_engine import make_engine, tiny_model

    engine = make_engine(tiny_model(seed=1))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_sequence("t", [1, 2, 3], GenerationParams(grammar={"type": "json_object"}))
    engine.assert_no_leaks()


def test_a_tokenizer_llguidance_cannot_read_refuses_grammars_only(smol, monkeypatch):
    """Where llguidance cannot read the tokenizer, the engine still serves: a grammar is refused naming why, and
    logprobs carry the tokens' text bytes."""
    from exl2_backend.grammar import vocabulary

    model, tok, _ = smol

    def unreadable(*args, **kwargs):
        raise ValueError("unsupported tokenizer")

    monkeypatch.setattr(vocabulary.Vocabulary, "__init__", unreadable)
    engine = Engine(model, tok, LoadSettings(**SETTINGS))
    assert engine.vocabulary() is None
    with pytest.raises(InvalidRequestError, match="unsupported tokenizer") as ei:
        engine.add_sequence("g", _prompt(tok), GenerationParams(grammar={"type": "json_object"}))
    assert ei.value.field == "grammar"
    _, tokens, last = _generate(engine, _prompt(tok), GenerationParams(sampling=GREEDY, max_new_tokens=3))
    assert len(tokens) == 3 and last.finish_reason == "length"
