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

#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_gemv.cuh"
#include "quant/exl2_gemv_norm.cuh"

namespace exl2q {
namespace {

constexpr int kTmaMaxStages = 32;
constexpr int kTmaComputeThreads = kGvWarps * 32;
constexpr int kTmaThreads = kTmaComputeThreads + 32;  // + the producer warp
constexpr int kBarBytes = (2 * kTmaMaxStages + 2) * 8;  // full[kTmaMaxStages], empty[kTmaMaxStages], scales
constexpr int kGroupScaleBytes = kGvWarps * 8 * 8;       // one group's scales of the block: [8 warps][8 gid] uint2

__host__ __device__ inline int align16(int x) { return (x + 15) & ~15; }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0;
}
// Completion of phase k of a barrier is seen as parity k & 1.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}
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

// Cluster split-K: every block leaves its partial [M][256] in its own (drained) ring; after a cluster barrier,
// block `rank` sums the columns [rank * 256 / C, (rank + 1) * 256 / C) over the C blocks in split order
// (deterministic, as the ticket path), adds the bias and writes the output; a second barrier keeps every
// block's shared memory alive until the others have read it. Called by all threads, producer warp included.
template <int MT, typename State>
__device__ __forceinline__ void cluster_reduce(const QDesc& d, const GvWork& wk, const State& st, bool active,
                                               bool compute, int n0, int M, float* part) {
  const int tid = threadIdx.x;
  const int nblk0 = wk.colblk * kGvCols, C = wk.ksplit;
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

__device__ __forceinline__ void compute_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kTmaComputeThreads) : "memory");
}

// MT token tiles of 8 (M <= 8 * MT): MT == 1 runs the register-batch kernel's chunk walk (gv_chunk); MT > 1
// decodes each A fragment once for MT mmas (gv_chunk_mt).
template <int B, int MT>
__device__ __forceinline__ void tma_block(const GemvParams& p, const GvWork& wk, unsigned char* smem) {
  const QDesc& d = p.d[wk.di];
  const Run& run = d.runs[wk.ri];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int J = d.Np / kWarpCols, j0 = wk.colblk * kGvWarps;
  const int nwa = min(kGvWarps, J - j0);  // active compute warps (a partial last column block has fewer)
  const int c0 = wk.c0, nch = wk.c1 - wk.c0, M = p.M;
  constexpr int kTileBytes = 256 * B;  // one warp tile of one chunk (64 rows x 32 columns x B bits)
  constexpr int kSlotBytes = kGvWarps * kTileBytes;
  const int stages = min(kTmaMaxStages, p.ring_bytes / kSlotBytes);

  // Shared memory: [barriers][ring][scales: maxgrp x 8 warps x 8 gid uint2][x: M x xstride halves][xmap slice]
  // [chunk info][fused norm: kGvWarps partial sums][fused norm: M x norm_k normalized halves]
  const uint32_t bar0 = smem_addr(smem);
  unsigned char* ring = smem + kBarBytes;
  uint2* s_scl = reinterpret_cast<uint2*>(ring + p.ring_bytes);
  __half* xs = reinterpret_cast<__half*>(reinterpret_cast<unsigned char*>(s_scl) + p.maxgrp * kGroupScaleBytes);
  unsigned short* xm = reinterpret_cast<unsigned short*>(reinterpret_cast<unsigned char*>(xs) +
                                                         align16(M * p.xstride * 2));
  int* s_info = reinterpret_cast<int*>(xm + p.maxnch * kChunkRows);
  float* s_red = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(s_info) + align16(p.maxnch * 4));
  __half* xf = reinterpret_cast<__half*>(s_red + kGvWarps);
  auto full_bar = [&](int s) { return bar0 + 8 * s; };
  auto empty_bar = [&](int s) { return bar0 + 8 * (kTmaMaxStages + s); };
  const uint32_t scale_bar = bar0 + 8 * (2 * kTmaMaxStages);

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full_bar(s), 1);
      mbar_init(empty_bar(s), nwa);
    }
    mbar_init(scale_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kGvWarps) {  // producer
    const uint64_t pol = evict_first_policy();
    const unsigned char* src = reinterpret_cast<const unsigned char*>(d.packed + run.word_base) +
                               ((size_t)(c0 - run.chunk_start) * J + j0) * kTileBytes;
    const size_t step = (size_t)J * kTileBytes;
    const uint32_t bytes = nwa * kTileBytes;
    const uint32_t ring_s = smem_addr(ring);
    const int first = min(stages, nch);
    if (lane == 0)  // the first slots need no release: start their DRAM reads before anything else
      for (int i = 0; i < first; ++i) {
        mbar_expect_tx(full_bar(i), bytes);
        bulk_copy(ring_s + i * kSlotBytes, src + i * step, bytes, full_bar(i), pol);
      }
    // Further chunks into L2 while the previous kernels finish (the small kernels between two GEMVs leave the
    // DRAM idle for microseconds; the ring alone holds 32 KB per block).
    const int pf_end = min(nch, first + (int)(p.prefetch_bytes / bytes));
    for (int i = first + lane; i < pf_end; i += 32)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + i * step), "r"(bytes) : "memory");
    // The scales of this block's groups, staged once: loads through the cache would queue behind the ring's
    // copies (~ring bytes / bandwidth per SM) on every group of the compute warps' critical path.
    const int g_first = __ldg(d.info + c0) & kInfoGroupMask;
    const int last = __ldg(d.info + wk.c1 - 1);  // its unit 1 starts a new group when unit 0 ends one
    const int ngrp = (last & kInfoGroupMask) + ((last >> 30) & 1) - g_first + 1;  // <= maxgrp (host bound)
    if (lane == 0) mbar_expect_tx(scale_bar, ngrp * nwa * 64);
    __syncwarp();
    for (int g = lane; g < ngrp; g += 32)
      bulk_copy(smem_addr(s_scl) + g * kGroupScaleBytes, p.scl[wk.di] + ((size_t)(g_first + g) * J + j0) * 8,
                nwa * 64, scale_bar, pol);
    if (lane == 0) {
      int s = first == stages ? 0 : first;
      uint32_t phase = first == stages ? 1 : 0;
      for (int i = first; i < nch; ++i) {
        mbar_wait(empty_bar(s), phase ^ 1);  // the slot's previous use was released
        mbar_expect_tx(full_bar(s), bytes);
        bulk_copy(ring_s + s * kSlotBytes, src + i * step, bytes, full_bar(s), pol);
        if (++s == stages) {
          s = 0;
          phase ^= 1;
        }
      }
    }
    __syncwarp();
    if (p.cluster) cluster_reduce<1>(d, wk, GvState{}, false, false, 0, M, nullptr);
    return;
  }

  // Compute warps. Constants first (before the PDL wait), then the activation gather.
  gv_load_xmap(d, c0, nch, xm, kTmaComputeThreads);
  for (int i = tid; i < nch; i += kTmaComputeThreads) s_info[i] = __ldg(d.info + c0 + i);
  exl2::pdl_wait();
  compute_sync();
  if (p.norm_nt) {
    gv_norm_rows(p, xf, s_red, blockIdx.x == 0 ? p.norm_res_out : nullptr, compute_sync);
    gv_gather_normed(p, nch, xs, xm, xf, kTmaComputeThreads);
  } else if (!(p.probe & kProbeNoGather)) {  // M > 8: M loads per row slot, 16 or 32 in flight (M = 32: 6 or 3 rounds)
    if (p.xpre) gv_copy_pregathered(p, wk.di, c0, nch, xs, kTmaComputeThreads);
    else if (MT > 1 || p.gather_rows) gv_gather<MT >= 4 ? 32 : 16>(p, nch, xs, xm, kTmaComputeThreads);
    else gv_gather_items(p, nch, xs, xm, kTmaComputeThreads);
  }
  compute_sync();

  const bool active = warp < nwa;
  const int gid = lane >> 2, t4 = lane & 3;
  GvStateMT<MT> st;
  gv_zero(st);
  if (active) {
    const uint2* scl_lane = s_scl + warp * 8 + gid;  // group g of the block: scl_lane[g * 64], g from 0
    const int last = s_info[nch - 1];
    const int ngrp = (last & kInfoGroupMask) + ((last >> 30) & 1) - (s_info[0] & kInfoGroupMask) + 1;
    mbar_wait(scale_bar, 0);
    st.g = 0;
    st.sc = scl_lane[0];
    const __half* xl = xs + min(gid, M - 1) * p.xstride + 8 * t4;  // tokens >= M: duplicates, discarded
    const __half* xls[MT];  // the same for every token tile
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) xls[mt] = xs + min(8 * mt + gid, M - 1) * p.xstride + 8 * t4;
    const uint32_t* tile = reinterpret_cast<const uint32_t*>(ring + warp * kTileBytes);
    int s = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (int i = 0; i < nch; ++i) {
      mbar_wait(full_bar(s), phase);
      uint32_t w[2][B];
      load_lane_words<B>(tile + s * (kSlotBytes / 4), lane, w);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_bar(s));  // release: the warp's reads of the slot are done
      if (p.probe & kProbeNoMath) {
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
    // A group that continues past this split is scaled here (its partial is linear in the scale).
    if (!((s_info[nch - 1] >> 31) & 1)) gv_flush(st);
  }

  const int n0 = (j0 + warp) * kWarpCols;
  if (wk.ksplit == 1) {
    if (active) gv_store<MT>(d, st, n0, M, wk.gsplit, false);
    return;
  }
  if (p.cluster) {  // the ring is drained: every copy into it was waited for and read
    cluster_reduce<MT>(d, wk, st, active, true, n0, M, reinterpret_cast<float*>(ring));
    return;
  }
  if (active) gv_store<MT>(d, st, n0, M, wk.gsplit, true);
  if (p.probe & kProbeNoReduce) return;
  __shared__ int s_last;
  compute_sync();
  if (tid == 0) s_last = gv_ticket(d, wk.colblk, wk.ksplit);
  compute_sync();
  if (!s_last) return;
  if (p.reduce_vec4) gv_reduce_partials_vec4(d, wk.colblk, wk.ksplit, M, tid, kTmaComputeThreads);
  else gv_reduce_partials(d, wk.colblk, wk.ksplit, M, tid, kTmaComputeThreads);
  if (tid == 0) d.counters[wk.colblk] = 0;  // ready for the next launch (and graph replay)
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
template <int MT>
__global__ void __launch_bounds__(kTmaThreads, MT == 1 ? EXL2_GEMV_TMA_MT1_MIN_BLOCKS : MT <= 2 ? 2 : 1)
    gemv_tma_kernel(const __grid_constant__ GemvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  exl2::pdl_launch_dependents();  // every block is resident now: the next kernel may launch into freed SMs
  const GvWork wk = gv_work(p);
  switch (p.d[wk.di].runs[wk.ri].bits) {
    case 8: tma_block<8, MT>(p, wk, smem); break;
    case 6: tma_block<6, MT>(p, wk, smem); break;
    case 5: tma_block<5, MT>(p, wk, smem); break;
    case 4: tma_block<4, MT>(p, wk, smem); break;
    case 3: tma_block<3, MT>(p, wk, smem); break;
    default: tma_block<2, MT>(p, wk, smem); break;
  }
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

constexpr int kMaxDevices = 64;

}  // namespace

int gemv_tma_smem_extra(int M, int xstride, int maxnch, int maxgrp, int norm_k) {
  return kBarBytes + maxgrp * kGroupScaleBytes + align16(M * xstride * 2) + maxnch * kChunkRows * 2 +
         align16(maxnch * 4) + (norm_k ? kGvWarps * 4 + align16(M * norm_k * 2) : 0);
}

namespace {
template <int MT>
int launch_mt(const GemvParams& p, int blocks, int smem, cudaStream_t stream) {
  static int smem_set[kMaxDevices] = {};  // function attributes are per kernel and per device
  static bool non_portable_set[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    dev = 0;
  }
  auto kernel = gemv_tma_kernel<MT>;
  if (smem > smem_set[dev]) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
      return exl2::set_error((int)err, "exl2_gemv (TMA): %d bytes of shared memory: %s", smem, cudaGetErrorString(err));
    if (smem_set[dev] == 0 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
      (void)cudaGetLastError();  // a hint only
    smem_set[dev] = smem;
  }
  if (!p.cluster) {
    exl2::launch_kernel(kernel, blocks, kTmaThreads, smem, stream, p);
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
  cudaLaunchKernelEx(&cfg, kernel, p);
  return exl2::check_launch("exl2_gemv (TMA, cluster)");
}
}  // namespace

int gemv_tma_launch(const GemvParams& p, int blocks, int smem, cudaStream_t stream) {
  switch ((p.M + 7) / 8) {
    case 1: return launch_mt<1>(p, blocks, smem, stream);
    case 2: return launch_mt<2>(p, blocks, smem, stream);
    default: return launch_mt<4>(p, blocks, smem, stream);  // M = 17..32
  }
}

}  // namespace exl2q
