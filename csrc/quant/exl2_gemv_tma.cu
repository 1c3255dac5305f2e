// Small-M EXL2 GEMV for sm_90+ (M = 1..8): weights stream through a shared-memory ring filled by bulk
// asynchronous copies (cp.async.bulk, the TMA engine) instead of register batches (exl2_gemm.cu gemv_kernel,
// 186 instructions per warp chunk, much of it 64-bit address arithmetic; 128 registers, 13 warps per SM).
// H200, 2026-12-02: 4096x14336 at 4 bits 13.4 us against 14.4 us, 14336x4096 (8/4-bit mix) 15.2 against 19.6 us,
// the 8B decode step 2.91 against 3.53 ms. The ring is 32 KB: 16-48 KB measured alike, 96 KB (one block per SM)
// far worse; a deeper ring only lengthens the queue that every cached load of the block waits behind.
//
// Block: 8 compute warps on 8 adjacent 32-column warp tiles (256 columns) plus one producer warp. For chunk c,
// the 8 tiles are adjacent in the packed layout (exl2_quant.cuh), so one chunk of the block is ONE contiguous
// copy of nwa * 256 * B bytes into a ring slot. The producer's lane 0 keeps `stages` slots in flight: it waits
// for a slot's `empty` mbarrier (one arrival per compute warp), posts the byte count on its `full` mbarrier and
// issues the copy with an L2 evict-first hint (weights are read once per step; activations stay cached). The
// producer starts before the PDL wait: weights, scales, xmap and chunk info are constants, so their DRAM
// latency overlaps the previous kernel's tail; only the activation gather waits.
//
// Compute warps: per chunk, wait `full`, read the lane's words (16-byte shared loads, conflict-free), release
// the slot, decode with the fp16 mantissa trick straight into mma.m16n8k16 A registers (exl2_gemv.cuh). The
// block's group scales are staged once by bulk copies on their own mbarrier (read through the cache, each group
// end waited behind the ring's queue: 20% of the stall samples). Split-K
// partials are reduced in split order by the last block of each column block (deterministic), like the
// register-batch kernel. Compute warps synchronize among themselves with named barrier 1 (256 threads), so the
// producer never joins a barrier it could deadlock on.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_gemv_tma.cuh"

namespace exl2q {
namespace {

// BlockStamp: the measurement build's timeline, called at points 1..4 (thread 0 of the compute warps); a no-op in
// every other build.
#ifdef EXL2_GEMV_TIMELINE
// Measurement build (scripts/build_variant.sh EXL2_GEMV_TIMELINE ...; scripts/gemv_timeline.py): every launch takes
// the next of kTimelineSlots slots (a host counter, so the launches of a captured graph keep theirs on every replay)
// and thread 0 of each of its first kTimelineBlocks blocks records %globaltimer at the kernel's start (0), after the
// PDL wait (1), with the input staged (2), after its chunk loop (3) and after the split-K finish (4), and its SM
// (5). Results are unchanged; the stamps' stores are the only extra work.
constexpr int kTimelineSlots = 1024, kTimelineBlocks = 512, kTimelinePoints = 6;
struct TimelineArg {
  unsigned long long* buf;  // [kTimelineSlots][kTimelineBlocks][kTimelinePoints], or null (not armed)
  int slot;
};
struct TimelineStamp {
  unsigned long long* row;  // this block's kTimelinePoints entries, or null
  __device__ void operator()(int j) const {
    if (row && threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      row[j] = t;
    }
  }
};
using BlockStamp = TimelineStamp;
#else
struct BlockStamp {
  __device__ void operator()(int) const {}
};
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {  // every thread of every block of the cluster
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ld_cluster(uint32_t local_addr, uint32_t rank) {  // the same offset in block `rank`
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// Cluster split-K: every block leaves its partial [M][256] in its own drained ring (its compute warps first meet at
// a block barrier: a warp done with its chunks would otherwise overwrite slot 0 while a slower warp still reads
// it; AJ3 of 2026-12-04 caught that with a 24 KB ring, whose last chunks land in other slots); after a cluster barrier,
// block `rank` sums the columns [rank * 256 / C, (rank + 1) * 256 / C) over the C blocks in split order
// (deterministic, as the ticket path), adds the bias and writes the output; a second barrier keeps every
// block's shared memory alive until the others have read it. Called by all threads, producer warp included.
template <int MT, typename State>
__device__ __forceinline__ void cluster_reduce(const QDesc& d, const GvWork& wk, const State& st, bool active,
                                               bool compute, int n0, int M, float* part) {
  const int tid = threadIdx.x;
  const int nblk0 = wk.colblk * kGvCols, C = wk.ksplit;
  if (compute) compute_sync();  // every compute warp has read its last slot
  if (compute && active)
    for_each_acc<MT>([&](int nt, int mt, int e, int c, int m) {
      if (m < M) part[m * kGvCols + n0 - nblk0 + c] = gv_acc(st, nt, mt, e);
    });
  __syncwarp();
  cluster_sync();
  if (compute) {
    const int rank = wk.gsplit, c_begin = rank * kGvCols / C, c_end = (rank + 1) * kGvCols / C;
    const int width = c_end - c_begin;
    const uint32_t base = smem_addr(part);
    for (int e = tid; e < width * M; e += kTmaComputeThreads) {
      const int m = e / width, c = c_begin + e % width, n = nblk0 + c;
      if (n >= d.N) continue;
      const uint32_t a = base + 4 * (m * kGvCols + c);
      float t[16];  // all C remote loads in flight, then the sum in split order (zeros past C, as the ticket path)
#pragma unroll
      for (int s = 0; s < 16; ++s) t[s] = s < C ? ld_cluster(a, s) : 0.f;
      float v = 0.f;
#pragma unroll
      for (int s = 0; s < 16; ++s) v += t[s];
      if (d.bias) v += __half2float(d.bias[n]);
      d.out[(size_t)m * d.ldo + n] = __float2half_rn(v);
    }
  }
  __syncwarp();
  cluster_sync();
}

// MT token tiles of 8 (M <= 8 * MT): MT == 1 runs the register-batch kernel's chunk walk (gv_chunk); MT > 1
// decodes each A fragment once for MT mmas (gv_chunk_mt). Only the producer and the chunk loop depend on the
// run's width: the prologue (constants, input staging with the fused norm) and the finish (split-K, rope) are
// compiled once. With all of it inside a switch on the width the kernel was 777 KB of SASS, six copies of
// every cold path; each launch then refetched its prologue's instructions (ncu in session 9: 34% of the input
// stage's stall samples were instruction fetch).
//
// A span split (GemvParams::span) covers the end of one width run and the start of the next: the block streams
// them one after the other, re-arming its ring between them (both roles meet at a block barrier once the ring is
// drained; the producer has sent the next run's first copies to L2 by then). Items inside one run (all but span
// items) take a straight path, one produce and one chunk loop: through the run loop every such launch ran ~0.5 us
// slower (H200 call X1 of 2026-12-03, 8B decode step at 1k 2.416 -> 2.360 ms). The code below is instruction for
// instruction the build X1 measured: a version with the run loop in an else branch (fewer instructions) took
// 2.384 ms in X2.
__device__ __forceinline__ int ring_stages(const GemvParams& p, int bits) {
  int stages = 0;
  with_bits(bits, [&](auto b) { stages = tma_stages<decltype(b)::value>(p); });
  return stages;
}
__device__ __forceinline__ GvWork run_segment(const QDesc& d, const GvWork& wk, int r) {  // wk's chunks of run r
  GvWork s = wk;
  s.ri = r;
  s.c0 = max(wk.c0, d.runs[r].chunk_start);
  s.c1 = min(wk.c1, d.runs[r].chunk_end);
  return s;
}

template <int MT, int F, typename Stamp = BlockStamp>
__device__ __forceinline__ void tma_block(const GemvParams& p, const GvWork& wk, unsigned char* smem,
                                          Stamp stamp = {}) {
  const QDesc& d = p.d[wk.di];
  const int tid = threadIdx.x, warp = tid >> 5;
  const TmaGeom g = tma_geom(d, wk);
  const bool one_run = wk.re == wk.ri + 1;  // wk as is: no run bounds to read (indexed constant loads)
  const int bits0 = d.runs[wk.ri].bits;
  int stages = ring_stages(p, bits0);
  const TmaSmem sm(smem, tma_layout(tma_sizes(p.ring_bytes, p.maxgrp, p.M, p.xstride, p.maxnch, p.norm_k)));
  if (tid == 0) tma_init_ring(sm, stages, g.nwa);
  __syncthreads();
  // Between two runs of a span split: every copy and scale of the last one has landed and been read.
  auto next_run = [&](int r) {
    __syncthreads();
    const int next = ring_stages(p, d.runs[r].bits);
    if (tid == 0) {
      tma_inval_ring(sm, stages);
      tma_init_ring(sm, next, g.nwa);
    }
    stages = next;
    __syncthreads();
  };

  if (warp == kGvWarps) {  // producer
    if (one_run) {
      tma_produce_run(p, wk, sm, stages);
      if ((F & kFCluster) && p.cluster) cluster_reduce<1>(d, wk, GvState{}, false, false, 0, p.M, nullptr);
      return;
    }
    for (int r = wk.ri; r < wk.re; ++r) {
      if (r > wk.ri) next_run(r);
      tma_produce_run(p, one_run ? wk : run_segment(d, wk, r), sm, stages);
      if (r + 1 < wk.re) tma_prefetch_run(d, run_segment(d, wk, r + 1), ring_stages(p, d.runs[r + 1].bits));
    }
    if ((F & kFCluster) && p.cluster) cluster_reduce<1>(d, wk, GvState{}, false, false, 0, p.M, nullptr);
    return;
  }

  // Compute warps. Constants first (before the PDL wait), then the activation gather: both for the whole item.
  tma_load_constants(d, wk, sm);
  exl2::pdl_wait();
  stamp(1);
  compute_sync();
  tma_stage_input<MT, NoMark, F>(p, wk, sm);
  compute_sync();
  stamp(2);

  const bool active = warp < g.nwa;
  GvStateMT<MT> st;
  gv_zero(st);
  if (one_run) {
    if (active) with_bits(bits0, [&](auto b) { tma_chunks<decltype(b)::value, MT, F>(p, wk, sm, stages, st); });
  }
  for (int r = wk.ri; r < (one_run ? wk.ri : wk.re); ++r) {
    if (r > wk.ri) next_run(r);
    const GvWork seg = one_run ? wk : run_segment(d, wk, r);
    if (active)
      with_bits(r == wk.ri ? bits0 : d.runs[r].bits, [&](auto b) {
        tma_chunks<decltype(b)::value, MT, F>(p, seg, sm, stages, st, seg.c0 - wk.c0);
      });
  }
  // The ring is drained: every copy into it was waited for and read.
  stamp(3);
  if ((F & kFCluster) && p.cluster && wk.ksplit > 1) {
    const int n0 = (g.j0 + warp) * kWarpCols;
    cluster_reduce<MT>(d, wk, st, active, true, n0, p.M, reinterpret_cast<float*>(sm.ring));
    return;
  }
  tma_finish<MT, F>(p, wk, st, active);
  stamp(4);
}
#endif

// Two blocks per SM up to two token tiles; one with the registers of four. A measurement build with
// EXL2_GEMV_TMA_MT1_MIN_BLOCKS=3 leaves room for a third block of one token tile (72 registers, 68 bytes spilled)
// while the split-K plan stays at two per SM: the next launch's blocks can then become resident, and request their
// weights, before this launch's blocks retire. H200 call H3: the 8B decode step took 3.577 ms with it (and the
// early PDL trigger) against 2.999 ms, 4096x14336 at M = 1 17.1 against 13.8 us; it stays a measurement build.
#ifndef EXL2_GEMV_TMA_MT1_MIN_BLOCKS
#define EXL2_GEMV_TMA_MT1_MIN_BLOCKS 2
#endif
// F: the features compiled in (kFLean: every launch without cluster split-K or timing probes; kFAll: those).
template <int MT, int F>
__global__ void __launch_bounds__(kTmaThreads, MT == 1 ? EXL2_GEMV_TMA_MT1_MIN_BLOCKS : MT <= 2 ? 2 : 1)
#ifdef EXL2_GEMV_TIMELINE
    gemv_tma_kernel(const __grid_constant__ GemvParams p, const TimelineArg tl) {
#else
    gemv_tma_kernel(const __grid_constant__ GemvParams p) {
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
#ifdef EXL2_GEMV_TIMELINE
  const TimelineStamp stamp{tl.buf && blockIdx.x < kTimelineBlocks
                                ? tl.buf + ((size_t)tl.slot * kTimelineBlocks + blockIdx.x) * kTimelinePoints
                                : nullptr};
  stamp(0);
  if (stamp.row && threadIdx.x == 0) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    stamp.row[5] = sm;
  }
#else
  const BlockStamp stamp{};
#endif
  exl2::pdl_launch_dependents();  // every block is resident now: the next kernel may launch into freed SMs
  tma_block<MT, F>(p, gv_work(p), smem, stamp);
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

}  // namespace

int gemv_tma_smem_extra(int M, int xstride, int maxnch, int maxgrp, int norm_k) {
  return tma_layout(tma_sizes(0, maxgrp, M, xstride, maxnch, norm_k)).total;
}

#ifdef EXL2_GEMV_TIMELINE
namespace {
unsigned long long* g_timeline[kMaxDevices] = {};
int g_timeline_next[kMaxDevices] = {};
// Per slot, what the launch was: blocks, M, part 0's K and N, parts, the kF* bits of the features it uses (kFNorm 1,
// kFRope 2, kFGated 4, kFPre 8, kFCluster 16), the kernel's token tiles.
constexpr int kTimelineMeta = 7;
int g_timeline_meta[kMaxDevices][kTimelineSlots][kTimelineMeta] = {};

// The next slot of an armed device (its metadata recorded), or {null, 0}.
TimelineArg timeline_take(const GemvParams& p, int blocks, int mt) {
  const int dev = current_device_slot();
  if (!g_timeline[dev]) return {nullptr, 0};
  const int slot = g_timeline_next[dev]++ % kTimelineSlots;
  const int feats = (p.norm_nt ? kFNorm : 0) | (p.rope_d ? kFRope : 0) | (p.gate_off > 0 && !p.xpre ? kFGated : 0) |
                    (p.xpre ? kFPre : 0) | (p.cluster ? kFCluster : 0);
  const int meta[kTimelineMeta] = {blocks, p.M, p.d[0].K, p.d[0].N, p.ndesc, feats, mt};
  for (int i = 0; i < kTimelineMeta; ++i) g_timeline_meta[dev][slot][i] = meta[i];
  return {g_timeline[dev], slot};
}
}  // namespace
#endif

namespace {
template <int MT, int F = kFAll>
int launch_mt(const GemvParams& p, int blocks, int smem, cudaStream_t stream) {
  static int smem_set[kMaxDevices] = {};  // function attributes are per kernel and per device
  static bool non_portable_set[kMaxDevices] = {};
  const int dev = current_device_slot();
  auto kernel = gemv_tma_kernel<MT, F>;
  if (const int st = raise_smem_limit(kernel, smem, smem_set[dev], "exl2_gemv (TMA)")) return st;
#ifdef EXL2_GEMV_TIMELINE
  const TimelineArg tl = timeline_take(p, blocks, MT);
#define EXL2_TIMELINE_ARG , tl
#else
#define EXL2_TIMELINE_ARG
#endif
  if (!p.cluster) {
    exl2::launch_kernel(kernel, blocks, kTmaThreads, smem, stream, p EXL2_TIMELINE_ARG);
    return exl2::check_launch("exl2_gemv (TMA)");
  }
  if (p.cluster > 8 && !non_portable_set[dev]) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess)
      return exl2::set_error((int)err, "exl2_gemv (TMA): cluster of %d: %s", p.cluster, cudaGetErrorString(err));
    non_portable_set[dev] = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kTmaThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = p.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = exl2::pdl_enabled() ? 2 : 1;
  cudaLaunchKernelEx(&cfg, kernel, p EXL2_TIMELINE_ARG);
#undef EXL2_TIMELINE_ARG
  return exl2::check_launch("exl2_gemv (TMA, cluster)");
}
}  // namespace

int gemv_tma_launch(const GemvParams& p, int blocks, int smem, cudaStream_t stream) {
  // Cluster split-K and timing probes run kFAll; every other launch the lean kernel. EXL2_GEMV_LEAN=0 (a
  // measurement switch, read once) sends every launch to kFAll. The same arithmetic in the same order either way.
  static const bool lean_on = [] {
    const char* e = getenv("EXL2_GEMV_LEAN");
    const bool on = !e || atoi(e) != 0;
    if (!on) fprintf(stderr, "exl2_backend: EXL2_GEMV_LEAN=0: every GEMV launch runs the kFAll kernel\n");
    return on;
  }();
  const bool lean = lean_on && !p.cluster && !p.probe;
  switch ((p.M + 7) / 8) {
    case 1: return lean ? launch_mt<1, kFLean>(p, blocks, smem, stream) : launch_mt<1>(p, blocks, smem, stream);
    case 2: return lean ? launch_mt<2, kFLean>(p, blocks, smem, stream) : launch_mt<2>(p, blocks, smem, stream);
    default: return lean ? launch_mt<4, kFLean>(p, blocks, smem, stream) : launch_mt<4>(p, blocks, smem, stream);
  }
}

}  // namespace exl2q

#ifdef EXL2_GEMV_TIMELINE
// Arms (or re-arms) the timeline of the current device: the buffer allocated once and zeroed, the slot counter at
// 0; clear = 1 only zeroes the stamps (the slots the launches already hold stay theirs, e.g. a captured graph's).
EXL2_API int exl2_gemv_timeline_arm(int clear) {
  using namespace exl2q;
  const int dev = current_device_slot();
  const size_t bytes = sizeof(unsigned long long) * kTimelineSlots * kTimelineBlocks * kTimelinePoints;
  if (!g_timeline[dev]) {
    cudaError_t err = cudaMalloc(&g_timeline[dev], bytes);
    if (err != cudaSuccess) {
      g_timeline[dev] = nullptr;
      return exl2::set_error((int)err, "exl2_gemv_timeline_arm: %s", cudaGetErrorString(err));
    }
  }
  cudaError_t err = cudaMemset(g_timeline[dev], 0, bytes);
  if (err != cudaSuccess) return exl2::set_error((int)err, "exl2_gemv_timeline_arm: %s", cudaGetErrorString(err));
  if (!clear) g_timeline_next[dev] = 0;
  return 0;
}

// The stamps of slots [0, n) into host[n][kTimelineBlocks][kTimelinePoints] (globaltimer ns; 0: not stamped) and
// their metadata into meta[n][7] (see g_timeline_meta); *slots_taken: launches since the last arm. n <= 1024.
EXL2_API int exl2_gemv_timeline_copy(unsigned long long* host, int* meta, int n, int* slots_taken) {
  using namespace exl2q;
  EXL2_REQUIRE(host && meta && slots_taken && n > 0 && n <= kTimelineSlots, "exl2_gemv_timeline_copy: bad argument");
  const int dev = current_device_slot();
  if (!g_timeline[dev]) return exl2::set_error(EXL2_ERR_UNSUPPORTED, "exl2_gemv_timeline_copy: not armed");
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess)
    err = cudaMemcpy(host, g_timeline[dev], sizeof(unsigned long long) * n * kTimelineBlocks * kTimelinePoints,
                     cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return exl2::set_error((int)err, "exl2_gemv_timeline_copy: %s", cudaGetErrorString(err));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < kTimelineMeta; ++j) meta[i * kTimelineMeta + j] = g_timeline_meta[dev][i][j];
  *slots_taken = g_timeline_next[dev];
  return 0;
}
#endif
