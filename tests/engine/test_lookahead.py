"""Decode lookahead (runtime/lookahead.py): with the next greedy step kept in flight, every token equals
plain graph decoding, whatever the host does between steps (batch changes, releases, finishes), and no KV
page leaks. Real SmolLM2 weights on the GPU."""

from __future__ import annotations

import pytest

from exl2_backend.runtime import Engine, LoadSettings
from tests.helpers.greedy_runs import run_greedy_batch as _run

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = Engine.load(LoadSettings(model_dir=default_model_dir, device="cuda", max_seq_len=512, max_batch_size=4))
    assert eng.lookahead is not None
    return eng


def test_lookahead_tokens_identical_single_and_batched(engine):
    tok = engine.tokenizer
    prompts = {"a": tok.encode("The capital of France is"), "b": tok.encode("def fibonacci(n):"),
               "c": tok.encode("Once upon a time")}
    lengths = {"a": 40, "b": 25, "c": 33}  # sequences finish at different steps: the batch shrinks
    free0 = engine.pages.available
    want = _run(engine, prompts, lengths, lookahead=False)
    got = _run(engine, prompts, lengths, lookahead=True)
    assert got == want
    assert engine.lookahead.steps_ahead_used > 0
    single = _run(engine, {"a": prompts["a"]}, {"a": 40}, lookahead=True)
    assert single["a"] == want["a"]
    assert engine.pages.available == free0
    engine.assert_no_leaks()


def test_lookahead_survives_release_between_steps(engine):
    tok = engine.tokenizer
    prompts = {"x": tok.encode("Water boils at"), "y": tok.encode("The largest planet is")}
    lengths = {"x": 30, "y": 30}

    def drop_y(step, eng, live, out):
        if step == 5 and "y" in live:
            eng.release("y")  # a queued step for the pair is dropped; x goes on alone
            return [s for s in live if s != "y"]
        return live

    free0 = engine.pages.available
    want = _run(engine, prompts, lengths, lookahead=False, schedule=drop_y)
    dropped0 = engine.lookahead.steps_ahead_dropped
    got = _run(engine, prompts, lengths, lookahead=True, schedule=drop_y)
    assert got["x"] == want["x"] and got["y"] == want["y"]
    assert engine.lookahead.steps_ahead_dropped > dropped0
    assert engine.pages.available == free0
    engine.assert_no_leaks()
