"""How a model writes tool calls: the conventions models are trained on, and which one a chat template asks for.

A template that renders tools also tells the model how to answer them; the reply's grammar and its parser
(serve/tools.py) must follow the same convention, or a Llama 3.1 model is pushed into a format it never saw (and in
"auto" its calls come back as text). Three families cover the EXL2 models in use:
- "hermes" (Qwen2.5/3, Hermes, SmolLM3, and our fallback for templates without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, blocks on separate lines;
- "llama3_json" (Llama 3.1 / 3.2 / 3.3 with custom tools): `{"name": ..., "parameters": {...}}`, optionally after
  the `<|python_tag|>` token, several calls separated by "; " (vLLM's reading);
- "mistral" (Mistral 7B v0.3, Nemo, Small 22B / 24B 2501): the `[TOOL_CALLS]` token, then a JSON list of
  `{"name": ..., "arguments": {...}}`. Its templates insist on call ids of 9 letters and digits;
- "mistral_v11" (mistral-common's tokenizers v11 and later: Mistral Small 3.1 / 3.2, Magistral, Devstral): each call
  is the `[TOOL_CALLS]` token, the function's name, the `[ARGS]` token and the arguments' JSON object, calls one
  after another (v11 may put `[CALL_ID]` and an id before `[ARGS]`; grammars leave it out, the reader takes it). The
  three tokens stay in the decoded text (tokenizer.Tokenizer.special_ids), so the reply reads back."""

from __future__ import annotations

import hashlib
import secrets
import string
from dataclasses import dataclass, replace

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral", "mistral_v11")
MISTRAL_V11_TOKENS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")  # the tokens of a v11+ call, kept in decoded text

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    args_key: str  # the call object's key for the arguments
    call_open: str  # text before each call object
    call_close: str  # text after each call object
    separator: str  # text between two calls
    list_open: str = ""  # text before the calls (after the marker)
    list_close: str = ""  # text after the calls
    marker: str | None = None  # a token that may (llama3_json) or must (mistral) begin the calls
    marker_id: int | None = None  # its id when the vocabulary has it as one token
    marker_required: bool = False
    text_excludes: str = ""  # a text reply in "auto" may not start with this character (it begins a call)
    tags: tuple[str, str] | None = None  # the tags call_open / call_close begin / end with (Hermes' <tool_call>)
    tag_ids: tuple[int, int] | None = None  # their ids where the vocabulary has them as added tokens
    args_marker: str | None = None  # "mistral_v11": a call is marker, name, this token, arguments (no call object)
    args_marker_id: int | None = None  # its id when the vocabulary has it as one token
    parallel: bool = True  # the chat template takes several calls in one turn of history (Llama 3.1's refuses)
    nine_char_ids: bool = False  # its templates demand call ids of 9 letters and digits (mistral_call_id)

    def to_dict(self) -> dict:
        """What crosses the worker -> API process boundary: the name and the ids of its tokens."""
        return {"name": self.name, "marker_id": self.marker_id, "tag_ids": self.tag_ids,
                "args_marker_id": self.args_marker_id, "parallel": self.parallel}

    def new_call_id(self) -> str:
        """A call id as the model's template accepts it."""
        if self.nine_char_ids:
            return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"


HERMES = ToolCallFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", text_excludes="<",
                        tags=("<tool_call>", "</tool_call>"))
LLAMA3_JSON = ToolCallFormat("llama3_json", "parameters", "", "", "; ", marker="<|python_tag|>", text_excludes="{")
MISTRAL = ToolCallFormat("mistral", "arguments", "", "", ", ", list_open="[", list_close="]", marker="[TOOL_CALLS]",
                         marker_required=True, text_excludes="[", nine_char_ids=True)
MISTRAL_V11 = ToolCallFormat("mistral_v11", "arguments", "", "", "", marker="[TOOL_CALLS]", marker_required=True,
                             args_marker="[ARGS]", nine_char_ids=True)
_BY_NAME = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11)}


def tool_call_format(name: str, marker_id: int | None = None, tag_ids: tuple[int, int] | list[int] | None = None,
                     args_marker_id: int | None = None, parallel: bool = True) -> ToolCallFormat:
    """The format of that name (ValueError naming the known ones), with the ids of its marker, tags and [ARGS], and
    whether the template takes several calls in one turn."""
    fmt = _BY_NAME.get(name)
    if fmt is None:
        raise ValueError(f"unknown tool call format {name!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
    if fmt.marker is not None:
        fmt = replace(fmt, marker_id=marker_id)
    if fmt.tags is not None and tag_ids is not None:
        fmt = replace(fmt, tag_ids=(int(tag_ids[0]), int(tag_ids[1])))
    if fmt.args_marker is not None:
        fmt = replace(fmt, args_marker_id=args_marker_id)
    return fmt if parallel else replace(fmt, parallel=False)


def format_from_dict(d: dict | None) -> ToolCallFormat:
    """ToolCallFormat.to_dict's inverse; the Hermes convention for None (a worker that did not say)."""
    if not d:
        return HERMES
    return tool_call_format(d["name"], d.get("marker_id"), d.get("tag_ids"), d.get("args_marker_id"),
                            d.get("parallel", True))


def template_takes_tools(source: str) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable or messages' `tool_calls`)."""
    return "tools" in source or "tool_calls" in source


def detect_format_name(source: str | None) -> str:
    """The convention a chat template asks for; "hermes" where it does not say (and for templates without tools,
    which get the Hermes rendering, tokenizer/tool_prompt.py)."""
    if not source or not template_takes_tools(source):
        return "hermes"
    if "[TOOL_CALLS]" in source:  # v11+ templates write the name, then [ARGS] and the arguments
        return "mistral_v11" if "[ARGS]" in source else "mistral"
    if "<tool_call>" in source:
        return "hermes"
    # Llama 3.x: "Respond in the format {"name": function name, "parameters": dictionary ...}", calls rendered
    # with a "parameters" key, the ipython environment / python_tag of its built-in tools
    if '"parameters"' in source and ("ipython" in source or "python_tag" in source or "function name" in source):
        return "llama3_json"
    return "hermes"


def mistral_call_id(call_id: str | None) -> str:
    """A client's call id as Mistral templates accept it (9 letters and digits): kept if it is one, else a stable
    9-character digest, so a call and its tool result keep matching ids."""
    if call_id and len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = hashlib.sha256((call_id or "").encode()).digest()
    return "".join(_ID_ALPHABET[b % len(_ID_ALPHABET)] for b in digest[:9])
