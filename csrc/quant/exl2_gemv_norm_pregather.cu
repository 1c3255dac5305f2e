// add_rms_norm whose normalized rows go straight into each GEMV part's stored row order: the add_rms_norm and
// pregather launches before a small-M GEMV as one. The norm-fused GEMV (exl2_gemv_norm.cuh) takes the rows that fit
// one pass of its 256 compute threads (M <= 2 at K = 4096); past that every one of its blocks would normalize all M
// rows again (H200 call Q1 of 2026-12-02: three passes took the 8B's k = 4 verify from 1.21x to 1.39x a decode
// step), so a verify step ran add_rms_norm, then the pregather kernel (or the GEMV's scattered two-byte gather),
// then the GEMV. Here one launch normalizes and scatters, and the GEMV copies its rows with 16-byte loads
// (GemvParams::xpre).
//
// Grid (M, parts): block (m, part) normalizes row m into shared memory with the norm-fused GEMV's arithmetic
// (gv_norm_rows, one row: rms_norm_kernel step for step), then writes the part's stored rows of token m
// (pregather_rows_from, the chain kernel's norm phase). The blocks of part 0 also write the residual stream's row.
// So the GEMV input, the residual stream and the GEMV output are bit-identical to add_rms_norm + pregather + GEMV.
#include "common/api.h"
#include "common/pdl.cuh"
#include "layers/common.cuh"
#include "quant/exl2_gemv_norm.cuh"
#include "quant/exl2_gemv_pregather.cuh"

using namespace exl2q;

namespace {

constexpr int kThreads = kMaxNormThreads;  // 256: gv_norm_rows's thread layout for one row of K <= 8192
constexpr int kMaxK = 8192;

struct NormPregatherParams {
  NormRows norm;       // h [M, ldx] (+ residual), weight [K]; block (m, part) normalizes row m
  __half* res_out;     // [M, res_out_ld] or null
  int res_out_ld;
  PregatherParams pg;  // xmap, Kpad per part; xp [parts, M, ld]
};

struct BlockSync {
  __device__ void operator()() const { __syncthreads(); }
};

// A thread's stored-row groups of a part: rows r_first + i * kThreads * kPregatherRows, i < kIdxSlots (Kpad <=
// kMaxK plus one group's padding).
constexpr int kIdxSlots = kMaxK / (kThreads * kPregatherRows) + 1;

__global__ void __launch_bounds__(kThreads) norm_pregather_kernel(const __grid_constant__ NormPregatherParams p) {
  __shared__ __align__(16) __half xf[kMaxK];  // row m, normalized, natural order
  __shared__ float red[kThreads / 32];
  const int m = blockIdx.x, part = blockIdx.y;
  const int r_first = threadIdx.x * kPregatherRows, kpad = p.pg.kpad[part];
  // Every xmap entry this thread scatters: constants, all loaded before the wait. (Loaded group by group after
  // the norm, the second group's load was one more L2 round trip on the verify step's critical path, once per
  // norm launch.)
  uint4 idx[kIdxSlots];
#pragma unroll
  for (int i = 0; i < kIdxSlots; ++i) {
    const int r0 = r_first + i * kThreads * kPregatherRows;
    if (r0 < kpad) idx[i] = pregather_index(p.pg, part, r0);
  }
  exl2::pdl_wait_and_trigger();  // h and the residual come from the previous kernel
  // part 0's blocks write the residual stream; ends with a barrier: xf complete
  gv_norm_row(p.norm, m, xf, red, part == 0 ? p.res_out : nullptr, p.res_out_ld, BlockSync{});
#pragma unroll
  for (int i = 0; i < kIdxSlots; ++i) {
    const int r0 = r_first + i * kThreads * kPregatherRows;
    if (r0 < kpad) pregather_rows_from(p.pg, part, m, r0, idx[i], xf);
  }
}

}  // namespace

// blob: the GEMV's descriptors (cuda_quant.py layout; xmap, Kpad and K are read, every part of one K); h [M, ldh]
// fp16; residual [M, res_ld] or null (input rms_norm(h)); weight fp16 [K]; res_out [M, res_out_ld] receives
// round(h + residual) (null: not written; it must not alias h or residual, which the other parts' blocks still
// read); xp fp16 [ndesc, M, ld] (ld >= every Kpad, a multiple of 8, 16-byte aligned) receives each part's input in
// stored row order, for exl2_gemv's xpre. Rows 16-byte aligned, K a multiple of 8 up to 8192, M up to 32.
EXL2_API int exl2_add_norm_pregather(const int64_t* blob, int ndesc, const void* h, int M, int ldh,
                                     const void* residual, int res_ld, const void* weight, void* res_out,
                                     int res_out_ld, float eps, void* xp, int ld, void* stream) {
  if (const int st = check_norm_args("exl2_add_norm_pregather", h, ldh, residual, res_ld, weight, res_out,
                                      res_out_ld, eps))
    return st;
  NormPregatherParams p{};
  const int st = pregather_plan(blob, ndesc, h, M, ldh, 0, xp, ld, p.pg);
  if (st) return st;
  const int K = (int)blob[F_K];
  for (int i = 1; i < ndesc; ++i)
    EXL2_REQUIRE((int)blob[(size_t)i * kDescLen + F_K] == K, "exl2_add_norm_pregather: parts of different K");
  EXL2_REQUIRE(K % kNormVec == 0 && K <= kMaxK && norm_row_threads(K) <= kThreads,
               "exl2_add_norm_pregather: K=%d (a multiple of %d up to %d)", K, kNormVec, kMaxK);
  EXL2_REQUIRE(p.pg.kmax <= kIdxSlots * kThreads * kPregatherRows,
               "exl2_add_norm_pregather: Kpad %d past the kernel's %d stored rows", p.pg.kmax,
               kIdxSlots * kThreads * kPregatherRows);
  p.norm = NormRows{reinterpret_cast<const __half*>(h), reinterpret_cast<const __half*>(residual),
                    reinterpret_cast<const __half*>(weight), ldh, res_ld, K, norm_row_threads(K), 1, eps};
  p.res_out = reinterpret_cast<__half*>(res_out);
  p.res_out_ld = res_out_ld;
  exl2::launch_kernel(norm_pregather_kernel, dim3((unsigned)M, (unsigned)ndesc), dim3(kThreads), 0,
                      reinterpret_cast<cudaStream_t>(stream), p);
  return exl2::check_launch("exl2_add_norm_pregather");
}
