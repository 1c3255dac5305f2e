"""logit_bias (GenerationParams.logit_bias) on the engine's CPU paths: +100 forces a token, -100 bans the
argmax, in prefill, decode and a verify's rows; the raw logits the logprobs report are not biased; ids outside
the vocabulary and values outside [-100, 100] are refused, naming the field."""

from __future__ import annotations

import pytest

from exl2_backend.errors import InvalidRequestError
from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams
from tests.engine.test_engine import VOCAB, make_engine, prompt, tiny_model

GREEDY = SamplingParams.greedy()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


def _generate(engine, sid, ids, params) -> list[int]:
    engine.add_sequence(sid, ids, params)
    out = engine.prefill([sid])[0].token_ids
    for _ in range(params.max_new_tokens):  # bounded
        if engine.seqs[sid].finished:
            break
        out += engine.decode([sid])[0].token_ids
    engine.release(sid)
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, seed=2)], ids=["greedy", "sampled"])
def test_plus_100_forces_a_token_and_minus_100_bans_one(model, sampling):
    engine = make_engine(model)
    ids = prompt(8, 5)
    forced = _generate(engine, "f", ids, GenerationParams(sampling=sampling, max_new_tokens=5, ignore_eos=True,
                                                          logit_bias={17: 100}))
    assert forced == [17] * 5
    plain = _generate(engine, "p", ids, GenerationParams(sampling=GREEDY, max_new_tokens=5, ignore_eos=True))
    banned = _generate(engine, "b", ids, GenerationParams(sampling=GREEDY, max_new_tokens=5, ignore_eos=True,
                                                          logit_bias={t: -100 for t in set(plain)}))
    assert not set(banned) & set(plain)
    engine.assert_no_leaks()


def test_a_verify_applies_the_bias_and_logprobs_stay_raw(model):
    """Greedy verification of a biased sequence takes the biased argmax (drafts of the forced token are all
    accepted); its logprobs are of the raw logits, where the forced token is not the most likely."""
    engine = make_engine(model)
    engine.add_sequence("a", prompt(8, 6), GenerationParams(sampling=GREEDY, max_new_tokens=10, ignore_eos=True,
                                                            logit_bias={23: 100}, logprobs=1))
    assert engine.prefill(["a"])[0].token_ids == [23]
    ev = engine.verify(["a"], {"a": [23, 23, 23]})[0]
    assert ev.token_ids == [23] * 4
    assert all(lp.token_id == 23 and lp.top[0][0] != 23 and lp.logprob < lp.top[0][1] for lp in ev.logprobs)
    engine.release("a")
    engine.assert_no_leaks()


def test_bad_biases_are_refused(model):
    engine = make_engine(model)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        engine.add_sequence("x", prompt(4), GenerationParams(logit_bias={VOCAB: 1.0}))
    assert e.value.field == "logit_bias"
    for bad in ({-1: 1.0}, {3: 101.0}, {3: float("nan")}, {"3": 1.0}, {3: True}, [3]):
        with pytest.raises(InvalidRequestError) as e:
            GenerationParams(logit_bias=bad)
        assert e.value.field == "logit_bias"
    assert GenerationParams(logit_bias={}).logit_bias is None
    engine.assert_no_leaks()
