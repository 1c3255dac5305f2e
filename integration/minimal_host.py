"""A minimal second host: proof that a serving framework can swap exl2_backend in through pluggy alone.

It knows only the hook contract (`exl2_backend.plugin.hookspecs` + the plain types): it finds the backend
through the `exl2_backend.backends` entry point, loads a model, and runs its own continuous-batching
scheduler over `exl2_prefill` / `exl2_decode` / `exl2_draft_verify` / `exl2_release`, optionally with
host-side drafts (prompt-lookup n-grams). No import of the backend's implementation, runtime or torch.

    python integration/minimal_host.py [MODEL_DIR] [--draft ngram] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pluggy

from exl2_backend.plugin import hookspecs
from exl2_backend.plugin.types import SequenceRequest, StepBatch

Drafter = Callable[[list[int]], list[int]]


def discover() -> pluggy.PluginManager:
    """A plugin manager holding every backend installed under the entry-point group (and nothing else)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP) == 0:
        raise RuntimeError(f"no backend installed under entry-point group {hookspecs.ENTRY_POINT_GROUP!r} "
                           "(pip install -e . in the exl2_backend checkout)")
    return pm


def ngram_drafter(k: int = 4, n: int = 2) -> Drafter:
    """Prompt lookup: find the latest earlier occurrence of the last `n` tokens, propose the `k` after it."""

    def draft(tokens: list[int]) -> list[int]:
        if len(tokens) <= n:
            return []
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
        return []

    return draft


@dataclass
class Result:
    seq_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    error: str | None = None


def generate(pm: pluggy.PluginManager, handle, requests: list[SequenceRequest], *, max_running: int = 8,
             drafter: Drafter | None = None) -> dict[str, Result]:
    """Run `requests` to completion with continuous batching: new sequences join at step boundaries, finished
    ones leave; sequences with a draft go through draft_verify, the rest through decode."""
    hook = pm.hook
    waiting = list(requests)
    context = {r.seq_id: list(r.prompt_ids or []) for r in requests}  # what the host knows (for drafting)
    results = {r.seq_id: Result(r.seq_id) for r in requests}
    prefilling: list[str] = []
    decoding: list[str] = []

    def take(ev) -> None:
        res = results[ev.seq_id]
        res.token_ids += ev.token_ids
        res.text += ev.text
        context[ev.seq_id] += ev.token_ids
        res.prompt_tokens = ev.usage.prompt_tokens
        if ev.accepted_drafts is not None:
            res.accepted_drafts += ev.accepted_drafts
        if ev.finished:
            res.finish_reason = ev.finish_reason
            res.error = str(ev.error) if ev.error is not None else None

    while waiting or prefilling or decoding:
        room = max_running - len(prefilling) - len(decoding)
        new, waiting = waiting[:max(room, 0)], waiting[max(room, 0):]
        if new or prefilling:
            events = hook.exl2_prefill(handle=handle, batch=StepBatch(seq_ids=prefilling, new=new))
            prefilling = []
            for ev in events:
                take(ev)
                if not ev.finished:
                    (decoding if ev.token_ids else prefilling).append(ev.seq_id)
        drafts = {sid: d for sid in decoding if drafter and (d := drafter(context[sid]))}
        plain = [sid for sid in decoding if sid not in drafts]
        events = []
        if drafts:
            for sid, d in drafts.items():
                results[sid].proposed_drafts += len(d)
            events += hook.exl2_draft_verify(handle=handle, batch=StepBatch(seq_ids=list(drafts), drafts=drafts))
        if plain:
            events += hook.exl2_decode(handle=handle, batch=StepBatch(seq_ids=plain))
        for ev in events:
            take(ev)
        decoding = [sid for sid in decoding if results[sid].finish_reason is None]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", nargs="?", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--draft", choices=["none", "ngram"], default="none")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    pm = discover()
    for caps in pm.hook.exl2_capabilities():
        print(f"backend {caps['name']} {caps['version']} (hook API {caps['hook_api_version']}): "
              f"formats {caps['formats']}, devices {caps['devices']}")
    handle = pm.hook.exl2_load(settings={"model_dir": args.model_dir, "device": args.device, "max_seq_len": 1024,
                                         "cache_tokens": 8192})
    prompts = ["What is the capital of France?", "Name three primary colors.", "Count from one to ten."]
    reqs = [SequenceRequest(f"q{i}", prompt_ids=handle.tokenize_chat([{"role": "user", "content": q}]),
                            temperature=0.0, max_new_tokens=args.max_new_tokens) for i, q in enumerate(prompts)]
    t0 = time.perf_counter()
    out = generate(pm, handle, reqs, drafter=ngram_drafter() if args.draft == "ngram" else None)
    dt = time.perf_counter() - t0
    for r in out.values():
        print(f"[{r.seq_id}] {r.finish_reason}: {r.text!r} (drafts accepted {r.accepted_drafts}/{r.proposed_drafts})")
    n = sum(len(r.token_ids) for r in out.values())
    print(f"{n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s); stats: {pm.hook.exl2_stats(handle=handle)}")
    pm.hook.exl2_unload(handle=handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
