// Steps of the split-K decode attention kernels that do not depend on how K/V are stored: the clamped context and
// the split's length, the lanes' butterfly sum, the split's page table (the fp16 kernel, paged_attention.cu, and
// the kernels over quantized pages) and the softmax statistics of a row tile's scores (the quantized-page
// kernels). The fp16 kernel's phase 2 is the same code written in place: calling attn_softmax_rows there compiled
// to different SASS (more unrolled), not yet run on the GPU.
#pragma once

#include <math.h>

#include "layers/common.cuh"

namespace exl2 {
namespace layers {

constexpr int kAttnWarps = 4;  // warps per CTA of every split-K decode attention kernel
constexpr int kAttnThreads = kAttnWarps * 32;

// The context length clamped to the table's pages (a bad length never reads past it). P: AttnParams or QAttnParams.
template <typename P>
__device__ __forceinline__ int attn_clamp_ctx(int ctx, const P& p) {
  const int cap = p.max_pages << p.log2S;
  return ctx < 0 ? 0 : (ctx > cap ? cap : ctx);
}

// Keys per split of a context of `ctx` keys (a multiple of 16, at least min_split).
__device__ __forceinline__ int attn_split_len(int ctx, int nsplit, int min_split) {
  int L = (ctx + nsplit - 1) / nsplit;
  L = (L + 15) & ~15;
  return L > min_split ? L : min_split;
}

constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }

// Sum N per-lane values over the O*2 lanes of a group. Each step while N > 1 halves the values a lane holds
// (lanes with bit O set keep the upper half); afterwards plain xor-reductions.
template <int N, int O>
__device__ __forceinline__ void butterfly(float* v, int lane) {
  if constexpr (O >= 1) {
    if constexpr (N > 1) {
      constexpr int H = N / 2;
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = upper ? v[i] : v[i + H];
        const float keep = upper ? v[i + H] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      butterfly<H, O / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
      butterfly<1, O / 2>(v, lane);
    }
  }
}

// The split's pages, clamped so that a bad table never faults. P: AttnParams or QAttnParams; NTH: the CTA's threads.
template <int NTH = kAttnThreads, typename P>
__device__ __forceinline__ void attn_load_pages(const P& p, int b, int first_page, int npages, int* pages) {
  for (int i = threadIdx.x; i < npages; i += NTH) {
    const int pg = p.block_tables[(int64_t)b * p.bt_stride + first_page + i];
    pages[i] = pg < 0 ? 0 : (pg >= p.num_pages ? p.num_pages - 1 : pg);
  }
}

// Phase 2: per row of scores [RT][KM] (log2 domain, n keys), the max and exp2 in place, row sums.
template <int RT, int KM>
__device__ __forceinline__ void attn_softmax_rows(float* scores, int n, float* row_m, float* row_l) {
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < RT; r += kAttnWarps) {
    float* sr = scores + r * KM;
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, sr[i]);
    m = warp_max(m);
    const float mu = m == -INFINITY ? 0.f : m;  // fully masked row: all p = 0, no NaN
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = exp2f(sr[i] - mu);
      sr[i] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      row_m[r] = m;
      row_l[r] = l;
    }
  }
}

}  // namespace layers
}  // namespace exl2
