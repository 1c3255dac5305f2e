"""`exl2-backend serve [MODEL_DIR]`: the OpenAI-compatible LitServe server."""

from __future__ import annotations

import argparse
import os

from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES
from exl2_backend.cli.common import (
    add_multi_gpu_args,
    add_prefill_args,
    add_spec_args,
    multi_gpu_settings_from_args,
    prefill_settings_from_args,
    spec_settings_from_args,
)
from exl2_backend.tokenizer.tool_formats import TOOL_CALL_FORMATS


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (LitServe)",
        description="Serve an EXL2 model with continuous batching: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics.")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="EXL2 model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default), 0.0.0.0 or ::")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length (prompt + completion)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="KV cache size in tokens, shared by all running sequences")
    p.add_argument("--max-batch-size", type=int, default=16, help="most sequences decoding together")
    p.add_argument("--max-chunk-size", type=int, default=None, help="prompt tokens per prefill step")
    p.add_argument("--cache-type", default=None, choices=CACHE_TYPE_NAMES,
                   help="KV cache storage: fp16 (default), fp8, q8, q6 or q4 (quantized pages, more context per GB)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait (beyond free batch slots) before 503")
    p.add_argument("--max-payload-mb", type=float, default=32.0,
                   help="largest request body in MB (larger ones get 413 before they are read whole)")
    p.add_argument("--model-id", default=None, help="name served at /v1/models (default: the directory name)")
    p.add_argument("--fast-queue", action="store_true", help="ZeroMQ transport between HTTP and engine processes")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $EXL2_BACKEND_API_KEY; none: open)")
    p.add_argument("--tool-call-format", default="auto", choices=["auto", *TOOL_CALL_FORMATS],
                   help="how the model writes tool calls: auto (default: the convention its chat template asks "
                        "for), hermes (<tool_call> blocks), llama3_json ({\"name\", \"parameters\"}), mistral "
                        "([TOOL_CALLS] list), mistral_v11 ([TOOL_CALLS]name[ARGS]{...})")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none"],
                   help="a reasoning model's <think> block returned apart as reasoning_content: auto (default: where "
                        "the chat template says the model reasons), think (always), none (the reply as generated)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="sampling defaults for requests that leave a field out: auto (default: the model's "
                        "generation_config.json, e.g. temperature 0.6 and top_p 0.9 for Llama 3.1, as vLLM), none "
                        "(the OpenAI API's: temperature 1, no top-p)")
    add_prefill_args(p)
    add_spec_args(p)
    add_multi_gpu_args(p)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    from exl2_backend.serve.server import API_KEY_ENV, run_server

    run_server(args.model_dir, host=args.host, port=args.port, cache_tokens=args.cache_tokens,
               max_concurrent=args.max_batch_size, max_seq_len=args.max_seq_len, device=args.device,
               max_chunk_size=args.max_chunk_size, max_queue=args.max_queue, model_id=args.model_id,
               log_level=args.log_level, fast_queue=args.fast_queue, cache_type=args.cache_type,
               max_payload_mb=args.max_payload_mb, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
               tool_call_format=args.tool_call_format, reasoning_parser=args.reasoning_parser,
               generation_config=args.generation_config, **prefill_settings_from_args(args),
               **spec_settings_from_args(args), **multi_gpu_settings_from_args(args))
    return 0
