"""The OpenAI objects made from the worker's items: items merged when a reader fell behind, logprobs in the chat and
legacy shapes, usage, finish reasons (torch-free; used by serve/openai_spec.py)."""

from __future__ import annotations


def mergeable(a: dict, b: dict) -> bool:
    """Two token items of one stream that can travel as one (neither is an error, `a` is not the last)."""
    return "text" in a and "text" in b and not a.get("finish_reason") and "error" not in a and "error" not in b


def merge_items(a: dict, b: dict) -> dict:
    out = dict(b)  # b's finish_reason, usage and timings (only the last item carries them)
    out["text"] = a["text"] + b["text"]
    out["token_ids"] = list(a.get("token_ids") or ()) + list(b.get("token_ids") or ())
    if "logprobs" in a or "logprobs" in b:
        out["logprobs"] = list(a.get("logprobs") or ()) + list(b.get("logprobs") or ())
    if "prompt_logprobs" in a:  # only the item that completed the prompt has them
        out["prompt_logprobs"] = a["prompt_logprobs"]
    return out


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """Backend logprob entries (runtime/logprobs.logprob_entries) -> a chat choice's "logprobs" object."""
    if entries is None:
        return None

    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict] | None, offset: int) -> dict | None:
    """Backend logprob entries -> a text completion choice's legacy "logprobs" object; text_offset counts the
    tokens' own text from `offset` (the characters of completion text before them)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None  # a prompt's first token (echo)
                             else {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def empty_usage() -> dict:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}}


def add_usage(usage: dict, item: dict, *, first_of_prompt: bool, reasoning_tokens: int = 0) -> None:
    """Count a finished choice's final item into the response's usage: each prompt once (as the OpenAI API counts
    it, with the prefix-cache hit of its first choice: later choices share its pages), completions summed."""
    u = item.get("usage") or {}
    if first_of_prompt:
        usage["prompt_tokens"] += int(u.get("prompt_tokens", 0))
        usage["prompt_tokens_details"]["cached_tokens"] += int(u.get("cached_tokens", 0))
    usage["completion_tokens"] += int(u.get("completion_tokens", 0))
    usage["completion_tokens_details"]["reasoning_tokens"] += reasoning_tokens  # a reasoning model's thinking
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def finish_reason(item: dict) -> str:
    reason = item.get("finish_reason") or "stop"
    return reason if reason in ("stop", "length") else "stop"
