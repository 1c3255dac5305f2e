// Activations shared by kernels that must agree bit for bit.
#pragma once

#include <cuda_runtime.h>

namespace exl2 {

// silu(g) * u in fp32, rounded like torch's F.silu(g.float()) * u.float(): silu_mul_kernel and the GEMV input
// gathers of the fused MLP (in-kernel and pre-gathered) compute the down projection's input with this one.
__device__ __forceinline__ float silu_mul(float g, float u) {
  const float s = __fdiv_rn(g, __fadd_rn(1.f, __expf(-g)));
  return __fmul_rn(s, u);
}

}  // namespace exl2
