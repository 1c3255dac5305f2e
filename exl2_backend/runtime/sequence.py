"""Per-sequence state: tokens, KV pages, sampling RNG, penalty counts, detokenization and stop matching."""

from __future__ import annotations

import torch

from exl2_backend.ops.reference import make_generator
from exl2_backend.runtime.logprobs import TokenLogprob
from exl2_backend.runtime.params import GenerationParams, StepEvent


def _needs_penalties(sp) -> bool:
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


def banned_stops(seq, generated: int) -> list[int] | None:
    """seq's EOS and stop token ids while `generated` < its min_new_tokens, else None."""
    if generated < seq.params.min_new_tokens and seq.stop_ids:
        return sorted(seq.stop_ids)
    return None


class Sequence:
    """One request inside the engine.

    Token positions 0..len(tokens)-1; the KV of the first `num_computed` is in the cache. While decoding,
    num_computed == len(tokens) - 1: the last sampled token is the next step's input."""

    def __init__(self, seq_id: str, prompt_ids: list[int], params: GenerationParams, *, max_total: int,
                 vocab_size: int, eos_ids: set[int], decoder, stop_matcher, grammar=None, device=None):
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.max_total = max_total  # prompt + output tokens this sequence may reach
        self.pages: list[int] = []
        self.reserved_pages = 0  # pages promised at admission but not yet allocated
        self.num_computed = 0
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache at admission
        self.finish_reason: str | None = None
        self.error: str | None = None
        # on the engine's GPU, uniforms are one kernel a row; a CPU generator spent ~0.4 ms of host time per row
        # and token drawing 128k of them (the same seed gives other draws on the CPU and on a GPU)
        self.generator = make_generator(params.sampling.seed, device if device is not None else "cpu")
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.decoder = decoder
        self.stop_matcher = stop_matcher
        self.prompt_counts = self.output_counts = None
        if _needs_penalties(params.sampling):  # counts [V] f32, only for sequences that use penalties
            self.prompt_counts = torch.bincount(torch.tensor(self.prompt_ids, dtype=torch.long),
                                                minlength=vocab_size)[:vocab_size].float()
            self.output_counts = torch.zeros(vocab_size)
        # prompt logprobs so far (the first prompt token's is None: nothing predicts it), when asked
        self.prompt_entries = None
        if params.prompt_logprobs is not None:
            self.prompt_entries = [TokenLogprob(self.prompt_ids[0], None)]
        self.logit_bias = None  # (ids int64 [n], biases f32 [n]) on the CPU
        if params.logit_bias:
            self.logit_bias = (torch.tensor(list(params.logit_bias), dtype=torch.int64),
                               torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
        self.grammar = grammar  # SequenceGrammar (exl2_backend/grammar/) when the output is constrained

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: no penalty, logit bias or grammar can change which token is the argmax (the
        greedy lookahead and greedy verification take the argmax of the logits as they come)."""
        return (self.params.sampling.temperature == 0 and self.prompt_counts is None and self.logit_bias is None
                and self.grammar is None and self.banned is None)

    @property
    def banned(self) -> list[int] | None:
        """Token ids that may not be sampled now: EOS and the stop tokens while fewer than min_new_tokens are out."""
        return banned_stops(self, len(self.output_ids))

    def banned_after(self, pending: int) -> list[int] | None:
        """`banned` once `pending` more tokens are out (the decode lookahead's step in flight)."""
        return banned_stops(self, len(self.output_ids) + pending)

    # --- sizes ------------------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_remaining(self) -> int:
        return max(len(self.prompt_ids) - self.num_computed, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_total - self.num_tokens

    @property
    def max_drafts(self) -> int:
        """Drafts one verify step may check: the step's last token is the target's own, so never past the
        length limit."""
        return max(self.remaining_new_tokens - 1, 0)

    # --- token bookkeeping ------------------------------------------------------------------------------

    def append_token(self, token: int) -> tuple[str, str | None]:
        """Record a sampled token; returns (text delta, finish reason or None)."""
        self.output_ids.append(token)
        if self.output_counts is not None and token < self.output_counts.numel():
            self.output_counts[token] += 1
        if token in self.stop_ids:
            return self._flush(), "stop"
        if self.grammar is not None and not self.grammar.consume(token):  # masked sampling never gets here
            self.error = f"token {token} is outside the request's grammar: {self.grammar.error}"
            return self._flush(), "error"
        emit, hit = self.stop_matcher.push(self.decoder.push(token))
        if hit:
            return emit, "stop"
        if self.grammar is not None and self.grammar.stopped:  # complete, and nothing may follow (EOS aside)
            return emit + self._flush(), "stop"
        if self.remaining_new_tokens <= 0:
            return emit + self._flush(), "length"
        return emit, None

    def _flush(self) -> str:
        """Text still held back (incomplete UTF-8, partial stop-string match), released at the end."""
        text = ""
        flush = getattr(self.decoder, "flush", None)
        if flush is not None:
            text = self.stop_matcher.push(flush())[0]
        flush = getattr(self.stop_matcher, "flush", None)
        return text + (flush() if flush is not None else "")

    def event(self, token_ids: list[int], text: str, logprobs: list | None = None) -> StepEvent:
        """logprobs: TokenLogprob per sampled token, when the request asked (cut to the tokens taken)."""
        return StepEvent(self.seq_id, token_ids, text, self.finish_reason, len(self.prompt_ids),
                         len(self.output_ids), self.error, self.cached_tokens,
                         None if self.params.logprobs is None else list(logprobs or [])[: len(token_ids)])
