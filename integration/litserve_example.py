"""Serving an EXL2 model with LitServe in a few lines, then calling it with the official OpenAI client.

    python integration/litserve_example.py [MODEL_DIR]          # serves on http://127.0.0.1:8000
    python integration/litserve_example.py --client             # talks to it

`Exl2LitAPI` is a regular `litserve.LitAPI`: pass it to `LitServer` with your own options (auth, callbacks,
middlewares, ...). It loads the model in the worker process through the plugin hooks and batches every
concurrent request in one engine loop; `exl2-backend serve` does the same with a CLI.
"""

from __future__ import annotations

import sys


def serve(model_dir: str | None) -> None:
    import litserve as ls

    from exl2_backend.serve.litapi import Exl2LitAPI

    api = Exl2LitAPI({"model_dir": model_dir, "max_batch_size": 8, "cache_tokens": 16384, "max_seq_len": 2048})
    server = ls.LitServer(api, accelerator="auto", devices=1, workers_per_device=1)
    server.run(host="127.0.0.1", port=8000, generate_client_file=False)


def client() -> None:
    from openai import OpenAI

    c = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    model = c.models.list().data[0].id
    for chunk in c.chat.completions.create(model=model, stream=True, max_tokens=64, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}]):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    if "--client" in sys.argv:
        client()
    else:
        serve(next((a for a in sys.argv[1:] if not a.startswith("-")), None))
