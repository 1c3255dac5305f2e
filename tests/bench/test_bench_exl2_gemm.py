"""pytest-benchmark suite for the fused EXL2 GEMV at M = 1 and 5 (a k = 4 verify), TMA-ring kernel (minb 0) and
register batches (minb 2) (GPU only; tests/conftest.py marks bench/ as cuda).

A round replays a CUDA graph of one kernel per weight copy (copies rotate through more bytes than L2 holds),
repeated to about 2 ms, and synchronizes (`exl2_backend.bench.timing.GraphRounds`); extra_info carries µs per
kernel and GB/s. scripts/bench_gemm.py has the full table.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.bench.timing import GraphRounds

SHAPES = [(4096, 14336, "4:1@128"), (14336, 4096, "8:0.05@32 4:0.95@128"), (4096, 4096, "5:0.1@128 4:0.9@128")]


@pytest.mark.parametrize("minb", [0, 2])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("k,n,option", SHAPES)
def test_bench_fused_gemv(benchmark, monkeypatch, k, n, option, m, minb):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor
    from tests.kernels.test_exl2_dequant import _to_cuda

    monkeypatch.setattr(cuda_quant, "GEMV_MINB", minb)
    base = cuda_quant.prepare_linear([_to_cuda(random_qtensor("w", k, n, option, seed=0))], "cuda")
    p = base.launch.parts[0]
    nbytes = p.packed.numel() * 4 + p.scales.numel() * 4
    ops = [base] + [cuda_quant.clone_for_bench(base) for _ in range(max(1, (180 << 20) // nbytes))]
    x = torch.randn(m, k, device="cuda").half()
    rounds = GraphRounds([lambda o=o: o.fused(x) for o in ops])
    benchmark.pedantic(rounds, rounds=30, iterations=1, warmup_rounds=2)
    us = rounds.us_per_call
    benchmark.extra_info.update(
        {"us_per_kernel": us, "gb_per_s": nbytes / us / 1e3, "ksplit": base.launch.gemv_plan(m).ksplit})
