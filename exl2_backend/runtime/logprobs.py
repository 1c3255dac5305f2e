"""Log-probabilities of sampled tokens (the OpenAI API's logprobs / top_logprobs).

They are of the model's own distribution: log_softmax of the raw logits, before penalties, temperature and
the top-k / top-p / min-p filters (vLLM's default, "raw logprobs"), so a token's logprob does not depend on how
it was drawn. Computed only for sequences that ask (GenerationParams.logprobs), from the logits rows the
sampler read; such sequences take the eager sampling path (the greedy lookahead keeps no logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its logprob, and the `n` most likely tokens of that step, most likely first. A prompt's first
    token has logprob None (nothing before it predicts it)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """logits [R, V] (one row per sampled token), tokens [R] ids in [0, V), top_n [R] alternatives wanted per
    row (0..sampling.MAX_TOP_LOGPROBS) -> one TokenLogprob per row. One device-to-host copy for all rows."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(tokens, dtype=torch.int64, device=lp.device)[:, None]
    chosen = lp.gather(-1, ids)[:, 0].tolist()  # [R]
    k = min(max(top_n), lp.shape[-1])
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, :0])  # [R, k], most likely first
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(top_ids[r][:n], top_vals[r][:n])))
            for r, (t, c, n) in enumerate(zip(tokens, chosen, top_n))]


def logprob_entries(logprobs: list[TokenLogprob], tokenizer, token_bytes=None) -> list[dict]:
    """TokenLogprobs -> JSON-able entries (the hook API's Event.logprobs): per token {"token_id", "token",
    "logprob", "bytes", "top_logprobs": [{"token_id", "token", "logprob", "bytes"}, ...]}. "token" is the id
    decoded on its own (special tokens included; a token that holds part of a UTF-8 character shows U+FFFD),
    "bytes" the token's own bytes from `token_bytes(id)` (so the bytes of consecutive tokens join into the exact
    text, as the OpenAI API means them), or that text's UTF-8 without it. A logprob of -inf (a token the model
    rules out) becomes -9999.0, as the OpenAI API reports it, so the entries stay valid JSON; a prompt's first
    token has "logprob" and "top_logprobs" None."""
    cache: dict[int, str] = {}

    def entry(token_id: int, logprob: float | None) -> dict:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        raw = token_bytes(token_id) if token_bytes is not None else text.encode("utf-8", "surrogatepass")
        return {"token_id": token_id, "token": text, "logprob": None if logprob is None else max(logprob, -9999.0),
                "bytes": list(raw)}

    return [{**entry(lp.token_id, lp.logprob),
             "top_logprobs": None if lp.logprob is None else [entry(t, v) for t, v in lp.top]} for lp in logprobs]
