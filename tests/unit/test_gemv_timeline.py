"""scripts/gemv_timeline.py's analysis on synthetic stamps (the GPU part needs the -DEXL2_GEMV_TIMELINE library)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gemv_timeline.py"
_spec = importlib.util.spec_from_file_location("gemv_timeline", _PATH)
tl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tl)

# meta rows: blocks, M, K, N (part 0), parts, feature bits (1 norm, 2 rope, 4 gated, 8 pre-gathered), tiles
QKV = [4, 1, 4096, 4096, 3, 3, 1]
O = [4, 1, 4096, 4096, 1, 0, 1]
GATE_UP = [4, 1, 4096, 14336, 2, 1, 1]
DOWN = [4, 1, 14336, 4096, 1, 4, 1]
HEAD = [4, 1, 4096, 128256, 1, 1, 1]


def _launch(start_ns: float, wait: float, stage: float, stream: list[float], finish: float) -> np.ndarray:
    """Stamps [BLOCKS, POINTS] of one launch: block b starts at start + 100 b ns, points 0..4 (ns), SM in 5."""
    s = np.zeros((tl.BLOCKS, tl.POINTS), dtype=np.uint64)
    for b, st in enumerate(stream):
        t0 = start_ns + 100 * b
        pts = np.cumsum([t0, wait, stage, st, finish])
        s[b, :5] = pts.astype(np.uint64)
        s[b, 5] = b
    return s


def test_roles_follow_the_feature_bits_and_shapes():
    assert [tl.role_of(np.array(m)) for m in (QKV, O, GATE_UP, DOWN, HEAD)] == ["q/k/v", "o", "gate/up", "down",
                                                                                 "head"]
    assert tl.role_of(np.array([4, 1, 4096, 1024, 1, 0, 1])) == "other"


def test_rows_and_summary_measure_each_phase():
    base = 1_000_000_000
    stamps = np.stack([
        _launch(base, 1000, 2000, [5000, 6000, 7000, 9000], 1500),  # q/k/v: ends at 900 + 3500 + 9000 + ... ns
        _launch(base + 30_000, 500, 1000, [4000, 4000, 4000, 4000], 800),  # o
    ])
    meta = np.array([QKV, O], dtype=np.int32)
    rows = tl.launch_rows(stamps, meta)
    assert [r["role"] for r in rows] == ["q/k/v", "o"]
    q, o = rows
    assert q["gap_us"] is None and q["start_us"] == 0.0
    assert q["wait_us"] == pytest.approx(1.0) and q["stage_us"] == pytest.approx(2.0)
    assert q["stream_us"] == pytest.approx(6.5) and q["stream_max_us"] == pytest.approx(9.0)
    assert q["finish_us"] == pytest.approx(1.5)
    q_end = (300 + 1000 + 2000 + 9000 + 1500) / 1e3  # the last block: started 300 ns late, streamed longest
    assert q["end_us"] == pytest.approx(q_end) and q["span_us"] == pytest.approx(q_end)
    assert o["gap_us"] == pytest.approx(30.0 - q_end)
    summary = tl.summarize(rows)
    assert summary["q/k/v"]["launches"] == 1 and summary["o"]["stream_us"] == pytest.approx(4.0)
    assert summary["step"]["first_start_to_last_end_us"] == pytest.approx(o["end_us"])
    assert summary["step"]["sum_gap_us"] == pytest.approx(o["gap_us"])


def test_blocks_that_missed_a_stamp_are_left_out():
    s = _launch(1e9, 1000, 1000, [2000, 2000], 1000)
    s[1, 3] = 0  # block 1 never reached its chunk loop's end stamp
    rows = tl.launch_rows(s[None], np.array([O], dtype=np.int32))
    assert rows[0]["stamped_blocks"] == 1
    assert tl.launch_rows(np.zeros((1, tl.BLOCKS, tl.POINTS), np.uint64), np.array([O], np.int32)) == []


def test_blocks_sharing_an_sm_are_told_from_blocks_alone():
    s = _launch(1e9, 1000, 1000, [3000, 3000, 2000], 1000)
    s[:3, 5] = [7, 7, 9]  # blocks 0 and 1 on SM 7, block 2 alone on SM 9
    row = tl.launch_rows(s[None], np.array([O], dtype=np.int32))[0]
    assert (row["sms_shared"], row["sms_alone"]) == (1, 1)
    assert row["stream_shared_us"] == pytest.approx(3.0) and row["stream_alone_us"] == pytest.approx(2.0)
    assert tl.summarize([row])["o"]["stream_alone_us"] == pytest.approx(2.0)


def test_the_slowest_blocks_are_found_and_placed():
    """Ten blocks, two SMs shared: block 9 streams longest and starts its chunks 5 us late on an SM of its own."""
    base = 1_000_000_000
    stream = [4000] * 9 + [9000]
    s = _launch(base, 500, 1000, stream, 800)
    s[9, 2:5] += 5000  # its input staged 5 us later than the others
    s[:10, 5] = [0, 0, 1, 1, 2, 3, 4, 5, 6, 7]  # blocks 0-3 pair up on SMs 0 and 1
    rows = tl.launch_rows(np.stack([_launch(base - 50_000, 500, 1000, [4000] * 4, 800), s]),
                          np.array([QKV, [10, *O[1:]]], dtype=np.int32))
    o = rows[1]
    assert o["slow_late_us"] == pytest.approx(5.0 + 0.9 - 0.45)  # stage end 5 us late (+ 100 ns per block index)
    assert o["slow_shared_frac"] == 0.0 and o["slow_index_frac"] == pytest.approx(0.9)
    assert o["step_us"] == pytest.approx(o["end_us"] - rows[0]["end_us"])
    summary = tl.summarize(rows)
    assert summary["o"]["step_us"] == pytest.approx(o["step_us"]) and summary["q/k/v"]["step_us"] is None


def test_kept_stamps_are_analysed_without_a_gpu(tmp_path, monkeypatch, capsys):
    """--raw's .npz read back with --from-raw: the same tables and JSON, no library or GPU needed."""
    import json

    base = 1_000_000_000
    stamps = np.stack([_launch(base, 1000, 2000, [5000, 6000, 7000, 9000], 1500),
                       _launch(base + 30_000, 500, 1000, [4000, 4000, 4000, 4000], 800)])
    raw = tmp_path / "t.npz"
    np.savez_compressed(raw, stamps=stamps, meta=np.array([QKV, O], dtype=np.int32))
    out = tmp_path / "t.json"
    monkeypatch.setattr("sys.argv", ["gemv_timeline.py", "--from-raw", str(raw), "--json", str(out)])
    assert tl.main() == 0
    assert "2 GEMV launches stamped" in capsys.readouterr().out
    assert json.loads(out.read_text())["summary"]["o"]["stream_us"] == pytest.approx(4.0)


def test_launches_bound_by_their_sms_are_listed():
    """Blocks that share an SM streaming 1.5x as long as a block alone flag the launch; 1.1x does not."""
    slow = _launch(1e9, 1000, 1000, [3000, 3000, 2000], 1000)
    fast = _launch(2e9, 1000, 1000, [2200, 2200, 2000], 1000)
    for s in (slow, fast):
        s[:3, 5] = [7, 7, 9]
    rows = tl.launch_rows(np.stack([slow, fast]), np.array([GATE_UP, GATE_UP], dtype=np.int32))
    assert [i for i, _ in tl.sm_bound_launches(rows)] == [0]


def test_session49_stamps_name_the_mixed_width_gate_up():
    """BM4's kept stamps (8B decode step at 1k, H100; its graph replayed an empty context, found in session 50, which
    leaves the GEMVs' own streaming as it is): the SM-bound launches are the gate/up ones whose span items enter a
    3-bit run, and no 4-bit gate/up."""
    kept = np.load(Path(__file__).resolve().parents[2] / "docs/measurements/2026-12-07-session49-BM4-timeline.npz")
    rows = tl.launch_rows(kept["stamps"], kept["meta"])
    bound = [i for i, r in tl.sm_bound_launches(rows) if r["role"] == "gate/up"]
    assert {74, 82, 90, 98, 106, 114, 122} <= set(bound) and len(bound) <= 8
