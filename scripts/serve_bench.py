"""Serving overhead and aggregate throughput: OpenAI streaming through LitServe vs direct engine decode.

    python scripts/serve_bench.py [MODEL_DIR] --device cuda --streams 1,8,32 --max-tokens 128

Direct: the Engine in this process, one sequence, greedy, the same prompt (TTFT = add + prefill to the
first token; decode tokens/s over the rest). Server: a real server on 127.0.0.1 (a subprocess), streaming
SSE with usage. Prints a table and writes JSON to $OUT/serve_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from exl2_backend.bench.serving import CHAT, concurrent_streams, time_to_first_token


def direct(model_dir: str, device: str, max_tokens: int, max_batch: int) -> dict:
    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.runtime.generate import generate_stream
    from exl2_backend.sampling import SamplingParams

    engine = Engine.load(LoadSettings(model_dir=model_dir, device=device, max_seq_len=2048, max_batch_size=max_batch))
    prompt = engine.tokenizer.encode_chat(CHAT)
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=max_tokens, ignore_eos=True)
    out = {}
    for run in range(2):  # the first run warms up
        t0 = time.perf_counter()
        first = None
        n = 0
        for ev in generate_stream(engine, prompt, params):
            n += len(ev.token_ids)
            first = first or time.perf_counter()
        end = time.perf_counter()
        out = {"ttft_ms": (first - t0) * 1e3, "decode_tokens_per_s": (n - 1) / (end - first), "tokens": n}
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    from exl2_backend.cli.common import resolve_model_dir
    from exl2_backend.serve.server import ServerProcess

    model_dir = str(resolve_model_dir(args.model_dir))
    streams = [int(s) for s in args.streams.split(",")]
    result = {"model_dir": model_dir, "device": args.device, "max_tokens": args.max_tokens,
              "direct": direct(model_dir, args.device, args.max_tokens, max(streams))}
    settings = {"model_dir": model_dir, "device": args.device, "max_seq_len": 2048,
                "max_batch_size": max(streams), "max_queue": 64, "log_level": "warning"}
    with ServerProcess(settings, startup_timeout=900) as srv:
        import httpx

        model = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        concurrent_streams(srv.base_url, model, 1, 16)  # warm-up
        ttft = time_to_first_token(srv.base_url, model)
        result["server_ttft_ms"] = ttft * 1e3
        result["server"] = [concurrent_streams(srv.base_url, model, n, args.max_tokens, ttft) for n in streams]
    one = result["server"][0]
    d = result["direct"]
    result["overhead"] = {
        "tokens_per_s_loss_pct": 100 * (1 - one["mean_stream_tokens_per_s"] / d["decode_tokens_per_s"]),
        "added_ttft_ms": result["server_ttft_ms"] - d["ttft_ms"],
    }
    print(f"direct engine: TTFT {d['ttft_ms']:.1f} ms, decode {d['decode_tokens_per_s']:.1f} tok/s; "
          f"server TTFT (max_tokens=1, median) {result['server_ttft_ms']:.1f} ms")
    print(f"{'streams':>8} {'ok':>4} {'agg tok/s':>10} {'per-stream tok/s':>17} {'TTFT ms':>9}")
    for r in result["server"]:
        print(f"{r['streams']:>8} {r['ok']:>4} {r['aggregate_tokens_per_s']:>10.1f} "
              f"{r['mean_stream_tokens_per_s']:>17.1f} {r['mean_ttft_ms']:>9.1f}  {r['errors'] or ''}")
    o = result["overhead"]
    print(f"overhead at 1 stream: {o['tokens_per_s_loss_pct']:.1f}% tokens/s, +{o['added_ttft_ms']:.1f} ms TTFT")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "serve_bench.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
