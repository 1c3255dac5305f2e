// RMSNorm split across two TMA GEMVs: the GEMV that produces the hidden state (o_proj, down_proj) finishes the
// residual add and leaves each row's sum of squares as block partials; the GEMV that consumes it (gate/up, the
// next layer's q/k/v) normalizes only its own split's rows from them. No block reads a whole row, no norm runs as
// its own launch:
//
// - producer (GemvParams::resid_ssq): the block that computes a 256-column block's final values (the last block of
//   the split-K ticket, or the only one) keeps them in shared memory (its drained ring), adds the residual stream
//   (loaded into registers while the partials were summed) and writes out = round(value + residual), and stores
//   each row's partial s_b (layers/rms_ssq.cuh) at resid_ssq[m * resid_ssq_ld + b]. One warp per row: lane l takes
//   the row's 16-byte vector l of the block, which is the canonical lane of that vector. No L2 round trip is
//   added to the critical path (re-reading the written output cost the 8B decode step ~67 us: H200 call AG1).
// - consumer (GemvParams::norm_ssq): before the PDL wait the compute warps stage the norm weight at the split's rows
//   in stored order (a constant); after it, the last warp sums each row's partials into 1 / rms while the others
//   gather the split's input rows as the plain GEMV does; then every staged element becomes
//   round(x * inv * w), the arithmetic of rms_norm_kernel.
//
// Together they are bit-identical to add_rms_norm between two plain GEMVs (tested).
#pragma once

#include "layers/rms_ssq.cuh"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

// Producer, every compute thread after its chunk loop: the residual vectors its epilogue will add (warp w, lane l:
// rows w, w + 8, ... of the block's vector l), loaded while the split-K partials are summed. Up to two token tiles
// (M <= 16: decode and verify steps); past that the epilogue loads them itself (kept live across the reduction,
// four vectors made the 168-register kernel spill).
template <int MT>
constexpr bool kResidualPrefetch = MT <= 2;
template <int MT>
__device__ __forceinline__ void gv_residual_prefetch(const GemvParams& p, const QDesc& d, int colblk,
                                                     uint4 (&res)[MT]) {
  if constexpr (!kResidualPrefetch<MT>) return;
  const int warp = threadIdx.x >> 5, n = colblk * kGvCols + exl2::layers::kSsqVec * (threadIdx.x & 31);
#pragma unroll
  for (int j = 0; j < MT; ++j) {  // M <= 8 MT: at most MT rows per warp
    const int m = warp + kGvWarps * j;
    if (m < p.M && n < d.N) res[j] = *reinterpret_cast<const uint4*>(p.resid_in + (size_t)m * p.resid_ld + n);
  }
}

// Producer, compute threads after a barrier over them: the block's final values of column block `colblk` are in
// stash[m * kGvCols + column] (shared memory, fp16, rounded as the output); writes round(value + residual) to
// d.out and each row's block partial.
// inv_stage: gv_stage_residual_inv's copy of the consumer's inverse maps for this column block.
template <int MT>
__device__ __forceinline__ void gv_residual_ssq(const GemvParams& p, const QDesc& d, int colblk, const __half* stash,
                                                const uint4 (&res)[MT], const unsigned short* inv_stage) {
  using namespace exl2::layers;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = colblk * kGvCols + kSsqVec * lane;  // N is a multiple of 8 (host): a vector is whole or absent
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    const int m = warp + kGvWarps * j;
    if (m >= p.M) break;  // warp-uniform
    float vs = 0.f;
    if (n < d.N) {
      uint4 hv = *reinterpret_cast<const uint4*>(stash + m * kGvCols + kSsqVec * lane);
      uint4 rv;
      if constexpr (kResidualPrefetch<MT>) rv = res[j];
      else rv = *reinterpret_cast<const uint4*>(p.resid_in + (size_t)m * p.resid_ld + n);
      __half* h = reinterpret_cast<__half*>(&hv);
      const __half* r = reinterpret_cast<const __half*>(&rv);
      float v[kSsqVec];
#pragma unroll
      for (int k = 0; k < kSsqVec; ++k) {
        h[k] = __float2half_rn(__fadd_rn(__half2float(h[k]), __half2float(r[k])));
        v[k] = __half2float(h[k]);
      }
      *reinterpret_cast<uint4*>(d.out + (size_t)m * d.ldo + n) = hv;
      vs = ssq_vec(v);
      for (int q = 0; q < p.resid_xp_parts; ++q) {  // the consumer's stored order: scattered stores, no waiting
        const unsigned short* iv = inv_stage + q * kGvCols + kSsqVec * lane;
        __half* xq = p.resid_xp + ((size_t)q * p.M + m) * p.resid_xp_ld;
#pragma unroll
        for (int k = 0; k < kSsqVec; ++k) xq[iv[k]] = h[k];
      }
    }
    const float sb = ssq_block(vs);
    if (lane == 0) p.resid_ssq[(size_t)m * p.resid_ssq_ld + colblk] = sb;
  }
}

// Producer, compute threads before the PDL wait (constants): the consumer parts' inverse maps at this column
// block's 256 features into inv_stage[q * kGvCols + c] (shared memory); the caller synchronizes.
__device__ __forceinline__ void gv_stage_residual_inv(const GemvParams& p, int colblk, unsigned short* inv_stage) {
  const int n0 = colblk * kGvCols, nvec = kGvCols / 8;  // N is a multiple of 8: whole 16-byte vectors
  for (int e = threadIdx.x; e < p.resid_xp_parts * nvec; e += kGvWarps * 32) {
    const int q = e / nvec, c = 8 * (e - q * nvec);
    if (n0 + c < p.d[0].N)
      *reinterpret_cast<uint4*>(inv_stage + q * kGvCols + c) = __ldg(reinterpret_cast<const uint4*>(p.resid_inv[q] + n0 + c));
  }
}

// Consumer, compute threads before the PDL wait: the norm weight of the item's rows [c0 * 64, c1 * 64) in stored
// order into wrow (padding rows 0); the caller synchronizes.
__device__ __forceinline__ void gv_load_norm_weight_rows(const GemvParams& p, const QDesc& d, int c0, int nch,
                                                         __half* wrow, int nthreads) {
  const int rows = nch * kChunkRows;
  for (int r = threadIdx.x; r < rows; r += nthreads) {
    const unsigned i = __ldg(d.xmap + (size_t)c0 * kChunkRows + r);
    wrow[r] = i == 0xFFFFu ? __float2half_rn(0.f) : __ldg(p.norm_w + i);
  }
}

// Consumer, the last compute warp: inv[m] = 1 / rms of row m from its block partials, 16 loads in flight.
__device__ __forceinline__ void gv_rows_inv_rms(const GemvParams& p, float* inv) {
  using namespace exl2::layers;
  const int lane = threadIdx.x & 31, nb = (p.norm_ssq_k + kSsqBlockCols - 1) / kSsqBlockCols;
  for (int m = lane; m < p.M; m += 32) {
    const float* s = p.norm_ssq + (size_t)m * p.norm_ssq_ld;
    float total = 0.f;
    for (int b0 = 0; b0 < nb; b0 += 16) {
      float t[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) t[u] = b0 + u < nb ? s[b0 + u] : 0.f;
#pragma unroll
      for (int u = 0; u < 16; ++u) total = __fadd_rn(total, t[u]);  // in block order; zeros add nothing
    }
    inv[m] = rms_inv(total, p.norm_ssq_k, p.norm_eps);
  }
}

// Consumer, compute threads after the gather (or the copy of the producer's stored-order stream) and a barrier:
// xs[m][r] = round(xs * inv[m] * wrow[r]); padding rows (xm 0xFFFF) 0, whatever the copy brought.
__device__ __forceinline__ void gv_scale_normed(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                                const __half* wrow, const float* inv, int nthreads) {
  const int rows = nch * kChunkRows, items = rows * p.M;
  for (int e = threadIdx.x; e < items; e += nthreads) {
    const int m = e / rows, r = e - m * rows;
    __half* x = xs + m * p.xstride + r;
    *x = xm[r] == 0xFFFFu ? __float2half_rn(0.f)
                          : __float2half_rn(__fmul_rn(__fmul_rn(__half2float(*x), inv[m]), __half2float(wrow[r])));
  }
}

}  // namespace exl2q
