"""The engine's sampled decode on the GPU over a small random EXL2 model (no SmolLM2 in a device call's carry):
seeded sampling reproduces its tokens, and a row of NaN logits fails only its sequence (tier 2, pages returned)
in the sampling kernels' path as in the reference's (tests/engine/test_engine.py asks the same on the CPU)."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams
from tests.helpers.gpu_engine import small_gpu_engine
from tests.helpers.nan_logits import check_nan_row_fails_only_its_sequence

# a stall fails with its stack at 150 s (H200 calls AN1 / AP1: no result from these tests in 90-100 s)
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(150)]

VOCAB = 5_000
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=7)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = small_gpu_engine(tmp_path_factory.mktemp("sampled") / "m", VOCAB, 5, max_seq_len=256, max_batch_size=4)
    eng.lookahead = None  # the eager sampling path (the greedy lookahead has tests of its own)
    return eng


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(engine, sid: str, prompt: list[int], params: GenerationParams) -> list[int]:
    engine.add_sequence(sid, prompt, params)
    out = []
    while not out:  # the prefill's last chunk samples the first token
        out += engine.prefill([sid])[0].token_ids
    while not engine.seqs[sid].finished:
        out += engine.decode([sid])[0].token_ids
    engine.release(sid)
    return out


def test_seeded_sampling_repeats_its_tokens(engine):
    params = GenerationParams(sampling=SAMPLED, max_new_tokens=24, ignore_eos=True)
    a = _generate(engine, "a", _prompt(19, 1), params)
    b = _generate(engine, "b", _prompt(19, 1), params)
    assert a == b and len(a) == 24 and all(0 <= t < VOCAB for t in a)
    engine.assert_no_leaks()


@pytest.mark.parametrize("sampling", [SamplingParams.greedy(), SAMPLED], ids=["greedy", "sampled"])
def test_nan_logits_fail_only_their_sequence(engine, monkeypatch, sampling):
    check_nan_row_fails_only_its_sequence(engine, monkeypatch,
                                          GenerationParams(sampling=sampling, max_new_tokens=6, ignore_eos=True),
                                          {"sick": _prompt(12, 2), "well": _prompt(12, 3)})


def test_prompt_logprobs_on_the_gpu(engine):
    """prompt_logprobs on the GPU: the prompt scored during its prefill equals log_softmax of one forward over
    the whole prompt with every position's logits, within 1e-3 absolute."""
    ids = _prompt(40, 9)
    engine.add_sequence("ref", ids, GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=1))
    engine.pages.grow(engine.seqs["ref"], len(ids))
    full = torch.log_softmax(engine.runner.run([ids], [0], [engine.seqs["ref"].pages], "all")[0].float(), -1)
    engine.release("ref")
    engine.add_sequence("p", ids, GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=1,
                                                   prompt_logprobs=3))
    events = []
    for _ in range(len(ids)):  # bounded: one chunk per call at worst
        events += engine.prefill(["p"])
        if events[-1].token_ids:
            break
    entries = events[-1].prompt_logprobs
    assert len(entries) == len(ids) and entries[0].logprob is None
    for j in range(1, len(ids)):
        assert entries[j].token_id == ids[j] and len(entries[j].top) == 3
        assert abs(entries[j].logprob - full[j - 1, ids[j]].item()) < 1e-3
    engine.release("p")
    engine.assert_no_leaks()


@pytest.mark.parametrize("sampling", [SamplingParams.greedy(), SAMPLED], ids=["greedy", "sampled"])
def test_grammar_masks_on_the_gpu(engine, sampling):
    """A grammar's masks applied to GPU logits (pinned host masks, copied and unpacked on the device): the random
    model's output is one of the choices / matches the regex, and the sequence ends when the grammar does."""
    import re

    tok = engine.tokenizer
    for grammar, conforms in (({"type": "choice", "value": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
                              ({"type": "regex", "value": "[a-f]{3,6}"}, lambda t: re.fullmatch("[a-f]{3,6}", t))):
        tokens = _generate(engine, "g", _prompt(9, 4), GenerationParams(sampling=sampling, max_new_tokens=16,
                                                                        grammar=grammar))
        text = tok.decode([t for t in tokens if t not in engine.eos_ids])
        assert conforms(text), (grammar, text)
    engine.assert_no_leaks()
