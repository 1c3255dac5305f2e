"""`exl2-backend info`: architecture, bits per weight per layer, sizes and estimated memory of a model."""

from __future__ import annotations

import json

from exl2_backend.cli.common import resolve_model_dir


def add_parser(sub):
    p = sub.add_parser("info", help="describe a model directory")
    p.add_argument("model_dir", nargs="?", default=None, help="default: the embedded model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context length for the memory estimate")
    p.add_argument("--vram-gb", type=float, default=24.0,
                   help="GPU memory budget (GiB) for the max-context column of the KV cache table (default 24)")
    p.add_argument("--reserve-gb", type=float, default=1.0,
                   help="part of --vram-gb kept for activations, scratch and the CUDA context (default 1)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from exl2_backend.cache.budget import GIB, cache_type_table
    from exl2_backend.format.inspect import describe_model

    info = describe_model(resolve_model_dir(args.model_dir))
    info["kv_cache_types"] = cache_type_table(
        info["num_layers"], info["num_key_value_heads"], info["head_dim"],
        weights_bytes=info["memory"]["weights_bytes"], vram_bytes=int(args.vram_gb * GIB),
        reserve_bytes=int(args.reserve_gb * GIB), context=args.max_seq_len)
    info["kv_cache_budget"] = {"vram_gb": args.vram_gb, "reserve_gb": args.reserve_gb, "context": args.max_seq_len}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    from exl2_backend.cli.info_render import render

    render(info, max_seq_len=args.max_seq_len)
    return 0
