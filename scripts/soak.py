"""Soak: mixed requests with random client disconnects for a fixed time, then check no KV page leaked.

    python scripts/soak.py --minutes 10 --concurrency 8 [MODEL_DIR] [--device cpu]

Starts a real server on 127.0.0.1, runs `concurrency` worker threads until the time is up (each request:
streaming or not, chat or completion, random max_tokens, about a third abandoned mid-stream), waits for the
server to go idle and compares free KV pages / free tokens with the values before the first request.
Exits 1 on a leak or on unexpected HTTP errors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

import httpx

from exl2_backend.bench.serving import metrics

PROMPTS = ["Tell me about the moon.", "List three colors.", "Write a haiku about rain.", "What is 12 times 7?",
           "Explain photosynthesis briefly.", "Name a famous painter."]


def one_request(client: httpx.Client, model: str, rng: random.Random, stats: dict) -> None:
    stream = rng.random() < 0.7
    abandon = stream and rng.random() < 0.35
    max_tokens = rng.randint(4, 64)
    if rng.random() < 0.8:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    else:
        path, body = "/v1/completions", {"prompt": rng.choice(PROMPTS)}
    body.update(model=model, max_tokens=max_tokens, stream=stream, temperature=rng.choice([0, 0.7]), seed=1)
    if stream:
        with client.stream("POST", path, json=body) as resp:
            status = resp.status_code
            if status == 200:
                for i, _ in enumerate(resp.iter_lines()):
                    if abandon and i >= rng.randint(1, 6):
                        stats["abandoned"] += 1
                        break  # leaving the block closes the connection mid-stream
    else:
        status = client.post(path, json=body).status_code
    stats[f"http_{status}"] = stats.get(f"http_{status}", 0) + 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    from exl2_backend.cli.common import resolve_model_dir
    from exl2_backend.serve.server import ServerProcess

    settings = {"model_dir": str(resolve_model_dir(args.model_dir)), "device": args.device, "max_seq_len": 512,
                "cache_tokens": 8192, "max_batch_size": args.concurrency, "max_queue": 64, "log_level": "warning"}
    stats: dict = {"abandoned": 0, "errors": 0}
    lock = threading.Lock()
    with ServerProcess(settings, startup_timeout=900) as srv:
        model = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        before = metrics(srv.base_url)
        deadline = time.monotonic() + args.minutes * 60

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            local = {"abandoned": 0}
            with httpx.Client(base_url=srv.base_url, timeout=300) as client:
                while time.monotonic() < deadline:
                    try:
                        one_request(client, model, rng, local)
                    except httpx.HTTPError as exc:
                        local["errors"] = local.get("errors", 0) + 1
                        local["last_error"] = repr(exc)
            with lock:
                for k, v in local.items():
                    stats[k] = v if isinstance(v, str) else stats.get(k, 0) + v

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        idle_deadline = time.monotonic() + 120
        while True:
            after = metrics(srv.base_url)
            if after["exl2_backend_active_sequences"] == 0 and after["exl2_backend_queue_length"] == 0:
                break
            if time.monotonic() > idle_deadline:
                break
            time.sleep(0.5)
    keys = ["exl2_backend_kv_pages_free", "exl2_backend_kv_free_tokens"]
    report = {"minutes": args.minutes, "concurrency": args.concurrency, "requests": stats,
              "before": {k: before[k] for k in keys}, "after": {k: after[k] for k in keys}}
    leaked = any(before[k] != after[k] for k in keys)
    unexpected = {k: v for k, v in stats.items() if k.startswith("http_") and k not in ("http_200", "http_503")}
    report["leak"] = leaked
    print(json.dumps(report, indent=2))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "soak.json"), "w") as f:
            json.dump(report, f, indent=2)
    return 1 if leaked or unexpected or stats.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
