"""Speculative decoding on the GPU over small random EXL2 models (no SmolLM2 in a device call's carry): greedy output
with n-gram drafts, a draft model that is the target itself (every draft accepted) and a different one (most drafts
rejected, so the caches roll back) is identical to plain decoding, also under penalties, a logit bias, min_tokens
and a grammar, which the draft model proposes under (session 28); sampled rejection sampling runs clean."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams
from tests.engine.test_engine import run
from tests.helpers.gpu_engine import small_gpu_engine, write_small_model

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(240)]

VOCAB = 5_000
SETTINGS = {"max_seq_len": 256, "max_batch_size": 4}
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
CASES = {
    "greedy": GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=40, ignore_eos=True),
    "penalties_bias": GenerationParams(sampling=PENALIZED, max_new_tokens=40, ignore_eos=True,
                                       logit_bias={101: 4.0, 102: -100.0}, min_new_tokens=10),
    "grammar": GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=40,
                                grammar={"type": "regex", "value": "[a-z ]{6,30}\\."}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target engine, plain; the target's directory; another model's directory of the same vocabulary)."""
    root = tmp_path_factory.mktemp("spec_tiny")
    plain = small_gpu_engine(root / "target", VOCAB, 11, **SETTINGS)
    return plain, str(root / "target"), str(write_small_model(root / "other", VOCAB, 12))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 250, (12,), generator=g).tolist()  # byte tokens: text a grammar can follow
    return [base * 3, torch.randint(3, 250, (20,), generator=g).tolist(), base[:5] * 4]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["ngram", "self_draft", "other_draft"])
def test_speculation_keeps_greedy_output(models, mode, case):
    plain, target_dir, other_dir = models
    ids, params = ["a", "b", "c"], CASES[case]
    want = run(plain, ids, _prompts(), params)
    kw = {"ngram": True} if mode == "ngram" else {"draft_model": target_dir if mode == "self_draft" else other_dir}
    spec = Engine.load(LoadSettings(model_dir=target_dir, device="cuda", **SETTINGS, **kw))
    try:
        assert run(spec, ids, _prompts(), params) == want
        if mode == "self_draft":  # the target drafting for itself: its drafts are accepted
            assert spec.stats()["spec_accepted_tokens"] > 0
    finally:
        spec.close()


def test_sampled_draft_model_runs_clean(models):
    _, target_dir, other_dir = models
    spec = Engine.load(LoadSettings(model_dir=target_dir, device="cuda", draft_model=other_dir, **SETTINGS))
    try:
        params = GenerationParams(sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=5), max_new_tokens=32,
                                  ignore_eos=True)
        out = run(spec, ["a", "b"], _prompts()[:2], params)
        assert all(len(t) == 32 and all(0 <= x < VOCAB for x in t) for t in out.values())
        assert run(spec, ["a", "b"], _prompts()[:2], params) == out  # seeded: the same again
    finally:
        spec.close()
