"""The Conversations API's store (serve/conversation_store.py) and bodies (serve/conversations_api.py): items kept in
order with ids, deleted one by one, least recently used conversations out past the bounds, metadata and items
checked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from exl2_backend.serve.conversation_store import ConversationStore
from exl2_backend.serve.conversations_api import AddItems, CreateConversation, checked_items
from exl2_backend.serve.responses_api import RequestFieldError


def test_items_in_order_with_ids_and_deleted_one_by_one():
    store = ConversationStore()
    conv = store.create(checked_items([{"role": "user", "content": "Hi"}]), {"topic": "t"})
    assert conv.id.startswith("conv_") and conv.as_object()["metadata"] == {"topic": "t"}
    added = store.add_items(conv.id, checked_items([{"role": "assistant", "content": "Hello"},
                                                    {"role": "user", "content": "Bye"}]))
    assert [i["content"][0]["text"] for i in store.get(conv.id).items] == ["Hi", "Hello", "Bye"]
    assert store.delete_item(conv.id, added[0]["id"]) and not store.delete_item(conv.id, added[0]["id"])
    assert [i["content"][0]["text"] for i in conv.items] == ["Hi", "Bye"] and store.bytes == conv.size > 0
    assert store.delete(conv.id) and store.get(conv.id) is None and store.bytes == 0


def test_least_recently_used_out_past_the_bounds():
    store = ConversationStore(capacity=2)
    a, b = store.create([], None), store.create([], None)
    store.get(a.id)
    c = store.create([], None)
    assert store.get(b.id) is None and store.get(a.id) and store.get(c.id)
    small = ConversationStore(max_bytes=600)
    x = small.create(checked_items([{"role": "user", "content": "x" * 300}]), None)
    y = small.create(checked_items([{"role": "user", "content": "y" * 300}]), None)
    assert small.get(x.id) is None and small.get(y.id) is not None and small.bytes <= 600


def test_bodies_are_checked():
    with pytest.raises(ValidationError):
        CreateConversation.model_validate({"metadata": {"k": 1}})
    with pytest.raises(ValidationError):
        CreateConversation.model_validate({"metadata": {f"k{i}": "v" for i in range(17)}})
    with pytest.raises(ValidationError):
        AddItems.model_validate({"items": []})
    with pytest.raises(RequestFieldError) as err:
        checked_items([{"role": "user", "content": "ok"}, {"type": "web_search_call"}])
    assert err.value.param == "items.1.type"
