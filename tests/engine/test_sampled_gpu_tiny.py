"""The engine's sampled decode on the GPU over a small random EXL2 model (no SmolLM2 in a device call's carry):
seeded sampling reproduces its tokens, and a row of NaN logits fails only its sequence (tier 2, pages returned)
in the sampling kernels' path as in the reference's (tests/engine/test_engine.py asks the same on the CPU)."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams
from tests.helpers.gpu_engine import small_gpu_engine

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(150)]  # a stall fails with its stack (AN1 / AP1: no result in 90-100 s)

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
    free = engine.pages.available
    params = GenerationParams(sampling=sampling, max_new_tokens=6, ignore_eos=True)
    for sid, seed in (("sick", 2), ("well", 3)):
        engine.add_sequence(sid, _prompt(12, seed), params)
    engine.prefill(["sick", "well"])
    real_run = engine.runner.run

    def nan_in_row_0(*args, **kwargs):
        logits = real_run(*args, **kwargs).clone()  # [B, V] on the GPU
        logits[0, 5] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "run", nan_in_row_0)
    sick, well = engine.decode(["sick", "well"])
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert sick.finish_reason == "error" and "NaN logits" in sick.error and not sick.token_ids
    assert well.finish_reason is None and len(well.token_ids) == 1
    while not engine.decode(["well"])[0].finish_reason:
        pass
    engine.release("sick")
    engine.release("well")
    engine.assert_no_leaks()
    assert engine.pages.available == free
