"""A streamed chat completion's SSE chunks turned into the Responses API's events (serve/responses_api.py).

Events, each `event: <type>` + `data: {..., "sequence_number": n}`: response.created and response.in_progress, then
per output item in order: response.output_item.added; for reasoning and message items a content part
(response.content_part.added), its text deltas (response.reasoning_text.delta / response.output_text.delta) and
their .done; for a function call its arguments' deltas and response.function_call_arguments.done; then
response.output_item.done. Last response.completed (or response.incomplete at max_output_tokens), or on an error
the `error` event and response.failed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from exl2_backend.serve.responses_api import (
    finished,
    function_call_item,
    message_item,
    new_id,
    output_logprobs,
    output_text,
    reasoning_item,
)


class _Item:
    """The output item being streamed."""

    def __init__(self, kind: str, index: int, item_id: str, call_id: str = "", name: str = ""):
        self.kind, self.index, self.id = kind, index, item_id
        self.call_id, self.name = call_id, name
        self.text = ""  # reasoning or message text, or a call's arguments
        self.logprobs: list = []

    def as_item(self, status: str) -> dict:
        """The output item as it stands."""
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return message_item(self.id, self.text, status, self.logprobs)
        return function_call_item(self.id, self.call_id, self.name, self.text, status)


class ResponseEvents:
    """Chat chunks in, Responses events out (as SSE text)."""

    def __init__(self, skeleton: dict):
        self.skeleton = skeleton
        self.seq = 0
        self.output: list[dict] = []
        self.item: _Item | None = None
        self.finish: str | None = None
        self.usage: dict | None = None
        self.final: dict | None = None  # the completed (or incomplete) response, once the stream ended

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.skeleton),
                self.event("response.in_progress", response=self.skeleton)]

    def _open(self, kind: str, **extra) -> list[str]:
        out = self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.item = item = _Item(kind, len(self.output), new_id(prefix), **extra)
        added = item.as_item("in_progress")
        if kind == "message":
            added["content"] = []  # its part is added next
        out.append(self.event("response.output_item.added", output_index=item.index, item=added))
        if kind != "function_call":
            part = output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", item_id=item.id, output_index=item.index,
                                  content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[str]:
        item, self.item = self.item, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        out = []
        if item.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", content_index=0, text=item.text, **where))
            out.append(self.event("response.content_part.done", content_index=0,
                                  part={"type": "reasoning_text", "text": item.text}, **where))
        elif item.kind == "message":
            out.append(self.event("response.output_text.done", content_index=0, text=item.text,
                                  logprobs=item.logprobs, **where))
            out.append(self.event("response.content_part.done", content_index=0,
                                  part=output_text(item.text, item.logprobs), **where))
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=item.text, **where))
        done = item.as_item(status if item.kind == "message" else "completed")  # only a message is cut short
        self.output.append(done)
        out.append(self.event("response.output_item.done", output_index=item.index, item=done))
        return out

    def chunk(self, chunk: dict) -> list[str]:
        """One chat chunk's events."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.item is None or self.item.kind != "reasoning":
                    out += self._open("reasoning")
                self.item.text += delta["reasoning_content"]
                out.append(self.event("response.reasoning_text.delta", item_id=self.item.id,
                                      output_index=self.item.index, content_index=0, delta=delta["reasoning_content"]))
            lps = output_logprobs(choice.get("logprobs"))
            if delta.get("content"):
                if self.item is None or self.item.kind != "message":
                    out += self._open("message")
                self.item.text += delta["content"]
                self.item.logprobs += lps
                out.append(self.event("response.output_text.delta", item_id=self.item.id,
                                      output_index=self.item.index, content_index=0, delta=delta["content"],
                                      logprobs=lps))
            elif lps and self.item is not None and self.item.kind == "message":
                self.item.logprobs += lps  # tokens whose text is still held back
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):
                    out += self._open("function_call", call_id=call["id"], name=fn.get("name", ""))
                if fn.get("arguments") and self.item is not None and self.item.kind == "function_call":
                    self.item.text += fn["arguments"]
                    out.append(self.event("response.function_call_arguments.delta", item_id=self.item.id,
                                          output_index=self.item.index, delta=fn["arguments"]))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[str]:
        incomplete = self.finish == "length"
        out = self._close("incomplete" if incomplete else "completed")
        response = self.final = finished(self.skeleton, self.output, self.usage, incomplete)
        return out + [self.event("response.incomplete" if incomplete else "response.completed", response=response)]

    def fail(self, error: dict) -> list[str]:
        out = self._close("incomplete")
        response = dict(self.skeleton, status="failed", output=self.output,
                        error={"code": error.get("code") or "server_error", "message": error.get("message", "")})
        return out + [self.event("error", message=error.get("message", ""), code=error.get("code"),
                                 param=error.get("param")),
                      self.event("response.failed", response=response)]


async def response_events(chat_sse: AsyncIterator, skeleton: dict,
                          on_done: Callable[[dict], None] | None = None) -> AsyncIterator[str]:
    """The chat stream's SSE text (the chat route's body iterator) -> Responses events; `on_done` gets the final
    response of a stream that completed (or stopped at max_output_tokens). Closing this generator closes the chat
    stream, whose own cleanup cancels the sequence (a client that went away)."""
    events = ResponseEvents(skeleton)
    buf = ""
    try:
        for e in events.start():
            yield e
        async for piece in chat_sse:
            buf += piece if isinstance(piece, str) else piece.decode()
            while "\n\n" in buf:
                block, buf = buf.split("\n\n", 1)
                if not block.startswith("data: "):
                    continue
                data = block[len("data: "):]
                if data == "[DONE]":
                    ended = events.end()
                    if on_done is not None:
                        on_done(events.final)
                    for e in ended:
                        yield e
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    for e in events.fail(chunk["error"]):
                        yield e
                    return
                for e in events.chunk(chunk):
                    yield e
        for e in events.fail({"message": "the stream ended early", "code": "server_error"}):
            yield e
    finally:
        close = getattr(chat_sse, "aclose", None)
        if close is not None:
            await close()
