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
    ttft_s: float  # request sent -> first SSE event (the role chunk, sent when the first token arrives)
    total_s: float  # request sent -> stream closed
    tokens: int  # completion tokens reported in usage
    first_to_last_s: float  # first SSE event -> the chunk carrying finish_reason (first -> last token)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time from the first to the last: the same definition as the direct
        engine measurement (independent of whether tokens decode to text, as random-weight models' often don't)."""
        return (self.tokens - 1) / self.first_to_last_s if self.tokens > 1 and self.first_to_last_s > 0 else 0.0


def stream_chat(base_url: str, model: str, max_tokens: int, *, timeout: float = 600.0,
                client: httpx.Client | None = None, temperature: float = 0.0) -> StreamResult:
    """One streaming chat completion (greedy unless `temperature`, ignore_eos); token count from
    `stream_options.include_usage`."""
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    own = client is None
    client = client or httpx.Client(base_url=base_url, timeout=timeout)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        with client.stream("POST", base_url + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                first = first or now
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                    last = now
    finally:
        if own:
            client.close()
    end = time.perf_counter()
    first = first or end
    return StreamResult(first - t0, end - t0, tokens, (last or end) - first)


def time_to_first_token(base_url: str, model: str, reps: int = 5) -> float:
    """Median seconds of a non-streaming max_tokens=1 request (a whole round trip for one token)."""
    body = {"model": model, "messages": CHAT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    times = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for _ in range(reps):
            t0 = time.perf_counter()
            client.post("/v1/chat/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def concurrent_streams(base_url: str, model: str, n: int, max_tokens: int, ttft_s: float | None = None,
                       temperature: float = 0.0) -> dict:
    """n streams started together; aggregate tokens/s over the wall time, mean TTFT and per-stream decode rates
    (first -> last token). `ttft_s` is accepted for compatibility and unused."""
    results: list[StreamResult | Exception] = [None] * n  # type: ignore[list-item]
    start = threading.Barrier(n)

    def worker(i: int) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=600.0) as client:  # connect outside the timed part
                start.wait(60)
                results[i] = stream_chat(base_url, model, max_tokens, client=client, temperature=temperature)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if isinstance(r, StreamResult)]
    errors = [repr(r) for r in results if not isinstance(r, StreamResult)]
    tokens = sum(r.tokens for r in ok)
    wall = max((r.total_s for r in ok), default=0.0)  # all started at the barrier: the slowest one's time
    per_stream = [r.decode_tokens_per_s for r in ok if r.tokens > 1]
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
