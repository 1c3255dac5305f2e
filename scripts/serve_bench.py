"""Serving overhead and aggregate throughput: OpenAI streaming through LitServe vs direct engine decode.

    python scripts/serve_bench.py [MODEL_DIR | --shape llama3-8b --bpw 4.0] --device cuda \
        --streams 1,8,32 --max-tokens 256 [--json PATH]

One run measures, on the same model and prompt (greedy unless --temperature, ignore_eos):
- direct engine: the Engine in this process (`generate_stream`): TTFT = add + prefill to the first token;
  decode tokens/s = (tokens - 1) / (first -> last token). Median of `--reps` runs after a warm-up.
- direct hooks: the same through the plugin hooks (prefill/decode in a plain loop, no server): what the hook
  layer costs by itself.
- server: a real server on 127.0.0.1 (subprocess), streaming SSE: TTFT = request -> first SSE event (sent when
  the first token arrives), decode tokens/s over first -> last token, median of `--reps` single streams;
  also the non-streaming max_tokens=1 round trip; aggregate tokens/s with N concurrent streams.
Overhead = 1 - server / direct engine decode tokens/s (target <= 5% on the H200), added TTFT = server -
direct (target <= 10 ms). Prints a table; writes JSON to --json, or to $OUT/serve_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from exl2_backend.bench.serving import CHAT, concurrent_streams, stream_chat, time_to_first_token


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def direct(model_dir: str, device: str, max_tokens: int, max_batch: int, reps: int,
           temperature: float = 0.0) -> tuple[dict, dict]:
    """(engine, hooks) figures from one load: the Engine's step API through `generate_stream`, then the same
    prefill/decode through pm.hook in a plain loop (the hook layer without any server)."""
    from exl2_backend.plugin.manager import get_plugin_manager
    from exl2_backend.plugin.types import SequenceRequest, StepBatch
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.runtime.generate import generate_stream
    from exl2_backend.sampling import SamplingParams

    pm = get_plugin_manager(builtin_fallback=True)
    handle = pm.hook.exl2_load(settings={"model_dir": model_dir, "device": device, "max_seq_len": 2048,
                                         "max_batch_size": max_batch})
    engine = handle.engine
    prompt = engine.tokenizer.encode_chat(CHAT)
    params = GenerationParams(sampling=SamplingParams(temperature=temperature), max_new_tokens=max_tokens,
                              ignore_eos=True)
    eng = []
    for _ in range(reps + 1):  # the first run warms up
        t0 = time.perf_counter()
        first = end = None
        n = 0
        for ev in generate_stream(engine, prompt, params):
            end = time.perf_counter()
            first = first or end
            n += len(ev.token_ids)
        eng.append({"ttft_ms": (first - t0) * 1e3, "decode_tokens_per_s": (n - 1) / (end - first), "tokens": n})
    hooks = []
    for i in range(reps + 1):
        req = SequenceRequest(f"bench-{i}", messages=CHAT, max_new_tokens=max_tokens, temperature=temperature,
                              ignore_eos=True)
        t0 = time.perf_counter()
        events = pm.hook.exl2_prefill(handle=handle, batch=StepBatch(new=[req]))
        while not events[0].token_ids and not events[0].finished:
            events = pm.hook.exl2_prefill(handle=handle, batch=StepBatch(seq_ids=[req.seq_id]))
        first = end = time.perf_counter()
        n, ev = len(events[0].token_ids), events[0]
        while not ev.finished:
            ev, = pm.hook.exl2_decode(handle=handle, batch=StepBatch(seq_ids=[req.seq_id]))
            n += len(ev.token_ids)
            end = time.perf_counter()
        hooks.append({"ttft_ms": (first - t0) * 1e3, "decode_tokens_per_s": (n - 1) / (end - first), "tokens": n})
    pm.hook.exl2_unload(handle=handle)
    del handle, engine
    _free()
    return _summary(eng[1:]), _summary(hooks[1:])


def _progress(name: str, r: dict) -> None:
    extra = "".join(f", {c['streams']} streams {c['aggregate_tokens_per_s']:.1f} tok/s"
                    for c in r.get("concurrent", []))
    print(f"[{name}] TTFT {r['ttft_ms']:.1f} ms, decode {r['decode_tokens_per_s']:.1f} tok/s{extra}",
          file=sys.stderr, flush=True)


def _summary(runs: list[dict]) -> dict:
    return {"ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "tokens": runs[0]["tokens"], "runs": runs}


def server(model_dir: str, device: str, max_tokens: int, streams: list[int], reps: int, settings: dict,
           concurrent: bool = True, temperature: float = 0.0) -> dict:
    import httpx

    from exl2_backend.serve.server import ServerProcess

    cfg = {"model_dir": model_dir, "device": device, "max_seq_len": 2048, "max_batch_size": max(streams),
           "max_queue": 64, "log_level": "warning", **settings}
    with ServerProcess(cfg, startup_timeout=900) as srv:
        model = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        concurrent_streams(srv.base_url, model, min(8, max(streams)), 16)  # warm-up (graphs, allocator, HTTP)
        # and the timed request itself once, as the direct runs do: on the H200 (2026-12-01) the first request
        # of a new prompt length took 67 ms to its first token, the next ones 13 ms
        stream_chat(srv.base_url, model, max_tokens, temperature=temperature)
        singles = [stream_chat(srv.base_url, model, max_tokens, temperature=temperature) for _ in range(reps)]
        return {
            "settings": cfg,
            "ttft_ms": statistics.median(r.ttft_s for r in singles) * 1e3,
            "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in singles),
            "single_streams": [{"ttft_ms": r.ttft_s * 1e3, "decode_tokens_per_s": r.decode_tokens_per_s,
                                "tokens": r.tokens} for r in singles],
            "round_trip_max_tokens_1_ms": time_to_first_token(srv.base_url, model) * 1e3,
            "concurrent": [concurrent_streams(srv.base_url, model, n, max_tokens, temperature=temperature)
                           for n in streams] if concurrent else [],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", nargs="?", default=None, help="model (default: the embedded model)")
    ap.add_argument("--shape", help="write (once) and use a random model of this shape, e.g. llama3-8b")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--model-out", default=None, help="where --shape writes its model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3, help="timed single-stream runs (median)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); else sampled")
    ap.add_argument("--fast-queue", action="store_true", help="serve with LitServe's ZeroMQ transport")
    ap.add_argument("--compare", action="append", default=[], metavar="SETTING=VALUE",
                    help="also measure single streams on a server with this ServeSettings override, e.g. "
                         "publish_on_launch=false (repeatable; one server start each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the server subprocess

    if args.shape:
        from exl2_backend.format.random_model import write_random_exl2_model

        out = Path(args.model_out or f"/tmp/models/{args.shape}-{args.bpw}bpw")
        if not (out / "config.json").exists():
            print(f"writing a random {args.shape} model at {args.bpw} bpw to {out} ...", file=sys.stderr, flush=True)
            write_random_exl2_model(out, args.shape, bpw=args.bpw)
        model_dir = str(out)
    else:
        from exl2_backend.cli.common import resolve_model_dir

        model_dir = str(resolve_model_dir(args.model_dir))
    streams = sorted({int(s) for s in args.streams.split(",")})
    max_batch = max(streams)
    t0 = time.perf_counter()
    result = {"model_dir": model_dir, "device": args.device, "max_tokens": args.max_tokens, "streams": streams,
              "temperature": args.temperature, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    result["direct_engine"], result["direct_hooks"] = direct(model_dir, args.device, args.max_tokens, max_batch,
                                                             args.reps, args.temperature)
    _progress("direct engine", result["direct_engine"])
    _progress("direct hooks", result["direct_hooks"])
    result["server"] = server(model_dir, args.device, args.max_tokens, streams, args.reps,
                              {"fast_queue": True} if args.fast_queue else {}, temperature=args.temperature)
    _progress("server", result["server"])
    result["compare"] = {}
    for item in args.compare:
        key, _, value = item.partition("=")
        parsed = json.loads(value) if value.lower() in ("true", "false", "null") or value[:1].isdigit() else value
        r = server(model_dir, args.device, args.max_tokens, streams, args.reps, {key: parsed}, concurrent=False,
                   temperature=args.temperature)
        result["compare"][item] = {k: r[k] for k in ("ttft_ms", "decode_tokens_per_s", "single_streams")}
    d, h, s = result["direct_engine"], result["direct_hooks"], result["server"]
    result["overhead"] = {
        "tokens_per_s_loss_pct": 100 * (1 - s["decode_tokens_per_s"] / d["decode_tokens_per_s"]),
        "hooks_tokens_per_s_loss_pct": 100 * (1 - h["decode_tokens_per_s"] / d["decode_tokens_per_s"]),
        "added_ttft_ms": s["ttft_ms"] - d["ttft_ms"],
    }
    result["wall_s"] = time.perf_counter() - t0

    o = result["overhead"]
    print(f"direct engine: TTFT {d['ttft_ms']:.1f} ms, decode {d['decode_tokens_per_s']:.1f} tok/s")
    print(f"direct hooks:  TTFT {h['ttft_ms']:.1f} ms, decode {h['decode_tokens_per_s']:.1f} tok/s "
          f"({o['hooks_tokens_per_s_loss_pct']:+.1f}% vs engine)")
    print(f"server 1 stream: TTFT {s['ttft_ms']:.1f} ms (max_tokens=1 round trip "
          f"{s['round_trip_max_tokens_1_ms']:.1f} ms), decode {s['decode_tokens_per_s']:.1f} tok/s")
    print(f"serving overhead at 1 stream: {o['tokens_per_s_loss_pct']:.1f}% tokens/s (target <= 5), "
          f"{o['added_ttft_ms']:+.1f} ms TTFT (target <= 10)")
    for item, r in result["compare"].items():
        print(f"server with {item}: TTFT {r['ttft_ms']:.1f} ms, decode {r['decode_tokens_per_s']:.1f} tok/s "
              f"({100 * (1 - r['decode_tokens_per_s'] / d['decode_tokens_per_s']):.1f}% below direct)")
    print(f"{'streams':>8} {'ok':>4} {'agg tok/s':>10} {'per-stream tok/s':>17} {'TTFT ms':>9}")
    for r in s["concurrent"]:
        print(f"{r['streams']:>8} {r['ok']:>4} {r['aggregate_tokens_per_s']:>10.1f} "
              f"{r['mean_stream_tokens_per_s']:>17.1f} {r['mean_ttft_ms']:>9.1f}  {r['errors'] or ''}")
    path = args.json or (os.path.join(os.environ["OUT"], "serve_bench.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
