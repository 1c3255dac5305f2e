"""generate_stream / generate_text: release on every exit, and the real default model answering a chat."""

from __future__ import annotations

import pytest

from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.generate import generate_stream, generate_text
from exl2_backend.sampling import SamplingParams
from tests.engine.test_engine import CharTokenizer, make_engine, naive_greedy, prompt, tiny_model

GREEDY = SamplingParams.greedy()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_stream_events_and_release(model):
    engine = make_engine(model, tokenizer=CharTokenizer(), max_chunk_size=4)
    p = prompt(10)
    events = list(generate_stream(engine, p, GenerationParams(sampling=GREEDY, max_new_tokens=6)))
    assert [t for e in events for t in e.token_ids] == naive_greedy(model, p, 6)
    assert all(e.token_ids for e in events)  # empty prefill-chunk events are not yielded
    assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
    assert engine.stats()["sequences"] == 0
    engine.assert_no_leaks()


def test_stream_closed_early_releases(model):
    engine = make_engine(model, tokenizer=CharTokenizer())
    total = engine.stats()["total_pages"]
    it = generate_stream(engine, prompt(30), GenerationParams(sampling=GREEDY, max_new_tokens=50), seq_id="x")
    next(it)
    next(it)
    assert engine.stats()["free_pages"] < total
    it.close()  # the consumer went away (e.g. client disconnect)
    assert engine.stats()["free_pages"] == total and "x" not in engine.seqs
    engine.assert_no_leaks()


def test_generate_text_from_ids(model):
    engine = make_engine(model, tokenizer=CharTokenizer())
    p = prompt(8)
    text = generate_text(engine, p, GenerationParams(sampling=GREEDY, max_new_tokens=5))
    assert text == "".join(chr(97 + t % 26) for t in naive_greedy(model, p, 5))


@pytest.mark.slow
def test_default_model_knows_paris(default_model_dir):
    engine = Engine.load(LoadSettings(model_dir=default_model_dir, device="cpu", max_seq_len=512, max_batch_size=2))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = generate_text(engine, chat, GenerationParams(sampling=GREEDY, max_new_tokens=24))
    assert "Paris" in text, text
    engine.assert_no_leaks()
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]
