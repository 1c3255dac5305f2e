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
// Rows the norm cannot fuse into the GEMV in one pass (K = 4096 from M = 3: a verify step, a batch of sequences)
// get two more phase kinds instead of the add_rms_norm and pregather launches between the GEMVs: a norm phase
// (block m normalizes row m into shared memory, writes the residual stream and the row in the next GEMV's
// stored order, exl2_gemv_pregather.cuh) and a pregather phase (the gated input of the down projection in stored
// order). The GEMV after either copies its rows with 16-byte loads (GemvParams::xpre).
//
// Inputs written in an earlier phase are read only after the grid barrier, and no block reads any of them
// before the phase that writes them, so the L1 holds no stale line of them (the host passes distinct buffers).
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_gemv_pregather.cuh"
#include "quant/exl2_gemv_tma.cuh"

namespace exl2q {
namespace {

constexpr int kMaxChain = 8;
enum ChainKind { kPhaseGemv = 0, kPhasePregather = 1, kPhaseNorm = 2 };
constexpr int kPregatherUnits = kTmaComputeThreads;  // units (8 stored rows) per pregather work item
// Per block and phase (measurements): [0] the phase's work starts (barrier passed), [1] the first item's input is
// staged, [2] its chunks are consumed, [3] the block's last item is finished (it arrives at the next barrier);
// [4] (EXL2_GEMV_CHAIN_STAMPS=2) thread 0's one dependent load of a hot L2 word after [0] returned (a probe of the
// round trip at that moment, which delays the input by it), [5] thread 0's input loads returned (the norm's rows,
// or its share of the gather), before the compute warps synchronize. chain_bench.py reads kStamps slots.
constexpr int kStamps = 8;
constexpr int kMaxStampBlocks = 1024;

// A pregather or norm phase: the stored-order output (pg) and, for a norm phase, the rows it normalizes (all M;
// block m takes row m) and where the residual stream goes.
struct AuxPhase {
  PregatherParams pg;
  NormRows norm;
  __half* res_out;
  int res_out_ld;
};

struct ChainParams {
  GemvParams ph[kMaxChain];  // kPhaseGemv
  AuxPhase aux[kMaxChain];   // kPhasePregather, kPhaseNorm
  int kind[kMaxChain];
  int items[kMaxChain];  // work items of each phase (a GEMV's one-launch grid; a norm phase's rows)
  int nphase;
  TmaLayout layout;        // the largest of every region over the phases
  unsigned int* barrier;   // [64]: arrivals at [0], generation at [32] (zeroed once; every barrier re-arms [0])
  unsigned long long* stamps;  // null, or [grid][kMaxChain][kStamps] globaltimer ns (EXL2_GEMV_CHAIN_STAMPS=1)
  // Measurements (N1's stamps: each phase boundary costs ~10 us of dependent round trips, which queue behind the
  // next phase's ring fill): hold = the producer issues a phase's first copies only once the block has passed the
  // barrier before it (EXL2_GEMV_CHAIN_HOLD=1); spin = the barrier's waiters poll without back-off
  // (EXL2_GEMV_CHAIN_SPIN=1).
  int hold, spin;
  int stamp_mode;  // EXL2_GEMV_CHAIN_STAMPS: 1 stamps, 2 stamps and the round-trip probe
};
static_assert(sizeof(ChainParams) <= 32764, "kernel parameters are limited to 32764 bytes");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Grid barrier of the compute warps of every block: the last arrival re-arms the count and bumps the generation
// (so graph replays reuse the same words). Writes before it (outputs, re-armed tickets) are visible after it. The
// count and the generation sit on different 128-byte lines, and the waiters poll with relaxed loads and a short
// back-off, so the arrivals' atomics do not queue behind the polls. (M1 / M3 ran a first version with both words on
// one line; this one, N1, was no faster. N3 / N4: the barrier's own latency is 1.25-2.5 us, a round trip right
// after it 0.25 us; the ~10 us per phase boundary are the input stage, the finish and the blocks' spread,
// docs/performance.md session 9.)
constexpr int kBarrierGenWord = 32;  // uint32 words from the count to the generation (128 bytes)
__device__ __forceinline__ void chain_grid_sync(unsigned int* bar, bool spin) {
  compute_sync();
  if (threadIdx.x == 0) {
    unsigned int* gen_word = bar + kBarrierGenWord;
    unsigned int gen, prev;
    // This thread acquired `gen` at the previous barrier: a relaxed read sees it or later (it cannot move on
    // before this block arrives).
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(gen) : "l"(gen_word) : "memory");
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the block's writes (ordered by the bar.sync above)
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(bar) : "memory");
    if (prev == gridDim.x - 1) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(bar), "r"(0u) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gen_word), "r"(gen + 1) : "memory");
    } else {
      unsigned int now, ns = 32;
      for (;;) {
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(gen_word) : "memory");
        if (now != gen) break;
        if (!spin) __nanosleep(ns);
        ns = ns < 256 ? 2 * ns : ns;
      }
      asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire: the other blocks' writes before the bump
    }
  }
  compute_sync();
}

// The producer warp: for each of the block's work items in phase order, wait until the compute warps are done
// with the previous item's ring, initialize the ring again for this item (its slot size and consuming warps),
// signal `ready`, and stream the item's weights (tma_produce).
__device__ __forceinline__ void chain_producer(const ChainParams& c, const TmaSmem& sm) {
  const int lane = threadIdx.x & 31;
  int k = 0, prev_stages = 0;
  uint32_t go = 0;  // the parity of the next `go` (hold)
  for (int ph = 0; ph < c.nphase; ++ph) {
    if (c.kind[ph] != kPhaseGemv) continue;  // no weights
    const GemvParams& p = c.ph[ph];
    if (c.hold && ph > 0 && (int)blockIdx.x < c.items[ph]) {
      if (lane == 0) mbar_wait(sm.go(), go);  // the compute warps passed this phase's barrier
      go ^= 1;
      __syncwarp();
    }
    for (int item = blockIdx.x; item < c.items[ph]; item += gridDim.x, ++k) {
      const GvWork wk = gv_work_at(p, item);
      const int bits = p.d[wk.di].runs[wk.ri].bits;
      with_bits(bits, [&](auto b) {
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

// A pregather phase's work item: kPregatherUnits units of 8 stored rows (part, token, rows), one per thread.
__device__ __forceinline__ void chain_pregather_item(const PregatherParams& pg, int item) {
  const int per_part_m = (pg.kmax + kPregatherRows - 1) / kPregatherRows;
  const int u = item * kPregatherUnits + threadIdx.x;
  const int part = u / (pg.M * per_part_m), rest = u - part * pg.M * per_part_m;
  const int m = rest / per_part_m, r0 = (rest - m * per_part_m) * kPregatherRows;
  if (part < pg.nparts && r0 < pg.kpad[part]) pregather_rows(pg, part, m, r0, pregather_index(pg, part, r0));
}

// A norm phase's work item m: row m of rms_norm(x + res) * w into shared memory (the arithmetic of
// add_rms_norm, gv_norm_rows with one row), the residual stream's row m, then row m of every part's stored-order
// input from shared memory.
__device__ __forceinline__ void chain_norm_item(const AuxPhase& a, int m, const TmaSmem& sm) {
  gv_norm_row(a.norm, m, sm.xf, sm.red, a.res_out, a.res_out_ld, compute_sync);
  const PregatherParams& pg = a.pg;
  for (int part = 0; part < pg.nparts; ++part)
    for (int r0 = threadIdx.x * kPregatherRows; r0 < pg.kpad[part]; r0 += kTmaComputeThreads * kPregatherRows)
      pregather_rows_from(pg, part, m, r0, pregather_index(pg, part, r0), sm.xf);
}

__device__ __forceinline__ void chain_stamp(const ChainParams& c, int ph, int j) {
  if (c.stamps && threadIdx.x == 0 && blockIdx.x < kMaxStampBlocks) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    c.stamps[((size_t)blockIdx.x * kMaxChain + ph) * kStamps + j] = t;
  }
}

// The compute warps: per phase, the PDL wait (phase 0) or the grid barrier, then each work item: for a GEMV,
// constants, input, `ready`, the chunk loop, `done`, the split-K finish. A GEMV's first item's constants are
// loaded before the wait (they do not depend on earlier phases).
__device__ __forceinline__ void chain_compute(const ChainParams& c, const TmaSmem& sm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int k = 0;
  for (int ph = 0; ph < c.nphase; ++ph) {
    const GemvParams& p = c.ph[ph];
    const int kind = c.kind[ph];
    int item = blockIdx.x;
    if (kind == kPhaseGemv && item < c.items[ph]) {
      const GvWork wk = gv_work_at(p, item);
      tma_load_constants(p.d[wk.di], wk, sm);
    }
    if (ph == 0) {
      exl2::pdl_wait();
      compute_sync();
    } else {
      chain_grid_sync(c.barrier, c.spin);
      if (c.hold && kind == kPhaseGemv && item < c.items[ph] && threadIdx.x == 0) mbar_arrive(sm.go());
    }
    chain_stamp(c, ph, 0);
    if (c.stamp_mode == 2 && threadIdx.x == 0) {
      unsigned int v;
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c.barrier + kBarrierGenWord) : "memory");
      if (v != 0x7FFFFFFFu) chain_stamp(c, ph, 4);  // consumes v: the stamp waits for the load
    }
    if (kind == kPhasePregather) {
      for (; item < c.items[ph]; item += gridDim.x) chain_pregather_item(c.aux[ph].pg, item);
      chain_stamp(c, ph, 3);
      continue;
    }
    if (kind == kPhaseNorm) {
      for (; item < c.items[ph]; item += gridDim.x) {
        chain_norm_item(c.aux[ph], item, sm);
        compute_sync();  // the next row reuses xf
      }
      chain_stamp(c, ph, 3);
      continue;
    }
    for (; item < c.items[ph]; item += gridDim.x, ++k) {
      const GvWork wk = gv_work_at(p, item);
      const QDesc& d = p.d[wk.di];
      if (item != (int)blockIdx.x) {
        tma_load_constants(d, wk, sm);
        compute_sync();
      }
      const bool first = item == (int)blockIdx.x;
      tma_stage_input<1>(p, wk, sm, [&] {
        if (first) chain_stamp(c, ph, 5);
      });
      compute_sync();
      if (first) chain_stamp(c, ph, 1);
      const bool active = warp < tma_geom(d, wk).nwa;
      GvState st;
      gv_zero(st);
      if (active) {
        mbar_wait(sm.ready(), k & 1);
        with_bits(d.runs[wk.ri].bits, [&](auto b) {
          constexpr int B = decltype(b)::value;
          tma_chunks<B, 1>(p, wk, sm, tma_stages<B>(p), st);
        });
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.done());  // every compute warp, active or not: the ring is free
      if (item == (int)blockIdx.x) chain_stamp(c, ph, 2);
      tma_finish<1>(p, wk, st, active);
      compute_sync();  // the next item's constants overwrite this one's
    }
    chain_stamp(c, ph, 3);
  }
}
#endif

// Two blocks per SM: ptxas caps the registers at 96 (a few spills outside and 2-3 local loads inside the chunk
// loops). M1 ran __maxnreg__(112), for which the occupancy query may still report two blocks per SM.
__global__ void __launch_bounds__(kTmaThreads, 2) gemv_chain_kernel(const __grid_constant__ ChainParams c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  exl2::pdl_launch_dependents();  // every block is resident now: the next kernel may launch into freed SMs
  const TmaSmem sm(smem, c.layout);
  if (threadIdx.x == 0) {
    mbar_init(sm.ready(), 1);
    mbar_init(sm.done(), kGvWarps);
    mbar_init(sm.go(), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if ((int)(threadIdx.x >> 5) == kGvWarps) chain_producer(c, sm);
  else chain_compute(c, sm);
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

// EXL2_GEMV_CHAIN_STAMPS=1: every launch records chain_stamp's times into one device buffer (measurements;
// exl2_gemv_chain_stamps copies the last launch's out).
unsigned long long* g_stamps[kMaxDevices] = {};
int g_stamp_grid = 0, g_stamp_phases = 0;

int stamp_mode() {
  static const int mode = [] {
    const char* e = getenv("EXL2_GEMV_CHAIN_STAMPS");
    return e ? atoi(e) : 0;
  }();
  return mode;
}

unsigned long long* stamps_buffer(int dev) {
  if (!stamp_mode()) return nullptr;
  if (!g_stamps[dev]) {
    const size_t bytes = sizeof(unsigned long long) * kMaxStampBlocks * kMaxChain * kStamps;
    if (cudaMalloc(&g_stamps[dev], bytes) != cudaSuccess || cudaMemset(g_stamps[dev], 0, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      g_stamps[dev] = nullptr;
    }
  }
  return g_stamps[dev];
}

int launch_chain(ChainParams& c, int max_items, int max_grid, int smem, cudaStream_t stream) {
  static int smem_set[kMaxDevices] = {};
  static int per_sm[kMaxDevices] = {};
  const int dev = current_device_slot();
  if (smem > smem_set[dev]) {
    if (const int st = raise_smem_limit(gemv_chain_kernel, smem, smem_set[dev], "exl2_gemv_chain")) return st;
    per_sm[dev] = 0;  // the occupancy changes with the limit
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
  static int verbose = [] {  // EXL2_GEMV_CHAIN_VERBOSE=n: the first n launches' plans on stderr (measurements)
    const char* e = getenv("EXL2_GEMV_CHAIN_VERBOSE");
    return e ? atoi(e) : 0;
  }();
  if (verbose > 0) {
    --verbose;
    fprintf(stderr, "exl2_gemv_chain: grid %d (%d per SM x %d SMs), smem %d, phases", grid, per_sm[dev], sms, smem);
    for (int i = 0; i < c.nphase; ++i) fprintf(stderr, " %d:%d", c.kind[i], c.items[i]);
    fprintf(stderr, "\n");
  }
  static const int hold = [] {
    const char* e = getenv("EXL2_GEMV_CHAIN_HOLD");
    return e ? atoi(e) : 0;
  }();
  static const int spin = [] {
    const char* e = getenv("EXL2_GEMV_CHAIN_SPIN");
    return e ? atoi(e) : 0;
  }();
  c.hold = hold;
  c.spin = spin;
  c.stamps = stamps_buffer(dev);
  c.stamp_mode = c.stamps ? stamp_mode() : 0;
  g_stamp_grid = grid;
  g_stamp_phases = c.nphase;
  exl2::launch_kernel(gemv_chain_kernel, grid, kTmaThreads, smem, stream, c);
  return exl2::check_launch("exl2_gemv_chain");
}

}  // namespace
}  // namespace exl2q

// A chain of 1..8 phases over M = 1..8 rows in one persistent launch, each reading the previous ones' outputs; the
// outputs are bit-identical to the launches it replaces (exl2_gemv, exl2_gemv_add_norm, exl2_gemv_pregather,
// exl2_add_rms_norm). phases: nphase x kChainFields int64, per phase {kind, blob, ndesc, x, ldx, gate_off, norm
// weight (0: none), norm residual (0: none), residual ld, residual out (0: not written), residual out ld, xpre,
// xpre ld}: kind 0 a GEMV (exl2_gemv's arguments; a norm weight fuses the norm as exl2_gemv_add_norm; xpre: its
// pre-gathered input), kind 1 a pregather of x into xpre in the stored order of blob's parts (gate_off: silu_mul),
// kind 2 the norm of x (+ residual) with that weight into xpre in that order, and the residual stream into
// residual out. eps is shared. max_grid > 0 caps the grid (tests: blocks then loop over more work items).
// barrier: 64 zeroed uint32 words owned by this stream's chains.
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
  auto aligned = [](const void* q, int64_t ld) { return reinterpret_cast<uintptr_t>(q) % 16 == 0 && ld % 8 == 0; };
  for (int i = 0; i < nphase; ++i) {
    const int64_t* f = phases + (size_t)i * kChainFields;
    const int kind = (int)f[0];
    const auto* blob = reinterpret_cast<const int64_t*>(f[1]);
    const int ndesc = (int)f[2], ldx = (int)f[4], gate_off = (int)f[5];
    const void* x = reinterpret_cast<const void*>(f[3]);
    const void* w = reinterpret_cast<const void*>(f[6]);
    const void* res = reinterpret_cast<const void*>(f[7]);
    void* res_out = reinterpret_cast<void*>(f[9]);
    void* xpre = reinterpret_cast<void*>(f[11]);
    const int res_ld = (int)f[8], res_out_ld = (int)f[10], xpre_ld = (int)f[12];
    EXL2_REQUIRE(kind >= kPhaseGemv && kind <= kPhaseNorm, "exl2_gemv_chain: phase %d: kind %d", i, kind);
    EXL2_REQUIRE(!res_out || (res && res_out != x && res_out != res), "exl2_gemv_chain: phase %d: residual out "
                 "without a residual, or aliasing an input", i);
    c.kind[i] = kind;
    TmaSizes z{};
    if (kind == kPhaseGemv) {
      const GemvNorm norm{res, res_ld, w, res_out, res_out_ld, eps};
      GemvPlan pl;
      const int st = gemv_plan(blob, ndesc, x, M, ldx, gate_off, 0, xpre, xpre_ld, w ? &norm : nullptr, c.ph[i], pl,
                               /*allow_span=*/false);
      if (st) return st;
      EXL2_REQUIRE(pl.tma && !c.ph[i].cluster && !c.ph[i].probe && !c.ph[i].rope_d, "exl2_gemv_chain: phase %d "
                   "does not run the plain TMA GEMV (cluster split-K, a timing probe or a fused rope is set)", i);
      c.items[i] = pl.blocks;
      const GemvParams& p = c.ph[i];
      z = tma_sizes(p.ring_bytes, p.maxgrp, M, p.xstride, p.maxnch, p.norm_k);
    } else {
      AuxPhase& a = c.aux[i];
      const int st = pregather_plan(blob, ndesc, x, M, ldx, kind == kPhaseNorm ? 0 : gate_off, xpre, xpre_ld, a.pg);
      if (st) return st;
      if (kind == kPhasePregather) {
        const int units = ndesc * M * ((a.pg.kmax + kPregatherRows - 1) / kPregatherRows);
        c.items[i] = (units + kPregatherUnits - 1) / kPregatherUnits;
      } else {
        const int K = (int)blob[F_K];
        for (int d = 1; d < ndesc; ++d)
          EXL2_REQUIRE(blob[(size_t)d * kDescLen + F_K] == K, "exl2_gemv_chain: phase %d: parts of different K", i);
        const int nt = norm_row_threads(K);
        EXL2_REQUIRE(w && K % kNormVec == 0 && nt <= kMaxNormThreads, "exl2_gemv_chain: phase %d: a norm of K=%d "
                     "(a multiple of %d up to %d, with a weight)", i, K, kNormVec, kMaxNormThreads * kNormVec * kNormMaxVecs);
        EXL2_REQUIRE(aligned(x, ldx) && aligned(w, 0) && (!res || aligned(res, res_ld)) &&
                     (!res_out || aligned(res_out, res_out_ld)), "exl2_gemv_chain: phase %d: norm rows must start "
                     "16-byte aligned (pointers and row strides)", i);
        a.norm = NormRows{reinterpret_cast<const __half*>(x), reinterpret_cast<const __half*>(res),
                          reinterpret_cast<const __half*>(w), ldx, res_ld, K, nt, M, eps};
        a.res_out = reinterpret_cast<__half*>(res_out);
        a.res_out_ld = res_out_ld;
        c.items[i] = M;
        z.norm_red = kGvWarps * 4;
        z.norm_xf = align16(K * 2);
      }
    }
    max_items = std::max(max_items, c.items[i]);
    mx = {std::max(mx.ring, z.ring), std::max(mx.scl, z.scl), std::max(mx.xs, z.xs), std::max(mx.xm, z.xm),
          std::max(mx.info, z.info), std::max(mx.norm_red, z.norm_red), std::max(mx.norm_xf, z.norm_xf)};
  }
  c.layout = tma_layout(mx);
  EXL2_REQUIRE(c.layout.total <= 227 * 1024 - 1024, "exl2_gemv_chain: %d bytes of shared memory per block",
               c.layout.total);
  return launch_chain(c, max_items, max_grid, c.layout.total, reinterpret_cast<cudaStream_t>(stream));
}

// The last launch's stamps (EXL2_GEMV_CHAIN_STAMPS=1 or 2; synchronizes the device): host receives up to
// max_blocks x 8 phases x 8 uint64 (globaltimer ns, 0 where not stamped: kStamps above), *grid and
// *nphase the launch's. EXL2_ERR_UNSUPPORTED when stamps are off.
EXL2_API int exl2_gemv_chain_stamps(void* host, int max_blocks, int* grid, int* nphase) {
  using namespace exl2q;
  EXL2_REQUIRE(host && grid && nphase && max_blocks > 0, "exl2_gemv_chain_stamps: bad argument");
  const int dev = current_device_slot();
  if (!g_stamps[dev]) return exl2::set_error(EXL2_ERR_UNSUPPORTED, "exl2_gemv_chain_stamps: EXL2_GEMV_CHAIN_STAMPS "
                                             "is not 1, or no chain has run");
  const int n = std::min(std::min(max_blocks, g_stamp_grid), kMaxStampBlocks);
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess)
    err = cudaMemcpy(host, g_stamps[dev], sizeof(unsigned long long) * n * kMaxChain * kStamps,
                     cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return exl2::set_error((int)err, "exl2_gemv_chain_stamps: %s", cudaGetErrorString(err));
  *grid = n;
  *nphase = g_stamp_phases;
  return EXL2_OK;
}
