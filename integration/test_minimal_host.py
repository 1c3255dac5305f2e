"""The minimal host drives the real backend (found through its entry point only) and the default model:
continuous batching, admission refusals, cancellation, and host-supplied drafts through exl2_draft_verify
(greedy output identical to plain decoding; sampled output keeps the model's distribution)."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import minimal_host

from exl2_backend.plugin.types import AdmissionRejected, SequenceRequest, StepBatch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_SEQ_LEN = 512
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Count from one to ten.",
             "Write a haiku about the sea.", "What is 12 times 12?", "Describe a cat in one sentence."]


@pytest.fixture(scope="module")
def host():
    from exl2_backend.default_model import ensure_default_model

    default_model_dir = ensure_default_model()
    pm = minimal_host.discover()
    handle = pm.hook.exl2_load(settings={"model_dir": str(default_model_dir), "device": "cpu",
                                         "max_seq_len": MAX_SEQ_LEN, "cache_tokens": 16384, "max_batch_size": 64})
    yield pm, handle
    pm.hook.exl2_unload(handle=handle)


def _greedy(handle, i, q, n=16):
    return SequenceRequest(f"g{i}-{random.random()}", prompt_ids=handle.tokenize_chat([{"role": "user", "content": q}]),
                           temperature=0.0, max_new_tokens=n)


def _free(pm, handle):
    s = pm.hook.exl2_stats(handle=handle)
    return s["free_pages"], s["free_tokens"], s["running"]


def test_backend_comes_from_the_entry_point(host):
    pm, handle = host
    assert pm.get_plugin("exl2").__name__ == "exl2_backend.plugin.impl"
    assert [c["name"] for c in pm.hook.exl2_capabilities()] == ["exl2_backend"]
    assert handle.limits.max_seq_len == MAX_SEQ_LEN and handle.model_id


def test_continuous_batching_equals_one_at_a_time(host):
    pm, handle = host
    alone = [minimal_host.generate(pm, handle, [r])[r.seq_id]
             for r in [_greedy(handle, i, q, 8) for i, q in enumerate(QUESTIONS[:4])]]
    reqs = [_greedy(handle, i, q, 8) for i, q in enumerate(QUESTIONS[:4])]
    batched = minimal_host.generate(pm, handle, reqs, max_running=3)  # the 4th joins when a slot frees
    for a, r in zip(alone, reqs):
        b = batched[r.seq_id]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert _free(pm, handle)[2] == 0


def test_draft_verify_greedy_is_identical_to_decode(host):
    pm, handle = host
    reqs = [_greedy(handle, i, q, 24) for i, q in enumerate(QUESTIONS[:3])]
    plain = minimal_host.generate(pm, handle, reqs)
    rng = random.Random(0)
    vocab = handle.limits.vocab_size

    def perfect(tokens):  # the true continuation (looked up by prompt): every draft must be accepted
        for r in reqs:
            n = len(r.prompt_ids)
            if tokens[:n] == r.prompt_ids:
                done = len(tokens) - n
                return plain[r.seq_id].token_ids[done:done + 4]
        return []

    drafters = {"perfect": perfect, "random": lambda t: [rng.randrange(vocab) for _ in range(3)],
                "ngram": minimal_host.ngram_drafter(k=4, n=1)}
    for name, drafter in drafters.items():
        again = [SequenceRequest(f"{name}-{r.seq_id}", prompt_ids=r.prompt_ids, temperature=0.0, max_new_tokens=24)
                 for r in reqs]
        out = minimal_host.generate(pm, handle, again, drafter=drafter)
        for r, a in zip(reqs, again):
            got, want = out[a.seq_id], plain[r.seq_id]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), name
            assert got.proposed_drafts > 0 or name == "ngram"
        if name == "perfect":
            accepted = sum(o.accepted_drafts for o in out.values())
            generated = sum(len(o.token_ids) for o in out.values())
            assert accepted >= generated * 0.6, (accepted, generated)  # ~4 of every 5 tokens came from drafts
    assert _free(pm, handle)[2] == 0


def test_draft_verify_keeps_the_sampling_distribution(host):
    """Temperature-1 sampling of 3 tokens, N sequences per arm: arm A decodes, arm B verifies a fixed
    2-token draft first (accepted only when the model samples it), then decodes. Different seeds per arm;
    a chi-square two-sample test per position must not reject equality (p > 0.001), while it does reject a
    temperature-0.3 arm (the test can see a difference of that size). With the same seeds, this engine also
    reproduces the tokens themselves (its exact-match rule uses the same per-position uniforms as
    decoding)."""
    torch = pytest.importorskip("torch")
    pm, handle = host
    prompt = handle.tokenize("Once upon a time, in a land far away, there lived a")  # short: prefill is cheap
    g = minimal_host.generate(pm, handle, [SequenceRequest("greedy", prompt_ids=prompt, temperature=0.0,
                                                           max_new_tokens=3, ignore_eos=True)])["greedy"].token_ids
    n = 128

    def arm(tag, seeds, draft, temperature=1.0):
        out = []
        seeds = list(seeds)
        for i in range(0, len(seeds), handle.limits.max_batch_size):
            out += arm_chunk(tag, seeds[i:i + handle.limits.max_batch_size], draft, temperature)
        return out

    def arm_chunk(tag, seeds, draft, temperature):
        reqs = [SequenceRequest(f"{tag}{s}", prompt_ids=prompt, temperature=temperature, seed=s, max_new_tokens=3,
                                ignore_eos=True) for s in seeds]
        toks = {r.seq_id: [] for r in reqs}
        for ev in pm.hook.exl2_prefill(handle=handle, batch=StepBatch(new=reqs)):
            assert ev.error is None, ev.error
            toks[ev.seq_id] += ev.token_ids
        live = list(toks)
        if draft:
            for ev in pm.hook.exl2_draft_verify(handle=handle, batch=StepBatch(
                    seq_ids=live, drafts={sid: list(draft) for sid in live})):
                toks[ev.seq_id] += ev.token_ids
            live = [sid for sid in live if len(toks[sid]) < 3]
        while live:
            for ev in pm.hook.exl2_decode(handle=handle, batch=StepBatch(seq_ids=live)):
                toks[ev.seq_id] += ev.token_ids
            live = [sid for sid in live if len(toks[sid]) < 3]
        assert all(len(t) == 3 for t in toks.values())
        return [toks[r.seq_id] for r in reqs]

    plain = arm("a", range(n), None)
    verified = arm("b", range(10_000, 10_000 + n), g[1:3])
    same_seeds = arm("c", range(n), g[1:3])
    accepted = sum(t[1] == g[1] for t in verified)
    assert 0 < accepted < n, "the draft should be accepted sometimes and rejected sometimes"

    def chi2_p(xs, ys):
        cx, cy = Counter(xs), Counter(ys)
        keys = [k for k in set(cx) | set(cy) if cx[k] + cy[k] >= 10]
        rows = [(cx[k], cy[k]) for k in keys]
        rows.append((len(xs) - sum(r[0] for r in rows), len(ys) - sum(r[1] for r in rows)))  # pooled rest
        rows = [r for r in rows if sum(r) > 0]
        tot_x, tot_y = len(xs), len(ys)
        stat = 0.0
        for a, b in rows:
            for obs, tot in ((a, tot_x), (b, tot_y)):
                exp = (a + b) * tot / (tot_x + tot_y)
                stat += (obs - exp) ** 2 / exp
        dof = len(rows) - 1
        if dof < 1:
            return 1.0
        return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(stat / 2, dtype=torch.float64)))

    for pos in (1, 2):
        p = chi2_p([t[pos] for t in plain], [t[pos] for t in verified])
        assert p > 1e-3, f"token {pos + 1}: draft_verify changed the sampling distribution (p={p:.2g})"
    # the test has power: a truly different distribution (temperature 0.3) is rejected
    colder = arm("d", range(20_000, 20_000 + n), None, temperature=0.3)
    assert min(chi2_p([t[pos] for t in plain], [t[pos] for t in colder]) for pos in (0, 1, 2)) < 1e-3
    identical = sum(a == c for a, c in zip(plain, same_seeds))
    assert identical >= 0.9 * n, f"only {identical}/{n} seeded sequences reproduced under draft_verify"
    assert _free(pm, handle)[2] == 0


def test_admission_refusals_and_release(host):
    pm, handle = host
    start = _free(pm, handle)
    ev, = pm.hook.exl2_prefill(handle=handle, batch=StepBatch(new=[SequenceRequest(
        "long", prompt_ids=[1] * (MAX_SEQ_LEN + 10), max_new_tokens=4)]))
    assert isinstance(ev.error, AdmissionRejected) and ev.error.reason == "prompt_too_long"
    assert ev.error.limit == MAX_SEQ_LEN and f"max_seq_len={MAX_SEQ_LEN}" in str(ev.error)
    ev, = pm.hook.exl2_prefill(handle=handle, batch=StepBatch(new=[SequenceRequest("bad", prompt="hi", top_p=0.0)]))
    assert ev.error.reason == "invalid_request" and ev.error.field == "top_p"

    # fill the cache: each sequence reserves its whole context (2 pages of 256); the next one must wait
    prompt = handle.tokenize("Once upon a time")
    fill = [SequenceRequest(f"fill{i}", prompt_ids=prompt, max_new_tokens=None, temperature=0.0) for i in range(32)]
    events = pm.hook.exl2_prefill(handle=handle, batch=StepBatch(new=fill + [SequenceRequest(
        "fill0", prompt_ids=prompt), SequenceRequest("extra", prompt_ids=prompt)]))
    assert all(e.error is None and len(e.token_ids) == 1 for e in events[:32])
    assert events[32].error.reason == "duplicate_id"
    assert events[33].error.reason == "no_capacity" and events[33].error.retry_after > 0
    assert not handle.can_admit(len(prompt) + 1) and handle.free_tokens() == 0

    events = pm.hook.exl2_decode(handle=handle, batch=StepBatch(seq_ids=[r.seq_id for r in fill]))
    assert all(len(e.token_ids) == 1 and not e.finished for e in events)
    cancelled = pm.hook.exl2_release(handle=handle, seq_ids=[r.seq_id for r in fill] + ["never-seen"])
    assert [e.seq_id for e in cancelled] == [r.seq_id for r in fill]
    assert all(e.finish_reason == "cancelled" for e in cancelled)
    assert pm.hook.exl2_release(handle=handle, seq_ids=["fill0"]) == []  # idempotent
    assert _free(pm, handle) == start
