"""Prefix caching and long-prompt memory on one loaded model (the issue's prefix-cache and chunked-prefill targets).

(a) Time to first token of a shared system prompt (default 4096 tokens) + a different 32-token question:
    the first request computes everything, later ones reuse the cached pages (target: >= 10x faster); a
    request after flushing the prefix cache gives the cold figure again.
(b) Peak device memory allocated while prefilling a long prompt (default 128k tokens) and a 16k one, over the
    allocation before the prompt, against the engine's planned scratch budget (Engine.prefill_scratch_bytes).

    python scripts/prefix_prefill.py MODEL_DIR [--long 131071] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams

MIB = 1 << 20


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params() -> GenerationParams:
    return GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=1, ignore_eos=True)


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from admission to the first token (synchronized), and the prompt tokens reused."""
    _sync(engine)
    t0 = time.perf_counter()
    engine.add_sequence("t", prompt, _params())
    cached = engine.seqs["t"].cached_tokens
    for _ in range(len(prompt) + 1):
        if engine.prefill(["t"])[0].token_ids:
            break
    _sync(engine)
    dt = time.perf_counter() - t0
    engine.release("t")
    return dt, cached


def prefill_peak(engine, n: int, seed: int, vocab: int) -> tuple[int, float]:
    """(peak bytes allocated over the pre-prompt allocation, seconds) of prefilling n tokens."""
    engine.add_sequence("m", _ids(n, seed, vocab), _params())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(n + 1):
        if engine.prefill(["m"])[0].token_ids:
            break
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    engine.release("m")
    return torch.cuda.max_memory_allocated() - base, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--system", type=int, default=4096, help="shared system prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long", type=int, default=131071, help="long prompt tokens for the memory check (0: skip)")
    ap.add_argument("--max-chunk-size", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of part (a) only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    max_seq_len = max(args.long + 1, args.system + args.new + 1)
    t0 = time.perf_counter()
    engine = Engine.load(LoadSettings(model_dir=args.model_dir, device=args.device, max_seq_len=max_seq_len,
                                      cache_tokens=max_seq_len, max_batch_size=1, max_chunk_size=args.max_chunk_size))
    load_s = time.perf_counter() - t0
    vocab = engine.model.vocab_size
    out: dict = {"model_dir": str(args.model_dir), "load_s": load_s, "max_seq_len": max_seq_len,
                 "max_chunk_size": engine.settings.max_chunk_size, "max_input_len": engine.settings.max_input_len}

    # (a) TTFT with a shared system prompt
    ttft(engine, _ids(min(600, max_seq_len - 1), 99, vocab))  # warm-up: first-use allocations and kernels
    engine.flush_prefix_cache()
    system = _ids(args.system, 0, vocab)
    first, _ = ttft(engine, system + _ids(args.new, 1, vocab))
    warm = [ttft(engine, system + _ids(args.new, 2 + i, vocab)) for i in range(args.repeats)]
    cold = []
    for i in range(3):
        engine.flush_prefix_cache()
        cold.append(ttft(engine, system + _ids(args.new, 100 + i, vocab))[0])
    second = statistics.median(t for t, _ in warm)
    out["ttft"] = {"system_tokens": args.system, "new_tokens": args.new, "first_ms": first * 1e3,
                   "second_ms_median": second * 1e3, "second_ms_all": [t * 1e3 for t, _ in warm],
                   "cached_tokens": warm[0][1], "cold_ms_median": statistics.median(cold) * 1e3,
                   "speedup": first / second, "target_speedup": 10.0}
    print(f"TTFT {args.system}+{args.new} tokens: first {first * 1e3:.1f} ms, second (median of {args.repeats}) "
          f"{second * 1e3:.2f} ms ({warm[0][1]} cached tokens) -> {first / second:.1f}x (target >= 10x); "
          f"cold again {statistics.median(cold) * 1e3:.1f} ms")

    # (b) prefill scratch memory
    if args.long and engine.device.type == "cuda":
        budget = engine.prefill_scratch_bytes()
        prefill_peak(engine, 3 * args.max_chunk_size + 17, 7, vocab)  # warm-up of the long-history path
        short_peak, short_s = prefill_peak(engine, 8 * args.max_chunk_size, 8, vocab)
        long_peak, long_s = prefill_peak(engine, args.long, 9, vocab)
        out["prefill_memory"] = {"planned_scratch_bytes": budget, "short_tokens": 8 * args.max_chunk_size,
                                 "short_peak_bytes": short_peak, "short_s": short_s, "long_tokens": args.long,
                                 "long_peak_bytes": long_peak, "long_s": long_s,
                                 "long_tokens_per_s": args.long / long_s, "within_budget": long_peak <= budget,
                                 "kv_cache_bytes": engine.cache.total_bytes()}
        print(f"prefill peak scratch: planned {budget / MIB:.0f} MiB; {8 * args.max_chunk_size} tokens "
              f"{short_peak / MIB:.0f} MiB ({short_s:.2f} s); {args.long} tokens {long_peak / MIB:.0f} MiB "
              f"({long_s:.1f} s, {args.long / long_s:.0f} tok/s) -> {'within' if long_peak <= budget else 'OVER'} "
              f"budget (KV cache {engine.cache.total_bytes() / 2**30:.1f} GiB)")
    out["stats"] = {k: v for k, v in engine.stats().items() if k.startswith("prefix_")}
    engine.assert_no_leaks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
