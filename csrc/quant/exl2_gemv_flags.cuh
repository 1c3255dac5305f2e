// Ready flags between two GEMV launches of a decode layer (gate/up -> down): the consumer's blocks start on the
// columns they read instead of the producer's whole grid.
//
// With PDL each GEMV's blocks wait (griddepcontrol.wait) until the previous grid has finished and flushed. down_proj
// reads gate/up's output, but each of its blocks only a K-slice of it: a few 256-column blocks of gate and of up.
// As a flag pair, the producer's block that writes a column block's final values publishes flags[colblk] = 1
// (release, gpu scope), and a consumer block polls the flags of the column blocks its rows come from (acquire)
// instead of the PDL wait. Its split streams while the producer's slowest column blocks still finish.
//
// The protocol. Flags live in one int32 buffer that is zero between pairs: producer column block j of the input
// is flag j (the host aligns each part's columns to 256), then one count-in int. Every consumer block counts in
// once its own wait is over; the last one waits for every flag (a column block no consumer reads may still be
// finishing) and clears the flags and the count. The next pair's producer only sets flags after its own PDL wait,
// and every kernel between two pairs waits for its predecessor before it completes, so it sets them after this
// consumer's grid has completed. Both launches come from one host call (ops/cuda_mlp_pair.py), never one alone.
// A consumer that polls ~4 s in vain traps (a broken pairing would otherwise hang the device).
#pragma once

#include <climits>

#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr long long kFlagSpinLimit = 1ll << 22;  // polls of ~1 us each

__device__ __forceinline__ int ld_acquire_gpu(const int* f) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* f, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(f), "r"(v) : "memory");
}
__device__ __forceinline__ void spin_until_ready(const int* f) {
  for (long long i = 0; ld_acquire_gpu(f) == 0; ++i) {
    if (i > kFlagSpinLimit) __trap();
    __nanosleep(64);
  }
}

// Producer, every compute thread after its stores of the column block's final values: flags[colblk] = 1 once all
// of them are visible at gpu scope (each thread's fence, the barrier, thread 0's release).
template <typename Sync>
__device__ __forceinline__ void gv_flag_ready(const QDesc& d, int colblk, Sync&& sync) {
  __threadfence();
  sync();
  if (threadIdx.x == 0) st_release_gpu(d.flags + colblk, 1);
}

// Consumer, the `nthreads` compute threads in place of the PDL wait (xm: the split's `rows` input indices in shared
// memory, 0xFFFF for padding; range: two ints of shared memory): waits for the flags of the input columns the split
// reads, those of gate [lo, hi] and, with gate_off, of up [gate_off + lo, gate_off + hi]. Thread 0 then counts the
// block in (gv_flags_count_in). Ends synchronized.
template <typename Sync>
__device__ __forceinline__ void gv_wait_input_flags(const GemvParams& p, const unsigned short* xm, int rows,
                                                    int nthreads, int* range, Sync&& sync) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    range[0] = INT_MAX;
    range[1] = -1;
  }
  sync();
  int lo = INT_MAX, hi = -1;
  for (int r = tid; r < rows; r += nthreads) {
    const int i = xm[r];
    if (i != 0xFFFF) {
      lo = min(lo, i);
      hi = max(hi, i);
    }
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if ((tid & 31) == 0) {
    atomicMin(range, lo);
    atomicMax(range + 1, hi);
  }
  sync();
  lo = range[0];
  hi = range[1];
  if (hi >= 0) {
    const int g0 = lo >> 8, ng = (hi >> 8) - g0 + 1;
    const int u0 = (p.gate_off + lo) >> 8, nu = p.gate_off > 0 ? ((p.gate_off + hi) >> 8) - u0 + 1 : 0;
    for (int t = tid; t < ng + nu; t += nthreads) spin_until_ready(p.wait_flags + (t < ng ? g0 + t : u0 + t - ng));
  }
  sync();
}

// Consumer, thread 0 once its block has waited: count in; the grid's last block clears the flags and the count.
__device__ __forceinline__ void gv_flags_count_in(const GemvParams& p) {
  int* count = p.wait_flags + p.wait_nflags;
  int prev;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(prev) : "l"(count), "r"(1) : "memory");
  if (prev != (int)gridDim.x - 1) return;
  for (int f = 0; f < p.wait_nflags; ++f) spin_until_ready(p.wait_flags + f);
  for (int f = 0; f < p.wait_nflags; ++f) p.wait_flags[f] = 0;
  *count = 0;
}

}  // namespace exl2q
