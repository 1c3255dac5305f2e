"""N-gram drafting offline: tokens per verify step of proposer settings, from one greedy transcript per workload.

Greedy speculation emits exactly the plain greedy tokens, so how many drafts a verify step accepts depends only
on the transcript: at each step the proposer sees prompt + output so far, drafts up to k tokens, and the step
emits the matching prefix plus one token. This replays that for several (min_n, max_n, k) settings on the
transcripts of `scripts/spec_bench.py`'s workloads (generated here, greedy, on any device) and prints tokens per
step; with verify costs relative to a decode step (measured by `spec_bench.py`: `--costs 1.168,1.274,1.429,1.811`
for k = 1, 2, 4, 8 on the 8B shape, 2026-12-02 G3) it also prints the expected speed-up, each step costed by its
draft width (a step with no draft is a plain decode step).

    python scripts/ngram_sim.py [--model DIR] [--device cpu] [--max-new 160] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl2_backend.spec.config import NgramConfig
from exl2_backend.spec.ngram import NgramIndex

SETTINGS = [(2, 4, 4), (2, 4, 8), (1, 4, 4), (3, 6, 4), (2, 8, 8), (2, 4, 16)]  # (min_n, max_n, k)


def replay(prompt: list[int], output: list[int], min_n: int, max_n: int, k: int) -> dict:
    """Verify steps a greedy speculative decode of `output` takes with this proposer (plain decode: len(output))."""
    index = NgramIndex(NgramConfig(min_n=min_n, max_n=max_n))
    tokens = list(prompt)
    pos, steps, drafted, accepted = 0, 0, 0, 0
    hist: dict[int, int] = {}
    while pos < len(output):
        proposal = index.propose(tokens, min(k, len(output) - pos - 1)) if pos + 1 < len(output) else []
        a = 0
        while a < len(proposal) and proposal[a] == output[pos + a]:
            a += 1
        emit = a + 1
        tokens.extend(output[pos : pos + emit])
        pos += emit
        steps += 1
        drafted += len(proposal)
        accepted += a
        hist[len(proposal)] = hist.get(len(proposal), 0) + 1
    return {"steps": steps, "tokens_per_step": len(output) / steps, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "draft_len_histogram": hist}


def step_cost(width: int, costs: dict[int, float]) -> float:
    """Cost of a step relative to a plain decode step. A step with no draft IS a plain decode step (the
    engine's verify of zero drafts runs the decode path: runtime/engine.py _decode_group); a draft of `width`
    tokens costs the measured verify of that width, interpolated linearly between measured widths."""
    table = {0: 1.0, **costs}
    if width in table:
        return table[width]
    lo = max(w for w in table if w < width)
    hi = min((w for w in table if w > width), default=None)
    if hi is None:
        raise ValueError(f"no verify cost measured for a draft of {width} tokens or more")
    return table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)


def expected_speedup(r: dict, costs: dict[int, float]) -> float:
    """Plain decode steps (one per token) over the cost of the replayed steps, each by its draft width."""
    tokens = r["tokens_per_step"] * r["steps"]
    return tokens / sum(n * step_cost(w, costs) for w, n in r["draft_len_histogram"].items())


def transcripts(model: str | None, device: str, max_new: int) -> dict[str, tuple[list[int], list[int]]]:
    from spec_bench import WORKLOADS

    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.sampling import SamplingParams

    if model is None:
        from exl2_backend.default_model.prepare import ensure_default_model

        model = str(ensure_default_model())
    engine = Engine.load(LoadSettings(model_dir=model, device=device, max_seq_len=2048, max_batch_size=1))
    tok = engine.tokenizer
    out = {}
    for name, text in WORKLOADS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=max_new)
        engine.add_sequence(name, prompt, params)
        toks: list[int] = []
        for ev in engine.prefill([name]):
            toks += ev.token_ids
        while len(toks) < max_new:
            evs = engine.decode([name])
            for ev in evs:
                toks += ev.token_ids
            if any(ev.finished for ev in evs):
                break
        engine.release(name)
        out[name] = (prompt, toks)
        print(f"[ngram_sim] {name}: {len(prompt)} prompt tokens, {len(toks)} generated", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="EXL2 model directory (default: the embedded default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--costs", default="1.168,1.274,1.429,1.811", help="verify cost / decode step at k = 1,2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    costs = dict(zip((1, 2, 4, 8), (float(c) for c in args.costs.split(","))))
    data = transcripts(args.model, args.device, args.max_new)
    results = {}
    for name, (prompt, output) in data.items():
        results[name] = {}
        for min_n, max_n, k in SETTINGS:
            r = replay(prompt, output, min_n, max_n, k)
            if k in costs:
                r["expected_speedup"] = expected_speedup(r, costs)
            results[name][f"min{min_n}_max{max_n}_k{k}"] = r
            sp = r.get("expected_speedup")
            print(f"{name:14s} min_n {min_n} max_n {max_n} k {k:2d}: {r['tokens_per_step']:.2f} tokens/step, "
                  f"accept {r['acceptance_rate']:.0%}"
                  + (f", expected x{sp:.2f} at the 8B's verify cost" if sp else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
