"""A seeded, bounded random schedule of requests through the hooks on the real default model (CPU): every feature
of the request (grammars, logprobs, prompt logprobs, logit bias, min_new_tokens, penalties, sampling, stop
strings, host drafts) mixed with admissions, cancellations and chunked prompts in a deliberately small KV cache.
After every hook call the page accounting must hold (no leaked or double-held page); every sequence ends exactly
once; a finished constrained sequence's text conforms; min_new_tokens holds."""

from __future__ import annotations

import json
import random
import re

import pytest

from exl2_backend.plugin.manager import new_plugin_manager
from exl2_backend.plugin.types import SequenceRequest, StepBatch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = {"device": "cpu", "max_seq_len": 160, "cache_tokens": 640, "page_size": 16, "max_batch_size": 6,
            "max_chunk_size": 24}
CALLS = 160  # hook calls in all: the schedule is bounded, whatever it draws
PROMPTS = ["Write a haiku about the sea.", "List three colors.", "What is 2 + 2?",
           "Return a JSON object with the name and age of Ann, who is 31.", "Say yes or no: is the sky blue?"]
GRAMMARS = [
    ({"type": "json_schema", "value": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                       "additionalProperties": False}}, lambda t: set(json.loads(t)) == {"a"}),
    ({"type": "regex", "value": "(yes|no)[.!]"}, lambda t: re.fullmatch("(yes|no)[.!]", t)),
    ({"type": "choice", "value": ["red", "green"]}, lambda t: t in ("red", "green")),
]


def _request(rng: random.Random, sid: str) -> tuple[SequenceRequest, object]:
    kw = {"max_new_tokens": rng.choice([1, 4, 12, 30]), "temperature": rng.choice([0.0, 0.0, 0.8]),
          "seed": rng.randrange(1000)}
    check = None
    roll = rng.random()
    if roll < 0.25:
        grammar, check = rng.choice(GRAMMARS)
        kw.update(grammar=grammar, max_new_tokens=40)
    elif roll < 0.4:
        kw.update(logprobs=rng.choice([0, 2]), prompt_logprobs=rng.choice([None, 1]))
    elif roll < 0.5:
        kw.update(logit_bias={rng.randrange(100, 5000): rng.choice([-100.0, 5.0])}, repetition_penalty=1.2)
    elif roll < 0.6:
        kw.update(min_new_tokens=min(3, kw["max_new_tokens"]), stop=["."])
    source = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]} if rng.random() < 0.7 else \
        {"prompt": rng.choice(PROMPTS) * rng.choice([1, 4])}
    return SequenceRequest(sid, **source, **kw), check


@pytest.mark.parametrize("speculation", [{}, {"ngram": True}], ids=["plain", "ngram"])
def test_random_schedules_keep_every_invariant(default_model_dir, speculation):
    pm = new_plugin_manager(builtin_fallback=True)
    hook = pm.hook
    h = hook.exl2_load(settings={"model_dir": str(default_model_dir), **SETTINGS, **speculation})
    rng = random.Random(20261205)
    live: dict[str, dict] = {}  # sid -> {"req", "check", "text", "tokens", "prefilling"}
    ended: set[str] = set()
    next_id = 0

    def take(events) -> None:
        for ev in events:
            assert ev.seq_id not in ended, f"{ev.seq_id} got an event after it ended"
            st = live.get(ev.seq_id)
            if st is None:  # refused at admission
                assert ev.finish_reason == "error" and ev.error is not None
                ended.add(ev.seq_id)
                continue
            st["text"] += ev.text
            st["tokens"] += ev.token_ids
            if ev.token_ids:
                st["prefilling"] = False
            if ev.logprobs is not None:
                assert len(ev.logprobs) == len(ev.token_ids)
            if ev.finished:
                ended.add(ev.seq_id)
                del live[ev.seq_id]
                req, check = st["req"], st["check"]
                if ev.finish_reason == "stop" and check is not None:
                    assert check(st["text"]), (req.grammar, st["text"])
                if req.min_new_tokens:  # no EOS among the first min_new_tokens (a stop string may end it sooner)
                    assert not set(st["tokens"][: req.min_new_tokens]) & h.engine.eos_ids, st["tokens"]
        h.engine.assert_no_leaks()

    try:
        for _ in range(CALLS):
            action = rng.random()
            prefilling = [s for s, st in live.items() if st["prefilling"]]
            decoding = [s for s, st in live.items() if not st["prefilling"]]
            if (action < 0.3 or not live) and len(live) < SETTINGS["max_batch_size"] + 1:  # one over: a refusal
                new = []
                for _ in range(rng.randint(1, 3)):
                    req, check = _request(rng, f"s{next_id}")
                    next_id += 1
                    live[req.seq_id] = {"req": req, "check": check, "text": "", "tokens": [], "prefilling": True}
                    new.append(req)
                events = hook.exl2_prefill(handle=h, batch=StepBatch(seq_ids=prefilling, new=new))
                for req in new:  # refused ones are not live
                    if any(ev.seq_id == req.seq_id and ev.error is not None and ev.finish_reason == "error"
                           and not ev.token_ids for ev in events) and req.seq_id in live:
                        del live[req.seq_id]
                take(events)
            elif prefilling and action < 0.45:
                take(hook.exl2_prefill(handle=h, batch=StepBatch(seq_ids=prefilling)))
            elif decoding and action < 0.85:
                take(hook.exl2_decode(handle=h, batch=StepBatch(seq_ids=decoding)))
            elif decoding and action < 0.93:  # host drafts: random tokens, mostly rejected
                drafts = {s: [rng.randrange(49152) for _ in range(rng.randint(1, 3))] for s in decoding}
                take(hook.exl2_draft_verify(handle=h, batch=StepBatch(seq_ids=decoding, drafts=drafts)))
            elif live:
                victims = rng.sample(list(live), k=min(len(live), rng.randint(1, 2)))
                take(hook.exl2_release(handle=h, seq_ids=victims))
        take(hook.exl2_release(handle=h, seq_ids=list(live)))
        assert not live
        stats = h.stats()
        assert stats["live_sequences"] == 0 and stats["reserved_pages"] == 0
        assert stats["free_pages"] == stats["total_pages"]
        assert next_id > 20  # the schedule really exercised admissions
    finally:
        hook.exl2_unload(handle=h)
