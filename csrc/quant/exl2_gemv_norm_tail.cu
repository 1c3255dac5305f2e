// exl2_gemv_norm_tail: a small-M GEMV followed by the next GEMV's input norm in the same launch (the device side and
// why: exl2_gemv_norm_tail.cuh). Where the grid would not be resident all at once the same values come from two
// launches: the GEMV, then exl2_add_norm_pregather.
#include "common/api.h"
#include "quant/exl2_gemv.cuh"
#include "quant/exl2_gemv_norm.cuh"
#include "quant/exl2_gemv_pregather.cuh"

EXL2_API int exl2_add_norm_pregather(const int64_t* blob, int ndesc, const void* h, int M, int ldh,
                                     const void* residual, int res_ld, const void* weight, void* res_out,
                                     int res_out_ld, float eps, void* xp, int ld, void* stream);

// blob: the GEMV's one descriptor (cuda_quant.py layout; its output h = F_OUT [M, F_LDO], N = the hidden size K);
// x [M, ldx] its input (gate_off > 0: silu(gate) * up, as exl2_gemv). Then, as exl2_add_norm_pregather with the
// next GEMV's descriptors next_blob: res_out [M, res_out_ld] = round(h + residual), xp [next_ndesc, M, ld] = each
// next part's input rms_norm(h + residual) * weight in stored row order. counter: one int32, zero before the first
// launch (the kernel leaves it at zero), used by one launch at a time. M 1..16; K a multiple of 8 up to 8192.
EXL2_API int exl2_gemv_norm_tail(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off,
                                 const void* residual, int res_ld, const void* weight, void* res_out, int res_out_ld,
                                 float eps, const int64_t* next_blob, int next_ndesc, void* xp, int ld, int* counter,
                                 void* stream) {
  using namespace exl2q;
  EXL2_REQUIRE(blob && next_blob && counter && residual && res_out, "exl2_gemv_norm_tail: null argument");
  EXL2_REQUIRE(ndesc == 1, "exl2_gemv_norm_tail: one descriptor, got %d", ndesc);
  EXL2_REQUIRE(M >= 1 && M <= 16, "exl2_gemv_norm_tail: M=%d outside 1..16", M);
  EXL2_REQUIRE(!blob[F_ROPE], "exl2_gemv_norm_tail: no fused rope");
  const void* h = reinterpret_cast<const void*>(blob[F_OUT]);
  const int ldh = (int)blob[F_LDO];
  if (const int st = check_norm_args("exl2_gemv_norm_tail", h, ldh, residual, res_ld, weight, res_out, res_out_ld,
                                      eps))
    return st;
  GemvParams p;
  GemvPlan pl;
  if (const int st = gemv_plan(blob, ndesc, x, M, ldx, gate_off, 0, nullptr, 0, nullptr, p, pl)) return st;
  EXL2_REQUIRE(pl.tma && !p.cluster && !p.probe, "exl2_gemv_norm_tail: needs the TMA kernel (sm_90+), no probe");
  const int K = p.d[0].N;
  EXL2_REQUIRE(K % kNormVec == 0 && K <= 8192 && norm_row_threads(K) <= kMaxNormThreads,
               "exl2_gemv_norm_tail: output width %d (a multiple of %d up to 8192)", K, kNormVec);
  EXL2_REQUIRE(p.ring_bytes >= 2 * K, "exl2_gemv_norm_tail: a %d-byte ring holds no row of %d", p.ring_bytes, K);
  for (int i = 0; i < next_ndesc; ++i)
    EXL2_REQUIRE((int)next_blob[(size_t)i * kDescLen + F_K] == K, "exl2_gemv_norm_tail: next part %d takes K=%d, "
                 "the output has %d", i, (int)next_blob[(size_t)i * kDescLen + F_K], K);
  if (const int st = pregather_plan(next_blob, next_ndesc, h, M, ldh, 0, xp, ld, p.tail.pg)) return st;
  p.tail.counter = counter;
  p.tail.finishers = p.d[0].ncolblk;  // a column block's last split, or its only block
  p.tail.res = reinterpret_cast<const __half*>(residual);
  p.tail.w = reinterpret_cast<const __half*>(weight);
  p.tail.res_out = reinterpret_cast<__half*>(res_out);
  p.tail.res_ld = res_ld;
  p.tail.res_out_ld = res_out_ld;
  p.tail.eps = eps;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  bool launched = false;
  if (const int st = gemv_tma_launch_tail(p, pl.blocks, pl.smem, s, &launched)) return st;
  if (launched) return EXL2_OK;
  p.tail = GemvParams::Tail{};
  if (const int st = gemv_tma_launch(p, pl.blocks, pl.smem, s)) return st;
  return exl2_add_norm_pregather(next_blob, next_ndesc, h, M, ldh, residual, res_ld, weight, res_out, res_out_ld, eps,
                                 xp, ld, stream);
}
