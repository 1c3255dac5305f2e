"""Tokenization: `Tokenizer` (tokenizer.json + chat template), streaming detokenization, stop strings."""

from exl2_backend.tokenizer.incremental import IncrementalDecoder
from exl2_backend.tokenizer.stops import StopMatcher
from exl2_backend.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDecoder", "StopMatcher", "Tokenizer"]
