"""OpenAI's Responses API (POST /v1/responses) on top of the chat completions path: a request is translated into a
chat request (instructions and input items into messages, function tools, text.format into response_format), run
exactly as a chat completion, and its result translated back into a `response` object with typed output items
(reasoning, message, function_call). Streaming translates the chat chunks into Responses events
(serve/responses_stream.py).

Responses are stored unless `store` is false (serve/response_store.py: in memory, bounded), so `previous_response_id`
continues a conversation (its input and output items come before the new input; its instructions do not carry
over), and GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items read them. `conversation` continues
a conversation of the Conversations API (serve/conversation_store.py) instead: its items come first, and this
request's input and output items are appended when it ends. With `truncation: "auto"`
a conversation longer than the context loses its oldest turns (serve/openai_spec.py `_fit_items`); the stored
conversation keeps them."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exl2_backend.serve.schemas import MAX_TOP_LOGPROBS


class RequestFieldError(Exception):
    """A request field with no chat translation: a 400 naming it."""

    def __init__(self, message: str):
        super().__init__(message)
        self.param = message.split(":", 1)[0]  # messages read "<param>: <why>"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity"}
    reasoning: dict | None = None  # {"effort", "summary"}: effort goes to the chat template as reasoning_effort
    stream: bool = False
    store: bool | None = None  # None: stored, as the OpenAI API does (serve/response_store.py)
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: the oldest turns go when the prompt is too long
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream_options: dict | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    # chat completions' fields that the Responses API lacks, and vLLM's extensions (checked by the chat request)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict | None = None
    stop: str | list[str] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_reasoning: bool | None = None

    @field_validator("conversation")
    @classmethod
    def _conversation_id(cls, v):
        if v is not None and not (isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("id"), str))):
            raise ValueError("must be a conversation id, or {\"id\": <conversation id>}")
        return v

    def conversation_id(self) -> str | None:
        return self.conversation if isinstance(self.conversation, str | None) else self.conversation["id"]

    @field_validator("include")
    @classmethod
    def _include(cls, v):
        wanted = set(v or ()) - {"message.output_text.logprobs", "reasoning.encrypted_content"}
        if wanted:
            raise ValueError(f"not supported: {sorted(wanted)}")
        return v

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)

    def chat_body(self, items: list[dict] | None = None) -> dict:
        """The chat completions request this one runs as, over `items` (the previous response's conversation and
        this input; default: this input); RequestFieldError("<param>: <why>") for what has no translation (the
        param named as in this API)."""
        body: dict[str, Any] = {"messages": input_messages(self.instructions, self.input if items is None else items),
                                "n": 1, "stream": self.stream}
        if self.model is not None:
            body["model"] = self.model
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for key in _PASSED:
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        if self.wants_logprobs():
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:  # a template variable, for templates that read it
            body["reasoning_effort"] = effort
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
        return body

    def skeleton(self, rid: str, model: str, store: bool = False) -> dict:
        """The response object before its output: what a `response.created` event carries."""
        return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
                "instructions": self.instructions, "metadata": self.metadata or {},
                "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "temperature": self.temperature, "top_p": self.top_p, "tools": self.tools or [],
                "tool_choice": self.tool_choice or "auto", "text": self.text or {"format": {"type": "text"}},
                "reasoning": self.reasoning, "store": store, "truncation": self.truncation or "disabled", "usage": None,
                "user": self.user, "previous_response_id": self.previous_response_id,
                "conversation": None if self.conversation is None else {"id": self.conversation_id()}}


_PASSED = ("temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "logit_bias", "stop", "min_tokens", "ignore_eos", "include_reasoning")


def _text_of(content: Any, where: str) -> str | None:
    """A message's content (a string, or text parts) as text."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestFieldError(f"{where}: must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise RequestFieldError(f"{where}.{j}.type: only text content parts are supported (got {kind!r})")
        out.append(str(part.get("text", "")))
    return "".join(out)


def input_messages(instructions: str | None, items: str | list[dict]) -> list[dict]:
    """`instructions` and `input` as chat messages: message items by role, function_call items as the assistant's
    tool_calls (consecutive ones in one message), function_call_output items as tool messages; reasoning items are
    dropped (chat templates leave earlier thinking out)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise RequestFieldError(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestFieldError(f"{where}.role: must be user, system, developer or assistant (got {role!r})")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content") or ""})
        elif kind == "function_call":
            call = {"id": _required(item, "call_id", where), "type": "function",
                    "function": {"name": _required(item, "name", where),
                                 "arguments": _required(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _required(item, "call_id", where),
                             "content": output or ""})
        elif kind != "reasoning":
            raise RequestFieldError(f"{where}.type: must be message, function_call, function_call_output or reasoning "
                             f"(got {kind!r})")
    return messages


def _required(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestFieldError(f"{where}.{key}: this field is required (a string)")
    return value


def _chat_tool(tool: dict, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise RequestFieldError(f"tools.{i}.type: only function tools are supported (got {kind!r})")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestFieldError(f"tool_choice: must be none, auto, required or {{type: function, name}} (got {choice!r})")


def _response_format(fmt: dict) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise RequestFieldError(f"text.format.type: must be text, json_object or json_schema (got {kind!r})")


# chat request params -> this API's names, for errors found by the chat request's validation or by the engine
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "prompt": "input"}


def responses_param(param: str | None) -> str | None:
    """A chat completions error's param named as in this API."""
    if not param:
        return param
    head, dot, rest = param.partition(".")
    if head == "tools" and ".function." in param:
        param = param.replace(".function.", ".", 1)
        head, dot, rest = param.partition(".")
    return _PARAMS.get(head, head) + (dot + rest if head not in ("messages", "prompt") else "")


def response_from_chat(chat: dict, skeleton: dict) -> dict:
    """A chat completion (one choice) -> the response object: output items, status and usage."""
    choice = chat["choices"][0]
    msg = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    output = []
    if msg.get("reasoning_content"):
        output.append(reasoning_item(new_id("rs"), msg["reasoning_content"]))
    if msg.get("content"):
        output.append(message_item(new_id("msg"), msg["content"], "incomplete" if incomplete else "completed",
                                   output_logprobs(choice.get("logprobs"))))
    for call in msg.get("tool_calls") or ():
        output.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                         call["function"]["arguments"]))
    return finished(skeleton, output, chat.get("usage"), incomplete)


def finished(skeleton: dict, output: list[dict], usage: dict | None, incomplete: bool) -> dict:
    return dict(skeleton, status="incomplete" if incomplete else "completed", output=output,
                incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                usage=responses_usage(usage))


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)]}


def output_text(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_logprobs(chat_logprobs: dict | None) -> list:
    """A chat choice's logprobs -> output_text logprobs ({token, logprob, bytes, top_logprobs})."""
    if not chat_logprobs:
        return []
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes") or [],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes") or []}
                              for t in e.get("top_logprobs") or ()]}
            for e in chat_logprobs.get("content") or ()]


def responses_usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": (usage.get("completion_tokens_details") or {"reasoning_tokens": 0}),
            "total_tokens": usage["total_tokens"]}
