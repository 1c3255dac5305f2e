"""Function calling in the OpenAI chat API: the `tools` / `tool_choice` / `parallel_tool_calls` fields, the grammar
that holds the model's reply to them, and the reply read back into `tool_calls`.

Calls are written in the Hermes convention (tokenizer/tool_prompt.py): `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`, one block per call. The grammar (exl2_backend/grammar/, llguidance Lark with embedded JSON
Schemas) makes every call name a defined function with arguments that follow its `parameters` schema:
- "auto" (the default with tools): free text, or one or more calls; a text reply may not start with "<";
- "required": one or more calls; a named function: exactly one call of it;
- "none": no grammar, the reply is text (the tools are still in the prompt, as the OpenAI API does);
- parallel_tool_calls false: at most one call."""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from exl2_backend.grammar.spec import JSON_OPTIONS
from exl2_backend.tokenizer.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_TOOLS = 128  # the OpenAI API's limit


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema for the arguments; None: no arguments ({})
    strict: bool | None = None  # accepted: the arguments always follow the schema


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: _NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as the API returns it


class ToolCall(BaseModel):
    """A call in an assistant message of the history (as a response returned it)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


def _call_schema(fn: FunctionDef) -> dict:
    """One call's JSON: {"name": <this function>, "arguments": <its parameters>}, nothing else."""
    params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {},
                                                              "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: list[ToolDef], choice: ToolChoice, parallel: bool) -> dict | None:
    """The engine grammar (SequenceRequest.grammar) for a reply to `tools` under `choice`, or None ("none")."""
    if choice == "none":
        return None
    functions = [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
    schemas = [_call_schema(f) for f in functions]
    body = dict(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, **{"x-guidance": JSON_OPTIONS})
    calls = "call" if isinstance(choice, NamedToolChoice) or not parallel else 'call ("\\n" call)*'
    start = "calls" if choice != "auto" else "TEXT | calls"
    lark = "\n".join([
        f"start: {start}",
        f"calls: {calls}",
        f"call: {json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}",
        f"body: %json {json.dumps(body)}",
        'TEXT: /[^<](.|\\n)*/',  # a text reply: anything that does not start like a call
    ])
    return {"type": "lark", "value": lark}


_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
# a call's head as the grammar writes it (compact JSON: no raw newline inside, names [A-Za-z0-9_-])
_HEAD = re.compile(re.escape(TOOL_CALL_OPEN) + r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(body: str, obj: dict) -> str:
    """The arguments as the model wrote them (what streaming sent), else re-serialized."""
    head = f'{{"name": {json.dumps(obj["name"])}, "arguments": '
    if body.startswith(head) and body.endswith("}"):
        return body[len(head) : -1]
    return json.dumps(obj.get("arguments", {}), ensure_ascii=False)


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A reply -> (its text outside the calls or None, the OpenAI `tool_calls`). A reply whose calls do not parse
    (cut by max_tokens) is returned whole as text with no calls."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": _arguments_text(match.group(1), obj)}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


class ToolCallStream:
    """A reply of calls read as it streams, turned into OpenAI `tool_calls` deltas: a call's id, type and name once
    its head is complete, then its arguments text as it arrives. Sound for the grammar's replies: compact JSON has
    no raw newline, so the first one after the arguments begins the call's end ("}\n</tool_call>"); the last
    character seen is held back, since it may be the wrapper's closing brace."""

    def __init__(self):
        self.buf = ""  # text not yet sent
        self.calls = 0  # calls begun
        self.in_args = False

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        deltas = []
        while True:
            if not self.in_args:
                m = _HEAD.search(self.buf)
                if m is None:
                    return deltas
                deltas.append({"index": self.calls, "id": _call_id(), "type": "function",
                               "function": {"name": m.group(1), "arguments": ""}})
                self.calls += 1
                self.in_args, self.buf = True, self.buf[m.end():]
                continue
            end = self.buf.find("\n")
            if end < 0:  # all but the last character, which may close the call's object
                chunk, self.buf = self.buf[:-1], self.buf[-1:]
                if chunk:
                    deltas.append({"index": self.calls - 1, "function": {"arguments": chunk}})
                return deltas
            chunk = self.buf[: end - 1]  # the arguments end before the call object's closing brace
            if chunk:
                deltas.append({"index": self.calls - 1, "function": {"arguments": chunk}})
            self.in_args, self.buf = False, self.buf[end:]


def may_be_a_call(text: str) -> bool:
    """Whether a reply that begins with `text` may hold calls (a grammar-held text reply never starts with "<")."""
    return text[:1] == "<"
