"""A host misusing the hook API (docs/hooks.md) gets InvalidRequestError and the engine loses nothing: batches of
the wrong shape, ids that are not lists, a failing prefill call that had admitted requests, two threads at once,
a stale handle after unload. The real engine on CPU with a deliberately tiny KV cache (as test_engine_loop.py)."""

from __future__ import annotations

import threading

import pytest

from exl2_backend.errors import InvalidRequestError
from exl2_backend.plugin.manager import new_plugin_manager
from exl2_backend.plugin.types import EngineUnhealthy, SequenceRequest, StepBatch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = {"device": "cpu", "max_seq_len": 64, "cache_tokens": 128, "page_size": 16, "max_batch_size": 8,
            "max_chunk_size": 8}
PAGES = 8


@pytest.fixture(scope="module")
def backend(default_model_dir):
    pm = new_plugin_manager(builtin_fallback=True)
    handle = pm.hook.exl2_load(settings={"model_dir": str(default_model_dir), **SETTINGS})
    yield pm.hook, handle
    pm.hook.exl2_unload(handle=handle)


def _req(sid: str, n: int = 4, **kw) -> SequenceRequest:
    # 7 prompt tokens: one prefill call (chunks of 8) gives the first token
    return SequenceRequest(sid, prompt_ids=list(range(1, 8)), temperature=0.0, max_new_tokens=n, **kw)


def _assert_idle(handle) -> None:
    s = handle.stats()
    assert s["live_sequences"] == 0 and s["free_pages"] == PAGES and s["reserved_pages"] == 0, s
    handle.engine.assert_no_leaks()


def test_a_failing_prefill_call_leaves_nothing_admitted(backend):
    """Admission runs before the continuing ids are checked: when those are wrong the call raises, and the
    requests it had admitted are released (the host never learned of them; they held a page each)."""
    hook, h = backend
    for batch in (StepBatch(new=[_req("a")], seq_ids=["nope"]),  # unknown continuing id
                  StepBatch(new=[_req("a")], seq_ids=["a"])):  # one id both new and continuing
        with pytest.raises(InvalidRequestError):
            hook.exl2_prefill(handle=h, batch=batch)
        _assert_idle(h)
    events = hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("a")]))  # the retry is not a duplicate
    assert events[0].error is None
    hook.exl2_release(handle=h, seq_ids=["a"])
    _assert_idle(h)


@pytest.mark.parametrize("batch", [
    None,
    StepBatch(seq_ids="ab"),  # a bare string would be taken character by character
    StepBatch(new=[{"seq_id": "x", "prompt_ids": [1]}]),
    StepBatch(drafts={"a": [100.9]}),  # not a token id
    StepBatch(drafts={"a": [True]}),
    StepBatch(drafts={"a": None}),
])
def test_batches_of_the_wrong_shape_are_host_errors(backend, batch):
    hook, h = backend
    for call in (hook.exl2_prefill, hook.exl2_decode, hook.exl2_draft_verify):
        with pytest.raises(InvalidRequestError):
            call(handle=h, batch=batch)
    _assert_idle(h)


def test_release_takes_a_list_of_ids(backend):
    hook, h = backend
    hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("ab")]))
    for bad in ("ab", None, [1], ["ab", ""]):  # "" as StepBatch refuses it: no sequence has an empty id
        with pytest.raises(InvalidRequestError, match="list of non-empty sequence id strings"):
            hook.exl2_release(handle=h, seq_ids=bad)
    assert h.stats()["live_sequences"] == 1  # "ab" was not taken for "a" and "b"
    hook.exl2_release(handle=h, seq_ids=["ab"])
    _assert_idle(h)


def test_a_second_thread_gets_an_error_not_a_corrupted_step(backend):
    """Hooks are not thread-safe (one engine thread): a call while another runs raises at once instead of
    interleaving two steps of one engine (which once gave silently wrong tokens). Thread A's decode waits in
    its on_launched callback until thread B has tried."""
    hook, h = backend
    hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("s", 8)]))
    tried = threading.Event()
    seen: list[BaseException] = []

    def other_thread() -> None:
        try:
            hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["s"]))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            seen.append(exc)
        finally:
            tried.set()

    def on_launched() -> None:
        t = threading.Thread(target=other_thread)
        t.start()
        assert tried.wait(60)
        t.join(60)

    events = hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["s"], on_launched=on_launched))
    assert len(events) == 1 and len(events[0].token_ids) == 1
    assert len(seen) == 1 and isinstance(seen[0], InvalidRequestError) and "not thread-safe" in str(seen[0])
    hook.exl2_release(handle=h, seq_ids=["s"])
    _assert_idle(h)


def test_drafts_past_the_length_limit_count_as_not_proposed(backend):
    """With 3 tokens to go a 10-token draft is verified as 2 drafts (the engine never drafts past the limit):
    the final event's proposed / accepted counts are over those 2, not the 10 sent."""
    hook, h = backend
    want = list(hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("plain", 4)]))[0].token_ids)
    for _ in range(8):  # bounded: 3 more steps end it
        ev = hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["plain"]))[0]
        want += ev.token_ids
        if ev.finished:
            break
    assert len(want) == 4
    first = hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("spec", 4)]))[0]
    assert first.token_ids == want[:1]
    ev = hook.exl2_draft_verify(handle=h, batch=StepBatch(drafts={"spec": want[1:] + [7] * 7}))[0]
    assert ev.finished and ev.token_ids == want[1:]
    assert ev.timings.proposed_drafts == 2 and ev.timings.accepted_drafts == 2
    _assert_idle(h)


def test_a_stale_handle_after_unload_raises_engine_unhealthy(default_model_dir):
    """After exl2_unload every step and stats call raises EngineUnhealthy (latched); release has nothing left to
    free and returns no events."""
    pm = new_plugin_manager(builtin_fallback=True)
    h = pm.hook.exl2_load(settings={"model_dir": str(default_model_dir), **SETTINGS})
    pm.hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("a")]))
    assert pm.hook.exl2_unload(handle=h) is True
    for call in (pm.hook.exl2_prefill, pm.hook.exl2_decode, pm.hook.exl2_draft_verify):
        for batch in (StepBatch(), StepBatch(seq_ids=["a"])):
            with pytest.raises(EngineUnhealthy, match="unloaded"):
                call(handle=h, batch=batch)
    with pytest.raises(EngineUnhealthy):
        pm.hook.exl2_stats(handle=h)
    assert pm.hook.exl2_release(handle=h, seq_ids=["a"]) == []


def test_logprobs_ride_on_the_events(backend):
    """SequenceRequest.logprobs / prompt_logprobs (hook API 1.3): every event's tokens come with one entry each
    (the keys of runtime/logprobs.logprob_entries), n alternatives, greedy's token the most likely, and the
    prompt's entries on the event that completes it; without them, None."""
    hook, h = backend
    lp, no = hook.exl2_prefill(handle=h, batch=StepBatch(new=[_req("lp", 3, logprobs=2, prompt_logprobs=1),
                                                               _req("no", 2)]))
    assert no.token_ids and no.logprobs is None and no.prompt_logprobs is None
    prompt = lp.prompt_logprobs  # one entry per prompt token, the first without a logprob
    assert [x["token_id"] for x in prompt] == list(range(1, 8))
    assert prompt[0]["logprob"] is None and prompt[0]["top_logprobs"] is None
    assert all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 1 for x in prompt[1:])
    hook.exl2_release(handle=h, seq_ids=["no"])
    events = [lp]
    for _ in range(3):  # bounded: 3 tokens in all
        if events[-1].finished:
            break
        events += hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["lp"]))
    assert events[-1].finished
    assert sum(len(e.logprobs) for e in events) == sum(len(e.token_ids) for e in events) == 3
    for e in events:
        for token_id, x in zip(e.token_ids, e.logprobs):
            assert set(x) == {"token_id", "token", "logprob", "bytes", "top_logprobs"} and x["token_id"] == token_id
            assert len(x["top_logprobs"]) == 2 and x["top_logprobs"][0]["token_id"] == token_id
            assert x["bytes"] == list(x["token"].encode()) and x["logprob"] <= 0
    _assert_idle(h)


def test_grammar_requests_through_the_hooks(backend):
    """SequenceRequest.grammar (hook API 1.4): a choice grammar's output is one of its strings and ends when
    complete (ignore_eos notwithstanding); in the same batch, a regex that does not compile is an invalid_request
    event naming the field, and admits nothing."""
    hook, h = backend
    good = SequenceRequest("g", prompt_ids=list(range(1, 8)), temperature=0.0, max_new_tokens=20, ignore_eos=True,
                           grammar={"type": "choice", "value": ["yes", "no"]})
    bad = SequenceRequest("b", prompt_ids=list(range(1, 8)), grammar={"type": "regex", "value": "(unclosed"})
    g, b = hook.exl2_prefill(handle=h, batch=StepBatch(new=[good, bad]))
    assert b.finish_reason == "error" and b.error.reason == "invalid_request" and b.error.field == "grammar"
    assert "regex" in str(b.error)
    text, events = g.text, [g]
    for _ in range(20):  # bounded: "yes" / "no" are a token or two
        if events[-1].finished:
            break
        events += hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=["g"]))
        text += events[-1].text
    assert events[-1].finish_reason == "stop" and text in ("yes", "no")
    _assert_idle(h)


def test_logprob_bytes_are_each_tokens_own(backend):
    """Event.logprobs "bytes": a byte-level token that holds part of a UTF-8 character carries those bytes (its
    "token" text shows U+FFFD), so the prompt's entries join into the prompt's exact UTF-8."""
    hook, h = backend
    text = "日本 🙂 é"
    tok = h.engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    req = SequenceRequest("u", prompt_ids=ids, temperature=0.0, max_new_tokens=1, prompt_logprobs=0)
    ev = hook.exl2_prefill(handle=h, batch=StepBatch(new=[req]))[0]
    entries = ev.prompt_logprobs
    assert [e["token_id"] for e in entries] == ids
    assert bytes(b for e in entries for b in e["bytes"]) == text.encode()
    assert any("\ufffd" in e["token"] for e in entries)  # the case this is about: a character split over tokens
    if not ev.finished:
        hook.exl2_release(handle=h, seq_ids=["u"])
    _assert_idle(h)
