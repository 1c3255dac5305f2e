// Activations of the small-M GEMV gathered once per launch into each part's stored row order (its act-order
// permutation, padding rows zero), xp[(part * M + m) * ld + r], so that every GEMV block copies its split's rows
// with 16-byte loads (GemvParams::xpre) instead of gathering them two bytes at a time. H200, call G1 of
// 2026-12-02: the in-kernel gather grew the 14336x4096 GEMV by ~3 us per token (15.4 us at M = 1, 27.7 at M = 5):
// per block 896 rows x M tokens of scattered 2-byte loads, a 32-byte L2 sector each, 264 blocks.
#include <cuda_fp16.h>

#include "common/activation.cuh"
#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_quant.cuh"

using namespace exl2q;

namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 8;  // one 16-byte xmap load and one 16-byte store

struct PregatherParams {
  const __half* x;  // [M, ldx]
  int ldx, M, gate_off;  // gate_off > 0: input = silu(x[:, i]) * x[:, gate_off + i] (the fused MLP's silu_mul)
  const uint16_t* xmap[kMaxDesc];  // [Kpad] per part (0xFFFF = padding row)
  int kpad[kMaxDesc];
  __half* xp;  // [parts, M, ld]
  int ld;
};

// grid (ceil(max Kpad / 2048), M, parts): thread -> 8 consecutive stored rows of one token of one part.
__global__ void __launch_bounds__(kThreads) gemv_pregather_kernel(const __grid_constant__ PregatherParams p) {
  const int part = blockIdx.z, m = blockIdx.y;
  const int r0 = (blockIdx.x * kThreads + threadIdx.x) * kRowsPerThread;
  const bool live = r0 < p.kpad[part];
  uint4 idx = make_uint4(0, 0, 0, 0);
  if (live) idx = __ldg(reinterpret_cast<const uint4*>(p.xmap[part] + r0));  // a constant: before the wait
  exl2::pdl_wait_and_trigger();  // x comes from the previous kernel
  if (!live) return;
  const unsigned short* iv = reinterpret_cast<const unsigned short*>(&idx);
  const __half* xr = p.x + (size_t)m * p.ldx;
  __align__(16) __half v[kRowsPerThread];
  if (p.gate_off > 0) {
    __half g[kRowsPerThread], u[kRowsPerThread];
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const bool ok = iv[k] != 0xFFFFu;
      g[k] = ok ? __ldg(xr + iv[k]) : __half(0.f);
      u[k] = ok ? __ldg(xr + p.gate_off + iv[k]) : __half(0.f);
    }
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k)
      v[k] = __float2half_rn(exl2::silu_mul(__half2float(g[k]), __half2float(u[k])));
  } else {
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) v[k] = iv[k] != 0xFFFFu ? __ldg(xr + iv[k]) : __half(0.f);
  }
  *reinterpret_cast<uint4*>(p.xp + ((size_t)part * p.M + m) * p.ld + r0) = *reinterpret_cast<const uint4*>(v);
}

}  // namespace

// blob: the GEMV's descriptors (cuda_quant.py layout; xmap, Kpad and K are read); x [M, ldx] fp16; xp fp16
// [ndesc, M, ld] with ld >= every Kpad, a multiple of 8, 16-byte aligned.
EXL2_API int exl2_gemv_pregather(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off,
                                 void* xp, int ld, void* stream) {
  EXL2_REQUIRE(blob && x && xp, "exl2_gemv_pregather: null argument");
  EXL2_REQUIRE(ndesc >= 1 && ndesc <= kMaxDesc, "exl2_gemv_pregather: %d descriptors (1..%d)", ndesc, kMaxDesc);
  EXL2_REQUIRE(M >= 1 && M <= 32 && gate_off >= 0, "exl2_gemv_pregather: M=%d gate_off=%d", M, gate_off);
  EXL2_REQUIRE(ld > 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0,
               "exl2_gemv_pregather: ld %d must be a multiple of 8 and xp 16-byte aligned", ld);
  PregatherParams p{};
  p.x = reinterpret_cast<const __half*>(x);
  p.ldx = ldx; p.M = M; p.gate_off = gate_off;
  p.xp = reinterpret_cast<__half*>(xp);
  p.ld = ld;
  int kmax = 0;
  for (int i = 0; i < ndesc; ++i) {
    const int64_t* f = blob + (size_t)i * kDescLen;
    p.xmap[i] = reinterpret_cast<const uint16_t*>(f[F_XMAP]);
    p.kpad[i] = (int)f[F_KPAD];
    const int k = (int)f[F_K];
    EXL2_REQUIRE(p.xmap[i] && p.kpad[i] > 0 && p.kpad[i] % kChunkRows == 0 && p.kpad[i] <= ld,
                 "exl2_gemv_pregather: part %d: Kpad %d (ld %d)", i, p.kpad[i], ld);
    EXL2_REQUIRE(ldx >= k + gate_off && (gate_off == 0 || gate_off >= k), "exl2_gemv_pregather: ldx %d, K %d, "
                 "gate_off %d", ldx, k, gate_off);
    kmax = kmax > p.kpad[i] ? kmax : p.kpad[i];
  }
  const dim3 grid((unsigned)((kmax + kThreads * kRowsPerThread - 1) / (kThreads * kRowsPerThread)), (unsigned)M,
                  (unsigned)ndesc);
  exl2::launch_kernel(gemv_pregather_kernel, grid, dim3(kThreads), 0, reinterpret_cast<cudaStream_t>(stream), p);
  return exl2::check_launch("exl2_gemv_pregather");
}
