"""Speculative decoding on the GPU -> one JSON document.

1. Step costs: a (k+1)-token verify step against a 1-token decode step of a random Llama-3.1-8B-shape model at
   4.0 bpw (weights drawn on the GPU, bench/random_weights.py), k = 1, 2, 4, 8, at a 1k context: GPU time of the
   captured graphs (CUDA events over replays), the eager verify forward, and whole engine steps (host included).
   The same decode cost for a Llama-3.2-1B-shape draft.
2. Acceptance: target SmolLM2-135M at 6.0 bpw, draft SmolLM2-135M at 2.5 bpw, made from the FP16 default model
   by `exl2-backend convert` (GPTQ with measurement and optimizer, reduced calibration; or GPTQ with one uniform
   option when the full conversion does not finish in time; round-to-nearest as the last resort, which at
   2.5 bpw leaves SmolLM2 unusable as a draft: JSON "models" says which was used); n-gram drafting and the
   draft model on chat, code-editing and summarization prompts (greedy; the draft model also sampled).
3. End-to-end decode tokens/s (batch 1, greedy: identical text in every mode) with and without speculation, the
   median of --reps runs per mode (interleaved).
4. Expected speedup of an 8B target with a 1B-shape draft from (1)'s step costs and (2)'s acceptance.

    python scripts/spec_bench.py --out spec_bench.json            # on the GPU (about 4-5 minutes)
    python scripts/spec_bench.py --smoke --device cpu              # the whole flow, tiny and slow, on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from exl2_backend.bench.timing import replay_mean_ms
from exl2_backend.default_model import MEASUREMENT_FILE
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams
from exl2_backend.spec.adaptive import expected_tokens

KS = (1, 2, 4, 8)
K_E2E = 4  # k of the acceptance and end-to-end runs

CODE = '''import csv


def load_rows(path):
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(row)
    return rows


def summarize(rows):
    total = 0
    count = 0
    for row in rows:
        total += float(row["amount"])
        count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}


def report(path):
    rows = load_rows(path)
    stats = summarize(rows)
    print(f"{stats['count']} rows, total {stats['total']:.2f}, average {stats['average']:.2f}")
    return stats
'''

ARTICLE = (
    "The town library reopened on Monday after an eight-month renovation that replaced the leaking roof, "
    "added a reading room for children and doubled the number of public computers. The project cost 2.4 "
    "million dollars, most of it paid by a state grant, and finished two weeks ahead of schedule. Librarians "
    "said the old building had become too small for the evening classes it hosts, which teach English, "
    "basic computing and job applications to about three hundred adults each year. The new reading room "
    "has low shelves, a small stage for story hours and large windows facing the park. Visitors on the "
    "first day praised the brighter lighting and the quieter heating system, though some complained that "
    "the parking lot is still closed while workers repave it. The library will keep its extended summer "
    "hours until September, opening at nine in the morning and closing at eight in the evening on weekdays."
)

WORKLOADS = {
    "chat": "Explain step by step how a refrigerator keeps food cold, in detail.",
    "code_edit": ("Rename the variable `total` to `running_sum` everywhere in this Python file and print the "
                  "complete updated file:\n\n" + CODE),
    "summarization": "Summarize this article in a few sentences, keeping its key facts:\n\n" + ARTICLE,
}

SMOKE_SHAPES = {  # tiny stand-ins for --smoke (CPU): same code paths, nothing like the real costs
    "target": {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 1024},
    "draft": {"hidden_size": 128, "num_hidden_layers": 1, "intermediate_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 1024},
}


def log(msg: str) -> None:
    print(f"[spec_bench] {msg}", file=sys.stderr, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --- 1. step costs ----------------------------------------------------------------------------------------------


def random_model(shape, device: torch.device):
    from exl2_backend.bench.random_weights import RandomSource
    from exl2_backend.model import LlamaModel

    src = RandomSource(shape, bpw=4.0, head_bits=6)
    config = src.config()
    return LlamaModel(config, src.weights(config, device), device)


def wall_ms(fn, dev: torch.device, iters: int) -> float:
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) * 1e3 / iters


def skip_prefill(e: Engine, seq_id: str) -> None:
    """Mark sequence `seq_id` prefilled without running the model: its prompt's pages are allocated and hold what
    they held (zeros in a fresh cache), and token 0 is its first output. For measurement switches whose wrong outputs
    fail the engine's NaN guard at the prefill (the GEMV's timing probes, EXL2_GEMV_PROBE: session 50's BN2); graph
    replays time the same kernels over any cache contents."""
    seq = e.seqs[seq_id]
    e.pages.grow(seq, len(seq.prompt_ids))
    seq.num_computed = len(seq.prompt_ids)
    seq.output_ids.append(0)


def step_costs(shape, dev: torch.device, context: int, iters: int, ks=KS, kernels: bool = False,
               engine: bool = True) -> dict:
    """Decode vs (k+1)-token verify costs of a random model of `shape` at `context` tokens. `kernels`: also
    the kernel table (count and µs per step, torch.profiler) of the decode graph and of each verify graph.
    `engine`: also whole engine steps, and the prompt prefilled by the engine (False for a measurement switch whose
    wrong outputs the engine refuses: its NaN guard fails the sequence, as H100 call BF7 of session 40 found; the
    prompt's KV is then left uncomputed, skip_prefill)."""
    from exl2_backend.runtime.model_runner import ModelRunner

    t0 = time.perf_counter()
    model = random_model(shape, dev)
    kmax = max(ks)
    n_steps = 4 * iters  # engine steps below generate tokens: room for them
    e = Engine(model, None, LoadSettings(device=str(dev), max_seq_len=context + n_steps * (kmax + 1) + 64,
                                         max_batch_size=1, ngram=True, num_speculative_tokens=kmax))
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (context,), generator=g).tolist()
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=n_steps * (kmax + 1), ignore_eos=True)
    e.add_sequence("s", prompt, params)
    if engine:
        while not e.prefill(["s"])[0].token_ids:
            pass
    else:  # no engine steps: a measurement switch may be on, whose wrong outputs the prefill's NaN guard refuses
        skip_prefill(e, "s")
    seq = e.seqs["s"]
    pos = seq.num_tokens - 1
    e.pages.grow(seq, pos + 1 + kmax)  # pages for the verify windows timed below (released with the sequence)
    runner = e.runner
    out = {"shape": shape if isinstance(shape, str) else "custom", "context": context, "load_s": load_s,
           "graphs": dev.type == "cuda" and hasattr(runner, "inner")}
    if out["graphs"]:
        runner.inner.run([[seq.last_token]], [pos], [seq.pages])  # upload the decode inputs
        out["decode_ms"] = replay_mean_ms(runner.inner._graphs[1], iters)
        out["verify_ms"], out["verify_ratio"], out["eager_verify_ms"] = {}, {}, {}
        for k in ks:
            toks = [[seq.last_token] * (k + 1)]
            runner.run(toks, [pos], [seq.pages], "all")  # capture (first time) and upload
            out["verify_ms"][k] = replay_mean_ms(runner._verify_graphs[(1, k + 1)], iters)
            out["verify_ratio"][k] = out["verify_ms"][k] / out["decode_ms"]
            def eager(toks=toks):
                return ModelRunner.run(runner.inner, toks, [pos], [seq.pages], "all")

            out["eager_verify_ms"][k] = wall_ms(eager, dev, max(iters // 4, 3))
        if kernels:  # where a verify step's extra time goes, kernel by kernel
            from gemv_roles import step_roles
            from profile_decode import gemv_launch_kinds, kernel_table  # scripts/ is sys.path[0] as a script

            # Durations overlap under PDL (a kernel's includes its wait for the one before): "critical" charges each
            # kernel from its predecessor's end to its own (profile_decode.critical_path), which sums to the step.
            graphs = {"decode": runner.inner._graphs[1]}
            graphs.update({f"verify_k{k}": runner._verify_graphs[(1, k + 1)] for k in ks})
            # Each GEMV launch labelled with its role and layer ("gate/up#3"), and each layer's bit widths per role,
            # so a verify's GEMVs can be compared with the decode's role by role.
            roles = step_roles(model.num_layers, model.lm_head is not None, by_layer=True)
            out["launch_kinds"] = {f"{r}#{i}": k for (r, i), k in gemv_launch_kinds(model)[1].items()}
            out["kernels"], out["critical"] = {}, {}
            for name, graph in graphs.items():
                out["critical"][name] = {}
                out["kernels"][name] = kernel_table(graph.replay, 10, critical=out["critical"][name], roles=roles)
    if engine:  # whole engine steps (sampling, bookkeeping, host-device syncs): plain decode vs k wrong drafts
        out["engine_decode_ms"] = wall_ms(lambda: e.verify(["s"], {}), dev, iters)
        out["engine_verify_ms"] = {}
        for k in ks:
            out["engine_verify_ms"][k] = wall_ms(lambda k=k: e.verify(["s"], {"s": [seq.last_token ^ 1] * k}), dev,
                                                 iters)
    e.release("s")
    e.assert_no_leaks()
    return out


def free_device_memory(dev: torch.device) -> None:
    gc.collect()  # engine <-> SpecDecoder reference cycle: free the last engine's graphs and weights now
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# --- 2. models ----------------------------------------------------------------------------------------------------


def rtn_model(fp16_dir: Path, out: Path, bpw: float, head_bits: int, dev: torch.device) -> dict:
    """Round-to-nearest EXL2 at `bpw` with the per-layer option mix of format/random_model.choose_options."""
    from exl2_backend.format.config import ModelConfig
    from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS
    from exl2_backend.format.random_model import choose_options
    from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, layer_linear_key
    from exl2_backend.format.safetensors_io import ShardIndex
    from exl2_backend.format.writer import make_quantization_config, qtensor_tensors, write_model_dir
    from exl2_backend.quant.rtn import quantize_rtn

    config = ModelConfig.from_dir(fp16_dir)
    tensors = {}
    with ShardIndex(fp16_dir) as index:
        for key in index.keys():  # noqa: SIM118 (ShardIndex has keys(), no iterator)
            if key.endswith("norm.weight") or key == "model.embed_tokens.weight":
                tensors[key] = index.get(key).clone()  # outlives the memory map
        for i, (ai, mi) in enumerate(choose_options(config, bpw)):
            for projs, opts in ((ATTN_PROJS, ATTENTION_OPTIONS[ai]), (MLP_PROJS, MLP_OPTIONS[mi])):
                for proj, opt in zip(projs, opts):
                    key = layer_linear_key(i, proj)
                    qt = quantize_rtn(key, index.get(f"{key}.weight").to(dev), opt)
                    tensors.update(qtensor_tensors(qt))
        head = index.get("lm_head.weight") if index.has("lm_head.weight") else index.get("model.embed_tokens.weight")
        tensors.update(qtensor_tensors(quantize_rtn("lm_head", head.to(dev), HEAD_OPTIONS[head_bits])))
    raw = json.loads((fp16_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    write_model_dir(out, raw, tensors, quantization_config=make_quantization_config(
        bpw, head_bits, {"dataset": "none (round-to-nearest)", "rows": 0, "length": 0}), copy_from=fp16_dir)
    return {"method": "rtn", "bpw": bpw, "head_bits": head_bits}


UNIFORM = {"target": "6:1@128", "draft": "3:0.4@64 2:0.6@64"}  # ~6.08 and ~2.55 bpw on SmolLM2's shapes


def prepare_models(fp16_dir: Path, root: Path, dev: torch.device, quant: str, timeout_s: float) -> dict:
    """{"target": (dir, info), "draft": (dir, info)}. "auto" runs, all in parallel within timeout_s, the full
    converter (measurement + optimizer + GPTQ, reduced calibration) and GPTQ with one uniform option per model
    (no measurement); it takes the full conversion if it finished, else the uniform one, else round-to-nearest
    with the per-layer option mix of random_model.choose_options."""
    specs = {"target": (6.0, 6), "draft": (2.5, 4)}
    info: dict[str, dict] = {}
    chosen: dict[str, Path] = {}
    if quant in ("auto", "convert"):
        procs = []
        for name, (bpw, hb) in specs.items():
            for kind in (("full", "uniform") if quant == "auto" else ("full",)):
                out = root / f"smollm2-{bpw}bpw-{kind}"
                cmd = [sys.executable, "-m", "exl2_backend.cli.main", "convert", str(fp16_dir), str(out),
                       "--bpw", str(bpw), "--head-bits", str(hb), "--rows", "16", "--length", "512",
                       "--measure-rows", "4", "--no-progress", "--device", str(dev)]
                cmd += ["--tf32"] if dev.type == "cuda" else []
                cmd += ["--uniform", UNIFORM[name]] if kind == "uniform" else []
                if kind == "full" and MEASUREMENT_FILE.is_file():  # SmolLM2's shipped measurement: no measure pass
                    cmd += ["--measurement", str(MEASUREMENT_FILE)]  # (measuring made 4 parallel jobs miss 140 s)
                procs.append((name, kind, out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                                text=True)))
        t0 = time.perf_counter()
        results = {}
        for name, kind, out, proc in procs:
            try:
                text, _ = proc.communicate(timeout=max(timeout_s - (time.perf_counter() - t0), 1))
                ok = proc.returncode == 0 and (out / "config.json").exists()
                results[(name, kind)] = {"ok": ok, "seconds": time.perf_counter() - t0, "log_tail": text[-300:]}
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                results[(name, kind)] = {"ok": False, "log_tail": f"timed out after {timeout_s:.0f} s"}
        for name, (bpw, _) in specs.items():
            for kind in ("full", "uniform"):
                r = results.get((name, kind))
                if r and r["ok"]:
                    method = "convert (GPTQ, measured + optimized)" if kind == "full" else \
                        f"convert (GPTQ, uniform {UNIFORM[name]!r})"
                    chosen[name] = root / f"smollm2-{bpw}bpw-{kind}"
                    info[name] = {"method": method, "target_bpw": bpw, "seconds": r["seconds"]}
                    break
            if name not in chosen:
                info[name] = {"convert_failed": {k: r["log_tail"] for (n, k), r in results.items() if n == name}}
    for name, (bpw, hb) in specs.items():
        if name in chosen:
            continue
        t0 = time.perf_counter()
        chosen[name] = root / f"smollm2-{bpw}bpw-rtn"
        info[name] = {**info.get(name, {}), **rtn_model(fp16_dir, chosen[name], bpw, hb, dev),
                      "seconds": time.perf_counter() - t0}
    for name, path in chosen.items():
        q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        info[name]["bits_in_config"] = q.get("bits")
    return {name: (chosen[name], info[name]) for name in specs}


# --- 2./3. acceptance and end-to-end speed ---------------------------------------------------------------------


def generate(e: Engine, prompt: list[int], params: GenerationParams) -> tuple[list[int], float]:
    """-> (output tokens, decode seconds from the first token to the last)."""
    e.add_sequence("g", prompt, params)
    out: list[int] = []
    ev = None
    while ev is None or not (ev.token_ids or ev.finish_reason):
        ev = e.prefill(["g"])[0]
    out += ev.token_ids
    sync(e.device)
    t0 = time.perf_counter()
    while not ev.finish_reason:
        ev = e.decode(["g"])[0]
        out += ev.token_ids
    sync(e.device)
    dt = time.perf_counter() - t0
    e.release("g")
    return out, dt


def _counters(e: Engine) -> dict:
    s = e.spec
    return {} if s is None else {"steps": s.steps, "draft_steps": s.draft_steps, "proposed": s.proposed,
                                 "accepted": s.accepted, "rejections": s.rejections, "emitted": s.emitted}


def _delta(before: dict, after: dict) -> dict:
    if not after:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in after}
    judged = d["accepted"] + d["rejections"]
    return {"proposed": d["proposed"], "accepted": d["accepted"],
            "acceptance_rate": d["accepted"] / d["proposed"] if d["proposed"] else 0.0,
            "alpha": d["accepted"] / judged if judged else 0.0,
            "mean_accepted_length": d["accepted"] / d["draft_steps"] if d["draft_steps"] else 0.0,
            "tokens_per_step": d["emitted"] / d["steps"] if d["steps"] else 0.0}


def workloads_run(target: Path, draft: Path, dev: torch.device, max_new: int, reps: int) -> dict:
    base = {"model_dir": target, "device": str(dev), "max_seq_len": 2048, "max_batch_size": 1}
    modes = {"plain": {}, "ngram": {"ngram": True, "num_speculative_tokens": K_E2E},
             "draft_model": {"draft_model": draft, "num_speculative_tokens": K_E2E}}
    engines = {}
    for name, kw in modes.items():
        t0 = time.perf_counter()
        engines[name] = Engine.load(LoadSettings(**base, **kw))
        log(f"loaded {name} engine in {time.perf_counter() - t0:.1f} s")
    tok = engines["plain"].tokenizer
    prompts = {w: tok.encode_chat([{"role": "user", "content": text}]) for w, text in WORKLOADS.items()}
    greedy = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=max_new)
    for e in engines.values():  # warm-up: graph captures (verify windows clipped near the end too)
        generate(e, prompts["chat"], GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=24))
    results = {}
    for w, prompt in prompts.items():
        row: dict = {"prompt_tokens": len(prompt)}
        outputs: dict[str, list[int]] = {}
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        repeats = dict.fromkeys(engines, True)
        # A run is ~0.15 s: one hiccup (a capture, a collection) can halve it. Each mode runs `reps` times, the
        # modes interleaved, and the median counts; the counters come from the first run (greedy repeats itself).
        for rep in range(reps):
            for name, e in engines.items():
                before = _counters(e)
                toks, dt = generate(e, prompt, greedy)
                speeds[name].append((len(toks) - 1) / dt if dt > 0 else 0.0)
                if rep == 0:
                    outputs[name] = toks
                    row[name] = {"tokens": len(toks), **_delta(before, _counters(e))}
                elif toks != outputs[name]:
                    repeats[name] = False
        for name, r in row.items():
            if name in engines:
                r["repeats_itself"] = repeats[name]
                r["decode_tokens_per_s_runs"] = speeds[name]
                r["decode_tokens_per_s"] = statistics.median(speeds[name])
                if name != "plain":
                    r["identical_to_plain"] = outputs[name] == outputs["plain"]
                    r["speedup"] = r["decode_tokens_per_s"] / row["plain"]["decode_tokens_per_s"]
        e = engines["draft_model"]  # sampled: acceptance of the distribution-preserving path
        before = _counters(e)
        toks, dt = generate(e, prompt, GenerationParams(sampling=SamplingParams(temperature=0.7, seed=0),
                                                        max_new_tokens=max_new))
        row["draft_model_sampled_t0.7"] = {"tokens": len(toks), **_delta(before, _counters(e))}
        row["output_preview"] = tok.decode(outputs["plain"][:60])
        results[w] = row
        log(f"{w}: plain {row['plain']['decode_tokens_per_s']:.0f} tok/s; ngram x{row['ngram']['speedup']:.2f} "
            f"(accept {row['ngram']['acceptance_rate']:.0%}); draft x{row['draft_model']['speedup']:.2f} "
            f"(accept {row['draft_model']['acceptance_rate']:.0%}); medians of {reps} runs")
    for e in engines.values():
        e.assert_no_leaks()
    return results


# --- 4. expected 8B speedup ------------------------------------------------------------------------------------


def expected_speedup(costs8: dict, costs1: dict, accept: dict) -> dict:
    """GPU-time speedup of speculation on the 8B shape: tokens per step / step cost relative to decode."""
    dec8, dec1 = costs8.get("decode_ms"), costs1.get("decode_ms")
    if not dec8 or not dec1:
        return {"note": "needs the graph step costs (CUDA)"}
    out = {"decode_ms_8b": dec8, "decode_ms_1b_draft": dec1, "draft_cost": dec1 / dec8, "workloads": {}}
    for w, row in accept.items():
        d, n = row["draft_model"], row["ngram"]
        per_k = {}
        for k in KS:
            cost = k * dec1 + costs8["verify_ms"][k]
            per_k[k] = expected_tokens(d["alpha"], k) * dec8 / cost
        best = max(per_k, key=per_k.get)
        out["workloads"][w] = {
            "draft_alpha": d["alpha"],
            "draft_speedup_by_k": per_k, "draft_best_k": best,
            # the measured tokens per step at k = K_E2E, not the geometric model
            f"draft_speedup_measured_tau_k{K_E2E}": d["tokens_per_step"] * dec8
            / (K_E2E * dec1 + costs8["verify_ms"][K_E2E]),
            f"ngram_speedup_measured_tau_k{K_E2E}": n["tokens_per_step"] * dec8 / costs8["verify_ms"][K_E2E],
        }
    return out


def _int_keys(d):
    """JSON turned the k keys into strings: back to ints (recursively)."""
    if not isinstance(d, dict):
        return d
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in d.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON path (default: stdout)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per mode and workload (the median counts)")
    ap.add_argument("--quant", choices=["auto", "convert", "rtn"], default="auto",
                    help="how the 6.0 / 2.5 bpw SmolLM2 models are made (auto: convert, RTN if it fails or times out)")
    ap.add_argument("--convert-timeout", type=float, default=240.0,
                    help="seconds for the conversions (in parallel; H100 call BE4 of 2026-12-06: 148 and 179 s)")
    ap.add_argument("--work-dir", default="/tmp/spec_bench")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: costs, smollm2, engine (the whole "
                                               "engine steps of the costs)")
    ap.add_argument("--costs-json", default=None,
                    help="step costs from an earlier run's JSON (default with --skip costs: WORK_DIR/costs.json if "
                         "an earlier run on this machine left it) for the expected-speedup part")
    ap.add_argument("--kernels", action="store_true", help="kernel tables of the 8B decode and verify graphs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens (checks the flow on a CPU)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "k": K_E2E}
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shapes = ({"target": SMOKE_SHAPES["target"], "draft": SMOKE_SHAPES["draft"]} if args.smoke
              else {"target": "llama3-8b", "draft": "llama3-1b"})
    iters = 3 if args.smoke else args.iters
    context = 64 if args.smoke else args.context
    max_new = 12 if args.smoke else args.max_new_tokens

    if "smollm2" not in skip:  # models first: the conversions run in subprocesses before our GPU work
        try:
            from exl2_backend.default_model import ensure_default_fp16

            fp16 = ensure_default_fp16()
            models = prepare_models(fp16, work, dev, "rtn" if args.smoke else args.quant, args.convert_timeout)
            result["models"] = {name: info for name, (_, info) in models.items()}
            log(f"models ready: {result['models']}")
        except Exception as exc:  # noqa: BLE001 - the GPU step costs are still worth reporting
            log(f"SmolLM2 unavailable ({type(exc).__name__}: {exc}); skipping acceptance and end-to-end runs")
            result["smollm2_error"] = f"{type(exc).__name__}: {exc}"
            skip.add("smollm2")
    if "costs" not in skip:
        t0 = time.perf_counter()
        result["costs_8b"] = step_costs(shapes["target"], dev, context, iters, kernels=args.kernels,
                                        engine="engine" not in skip)
        free_device_memory(dev)
        result["costs_1b_draft"] = step_costs(shapes["draft"], dev, context, iters, ks=(4,),
                                              engine="engine" not in skip)
        free_device_memory(dev)
        log(f"step costs in {time.perf_counter() - t0:.0f} s: 8B decode {result['costs_8b'].get('decode_ms')} ms, "
            f"verify ratio {result['costs_8b'].get('verify_ratio')}")
        (work / "costs.json").write_text(json.dumps({k: result[k] for k in ("costs_8b", "costs_1b_draft")}))
    else:
        path = Path(args.costs_json) if args.costs_json else work / "costs.json"
        if path.is_file():
            earlier = json.loads(path.read_text())
            for key in ("costs_8b", "costs_1b_draft"):
                if key in earlier:
                    result[key] = _int_keys(earlier[key])
            result["costs_from"] = str(path)
    if "smollm2" not in skip:
        result["workloads"] = workloads_run(models["target"][0], models["draft"][0], dev, max_new, args.reps)
        if "costs_8b" in result and "costs_1b_draft" in result:
            result["expected_8b_with_1b_draft"] = expected_speedup(result["costs_8b"], result["costs_1b_draft"],
                                                                   result["workloads"])
    result["total_seconds"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    log(f"done in {result['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
