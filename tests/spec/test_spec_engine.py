"""Speculative decoding through the engine on tiny synthetic EXL2 models (CPU): greedy output identical to
plain decoding (n-gram, draft model, both; batch 1 and batched), sampled output distributed as plain sampling
(chi-square), pages of both caches rolled back and returned, vocabulary and memory checks, adaptive k."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from exl2_backend.errors import ConfigError, InsufficientMemoryError, VocabMismatchError
from exl2_backend.format.config import ModelConfig
from exl2_backend.model import LlamaModel
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.model_runner import ModelRunner
from exl2_backend.sampling import SamplingParams
from exl2_backend.spec.memory import plan_draft
from tests.engine.test_engine import run
from tests.helpers.chi2 import two_sample
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

V = 32  # small vocabulary: token frequencies are testable with a few hundred samples
GREEDY = SamplingParams.greedy()
BASE = {"device": "cpu", "page_size": 16, "cache_tokens": 4096, "max_seq_len": 256, "max_batch_size": 32}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    cfg = tiny_config_dict(vocab_size=V, bos_token_id=30, eos_token_id=31)
    return {
        "target": write_tiny_exl2_model(root / "target", cfg, seed=0, head_bits=8),
        "draft": write_tiny_exl2_model(root / "draft", cfg, seed=0, head_bits=2),  # close to the target
        "bad": write_tiny_exl2_model(root / "bad", cfg, seed=5, head_bits=4),  # an unrelated model
        "cfg": cfg,
        "root": root,
    }


@pytest.fixture(scope="module")
def target(dirs):
    return LlamaModel.from_dir(dirs["target"], "cpu")


def engine(target, **kw) -> Engine:
    return Engine(target, None, LoadSettings(**{**BASE, **kw}))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of varied length with a repeated span (n-gram matches) and no EOS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        span = torch.randint(0, 30, (5 + 3 * i,), generator=g).tolist()
        out.append(span + torch.randint(0, 30, (2 + i,), generator=g).tolist() + span[:4])
    return out


MODES = {
    "ngram": {"ngram": {"min_n": 1, "max_n": 3}},
    "draft_model": {"draft_model": "draft"},
    "draft_model+ngram": {"draft_model": "draft", "ngram": True, "num_speculative_tokens": 3},
}


def _mode(dirs, name: str) -> dict:
    kw = dict(MODES[name])
    if "draft_model" in kw:
        kw["draft_model"] = dirs[kw["draft_model"]]
    return kw


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_identical_to_plain_decoding(dirs, target, mode, batch):
    ps = prompts(batch, seed=batch)
    ids = [f"s{i}" for i in range(batch)]
    params = GenerationParams(sampling=GREEDY, max_new_tokens=30, stop_token_ids=[7], ignore_eos=True)
    plain = run(engine(target), ids, ps, params)
    spec_engine = engine(target, **_mode(dirs, mode))
    spec = run(spec_engine, ids, ps, params)  # run() asserts no leaked pages in either cache
    assert spec == plain
    st = spec_engine.stats()
    assert st["spec_mode"] == mode
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]  # both paths: accept and roll back
    assert st["spec_tokens_per_step"] > 1.0
    assert st["free_pages"] == st["total_pages"]
    if spec_engine.spec.draft is not None:
        d = spec_engine.spec.draft
        assert not d.states and d.pages.allocator.num_free == d.pages.num_pages and d.pages.reserved == 0


def _draft_kv_is_committed(draft, seq, st) -> None:
    """The draft cache holds, at positions < st.num_computed, the K of the sequence's committed tokens (what a
    fresh prefill of them writes): never the K of a rejected or padded-over draft."""
    n = st.num_computed
    if n == 0:
        return
    fresh_pages = -(-n // 16)
    fresh = draft.model.make_cache(fresh_pages, 16)
    ModelRunner(draft.model, fresh, fresh_pages).run([seq.tokens[:n]], [0], [list(range(fresh_pages))])
    pos = torch.arange(n)
    pages = torch.tensor(st.pages)[pos // 16]
    for layer in range(draft.model.num_layers):
        got = draft.cache.k[layer][pages, pos % 16]  # [n, Hkv, D]
        want = fresh.k[layer][pos // 16, pos % 16]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (seq.seq_id, layer, n)


def test_rollback_keeps_both_caches_consistent_mid_run(dirs, target):
    """Step by step: after every speculative step each cache holds exactly the pages its computed tokens
    need, the draft's KV is that of committed tokens only (also when a proposal was clipped near the length
    limit and padded), and releasing sequences mid-run frees their pages in both caches."""
    e = engine(target, draft_model=dirs["draft"], ngram=True, num_speculative_tokens=6)
    ps = prompts(4, seed=3)
    for i, p in enumerate(ps):
        params = GenerationParams(sampling=SamplingParams(temperature=0.8, seed=i), max_new_tokens=14 + 9 * i)
        e.add_sequence(f"s{i}", p, params)
    while any(not ev.token_ids for ev in e.prefill([f"s{i}" for i in range(4)])):
        pass
    live = [f"s{i}" for i in range(4)]
    draft = e.spec.draft
    for step in range(14):
        if not live:
            break
        if step == 1:  # different k per sequence: short proposals are padded to the longest in the verify
            for sid, k in zip(live, (1, 3, 6, 2)):
                e.spec.seqs[sid].controller.k = k
        for ev in e.decode(live):
            if ev.finish_reason:
                live.remove(ev.seq_id)
        e.assert_no_leaks()
        for sid in live:
            seq, st = e.seqs[sid], draft.states.get(sid)
            assert len(seq.pages) == -(-seq.num_computed // 16)  # rejected positions' pages returned
            if st is not None:
                assert st.num_computed <= seq.num_tokens - 1
                assert len(st.pages) == -(-st.num_computed // 16)
                _draft_kv_is_committed(draft, seq, st)
        if step == 4 and len(live) > 1:
            gone = live.pop()
            e.release(gone)
            assert gone not in draft.states
    for sid in list(e.seqs):
        e.release(sid)
    e.assert_no_leaks()
    assert not draft.states and draft.pages.allocator.num_free == draft.pages.num_pages


def test_draft_rollback_keeps_only_the_committed_prefix(dirs, target):
    """The draft cached K for its own proposal x1..x(k-1); when the sequence committed x1 and then something
    else, only x1's K may stay (whatever the verify's padded drafts were)."""
    e = engine(target, draft_model=dirs["draft"])
    e.add_sequence("a", prompts(1, seed=5)[0], GenerationParams(sampling=GREEDY, max_new_tokens=40, ignore_eos=True))
    e.prefill(["a"])
    seq, draft = e.seqs["a"], e.spec.draft
    start = seq.num_tokens
    x = draft.propose([seq], 4)[0]["a"]
    st = draft.states["a"]
    assert st.num_computed == start + 3  # the last token, x1, x2, x3 were fed
    for t in (x[0], (x[1] + 1) % V, x[2]):  # committed: x1, then a token other than x2
        seq.append_token(t)
    draft.rollback(seq)
    assert st.num_computed == start + 1 and len(st.pages) == -(-(start + 1) // 16)
    _draft_kv_is_committed(draft, seq, st)
    e.release("a")
    e.assert_no_leaks()


def _token_counts(e, n: int, seed0: int, positions: int) -> list[torch.Tensor]:
    """Counts [V] of the tokens at output positions 0..positions-1 (0: the prefill's) over n seeded
    sequences sampled at temperature 0.7."""
    counts = [torch.zeros(V) for _ in range(positions)]
    p = prompts(1, seed=11)[0]
    for start in range(0, n, 32):
        ids = [f"q{seed0 + i}" for i in range(start, min(n, start + 32))]
        for sid in ids:
            params = GenerationParams(sampling=SamplingParams(temperature=0.7, seed=int(sid[1:])),
                                      max_new_tokens=positions, ignore_eos=True)
            e.add_sequence(sid, p, params)
        out = {ev.seq_id: list(ev.token_ids) for ev in e.prefill(ids)}
        live = [sid for sid in ids if len(out[sid]) < positions]
        while live:
            for ev in e.decode(live):
                out[ev.seq_id] += ev.token_ids
                if ev.finish_reason:
                    live.remove(ev.seq_id)
        for sid in ids:
            e.release(sid)
            for j in range(positions):
                counts[j][out[sid][j]] += 1
    e.assert_no_leaks()
    return counts


def test_sampled_speculation_keeps_the_distribution(dirs, target):
    """Draft-model proposals sampled from q and accepted by rejection sampling: the tokens' frequencies match
    plain sampling (chi-square). The draft is an unrelated model (total variation ~0.6 from the target), so
    outputs that followed the draft instead would fail the same test, as the check on its own samples shows."""
    n, positions = 320, 3
    plain = _token_counts(engine(target), n, 0, positions)
    spec_engine = engine(target, draft_model=dirs["bad"], num_speculative_tokens=2)
    spec = _token_counts(spec_engine, n, 100_000, positions)
    st = spec_engine.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
    for j in range(1, positions):  # position 0 comes from the prefill, before any speculation
        assert two_sample(plain[j], spec[j]) > 1e-3, f"position {j}"
    draft_alone = _token_counts(Engine(LlamaModel.from_dir(dirs["bad"], "cpu"), None, LoadSettings(**BASE)),
                                n, 200_000, 1)
    assert two_sample(plain[0], draft_alone[0]) < 1e-6


def test_seeded_speculative_sampling_is_reproducible(dirs, target):
    params = GenerationParams(sampling=SamplingParams(temperature=0.9, top_k=12, seed=42), max_new_tokens=40)
    ps = prompts(3, seed=7)
    ids = ["a", "b", "c"]
    runs = [run(engine(target, draft_model=dirs["draft"]), ids, ps, params) for _ in range(2)]
    assert runs[0] == runs[1]
    # n-gram proposals are deterministic and accepted by exact match: seeded output equals plain sampling's
    assert run(engine(target, ngram=True), ids, ps, params) == run(engine(target), ids, ps, params)


def test_vocabulary_mismatch_is_refused(dirs, target):
    other = write_tiny_exl2_model(dirs["root"] / "v48", tiny_config_dict(vocab_size=48), seed=0)
    with pytest.raises(VocabMismatchError, match="vocab_size 48") as exc:
        engine(target, draft_model=other)
    assert exc.value.field == "draft_model"

    # Same size, different token -> id mapping: the tokenizers disagree.
    cfg = tiny_config_dict()  # vocab 300: byte tokenizer written beside the weights
    a = write_tiny_exl2_model(dirs["root"] / "tok_a", cfg, seed=0)
    b = dirs["root"] / "tok_b"
    shutil.copytree(a, b)
    tok = json.loads((b / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (b / "tokenizer.json").write_text(json.dumps(tok))
    settings = LoadSettings(**{**BASE, "model_dir": a, "draft_model": b})
    with pytest.raises(VocabMismatchError, match="token id 0"):
        Engine.load(settings)
    e = Engine.load(settings.model_copy(update={"draft_model": a}))  # the same vocabulary loads
    assert e.spec.draft is not None


def test_draft_with_too_short_context_is_refused(dirs, target):
    short = write_tiny_exl2_model(dirs["root"] / "short", {**dirs["cfg"], "max_position_embeddings": 128}, seed=0)
    with pytest.raises(ConfigError, match="128 positions"):
        engine(target, draft_model=short)


def test_memory_plan_refuses_a_draft_that_does_not_fit(dirs):
    settings = LoadSettings(**{**BASE, "draft_model": dirs["draft"], "cache_tokens": 1 << 20})
    cfg = ModelConfig.from_dir(dirs["target"])
    with pytest.raises(InsufficientMemoryError, match="draft KV cache") as exc:
        plan_draft(settings, cfg, cfg, dirs["draft"], free_bytes=2 << 30)
    assert exc.value.field == "draft_model"
    plan_draft(settings.model_copy(update={"cache_tokens": 4096}), cfg, cfg, dirs["draft"], free_bytes=2 << 30)


def test_adaptive_k_moves_with_acceptance(dirs, target):
    params = GenerationParams(sampling=GREEDY, max_new_tokens=80, ignore_eos=True)
    p = prompts(1, seed=2)
    # Greedy tiny models fall into loops: n-gram drafts are then almost always right and free -> k rises.
    e = engine(target, ngram=True, adaptive_speculation=True, num_speculative_tokens=3)
    e.add_sequence("a", p[0], params)
    e.prefill(["a"])
    ks = []
    for _ in range(12):
        e.decode(["a"])
        ks.append(e.spec.seqs["a"].controller.k)
    assert max(ks) == 6 and ks[-1] > 3
    e.release("a")
    # An unrelated draft model is rarely right -> k falls (to 0: plain decoding, with a probe now and then).
    e = engine(target, draft_model=dirs["bad"], adaptive_speculation=True, num_speculative_tokens=3)
    plain = run(engine(target), ["a"], p, params)
    assert run(e, ["a"], p, params) == plain
    e.add_sequence("b", p[0], params)
    e.prefill(["b"])
    ks = []
    for _ in range(12):
        e.decode(["b"])
        ks.append(e.spec.seqs["b"].controller.k)
    assert ks[-1] < 3 and min(ks) <= 1
    e.release("b")
    e.assert_no_leaks()
