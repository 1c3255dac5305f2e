// The norm handoff: an RMSNorm between two small-M GEMVs split across their launch boundary, so that no block
// reads whole rows to normalize them and no launch runs between the two GEMVs.
//
// A decoder layer runs o_proj, then rms_norm(h + residual) into gate/up; down_proj, then the next layer's
// rms_norm(h + residual) into q/k/v. The norm fused into the next GEMV (exl2_gemv_norm.cuh) has every one of its
// ~264 blocks read all M rows of h and of the residual: 16 KB at M = 1, 80 KB at M = 5, so a verify step (M = 5)
// ran a norm launch of its own instead (exl2_gemv_norm_pregather.cu, ~4.7 us of the critical path each, 64 per
// step). Here:
// - out (the producing GEMV, hand_sq_out set): the block that writes a column block's final values y also writes
//   the new residual stream r = round(y + residual) for those columns, and per token the sum of r^2 over them into
//   hand_sq[m * hand_sq_ld + colblk];
// - in (the consuming GEMV, hand_sq_in set, its input x = r): each block stages the norm weight of its rows
//   before the PDL wait, sums the hand_ncb partial sums of each token (one load per lane), gathers only its own
//   split's rows of r and normalizes them in shared memory: round(r * rsqrt(sum / K + eps) * w), the arithmetic
//   of rms_norm_kernel.
// The values differ from add_rms_norm only in the order of the sum of squares (column blocks, then a butterfly),
// so the normalized input may differ from it by one fp16 ulp where the rounding falls that way; r is bit-identical.
#pragma once

#include <cstring>

#include "common/api.h"
#include "layers/common.cuh"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr int kHandoffMaxBlocks = 32;  // column blocks of the producer a consumer sums (a lane each): K <= 8192

// Host: the int64 arguments behind blob field F_HANDOFF. kHandKind: 1 = out, 2 = in.
// out: residual [M, res_ld], res_out [M, res_out_ld] (may alias residual: each value is read and written by one
//      thread), sq fp32 [M, sq_ld] (sq_ld >= the column blocks).
// in:  sq fp32 [M, sq_ld] with ncb column blocks, weight fp16 [K], eps (float bits), K.
enum HandoffArg { kHandKind = 0, kHandA1, kHandA2, kHandA3, kHandA4, kHandA5, kHandA6, kHandArgs };
constexpr int kHandOut = 1, kHandIn = 2;

// Host: checks the handoff's arguments against the planned launch and sets them in p (after the descriptors, the
// fused norm and the rope are planned).
inline int plan_handoff(const int64_t* a, bool norm, bool rope, int gate_off, bool xpre, GemvParams& p) {
  auto al = [](int64_t ptr, int bytes) { return ptr && ptr % bytes == 0; };
  EXL2_REQUIRE(!p.cluster && !p.probe, "exl2_gemv handoff: no cluster split-K or probe launch");
  if (a[kHandKind] == kHandOut) {
    const QDesc& d = p.d[0];
    EXL2_REQUIRE(p.ndesc == 1 && !norm && !rope, "exl2_gemv handoff out: one part, no fused norm or rope");
    EXL2_REQUIRE(d.N % 4 == 0 && d.ldo % 4 == 0 && reinterpret_cast<uintptr_t>(d.out) % 8 == 0,
                 "exl2_gemv handoff out: N=%d and the output rows must hold whole 8-byte groups", d.N);
    EXL2_REQUIRE(al(a[kHandA1], 8) && a[kHandA2] % 4 == 0 && a[kHandA2] >= d.N && al(a[kHandA3], 8) &&
                 a[kHandA4] % 4 == 0 && a[kHandA4] >= d.N,
                 "exl2_gemv handoff out: residual rows must be 8-byte aligned and hold N=%d", d.N);
    EXL2_REQUIRE(al(a[kHandA5], 4) && a[kHandA6] >= (d.N + kGvCols - 1) / kGvCols,
                 "exl2_gemv handoff out: sums of squares [M, >= %d] fp32", (d.N + kGvCols - 1) / kGvCols);
    p.hand_res = reinterpret_cast<const __half*>(a[kHandA1]);
    p.hand_res_ld = (int)a[kHandA2];
    p.hand_res_out = reinterpret_cast<__half*>(a[kHandA3]);
    p.hand_res_out_ld = (int)a[kHandA4];
    p.hand_sq_out = reinterpret_cast<float*>(a[kHandA5]);
    p.hand_sq_ld = (int)a[kHandA6];
    return EXL2_OK;
  }
  EXL2_REQUIRE(a[kHandKind] == kHandIn, "exl2_gemv handoff: kind %lld (1 out, 2 in)", (long long)a[kHandKind]);
  EXL2_REQUIRE(!norm && gate_off == 0 && !xpre, "exl2_gemv handoff in: no fused norm, gated or pre-gathered input");
  const int K = (int)a[kHandA6], ncb = (int)a[kHandA3];
  for (int i = 0; i < p.ndesc; ++i)
    EXL2_REQUIRE(p.d[i].K == K, "exl2_gemv handoff in: part %d has K=%d, the stream %d", i, p.d[i].K, K);
  EXL2_REQUIRE(ncb == (K + kGvCols - 1) / kGvCols && ncb <= kHandoffMaxBlocks,
               "exl2_gemv handoff in: %d column blocks for K=%d (up to %d)", ncb, K, kHandoffMaxBlocks);
  EXL2_REQUIRE(al(a[kHandA1], 4) && a[kHandA2] >= ncb && al(a[kHandA4], 2),
               "exl2_gemv handoff in: null or misaligned sums of squares or weight");
  float eps;
  const uint32_t bits = (uint32_t)a[kHandA5];
  memcpy(&eps, &bits, 4);
  EXL2_REQUIRE(eps > 0.f && eps < 1.f, "exl2_gemv handoff in: eps %g outside (0, 1)", (double)eps);
  p.hand_sq_in = reinterpret_cast<const float*>(a[kHandA1]);
  p.hand_sq_ld = (int)a[kHandA2];
  p.hand_ncb = ncb;
  p.norm_w = reinterpret_cast<const __half*>(a[kHandA4]);
  p.norm_eps = eps;
  p.hand_k = K;
  return EXL2_OK;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The stream's four values of y (fp16, as stored) at (m, n): round(y + residual) into hand_res_out; returns the
// sum of their squares (fma chain in column order).
__device__ __forceinline__ float gv_handoff_quad(const GemvParams& p, int m, int n, uint2 y, uint2 res) {
  const __half* yh = reinterpret_cast<const __half*>(&y);
  const __half* rh = reinterpret_cast<const __half*>(&res);
  uint2 o;
  __half* oh = reinterpret_cast<__half*>(&o);
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    oh[c] = __float2half_rn(__fadd_rn(__half2float(yh[c]), __half2float(rh[c])));  // add_rms_norm's rounding
    const float v = __half2float(oh[c]);
    ss = __fmaf_rn(v, v, ss);
  }
  *reinterpret_cast<uint2*>(p.hand_res_out + (size_t)m * p.hand_res_out_ld + n) = o;
  return ss;
}

// Out, the sums of squares of the column block per token from scratch[m * quads + q] (after `sync`): a warp per
// token, its quads in order, then a butterfly.
template <typename Sync>
__device__ __forceinline__ void gv_handoff_sums(const GemvParams& p, int colblk, int quads, const float* scratch,
                                                int tid, int nthreads, Sync&& sync) {
  using exl2::layers::warp_sum;
  sync();
  const int warp = tid >> 5, lane = tid & 31;
  for (int m = warp; m < p.M; m += nthreads / 32) {
    float s = 0.f;
    for (int q = lane; q < quads; q += 32) s += scratch[m * quads + q];
    s = warp_sum(s);
    if (lane == 0) p.hand_sq_out[(size_t)m * p.hand_sq_ld + colblk] = s;
  }
}

// Out, split-K: gv_reduce_partials_vec4 (the same sums, items and stores of y) with the stream written from the
// values in registers; the residual's loads go out with the partials'. scratch: M * 64 floats of shared memory.
template <typename Sync>
__device__ __forceinline__ void gv_reduce_partials_handoff(const GemvParams& p, const QDesc& d, int colblk,
                                                           int ksplit, float* scratch, int tid, int nthreads,
                                                           Sync&& sync) {
  const int M = p.M, nblk0 = colblk * kGvCols, quads = min(kGvCols, d.N - nblk0) / 4;  // N % 4 == 0 (host)
  for (int e = tid; e < quads * M; e += nthreads) {
    const int m = e / quads, n = nblk0 + 4 * (e - m * quads);
    const uint2 res = __ldcg(reinterpret_cast<const uint2*>(p.hand_res + (size_t)m * p.hand_res_ld + n));
    const float4 v = gv_sum_partials_vec4(d, m, n, ksplit, M);
    const float o[4] = {v.x, v.y, v.z, v.w};
    uint2 y;
    __half* yh = reinterpret_cast<__half*>(&y);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float b = d.bias ? __half2float(d.bias[n + c]) : 0.f;
      yh[c] = __float2half_rn(o[c] + b);
      d.out[(size_t)m * d.ldo + n + c] = yh[c];
    }
    scratch[e] = gv_handoff_quad(p, m, n, y, res);
  }
  gv_handoff_sums(p, colblk, quads, scratch, tid, nthreads, sync);
}

// Out, ksplit 1 (or the scalar reduce): after the column block's final values y are stored by this block's
// `nthreads` threads (and made visible to it by a barrier), r = round(y + residual) into hand_res_out from y read
// back, and the column block's sums of r^2 per token into hand_sq_out. scratch: M * 64 floats of shared memory (the
// drained ring); callers synchronize before reusing it.
template <typename Sync>
__device__ __forceinline__ void gv_handoff_out(const GemvParams& p, const QDesc& d, int colblk, float* scratch,
                                               int tid, int nthreads, Sync&& sync) {
  const int M = p.M, nblk0 = colblk * kGvCols, quads = min(kGvCols, d.N - nblk0) / 4;
  for (int e = tid; e < quads * M; e += nthreads) {
    const int m = e / quads, n = nblk0 + 4 * (e - m * quads);
    const uint2 y = __ldcg(reinterpret_cast<const uint2*>(d.out + (size_t)m * d.ldo + n));
    const uint2 res = __ldcg(reinterpret_cast<const uint2*>(p.hand_res + (size_t)m * p.hand_res_ld + n));
    scratch[e] = gv_handoff_quad(p, m, n, y, res);
  }
  gv_handoff_sums(p, colblk, quads, scratch, tid, nthreads, sync);
}

// In, before the PDL wait (constants): the norm weight of the split's rows in stored order, hw[r] = w[xmap[r]]
// (padding rows 0), by `nthreads` threads from thread 0 (the caller's barrier after the wait orders it).
__device__ __forceinline__ void gv_stage_handoff_weight(const GemvParams& p, const QDesc& d, int c0, int nch,
                                                        __half* hw, int nthreads) {
  const unsigned short* xmap = d.xmap + (size_t)c0 * kChunkRows;
  for (int r = threadIdx.x; r < nch * kChunkRows; r += nthreads) {
    const unsigned i = __ldg(xmap + r);
    hw[r] = i == 0xFFFFu ? __float2half_rn(0.f) : __ldg(p.norm_w + i);
  }
}

// In: the split's rows of the stream x (stored order, xs[m * xstride + r]), normalized: round(x * inv[m] * hw[r])
// with inv[m] = rsqrt(sum of the token's hand_ncb partial sums / K + eps). The partials' loads (warp w: tokens w,
// w + 8, ..., a lane each) go out first; then the rows are gathered as the plain GEMV gathers them (row slots, up
// to 16 or 32 two-byte loads in flight per thread), then scaled in place. H100 call AZ3 of 2026-12-06: a gather of
// r and w together, eight items per thread per round, took M rounds in a verify step's gate/up (+285 us per k = 4
// verify step against the pre-gathering norm). `nthreads` = kGvWarps * 32 threads from thread 0; `sync` is their
// barrier. Callers synchronize after it.
template <int MT, typename Sync>
__device__ __forceinline__ void gv_gather_handoff(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                                  const __half* hw, int nthreads, Sync&& sync) {
  using exl2::layers::warp_sum;
  constexpr int kTokensPerWarp = 32 / kGvWarps;  // M <= 32
  __shared__ float s_inv[32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, M = p.M;
  float sq[kTokensPerWarp];
#pragma unroll
  for (int j = 0; j < kTokensPerWarp; ++j) {
    const int m = warp + kGvWarps * j;
    sq[j] = m < M && lane < p.hand_ncb ? __ldcg(p.hand_sq_in + (size_t)m * p.hand_sq_ld + lane) : 0.f;
  }
  gv_gather<MT >= 4 ? 32 : 16, false>(p, nch, xs, xm, nthreads);  // padding rows: 0 (32 in flight at MT < 4 spills)
#pragma unroll
  for (int j = 0; j < kTokensPerWarp; ++j) {
    const int m = warp + kGvWarps * j;
    const float s = warp_sum(sq[j]);
    if (m < M && lane == 0) s_inv[m] = rsqrtf(__fadd_rn(__fdiv_rn(s, (float)p.hand_k), p.norm_eps));
  }
  sync();  // s_inv, and every thread's gathered rows
  const int rows = nch * kChunkRows;
  for (int e = tid; e < rows * M; e += nthreads) {
    const int m = e / rows, r = e - m * rows;
    __half* x = xs + m * p.xstride + r;
    *x = __float2half_rn(__fmul_rn(__fmul_rn(__half2float(*x), s_inv[m]), __half2float(hw[r])));
  }
}
#endif

}  // namespace exl2q
