"""Prefix cache and page budget (cache/prefix.py, runtime/pages.py): chain keys, full-page sharing,
copy-on-write of a partially matching page, admission cost, LRU eviction, and page accounting that never
leaks (checked after every operation of a seeded random workload)."""

from __future__ import annotations

import random

import pytest
import torch

from exl2_backend.cache import PagedKVCache
from exl2_backend.cache.prefix import ROOT, page_key
from exl2_backend.errors import CapacityError
from exl2_backend.runtime.pages import PageBudget
from exl2_backend.runtime.params import GenerationParams
from exl2_backend.runtime.sequence import Sequence
from exl2_backend.tokenizer import StopMatcher

S = 16  # page size


class _Decoder:
    def push(self, token_id: int) -> str:
        return ""


def make_seq(sid: str, prompt: list[int], max_total: int) -> Sequence:
    return Sequence(sid, prompt, GenerationParams(max_new_tokens=max(1, max_total - len(prompt))),
                    max_total=max_total, vocab_size=1000, eos_ids=set(), decoder=_Decoder(),
                    stop_matcher=StopMatcher([]))


class Harness:
    """A PageBudget with prefix caching over a real (tiny) KV cache whose slots record the token written."""

    def __init__(self, num_pages: int = 16):
        self.cache = PagedKVCache(1, num_pages, S, 1, 2, torch.float32)
        self.budget = PageBudget(num_pages, S, prefix_caching=True, copy_pages=self.cache.copy_pages)
        self.seqs: dict[str, Sequence] = {}

    def admit(self, sid: str, prompt: list[int], max_total: int | None = None) -> Sequence:
        max_total = max_total or len(prompt) + 4
        match = self.budget.match(prompt)
        if self.budget.admission_cost(match, max_total) > self.budget.available:
            raise CapacityError("full")
        seq = make_seq(sid, prompt, max_total)
        seq.num_computed = self.budget.admit(seq, prompt, match, max_total)
        self.seqs[sid] = seq
        self.check()
        return seq

    def compute(self, seq: Sequence, n: int | None = None) -> None:
        """'Prefill' n more prompt tokens: write each token id into its slot (the stand-in for its KV)."""
        n = seq.prefill_remaining if n is None else n
        self.budget.grow(seq, seq.num_computed + n)
        for pos in range(seq.num_computed, seq.num_computed + n):
            self.cache.k[0][seq.pages[pos // S], pos % S] = float(seq.tokens[pos])
        seq.num_computed += n
        self.budget.cache_prefix(seq)
        self.check()

    def kv_tokens(self, seq: Sequence, upto: int) -> list[int]:
        return [int(self.cache.k[0][seq.pages[p // S], p % S, 0, 0]) for p in range(upto)]

    def release(self, seq: Sequence) -> None:
        self.budget.release(seq)
        del self.seqs[seq.seq_id]
        self.check()

    def check(self) -> None:
        self.budget.check(list(self.seqs.values()))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_page_key_chains_over_the_whole_prefix():
    a, b = tokens(S, 0), tokens(S, 1)
    assert page_key(ROOT, a) == page_key(ROOT, list(a))
    assert page_key(ROOT, a) != page_key(ROOT, b)
    assert page_key(page_key(ROOT, a), b) != page_key(page_key(ROOT, b), b)  # same page, other history


def test_full_pages_shared_and_kv_reused():
    h = Harness()
    base = tokens(50, 0)
    a = h.admit("a", base)
    h.compute(a)  # 50 computed: pages 0..2 full -> cached
    assert h.budget.prefix.num_cached == 3
    b = h.admit("b", base[:35] + tokens(10, 1))
    assert b.num_computed == 35  # 2 full pages, then 3 tokens of a's page 2 (copy-on-write)
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]  # shared, then a private copy
    h.compute(b)
    assert h.kv_tokens(b, 45) == b.prompt_ids
    assert h.budget.allocator.refcount(a.pages[0]) == 3  # a, b and the cache
    h.release(a)
    h.release(b)
    assert h.budget.unheld == h.budget.num_pages and h.budget.available == h.budget.num_pages


def test_partial_page_copy_on_write_and_full_hit_leaves_one_token():
    h = Harness()
    base = tokens(48, 2)
    a = h.admit("a", base)
    h.compute(a)
    h.release(a)  # 3 pages cached, all evictable
    assert h.budget.evictable == 3
    c = h.admit("c", base[:40] + tokens(5, 3))
    assert c.num_computed == 40 and h.budget.prefix.stats.cow_copies == 1
    src = h.budget.prefix._page_of[page_key(page_key(page_key(ROOT, base[:16]), base[16:32]), base[32:48])]
    assert c.pages[2] != src and h.budget.allocator.refcount(src) == 1  # the source stays cached, unheld
    assert h.kv_tokens(c, 40) == base[:40]  # copied KV of the partial page
    h.compute(c)
    assert h.kv_tokens(c, 45) == c.prompt_ids
    assert h.kv_tokens(c, 40) == base[:40]
    src_tokens = [int(h.cache.k[0][src, i, 0, 0]) for i in range(S)]
    assert src_tokens == base[32:48]  # writing the copy never touched the cached page
    d = h.admit("d", list(base))  # every page cached: the last token still runs, from a copy of page 2
    assert d.num_computed == 47 and d.prefill_remaining == 1
    h.compute(d)
    for s in list(h.seqs.values()):
        h.release(s)
    h.budget.flush_prefix_cache()
    h.check()
    assert h.budget.allocator.num_free == h.budget.num_pages


def test_admission_cost_counts_only_new_and_evictable_pages():
    h = Harness(num_pages=8)
    base = tokens(64, 4)
    a = h.admit("a", base[:40], max_total=48)  # 3 pages
    h.compute(a)  # pages 0, 1 cached (40 tokens: 2 full)
    m = h.budget.match(base[:40] + [7])
    assert len(m.pages) == 2
    assert h.budget.admission_cost(m, 48) == 3 - 2  # both matched pages are held by a: free to share
    h.release(a)
    m = h.budget.match(base[:40] + [7])
    assert h.budget.admission_cost(m, 48) == 3  # evictable pages stop counting as free once shared
    assert h.budget.available == 8


def test_lru_evicts_unheld_pages_deepest_first_and_never_held_ones():
    h = Harness(num_pages=6)
    x, y = tokens(48, 5), tokens(32, 6)
    a = h.admit("a", x, max_total=48)
    h.compute(a)
    h.release(a)  # x's 3 pages evictable
    b = h.admit("b", y, max_total=48)  # 3 pages: free list has 3
    h.compute(b)
    c = h.admit("c", tokens(40, 7), max_total=48)  # needs 3 more: only evictable pages are left
    h.compute(c)  # 3 pages: the free one, then x's pages 2 and 1 (deepest first)
    assert h.budget.prefix.stats.evictions == 2
    with pytest.raises(CapacityError):  # what is left is reserved by b, or cached for x's first page
        h.admit("d", tokens(20, 8), max_total=32)
    assert h.budget.match(x).num_tokens == 16
    assert h.budget.match(y[:32] + [1]).num_tokens == 32  # b's pages survived: held
    h.release(b)
    h.release(c)
    h.budget.flush_prefix_cache()
    assert h.budget.allocator.num_free == 6


def test_eviction_prefers_deeper_pages():
    h = Harness(num_pages=4)
    x = tokens(48, 9)
    a = h.admit("a", x, max_total=48)
    h.compute(a)
    h.release(a)
    b = h.admit("b", tokens(20, 10), max_total=32)  # 2 pages: 1 free + 1 evicted (x's last page)
    h.compute(b)
    assert h.budget.match(x).num_tokens == 32  # x's first two pages still hit
    h.release(b)


def test_cow_skipped_when_the_source_is_the_only_room():
    h = Harness(num_pages=3)
    x = tokens(48, 11)
    a = h.admit("a", x, max_total=48)
    h.compute(a)
    h.release(a)  # all 3 pages cached and evictable; none free
    c = h.admit("c", x[:40] + [5], max_total=48)  # shares 2, COW of page 2 would need a 4th page
    assert c.num_computed == 32
    h.compute(c)
    h.release(c)


def test_flush_keeps_held_pages_with_their_sequences():
    h = Harness()
    x = tokens(40, 12)
    a = h.admit("a", x)
    h.compute(a)
    b = h.admit("b", x[:33])
    assert b.num_computed == 32
    h.budget.flush_prefix_cache()
    h.check()
    assert h.budget.prefix.num_cached == 0 and h.budget.allocator.refcount(a.pages[0]) == 2
    h.release(a)
    h.release(b)
    h.budget.flush_prefix_cache()
    assert h.budget.allocator.num_free == h.budget.num_pages


def test_random_workload_never_leaks():
    rng = random.Random(0)
    h = Harness(num_pages=24)
    stems = [tokens(rng.randrange(10, 60), 100 + i) for i in range(4)]
    n = 0
    for _ in range(300):
        live = list(h.seqs.values())
        op = rng.random()
        if op < 0.4 or not live:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + tokens(rng.randrange(0, 20), rng.randrange(10**6))
            try:
                h.admit(f"s{n}", prompt, max_total=len(prompt) + rng.randrange(1, 30))
            except CapacityError:
                pass
            n += 1
        elif op < 0.75:
            s = rng.choice(live)
            if s.prefill_remaining:
                h.compute(s, rng.randrange(1, s.prefill_remaining + 1))
            elif s.num_tokens < s.max_total:  # 'decode' one token
                s.output_ids.append(rng.randrange(1, 1000))
                h.budget.grow(s, s.num_tokens)
                pos = s.num_computed
                h.cache.k[0][s.pages[pos // S], pos % S] = float(s.tokens[pos])
                s.num_computed += 1
                h.check()
        else:
            h.release(rng.choice(live))
        for s in h.seqs.values():  # every computed slot holds its own token, shared or copied
            assert h.kv_tokens(s, s.num_computed) == s.tokens[: s.num_computed]
    st = h.budget.prefix.stats
    assert st.hits > 0 and st.cow_copies > 0 and st.evictions > 0
    for s in list(h.seqs.values()):
        h.release(s)
    assert h.budget.unheld == h.budget.num_pages and h.budget.reserved == 0
    h.budget.flush_prefix_cache()
    assert h.budget.allocator.num_free == h.budget.num_pages
