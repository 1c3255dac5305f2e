"""Benchmark the EXL2 GEMM kernels on the GPU and print a table (JSON to $OUT/bench_gemm.json when set).

Per shape: fused kernel time for M = 1..32 (CUDA-graph replay, rotating through enough weight copies that L2
cannot serve them), GB/s over packed weights + activations + output, % of the read bandwidth measured in the
same run (torch.sum over 4 GB), cuBLAS fp16 GEMV on a dense weight of the same shape, and dequant + cuBLAS
times up to large M for the crossover.

Usage: PYTHONPATH=. python3 scripts/bench_gemm.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from exl2_backend.bench.roofline import measure_read_bandwidth
from exl2_backend.bench.timing import graph_time_us
from exl2_backend.format.layout import QuantOption
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.random_model import random_linear_tensors
from exl2_backend.ops import cuda_quant

L2_BYTES = 60 << 20
SHAPES = [  # (name, K, N, option)
    ("gate/up 4096x14336", 4096, 14336, "4:1@128"),
    ("gate/up 4096x14336", 4096, 14336, "5:0.1@128 4:0.9@128"),
    ("down 14336x4096", 14336, 4096, "8:0.05@32 4:0.95@128"),
    ("q/o 4096x4096", 4096, 4096, "4:1@128"),
    ("k/v 4096x1024", 4096, 1024, "4:1@128"),
]
# 4096x14336 at M = 1: the widths, the 8B's mixed gate, and 3 / 4 bits in groups of 32 rows (the mixed gate's groups;
# session 49's BM4 found its launches bound by each SM's chunk rate, the 4-bit ones with groups of 128 by the bandwidth)
WIDTHS = ["2:1@128", "3:1@128", "6:1@128", "8:1@128", "4:0.1@32 3:0.9@32", "3:1@32", "4:1@32"]
FUSED_M = [1, 2, 4, 5, 8, 9, 16, 32]  # the TMA GEMV takes M <= 32 (sm_90+); the mma kernel M <= 32
DEQ_M = [8, 16, 32, 64]


def qtensor(k: int, n: int, option: str, seed: int, device) -> QTensor:
    t = random_linear_tensors("w", k, n, QuantOption.parse(option), torch.Generator().manual_seed(seed))
    return QTensor(key="w", q_weight=t["w.q_weight"].to(device), q_scale=t["w.q_scale"].to(device),
                   q_scale_max=t["w.q_scale_max"].to(device), q_groups=t["w.q_groups"].to(device),
                   q_invperm=t["w.q_invperm"].to(device), out_features=n)





def copies_for(nbytes: int) -> int:
    return max(2, min(64, math.ceil(3 * L2_BYTES / nbytes)))


def gemv_bytes(p, m: int) -> int:
    """Bytes the GEMV kernel must read: packed weights, fp16 lane scales, chunk info, gather map, activations."""
    return (p.packed.numel() * 4 + p.scl16.numel() * 2 + p.info.numel() * 4 + p.xmap.numel() * 2 + m * p.K * 2)


def bench_shape(name, k, n, option, bw, ms_fused, ms_deq, rows, seed=0):
    qt = qtensor(k, n, option, seed, "cuda")
    base = cuda_quant.prepare_linear([qt], "cuda")
    p = base.launch.parts[0]
    wbytes = p.packed.numel() * 4 + p.scales.numel() * 4 + p.maxf.numel() * 4
    bpw = p.packed.numel() * 32 / (k * p.Np)
    ops = [base] + [cuda_quant.clone_for_bench(base) for _ in range(copies_for(gemv_bytes(p, 1)) - 1)]
    dense = [torch.randn(n, k, device="cuda").half() for _ in range(copies_for(n * k * 2))]
    res = {"shape": name, "K": k, "N": n, "option": option, "bpw": round(bpw, 3), "fused": {}, "gemv": {},
           "mma": {}, "dequant": {}, "cublas": {}, "ksplit": {}}
    for m in ms_fused + [mm for mm in ms_deq if mm not in ms_fused]:
        x = torch.randn(m, k, device="cuda").half()
        io = m * k * 2 + m * n * 2
        if m in ms_fused:
            t_old = graph_time_us([(lambda o=o, x=x: o.fused_kernel(x, "mma")) for o in ops])
            cap = cuda_quant.gemv_row_cap(torch.device("cuda"))
            t_new = graph_time_us([(lambda o=o, x=x: o.fused_kernel(x, "gemv")) for o in ops]) if m <= cap else None
            res["mma"][m] = t_old
            res["gemv"][m] = t_new
            res["fused"][m] = min(t_old, t_new or t_old)
            tc = graph_time_us([(lambda w=w, x=x: x @ w.t()) for w in dense])
            res["cublas"][m] = tc
            if t_new is not None:
                nb = gemv_bytes(p, m)
                gbs = nb / t_new / 1e3
                res["ksplit"][m] = base.launch.gemv_plan(m).ksplit
                rows.append([name, option, f"{bpw:.2f}", m, f"{t_new:.2f}", f"{gbs:.0f}", f"{100 * gbs / bw:.1f}",
                             f"{t_old:.2f}", f"{tc:.2f}", res["ksplit"][m]])
            else:
                gbs = (wbytes + io) / t_old / 1e3
                rows.append([name, option, f"{bpw:.2f}", m, "-", f"{gbs:.0f}", f"{100 * gbs / bw:.1f}",
                             f"{t_old:.2f}", f"{tc:.2f}", base.launch.plan(m).ksplit])
        if m in ms_deq:
            res["dequant"][m] = graph_time_us([(lambda o=o, x=x: o._dequant_matmul(x)) for o in ops[:2]], reps=10)
    cross = next((m for m in ms_deq if m in res["fused"] and res["dequant"][m] < res["fused"][m]), None)
    res["crossover_first_M_where_dequant_wins"] = cross
    del ops, dense
    torch.cuda.empty_cache()
    return res


def sweep_gemv_minb(bw, k, n, option) -> dict:
    out = {}
    saved = cuda_quant.GEMV_MINB
    qt = qtensor(k, n, option, 1, "cuda")
    base = cuda_quant.prepare_linear([qt], "cuda")
    p = base.launch.parts[0]
    ops = [base] + [cuda_quant.clone_for_bench(base) for _ in range(copies_for(gemv_bytes(p, 1)) - 1)]
    x = torch.randn(1, k, device="cuda").half()
    for minb in (0, 2, 3):  # 0: TMA ring (sm_90+)
        cuda_quant.GEMV_MINB = minb
        t = graph_time_us([(lambda o=o, x=x: o.fused_kernel(x, "gemv")) for o in ops])
        out[minb] = {"us": round(t, 2), "pct": round(100 * gemv_bytes(p, 1) / t / 1e3 / bw, 1),
                     "ksplit": base.launch.gemv_plan(1).ksplit}
    cuda_quant.GEMV_MINB = saved
    del ops
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes and M values")
    ap.add_argument("--m1", action="store_true", help="only M = 1 of each shape (variant comparison)")
    ap.add_argument("--one", action="store_true", help="a few launches of one shape (for ncu)")
    ap.add_argument("--shape", type=int, default=0, help="--one: index into SHAPES")
    ap.add_argument("--m", type=int, default=1, help="--one: rows of x")
    ap.add_argument("--option", help="--one: this quantization option instead of the shape's (e.g. '3:1@32')")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.one:
        _, k, n, opt = SHAPES[args.shape]
        opt = args.option or opt
        op = cuda_quant.prepare_linear([qtensor(k, n, opt, 0, "cuda")], "cuda")
        x = torch.randn(args.m, k, device="cuda").half()
        for _ in range(3):
            op.fused(x)
        torch.cuda.synchronize()
        return
    bw = measure_read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth (torch.sum over 4 GB fp16): {bw:.0f} GB/s", flush=True)
    if args.m1:
        rows: list = []
        for name, k, n, opt in SHAPES + [("width 4096x14336", 4096, 14336, w) for w in WIDTHS]:
            bench_shape(name, k, n, opt, bw, [1], [], rows)
        for r in rows:
            print(f"M1 {r[0]:<20} {r[1]:<22} {r[4]:>7} us {r[6]:>5}% of read bw  old {r[7]} us  ksplit {r[9]}")
        return
    rows, results = [], []
    shapes = SHAPES[:1] + SHAPES[2:4] if args.quick else SHAPES
    for name, k, n, opt in shapes:
        results.append(bench_shape(name, k, n, opt, bw, FUSED_M, DEQ_M if not args.quick else [1, 16, 32, 64], rows))
        print(f"done {name} {opt}", flush=True)
    for opt in WIDTHS:
        results.append(bench_shape("width 4096x14336", 4096, 14336, opt, bw, [1], [], rows))
    sweep = {f"{k}x{n}": sweep_gemv_minb(bw, k, n, opt) for _, k, n, opt in (SHAPES[0], SHAPES[2])}
    qkv = bench_qkv(bw)
    head = ["shape", "option", "bpw", "M", "gemv us", "GB/s", "% read bw", "old mma us", "cuBLAS fp16 us", "ksplit"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print("\ncrossover (first M where dequant+cuBLAS beats the fused kernel):")
    for r in results:
        if r["dequant"]:
            d = ", ".join(f"M={m}: best fused {r['fused'].get(m, float('nan')):.1f} / deq {t:.1f}"
                          for m, t in r["dequant"].items())
            print(f"  {r['shape']} {r['option']}: {r['crossover_first_M_where_dequant_wins']}   ({d})")
    print("\nGEMV blocks/SM variant sweep at M=1:", json.dumps(sweep))
    print("q/k/v fused vs separate (M=1, us):", json.dumps(qkv))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_gemm.json"), "w") as f:
            json.dump({"read_bw_gbs": bw, "results": results, "sweep": sweep, "qkv": qkv}, f, indent=1)


def bench_qkv(bw) -> dict:
    qs = [qtensor(4096, n, "4:1@128", i, "cuda") for i, n in enumerate((4096, 1024, 1024))]
    fused = cuda_quant.prepare_linear(qs, "cuda")
    sep = [cuda_quant.prepare_linear([q], "cuda") for q in qs]
    x = torch.randn(1, 4096, device="cuda").half()
    f_ops = [fused] + [cuda_quant.clone_for_bench(fused) for _ in range(5)]
    s_ops = [sep] + [[cuda_quant.clone_for_bench(o) for o in sep] for _ in range(5)]
    tf = graph_time_us([(lambda o=o: o.fused(x)) for o in f_ops])
    ts = graph_time_us([(lambda ss=ss: [o.fused(x) for o in ss]) for ss in s_ops])
    return {"fused": tf, "separate": ts}


if __name__ == "__main__":
    main()
