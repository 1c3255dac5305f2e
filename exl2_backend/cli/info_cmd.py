"""`exl2-backend info`: architecture, bits per weight per layer, sizes and estimated memory of a model."""

from __future__ import annotations

import json

from exl2_backend.cli.common import resolve_model_dir


def add_parser(sub):
    p = sub.add_parser("info", help="describe a model directory")
    p.add_argument("model_dir", nargs="?", default=None, help="default: the embedded model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context length for the memory estimate")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from exl2_backend.format.inspect import describe_model

    info = describe_model(resolve_model_dir(args.model_dir))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    from exl2_backend.cli.info_render import render

    render(info, max_seq_len=args.max_seq_len)
    return 0
