"""N-gram (prompt-lookup) proposals and the k controller, as units."""

from __future__ import annotations

import pytest

from exl2_backend.spec.adaptive import KController, StepCosts, expected_tokens
from exl2_backend.spec.config import NgramConfig
from exl2_backend.spec.ngram import NgramIndex


def test_longest_latest_match_proposes_what_followed():
    idx = NgramIndex(NgramConfig(min_n=1, max_n=3))
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6]
    # suffix [5, 6] occurred at 0..1 (followed by 7 8 9); [6] alone last occurred at 6 (followed by 7 2)
    assert idx.propose(tokens, 3) == [7, 8, 9]
    tokens += [7, 2]  # suffix [6, 7, 2] occurred at 6..8, followed by 5 6 7 2 (runs into the suffix itself)
    assert idx.propose(tokens, 4) == [5, 6, 7, 2]


def test_repeating_pattern_continues_past_the_end():
    idx = NgramIndex(NgramConfig(min_n=2, max_n=4))
    assert idx.propose([1, 2, 3, 1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramIndex(NgramConfig(min_n=1, max_n=2)).propose([4, 4], 3) == [4, 4, 4]


def test_no_match_and_limits():
    idx = NgramIndex(NgramConfig(min_n=2, max_n=3))
    assert idx.propose([1, 2, 3, 4, 5], 4) == []  # no bigram repeats
    assert idx.propose([1, 2, 3, 4, 5, 1], 4) == []  # a unigram match is below min_n
    assert idx.propose([1, 2, 3, 4, 5, 1, 2], 0) == []
    assert idx.propose([1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]
    assert NgramIndex(NgramConfig()).propose([7], 4) == []


def test_index_is_incremental():
    """Growing the sequence one token at a time gives the same proposals as a fresh index."""
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(200)]
    grown = NgramIndex(NgramConfig(min_n=1, max_n=4))
    for n in range(1, len(tokens)):
        fresh = NgramIndex(NgramConfig(min_n=1, max_n=4)).propose(tokens[:n], 5)
        assert grown.propose(tokens[:n], 5) == fresh, n


def test_ngram_config_validation():
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=4, max_n=2)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_fixed_controller_never_moves():
    c = KController(4)
    for _ in range(20):
        c.update(4, 0)
    assert c.next_k() == 4


def test_adaptive_k_rises_with_acceptance_and_falls_without():
    costs = StepCosts(draft=0.1, verify=0.04)
    up = KController(4, adaptive=True, k_max=8, costs=costs)
    for _ in range(20):
        up.update(up.next_k(), up.next_k())  # everything accepted
    assert up.next_k() == 8 and up.alpha > 0.9

    down = KController(4, adaptive=True, k_max=8, costs=costs)
    ks = []
    for _ in range(20):
        k = down.next_k()
        down.update(k, 0)  # nothing accepted
        ks.append(down.k)
    assert ks == sorted(ks, reverse=True) and down.k == 0  # monotone down to "do not draft"
    # at k = 0 it still probes one draft every probe_every steps, so it can recover
    probes = 0
    for _ in range(3 * down.probe_every):
        k = down.next_k()
        probes += k
        down.update(k, k)  # the probes are accepted now
    assert probes >= 1 and down.k >= 1


def test_best_k_trades_acceptance_against_cost():
    cheap, dear = StepCosts(draft=0.0, verify=0.04), StepCosts(draft=0.6, verify=0.04)
    assert KController.best_k(0.8, cheap, 8) > KController.best_k(0.8, dear, 8) >= 1
    assert KController.best_k(0.1, dear, 8) == 0  # a draft that is rarely right and costly: do not draft
    assert KController.best_k(0.99, cheap, 8) == 8
