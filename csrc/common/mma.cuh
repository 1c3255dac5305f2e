// One warp-level tensor-core product, D = A B + D with fp16 inputs and fp32 accumulation (mma.sync, sm_80+), as
// the EXL2 GEMV / GEMM kernels and the quantized-cache attention kernel use it. Fragment layout per lane
// (gid = lane / 4, t4 = lane % 4): a0 = A[gid][2t4, 2t4+1], a1 = A[gid+8][2t4, 2t4+1], a2 = A[gid][2t4+8, 2t4+9],
// a3 = A[gid+8][2t4+8, 2t4+9]; b0 = B[2t4, 2t4+1][gid], b1 = B[2t4+8, 2t4+9][gid]; c0, c1 = C[gid][2t4, 2t4+1],
// c2, c3 = C[gid+8][2t4, 2t4+1]. Each register holds two halves, the lower index in the low 16 bits.
#pragma once

#include <stdint.h>

namespace exl2 {

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace exl2
