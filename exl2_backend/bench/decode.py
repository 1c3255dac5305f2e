"""Prefill and decode speed of one model at several context lengths, with roofline ratios.

Decode is timed two ways in the same run: through the engine's step API (what a host gets: replay plus
the Python bookkeeping of a step) and as bare CUDA-graph replays of the batch-1 decode step (the GPU
time alone). Both are compared with the roofline: measured read bandwidth / bytes moved per token.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import torch

from exl2_backend.bench.roofline import decode_bytes, measure_read_bandwidth, weight_bytes_per_token
from exl2_backend.bench.timing import replay_mean_ms

PREFILL_RUNS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_model_args(ap, workdir: str) -> None:
    """A measurement script's model arguments: an optional MODEL_DIR, else a random --shape directory under
    --workdir (model_dir_from_args), and --device."""
    ap.add_argument("model_dir", nargs="?", help="an EXL2 directory (default: a random --shape directory)")
    ap.add_argument("--shape", default="llama3-8b", help="random model shape when no MODEL_DIR is given")
    ap.add_argument("--workdir", default=workdir)
    ap.add_argument("--device", default="auto")


def model_dir_from_args(args) -> Path:
    """add_model_args' directory: MODEL_DIR, or the random --shape directory at 4.0 bpw, written when missing."""
    if args.model_dir:
        return Path(args.model_dir)
    model_dir = Path(args.workdir) / args.shape
    if not (model_dir / "config.json").is_file():
        from exl2_backend.format.random_model import write_random_exl2_model

        write_random_exl2_model(model_dir, args.shape, 4.0)
    return model_dir


def load_model(model_dir: str | Path, device: str, multi: dict | None = None):
    """-> (LlamaModel on `device`, weight bytes per decode step, load seconds). `multi`: multi-GPU load
    settings (gpu_split / autosplit / tensor_parallel): the model Engine.load would build (planned, checked)."""
    if multi:
        return _load_placed(model_dir, device, multi)
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.reader import load_weights
    from exl2_backend.model import LlamaModel
    from exl2_backend.runtime.settings import resolve_device

    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config)
    wbytes = weight_bytes_per_token(config, weights)
    t0 = time.perf_counter()
    model = LlamaModel(config, weights, resolve_device(device))
    del weights
    _sync(model.device)
    return model, wbytes, time.perf_counter() - t0


def _load_placed(model_dir, device: str, multi: dict):
    from exl2_backend.plan import describe_dir
    from exl2_backend.runtime import LoadSettings
    from exl2_backend.runtime.placement import load_model as place

    desc = describe_dir(model_dir)
    wbytes = sum(d.disk_bytes() for layer in desc.layers for d in layer.values())  # as weight_bytes_per_token
    wbytes += desc.head.disk_bytes() if desc.head is not None else 2 * desc.config.vocab_size * desc.hidden
    wbytes += 2 * desc.hidden * (2 * len(desc.layers) + 2)  # norms, final norm, one embedding row
    t0 = time.perf_counter()
    model, _ = place(LoadSettings(model_dir=str(model_dir), device=device, **multi))
    for dev in getattr(model, "devices", [model.device]):
        _sync(dev)
    return model, wbytes, time.perf_counter() - t0


def load_engine(model_dir: str | Path, device: str, max_seq_len: int, use_graphs: bool, max_batch_size: int = 1,
                cache_type: str = "fp16", loaded=None, spec: dict | None = None, multi: dict | None = None):
    """-> (Engine, weight bytes per decode step, load seconds); `loaded` = a load_model result to reuse (one
    model, several cache types); `spec` = speculative decoding load settings (draft_model, ngram, ...)."""
    from exl2_backend.runtime import Engine, LoadSettings
    from exl2_backend.tokenizer import Tokenizer

    settings = LoadSettings(model_dir=str(model_dir), device=device, max_seq_len=max_seq_len,
                            cache_tokens=max_seq_len * max_batch_size, max_batch_size=max_batch_size,
                            use_cuda_graphs=use_graphs, cache_type=cache_type, **(spec or {}), **(multi or {}))
    model, wbytes, load_s = loaded or load_model(model_dir, device, multi)
    engine = Engine(model, Tokenizer.from_dir(model_dir), settings)
    _sync(engine.device)
    return engine, wbytes, load_s


def prefill_seconds(engine, seq_id: str, prompt: list[int], new_tokens: int) -> float:
    """Add a greedy sequence (ignore_eos, `new_tokens` to generate) and prefill it to its first token, every
    chunk; -> seconds of the prefill alone, device synchronized before and after. The caller releases it."""
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.sampling import SamplingParams

    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_sequence(seq_id, prompt, params)
    _sync(engine.device)
    t0 = time.perf_counter()
    while not engine.prefill([seq_id])[0].token_ids:
        pass
    _sync(engine.device)
    return time.perf_counter() - t0


def decode_graph(engine):
    """The CUDA graph that repeats the engine's last batch-1 decode step (same inputs, same cache slots), or None.
    With greedy graphs (EXL2_BACKEND_GRAPH_IO, the default) that is the last one launched: the plain graph's staging
    was never written then, and replaying it times a step over an empty context (found for this bench in session
    26, for the profiles and the pytest-benchmark suite in session 50)."""
    greedy = getattr(getattr(engine, "lookahead", None), "graphs", None)
    if greedy is not None and greedy.last is not None:
        return greedy.last
    return getattr(engine.runner, "_graphs", {}).get(1)


def graph_step_seconds(engine, iters: int) -> float | None:
    """Seconds per replay of decode_graph(engine) (None without one): 3 warm-up replays, then `iters` timed with
    CUDA events."""
    g = decode_graph(engine)
    return None if g is None else replay_mean_ms(g, iters) / 1e3


def decode_slack(spec: bool) -> int:
    """Positions past the measured decode tokens: speculative steps may overshoot the count."""
    return 40 if spec else 4


def positions_needed(context: int, prefill_tokens: int, decode_tokens: int, spec: bool = False) -> int:
    """The max_seq_len run_bench loads for measuring `context` (the model's max_position_embeddings bounds it)."""
    return math.ceil((max(context, prefill_tokens) + decode_tokens + 4 + decode_slack(spec)) / 256) * 256


def run_bench(model_dir: str | Path, *, contexts=(512, 2048, 8192, 32768), decode_tokens: int = 128,
              prefill_tokens: int = 2048, device: str = "auto", use_graphs: bool = True, seed: int = 0,
              progress=None, cache_type: str = "fp16", loaded=None, bandwidth: float | None = None,
              spec: dict | None = None, multi: dict | None = None) -> dict:
    """Measure and return a JSON-able dict: bandwidth, bytes/token, prefill and per-context decode speed with a
    KV cache of `cache_type`. `loaded` (a load_model result) and `bandwidth` (GB/s) reuse what an earlier run
    of the same model measured. With `spec` (speculative decoding load settings) decode rates are tokens per
    second over steps that emit one or more tokens, and result["speculation"] holds the acceptance figures."""
    slack = decode_slack(bool(spec))
    max_seq_len = max(positions_needed(c, prefill_tokens, decode_tokens, bool(spec)) for c in contexts)
    engine, wbytes, load_s = load_engine(model_dir, device, max_seq_len, use_graphs, cache_type=cache_type,
                                         loaded=loaded, spec=spec, multi=multi)
    dev = engine.device
    config = engine.config
    if bandwidth is None and dev.type == "cuda":
        bandwidth = measure_read_bandwidth(dev)
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    result = {
        "model_dir": str(model_dir), "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "load_seconds": load_s, "read_bandwidth_gbs": bandwidth, "weight_bytes_per_token": wbytes,
        "cuda_graphs": type(getattr(engine.runner, "inner", engine.runner)).__name__ == "CudaGraphRunner",
        "decode": [],
        "cache_type": cache_type, "kv_bytes_per_token": decode_bytes(config, 0, 0, cache_type),
        # the kernel and runtime switches of this process (EXL2_*), so a result says which paths it measured
        "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("EXL2_")},
    }
    plan = getattr(engine.model, "plan", None)
    if plan is not None and plan.mode != "single":  # layer split / tensor parallel: where everything went
        result["placement"] = plan.to_dict()
    # Warm-up (kernel selection, graph capture) on a short sequence.
    prefill_seconds(engine, "warmup", prompt(64), 8)
    for _ in range(4):
        engine.decode(["warmup"])
    engine.release("warmup")

    # The median of PREFILL_RUNS prefills of fresh ids (a repeated prompt would hit the prefix cache): one timed
    # prefill moved by a third between processes on the H200 (sessions 19-20).
    runs = []
    for i in range(PREFILL_RUNS):
        runs.append(prefill_seconds(engine, f"prefill{i}", prompt(prefill_tokens), 1))
        engine.release(f"prefill{i}")
    secs = statistics.median(runs)
    result["prefill"] = {"tokens": prefill_tokens, "seconds": secs, "tokens_per_s": prefill_tokens / secs,
                         "runs_tokens_per_s": [prefill_tokens / t for t in runs]}
    for ctx in contexts:
        if progress:
            progress(f"context {ctx}")
        prefill_s = prefill_seconds(engine, "seq", prompt(ctx), decode_tokens + slack)
        for _ in range(2):
            engine.decode(["seq"])
        _sync(dev)
        t0 = time.perf_counter()
        emitted = 0
        for _ in range(decode_tokens):  # one token per step, or more when speculating
            ev = engine.decode(["seq"])[0]
            emitted += len(ev.token_ids)
            if emitted >= decode_tokens or ev.finish_reason:
                break
        _sync(dev)
        step = (time.perf_counter() - t0) / max(emitted, 1)  # seconds per generated token
        gpu_step = graph_step_seconds(engine, decode_tokens) if dev.type == "cuda" else None
        engine.release("seq")
        nbytes = decode_bytes(config, wbytes, ctx, cache_type)
        row = {"context": ctx, "prefill_tokens_per_s": ctx / prefill_s, "decode_tokens_per_s": 1 / step,
               "decode_step_ms": step * 1e3, "bytes_per_token": nbytes}
        if gpu_step is not None:
            row.update(graph_step_ms=gpu_step * 1e3, graph_tokens_per_s=1 / gpu_step)
        if bandwidth:
            roof = bandwidth * 1e9 / nbytes
            row.update(roofline_tokens_per_s=roof, pct_roofline=100 / step / roof)
            if gpu_step is not None:
                row["graph_pct_roofline"] = 100 / gpu_step / roof
        result["decode"].append(row)
    engine.assert_no_leaks()
    stats = engine.stats()
    result["graph_io"] = {k: stats[k] for k in ("graph_io_launches", "graph_io_failed")}  # which path ran
    if engine.spec is not None:
        result["speculation"] = {k: v for k, v in engine.stats().items() if k.startswith("spec_")}
    return result


def plot(result: dict | list[dict], path: str | Path) -> None:
    """PNG of decode tokens/s against context length, with the roofline; a list of results (one per cache type)
    draws one engine-step and one roofline curve per cache type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = result if isinstance(result, list) else [result]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        rows = r["decode"]
        ctx = [x["context"] for x in rows]
        tag = f" ({r.get('cache_type', 'fp16')} cache)" if len(results) > 1 else ""
        line = ax.plot(ctx, [x["decode_tokens_per_s"] for x in rows], "o-", label=f"engine step{tag}")[0]
        if len(results) == 1 and all("graph_tokens_per_s" in x for x in rows):
            ax.plot(ctx, [x["graph_tokens_per_s"] for x in rows], "s--", label="graph replay only")
        if all("roofline_tokens_per_s" in x for x in rows):
            ax.plot(ctx, [x["roofline_tokens_per_s"] for x in rows], ":", color="k" if len(results) == 1 else
                    line.get_color(), label=f"roofline{tag} (measured bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    first = results[0]
    ax.set_title(f"{Path(first['model_dir']).name} on {first.get('gpu') or first['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
