"""Function calling in the OpenAI chat API: the `tools` / `tool_choice` / `parallel_tool_calls` fields, the grammar
that holds the model's reply to them, and the reply read back into `tool_calls`.

Calls are written in the model's own convention (tokenizer/tool_formats.py: Hermes `<tool_call>` blocks, Llama 3's
`{"name", "parameters"}` objects, Mistral's `[TOOL_CALLS]` list, Mistral v11+'s `[TOOL_CALLS]name[ARGS]{...}`). The
grammar (exl2_backend/grammar/, llguidance Lark with embedded JSON Schemas) makes every call name a defined function
with arguments that follow its `parameters` schema:
- "auto" (the default with tools): free text, or one or more calls; a text reply may not start (after any
  whitespace) with the character that begins a call ("<", "{" or "["; Mistral v11+'s calls begin with a token);
- "required": one or more calls; a named function: exactly one call of it;
- "none": no grammar, the reply is text (the tools are still in the prompt, as the OpenAI API does);
- parallel_tool_calls false: at most one call."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from exl2_backend.grammar.spec import JSON_OPTIONS
from exl2_backend.tokenizer.tool_formats import HERMES, ToolCallFormat

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


def _parameters(fn: FunctionDef) -> dict:
    """The JSON Schema of a function's arguments; no parameters: an empty object."""
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {},
                                                            "additionalProperties": False}


def _call_schema(fn: FunctionDef, args_key: str) -> dict:
    """One call's JSON: {"name": <this function>, <args_key>: <its parameters>}, nothing else."""
    params = _parameters(fn)
    return {"type": "object", "properties": {"name": {"const": fn.name}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (JSON escapes are Lark's)


def tool_grammar(tools: list[ToolDef], choice: ToolChoice, parallel: bool,
                 fmt: ToolCallFormat = HERMES) -> dict | None:
    """The engine grammar (SequenceRequest.grammar) for a reply to `tools` under `choice` in the model's call
    convention `fmt`, or None ("none"). One call at most where `parallel` is false or the model's template cannot
    take several calls back in the next turn's history (fmt.parallel)."""
    if choice == "none":
        return None
    functions = [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
    if fmt.args_marker is not None:
        return _named_calls_grammar(functions, choice, parallel, fmt)
    schemas = [_call_schema(f, fmt.args_key) for f in functions]
    body = dict(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, **{"x-guidance": JSON_OPTIONS})
    one = isinstance(choice, NamedToolChoice) or not (parallel and fmt.parallel)
    rules = [f"start: {'calls' if choice != 'auto' else 'TEXT | calls'}"]
    marker = None
    if fmt.marker_id is not None:
        marker = f"<[{fmt.marker_id}]>"  # the special token itself (text cannot spell it)
    elif fmt.marker_required:
        marker = _literal(fmt.marker)
    head = [] if marker is None else [marker if fmt.marker_required else "marker?"]
    if marker is not None and not fmt.marker_required:
        rules.append(f"marker: {marker}")
    if marker is not None and fmt.list_open:
        head.append('" "?')  # a SentencePiece model's "▁[" after the marker
    seq = ["call"] if one else ["call", f"({_literal(fmt.separator)} call)*"]
    parts = head + ([_literal(fmt.list_open)] if fmt.list_open else []) + seq + (
        [_literal(fmt.list_close)] if fmt.list_close else [])
    rules.append("calls: " + " ".join(parts))
    rules.append("call: " + " ".join(_pieces(fmt.call_open, fmt, 0) + ["body"] + _pieces(fmt.call_close, fmt, 1)))
    rules.append(f"body: %json {json.dumps(body)}")
    # a text reply: anything that does not start (after whitespace) like a call
    rules.append(f"TEXT: /\\s*[^\\s{re.escape(fmt.text_excludes)}](.|\\n)*/")
    return {"type": "lark", "value": "\n".join(rules)}


def _named_calls_grammar(functions: list[FunctionDef], choice: ToolChoice, parallel: bool,
                         fmt: ToolCallFormat) -> dict:
    """Mistral v11+'s calls: each the marker, a defined function's name, [ARGS] and arguments that follow that
    function's schema, calls one after another; [CALL_ID] is left out (the ids are ours). The markers are the
    vocabulary's tokens where it has them."""
    one = isinstance(choice, NamedToolChoice) or not (parallel and fmt.parallel)
    marker, args = (f"<[{i}]>" if i is not None else _literal(t)
                    for i, t in ((fmt.marker_id, fmt.marker), (fmt.args_marker_id, fmt.args_marker)))
    rules = [f"start: {'calls' if choice != 'auto' else 'TEXT | calls'}", f"calls: call{'' if one else '+'}",
             f"call: {marker} ({' | '.join(f'fn{i}' for i in range(len(functions)))})"]
    for i, fn in enumerate(functions):
        rules.append(f"fn{i}: {_literal(fn.name)} {args} args{i}")
        rules.append(f"args{i}: %json {json.dumps(dict(_parameters(fn), **{'x-guidance': JSON_OPTIONS}))}")
    rules.append("TEXT: /\\s*\\S(.|\\n)*/")  # a text reply (a call begins with the marker token)
    return {"type": "lark", "value": "\n".join(rules)}


def _pieces(text: str, fmt: ToolCallFormat, which: int) -> list[str]:
    """Grammar items that spell `text` (a call's open or close): its tag as the token where the vocabulary has one
    (the model's own token; llguidance would not let the tag's text match it), the rest as literals."""
    if not text:
        return []
    if fmt.tag_ids is None:
        return [_literal(text)]
    tag, token = fmt.tags[which], f"<[{fmt.tag_ids[which]}]>"
    head, _, tail = text.partition(tag)
    return ([_literal(head)] if head else []) + [token] + ([_literal(tail)] if tail else [])


def _head(fmt: ToolCallFormat) -> re.Pattern:
    """A call's head as the grammar writes it, up to its arguments' value: the call object's (compact JSON, names
    [A-Za-z0-9_-]), or Mistral v11+'s marker, name, optional [CALL_ID] and id, and [ARGS]."""
    if fmt.args_marker is not None:
        return re.compile(re.escape(fmt.marker) + r"\s*([A-Za-z0-9_-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?"
                          + re.escape(fmt.args_marker) + r"\s*")
    return re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "' + re.escape(fmt.args_key) + '": ')


def _arguments_text(body: str, obj: dict, fmt: ToolCallFormat) -> str:
    """The arguments as the model wrote them (what streaming sent), else re-serialized."""
    if fmt.args_marker is not None:  # the source is the arguments' own text
        return body
    head = f'{{"name": {json.dumps(obj["name"])}, "{fmt.args_key}": '
    if body.startswith(head) and body.endswith("}"):
        return body[len(head) : -1]
    return json.dumps(obj.get(fmt.args_key, {}), ensure_ascii=False)


def _skip(text: str, pos: int, literal: str) -> int | None:
    """pos past whitespace, `literal` (stripped; "" matches) and whitespace, or None where it is not there."""
    pos = _past_space(text, pos)
    literal = literal.strip()
    if not text.startswith(literal, pos):
        return None
    return _past_space(text, pos + len(literal))


def _past_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


_DECODER = json.JSONDecoder()


def _parse_calls(text: str, fmt: ToolCallFormat) -> tuple[list[tuple[dict, str]], int]:
    """The reply's call objects in `fmt` with their source text, read from the start for as long as the reply
    follows the format (whitespace between the parts is allowed), and where reading stopped (len(text): the whole
    reply is calls)."""
    if fmt.args_marker is not None:
        return _parse_named_calls(text, fmt)
    pos, calls = 0, []
    if fmt.marker:
        after = _skip(text, 0, fmt.marker)  # the marker's text, when it was not a special token (skipped)
        pos = after if after is not None else 0
    if fmt.list_open and (pos := _skip(text, pos, fmt.list_open)) is None:
        return calls, 0
    while True:
        start = _skip(text, pos, fmt.call_open)
        if start is None:
            return calls, pos
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return calls, pos
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and fmt.args_key in obj):
            return calls, pos
        if (after := _skip(text, end, fmt.call_close)) is None:
            return calls, pos
        calls.append((obj, text[start:end]))
        pos = after
        if fmt.list_close:
            closed = _skip(text, pos, fmt.list_close)
            if closed is not None and not text[closed:].strip():
                return calls, len(text)
        elif not text[pos:].strip():
            return calls, len(text)
        if (after := _skip(text, pos, fmt.separator)) is None:
            return calls, pos
        pos = after


def _parse_named_calls(text: str, fmt: ToolCallFormat) -> tuple[list[tuple[dict, str]], int]:
    """_parse_calls for Mistral v11+: each call the head (_head) and an arguments object, with the arguments'
    text as the source."""
    head, pos, calls = _head(fmt), 0, []
    while (m := head.match(text, _past_space(text, pos))) is not None:
        try:
            args, end = _DECODER.raw_decode(text, m.end())
        except json.JSONDecodeError:
            break
        if not isinstance(args, dict):
            break
        calls.append(({"name": m.group(1), fmt.args_key: args}, text[m.end():end]))
        pos = end
        if not text[pos:].strip():
            return calls, len(text)
    return calls, pos


def split_tool_calls(text: str, fmt: ToolCallFormat = HERMES) -> tuple[str | None, list[dict]]:
    """A reply -> (its text that is not calls, or None; the OpenAI `tool_calls`). A reply cut inside a call (by
    max_tokens) gives the calls before it, the cut text as text; a reply whose first call does not parse is
    returned whole as text with no calls."""
    if not may_be_a_call(text, fmt):
        return text, []
    parsed, stop = _parse_calls(text, fmt)
    if not parsed:
        return text, []
    calls = [{"id": fmt.new_call_id(), "type": "function",
              "function": {"name": obj["name"], "arguments": _arguments_text(src, obj, fmt)}} for obj, src in parsed]
    return text[stop:].strip() or None, calls


class _ValueEnd:
    """Where a JSON value ends, found from its text given piece by piece (strings and escapes respected)."""

    def __init__(self):
        self.depth = 0
        self.started = self.scalar = self.in_string = self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None while it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif not self.started:
                if ch.isspace():
                    continue
                self.started = True
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth = 1
                else:
                    self.scalar = True
            elif self.scalar:
                if ch in ",}] \t\r\n":
                    return i
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallStream:
    """A reply of calls read as it streams, turned into OpenAI `tool_calls` deltas: a call's id, type and name once
    its head (`{"name": ..., "arguments": `) is complete, then its arguments text as it arrives, up to the end of
    the arguments' JSON value (found by _ValueEnd, so nothing is held back)."""

    def __init__(self, fmt: ToolCallFormat = HERMES):
        self.fmt = fmt
        self.head = _head(fmt)
        self.buf = ""  # text not yet read
        self.calls = 0  # calls begun
        self.value: _ValueEnd | None = None  # the current call's arguments, while they stream

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        deltas = []
        while True:
            if self.value is None:
                m = self.head.search(self.buf)
                if m is None:
                    return deltas
                deltas.append({"index": self.calls, "id": self.fmt.new_call_id(), "type": "function",
                               "function": {"name": m.group(1), "arguments": ""}})
                self.calls += 1
                self.value, self.buf = _ValueEnd(), self.buf[m.end():]
                continue
            end = self.value.feed(self.buf)
            chunk = self.buf if end is None else self.buf[:end]
            if chunk:
                deltas.append({"index": self.calls - 1, "function": {"arguments": chunk}})
            if end is None:
                self.buf = ""
                return deltas
            self.value, self.buf = None, self.buf[end:]


def may_be_a_call(text: str, fmt: ToolCallFormat = HERMES) -> bool:
    """Whether a reply that begins with `text` (not only whitespace) may hold calls: a grammar-held text reply
    never starts, after whitespace, with the character calls begin with (the marker, a special token, is not in
    the text)."""
    text = text.lstrip()
    if fmt.marker and text.startswith(fmt.marker):
        return True
    return text[:1] == fmt.text_excludes
