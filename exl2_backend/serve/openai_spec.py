"""`Exl2OpenAISpec`: our OpenAI-compatible surface on LitServe (runs in the API server process).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (serve/responses_api.py; GET / DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items read stored ones, serve/response_store.py), the
Conversations API under /v1/conversations (serve/conversation_store.py), GET
/v1/models[/{id}], POST /tokenize and /detokenize, GET /metrics (Prometheus text). LitServe's own GET /health
calls `Exl2LitAPI.health`, which asks the worker through `query_worker`.

Each completion gets one id (`chatcmpl-…` / `cmpl-…`) that is also the engine's sequence id, so a client
disconnect can be turned into a `cancel` for exactly that sequence. Requests are validated here (400 naming
the field; unknown `model` -> 404 naming the served one); engine-side refusals (prompt longer than the
context -> 400 naming the limit, no capacity -> 503 with Retry-After) come back from the worker as the
first item of the stream, before any byte of the response is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem
from pydantic import ValidationError

from exl2_backend.serve.conversation_store import ConversationStore
from exl2_backend.serve.conversations_api import AddItems, CreateConversation, UpdateConversation, checked_items
from exl2_backend.serve.metrics import METRICS_CONTENT_TYPE, render_metrics
from exl2_backend.serve.openai_items import (
    add_usage,
    chat_logprobs,
    completion_logprobs,
    empty_usage,
    finish_reason,
    merge_items,
    mergeable,
)
from exl2_backend.serve.response_store import ResponseStore, input_items, item_page
from exl2_backend.serve.responses_api import (
    RequestFieldError,
    ResponsesRequest,
    new_id,
    response_from_chat,
    responses_param,
)
from exl2_backend.serve.responses_stream import response_events
from exl2_backend.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    first_error,
    lone_surrogate,
)
from exl2_backend.serve.tools import ToolCallStream, may_be_a_call, split_tool_calls
from exl2_backend.tokenizer.reasoning import ReasoningSplitter, ReasoningTags, split_reasoning
from exl2_backend.tokenizer.tool_formats import HERMES, ToolCallFormat, format_from_dict

log = logging.getLogger("exl2_backend.serve")

DISCONNECT_POLL_S = 0.5
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of a stream


class _Disconnected(Exception):
    pass


class _Watch:
    """Rate-limited `request.is_disconnected()` for handlers that wait on the worker (non-streaming, and
    streaming before the first byte). Streaming responses learn of a disconnect from Starlette instead."""

    def __init__(self, request: Request):
        self.request = request
        self.last = time.monotonic()

    async def check(self) -> None:
        now = time.monotonic()
        if now - self.last >= DISCONNECT_POLL_S:
            self.last = now
            if await self.request.is_disconnected():
                raise _Disconnected()


def _error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                    type_: str | None = None, retry_after: float | None = None) -> JSONResponse:
    type_ = type_ or ("invalid_request_error" if status < 500 else "server_error")
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _item_list(items: list[dict], order: str, limit: str, after: str | None, owner: str = "response") -> JSONResponse:
    """A page of stored items (item_page), its query parameters read here: a bad one is a 400 in the API's error
    shape, not FastAPI's 422."""
    if order not in ("asc", "desc"):
        return _error_response(400, f"order: must be asc or desc (got {order!r})", param="order")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        return _error_response(400, f"limit: must be an integer in 1..100 (got {limit!r})", param="limit")
    try:
        return JSONResponse(item_page(items, order=order, limit=int(limit), after=after, owner=owner))
    except ValueError as exc:
        return _error_response(400, str(exc), param="after")


def _no_conversation(conversation_id: str, status: int = 404, param: str = "conversation_id") -> JSONResponse:
    return _error_response(status, f"no conversation {conversation_id!r} (not made here, deleted, or dropped as least "
                           "recently used)", param=param, code="not_found")


def _no_response(response_id: str) -> JSONResponse:
    return _error_response(404, f"no stored response {response_id!r} (not stored, deleted, or dropped as least "
                           "recently used)", param="response_id", code="not_found")


class Exl2OpenAISpec(LitSpec):
    def __init__(self):
        super().__init__()
        self.api_path = "/v1/chat/completions"
        self.model_id = "default"
        self._max_model_len: int | None = None
        self._model_info: dict | None = None  # the worker's model_info (tool calls, reasoning), asked once
        self.response_store = ResponseStore()  # the Responses API's stored responses (serve/response_store.py)
        self.conversations = ConversationStore()  # the Conversations API's (serve/conversation_store.py)

    @property
    def stream(self) -> bool:
        return True

    def pre_setup(self, lit_api) -> None:
        from exl2_backend.serve.litapi import served_model_id

        settings = getattr(lit_api, "serve_settings", None)
        if settings is not None:
            self.model_id = served_model_id(settings)
        self.add_endpoint("/v1/chat/completions", self.chat_completions, ["POST"])
        self.add_endpoint("/v1/completions", self.completions, ["POST"])
        self.add_endpoint("/v1/responses", self.responses, ["POST"])
        self.add_endpoint("/v1/responses/{response_id}", self.get_response, ["GET"])
        self.add_endpoint("/v1/responses/{response_id}", self.delete_response, ["DELETE"])
        self.add_endpoint("/v1/responses/{response_id}/input_items", self.response_input_items, ["GET"])
        self.add_endpoint("/v1/conversations", self.create_conversation, ["POST"])
        self.add_endpoint("/v1/conversations/{conversation_id}", self.get_conversation, ["GET"])
        self.add_endpoint("/v1/conversations/{conversation_id}", self.update_conversation, ["POST"])
        self.add_endpoint("/v1/conversations/{conversation_id}", self.delete_conversation, ["DELETE"])
        self.add_endpoint("/v1/conversations/{conversation_id}/items", self.list_conversation_items, ["GET"])
        self.add_endpoint("/v1/conversations/{conversation_id}/items", self.add_conversation_items, ["POST"])
        self.add_endpoint("/v1/conversations/{conversation_id}/items/{item_id}", self.get_conversation_item, ["GET"])
        self.add_endpoint("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_conversation_item,
                          ["DELETE"])
        self.add_endpoint("/v1/models", self.list_models, ["GET"])
        self.add_endpoint("/v1/models/{model_name:path}", self.get_model, ["GET"])
        self.add_endpoint("/metrics", self.metrics, ["GET"])
        self.add_endpoint("/tokenize", self.tokenize, ["POST"])
        self.add_endpoint("/detokenize", self.detokenize, ["POST"])

    def decode_request(self, request, context_kwargs=None):
        return request

    def encode_response(self, output, context_kwargs=None):
        return output

    # --- talking to the worker ---------------------------------------------------------------------------

    def _submit(self, payload: dict) -> str:
        uid = uuid.uuid4().hex
        self.response_buffer[uid] = ResponseBufferItem(event=asyncio.Event(), response_queue=deque())
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), payload))
        return uid

    async def _items(self, uid: str) -> AsyncIterator[dict]:
        """The worker's items for one submitted payload, as dicts. Token items that arrived together (this
        reader fell behind) come out merged into one, so a slow client or a busy API process costs one SSE
        chunk per wakeup rather than one per token."""
        buf = self.response_buffer[uid]
        queue, ready = buf.response_queue, buf.event
        try:
            while True:
                await ready.wait()
                ready.clear()  # nothing can be appended between here and the drain (same event loop, no await)
                merged = None
                while queue:
                    data, status = queue.popleft()
                    if status == LitAPIStatus.FINISH_STREAMING:
                        if merged is not None:
                            yield merged
                        return
                    if status == LitAPIStatus.ERROR:
                        if merged is not None:
                            yield merged
                        log.error("exl2_backend: the worker failed a request: %r", data)
                        yield {"error": {"status": 500, "message": "internal error in the inference worker",
                                         "type": "server_error"}}
                        return
                    item = json.loads(data) if isinstance(data, (str, bytes)) else data
                    if merged is not None and mergeable(merged, item):
                        merged = merge_items(merged, item)
                        continue
                    if merged is not None:
                        yield merged
                    merged = item
                if merged is not None:
                    yield merged
        finally:
            self.response_buffer.pop(uid, None)

    def _cancel(self, seq_id: str) -> None:
        """Fire-and-forget (synchronous, so it works inside a cancelled task's finally)."""
        try:
            self.request_queue.put((self.response_queue_id, uuid.uuid4().hex, time.monotonic(),
                                    {"op": "cancel", "seq_id": seq_id}))
        except Exception:  # noqa: BLE001 - the server may be shutting down
            log.warning("exl2_backend: could not send cancel for %s", seq_id)

    async def query_worker(self, payload: dict, timeout: float = 10.0) -> dict:
        uid = self._submit(payload)
        agen = self._items(uid)
        try:
            return await asyncio.wait_for(agen.__anext__(), timeout)
        finally:
            self.response_buffer.pop(uid, None)
            await agen.aclose()

    @staticmethod
    async def _next(agen: AsyncIterator[dict], watch: _Watch | None) -> dict | None:
        """Next item, or None at the end; raises _Disconnected if the client went away (checked at most every
        DISCONNECT_POLL_S, also while items keep arriving). Without a watch (streaming: Starlette cancels the
        task on a disconnect) it simply awaits the next item."""
        if watch is None:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return None
        await watch.check()
        task = asyncio.ensure_future(agen.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    try:
                        return task.result()
                    except StopAsyncIteration:
                        return None
                await watch.check()
        finally:
            if not task.done():
                task.cancel()

    # --- routes ----------------------------------------------------------------------------------------

    async def _parse(self, request: Request, schema):
        """The validated request body, or the error Response (400 naming the field, 404 unknown model)."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        bad_text = lone_surrogate(body)
        if bad_text is not None:
            return _error_response(400, bad_text[1], param=bad_text[0])
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            param, message = first_error(exc)
            return _error_response(400, message, param=param)
        bad = self._check_model(getattr(req, "model", None))  # bodies without a model (conversations) pass
        return req if bad is None else bad

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        if isinstance(req, Response):
            return req
        return await self._chat(request, req)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: run as a chat completion, answered in the Responses API's shapes
        (serve/responses_api.py; streamed events: serve/responses_stream.py)."""
        rreq = await self._parse(request, ResponsesRequest)
        if isinstance(rreq, Response):
            return rreq
        history: list[dict] = []
        conversation = None
        if rreq.conversation is not None:
            if rreq.previous_response_id is not None:
                return _error_response(400, "conversation: give either conversation or previous_response_id",
                                       param="conversation")
            conversation = self.conversations.get(rreq.conversation_id())
            if conversation is None:
                return _no_conversation(rreq.conversation_id(), status=400, param="conversation")
            history = list(conversation.items)
        if rreq.previous_response_id is not None:
            previous = self.response_store.get(rreq.previous_response_id)
            if previous is None:
                return _error_response(400, f"previous response {rreq.previous_response_id!r} not found (stored "
                                       "responses are kept in memory, the least recently used dropped past "
                                       f"{self.response_store.capacity})", param="previous_response_id",
                                       code="previous_response_not_found")
            history = previous.conversation
        try:
            own = input_items(rreq.input)
            items = history + own
            if rreq.truncation == "auto":
                items = await self._fit_items(rreq, items)
            chat_body = rreq.chat_body(items)
        except RequestFieldError as exc:  # what has no chat translation
            return _error_response(400, str(exc), param=exc.param)
        try:
            req = ChatCompletionRequest.model_validate(chat_body)
        except ValidationError as exc:
            param, message = first_error(exc)
            named = responses_param(param)
            return _error_response(400, message.replace(param, named, 1), param=named)
        store = rreq.store is not False and self.response_store.capacity > 0
        skeleton = rreq.skeleton(new_id("resp"), req.model or self.model_id, store)
        info = await self._learn_model_info()  # the response says the sampling it ran with, defaults included
        used = req.sampling_fields(info.get("generation_defaults") if info else None)
        skeleton.update(temperature=used["temperature"], top_p=used["top_p"])

        def keep(response: dict) -> None:
            if store:
                self.response_store.put(response, own, history)
            if conversation is not None:  # the turn joins the conversation, stored or not (as the OpenAI API does)
                self.conversations.add_items(conversation.id, own + list(response.get("output") or ()))

        resp = await self._chat(request, req)
        if isinstance(resp, StreamingResponse):
            return StreamingResponse(response_events(resp.body_iterator, skeleton, keep),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        if resp.status_code == 499:
            return resp
        data = json.loads(resp.body)
        if resp.status_code != 200:
            data["error"]["param"] = responses_param(data["error"].get("param"))
            retry = resp.headers.get("Retry-After")
            return JSONResponse(data, status_code=resp.status_code, headers={"Retry-After": retry} if retry else None)
        response = response_from_chat(data, skeleton)
        keep(response)
        return JSONResponse(response)

    async def _fit_items(self, rreq: ResponsesRequest, items: list[dict]) -> list[dict]:
        """truncation "auto": the longest suffix of `items` starting at a user turn whose prompt, with
        max_output_tokens (or one token), fits the context (binary search over the turns, a worker tokenize per
        probe); all of them when they fit, the last turn alone when nothing shorter does (the usual 400 then)."""
        starts = [i for i, item in enumerate(items) if item.get("type", "message") == "message"
                  and item.get("role") == "user" and i > 0]

        async def fits(start: int) -> bool:
            body = rreq.chat_body(items[start:])
            try:
                fields = TokenizeRequest(messages=body["messages"], tools=body.get("tools"),
                                         chat_template_kwargs=body.get("chat_template_kwargs")).sequence_fields()
                answer = await self.query_worker({"op": "tokenize", "add_special_tokens": True,
                                                  "request": {"seq_id": "truncate", **fields}}, timeout=60.0)
            except Exception:  # noqa: BLE001 - the request's own validation or answer will say what fails
                return True
            if "error" in answer or not answer.get("max_model_len"):
                return True
            return answer["count"] + (rreq.max_output_tokens or 1) <= answer["max_model_len"]

        if not starts or await fits(0):
            return items
        lo, hi = 0, len(starts) - 1  # the first start that fits is searched; the last is taken if none does
        if not await fits(starts[hi]):
            return items[starts[hi]:]
        while lo < hi:  # bounded: log2(turns) probes
            mid = (lo + hi) // 2
            if await fits(starts[mid]):
                hi = mid
            else:
                lo = mid + 1
        return items[starts[lo]:]

    # --- the Conversations API (serve/conversation_store.py, serve/conversations_api.py) ---------------------------

    async def create_conversation(self, request: Request) -> Response:
        body = await self._parse(request, CreateConversation)
        if isinstance(body, Response):
            return body
        try:
            items = checked_items(body.items)
        except RequestFieldError as exc:
            return _error_response(400, str(exc), param=exc.param)
        return JSONResponse(self.conversations.create(items, body.metadata).as_object())

    async def get_conversation(self, conversation_id: str) -> Response:
        conv = self.conversations.get(conversation_id)
        return JSONResponse(conv.as_object()) if conv is not None else _no_conversation(conversation_id)

    async def update_conversation(self, conversation_id: str, request: Request) -> Response:
        body = await self._parse(request, UpdateConversation)
        if isinstance(body, Response):
            return body
        conv = self.conversations.get(conversation_id)
        if conv is None:
            return _no_conversation(conversation_id)
        conv.metadata = dict(body.metadata)
        return JSONResponse(conv.as_object())

    async def delete_conversation(self, conversation_id: str) -> Response:
        if not self.conversations.delete(conversation_id):
            return _no_conversation(conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_conversation_items(self, conversation_id: str, order: str = "desc", limit: str = "20",
                                      after: str | None = None) -> Response:
        conv = self.conversations.get(conversation_id)
        if conv is None:
            return _no_conversation(conversation_id)
        return _item_list(conv.items, order, limit, after, owner="conversation")

    async def add_conversation_items(self, conversation_id: str, request: Request) -> Response:
        body = await self._parse(request, AddItems)
        if isinstance(body, Response):
            return body
        if self.conversations.get(conversation_id) is None:
            return _no_conversation(conversation_id)
        try:
            added = self.conversations.add_items(conversation_id, checked_items(body.items))
        except RequestFieldError as exc:
            return _error_response(400, str(exc), param=exc.param)
        return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                             "has_more": False})

    async def get_conversation_item(self, conversation_id: str, item_id: str) -> Response:
        conv = self.conversations.get(conversation_id)
        if conv is None:
            return _no_conversation(conversation_id)
        item = next((i for i in conv.items if i.get("id") == item_id), None)
        if item is None:
            return _error_response(404, f"no item {item_id!r} in conversation {conversation_id!r}", param="item_id",
                                   code="not_found")
        return JSONResponse(item)

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> Response:
        conv = self.conversations.get(conversation_id)
        if conv is None:
            return _no_conversation(conversation_id)
        if not self.conversations.delete_item(conversation_id, item_id):
            return _error_response(404, f"no item {item_id!r} in conversation {conversation_id!r}", param="item_id",
                                   code="not_found")
        return JSONResponse(conv.as_object())

    async def get_response(self, response_id: str) -> Response:
        entry = self.response_store.get(response_id)
        return JSONResponse(entry.response) if entry is not None else _no_response(response_id)

    async def delete_response(self, response_id: str) -> Response:
        if not self.response_store.delete(response_id):
            return _no_response(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def response_input_items(self, response_id: str, order: str = "desc", limit: str = "20",
                                   after: str | None = None) -> Response:
        entry = self.response_store.get(response_id)
        if entry is None:
            return _no_response(response_id)
        return _item_list(entry.input_items, order, limit, after)

    async def _chat(self, request: Request, req: ChatCompletionRequest) -> Response:
        sid = f"chatcmpl-{uuid.uuid4().hex}"
        info = await self._learn_model_info()
        if info is None:
            return _error_response(503, "the inference worker did not describe the model", retry_after=1.0)
        fmt = format_from_dict(info.get("tool_call_format"))
        if req.calls_tools():
            req.use_tool_format(fmt)
        tags = ReasoningTags.from_dict(info.get("reasoning"))
        reply = _Reply(chat=True, n=req.n, tools=req.calls_tools(), tool_format=fmt, reasoning=tags,
                       inside_reasoning=tags is not None and req.reply_inside_reasoning(tags),
                       include_reasoning=req.include_reasoning)
        fields = req.prompt_fields()
        if tags is not None and tags.prompt_opens:
            # where the reply begins (inside the thinking block or not) is learned once, from the template without
            # variables; one that changes the prompt's end would leave thinking and answer unsplit or mixed up
            if req.chat_template_kwargs:
                return _error_response(400, "chat_template_kwargs: this model's chat template opens the thinking "
                                            "block itself; template variables are not supported for it",
                                       param="chat_template_kwargs")
            fields.pop("chat_template_kwargs", None)  # reasoning_effort alone: not passed to such a template
        seq = dict(seq_id=sid, **fields, max_new_tokens=req.limit(), cap_to_context=req.limit() is None,
                   **req.sampling_fields(info.get("generation_defaults")))
        # a reasoning model thinks first; a constraint holds its answer
        thinking = tags.grammar_field(reply.inside_reasoning) if tags is not None else None
        if thinking is not None and seq.get("grammar"):
            seq["grammar"] = dict(seq["grammar"], reasoning=thinking)
        return await self._run(request, req, sid, [seq], reply)

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        if isinstance(req, Response):
            return req
        sid = f"cmpl-{uuid.uuid4().hex}"
        info = await self._learn_model_info()
        if info is None:
            return _error_response(503, "the inference worker did not describe the model", retry_after=1.0)
        sampling = req.sampling_fields(info.get("generation_defaults"))
        seqs, echoes = [], []
        for prompt in req.prompts():
            text_prompt = isinstance(prompt, str)
            seq = dict(seq_id=sid, max_new_tokens=req.limit(), cap_to_context=req.limit() is None,
                       **({"prompt": prompt} if text_prompt else {"prompt_ids": list(prompt)}), **sampling)
            if req.suffix is not None:
                seq["suffix"] = req.suffix
            echo = None
            if req.echo:  # the prompt's logprobs when asked; a token-id prompt's text from its tokens' entries
                echo = _Echo(prompt if text_prompt else None, req.logprobs is not None)
                if echo.logprobs or not text_prompt:
                    seq["prompt_logprobs"] = req.logprobs or 0
            seqs.append(seq)
            echoes += [echo] * req.n
        return await self._run(request, req, sid, seqs, _Reply(chat=False, n=req.n, echoes=echoes))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"tokens", "count", "max_model_len"} of a text or of chat messages."""
        req = await self._parse(request, TokenizeRequest)
        if isinstance(req, Response):
            return req
        payload = {"op": "tokenize", "request": {"seq_id": "tokenize", **req.sequence_fields()},
                   "add_special_tokens": req.add_special_tokens}
        return await self._tokenizer_answer(payload, chat=req.messages is not None)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"prompt"} of token ids."""
        req = await self._parse(request, DetokenizeRequest)
        if isinstance(req, Response):
            return req
        return await self._tokenizer_answer({"op": "detokenize", "tokens": req.tokens}, chat=False)

    async def _tokenizer_answer(self, payload: dict, chat: bool) -> Response:
        try:
            item = await self.query_worker(payload, timeout=60.0)
        except Exception as exc:  # noqa: BLE001 - the worker did not answer
            return _error_response(503, f"the inference worker did not answer: {type(exc).__name__}")
        if "error" in item:
            return self._error_from_item(item, chat)
        return JSONResponse(item)

    async def list_models(self) -> Response:
        await self._learn_limits()
        return JSONResponse(ModelList(data=[self._card()]).model_dump())

    async def get_model(self, model_name: str) -> Response:
        if model_name != self.model_id:
            return self._unknown_model(model_name)
        await self._learn_limits()
        return JSONResponse(self._card().model_dump())

    async def metrics(self) -> Response:
        try:
            stats = await self.query_worker({"op": "stats"}, timeout=10.0)
        except Exception as exc:  # noqa: BLE001
            return Response(f"# worker did not answer: {type(exc).__name__}\nexl2_backend_up 0\n", status_code=503,
                            media_type=METRICS_CONTENT_TYPE)
        return Response(render_metrics(stats, self.model_id), media_type=METRICS_CONTENT_TYPE)

    # --- helpers -----------------------------------------------------------------------------------------

    @staticmethod
    async def _body(request: Request) -> Any:
        try:
            body = await request.json()
        except HTTPException as exc:  # LitServe's size limit, raised while the body is read
            if exc.status_code != 413:
                raise
            return _error_response(413, f"the request body is larger than this server accepts ({exc.detail})",
                                   param="body", code="payload_too_large")
        except Exception:  # noqa: BLE001
            return _error_response(400, "the request body is not valid JSON", param="body")
        if not isinstance(body, dict):
            return _error_response(400, "the request body must be a JSON object", param="body")
        return body

    def _check_model(self, model: str | None) -> Response | None:
        if model in (None, "", self.model_id):
            return None
        return self._unknown_model(model)

    def _unknown_model(self, model: str) -> Response:
        return _error_response(404, f"The model '{model}' does not exist; this server serves '{self.model_id}'",
                               param="model", code="model_not_found")

    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_id, max_model_len=self._max_model_len)

    async def _learn_model_info(self) -> dict | None:
        """The worker's model_info (how the model writes tool calls, whether it reasons in tags), asked once; None
        if it did not answer."""
        if self._model_info is None:
            try:
                info = await self.query_worker({"op": "model_info"}, timeout=60.0)
            except Exception as exc:  # noqa: BLE001 - the request gets a 503
                log.warning("exl2_backend: no model_info from the worker: %s", exc)
                return None
            if "error" in info:
                return None
            self._model_info = info
            self._max_model_len = self._max_model_len or info.get("max_seq_len")
        return self._model_info

    async def _learn_limits(self) -> None:
        if self._max_model_len is None:
            try:
                stats = await self.query_worker({"op": "stats"}, timeout=5.0)
                self._max_model_len = stats.get("backend", {}).get("max_seq_len")
            except Exception as exc:  # noqa: BLE001 - the card is still valid without it
                log.debug("exl2_backend: no stats from the worker for /v1/models: %s", exc)

    @staticmethod
    def _error_from_item(item: dict, chat: bool) -> Response:
        err = item["error"]
        param = err.get("param")
        if chat and param == "prompt":
            param = "messages"
        return _error_response(int(err.get("status", 500)), err.get("message", "error"), param=param,
                               code=err.get("code"), type_=err.get("type"), retry_after=err.get("retry_after"))

    async def _run(self, request: Request, req, sid: str, prompts: list[dict], reply: _Reply) -> Response:
        """Submit the request: one engine sequence per choice, `reply.n` per prompt (choice p * n + j of prompt p;
        ids "<sid>.<index>" when there are several, seeds seed + j so seeded choices differ and repeat), wait for
        every choice's admission, then stream or collect. A choice refused at admission fails the whole request
        (the others are cancelled)."""
        n = reply.n
        seqs = prompts if len(prompts) * n == 1 else [_choice(seq, sid, p * n + j, j)
                                                      for p, seq in enumerate(prompts) for j in range(n)]
        if not reply.echoes:
            reply.echoes = [None] * len(seqs)
        ids = [s["seq_id"] for s in seqs]
        uids = [self._submit({"op": "generate", "request": s}) for s in seqs]
        agens = [self._items(uid) for uid in uids]
        watch = _Watch(request)
        firsts = []
        try:
            for agen in agens:
                firsts.append(await self._next(agen, watch))
        except _Disconnected:
            self._drop(uids, ids)
            return Response(status_code=499)
        bad = next((f for f in firsts if f is None or "error" in f), False)
        if bad is not False:
            self._drop(uids, ids)
            if bad is None:
                return _error_response(500, "the inference worker ended the request without a result")
            return self._error_from_item(bad, reply.chat)
        model = req.model or self.model_id
        if req.stream:
            reply.include_usage = req.include_usage()
            return StreamingResponse(self._sse(uids, ids, sid, agens, firsts, model, reply),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        return await self._collect(watch, uids, ids, sid, agens, firsts, model, reply)

    def _drop(self, uids: list[str], ids: list[str]) -> None:
        """Cancel a request's sequences (those already finished ignore it) and forget their buffers."""
        for uid, seq_id in zip(uids, ids):
            self._cancel(seq_id)
            self.response_buffer.pop(uid, None)

    async def _collect(self, watch, uids, ids, sid, agens, firsts, model, reply: _Reply) -> Response:
        chat, choices, usage = reply.chat, [], empty_usage()
        try:
            for index, (agen, item) in enumerate(zip(agens, firsts)):  # later choices buffer meanwhile
                parts, lps, prompt_lps, tokens = [], None, None, []  # lps None: the request asked for no logprobs
                while True:
                    if "error" in item:
                        self._drop(uids, ids)
                        return self._error_from_item(item, chat)
                    prompt_lps = item.get("prompt_logprobs", prompt_lps)
                    parts.append(item.get("text", ""))
                    if reply.reasoning is not None:  # usage's reasoning_tokens
                        tokens += item.get("token_ids") or ()
                    if "logprobs" in item:
                        lps = lps if lps is not None else []
                        lps.extend(item["logprobs"])  # in place: a long reply's items cost linear time
                    if item.get("finish_reason"):
                        break
                    item = await self._next(agen, watch)
                    if item is None:
                        self._drop(uids, ids)
                        return _error_response(500, "the inference worker ended the stream early")
                text, reason = "".join(parts), finish_reason(item)
                add_usage(usage, item, first_of_prompt=index % reply.n == 0,
                          reasoning_tokens=reply.reasoning_tokens(tokens))
                if chat:
                    reasoning = None
                    if reply.reasoning is not None:
                        reasoning, text = split_reasoning(text, reply.reasoning, reply.inside_reasoning)
                    message = {"role": "assistant", "content": text}
                    calls = split_tool_calls(text, reply.tool_format) if reply.tools and text else (text, [])
                    if calls[1]:
                        message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
                        reason = "tool_calls" if reason == "stop" else reason
                    if reply.reasoning is not None and reply.include_reasoning:
                        message["reasoning_content"] = reasoning
                    choices.append({"index": index, "message": message, "logprobs": chat_logprobs(lps),
                                    "finish_reason": reason})
                else:
                    echo = reply.echoes[index]
                    if echo is not None:
                        text = echo.text_of(prompt_lps) + text
                        if echo.logprobs:
                            lps = (prompt_lps or []) + (lps or [])
                    choices.append({"index": index, "text": text, "logprobs": completion_logprobs(lps, 0),
                                    "finish_reason": reason})
        except _Disconnected:
            self._drop(uids, ids)
            return Response(status_code=499)
        finally:
            for uid in uids:
                self.response_buffer.pop(uid, None)
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": sid, "object": obj, "created": int(time.time()), "model": model,
                             "system_fingerprint": None, "choices": choices, "usage": usage})

    async def _sse(self, uids, ids, sid, agens, firsts, model, reply: _Reply) -> AsyncIterator[str]:
        """The choices' items as SSE chunks in arrival order (each chunk names its choice's index); the usage
        chunk (when asked) and [DONE] after the last choice finished. A disconnect cancels this generator's task
        (Starlette), and `finally` cancels every choice still running. With tools, a reply that starts like a
        call streams as `tool_calls` deltas: each call's id and name once its head is written, then its arguments
        text as it comes (serve/tools.ToolCallStream); logprobs ride on content chunks only."""
        chat, tools, include_usage, echoes = reply.chat, reply.tools, reply.include_usage, reply.echoes
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(agens)  # characters of completion text sent so far per choice (legacy text_offset)
        echoed = [e is None for e in echoes]  # whether each choice's prompt went out (echo)
        calls: list[ToolCallStream | None] = [None] * len(agens)  # tools: the replies that are calls
        started = [False] * len(agens)  # tools: whether the reply's first text arrived
        held = [""] * len(agens)  # tools: leading whitespace not yet sent
        tokens: list[list[int]] = [[] for _ in agens]  # a reasoning model's replies: their tokens (usage)
        fmt = reply.tool_format
        thinking = [ReasoningSplitter(reply.reasoning, reply.inside_reasoning) if reply.reasoning is not None
                    else None for _ in agens]  # a reasoning model's replies: thinking and answer apart

        def chunk(index: int, text: str | None, finish: str | None, *, role: bool = False,
                  lps: list | None = None, reasoning: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                if reasoning:
                    delta = {"reasoning_content": text}
                choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(lps), "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": completion_logprobs(lps, offsets[index]),
                          "finish_reason": finish}
            return event(choice)

        def calls_chunk(index: int, deltas: list[dict]) -> str:
            delta = {"content": None, "tool_calls": deltas}
            return event({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})

        def event(choice: dict) -> str:  # one choice's chunk as an SSE event
            c = {"id": sid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
                 "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return f"data: {json.dumps(c)}\n\n"

        def failure(err: dict) -> str:
            return "data: " + json.dumps({"error": {"message": err.get("message"), "type": err.get("type"),
                                                    "param": err.get("param"), "code": err.get("code")}}) + "\n\n"

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, agen) -> None:  # one choice's items after its first, into `merged`
            while True:
                item = await self._next(agen, None)
                await merged.put((index, item))
                if item is None or "error" in item or item.get("finish_reason"):
                    return

        pumps: list[asyncio.Task] = []
        done: set[int] = set()  # choices whose sequence ended (finished or failed)
        try:
            if chat:
                for index in range(len(agens)):
                    yield chunk(index, None, None, role=True)
            for index, first in enumerate(firsts):
                await merged.put((index, first))
            pumps = [asyncio.ensure_future(pump(i, agen)) for i, agen in enumerate(agens)
                     if not firsts[i].get("finish_reason") and "error" not in firsts[i]]
            usage = empty_usage()
            while len(done) < len(agens):
                index, item = await merged.get()
                if item is None:
                    yield failure({"message": "the inference worker ended the stream early", "type": "server_error"})
                    return
                if "error" in item:
                    done.add(index)
                    yield failure(item["error"])
                    return
                echo = echoes[index]
                if not echoed[index] and ("prompt_logprobs" in item or not echo.needs_entries):
                    echoed[index] = True  # the prompt first, with its logprobs when asked
                    prompt_text = echo.text_of(item.get("prompt_logprobs"))
                    yield chunk(index, prompt_text, None, lps=item.get("prompt_logprobs") if echo.logprobs else None)
                    offsets[index] += len(prompt_text)
                text, reason = item.get("text", ""), finish_reason(item) if item.get("finish_reason") else None
                lps = item.get("logprobs")
                if reply.reasoning is not None:
                    tokens[index] += item.get("token_ids") or ()
                if thinking[index] is not None:
                    thought, text = thinking[index].feed(text, final=reason is not None)
                    if thought and reply.include_reasoning:  # logprobs ride on the answer's chunks
                        yield chunk(index, thought, None, reasoning=True)
                if tools and not started[index]:  # whitespace first: held until the reply shows what it is
                    text, held[index] = held[index] + text, ""
                    if text.strip():
                        started[index] = True
                        calls[index] = ToolCallStream(fmt) if may_be_a_call(text, fmt) else None
                    elif not reason:
                        held[index], text = text, ""
                if calls[index] is not None:  # a reply of calls: tool_calls deltas instead of content
                    deltas = calls[index].feed(text)
                    if deltas:
                        yield calls_chunk(index, deltas)
                    text, lps = "", None
                    if reason == "stop" and calls[index].calls:
                        reason = "tool_calls"
                if text or lps:  # tokens whose text is held back (a stop string may be forming) still report
                    yield chunk(index, text, None, lps=lps)
                    offsets[index] += len(text)
                if reason:
                    yield chunk(index, None, reason)
                    add_usage(usage, item, first_of_prompt=index % reply.n == 0,
                              reasoning_tokens=reply.reasoning_tokens(tokens[index]))
                    done.add(index)
            if include_usage:
                yield "data: " + json.dumps({"id": sid, "object": obj, "created": created, "model": model,
                                             "system_fingerprint": None, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for uid in uids:
                self.response_buffer.pop(uid, None)
            # the client went away, the server is stopping, or an error ended the stream: free the pages of every
            # choice still running now
            for index, seq_id in enumerate(ids):
                if index not in done:
                    self._cancel(seq_id)


@dataclass
class _Reply:
    """How a request's choices are answered: chat or text completion, choices per prompt, a text completion's
    echo per choice, whether replies may be tool calls (serve/tools.py), and the streamed usage chunk."""

    chat: bool
    n: int = 1
    echoes: list = field(default_factory=list)  # per choice: _Echo or None
    tools: bool = False
    tool_format: ToolCallFormat = HERMES  # the model's convention for calls (tokenizer/tool_formats.py)
    reasoning: ReasoningTags | None = None  # a reasoning model's tags: its thinking goes apart (tokenizer/reasoning.py)
    inside_reasoning: bool = False  # the reply begins inside the thinking block
    include_reasoning: bool = True  # false: the thinking is dropped

    def reasoning_tokens(self, ids: list[int]) -> int:
        """How many of a reply's tokens were thinking (usage.completion_tokens_details)."""
        return 0 if self.reasoning is None else self.reasoning.token_count(ids, self.inside_reasoning)
    include_usage: bool = False


class _Echo:
    """A text completion's `echo`: the prompt goes out before the completion, its text given (a text prompt)
    or made of its tokens' entries (a token-id prompt), with its logprobs when the request asked."""

    def __init__(self, text: str | None, logprobs: bool):
        self.text, self.logprobs = text, logprobs

    @property
    def needs_entries(self) -> bool:
        return self.logprobs or self.text is None

    def text_of(self, prompt_entries: list[dict] | None) -> str:
        if self.text is not None:
            return self.text
        return "".join(e["token"] for e in prompt_entries or ())


def _choice(seq: dict, sid: str, index: int, j: int) -> dict:
    """Choice `index` of a request with several: its own engine sequence (prompt pages shared through the prefix
    cache once the first has run), the `j`-th of its prompt, seeded seed + j when the request is seeded (so a
    prompt's choices do not depend on where it sits in a batch)."""
    out = dict(seq, seq_id=f"{sid}.{index}")
    if seq.get("seed") is not None:
        out["seed"] = (seq["seed"] + j) % (1 << 64)
    return out
