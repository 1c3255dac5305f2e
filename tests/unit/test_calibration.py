"""Built-in calibration / evaluation text (offline, deterministic, held out) and users' calibration files."""

from __future__ import annotations

import json

import pytest

from exl2_backend.quant import calibration
from exl2_backend.quant.calibration import (
    CalibrationDataError,
    calibration_rows,
    load_calibration_texts,
    load_eval_text,
)


@pytest.fixture(scope="module")
def default_texts():
    return load_calibration_texts()


def test_default_calibration_is_varied_and_nonempty(default_texts):
    assert len(default_texts) >= 50
    assert all(isinstance(t, str) and t.strip() for t in default_texts)
    total = sum(len(t) for t in default_texts)
    assert total > 300_000
    sources = calibration.default_calibration_sources()
    assert [t for _, t in sources] == default_texts
    code = [t for name, t in sources if name.startswith("module:")]
    assert len(code) >= 10 and all("def " in t for t in code), "no source code in the calibration set"
    assert sum(name.startswith("topic:") for name, _ in sources) >= 50
    assert 0.15 < sum(len(t) for name, t in sources if not name.startswith("topic:")) / total < 0.6
    # interleaved: the first tenth already mixes prose and code
    head = [name for name, _ in sources[: len(sources) // 10]]
    assert any(n.startswith("module:") for n in head) and any(n.startswith("topic:") for n in head)


def test_deterministic(default_texts):
    assert load_calibration_texts() == default_texts
    assert load_calibration_texts(None) == default_texts
    assert load_eval_text() == load_eval_text()


def test_eval_text_is_held_out(default_texts):
    ev = load_eval_text()
    assert len(ev) > 50_000
    held = set(calibration._paragraphs(ev))
    assert len(held) > 100
    for t in default_texts:
        shared = held.intersection(calibration._paragraphs(t))
        assert not shared, f"calibration text shares a paragraph with the eval text: {next(iter(shared))[:80]!r}"
    # the eval topics' titles do not occur as calibration documents
    cal = "\n".join(default_texts)
    assert "Structure of a program" not in cal  # execmodel's first section


def test_user_files_override(tmp_path, default_texts):
    txt = tmp_path / "a.txt"
    txt.write_text("first file\nwith two lines\n", encoding="utf-8")
    jl = tmp_path / "b.jsonl"
    jl.write_text(json.dumps({"text": "row one"}) + "\n\n" + json.dumps({"text": "row two", "id": 3}) + "\n")
    assert load_calibration_texts([str(txt), str(jl)]) == ["first file\nwith two lines\n", "row one", "row two"]

    bad = tmp_path / "c.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(CalibrationDataError, match="text"):
        load_calibration_texts([str(bad)])
    csv = tmp_path / "d.csv"
    csv.write_text("x")
    with pytest.raises(CalibrationDataError, match="unsupported"):
        load_calibration_texts([str(csv)])
    with pytest.raises(CalibrationDataError, match="not found"):
        load_calibration_texts([str(tmp_path / "missing.txt")])
    empty = tmp_path / "e.txt"
    empty.write_text("  \n")
    with pytest.raises(CalibrationDataError, match="no text"):
        load_calibration_texts([str(empty)])


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "cal.parquet"
    pq.write_table(pa.table({"text": ["alpha", "beta"], "n": [1, 2]}), path)
    assert load_calibration_texts([str(path)]) == ["alpha", "beta"]


class _CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 251 for c in text]


def test_calibration_rows():
    texts = ["abcdefghij" * 10, "0123456789" * 10]
    rows = calibration_rows(_CharTokenizer(), texts, rows=4, length=16)
    assert rows.shape == (4, 16) and rows.dtype.is_floating_point is False
    stream = _CharTokenizer().encode("\n\n".join(texts))
    assert rows[0].tolist() == stream[:16] and rows[-1].tolist() == stream[-16:]
    assert calibration_rows(_CharTokenizer(), texts, 4, 16).equal(rows)
    short = calibration_rows(_CharTokenizer(), ["abc"], rows=2, length=8)
    assert short.shape == (2, 8)
