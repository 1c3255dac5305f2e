"""Batch decoding through the engine's public step API, with the decode lookahead on or off: what the
lookahead tests compare (runtime/lookahead.py: its tokens must equal plain graph decoding)."""

from __future__ import annotations

from exl2_backend.runtime import GenerationParams
from exl2_backend.sampling import SamplingParams


def run_batch(engine, prompts: dict[str, list[int]], params: dict[str, GenerationParams], *, lookahead: bool,
              schedule=None, logprobs: dict | None = None) -> dict[str, list[int]]:
    """Decode the prompts as one batch; schedule(step, engine, live, out) may release sequences (or verify
    drafts, adding their tokens to out[sid]) between steps and returns the sequences to decode. -> the tokens of
    each sequence (its prefill's first token included); every sequence is released. `logprobs`, when given,
    receives each sequence's TokenLogprob entries of its decode steps."""
    saved = engine.lookahead
    engine.lookahead = saved if lookahead else None
    try:
        out = {sid: [] for sid in prompts}
        for sid, p in prompts.items():
            engine.add_sequence(sid, p, params[sid])
            while not out[sid]:
                out[sid] += engine.prefill([sid])[0].token_ids
        live = [sid for sid in prompts if not engine.seqs[sid].finished]
        step = 0
        while live:
            if schedule is not None:
                live = schedule(step, engine, live, out)
                if not live:
                    break
            for ev in engine.decode(live):
                out[ev.seq_id] += ev.token_ids
                if logprobs is not None and ev.logprobs is not None:
                    logprobs.setdefault(ev.seq_id, []).extend(ev.logprobs)
            live = [sid for sid in live if not engine.seqs[sid].finished]
            step += 1
        for sid in prompts:
            engine.release(sid)
        return out
    finally:
        engine.lookahead = saved


def run_greedy_batch(engine, prompts: dict[str, list[int]], new_tokens: dict[str, int], *, lookahead: bool,
                     schedule=None) -> dict[str, list[int]]:
    """run_batch with every sequence greedy, ignoring EOS, for new_tokens[sid] tokens."""
    params = {sid: GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=new_tokens[sid],
                                    ignore_eos=True) for sid in prompts}
    return run_batch(engine, prompts, params, lookahead=lookahead, schedule=schedule)
