"""Terminal rendering of `describe_model` output for `exl2-backend info` (rich tables)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from exl2_backend.cli.console import cli_console

GB = 1024**3


def render(info: dict, *, max_seq_len: int = 4096, console: Console | None = None) -> None:
    console = console or cli_console()
    head = info.get("head") or {}
    summary = Table(title=f"{info['model_dir']}", show_header=False)
    rows = [
        ("architecture", info["architecture"]),
        ("layers / hidden / intermediate",
         f"{info['num_layers']} / {info['hidden_size']} / {info['intermediate_size']}"),
        ("heads (q / kv) × head_dim",
         f"{info['num_attention_heads']} / {info['num_key_value_heads']} × {info['head_dim']}"),
        ("vocab", str(info["vocab_size"])),
        ("rope", f"theta {info['rope_theta']}, scaling {info.get('rope_scaling') or 'none'}"),
        ("decoder bpw (target)", f"{info['decoder_bpw']:.3f} ({info.get('target_bits')})"),
        ("head", f"{head.get('format', 'tied')} {head.get('bpw', 0):.2f} bpw" if head else "tied embedding"),
        ("parameters", f"{info['parameters']['total'] / 1e6:.1f} M"),
        ("files", f"{len(info['files'])} shard(s), {info['file_bytes'] / GB:.3f} GiB"),
    ]
    mem = info["memory"]
    kv = mem["kv_cache_bytes_per_token"]
    rows += [
        ("weights in memory", f"{mem['weights_bytes'] / GB:.3f} GiB"),
        ("KV cache (fp16)", f"{kv} bytes/token; {kv * max_seq_len / GB:.3f} GiB at {max_seq_len} tokens"),
        ("estimated total", f"{(mem['weights_bytes'] + kv * max_seq_len) / GB:.3f} GiB at {max_seq_len} tokens"),
    ]
    prompting = info.get("prompting") or {}
    if "chat_template" in prompting:
        fim = prompting["fill_in_the_middle"]
        parts = ("template" if prompting["chat_template"] else "no template",
                 ("the template" if prompting["tools"] == "template" else "Hermes form")
                 + f", calls read as {prompting.get('tool_call_format', 'hermes')}"
                 + (", <think> apart" if prompting.get("reasoning") else ""),
                 " ".join(fim) if fim else "no")
        rows.append(("chat / tools / fill-in-middle", " / ".join(parts)))
    if "sampling_defaults" in info:
        defaults = info["sampling_defaults"]
        rows.append(("sampling defaults", ", ".join(f"{k} {v}" for k, v in defaults.items()) if defaults
                     else "the API's (generation_config.json sets none)"))
    for k, v in rows:
        summary.add_row(k, v)
    console.print(summary)
    if info.get("kv_cache_types"):
        render_cache_types(info["kv_cache_types"], info.get("kv_cache_budget", {}), console,
                           max_positions=info.get("max_position_embeddings"))

    layers = Table(title="bits per weight by layer")
    layers.add_column("layer", justify="right")
    layers.add_column("bpw", justify="right")
    layers.add_column("share of weights by bit width")
    for layer in info["layers"]:
        hist = ", ".join(f"{b}b {frac * 100:.1f}%" for b, frac in layer["bit_histogram"].items())
        layers.add_row(str(layer["index"]), f"{layer['bpw']:.3f}", hist)
    console.print(layers)


def render_cache_types(rows: list[dict], budget: dict, console: Console, max_positions: int | None = None) -> None:
    """KV cache bytes per token of each cache type, and the cache tokens that fit the VRAM budget (the longest
    context when one sequence holds them; past `max_positions` they serve several sequences, the caption says)."""
    ctx, vram, reserve = budget.get("context"), budget.get("vram_gb"), budget.get("reserve_gb")
    t = Table(title=f"KV cache types (tokens that fit {vram:g} GiB after weights and a {reserve:g} GiB reserve)"
              if vram is not None else "KV cache types")
    fits = [r["max_context"] for r in rows if r.get("supported", True) and "max_context" in r]
    if max_positions and fits and max(fits) > max_positions:
        t.caption = (f"one sequence is held to the model's {max_positions:,} positions; the rest of the cache "
                     f"serves other sequences")
    for col in ("type", "K / V", "bytes/token", "vs fp16", f"GiB at {ctx}" if ctx else None, "tokens that fit"):
        if col:
            t.add_column(col, justify="right")
    for r in rows:
        cells = [r["cache_type"], f"{r['k_format']} / {r['v_format']}", str(r["bytes_per_token"]),
                 f"{r['ratio_vs_fp16'] * 100:.1f}%"]
        if ctx:
            cells.append(f"{r['bytes_at_context'] / GB:.3f}")
        cells.append(f"{r['max_context']:,}" if r.get("supported", True) and "max_context" in r else "-")
        t.add_row(*cells)
    console.print(t)


def render_plan(plan, error=None, console: Console | None = None) -> None:
    """The VramPlan per device (GB = 1e9 bytes), and why it does not fit when it does not."""
    console = console or cli_console()
    title = (f"memory plan: {plan.mode}, {plan.backend} weights, {plan.cache_tokens} cache tokens ({plan.cache_type}),"
             f" max_seq_len {plan.max_seq_len}")
    t = Table(title=title)
    for col in ("device", "layers", "holds", "weights GB", "KV cache GB", "draft GB", "scratch GB", "reserve GB",
                "peak GB", "budget GB"):
        t.add_column(col, justify="right")
    for d in plan.devices:
        holds = ", ".join(x for x, on in (("embedding", d.embed), ("head", d.head)) if on) or "-"
        budget = "unchecked" if d.capacity is None else f"{d.capacity / 1e9:.2f} ({d.capacity_source})"
        peak = f"{d.peak / 1e9:.2f}" + (f" [red](-{d.shortfall / 1e9:.2f})[/red]" if d.shortfall else "")
        t.add_row(d.device, f"{d.layers[0]}-{d.layers[1] - 1}" if d.layers[1] > d.layers[0] else "-", holds,
                  f"{d.weights / 1e9:.2f}", f"{d.kv_cache / 1e9:.2f}", f"{d.draft / 1e9:.2f}",
                  f"{d.scratch / 1e9:.2f}", f"{d.reserve / 1e9:.2f}", peak, budget)
    console.print(t)
    for note in plan.notes:
        console.print(f"note: {note}")
    if error is not None:
        console.print(f"[red]does not fit:[/red] {error}")


def render_missing(missing: list[str], console: Console | None = None, shown: int = 8) -> None:
    """The tensors a load needs and the directory lacks (nothing when complete)."""
    if not missing:
        return
    console = console or cli_console()
    more = f" and {len(missing) - shown} more" if len(missing) > shown else ""
    console.print(f"[red]will not load:[/red] {len(missing)} tensors missing: {', '.join(missing[:shown])}{more}")
