"""CUDA EXL2 linears: load-time repacking into the kernels' layout, ctypes launchers, torch custom ops, LinearOp.

The layout (documented in csrc/quant/exl2_quant.cuh) is built here in plain torch by `pack_qtensor`, once per
linear at load time: width runs padded to 64-row chunks, per-lane bit planes arranged so one 16-byte load per
lane feeds mma A registers through the fp16 mantissa trick, a per-chunk group map, the act-order gather map
`xmap`, and the on-disk 4-bit scale codes kept as they are (they are 1/8 of a 4-bit weight's bytes).

Ops (torch.library custom ops, so they work under CUDA-graph capture and torch.compile):
- `exl2_backend::exl2_gemm(x, packed, handle, ws!, counters!)`: fused dequant-GEMM, M <= 32, one launch for
  all linears of a prepared op (q/k/v, gate/up); split-K partials reduced deterministically in `ws`.
- `exl2_backend::exl2_dequant(packed, handle, part, n_begin, n_end)`: fp16 W[K, n_end - n_begin], original
  row order, bit-exact with the reference; large M runs it into scratch and then cuBLAS (torch.matmul).
`handle` names a prepared `_Launch` in a process-wide registry (the prepared tensors are not op inputs).
The shared split-K workspace assumes one stream per device.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch

from exl2_backend.errors import TensorShapeError, UnsupportedBitWidthError
from exl2_backend.format.qtensor import QTensor, rows_in_input_order
from exl2_backend.ops import library

# Largest M that uses the mma kernel (which supports 1..32) where the GEMV does not take M (below sm_90, or its
# split-K partials would not fit WORKSPACE_BUDGET); above it, dequantize + cuBLAS. Measured on the H200
# (scripts/bench_gemm.py, 2026-11-29): dequant+cuBLAS first wins over the mma kernel at M=16 on 4096x14336 and
# 4096x4096, M=32 on 14336x4096, M=8 on 4096x1024 (a 2 MB matrix, where both are launch-bound).
FUSED_MAX_M = int(os.environ.get("EXL2_BACKEND_FUSED_MAX_M", "8"))
# Planned resident blocks per SM by token tiles (MT = ceil(M/8)); must match the kernel's __launch_bounds__.
BLOCKS_PER_SM = {1: 4, 2: 4, 3: 3, 4: 3}
DEQUANT_SLICE = 8192  # columns dequantized per scratch buffer on the large-M path (bounds scratch memory)

_BLOCK_COLS = 128
_CHUNK = 64
_MAX_RUNS = 6
_MAX_DESC = 4
_DESC_LEN = 24 + 4 * _MAX_RUNS
(F_PACKED, F_SCALES, F_MAXF, F_INFO, F_XMAP, F_BIAS, F_OUT, F_WS, F_COUNTERS, F_LDO, F_K, F_KPAD, F_N, F_NP, F_C,
 F_G, F_NRUNS, F_KSPLIT, F_RUNS) = range(19)
F_SCL16 = F_RUNS + 4 * _MAX_RUNS
F_ROPE = F_SCL16 + 1  # first descriptor: host address of the fused rope's int64 arguments (_rope_args), or 0
F_SLOTS = F_ROPE + 1  # first descriptor: blocks the TMA GEMV may plan, its per-run splits balanced by bytes (0: off)
F_GROUP_ROWS = F_SLOTS + 1  # the fewest rows of any quantization group: bounds the scales a GEMV split stages
F_SPAN = F_GROUP_ROWS + 1  # first descriptor: 1 = TMA GEMV splits of equal bytes that may span width runs
F_VEC8 = F_SPAN + 1  # 1: xmap in aligned runs of 8 features (xmap_in_runs_of_8), which the TMA GEMV's gated input needs

# Small-M GEMV kernels: used for M <= GEMV_MAX_M. Blocks of 8 compute warps (256 columns). GEMV_MINB selects:
# 0 = the TMA-ring kernel on sm_90+ (exl2_gemv_tma.cu; the register-batch kernel below sm_90), planned at 2 blocks
# per SM; 1 = the same with the split-K partials reduced inside thread-block clusters (distributed shared memory,
# no workspace round trip; H200 F1 2026-12-02: slower, 21.8 against 15.0 us on 14336x4096); 2 or 3 = the
# register-batch kernel (exl2_gemm.cu gemv_kernel) with that many planned resident blocks per SM (2 -> 128
# registers, no spills; 3 -> 80 registers, small spills; H200 2026-11-29, M=1: 2 gave 15.8 us vs 17.1 us on
# 4096x14336).
# Rows routed to the GEMV (capped by gemv_row_cap): 32 since 2026-12-02 (H200, call F2): M = 9 on the GEMV made
# the 8B's k = 8 verify 2.25x a decode step instead of 4.55x (dequant + cuBLAS), and M = 32 cut a 32-token
# prefill over a 4k cached prefix from 83 to 61 ms.
GEMV_MAX_M = int(os.environ.get("EXL2_BACKEND_GEMV_MAX_M", "32"))
# The TMA GEMV's input is gathered into each part's stored row order by one small kernel first
# (csrc/quant/exl2_gemv_pregather.cu), its blocks then copying their rows with 16-byte loads, when a block would
# otherwise gather at least this many (token, row) items two bytes at a time: M x Kpad / ksplit. H200, call G3
# (scripts/bench_gemm.py, same code with and without): 14336x4096 (896 rows per block) at M = 4 / 8 / 32 took
# 20.2 / 25.0 / 77.4 us pre-gathered against 24.1 / 36.8 / 128.1; 4096x4096 (256 rows) lost at M <= 8 (15.4
# against 14.9 us at 2,048 items) and won from M = 16 (23.4 against 25.4); 4096x14336 (1,024 rows) broke even
# at M = 4. The 8B's k = 4 verify fell from 1.60x to 1.43x a decode step with it from M = 2.
# EXL2_BACKEND_GEMV_PREGATHER_ITEMS: 0 = never, 1 = always.
GEMV_PREGATHER_ITEMS = int(os.environ.get("EXL2_BACKEND_GEMV_PREGATHER_ITEMS", "3072"))
# Bytes the GEMV's split-K partials may take (plan/vram.py KERNEL_WORKSPACE counts 64 MB with the tickets): a
# launch whose plan needs more (a 128k-column head at M > 12: its activations split K six ways at M = 32, ~200 MB
# of partials, as many bytes as the weights) runs on the mma kernel or dequant + cuBLAS instead.
WORKSPACE_BUDGET = 60 << 20
# RMSNorm fused into the TMA GEMV (CudaLinearOp.add_normed, csrc/quant/exl2_gemv_norm.cuh): every block keeps the
# M normalized rows in shared memory beside its 24 KB ring, so M * K * 2 bytes are capped here (two blocks per SM
# must still fit: at K = 4096, M <= 5 covers a decode step and a k = 4 verify).
NORM_SMEM_BYTES = int(os.environ.get("EXL2_BACKEND_NORM_SMEM_BYTES", str(40 << 10)))
# Passes of the fused norm's 256 threads over the M rows that routing accepts (_Launch.takes_norm). 1 since call
# I1 (each pass then waited 8-12 dependent round trips). 3 lost twice after a pass came to wait one round trip:
# H200 calls Q1 (session 10) and X2 (session 14), 8B k = 4 verify 1.394x / 1.678x a decode step against 1.205x /
# 1.303x with 1, since every GEMV block normalizes all M rows again where the norm_pregather launch does it once.
NORM_MAX_PASSES = max(1, int(os.environ.get("EXL2_BACKEND_FUSED_NORM_PASSES", "1")))
# Rows past one pass of the fused norm: add_rms_norm writes each part's stored row order itself
# (csrc/quant/exl2_gemv_norm_pregather.cu; one launch instead of add_rms_norm + pregather, and no scattered gather
# in the GEMV), bit-identical. EXL2_BACKEND_NORM_PREGATHER=0 runs the ops apart, for A/B timing.
NORM_PREGATHER = os.environ.get("EXL2_BACKEND_NORM_PREGATHER", "1") != "0"
# A measurement switch (results wrong): the pre-gathering norm launch skipped, its GEMV reading whatever the stored-
# order buffer and the residual stream hold. What a verify step would save if the producing GEMV wrote its
# consumers' normalized input itself (the ceiling of that design; session 40).
MEASURE_SKIP_NORM_PREGATHER = os.environ.get("EXL2_BACKEND_MEASURE_SKIP_NORM_PREGATHER") == "1"
GEMV_MINB = int(os.environ.get("EXL2_BACKEND_GEMV_MINB", "0"))
# Blocks per SM the GEMV's split-K factor aims at (one wave of the planned resident blocks); the TMA kernel's
# default. Below 1 (e.g. 0.4) plans fewer, longer blocks: no split-K reduction where the columns fill the GPU.
# Launches of M > 1 rows keep it: H100 call BC2 of 2026-12-06 (spec_bench, 8B at 1k) with 1.5 / 1 for them only,
# k = 4 verify 1.531 / 1.441 of a decode step against 1.257 (their partials grow with M, their streaming did more).
GEMV_BLOCKS_PER_SM = float(os.environ.get("EXL2_BACKEND_GEMV_BLOCKS_PER_SM", "2"))
# Splits of the TMA GEMV (csrc/quant/exl2_gemv_splits.cuh): "span" = ksplit splits of equal bytes that may cover
# the end of one width run and the start of the next (the block re-arms its ring between them); "balanced" = splits
# inside one run, the run with the longest item given one more split at a time within GEMV_WAVES waves of the
# planned blocks; "proportional" = each run's share of ksplit by bytes (short runs then stream whole: the 8B's
# gate/up items were 48-348 KB; per-run items leave a 58-chunk 3-bit item beside a 7-chunk 4-bit one).
GEMV_SPLITS = os.environ.get("EXL2_BACKEND_GEMV_SPLITS", "span")
GEMV_WAVES = max(1.0, float(os.environ.get("EXL2_BACKEND_GEMV_WAVES", "1")))
_CAPABILITY: dict[int, tuple[int, int]] = {}


def xmap_in_runs_of_8(xmap: torch.Tensor) -> bool:
    """Whether a kernel xmap (int16 [Kpad], 0xFFFF padding) comes in aligned runs of 8: each 8 stored rows are 8
    consecutive features from a multiple of 8, or 8 padding rows (the TMA GEMV's gated gather by vectors,
    gv_gather_gated_runs)."""
    xm = xmap.to("cpu", torch.int64).reshape(-1, 8) & 0xFFFF
    pad = (xm == 0xFFFF).all(dim=1)
    first = xm[:, :1]
    runs = (xm == first + torch.arange(8)).all(dim=1) & (first[:, 0] % 8 == 0)
    return bool((pad | runs).all())


def gemv_row_cap(device: torch.device) -> int:
    """Rows the small-M GEMV takes on `device`: 32 with the TMA kernel (sm_90+, GEMV_MINB 0 or 1: one decode feeds
    up to four token tiles), else 8."""
    if GEMV_MINB > 1 or device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return 32 if _CAPABILITY[index][0] >= 9 else 8
_GEMV_COLS = 256


# --- layout ----------------------------------------------------------------------------------------------


@dataclass
class PackedQ:
    """One linear in the kernel layout. Shapes: K in_features, Kpad = 64*C, Np = pad32(N), G groups."""

    key: str
    K: int
    Kpad: int
    N: int
    Np: int
    C: int
    G: int
    runs: list[tuple[int, int, int, int]]  # (bits, first chunk, end chunk, word offset)
    packed: torch.Tensor  # int32 [words]
    scales: torch.Tensor  # int32 [G, Np/8] (q_scale as on disk)
    maxf: torch.Tensor  # fp32 [G]: fp16(q_scale_max / 256)
    info: torch.Tensor  # int32 [C]
    xmap: torch.Tensor  # int16 [Kpad] (uint16 bits; 0xFFFF = padding row)
    bias: torch.Tensor | None  # fp16 [Np]
    q_invperm: torch.Tensor  # int32 [K], kept for perm comparisons
    scl16: torch.Tensor | None = None  # fp16 [G, Np/32, 8, 4]: GEMV scales in lane layout (see _lane_scales)
    group_rows: int = 0  # the fewest rows of any group (0: unknown): bounds the scales a GEMV split stages

    def weight_bytes(self) -> int:
        return self.packed.numel() * 4 + self.scales.numel() * 4


def _lane_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (low half; +1 is the high half) and column, within a 64x32 chunk tile, of pair p of lane l in
    n-tile nt: [2, 32, 16] each (exl2_quant.cuh)."""
    nt = torch.arange(2, device=device).view(2, 1, 1)
    lane = torch.arange(32, device=device).view(1, 32, 1)
    p = torch.arange(16, device=device).view(1, 1, 16)
    s, r, t, gid = p // 4, p % 4, lane % 4, lane // 4
    row = 32 * (s // 2) + 8 * t + 4 * (s % 2) + 2 * (r // 2) + 0 * nt
    col = 16 * nt + gid + 8 * (r % 2)
    return row.expand(2, 32, 16), col.expand(2, 32, 16)


def _field_words(lo: torch.Tensor, hi: torch.Tensor, per_word: int, width: int) -> torch.Tensor:
    """[..., 16] pair fields -> [..., 16/per_word] words: pair p at bit width*(p%per_word), +16 for hi."""
    sh = (torch.arange(16, device=lo.device) % per_word) * width
    x = (lo << sh) | (hi << (sh + 16))
    return x.view(*x.shape[:-1], 16 // per_word, per_word).sum(-1)  # disjoint bit fields: sum == or


def _three_bit_words(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """[..., 16] 3-bit pairs -> [..., 3] words: word k holds pairs 5k..5k+4 whole at bit offsets 0, 3, 6, 9, 12
    (+16 for hi), and bit k of pair 15 at bit 15 (+16). Whole fields decode in ~1.4 INT ops per pair
    (exl2_quant.cuh pair_qz<3>)."""
    sh = 3 * torch.arange(5, device=lo.device)
    words = []
    for k in range(3):
        w = ((lo[..., 5 * k : 5 * k + 5] << sh) | (hi[..., 5 * k : 5 * k + 5] << (sh + 16))).sum(-1)
        words.append(w | (((lo[..., 15] >> k) & 1) << 15) | (((hi[..., 15] >> k) & 1) << 31))
    return torch.stack(words, dim=-1)


def _planes(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """MAIN (low bits) and AUX (high bits) plane words of each lane, in kernel order."""
    if bits in (8, 4, 2):
        per = {8: 2, 4: 4, 2: 8}[bits]
        return [_field_words(lo, hi, per, bits)]
    if bits == 6:
        return [_field_words(lo & 15, hi & 15, 4, 4), _field_words(lo >> 4, hi >> 4, 8, 2)]
    if bits == 5:
        return [_field_words(lo & 15, hi & 15, 4, 4), _field_words(lo >> 4, hi >> 4, 16, 1)]
    if bits == 3:
        words = _three_bit_words(lo, hi)
        return [words[..., :2], words[..., 2:]]
    raise UnsupportedBitWidthError(f"bit width {bits}")


def _unpack_run(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows*bits/32, Np] bit streams -> uint8 [rows, Np] values (format doc b.3), in bounded batches."""
    qrows, np_ = words.shape
    units = qrows // bits
    out = torch.empty(units * 32, np_, dtype=torch.uint8, device=words.device)
    step = max(1, (1 << 22) // (32 * np_))
    mask = (1 << bits) - 1
    for u0 in range(0, units, step):
        u1 = min(units, u0 + step)
        w = (words[u0 * bits : u1 * bits].view(u1 - u0, bits, np_).to(torch.int64)) & 0xFFFFFFFF
        vals = torch.empty(u1 - u0, 32, np_, dtype=torch.int64, device=words.device)
        for k in range(32):
            i, s = divmod(k * bits, 32)
            v = w[:, i] >> s
            if s + bits > 32:
                v = v | (w[:, i + 1] << (32 - s))
            vals[:, k] = v & mask
        out[u0 * 32 : u1 * 32] = vals.view(-1, np_).to(torch.uint8)
    return out


def _pack_run(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [64*nch, Np] -> int64 words [nch * J * 64 * bits] in (chunk, warp tile j, plane, nt, lane) order."""
    prow, np_ = vals.shape
    nch, J = prow // _CHUNK, np_ // 32
    row, col = _lane_tables(vals.device)
    out = []
    step = max(1, (1 << 21) // (_CHUNK * np_))
    for c0 in range(0, nch, step):
        n = min(nch, c0 + step) - c0
        v = vals[c0 * _CHUNK : (c0 + n) * _CHUNK].view(n, _CHUNK, J, 32).permute(0, 2, 1, 3).to(torch.int64)
        lo, hi = v[:, :, row, col], v[:, :, row + 1, col]  # [n, J, 2, 32, 16]
        parts = [pl.reshape(n, J, -1) for pl in _planes(lo, hi, bits)]
        out.append(torch.cat(parts, dim=2).reshape(-1))
    return torch.cat(out)


def _lane_scales(scales: torch.Tensor, maxf: torch.Tensor, np_: int) -> torch.Tensor:
    """fp16 scale of every (group, column), fp16(fp16((c+1)^2) * max16) like the kernels' scale_of, laid out
    [G, Np/32, 8 gid, 4]: lane gid of warp tile j reads columns 32j + (gid, gid+8, gid+16, gid+24) as one uint2."""
    g = scales.shape[0]
    w = scales.to(torch.int64) & 0xFFFFFFFF
    sh = 4 * torch.arange(8, device=scales.device)
    codes = ((w.unsqueeze(-1) >> sh) & 15).reshape(g, np_)  # column n: nibble n % 8 of word n / 8
    sc = (((codes + 1) ** 2).float() * maxf.view(g, 1)).half()  # the fp32 product is exact: one rounding
    return sc.view(g, np_ // 32, 4, 8).permute(0, 1, 3, 2).contiguous()


def _to_i32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= (1 << 31), x - (1 << 32), x).to(torch.int32)


def pack_qtensor(qt: QTensor, device) -> PackedQ:
    """Repack one QTensor (any device) into the kernel layout on `device`."""
    device = torch.device(device)
    groups = qt.groups
    k, np_ = qt.in_features, qt.padded_out_features
    if k > 65535:
        raise TensorShapeError(f"K={k} exceeds 65535 (uint16 gather map)", path=qt.source, tensor=f"{qt.key}.q_invperm")
    qw = qt.q_weight.to(device)
    perm = torch.argsort(qt.q_invperm.to(device).long())  # stored row -> original feature
    runs: list[list[int]] = []  # [bits, first group, end group]
    for gi, g in enumerate(groups):
        if runs and runs[-1][0] == g.bits:
            runs[-1][2] = gi + 1
        else:
            runs.append([g.bits, gi, gi + 1])
    words, xmap, unit_group, table = [], [], [], []
    chunk = base = 0
    for bits, ga, gb in runs:
        gs = groups[ga:gb]
        rows = sum(g.rows for g in gs)
        prow = -(-rows // _CHUNK) * _CHUNK
        q0 = gs[0].qrow_start
        vals = _unpack_run(qw[q0 : q0 + rows * bits // 32], bits)
        if prow > rows:  # padding rows hold the zero point (and get activation 0 through xmap)
            vals = torch.cat([vals, torch.full((prow - rows, np_), 1 << (bits - 1), dtype=torch.uint8, device=device)])
        w = _pack_run(vals, bits)
        words.append(w)
        r0 = gs[0].row_start
        xmap += [perm[r0 : r0 + rows], torch.full((prow - rows,), 0xFFFF, dtype=torch.int64, device=device)]
        for gi, g in zip(range(ga, gb), gs):
            unit_group += [gi] * (g.rows // 32)
        unit_group += [gb - 1] * ((prow - rows) // 32)  # padding units join the run's last group
        table.append((bits, chunk, chunk + prow // _CHUNK, base))
        chunk += prow // _CHUNK
        base += w.numel()
    ug = torch.tensor(unit_group, dtype=torch.int64)
    flush = torch.ones_like(ug)
    flush[:-1] = (ug[1:] != ug[:-1]).long()
    info = ug[0::2] | (flush[0::2] << 30) | (flush[1::2] << 31)
    xm = torch.cat(xmap)
    maxf = (qt.q_scale_max.to(device).float() * (1.0 / 256)).half().float()  # max16 of format doc b.4
    return PackedQ(
        key=qt.key, K=k, Kpad=chunk * _CHUNK, N=qt.out_features, Np=np_, C=chunk, G=len(groups), runs=table,
        packed=_to_i32(torch.cat(words)), scales=qt.q_scale.to(device).contiguous(), maxf=maxf.contiguous(),
        info=_to_i32(info).to(device), xmap=torch.where(xm >= 32768, xm - 65536, xm).to(torch.int16),
        bias=None if qt.bias is None else qt.bias.to(device=device, dtype=torch.float16).contiguous(),
        q_invperm=qt.q_invperm.to(device), scl16=_lane_scales(qt.q_scale.to(device), maxf, np_),
        group_rows=min(g.rows for g in groups),
    )


# --- C library ---------------------------------------------------------------------------------------------

_fns: dict[str, object] = {}


def _fn(name: str):
    if name not in _fns:
        P, I32 = library.PTR, library.I32
        sig = {
            "exl2_gemm": (P, I32, P, I32, I32, library.STREAM),
            "exl2_gemv": (P, I32, P, I32, I32, I32, I32, P, I32, library.STREAM),
            "exl2_gemv_pregather": (P, I32, P, I32, I32, I32, P, I32, library.STREAM),
            "exl2_gemv_add_norm": (P, I32, P, I32, I32, P, I32, P, P, I32, library.F32, library.STREAM),
            "exl2_add_norm_pregather": (P, I32, P, I32, I32, P, I32, P, P, I32, library.F32, P, I32,
                                        library.STREAM),
            "exl2_dequant": (P, P, I32, I32, library.STREAM),
            "exl2_gemv_splits": (P, I32, I32, P, P, P),
        }[name]
        _fns[name] = library.declare(name, *sig)
    return _fns[name]


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


class _Workspace:
    """Per-device split-K partials (grow-only) and the per-column-block tickets, which every launch leaves at zero.
    A buffer that a CUDA graph may have captured stays alive when the workspace grows (the graph keeps pointing
    at it); one that no capture saw is freed (model loading grows it linear by linear)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ws = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(1 << 16, dtype=torch.int32, device=device)
        # exl2_gemv_chain's grid barrier: arrivals at [0], the generation one 128-byte line further, at [32]
        self.chain_barrier = torch.zeros(64, dtype=torch.int32, device=device)
        self._old: list[torch.Tensor] = []
        self._captured = False  # self.ws was handed to a launch during a stream capture

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(partials, tickets) for one launch. While torch.compile traces, the buffer counts as captured (the
        compiled graph may later run under a capture; dynamo cannot trace the capture query, which broke
        fullgraph compiles in any process that had not captured a graph yet)."""
        if not self._captured and self.device.type == "cuda" and (
                torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
            self._captured = True
        return self.ws, self.counters

    def reserve(self, numel: int) -> None:
        if numel > self.ws.numel():
            if self._captured:
                self._old.append(self.ws)
            self.ws = torch.empty(numel, dtype=torch.float32, device=self.device)
            self._captured = False


_WORKSPACES: dict[torch.device, _Workspace] = {}


def workspace(device: torch.device) -> _Workspace:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _WORKSPACES:
        _WORKSPACES[device] = _Workspace(device)
    return _WORKSPACES[device]


_REG: weakref.WeakValueDictionary[int, _Launch] = weakref.WeakValueDictionary()  # owners keep launches alive
_handles = itertools.count(1)


@dataclass
class _Plan:
    ksplit: int
    blob: np.ndarray  # int64 [ndesc, _DESC_LEN], OUT/WS/COUNTERS filled per call
    ws_off: list[int]
    cnt_off: list[int]
    ws_numel: int


class _Launch:
    """Linears sharing one input, launched together. Registered under `handle` for the custom ops."""

    def __init__(self, parts: list[PackedQ], device: torch.device):
        if not 1 <= len(parts) <= _MAX_DESC:
            raise TensorShapeError(f"{len(parts)} linears in one launch (1..{_MAX_DESC})")
        ks = {p.K for p in parts}
        if len(ks) != 1:
            raise TensorShapeError(f"fused linears have different in_features: {sorted(ks)}",
                                   tensor=", ".join(p.key for p in parts))
        self.parts = parts
        self.device = device
        self.K = parts[0].K
        self.splits = [p.N for p in parts]
        self.kpad = max(p.Kpad for p in parts)  # rows of the longest part, padding included
        self.out_features = sum(self.splits)
        self.col_off = list(itertools.accumulate([0] + self.splits[:-1]))
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self._plans: dict[int, _Plan] = {}
        self._descs = [self._desc(p) for p in parts]
        # every part stores its rows in input order (no act-order permutation, or down_proj after
        # model/tp_shard.fold_down_order): the in-kernel gather reads contiguous features, coalesced
        self.input_in_order = all(rows_in_input_order(p.q_invperm) for p in parts)
        self.handle = next(_handles)
        _REG[self.handle] = self

    @staticmethod
    def _desc(p: PackedQ) -> np.ndarray:
        f = np.zeros(_DESC_LEN, dtype=np.int64)
        f[F_PACKED], f[F_SCALES], f[F_MAXF] = p.packed.data_ptr(), p.scales.data_ptr(), p.maxf.data_ptr()
        f[F_INFO], f[F_XMAP] = p.info.data_ptr(), p.xmap.data_ptr()
        f[F_BIAS] = 0 if p.bias is None else p.bias.data_ptr()
        f[F_K], f[F_KPAD], f[F_N], f[F_NP], f[F_C], f[F_G] = p.K, p.Kpad, p.N, p.Np, p.C, p.G
        f[F_NRUNS] = len(p.runs)
        for r, run in enumerate(p.runs):
            f[F_RUNS + 4 * r : F_RUNS + 4 * r + 4] = run
        f[F_SCL16] = 0 if p.scl16 is None else p.scl16.data_ptr()
        f[F_GROUP_ROWS] = p.group_rows
        f[F_VEC8] = int(xmap_in_runs_of_8(p.xmap))
        return f

    def gemv_plan(self, m: int) -> _Plan:
        """GEMV kernel: split-K factor filling one wave of GEMV_MINB blocks of 256 columns per SM; per-run
        splits may add up to _MAX_RUNS more (the kernel shares the factor among width runs)."""
        per_sm = GEMV_MINB if GEMV_MINB >= 2 else GEMV_BLOCKS_PER_SM
        key = ("gemv", m, GEMV_MINB, per_sm, GEMV_SPLITS, GEMV_WAVES)  # every setting the blob depends on
        if key not in self._plans:
            ncol = [-(-p.Np // _GEMV_COLS) for p in self.parts]
            ks = max(1, int(self.sms * per_sm) // sum(ncol))
            # activations of one split in shared memory: <= ~48 KB at M tokens
            ks = max(ks, -(-self.kpad * m * 2 // (48 << 10)))
            ks = min(ks, min(p.C for p in self.parts))
            blob = np.stack(self._descs).copy()
            blob[:, F_KSPLIT] = ks
            blob[:, F_LDO] = self.out_features
            if GEMV_SPLITS in ("balanced", "span"):  # span: the per-run plan it is weighed against
                blob[0, F_SLOTS] = int(self.sms * per_sm * GEMV_WAVES)
            blob[0, F_SPAN] = int(GEMV_SPLITS == "span")
            kmax = ks + _MAX_RUNS
            ws_off = list(itertools.accumulate([0] + [kmax * m * p.Np for p in self.parts[:-1]]))
            cnt_off = list(itertools.accumulate([0] + ncol[:-1]))
            ws_numel = kmax * m * sum(p.Np for p in self.parts)
            self._plans[key] = _Plan(ks, blob, ws_off, cnt_off, ws_numel)
        return self._plans[key]

    def gemv_splits(self, m: int) -> tuple[list[list[int]], int]:
        """The TMA GEMV's split count per width run of each part at M rows, and the launch's blocks (host only:
        the planner exl2_gemv runs, csrc/quant/exl2_gemv_splits.cuh)."""
        splits, blocks, _ = self._split_query(m)
        return splits, blocks

    def gemv_staged_groups(self, m: int) -> int:
        """Quantization groups per block whose scales the TMA GEMV stages in shared memory at M rows."""
        return self._split_query(m)[2]

    def _split_query(self, m: int) -> tuple[list[list[int]], int, int]:
        pl = self.gemv_plan(m)
        blob = pl.blob.copy()
        blob[:, F_WS] = blob[:, F_COUNTERS] = 1  # split-K storage present (the planner only checks for it)
        splits = np.zeros(len(self.parts) * _MAX_RUNS, dtype=np.int32)
        blocks, groups = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32)
        st = _fn("exl2_gemv_splits")(blob.ctypes.data, len(self.parts), int(blob[0, F_SLOTS]), splits.ctypes.data,
                                     blocks.ctypes.data, groups.ctypes.data)
        library.check(st, "exl2_gemv_splits")
        runs = [len(p.runs) for p in self.parts]
        split_lists = [splits[i * _MAX_RUNS: i * _MAX_RUNS + n].tolist() for i, n in enumerate(runs)]
        return split_lists, int(blocks[0]), int(groups[0])

    def plan(self, m: int) -> _Plan:
        """Split-K factor: fill the planned resident blocks of one wave, shared by all parts."""
        if m not in self._plans:
            ncol = [-(-p.Np // _BLOCK_COLS) for p in self.parts]
            ks = max(1, self.sms * BLOCKS_PER_SM[(m + 7) // 8] // sum(ncol))
            ks = max(ks, -(-max(p.C for p in self.parts) // 256))  # bounds per-split shared memory
            ks = min(ks, min(p.C for p in self.parts))
            blob = np.stack(self._descs).copy()
            blob[:, F_KSPLIT] = ks
            blob[:, F_LDO] = self.out_features
            ws_off = list(itertools.accumulate([0] + [ks * m * p.Np for p in self.parts[:-1]]))
            cnt_off = list(itertools.accumulate([0] + ncol[:-1]))
            ws_numel = ks * m * sum(p.Np for p in self.parts) if ks > 1 else 0
            self._plans[m] = _Plan(ks, blob, ws_off, cnt_off, ws_numel)
        return self._plans[m]

    def takes_gemv(self, m: int) -> bool:
        """Whether auto-routing sends M rows to the GEMV: within GEMV_MAX_M and the row cap, partials in budget."""
        return 1 <= m <= min(GEMV_MAX_M, gemv_row_cap(self.device)) and \
            4 * self.gemv_plan(m).ws_numel <= WORKSPACE_BUDGET

    def takes_fused(self, m: int) -> bool:
        """Whether M rows run a fused kernel (GEMV or mma) rather than dequantize + cuBLAS."""
        return self.takes_gemv(m) or 1 <= m <= min(FUSED_MAX_M, 32)

    def reserve(self, max_m: int) -> None:
        """Workspace for every routed launch of up to max_m rows."""
        ws = workspace(self.device)
        need = [self.plan(m).ws_numel for m in range(1, max_m + 1)]
        need += [self.gemv_plan(m).ws_numel for m in range(1, max_m + 1) if self.takes_gemv(m)]
        ws.reserve(max(need))

    def gemm(self, x: torch.Tensor, ws: torch.Tensor, counters: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
        m = x.shape[0]
        cap = gemv_row_cap(self.device)
        if kernel == "gemv" or (kernel == "auto" and self.takes_gemv(m)):
            if m > cap:
                raise TensorShapeError(f"the GEMV kernel takes 1..{cap} rows here, got {m}", tensor="x")
            return self._gemv(x, ws, counters)
        pl = self.plan(m)
        out, blob = self._bind(pl, m, ws, counters, x.device)
        if pl.ksplit == 1:
            blob[:, F_WS] = 0  # the mma kernel without split-K takes no workspace
        st = _fn("exl2_gemm")(blob.ctypes.data, len(self.parts), x.data_ptr(), m, _row_stride(x), _stream(x.device))
        library.check(st, "exl2_gemm")
        return out

    def _bind(self, pl: _Plan, m: int, ws: torch.Tensor, counters: torch.Tensor,
              device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
        """The output [M, N] of one launch of plan `pl` and a copy of its descriptors with the output, split-K
        partials and tickets filled in."""
        out = torch.empty(m, self.out_features, dtype=torch.float16, device=device)
        if pl.ws_numel > ws.numel():
            raise TensorShapeError(f"workspace holds {ws.numel()} floats, the launch needs {pl.ws_numel}", tensor="ws")
        blob = pl.blob.copy()
        for i in range(len(self.parts)):
            blob[i, F_OUT] = out.data_ptr() + 2 * self.col_off[i]
            blob[i, F_WS] = ws.data_ptr() + 4 * pl.ws_off[i]
            blob[i, F_COUNTERS] = counters.data_ptr() + 4 * pl.cnt_off[i]
        return out, blob

    def _stored_order_buffer(self, m: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """(buffer, ld): every part's input in stored row order, [parts, M, ld], ld = the longest Kpad (a multiple
        of 64), for the GEMV's pre-gathered input."""
        ld = self.kpad
        return torch.empty(len(self.parts) * m * ld, dtype=torch.float16, device=device), ld

    def _launch_gemv(self, blob: np.ndarray, x: torch.Tensor, m: int, gate_off: int, pre: torch.Tensor | None,
                     ld: int, stream: int) -> None:
        """exl2_gemv of x (the descriptors `blob`), copying its rows from `pre` when given."""
        st = _fn("exl2_gemv")(blob.ctypes.data, len(self.parts), x.data_ptr(), m, _row_stride(x), gate_off, GEMV_MINB,
                              None if pre is None else pre.data_ptr(), ld, stream)
        library.check(st, "exl2_gemv")

    def _gemv(self, x: torch.Tensor, ws: torch.Tensor, counters: torch.Tensor, gate_off: int = 0) -> torch.Tensor:
        """x [M, K], or with gate_off > 0 x [M, >= gate_off + K] holding gate and up (input = silu(gate) * up)."""
        m = x.shape[0]
        pl = self.gemv_plan(m)
        out, blob = self._bind(pl, m, ws, counters, x.device)
        ldx = _row_stride(x)
        stream = _stream(x.device)
        pre, ld = None, 0
        if self.pregathers(m, x, gate_off):
            pre, ld = self._stored_order_buffer(m, x.device)
            st = _fn("exl2_gemv_pregather")(blob.ctypes.data, len(self.parts), x.data_ptr(), m, ldx, gate_off,
                                            pre.data_ptr(), ld, stream)
            library.check(st, "exl2_gemv_pregather")
        self._launch_gemv(blob, x, m, gate_off, pre, ld, stream)
        return out

    def pregathers(self, m: int, x: torch.Tensor | None = None, gate_off: int = 0) -> bool:
        """Whether the GEMV of M rows copies a pre-gathered input (exl2_gemv_pregather, one launch more): each block
        gathers at least GEMV_PREGATHER_ITEMS items, scattered by the rows' permutation (rows in input order are
        gathered coalesced in the kernel; GEMV_PREGATHER_ITEMS = 1 still forces the launch); and always for a gated
        input x (gate_off > 0) that the TMA kernel cannot gather itself (gathers_gated)."""
        if gate_off > 0 and x is not None and gemv_row_cap(self.device) == 32 and not self.gathers_gated(x, gate_off):
            return True
        if self.input_in_order and GEMV_PREGATHER_ITEMS != 1:
            return False
        return 0 < GEMV_PREGATHER_ITEMS <= m * self.kpad // self.gemv_plan(m).ksplit and \
            gemv_row_cap(self.device) == 32

    def gathers_gated(self, x: torch.Tensor, gate_off: int) -> bool:
        """Whether the TMA GEMV gathers the gated input silu(x[:, :K]) * x[:, gate_off:gate_off + K] itself: by
        vectors, so every part's rows must come in aligned runs of 8 features (xmap_in_runs_of_8: rows in
        input order, as down_proj after model/tp_shard.fold_down_order), gate_off and x's row stride multiples of
        8 and x 16-byte aligned."""
        return (all(d[F_VEC8] == 1 for d in self._descs) and gate_off % 8 == 0 and _row_stride(x) % 8 == 0
                and x.data_ptr() % 16 == 0)

    def can_norm(self, m: int) -> bool:
        """Whether M rows can run the GEMV with rms_norm fused into its input (exl2_gemv_add_norm): the TMA kernel
        takes M, the hidden size is a multiple of 8 up to 8192, and the M normalized rows fit NORM_SMEM_BYTES."""
        return (GEMV_MINB == 0 and gemv_row_cap(self.device) == 32 and self.takes_gemv(m)
                and self.K % 8 == 0 and self.K <= 8192 and m * self.K * 2 <= NORM_SMEM_BYTES)

    def takes_norm(self, m: int) -> bool:
        """Whether routing fuses the norm for M rows: can_norm, and the rows fit NORM_MAX_PASSES passes (default
        one) of the kernel's 256 compute threads (norm_row_threads(K) per row). H200 call I1, before the norm's loads
        were issued together: the 8B's k = 4 verify (M = 5, three passes) took 1.55x a decode step fused against
        1.28x apart; the decode step (one pass) gained 3.9%."""
        return self.can_norm(m) and m <= NORM_MAX_PASSES * (256 // norm_row_threads(self.K))

    def can_norm_pregather(self, m: int) -> bool:
        """Whether M rows can run add_rms_norm writing the stored row order, then the GEMV copying it
        (exl2_add_norm_pregather): the TMA kernel takes M, the hidden size is a multiple of 8 up to 8192."""
        return (GEMV_MINB == 0 and gemv_row_cap(self.device) == 32 and self.takes_gemv(m)
                and self.K % 8 == 0 and self.K <= 8192)

    def gemv_add_norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      ws: torch.Tensor, counters: torch.Tensor, pregather: bool = False,
                      rope: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h, residual [M, K] fp16 (rows 16-byte aligned), weight fp16 [K] -> (GEMV output [M, N], residual out
        [M, K] = h + residual; an empty tensor when residual is None). One launch that normalizes inside the GEMV,
        or with `pregather` two: the norm writing every part's input in stored row order, then the GEMV copying
        its rows. rope: the fused rope's arguments (_rope_args), applied by the GEMV after its output."""
        m = h.shape[0]
        out, blob = self._bind(self.gemv_plan(m), m, ws, counters, h.device)
        if rope is not None:
            blob[0, F_ROPE] = rope.ctypes.data  # read by the C call below, while `rope` is alive
        res_out = h.new_empty((m, self.K)) if residual is not None else h.new_empty(0)
        norm_args = (blob.ctypes.data, len(self.parts), h.data_ptr(), m, _row_stride(h),
                     None if residual is None else residual.data_ptr(),
                     0 if residual is None else _row_stride(residual), weight.data_ptr(),
                     None if residual is None else res_out.data_ptr(), self.K, float(eps))
        stream = _stream(h.device)
        if not pregather:
            library.check(_fn("exl2_gemv_add_norm")(*norm_args, stream), "exl2_gemv_add_norm")
            return out, res_out
        pre, ld = self._stored_order_buffer(m, h.device)
        if not MEASURE_SKIP_NORM_PREGATHER:
            library.check(_fn("exl2_add_norm_pregather")(*norm_args, pre.data_ptr(), ld, stream),
                          "exl2_add_norm_pregather")
        self._launch_gemv(blob, h, m, 0, pre, ld, stream)
        return out, res_out

    def dequant(self, part: int, n_begin: int, n_end: int) -> torch.Tensor:
        p = self.parts[part]
        out = torch.empty(p.K, n_end - n_begin, dtype=torch.float16, device=p.packed.device)
        st = _fn("exl2_dequant")(self._descs[part].ctypes.data, out.data_ptr(), n_begin, n_end, _stream(out.device))
        library.check(st, "exl2_dequant")
        return out


def _check_x(x: torch.Tensor, k: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TensorShapeError(f"x must be a tensor, got {type(x).__name__}", tensor="x")
    if x.dtype != torch.float16:
        raise TensorShapeError(f"x has dtype {x.dtype}; the EXL2 kernels take float16", tensor="x")
    if x.dim() != 2 or x.shape[1] != k:
        raise TensorShapeError(f"x has shape {tuple(x.shape)}, expected [M, {k}]", tensor="x")
    if x.device != device:
        raise TensorShapeError(f"x is on {x.device}, the weights on {device}", tensor="x")
    if x.stride(1) != 1:
        raise TensorShapeError("x rows must be contiguous", tensor="x")


# --- custom ops --------------------------------------------------------------------------------------------


@torch.library.custom_op("exl2_backend::exl2_gemm", mutates_args=("ws", "counters"))
def _gemm_op(x: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
             counters: torch.Tensor) -> torch.Tensor:
    launch = _REG[handle]
    _check_x(x, launch.K, packed.device)
    if not 1 <= x.shape[0] <= 32:
        raise TensorShapeError(f"fused EXL2 GEMM takes 1..32 rows, got {x.shape[0]}", tensor="x")
    return launch.gemm(x, ws, counters)


@_gemm_op.register_fake
def _(x, packed, handle, ws, counters):
    return x.new_empty((x.shape[0], _REG[handle].out_features))


@torch.library.custom_op("exl2_backend::exl2_gemv_gated", mutates_args=("ws", "counters"))
def _gemv_gated_op(gate_up: torch.Tensor, packed: torch.Tensor, handle: int, ws: torch.Tensor,
                   counters: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2K] (gate | up) -> [M, N]: the GEMV of silu(gate) * up, silu_mul fused into its input (M up to
    the device's GEMV row cap)."""
    launch = _REG[handle]
    k = launch.K
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * k or gate_up.stride(1) != 1:
        raise TensorShapeError(f"gate_up has shape {tuple(gate_up.shape)}, expected [M, {2 * k}] with contiguous rows",
                               tensor="gate_up")
    if gate_up.dtype != torch.float16 or gate_up.device != packed.device:
        raise TensorShapeError(f"gate_up must be float16 on {packed.device}", tensor="gate_up")
    cap = gemv_row_cap(packed.device)
    if not 1 <= gate_up.shape[0] <= cap:
        raise TensorShapeError(f"the gated GEMV takes 1..{cap} rows here, got {gate_up.shape[0]}", tensor="gate_up")
    return launch._gemv(gate_up, ws, counters, gate_off=k)


@_gemv_gated_op.register_fake
def _(gate_up, packed, handle, ws, counters):
    return gate_up.new_empty((gate_up.shape[0], _REG[handle].out_features))


def _check_norm_input(t: torch.Tensor, name: str, k: int, m: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or t.device != device:
        raise TensorShapeError(f"{name} must be a float16 tensor on {device}", tensor=name)
    if t.shape != (m, k) or not _rows_aligned(t):
        raise TensorShapeError(f"{name} has shape {tuple(t.shape)} and strides {t.stride()}, expected [{m}, {k}] "
                               "with contiguous rows starting 16-byte aligned", tensor=name)


def _check_norm_call(launch: _Launch, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     packed: torch.Tensor, pregather: bool) -> int:
    """Checks the norm-fused GEMV's inputs (TensorShapeError); returns M."""
    k, m = launch.K, h.shape[0] if isinstance(h, torch.Tensor) and h.dim() == 2 else -1
    _check_norm_input(h, "h", k, m, packed.device)
    if residual is not None:
        _check_norm_input(residual, "residual", k, m, packed.device)
    if not isinstance(weight, torch.Tensor) or weight.shape != (k,) or weight.dtype != torch.float16 \
            or weight.device != packed.device or not weight.is_contiguous() or weight.data_ptr() % 16:
        raise TensorShapeError(f"the norm weight must be a contiguous float16 [{k}] tensor on {packed.device}",
                               tensor="weight")
    if pregather:
        if not launch.can_norm_pregather(m):
            raise TensorShapeError(f"the pre-gathering norm does not take {m} rows of {k} here", tensor="h")
    elif not launch.can_norm(m):
        raise TensorShapeError(f"the norm-fused GEMV does not take {m} rows of {k} here", tensor="h")
    return m


@torch.library.custom_op("exl2_backend::exl2_gemv_add_norm", mutates_args=("ws", "counters"))
def _gemv_add_norm_op(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      packed: torch.Tensor, handle: int, ws: torch.Tensor, counters: torch.Tensor,
                      pregather: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(GEMV of rms_norm(h + residual) * weight, h + residual); residual None: rms_norm(h), and the second output
    is empty. One launch (the norm inside the GEMV), or with `pregather` two (the norm writing the GEMV's stored
    row order, exl2_add_norm_pregather). Bit-identical to add_rms_norm followed by the GEMV either way."""
    launch = _REG[handle]
    _check_norm_call(launch, h, residual, weight, packed, pregather)
    return launch.gemv_add_norm(h, residual, weight, eps, ws, counters, pregather)


@_gemv_add_norm_op.register_fake
def _(h, residual, weight, eps, packed, handle, ws, counters, pregather=False):
    res_out = h.new_empty(h.shape) if residual is not None else h.new_empty(0)
    return h.new_empty((h.shape[0], _REG[handle].out_features)), res_out


def _rope_args(launch: _Launch, m: int, positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor) -> np.ndarray:
    """The fused rope's int64 arguments (csrc/quant/exl2_gemv_rope.cuh RopeArg), after checking them (TensorShapeError):
    the launch's three parts are q, k and v heads of D; caches fp16 [P, S, Hk, D] contiguous with D dividing 256;
    positions and slots int64 [M]; inv_freq fp32 [D/2]; all on the launch's device."""
    dev = launch.parts[0].packed.device
    if len(launch.parts) != 3:
        raise TensorShapeError(f"the fused rope needs the q, k and v parts in one launch, got {len(launch.parts)}",
                               tensor="qkv")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (isinstance(c, torch.Tensor) and c.dim() == 4 and c.dtype == torch.float16 and c.device == dev
                and c.is_contiguous() and c.shape == k_cache.shape and c.data_ptr() % 16 == 0):
            raise TensorShapeError(f"{name} must be a contiguous float16 [P, S, Hk, D] tensor on {dev} shaped like "
                                   "k_cache", tensor=name)
    hk, d = k_cache.shape[2], k_cache.shape[3]
    nq, nk, nv = launch.splits
    if d % 16 or _GEMV_COLS % d or nq % d or nk != hk * d or nv != hk * d:
        raise TensorShapeError(f"q / k / v widths {nq} / {nk} / {nv} are not heads of {d} matching the cache's {hk} "
                               f"kv heads (head_dim must divide {_GEMV_COLS})", tensor="k_cache")
    for name, t, dtype, n in (("positions", positions, torch.int64, m), ("slots", slots, torch.int64, m),
                              ("inv_freq", inv_freq, torch.float32, d // 2)):
        if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == (n,) and t.device == dev
                and t.is_contiguous()):
            raise TensorShapeError(f"{name} must be a contiguous {dtype} [{n}] tensor on {dev}", tensor=name)
    return np.array([positions.data_ptr(), inv_freq.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                     v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1], d], dtype=np.int64)


@torch.library.custom_op("exl2_backend::exl2_gemv_add_norm_rope_kv",
                         mutates_args=("ws", "counters", "k_cache", "v_cache"))
def _gemv_add_norm_rope_kv_op(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                              packed: torch.Tensor, handle: int, ws: torch.Tensor, counters: torch.Tensor,
                              pregather: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exl2_gemv_add_norm of the q/k/v projection with rope_kv_write fused after it: the q columns of the output
    rotated in place, rotated k and v written into the caches at `slots` (< 0 or past the cache: not written); the
    k and v columns of the output keep the projection. Bit-identical to the GEMV followed by rope_kv_write."""
    launch = _REG[handle]
    m = _check_norm_call(launch, h, residual, weight, packed, pregather)
    rope = _rope_args(launch, m, positions, inv_freq, k_cache, v_cache, slots)
    return launch.gemv_add_norm(h, residual, weight, eps, ws, counters, pregather, rope)


@_gemv_add_norm_rope_kv_op.register_fake
def _(h, residual, weight, eps, packed, handle, ws, counters, pregather, positions, inv_freq, k_cache, v_cache, slots):
    res_out = h.new_empty(h.shape) if residual is not None else h.new_empty(0)
    return h.new_empty((h.shape[0], _REG[handle].out_features)), res_out


@torch.library.custom_op("exl2_backend::exl2_dequant", mutates_args=())
def _dequant_op(packed: torch.Tensor, handle: int, part: int, n_begin: int, n_end: int) -> torch.Tensor:
    return _REG[handle].dequant(part, n_begin, n_end)


@_dequant_op.register_fake
def _(packed, handle, part, n_begin, n_end):
    return packed.new_empty((_REG[handle].parts[part].K, n_end - n_begin), dtype=torch.float16)


# --- LinearOp and reference-signature entry points ---------------------------------------------------------


class CudaLinearOp:
    """`LinearOp`-compatible: __call__(x [..., K] fp16) -> [..., sum N]. Fused kernels for small M (the GEMV up to
    GEMV_MAX_M rows, the mma kernel up to FUSED_MAX_M where the GEMV does not take M), dequantize-to-scratch +
    cuBLAS above (dequantized weights are never kept)."""

    def __init__(self, parts: list[PackedQ], device: torch.device, dtype: torch.dtype = torch.float16):
        self.launch = _Launch(parts, device)
        self.device = device
        self.dtype = dtype
        self.in_features = self.launch.K
        self.out_features = self.launch.out_features
        self.splits = list(self.launch.splits)
        self.workspace = workspace(device)
        self.launch.reserve(32)  # the fused op may be called directly for any M <= 32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if x2.dtype == torch.float16 and x2.dim() == 2 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        _check_x(x2, self.in_features, self.launch.parts[0].packed.device)
        m = x2.shape[0]
        if m == 0:
            y = x2.new_empty((0, self.out_features))
        elif self.launch.takes_fused(m):
            y = self.fused(x2)
        else:
            y = self._dequant_matmul(x2)
        return y.reshape(*lead, self.out_features)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The fused kernel for x [M <= 32, K] whatever FUSED_MAX_M says (tests, benchmarks)."""
        ws, counters = self.workspace.buffers()
        return torch.ops.exl2_backend.exl2_gemm(x, self.launch.parts[0].packed, self.launch.handle, ws, counters)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2K] (gate | up, the fused gate/up projection's output) -> [M, N] = self(silu(gate) * up).
        Small M runs one GEMV that applies silu_mul while gathering its input (one kernel and one round trip of
        the [M, K] intermediate fewer per layer); larger M runs silu_mul then the usual path."""
        m = gate_up.shape[0]
        k = self.in_features
        if (self.launch.takes_gemv(m) and gate_up.shape[1] == 2 * k
                and gate_up.stride(-1) == 1 and gate_up.stride(0) == 2 * k):
            ws, counters = self.workspace.buffers()
            return torch.ops.exl2_backend.exl2_gemv_gated(gate_up, self.launch.parts[0].packed, self.launch.handle,
                                                          ws, counters)
        from exl2_backend import ops

        return self(ops.silu_mul(gate_up[:, :k], gate_up[:, k:]))

    def add_normed(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   always: bool = False, pregather: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self(rms_norm(h + residual) * weight), h + residual), bit-identical to add_rms_norm then self(...)
        (residual None: rms_norm(h), and h is returned as the residual stream). Rows that fit one pass of the
        fused norm (_Launch.takes_norm; always=True: any M the norm-fused GEMV can take, for tests and benchmarks)
        run one GEMV that normalizes its own input; more rows (NORM_PREGATHER) run the norm writing the GEMV's
        stored row order, then the GEMV (`pregather` True / False forces either, for tests). None where neither
        applies (the caller runs the two ops): M rows the TMA GEMV does not take, unaligned rows, another weight
        dtype."""
        pregather = self._norm_route(h, residual, weight, always, pregather)
        if pregather is None:
            return None
        ws, counters = self.workspace.buffers()
        launch = self.launch
        y, res_out = torch.ops.exl2_backend.exl2_gemv_add_norm(h, residual, weight, float(eps), launch.parts[0].packed,
                                                               launch.handle, ws, counters, pregather)
        return y, (h if residual is None else res_out)

    def add_normed_rope_kv(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor,
                           pregather: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """add_normed of a fused q/k/v projection with rope_kv_write inside the same GEMV launch: (qkv [M, N] with
        its q columns rotated, h + residual), rotated k and v written into the fp16 caches [P, S, Hk, D] at
        `slots`; bit-identical to add_normed then ops.rope_kv_write. None where add_normed would decline or the
        rope's tensors do not fit the fused kernel (then the caller runs the two ops)."""
        pregather = self._norm_route(h, residual, weight, False, pregather)
        if pregather is None:
            return None
        try:
            _rope_args(self.launch, h.shape[0], positions, inv_freq, k_cache, v_cache, slots)
        except TensorShapeError:
            return None
        ws, counters = self.workspace.buffers()
        launch = self.launch
        y, res_out = torch.ops.exl2_backend.exl2_gemv_add_norm_rope_kv(
            h, residual, weight, float(eps), launch.parts[0].packed, launch.handle, ws, counters, pregather,
            positions, inv_freq, k_cache, v_cache, slots)
        return y, (h if residual is None else res_out)

    def _norm_route(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, always: bool,
                    pregather: bool | None) -> bool | None:
        """add_normed's routing: False for the norm inside the GEMV, True for the pre-gathering norm, None to
        decline (see add_normed)."""
        m = h.shape[0] if h.dim() == 2 else 0
        if not (m and weight.dtype == torch.float16 and weight.is_contiguous() and weight.data_ptr() % 16 == 0
                and _rows_aligned(h) and (residual is None or _rows_aligned(residual))):
            return None
        launch = self.launch
        if pregather is None:
            if (launch.can_norm if always else launch.takes_norm)(m):
                return False
            if NORM_PREGATHER and not always and launch.can_norm_pregather(m):
                return True
            return None
        return pregather if (launch.can_norm_pregather if pregather else launch.can_norm)(m) else None

    def fused_kernel(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """One fused kernel by name ("gemv": M <= gemv_row_cap, "mma": M <= 32), bypassing routing and the workspace
        budget (benchmarks, tests)."""
        ws = self.workspace
        m = x.shape[0]
        if kernel == "gemv" and 1 <= m <= gemv_row_cap(self.device):
            ws.reserve(self.launch.gemv_plan(m).ws_numel)
        return self.launch.gemm(x, *ws.buffers(), kernel=kernel)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        direct = library.direct_calls()  # the dequantization without the dispatcher (eager prefill)
        for i, p in enumerate(self.launch.parts):
            for n0 in range(0, p.N, DEQUANT_SLICE):
                n1 = min(p.Np, n0 + DEQUANT_SLICE)
                if direct:
                    w = self.launch.dequant(i, n0, n1)  # [K, n1-n0]
                else:
                    w = torch.ops.exl2_backend.exl2_dequant(p.packed, self.launch.handle, i, n0, n1)
                cols = min(p.N, n1) - n0
                if p.bias is not None:
                    outs.append(torch.addmm(p.bias[n0 : n0 + cols], x, w[:, :cols]))
                else:
                    outs.append(torch.matmul(x, w[:, :cols]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def __repr__(self) -> str:
        return f"CudaLinearOp(in={self.in_features}, splits={self.splits})"


def norm_row_threads(k: int) -> int:
    """Threads per row of rms_norm_kernel (csrc/layers/norm.cu) and of the norm-fused GEMV: K / 8 vectors,
    4 per thread, rounded up to a warp."""
    t = (k // 8 + 3) // 4
    return 32 if t < 32 else (t + 31) // 32 * 32


def _row_stride(t: torch.Tensor) -> int:
    """Elements between the rows of a 2-D tensor; its width for one row, whose stride can be anything."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _rows_aligned(t: torch.Tensor) -> bool:
    """fp16 [M, K] with contiguous rows starting 16-byte aligned (the fused norm's vector loads)."""
    return (t.dtype == torch.float16 and t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.shape[0] == 1 or t.stride(0) % 8 == 0))


def prepare_linear(linears, device, dtype: torch.dtype = torch.float16):
    """QTensors sharing an input -> one CudaLinearOp (one fused launch, outputs concatenated). Lists with
    dense linears, more than 4 parts or a dtype other than fp16 use the reference LinearOp."""
    from exl2_backend.ops import reference

    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    linears = list(linears)
    if dtype != torch.float16 or not linears or len(linears) > _MAX_DESC or not all(
        isinstance(lin, QTensor) for lin in linears
    ):
        return reference.prepare_linear(linears, device, dtype)
    return CudaLinearOp([pack_qtensor(lin, device) for lin in linears], device, dtype)


_QT_CACHE: dict[tuple[int, torch.device], tuple[weakref.ref, CudaLinearOp]] = {}


def _op_for(qt: QTensor, device: torch.device) -> CudaLinearOp:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(qt), device)
    hit = _QT_CACHE.get(key)
    if hit is not None and hit[0]() is qt:
        return hit[1]
    op = CudaLinearOp([pack_qtensor(qt, device)], device)
    _QT_CACHE[key] = (weakref.ref(qt, lambda _r, k=key: _QT_CACHE.pop(k, None)), op)
    return op


def exl2_gemm(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    """x [M, K] fp16 (CUDA) -> [M, N] (+ bias), prepared on first use and cached per QTensor object."""
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        raise TensorShapeError("x must be a CUDA tensor for the CUDA exl2_gemm", tensor="x")
    return _op_for(qt, x.device)(x)


def exl2_dequant(qt: QTensor) -> torch.Tensor:
    """fp16 [K, Np], original row order, bit-exact with the reference."""
    op = _op_for(qt, qt.q_weight.device)
    p = op.launch.parts[0]
    return torch.ops.exl2_backend.exl2_dequant(p.packed, op.launch.handle, 0, 0, p.Np)


def clone_for_bench(op: CudaLinearOp) -> CudaLinearOp:
    """A copy with its own packed weights (to rotate through more bytes than L2 holds when timing)."""
    parts = [replace(p, packed=p.packed.clone(), scl16=None if p.scl16 is None else p.scl16.clone())
             for p in op.launch.parts]
    return CudaLinearOp(parts, op.device, op.dtype)
