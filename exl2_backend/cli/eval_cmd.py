"""`exl2-backend eval MODEL_DIR --reference FP16_DIR`: perplexity, KL divergence and top-1 agreement of a
(quantized) model against its FP16 source on held-out text. Definitions: `exl2_backend.quant.evaluate`."""

from __future__ import annotations

import json
import sys

from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES
from exl2_backend.quant.evaluate import DEFAULT_WINDOW

DEFAULT_MAX_TOKENS = 4096


def add_parser(sub):
    p = sub.add_parser("eval", help="perplexity / KL / top-1 agreement of a model vs its FP16 reference",
                       description="Compare MODEL_DIR with the FP16 reference on held-out text (default: the "
                                   "built-in evaluation text, disjoint from the calibration text).")
    p.add_argument("model_dir", help="model directory to evaluate (EXL2 or FP16)")
    p.add_argument("--reference", required=True, metavar="FP16_DIR", help="the unquantized source model")
    p.add_argument("--text", metavar="FILE", default=None, help="evaluate on this UTF-8 text file instead")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"use at most this many tokens of the text (default {DEFAULT_MAX_TOKENS}; 0 = all)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"tokens per evaluation window (default {DEFAULT_WINDOW})")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--cache-type", default="fp16", choices=CACHE_TYPE_NAMES,
                   help="KV cache type of the evaluated model (the reference always uses fp16); with --reference "
                        "equal to MODEL_DIR this measures what the quantized cache alone costs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)
    return p


def _table(result) -> None:
    from rich.table import Table

    from exl2_backend.cli.console import cli_console

    t = Table(title=f"eval: {result.tokens} tokens in {result.windows} windows of {result.window}")
    t.add_column("metric")
    t.add_column("model", justify="right")
    t.add_column("reference", justify="right")
    t.add_row("perplexity", f"{result.perplexity:.4f}", f"{result.reference_perplexity:.4f}")
    t.add_row("top-1 accuracy (next token)", f"{result.top1_accuracy:.4f}", f"{result.reference_top1_accuracy:.4f}")
    t.add_row("KL(ref || model) mean, nats/token", f"{result.kl_mean:.5f}", "")
    t.add_row("KL max (one position)", f"{result.kl_max:.4f}", "")
    t.add_row("top-1 agreement with reference", f"{result.top1_agreement:.4f}", "")
    console = cli_console()
    console.print(t)
    m = result.meta
    console.print(f"model {m.get('model_dir')} (KV cache {m.get('cache_type', 'fp16')})\n"
                  f"reference {m.get('reference_dir')}\n"
                  f"device {m.get('device')}, load {m.get('load_seconds')} s, eval {result.seconds:.1f} s")


def run(args) -> int:
    from pathlib import Path

    from exl2_backend.quant.evaluate import evaluate

    if args.window < 2:
        print("error: --window must be at least 2", file=sys.stderr)
        return 2
    if args.max_tokens is not None and args.max_tokens < 0:  # a negative count silently dropped the text's tail
        print(f"error: --max-tokens must be >= 0 (0: all), got {args.max_tokens}", file=sys.stderr)
        return 2
    text = None
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            print(f"error: no such text file: {path}", file=sys.stderr)
            return 2
        text = path.read_text(encoding="utf-8", errors="replace")
    result = evaluate(args.model_dir, args.reference, text=text, max_tokens=args.max_tokens or None,
                      window=args.window, device=args.device, progress=not args.json and sys.stderr.isatty(),
                      cache_type=args.cache_type)
    if args.text:
        result.meta["text"] = str(args.text)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _table(result)
    return 0
