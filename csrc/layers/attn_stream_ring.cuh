// What the two streamed decode attention kernels share (paged_attention_stream.cu on CUDA cores,
// paged_attention_stream_mma.cu on tensor cores): the ring's barriers, a split's token range and the output of an
// unused split. A CTA takes one split of one sequence for all its kv heads (grid (nsplit, B)).
#pragma once

#include <cuda_fp16.h>

#include "common/bulk_copy.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {

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
  ctx = attn_clamp_ctx(ctx, p);
  const int L = attn_split_len(ctx, p.nsplit, p.min_split);
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
