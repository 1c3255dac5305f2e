"""exl2_gemm (CUDA): fused kernel for M <= 32, dequant + cuBLAS above, against the reference.

Tolerance rule (tests.helpers.tolerances.assert_close_rel): with ref = float64 x @ W (W = the bit-exact
reference dequantization) + bias,  max|out - ref| <= 2 * max|fp16 torch.matmul(x, W) (+ bias) - ref| + 2e-3.
The fused kernel sums exact fp16 products of (q - z) and x in fp32 per group and scales in fp32, so its only
fp16 rounding is the output; the factor 2 leaves room for the weight rounding it skips.
A CPU test replays the kernel's split-K / group-flush schedule in float64 on the packed layout.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import reference
from exl2_backend.ops.cuda_quant import PackedQ, pack_qtensor
from tests.helpers.tolerances import assert_close_rel
from tests.kernels.test_exl2_dequant import ALL_WIDTHS, _to_cuda, emulate_qz, make_qt, unit_scales

SMALL_M = [1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 32]
LARGE_M = [33, 64, 200]


# --- CPU: the kernel's K schedule (split ranges, group flushes, fixed-order split sum) in float64 -------------


def _split_ranges(pq: PackedQ, ksplit: int) -> list[tuple[int, int]]:
    """Python copy of exl2_quant.cuh split_range: equal shares of sum(chunks * bits)."""
    total = sum((ce - cs) * b for b, cs, ce, _ in pq.runs)

    def chunk_at(target):
        acc = 0
        for b, cs, ce, _ in pq.runs:
            if target < acc + (ce - cs) * b:
                return cs + -(-(target - acc) // b)
            acc += (ce - cs) * b
        return pq.C

    return [(chunk_at(total * s // ksplit), chunk_at(total * (s + 1) // ksplit)) for s in range(ksplit)]


def emulate_gemm(pq: PackedQ, x: np.ndarray, ksplit: int) -> np.ndarray:
    qz = emulate_qz(pq).astype(np.float64)  # [Kpad, Np]
    scales = unit_scales(pq).astype(np.float64)  # [units, Np]
    xmap = pq.xmap.numpy().view(np.uint16).astype(np.int64)
    xs = np.where(xmap != 0xFFFF, x[:, np.minimum(xmap, x.shape[1] - 1)], 0.0)  # [M, Kpad]
    info = pq.info.numpy().view(np.uint32).astype(np.int64)
    y = np.zeros((x.shape[0], pq.Np))
    for c0, c1 in _split_ranges(pq, ksplit):
        acc = np.zeros_like(y)
        cg = np.zeros_like(y)
        flushed = True
        for c in range(c0, c1):
            for u in range(2):
                rows = slice(c * 64 + 32 * u, c * 64 + 32 * u + 32)
                cg += xs[:, rows] @ qz[rows]
                flushed = bool((info[c] >> (30 + u)) & 1)
                if flushed:
                    acc += cg * scales[2 * c + u]
                    cg[:] = 0
        if not flushed:
            acc += cg * scales[2 * c1 - 1]
        y += acc
    return y


@pytest.mark.parametrize("ksplit", [1, 3, 7])
def test_split_schedule_matches_reference_cpu(ksplit):
    qt = make_qt(ALL_WIDTHS, 64, seed=ksplit)
    pq = pack_qtensor(qt, "cpu")
    x = np.random.default_rng(ksplit).standard_normal((3, pq.K))
    ref = x @ reference.exl2_dequant(qt).double().numpy()
    got = emulate_gemm(pq, x, ksplit)
    # the reference rounds each weight to fp16, the kernel schedule does not: a few fp16 ulps of the weights
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()


def test_split_ranges_cover_every_chunk_cpu():
    pq = pack_qtensor(make_qt([(8, 32)] * 5 + [(4, 128)] * 9 + [(2, 64)], 32, seed=1), "cpu")
    for ks in range(1, pq.C + 1):
        r = _split_ranges(pq, ks)
        assert r[0][0] == 0 and r[-1][1] == pq.C and all(a[1] == b[0] for a, b in itertools.pairwise(r))


# --- CUDA -------------------------------------------------------------------------------------------------


_DQ: dict[int, tuple] = {}  # reference dequantizations, by QTensor identity


def _ref(x: torch.Tensor, qt) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference, fp16 torch matmul of the same dequantized weight), both [M, N] (+ bias)."""
    n = qt.out_features
    if id(qt) not in _DQ or _DQ[id(qt)][0] is not qt:
        _DQ[id(qt)] = (qt, reference.exl2_dequant(qt))
    w = _DQ[id(qt)][1][:, :n].to(x.device)  # [K, N] fp16
    ref = x.double() @ w.double()
    same = x @ w
    if qt.bias is not None:
        ref = ref + qt.bias[:n].double().to(x.device)
        same = same + qt.bias[:n].to(x.device)
    return ref, same


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").half()


@pytest.fixture(scope="module")
def layouts():
    from tests.helpers.synth import random_qtensor

    return {
        "mixed": _to_cuda(make_qt(ALL_WIDTHS, 1000, seed=5, bias=True)),
        "down": _to_cuda(random_qtensor("down", 2048, 1024, "8:0.05@32 4:0.95@128", seed=1)),
        "mlp5": _to_cuda(random_qtensor("up", 1024, 4097, "5:0.1@128 4:0.9@128", seed=2)),
        "odd": _to_cuda(make_qt([(6, 32), (3, 64)], 100, seed=6)),
    }


@pytest.mark.cuda
@pytest.mark.parametrize("m", SMALL_M + LARGE_M)
@pytest.mark.parametrize("name", ["mixed", "down", "mlp5", "odd"])
def test_gemm_against_reference(layouts, name, m):
    from exl2_backend.ops import cuda_quant

    qt = layouts[name]
    x = _x(m, qt.in_features, seed=m)
    ref, same = _ref(x, qt)
    out = cuda_quant.exl2_gemm(x, qt)  # routed: fused for M <= FUSED_MAX_M, dequant + cuBLAS above
    assert out.shape == (m, qt.out_features) and out.dtype == torch.float16
    assert_close_rel(out, ref, same, msg=f"{name} M={m}")
    if m <= 32:  # the fused kernel itself, whatever the routing threshold
        assert_close_rel(cuda_quant._op_for(qt, x.device).fused(x), ref, same, msg=f"fused {name} M={m}")
    if m <= 8:  # both small-M kernels explicitly
        op = cuda_quant._op_for(qt, x.device)
        assert_close_rel(op.fused_kernel(x, "gemv"), ref, same, msg=f"gemv {name} M={m}")
        assert_close_rel(op.fused_kernel(x, "mma"), ref, same, msg=f"mma {name} M={m}")


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 8, 32])
def test_gemm_each_width(bits, m):
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(bits, 128)] * 6 + [(bits, 32)], 512, seed=bits * 100 + m, bias=bits == 5))
    x = _x(m, qt.in_features, seed=bits)
    ref, same = _ref(x, qt)
    op = cuda_quant.prepare_linear([qt], "cuda")
    assert_close_rel(op.fused(x), ref, same, msg=f"{bits}-bit M={m}")


@pytest.mark.cuda
@pytest.mark.parametrize("per_sm", [0, 4, 64])  # ksplit from 1 (whole K per block) to one chunk per split
def test_gemm_split_factors(monkeypatch, per_sm):
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "BLOCKS_PER_SM", {t: per_sm for t in range(1, 5)})
    qt = _to_cuda(make_qt([(8, 32)] * 3 + [(5, 128)] * 4 + [(4, 128)] * 8, 384, seed=per_sm, bias=True))
    op = cuda_quant.prepare_linear([qt], "cuda")
    for m in (1, 9, 32):
        x = _x(m, qt.in_features, seed=m)
        ref, same = _ref(x, qt)
        assert_close_rel(op.fused(x), ref, same, msg=f"per_sm={per_sm} ksplit={op.launch.plan(m).ksplit} M={m}")


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 5, 32, 64])
def test_fused_qkv_matches_separate(m):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    q, k, v = (_to_cuda(random_qtensor(n, 1024, o, opt, seed=i, bias=True)) for i, (n, o, opt) in enumerate(
        [("q", 1024, "4:1@128"), ("k", 256, "6:1@128"), ("v", 256, "8:0.05@32 4:0.95@128")]))
    op = cuda_quant.prepare_linear([q, k, v], "cuda")
    assert op.splits == [1024, 256, 256] and op.out_features == 1536
    x = _x(m, 1024, seed=m)
    run = (lambda o, t: o.fused(t)) if m <= 32 else (lambda o, t: o(t))
    fused = run(op, x)
    parts = [run(cuda_quant.prepare_linear([t], "cuda"), x) for t in (q, k, v)]
    sep = torch.cat(parts, dim=1)
    # split-K factors differ between one fused launch and three separate ones: compare at fp16 ulp level
    torch.testing.assert_close(fused, sep, atol=2e-3, rtol=2e-3)
    for t, got in zip((q, k, v), fused.split(op.splits, dim=1)):
        ref, same = _ref(x, t)
        assert_close_rel(got, ref, same, msg=f"fused part {t.key}")


@pytest.mark.cuda
def test_gemm_deterministic():
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(8, 32)] * 4 + [(4, 128)] * 15, 2048, seed=9))
    op = cuda_quant.prepare_linear([qt], "cuda")
    assert op.launch.plan(4).ksplit > 1
    for m in (1, 4, 24):
        x = _x(m, qt.in_features, seed=m)
        first = op.fused(x)
        for _ in range(3):
            assert torch.equal(op.fused(x), first)


@pytest.mark.cuda
def test_gemm_cuda_graph_replay():
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(6, 128)] * 4 + [(4, 128)] * 4, 1536, seed=4, bias=True))
    op = cuda_quant.prepare_linear([qt], "cuda")
    x = _x(3, qt.in_features, seed=1)
    eager = op(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(x)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = op(x)
    x2 = _x(3, qt.in_features, seed=2)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, op(x2))


@pytest.mark.cuda
def test_gemm_opcheck():
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(8, 32), (4, 128), (4, 128)], 200, seed=8, bias=True))
    op = cuda_quant.prepare_linear([qt], "cuda")
    ws = op.workspace
    for m in (1, 17):
        x = _x(m, qt.in_features, seed=m)
        args = (x, op.launch.parts[0].packed, op.launch.handle, ws.ws, ws.counters)
        torch.library.opcheck(torch.ops.exl2_backend.exl2_gemm.default, args)


@pytest.mark.cuda
def test_gemm_torch_compile():
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(4, 128)] * 4, 256, seed=12))
    op = cuda_quant.prepare_linear([qt], "cuda")
    x = _x(2, qt.in_features, seed=3)
    compiled = torch.compile(lambda t: op(t) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), op(x) * 2)


@pytest.mark.cuda
def test_gemm_bad_inputs():
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(4, 128)] * 2, 64, seed=1))
    op = cuda_quant.prepare_linear([qt], "cuda")
    x = _x(2, 256, seed=0)
    with pytest.raises(TensorShapeError):
        op(x.float())  # dtype
    with pytest.raises(TensorShapeError):
        op(x[:, :128])  # K
    with pytest.raises(TensorShapeError):
        op(x.cpu())  # device
    with pytest.raises(TensorShapeError):
        cuda_quant.exl2_gemm(x.cpu(), qt)
    with pytest.raises(TensorShapeError):
        torch.ops.exl2_backend.exl2_gemm(_x(33, 256, 0), op.launch.parts[0].packed, op.launch.handle,
                                         op.workspace.ws, op.workspace.counters)  # fused kernel is M <= 32
    assert op(x[:0]).shape == (0, 64)
    assert op(x.reshape(2, 1, 256)).shape == (2, 1, 64)


# --- small-M GEMV kernel -------------------------------------------------------------------------------------


def test_lane_scales_match_scale_codes_cpu():
    from exl2_backend.ops.cuda_quant import _lane_scales

    pq = pack_qtensor(make_qt(ALL_WIDTHS, 100, seed=3), "cpu")
    sc = unit_scales(pq)  # [units, Np] per 32-row unit, the kernels' scale_of
    info = pq.info.numpy().view(np.uint32).astype(np.int64)
    lane = _lane_scales(pq.scales, pq.maxf, pq.Np).float().numpy()  # [G, J, 8, 4]
    j, gid, q = np.meshgrid(np.arange(pq.Np // 32), np.arange(8), np.arange(4), indexing="ij")
    cols = 32 * j + gid + 8 * q
    for c in range(pq.C):
        g = info[c] & 0x3FFFFFFF
        np.testing.assert_array_equal(lane[g], sc[2 * c][cols])  # unit 0 of chunk c lies in group g


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_gemv_each_width(bits, m):
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(bits, 128)] * 6 + [(bits, 32)], 1000, seed=bits * 10 + m, bias=bits == 4))
    x = _x(m, qt.in_features, seed=bits + m)
    ref, same = _ref(x, qt)
    op = cuda_quant.prepare_linear([qt], "cuda")
    assert_close_rel(op.fused_kernel(x, "gemv"), ref, same, msg=f"gemv {bits}-bit M={m}")


@pytest.mark.cuda
@pytest.mark.parametrize("minb", [0, 1, 2, 3])  # 0: the TMA-ring kernel on sm_90+, 1: with cluster split-K
def test_gemv_variants_and_splits(monkeypatch, minb):
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "GEMV_MINB", minb)
    qt = _to_cuda(make_qt([(8, 32)] * 3 + [(6, 64)] + [(5, 128)] * 4 + [(4, 128)] * 8 + [(3, 64), (2, 96)], 700,
                          seed=minb, bias=True))
    op = cuda_quant.prepare_linear([qt], "cuda")
    for m in (1, 4, 6):
        x = _x(m, qt.in_features, seed=m)
        ref, same = _ref(x, qt)
        first = op.fused_kernel(x, "gemv")
        assert_close_rel(first, ref, same, msg=f"gemv minb={minb} M={m}")
        assert torch.equal(op.fused_kernel(x, "gemv"), first)  # deterministic split-K reduction


@pytest.mark.cuda
@pytest.mark.parametrize("minb", [0, 1, 2])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gemv_long_splits_wrap_the_ring(monkeypatch, minb, bits):
    """One split per column block (planned for a 1-SM device): each block streams all 40 chunks, several times
    around the TMA kernel's ring (6 to 26 slots), with a partial last column block (700 columns: 6 of 8 warps)."""
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "GEMV_MINB", minb)
    qt = _to_cuda(make_qt([(bits, 128)] * 20, 700, seed=bits, bias=True))  # K = 2560: 40 chunks
    op = cuda_quant.prepare_linear([qt], "cuda")
    op.launch.sms = 1
    op.launch._plans.clear()  # planned at load for this device's SMs
    op.launch.reserve(8)
    for m in (1, 3, 8):
        assert op.launch.gemv_plan(m).ksplit == 1
        x = _x(m, qt.in_features, seed=m)
        ref, same = _ref(x, qt)
        assert_close_rel(op.fused_kernel(x, "gemv"), ref, same, msg=f"gemv ring wrap {bits}-bit minb={minb} M={m}")


@pytest.mark.cuda
@pytest.mark.parametrize("sms", [8, 20, 64])  # split-K factor 2, 5 and 16 over 8 column blocks
def test_gemv_cluster_split_k_fused_parts(monkeypatch, sms):
    """minb 1: three linears in one launch, each with exactly ksplit splits reduced inside a thread-block cluster
    (a 3-run part needs ksplit >= 3; below that the launch takes the ticket path; 16 is a non-portable cluster
    size). Against the reference, and deterministic."""
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "GEMV_MINB", 1)
    widths = [(8, 32)] * 4 + [(4, 128)] * 11 + [(2, 128)] * 2  # 3 runs: ksplit 2 takes the ticket path
    qts = [_to_cuda(make_qt(g, n, seed=i, bias=i == 1, key=f"p{i}"))
           for i, (g, n) in enumerate([(widths, 700), ([(4, 128)] * 14, 300), ([(8, 64)] * 4 + [(4, 128)] * 12, 520)])]
    assert len({q.in_features for q in qts}) == 1
    op = cuda_quant.prepare_linear(qts, "cuda")
    op.launch.sms = sms
    op.launch._plans.clear()
    op.launch.reserve(8)
    for m in (1, 5, 8):
        x = _x(m, qts[0].in_features, seed=m)
        first = op.fused_kernel(x, "gemv")
        for t, got in zip(qts, first.split(op.splits, dim=1)):
            ref, same = _ref(x, t)
            assert_close_rel(got, ref, same, msg=f"cluster split-K sms={sms} M={m} part {t.key}")
        assert torch.equal(op.fused_kernel(x, "gemv"), first)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 4, 5, 8])
@pytest.mark.parametrize("m", [9, 12, 16, 17, 24, 32])
def test_gemv_token_tiles_on_the_tma_kernel(monkeypatch, bits, m):
    """The TMA kernel takes up to 32 rows (one decode feeding 2 or 4 token tiles): plain, gated (silu_mul in the
    gather, bit-identical to silu_mul then the GEMV) and cluster split-K, against the reference."""
    from exl2_backend import ops
    from exl2_backend.ops import cuda_quant

    if cuda_quant.gemv_row_cap(torch.device("cuda")) < 32:
        pytest.skip("the GEMV takes more than 8 rows with the TMA kernel only (sm_90+)")
    monkeypatch.setattr(cuda_quant, "GEMV_MAX_M", 32)
    monkeypatch.setattr(cuda_quant, "FUSED_MAX_M", 32)
    qt = _to_cuda(make_qt([(8, 32)] + [(bits, 128)] * 6 + [(bits, 32)], 700, seed=bits * 5 + m, bias=bits == 4))
    op = cuda_quant.prepare_linear([qt], "cuda")
    k = qt.in_features
    x = _x(m, k, seed=m)
    ref, same = _ref(x, qt)
    got = op.fused_kernel(x, "gemv")
    assert_close_rel(got, ref, same, msg=f"gemv {bits}-bit M={m}")
    assert torch.equal(op(x), got)  # routed to the GEMV too
    gate_up = _x(m, 2 * k, seed=m + 100)
    xs = ops.silu_mul(gate_up[:, :k], gate_up[:, k:]).contiguous()
    assert torch.equal(op.gated(gate_up), op.fused_kernel(xs, "gemv"))
    monkeypatch.setattr(cuda_quant, "GEMV_MINB", 1)
    op.launch.sms = 12  # a split-K factor of 8 over the 3 column blocks: cluster reduction
    op.launch._plans.clear()
    op.launch.reserve(32)
    assert_close_rel(op.fused_kernel(x, "gemv"), ref, same, msg=f"cluster gemv {bits}-bit M={m}")


@pytest.mark.cuda
@pytest.mark.parametrize("minb", [0, 2])
def test_gemv_rejects_large_m(monkeypatch, minb):
    """More rows than the kernel takes (32 for the TMA kernel, 8 for register batches): a typed error."""
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "GEMV_MINB", minb)
    qt = _to_cuda(make_qt([(4, 128)] * 2, 64, seed=1))
    op = cuda_quant.prepare_linear([qt], "cuda")
    cap = cuda_quant.gemv_row_cap(torch.device("cuda"))
    assert cap == (8 if minb == 2 else cap)
    with pytest.raises(TensorShapeError):
        op.fused_kernel(_x(cap + 1, 256, 0), "gemv")


# --- silu_mul fused into the GEMV input (the down projection), and programmatic dependent launch ------------


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_gated_gemv_equals_silu_mul_then_gemv(bits, m):
    """Exact: the gated gather computes silu(gate) * up with silu_mul's arithmetic, so the kernel sees the same
    fp16 input and runs the same deterministic schedule. Odd K (tile edge) and a mixed-width layout."""
    from exl2_backend import ops
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(8, 32)] + [(bits, 128)] * 3 + [(bits, 32)], 333, seed=bits * 7 + m, bias=bits == 5))
    op = cuda_quant.prepare_linear([qt], "cuda")
    k = qt.in_features
    gate_up = _x(m, 2 * k, seed=bits * 3 + m) * 2  # [M, 2K]
    x = ops.silu_mul(gate_up[:, :k], gate_up[:, k:]).contiguous()  # [M, K]: the unfused CUDA input
    want = op.fused_kernel(x, "gemv")
    got = op.gated(gate_up)
    assert torch.equal(got, want)
    ref, same = _ref(x, qt)  # the tolerance rule, for the input the kernel saw
    # silu outputs x 2 are large: the fp16 rounding of W that the kernel skips (it scales exact integer sums in
    # fp32) can pass the factor-2 rule (H200: 0.034 against 2 x 0.0156 at 4-bit M=1). Its bound is added:
    # |sum_k x_k dw_k| <= sum_k |x_k| |w_k| 2^-11.
    w = _DQ[id(qt)][1][:, : qt.out_features].double().to(x.device)  # [K, N]
    w_rounding = float((x.double().abs() @ w.abs()).max()) * 2**-11
    assert_close_rel(got, ref, same, atol=2e-3 + w_rounding, msg=f"gated gemv {bits}-bit M={m}")
    silu_ref = reference.silu_mul(gate_up[:, :k].float(), gate_up[:, k:].float())  # fp32 torch silu
    assert (x.float() - silu_ref).abs().max() <= 2e-3 * silu_ref.abs().max() + 1e-3  # fp16 rounding of silu


@pytest.mark.cuda
def test_gated_gemv_large_m_and_bad_shapes():
    from exl2_backend import ops
    from exl2_backend.ops import cuda_quant

    qt = _to_cuda(make_qt([(4, 128)] * 4, 96, seed=3))
    op = cuda_quant.prepare_linear([qt], "cuda")
    k = qt.in_features
    gate_up = _x(20, 2 * k, seed=4)  # past the GEMV: silu_mul + the routed path
    want = op(ops.silu_mul(gate_up[:, :k], gate_up[:, k:]))
    assert torch.equal(op.gated(gate_up), want)
    with pytest.raises(TensorShapeError):
        torch.ops.exl2_backend.exl2_gemv_gated(_x(1, 2 * k + 2, 0), op.launch.parts[0].packed, op.launch.handle,
                                               op.workspace.ws, op.workspace.counters)


@pytest.mark.cuda
def test_pdl_on_and_off_give_identical_graph_replays():
    """Programmatic dependent launch only changes when kernels start, never what they compute: a captured
    norm -> GEMV -> gated GEMV -> sampling chain replays to the same bits with PDL on and off."""
    from exl2_backend import ops
    from exl2_backend.ops import cuda_quant, library

    qt_up = _to_cuda(make_qt([(4, 128)] * 4, 576, seed=11))  # K 512 -> N 576
    qt_down = _to_cuda(make_qt([(8, 32), (6, 32)] + [(4, 128)] * 4, 509, seed=12))  # K 576 -> N 509
    up = cuda_quant.prepare_linear([qt_up, qt_up], "cuda")  # [M, 1200]: gate | up
    down = cuda_quant.prepare_linear([qt_down], "cuda")
    w = torch.rand(up.in_features, device="cuda").half() + 0.5
    x = _x(1, up.in_features, seed=5)

    def step():
        h = ops.rms_norm(x, w, 1e-5)
        return down.gated(up(h))

    outs = []
    try:
        for on in (False, True):
            library.set_pdl(on)
            torch.cuda.synchronize()
            step()  # warm-up outside capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = step()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            outs.append(y.clone())
    finally:
        library.set_pdl(True)
    assert torch.equal(outs[0], outs[1])


# --- routing between the GEMV, the mma kernel and dequantize + cuBLAS; the workspace ---------------------------


def test_gemv_routing_respects_the_workspace_budget_cpu(monkeypatch):
    """Auto-routing takes the GEMV for M up to the row cap exactly while its split-K partials fit
    WORKSPACE_BUDGET; reserve() covers the routed plans and nothing beyond the budget."""
    from exl2_backend.ops import cuda_quant

    monkeypatch.setattr(cuda_quant, "gemv_row_cap", lambda device: 32)
    monkeypatch.setattr(cuda_quant, "_WORKSPACES", {})
    launch = cuda_quant._Launch([pack_qtensor(make_qt([(4, 128)] * 8, 2048, seed=3), "cpu")], torch.device("cpu"))
    need = {m: 4 * launch.gemv_plan(m).ws_numel for m in range(1, 33)}
    assert need[32] > need[1] > 0  # more rows: more activation splits, more partials
    budget = need[16]
    monkeypatch.setattr(cuda_quant, "WORKSPACE_BUDGET", budget)
    for m in range(1, 33):
        assert launch.takes_gemv(m) == (need[m] <= budget), m
        assert launch.takes_fused(m) == (need[m] <= budget or m <= cuda_quant.FUSED_MAX_M), m
    monkeypatch.setattr(cuda_quant, "GEMV_MAX_M", 4)
    assert launch.takes_gemv(4) and not launch.takes_gemv(5)
    monkeypatch.setattr(cuda_quant, "GEMV_MAX_M", 32)
    launch.reserve(32)
    ws = cuda_quant.workspace(torch.device("cpu"))
    assert 4 * ws.ws.numel() == max([4 * launch.plan(m).ws_numel for m in range(1, 33)]
                                    + [b for b in need.values() if b <= budget])


def test_workspace_frees_uncaptured_buffers_when_it_grows_cpu():
    from exl2_backend.ops.cuda_quant import _Workspace

    ws = _Workspace(torch.device("cpu"))
    ws.reserve(100)
    first, _ = ws.buffers()
    ws.reserve(50)  # never shrinks
    assert ws.ws is first
    ws.reserve(200)
    assert ws.ws.numel() == 200 and ws._old == []  # no capture saw the 100-float buffer: freed
    ws._captured = True
    ws.reserve(300)
    assert len(ws._old) == 1 and ws._old[0].numel() == 200 and not ws._captured


@pytest.mark.cuda
def test_workspace_keeps_a_captured_buffer_alive_when_it_grows():
    from exl2_backend.ops import cuda_quant

    op = cuda_quant.prepare_linear([_to_cuda(make_qt([(4, 128)] * 4, 512, seed=4))], "cuda")
    x = _x(1, 512, 0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op.fused(x)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = op.fused(x)
    ws = op.workspace
    captured = ws.ws
    ws.reserve(ws.ws.numel() + (1 << 20))
    assert any(t is captured for t in ws._old)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, op.fused(x))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8, 9, 16, 32])
def test_routing_picks_gemv_mma_or_dequant(monkeypatch, m):
    """Each route gives the reference within tolerance: the GEMV up to 32 rows on sm_90+; over the workspace
    budget the mma kernel up to FUSED_MAX_M rows and dequantize + cuBLAS above."""
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    qt = _to_cuda(random_qtensor("w", 1024, 1500, "5:0.1@128 4:0.9@128", seed=m))
    op = cuda_quant.prepare_linear([qt], "cuda")
    x = _x(m, 1024, seed=m)
    ref, same = _ref(x, qt)
    cap = cuda_quant.gemv_row_cap(x.device)
    assert op.launch.takes_gemv(m) == (m <= cap)
    assert_close_rel(op(x), ref, same, msg=f"routed M={m}")
    if m <= cap:
        assert torch.equal(op(x), op.fused_kernel(x, "gemv"))
    monkeypatch.setattr(cuda_quant, "WORKSPACE_BUDGET", 0)
    assert not op.launch.takes_gemv(m)
    got = op(x)
    assert_close_rel(got, ref, same, msg=f"over budget M={m}")
    if m <= cuda_quant.FUSED_MAX_M:
        assert torch.equal(got, op.fused_kernel(x, "mma"))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17, 32])
def test_pregathered_input_is_bit_identical(monkeypatch, m):
    """The TMA GEMV with its input gathered by one small kernel first (GEMV_PREGATHER_ITEMS) equals the in-kernel
    gather bit for bit: three fused parts with their own permutations and padded row counts (Kpad 512, 448,
    448), widths 8/5/4, bias, split-K; plain and gated (silu_mul in the pre-gather)."""
    from exl2_backend.ops import cuda_quant

    if cuda_quant.gemv_row_cap(torch.device("cuda")) < 32:
        pytest.skip("the pre-gathered input is read by the TMA kernel only (sm_90+)")
    parts = [make_qt([(8, 32), (4, 416)], 300, seed=m, bias=True, key="a"),
             make_qt([(4, 448)], 64, seed=m + 1, key="b"), make_qt([(5, 64), (4, 384)], 520, seed=m + 2, key="c")]
    op = cuda_quant.prepare_linear([_to_cuda(q) for q in parts], "cuda")
    assert sorted({p.Kpad for p in op.launch.parts}) == [448, 512]
    x = _x(m, 448, seed=m)
    gate_up = _x(m, 2 * 448, seed=m + 50)
    monkeypatch.setattr(cuda_quant, "GEMV_PREGATHER_ITEMS", 0)  # never
    plain, gated = op.fused_kernel(x, "gemv"), op.gated(gate_up)
    monkeypatch.setattr(cuda_quant, "GEMV_PREGATHER_ITEMS", 1)  # always
    assert torch.equal(op.fused_kernel(x, "gemv"), plain)
    assert torch.equal(op.gated(gate_up), gated)
    for q, got in zip(parts, plain.split(op.splits, dim=1)):
        ref, same = _ref(x, _to_cuda(q))
        assert_close_rel(got, ref, same, msg=f"pre-gathered M={m} part {q.key}")


_REDUCE_SCRIPT = """
import sys, torch
from exl2_backend.ops import cuda_quant
from tests.kernels.test_exl2_dequant import _to_cuda, make_qt
outs = []
for m in (1, 3, 5, 8, 16, 32):
    parts = [_to_cuda(make_qt([(8, 64), (4, 960)], 301, seed=m, bias=True, key="a")),
             _to_cuda(make_qt([(4, 1024)], 1000, seed=m + 1, key="b"))]
    op = cuda_quant.prepare_linear(parts, "cuda")
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).half().cuda()
    outs.append(op.fused_kernel(x, "gemv").cpu())
torch.save(outs, sys.argv[1])
"""


@pytest.mark.cuda
def test_vec4_split_reduction_is_bit_identical(tmp_path):
    """EXL2_GEMV_REDUCE=vec4 (read once per process: run in subprocesses) sums the same partials in the same order
    as the scalar reduction: odd column counts (301: a partial quad), bias, two parts, M = 1..32."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    got = {}
    for mode in ("scalar", "vec4"):
        path = f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        env = {**os.environ, "EXL2_GEMV_REDUCE": mode, "PYTHONPATH": path}
        out = tmp_path / f"{mode}.pt"
        subprocess.run([sys.executable, "-c", _REDUCE_SCRIPT, str(out)], env=env, cwd=root, check=True, timeout=120)
        got[mode] = torch.load(out)
    for a, b in zip(got["scalar"], got["vec4"]):
        assert torch.equal(a, b)
