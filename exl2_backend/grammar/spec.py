"""What a request may constrain its output to, as plain JSON-able data (hook API 1.4 `SequenceRequest.grammar`,
`GenerationParams.grammar`), and its translation into an llguidance grammar.

A grammar is a dict `{"type": T, "value": V}`:
- `json_object`: any JSON object (V absent or None);
- `json_schema`: a JSON Schema, as a dict or its JSON text;
- `regex`: a regular expression (Rust `regex` syntax) the whole output matches;
- `lark`: a Lark grammar (llguidance's dialect), `start` the whole output;
- `choice`: a non-empty list of strings, the output exactly one of them.

An optional `"reasoning": {"open": "<think>", "close": "</think>", "inside": bool}` (hook API 1.5) lets a reasoning
model think first: free text up to the closing tag (a special token; opened by the model unless `inside`, where
the prompt already did, and optional then), up to 4 whitespace characters, and then the output the grammar describes.

Torch-free, so the plugin's types can check a request without the engine (llguidance is a small pure-Rust
extension with no dependencies)."""

from __future__ import annotations

import json
import re
from typing import Any

GRAMMAR_TYPES = ("json_object", "json_schema", "regex", "lark", "choice")

# JSON text the model writes: ", " and ": " as json.dumps does, no other whitespace between tokens. Flexible
# whitespace lets a small model pad forever with newlines; a fixed form also makes outputs comparable.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def grammar_problem(grammar: Any) -> str | None:
    """None when `grammar` is None or well-formed (its shape only: whether a schema, regex or Lark text compiles is
    `compile_grammar`'s check), else the rule it breaks."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict) or set(grammar) - {"type", "value", "reasoning"}:
        return f"must be {{'type': one of {list(GRAMMAR_TYPES)}, 'value': ...}}, got {_short(grammar)}"
    tags = grammar.get("reasoning")
    if tags is not None and not (isinstance(tags, dict) and set(tags) == {"open", "close", "inside"}
                                 and _tag(tags["open"]) and _tag(tags["close"]) and isinstance(tags["inside"], bool)):
        return f"reasoning must be {{'open': '<...>', 'close': '<...>', 'inside': bool}}, got {_short(tags)}"
    kind, value = grammar.get("type"), grammar.get("value")
    if kind not in GRAMMAR_TYPES:
        return f"type must be one of {list(GRAMMAR_TYPES)}, got {kind!r}"
    if kind == "json_object" and value is not None:
        return "a json_object grammar takes no value"
    if kind == "json_schema" and not isinstance(value, (dict, str)):
        return f"a json_schema grammar's value must be a JSON Schema (an object or its JSON text), got {_short(value)}"
    if kind in ("regex", "lark") and (not isinstance(value, str) or not value):
        return f"a {kind} grammar's value must be a non-empty string, got {_short(value)}"
    if kind == "choice" and (not isinstance(value, list) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        return f"a choice grammar's value must be a non-empty list of non-empty strings, got {_short(value)}"
    return None


def llguidance_grammar(grammar: dict) -> str:
    """A well-formed grammar (grammar_problem is None) -> llguidance's grammar text. Raises ValueError for a
    json_schema that is not valid JSON text; whether the result compiles is checked by `compile_grammar`."""
    text = _output_grammar(grammar)
    tags = grammar.get("reasoning")
    return text if tags is None else _after_reasoning(text, tags)


def _after_reasoning(text: str, tags: dict) -> str:
    """The grammar `text` behind a reasoning block: a top-level grammar whose first part is the thinking (free text
    that ends at the closing tag, a special token text cannot spell) and whose second is `text`."""
    inner = json.loads(text)["grammars"][0] if text.lstrip().startswith("{") else {"lark_grammar": text}
    think = f"/(.|\\n)*/ {tags['close']}"
    head = think if tags["inside"] else f"({tags['open']} {think})?"
    # a few whitespace characters after the block (models write two newlines); unbounded, a model may pad forever
    lark = f"start: {head} /[ \\t\\r\\n]{{0,4}}/ @answer"
    return json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": lark}, dict(inner, name="answer")]})


def _tag(value: Any) -> bool:
    """A tag llguidance can name as a special token: <...> (no whitespace or brackets inside), or <[id]>."""
    return isinstance(value, str) and re.fullmatch(r"<[^<>\s]+>", value) is not None


def _output_grammar(grammar: dict) -> str:
    import llguidance

    kind, value = grammar["type"], grammar.get("value")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"the JSON Schema must be an object, got {_short(value)}")
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(value)
    # choice: each string as a Lark literal (JSON string syntax is a valid Lark string)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def compile_grammar(grammar: dict, tokenizer=None) -> tuple[str | None, str]:
    """(llguidance grammar text, "") when it compiles, (None, the compiler's message) when it does not. With an
    llguidance tokenizer the check includes what depends on the vocabulary."""
    import llguidance

    try:
        text = llguidance_grammar(grammar)
    except ValueError as exc:
        return None, str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    return (None, messages[0].strip()) if is_error else (text, "")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
