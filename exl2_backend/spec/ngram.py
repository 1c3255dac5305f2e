"""N-gram (prompt-lookup) drafting: no draft model, proposals copied from earlier in the sequence.

Copy-heavy work (editing code, extraction, summaries that quote) repeats spans of the prompt. If the last n
tokens of a sequence occurred before, the tokens that followed that occurrence are a good guess for what
comes next. Each sequence keeps an index from n-gram to the end position of its latest earlier occurrence,
extended incrementally as tokens are committed, so a proposal costs O(max_n) dictionary lookups.
"""

from __future__ import annotations

from exl2_backend.spec.config import NgramConfig


class NgramIndex:
    """Latest occurrence of every n-gram (min_n <= n <= max_n) of one sequence's committed tokens."""

    def __init__(self, config: NgramConfig):
        self.min_n = config.min_n
        self.max_n = config.max_n
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its latest occurrence
        self._indexed = 0  # end positions [0, _indexed) are in the index

    def _extend(self, tokens: list[int], upto: int) -> None:
        """Index every n-gram ending at a position < upto."""
        for end in range(self._indexed, upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix of
        `tokens` (the whole committed sequence: prompt + output); [] when no suffix of >= min_n tokens
        occurred before. `tokens` only ever grows between calls."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        # Occurrences must end before the suffix itself (end <= length - 2) so a continuation exists.
        self._extend(tokens, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._last_end.get(tuple(tokens[length - n :]))
            if end is not None:
                # Copy what followed; past the end of `tokens` keep copying from the proposal itself, so a
                # repeating pattern (period length - 1 - end) continues for all k tokens.
                out: list[int] = []
                for j in range(end + 1, end + 1 + k):
                    out.append(tokens[j] if j < length else out[j - length])
                return out
        return []
