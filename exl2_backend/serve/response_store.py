"""Stored responses of the Responses API (serve/responses_api.py): what `previous_response_id`, GET / DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items read.

A response is stored unless its request said `store: false` (the OpenAI API's default is to store), once it has
completed or stopped at max_output_tokens; a failed or abandoned one is not. The store lives in the API process
(the server runs one), in memory, bounded: past `capacity` responses, or past `max_bytes` of their own input and
output (as JSON), the least recently used goes. Each entry keeps its request's own input items (with ids) and the
whole conversation up to and including its output, so a chain of `previous_response_id`s continues without walking
back (entries share their item objects; an evicted response's items live on in its descendants' conversations)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from exl2_backend.serve.bounded_store import BoundedLRU
from exl2_backend.serve.responses_api import new_id

STORED_RESPONSES = 1024  # responses kept; each holds its conversation's items (shared with its ancestors)
STORED_BYTES = 256 * 2**20  # their own input and output, as JSON text

_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as it was returned (store true)
    input_items: list[dict]  # the request's own input items, each with an id
    conversation: list[dict]  # every item up to and including this response's output: the next turn's history
    size: int  # bytes of its own input items and response as JSON (what the store's byte bound counts)


def input_items(items: str | list[dict]) -> list[dict]:
    """A request's `input` as items with ids, a message's text content as one text part (a string input is one
    user message), copied: what input_items lists."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in copy.deepcopy(items):
        kind = item.get("type", "message")
        item.setdefault("type", kind)
        item.setdefault("id", new_id(_ITEM_ID_PREFIX.get(kind, "item")))
        if kind == "message" and isinstance(item.get("content"), str):  # as the API lists them: content parts
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        out.append(item)
    return out


class ResponseStore(BoundedLRU[StoredResponse]):
    """Responses by id, least recently used first out past `capacity` or `max_bytes`."""

    def __init__(self, capacity: int = STORED_RESPONSES, max_bytes: int = STORED_BYTES):
        super().__init__(capacity, max_bytes)

    def put(self, response: dict, own_input: list[dict], history: list[dict]) -> None:
        """Store a finished response: `own_input` its request's items (input_items), `history` the conversation
        before them (the previous response's, or [])."""
        if self.capacity <= 0:
            return
        size = len(json.dumps(response, default=str)) + len(json.dumps(own_input, default=str))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        conversation = history + own_input + list(response.get("output") or ())
        self._insert(response["id"], StoredResponse(response, own_input, conversation, size))


def item_page(items: list[dict], *, order: str = "desc", limit: int = 20, after: str | None = None,
              owner: str = "response") -> dict:
    """GET .../input_items and .../items: a list page of `items` (stored in order), newest first unless order is asc,
    starting after the item `after` (ValueError naming the `owner`, "response" or "conversation", for an unknown
    one)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ValueError(f"no {'input ' if owner == 'response' else ''}item {after!r} in this {owner}")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
