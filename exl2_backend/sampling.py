"""Per-request sampling parameters, validated at construction (the sampler itself is in ops/reference_sampling.py
and, later, the CUDA library)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from exl2_backend.errors import SamplingParamsError

_SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes an unsigned 64-bit seed
# Where valid values meet fp32 (SamplingParams._into_fp32_range): temperatures below MIN_TEMPERATURE are greedy,
# top_p is at least MIN_TOP_P (the same kept set for vocabularies under 10^7), repetition penalties are held
# within [1 / BOUND, BOUND] (a penalized logit stays finite and ranks the same).
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-7
REPETITION_PENALTY_BOUND = 1e6


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise SamplingParamsError(f"{name} must be a number, got {value!r}", field=name)
    value = float(value)
    if not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be finite, got {value!r}", field=name)
    return value


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SamplingParamsError(f"{name} must be an integer, got {value!r}", field=name)
    return int(value)


MAX_TOP_LOGPROBS = 20  # most likely alternatives reported per token at most (the OpenAI API's limit)
MAX_LOGIT_BIAS = 100.0  # the OpenAI API's range: +-100 bans or forces a token


# The checks of the logprobs counts and logit_bias, shared by GenerationParams, the plugin's SequenceRequest and
# the OpenAI schema so each refuses exactly the same values: None when fine, else the rule and the value.
def logprobs_count_problem(value) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP_LOGPROBS):
        return None
    return f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the most likely alternatives per token), got " \
           f"{value!r}"


def min_new_tokens_problem(min_new, max_new) -> str | None:
    """min_new: an integer >= 0, at most max_new (an integer, or None: up to the context)."""
    if isinstance(min_new, bool) or not isinstance(min_new, int) or min_new < 0:
        return f"must be an integer >= 0, got {min_new!r}"
    if isinstance(max_new, int) and min_new > max_new:
        return f"({min_new}) must not exceed max_new_tokens ({max_new})"
    return None


def logit_bias_problem(bias) -> str | None:
    """bias: {token id: number} (ids integers >= 0, numbers finite in [-100, 100]) or None."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        return f"must map token ids to numbers, got {type(bias).__name__}"
    for key, value in bias.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            return f"keys must be token ids (integers >= 0), got {key!r}"
        if isinstance(value, bool) or not isinstance(value, Real) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            return f"the bias of token {key} must be a number in [-100, 100], got {value!r}"
    return None

def generation_field_problem(request) -> tuple[str, str] | None:
    """The first of a request's generation fields (min_new_tokens, logprobs, prompt_logprobs, logit_bias, grammar)
    that breaks its rule, as (field, rule and value), or None. GenerationParams and the plugin's SequenceRequest
    share it, so the engine and a host refuse exactly the same values."""
    from exl2_backend.grammar.spec import grammar_problem  # torch-free too

    checks = (("min_new_tokens", min_new_tokens_problem(request.min_new_tokens, request.max_new_tokens)),
              ("logprobs", logprobs_count_problem(request.logprobs)),
              ("prompt_logprobs", logprobs_count_problem(request.prompt_logprobs)),
              ("logit_bias", logit_bias_problem(request.logit_bias)),
              ("grammar", grammar_problem(request.grammar)))
    return next(((name, problem) for name, problem in checks if problem is not None), None)


# Valid ranges of the float sampling fields: (predicate, rule for the message). Shared with the plugin's
# request validation so a host and the engine reject exactly the same values.
SAMPLING_RANGES = {
    "temperature": (lambda x: x >= 0, ">= 0"),
    "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "min_p": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "repetition_penalty": (lambda x: x > 0, "> 0"),
    "frequency_penalty": (lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "presence_penalty": (lambda x: -2 <= x <= 2, "in [-2, 2]"),
}


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off; penalties 1 / 0 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 0; applied to tokens seen in prompt or output
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI semantics over output tokens
    presence_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None  # per-sequence generator seed; None = fresh entropy

    def __post_init__(self):
        for name, (ok, rule) in SAMPLING_RANGES.items():
            value = _real(name, getattr(self, name))
            if not ok(value):
                raise SamplingParamsError(f"{name} must be {rule}, got {value!r}", field=name)
            object.__setattr__(self, name, value)
        self._into_fp32_range()
        top_k = _int("top_k", self.top_k)
        if top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (0 = off), got {top_k}", field="top_k")
        object.__setattr__(self, "top_k", top_k)
        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not 0 <= seed < _SEED_LIMIT:
                raise SamplingParamsError(f"seed must be an integer in [0, 2^64), got {seed}", field="seed")
            object.__setattr__(self, "seed", seed)

    def _into_fp32_range(self) -> None:
        """Valid values that the fp32 sampler cannot carry act as the nearest ones it can, which sample the same
        way. Unmapped, a temperature of 1e-40 made the scaled logits inf and a top_p of 1e-50 became 0 in fp32:
        NaN rows, from which the sampler silently drew token 0."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy (vLLM draws the same line)
        # any top_p up to the top token's probability (>= 1 / vocab) keeps that token alone
        object.__setattr__(self, "top_p", max(self.top_p, MIN_TOP_P))
        rp = min(max(self.repetition_penalty, 1 / REPETITION_PENALTY_BOUND), REPETITION_PENALTY_BOUND)
        object.__setattr__(self, "repetition_penalty", rp)

    @property
    def is_greedy(self) -> bool:
        """Deterministic argmax: temperature 0 or top_k 1 (equal results, ties to the lowest id)."""
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0)
