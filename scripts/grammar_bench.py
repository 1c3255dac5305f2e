"""What constrained output costs per token on the GPU: the same greedy decode of one sequence, timed three ways in
one process on one model directory (e.g. the random 8B that `bench --shape llama3-8b --model-out` writes):

- plain: the greedy lookahead (graph I/O), the engine's fastest path;
- eager: logprobs=0, which leaves the lookahead for eager sampling (the path every constrained sequence takes);
- grammar: a permissive regex, so the mask work is added to the eager path.

    python scripts/grammar_bench.py /tmp/models/llama3-8b --tokens 128 --json out.json

Prints ms per token and the ratios; each variant is run twice, interleaved, and the faster run is kept."""

from __future__ import annotations

import argparse
import json
import time

import torch

# any run of lowercase words: constrains every step (the mask is computed and applied) without ending early
PERMISSIVE = {"type": "regex", "value": "[a-z]+( [a-z]+)*"}


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _decode_ms(engine, prompt: list[int], params, sid: str) -> float:
    engine.add_sequence(sid, prompt, params)
    events = engine.prefill([sid])
    while not events[0].token_ids and not events[0].finished:
        events = engine.prefill([sid])
    _sync(engine)
    t0, n = time.perf_counter(), 0
    while not events[0].finished:
        events = engine.decode([sid])
        n += len(events[0].token_ids)
    _sync(engine)
    elapsed = time.perf_counter() - t0
    engine.release(sid)
    return 1000 * elapsed / max(n, 1)


def main(argv=None) -> int:
    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    engine = Engine.load(LoadSettings(model_dir=args.model_dir, device=args.device, max_seq_len=1024,
                                       max_batch_size=1))
    engine.vocabulary()  # built at load in a server (exl2_load)
    prompt = torch.randint(300, 5000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams.greedy()
    variants = {
        "plain": GenerationParams(sampling=greedy, max_new_tokens=args.tokens, ignore_eos=True),
        "eager": GenerationParams(sampling=greedy, max_new_tokens=args.tokens, ignore_eos=True, logprobs=0),
        "grammar": GenerationParams(sampling=greedy, max_new_tokens=args.tokens, ignore_eos=True, grammar=PERMISSIVE),
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(2):
        for name, params in variants.items():
            runs[name].append(_decode_ms(engine, prompt, params, f"{name}{round_}"))
    best = {name: min(ms) for name, ms in runs.items()}
    for name, ms in best.items():
        print(f"{name:8s} {ms:7.3f} ms/token  ({1000 / ms:7.1f} tok/s)  runs {runs[name]}")
    print(f"eager / plain {best['eager'] / best['plain']:.3f}; grammar / eager {best['grammar'] / best['eager']:.3f}; "
          f"grammar / plain {best['grammar'] / best['plain']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms_per_token": best, "runs": runs, "tokens": args.tokens,
                       "grammar": PERMISSIVE, "device": str(engine.device)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
