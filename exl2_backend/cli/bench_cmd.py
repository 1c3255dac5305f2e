"""`exl2-backend bench`: prefill/decode tokens/s at several contexts, bytes per token, % of roofline.

With `--shape llama3-8b|llama3-70b|llama3-1b` it first writes an EXL2 directory with random weights at
that shape (mixed bit widths as the format allows) and benchmarks it; speed does not depend on values.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path

from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES
from exl2_backend.errors import ConfigError

DEFAULT_CONTEXTS = "512,2048,8192,32768"


def add_parser(sub):
    p = sub.add_parser("bench", help="measure prefill/decode speed against the memory-bandwidth roofline")
    p.add_argument("model_dir", nargs="?", default=None, help="model to measure (default: embedded model)")
    p.add_argument("--shape", help="write and measure a random model of this shape (llama3-1b|llama3-8b|llama3-70b)")
    p.add_argument("--bpw", type=float, default=4.0, help="target decoder bpw for --shape")
    p.add_argument("--head-bits", type=int, default=6, help="head bits for --shape")
    p.add_argument("--model-out", help="where --shape writes its model (default: the cache dir)")
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS,
                   help=f"comma-separated context lengths (default {DEFAULT_CONTEXTS}: those the model's positions "
                        "hold)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (to show what graphs buy)")
    p.add_argument("--cache-type", default="fp16",
                   help="KV cache type(s), comma-separated, each measured in turn on the same loaded model: "
                        f"{', '.join(CACHE_TYPE_NAMES)} (default fp16)")
    p.add_argument("--vram-gb", type=float, default=None,
                   help="GPU memory budget (GiB) for the max-context table (default: the device's memory; 24 on CPU)")
    from exl2_backend.cli.common import add_multi_gpu_args

    add_multi_gpu_args(p)
    p.add_argument("--json", help="write results as JSON to this path ('-' for stdout)")
    p.add_argument("--plot", help="write a PNG of tokens/s against context")
    from exl2_backend.cli.common import add_spec_args

    add_spec_args(p)
    p.set_defaults(func=run)
    return p


def _model_dir(args) -> Path:
    if not args.shape:
        from exl2_backend.cli.common import resolve_model_dir

        return resolve_model_dir(args.model_dir)
    from exl2_backend.format.layout import HEAD_OPTIONS
    from exl2_backend.format.random_model import SHAPES, shape_config_dict, write_random_exl2_model

    if args.shape not in SHAPES:
        raise ConfigError(f"--shape must be one of {', '.join(SHAPES)}, got {args.shape!r}", field="shape")
    if not 2.0 <= args.bpw <= 8.0:  # NaN fails too
        raise ConfigError(f"--bpw must be in [2, 8] for --shape, got {args.bpw}", field="bpw")
    if args.head_bits not in HEAD_OPTIONS:
        raise ConfigError(f"--head-bits must be one of {sorted(HEAD_OPTIONS)}, got {args.head_bits}",
                          field="head_bits")

    if args.model_out:
        out = Path(args.model_out)
    else:
        from exl2_backend.default_model.prepare import cache_root

        out = cache_root().parent / "random" / f"{args.shape}-{args.bpw}bpw-h{args.head_bits}"
    if not (out / "config.json").exists():
        print(f"writing a random {args.shape} model at {args.bpw} bpw to {out} ...", file=sys.stderr)
        write_random_exl2_model(out, args.shape, bpw=args.bpw, head_bits=args.head_bits)
    else:  # reused: it must be that shape (a tiny model there was benchmarked as "llama3-8b")
        have = json.loads((out / "config.json").read_text())
        want = shape_config_dict(args.shape)
        keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
        if any(have.get(k) != want.get(k) for k in keys):
            raise ConfigError(f"--model-out {out} holds a model that is not {args.shape} "
                              f"({ {k: have.get(k) for k in keys} }); remove it or choose another path",
                              field="model_out")
    return out


def _cache_types(arg: str) -> list[str]:
    types = [t.strip().lower() for t in arg.split(",") if t.strip()]
    bad = [t for t in types if t not in CACHE_TYPE_NAMES]
    if bad or not types:
        raise ConfigError(f"--cache-type takes a comma-separated list of {', '.join(CACHE_TYPE_NAMES)}, got {arg!r}",
                          field="cache_type")
    return types


def _free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args) -> int:
    from exl2_backend.bench.decode import plot

    types = _cache_types(args.cache_type)
    try:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    except ValueError:
        contexts = ()
    if not contexts or min(contexts) < 1:
        raise ConfigError(f"--contexts takes comma-separated positive token counts, got {args.contexts!r}",
                          field="contexts")
    if args.decode_tokens < 1:  # none decoded would report a speed of nothing timed
        raise ConfigError(f"--decode-tokens must be >= 1, got {args.decode_tokens}", field="decode_tokens")
    for flag, path in (("--json", args.json if args.json != "-" else None), ("--plot", args.plot)):
        if path and (Path(path).is_dir() or not Path(path).absolute().parent.is_dir()):  # before the run, not after
            raise ConfigError(f"{flag} {path}: not a file path in an existing directory", field=flag.lstrip("-"))
    # with --json - the JSON alone goes to stdout: the tables (and what writing a --shape model prints) to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        model_dir = _model_dir(args)
        contexts = _contexts_that_fit(args, model_dir, contexts)
        results, out = _measure_all(args, model_dir, types, contexts)
    if args.json:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.plot:
        plot(results if len(results) > 1 else results[0], args.plot)
    return 0


def _contexts_that_fit(args, model_dir: Path, contexts: tuple[int, ...]) -> tuple[int, ...]:
    """The contexts whose run fits the model's max_position_embeddings: the default list loses those past it (said
    on stderr; SmolLM2's 8192 positions cannot hold the 32k point), an explicit one is a ConfigError."""
    from exl2_backend.bench.decode import positions_needed
    from exl2_backend.cli.common import spec_settings_from_args
    from exl2_backend.format.config import ModelConfig

    limit = ModelConfig.from_dir(model_dir).max_position_embeddings
    spec = bool(spec_settings_from_args(args))
    need = {c: positions_needed(c, args.prefill_tokens, args.decode_tokens, spec) for c in contexts}
    fit = tuple(c for c in contexts if need[c] <= limit)
    if positions_needed(1, args.prefill_tokens, args.decode_tokens, spec) > limit:
        raise ConfigError(f"--prefill-tokens {args.prefill_tokens} with --decode-tokens {args.decode_tokens} need "
                          f"more than the model's {limit} positions (max_position_embeddings)", field="prefill_tokens")
    if args.contexts != DEFAULT_CONTEXTS and len(fit) < len(contexts):
        c = next(c for c in contexts if need[c] > limit)
        raise ConfigError(f"--contexts {c} needs {need[c]} positions with --decode-tokens {args.decode_tokens}; the "
                          f"model has {limit} (max_position_embeddings)", field="contexts")
    if len(fit) < len(contexts):
        print(f"bench: contexts past the model's {limit} positions skipped: "
              f"{', '.join(str(c) for c in contexts if c not in fit)}", file=sys.stderr)
    if not fit:
        raise ConfigError(f"no default context fits the model's {limit} positions; pass --contexts",
                          field="contexts")
    return fit


def _measure_all(args, model_dir: Path, types: list[str], contexts: tuple[int, ...]) -> tuple[list[dict], dict]:
    """Every cache type's bench run, its table printed as it finishes; -> (results, the JSON document)."""
    from exl2_backend.bench.decode import load_model, run_bench
    from exl2_backend.cli.common import multi_gpu_settings_from_args, spec_settings_from_args

    multi = multi_gpu_settings_from_args(args)
    loaded = load_model(model_dir, args.device, multi)
    results, bandwidth = [], None
    for ct in types:
        result = run_bench(model_dir, contexts=contexts, decode_tokens=args.decode_tokens,
                           prefill_tokens=args.prefill_tokens, device=args.device, use_graphs=not args.no_graphs,
                           progress=lambda m, ct=ct: print(f"[{ct} cache] {m}", file=sys.stderr), cache_type=ct,
                           loaded=loaded, bandwidth=bandwidth, spec=spec_settings_from_args(args) or None,
                           multi=multi)
        bandwidth = result["read_bandwidth_gbs"]
        results.append(result)
        _print_table(result)
        _free_device_memory()  # the engine (cache, graphs) of this type goes before the next one is built
    budget = _budget(loaded[0], loaded[1], args.vram_gb)
    _print_budget(budget)
    if len(results) > 1:
        _print_comparison(results)
    out = {**results[0], "kv_cache_types": budget} if len(results) == 1 else {"runs": results, "kv_cache_types": budget}
    return results, out


def _budget(model, weight_bytes: int, vram_gb: float | None) -> dict:
    """Cache bytes per token of every type and the context fitting the VRAM budget (weights = what the loaded
    model holds on its device, or the per-token weight bytes plus the embedding table on CPU)."""
    import torch

    from exl2_backend.cache.budget import DEFAULT_RESERVE_BYTES, GIB, cache_type_table

    c = model.config
    dev = model.device
    if dev.type == "cuda":
        weights = torch.cuda.memory_allocated(dev)
        vram = int(vram_gb * GIB) if vram_gb else torch.cuda.get_device_properties(dev).total_memory
    else:
        weights = weight_bytes + c.vocab_size * c.hidden_size * 2
        vram = int((vram_gb or 24.0) * GIB)
    rows = cache_type_table(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, weights_bytes=weights,
                            vram_bytes=vram)
    return {"vram_bytes": vram, "weights_bytes": weights, "reserve_bytes": DEFAULT_RESERVE_BYTES, "types": rows}


def _print_budget(b: dict) -> None:
    from rich.table import Table

    from exl2_backend.cli.console import cli_console

    gib = 1024**3
    t = Table(title=f"KV cache per token and the tokens that fit {b['vram_bytes'] / gib:.1f} GiB "
                    f"(weights {b['weights_bytes'] / gib:.2f} GiB, reserve {b['reserve_bytes'] / gib:.1f} GiB)")
    for col in ("type", "K / V", "bytes/token", "vs fp16", "tokens that fit"):
        t.add_column(col, justify="right")
    for r in b["types"]:
        t.add_row(r["cache_type"], f"{r['k_format']} / {r['v_format']}", str(r["bytes_per_token"]),
                  f"{r['ratio_vs_fp16'] * 100:.1f}%", f"{r['max_context']:,}" if r["supported"] else "-")
    cli_console().print(t)


def _print_comparison(results: list[dict]) -> None:
    """Decode tokens/s (engine step, and graph replay when measured) per context, one column per cache type."""
    from rich.table import Table

    from exl2_backend.cli.console import cli_console

    t = Table(title="decode tokens/s by cache type (engine step / graph replay)")
    t.add_column("context", justify="right")
    for r in results:
        t.add_column(r["cache_type"], justify="right")
    for i, row in enumerate(results[0]["decode"]):
        cells = [str(row["context"])]
        for r in results:
            x = r["decode"][i]
            g = f" / {x['graph_tokens_per_s']:.1f}" if "graph_tokens_per_s" in x else ""
            cells.append(f"{x['decode_tokens_per_s']:.1f}{g}")
        t.add_row(*cells)
    cli_console().print(t)


def _print_table(r: dict) -> None:
    from rich.table import Table

    from exl2_backend.cli.console import cli_console

    bw = r["read_bandwidth_gbs"]
    title = (f"{r['model_dir']} on {r.get('gpu') or r['device']}; read bandwidth "
             f"{bw:.0f} GB/s" if bw else f"{r['model_dir']} on {r['device']}")
    title += f"; {r.get('cache_type', 'fp16')} KV cache"
    t = Table(title=title)
    for col in ("context", "decode tok/s", "step ms", "graph tok/s", "MB/token", "roofline tok/s", "% roofline",
                "graph %", "prefill tok/s"):
        t.add_column(col, justify="right")
    for row in r["decode"]:
        def f(key, fmt="{:.1f}", row=row):
            return fmt.format(row[key]) if key in row else "-"
        t.add_row(str(row["context"]), f("decode_tokens_per_s"), f("decode_step_ms", "{:.3f}"),
                  f("graph_tokens_per_s"), f"{row['bytes_per_token'] / 1e6:.1f}", f("roofline_tokens_per_s"),
                  f("pct_roofline"), f("graph_pct_roofline"), f("prefill_tokens_per_s", "{:.0f}"))
    cli_console().print(t)
    p = r["prefill"]
    runs = " / ".join(f"{x:.0f}" for x in p.get("runs_tokens_per_s", []))
    print(f"prefill {p['tokens']} tokens: {p['tokens_per_s']:.0f} tokens/s (median of {runs}); "
          f"load {r['load_seconds']:.1f} s; "
          f"weights {r['weight_bytes_per_token'] / 1e9:.3f} GB read per token; cuda graphs {r['cuda_graphs']}")
    sp = r.get("speculation")
    if sp:
        print(f"speculation {sp['spec_mode']} (k={sp['spec_num_speculative_tokens']}): acceptance rate "
              f"{sp['spec_acceptance_rate']:.1%}, mean accepted length {sp['spec_mean_accepted_length']:.2f}, "
              f"{sp['spec_tokens_per_step']:.2f} tokens per step (random-token prompts: expect little acceptance)")
