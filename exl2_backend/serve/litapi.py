"""`Exl2LitAPI`: the LitServe worker side. `setup` loads the model through the plugin hooks and starts the
engine loop thread; `predict` turns one request into a sequence and streams its events.

Why `enable_async=True` with an async-generator `predict` (LitServe's async StreamingLoop), and not
`ContinuousBatchingLoop`: with the async loop every request is its own asyncio task, so any number of
requests stream concurrently from one worker, while the batching itself happens in our engine loop thread
(engine_loop.py), which owns the step cadence, cancellation and admission control. ContinuousBatchingLoop
would call `add_request` and `step` from two threads, hand us raw requests, drop FINISH_STREAMING payloads and
has no queue timeout (host-integration.md §1.3); a sync streaming `predict` would serialise requests
(§1.3, verified). The OpenAI surface is our own spec (openai_spec.py) because LitServe's OpenAISpec drops
unknown sampler fields and always reports finish_reason "stop" (§1.6).

Wire format between the spec (API process) and predict (worker process): the spec puts a plain dict
`{"op": "generate", "request": {...SequenceRequest fields...}}` or a control dict (`{"op": "cancel",
"seq_id"}`, `{"op": "stats"}`, `{"op": "health"}`, `{"op": "model_info"}`, `{"op": "tokenize" | "detokenize", ...}`)
on LitServe's request queue; predict yields plain dicts
(strings, JSON lines): `{"text", "token_ids", "finish_reason"}` per step ("logprobs" too when the request
asked), plus "usage" and "timings" on the final one, or
`{"error": {"status", "message", "param", "code", "type", "retry_after"}}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import litserve as ls

from exl2_backend.errors import Exl2Error
from exl2_backend.plugin.types import AdmissionRejected, EngineUnhealthy, SequenceFailed, SequenceRequest
from exl2_backend.serve.engine_loop import EngineLoop, LoopUnhealthy, QueueFull, merge_events
from exl2_backend.serve.schemas import ServeSettings

log = logging.getLogger("exl2_backend.serve")


def error_dict(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error", retry_after: float | None = None) -> dict:
    return {"error": {"status": status, "message": message, "param": param, "code": code, "type": type_,
                      "retry_after": retry_after}}


def error_from_backend(err: Exception) -> dict:
    """Hook-API error (three tiers) -> HTTP status + OpenAI error fields."""
    if isinstance(err, AdmissionRejected):
        if err.reason == "no_capacity":
            return error_dict(503, str(err), code="no_capacity", type_="server_error",
                              retry_after=err.retry_after or 1.0)
        if err.reason == "prompt_too_long":
            return error_dict(400, str(err), param=err.field or "prompt", code="context_length_exceeded")
        return error_dict(400, str(err), param=err.field, code=err.reason)
    if isinstance(err, SequenceFailed):
        return error_dict(500, f"generation failed: {err}", code="sequence_failed", type_="server_error")
    if isinstance(err, (EngineUnhealthy, LoopUnhealthy)):
        return error_dict(503, f"the engine is unhealthy: {err}", code="engine_unhealthy", type_="server_error",
                          retry_after=5.0)
    if isinstance(err, QueueFull):
        return error_dict(503, str(err), code="queue_full", type_="server_error", retry_after=err.retry_after)
    return error_dict(500, f"{type(err).__name__}: {err}", type_="server_error")


def _encode_event(ev) -> str:
    """One event as the JSON line LitServe sends to the API server (strings pass its encoder unchanged).
    Usage and timings ride only on the final event: the spec reads them there, and per token they are
    work on the GIL the engine thread shares."""
    item = {"text": ev.text, "token_ids": ev.token_ids, "finish_reason": ev.finish_reason}
    if ev.logprobs is not None:
        item["logprobs"] = ev.logprobs
    if ev.prompt_logprobs is not None:
        item["prompt_logprobs"] = ev.prompt_logprobs
    if ev.finish_reason is not None:
        item["usage"] = ev.usage.to_dict()
        if ev.timings is not None:
            item["timings"] = ev.timings.to_dict()
    return json.dumps(item, separators=(",", ":")) + "\n"


async def _tokenizer_op(loop, op: str, x: dict) -> dict:
    """/tokenize and /detokenize, answered on the engine thread between steps (EngineLoop.call)."""
    try:
        if op == "tokenize":
            req = SequenceRequest(**x["request"])
            req.validate()
            add_special = x.get("add_special_tokens", True)

            def tokenize(h):
                if req.prompt is None:
                    ids = h.prompt_ids(req)
                else:  # a text sure to be longer than the context is refused before it is tokenized
                    ids = h.tokenize(req.prompt, add_special, limit=h.limits.max_seq_len)
                return {"tokens": ids, "count": len(ids), "max_model_len": h.limits.max_seq_len}

            return await loop.call(tokenize)
        tokens = list(x["tokens"])

        def detokenize(h):
            bad = next((t for t in tokens if not 0 <= t < h.limits.vocab_size), None)
            if bad is not None:
                return error_dict(400, f"token id {bad} is outside the vocabulary [0, {h.limits.vocab_size})",
                                  param="tokens")
            return {"prompt": h.detokenize(tokens)}

        return await loop.call(detokenize)
    except (AdmissionRejected, LoopUnhealthy) as exc:
        return error_from_backend(exc)
    except Exl2Error as exc:  # the tokenizer or chat template refused the text
        return error_dict(400, str(exc), param="messages" if op == "tokenize" else "tokens")


class Exl2LitAPI(ls.LitAPI):
    """One worker = one engine. Construct with a ServeSettings (or dict); nothing heavy happens before setup."""

    def __init__(self, settings: ServeSettings | dict | None = None, *, spec: ls.specs.base.LitSpec | None = None):
        from exl2_backend.serve.openai_spec import Exl2OpenAISpec

        self.serve_settings = (settings if isinstance(settings, ServeSettings)
                               else ServeSettings.model_validate(settings or {}))
        super().__init__(spec=spec if spec is not None else Exl2OpenAISpec(), enable_async=True, max_batch_size=1)
        self._engine_loop: EngineLoop | None = None
        self._model_defaults: dict = {}  # the model's sampling defaults (generation_config "auto"), set in setup

    # worker side ---------------------------------------------------------------------------------------

    def setup(self, device: str) -> None:
        from exl2_backend.plugin.manager import get_plugin_manager

        s = self.serve_settings
        pm = get_plugin_manager(builtin_fallback=True)
        load = s.load_settings()
        load.setdefault("model_id", served_model_id(s))
        if s.device == "auto" and isinstance(device, str) and device.startswith("cuda"):
            load["device"] = device  # LitServe assigned this worker a GPU
        handle = pm.hook.exl2_load(settings=load)
        if handle is None:
            raise RuntimeError(f"no installed backend accepted these load settings: {load}")
        if s.generation_config == "auto":  # what requests that leave sampling fields out get (vLLM's rule)
            self._model_defaults = handle.generation_defaults()
            if self._model_defaults:
                log.info("sampling defaults from the model's generation_config.json: %s", self._model_defaults)
        self._engine_loop = EngineLoop(pm.hook, handle, max_batch_size=s.max_batch_size, max_queue=s.max_queue,
                                       queue_timeout_s=s.queue_timeout_s,
                                       publish_on_launch=s.publish_on_launch).start()

    async def decode_request(self, request: Any) -> Any:
        return request

    async def predict(self, x: dict):
        op = x.get("op") if isinstance(x, dict) else None
        loop = self._engine_loop
        if op == "cancel":
            loop.cancel(str(x.get("seq_id")))
            yield {"ok": True}
            return
        if op == "stats":
            yield loop.stats()
            return
        if op == "health":
            yield {"healthy": loop.healthy, "fatal_error": loop.fatal_error}
            return
        if op in ("tokenize", "detokenize"):
            yield await _tokenizer_op(loop, op, x)
            return
        if op == "model_info":
            yield await self._model_info()
            return
        if op != "generate":
            yield error_dict(400, f"unknown operation {op!r}")
            return
        try:
            req = SequenceRequest(**x["request"])
            if req.logit_bias:  # a transport that went through JSON turned the ids into strings
                req.logit_bias = {int(k): v for k, v in req.logit_bias.items()}
            if req.max_new_tokens is None:  # the server's default, else the model's (generation_config.json)
                req.max_new_tokens = self.serve_settings.default_max_tokens or self._model_defaults.get(
                    "max_new_tokens")
            stream = loop.submit(req)
        except (AdmissionRejected, QueueFull, LoopUnhealthy) as exc:
            yield error_from_backend(exc)
            return
        except TypeError as exc:  # a field the request type does not know: a host bug, not a client error
            yield error_dict(500, f"bad request payload: {exc}", type_="server_error")
            return
        done = False
        try:
            async for ev in stream:
                ev = merge_events([ev] + stream.drain_nowait())  # catch up in one message if we fell behind
                if ev.error is not None:
                    done = True
                    yield error_from_backend(ev.error)
                    return
                done = ev.finished
                yield _encode_event(ev)
                if done:
                    return
        finally:
            if not done:
                stream.cancel()

    async def _model_info(self) -> dict:
        """What the API process needs of the model: its context, how it writes tool calls and whether it reasons
        in tags (the serve settings, or what its chat template says)."""
        name, reasoning = self.serve_settings.tool_call_format, self.serve_settings.reasoning_parser

        def info(h):
            return {"max_seq_len": h.limits.max_seq_len, "tool_call_format": h.tool_call_format(name),
                    "reasoning": h.reasoning_tags(reasoning), "generation_defaults": self._model_defaults}

        try:
            return await self._engine_loop.call(info)
        except (AdmissionRejected, LoopUnhealthy) as exc:
            return error_from_backend(exc)

    async def encode_response(self, output):
        async for item in output:
            yield item

    # both sides -----------------------------------------------------------------------------------------

    async def health(self) -> bool:
        if self._engine_loop is not None:  # inside the worker
            return self._engine_loop.healthy
        spec = self._spec
        if spec is None or getattr(spec, "request_queue", None) is None:
            return False
        try:
            reply = await spec.query_worker({"op": "health"}, timeout=10.0)
        except Exception:  # noqa: BLE001 - no answer = not healthy
            return False
        return bool(reply.get("healthy"))


def served_model_id(settings: ServeSettings) -> str:
    """The name clients pass as `model`: explicit, else the model directory's name, else the default's."""
    if settings.model_id:
        return settings.model_id
    if settings.model_dir:
        from pathlib import Path

        return Path(settings.model_dir).resolve().name
    from exl2_backend.plugin.impl import DEFAULT_MODEL_ID

    return DEFAULT_MODEL_ID
