// The TMA GEMV's chunk walk at M <= 8 with the zero point taken out of the decode (4, 5, 6 and 8 bits). The mma A
// operand is the bare code as an fp16 subnormal, q * 2^-24 (pair_raw with no exponent bits, so one
// INT op per pair and no HADD2 / HFMA2; at 4 bits the odd pairs, the columns gid + 8, sit 4 bits up: 16q * 2^-24).
// Products with x stay exact in fp32. One more mma per k-step with A = 1 sums x (its C fragment holds the sums of
// tokens 2t4 and 2t4 + 1 in the layout of every accumulator), and the group's flush applies
//     sum_k (q_k - z) x_k = F * sum_k A_k x_k - z * sum_k x_k,   F = 2^24 (2^20 for the 4-bit odd pairs).
// A 4-bit warp chunk: 97 instructions on the path without a group end, against 120 (ptxas 13.0, sm_90a; 32 fewer
// HADD2 / HFMA2, 4 more HMMAs); each group end costs 12 more (the z * sum(x) terms and the scale factors).
// The two sums are of the same order as the result (no cancellation against a 1024 offset).
// A measurement build (EXL2_GEMV_FOLD_ZERO), and it LOST: H200 call Z1 of 2026-12-03, 8B decode step at 1k 2.389
// against 2.315 ms; bench_gemm --m1 4:1 gate/up 13.70 against 13.27 us, but also 3-bit (not folded) 15.41 against
// 13.80. The sums' 4 registers and the ones quad push the M <= 8 kernel past its 96-register cap: ptxas spills 16
// bytes in its prologue and reloads them before every chunk loop; every width got slower, unfolded ones too, which
// points at that rather than at the fold. On 4-bit runs only (EXL2_GEMV_FOLD_ZERO=4, no spills) it lost too (call
// Z3: 2.347 against 2.320 ms; the 4:1 gate/up 26.7 against 25.2 us, the 4-bit o and q/k/v unchanged): the 4 extra
// mmas per chunk cost more than the 32 FP ops saved (the lean flush showed that fewer instructions do pay: mmas
// weigh more). It also breaks the bit-identity of the folded down_proj row order
// (tests/kernels/test_fold_down_order_cuda.py: x is summed in a different order). EXL2_GEMV_FOLD_STAGED (prepared in
// session 15, not yet run: call AA1) tests the idea cleanly: per-group sums of x computed once after the input is
// staged (fold_group_sums; no registers across the chunk loop, no extra mma), read at the flush.
#pragma once

#include "quant/exl2_gemv.cuh"

namespace exl2q {

// EXL2_GEMV_FOLD_ZERO=4: 4-bit runs only (the M <= 8 kernel then stays spill-free); otherwise 4, 5, 6 and 8 bits.
// With EXL2_GEMV_FOLD_PROBE as well, a timing probe whose results are WRONG: no sums of x (the extra mma per k-step
// is left out, the sums stay 0), so it times the decode without its FP ops and without anything in their place, the
// most any fold of the zero point can gain (prepared in session 15, not yet run: call AA1).
#if defined(EXL2_GEMV_FOLD_ZERO) && EXL2_GEMV_FOLD_ZERO == 4
__host__ __device__ constexpr bool fold_width(int b) { return b == 4; }
#else
__host__ __device__ constexpr bool fold_width(int b) { return b == 4 || b == 5 || b == 6 || b == 8; }
#endif
template <int B>
constexpr bool kFoldable = fold_width(B);

#ifndef EXL2_GEMV_FOLD_STAGED
// The lane's running sums of x since the last flush: the C fragment of an mma with A = 1 (v[0], v[2]: token 2t4;
// v[1], v[3]: token 2t4 + 1).
struct XSum {
  float v[4];
};
// One k-step's x (B operand b0, b1) into the sums: one mma.
__device__ __forceinline__ void xsum_add(XSum& xs, uint32_t b0, uint32_t b1) {
#ifndef EXL2_GEMV_FOLD_PROBE
  constexpr uint32_t kOnes = 0x3C003C00u;  // fp16 1.0 in both halves
  mma16816(xs.v, kOnes, kOnes, kOnes, kOnes, b0, b1);
#endif
}
// The sums of the lane's tokens 2t4 and 2t4 + 1 over group g, zeroed for the next group.
__device__ __forceinline__ float2 xsum_take(XSum& xs, int /*g*/) {
  const float2 r = make_float2(xs.v[0], xs.v[1]);
#pragma unroll
  for (int e = 0; e < 4; ++e) xs.v[e] = 0.f;
  return r;
}
#else
// EXL2_GEMV_FOLD_STAGED: the sums per (group, token) computed once after the input is staged (fold_group_sums),
// read at the flush: no registers across the chunk loop and no extra mma.
struct XSum {
  const float* S;  // [group of the segment][8 tokens]
};
__device__ __forceinline__ void xsum_add(XSum&, uint32_t, uint32_t) {}
__device__ __forceinline__ float2 xsum_take(XSum& xs, int g) {
  return *reinterpret_cast<const float2*>(xs.S + g * 8 + 2 * (threadIdx.x & 3));
}

// Sums of the staged x over each group's rows in this block, S[g * 8 + m] for m < 8 (tokens >= M repeat token
// M - 1, as the staged rows do), g from 0 at the block's first chunk. Warp w takes groups w, w + 8, ...: a group's
// units are consecutive, found by two ballots over the chunk info; each lane sums its rows in order, then a fixed
// butterfly (deterministic). All compute threads; the caller synchronizes after.
__device__ __forceinline__ void fold_group_sums(const int* s_info, int nch, const __half* xs, int xstride, int M,
                                                float* S) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g0 = s_info[0] & kInfoGroupMask, nunits = 2 * nch, last = s_info[nch - 1];
  const int ngrp = (last & kInfoGroupMask) + ((last >> 30) & 1) - g0 + 1;
  for (int g = warp; g < ngrp; g += kGvWarps) {
    int ua = 0, ub = 0;  // the group's units [ua, ub)
    for (int base = 0; base < nunits; base += 32) {
      const int u = base + lane;
      int gl = ngrp;  // past the block's units: after every group
      if (u < nunits) {
        const int inf = s_info[u >> 1];
        gl = (inf & kInfoGroupMask) - g0 + ((u & 1) ? ((inf >> 30) & 1) : 0);
      }
      ua += __popc(__ballot_sync(0xFFFFFFFFu, gl < g));
      ub += __popc(__ballot_sync(0xFFFFFFFFu, gl <= g));
    }
    float mine = 0.f;  // lane m < 8: the sum of token min(m, M - 1)
    for (int m = 0; m < M && m < 8; ++m) {
      float t = 0.f;
      for (int r = ua * 32 + lane; r < ub * 32; r += 32) t += __half2float(xs[m * xstride + r]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xFFFFFFFFu, t, o);
      if (lane >= m) mine = t;  // lanes >= M keep token M - 1
    }
    if (lane < 8) S[g * 8 + lane] = mine;
  }
}
#endif

// k-step S of a 32-row unit on bare codes, and the sums of x.
template <int B, int S>
__device__ __forceinline__ void fold_kstep(const uint32_t (&w)[2][B], const uint32_t (&xb)[4], TileAcc<1>& a,
                                           XSum& xs) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
    mma16816(a.cg[nt][0], pair_raw<B, 4 * S + 0, 0>(w[nt]), pair_raw<B, 4 * S + 1, 0>(w[nt]),
             pair_raw<B, 4 * S + 2, 0>(w[nt]), pair_raw<B, 4 * S + 3, 0>(w[nt]), xb[2 * (S & 1)], xb[2 * (S & 1) + 1]);
  xsum_add(xs, xb[2 * (S & 1)], xb[2 * (S & 1) + 1]);
}

// acc += s F (cg - z / F * sum(x)) for the current group; cg and the sums = 0. F and z / F are powers of two
// times small integers: the products by them are exact.
template <int B>
__device__ __forceinline__ void fold_flush(GvState& s, XSum& xs) {
  constexpr float kFa = 16777216.f, kFb = B == 4 ? 1048576.f : kFa;  // 2^24, 2^20
  constexpr float kZa = (1 << (B - 1)) / kFa, kZb = (1 << (B - 1)) / kFb;
  const float2 s0 = h2_to_f2(s.sc.x), s1 = h2_to_f2(s.sc.y);
  const float2 x = xsum_take(xs, s.g);  // tokens 2t4, 2t4 + 1 (c0 / c2 and c1 / c3)
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const float sa = (nt ? s1.x : s0.x) * kFa, sb = (nt ? s1.y : s0.y) * kFb;
    float(&cg)[4] = s.a.cg[nt][0];
    float(&acc)[4] = s.a.acc[nt][0];
    acc[0] = fmaf(sa, fmaf(-kZa, x.x, cg[0]), acc[0]);
    acc[1] = fmaf(sa, fmaf(-kZa, x.y, cg[1]), acc[1]);
    acc[2] = fmaf(sb, fmaf(-kZb, x.x, cg[2]), acc[2]);
    acc[3] = fmaf(sb, fmaf(-kZb, x.y, cg[3]), acc[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) cg[e] = 0.f;
  }
}

// gv_unit on bare codes (staged scales in shared memory).
template <int B, int U>
__device__ __forceinline__ void fold_unit(const uint32_t (&w)[2][B], int info, const __half* xl, GvState& s, XSum& xs,
                                          const uint2* scl_lane, int scl_gstride, int G) {
  const uint4 xv = *reinterpret_cast<const uint4*>(xl + 32 * U);
  const uint32_t xb[4] = {xv.x, xv.y, xv.z, xv.w};
  fold_kstep<B, 2 * U>(w, xb, s.a, xs);
  fold_kstep<B, 2 * U + 1>(w, xb, s.a, xs);
  if ((info >> (30 + U)) & 1) {
    fold_flush<B>(s, xs);
    ++s.g;
    s.sc = scl_lane[min(s.g, G - 1) * scl_gstride];  // as gv_unit: past the last group, read and unused
  }
}

template <int B>
__device__ __forceinline__ void fold_chunk(const uint32_t (&w)[2][B], int info, const __half* xl, GvState& s, XSum& xs,
                                           const uint2* scl_lane, int scl_gstride, int G) {
  fold_unit<B, 0>(w, info, xl, s, xs, scl_lane, scl_gstride, G);
  fold_unit<B, 1>(w, info, xl, s, xs, scl_lane, scl_gstride, G);
}

}  // namespace exl2q
