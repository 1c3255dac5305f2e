"""A continuous-batching loop over the backend hooks, run by ONE engine thread (the engine is not thread-safe).

Requests arrive from any thread (usually an asyncio loop) through `submit`, wait in a bounded admission
queue, and join the running batch at a step boundary: each iteration of the engine thread
  1. releases cancelled sequences (client disconnects) through `exl2_release`,
  2. admits waiting requests while fewer than `max_batch_size` run, running the next prompt chunk of every
     sequence still prefilling (`exl2_prefill`); a request the engine cannot fit now ("no_capacity")
     goes back to the head of the queue until a running sequence finishes,
  3. decodes one token for every running sequence (`exl2_decode`),
  4. publishes each sequence's events to its own asyncio queue (one `call_soon_threadsafe` per asyncio loop
     per step) and forgets finished sequences (their pages are already free).
Nothing here reaches past the hooks (architecture decision 8).

Why step i's events are published from step i+1's `on_launched` callback (hook API 1.1): the asyncio side
(predict, LitServe's transport) shares this process's GIL with the engine thread. Woken at the end of step i
it would run exactly while this thread prepares step i+1, and every µs of it would delay the next launch.
Published once step i+1 is queued on the GPU, it runs while the GPU computes. Tokens wait only for the
next step's host-side preparation; a prefill's events (first tokens, refusals) and every event after which
no decode step follows are published at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from exl2_backend.plugin.types import (
    AdmissionRejected,
    EngineUnhealthy,
    Event,
    SequenceRequest,
    StepBatch,
)

log = logging.getLogger("exl2_backend.serve")

TOKENS_PER_S_WINDOW = 10.0  # seconds over which /metrics averages generated tokens per second
STATS_REFRESH_S = 0.25  # while busy, the backend's stats (/metrics) are refreshed at most this often


class QueueFull(Exception):
    """The admission queue is full: answer 503 with Retry-After."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class LoopUnhealthy(Exception):
    """The engine failed (tier 3) or the loop stopped: no new requests."""


@dataclass
class _Job:
    req: SequenceRequest
    sink: Stream
    t_submit: float
    prefilling: bool = True


class Stream:
    """The events of one request, as an async iterator (ends after the event with a finish_reason)."""

    def __init__(self, engine_loop: EngineLoop, seq_id: str, aio_loop: asyncio.AbstractEventLoop):
        self.seq_id = seq_id
        self._engine_loop = engine_loop
        self._aio_loop = aio_loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False

    def _put(self, ev: Event) -> None:  # on the asyncio loop
        self._queue.put_nowait(ev)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if ev.finished:
            self.finished = True
        return ev

    def drain_nowait(self) -> list[Event]:
        """Events already delivered (none if finished), without waiting."""
        out = []
        while not self.finished and not self._queue.empty():
            ev = self._queue.get_nowait()
            out.append(ev)
            if ev.finished:
                self.finished = True
        return out

    def cancel(self) -> None:
        """Stop generating; the pages are freed at the next step boundary. Safe to call twice."""
        if not self.finished:
            self._engine_loop.cancel(self.seq_id)


def merge_events(events: list[Event]) -> Event:
    """Several events of one sequence as one (text and tokens concatenated; the last one's status)."""
    if len(events) == 1:
        return events[0]
    last = events[-1]
    merged = Event(last.seq_id, [t for e in events for t in e.token_ids], "".join(e.text for e in events),
                   last.finish_reason, last.usage, last.timings, last.error, last.prefill_remaining,
                   None if all(e.accepted_drafts is None for e in events) else sum(e.accepted_drafts or 0
                                                                                   for e in events),
                   None if all(e.logprobs is None for e in events) else [x for e in events for x in e.logprobs or ()],
                   next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None))
    return merged


@dataclass
class _Counters:
    requests: collections.Counter = field(default_factory=collections.Counter)  # by outcome
    rejected: collections.Counter = field(default_factory=collections.Counter)  # by reason
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: collections.Counter = field(default_factory=collections.Counter)  # by kind
    step_seconds: collections.Counter = field(default_factory=collections.Counter)


class EngineLoop:
    """Drives one loaded backend handle through the hooks from a dedicated thread."""

    def __init__(self, hook, handle, *, max_batch_size: int = 16, max_queue: int = 64,
                 queue_timeout_s: float = 120.0, publish_on_launch: bool = True, name: str = "exl2-engine"):
        self.hook = hook  # pm.hook (a pluggy HookRelay)
        self.handle = handle
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.publish_on_launch = publish_on_launch  # False: publish at the end of each step (for comparison)
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._cancels: set[str] = set()
        self._calls: collections.deque = collections.deque()  # (fn, future, asyncio loop): run between steps
        self._early_cancels: dict[str, float] = {}  # cancels that arrived before their request (id -> time)
        self._active: dict[str, _Job] = {}  # engine thread only
        self._blocked = False  # engine thread: the head of the queue did not fit; wait for a finish
        # jobs taken off the queue for this step's prefill, not yet in _active (set under _cv; _die fails them too)
        self._admitting: list[_Job] = []
        self._stop = False
        self._fatal: str | None = None
        self._counters = _Counters()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._backend_stats: dict = {}
        self._stats_at = -1e9  # engine thread: when _backend_stats was last refreshed
        self._stats_stale = False  # engine thread: sequences came or went since then (pages moved)
        self._pending: list[tuple[Stream, Event]] = []  # engine thread: events waiting for the next launch
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- any thread --------------------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._refresh_backend_stats()
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._fatal is None and not self._stop and self._thread.is_alive()

    @property
    def fatal_error(self) -> str | None:
        return self._fatal

    def submit(self, req: SequenceRequest) -> Stream:
        """Queue a request (call from the asyncio loop that will read the stream). Raises QueueFull,
        LoopUnhealthy, or AdmissionRejected for a request that is malformed on its face."""
        req.validate()
        stream = Stream(self, req.seq_id, asyncio.get_running_loop())
        with self._cv:
            if not self.healthy:
                raise LoopUnhealthy(f"the engine is not serving: {self._fatal or 'stopped'}")
            free_slots = max(self.max_batch_size - len(self._active) - len(self._admitting), 0)  # join next step
            if len(self._waiting) >= self.max_queue + free_slots:
                self._counters.rejected["queue_full"] += 1
                raise QueueFull(f"no capacity: {len(self._active)} sequences are running (max_batch_size="
                                f"{self.max_batch_size}) and {len(self._waiting)} requests are waiting (max_queue="
                                f"{self.max_queue}); retry later", retry_after=self._retry_after())
            job = _Job(req, stream, time.monotonic())
            self._waiting.append(job)
            if self._early_cancels.pop(req.seq_id, None) is not None:
                self._cancels.add(req.seq_id)  # its cancel overtook it: drop it at the next step
            self._cv.notify_all()
        return stream

    def call(self, fn) -> asyncio.Future:
        """Run fn(handle) on the engine thread between steps (a handle serves one thread at a time): tokenizer
        questions. Call from an asyncio loop; its result, or its exception, arrives in the returned future."""
        aio = asyncio.get_running_loop()
        fut = aio.create_future()
        with self._cv:
            if not self.healthy:
                raise LoopUnhealthy(f"the engine is not serving: {self._fatal or 'stopped'}")
            self._calls.append((fn, fut, aio))
            self._cv.notify_all()
        return fut

    def cancel(self, seq_id: str) -> None:
        """Thread-safe: the sequence ends as "cancelled" and its pages are released at the next step."""
        with self._cv:
            self._cancels.add(seq_id)
            self._cv.notify_all()

    def stats(self) -> dict:
        """A snapshot for /metrics (thread-safe)."""
        with self._cv:
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW:
                self._recent.popleft()
            span = min(TOKENS_PER_S_WINDOW, max(now - self._t0, 1e-3))
            c = self._counters
            return {
                "healthy": self.healthy,
                "fatal_error": self._fatal,
                "queue_length": len(self._waiting),
                "active_sequences": len(self._active),
                "max_batch_size": self.max_batch_size,
                "max_queue": self.max_queue,
                "tokens_per_second": sum(n for _, n in self._recent) / span,
                "requests": dict(c.requests),
                "rejected": dict(c.rejected),
                "prompt_tokens_total": c.prompt_tokens,
                "generation_tokens_total": c.generation_tokens,
                "steps": dict(c.steps),
                "step_seconds": dict(c.step_seconds),
                "backend": dict(self._backend_stats),
            }

    def _retry_after(self) -> float:
        return 1.0 + len(self._waiting) / max(self.max_batch_size, 1)

    # --- engine thread -----------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._cancels or self._calls or self._active or (self._waiting and not self._blocked))

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    idle = not self._stop and not self._has_work()
                if idle:  # going idle: nothing may stay unpublished, and /metrics shows the final state
                    self._flush()
                    self._refresh_backend_stats()
                with self._cv:
                    while not self._stop and not self._has_work():
                        self._cv.wait(timeout=1.0)
                        self._expire_waiting(time.monotonic())
                    if self._stop:
                        break
                    cancels, self._cancels = self._cancels, set()
                    calls, self._calls = self._calls, collections.deque()
                self._run_calls(calls)
                try:
                    self._step(cancels)
                except EngineUnhealthy as exc:
                    self._die(str(exc))
                    break
                except Exception as exc:
                    log.exception("exl2_backend: engine loop step failed")
                    self._die(f"{type(exc).__name__}: {exc}")
                    break
        finally:
            self._shutdown()

    def _run_calls(self, calls) -> None:
        for fn, fut, aio in calls:
            try:
                result, error = fn(self.handle), None
            except Exception as exc:  # noqa: BLE001 - the caller's to handle
                result, error = None, exc
            _resolve_soon(aio, fut, result, error)

    def _flush(self) -> None:
        """Publish the events held for the next launch (engine thread; also the decode's on_launched)."""
        if self._pending:
            items, self._pending = self._pending, []
            self._deliver(items)

    def _deliver(self, items: list[tuple[Stream, Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Event]]] = {}
        for stream, ev in items:
            by_loop.setdefault(stream._aio_loop, []).append((stream, ev))
        for aio_loop, batch in by_loop.items():
            try:
                aio_loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that asyncio loop is closed: nobody is listening
                pass

    def _expire_waiting(self, now: float) -> None:
        """(lock held) Fail requests that waited longer than queue_timeout_s."""
        expired = [j for j in self._waiting if now - j.t_submit > self.queue_timeout_s]
        if not expired:
            return
        for j in expired:
            self._waiting.remove(j)
            self._counters.rejected["queue_timeout"] += 1
        err = [(j.sink, Event(j.req.seq_id, finish_reason="error", error=AdmissionRejected(
            f"no capacity: waited {self.queue_timeout_s:.0f} s for a free slot; retry later", reason="no_capacity",
            retry_after=self._retry_after(), seq_id=j.req.seq_id))) for j in expired]
        self._deliver(err)

    def _step(self, cancels: set[str]) -> None:
        out: list[tuple[Stream, Event]] = []
        now = time.monotonic()

        # 1. cancellations: waiting jobs just vanish; running ones are released through the hook
        if cancels:
            with self._cv:
                for j in [j for j in self._waiting if j.req.seq_id in cancels]:
                    self._waiting.remove(j)
                    out.append((j.sink, Event(j.req.seq_id, finish_reason="cancelled")))
                    self._counters.requests["cancelled"] += 1
            running = [sid for sid in cancels if sid in self._active]
            with self._cv:  # a cancel for an id not seen yet may have overtaken its request: remember it
                for sid in cancels - set(running) - {stream.seq_id for stream, _ in out}:
                    self._early_cancels[sid] = now
                for sid, t in list(self._early_cancels.items()):
                    if now - t > 60.0:
                        del self._early_cancels[sid]
            if running:
                self.hook.exl2_release(handle=self.handle, seq_ids=running)
                for sid in running:
                    job = self._active.pop(sid)
                    out.append((job.sink, Event(sid, finish_reason="cancelled")))
                    self._counters.requests["cancelled"] += 1
                self._blocked = False

        # 2. admission + prompt chunks
        with self._cv:
            self._expire_waiting(now)
            new: list[_Job] = []
            if not self._blocked:
                while self._waiting and len(self._active) + len(new) < self.max_batch_size:
                    new.append(self._waiting.popleft())
            self._admitting = new
        prefilling = [sid for sid, j in self._active.items() if j.prefilling]
        if new or prefilling:
            self._flush()  # an eager prompt chunk takes a while: do not hold the previous tokens through it
            t = time.perf_counter()
            events = self.hook.exl2_prefill(handle=self.handle, batch=StepBatch(seq_ids=prefilling,
                                                                               new=[j.req for j in new]))
            self._account("prefill", time.perf_counter() - t, events)
            jobs = {j.req.seq_id: j for j in new}
            requeue = []
            for ev in events:
                job = jobs.get(ev.seq_id) or self._active.get(ev.seq_id)
                if job is None:
                    continue
                rejected = isinstance(ev.error, AdmissionRejected)
                if rejected and ev.error.reason == "no_capacity" and (self._active or requeue):
                    requeue.append(job)  # not now: back to the head of the queue, in order
                    continue
                if rejected:
                    self._counters.rejected[ev.error.reason] += 1
                elif ev.seq_id in jobs:
                    self._active[ev.seq_id] = job
                    self._counters.prompt_tokens += ev.usage.prompt_tokens
                self._route(job, ev, out)
            with self._cv:
                if requeue:
                    self._blocked = True
                    self._waiting.extendleft(reversed(requeue))
                self._admitting = []
            self._deliver(out)  # first tokens and refusals now: holding them through a decode step adds to TTFT
            out = []

        # 3. one decode step for every sequence past its prompt
        decoding = [sid for sid, j in self._active.items() if not j.prefilling]
        launched = False
        if decoding:
            self._pending += out  # published as soon as this step is queued on the device
            out = []

            def on_launched() -> None:
                nonlocal launched
                launched = True
                self._flush()

            t = time.perf_counter()
            events = self.hook.exl2_decode(handle=self.handle, batch=StepBatch(
                seq_ids=decoding, on_launched=on_launched if self.publish_on_launch else None))
            self._account("decode", time.perf_counter() - t, events)
            self._flush()  # the backend did not call on_launched (or failed before launching)
            for ev in events:
                job = self._active.get(ev.seq_id)
                if job is not None:
                    self._route(job, ev, out)

        if cancels or new or self._stats_stale or time.monotonic() - self._stats_at >= STATS_REFRESH_S:
            self._refresh_backend_stats()
        if launched and any(not j.prefilling for j in self._active.values()):
            # another decode step follows at once: publish from its launch. (A backend that did not call
            # on_launched, e.g. one already keeping the next step in flight, gets its events published now.)
            self._pending += out
        else:
            self._flush()
            self._deliver(out)

    def _route(self, job: _Job, ev: Event, out: list) -> None:
        """Queue an event for its stream; drop finished sequences from the running set."""
        if ev.token_ids:
            job.prefilling = False
        out.append((job.sink, ev))
        if ev.finished:
            self._stats_stale = True
            if self._active.pop(ev.seq_id, None) is not None:
                self._blocked = False  # pages came free: the queue head may fit now
            self._counters.requests[ev.finish_reason if ev.error is None or ev.finish_reason != "error"
                                    else f"error_tier{ev.error.tier}"] += 1

    def _account(self, kind: str, seconds: float, events: list[Event]) -> None:
        n = sum(len(e.token_ids) for e in events)
        with self._cv:
            c = self._counters
            c.steps[kind] += 1
            c.step_seconds[kind] += seconds
            c.generation_tokens += n
            if n:
                self._recent.append((time.monotonic(), n))

    def _refresh_backend_stats(self) -> None:
        self._stats_at, self._stats_stale = time.monotonic(), False
        try:
            s = self.hook.exl2_stats(handle=self.handle) or {}
        except Exception:  # noqa: BLE001 - stats are best effort
            return
        with self._cv:
            self._backend_stats = s

    def _die(self, message: str) -> None:
        """Tier 3: fail everything, refuse new requests."""
        log.error("exl2_backend: the engine is unhealthy: %s", message)
        self._flush()
        with self._cv:
            self._fatal = message
            waiting = list(self._waiting)
            self._waiting.clear()
            # a step that failed during admission holds jobs in neither _active nor _waiting: they are failed
            # too, or their requests would wait forever
            admitting, self._admitting = self._admitting, []
        err = EngineUnhealthy(message)
        active = list(self._active.values())
        admitting = [j for j in admitting if self._active.get(j.req.seq_id) is not j]
        items = [(j.sink, Event(j.req.seq_id, finish_reason="error", error=err)) for j in active + admitting + waiting]
        self._active.clear()
        self._deliver(items)

    def _shutdown(self) -> None:
        # Requests still open end with an error (503, retry elsewhere), not "cancelled": the spec maps that to
        # finish_reason "stop", and a client would take a cut-off answer for a whole one.
        self._flush()
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
            calls, self._calls = self._calls, collections.deque()
        err = LoopUnhealthy("the server is shutting down; the request did not finish")
        for _, fut, aio in calls:
            _resolve_soon(aio, fut, None, err)

        def ended(sid: str) -> Event:
            return Event(sid, finish_reason="error", error=err)

        items = [(j.sink, ended(j.req.seq_id)) for j in waiting]
        if self._active:
            ids = list(self._active)
            try:
                self.hook.exl2_release(handle=self.handle, seq_ids=ids)
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                log.debug("exl2_backend: release at shutdown failed: %s", exc)
            items += [(self._active[sid].sink, ended(sid)) for sid in ids]
            self._active.clear()
        self._deliver(items)


def _resolve_soon(aio: asyncio.AbstractEventLoop, fut: asyncio.Future, result, error) -> None:
    """Settle an asyncio future from the engine thread (ignored when its caller gave up or its loop closed)."""

    def settle() -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    try:
        aio.call_soon_threadsafe(settle)
    except RuntimeError:  # that asyncio loop is closed
        pass


def _put_all(batch: list[tuple[Stream, Event]]) -> None:
    for stream, ev in batch:
        stream._put(ev)
