// The next GEMV's input norm as the tail of the GEMV that produces it (GemvParams::tail_cnt; kFTail).
//
// A verify step (M = 3..8 rows at hidden 4096) cannot normalize inside the consuming GEMV in one pass, so o and down
// were each followed by exl2_add_norm_pregather (normalize, write the residual stream and the consumer's stored row
// order) and only then the consumer: one launch boundary more per norm. H100 call BH1 of 2026-12-06 (spec_bench, 8B
// at 1k) measured the verify step without those launches (results wrong): k = 4 1.146 / 1.141 of a decode step
// against 1.245 / 1.263, 3.7 us per launch. Here the producing GEMV does that work itself: every block, once past
// its split-K finish, takes a ticket; the last `jobs` blocks to arrive wait until every block has arrived (each
// waits only for blocks that already run: all the others are done) and then each normalizes its rows of the
// output with gv_norm_rows (one pass, the norm kernel's threads per row: the same arithmetic) and scatters them
// into each consumer part's stored row order (pregather_rows_from). So the residual stream, the consumer's input
// and its output are bit-identical to GEMV + exl2_add_norm_pregather + GEMV. The last job re-arms the two words.
#pragma once

#include "quant/exl2_gemv.cuh"
#include "quant/exl2_gemv_norm.cuh"
#include "quant/exl2_gemv_pregather.cuh"

namespace exl2q {

// Rows of hidden size K one tail job normalizes: one pass of gv_norm_rows.
__host__ __device__ inline int tail_rows_per_job(int K) { return kMaxNormThreads / norm_row_threads(K); }

// Host: the tail's arguments (exl2_gemv_tail): the norm (residual [M, res_ld] or null, weight [N], res_out
// [M, res_out_ld] or null: not written), the consumer's descriptors and its input buffer xp [c_ndesc, M, ld], cnt [2].
struct GemvTail {
  int* cnt;
  GemvNorm norm;
  const int64_t* c_blob;
  int c_ndesc;
  void* xp;
  int ld;
};

// Host: checks the tail against the planned launch p (TMA, `blocks` blocks) and sets it in p.
inline int plan_tail(const GemvTail& t, int blocks, GemvParams& p) {
  EXL2_REQUIRE(!p.cluster && !p.probe && !p.rope_d && !p.norm_nt, "exl2_gemv_tail: no cluster split-K, probe, "
               "fused rope or fused norm in the producing launch");
  EXL2_REQUIRE(p.ndesc == 1 && p.M <= 8, "exl2_gemv_tail: one part and M <= 8 (got %d parts, M=%d)", p.ndesc, p.M);
  EXL2_REQUIRE(t.cnt && reinterpret_cast<uintptr_t>(t.cnt) % 4 == 0, "exl2_gemv_tail: null or misaligned counters");
  const QDesc& d = p.d[0];
  const GemvNorm& n = t.norm;
  if (const int st = check_norm_args("exl2_gemv_tail", d.out, d.ldo, n.res, n.res_ld, n.w, n.res_out, n.res_out_ld,
                                     n.eps))
    return st;
  const int K = d.N;
  EXL2_REQUIRE(K % kNormVec == 0 && norm_row_threads(K) <= kMaxNormThreads, "exl2_gemv_tail: N=%d must be a "
               "multiple of %d and at most %d", K, kNormVec, kMaxNormThreads * kNormVec * kNormMaxVecs);
  const int per = tail_rows_per_job(K), jobs = (p.M + per - 1) / per;
  EXL2_REQUIRE(p.ring_bytes >= per * K * 2, "exl2_gemv_tail: %d normalized rows of %d do not fit the %d-byte ring",
               per, K, p.ring_bytes);
  EXL2_REQUIRE(blocks >= jobs, "exl2_gemv_tail: %d blocks for %d jobs", blocks, jobs);
  if (const int st = pregather_plan(t.c_blob, t.c_ndesc, d.out, p.M, d.ldo, 0, t.xp, t.ld, p.tail_pg)) return st;
  for (int i = 0; i < t.c_ndesc; ++i)
    EXL2_REQUIRE((int)t.c_blob[(size_t)i * kDescLen + F_K] == K, "exl2_gemv_tail: consumer part %d takes K=%d, the "
                 "producer writes N=%d", i, (int)t.c_blob[(size_t)i * kDescLen + F_K], K);
  p.tail_cnt = t.cnt;
  p.tail_res = reinterpret_cast<const __half*>(n.res);
  p.tail_w = reinterpret_cast<const __half*>(n.w);
  p.tail_res_out = reinterpret_cast<__half*>(n.res_out);
  p.tail_res_ld = n.res_ld;
  p.tail_res_out_ld = n.res_out_ld;
  p.tail_nt = norm_row_threads(K);
  p.tail_eps = n.eps;
  return EXL2_OK;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ int ld_acquire_gpu(const int* a) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  return v;
}

// The kMaxNormThreads compute threads, after the block's finish (tma_finish); `sync` is their barrier. `ring` (the
// drained weight ring, >= one job's rows: plan_tail) holds the job's normalized rows.
template <typename Sync>
__device__ __forceinline__ void tma_norm_tail(const GemvParams& p, unsigned char* ring, Sync&& sync) {
  __shared__ int s_job;
  __shared__ float red[kGvWarps];
  const int tid = threadIdx.x;
  const QDesc& d = p.d[0];
  const int K = d.N, per = kMaxNormThreads / p.tail_nt, jobs = (p.M + per - 1) / per;
  sync();  // this block's output stores (the finish's too) come before its ticket
  if (tid == 0) {
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(prev) : "l"(p.tail_cnt), "r"(1) : "memory");
    const int job = prev - ((int)gridDim.x - jobs);
    if (job >= 0)
      while (ld_acquire_gpu(p.tail_cnt) < (int)gridDim.x) __nanosleep(32);
    s_job = job;
  }
  sync();
  const int job = s_job;
  if (job < 0) return;
  const int m0 = job * per, rows = min(per, p.M - m0);
  const NormRows n{d.out + (size_t)m0 * d.ldo, p.tail_res ? p.tail_res + (size_t)m0 * p.tail_res_ld : nullptr,
                   p.tail_w, d.ldo, p.tail_res_ld, K, p.tail_nt, rows, p.tail_eps};
  __half* xf = reinterpret_cast<__half*>(ring);  // [rows][K]
  gv_norm_rows(n, xf, red, p.tail_res_out ? p.tail_res_out + (size_t)m0 * p.tail_res_out_ld : nullptr,
               p.tail_res_out_ld, sync);  // ends with a barrier: xf complete
  const PregatherParams& pg = p.tail_pg;
  for (int part = 0; part < pg.nparts; ++part)
    for (int r0 = tid * kPregatherRows; r0 < pg.kpad[part]; r0 += kMaxNormThreads * kPregatherRows) {
      const uint4 idx = pregather_index(pg, part, r0);
      for (int i = 0; i < rows; ++i) pregather_rows_from(pg, part, m0 + i, r0, idx, xf + (size_t)i * K);
    }
  if (tid == 0) {  // every job has passed its wait once the last one gets here: the words can be re-armed
    int prev;
    asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;" : "=r"(prev) : "l"(p.tail_cnt + 1), "r"(1)
                 : "memory");
    if (prev == jobs - 1) {
      atomicExch(p.tail_cnt, 0);
      atomicExch(p.tail_cnt + 1, 0);
    }
  }
}
#endif

}  // namespace exl2q
