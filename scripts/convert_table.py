"""The converter's bitrate table on SmolLM2-135M-Instruct (issue 4's targets), for the lead's GPU run.

Measure once (every option), then convert at each target bpw reusing that measurement, plus two uniform
4-bit baselines (the same option "4:1@128" for every decoder linear, no mixing): round-to-nearest without
act-order, and GPTQ. Each model is evaluated against the FP16 source on the held-out text (`exl2-backend eval`'s
figures). Checks: KL falls with every bpw step, |achieved - target| <= 0.02, KL(4.0 optimized) <= 0.5 x
KL(uniform RTN 4-bit) and <= 0.8 x KL(uniform GPTQ 4-bit). Also the optimized model at the uniform models' own
achieved bpw ("matched"), since "4-bit" uniform costs a little more than 4.0 bpw with its scales.

Heads: 6 bits below 6.0 bpw, 8 bits from 6.0 up (ExLlamaV2's usual pairing); the baselines use 6 bits, RTN's
head round-to-nearest too. Writes convert_table.json, convert_table.md and smollm2_measurement.json to --out.

    python scripts/convert_table.py --out $OUT [--work /tmp/convert_table] [--device cuda] [--max-tokens 0]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

import torch

BPWS = (2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0)
UNIFORM = "4:1@128"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def head_bits_for(bpw: float) -> int:
    return 6 if bpw < 6.0 else 8


def evaluate_dir(model_dir: Path, reference, ids: list[int], bos, device: str, window: int) -> dict:
    from exl2_backend.format.inspect import describe_model
    from exl2_backend.model import LlamaModel
    from exl2_backend.quant.evaluate import evaluate_models

    model = LlamaModel.from_dir(model_dir, device)
    r = evaluate_models(model, reference, ids, window=window, bos=bos)
    del model
    _free(device)
    return {"file_bpw": describe_model(model_dir)["decoder_bpw"], "perplexity": r.perplexity,
            "reference_perplexity": r.reference_perplexity, "kl": r.kl_mean, "kl_max": r.kl_max,
            "top1_agreement": r.top1_agreement, "top1_accuracy": r.top1_accuracy, "eval_tokens": r.tokens,
            "eval_s": r.seconds}


def run(out: Path, work: Path, device: str, max_tokens: int | None, window: int, bpws=BPWS,
        fp16: Path | None = None, sizes: dict | None = None, measurement: Path | None = None) -> dict:
    from exl2_backend.default_model import ensure_default_fp16
    from exl2_backend.model import LlamaModel
    from exl2_backend.quant.convert import ConvertSettings, convert
    from exl2_backend.quant.evaluate import tokenize_eval_text

    t_start = time.perf_counter()
    fp16 = fp16 or ensure_default_fp16()
    work.mkdir(parents=True, exist_ok=True)
    ids, bos = tokenize_eval_text(fp16, None, max_tokens)
    reference = LlamaModel.from_dir(fp16, device)
    rows: list[dict] = []

    def convert_eval(name: str, settings: ConvertSettings, **extra) -> dict:
        target = work / name
        t0 = time.perf_counter()
        summary = convert(fp16, target, settings)
        row = {"name": name, "target_bpw": settings.bpw if settings.uniform is None else None,
               "achieved_bpw": summary["achieved_bpw"], "head_bits": settings.head_bits, "method": settings.method,
               "uniform": settings.uniform, "convert_s": time.perf_counter() - t0, "timings": summary["timings"],
               "calibration_ppl": summary["calibration_ppl"], **extra}
        row.update(evaluate_dir(target, reference, ids, bos, device, window))
        shutil.rmtree(summary["work_dir"], ignore_errors=True)
        _log(f"{name}: {row['achieved_bpw']:.4f} bpw, ppl {row['perplexity']:.3f}, KL {row['kl']:.4f}, "
             f"top-1 {row['top1_agreement']:.4f} (convert {row['convert_s']:.0f} s, eval {row['eval_s']:.0f} s)")
        rows.append(row)
        return row

    base = {"device": device, "progress": False, "attn_options": None, "mlp_options": None, **(sizes or {})}
    # 1. measure once (every option), converting at 4.0 on the way; or reuse a given measurement
    given = str(measurement) if measurement else None
    first = convert_eval("opt_4.0", ConvertSettings(bpw=4.0, head_bits=head_bits_for(4.0), measurement=given, **base),
                         kind="optimized")
    if measurement is None:
        measurement = work / "opt_4.0" / "measurement.json"
        shutil.copyfile(measurement, out / "smollm2_measurement.json")
    measure_s = first["timings"]["measure_s"]
    # 2. every other bitrate from that measurement
    for bpw in bpws:
        if bpw == 4.0:
            continue
        convert_eval(f"opt_{bpw}", ConvertSettings(bpw=bpw, head_bits=head_bits_for(bpw), measurement=str(measurement),
                                                   **base), kind="optimized")
    # 3. uniform 4-bit baselines, and the optimized model at their achieved bpw
    rtn = convert_eval("uniform_rtn_4", ConvertSettings(head_bits=6, method="rtn", uniform=UNIFORM, **base),
                       kind="uniform RTN")
    gptq = convert_eval("uniform_gptq_4", ConvertSettings(head_bits=6, uniform=UNIFORM, **base), kind="uniform GPTQ")
    matched_bpw = round(gptq["achieved_bpw"], 4)
    convert_eval(f"opt_matched_{matched_bpw}", ConvertSettings(bpw=matched_bpw, head_bits=6,
                                                               measurement=str(measurement), **base),
                 kind="optimized (matched)")

    opt = sorted((r for r in rows if r["kind"] == "optimized"), key=lambda r: r["target_bpw"])
    at4 = next(r for r in opt if r["target_bpw"] == 4.0)
    matched = next(r for r in rows if r["kind"] == "optimized (matched)")
    kls = [r["kl"] for r in opt]
    checks = {
        "kl_monotone_decreasing": all(a > b for a, b in itertools.pairwise(kls)),
        "achieved_within_0.02": all(abs(r["achieved_bpw"] - r["target_bpw"]) <= 0.02 for r in opt),
        "file_bpw_equals_achieved": all(abs(r["file_bpw"] - r["achieved_bpw"]) < 1e-6 for r in opt),
        "kl4_le_half_rtn4": at4["kl"] <= 0.5 * rtn["kl"],
        "kl4_le_0.8_uniform_gptq4": at4["kl"] <= 0.8 * gptq["kl"],
        "matched_kl_le_0.8_uniform_gptq4": matched["kl"] <= 0.8 * gptq["kl"],
    }
    ratios = {"kl4_over_rtn4": at4["kl"] / rtn["kl"], "kl4_over_uniform_gptq4": at4["kl"] / gptq["kl"],
              "matched_over_uniform_gptq4": matched["kl"] / gptq["kl"]}
    return {"model": "SmolLM2-135M-Instruct", "fp16_dir": str(fp16), "device": device, "measurement": given,
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "eval_tokens": len(ids), "window": window, "measure_s": measure_s, "rows": rows, "checks": checks,
            "ratios": ratios, "all_passed": all(checks.values()), "total_s": time.perf_counter() - t_start,
            "python": sys.version.split()[0], "torch": torch.__version__}


def markdown(result: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct on {result['gpu'] or result['device']}, {result['eval_tokens']} held-out tokens "
             f"(windows of {result['window']}); FP16 perplexity {result['rows'][0]['reference_perplexity']:.3f}; "
             + (f"measurement {result['measure_s']:.0f} s" if not result.get("measurement")
                else f"measurement reused from {Path(result['measurement']).name}"),
             "",
             "| model | target bpw | achieved bpw | head bits | perplexity | KL (nats/token) | top-1 agreement |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(result["rows"], key=lambda r: (r["kind"] != "optimized", r["target_bpw"] or 0)):
        target = "" if r["target_bpw"] is None else f"{r['target_bpw']:g}"
        label = r["kind"] + (f" {r['uniform']}" if r["uniform"] else "")
        lines.append(f"| {label} | {target} | {r['achieved_bpw']:.4f} | {r['head_bits']} | {r['perplexity']:.3f} | "
                     f"{r['kl']:.4f} | {r['top1_agreement']:.4f} |")
    lines += ["", "checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in result["checks"].items()),
              "ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in result["ratios"].items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for convert_table.json/.md and smollm2_measurement.json")
    p.add_argument("--work", default="/tmp/convert_table", help="converted models (kept for exllamav2_compare.py)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", type=int, default=0, help="held-out tokens to evaluate (0: all, ~24k)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--bpws", default=",".join(f"{b:g}" for b in BPWS))
    p.add_argument("--fp16-dir", default=None, help="source model (default: the SmolLM2 default model's FP16 dir)")
    p.add_argument("--measurement", default=None,
                   help="reuse this measurement.json (e.g. exl2_backend/data/smollm2_measurement.json) instead of "
                        "measuring every option")
    p.add_argument("--quick", action="store_true", help="tiny calibration (a smoke test of the script on CPU)")
    args = p.parse_args()
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"rows": 4, "length": 64, "measure_rows": 2} if args.quick else None
    result = run(out, Path(args.work), device, args.max_tokens or None, args.window,
                 tuple(float(b) for b in args.bpws.split(",")), Path(args.fp16_dir) if args.fp16_dir else None, sizes,
                 Path(args.measurement) if args.measurement else None)
    (out / "convert_table.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    (out / "convert_table.md").write_text(md)
    print(md)
    print(json.dumps({"checks": result["checks"], "ratios": result["ratios"], "total_s": result["total_s"]}))
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
