"""Per-request generation parameters and the per-step event the engine reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from exl2_backend.errors import InvalidRequestError
from exl2_backend.runtime.logprobs import TokenLogprob
from exl2_backend.sampling import SamplingParams, generation_field_problem

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class GenerationParams:
    """What to generate: sampling settings and when to stop.

    max_new_tokens None means "until the context (max_seq_len) is full". Stop strings end generation
    with the matched string removed from the text; stop_token_ids end it like EOS (even with ignore_eos)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int | None = 256
    min_new_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens (stop strings can)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's logprob and the n most likely (runtime/logprobs.py)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's logprob (the first has none) and n
    # alternatives, on the event that completes the prompt (its prefix is computed, not taken from the cache)
    grammar: dict | None = None  # {"type": json_object | json_schema | regex | lark | choice, "value": ...}: the
    # output is constrained to it (exl2_backend/grammar/spec.py); it ends when the grammar is complete

    def __post_init__(self):
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise InvalidRequestError(f"max_new_tokens must be a positive integer or None, got {self.max_new_tokens!r}",
                                      field="max_new_tokens")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", field="stop")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids", field="stop_token_ids")
        problem = generation_field_problem(self)
        if problem is not None:
            raise InvalidRequestError(f"{problem[0]} {problem[1]}", field=problem[0])
        if self.logit_bias is not None:  # {id: float}; an empty mapping is no bias
            self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()} or None


@dataclass
class StepEvent:
    """What one engine step produced for one sequence.

    token_ids: tokens sampled this step (empty while a prompt is still being prefilled); text: the new
    decoded text, held back while a stop string may be forming or a UTF-8 character is incomplete;
    prompt_tokens / completion_tokens: running totals (usage); cached_tokens: prompt tokens whose KV came
    from the prefix cache instead of being computed."""

    seq_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token (the first's logprob None), when
    # asked, on the event that completes the prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
