"""The sampling defaults a model ships in generation_config.json (e.g. Llama 3.1: temperature 0.6, top_p 0.9; Qwen2.5:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05): what a request that leaves a field out gets, as vLLM's
`--generation-config auto` does. Only the keys the file sets count; `do_sample` is not read (vLLM does not either:
a model that ships do_sample false sets no temperature). A value outside its range is a ConfigError at load, not a
request that later fails."""

from __future__ import annotations

import math

from exl2_backend.errors import ConfigError
from exl2_backend.sampling import SAMPLING_RANGES

# the generation_config.json keys read, each named as the request field it is the default of
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(gen: dict, path: str | None = None) -> dict:
    """The request defaults a parsed generation_config.json sets: {field: value} for the GENERATION_KEYS present
    (null counts as absent; top_k -1 or 0 is off, i.e. 0)."""
    out: dict = {}
    for key in GENERATION_KEYS:
        value = gen.get(key)
        if value is None:
            continue
        if key in ("top_k", "max_new_tokens"):
            if isinstance(value, bool) or not isinstance(value, int) or value < (-1 if key == "top_k" else 1):
                rule = "an integer >= 0 (-1 or 0: off)" if key == "top_k" else "an integer >= 1"
                raise ConfigError(f"generation_config.json: {key}={value!r} must be {rule}", field=key, path=path)
            out[key] = max(value, 0)
            continue
        ok, rule = SAMPLING_RANGES[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ConfigError(f"generation_config.json: {key}={value!r} must be a number {rule}", field=key,
                              path=path)
        out[key] = float(value)
    return out
