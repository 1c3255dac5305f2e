"""Structured output in the OpenAI API: `response_format` (json_object, json_schema) and vLLM's `structured_outputs`
extension (json, regex, choice, grammar), turned into the engine's grammar (exl2_backend/grammar/spec.py).

A request's constraint is compiled here, without the model's vocabulary, so a schema, regex or grammar that does
not compile is a 400 naming the field before anything is queued."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from exl2_backend.grammar.spec import compile_grammar, grammar_problem


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema under its name (OpenAI's fields; `strict` is accepted, and the
    output always follows the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs json_schema: {name, schema}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is given but type is {self.type!r}")
        return self

    def grammar(self) -> dict | None:
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            return {"type": "json_schema", "value": self.json_schema.json_schema or {}}
        return None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (sent through the client's extra_body): exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")  # a JSON Schema (object or text)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)

    @model_validator(mode="after")
    def _exactly_one(self):
        names = ("json", "json_object", "regex", "choice", "grammar")
        given = [n for n in names if self._value(n) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, grammar (got {given or 'none'})")
        return self

    def _value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def as_grammar(self) -> dict:
        if self.json_ is not None:
            return {"type": "json_schema", "value": self.json_}
        if self.json_object:
            return {"type": "json_object"}
        if self.regex is not None:
            return {"type": "regex", "value": self.regex}
        if self.choice is not None:
            return {"type": "choice", "value": self.choice}
        return {"type": "lark", "value": self.grammar}


def checked(grammar: dict | None) -> dict | None:
    """The grammar if it is well-formed and compiles; ValueError with the reason otherwise (pydantic reports it as
    a 400 on the field being validated)."""
    if grammar is None:
        return None
    problem = grammar_problem(grammar)
    if problem is not None:
        raise ValueError(problem)
    text, message = compile_grammar(grammar)
    if text is None:
        raise ValueError(f"does not compile: {message}")
    return grammar

