"""KV page budget of the engine: the allocator's free pages minus what admitted sequences were promised.

A sequence reserves, at admission, the pages its longest possible run needs; it allocates them lazily as it
grows and gives back pages of rolled-back positions to its reservation, so a running sequence never fails
for lack of pages and every exit returns both its pages and its reservation.
"""

from __future__ import annotations

import math

from exl2_backend.cache import PageAllocator
from exl2_backend.errors import CapacityError


class PageBudget:
    def __init__(self, num_pages: int, page_size: int):
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved = 0  # pages promised to sequences, not yet allocated

    @property
    def available(self) -> int:
        """Pages neither allocated nor promised."""
        return self.allocator.num_free - self.reserved

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def reserve(self, seq, num_pages: int) -> None:
        seq.reserved_pages += num_pages
        self.reserved += num_pages

    def grow(self, seq, num_positions: int) -> None:
        """Make seq's block table cover positions [0, num_positions), drawing on its reservation first."""
        extra = self.pages_for(num_positions) - len(seq.pages)
        if extra <= 0:
            return
        from_reserve = min(extra, seq.reserved_pages)
        if extra - from_reserve > self.available:
            raise CapacityError("KV cache full while growing a sequence past its reservation")
        seq.pages += self.allocator.allocate(extra)
        seq.reserved_pages -= from_reserve
        self.reserved -= from_reserve

    def shrink(self, seq, num_positions: int) -> None:
        """Free pages past position `num_positions` (rejected drafts) back into seq's reservation."""
        keep = self.pages_for(num_positions)
        extra = seq.pages[keep:]
        if extra:
            del seq.pages[keep:]
            self.allocator.free(extra)
            self.reserve(seq, len(extra))

    def release(self, seq) -> None:
        """Return all of seq's pages and its reservation."""
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []
        self.reserved -= seq.reserved_pages
        seq.reserved_pages = 0

    def check(self, seqs) -> None:
        """Invariant: every page is free or held by exactly one live sequence; reservations add up."""
        held = [p for s in seqs for p in s.pages]
        assert len(held) == len(set(held)), "a KV page is held by two sequences"
        assert len(held) + self.allocator.num_free == self.num_pages, (
            f"KV page leak: {self.num_pages - self.allocator.num_free - len(held)} pages unaccounted for")
        assert self.reserved == sum(s.reserved_pages for s in seqs), "page reservation leak"
