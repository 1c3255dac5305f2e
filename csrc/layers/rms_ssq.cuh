// The one order in which every RMSNorm of this library sums a row's squares, so that a norm computed whole
// (rms_norm_kernel, the norm inside the GEMV, the pre-gathering norm) and one assembled from the partial sums that
// the producing GEMV leaves per 256-column block (exl2_gemv_residual.cuh) give the same bits:
//
//   vector   v = the squares of 8 adjacent elements, an fma chain from 0 in element order;
//   block    s_b = the warp butterfly (warp_sum) of the 32 vectors of columns [256 b, 256 b + 256), lane l holding
//                  vector 32 b + l (zero past the row's end);
//   total    S = ((s_0 + s_1) + s_2) + ... in block order.
//
// Every square is >= 0, so zero vectors and zero blocks past the row's end add exactly nothing: a 256-column block
// needs no knowledge of the row's length, and the total needs none of the producer's grid.
#pragma once

#include "layers/common.cuh"

namespace exl2 {
namespace layers {

constexpr int kSsqVec = 8;                       // elements per vector
constexpr int kSsqBlockCols = 32 * kSsqVec;      // 256 columns per block partial (the GEMV's column block)
constexpr int kSsqMaxBlocks = 128;               // rows up to 32768 (rms_norm_kernel's shared array)

// The fma chain of a vector's squares (v: the rounded values as floats).
__device__ __forceinline__ float ssq_vec(const float (&v)[kSsqVec]) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kSsqVec; ++k) s = __fmaf_rn(v[k], v[k], s);
  return s;
}

// The block partial s_b: all 32 lanes call it, lane l with vector 32 b + l's ssq_vec (0 past the row).
__device__ __forceinline__ float ssq_block(float vec_ssq) { return warp_sum(vec_ssq); }

// S from nb block partials p[0], p[stride], ... in block order.
__device__ __forceinline__ float ssq_total(const float* p, int nb, int stride = 1) {
  float s = 0.f;  // 0 + s_0 == s_0
  for (int b = 0; b < nb; ++b) s = __fadd_rn(s, p[b * stride]);
  return s;
}

// 1 / rms of a row of K elements with sum of squares S.
__device__ __forceinline__ float rms_inv(float total, int K, float eps) {
  return rsqrtf(__fadd_rn(__fdiv_rn(total, (float)K), eps));
}

}  // namespace layers
}  // namespace exl2
