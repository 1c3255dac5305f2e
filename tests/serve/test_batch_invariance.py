"""Continuous batching must not change greedy output: 16 concurrent streams (joining the batch at different
steps) produce exactly what each prompt produces alone, on CPU."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct-exl2"
MAX_TOKENS = 8
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 2 plus 2?", "Say hello in Spanish.",
    "What animal barks?", "Name a planet.", "What do bees make?", "What is the opposite of hot?",
    "Name a fruit that is yellow.", "How many legs does a spider have?", "What color is the sky?",
    "Name a musical instrument.", "What is frozen water called?", "Which ocean is the largest?",
    "What language is spoken in Brazil?", "Name a shape with three sides.",
]


def _messages(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def test_16_concurrent_greedy_streams_equal_each_alone(server, client):
    alone = []
    for q in QUESTIONS:
        r = client.chat.completions.create(model=MODEL, messages=_messages(q), temperature=0, max_tokens=MAX_TOKENS)
        alone.append((r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason))

    async def one(ac, i, q):
        await asyncio.sleep(0.05 * i)  # staggered arrival: sequences join a batch that is already decoding
        stream = await ac.chat.completions.create(model=MODEL, messages=_messages(q), temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True,
                                                  stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            if c.usage is not None:
                usage = c.usage.completion_tokens
        return text, usage, finish

    async def main():
        ac = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(ac, i, q) for i, q in enumerate(QUESTIONS)))
        finally:
            await ac.close()

    together = asyncio.run(main())
    mismatches = [(q, a, b) for q, a, b in zip(QUESTIONS, alone, together) if a != b]
    assert not mismatches, f"{len(mismatches)} of 16 differ when batched: {mismatches[:3]}"
