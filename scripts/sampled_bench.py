"""What sampling costs per token on the GPU, with and without the decode lookahead: one sequence decoded greedy,
sampled (temperature only, and with top-k / top-p) and greedy under a grammar, each with the lookahead on and off,
in one process on one model directory (e.g. the random 8B that `bench --shape llama3-8b --model-out` writes).
`reference` is the eager path with the reference's torch-op sampler on the GPU and CPU generators (eager sampling
before session 30).

    python scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json out.json

Prints ms per token and each variant's ratio to greedy with the lookahead; every variant runs twice, interleaved,
and the faster run is kept."""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch

# any run of lowercase words: constrains every step without ending early
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


@contextmanager
def _variant(engine, lookahead: bool, reference: bool):
    from exl2_backend.ops import reference as ref
    from exl2_backend.runtime import sampler, sequence

    saved, saved_sampler, saved_generator = engine.lookahead, sampler.sample_tokens, sequence.make_generator
    engine.lookahead = saved if lookahead else None
    if reference:  # the torch-op sampler on the GPU, uniforms from CPU generators
        sampler.sample_tokens = ref.sample_tokens
        sequence.make_generator = lambda seed, device="cpu": saved_generator(seed, "cpu")
    try:
        yield
    finally:
        engine.lookahead, sampler.sample_tokens, sequence.make_generator = saved, saved_sampler, saved_generator


def main(argv=None) -> int:
    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-seq-len", type=int, default=1024)
    args = p.parse_args(argv)
    engine = Engine.load(LoadSettings(model_dir=args.model_dir, device=args.device, max_seq_len=args.max_seq_len,
                                       max_batch_size=1))
    prompt = torch.randint(300, 5000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    samplings = {"greedy": SamplingParams.greedy(), "temp": SamplingParams(temperature=0.8, seed=1),
                 "topp": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1),
                 "nucleus": SamplingParams(temperature=0.8, top_p=0.9, seed=1)}
    variants = {f"{s}_{mode}": (samplings[s], mode, None) for s in samplings for mode in ("lookahead", "eager")}
    variants["temp_reference"] = (samplings["temp"], "reference", None)
    variants["topp_reference"] = (samplings["topp"], "reference", None)
    for mode in ("lookahead", "eager"):  # a grammar's batch: sampled when each step is consumed
        variants[f"grammar_{mode}"] = (samplings["greedy"], mode, PERMISSIVE)
    engine.vocabulary()  # built at load in a server (exl2_load)
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(2):
        for name, (sampling, mode, grammar) in variants.items():
            params = GenerationParams(sampling=sampling, max_new_tokens=args.tokens, ignore_eos=True, grammar=grammar)
            with _variant(engine, lookahead=mode == "lookahead", reference=mode == "reference"):
                runs[name].append(_decode_ms(engine, prompt, params, f"{name}{round_}"))
    best = {name: min(ms) for name, ms in runs.items()}
    base = best["greedy_lookahead"]
    for name, ms in best.items():
        print(f"{name:18s} {ms:7.3f} ms/token  ({1000 / ms:7.1f} tok/s)  x{ms / base:.3f}  runs {runs[name]}")
    stats = engine.stats()
    print(f"lookahead steps used {stats['lookahead_steps_used']}, sampled {stats['lookahead_sampled_steps']}, "
          f"deferred {stats['lookahead_deferred_steps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms_per_token": best, "runs": runs, "tokens": args.tokens, "device": str(engine.device),
                       "gpu": torch.cuda.get_device_name() if engine.device.type == "cuda" else None}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
