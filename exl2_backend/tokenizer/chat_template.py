"""Chat templates: Jinja2 rendering with the environment Hugging Face templates are written for.

Templates in `tokenizer_config.json` assume transformers' environment: `trim_blocks` + `lstrip_blocks`, the
`loopcontrols` extension, a `raise_exception(msg)` global, `strftime_now(fmt)` and a `tojson` filter that
keeps non-ASCII text as is. We reproduce that contract (not the code) so renderings match byte for byte.
The sandbox keeps a hostile template from reaching Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from exl2_backend.errors import TokenizerError


class _TemplateRaised(jinja2.TemplateError):
    """What a template's own `raise_exception(...)` throws (e.g. 'roles must alternate')."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes '<' and '&' and sorts keys; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text; syntax errors become `TokenizerError`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


def select_template(value: Any, name: str | None = None) -> str | None:
    """The template text from a `chat_template` config value: a string, or a list of `{name, template}`.

    With a list, `name` picks one (default: the one called "default", else the first).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
            raise TokenizerError("chat_template as a list must hold {name, template} objects with string templates, "
                                 f"got {value!r:.120}")
        named = {str(t.get("name")): t.get("template") for t in value}
        if name is not None:
            if name not in named:
                raise TokenizerError(f"no chat template named {name!r} (have {sorted(named)})")
            return named[name]
        if "default" in named:
            return named["default"]
        return next(iter(named.values()), None)
    raise TokenizerError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


def cut_after_final_content(text: str, messages: list[dict]) -> str:
    """A rendered chat cut right after the last message's content (transformers' continue_final_message rule: the
    content as given, else stripped, found from the end). TokenizerError when the template does not show it."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    for needle in (content, (content or "").strip()):
        if needle and (at := text.rfind(needle)) >= 0:
            return text[: at + len(needle)]
    raise TokenizerError("continue_final_message: the last message has no content to continue, or the chat "
                         "template does not show it as given")


def render(source: str, messages: list[dict], *, add_generation_prompt: bool, special_tokens: dict[str, str | None],
           **kwargs: Any) -> str:
    """Render `source` for `messages`; every failure (including `raise_exception`) is a `TokenizerError`."""
    template = compile_template(source)
    context = {**special_tokens, **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(**context)
    except _TemplateRaised as exc:
        raise TokenizerError(f"chat template rejected the messages: {exc}") from exc
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise TokenizerError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
