// What the streamed decode attention kernels share (paged_attention_stream.cu on CUDA cores,
// paged_attention_stream_mma.cu and paged_attention_stream_mma_quant.cu on tensor cores): a stage's layout over code
// pages, the ring's barriers, a split's token range and the output of an unused split. A CTA takes one split of one sequence for all its kv heads (grid (nsplit, B)).
#pragma once

#include <cuda_fp16.h>

#include "common/bulk_copy.cuh"
#include "layers/kv_quant.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {

constexpr int kStreamRingD = 128;     // head dim of the streamed kernels
constexpr int kStreamRingChunk = 16;  // tokens per ring stage (page sizes are powers of two >= 16)

// Whether pages of format F (kFmtF16: fp16 pages, else a KVFmt code) come with group scales.
template <int F>
constexpr bool kScaled = F != kFmtF16;

// Bytes of one stage: K codes, K scales, V codes, V scales of kStreamRingChunk tokens (each a multiple of 16).
template <int KF, int VF>
struct StageLayout {
  int k_codes, k_scales, v_codes, v_scales, total;
  __host__ __device__ StageLayout(int hkv) {
    const int scales = kStreamRingChunk * hkv * (kStreamRingD / KV_GROUP) * 2;
    k_codes = kStreamRingChunk * hkv * kStreamRingD * KVFormat<KF>::BITS / 8;
    k_scales = kScaled<KF> ? scales : 0;
    v_codes = kStreamRingChunk * hkv * kStreamRingD * KVFormat<VF>::BITS / 8;
    v_scales = kScaled<VF> ? scales : 0;
    total = k_codes + k_scales + v_codes + v_scales;
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// `stages` barrier pairs: full[s] (the producer's one arrival + its copies' bytes) at full0 + 8 s, empty[s] (one
// arrival per consumer warp) at empty0 + 8 s. Every thread of the CTA calls it (it ends in __syncthreads).
__device__ __forceinline__ void stream_ring_init(uint32_t full0, uint32_t empty0, int stages, int consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      exl2::mbar_init(full0 + 8 * s, 1);
      exl2::mbar_init(empty0 + 8 * s, consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}
#endif

// Split `split`'s keys [t0, t1) of a context of `ctx` keys, clamped to the table's capacity (t0 >= t1: unused).
struct StreamRange {
  int t0, t1;
};
__device__ __forceinline__ StreamRange stream_split_range(const QAttnParams& p, int ctx, int split) {
  const int cap = p.max_pages << p.log2S;
  ctx = ctx < 0 ? 0 : (ctx > cap ? cap : ctx);
  const int L = qattn_split_len(ctx, p.nsplit, p.min_split);
  const int t0 = split * L;
  return {t0, min(ctx, t0 + L)};
}

// An unused split (or an empty context): with one split the output is zeros, as the reference (the reduce covers
// the other case). `threads`: the compute threads that call it.
template <int D>
__device__ __forceinline__ void stream_empty_split(const QAttnParams& p, int b, int threads) {
  if (p.nsplit != 1) return;
  const int n = p.Tq * p.Hq * D;  // sequence b's rows [Tq][Hq][D]
  for (int i = threadIdx.x; i < n; i += threads) p.out[(int64_t)b * n + i] = __float2half_rn(0.f);
}

}  // namespace layers
}  // namespace exl2
