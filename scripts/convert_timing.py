"""Wall time of a conversion at a real model shape (random FP16 weights), on the GPU by default.

Random weights make the measurement meaningless, but the work and so the wall time are real. A full 8B
conversion is long for one device call, so by default the model is cut to --layers decoder layers (full width,
full vocabulary and head) and the time of a whole model is extrapolated: per-layer stages (measurement, quant
pass) scale with the layer count, loading and writing with the bytes, the head is paid once. Both the measured
and the extrapolated figures are printed (JSON), with the settings used.

    python scripts/convert_timing.py --out $OUT [--shape llama3-8b] [--layers 4] [--bpw 4.0] [--tf32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch


def _fp16_bytes(cfg: dict) -> int:
    """FP16 bytes of a model of config `cfg` (embedding, decoder linears and norms, head)."""
    h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return 2 * (v * h * (1 if cfg.get("tie_word_embeddings") else 2) + layers * per_layer + h)


def main() -> int:
    from exl2_backend.format.random_fp16_model import fp16_config, write_random_fp16_model
    from exl2_backend.quant.convert import ConvertSettings, convert

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4, help="decoder layers to convert (0: all)")
    p.add_argument("--bpw", type=float, default=4.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--tf32", action="store_true", help="TF32 block forwards and Hessians")
    p.add_argument("--options", default="all", choices=["all", "default"], help="measured options")
    p.add_argument("--work", default="/tmp/convert_timing")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    work = Path(args.work)
    full_cfg = fp16_config(args.shape)
    layers = args.layers or full_cfg["num_hidden_layers"]
    src = work / f"fp16_{args.shape}_L{layers}"
    t = time.perf_counter()
    if not (src / "config.json").is_file():
        write_random_fp16_model(src, args.shape, num_layers=layers)
    gen_s = time.perf_counter() - t

    from exl2_backend.quant.measure import DEFAULT_OPTIONS

    opts = {"attn_options": None, "mlp_options": None} if args.options == "all" else \
        {"attn_options": DEFAULT_OPTIONS["attn"], "mlp_options": DEFAULT_OPTIONS["mlp"]}
    out_dir = work / f"exl2_{args.shape}_L{layers}{args.tag}"
    s = ConvertSettings(bpw=args.bpw, head_bits=6, device=args.device, tf32=args.tf32, progress=False,
                        work_dir=str(out_dir) + ".work", **opts)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = convert(src, out_dir, s)
    tm = summary["timings"]
    full_layers = full_cfg["num_hidden_layers"]
    byte_ratio = _fp16_bytes(full_cfg) / _fp16_bytes(fp16_config(args.shape, layers))
    per_layer = {"measure_s": tm["measure_s"] / layers, "quant_s": tm["quant_layers_s"] / layers}
    extrapolated = (tm["load_s"] * byte_ratio + full_layers * (per_layer["measure_s"] + per_layer["quant_s"])
                    + tm["head_s"] + tm["write_s"] * byte_ratio)
    result = {
        "shape": args.shape, "layers_converted": layers, "layers_full": full_layers, "bpw": args.bpw,
        "achieved_bpw": summary["achieved_bpw"], "device": summary["device"],
        "gpu": torch.cuda.get_device_name() if summary["device"].startswith("cuda") else None,
        "tf32": args.tf32, "options": args.options, "sizes": summary["sizes"],
        "generate_fp16_s": gen_s, "timings": tm, "per_layer": per_layer,
        "extrapolated_full_model_s": extrapolated if layers < full_layers else tm["total_s"],
        "extrapolation": "load and write scaled by FP16 bytes, measurement and quant pass by layers, head once",
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    shutil.rmtree(summary["work_dir"], ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"convert_timing_{args.shape}_L{layers}{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"{args.shape}: {layers} layers converted in {tm['total_s']:.1f} s "
          f"(measure {per_layer['measure_s']:.2f} s/layer, quant {per_layer['quant_s']:.2f} s/layer, "
          f"head {tm['head_s']:.1f} s); full {full_layers}-layer model extrapolated: "
          f"{result['extrapolated_full_model_s']:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
