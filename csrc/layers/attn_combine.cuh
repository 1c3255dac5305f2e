// The split combination of the decode attention's reduce kernels (paged_attention.cu, paged_attention_quant.cu)
// with the row's partials staged in shared memory first. The per-thread loop over the splits waited one L2
// round trip per 16 splits, twice (the maxima, then the weighted sums): H200 call I3 of 2026-12-02, 8B decode at
// 32k (66 splits), the reduce held 11 us per layer of the graph's critical path against 3 us at 512 tokens.
// Here every thread issues its asynchronous copies (cp.async, sm_80+) at once, then the same arithmetic runs
// from shared memory: the max of the split maxima, then num and den as fmaf chains in split order, so the
// result is bit-identical to the loop.
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/pdl.cuh"

namespace exl2 {
namespace layers {

// Dynamic shared memory of a staged combine of `nsplit` splits of D dims: partials [nsplit][D], stats [nsplit][2].
constexpr int64_t attn_combine_smem(int64_t nsplit, int D) { return nsplit * (D + 2) * 4; }
constexpr int64_t kAttnCombineSmemMax = 48 * 1024;  // without the opt-in attribute

// Most bytes a reduce kernel stages: 200 KB through the kernel's opt-in attribute, or EXL2_ATTN_COMBINE_MAX_KB
// (read once, 48..200). The q8 cache at 32k splits 99 ways for the 8B (51.5 KB at D = 128): H200 call J1 of
// 2026-12-02, 8B decode at 32k with the q8 cache 202.3 tok/s looping (48 KB) against 209.0 staged (200 KB), the
// reduce's critical path 350 -> 205 us per step; fp16 (66 splits, 34 KB) unchanged at 227.4.
inline int64_t attn_combine_max_bytes() {
  static const int64_t v = [] {
    const char* e = getenv("EXL2_ATTN_COMBINE_MAX_KB");
    const int kb = e ? atoi(e) : 200;
    return (int64_t)(kb < 48 ? 48 : (kb > 200 ? 200 : kb)) * 1024;
  }();
  return v;
}

// Whether `Kernel` (a reduce kernel's staged instantiation) can be launched with `bytes` of dynamic shared memory
// on the current device, opting in (exl2::opt_in_dynamic_smem) where more than 48 KB are allowed.
template <auto Kernel>
bool attn_combine_fits(int64_t bytes) {
  if (bytes <= kAttnCombineSmemMax) return true;
  if (bytes > attn_combine_max_bytes()) return false;
  if (exl2::opt_in_dynamic_smem<Kernel>((size_t)bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // the loop over global memory instead
    return false;
  }
  return true;
}

__device__ __forceinline__ void cp_async_f32(float* dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

__device__ __forceinline__ void cp_async_f32x4(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

// The combination of one output element, shared by every reduce path: the max of the split maxima, then num and
// den as fmaf chains in split order. ml(i): float i of the row's statistics [used][2] (max in log2 units, sum);
// po(s): split s's partial of this element.
template <typename ML, typename PO>
__device__ __forceinline__ float attn_combine_in_order(int used, ML&& ml, PO&& po) {
  float M = -INFINITY;
  for (int s = 0; s < used; ++s) M = fmaxf(M, ml(2 * s));
  float num = 0.f, den = 0.f;
  if (M != -INFINITY) {
    for (int s = 0; s < used; ++s) {
      const float w = exp2f(ml(2 * s) - M);
      den = fmaf(w, ml(2 * s + 1), den);
      num = fmaf(w, po(s), num);
    }
  }
  return den > 0.f ? num / den : 0.f;
}

// Output dim threadIdx.x (D threads, the whole block) of one row: ml [used][2] and po [used][D] (16-byte aligned)
// are the row's split statistics and partials; smem holds attn_combine_smem(used, D) bytes. Ends with a block
// barrier passed.
template <int D>
__device__ __forceinline__ float attn_combine_staged(const float* ml, const float* po, int used, float* smem) {
  static_assert(D % 4 == 0, "partials are copied four floats at a time");
  float* s_po = smem;             // [used][D]
  float* s_ml = smem + used * D;  // [used][2]
  const int d = threadIdx.x;
  for (int i = d; i < 2 * used; i += D) cp_async_f32(s_ml + i, ml + i);
  for (int i = d; i < used * (D / 4); i += D) cp_async_f32x4(s_po + 4 * i, po + 4 * i);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  return attn_combine_in_order(used, [&](int i) { return s_ml[i]; }, [&](int s) { return s_po[s * D + d]; });
}

// Dims [32 slice, 32 slice + 32) of one row by one warp (lane = dim within the slice; the reduce's sliced kernel):
// ml [used][2], po [used][D] (16-byte aligned); smem holds used * (32 + 2) floats. The same staging and arithmetic
// per element as attn_combine_staged, so the same bits.
template <int D>
__device__ __forceinline__ float attn_combine_staged_slice(const float* ml, const float* po, int used, int slice,
                                                           float* smem) {
  float* s_po = smem;             // [used][32]
  float* s_ml = smem + used * 32;  // [used][2]
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < 2 * used; i += 32) cp_async_f32(s_ml + i, ml + i);
  for (int i = lane; i < used * 8; i += 32)  // 8 words of 4 floats per split
    cp_async_f32x4(s_po + 4 * i, po + (int64_t)(i >> 3) * D + 32 * slice + 4 * (i & 7));
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncwarp();
  return attn_combine_in_order(used, [&](int i) { return s_ml[i]; }, [&](int s) { return s_po[s * 32 + lane]; });
}

}  // namespace layers
}  // namespace exl2
