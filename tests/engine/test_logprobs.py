"""Token logprobs (GenerationParams.logprobs, runtime/logprobs.py) on the engine's CPU paths: prefill's first
token, decode, sampled rows and a verify's accepted drafts. Each is log_softmax of the raw logits row the step
produced (recorded from the runner), whatever the sampling settings; the alternatives are the most likely
tokens, most likely first. Tolerance: 1e-5 absolute (the same fp32 log_softmax)."""

from __future__ import annotations

import math

import pytest
import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.runtime import GenerationParams
from exl2_backend.runtime.logprobs import TokenLogprob
from exl2_backend.sampling import SamplingParams
from tests.engine.test_engine import make_engine, prompt, tiny_model

GREEDY = SamplingParams.greedy()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def _recording(engine):
    """Record every logits tensor the runner returns (rows as the engine sampled them)."""
    seen, real_run = [], engine.runner.run

    def run(*args, **kwargs):
        out = real_run(*args, **kwargs)
        seen.append(out.detach().float().clone())
        return out

    engine.runner.run = run
    return seen


def _check(lp, row: torch.Tensor, token: int, n: int) -> None:
    want = torch.log_softmax(row, -1)
    assert lp.token_id == token
    assert math.isclose(lp.logprob, want[token].item(), abs_tol=1e-5) and lp.logprob <= 0
    assert len(lp.top) == n
    top = want.topk(n) if n else None
    for j, (tid, value) in enumerate(lp.top):
        assert math.isclose(value, want[tid].item(), abs_tol=1e-5)
        assert math.isclose(value, top.values[j].item(), abs_tol=1e-5)
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3,
                                                             seed=11)], ids=["greedy", "sampled"])
def test_each_token_carries_its_raw_logprob(model, sampling):
    engine = make_engine(model)
    seen = _recording(engine)
    n = 3
    engine.add_sequence("a", prompt(10, 1), GenerationParams(sampling=sampling, max_new_tokens=6, logprobs=n,
                                                             ignore_eos=True))
    events = [engine.prefill(["a"])[0]]
    while not events[-1].finished:  # bounded: max_new_tokens
        events.append(engine.decode(["a"])[0])
    assert len(seen) == len(events) == 6
    for ev, logits in zip(events, seen):
        (token,) = ev.token_ids
        (lp,) = ev.logprobs
        _check(lp, logits[0], token, n)
        if sampling is GREEDY:  # raw argmax, no penalties: the chosen token is the most likely one
            assert lp.top[0] == (token, lp.logprob)
    engine.release("a")
    engine.assert_no_leaks()


def test_a_verify_gives_one_logprob_per_accepted_token(model):
    """Drafts taken from a plain greedy run are all accepted: k + 1 tokens, each with its row's logprob."""
    plain = make_engine(model)
    params = GenerationParams(sampling=GREEDY, max_new_tokens=12, ignore_eos=True)
    plain.add_sequence("a", prompt(9, 2), params)
    ref = plain.prefill(["a"])[0].token_ids
    while not plain.seqs["a"].finished:
        ref += plain.decode(["a"])[0].token_ids

    engine = make_engine(model)
    engine.add_sequence("a", prompt(9, 2), GenerationParams(sampling=GREEDY, max_new_tokens=12, ignore_eos=True,
                                                            logprobs=2))
    assert engine.prefill(["a"])[0].token_ids == ref[:1]
    seen = _recording(engine)
    ev = engine.verify(["a"], {"a": ref[1:5]})[0]
    assert ev.token_ids == ref[1:6] and len(ev.logprobs) == 5
    (logits,) = seen  # [1, k + 1, V]
    for j, (token, lp) in enumerate(zip(ev.token_ids, ev.logprobs)):
        _check(lp, logits[0, j], token, 2)
    engine.release("a")
    engine.assert_no_leaks()


def test_logprobs_off_zero_and_out_of_range(model):
    engine = make_engine(model)
    engine.add_sequence("off", prompt(5, 3), GenerationParams(sampling=GREEDY, max_new_tokens=2))
    engine.add_sequence("zero", prompt(5, 4), GenerationParams(sampling=GREEDY, max_new_tokens=2, logprobs=0))
    off, zero = engine.prefill(["off", "zero"])
    assert off.logprobs is None
    assert len(zero.logprobs) == 1 and zero.logprobs[0].top == ()
    for sid in ("off", "zero"):
        engine.release(sid)
    for bad in (-1, 21, True, 2.0, "3"):
        with pytest.raises(InvalidRequestError, match="logprobs must be") as e:
            GenerationParams(logprobs=bad)
        assert e.value.field == "logprobs"


@pytest.mark.parametrize("chunk", [2048, 5], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_score_every_prompt_token(model, chunk):
    """prompt_logprobs: one entry per prompt token (the first's logprob None), each later one log_softmax of the
    logits at the position before it, with n alternatives; equal whether the prompt runs in one chunk or in
    chunks of 5; a prefix in the prefix cache is computed again (its positions' logits are needed)."""
    ids = prompt(37, 7)  # two full pages of 16 for the prefix cache
    reference = make_engine(model)  # the whole prompt's logits in one forward: [P, V]
    reference.add_sequence("r", ids, GenerationParams(sampling=GREEDY, max_new_tokens=1))
    reference.pages.grow(reference.seqs["r"], len(ids))
    full = reference.runner.run([ids], [0], [reference.seqs["r"].pages], "all")[0]
    reference.release("r")

    engine = make_engine(model, max_chunk_size=chunk)
    runs = {}
    for sid in ("warm", "p", "hit"):  # "warm" fills the prefix cache with this prompt's full pages first
        engine.add_sequence(sid, ids, GenerationParams(sampling=GREEDY, max_new_tokens=2,
                                                       prompt_logprobs=2 if sid == "p" else None))
        runs[sid] = []
        while not runs[sid] or not runs[sid][-1].token_ids:  # bounded: 37 / 5 chunks at most
            runs[sid] += engine.prefill([sid])
    assert engine.seqs["hit"].cached_tokens > 0 and engine.seqs["p"].cached_tokens == 0
    events = runs["p"]
    ev = events[-1]
    assert [e.prompt_logprobs for e in events[:-1]] == [None] * (len(events) - 1)
    entries = ev.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] == TokenLogprob(ids[0], None)
    for j in range(1, len(ids)):
        _check(entries[j], full[j - 1], ids[j], 2)
    for sid in runs:
        engine.release(sid)
    engine.assert_no_leaks()
