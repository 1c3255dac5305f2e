// RMSNorm fused into the TMA GEMV's input (GemvParams::norm_nt > 0): the layer's add_rms_norm kernel and the
// launch boundary before the q/k/v or gate/up GEMV disappear. Every block normalizes all M tokens' whole rows
// into shared memory (M x K fp16; at M = 1 and K = 4096 an 8 KB read from L2, where the rows were just written)
// and then gathers its split's rows from there in stored order. Block 0 alone writes the new residual stream.
//
// The arithmetic is layers/norm.cu's rms_norm_kernel with 16-byte vectors, step for step: the same threads per
// row (ceil(K / 32) rounded up to a warp, at most kMaxNormThreads), the same vectors per thread in the same order,
// the same fma chain, warp sums and final warp sum over the row's warps, and the same rounding of h + residual
// and of the output. So the fused GEMV is bit-identical to add_rms_norm followed by the plain GEMV (tested).
#pragma once

#include "common/api.h"
#include "layers/common.cuh"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr int kNormVec = 8;       // halves per 16-byte vector (rms_norm_kernel VEC)
constexpr int kNormMaxVecs = 4;   // vectors per thread (rms_norm_kernel MAXV)
constexpr int kMaxNormThreads = kGvWarps * 32;  // a row's threads must fit the compute warps (K <= 8192)

// rms_norm_kernel's block size for a row of K halves (its launch(): vectors / MAXV, rounded up to a warp).
__host__ __device__ inline int norm_row_threads(int K) {
  const int t = (K / kNormVec + kNormMaxVecs - 1) / kNormMaxVecs;
  return t < 32 ? 32 : (t + 31) / 32 * 32;
}

// Host: the arguments every norm-into-GEMV-input entry point takes (exl2_gemv_add_norm, exl2_add_norm_pregather):
// h [M, ldh], residual [M, res_ld] or null, weight [K], res_out [M, res_out_ld] or null (needs a residual and must
// alias neither input, which other blocks still read). Rows start 16-byte aligned. Returns a status naming `op`.
inline int check_norm_args(const char* op, const void* h, int ldh, const void* residual, int res_ld,
                           const void* weight, const void* res_out, int res_out_ld, float eps) {
  using exl2::layers::aligned16;
  EXL2_REQUIRE(h && weight, "%s: null argument", op);
  EXL2_REQUIRE(eps > 0.f && eps < 1.f, "%s: eps %g outside (0, 1)", op, (double)eps);
  EXL2_REQUIRE(aligned16(h) && aligned16(weight) && ldh % 8 == 0 &&
               (!residual || (aligned16(residual) && res_ld % 8 == 0)) &&
               (!res_out || (aligned16(res_out) && res_out_ld % 8 == 0)),
               "%s: rows must start 16-byte aligned (pointers and row strides)", op);
  EXL2_REQUIRE(!res_out || residual, "%s: res_out without a residual", op);
  EXL2_REQUIRE(!res_out || (res_out != h && res_out != residual), "%s: res_out aliases an input", op);
  return EXL2_OK;
}

// The rows a norm step reads: x [M, ldx] (+ res [M, res_ld], null: no add), weight w [K], nt threads per row.
struct NormRows {
  const __half* x;
  const __half* res;
  const __half* w;
  int ldx, res_ld, K, nt, M;
  float eps;
};
__device__ __forceinline__ NormRows norm_rows_of(const GemvParams& p) {
  return {p.x, p.norm_res, p.norm_w, p.ldx, p.norm_res_ld, p.norm_k, p.norm_nt, p.M, p.norm_eps};
}

// Normalized rows of all M tokens into xf[m * K + k] (shared memory): xf = round(r * inv_rms(r) * w) with
// r = round(h + residual) (r = h without a residual); `res_out` (may be null) receives r. `sync` is the compute
// warps' barrier; `red` holds kGvWarps floats. Called by the kMaxNormThreads compute threads after the PDL wait.
// A thread's loads of a row (h, residual and weight vectors) are all issued before any of them is used or anything
// is stored: one round trip. Written as load-then-use per vector, with the residual store in between, the
// compiler kept them in order (it cannot move a load above a store that may alias it): eight to twelve dependent
// round trips per row on the critical path of every fused-norm launch (H200 call N4, ncu).
template <typename Sync>
__device__ __forceinline__ void gv_norm_rows(const NormRows& n, __half* xf, float* red, __half* res_out,
                                             int res_out_ld, Sync&& sync) {
  using namespace exl2::layers;
  const int K = n.K, nvec = K / kNormVec, nt = n.nt, per_pass = kMaxNormThreads / nt;
  const int tid = threadIdx.x, sub = tid / nt, t = tid - sub * nt;
  const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5, w0 = sub * nw;
  for (int m0 = 0; m0 < n.M; m0 += per_pass) {
    const int m = m0 + sub;
    const bool live = sub < per_pass && m < n.M;
    uint4 hv[kNormMaxVecs], rv[kNormMaxVecs], wv[kNormMaxVecs];  // 8 halves each
#pragma unroll
    for (int i = 0; i < kNormMaxVecs; ++i) {
      const int c = t + i * nt;
      if (live && c < nvec) {
        hv[i] = *reinterpret_cast<const uint4*>(n.x + (size_t)m * n.ldx + c * kNormVec);
        if (n.res) rv[i] = *reinterpret_cast<const uint4*>(n.res + (size_t)m * n.res_ld + c * kNormVec);
        wv[i] = __ldg(reinterpret_cast<const uint4*>(n.w + c * kNormVec));  // a constant
      }
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kNormMaxVecs; ++i) {
      const int c = t + i * nt;
      if (live && c < nvec) {
        __half* h = reinterpret_cast<__half*>(&hv[i]);
        if (n.res) {
          const __half* r = reinterpret_cast<const __half*>(&rv[i]);
#pragma unroll
          for (int k = 0; k < kNormVec; ++k) h[k] = __float2half_rn(__fadd_rn(__half2float(h[k]), __half2float(r[k])));
          if (res_out) *reinterpret_cast<uint4*>(res_out + (size_t)m * res_out_ld + c * kNormVec) = hv[i];
        }
#pragma unroll
        for (int k = 0; k < kNormVec; ++k) {
          const float v = __half2float(h[k]);
          ss = __fmaf_rn(v, v, ss);
        }
      }
    }
    ss = warp_sum(ss);  // block_sum: each warp's sum, then one warp sum over the row's warps (zeros past them)
    if (lane == 0) red[warp] = ss;
    sync();
    float s = sub < per_pass && lane < nw ? red[w0 + lane] : 0.f;
    s = warp_sum(s);
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(s, (float)K), n.eps));
#pragma unroll
    for (int i = 0; i < kNormMaxVecs; ++i) {
      const int c = t + i * nt;
      if (live && c < nvec) {
        const __half* h = reinterpret_cast<const __half*>(&hv[i]);
        const __half* w = reinterpret_cast<const __half*>(&wv[i]);
        float v[kNormVec];
#pragma unroll
        for (int k = 0; k < kNormVec; ++k) v[k] = __fmul_rn(__fmul_rn(__half2float(h[k]), inv), __half2float(w[k]));
        store_vec<kNormVec>(xf + (size_t)m * K + c * kNormVec, v);
      }
    }
    sync();  // red is reused by the next pass; xf is complete after the last
  }
}

// Row m of `rows` alone (gv_norm_rows with one row) into xf[0 .. K); res_out (null: not written) is the residual
// stream's base, its row m receives round(h + residual). One block per row: the chain's norm phase and the
// pre-gathering norm (exl2_gemv_norm_pregather.cu).
template <typename Sync>
__device__ __forceinline__ void gv_norm_row(NormRows rows, int m, __half* xf, float* red, __half* res_out,
                                            int res_out_ld, Sync&& sync) {
  rows.x += (size_t)m * rows.ldx;
  if (rows.res) rows.res += (size_t)m * rows.res_ld;
  rows.M = 1;
  gv_norm_rows(rows, xf, red, res_out ? res_out + (size_t)m * res_out_ld : nullptr, res_out_ld, sync);
}

// The split's rows of the normalized tokens (xf) into xs[m * xstride + r] in stored row order (padding rows
// zero), shared memory to shared memory, by `nthreads` threads from thread 0 (callers synchronize).
__device__ __forceinline__ void gv_gather_normed(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                                 const __half* xf, int nthreads) {
  const int rows = nch * kChunkRows, items = rows * p.M;
  for (int e = threadIdx.x; e < items; e += nthreads) {
    const int m = e / rows, r = e - m * rows;
    const unsigned i = xm[r];
    xs[m * p.xstride + r] = i == 0xFFFFu ? __float2half_rn(0.f) : xf[(size_t)m * p.norm_k + i];
  }
}

}  // namespace exl2q
