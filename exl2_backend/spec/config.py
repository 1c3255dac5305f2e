"""Settings of speculative decoding that live inside `LoadSettings` (torch-free, validated at the edge)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # k; a (k+1)-token verify reads the weights once, like a decode step
MAX_SPECULATIVE_TOKENS = 15  # k + 1 <= 16 queries per sequence keeps verify on the paged decode-attention kernel


class NgramConfig(BaseModel):
    """Prompt-lookup drafting: the longest suffix of the sequence (between max_n and min_n tokens) that
    occurred before in the prompt or output proposes the tokens that followed its latest occurrence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(default=2, ge=1, le=16)
    max_n: int = Field(default=4, ge=1, le=16)

    @model_validator(mode="after")
    def _check(self) -> NgramConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"ngram min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        return self


def ngram_config(value: bool | NgramConfig | None) -> NgramConfig | None:
    """The `LoadSettings.ngram` field as a config (True -> defaults) or None when off."""
    if value is None or value is False:
        return None
    return NgramConfig() if value is True else value
