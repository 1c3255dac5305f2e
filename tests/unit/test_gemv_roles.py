"""scripts/gemv_roles.py: the GEMV launches of a profiled decode step labelled by role, and each role's time past
what its bytes take to stream (plain Python)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gemv_roles.py"
_spec = importlib.util.spec_from_file_location("gemv_roles", _PATH)
roles_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roles_mod)

K = "gemv_tma_kernel<1>"


def _step(t0: float) -> list[tuple[float, float, str]]:
    """One 2-layer step: embedding, then per layer q/k/v, attention, o, gate/up, down; then the head."""
    names = ["embedding"] + [K, "attention", K, K, K] * 2 + [K]
    return [(t0 + i, t0 + i + 1, n) for i, n in enumerate(names)]


def test_step_roles_follow_the_launch_order():
    assert roles_mod.step_roles(2, head=True) == ["q/k/v", "o", "gate/up", "down"] * 2 + ["head"]
    assert roles_mod.step_roles(1, head=False) == ["q/k/v", "o", "gate/up", "down"]


def test_launches_are_labelled_in_start_order_over_several_steps():
    events = _step(0) + _step(100)
    shuffled = events[::-1]  # labels follow start times, not list order
    got = roles_mod.label_gemv_roles(shuffled, roles_mod.step_roles(2, head=True))
    names = [n for _, _, n in sorted(got)]
    want_roles = ["q/k/v", "o", "gate/up", "down"] * 2 + ["head"]
    gemv_names = [n for n in names if n.startswith(K)]
    assert gemv_names == [f"{K} [{r}]" for r in want_roles * 2]
    assert [n for n in names if not n.startswith(K)] == ["embedding", "attention", "attention"] * 2


def test_a_launch_count_off_the_roles_leaves_the_names():
    events = _step(0)[:-1]  # the head missing: 8 launches for 9 roles
    assert roles_mod.label_gemv_roles(events, roles_mod.step_roles(2, head=True)) == events


def test_role_rows_compare_time_with_streaming():
    critical = {f"{K} [down]": [32.0, 640.0], f"{K} [o]": [32.0, 256.0], "attention": [32.0, 200.0]}
    role_bytes = {"down": 32 * 29_400_000, "o": 32 * 8_400_000}
    rows = roles_mod.role_rows(critical, role_bytes, bandwidth_gbs=4200.0)
    assert [r["role"] for r in rows] == ["down", "o"]
    down = rows[0]
    assert down["us_per_launch"] == pytest.approx(20.0)
    assert down["mb_per_launch"] == pytest.approx(29.4)
    assert down["stream_us_per_launch"] == pytest.approx(29.4e6 / 4200e9 * 1e6)
    assert down["past_stream_us_per_launch"] == pytest.approx(20.0 - 7.0)


def test_roles_by_layer_sum_to_the_role_rows_and_group_by_kind():
    events = _step(0) + _step(100)
    labelled = roles_mod.label_gemv_roles(events, roles_mod.step_roles(2, head=True, by_layer=True))
    names = [n for _, _, n in sorted(labelled) if n.startswith(K)]
    assert names[:5] == [f"{K} [{r}]" for r in ("q/k/v#0", "o#0", "gate/up#0", "down#0", "q/k/v#1")]
    assert roles_mod.split_label("gate/up#1") == ("gate/up", 1) and roles_mod.split_label("head") == ("head", None)
    # layer 0's gate/up is 3-bit and slow, layer 1's 4-bit
    critical = {f"{K} [gate/up#0]": [2.0, 80.0], f"{K} [gate/up#1]": [2.0, 40.0], f"{K} [head]": [2.0, 200.0]}
    rows = roles_mod.role_rows(critical, {"gate/up": 2 * 60_000_000, "head": 400_000_000}, bandwidth_gbs=4000.0)
    gate = next(r for r in rows if r["role"] == "gate/up")
    assert gate["launches"] == 4.0 and gate["us_per_launch"] == pytest.approx(30.0)
    assert gate["mb_per_launch"] == pytest.approx(30.0)
    kinds = roles_mod.kind_rows(critical, {("gate/up", 0): 50_000_000, ("gate/up", 1): 60_000_000},
                                {("gate/up", 0): "4:0.1 3:0.9", ("gate/up", 1): "4:1"}, bandwidth_gbs=4000.0)
    assert [(r["kind"], r["us_per_launch"]) for r in kinds] == [("4:0.1 3:0.9", 40.0), ("4:1", 20.0)]
    assert kinds[0]["mb_per_launch"] == pytest.approx(50.0)
    assert kinds[0]["past_stream_us_per_launch"] == pytest.approx(40.0 - 12.5)
