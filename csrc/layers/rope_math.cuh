// The RoPE arithmetic shared by rope.cu (apply_rope, rope_kv_write) and kv_quant.cu (the quantizing write with
// rope): the cos/sin table of one token and the rotation of one pair, op for op as reference.apply_rope, so every
// kernel that rotates stores the same bits.
#pragma once

namespace exl2 {
namespace layers {

// cos [half] then sin [half] of float(position) * inv_freq in fp32, evaluated in double and rounded to fp32 (fast
// math would turn sincosf into the approximate __sincosf). Block-strided; the caller synchronizes.
__device__ __forceinline__ void rope_table(float pos, const float* inv_freq, int half, float* cs) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float ang = __fmul_rn(pos, inv_freq[i]);
    double s, c;
    sincos((double)ang, &s, &c);
    cs[i] = (float)c;
    cs[half + i] = (float)s;
  }
}

// The pair (x1, x2) = (x[i], x[i + D/2]) rotated by (co, si): x1 co - x2 si and x2 co + x1 si.
__device__ __forceinline__ float rope_first(float x1, float x2, float co, float si) {
  return __fsub_rn(__fmul_rn(x1, co), __fmul_rn(x2, si));
}
__device__ __forceinline__ float rope_second(float x1, float x2, float co, float si) {
  return __fadd_rn(__fmul_rn(x2, co), __fmul_rn(x1, si));
}

}  // namespace layers
}  // namespace exl2
