"""Greedy batch decoding through the engine's public step API, with the decode lookahead on or off: what the
lookahead tests compare (runtime/lookahead.py: its tokens must equal plain graph decoding)."""

from __future__ import annotations

from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams


def run_greedy_batch(engine, prompts: dict[str, list[int]], new_tokens: dict[str, int], *, lookahead: bool,
                     schedule=None) -> dict[str, list[int]]:
    """Decode the prompts as one batch; schedule(step, engine, live) may release sequences between steps.
    -> the tokens of each sequence (its prefill's first token included); every sequence is released."""
    saved = engine.lookahead
    engine.lookahead = saved if lookahead else None
    try:
        out = {sid: [] for sid in prompts}
        for sid, p in prompts.items():
            engine.add_sequence(sid, p, GenerationParams(sampling=SamplingParams.greedy(),
                                                         max_new_tokens=new_tokens[sid], ignore_eos=True))
            while not out[sid]:
                out[sid] += engine.prefill([sid])[0].token_ids
        live = [sid for sid in prompts if not engine.seqs[sid].finished]
        step = 0
        while live:
            if schedule is not None:
                live = schedule(step, engine, live)
            for ev in engine.decode(live):
                out[ev.seq_id] += ev.token_ids
            live = [sid for sid in live if not engine.seqs[sid].finished]
            step += 1
        for sid in prompts:
            engine.release(sid)
        return out
    finally:
        engine.lookahead = saved
