"""scripts/profile_engine_step.py: its trace arithmetic on synthetic intervals, and the script on a tiny model on
the CPU (host time only: no device trace there)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "profile_engine_step.py"
_spec = importlib.util.spec_from_file_location("profile_engine_step", _PATH)
pes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pes)


def test_busy_time_is_the_union_and_gaps_name_their_neighbours():
    spans = [(0.0, 10.0, "graph_a"), (2.0, 4.0, "inside"), (9.0, 12.0, "graph_b"), (15.0, 16.0, "argmax"),
             (16.5, 18.0, "copy"), (30.0, 31.0, "graph_a")]
    wall, busy, gaps = pes.busy_and_gaps(spans)
    assert wall == 31.0
    assert busy == pytest.approx(12.0 + 1.0 + 1.5 + 1.0)
    assert gaps == [(3.0, "graph_b", "argmax"), (12.0, "copy", "graph_a")]  # the 0.5 us gap is below 1 us
    assert pes.busy_and_gaps([]) == (0.0, 0.0, [])


def test_summary_per_step():
    spans = [(0.0, 8.0, "k"), (10.0, 11.0, "argmax"), (20.0, 28.0, "k"), (30.0, 31.0, "argmax")]
    s = pes.summarize(spans, steps=2, top=5)
    assert s["wall_us_per_step"] == 15.5 and s["busy_us_per_step"] == 9.0 and s["idle_us_per_step"] == 6.5
    assert s["work"][0] == {"name": "k", "per_step": 1.0, "us_per_step": 8.0}
    gaps = {(g["before"], g["after"]): g for g in s["gaps"]}
    assert gaps[("k", "argmax")]["us_per_step"] == 2.0 and gaps[("argmax", "k")]["per_step"] == 0.5


def test_script_on_a_tiny_model_on_the_cpu(tmp_path, monkeypatch, capsys):
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=2)
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["profile_engine_step.py", str(d), "--device", "cpu", "--context", "24",
                                      "--steps", "3", "--json", str(out)])
    assert pes.main() == 0
    result = json.loads(out.read_text())
    assert result["context"] == 24 and result["engine_step_us"] > 0 and "trace" not in result
    assert "engine decode step" in capsys.readouterr().out
