"""Request bodies of the Conversations API (serve/conversation_store.py holds the conversations): create, update
and add items. Items are the Responses API's input items, checked by the same translation into chat messages."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exl2_backend.serve.conversation_store import metadata_problem
from exl2_backend.serve.response_store import input_items
from exl2_backend.serve.responses_api import RequestFieldError, input_messages

MAX_ADDED_ITEMS = 20  # the OpenAI API's limit per create / add


def _metadata(v):
    problem = metadata_problem(v)
    if problem is not None:
        raise ValueError(problem)
    return v


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[dict] | None = Field(default=None, max_length=MAX_ADDED_ITEMS)
    metadata: dict | None = None
    _metadata = field_validator("metadata")(_metadata)


class UpdateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: dict
    _metadata = field_validator("metadata")(_metadata)


class AddItems(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[dict] = Field(min_length=1, max_length=MAX_ADDED_ITEMS)


def checked_items(items: list[dict] | None) -> list[dict]:
    """Items as stored (ids, text parts); RequestFieldError("items.<i>...: <why>") for one with no chat translation."""
    if not items:
        return []
    try:
        input_messages(None, items)
    except RequestFieldError as exc:
        raise RequestFieldError("items" + str(exc).removeprefix("input")) from None
    return input_items(items)
