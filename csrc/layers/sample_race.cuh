// The exponential race both samplers draw with (sampling.cu, sampling_top_k.cu; ops/reference_sampling.py):
// token = argmax p_i / max(-log(u_i), 2^-25), exp and log evaluated in double and rounded to fp32 (the build's fast
// math would otherwise take approximate intrinsics), divisions IEEE.
#pragma once

namespace exl2 {
namespace layers {

__device__ __forceinline__ float exp_f(float x) { return (float)exp((double)x); }

// race score of probability-like weight p against uniform u: p / max(-log(u), 2^-25), p = 0 -> -1
// (u = 1 gives -log(u) = -0.0, which the clamp turns into 2^-25, as the reference's clamp_min)
__device__ __forceinline__ float race(float p, float u) {
  const float e = fmaxf(-(float)log((double)u), 0x1p-25f);
  return p > 0.f ? __fdiv_rn(p, e) : -1.f;
}

}  // namespace layers
}  // namespace exl2
