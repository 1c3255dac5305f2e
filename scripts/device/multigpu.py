#!/usr/bin/env python3
"""Issue 8 on 2 GPUs: one GPU vs layer split vs tensor parallelism on the Llama-3.1-70B shape.

For each bpw (4.0, 4.25): a random EXL2 model is drawn directly on the GPU(s) (bench/random_weights.py; writing
the ~37 GB directory takes ~10 min of CPU on the dev machine), loaded three ways -- all on cuda:0; split over
cuda:0 and cuda:1 (gpu_split chosen so the layers divide about evenly); tensor parallel over both (NCCL,
multicast off) -- and for each: load seconds, batch-1 decode tokens/s through the engine (CUDA graphs), the
plan's predicted bytes per device against torch's allocator figures, and greedy tokens / prompt logits
compared with the one-GPU run. Prints and writes one JSON summary. Phases past --budget-s are skipped
(recorded as such) so the whole run stays within a device call.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback

import torch

from exl2_backend.bench.random_weights import RandomSource
from exl2_backend.plan import describe_random, plan_load
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def free_all() -> None:
    gc.collect()
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(i)


def local_memory(devices: list[int]) -> list[dict]:
    sync_all()
    return [{"allocated": torch.cuda.memory_allocated(i), "max_allocated": torch.cuda.max_memory_allocated(i),
             "reserved": torch.cuda.memory_reserved(i)} for i in devices]


def measure(engine, prompt: list[int], decode_tokens: int) -> dict:
    """Prompt logits on fresh pages, then greedy generation: first token + warm-up + timed decode steps."""
    pages = math.ceil(len(prompt) / engine.page_size)
    logits = engine.runner.run([prompt], [0], [list(range(pages))], "last")[0].float().cpu()
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=decode_tokens + 16, ignore_eos=True)
    engine.add_sequence("m", prompt, params)
    toks = list(engine.prefill(["m"])[0].token_ids)
    for _ in range(4):  # warm-up steps (first replays)
        toks += engine.decode(["m"])[0].token_ids
    sync_all()
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        toks += engine.decode(["m"])[0].token_ids
    sync_all()
    dt = time.perf_counter() - t0
    engine.release("m")
    return {"decode_tokens_per_s": decode_tokens / dt, "step_ms": dt / decode_tokens * 1e3, "tokens": toks,
            "logits": logits, "runner": type(getattr(engine.runner, "inner", engine.runner)).__name__}


def plan_rows(plan) -> list[dict]:
    return [{"device": d.device, "layers": list(d.layers), "weights": d.weights, "kv_cache": d.kv_cache,
             "scratch": d.scratch, "resident": d.resident, "peak": d.peak} for d in plan.devices]


def compare_memory(rows: list[dict], mem: list[dict]) -> None:
    """Predicted resident bytes (weights + KV + draft) vs allocated after load and warm-up, per device."""
    for row, m in zip(rows, mem):
        row.update(measured_allocated=m.get("allocated"), measured_max_allocated=m.get("max_allocated"),
                   measured_reserved=m.get("reserved"))
        if m.get("allocated"):
            row["resident_error_pct"] = 100.0 * (row["resident"] - m["allocated"]) / m["allocated"]
            row["peak_vs_max_allocated_pct"] = 100.0 * (row["peak"] - m["max_allocated"]) / m["max_allocated"]


def split_budget(settings: LoadSettings, desc, free: dict) -> float:
    """The smallest first-device budget (GB, 0.25 steps) that puts half the layers on cuda:0."""
    half = desc.config.num_hidden_layers // 2

    def layers_on_first(quarter: int) -> int:
        plan = plan_load(settings.model_copy(update={"gpu_split": (quarter / 4, 140.0)}), desc=desc, free_memory=free)
        return plan.devices[0].layers[1]

    lo, hi = 4, 4 * 140  # layers_on_first grows with the budget: bisect for the first quarter-GB reaching half
    if layers_on_first(hi) < half:
        raise RuntimeError("no budget splits the layers")
    for _ in range(12):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if layers_on_first(mid) >= half else (mid, hi)
    return hi / 4


def run_mode(mode: str, src: RandomSource, desc, args) -> dict:
    from exl2_backend.model import LlamaModel

    free_all()
    ctx = args.context
    base = LoadSettings(device="cuda:0" if mode == "single" else "cuda", max_seq_len=ctx, cache_tokens=ctx,
                        max_batch_size=1, prefix_caching=False)
    free = {f"cuda:{i}": int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())}
    if mode == "split":
        base = base.model_copy(update={"gpu_split": (split_budget(base, desc, free), 140.0)})
    elif mode == "tp":
        base = base.model_copy(update={"tensor_parallel": 2})
    plan = plan_load(base, desc=desc, free_memory=free)
    plan.check()
    settings = base.model_copy(update={"max_seq_len": plan.max_seq_len, "cache_tokens": plan.cache_tokens})
    config = src.config()
    model = engine = None
    try:
        t0 = time.perf_counter()
        if mode == "single":
            model = LlamaModel(config, src.weights(config, torch.device("cuda:0")), "cuda:0")
        elif mode == "split":
            from exl2_backend.model.split import SplitLlamaModel, segments_from_plan

            model = SplitLlamaModel(config, src.weights(config, torch.device("cuda:0")), segments_from_plan(plan))
        else:
            from exl2_backend.runtime.tp_group import launch_tensor_parallel

            model = launch_tensor_parallel(src, 2, "cuda")
        sync_all()
        load_weights_s = time.perf_counter() - t0
        engine = Engine(model, None, settings)
        sync_all()
        load_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
        out = measure(engine, prompt, args.decode_tokens)
        rows = plan_rows(plan)
        mem = model.coordinator.rank_memory() if mode == "tp" else local_memory(
            sorted({int(d.device.split(":")[1]) for d in plan.devices}))
        compare_memory(rows, mem)
        out.update(mode=mode, load_seconds=load_s, load_weights_seconds=load_weights_s, plan=rows,
                   gpu_split=list(base.gpu_split) if base.gpu_split else None,
                   segments=plan.segments() if mode == "split" else None)
        return out
    finally:
        if engine is not None:
            engine.close()  # tensor-parallel ranks
        elif hasattr(model, "close"):
            model.close()
        del engine, model
        free_all()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="llama3-70b")
    p.add_argument("--bpw", default="4.0,4.25")
    p.add_argument("--modes", default="single,split,tp")
    p.add_argument("--context", type=int, default=2048, help="max_seq_len and KV cache tokens")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip phases that would start after this")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    summary = {"shape": args.shape, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "context": args.context, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
               "runs": []}
    for bpw in [float(x) for x in args.bpw.split(",")]:
        src = RandomSource(args.shape, bpw)
        desc = describe_random(args.shape, bpw)
        results = {}
        for mode in args.modes.split(","):
            if time.perf_counter() - T0 > args.budget_s:
                summary["runs"].append({"bpw": bpw, "mode": mode, "skipped": "time budget"})
                log(f"{bpw} bpw {mode}: skipped (time budget)")
                continue
            if mode != "single" and torch.cuda.device_count() < 2:
                summary["runs"].append({"bpw": bpw, "mode": mode, "skipped": "needs 2 GPUs"})
                continue
            log(f"{bpw} bpw {mode}: loading")
            try:
                r = run_mode(mode, src, desc, args)
            except Exception as exc:  # noqa: BLE001 - recorded, the other modes still run
                traceback.print_exc()
                summary["runs"].append({"bpw": bpw, "mode": mode, "error": f"{type(exc).__name__}: {exc}"})
                continue
            results[mode] = r
            log(f"{bpw} bpw {mode}: load {r['load_seconds']:.1f} s, decode {r['decode_tokens_per_s']:.1f} tok/s "
                f"({r['runner']})")
        ref = results.get("single")
        for mode, r in results.items():
            row = {k: v for k, v in r.items() if k not in ("tokens", "logits")}
            row["bpw"] = bpw
            if ref is not None:
                row["speedup_vs_single"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
                same = [a == b for a, b in zip(r["tokens"], ref["tokens"])]
                row["greedy_tokens_identical"] = all(same) and len(r["tokens"]) == len(ref["tokens"])
                row["greedy_first_divergence"] = same.index(False) if False in same else None
                diff = (r["logits"] - ref["logits"]).abs()
                row["prompt_logits_max_abs_diff"] = float(diff.max())
                row["prompt_logits_argmax_same"] = bool(r["logits"].argmax() == ref["logits"].argmax())
            summary["runs"].append(row)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
