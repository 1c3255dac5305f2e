"""How the OpenAI spec merges token items that reached it together (serve/openai_spec.merge_items) and writes
logprob entries in the chat and legacy shapes: no entry is lost or reordered, the prompt's entries survive a
merge, a prompt's first token has null logprobs."""

from __future__ import annotations

from exl2_backend.serve.openai_items import chat_logprobs, completion_logprobs, merge_items, mergeable


def _entry(token: str, logprob, top=()):
    top_entries = None if logprob is None else [{"token_id": 0, "token": t, "logprob": v, "bytes": list(t.encode())}
                                                for t, v in top]
    return {"token_id": 0, "token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": top_entries}


def test_merged_items_keep_every_entry_and_the_prompts():
    prompt = [_entry("The", None), _entry(" sea", -2.0, [(" sky", -1.0)])]
    a = {"text": " is", "token_ids": [1], "finish_reason": None, "logprobs": [_entry(" is", -0.5)],
         "prompt_logprobs": prompt}
    b = {"text": " blue", "token_ids": [2], "finish_reason": "length", "logprobs": [_entry(" blue", -0.25)],
         "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    assert mergeable(a, b)
    m = merge_items(a, b)
    assert m["text"] == " is blue" and m["token_ids"] == [1, 2] and m["finish_reason"] == "length"
    assert [e["token"] for e in m["logprobs"]] == [" is", " blue"] and m["prompt_logprobs"] == prompt
    assert m["usage"] == b["usage"]


def test_legacy_and_chat_shapes():
    entries = [_entry("The", None), _entry(" sea", -2.0, [(" sky", -1.0), (" sea", -2.0)])]
    legacy = completion_logprobs(entries, 3)
    assert legacy == {"tokens": ["The", " sea"], "token_logprobs": [None, -2.0],
                      "top_logprobs": [None, {" sky": -1.0, " sea": -2.0}], "text_offset": [3, 6]}
    chat = chat_logprobs(entries[1:])
    assert chat["refusal"] is None
    assert chat["content"] == [{"token": " sea", "logprob": -2.0, "bytes": list(b" sea"),
                                "top_logprobs": [{"token": " sky", "logprob": -1.0, "bytes": list(b" sky")},
                                                 {"token": " sea", "logprob": -2.0, "bytes": list(b" sea")}]}]
    assert chat_logprobs(None) is None and completion_logprobs(None, 0) is None
