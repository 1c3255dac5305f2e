"""GenerationParams.min_new_tokens (the OpenAI extension min_tokens): EOS and stop_token_ids are not sampled before
that many tokens, whichever path samples (eager decode, greedy and sampled; a verify's rows; the draft model's
proposals through the same sampling state), and the sequence is free to stop after it. A +100 logit bias on the
stop token makes it the model's only wish, so each step tests the ban."""

from __future__ import annotations

import pytest

from exl2_backend.errors import InvalidRequestError
from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams
from tests.engine.test_engine import make_engine, prompt, run, tiny_model

STOP = 7


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


def _params(sampling, min_new: int, **kw) -> GenerationParams:
    return GenerationParams(sampling=sampling, max_new_tokens=12, min_new_tokens=min_new, stop_token_ids=[STOP],
                            logit_bias={STOP: 100.0}, **kw)


@pytest.mark.parametrize("sampling", [SamplingParams.greedy(), SamplingParams(temperature=0.9, seed=2)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("min_new", [0, 1, 5])
def test_the_stop_token_waits_for_min_new_tokens(model, sampling, min_new):
    out = run(make_engine(model), ["a"], [prompt(9, 1)], _params(sampling, min_new))["a"]
    assert len(out) == min_new + 1 and out[-1] == STOP and STOP not in out[:-1]


def test_verify_rows_keep_the_ban(model):
    """Host drafts of the stop token inside the first min_new_tokens are rejected; the row after them samples it."""
    engine = make_engine(model)
    engine.add_sequence("v", prompt(9, 2), _params(SamplingParams.greedy(), 3))
    out = list(engine.prefill(["v"])[0].token_ids)
    while not engine.seqs["v"].finished:
        out += engine.verify(["v"], {"v": [STOP, STOP, STOP]})[0].token_ids
    engine.release("v")
    engine.assert_no_leaks()
    assert len(out) == 4 and out[-1] == STOP and STOP not in out[:-1]


@pytest.mark.parametrize("bad", [-1, 13, 2.5, True])
def test_bad_min_new_tokens_is_refused(bad):
    with pytest.raises(InvalidRequestError) as ei:
        GenerationParams(max_new_tokens=12, min_new_tokens=bad)
    assert ei.value.field == "min_new_tokens"
