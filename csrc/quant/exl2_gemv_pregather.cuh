// Activations of the small-M GEMV gathered into each part's stored row order (its act-order permutation, padding
// rows zero), xp[(part * M + m) * ld + r], so that every GEMV block copies its split's rows with 16-byte loads
// (GemvParams::xpre) instead of gathering them two bytes at a time. Used by the pregather kernel
// (exl2_gemv_pregather.cu) and by the chain kernel's pregather and norm phases (exl2_gemv_chain.cu).
#pragma once

#include <cuda_fp16.h>

#include "common/activation.cuh"
#include "quant/exl2_quant.cuh"

namespace exl2q {

constexpr int kPregatherRows = 8;  // stored rows per thread: one 16-byte xmap load and one 16-byte store

struct PregatherParams {
  const __half* x;  // [M, ldx]
  int ldx, M, gate_off;  // gate_off > 0: input = silu(x[:, i]) * x[:, gate_off + i] (the fused MLP's silu_mul)
  const uint16_t* xmap[kMaxDesc];  // [Kpad] per part (0xFFFF = padding row)
  int kpad[kMaxDesc];
  int nparts, kmax;
  __half* xp;  // [parts, M, ld]
  int ld;
};

// The xmap entries of stored rows r0 .. r0 + 7 of `part` (a constant: may be loaded before the PDL wait).
__device__ __forceinline__ uint4 pregather_index(const PregatherParams& p, int part, int r0) {
  return __ldg(reinterpret_cast<const uint4*>(p.xmap[part] + r0));
}

// Stored rows r0 .. r0 + 7 of token m of `part` from p.x (xmap entries idx) into p.xp, one 16-byte store.
__device__ __forceinline__ void pregather_rows(const PregatherParams& p, int part, int m, int r0, uint4 idx) {
  const unsigned short* iv = reinterpret_cast<const unsigned short*>(&idx);
  const __half* xr = p.x + (size_t)m * p.ldx;
  __align__(16) __half v[kPregatherRows];
  if (p.gate_off > 0) {
    __half g[kPregatherRows], u[kPregatherRows];
#pragma unroll
    for (int k = 0; k < kPregatherRows; ++k) {
      const bool ok = iv[k] != 0xFFFFu;
      g[k] = ok ? __ldg(xr + iv[k]) : __half(0.f);
      u[k] = ok ? __ldg(xr + p.gate_off + iv[k]) : __half(0.f);
    }
#pragma unroll
    for (int k = 0; k < kPregatherRows; ++k)
      v[k] = __float2half_rn(exl2::silu_mul(__half2float(g[k]), __half2float(u[k])));
  } else {
#pragma unroll
    for (int k = 0; k < kPregatherRows; ++k) v[k] = iv[k] != 0xFFFFu ? __ldg(xr + iv[k]) : __half(0.f);
  }
  *reinterpret_cast<uint4*>(p.xp + ((size_t)part * p.M + m) * p.ld + r0) = *reinterpret_cast<const uint4*>(v);
}

// Stored rows r0 .. r0 + 7 of `part` (xmap entries idx) from one normalized row in shared memory (xf[K], natural
// order) into row m of p.xp (the chain's norm phase and the pre-gathering norm: the same values the pregather of
// add_rms_norm's output writes).
__device__ __forceinline__ void pregather_rows_from(const PregatherParams& p, int part, int m, int r0, uint4 idx,
                                                    const __half* xf) {
  const unsigned short* iv = reinterpret_cast<const unsigned short*>(&idx);
  __align__(16) __half v[kPregatherRows];
#pragma unroll
  for (int k = 0; k < kPregatherRows; ++k) v[k] = iv[k] != 0xFFFFu ? xf[iv[k]] : __half(0.f);
  *reinterpret_cast<uint4*>(p.xp + ((size_t)part * p.M + m) * p.ld + r0) = *reinterpret_cast<const uint4*>(v);
}

// Checks and fills p for the descriptors `blob` (xmap, Kpad and K are read), x [M, ldx], xp [ndesc, M, ld] with ld
// >= every Kpad, a multiple of 8, 16-byte aligned. Returns a status (exl2_gemv_pregather.cu).
int pregather_plan(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off, void* xp, int ld,
                   PregatherParams& p);

}  // namespace exl2q
