// The TMA-ring GEMV's steps (sm_90+), shared by the one-launch kernel (exl2_gemv_tma.cu) and the persistent
// chain kernel that runs several dependent GEMVs in one launch (exl2_gemv_chain.cu). The design is described at
// the top of exl2_gemv_tma.cu; this header holds:
// - the mbarrier and bulk-copy wrappers;
// - the shared-memory layout (TmaLayout: byte offsets, TmaSmem: pointers and barrier addresses);
// - the producer warp's work for one block (tma_produce: first fill, L2 prefetch, staged scales, the ring loop);
// - the compute warps' steps: constants (tma_load_constants), the input (tma_stage_input), the chunk loop
//   (tma_chunks) and the split-K store, ticket and reduce (tma_finish).
#pragma once

#include <type_traits>

#include "common/api.h"
#include "common/bulk_copy.cuh"
#include "common/pdl.cuh"
#include "quant/exl2_gemv.cuh"
#include "quant/exl2_gemv_norm.cuh"
#include "quant/exl2_gemv_rope.cuh"

namespace exl2q {

// Host: per-device kernel attributes are kept for the first kMaxDevices devices.
constexpr int kMaxDevices = 64;

// Host: the current device's index (0 when unknown or out of range).
inline int current_device_slot() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    dev = 0;
  }
  return dev;
}

// Host: raises `kernel`'s dynamic shared memory limit to `smem` when it grows past `set` (this device's value so
// far), asking for the whole carveout as shared memory the first time. `what` names the op in the error.
template <typename Kernel>
int raise_smem_limit(Kernel kernel, int smem, int& set, const char* what) {
  if (smem <= set) return EXL2_OK;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess)
    return exl2::set_error((int)err, "%s: %d bytes of shared memory: %s", what, smem, cudaGetErrorString(err));
  if (set == 0 && cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
    (void)cudaGetLastError();  // a hint only
  set = smem;
  return EXL2_OK;
}

constexpr int kTmaMaxStages = 32;
constexpr int kTmaComputeThreads = kGvWarps * 32;
constexpr int kTmaThreads = kTmaComputeThreads + 32;  // + the producer warp
// mbarriers: full[kTmaMaxStages], empty[kTmaMaxStages], scales, and the chain kernel's ready / done / go
// hand-offs between the producer and the compute warps.
constexpr int kBarScale = 2 * kTmaMaxStages, kBarReady = kBarScale + 1, kBarDone = kBarScale + 2,
              kBarGo = kBarScale + 3;
// The ring starts on a 128-byte boundary after the barriers (byte 640): session 46's call BL2 on one H100 measured the
// 8B decode step at 2.294 ms with it, 2.322 at byte 544 (32-byte aligned) and 2.482 at byte 560 (16-byte aligned).
constexpr int kBarBytes = ((2 * kTmaMaxStages + 4) * 8 + 127) & ~127;
constexpr int kGroupScaleBytes = kGvWarps * 8 * 8;  // one group's scales of the block: [8 warps][8 gid] uint2
// The ring's slots (2,048 x B bytes) and the staged scales after it keep the ring's line alignment (BL2, above).
static_assert(kBarBytes % 128 == 0 && (kGvWarps * 256) % 128 == 0 && kGroupScaleBytes % 128 == 0,
              "bulk-copy destinations of the GEMV ring and its scales must start on 128-byte lines");

__host__ __device__ inline int align16(int x) { return (x + 15) & ~15; }

// Byte offsets of the regions after the barriers and the ring (which starts at kBarBytes):
// [barriers][ring][scales: maxgrp x 8 warps x 8 gid uint2][x: M x xstride halves][xmap slice: maxnch x 64]
// [chunk info: maxnch ints][fused norm: kGvWarps partial sums][fused norm: M x norm_k normalized halves]
struct TmaLayout {
  int scl, xs, xm, info, red, xf, total;
};

struct TmaSizes {  // the bytes of each region for one launch's parameters
  int ring, scl, xs, xm, info, norm_red, norm_xf;
};

__host__ __device__ inline TmaSizes tma_sizes(int ring_bytes, int maxgrp, int M, int xstride, int maxnch, int norm_k) {
  return {ring_bytes, maxgrp * kGroupScaleBytes, align16(M * xstride * 2), maxnch * kChunkRows * 2,
          align16(maxnch * 4), norm_k ? kGvWarps * 4 : 0, norm_k ? align16(M * norm_k * 2) : 0};
}

__host__ __device__ inline TmaLayout tma_layout(const TmaSizes& z) {
  TmaLayout l;
  l.scl = kBarBytes + z.ring;
  l.xs = l.scl + z.scl;
  l.xm = l.xs + z.xs;
  l.info = l.xm + z.xm;
  l.red = l.info + z.info;
  l.xf = l.red + z.norm_red;
  l.total = l.xf + z.norm_xf;
  return l;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using exl2::bulk_copy;
using exl2::evict_first_policy;
using exl2::mbar_arrive;
using exl2::mbar_expect_tx;
using exl2::mbar_init;
using exl2::mbar_inval;
using exl2::mbar_try_wait;
using exl2::mbar_wait;
using exl2::smem_addr;

__device__ __forceinline__ void compute_sync() {  // the compute warps only (named barrier 1)
  asm volatile("bar.sync 1, %0;" ::"n"(kTmaComputeThreads) : "memory");
}

// Pointers and barrier addresses of one block's shared memory under layout `l`.
struct TmaSmem {
  uint32_t bar0;
  unsigned char* ring;
  uint2* scl;
  __half* xs;
  unsigned short* xm;
  int* info;
  float* red;
  __half* xf;
  __device__ TmaSmem(unsigned char* smem, const TmaLayout& l)
      : bar0(smem_addr(smem)), ring(smem + kBarBytes), scl(reinterpret_cast<uint2*>(smem + l.scl)),
        xs(reinterpret_cast<__half*>(smem + l.xs)), xm(reinterpret_cast<unsigned short*>(smem + l.xm)),
        info(reinterpret_cast<int*>(smem + l.info)), red(reinterpret_cast<float*>(smem + l.red)),
        xf(reinterpret_cast<__half*>(smem + l.xf)) {}
  __device__ uint32_t full(int s) const { return bar0 + 8 * s; }
  __device__ uint32_t empty(int s) const { return bar0 + 8 * (kTmaMaxStages + s); }
  __device__ uint32_t scale() const { return bar0 + 8 * kBarScale; }
  __device__ uint32_t ready() const { return bar0 + 8 * kBarReady; }
  __device__ uint32_t done() const { return bar0 + 8 * kBarDone; }
  __device__ uint32_t go() const { return bar0 + 8 * kBarGo; }
};

// One block's geometry for work item `wk`: its column block's warp tiles and chunk range.
struct TmaGeom {
  int J, j0, nwa, c0, nch;
};
__device__ __forceinline__ TmaGeom tma_geom(const QDesc& d, const GvWork& wk) {
  const int J = d.Np / kWarpCols, j0 = wk.colblk * kGvWarps;
  return {J, j0, min(kGvWarps, J - j0), wk.c0, wk.c1 - wk.c0};  // nwa: a partial last column block has fewer
}
// Calls f(std::integral_constant<int, B>{}) for the run's width B (2, 3, 4, 5, 6 or 8).
template <typename F>
__device__ __forceinline__ void with_bits(int bits, F&& f) {
  switch (bits) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 2>{}); break;
  }
}

// Ring slots of B-bit weights: ring_fill bytes in flight, but at least min_stages slots (a 2-slot ring of 8-bit
// or 6-bit weights only double-buffers) and no more than the ring holds.
// Measurement build EXL2_GEMV_DEEP_RING (scripts/build_variant.sh; the host makes the ring EXL2_GEMV_DEEP_RING_KB,
// default 64, where two blocks per SM still fit): every slot of the ring is used, but at most ring_fill bytes of copies
// are in flight (the producer waits for copy i - flight to land before it issues copy i). The first fill then reaches
// deeper into the block's weights while the previous kernel finishes, and what the block loads through the cache
// after the PDL wait still queues behind no more than ring_fill bytes (why 32 KB rings lost to 24 KB, AJ3).
template <int B>
__device__ __forceinline__ int tma_stages(const GemvParams& p) {
  constexpr int kSlot = kGvWarps * 256 * B;
#ifdef EXL2_GEMV_DEEP_RING
  return min(kTmaMaxStages, p.ring_bytes / kSlot);
#else
  return min(min(kTmaMaxStages, p.ring_bytes / kSlot), max(p.min_stages, p.ring_fill / kSlot));
#endif
}

// The ring's barriers for `stages` slots and `nwa` consuming warps, plus the scale barrier (one thread).
__device__ __forceinline__ void tma_init_ring(const TmaSmem& sm, int stages, int nwa) {
  for (int s = 0; s < stages; ++s) {
    mbar_init(sm.full(s), 1);
    mbar_init(sm.empty(s), nwa);
  }
  mbar_init(sm.scale(), 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void tma_inval_ring(const TmaSmem& sm, int stages) {
  for (int s = 0; s < stages; ++s) {
    mbar_inval(sm.full(s));
    mbar_inval(sm.empty(s));
  }
  mbar_inval(sm.scale());
}

// Where a block's copies of run wk.ri come from: its first chunk's bytes, the stride between chunks, the bytes
// of one copy (the block's warp tiles of one chunk are contiguous).
struct TmaSource {
  const unsigned char* src;
  size_t step;
  uint32_t bytes;
};
__device__ __forceinline__ TmaSource tma_source(const QDesc& d, const GvWork& wk) {
  const Run& run = d.runs[wk.ri];
  const TmaGeom g = tma_geom(d, wk);
  const int tile_bytes = 256 * run.bits;  // one warp tile of one chunk (64 rows x 32 columns x B bits)
  return {reinterpret_cast<const unsigned char*>(d.packed + run.word_base) +
              ((size_t)(g.c0 - run.chunk_start) * g.J + g.j0) * tile_bytes,
          (size_t)g.J * tile_bytes, (uint32_t)(g.nwa * tile_bytes)};
}

// The producer warp: the first `chunks` copies of a block's next run segment into L2 (a span split re-arms its
// ring between runs; its first copies then come from L2).
__device__ __forceinline__ void tma_prefetch_run(const QDesc& d, const GvWork& wk, int chunks) {
  const TmaSource s = tma_source(d, wk);
  for (int i = threadIdx.x & 31; i < min(chunks, wk.c1 - wk.c0); i += 32)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s.src + i * s.step), "r"(s.bytes) : "memory");
}

// The producer warp's work for one block: the first `stages` copies (their slots need no release) before anything
// else, an optional L2 prefetch of the following chunks, the block's group scales staged once on their own
// barrier, then lane 0 keeps the ring full until the block's last chunk is issued. Weights, scales and chunk info
// are constants: all of it may run before the PDL wait (and, in the chain kernel, before the grid barrier).
// The width only sets the tile bytes, so the code is not specialized per width (one copy in the kernel).
__device__ __forceinline__ void tma_produce_run(const GemvParams& p, const GvWork& wk, const TmaSmem& sm,
                                                int stages) {
  const QDesc& d = p.d[wk.di];
  const TmaGeom g = tma_geom(d, wk);
  const int lane = threadIdx.x & 31;
  const int slot_bytes = kGvWarps * 256 * d.runs[wk.ri].bits;
  const uint64_t pol = evict_first_policy();
  const auto [src, step, bytes] = tma_source(d, wk);
  const uint32_t ring_s = smem_addr(sm.ring);
  const int first = min(stages, g.nch);
  // The scales of this block's groups, staged once: loads through the cache would queue behind the ring's
  // copies (~ring bytes / bandwidth per SM) on every group of the compute warps' critical path. Before the ring's
  // first fill by default (GemvParams::scales_first): the first chunk then waits for its own slot, not for the
  // whole fill and the scales behind it (H200 call AK4: -15 us per 8B decode step).
  auto stage_scales = [&] {
    const int g_first = __ldg(d.info + g.c0) & kInfoGroupMask;
    const int last = __ldg(d.info + wk.c1 - 1);  // its unit 1 starts a new group when unit 0 ends one
    const int ngrp = (last & kInfoGroupMask) + ((last >> 30) & 1) - g_first + 1;  // <= maxgrp (host bound)
    if (lane == 0) mbar_expect_tx(sm.scale(), ngrp * g.nwa * 64);
    __syncwarp();
    for (int gi = lane; gi < ngrp; gi += 32)
      bulk_copy(smem_addr(sm.scl) + gi * kGroupScaleBytes,
                p.scl[wk.di] + ((size_t)(g_first + gi) * g.J + g.j0) * 8, g.nwa * 64, sm.scale(), pol);
  };
  if (p.scales_first) stage_scales();
  // Ring copies before the PDL wait: the whole first fill unless the measurement switch caps them; the producer
  // then waits for the previous grid itself before the rest (a no-op once passed).
  const int pre = p.prewait_slots < 0 ? first : min(first, p.prewait_slots);
#ifdef EXL2_GEMV_DEEP_RING
  const int flight = min(stages, max(p.min_stages, p.ring_fill / slot_bytes));  // copies in flight (tma_stages)
  auto cap = [&](int i) {  // copy i - flight has landed
    if (i >= flight) mbar_wait(sm.full((i - flight) % stages), ((i - flight) / stages) & 1);
  };
#else
  auto cap = [](int) {};
#endif
  if (lane == 0)
#pragma unroll 1
    for (int i = 0; i < first; ++i) {
      if (i == pre) exl2::pdl_wait();
      cap(i);
      mbar_expect_tx(sm.full(i), bytes);
      bulk_copy(ring_s + i * slot_bytes, src + i * step, bytes, sm.full(i), pol);
    }
  // Further chunks into L2 while the previous kernels finish (the small kernels between two GEMVs leave the
  // DRAM idle for microseconds; the ring alone holds 32 KB per block).
  const int pf_end = min(g.nch, first + (int)(p.prefetch_bytes / bytes));
  for (int i = first + lane; i < pf_end; i += 32)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + i * step), "r"(bytes) : "memory");
  if (!p.scales_first) stage_scales();
  if (lane == 0) {
    int s = first == stages ? 0 : first;
    uint32_t phase = first == stages ? 1 : 0;
    for (int i = first; i < g.nch; ++i) {
      mbar_wait(sm.empty(s), phase ^ 1);  // the slot's previous use was released
      cap(i);
      mbar_expect_tx(sm.full(s), bytes);
      bulk_copy(ring_s + s * slot_bytes, src + i * step, bytes, sm.full(s), pol);
      if (++s == stages) {
        s = 0;
        phase ^= 1;
      }
    }
  }
  __syncwarp();
}

template <int B>  // the chain kernel's spelling
__device__ __forceinline__ void tma_produce(const GemvParams& p, const GvWork& wk, const TmaSmem& sm, int stages) {
  tma_produce_run(p, wk, sm, stages);
}

// Compute warps: the split's xmap slice and chunk info (constants) into shared memory; the caller synchronizes.
__device__ __forceinline__ void tma_load_constants(const QDesc& d, const GvWork& wk, const TmaSmem& sm) {
  const int c0 = wk.c0, nch = wk.c1 - wk.c0;
  gv_load_xmap(d, c0, nch, sm.xm, kTmaComputeThreads);
  for (int i = threadIdx.x; i < nch; i += kTmaComputeThreads) sm.info[i] = __ldg(d.info + c0 + i);
}

// Compute warps, after the PDL wait (or the chain's grid barrier) and a compute_sync: the split's input rows in
// stored order into sm.xs (normalized, pre-gathered or gathered); the caller synchronizes after it.
// `loaded` runs once the global loads are done (after the norm's rows, or the gather's loads of this thread; the
// chain kernel's measurement stamps).
struct NoMark {
  __device__ void operator()() const {}
};
template <int MT, typename Mark = NoMark, int F = kFAll>
__device__ __forceinline__ void tma_stage_input(const GemvParams& p, const GvWork& wk, const TmaSmem& sm,
                                                Mark&& loaded = Mark{}) {
  const int nch = wk.c1 - wk.c0;
  constexpr bool kGate = (F & kFGated) != 0;
  if ((F & kFNorm) && p.norm_nt) {
    gv_norm_rows(norm_rows_of(p), sm.xf, sm.red, blockIdx.x == 0 ? p.norm_res_out : nullptr, p.norm_res_out_ld,
                 compute_sync);
    loaded();
    gv_gather_normed(p, nch, sm.xs, sm.xm, sm.xf, kTmaComputeThreads);
  } else if (!((F & kFProbe) && (p.probe & kProbeNoGather))) {
    // rows at M > 8: M loads per row slot, 16 or 32 in flight
    const int mode = p.gather_mode == kGatherAuto ? (MT > 1 ? kGatherRows : kGatherItems) : p.gather_mode;
    if ((F & kFPre) && p.xpre) gv_copy_pregathered(p, wk.di, wk.c0, nch, sm.xs, kTmaComputeThreads);
    else if (kGate && p.gate_off > 0) gv_gather_gated_runs(p, nch, sm.xs, sm.xm, kTmaComputeThreads);  // F_VEC8
    else if (mode == kGatherRows) gv_gather<MT >= 4 ? 32 : 16>(p, nch, sm.xs, sm.xm, kTmaComputeThreads);
    else gv_gather_items<false>(p, nch, sm.xs, sm.xm, kTmaComputeThreads);
    loaded();
  }
}

// An active compute warp's chunk loop: per chunk wait `full`, read the lane's words, release the slot, decode
// into mma A registers. Ends with the flush of a group that continues past this split (its partial is linear in
// the scale). `off`: chunks of the block's item before wk.c0 (a span split's later runs), whose chunk info and
// input rows come first in shared memory.
template <int B, int MT, int F = kFAll>
__device__ __forceinline__ void tma_chunks(const GemvParams& p, const GvWork& wk, const TmaSmem& sm, int stages,
                                           GvStateMT<MT>& st, int off = 0) {
  constexpr int kTileBytes = 256 * B;
  constexpr int kSlotBytes = kGvWarps * kTileBytes;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int nch = wk.c1 - wk.c0, M = p.M;
  const int* s_info = sm.info + off;
  const uint2* scl_lane = sm.scl + warp * 8 + gid;  // group g of the block: scl_lane[g * 64], g from 0
  const int last = s_info[nch - 1];
  const int ngrp = (last & kInfoGroupMask) + ((last >> 30) & 1) - (s_info[0] & kInfoGroupMask) + 1;
  mbar_wait(sm.scale(), 0);
  st.g = 0;
  st.sc = scl_lane[0];
  const __half* xs = sm.xs + off * kChunkRows;
  const __half* xl = xs + min(gid, M - 1) * p.xstride + 8 * t4;  // tokens >= M: duplicates, discarded
  const __half* xls[MT];  // the same for every token tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xls[mt] = xs + min(8 * mt + gid, M - 1) * p.xstride + 8 * t4;
  const uint32_t* tile = reinterpret_cast<const uint32_t*>(sm.ring + warp * kTileBytes);
  int s = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int i = 0; i < nch; ++i) {
    mbar_wait(sm.full(s), phase);
    uint32_t w[2][B];
    load_lane_words<B>(tile + s * (kSlotBytes / 4), lane, w);
    // Release: the warp's reads of the slot are done. The next copy into the slot is an async-proxy write: without
    // the proxy fence the arrive could overtake the lanes' shared loads (their data was not yet used) and the copy
    // land before they read. BD20-BD22 of 2026-12-06 (H100): the 8B's gated down GEMV at M = 2 returned a wrong
    // warp tile (up to 1.2 off) in 27% of identical launches, the norm-fused gate/up in 0.2-1%; none with the fence.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.empty(s));
    if ((F & kFProbe) && (p.probe & kProbeNoMath)) {
      asm volatile("" ::"r"(w[0][0]), "r"(w[1][B - 1]));  // keep the shared loads
    } else if constexpr (MT == 1) {
      gv_chunk<B, true>(w, s_info[i], xl + i * kChunkRows, st, scl_lane, kGvWarps * 8, ngrp);
    } else {
      gv_chunk_mt<B, MT>(w, s_info[i], xls, i * kChunkRows, st, scl_lane, kGvWarps * 8, ngrp);
    }
    if (++s == stages) {
      s = 0;
      phase ^= 1;
    }
  }
  if (!((s_info[nch - 1] >> 31) & 1)) gv_flush(st);
}

// Compute warps, split-K through the global workspace: every active warp writes its partial, thread 0 takes the
// column block's ticket, and the last block sums the partials in split order (deterministic) and re-arms the
// ticket for the next launch (and graph replay). ksplit == 1: the result is stored directly.
template <int MT, int F = kFAll>
__device__ __forceinline__ void tma_finish(const GemvParams& p, const GvWork& wk, const GvStateMT<MT>& st,
                                           bool active) {
  const QDesc& d = p.d[wk.di];
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int n0 = (wk.colblk * kGvWarps + warp) * kWarpCols;
  if (wk.ksplit == 1) {
    if (active) gv_store<MT>(d, st, n0, p.M, wk.gsplit, false);
    if ((F & kFRope) && p.rope_d) {
      compute_sync();
      gv_rope_kv(p, wk.di, wk.colblk, tid, kTmaComputeThreads);
    }
    return;
  }
  if (active) gv_store<MT>(d, st, n0, p.M, wk.gsplit, true);
  if ((F & kFProbe) && (p.probe & kProbeNoReduce)) return;
  __shared__ int s_last;
  compute_sync();
  if (tid == 0) s_last = gv_ticket(d, wk.colblk, wk.ksplit);
  compute_sync();
  if (!s_last) return;
  if (p.reduce_vec4) gv_reduce_partials_vec4(d, wk.colblk, wk.ksplit, p.M, tid, kTmaComputeThreads);
  else gv_reduce_partials(d, wk.colblk, wk.ksplit, p.M, tid, kTmaComputeThreads);
  if (tid == 0) d.counters[wk.colblk] = 0;  // ready for the next launch (and graph replay)
  if ((F & kFRope) && p.rope_d) {
    compute_sync();
    gv_rope_kv(p, wk.di, wk.colblk, tid, kTmaComputeThreads);
  }
}
#endif

}  // namespace exl2q
