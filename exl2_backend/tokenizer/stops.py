"""Stop strings over streamed text: emit what is safe, hold back what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas with `push`; it returns `(emit, hit)`.

    `emit` never contains a stop string nor any suffix that could be the start of one (that part is held
    until the next push proves otherwise). On a hit, `emit` ends right before the earliest stop string and
    everything after it is dropped; later pushes return `("", True)`. `flush()` releases the held text at
    the end of generation.
    """

    def __init__(self, stop_strings: list[str] | tuple[str, ...] | None = None):
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop_strings or ()) if s))
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the text, once one has

    @property
    def stopped(self) -> bool:
        return self.hit is not None

    def push(self, text: str) -> tuple[str, bool]:
        if self.hit is not None:
            return "", True
        buf = self._held + text
        if not self.stop_strings:
            self._held = ""
            return buf, False
        # Earliest stop string wins; at the same position the longer one (it covers the shorter).
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            at = buf.find(stop)
            if at >= 0 and (best is None or (at, -len(stop)) < (best[0], -best[1])):
                best = (at, len(stop), stop)
        if best is not None:
            self._held = ""
            self.hit = best[2]
            return buf[:best[0]], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back text (no stop string was completed); the matcher is empty afterwards."""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        return self._held
