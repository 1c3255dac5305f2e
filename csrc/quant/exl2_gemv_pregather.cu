// The pregather kernel (exl2_gemv_pregather.cuh): one launch before the GEMV. H200, call G1 of 2026-12-02: the
// in-kernel gather grew the 14336x4096 GEMV by ~3 us per token (15.4 us at M = 1, 27.7 at M = 5): per block 896
// rows x M tokens of scattered 2-byte loads, a 32-byte L2 sector each, 264 blocks.
#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_gemv_pregather.cuh"

using namespace exl2q;

namespace {

constexpr int kThreads = 256;

// grid (ceil(max Kpad / 2048), M, parts): thread -> 8 consecutive stored rows of one token of one part.
__global__ void __launch_bounds__(kThreads) gemv_pregather_kernel(const __grid_constant__ PregatherParams p) {
  const int part = blockIdx.z, m = blockIdx.y;
  const int r0 = (blockIdx.x * kThreads + threadIdx.x) * kPregatherRows;
  const bool live = r0 < p.kpad[part];
  uint4 idx = make_uint4(0, 0, 0, 0);
  if (live) idx = pregather_index(p, part, r0);  // a constant: before the wait
  exl2::pdl_wait_and_trigger();  // x comes from the previous kernel
  if (live) pregather_rows(p, part, m, r0, idx);
}

}  // namespace

int exl2q::pregather_plan(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off, void* xp,
                          int ld, PregatherParams& p) {
  EXL2_REQUIRE(blob && x && xp, "exl2_gemv_pregather: null argument");
  EXL2_REQUIRE(ndesc >= 1 && ndesc <= kMaxDesc, "exl2_gemv_pregather: %d descriptors (1..%d)", ndesc, kMaxDesc);
  EXL2_REQUIRE(M >= 1 && M <= 32 && gate_off >= 0, "exl2_gemv_pregather: M=%d gate_off=%d", M, gate_off);
  EXL2_REQUIRE(ld > 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0,
               "exl2_gemv_pregather: ld %d must be a multiple of 8 and xp 16-byte aligned", ld);
  p = PregatherParams{};
  p.x = reinterpret_cast<const __half*>(x);
  p.ldx = ldx; p.M = M; p.gate_off = gate_off;
  p.xp = reinterpret_cast<__half*>(xp);
  p.ld = ld;
  p.nparts = ndesc;
  for (int i = 0; i < ndesc; ++i) {
    const int64_t* f = blob + (size_t)i * kDescLen;
    p.xmap[i] = reinterpret_cast<const uint16_t*>(f[F_XMAP]);
    p.kpad[i] = (int)f[F_KPAD];
    const int k = (int)f[F_K];
    EXL2_REQUIRE(p.xmap[i] && p.kpad[i] > 0 && p.kpad[i] % kChunkRows == 0 && p.kpad[i] <= ld,
                 "exl2_gemv_pregather: part %d: Kpad %d (ld %d)", i, p.kpad[i], ld);
    EXL2_REQUIRE(ldx >= k + gate_off && (gate_off == 0 || gate_off >= k), "exl2_gemv_pregather: ldx %d, K %d, "
                 "gate_off %d", ldx, k, gate_off);
    p.kmax = p.kmax > p.kpad[i] ? p.kmax : p.kpad[i];
  }
  return EXL2_OK;
}

// blob: the GEMV's descriptors (cuda_quant.py layout; xmap, Kpad and K are read); x [M, ldx] fp16; xp fp16
// [ndesc, M, ld] with ld >= every Kpad, a multiple of 8, 16-byte aligned.
EXL2_API int exl2_gemv_pregather(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off,
                                 void* xp, int ld, void* stream) {
  PregatherParams p;
  const int st = pregather_plan(blob, ndesc, x, M, ldx, gate_off, xp, ld, p);
  if (st) return st;
  const dim3 grid((unsigned)((p.kmax + kThreads * kPregatherRows - 1) / (kThreads * kPregatherRows)), (unsigned)M,
                  (unsigned)ndesc);
  exl2::launch_kernel(gemv_pregather_kernel, grid, dim3(kThreads), 0, reinterpret_cast<cudaStream_t>(stream), p);
  return exl2::check_launch("exl2_gemv_pregather");
}
