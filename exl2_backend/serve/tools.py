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
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False)}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


def may_be_a_call(text: str) -> bool:
    """Whether a reply that begins with `text` may hold calls (a grammar-held text reply never starts with "<")."""
    return text[:1] == "<"
