"""scripts/ngram_sim.py: the offline replay of n-gram drafting and its expected speed-up (plain Python)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "ngram_sim.py"
_spec = importlib.util.spec_from_file_location("ngram_sim", _PATH)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

COSTS = {1: 1.2, 2: 1.3, 4: 1.5, 8: 2.0}


def test_a_step_without_a_draft_costs_a_plain_decode_step():
    assert sim.step_cost(0, COSTS) == 1.0
    assert sim.step_cost(4, COSTS) == 1.5
    assert sim.step_cost(3, COSTS) == pytest.approx(1.4)  # between the measured widths 2 and 4
    with pytest.raises(ValueError):
        sim.step_cost(9, COSTS)


def test_replay_and_expected_speedup():
    """A repeated phrase: the proposer copies it; steps with and without drafts are costed by their width."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    output = [9, 1, 2, 3, 4, 5, 6, 7, 8, 10]
    r = sim.replay(prompt, output, 2, 4, 4)
    assert sum(r["draft_len_histogram"].values()) == r["steps"] < len(output)
    tokens = r["tokens_per_step"] * r["steps"]
    cost = sum(n * sim.step_cost(w, COSTS) for w, n in r["draft_len_histogram"].items())
    assert sim.expected_speedup(r, COSTS) == pytest.approx(tokens / cost)
    assert sim.expected_speedup(r, COSTS) > 1.0
