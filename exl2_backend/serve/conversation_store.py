"""The Conversations API's conversations (POST/GET/DELETE /v1/conversations, their items), which a Responses request
continues with `conversation`: its items come before the request's input, and the request's input and output items
are appended once it ends (serve/openai_spec.py).

In the API process's memory, bounded like the response store: past `capacity` conversations, or past `max_bytes` of
their items as JSON, the least recently used goes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from exl2_backend.serve.bounded_store import BoundedLRU
from exl2_backend.serve.responses_api import new_id

STORED_CONVERSATIONS = 1024
CONVERSATION_BYTES = 256 * 2**20
MAX_METADATA = 16  # the OpenAI API's limit on metadata pairs


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict] = field(default_factory=list)  # in conversation order, each with an id
    size: int = 0  # bytes of the items as JSON

    def as_object(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


def metadata_problem(metadata) -> str | None:
    """Why `metadata` is not at most 16 string pairs (keys up to 64 characters, values up to 512), or None."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        return f"must be an object of at most {MAX_METADATA} string pairs"
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            return "keys must be strings of at most 64 characters, values strings of at most 512"
    return None


class ConversationStore(BoundedLRU[Conversation]):
    """Conversations by id, least recently used first out past `capacity` or `max_bytes`."""

    def __init__(self, capacity: int = STORED_CONVERSATIONS, max_bytes: int = CONVERSATION_BYTES):
        super().__init__(capacity, max_bytes)

    def create(self, items: list[dict], metadata: dict[str, str] | None) -> Conversation:
        conv = Conversation(new_id("conv"), int(time.time()), dict(metadata or {}))
        self._insert(conv.id, conv)
        self.add_items(conv.id, items)
        return conv

    def add_items(self, conversation_id: str, items: list[dict]) -> list[dict]:
        """Append items (already with ids) to a stored conversation; then evict past the bounds (never the one just
        added to, unless it alone is over them)."""
        conv = self.get(conversation_id)
        if conv is None or not items:
            return []
        size = sum(_size(item) for item in items)
        conv.items.extend(items)
        conv.size += size
        self._grew(size)
        return items

    def delete_item(self, conversation_id: str, item_id: str) -> bool:
        conv = self.get(conversation_id)
        for i, item in enumerate(conv.items if conv is not None else ()):
            if item.get("id") == item_id:
                size = _size(item)
                del conv.items[i]
                conv.size -= size
                self.bytes -= size
                return True
        return False


def _size(item: dict) -> int:
    return len(json.dumps(item, default=str))
