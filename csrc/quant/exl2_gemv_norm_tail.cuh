// The next GEMV's input norm at the end of a GEMV launch (kFTail instantiations, GemvParams::tail): o_proj followed
// by the post-attention norm for gate/up, down_proj by the next layer's input norm for q/k/v, in a step of M >= 3
// rows (a k >= 2 verify, or three or more sequences). There the norm ran as its own launch writing the next GEMV's
// stored row order (exl2_gemv_norm_pregather.cu): 65 launches and 305 us of the 8B's k = 4 verify step's critical
// path (H200 call AF3), each paying a launch boundary more than the ~2 us of work it does.
//
// Here the blocks that write the GEMV's final values (one per column block) count in on a global counter once their
// stores are out. The first min(finishers, M x parts) of them to count in are the norm's workers: each waits until
// every finisher has counted in, then runs what a block (m, part) of norm_pregather_kernel runs, for its items
// m + M * part = worker, worker + workers, ...: gv_norm_row (rms_norm_kernel step for step) into its drained ring,
// then the part's stored rows of token m; part 0 also writes the residual stream's row. So the residual stream, the
// next GEMV's input and its output are bit-identical to the GEMV, exl2_add_norm_pregather and the next GEMV.
//
// Waiting blocks cannot deadlock: the host launches a kFTail kernel only when its whole grid is resident at once
// (exl2_gemv_norm_tail.cu), and the dependent kernel's blocks launch only after every block of this one has started.
#pragma once

#include "quant/exl2_gemv_norm.cuh"
#include "quant/exl2_gemv_pregather.cuh"
#include "quant/exl2_gemv_tma.cuh"

namespace exl2q {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
struct ComputeSync {
  __device__ void operator()() const { compute_sync(); }
};

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Called by the compute threads of a block that wrote final output values (tma_finish returned true); its ring is
// drained, and the normalized row (K halves) goes to its start. The ring's address is taken from the dynamic
// shared memory base here, not passed in: a pointer kept live across the chunk loop for this made the kernel spill.
__device__ __noinline__ void gv_norm_tail(const GemvParams& p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __half* xf = reinterpret_cast<__half*>(smem + kBarBytes);  // the ring (TmaSmem::ring)
  const GemvParams::Tail& t = p.tail;
  __shared__ int s_slot;
  __shared__ float red[kGvWarps];
  const int tid = threadIdx.x;
  __threadfence();  // release: this thread's output stores, before the block counts in
  compute_sync();
  if (tid == 0) s_slot = atomicAdd(t.counter, 1);
  compute_sync();
  const int items = p.M * t.pg.nparts, workers = min(t.finishers, items), slot = s_slot;
  if (slot >= workers) return;
  if (tid == 0) {  // acquire: every finisher's stores
    int ns = 32;
    while (ld_acquire_gpu(t.counter) < t.finishers) {
      __nanosleep(ns);
      ns = min(2 * ns, 256);
    }
  }
  compute_sync();
  const QDesc& d = p.d[0];
  const NormRows rows{d.out, t.res, t.w, d.ldo, t.res_ld, d.N, norm_row_threads(d.N), 1, t.eps};
  for (int it = slot; it < items; it += workers) {
    const int m = it % p.M, part = it / p.M;
    // ends with a barrier: xf complete; h read through L2 (other blocks wrote it)
    gv_norm_row<true>(rows, m, xf, red, part == 0 ? t.res_out : nullptr, t.res_out_ld, ComputeSync{});
    for (int r0 = tid * kPregatherRows; r0 < t.pg.kpad[part]; r0 += kTmaComputeThreads * kPregatherRows)
      pregather_rows_from(t.pg, part, m, r0, pregather_index(t.pg, part, r0), xf);
    compute_sync();  // the next item rewrites xf
  }
  // Count out; the last worker re-arms the counter for the next launch (and graph replay).
  if (tid == 0 && atomicAdd(t.counter, 1) == t.finishers + workers - 1) *t.counter = 0;
}
#endif

}  // namespace exl2q
