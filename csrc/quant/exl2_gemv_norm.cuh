// RMSNorm fused into the TMA GEMV's input (GemvParams::norm_nt > 0): the layer's add_rms_norm kernel and the
// launch boundary before the q/k/v or gate/up GEMV disappear. Every block normalizes all M tokens' whole rows (at
// M = 1 and K = 4096 an 8 KB read from L2, where the rows were just written). Two forms:
// - rows in one pass of one row per thread (K = 4096: M <= 2, the decode step; the kernel with kFNorm): the M
//   normalized rows go to shared memory (M x K halves), then each block gathers its split's rows from there;
// - more rows (GemvParams::norm_stored; the kernel with kFNormStored, a verify step's q/k/v, gate/up and head):
//   each thread takes two rows per pass and stores every value of its block's split straight into the block's
//   stored-order input, through an inverse of its xmap slice built before the PDL wait (K uint16, and the norm
//   weight beside it, whatever M). Kept in shared memory, M x K halves (40 KB at M = 5) left one block per SM for
//   the head and gate/up of a k = 4 verify: BN1 (session 50), gate/up 51.2 us fused against 25.6 + 3.7.
// Block 0 alone writes the new residual stream.
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
// Rows a thread of the stored-order norm takes per pass, their loads issued together (one L2 round trip per pass):
// a pass covers kNormRowsPerThread x kMaxNormThreads / norm_row_threads(K) rows (K = 4096: four).
constexpr int kNormRowsPerThread = 2;

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

// One row's vectors of a thread (hv: h, rv: residual, `live` rows and vectors c = t + i * nt < nvec only): h becomes
// round(h + residual), which res_out's row m receives (null: not written), and the thread's sum of squares of it,
// fma by fma in vector order, is returned. The step both norm forms share with rms_norm_kernel.
__device__ __forceinline__ float norm_add_sumsq(const NormRows& n, uint4 (&hv)[kNormMaxVecs],
                                                const uint4 (&rv)[kNormMaxVecs], int m, int t, bool live,
                                                __half* res_out, int res_out_ld) {
  const int nvec = n.K / kNormVec;
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormMaxVecs; ++i) {
    const int c = t + i * n.nt;
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
  return ss;
}

// A row's 1 / rms after the barrier: the warp sum of its nw warps' sums, red_row[w0 ..] (zeros past them and for a
// thread outside the pass's row groups, `in_group` false).
__device__ __forceinline__ float norm_inv_rms(const float* red_row, bool in_group, int lane, int w0, int nw, int K,
                                              float eps) {
  float s = in_group && lane < nw ? red_row[w0 + lane] : 0.f;
  s = exl2::layers::warp_sum(s);
  return rsqrtf(__fadd_rn(__fdiv_rn(s, (float)K), eps));
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
    float ss = norm_add_sumsq(n, hv, rv, m, t, live, res_out, res_out_ld);
    ss = warp_sum(ss);  // block_sum: each warp's sum, then one warp sum over the row's warps (zeros past them)
    if (lane == 0) red[warp] = ss;
    sync();
    const float inv = norm_inv_rms(red, sub < per_pass, lane, w0, nw, K, n.eps);
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

// Compute warps, before the PDL wait (constants only): the norm weight w [K] into shared memory (ws), the inverse of
// the block's xmap slice, linv[i] = the row of xs that input row i of the part fills, and zeros in xs's padding
// rows, which no input row fills. Input rows of
// other blocks' splits map to xstride - 1, a half of each token row's 8-half tail that no chunk reads: the norm
// then stores every value without a branch (a branch per value, with the spilled weights reloaded inside it,
// cost ~7 us per launch at M = 1: H100 call BO1 of session 51). `rows` = the block's item's chunks x kChunkRows.
// Synchronizes the compute warps.
template <typename Sync>
__device__ __forceinline__ void gv_norm_prepare_stored(const __half* w, int K, int M, int xstride, int rows,
                                                       const unsigned short* xm, unsigned short* linv, __half* ws,
                                                       __half* xs, int nthreads, Sync&& sync) {
  const int tid = threadIdx.x;
  const unsigned elsewhere = (unsigned)(xstride - 1) * 0x10001u;  // two halves of linv
  for (int v = tid; v < K / kNormVec; v += nthreads) {
    reinterpret_cast<uint4*>(linv)[v] = make_uint4(elsewhere, elsewhere, elsewhere, elsewhere);
    reinterpret_cast<uint4*>(ws)[v] = __ldg(reinterpret_cast<const uint4*>(w) + v);
  }
  sync();
  for (int r = tid; r < rows; r += nthreads) {
    const unsigned i = xm[r];
    if (i != 0xFFFFu) {
      linv[i] = (unsigned short)r;
    } else {
      for (int m = 0; m < M; ++m) xs[m * xstride + r] = __float2half_rn(0.f);
    }
  }
  sync();
}

// gv_norm_rows with the output in the block's stored order: the normalized value of row m, input row i goes to
// xs[m * xstride + linv[i]]. Each thread takes kNormRowsPerThread rows per pass (rows sub, sub + slots, ... of
// the pass), all their loads issued before any is used; the per-row arithmetic is gv_norm_rows's (so
// rms_norm_kernel's) exactly, through the same steps (norm_add_sumsq, norm_inv_rms). `red` holds kGvWarps x kNormRowsPerThread floats; `ws` is the norm weight in shared
// memory (gv_norm_prepare_stored), read at each use: held in registers across the pass loop, the compiler kept it
// as 32 floats and spilled them.
template <typename Sync>
__device__ __forceinline__ void gv_norm_rows_stored(const NormRows& n, const unsigned short* linv, const __half* ws,
                                                    __half* xs, int xstride, float* red, __half* res_out,
                                                    int res_out_ld, Sync&& sync) {
  using namespace exl2::layers;
  constexpr int R = kNormRowsPerThread;
  const int K = n.K, nvec = K / kNormVec, nt = n.nt, slots = kMaxNormThreads / nt;
  const int tid = threadIdx.x, sub = tid / nt, t = tid - sub * nt;
  const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5, w0 = sub * nw;
  for (int m0 = 0; m0 < n.M; m0 += slots * R) {
    uint4 hv[R][kNormMaxVecs], rv[R][kNormMaxVecs];  // 8 halves each
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int m = m0 + sub + j * slots;
      const bool live = sub < slots && m < n.M;
#pragma unroll
      for (int i = 0; i < kNormMaxVecs; ++i) {
        const int c = t + i * nt;
        if (live && c < nvec) {
          hv[j][i] = *reinterpret_cast<const uint4*>(n.x + (size_t)m * n.ldx + c * kNormVec);
          if (n.res) rv[j][i] = *reinterpret_cast<const uint4*>(n.res + (size_t)m * n.res_ld + c * kNormVec);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int m = m0 + sub + j * slots;
      const bool live = sub < slots && m < n.M;
      float ss = norm_add_sumsq(n, hv[j], rv[j], m, t, live, res_out, res_out_ld);
      ss = warp_sum(ss);  // block_sum: each warp's sum, then one warp sum over the row's warps (zeros past them)
      if (lane == 0) red[j * kGvWarps + warp] = ss;
    }
    sync();
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int m = m0 + sub + j * slots;
      const bool live = sub < slots && m < n.M;
      const float inv = norm_inv_rms(red + j * kGvWarps, sub < slots, lane, w0, nw, K, n.eps);
      __half* row = xs + m * xstride;
#pragma unroll
      for (int i = 0; i < kNormMaxVecs; ++i) {
        const int c = t + i * nt;
        if (live && c < nvec) {
          const uint4 wv = *reinterpret_cast<const uint4*>(ws + c * kNormVec);
          const uint4 lv = *reinterpret_cast<const uint4*>(linv + c * kNormVec);
          const __half* h = reinterpret_cast<const __half*>(&hv[j][i]);
          const __half* w = reinterpret_cast<const __half*>(&wv);
          const uint32_t l4[4] = {lv.x, lv.y, lv.z, lv.w};
#pragma unroll
          for (int k = 0; k < kNormVec; ++k) {
            const unsigned idx = (l4[k >> 1] >> (16 * (k & 1))) & 0xFFFFu;
            row[idx] = __float2half_rn(__fmul_rn(__fmul_rn(__half2float(h[k]), inv), __half2float(w[k])));
          }
        }
      }
    }
    sync();  // red is reused by the next pass
  }
}
}  // namespace exl2q
