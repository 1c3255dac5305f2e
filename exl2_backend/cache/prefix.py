"""Prefix cache: full KV pages keyed by a chain hash of their tokens and every token before them.

Page i of a sequence has the key blake2b(key of page i-1 || tokens of page i) (page 0 chains from a fixed
root), so two sequences whose first k*S tokens agree have the same first k keys, whatever their lengths.
A new sequence whose prompt starts with cached pages shares them instead of recomputing their KV
(architecture decision 5).

Ownership, on top of `PageAllocator`'s refcounts: the cache holds one reference on every page it indexes and
each sequence holds one on each page of its block table. A cached page that no sequence holds (refcount 1)
is *evictable*: it keeps its KV for later hits, counts as free space for admission, and is dropped, least
recently released first, when an allocation needs the room. Only full, fully computed pages are indexed.
A match that ends inside a page (a prompt that diverges mid-page, or one whose every page is cached: the
last prompt token must still run to give logits) is served by copy-on-write: the matching tokens of the
cached page are copied into a fresh page of the new sequence, which then writes its own tokens there.

The cache moves page ids and refcounts only; what a page holds (FP16 or quantized KV) is the storage's
business (`copy_pages` of the KV cache object).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from exl2_backend.cache.paged import PageAllocator

ROOT = b"exl2-prefix-root"  # parent key of a sequence's first page
MAX_PARTIAL_CANDIDATES = 64  # cached continuations of one page compared token by token for a partial match


def page_key(parent: bytes, tokens) -> bytes:
    """128-bit chain key of one page: its parent's key and its token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class PrefixMatch:
    """What a prompt can reuse: `pages` (full cached pages, shared as its first pages) then, optionally,
    the first `cow_tokens` tokens of the cached page `cow_source`, copied into a private page.
    `num_tokens` = len(pages) * S + cow_tokens is where its prefill starts."""

    pages: tuple[int, ...] = ()
    cow_source: int | None = None
    cow_tokens: int = 0
    num_tokens: int = 0


NO_MATCH = PrefixMatch()


@dataclass
class PrefixStats:
    lookups: int = 0  # admitted sequences looked up
    hits: int = 0  # of which reused at least one token
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens reused instead of computed
    cow_copies: int = 0  # partial pages copied
    evictions: int = 0  # cached pages dropped to make room
    registered: int = 0  # pages indexed over the cache's life

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were reused."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PrefixCache:
    """Index of cached pages over a `PageAllocator` (see the module docstring for the ownership rules)."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._key_of: dict[int, bytes] = {}  # page -> key
        self._parent: dict[int, bytes] = {}  # page -> parent key
        self._tokens: dict[int, tuple[int, ...]] = {}  # page -> its S tokens (collision guard, partial matches)
        self._children: dict[bytes, dict[int, None]] = {}  # parent key -> cached pages (insertion order)
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently released first
        self._progress: dict[object, tuple[int, bytes]] = {}  # sequence -> (pages indexed so far, last key)
        self.stats = PrefixStats()

    # --- sizes -----------------------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        """Pages indexed (held by sequences or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Cached pages no sequence holds: reusable now, or free space when needed."""
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    # --- lookup ----------------------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int) -> PrefixMatch:
        """The longest cached prefix of `tokens`, at most `limit` tokens long (pure: changes nothing)."""
        s = self.page_size
        limit = max(0, min(limit, len(tokens)))
        parent, pages = ROOT, []
        while (len(pages) + 1) * s <= limit:
            lo = len(pages) * s
            chunk = tuple(tokens[lo : lo + s])
            key = page_key(parent, chunk)
            page = self._page_of.get(key)
            if page is None or self._tokens[page] != chunk:
                break
            pages.append(page)
            parent = key
        lo = len(pages) * s
        want = tokens[lo : min(lo + s, limit)]  # the tokens a partially matching page must start with
        source, best = None, 0
        if want:
            for page in list(self._children.get(parent, ()))[-MAX_PARTIAL_CANDIDATES:]:
                n = _common_prefix(self._tokens[page], want)
                if n > best:
                    source, best = page, n
        return PrefixMatch(tuple(pages), source, best, lo + best)

    def acquire(self, match: PrefixMatch) -> list[int]:
        """Share the matched full pages (one reference each, taken out of the evictable set)."""
        pages = list(match.pages)
        self.allocator.share(pages)
        for p in pages:
            self._lru.pop(p, None)
        return pages

    def pin(self, page: int) -> None:
        """Hold a cached page for a moment (the source of a copy-on-write) so no eviction takes it."""
        self.allocator.share([page])
        self._lru.pop(page, None)

    def unpin(self, page: int) -> None:
        self.allocator.free([page])
        self.released([page])

    def record(self, prompt_tokens: int, reused_tokens: int, cow: bool) -> None:
        st = self.stats
        st.lookups += 1
        st.lookup_tokens += prompt_tokens
        st.hit_tokens += reused_tokens
        st.hits += reused_tokens > 0
        st.cow_copies += cow

    # --- indexing --------------------------------------------------------------------------------------

    def register(self, seq, tokens: list[int], pages: list[int], num_computed: int) -> None:
        """Index seq's full pages whose KV is computed (tokens[:num_computed]); pages already indexed, or
        whose key another page already holds, are skipped. Incremental per sequence."""
        s = self.page_size
        done, parent = self._progress.get(seq, (0, ROOT))
        full = min(num_computed // s, len(pages))
        for i in range(done, full):
            page = pages[i]
            key = self._key_of.get(page)
            if key is None:
                chunk = tuple(tokens[i * s : (i + 1) * s])
                key = page_key(parent, chunk)
                if key not in self._page_of:
                    self._index(page, key, parent, chunk)
            parent = key
        if full > done:
            self._progress[seq] = (full, parent)

    def _index(self, page: int, key: bytes, parent: bytes, chunk: tuple[int, ...]) -> None:
        self.allocator.share([page])  # the cache's own reference
        self._page_of[key] = page
        self._key_of[page] = key
        self._parent[page] = parent
        self._tokens[page] = chunk
        self._children.setdefault(parent, {})[page] = None
        self.stats.registered += 1

    def _unindex(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        parent = self._parent.pop(page)
        del self._tokens[page]
        kids = self._children[parent]
        del kids[page]
        if not kids:
            del self._children[parent]
        self._lru.pop(page, None)
        self.allocator.free([page])

    def released(self, pages: list[int]) -> None:
        """Call after a holder dropped its references to `pages` (in block-table order): cached pages now
        held by no sequence become evictable. Deeper pages are queued first so they are evicted before
        the pages their keys chain from."""
        for p in reversed(pages):
            if p in self._key_of and self.allocator.refcount(p) == 1:
                self._lru[p] = None
                self._lru.move_to_end(p)

    def forget(self, seq) -> None:
        self._progress.pop(seq, None)

    # --- eviction --------------------------------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Drop up to n evictable pages (least recently released first) back to the allocator."""
        dropped = 0
        while dropped < n and self._lru:
            page = next(iter(self._lru))
            self._unindex(page)
            dropped += 1
        self.stats.evictions += dropped
        return dropped

    def clear(self) -> int:
        """Forget every cached page: evictable ones return to the free list, held ones stay with their
        sequences. Returns how many pages went back to the free list."""
        freed = self.evict(len(self._lru))
        for page in list(self._key_of):
            self._unindex(page)
        self._progress.clear()
        return freed

    # --- checks (tests) --------------------------------------------------------------------------------

    def check(self, holders: dict[int, int]) -> None:
        """Invariants given how many sequences hold each page: refcount = holders + 1 on cached pages;
        evictable = cached and unheld; the indexes agree with each other."""
        for page, key in self._key_of.items():
            held = holders.get(page, 0)
            assert self.allocator.refcount(page) == held + 1, f"cached page {page}: refcount mismatch"
            assert (page in self._lru) == (held == 0), f"cached page {page}: wrong evictable state"
            assert self._page_of[key] == page and page in self._children[self._parent[page]]
        assert all(p in self._key_of for p in self._lru), "evictable page that is not cached"
        assert len(self._page_of) == len(self._key_of) == len(self._tokens) == len(self._parent)
