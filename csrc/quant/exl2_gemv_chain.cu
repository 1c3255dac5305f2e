// A chain of dependent small-M GEMVs in one persistent launch (sm_90+): a decoder layer's O -> gate/up (with the
// post-attention norm) -> down (silu_mul in its gather) -> the next layer's q/k/v (with its input norm). Every
// GEMV of a decode step ran as its own launch; each launch paid a ramp (its blocks start, fill their rings, wait
// for their first weights) and a tail (the split-K reduce of the last blocks while the DRAM idles), ~6 us per
// GEMV on the H200 against 7-16 us of streaming (docs/performance.md, session 5 probes).
//
// Here one grid (every block resident: the host sizes it by the occupancy query) runs the phases in order with a
// grid barrier between them. Each phase is an ordinary planned GEMV (GemvParams, the same splits and split-K
// reduction, so the outputs are bit-identical to separate launches); a block walks the phase's work items
// blockIdx.x, blockIdx.x + gridDim.x, ... The producer warp never joins the grid barrier: once the compute warps
// have consumed a work item's last chunk (the `done` mbarrier), it re-plans the ring for the block's next work
// item and issues that item's weight copies, which are constants, so the next phase's first ring fill is in
// flight while the compute warps finish the split-K reduce and wait at the grid barrier. The compute warps wait
// on `ready` (the ring's barriers were initialized again) before their chunk loop.
//
// Inputs written in an earlier phase are read only after the grid barrier, and no block reads any of them
// before the phase that writes them, so the L1 holds no stale line of them (the host passes distinct buffers).
#include <algorithm>

#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_gemv_tma.cuh"

namespace exl2q {
namespace {

constexpr int kMaxChain = 4;

struct ChainParams {
  GemvParams ph[kMaxChain];
  int items[kMaxChain];  // work items of each phase (its one-launch grid)
  int nphase;
  TmaLayout layout;        // the largest of every region over the phases
  unsigned int* barrier;   // [2]: arrivals, generation (zero-initialized once; every barrier leaves arrivals 0)
};
static_assert(sizeof(ChainParams) <= 32764, "kernel parameters are limited to 32764 bytes");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Grid barrier of the compute warps of every block: the last arrival re-arms the count and bumps the generation
// (so graph replays reuse the same two words). Writes before it (outputs, re-armed tickets) are visible after it.
__device__ __forceinline__ void chain_grid_sync(unsigned int* bar) {
  compute_sync();
  if (threadIdx.x == 0) {
    unsigned int gen, prev;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(gen) : "l"(bar + 1) : "memory");
    __threadfence();
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(bar) : "memory");
    if (prev == gridDim.x - 1) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(bar), "r"(0u) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1) : "memory");
    } else {
      unsigned int now;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar + 1) : "memory");
      } while (now == gen);
    }
    __threadfence();
  }
  compute_sync();
}

template <typename F>
__device__ __forceinline__ void by_bits(int bits, F&& f) {
  switch (bits) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 2>{}); break;
  }
}

// The producer warp: for each of the block's work items in phase order, wait until the compute warps are done
// with the previous item's ring, initialize the ring again for this item (its slot size and consuming warps),
// signal `ready`, and stream the item's weights (tma_produce).
__device__ __forceinline__ void chain_producer(const ChainParams& c, const TmaSmem& sm) {
  const int lane = threadIdx.x & 31;
  int k = 0, prev_stages = 0;
  for (int ph = 0; ph < c.nphase; ++ph) {
    const GemvParams& p = c.ph[ph];
    for (int item = blockIdx.x; item < c.items[ph]; item += gridDim.x, ++k) {
      const GvWork wk = gv_work_at(p, item);
      const int bits = p.d[wk.di].runs[wk.ri].bits;
      by_bits(bits, [&](auto b) {
        constexpr int B = decltype(b)::value;
        const int stages = tma_stages<B>(p);
        if (lane == 0) {
          if (k > 0) {
            mbar_wait(sm.done(), (k - 1) & 1);
            tma_inval_ring(sm, prev_stages);
          }
          tma_init_ring(sm, stages, tma_geom(p.d[wk.di], wk).nwa);
          mbar_arrive(sm.ready());
        }
        __syncwarp();
        tma_produce<B>(p, wk, sm, stages);
        prev_stages = stages;
      });
    }
  }
}

// The compute warps: per phase, the PDL wait (phase 0) or the grid barrier, then each work item: constants,
// input, `ready`, the chunk loop, `done`, the split-K finish. The first item's constants are loaded before the
// wait (they do not depend on earlier phases).
__device__ __forceinline__ void chain_compute(const ChainParams& c, const TmaSmem& sm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int k = 0;
  for (int ph = 0; ph < c.nphase; ++ph) {
    const GemvParams& p = c.ph[ph];
    int item = blockIdx.x;
    if (item < c.items[ph]) {
      const GvWork wk = gv_work_at(p, item);
      tma_load_constants(p.d[wk.di], wk, sm);
    }
    if (ph == 0) {
      exl2::pdl_wait();
      compute_sync();
    } else {
      chain_grid_sync(c.barrier);
    }
    for (; item < c.items[ph]; item += gridDim.x, ++k) {
      const GvWork wk = gv_work_at(p, item);
      const QDesc& d = p.d[wk.di];
      if (item != (int)blockIdx.x) {
        tma_load_constants(d, wk, sm);
        compute_sync();
      }
      tma_stage_input<1>(p, wk, sm);
      compute_sync();
      const bool active = warp < tma_geom(d, wk).nwa;
      GvState st;
      gv_zero(st);
      if (active) {
        mbar_wait(sm.ready(), k & 1);
        by_bits(d.runs[wk.ri].bits, [&](auto b) {
          constexpr int B = decltype(b)::value;
          tma_chunks<B, 1>(p, wk, sm, tma_stages<B>(p), st);
        });
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.done());  // every compute warp, active or not: the ring is free
      tma_finish<1>(p, wk, st, active);
      compute_sync();  // the next item's constants overwrite this one's
    }
  }
}
#endif

// 112 registers: two blocks per SM (2 x 288 threads x 112 <= 64K); __launch_bounds__(288, 2) capped it at 96 (120
// bytes of spills).
__global__ void __maxnreg__(112) gemv_chain_kernel(const __grid_constant__ ChainParams c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  exl2::pdl_launch_dependents();  // every block is resident now: the next kernel may launch into freed SMs
  const TmaSmem sm(smem, c.layout);
  if (threadIdx.x == 0) {
    mbar_init(sm.ready(), 1);
    mbar_init(sm.done(), kGvWarps);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if ((int)(threadIdx.x >> 5) == kGvWarps) chain_producer(c, sm);
  else chain_compute(c, sm);
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

constexpr int kMaxDevices = 64;

int launch_chain(const ChainParams& c, int max_items, int max_grid, int smem, cudaStream_t stream) {
  static int smem_set[kMaxDevices] = {};
  static int per_sm[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    dev = 0;
  }
  if (smem > smem_set[dev]) {
    cudaError_t err = cudaFuncSetAttribute(gemv_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
      return exl2::set_error((int)err, "exl2_gemv_chain: %d bytes of shared memory: %s", smem, cudaGetErrorString(err));
    if (smem_set[dev] == 0 &&
        cudaFuncSetAttribute(gemv_chain_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
      (void)cudaGetLastError();  // a hint only
    smem_set[dev] = smem;
    per_sm[dev] = 0;
  }
  // Every block must be resident at once (the grid barrier): at most the occupancy times the SMs.
  if (per_sm[dev] == 0) {
    int n = 0;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemv_chain_kernel, kTmaThreads, smem_set[dev]);
    if (err != cudaSuccess)
      return exl2::set_error((int)err, "exl2_gemv_chain: occupancy: %s", cudaGetErrorString(err));
    per_sm[dev] = n;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return exl2::check_launch("exl2_gemv_chain: SM count");
  int grid = std::min(max_items, per_sm[dev] * sms);
  if (max_grid > 0) grid = std::min(grid, max_grid);
  EXL2_REQUIRE(grid >= 1, "exl2_gemv_chain: no resident block fits %d bytes of shared memory", smem);
  exl2::launch_kernel(gemv_chain_kernel, grid, kTmaThreads, smem, stream, c);
  return exl2::check_launch("exl2_gemv_chain");
}

}  // namespace
}  // namespace exl2q

// A chain of 1..4 small-M GEMVs (M = 1..8, TMA kernel, sm_90+), each reading the previous ones' outputs, in one
// persistent launch; the outputs are bit-identical to running exl2_gemv / exl2_gemv_add_norm in order. phases:
// nphase x kChainFields int64, per phase {blob, ndesc, x, ldx, gate_off, norm weight (0: no norm), norm
// residual (0: none), residual ld, residual out (0: not written), residual out ld} with the meanings of exl2_gemv
// and exl2_gemv_add_norm (eps shared). max_grid > 0 caps the grid (tests: blocks then loop over more work items).
// barrier: two zeroed uint32 words owned by this stream's chains.
EXL2_API int exl2_gemv_chain(const int64_t* phases, int nphase, int M, float eps, int max_grid, void* barrier,
                             void* stream) {
  using namespace exl2q;
  EXL2_REQUIRE(phases && barrier, "exl2_gemv_chain: null argument");
  EXL2_REQUIRE(nphase >= 1 && nphase <= kMaxChain, "exl2_gemv_chain: %d phases (1..%d)", nphase, kMaxChain);
  EXL2_REQUIRE(M >= 1 && M <= 8, "exl2_gemv_chain: M=%d outside 1..8", M);
  EXL2_REQUIRE(eps > 0.f && eps < 1.f, "exl2_gemv_chain: eps %g outside (0, 1)", (double)eps);
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    major = 0;
  }
  if (major < 9) return exl2::set_error(EXL2_ERR_UNSUPPORTED, "exl2_gemv_chain: needs sm_90+ (the TMA GEMV)");
  ChainParams c{};  // copied into the launch's parameters
  c.nphase = nphase;
  c.barrier = reinterpret_cast<unsigned int*>(barrier);
  TmaSizes mx{};
  int max_items = 0;
  for (int i = 0; i < nphase; ++i) {
    const int64_t* f = phases + (size_t)i * kChainFields;
    const GemvNorm norm{reinterpret_cast<const void*>(f[6]), (int)f[7], reinterpret_cast<const void*>(f[5]),
                        reinterpret_cast<void*>(f[8]), (int)f[9], eps};
    if (f[5]) {
      EXL2_REQUIRE(!norm.res_out || norm.res, "exl2_gemv_chain: phase %d: residual out without a residual", i);
      EXL2_REQUIRE(!norm.res_out || (norm.res_out != reinterpret_cast<const void*>(f[2]) && norm.res_out != norm.res),
                   "exl2_gemv_chain: phase %d: residual out aliases an input", i);
    }
    GemvPlan pl;
    const int st = gemv_plan(reinterpret_cast<const int64_t*>(f[0]), (int)f[1], reinterpret_cast<const void*>(f[2]), M,
                             (int)f[3], (int)f[4], 0, nullptr, 0, f[5] ? &norm : nullptr, c.ph[i], pl);
    if (st) return st;
    EXL2_REQUIRE(pl.tma && !c.ph[i].cluster && !c.ph[i].probe, "exl2_gemv_chain: phase %d does not run the plain "
                 "TMA GEMV (cluster split-K or a timing probe is set)", i);
    c.items[i] = pl.blocks;
    max_items = std::max(max_items, pl.blocks);
    const GemvParams& p = c.ph[i];
    const TmaSizes z = tma_sizes(p.ring_bytes, p.maxgrp, M, p.xstride, p.maxnch, p.norm_k);
    mx = {std::max(mx.ring, z.ring), std::max(mx.scl, z.scl), std::max(mx.xs, z.xs), std::max(mx.xm, z.xm),
          std::max(mx.info, z.info), std::max(mx.norm_red, z.norm_red), std::max(mx.norm_xf, z.norm_xf)};
  }
  c.layout = tma_layout(mx);
  EXL2_REQUIRE(c.layout.total <= 227 * 1024 - 1024, "exl2_gemv_chain: %d bytes of shared memory per block",
               c.layout.total);
  return launch_chain(c, max_items, max_grid, c.layout.total, reinterpret_cast<cudaStream_t>(stream));
}
