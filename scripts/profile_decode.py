#!/usr/bin/env python3
"""Where the GPU time of one batch-1 decode step goes, before and after the launch-count work.

For each model shape (random EXL2 weights at 4.0 bpw) and each variant of the decode path:
  - the engine (CUDA-graph runner, max_batch_size 1, max_seq_len 2048) prefills a 512-token prompt and
    decodes a few tokens;
  - every CUDA kernel (and memset/memcpy) of one decode step is listed with torch.profiler, both for a
    graph replay and for the same step run eagerly (the eager list shows hidden torch kernels: casts,
    copies, fills), as count per step and µs per step;
  - the graph replay is timed with CUDA events (median over repetitions).
A greedy check runs a small model for 20 decode steps: the variants' graphs must give the same tokens and
bit-identical logits (the fused ops compute the same bits as the unfused ones); the eager GPU path and the
CPU reference model (fp32) are compared by token agreement (informational: fp16 vs fp32).

Variants (switches that keep the old path selectable; all use the fused rope + KV write):
  before:  no programmatic dependent launch, silu_mul and add_rms_norm as their own kernels (the 2026-11-29 path)
  pdl:     programmatic dependent launch (EXL2_BACKEND_PDL, ops.library.set_pdl) on every decode kernel
  silu:    silu_mul folded into the down GEMV's input gather (EXL2_BACKEND_FUSED_SILU_DOWN)
  after:   both, and add_rms_norm inside the GEMV after it (the default)
  tickets: after + attention splits combined by their last CTA (one kernel; EXL2_BACKEND_ATTN_TICKETS=1)
  regbatch: after with the register-batch small-M GEMV (EXL2_BACKEND_GEMV_MINB=2) instead of the TMA-ring one
  cluster:  after with the TMA GEMV's split-K partials reduced inside thread-block clusters (GEMV_MINB=1)
  nonorm:   after with add_rms_norm as its own kernel instead of inside the next GEMV (EXL2_BACKEND_FUSED_NORM=0)
  nochain:  after with o_proj -> gate/up -> down -> next q/k/v as four launches instead of one persistent chain
            (EXL2_BACKEND_GEMV_CHAIN=0)
  nochain_tickets: nochain with the attention splits combined by their last CTA (the engines' GEMVs, tickets on)

Shapes: "llama3-8b" is written with 4 layers of Llama-3.1-8B width and the full 128256-token head, then
loaded as 32 layers (layer i reuses the weights of layer i % 4, each packed into its own GPU copy, so the
step reads all 32 layers' bytes); "smollm2" is hidden 576, 30 layers, 9/3 heads of 64, inter 1536,
vocab 49152, tied embeddings.

    python3 scripts/profile_decode.py [--shapes llama3-8b,smollm2] [--variants before,after] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_roles import LAYER_ROLES, kind_rows, label_gemv_roles, print_role_rows, role_rows, step_roles

from exl2_backend.bench.roofline import measure_read_bandwidth
from exl2_backend.bench.timing import replay_mean_ms

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
           "rope_theta": 100000.0, "max_position_embeddings": 8192}

VARIANTS = {
    "before": {"pdl": False, "silu_down": False, "fused_norm": False},
    "pdl": {"pdl": True, "silu_down": False},
    "silu": {"pdl": False, "silu_down": True},
    "after": {"pdl": True, "silu_down": True},
    "tickets": {"pdl": True, "silu_down": True, "attn_tickets": True},
    "regbatch": {"pdl": True, "silu_down": True, "gemv_minb": 2},  # the register-batch GEMV instead of the TMA ring
    "cluster": {"pdl": True, "silu_down": True, "gemv_minb": 1},  # TMA ring, split-K reduced inside clusters
    "nonorm": {"pdl": True, "silu_down": True, "fused_norm": False},  # add_rms_norm as its own kernel
    "nochain": {"pdl": True, "silu_down": True, "chain": False},  # the layer's GEMVs one launch each
    "nochain_tickets": {"pdl": True, "silu_down": True, "chain": False, "attn_tickets": True},
}


def shape_spec(name: str) -> tuple[dict, int]:
    """(config fields written to disk, layers to run)."""
    from exl2_backend.format.random_model import SHAPES

    if name == "llama3-8b":
        return {**SHAPES["llama3-8b"], "num_hidden_layers": 4}, 32
    if name == "smollm2":
        return dict(SMOLLM2), SMOLLM2["num_hidden_layers"]
    if name == "tiny":  # for the greedy check: small and fast on the CPU reference
        return {**SMOLLM2, "num_hidden_layers": 4, "vocab_size": 4096}, 4
    raise SystemExit(f"unknown shape {name}")


def load(name: str, workdir: Path):
    """-> (config, weights) with the layer list replicated to the run length."""
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.random_model import write_random_exl2_model
    from exl2_backend.format.reader import load_weights

    fields, layers = shape_spec(name)
    d = workdir / name
    if not (d / "config.json").is_file():
        t0 = time.perf_counter()
        write_random_exl2_model(d, fields, bpw=4.0)
        print(f"[{name}] wrote random model in {time.perf_counter() - t0:.1f} s", flush=True)
    config = ModelConfig.from_dir(d)
    weights = load_weights(d, config)
    n = config.num_hidden_layers
    if layers != n:
        weights.layers = [weights.layers[i % n] for i in range(layers)]
        config = dataclasses.replace(config, num_hidden_layers=layers)
    return config, weights


def set_variant(v: dict) -> None:
    from exl2_backend.model import layers
    from exl2_backend.ops import cuda_chain, cuda_quant, library

    layers.FUSED_SILU_DOWN = v["silu_down"]
    cuda_chain.GEMV_CHAIN = v.get("chain", True) and v.get("fused_norm", True) and v["silu_down"]
    layers.FUSED_NORM = v.get("fused_norm", True)
    cuda_quant.GEMV_MINB = v.get("gemv_minb", 0)
    library.set_pdl(v["pdl"])  # recorded into the graphs captured from now on
    os.environ["EXL2_BACKEND_ATTN_TICKETS"] = "1" if v.get("attn_tickets") else "0"


def make_engine(model, graphs: bool = True, max_seq_len: int = 2048, cache_type: str = "fp16"):
    from exl2_backend.runtime import Engine, LoadSettings

    settings = LoadSettings(device=str(model.device), max_batch_size=1, max_seq_len=max_seq_len,
                            cache_tokens=max_seq_len, use_cuda_graphs=graphs, cache_type=cache_type)
    return Engine(model, None, settings)


def generate(engine, prompt: list[int], steps: int) -> list[int]:
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.sampling import SamplingParams

    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=steps + 8, ignore_eos=True)
    engine.add_sequence("s", prompt, params)
    toks: list[int] = []
    while not toks:
        toks = list(engine.prefill(["s"])[0].token_ids)
    for _ in range(steps):
        ev = engine.decode(["s"])[0]
        if ev.error:
            raise RuntimeError(ev.error)
        toks += ev.token_ids
    return toks


def upload_decode_step(engine, seq_id: str) -> None:
    """Write sequence `seq_id`'s next decode step into the plain batch-1 graph's static inputs (by running that step
    once). Greedy steps (EXL2_BACKEND_GRAPH_IO, on by default) launch graphs of their own and never write them: the
    plain graph replayed as it was timed a step over an empty context, the 1k attention and its reduce nearly free
    (session 50: 68 against 264 us of the 8B step's critical path, the step 2.10 against 2.25 ms)."""
    seq = engine.seqs[seq_id]
    engine.pages.grow(seq, seq.num_tokens)
    engine.runner.run([[seq.last_token]], [seq.num_tokens - 1], [seq.pages])


# --- profiler ------------------------------------------------------------------------------------------

_NS = re.compile(r"\b[A-Za-z_][A-Za-z_0-9]*::|\(anonymous namespace\)::")


def short_name(name: str, cat: str) -> str:
    if cat != "kernel":
        return f"[{cat}] {name[:60]}"
    n = name.removeprefix("void ")
    n = n.replace("(anonymous namespace)::", "")
    n = n.split("(")[0] if not n.startswith("(") else n
    n = _NS.sub("", n)
    return n[:78] or name[:78]


def trace_events(fn, iters: int) -> list[dict]:
    """The chrome-trace events of `iters` calls of fn under torch.profiler (CPU and CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


def kernel_table(fn, iters: int, critical: dict | None = None, roles: list[str] | None = None,
                 layer_critical: dict | None = None, layer_roles: list[str] | None = None) -> dict[str, list[float]]:
    """{kernel: [count per call, µs per call]} of the device activity of `fn` (torch.profiler, CUDA). With
    `critical`, also fills it with critical_path(...) of the same events, the GEMV launches labelled by `roles`
    (scripts/gemv_roles.py) when given."""
    events = trace_events(fn, iters)
    rows: dict[str, list[float]] = {}
    device_events = []
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        name = short_name(e.get("name", "?"), cat)
        r = rows.setdefault(name, [0.0, 0.0])
        r[0] += 1
        r[1] += float(e.get("dur", 0.0))
        device_events.append((float(e.get("ts", 0.0)), float(e.get("ts", 0.0)) + float(e.get("dur", 0.0)), name))
    if critical is not None:
        critical.update(critical_path(label_gemv_roles(device_events, roles) if roles else device_events, iters))
    if layer_critical is not None and layer_roles:  # the same path, each GEMV labelled with its layer too
        layer_critical.update(critical_path(label_gemv_roles(device_events, layer_roles), iters))
    return {k: [c / iters, us / iters] for k, (c, us) in rows.items()}


def critical_path(events: list[tuple[float, float, str]], iters: int) -> dict[str, list[float]]:
    """Where a chain of kernels spends its wall time, under programmatic dependent launch: a kernel's duration
    includes the time it waits for its predecessor, so durations overlap and their sum exceeds the step. In
    start order, kernel i is charged end_i - max(start_i, end_{i-1}) (from the previous kernel's completion to
    its own: what it adds to the step) and the idle time max(0, start_i - end_{i-1}) goes to "(gap)". The charges
    sum to the span from the first start to the last end. {name: [count per call, µs per call]}."""
    out: dict[str, list[float]] = {}
    prev_end = None
    for start, end, name in sorted(events):
        if prev_end is not None and start > prev_end:
            g = out.setdefault("(gap)", [0.0, 0.0])
            g[0] += 1
            g[1] += start - prev_end
        r = out.setdefault(name, [0.0, 0.0])
        r[0] += 1
        r[1] += max(0.0, end - max(start, prev_end if prev_end is not None else start))
        prev_end = end if prev_end is None else max(prev_end, end)
    return {k: [c / iters, us / iters] for k, (c, us) in out.items()}


def graph_ms(graph, iters: int = 100, reps: int = 7) -> float:
    """Median over `reps` rounds of the mean ms per replay in `iters` back-to-back replays (10 warm-ups first)."""
    return statistics.median(replay_mean_ms(graph, iters, warmup=10 if r == 0 else 0) for r in range(reps))


def print_table(title: str, table: dict[str, list[float]], layers: int) -> None:
    print(f"\n== {title}")
    print(f"{'kernel':80s} {'n/step':>7s} {'n/layer':>7s} {'us/step':>9s}")
    tot_n = tot_us = 0.0
    for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        tot_n += n
        tot_us += us
        print(f"{name:80s} {n:7.1f} {n / layers:7.2f} {us:9.1f}")
    print(f"{'TOTAL':80s} {tot_n:7.1f} {tot_n / layers:7.2f} {tot_us:9.1f}")


def profile_shape(name: str, variants: list[str], workdir: Path, results: dict, context: int = 512,
                  cache_types: tuple[str, ...] = ("fp16",)) -> None:
    from exl2_backend.model import LlamaModel

    config, weights = load(name, workdir)
    t0 = time.perf_counter()
    model = LlamaModel(config, weights, "cuda")
    del weights
    torch.cuda.synchronize()
    print(f"[{name}] model on the GPU in {time.perf_counter() - t0:.1f} s ({config.num_hidden_layers} layers)",
          flush=True)
    role_bytes = gemv_role_bytes(model)
    launch_bytes, launch_kinds = gemv_launch_kinds(model)
    bandwidth = measure_read_bandwidth(torch.device("cuda"))
    results.setdefault(name, {})["read_bandwidth_gbs"] = bandwidth
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (context,), generator=gen).tolist()
    tokens: dict[str, dict[str, list[int]]] = {}  # cache type -> variant -> decoded tokens
    for ct, variant in itertools.product(cache_types, variants):
        set_variant(VARIANTS[variant])
        engine = make_engine(model, max_seq_len=max(2048, context + 64), cache_type=ct)
        vname = variant if ct == "fp16" and context == 512 else f"{variant}@{ct},{context}"
        runner = engine.runner
        tokens.setdefault(ct, {})[vname] = generate(engine, prompt, 8)
        upload_decode_step(engine, "s")
        g = runner._graphs[1]
        step_ms = graph_ms(g)
        critical: dict = {}
        layer_critical: dict = {}
        head = model.lm_head is not None
        graph_tab = kernel_table(g.replay, 20, critical, step_roles(config.num_hidden_layers, head), layer_critical,
                                 step_roles(config.num_hidden_layers, head, by_layer=True))
        eager_tab = kernel_table(functools.partial(model.forward, runner._ids[:1], runner._pos[:1], engine.cache,
                                                   runner._meta(1), logits="last"), 5)
        step_ms2 = graph_ms(g)
        print(f"\n######## {name} / {vname}: graph step {step_ms:.3f} ms (again {step_ms2:.3f} ms), "
              f"{sum(n for n, _ in graph_tab.values()):.0f} kernels per step in the graph, "
              f"{sum(n for n, _ in eager_tab.values()):.0f} eager", flush=True)
        print_table(f"{name} / {vname}: graph replay (per step)", graph_tab, config.num_hidden_layers)
        print_table(f"{name} / {vname}: graph replay, critical path (per step; us from the previous kernel's end "
                    "to this one's)", critical, config.num_hidden_layers)
        print_table(f"{name} / {vname}: eager step (per step)", eager_tab, config.num_hidden_layers)
        roles = role_rows(critical, role_bytes, bandwidth)
        print_role_rows(f"{name} / {vname}: GEMVs by role on the critical path (stream us: the launch's weights and "
                        f"scales at {bandwidth:.0f} GB/s; past us: the rest)", roles)
        kinds = kind_rows(layer_critical, launch_bytes, launch_kinds, bandwidth)
        print_role_rows(f"{name} / {vname}: the same by the launch's bit widths (layers of one role grouped by the "
                        "widths of their GEMV parts, 'gate 4:1|up 4:1')", kinds)
        results.setdefault(name, {})[vname] = {"graph_step_ms": [step_ms, step_ms2], "graph_kernels": graph_tab,
                                                "graph_critical_path": critical, "gemv_roles": roles,
                                                "gemv_kinds": kinds,
                                                "eager_kernels": eager_tab, "tokens": tokens[ct][vname]}
        del engine, runner, g
        gc.collect()
        torch.cuda.empty_cache()
    for same_type in tokens.values():  # the variants of one cache type must decode the same tokens
        if len(set(map(tuple, same_type.values()))) > 1:
            print(f"!! [{name}] variants decoded different tokens: {same_type}")
            results[name]["tokens_differ"] = True
    del model
    gc.collect()
    torch.cuda.empty_cache()


def gemv_role_bytes(model) -> dict[str, int]:
    """Bytes one decode step's GEMVs read per role (packed weights and fp16 lane scales), summed over layers."""
    out = dict.fromkeys(LAYER_ROLES, 0)
    for (role, _), nbytes in gemv_launch_kinds(model)[0].items():
        out[role] += nbytes
    if model.lm_head is not None:
        out["head"] = _op_bytes(model.lm_head)
    return out


def _op_bytes(op) -> int:
    parts = getattr(getattr(op, "launch", None), "parts", [])
    return sum(p.packed.numel() * 4 + (0 if p.scl16 is None else p.scl16.numel() * 2) for p in parts)


def _op_kind(op) -> str:
    """The bit widths of a GEMV's parts: '4:0.1 3:0.9' per part (each width's share of its chunks), '|' between."""
    kinds = []
    for p in getattr(getattr(op, "launch", None), "parts", []):
        kinds.append(" ".join(f"{bits}:{(end - start) / p.C:.2g}" for bits, start, end, _ in p.runs))
    return "|".join(kinds)


def gemv_launch_kinds(model) -> tuple[dict, dict]:
    """{(role, layer): bytes} and {(role, layer): bit widths} of every layer's GEMV launches."""
    nbytes, kinds = {}, {}
    for i, layer in enumerate(model.layers):
        for role, op in zip(LAYER_ROLES, (layer.qkv, layer.o, layer.gate_up, layer.down)):
            nbytes[(role, i)] = _op_bytes(op)
            kinds[(role, i)] = _op_kind(op)
    return nbytes, kinds


def greedy_check(workdir: Path, results: dict, steps: int = 20) -> bool:
    """Variants' graphs: same tokens and bit-identical last logits; eager GPU and CPU reference: agreement."""
    from exl2_backend.model import LlamaModel

    config, weights = load("tiny", workdir)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (40,), generator=gen).tolist()
    model = LlamaModel(config, weights, "cuda")
    out, logits = {}, {}
    for vname in ("before", "after"):
        set_variant(VARIANTS[vname])
        engine = make_engine(model, max_seq_len=256)
        out[f"graph/{vname}"] = generate(engine, prompt, steps)
        logits[vname] = engine.runner._outputs[1].clone()
        del engine
    set_variant(VARIANTS["after"])
    out["eager/after"] = generate(make_engine(model, graphs=False, max_seq_len=256), prompt, steps)
    set_variant(VARIANTS["before"])
    out["eager/before"] = generate(make_engine(model, graphs=False, max_seq_len=256), prompt, steps)
    cpu_model = LlamaModel(config, weights, "cpu")
    out["cpu/reference"] = generate(make_engine(cpu_model, graphs=False, max_seq_len=256), prompt, steps)
    set_variant(VARIANTS["after"])
    ref = out["graph/after"]
    print(f"\n== greedy check ({steps} decode steps, tiny random model)")
    for k, toks in out.items():
        agree = sum(a == b for a, b in zip(toks, ref))
        print(f"{k:16s} {agree:3d}/{len(ref)} tokens equal to graph/after   {toks}")
    exact = out["graph/before"] == ref and torch.equal(logits["before"], logits["after"])
    eager_same = out["eager/before"] == out["eager/after"]
    print(f"graph before/after: tokens equal and last logits bit-identical: {exact}; "
          f"eager before/after tokens equal: {eager_same}")
    results["greedy_check"] = {"tokens": out, "graph_variants_exact": exact, "eager_variants_equal": eager_same}
    return exact and eager_same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--variants", default="before,pdl,silu,after")
    ap.add_argument("--workdir", default="/tmp/profile_decode")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the profiled decode steps")
    ap.add_argument("--cache-types", default="fp16", help="comma-separated KV cache types, each profiled")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU")
        return 1
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"gpu": torch.cuda.get_device_name()}
    ok = True
    if not args.no_check:
        ok = greedy_check(workdir, results)
    for name in args.shapes.split(","):
        profile_shape(name, args.variants.split(","), workdir, results, args.context,
                      tuple(args.cache_types.split(",")))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "profile_decode.json", "w") as f:
        json.dump(results, f, indent=1)
    print("\n== summary: graph step ms (median of 7 x 100 replays, two measurements)")
    for name in args.shapes.split(","):
        for vname, r in results.get(name, {}).items():
            if isinstance(r, dict):
                n = sum(c for c, _ in r["graph_kernels"].values())
                print(f"{name:10s} {vname:7s} {r['graph_step_ms'][0]:.3f} / {r['graph_step_ms'][1]:.3f} ms, "
                      f"{n:.0f} kernels per step")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
