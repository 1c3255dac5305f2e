"""The Responses API's store (serve/response_store.py): least recently used out past its capacity or its bytes, a
chain's conversation built from its parent's, input items with ids, and their list pages."""

from __future__ import annotations

import pytest

from exl2_backend.serve.response_store import ResponseStore, input_items, item_page


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "id": f"msg_{rid}", "role": "assistant",
                                                         "content": [{"type": "output_text", "text": text}]}]}


def test_least_recently_used_goes_past_capacity():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(_response(rid, rid), input_items(rid), [])
    assert store.get("a") is not None  # now the most recent
    store.put(_response("c", "c"), input_items("c"), [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    off = ResponseStore(capacity=0)
    off.put(_response("x", "x"), input_items("x"), [])
    assert len(off) == 0


def test_the_byte_bound():
    store = ResponseStore(capacity=100, max_bytes=2000)
    for n in range(10):
        store.put(_response(f"r{n}", "x" * 300), input_items("y" * 100), [])
    assert 0 < store.bytes <= 2000 and store.get("r9") is not None and store.get("r0") is None
    kept = len(store)
    store.put(_response("huge", "z" * 5000), input_items("q"), [])  # larger than the store: not kept
    assert store.get("huge") is None and len(store) == kept
    for rid in [r for r in (f"r{n}" for n in range(10)) if store.get(r) is not None]:
        store.delete(rid)
    assert store.bytes == 0


def test_a_chain_carries_the_whole_conversation():
    store = ResponseStore()
    store.put(_response("r1", "Hello Ada."), input_items("I am Ada."), [])
    first = store.get("r1")
    store.put(_response("r2", "Ada."), input_items("Who am I?"), first.conversation)
    second = store.get("r2")
    texts = [item["content"][0]["text"] for item in second.conversation]  # string inputs as text parts
    assert texts == ["I am Ada.", "Hello Ada.", "Who am I?", "Ada."]
    assert [item["content"][0]["text"] for item in second.input_items] == ["Who am I?"]


def test_input_items_get_ids_and_are_copies():
    given = [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c", "output": "1"},
             {"type": "message", "role": "user", "content": "x", "id": "msg_mine"}]
    items = input_items(given)
    assert [i["id"][:4] for i in items[:2]] == ["msg_", "fco_"] and items[2]["id"] == "msg_mine"
    assert items[0]["type"] == "message" and "id" not in given[0]
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi"}] and given[0]["content"] == "Hi"


def test_pages():
    items = [{"id": f"i{n}"} for n in range(5)]
    page = item_page(items, limit=2)
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"] and page["last_id"] == "i3"
    page = item_page(items, limit=2, after="i3")
    assert [i["id"] for i in page["data"]] == ["i2", "i1"] and page["has_more"]
    page = item_page(items, order="asc", limit=10, after="i2")
    assert [i["id"] for i in page["data"]] == ["i3", "i4"] and not page["has_more"]
    assert item_page([], limit=5) == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                      "has_more": False}
    with pytest.raises(ValueError, match="no input item"):
        item_page(items, after="nope")
