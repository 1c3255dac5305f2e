"""Tools in a chat prompt: how function definitions, an assistant's tool calls and tool results reach the model.

A chat template written for tools (Qwen2.5/3, Hermes, SmolLM3, Llama 3.1 ...) receives them as transformers passes
them: `tools` as a template variable, `tool_calls` on assistant messages (arguments as objects) and `tool` messages.
A template that never mentions tools gets them in the widely trained "Hermes" convention instead, written as plain
messages it can render: the definitions in the system message between <tools></tools>, each call the assistant made
as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in its content, each result as a user message in
<tool_response></tool_response>. Calls are read back from the model's output in the same convention
(serve/tools.py), which is also how the tool-trained Hermes-style templates ask for them."""

from __future__ import annotations

import json
from typing import Any

from exl2_backend.tokenizer.tool_formats import mistral_call_id

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"

_SYSTEM_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{signatures}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes convention (arguments: an object, or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the string the client sent
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CALL_CLOSE


def template_messages(messages: list[dict], nine_char_ids: bool = False) -> list[dict]:
    """Messages for a template that takes tools: each call's arguments as an object (templates write them with
    `tojson`; a JSON string would come out quoted twice). nine_char_ids: call ids (and the results' tool_call_id)
    as Mistral templates demand them, 9 letters and digits (tool_formats.mistral_call_id)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [_with_object_arguments(c) for c in calls]
            if nine_char_ids:
                calls = [dict(c, id=mistral_call_id(c.get("id"))) for c in calls]
            m = dict(m, tool_calls=calls)
        if nine_char_ids and m.get("role") == "tool" and "tool_call_id" in m:
            m = dict(m, tool_call_id=mistral_call_id(m["tool_call_id"]))
        out.append(m)
    return out


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows nothing of tools: the conversation in the Hermes convention."""
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"].get("arguments", {}))
                              for c in m["tool_calls"])
            out.append({"role": role, "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": role, "content": content})
    if tools:
        text = _SYSTEM_TOOLS.format(signatures="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _with_object_arguments(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return call
    return dict(call, function=dict(fn, arguments=args))
