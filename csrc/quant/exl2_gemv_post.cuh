// RMSNorm applied at the GEMV's output instead of its input. The linear commutes with the norm's per-row scale:
// W (r * inv * w) = inv * (W (r * w)), inv = rsqrt(mean(r^2) + eps). So between two GEMVs of a decoder layer
// (o -> gate/up, down -> the next layer's q/k/v) no kernel has to wait for a whole row's reduction before the
// consumer can start:
// - the producer's split-K finish, which holds whole 256-column blocks of its output, adds the residual, writes
//   the residual stream r and each row's sum of squares of its block (gv_feed_finish; GemvParams::feed_*);
// - the consumer gathers round(r * w') for its rows (gv_gather_post; w' = w * 2^-e keeps |r * w'| <= |r|, so the
//   fp16 product cannot overflow) and multiplies each output row by rsqrt(sum / K + eps) * 2^e before its bias
//   (gv_post_scales; GemvParams::post_*), from the tile sums added in tile order.
// A row's sums, scale and products never depend on the rows beside it, so a verify step's rows stay bit-identical
// to the decode step's (the speculative verify's exactness), with no norm launch and no norm prologue at any M.
// Where the producer cannot feed, exl2_row_feed (exl2_row_feed.cu) writes the same r and sums from its output.
//
// The tile sum of row m over columns [256 t, 256 t + 256): each column quad's squares chained with fmaf in column
// order from 0; the half sums warp_sum over quads 0 .. 31 and 32 .. 63 (lane L: quad L of the half; absent
// columns 0); the tile sum half 0 + half 1.
#pragma once

#include "common/api.h"
#include "layers/common.cuh"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr int kPostTileCols = 256;  // columns per tile sum (one GEMV column block)
constexpr int kPostMaxTiles = 32;   // K <= 8192
constexpr int kPostMaxRows = 32;    // the GEMV's M

// The per-row output scales of a post-norm launch (kPostMaxRows floats, one set per block: a function-scope
// __shared__ array is a single static allocation, the same at every inlined call).
__device__ __forceinline__ float* gv_row_scales() {
  __shared__ float s_rs[kPostMaxRows];
  return s_rs;
}

// Threads 0 .. M - 1 (of the compute threads, after the PDL wait): row m's scale rsqrt(sum of post_ss[m, 0 .. T)
// in tile order / K + eps) * post_mul into rs[m]. The caller's barrier publishes them before the finish.
__device__ __forceinline__ void gv_post_scales(const GemvParams& p, float* rs) {
  const int m = threadIdx.x;
  if (m >= p.M) return;
  const float* src = p.post_ss + (size_t)m * p.post_ss_ld;
  float t[kPostMaxTiles];
#pragma unroll
  for (int j = 0; j < kPostMaxTiles; ++j) t[j] = j < p.post_tiles ? __ldcg(src + j) : 0.f;  // written by the producer
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kPostMaxTiles; ++j)
    if (j < p.post_tiles) s = __fadd_rn(s, t[j]);
  rs[m] = __fmul_rn(rsqrtf(__fadd_rn(__fdiv_rn(s, (float)p.post_k), p.post_eps)), p.post_mul);
}

// Gather of the split's rows of round(r * w') into xs[m * xstride + r] in stored row order (padding rows zero), by
// `nthreads` threads from thread 0 (callers synchronize); 8 items (two 2-byte loads each) in flight per thread.
__device__ __forceinline__ void gv_gather_post(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                               int nthreads) {
  gv_gather_item_pairs(
      p, nch, xs, xm, nthreads, [&](int, unsigned i) { return __ldg(p.post_w + i); },
      [](float x, float w) { return __fmul_rn(x, w); });
}

// A quad's chain of squares (post_tile's order).
__device__ __forceinline__ float post_quad_chain(const float (&q4)[4]) {
  float q = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) q = __fmaf_rn(q4[c], q4[c], q);
  return q;
}

// A feeding GEMV's finish for column block `colblk` (GemvParams::feed_ss; the last block of the column block, or
// the only one at ksplit == 1 after its warps stored their fp16 results in out): per element the output h (the
// split partials summed in split order plus bias and rounded, as gv_reduce_partials_vec4; or the stored result),
// then r = round(h + feed_res) written to out in its place, per row the tile sum of r into feed_ss[m * feed_ss_ld +
// colblk], and with feed_xp round(r * feed_w) into each consumer part's stored rows (GemvParams::feed_xp). Two
// warps per row, four rows per pass (lane L of the second warp: quad 32 + L); each pass one round of loads, as the
// vec4 reduce's. Called by the 256 compute threads; `sync` is their barrier.
template <typename Sync>
__device__ __forceinline__ void gv_feed_finish(const GemvParams& p, const QDesc& d, int colblk, int ksplit,
                                               Sync&& sync) {
  __shared__ float s_half[kPostMaxRows][2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slot = warp >> 1, half = warp & 1;
  const int M = p.M, n = colblk * kGvCols + 4 * (32 * half + lane);  // this lane's first column
  const bool cols = n < d.N;  // N % 8 == 0 (host): all four columns or none
  const size_t stride = (size_t)M * d.Np;
  // the pre-gathered consumer input's constants: the scaled weight and each part's stored rows of these columns
  const bool scatter = p.feed_xp != nullptr && cols;
  const uint2 wv = scatter ? __ldg(reinterpret_cast<const uint2*>(p.feed_w + n)) : make_uint2(0, 0);
  for (int m = slot; m < M; m += kGvWarps / 2) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    uint2 res = make_uint2(0, 0);
    if (cols) {
      res = __ldcg(reinterpret_cast<const uint2*>(p.feed_res + (size_t)m * p.feed_res_ld + n));
      if (ksplit > 1) {
        const float4 sum = gv_split_sum4(d, m, n, ksplit, stride);
        v[0] = sum.x;
        v[1] = sum.y;
        v[2] = sum.z;
        v[3] = sum.w;
#pragma unroll
        for (int c = 0; c < 4; ++c) v[c] += d.bias ? __half2float(d.bias[n + c]) : 0.f;  // as the vec4 reduce
      } else {
        const uint2 hv = __ldcg(reinterpret_cast<const uint2*>(d.out + (size_t)m * d.ldo + n));  // this block's
        const __half* hh = reinterpret_cast<const __half*>(&hv);
#pragma unroll
        for (int c = 0; c < 4; ++c) v[c] = __half2float(hh[c]);
      }
    }
    const __half* rh = reinterpret_cast<const __half*>(&res);
    __align__(8) __half r[4];
    float rf[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float h = __half2float(__float2half_rn(v[c]));
      r[c] = __float2half_rn(__fadd_rn(h, __half2float(rh[c])));
      rf[c] = cols ? __half2float(r[c]) : 0.f;
    }
    if (cols) *reinterpret_cast<uint2*>(d.out + (size_t)m * d.ldo + n) = *reinterpret_cast<const uint2*>(r);
    if (scatter) {
      const __half* wh = reinterpret_cast<const __half*>(&wv);
      __half y[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) y[c] = __float2half_rn(__fmul_rn(rf[c], __half2float(wh[c])));
      for (int q = 0; q < p.feed_parts; ++q) {  // each part's stored rows of these columns (constants)
        const int4 row = __ldg(reinterpret_cast<const int4*>(p.feed_inv[q] + n));
        __half* dst = p.feed_xp + ((size_t)q * M + m) * p.feed_xp_ld;
        dst[row.x] = y[0];
        dst[row.y] = y[1];
        dst[row.z] = y[2];
        dst[row.w] = y[3];
      }
    }
    const float q = exl2::layers::warp_sum(post_quad_chain(rf));
    if (lane == 0) s_half[m][half] = q;
  }
  if (p.feed_xp && colblk == 0) {  // the parts' padding rows: zero, as the pre-gathering kernels write them
    for (int q = 0; q < p.feed_parts; ++q)
      for (int e = threadIdx.x; e < p.feed_npad[q] * M; e += kGvWarps * 32) {
        const int m = e / p.feed_npad[q];
        p.feed_xp[((size_t)q * M + m) * p.feed_xp_ld + __ldg(p.feed_pad[q] + (e - m * p.feed_npad[q]))] =
            __float2half_rn(0.f);
      }
  }
  sync();
  if (threadIdx.x < M) {
    const int m = threadIdx.x;
    p.feed_ss[(size_t)m * p.feed_ss_ld + colblk] = __fadd_rn(s_half[m][0], s_half[m][1]);
  }
}

}  // namespace exl2q
