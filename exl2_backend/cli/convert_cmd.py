"""`exl2-backend convert IN_DIR OUT_DIR --bpw 4.0`: quantize an FP16 HF model to EXL2 (GPTQ + optimizer)."""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("convert", help="quantize an FP16 HF model directory to EXL2")
    p.add_argument("in_dir", help="FP16/BF16 HF model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("out_dir", help="EXL2 output directory (replaced atomically when done)")
    p.add_argument("--bpw", type=float, default=4.0, help="target decoder bits per weight (default 4.0)")
    p.add_argument("--head-bits", type=int, default=6, choices=[2, 3, 4, 5, 6, 8], help="head bits (default 6)")
    p.add_argument("--cal", nargs="+", default=None, metavar="FILE", help="calibration text files (default: built-in)")
    p.add_argument("--measurement", default=None, metavar="FILE", help="reuse a measurement.json (skips measuring)")
    p.add_argument("--rows", type=int, default=None, help="quant-pass calibration rows (default 32 on CPU, 64 on GPU)")
    p.add_argument("--length", type=int, default=None,
                   help="tokens per calibration row (default 512 on CPU, 2048 on GPU)")
    p.add_argument("--measure-rows", type=int, default=None, help="measurement rows (default 8 on CPU, 16 on GPU)")
    p.add_argument("--attn-options", default="default",
                   help="attention options (0-18) to measure: 'default' (11 spanning the range), 'all', or e.g. 0,4,6")
    p.add_argument("--mlp-options", default="default",
                   help="MLP options (0-16) to measure: 'default' (11 spanning the range), 'all', or e.g. 0,4,7")
    p.add_argument("--work-dir", default=None, help="resumable job state (default OUT_DIR.work)")
    p.add_argument("--shard-mb", type=float, default=8192, help="output shard size in MB")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda or cuda:N")
    p.add_argument("--method", default="gptq", choices=["gptq", "rtn"],
                   help="gptq (default), or rtn: round-to-nearest without act-order (a baseline)")
    p.add_argument("--uniform", default=None, metavar="OPTION",
                   help='one option for every decoder linear, e.g. "4:1@128" (skips measurement and optimizer)')
    p.add_argument("--tf32", action="store_true", help="GPU: TF32 matmuls for block forwards and Hessians")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from exl2_backend.errors import ConfigError
    from exl2_backend.quant.convert import ConvertSettings, convert
    from exl2_backend.quant.measure import parse_option_ids

    try:
        attn, mlp = parse_option_ids(args.attn_options, "attn"), parse_option_ids(args.mlp_options, "mlp")
    except ValueError as e:
        raise ConfigError(str(e), field="measure-options") from None
    s = ConvertSettings(bpw=args.bpw, head_bits=args.head_bits, cal_files=args.cal, measurement=args.measurement,
                        rows=args.rows, length=args.length, measure_rows=args.measure_rows, attn_options=attn,
                        mlp_options=mlp, work_dir=args.work_dir, shard_mb=args.shard_mb,
                        progress=not args.no_progress, device=args.device, method=args.method, uniform=args.uniform,
                        tf32=args.tf32)
    summary = convert(args.in_dir, args.out_dir, s)
    t = summary["timings"]
    print(f"wrote {args.out_dir} on {summary['device']}: {summary['achieved_bpw']:.3f} bpw (target {args.bpw}), "
          f"head {args.head_bits} bits; "
          f"measure {t['measure_s']:.0f} s, quantize {t['quant_s']:.0f} s, total {t['total_s']:.0f} s; "
          f"calibration ppl {summary['calibration_ppl']:.2f}")
    print(json.dumps({"achieved_bpw": summary["achieved_bpw"], "work_dir": summary["work_dir"]}))
    return 0
