"""`exl2-backend bench`: prefill/decode tokens/s at several contexts, bytes per token, % of roofline.

With `--shape llama3-8b|llama3-70b|llama3-1b` it first writes an EXL2 directory with random weights at
that shape (mixed bit widths as the format allows) and benchmarks it; speed does not depend on values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser("bench", help="measure prefill/decode speed against the memory-bandwidth roofline")
    p.add_argument("model_dir", nargs="?", default=None, help="model to measure (default: embedded model)")
    p.add_argument("--shape", help="write and measure a random model of this shape (llama3-1b|llama3-8b|llama3-70b)")
    p.add_argument("--bpw", type=float, default=4.0, help="target decoder bpw for --shape")
    p.add_argument("--head-bits", type=int, default=6, help="head bits for --shape")
    p.add_argument("--model-out", help="where --shape writes its model (default: the cache dir)")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="comma-separated context lengths")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (to show what graphs buy)")
    p.add_argument("--json", help="write results as JSON to this path ('-' for stdout)")
    p.add_argument("--plot", help="write a PNG of tokens/s against context")
    p.set_defaults(func=run)
    return p


def _model_dir(args) -> Path:
    if not args.shape:
        from exl2_backend.cli.common import resolve_model_dir

        return resolve_model_dir(args.model_dir)
    from exl2_backend.format.random_model import write_random_exl2_model

    if args.model_out:
        out = Path(args.model_out)
    else:
        from exl2_backend.default_model.prepare import cache_root

        out = cache_root().parent / "random" / f"{args.shape}-{args.bpw}bpw-h{args.head_bits}"
    if not (out / "config.json").exists():
        print(f"writing a random {args.shape} model at {args.bpw} bpw to {out} ...", file=sys.stderr)
        write_random_exl2_model(out, args.shape, bpw=args.bpw, head_bits=args.head_bits)
    return out


def run(args) -> int:
    from exl2_backend.bench.decode import plot, run_bench

    contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    result = run_bench(_model_dir(args), contexts=contexts, decode_tokens=args.decode_tokens,
                       prefill_tokens=args.prefill_tokens, device=args.device, use_graphs=not args.no_graphs,
                       progress=lambda m: print(m, file=sys.stderr))
    _print_table(result)
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.plot:
        plot(result, args.plot)
    return 0


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    bw = r["read_bandwidth_gbs"]
    title = (f"{r['model_dir']} on {r.get('gpu') or r['device']}; read bandwidth "
             f"{bw:.0f} GB/s" if bw else f"{r['model_dir']} on {r['device']}")
    t = Table(title=title)
    for col in ("context", "decode tok/s", "step ms", "graph tok/s", "MB/token", "roofline tok/s", "% roofline",
                "graph %", "prefill tok/s"):
        t.add_column(col, justify="right")
    for row in r["decode"]:
        def f(key, fmt="{:.1f}"):
            return fmt.format(row[key]) if key in row else "-"
        t.add_row(str(row["context"]), f("decode_tokens_per_s"), f("decode_step_ms", "{:.3f}"),
                  f("graph_tokens_per_s"), f"{row['bytes_per_token'] / 1e6:.1f}", f("roofline_tokens_per_s"),
                  f("pct_roofline"), f("graph_pct_roofline"), f("prefill_tokens_per_s", "{:.0f}"))
    Console().print(t)
    p = r["prefill"]
    print(f"prefill {p['tokens']} tokens: {p['tokens_per_s']:.0f} tokens/s; load {r['load_seconds']:.1f} s; "
          f"weights {r['weight_bytes_per_token'] / 1e9:.3f} GB read per token; cuda graphs {r['cuda_graphs']}")
