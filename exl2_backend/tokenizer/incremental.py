"""Streaming detokenization: text deltas per generated token, never splitting a UTF-8 character.

Decoding one token at a time is wrong twice over: a byte-level token may hold half of a multi-byte character,
and SentencePiece/Metaspace decoders treat the first token of a decode call specially (they drop its leading
space). So each step decodes a short window instead: `ids[prefix:read]` was already emitted, `ids[prefix:]`
adds the new tokens, and the delta is the difference of the two texts. Both windows share the same first
token, so any first-token effect cancels. While the window's text ends in U+FFFD (an incomplete byte
sequence), nothing is emitted and the window grows until the character completes.
"""

from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """`push(token_id) -> delta`, `flush() -> rest`; the deltas concatenate to `decode(all_ids)`."""

    def __init__(self, backend: _HFTokenizer, *, skip_special_tokens: bool = True,
                 special_ids: frozenset[int] | set[int] = frozenset()):
        self._tok = backend
        self._skip = skip_special_tokens
        self._special = frozenset(special_ids)
        # Skipped specials are dropped here rather than by `decode`, so a window never consists of
        # skipped tokens only (which would hide the first-token effect from the prefix text).
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window (already emitted)
        self._read = 0  # end of what has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if self._skip and token_id in self._special:
            return ""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is still held (an incomplete character at the very end decodes to U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (skipped special tokens excluded)."""
        return list(self._ids)
