"""Single-request conveniences over the step API (used by the CLI and tests): stream events, or get text."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from exl2_backend.errors import InvalidRequestError
from exl2_backend.runtime.params import GenerationParams, StepEvent

_ids = itertools.count()


def generate_stream(engine, prompt_ids: list[int], params: GenerationParams | None = None, *,
                    seq_id: str | None = None) -> Iterator[StepEvent]:
    """Admit one sequence, prefill it, decode until it finishes; yield every event that carries tokens or
    a finish. The sequence is released on every exit, including when the caller stops iterating early."""
    seq_id = seq_id or f"generate-{next(_ids)}"
    engine.add_sequence(seq_id, prompt_ids, params)
    try:
        ev = None
        while ev is None or not (ev.token_ids or ev.finish_reason):  # chunked prefill: empty events until done
            ev = engine.prefill([seq_id])[0]
        yield ev
        while not ev.finish_reason:
            ev = engine.decode([seq_id])[0]
            yield ev
    finally:
        engine.release(seq_id)


def encode_prompt(engine, prompt) -> list[int]:
    """str -> tokenized with BOS as the model wants; list of {role, content} dicts -> chat template;
    list of ints -> as is."""
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt)
    prompt = list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        return engine.tokenizer.encode_chat(prompt)
    if all(isinstance(t, int) for t in prompt):
        return prompt
    raise InvalidRequestError("prompt must be a string, a list of token ids or a list of chat messages",
                              field="prompt")


def generate_text(engine, prompt, params: GenerationParams | None = None) -> str:
    """The whole completion text of `prompt` (see `encode_prompt`)."""
    return "".join(ev.text for ev in generate_stream(engine, encode_prompt(engine, prompt), params))
