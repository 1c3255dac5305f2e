// Ranking keys of the top-k / nucleus sampler (sampling_top_k.cu, sample_nucleus.cuh): a token's (x, id) as one
// 64-bit key, the order-preserving bits of x above the complemented id. Keys are distinct, a larger x is a larger
// key and equal x rank the lower id first (the reference's stable descending sort); 0 is below every token's key
// and pads. The same encoding packs a race score with its id, so the largest key is better()'s winner.
#pragma once

#include <stdint.h>

namespace exl2 {
namespace layers {

__device__ __forceinline__ uint64_t make_key(float x, int id) {
  const uint32_t u = x == 0.f ? 0u : __float_as_uint(x);  // -0 as +0: equal x rank by id (not x + 0, which fast
                                                           // math may fold away)
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)ord << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)id);
}

__device__ __forceinline__ float key_x(uint64_t key) {
  const uint32_t ord = (uint32_t)(key >> 32);
  return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7FFFFFFFu) : ~ord);
}

__device__ __forceinline__ int key_id(uint64_t key) { return (int)(0xFFFFFFFFu - (uint32_t)key); }

// n keys in shared memory sorted descending (n a power of two), by the whole block of THREADS threads
template <int THREADS>
__device__ void bitonic_sort_desc(uint64_t* keys, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += THREADS) {
        const int lo = 2 * i - (i & (stride - 1));  // i with a zero bit inserted at `stride`
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const uint64_t a = keys[lo], b = keys[hi];
        if ((a < b) == desc) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace layers
}  // namespace exl2
