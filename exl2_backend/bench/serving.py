"""Load generation against our OpenAI-compatible server (127.0.0.1 only): streaming timings and soak.

Used by scripts/serve_bench.py (serving overhead vs direct engine decode; aggregate throughput with N
concurrent streams) and scripts/soak.py (mixed requests with random disconnects, then a page-leak check).
Every loop is bounded in count and time and stops by itself.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx

CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


@dataclass
class StreamResult:
    ttft_s: float  # request sent -> first content chunk
    total_s: float  # request sent -> stream closed
    tokens: int  # completion tokens reported in usage
    first_to_last_s: float  # first -> last content chunk


def stream_chat(base_url: str, model: str, max_tokens: int, *, timeout: float = 600.0) -> StreamResult:
    """One streaming chat completion; token count from `stream_options.include_usage`."""
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    last = time.perf_counter()
                    first = first or last
    end = time.perf_counter()
    first = first or end
    return StreamResult(first - t0, end - t0, tokens, (last or end) - first)


def time_to_first_token(base_url: str, model: str, reps: int = 5) -> float:
    """Median seconds of a max_tokens=1 request: TTFT that does not depend on the first token having text
    (random-weight models often emit tokens that decode to nothing, so no content chunk marks them)."""
    body = {"model": model, "messages": CHAT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    times = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for _ in range(reps):
            t0 = time.perf_counter()
            client.post("/v1/chat/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def concurrent_streams(base_url: str, model: str, n: int, max_tokens: int, ttft_s: float | None = None) -> dict:
    """n streams started together; aggregate tokens/s over the wall time, mean TTFT and per-stream rates.
    With `ttft_s` (from time_to_first_token) per-stream decode rates are (tokens - 1) / (total - ttft_s)."""
    results: list[StreamResult | Exception] = [None] * n  # type: ignore[list-item]

    def worker(i: int) -> None:
        try:
            results[i] = stream_chat(base_url, model, max_tokens)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, StreamResult)]
    errors = [repr(r) for r in results if not isinstance(r, StreamResult)]
    tokens = sum(r.tokens for r in ok)
    if ttft_s is not None:
        per_stream = [(r.tokens - 1) / (r.total_s - ttft_s) for r in ok if r.tokens > 1 and r.total_s > ttft_s]
    else:
        per_stream = [(r.tokens - 1) / r.first_to_last_s for r in ok if r.tokens > 1 and r.first_to_last_s > 0]
    return {"streams": n, "ok": len(ok), "errors": errors[:3], "tokens": tokens, "wall_s": wall,
            "aggregate_tokens_per_s": tokens / wall if wall else 0.0,
            "mean_ttft_ms": 1e3 * sum(r.ttft_s for r in ok) / max(len(ok), 1),
            "mean_stream_tokens_per_s": sum(per_stream) / max(len(per_stream), 1)}


def metrics(base_url: str) -> dict[str, float]:
    """The unlabelled (or model-labelled) Prometheus samples of /metrics as {name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
