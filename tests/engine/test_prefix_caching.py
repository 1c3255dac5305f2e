"""Prefix caching through the engine (CPU reference path): a prompt whose prefix is cached starts its prefill at
the first uncached token, and what it samples is what a cold engine samples.

Bitwise logits: reusing cached KV is the same computation as a chunked prefill whose first chunk ends where the
reuse ends, so each comparison runs the engines with max_chunk_size at that split (the CPU GEMM's rounding
depends on the number of rows, so an unsplit prefill differs from a split one by ~1e-6: compared with a bound).
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import CapacityError
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.sampling import SamplingParams
from tests.engine.test_engine import make_engine, prompt, run, tiny_model

GREEDY = SamplingParams.greedy()
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class RecordingRunner(ModelRunner):
    """The engine's eager runner, keeping the logits of every forward and the tokens each one carried."""

    def __init__(self, engine):
        super().__init__(engine.model, engine.cache, engine.runner.max_pages_per_seq)
        self.logits: list[torch.Tensor] = []
        self.tokens_per_forward: list[int] = []
        engine.runner = self

    def run(self, tokens, starts, block_tables, logits="last"):
        out = super().run(tokens, starts, block_tables, logits)
        self.logits.append(out.clone())
        self.tokens_per_forward.append(sum(len(t) for t in tokens))
        return out


def two_requests(model, p1, p2, params, **kw):
    """p1 then p2 on one engine: -> (engine, logits of p2's first token, p2's tokens, p2's cached tokens)."""
    engine = make_engine(model, **kw)
    rec = RecordingRunner(engine)
    run(engine, ["a"], [p1], params)
    engine.add_sequence("b", p2, params)
    cached = engine.seqs["b"].cached_tokens
    n = len(rec.logits)
    out = []
    while not out:
        out = engine.prefill(["b"])[0].token_ids
    first = rec.logits[-1][0]
    assert len(rec.logits) > n
    while True:
        ev = engine.decode(["b"])[0]
        out += ev.token_ids
        if ev.finish_reason:
            break
    engine.release("b")
    engine.assert_no_leaks()
    return engine, first, out, cached


@pytest.mark.parametrize("split, p2_len", [(32, 45), (40, 45), (47, 48)])  # page-aligned, copy-on-write, full hit
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_reuse_is_bitwise_a_split_prefill(model, split, p2_len, params):
    base = prompt(48, seed=1)
    p1 = base
    p2 = base[:split] + prompt(p2_len - split, seed=2) if p2_len > split + 1 else base[:p2_len]
    gp = GenerationParams(sampling=params, max_new_tokens=8)
    warm, warm_logits, warm_out, cached = two_requests(model, p1, p2, gp, max_chunk_size=split)
    assert cached == split  # prefill started at the first uncached token
    cold, cold_logits, cold_out, cold_cached = two_requests(model, p1, p2, gp, max_chunk_size=split,
                                                           prefix_caching=False)
    assert cold_cached == 0
    assert torch.equal(warm_logits, cold_logits)
    assert warm_out == cold_out
    st = warm.stats()
    assert st["prefix_hit_tokens"] >= split and st["prefix_caching"] and not cold.stats()["prefix_caching"]
    assert st["prefix_cow_copies"] == (1 if split % 16 else 0)


def test_unsplit_prefill_same_tokens_close_logits(model):
    base = prompt(70, seed=3)
    p2 = base[:53] + prompt(9, seed=4)
    gp = GenerationParams(sampling=GREEDY, max_new_tokens=12)
    _, warm_logits, warm_out, cached = two_requests(model, base, p2, gp)
    _, cold_logits, cold_out, _ = two_requests(model, base, p2, gp, prefix_caching=False)
    assert cached == 53 and warm_out == cold_out
    torch.testing.assert_close(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)


def test_generated_tokens_are_cached_for_the_next_turn(model):
    """A finished sequence's output pages are cached too: the next turn (prompt + answer + more) reuses them."""
    engine = make_engine(model)
    p = prompt(20, seed=5)
    out = run(engine, ["t1"], [p], GenerationParams(sampling=GREEDY, max_new_tokens=30))["t1"]
    turn2 = p + out + prompt(5, seed=6)
    engine.add_sequence("t2", turn2, GenerationParams(sampling=GREEDY, max_new_tokens=2))
    computed = len(p) + len(out) - 1  # the last sampled token never ran
    assert engine.seqs["t2"].cached_tokens == computed // 16 * 16  # its full pages (partial ones are not indexed)
    engine.release("t2")
    engine.assert_no_leaks()


def test_concurrent_sharing_and_accounting(model):
    engine = make_engine(model, cache_tokens=256, max_seq_len=128)  # 16 pages of 16
    sys_prompt = prompt(64, seed=8)
    gp = GenerationParams(sampling=GREEDY, max_new_tokens=10)
    run(engine, ["warm"], [sys_prompt + [1]], gp)
    total = engine.stats()["total_pages"]
    assert engine.stats()["free_pages"] == total  # cached pages are unheld: free for admission
    ids = [f"u{i}" for i in range(4)]
    prompts = [sys_prompt + prompt(6, seed=20 + i) for i in range(4)]
    alone = {sid: run(make_engine(model, prefix_caching=False), [sid], [p], gp)[sid] for sid, p in zip(ids, prompts)}
    together = run(engine, ids, prompts, gp)  # 4 x 5 pages unshared > 16; shared: 4 + 4 x 1
    assert together == alone
    st = engine.stats()
    assert st["prefix_hits"] == 4 and st["prefix_hit_tokens"] == 4 * 64
    assert 0 < st["prefix_hit_rate"] < 1
    engine.assert_no_leaks()
    assert engine.flush_prefix_cache() > 0
    assert engine.pages.allocator.num_free == total and engine.stats()["prefix_cached_pages"] == 0


def test_eviction_makes_room_and_admission_counts_reuse(model):
    engine = make_engine(model, cache_tokens=128, max_seq_len=128)  # 8 pages of 16
    gp = GenerationParams(sampling=GREEDY, max_new_tokens=4)
    a = prompt(60, seed=9)
    run(engine, ["a"], [a], gp)  # 3 full pages cached (KV of 63 computed tokens)
    assert engine.stats()["prefix_cached_pages"] == 3 and engine.can_admit(128)
    # a 128-token sequence needs every page: the cached ones are evicted
    run(engine, ["big"], [prompt(120, seed=10)], GenerationParams(sampling=GREEDY, max_new_tokens=8))
    assert engine.stats()["prefix_evictions"] >= 3
    engine.assert_no_leaks()
    # while a holds its pages, an identical prompt costs only its unshared pages
    engine.flush_prefix_cache()
    engine.add_sequence("a1", a, GenerationParams(sampling=GREEDY, max_new_tokens=30))  # 90 tokens: 6 pages
    engine.prefill(["a1"])
    assert not engine.can_admit(128) and not engine.can_admit(80)
    assert engine.can_admit(80, a[:48] + [3])  # 3 pages shared with a1, 2 new: fits
    engine.add_sequence("a2", a[:48] + [3], GenerationParams(sampling=GREEDY, max_new_tokens=31))
    with pytest.raises(CapacityError):
        engine.add_sequence("a3", prompt(10, seed=11), GenerationParams(sampling=GREEDY, max_new_tokens=30))
    for sid in ("a1", "a2"):
        engine.release(sid)
    engine.assert_no_leaks()
    assert engine.stats()["free_pages"] == engine.stats()["total_pages"]


def test_failed_step_does_not_cache(model, monkeypatch):
    engine = make_engine(model)
    p = prompt(40, seed=12)
    engine.add_sequence("x", p, GenerationParams(sampling=GREEDY, max_new_tokens=20))
    engine.prefill(["x"])
    cached = engine.stats()["prefix_cached_pages"]  # prompt pages indexed right after their prefill
    assert cached == 2

    def boom(*a, **k):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "run", boom)
    assert engine.decode(["x"])[0].finish_reason == "error"
    engine.release("x")
    engine.assert_no_leaks()
    assert engine.stats()["prefix_cached_pages"] == cached  # nothing more was indexed from the failed run


def test_max_input_len_bounds_every_forward(model):
    engine = make_engine(model, max_input_len=24, max_chunk_size=2048)
    assert engine.settings.max_chunk_size == 24 and engine.settings.max_input_len == 24
    rec = RecordingRunner(engine)
    prompts = [prompt(n, seed=30 + i) for i, n in enumerate((10, 10, 10, 50))]
    ids = [f"m{i}" for i in range(4)]
    got = run(engine, ids, prompts, GenerationParams(sampling=GREEDY, max_new_tokens=3))
    assert max(rec.tokens_per_forward) <= 24
    ref = run(make_engine(model, prefix_caching=False), ids, prompts,
              GenerationParams(sampling=GREEDY, max_new_tokens=3))
    assert got == ref


def test_settings_defaults():
    s = LoadSettings()
    assert s.prefix_caching is True and s.max_input_len is None


@pytest.mark.slow
def test_default_model_chat_prefix_reuse(default_model_dir):
    """SmolLM2: a long shared system prompt; the second chat reuses it and answers exactly like a cold engine
    whose prefill is split at the same token (bitwise logits). (Unsplit vs split: the tiny-model test.)"""
    from exl2_backend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    system = ("You are a meticulous assistant for a shipping company. " * 8).strip()
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("Where is Paris?", "Name three colours.")]
    p1, p2 = (tok.encode_chat(c) for c in chats)
    shared = next(i for i, (x, y) in enumerate(zip(p1, p2)) if x != y)
    gp = GenerationParams(sampling=GREEDY, max_new_tokens=6)

    def second(**kw):
        engine = Engine.load(LoadSettings(model_dir=default_model_dir, device="cpu", max_seq_len=512,
                                          max_batch_size=2, page_size=16, **kw))
        rec = RecordingRunner(engine)
        run(engine, ["a"], [p1], gp)
        engine.add_sequence("b", p2, gp)
        cached = engine.seqs["b"].cached_tokens
        engine.release("b")
        out = run(engine, ["b"], [p2], gp)["b"]
        return engine, rec, cached, out

    warm, rec_w, cached, out_w = second(max_chunk_size=shared)
    _cold, rec_c, _, out_c = second(max_chunk_size=shared, prefix_caching=False)
    assert cached == shared and out_w == out_c
    assert torch.equal(rec_w.logits[-len(out_w)], rec_c.logits[-len(out_c)])
    assert warm.stats()["prefix_hit_rate"] > 0.3
    warm.assert_no_leaks()


def test_hooks_benefit_without_knowing(tmp_path):
    """A host driving the hooks gets the reuse for free: usage.cached_tokens, prefill_remaining, stats."""
    from exl2_backend.plugin import impl
    from exl2_backend.plugin.types import SequenceRequest, StepBatch
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    assert impl.exl2_capabilities()["prefix_caching"] is True
    model_dir = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict())
    handle = impl.exl2_load({"model_dir": str(model_dir), "device": "cpu", "page_size": 16, "max_seq_len": 256,
                             "cache_tokens": 1024, "max_chunk_size": 16})
    ids = prompt(59, seed=40)

    def generate(sid):
        req = SequenceRequest(seq_id=sid, prompt_ids=ids, max_new_tokens=3, temperature=0.0)
        ev = handle.prefill(StepBatch(new=[req]))[0]
        remaining = [ev.prefill_remaining]
        while not ev.token_ids:
            ev = handle.prefill(StepBatch(seq_ids=[sid]))[0]
            remaining.append(ev.prefill_remaining)
        tokens = list(ev.token_ids)
        while not ev.finished:
            ev = handle.decode(StepBatch(seq_ids=[sid]))[0]
            tokens += ev.token_ids
        return ev, tokens, remaining

    first, out1, rem1 = generate("a")
    second, out2, rem2 = generate("b")  # a's 3 full pages (48 tokens) are cached: 11 tokens left to run
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 48
    assert rem1 == [43, 27, 11, 0] and rem2 == [0]  # chunks of 16; b needs one chunk of 11
    assert out1 == out2
    st = handle.stats()
    assert st["prefix_hit_tokens"] == 48 and st["prefix_lookups"] == 2
    handle.engine.assert_no_leaks()
    handle.unload()
