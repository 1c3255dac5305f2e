"""Calibration text for the converter and held-out evaluation text, both available offline.

Default source: text that ships with every CPython install, so nothing is downloaded and nothing new is
installed.

- **Prose**: `pydoc_data.topics`, the English prose of the Python Language Reference and Library Reference
  (the text `help("TOPIC")` shows: execution model, data model, statements, string methods, the debugger,
  ...), about 465 k characters on CPython 3.11. Licence: Python documentation, PSF License Version 2
  (redistribution and derived works allowed, with the PSF copyright notice kept).
- **Code**: the Python source of a fixed list of standard-library modules (`CODE_MODULES`), each cut to
  `CODE_CHARS_PER_MODULE` characters. Licence: PSF License Version 2.
- **Legal English**: CPython's own `LICENSE.txt`, where the install carries it.

Held-out split: the reference-manual topics named in `EVAL_TOPICS` form the evaluation text
(`load_eval_text()`, about 95 k characters / 22 k tokens with SmolLM2's tokenizer); every other topic, the
code and the licence form the calibration set (`load_calibration_texts()`). Reference-manual topics repeat
paragraphs of one another (e.g. `compound` contains `if`, `while`, `try`), so any calibration paragraph
that also occurs in an evaluation topic is dropped: no paragraph of more than `MIN_SHARED_CHARS`
characters is shared between the two sets.

Both functions are deterministic for a given Python install. The text of `pydoc_data` changes a little
between CPython minor versions, so figures computed on it are comparable within one version (the
project's figures in docs/quantization.md were made on CPython 3.11.7).

Users' own calibration files (`--cal FILE`) replace the default: `.txt` (the whole file is one text),
`.jsonl` (one JSON object a line, its `"text"` field) or `.parquet` (the `text` column; needs pyarrow).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sysconfig
from pathlib import Path

from exl2_backend.errors import Exl2Error

# Reference-manual topics held out for evaluation (varied: semantics, import system, mini-language,
# tool documentation, comparison rules, exception handling, mappings).
EVAL_TOPICS = ("execmodel", "import", "formatstrings", "debugger", "comparisons", "try", "typesmapping")

# Standard-library modules whose source is the code share of the calibration set (pure Python, stable).
CODE_MODULES = (
    "textwrap", "heapq", "bisect", "fractions", "statistics", "shlex", "difflib", "calendar", "dataclasses",
    "string", "json.decoder", "json.encoder", "csv", "functools", "contextlib", "pprint", "colorsys",
    "graphlib", "argparse", "ipaddress", "configparser", "tokenize", "urllib.parse", "email.utils",
)
CODE_CHARS_PER_MODULE = 8_000
MIN_SHARED_CHARS = 60  # paragraphs shorter than this (a blank line, "}", a one-line example) may repeat

_WS = re.compile(r"\s+")


class CalibrationDataError(Exl2Error):
    """A calibration file could not be read (unknown type, missing field, missing pyarrow, empty)."""


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace-normalized, those of at least MIN_SHARED_CHARS."""
    out = []
    for p in re.split(r"\n\s*\n", text):
        p = _WS.sub(" ", p).strip()
        if len(p) >= MIN_SHARED_CHARS:
            out.append(p)
    return out


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def _eval_paragraphs() -> set[str]:
    topics = _topics()
    return {p for name in EVAL_TOPICS if name in topics for p in _paragraphs(topics[name])}


def _drop_shared(text: str, held_out: set[str]) -> str:
    """`text` without the paragraphs that also occur in the held-out set (layout of the rest kept)."""
    kept = [p for p in re.split(r"\n\s*\n", text) if _WS.sub(" ", p).strip() not in held_out]
    return "\n\n".join(kept).strip()


def _module_source(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec else None
    if not origin or not origin.endswith(".py") or not Path(origin).is_file():
        return None  # frozen, built-in or stripped install
    return Path(origin).read_text(encoding="utf-8", errors="replace")


def _cut(text: str, limit: int) -> str:
    """The first `limit` characters of `text`, ending at a line break."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > 0 else limit]


def default_calibration_sources() -> list[tuple[str, str]]:
    """The built-in calibration set as (source, text) pairs, interleaved so that any prefix mixes prose and
    code (about 3 prose texts per code text). Sources: "topic:NAME" (pydoc_data.topics), "module:NAME"
    (standard-library source), "LICENSE.txt"."""
    topics = _topics()
    held_out = _eval_paragraphs()
    prose = []
    for name in sorted(topics):
        if name in EVAL_TOPICS:
            continue
        text = _drop_shared(topics[name], held_out)
        if len(text) >= MIN_SHARED_CHARS:
            prose.append((f"topic:{name}", text))
    code = []
    for name in CODE_MODULES:
        src = _module_source(name)
        if src:
            code.append((f"module:{name}", _drop_shared(_cut(src, CODE_CHARS_PER_MODULE), held_out)))
    license_path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_path.is_file():
        code.append(("LICENSE.txt", _drop_shared(license_path.read_text(encoding="utf-8", errors="replace"),
                                                 held_out)))
    out: list[tuple[str, str]] = []
    step = max(1, round(len(prose) / max(1, len(code))))
    ci = 0
    for i, item in enumerate(prose):
        out.append(item)
        if (i + 1) % step == 0 and ci < len(code):
            out.append(code[ci])
            ci += 1
    out.extend(code[ci:])
    return [(name, text) for name, text in out if text.strip()]


def default_calibration_texts() -> list[str]:
    """The built-in calibration set (texts of `default_calibration_sources()`)."""
    return [text for _, text in default_calibration_sources()]


def _read_file(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if not path.is_file():
        raise CalibrationDataError(f"calibration file not found: {path}")
    if suffix in (".txt", ".md", ".text"):
        return [path.read_text(encoding="utf-8", errors="replace")]
    if suffix == ".jsonl":
        texts = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise CalibrationDataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationDataError(f"{path}:{n}: not JSON: {exc}") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise CalibrationDataError(f'{path}:{n}: expected an object with a string "text" field')
            texts.append(row["text"])
        return texts
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise CalibrationDataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise CalibrationDataError(f'{path}: no "text" column (columns: {table.column_names})')
        return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    raise CalibrationDataError(f"{path}: unsupported calibration file type {suffix!r} (.txt, .jsonl, .parquet)")


def load_calibration_texts(files: list[str] | None = None) -> list[str]:
    """Calibration texts: the users' `files` (in the given order) if any, else the built-in set.

    Returns non-empty texts of varied length (whole documents; the converter tokenizes and cuts them into
    rows, e.g. with `calibration_rows`)."""
    if files:
        texts = [t for f in files for t in _read_file(Path(f)) if t.strip()]
        if not texts:
            raise CalibrationDataError(f"no text in calibration files {list(files)}")
        return texts
    return default_calibration_texts()


def load_eval_text() -> str:
    """The held-out evaluation text: the `EVAL_TOPICS` reference-manual topics, in that order."""
    topics = _topics()
    return "\n\n".join(topics[name].strip() for name in EVAL_TOPICS if name in topics)


def calibration_rows(tokenizer, texts: list[str], rows: int, length: int):
    """int64 tensor [rows, length] of token ids cut from `texts` (joined by blank lines, tokenized once).

    Rows start at evenly spaced offsets across the whole token stream, so they sample every part of the
    text; if the stream is shorter than rows * length the rows overlap, if shorter than `length` it is
    repeated. Deterministic."""
    import torch

    if rows <= 0 or length <= 0:
        raise ValueError("rows and length must be positive")
    ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)
    if not ids:
        raise CalibrationDataError("calibration text tokenizes to nothing")
    stream = torch.tensor(ids, dtype=torch.int64)
    if stream.numel() < length:
        stream = stream.repeat(-(-length // stream.numel()))
    last = stream.numel() - length
    starts = [round(i * last / max(1, rows - 1)) for i in range(rows)] if rows > 1 else [0]
    return torch.stack([stream[s : s + length] for s in starts])
