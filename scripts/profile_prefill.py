#!/usr/bin/env python3
"""Where the time of one prefill goes, per KV cache type (torch.profiler kernel table).

One model is loaded once (a random EXL2 directory of --shape at 4.0 bpw written under --workdir, or MODEL_DIR);
for each cache type an engine prefills a warm-up prompt, then one --tokens prompt of fresh ids runs under
torch.profiler. Printed per type: the prefill's wall time and tokens/s, and the kernels (GPU) or ops (CPU) with the
most self time, grouped by name. Session 20 (H200 call AI5) measured a 2k prefill of the 8B 27-34% slower with q8
and q4 caches than with fp16; this shows which kernels the difference sits in. --json keeps the tables.

    python scripts/profile_prefill.py --shape llama3-8b --cache-types fp16,q4 --json prefill.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from exl2_backend.bench.decode import add_model_args, load_engine, load_model, model_dir_from_args, prefill_seconds


def prefill_once(engine, seq_id: str, ids: list[int]) -> float:
    """Seconds of one prefill of `ids` to its first token (every chunk); the sequence released after."""
    secs = prefill_seconds(engine, seq_id, ids, 1)
    engine.release(seq_id)
    return secs


def kernel_table(prof, on_gpu: bool, top: int) -> tuple[list[dict], float]:
    """(the events with the most self time, as rows name / count / total us / share; the total us of all of them).
    On the GPU the kernels only: an op's row carries the device time of the kernels it launched, which have rows of
    their own (counting both doubled the table's total in session 21's AJ1)."""
    rows = []
    for e in prof.key_averages():
        if on_gpu and e.device_type != DeviceType.CUDA:
            continue
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "count": e.count, "us": us})
    total = sum(r["us"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["us"])
    for r in rows:
        r["share"] = r["us"] / total
    return rows[:top], total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "/tmp/profile_prefill")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of the profiled prefill")
    ap.add_argument("--cache-types", default="fp16,q4")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write the tables here")
    args = ap.parse_args()

    model_dir = model_dir_from_args(args)
    loaded = load_model(model_dir, args.device)
    gen = torch.Generator().manual_seed(0)
    results = {}
    for ct in [c.strip() for c in args.cache_types.split(",") if c.strip()]:
        engine, _, _ = load_engine(model_dir, args.device, args.tokens + 256, use_graphs=False, cache_type=ct,
                                   loaded=loaded)
        vocab = engine.config.vocab_size

        def ids(n: int, vocab: int = vocab) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=gen).tolist()  # fresh ids: no prefix-cache hits

        prefill_once(engine, "warmup", ids(args.tokens))
        plain = prefill_once(engine, "plain", ids(args.tokens))
        on_gpu = engine.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            profiled = prefill_once(engine, "profiled", ids(args.tokens))
        table, total_us = kernel_table(prof, on_gpu, args.top)
        engine.assert_no_leaks()
        results[ct] = {"tokens": args.tokens, "seconds": plain, "tokens_per_s": args.tokens / plain,
                       "profiled_seconds": profiled, "self_total_us": total_us, "top": table}
        print(f"== {ct} cache: {args.tokens} tokens in {plain * 1e3:.1f} ms ({args.tokens / plain:.0f} tok/s; "
              f"{profiled * 1e3:.1f} ms under the profiler; {'kernels' if on_gpu else 'ops'} "
              f"{total_us / 1e3:.1f} ms)")
        for r in table:
            print(f"  {r['us'] / 1e3:9.3f} ms {r['share']:6.1%} x{r['count']:<6d} {r['name'][:110]}")
        del engine
        if on_gpu:
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"model_dir": str(model_dir), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
