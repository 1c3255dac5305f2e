"""KV page budget of the engine: free pages (plus evictable prefix-cache pages) minus what admitted
sequences were promised.

A sequence reserves, at admission, the pages its longest possible run needs; it allocates them lazily as it
grows and gives back pages of rolled-back positions to its reservation, so a running sequence never fails
for lack of pages and every exit returns both its pages and its reservation.

With prefix caching (cache/prefix.py) a sequence starts with the cached pages of its prompt's prefix,
shared, and reserves only the rest. Its admission costs the pages it will allocate plus the matched pages
that were evictable (sharing takes them out of the free space); matched pages other sequences already hold
cost nothing. Allocation evicts unheld cached pages when the free list runs short.
"""

from __future__ import annotations

import math
from collections import Counter

from exl2_backend.cache import PageAllocator
from exl2_backend.cache.prefix import NO_MATCH, PrefixCache, PrefixMatch
from exl2_backend.errors import CapacityError


class PageBudget:
    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = False, copy_pages=None):
        """copy_pages(src, dst): the KV cache's page copy, needed for copy-on-write with prefix caching."""
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved = 0  # pages promised to sequences, not yet allocated
        self.prefix = PrefixCache(self.allocator, page_size) if prefix_caching else None
        self._copy_pages = copy_pages

    @property
    def evictable(self) -> int:
        return self.prefix.num_evictable if self.prefix is not None else 0

    @property
    def unheld(self) -> int:
        """Pages no sequence holds: free, or cached and evictable."""
        return self.allocator.num_free + self.evictable

    @property
    def available(self) -> int:
        """Pages neither held nor promised (evictable cached pages count as available)."""
        return self.unheld - self.reserved

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def _allocate(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.allocator.allocate(n)

    # --- admission -------------------------------------------------------------------------------------

    def match(self, prompt: list[int]) -> PrefixMatch:
        """Cached prefix of a prompt; the last prompt token is never covered (it must run to give logits)."""
        if self.prefix is None:
            return NO_MATCH
        return self.prefix.match(prompt, len(prompt) - 1)

    def admission_cost(self, match: PrefixMatch, max_total: int) -> int:
        """Pages of `available` a sequence of up to max_total tokens takes when admitted with `match`."""
        live = sum(1 for p in match.pages if self.allocator.refcount(p) > 1)  # held by a sequence already
        return self.pages_for(max_total) - live

    def admit(self, seq, prompt: list[int], match: PrefixMatch, max_total: int) -> int:
        """Give seq its shared prefix pages and reserve the rest (call after admission_cost fits). A partial
        match is copied into a fresh page when one can be had without evicting the copy's source; else
        it is dropped. Returns the prompt tokens reused (where seq's prefill starts)."""
        seq.pages = self.prefix.acquire(match) if match.pages else []
        self.reserve(seq, self.pages_for(max_total) - len(seq.pages))
        reused = len(seq.pages) * self.page_size
        cow = False
        if match.cow_source is not None and self._copy_pages is not None and seq.reserved_pages > 0:
            src = match.cow_source
            self.prefix.pin(src)  # no eviction may take the source while its copy is made
            try:
                if self.unheld >= 1:  # a page for the copy that is not the source itself
                    page = self._allocate(1)[0]  # from seq's reservation
                    seq.pages.append(page)
                    seq.reserved_pages -= 1
                    self.reserved -= 1
                    self._copy_pages([src], [page])
                    reused += match.cow_tokens
                    cow = True
            finally:
                self.prefix.unpin(src)
        if self.prefix is not None:
            self.prefix.record(len(prompt), reused, cow)
        return reused

    def reserve(self, seq, num_pages: int) -> None:
        seq.reserved_pages += num_pages
        self.reserved += num_pages

    # --- growth ----------------------------------------------------------------------------------------

    def grow(self, seq, num_positions: int) -> None:
        """Make seq's block table cover positions [0, num_positions), drawing on its reservation first."""
        extra = self.pages_for(num_positions) - len(seq.pages)
        if extra <= 0:
            return
        from_reserve = min(extra, seq.reserved_pages)
        if extra - from_reserve > self.available:
            raise CapacityError("KV cache full while growing a sequence past its reservation")
        seq.pages += self._allocate(extra)
        seq.reserved_pages -= from_reserve
        self.reserved -= from_reserve

    def shrink(self, seq, num_positions: int) -> None:
        """Free pages past position `num_positions` (rejected drafts) back into seq's reservation. Those
        pages are past the computed tokens, so never cached or shared."""
        keep = self.pages_for(num_positions)
        extra = seq.pages[keep:]
        if extra:
            del seq.pages[keep:]
            self.allocator.free(extra)
            self.reserve(seq, len(extra))

    # --- prefix cache ----------------------------------------------------------------------------------

    def cache_prefix(self, seq) -> None:
        """Index seq's full pages whose KV is computed, so later prompts can share them."""
        if self.prefix is not None:
            self.prefix.register(seq, seq.tokens, seq.pages, seq.num_computed)

    def flush_prefix_cache(self) -> int:
        """Drop every cached page (held ones stay with their sequences); returns pages freed."""
        return self.prefix.clear() if self.prefix is not None else 0

    # --- exits -----------------------------------------------------------------------------------------

    def release(self, seq, cache: bool = True) -> None:
        """Return all of seq's pages and its reservation; with `cache`, its computed full pages (prompt and
        output) are indexed first and stay cached as evictable pages."""
        if self.prefix is not None:
            if cache:
                self.cache_prefix(seq)
            self.prefix.forget(seq)
        if seq.pages:
            pages, seq.pages = seq.pages, []
            self.allocator.free(pages)
            if self.prefix is not None:
                self.prefix.released(pages)
        self.reserved -= seq.reserved_pages
        seq.reserved_pages = 0

    def check(self, seqs) -> None:
        """Invariant: a page's refcount is the number of live sequences holding it (+1 when cached);
        every other page is free; reservations add up."""
        holders = Counter(p for s in seqs for p in s.pages)
        for s in seqs:
            assert len(set(s.pages)) == len(s.pages), f"sequence {s.seq_id} holds a page twice"
        cached = {p for p in range(self.num_pages) if self.prefix is not None and self.prefix.is_cached(p)}
        for p in range(self.num_pages):
            want = holders.get(p, 0) + (p in cached)
            assert self.allocator.refcount(p) == want, (
                f"KV page leak: page {p} has refcount {self.allocator.refcount(p)}, expected {want}")
        used = sum(1 for p in range(self.num_pages) if self.allocator.refcount(p) > 0)
        assert used + self.allocator.num_free == self.num_pages, "KV page leak: free list out of step"
        if self.prefix is not None:
            self.prefix.check(holders)
        assert self.reserved == sum(s.reserved_pages for s in seqs), "page reservation leak"

    def prefix_stats(self) -> dict:
        """Prefix-cache figures for Engine.stats() (zeros when prefix caching is off)."""
        p = self.prefix
        st = p.stats if p is not None else None
        return {
            "prefix_caching": p is not None,
            "prefix_cached_pages": p.num_cached if p is not None else 0,
            "prefix_evictable_pages": self.evictable,
            "prefix_lookups": st.lookups if st else 0,
            "prefix_hits": st.hits if st else 0,
            "prefix_lookup_tokens": st.lookup_tokens if st else 0,
            "prefix_hit_tokens": st.hit_tokens if st else 0,
            "prefix_hit_rate": st.hit_rate if st else 0.0,
            "prefix_cow_copies": st.cow_copies if st else 0,
            "prefix_evictions": st.evictions if st else 0,
        }
