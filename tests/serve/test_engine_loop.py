"""The engine loop over the hooks, in-process with the real engine and a deliberately tiny KV cache: requests
that do not fit wait for pages (they are not refused), waiting too long ends in a "no_capacity" refusal, a
cancelled request frees its pages, and a full queue raises QueueFull."""

from __future__ import annotations

import asyncio
import time

import pytest

from exl2_backend.plugin.manager import new_plugin_manager
from exl2_backend.plugin.types import AdmissionRejected, SequenceRequest
from exl2_backend.serve.engine_loop import EngineLoop, QueueFull

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = 16
PAGES = 8


@pytest.fixture(scope="module")
def backend(default_model_dir):
    pm = new_plugin_manager(builtin_fallback=True)
    # 8 pages of 16 tokens; a sequence reserves ceil((4 prompt + max_new_tokens) / 16) pages at admission
    handle = pm.hook.exl2_load(settings={"model_dir": str(default_model_dir), "device": "cpu", "max_seq_len": 64,
                                         "cache_tokens": PAGES * PAGE, "page_size": PAGE, "max_batch_size": 8,
                                         "max_chunk_size": 8})  # prompts longer than 8 tokens prefill in chunks
    yield pm, handle
    pm.hook.exl2_unload(handle=handle)


def _req(sid, handle, n):
    return SequenceRequest(sid, prompt_ids=handle.tokenize("Once upon a time"), temperature=0.0,
                           max_new_tokens=n, ignore_eos=True)


async def _drain(stream):
    events = [ev async for ev in stream]
    return events


def test_requests_wait_for_pages_then_run(backend):
    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=8, max_queue=8, queue_timeout_s=120).start()
    peak = 0

    async def main():
        nonlocal peak
        streams = [loop.submit(_req(f"w{i}", handle, 40)) for i in range(3)]  # 3 pages each: two fit
        tasks = [asyncio.ensure_future(_drain(s)) for s in streams]
        while not all(t.done() for t in tasks):
            peak = max(peak, loop.stats()["active_sequences"])
            await asyncio.sleep(0.01)
        return [t.result() for t in tasks]

    try:
        results = asyncio.run(main())
        for events in results:
            assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 40
            assert sum(len(e.token_ids) for e in events) == 40
        assert peak == 2, "only two sequences fit the cache at once"
        s = loop.stats()
        assert s["backend"]["free_pages"] == PAGES and s["active_sequences"] == 0 and s["queue_length"] == 0
        assert s["requests"]["length"] == 3 and not s["rejected"]
    finally:
        loop.stop()


def test_queue_timeout_cancel_and_queue_full(backend):
    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=2, max_queue=1, queue_timeout_s=1.0).start()

    async def main():
        a = loop.submit(_req("a", handle, 58))  # 4 pages each: a and b fill the cache and both batch slots
        b = loop.submit(_req("b", handle, 58))
        c = loop.submit(_req("c", handle, 4))  # waits in the queue (max_queue=1)
        with pytest.raises(QueueFull) as full:
            loop.submit(_req("d", handle, 4))
        assert full.value.retry_after >= 1
        await a.__anext__()  # a is running
        t0 = time.monotonic()
        c_events = await _drain(c)  # times out in the queue after ~1 s
        waited = time.monotonic() - t0
        a.cancel()
        b.cancel()
        a_events, b_events = await _drain(a), await _drain(b)
        return c_events, waited, a_events, b_events

    try:
        c_events, waited, a_events, b_events = asyncio.run(main())
        err = c_events[-1].error
        assert isinstance(err, AdmissionRejected) and err.reason == "no_capacity" and waited < 30
        assert a_events[-1].finish_reason == "cancelled" and b_events[-1].finish_reason == "cancelled"
        deadline = time.monotonic() + 30
        while loop.stats()["backend"]["free_pages"] != PAGES and time.monotonic() < deadline:
            time.sleep(0.05)
        s = loop.stats()
        assert s["backend"]["free_pages"] == PAGES and s["backend"]["free_tokens"] == PAGES * PAGE
        assert s["rejected"] == {"queue_full": 1, "queue_timeout": 1} and s["requests"]["cancelled"] == 2
        assert loop.healthy
    finally:
        loop.stop()


def test_chunked_prefill_interleaves_with_decoding(backend):
    """A 26-token prompt needs 4 prefill steps (chunks of 8) while a short sequence keeps decoding."""
    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=8, max_queue=8).start()
    long_ids = handle.tokenize("The quick brown fox jumps over the lazy dog. " * 3)[:26]
    assert len(long_ids) == 26

    async def main():
        short = loop.submit(_req("short", handle, 12))
        first = await short.__anext__()  # decoding has started
        long = loop.submit(SequenceRequest("long", prompt_ids=long_ids, temperature=0.0, max_new_tokens=4,
                                           ignore_eos=True))
        return [first] + await _drain(short), await _drain(long)

    try:
        before = loop.stats()["steps"].get("prefill", 0)
        short_events, long_events = asyncio.run(main())
        assert sum(len(e.token_ids) for e in short_events) == 12 and short_events[-1].finish_reason == "length"
        assert sum(len(e.token_ids) for e in long_events) == 4 and long_events[-1].usage.prompt_tokens == 26
        waiting = [e for e in long_events if not e.token_ids and not e.finished]
        assert len(waiting) == 3 and [e.prefill_remaining for e in waiting] == [18, 10, 2]
        assert loop.stats()["steps"]["prefill"] - before >= 5  # 1 for short + 4 chunks for long
    finally:
        loop.stop()


def test_cancel_that_overtakes_its_request(backend):
    """A cancel for an id the loop has not seen yet (it raced ahead of its request) still cancels it."""
    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=8, max_queue=8).start()

    async def main():
        loop.cancel("late")
        await asyncio.sleep(0.2)  # the loop has processed the cancel and found nothing
        return await _drain(loop.submit(_req("late", handle, 40)))

    try:
        events = asyncio.run(main())
        assert events[-1].finish_reason == "cancelled" and sum(len(e.token_ids) for e in events) < 40
    finally:
        loop.stop()


def test_a_request_whose_text_is_not_unicode_fails_alone(backend):
    """A prompt holding a lone surrogate (half an emoji cut by a client, "\\ud83d" in JSON) reaching the hooks from
    a host that does not check text: no tokenizer can encode it, so that request is refused (invalid_request,
    naming the character) and the loop stays healthy: the next request runs. It once killed the engine."""
    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=8, max_queue=8).start()

    async def main():
        bad = await _drain(loop.submit(SequenceRequest("bad", prompt="Hi \ud83d", max_new_tokens=4)))
        chat = await _drain(loop.submit(SequenceRequest(
            "bad-chat", messages=[{"role": "user", "content": "x\udc00"}], max_new_tokens=4)))
        good = await _drain(loop.submit(_req("good", handle, 4)))
        return bad, chat, good

    try:
        bad, chat, good = asyncio.run(main())
        for events, field in ((bad, "prompt"), (chat, "messages")):
            err = events[-1].error
            assert isinstance(err, AdmissionRejected) and err.reason == "invalid_request" and err.field == field
            assert "surrogate" in str(err)
        assert good[-1].finish_reason == "length" and sum(len(e.token_ids) for e in good) == 4
        assert loop.healthy and loop.stats()["backend"]["free_pages"] == PAGES
    finally:
        loop.stop()


def test_a_step_that_fails_fails_the_requests_it_was_admitting(backend):
    """A hook failure the loop cannot attribute to one request ends the loop (tier 3), and every request ends
    with an error event, including those taken off the queue for the failing step's admission, which are in
    neither the queue nor the running set at that moment (they used to wait forever)."""
    pm, handle = backend

    class PrefillFails:  # the real hooks, except that the prefill step raises
        def __getattr__(self, name):
            return getattr(pm.hook, name)

        def exl2_prefill(self, **kwargs):
            raise RuntimeError("injected prefill failure")

    loop = EngineLoop(PrefillFails(), handle, max_batch_size=8, max_queue=8).start()

    async def main():
        return await asyncio.wait_for(_drain(loop.submit(_req("x", handle, 4))), 60)

    try:
        events = asyncio.run(main())
        assert events[-1].finish_reason == "error" and "injected prefill failure" in str(events[-1].error)
        assert not loop.healthy
    finally:
        loop.stop()


def test_requests_open_at_shutdown_end_with_an_error_not_a_stop(backend):
    """Stopping the loop ends running and waiting requests with an error event (the server answers 503), not
    "cancelled", which the OpenAI surface reports as finish_reason "stop": a cut-off answer looked whole."""
    from exl2_backend.serve.engine_loop import LoopUnhealthy

    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=1, max_queue=4).start()

    async def main():
        running = loop.submit(_req("running", handle, 60))
        waiting = loop.submit(_req("waiting", handle, 4))  # one batch slot: it waits behind "running"
        first = await running.__anext__()
        await asyncio.to_thread(loop.stop)
        return [first] + await _drain(running), await _drain(waiting)

    try:
        running, waiting = asyncio.run(main())
        for events in (running, waiting):
            assert events[-1].finish_reason == "error" and isinstance(events[-1].error, LoopUnhealthy)
            assert "shutting down" in str(events[-1].error)
        assert sum(len(e.token_ids) for e in running) < 60
        assert handle.stats()["free_pages"] == PAGES  # released at shutdown
    finally:
        loop.stop()


def test_calls_run_on_the_engine_thread_between_steps(backend):
    """EngineLoop.call: a tokenizer question answered on the engine thread while a generation runs (which goes on
    undisturbed); an exception reaches the caller; after stop, a call is refused."""
    import threading

    from exl2_backend.serve.engine_loop import LoopUnhealthy

    pm, handle = backend
    loop = EngineLoop(pm.hook, handle, max_batch_size=8, max_queue=8, queue_timeout_s=120).start()

    async def main():
        task = asyncio.ensure_future(_drain(loop.submit(_req("g", handle, 20))))
        ids, thread = await loop.call(lambda h: (h.tokenize("Once upon a time"), threading.current_thread().name))
        with pytest.raises(ZeroDivisionError):
            await loop.call(lambda h: 1 / 0)
        return ids, thread, await task

    try:
        ids, thread, events = asyncio.run(main())
        assert ids == handle.tokenize("Once upon a time") and thread == "exl2-engine"
        assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 20
    finally:
        loop.stop()

    async def after_stop():
        with pytest.raises(LoopUnhealthy):
            loop.call(lambda h: None)

    asyncio.run(after_stop())
