"""Rejection sampling (spec/rejection.py): whatever the draft distribution q, the emitted token is
distributed as the target's processed distribution p (chi-square goodness of fit over many seeded draws)."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.ops.reference import apply_penalties, make_generator, sampling_probs
from exl2_backend.runtime.engine import _NoDecoder
from exl2_backend.runtime.params import GenerationParams
from exl2_backend.runtime.sequence import Sequence
from exl2_backend.sampling import SamplingParams
from exl2_backend.spec.rejection import accept_or_resample, race
from exl2_backend.tokenizer import StopMatcher
from tests.helpers.chi2 import goodness_of_fit

V = 12
N = 6000


def _seq(sampling: SamplingParams, prompt=(1, 2, 3)) -> Sequence:
    return Sequence("s", list(prompt), GenerationParams(sampling=sampling), max_total=64, vocab_size=V,
                    eos_ids=set(), decoder=_NoDecoder(), stop_matcher=StopMatcher([]))


def _draws(seq, logits, q, n=N, seed=1):
    """Draft d ~ q (own generator), then the target's decision; -> (emitted counts, draft counts)."""
    g = make_generator(seed)
    out, drafts = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        d = int(race(q[None, :], [g])[0])
        drafts[d] += 1
        out[accept_or_resample(seq, logits, d, q)] += 1
    return out, drafts


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, seed=5),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.95, min_p=0.02, seed=6),
], ids=["plain", "filtered"])
def test_emitted_tokens_follow_the_target(sampling):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=g) * 1.5  # [1, V] target logits
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)  # [V] a different draft distribution
    seq = _seq(sampling)
    p = sampling_probs(logits, [sampling])[0]  # [V]
    out, drafts = _draws(seq, logits, q)
    assert goodness_of_fit(out, p) > 1e-3
    assert goodness_of_fit(drafts, p.clamp_min(1e-6)) < 1e-6  # "accept every draft" would be caught
    if sampling.top_k:
        assert float(out[p == 0].sum()) == 0  # filtered tokens never come back through the residual


def test_penalties_are_part_of_the_target_distribution():
    sampling = SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.7, seed=9)
    seq = _seq(sampling, prompt=(0, 1, 2))
    for t in (3, 3, 4):
        seq.append_token(t)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, V, generator=g)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    pc = torch.bincount(torch.tensor([0, 1, 2]), minlength=V).float()[None]
    oc = torch.bincount(torch.tensor([3, 3, 4]), minlength=V).float()[None]
    p = sampling_probs(apply_penalties(logits, pc, oc, [sampling]), [sampling])[0]
    out, _ = _draws(seq, logits, q, seed=2)
    assert goodness_of_fit(out, p) > 1e-3


def test_identical_distributions_always_accept_and_seeds_reproduce():
    sampling = SamplingParams(temperature=1.0, seed=3)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    q = sampling_probs(logits, [sampling])[0]
    a, b = _seq(sampling), _seq(sampling)
    g = make_generator(8)
    for _ in range(200):
        d = int(race(q[None, :], [g])[0])
        assert accept_or_resample(a, logits, d, q) == d  # p == q: acceptance probability 1
        assert accept_or_resample(b, logits, d, q) == d
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
