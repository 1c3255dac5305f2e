// RMSNorm fused into the TMA GEMV's input (GemvParams::norm_nt > 0): the layer's add_rms_norm kernel and the
// launch boundary before the q/k/v or gate/up GEMV disappear. Every block normalizes all M tokens' whole rows
// into shared memory (M x K fp16; at M = 1 and K = 4096 an 8 KB read from L2, where the rows were just written)
// and then gathers its split's rows from there in stored order. Block 0 alone writes the new residual stream.
//
// The sum of squares has one canonical order, shared by every kernel that normalizes a row (layers/norm.cu
// rms_norm_kernel, gv_norm_rows here, the pre-gathering norm, the chain's norm phase, and the feeding GEMV's finish,
// gv_feed_finish): the row is cut into tiles of 256 columns, each tile into 32 groups of 8 adjacent columns; a
// group's sum is an fma chain over its 8 squares from 0, a tile's sum the warp butterfly (warp_sum) over its 32
// groups (absent columns count 0), and the row's sum adds the tile sums in tile order from 0. So a GEMV that owns
// one 256-column block of the output can leave that tile's sum for the next GEMV's norm (GemvParams::feed_ss), and
// the norm computed from those sums is bit-identical to the one computed from the row (tested).
// Every kernel also keeps the rest of rms_norm_kernel's arithmetic: r = round(h + residual), inv =
// rsqrt(sum / K + eps), the output round(r * inv * w).
#pragma once

#include "common/api.h"
#include "layers/common.cuh"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr int kNormVec = 8;       // halves per 16-byte vector (rms_norm_kernel VEC)
constexpr int kNormMaxVecs = 4;   // vectors per thread (rms_norm_kernel MAXV)
constexpr int kMaxNormThreads = kGvWarps * 32;  // a row's threads must fit the compute warps (K <= 8192)
constexpr int kNormTileCols = 256;              // columns per tile of the canonical sum (one GEMV column block)
// Tile sums kept by one pass of gv_norm_rows: rows per pass x tiles per row <= 256 / nt x nt / 8 = 32.
constexpr int kNormRedFloats = 64;

// The canonical partial of one group of 8 adjacent columns: an fma chain over their squares from s.
__device__ __forceinline__ float norm_group_chain(const float (&v)[kNormVec], float s) {
#pragma unroll
  for (int k = 0; k < kNormVec; ++k) s = __fmaf_rn(v[k], v[k], s);
  return s;
}

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
// warps' barrier; `red` holds kNormRedFloats floats. Called by the kMaxNormThreads compute threads after the PDL
// wait; the sum in the canonical tile order (top of this file).
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
  const int lane = tid & 31;
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
    // Per vector (one group of 8 columns: tile c / 32, lane c % 32 since nt is a multiple of 32) its chain, then
    // one butterfly per vector slot over the warp: the tile sums, in red[sub * ntiles + tile].
    const int ntiles = (nvec + 31) / 32;
#pragma unroll
    for (int i = 0; i < kNormMaxVecs; ++i) {
      const int c = t + i * nt;
      float q = 0.f;
      if (live && c < nvec) {
        __half* h = reinterpret_cast<__half*>(&hv[i]);
        if (n.res) {
          const __half* r = reinterpret_cast<const __half*>(&rv[i]);
#pragma unroll
          for (int k = 0; k < kNormVec; ++k) h[k] = __float2half_rn(__fadd_rn(__half2float(h[k]), __half2float(r[k])));
          if (res_out) *reinterpret_cast<uint4*>(res_out + (size_t)m * res_out_ld + c * kNormVec) = hv[i];
        }
        float v[kNormVec];
#pragma unroll
        for (int k = 0; k < kNormVec; ++k) v[k] = __half2float(h[k]);
        q = norm_group_chain(v, 0.f);
      }
      q = warp_sum(q);  // every lane of the warp: the slot is warp-uniform
      const int tile = (c - lane) / 32;
      if (lane == 0 && sub < per_pass && tile < ntiles) red[sub * ntiles + tile] = q;
    }
    sync();
    float s = 0.f;
    if (sub < per_pass)
      for (int j = 0; j < ntiles; ++j) s += red[sub * ntiles + j];
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


// The fed norm (GemvParams::norm_ss): the producing GEMV already wrote the residual stream r (p.x) and each row's
// tile sums (norm_ss, gv_feed_finish), so a block only copies the M rows of r into xf[m * K + k] (16-byte loads,
// all in flight together), reads the M x tiles sums and turns each row's sum into inv_rms (s_inv[m]); the caller's
// gather (gv_gather_fed) then normalizes only its split's rows. The weight (w_s, K halves) was staged before the
// PDL wait. s_ss holds M * norm_tiles floats. Called by the kMaxNormThreads compute threads; ends synchronized.
template <typename Sync>
__device__ __forceinline__ void gv_fed_rows(const GemvParams& p, __half* xf, float* s_ss, float* s_inv,
                                            Sync&& sync) {
  constexpr int kInFlight = 8;  // 16-byte loads per thread per round
  const int K = p.norm_k, nvec = K / kNormVec, T = p.norm_tiles, M = p.M, tid = threadIdx.x;
  for (int e = tid; e < M * T; e += kMaxNormThreads) {
    const int m = e / T;
    s_ss[e] = __ldcg(p.norm_ss + (size_t)m * p.norm_ss_ld + (e - m * T));  // written by the previous kernel
  }
  const int total = M * nvec;
  for (int e0 = tid; e0 < total; e0 += kInFlight * kMaxNormThreads) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = e0 + u * kMaxNormThreads, m = e / nvec;
      if (e < total) v[u] = __ldcg(reinterpret_cast<const uint4*>(p.x + (size_t)m * p.ldx) + (e - m * nvec));
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = e0 + u * kMaxNormThreads, m = e / nvec;
      if (e < total) reinterpret_cast<uint4*>(xf + (size_t)m * K)[e - m * nvec] = v[u];
    }
  }
  sync();
  if (tid < M) {
    float s = 0.f;  // the tile sums in tile order (the canonical order)
    for (int j = 0; j < T; ++j) s += s_ss[tid * T + j];
    s_inv[tid] = rsqrtf(__fadd_rn(__fdiv_rn(s, (float)K), p.norm_eps));
  }
  sync();
}

// The split's rows of the fed norm's output into xs[m * xstride + r] in stored row order (padding rows zero):
// round(r * inv * w) from the raw rows xf, s_inv and the staged weight w_s, the arithmetic of gv_norm_rows.
__device__ __forceinline__ void gv_gather_fed(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                              const __half* xf, const __half* w_s, const float* s_inv,
                                              int nthreads) {
  const int rows = nch * kChunkRows, items = rows * p.M;
  for (int e = threadIdx.x; e < items; e += nthreads) {
    const int m = e / rows, r = e - m * rows;
    const unsigned i = xm[r];
    xs[m * p.xstride + r] =
        i == 0xFFFFu ? __float2half_rn(0.f)
                     : __float2half_rn(__fmul_rn(__fmul_rn(__half2float(xf[(size_t)m * p.norm_k + i]), s_inv[m]),
                                                 __half2float(w_s[i])));
  }
}

// A feeding GEMV's finish for column block `colblk` (GemvParams::feed_ss; the last block of the column block, or
// the only one at ksplit == 1 after its warps stored their fp16 results in out): per element the output h (the
// split partials summed in split order plus bias and rounded, as gv_reduce_partials; or the stored result), then
// r = round(h + feed_res) written to out in its place, and per row the tile's canonical sum of squares of r into
// feed_ss[m * feed_ss_ld + colblk]. Two warps per row (four rows per pass): lane L of the first holds columns
// 8L .. 8L + 3 of the tile, the second 8L + 4 .. 8L + 7; the first hands its half of the group chain to the second
// through shared memory, which finishes it and sums the tile over its warp. Called by the 256 compute threads.
template <typename Sync>
__device__ __forceinline__ void gv_feed_finish(const GemvParams& p, const QDesc& d, int colblk, int ksplit,
                                               Sync&& sync) {
  __shared__ float s_half[kGvWarps / 2][32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, slot = warp >> 1, second = warp & 1;
  const int M = p.M, n = colblk * kGvCols + 8 * lane + 4 * second;  // this thread's first column
  const bool cols = n < d.N;  // N % 8 == 0 (host): all four columns or none
  const size_t stride = (size_t)M * d.Np;
  for (int m0 = 0; m0 < M; m0 += kGvWarps / 2) {
    const int m = m0 + slot;
    const bool live = m < M && cols;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    uint2 res = make_uint2(0, 0);
    if (live) {
      res = __ldcg(reinterpret_cast<const uint2*>(p.feed_res + (size_t)m * p.feed_res_ld + n));
      if (ksplit > 1) {
        const float4* src = reinterpret_cast<const float4*>(d.ws + (size_t)m * d.Np + n);
        for (int s0 = 0; s0 < ksplit; s0 += 16) {  // 16 loads in flight, summed in split order
          float4 t[16];
#pragma unroll
          for (int u = 0; u < 16; ++u)
            t[u] = s0 + u < ksplit ? __ldcg(src + (s0 + u) * (stride / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int u = 0; u < 16; ++u) {
            v[0] += t[u].x;
            v[1] += t[u].y;
            v[2] += t[u].z;
            v[3] += t[u].w;
          }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) v[c] += d.bias ? __half2float(d.bias[n + c]) : 0.f;  // as the vec4 reduce
      } else {
        const uint2 h = __ldcg(reinterpret_cast<const uint2*>(d.out + (size_t)m * d.ldo + n));  // this block's
        const __half* hh = reinterpret_cast<const __half*>(&h);
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
      rf[c] = live ? __half2float(r[c]) : 0.f;
    }
    if (live) *reinterpret_cast<uint2*>(d.out + (size_t)m * d.ldo + n) = *reinterpret_cast<const uint2*>(r);
    float q = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) q = __fmaf_rn(rf[c], rf[c], q);  // the chain's first four squares
    if (!second) s_half[slot][lane] = q;
    sync();
    if (second) {
      q = s_half[slot][lane];
#pragma unroll
      for (int c = 0; c < 4; ++c) q = __fmaf_rn(rf[c], rf[c], q);  // the chain's last four
      q = exl2::layers::warp_sum(q);
      if (lane == 0 && m < M) p.feed_ss[(size_t)m * p.feed_ss_ld + colblk] = q;
    }
    sync();  // s_half is reused by the next pass
  }
}

}  // namespace exl2q
