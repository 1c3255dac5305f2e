"""Checks of user text shared by the HTTP layer and the tokenizer (no dependencies)."""

from __future__ import annotations


def unicode_problem(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone surrogate, e.g. from JSON's "\\ud83d" or half of an emoji cut by a
    client: no tokenizer can encode it), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"character {exc.start} is a lone surrogate (U+{ord(text[exc.start]):04X}), not valid Unicode"
    return None
