"""Log-probabilities of sampled tokens (the OpenAI API's logprobs / top_logprobs).

They are of the model's own distribution: log_softmax of the raw logits, before penalties, temperature and
the top-k / top-p / min-p filters (vLLM's default, "raw logprobs"), so a token's logprob does not depend on how
it was drawn. Computed only for sequences that ask (GenerationParams.logprobs), from the logits rows the
sampler read, in eager steps and in the decode lookahead's (logprob_tensors there, read back with the tokens)."""

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


def logprob_tensors(logits: torch.Tensor, ids: torch.Tensor, k: int):
    """logits [R, V], ids int64 [R] on the logits' device (every id in [0, V)), k alternatives -> (the ids'
    logprobs f32 [R], the k best logprobs [R, k] most likely first, their ids int64 [R, k]), on the device without a
    host sync: log_softmax of the raw logits."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(-1, ids[:, None])[:, 0]  # [R]
    k = min(k, lp.shape[-1])
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])  # [R, k]
    return chosen, top_vals, top_ids


def entries_from(tokens: list[int], chosen: list[float], top_vals: list[list[float]], top_ids: list[list[int]],
                 top_n: list[int]) -> list[TokenLogprob]:
    """logprob_tensors' results as host lists -> one TokenLogprob per row, top_n[r] alternatives each."""
    return [TokenLogprob(t, c, tuple(zip(top_ids[r][:n], top_vals[r][:n])))
            for r, (t, c, n) in enumerate(zip(tokens, chosen, top_n))]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """logits [R, V] (one row per sampled token), tokens [R] ids in [0, V), top_n [R] alternatives wanted per
    row (0..sampling.MAX_TOP_LOGPROBS) -> one TokenLogprob per row. One device-to-host copy for all rows."""
    if not tokens:
        return []
    ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    chosen, top_vals, top_ids = logprob_tensors(logits, ids, max(top_n))
    return entries_from(tokens, chosen.tolist(), top_vals.tolist(), top_ids.tolist(), top_n)


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
