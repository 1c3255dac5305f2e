// Small-M GEMV shared parts: the launch parameters, the block work split, the activation gathers, the decode into
// mma A registers, the stores and the split-K ticket, used by both GEMV kernels: the register-batch kernel in
// exl2_gemm.cu (M = 1..8; sm_80..89, and a fallback) and the TMA-ring kernel in exl2_gemv_tma.cu (sm_90+,
// M = 1..32 with one decode feeding up to four token tiles). Packed layout and decode: exl2_quant.cuh.
#pragma once

#include <cuda_runtime.h>

#include "common/activation.cuh"
#include "common/mma.cuh"
#include "quant/exl2_quant.cuh"

namespace exl2q {

constexpr int kGvWarps = 8;                    // compute warps per block, on 8 adjacent 32-column warp tiles
constexpr int kGvCols = kGvWarps * kWarpCols;  // 256 columns per block

// Timing probes of the TMA kernel (METHOD: time variants that leave one stage out, take differences). Each bit
// skips a stage and makes the result wrong; set only by benchmarks through EXL2_GEMV_PROBE.
constexpr int kProbeNoGather = 1;  // activations not gathered (shared memory left as is)
constexpr int kProbeNoReduce = 2;  // split partials written, no ticket and no final reduction
constexpr int kProbeNoMath = 4;    // weights streamed through the ring, no decode or mma

// Features a TMA GEMV instantiation compiles (its template argument F): every runtime switch of a launch's
// parameters is tested as (F & bit) && switch, so a kernel with every bit takes any launch, and a narrower F leaves
// the code of unused features out. H200 calls AG1 / AG2 of 2026-12-03: code compiled into the kernel but not run
// slowed every launch ~0.6 us. Narrower sets per role (the measurement build EXL2_GEMV_SPECIALIZED, sessions 19-20,
// removed; in git history at 72067f9) lost to one function for every role: see kFLean.
constexpr int kFNorm = 1;     // the norm inside the GEMV (norm_nt)
constexpr int kFRope = 2;     // the fused rope (rope_d)
constexpr int kFGated = 4;    // a gathered silu(gate) * up input (gate_off, no xpre)
constexpr int kFPre = 8;      // a pre-gathered input (xpre)
constexpr int kFCluster = 16; // cluster split-K (cluster)
constexpr int kFProbe = 32;   // timing probes (probe)
constexpr int kFAll = 63;
// The kernel every launch runs unless it asks for cluster split-K or timing probes (those take kFAll): both paths
// compiled out, one function for every role, so a decode layer's four GEMV launches still re-enter the same code.
// H200 call AI1 of 2026-12-04: the kFAll code as one copy per role cost the 8B decode step +99 us against one
// function (the instruction cache), while the narrower per-role sets cost only +33 us.
// (kFLean without the pre-gathered copy for the decode step's one-row GEMVs gained nothing: H200 call AJ1, 2.296
// against 2.295 ms; removed.)
constexpr int kFLean = kFNorm | kFRope | kFGated | kFPre;

// GemvParams::gather_mode. Auto: by items at M <= 8, by row slots past it. (A gather by 16-byte vectors where the
// rows are in input order, for down_proj after model/tp_shard.fold_down_order, lost to the item gather: H200 call
// R2 of 2026-12-02, 8B decode step 2.687 against 2.657 ms, k = 4 verify 3.381 against 3.335 ms.)
constexpr int kGatherAuto = 0, kGatherRows = 1, kGatherItems = 2;

struct GemvParams {
  QDesc d[kMaxDesc];
  const uint2* scl[kMaxDesc];         // fp16 scales in lane layout [G][J][8 gid] uint2 (cuda_quant._lane_scales)
  int rbase[kMaxDesc][kMaxRuns + 1];  // first split of each run (rbase[nruns] = splits in all)
  const __half* x;                    // [M, ldx]
  int ndesc, M, ldx, xstride;
  int gate_off;  // 0: x is the input; > 0: input = silu(x[:, i]) * x[:, gate_off + i] (the fused MLP's silu_mul)
  int maxnch;    // most chunks of any block (sizes the staged activations, xmap slice and chunk info)
  int ring_bytes;  // TMA kernel: bytes of its weight ring
  int ring_fill;   // TMA kernel: bytes a run keeps in flight (its slots: at least min_stages, at most the ring)
  int min_stages;  // TMA kernel: the fewest ring slots of any width (the ring holds that many of the widest)
  int maxgrp;      // TMA kernel: most quantization groups any block touches (sizes its staged scales)
  int probe;       // TMA kernel, timing probes only (results are wrong): kProbe* bits, from EXL2_GEMV_PROBE
  int prefetch_bytes;  // TMA kernel: weight bytes per block past the ring's first fill prefetched into L2 early
  // TMA kernel, the producer warp's order (exl2_gemm.cu, EXL2_GEMV_SCALES_FIRST / EXL2_GEMV_PREWAIT_SLOTS): the
  // group scales staged before the ring's first fill (1, the default) or after it; at most prewait_slots ring
  // copies before the PDL wait (< 0: the whole first fill, the default), the rest after it
  int scales_first, prewait_slots;
  int gather_mode;  // kGather*: how the TMA kernel gathers an input that is not pre-gathered (EXL2_GEMV_GATHER)
  int cluster;  // TMA kernel: 0, or the split count C of every descriptor, reduced through distributed shared
                // memory inside a cluster of C blocks instead of the global workspace and ticket
  const __half* xpre;  // TMA kernel: null, or the input already in stored row order, xpre[(di * M + m) * xpre_ld
  int xpre_ld;         // + r] (exl2_gemv_pregather.cu; silu_mul applied): blocks copy their rows, no gather
  int reduce_vec4;     // TMA kernel: the last block sums the split partials four columns per item
  int span;            // TMA kernel: splits of equal bytes across width runs (span_range; rbase[di][nruns] of them)
  // TMA kernel: RoPE and the fp16 KV-cache write after the q/k/v GEMV when rope_d > 0 (exl2_gemv_rope.cuh)
  const long long* rope_pos;    // [M] token positions
  const float* rope_inv_freq;   // [rope_d / 2]
  const long long* rope_slots;  // [M] cache slots; < 0 or >= rope_num_slots: not written
  __half* rope_kc;              // [rope_num_slots, Hk, rope_d]
  __half* rope_vc;
  long long rope_num_slots;
  int rope_d;
  // TMA kernel, RMSNorm fused into the input (exl2_gemv_norm.cuh) when norm_nt > 0: the input is
  // rms_norm(x + norm_res) * norm_w over rows of norm_k (x is the previous op's output h; norm_res null: no add),
  // and block 0 writes x + norm_res into norm_res_out (null: not written).
  const __half* norm_res;
  const __half* norm_w;  // [norm_k]
  __half* norm_res_out;
  int norm_res_ld, norm_res_out_ld, norm_k, norm_nt;
  float norm_eps;
};

// The block's work: descriptor, run, column block and chunk range [c0, c1). Splits are numbered run by run:
// run r owns splits [rbase[r], rbase[r+1]), equal chunk shares inside it, so a block never crosses runs; with
// GemvParams::span they are equal byte shares over all runs and ri is the run of c0 (the block walks on).
struct GvWork {
  int di, ri, colblk, gsplit, ksplit, c0, c1;
  int re;  // one past the last run the chunks touch (ri + 1 unless a span split crosses into later runs)
};

// Work item `b` of a launch (the one-launch kernels: b = blockIdx.x; the chain kernel loops b over its grid).
__device__ __forceinline__ GvWork gv_work_at(const GemvParams& p, int b) {
  GvWork w;
  w.di = 0;
  while (w.di + 1 < p.ndesc && b >= p.d[w.di + 1].block_start) ++w.di;
  const QDesc& d = p.d[w.di];
  const int local = b - d.block_start;
  // Cluster mode: a column block's splits are consecutive blocks, one cluster (split = rank in the cluster).
  w.colblk = p.cluster ? local / p.cluster : local % d.ncolblk;
  w.gsplit = p.cluster ? local % p.cluster : local / d.ncolblk;
  w.ri = 0;
  w.ksplit = p.rbase[w.di][d.nruns];
  if (p.span && d.nruns > 1) {  // one run: the per-run walk below (span_splits plans one-run parts for it)
    span_range(d, w.gsplit, w.ksplit, w.c0, w.c1, w.ri, w.re);
    return w;
  }
  while (w.ri + 1 < d.nruns && w.gsplit >= p.rbase[w.di][w.ri + 1]) ++w.ri;
  w.re = w.ri + 1;
  const Run& r = d.runs[w.ri];
  const int ks = p.rbase[w.di][w.ri + 1] - p.rbase[w.di][w.ri], sr = w.gsplit - p.rbase[w.di][w.ri];
  const int nr = r.chunk_end - r.chunk_start;
  w.c0 = r.chunk_start + nr * sr / ks;
  w.c1 = r.chunk_start + nr * (sr + 1) / ks;
  return w;
}
__device__ __forceinline__ GvWork gv_work(const GemvParams& p) { return gv_work_at(p, blockIdx.x); }

using exl2::mma16816;

__device__ __forceinline__ float2 h2_to_f2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return __half22float2(h);
}

// ---- MT token tiles of 8 (all three small-M kernels): one decoded A fragment feeds MT mmas ----
template <int MT>
struct TileAcc {
  float acc[2][MT][4];  // [n-tile][token tile][c0..c3]: running total
  float cg[2][MT][4];   // current group's unscaled sum
};

template <int MT>
__device__ __forceinline__ void tile_zero(TileAcc<MT>& a) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a.acc[nt][mt][e] = a.cg[nt][mt][e] = 0.f;
}

// acc += scale * cg. sc: the lane's fp16 scales {(a0, b0), (a1, b1)} for columns 16nt + gid (a) and
// 16nt + gid + 8 (b).
template <int MT>
__device__ __forceinline__ void tile_scale_into(float (&acc)[2][MT][4], const float (&cg)[2][MT][4], uint2 sc) {
  const float2 s0 = h2_to_f2(sc.x), s1 = h2_to_f2(sc.y);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const float sa = nt ? s1.x : s0.x, sb = nt ? s1.y : s0.y;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[nt][mt][0] += sa * cg[nt][mt][0];
      acc[nt][mt][1] += sa * cg[nt][mt][1];
      acc[nt][mt][2] += sb * cg[nt][mt][2];
      acc[nt][mt][3] += sb * cg[nt][mt][3];
    }
  }
}

// acc += scale * cg for the current group; cg = 0.
template <int MT>
__device__ __forceinline__ void tile_flush(TileAcc<MT>& a, uint2 sc) {
  tile_scale_into(a.acc, a.cg, sc);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a.cg[nt][mt][e] = 0.f;
}

// k-step S of a 32-row unit: decode the lane's 4 pairs of each n-tile once, one mma per token tile.
template <int B, int MT, int S>
__device__ __forceinline__ void tile_kstep(const uint32_t (&w)[2][B], const uint32_t (&xb)[MT][4], TileAcc<MT>& a) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const uint32_t a0 = pair_qz<B, 4 * S + 0>(w[nt]);
    const uint32_t a1 = pair_qz<B, 4 * S + 1>(w[nt]);
    const uint32_t a2 = pair_qz<B, 4 * S + 2>(w[nt]);
    const uint32_t a3 = pair_qz<B, 4 * S + 3>(w[nt]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      mma16816(a.cg[nt][mt], a0, a1, a2, a3, xb[mt][2 * (S & 1)], xb[mt][2 * (S & 1) + 1]);
  }
}

// Every accumulator element of a lane's warp tile: f(nt, mt, e, c, m) with c = 16nt + gid + 8*(e>=2) the column
// within the 32-column tile and m = 8mt + 2*t4 + (e&1) the token (the mma C fragment layout).
template <int MT, typename F>
__device__ __forceinline__ void for_each_acc(F&& f) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(nt, mt, e, 16 * nt + gid + 8 * (e >> 1), 8 * mt + 2 * t4 + (e & 1));
}

// Per-lane state of one warp tile: a TileAcc plus the current group. MT = 1 (M <= 8, tokens the mma N dimension)
// in the register-batch kernel and the TMA GEMV; more token tiles in the TMA GEMV for M = 9..32.
template <int MT>
struct GvStateMT {
  TileAcc<MT> a;
  uint2 sc;  // fp16 scales of the current group (lane layout)
  int g;     // current group
#ifdef EXL2_GEMV_GROUP32_FAST
  bool fresh;  // a.cg is zero: the last unit ended a group (or nothing was summed yet)
#endif
};
using GvState = GvStateMT<1>;

template <int MT>
__device__ __forceinline__ void gv_zero(GvStateMT<MT>& s) {
  tile_zero(s.a);
#ifdef EXL2_GEMV_GROUP32_FAST
  s.fresh = true;
#endif
}
template <int MT>
__device__ __forceinline__ void gv_flush(GvStateMT<MT>& s) {
  tile_flush(s.a, s.sc);
#ifdef EXL2_GEMV_GROUP32_FAST
  s.fresh = true;
#endif
}

// The next group: its index and its scales (a whole group before their use). kSmem: staged in shared memory, read
// without a branch (an index clamped to the last group; past it the value is unused); else through the read-only
// cache.
template <bool kSmem>
__device__ __forceinline__ void gv_next_group(GvState& s, const uint2* scl_lane, int scl_gstride, int G) {
  ++s.g;
  if constexpr (kSmem) s.sc = scl_lane[min(s.g, G - 1) * scl_gstride];
  else if (s.g < G) s.sc = __ldg(scl_lane + (size_t)s.g * scl_gstride);
}

// One 32-row unit U of a chunk: two k-steps, then the group end if the chunk info says so (the next group's
// scales are loaded then, a whole group before their use). kSmem: the scales were staged in shared memory
// (plain loads) instead of read from global memory through the read-only cache.
template <int B, int U, bool kSmem>
__device__ __forceinline__ void gv_unit(const uint32_t (&w)[2][B], int info, const __half* xl, GvState& s,
                                        const uint2* scl_lane, int scl_gstride, int G) {
  const uint4 xv = *reinterpret_cast<const uint4*>(xl + 32 * U);
  const uint32_t xb[1][4] = {{xv.x, xv.y, xv.z, xv.w}};
  tile_kstep<B, 1, 2 * U>(w, xb, s.a);
  tile_kstep<B, 1, 2 * U + 1>(w, xb, s.a);
  if ((info >> (30 + U)) & 1) {
    gv_flush(s);
    // Staged scales read without a branch: H200 call Y1 of 2026-12-03, the 4-bit TMA chunk loop's group-end blocks
    // 27 / 37 -> 21 / 29 SASS instructions, the 8B decode step at 1k 2.360 -> 2.315 ms.
    gv_next_group<kSmem>(s, scl_lane, scl_gstride, G);
  }
#ifdef EXL2_GEMV_GROUP32_FAST
  else {
    s.fresh = false;
  }
#endif
}

#ifdef EXL2_GEMV_GROUP32_FAST
// Measurement build (scripts/build_variant.sh EXL2_GEMV_GROUP32_FAST ...): a unit that is a whole group of 32 rows
// (it starts one, s.fresh, and ends it). Its two k-steps sum into a fresh tile whose mma C operand is zero, then
// scale into the totals: no accumulator clearing, no group-end branch (21 SASS instructions per group end in the
// default build, against ~35 for the unit's decode and mmas: up_proj's groups of 32 rows in the 8B stream ~15%
// slower than gate's of 128). The same arithmetic as gv_unit (whose group sum also starts at +0): bit-identical.
template <int B, int U, bool kSmem>
__device__ __forceinline__ void gv_unit_group32(const uint32_t (&w)[2][B], const __half* xl, GvState& s,
                                                const uint2* scl_lane, int scl_gstride, int G) {
  const uint4 xv = *reinterpret_cast<const uint4*>(xl + 32 * U);
  const uint32_t xb[1][4] = {{xv.x, xv.y, xv.z, xv.w}};
  TileAcc<1> t;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) t.cg[nt][0][e] = 0.f;
  tile_kstep<B, 1, 2 * U>(w, xb, t);
  tile_kstep<B, 1, 2 * U + 1>(w, xb, t);
  tile_scale_into(s.a.acc, t.cg, s.sc);
  gv_next_group<kSmem>(s, scl_lane, scl_gstride, G);
}
#endif

template <int B, bool kSmem = false>
__device__ __forceinline__ void gv_chunk(const uint32_t (&w)[2][B], int info, const __half* xl, GvState& s,
                                         const uint2* scl_lane, int scl_gstride, int G) {
#ifdef EXL2_GEMV_GROUP32_FAST
  if (s.fresh && ((info >> 30) & 3) == 3) {  // both units end a group, and a group starts here
    gv_unit_group32<B, 0, kSmem>(w, xl, s, scl_lane, scl_gstride, G);
    gv_unit_group32<B, 1, kSmem>(w, xl, s, scl_lane, scl_gstride, G);
    return;
  }
#endif
  gv_unit<B, 0, kSmem>(w, info, xl, s, scl_lane, scl_gstride, G);
  gv_unit<B, 1, kSmem>(w, info, xl, s, scl_lane, scl_gstride, G);
}

// ---- several token tiles in the TMA GEMV (M = 9..32) ----
// One 32-row unit: B operands of every token tile (one 16-byte shared load each), two k-steps, group end.
// xl[mt]: the lane's activations of token tile mt (tokens >= M point at row M - 1: computed, discarded); row:
// the chunk's first row in the staged activations.
template <int B, int U, int MT>
__device__ __forceinline__ void gv_unit_mt(const uint32_t (&w)[2][B], int info, const __half* const (&xl)[MT],
                                           int row, GvStateMT<MT>& s, const uint2* scl_lane, int scl_gstride,
                                           int G) {
  uint32_t xb[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const uint4 v = *reinterpret_cast<const uint4*>(xl[mt] + row + 32 * U);
    xb[mt][0] = v.x; xb[mt][1] = v.y; xb[mt][2] = v.z; xb[mt][3] = v.w;
  }
  tile_kstep<B, MT, 2 * U>(w, xb, s.a);
  tile_kstep<B, MT, 2 * U + 1>(w, xb, s.a);
  if ((info >> (30 + U)) & 1) {
    gv_flush(s);
    ++s.g;
    if (s.g < G) s.sc = scl_lane[s.g * scl_gstride];  // staged in shared memory
  }
}

template <int B, int MT>
__device__ __forceinline__ void gv_chunk_mt(const uint32_t (&w)[2][B], int info, const __half* const (&xl)[MT],
                                            int row, GvStateMT<MT>& s, const uint2* scl_lane, int scl_gstride,
                                            int G) {
  gv_unit_mt<B, 0, MT>(w, info, xl, row, s, scl_lane, scl_gstride, G);
  gv_unit_mt<B, 1, MT>(w, info, xl, row, s, scl_lane, scl_gstride, G);
}

// The accumulator of element (nt, mt, e), for code shared between the GEMV states and the mma kernel's bare
// TileAcc.
template <int MT>
__device__ __forceinline__ float gv_acc(const GvStateMT<MT>& s, int nt, int mt, int e) { return s.a.acc[nt][mt][e]; }
template <int MT>
__device__ __forceinline__ float gv_acc(const TileAcc<MT>& a, int nt, int mt, int e) { return a.acc[nt][mt][e]; }

// Writes the warp tile's result (ksplit == 1: + bias, fp16, columns < N) or its split partial into the fp32
// workspace. MT: the state's token tiles (1 for GvState). Used by all three small-M kernels.
template <int MT, typename State>
__device__ __forceinline__ void gv_store(const QDesc& d, const State& s, int n0, int M, int gsplit, bool partial) {
  float* ws = partial ? d.ws + (size_t)gsplit * M * d.Np : nullptr;
  for_each_acc<MT>([&](int nt, int mt, int e, int c, int m) {
    const int n = n0 + c;
    if (m < M && partial) {
      ws[(size_t)m * d.Np + n] = gv_acc(s, nt, mt, e);
    } else if (m < M && n < d.N) {
      float v = gv_acc(s, nt, mt, e);
      if (d.bias) v += __half2float(d.bias[n]);
      d.out[(size_t)m * d.ldo + n] = __float2half_rn(v);
    }
  });
}

// The split-K ticket: one gpu-scope acq_rel atomic by thread 0 after the caller's barrier releases every
// thread's partials (cumulativity); true for the last block of the column block, which then reduces.
__device__ __forceinline__ bool gv_ticket(const QDesc& d, int colblk, int ksplit) {
  int prev;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(prev) : "l"(d.counters + colblk), "r"(1)
               : "memory");
  return prev == ksplit - 1;
}

// The split's slice of xmap (a constant) into shared memory with 16-byte loads, by `nthreads` threads from
// thread 0 (callers synchronize). Safe before the PDL wait.
__device__ __forceinline__ void gv_load_xmap(const QDesc& d, int c0, int nch, unsigned short* xm, int nthreads) {
  const int rows = nch * kChunkRows;
  const uint4* src = reinterpret_cast<const uint4*>(d.xmap + c0 * kChunkRows);
  for (int v = threadIdx.x; v < rows / 8; v += nthreads) reinterpret_cast<uint4*>(xm)[v] = __ldg(src + v);
}

// Gather of the split's activations into shared memory in stored row order, xs[m * xstride + r], by `nthreads`
// threads from thread 0 (callers synchronize); 8 independent 2-byte loads in flight per thread, items in
// (token, row) order. With gate_off the input is silu(gate) * up, the same arithmetic as silu_mul_kernel
// (bit-identical). The TMA kernel's default for an ungated input at M <= 8 (GemvParams::gather_mode).
template <bool kMayGate = true>  // false: the input is never gated (the gated code is not compiled)
__device__ __forceinline__ void gv_gather_items(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                          int nthreads) {
  constexpr int kB = 8;
  const int T = nthreads;
  const int rows = nch * kChunkRows;
  const unsigned short* xg = reinterpret_cast<const unsigned short*>(p.x);
  unsigned short* xo = reinterpret_cast<unsigned short*>(xs);
  const int items = rows * p.M;  // (token, row) pairs, all tokens' loads in flight together
  if (kMayGate && p.gate_off > 0) {
    const __half* xh = p.x;
    for (int e0 = threadIdx.x; e0 < items; e0 += kB * T) {
      __half g[kB], u[kB];
      int o[kB];
#pragma unroll
      for (int k = 0; k < kB; ++k) {
        const int e = e0 + k * T, m = e / rows, r = e - m * rows;
        const unsigned i = e < items ? xm[r] : 0xFFFFu;
        o[k] = m * p.xstride + r;
        const bool ok = i != 0xFFFFu;
        g[k] = ok ? __ldg(xh + (size_t)m * p.ldx + i) : __half(0.f);
        u[k] = ok ? __ldg(xh + (size_t)m * p.ldx + p.gate_off + i) : __half(0.f);
      }
#pragma unroll
      for (int k = 0; k < kB; ++k) {
        if (e0 + k * T >= items) continue;
        xs[o[k]] = __float2half_rn(exl2::silu_mul(__half2float(g[k]), __half2float(u[k])));
      }
    }
    return;
  }
  for (int e0 = threadIdx.x; e0 < items; e0 += kB * T) {
    unsigned short v[kB];
    int o[kB];
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int e = e0 + u * T, m = e / rows, r = e - m * rows;
      const unsigned i = e < items ? xm[r] : 0xFFFFu;
      o[u] = m * p.xstride + r;
      v[u] = i == 0xFFFFu ? (unsigned short)0 : __ldg(xg + (size_t)m * p.ldx + i);
    }
#pragma unroll
    for (int u = 0; u < kB; ++u)
      if (e0 + u * T < items) xo[o[u]] = v[u];
  }
}

// Gather of the split's activations into shared memory in stored row order, xs[m * xstride + r], by `nthreads`
// threads from thread 0 (callers synchronize). Thread t owns rows t, t + T, ... of every token: `per` row slots
// per token, M * per (token, slot) items, kB of them in flight per round. Every round waits a whole L2 latency
// (behind the block's queued weight copies in the TMA kernel), so gv_gather picks the smallest kB that takes all
// items in one round, up to kMaxB (the TMA kernel: 16; 32 made ptxas spill under its 96-register cap): a verify
// (M = 5, 4 row slots per thread) takes two rounds, not three.
// Ungated inputs only: the TMA kernel reads a gated one by vectors (gv_gather_gated_runs).
template <int kB>
__device__ __forceinline__ void gv_gather_rounds(const GemvParams& p, int rows, int per, __half* xs,
                                                 const unsigned short* xm, int T) {
  static_assert(kB % 2 == 0, "values are kept two per register");
  const int total = per * p.M;
  const unsigned short* xg = reinterpret_cast<const unsigned short*>(p.x);
  unsigned short* xo = reinterpret_cast<unsigned short*>(xs);
  for (int base = 0; base < total; base += kB) {
    const int m0 = base / per, sl0 = base - m0 * per;
    uint32_t g[kB / 2];  // two 16-bit values per register (register pressure)
    int m = m0, sl = sl0;
#pragma unroll
    for (int k = 0; k < kB; ++k) {
      const int r = threadIdx.x + sl * T;
      const unsigned i = base + k < total && r < rows ? xm[r] : 0xFFFFu;
      const unsigned short* xr = xg + (size_t)m * p.ldx;
      const uint32_t gv = i == 0xFFFFu ? 0u : (uint32_t)__ldg(xr + i);
      g[k / 2] = k % 2 ? g[k / 2] | (gv << 16) : gv;
      if (++sl == per) {
        sl = 0;
        ++m;
      }
    }
    m = m0;
    sl = sl0;
#pragma unroll
    for (int k = 0; k < kB; ++k) {  // the same (token, row) walk again: positions are not kept in registers
      const int r = threadIdx.x + sl * T;
      if (base + k < total && r < rows) xo[m * p.xstride + r] = (unsigned short)(g[k / 2] >> (16 * (k % 2)));
      if (++sl == per) {
        sl = 0;
        ++m;
      }
    }
  }
}

// The split's rows of the pre-gathered input (GemvParams::xpre, part di) into xs[m * xstride + r] with 16-byte
// loads, four in flight per thread, by `nthreads` threads from thread 0 (callers synchronize).
__device__ __forceinline__ void gv_copy_pregathered(const GemvParams& p, int di, int c0, int nch, __half* xs,
                                                    int nthreads) {
  constexpr int kB = 4;
  const int vec = nch * kChunkRows / 8, total = vec * p.M;  // 16-byte vectors per token, in all
  const uint4* src = reinterpret_cast<const uint4*>(p.xpre + (size_t)di * p.M * p.xpre_ld + (size_t)c0 * kChunkRows);
  const int ldv = p.xpre_ld / 8, xsv = p.xstride / 8;
  uint4* dst = reinterpret_cast<uint4*>(xs);
  for (int e0 = threadIdx.x; e0 < total; e0 += kB * nthreads) {
    uint4 t[kB];
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int e = e0 + u * nthreads, m = e / vec;
      t[u] = e < total ? __ldg(src + (size_t)m * ldv + (e - m * vec)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int e = e0 + u * nthreads, m = e / vec;
      if (e < total) dst[m * xsv + (e - m * vec)] = t[u];
    }
  }
}

// The TMA kernel's gated input, silu(gate) * up, into xs[m * xstride + r] by 8-byte vectors of 4 features, for
// parts whose stored rows come in aligned runs of 8 features (F_VEC8: every 8-row group of xmap is 8 consecutive
// features from a multiple of 8, or 8 padding rows; down_proj after model/tp_shard.fold_down_order is in input
// order, its width runs padded to whole chunks). Each vector's first feature comes from the staged xmap slice xm;
// kV vectors of gate and of up in flight per thread, so a verify step's five rows take one round of loads where the
// 2-byte item gather took three. 4 features, not 8: a decode step's 112 vectors of 8 per block left half the
// threads idle and the rest with 8 serial silus each (H100 call BS1: down 15.2 us per launch against 14.7 with the
// item gather; 18.4 against 19.1 at five rows). The same arithmetic per value as silu_mul_kernel (bit-identical);
// padding rows are zero.
template <int kV = 8>
__device__ __forceinline__ void gv_gather_gated_runs(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                                     int nthreads) {
  const int vec = nch * kChunkRows / 4, total = vec * p.M;  // 8-byte vectors per token, in all
  const uint2* xg = reinterpret_cast<const uint2*>(p.x);
  const int ldv = p.ldx / 4, gv = p.gate_off / 4, xsv = p.xstride / 4;
  uint2* dst = reinterpret_cast<uint2*>(xs);
  for (int e0 = threadIdx.x; e0 < total; e0 += kV * nthreads) {
    uint2 g[kV], u[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      const int e = e0 + k * nthreads, m = e / vec;
      const unsigned f = e < total ? xm[4 * (e - m * vec)] : 0xFFFFu;  // the vector's first feature
      const uint2* row = xg + (size_t)m * ldv + f / 4;
      g[k] = f != 0xFFFFu ? __ldg(row) : make_uint2(0, 0);
      u[k] = f != 0xFFFFu ? __ldg(row + gv) : make_uint2(0, 0);
    }
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      const int e = e0 + k * nthreads, m = e / vec;
      if (e >= total) continue;
      uint32_t* gw = reinterpret_cast<uint32_t*>(&g[k]);
      const uint32_t* uw = reinterpret_cast<const uint32_t*>(&u[k]);
#pragma unroll
      for (int w = 0; w < 2; ++w) {  // silu(0) * 0 = +0: padding rows stay zero
        const float2 gf = __half22float2(*reinterpret_cast<const __half2*>(&gw[w]));
        const float2 uf = __half22float2(*reinterpret_cast<const __half2*>(&uw[w]));
        const __half2 r = __halves2half2(__float2half_rn(exl2::silu_mul(gf.x, uf.x)),
                                         __float2half_rn(exl2::silu_mul(gf.y, uf.y)));
        gw[w] = *reinterpret_cast<const uint32_t*>(&r);
      }
      dst[m * xsv + (e - m * vec)] = g[k];
    }
  }
}

template <int kMaxB = 8>
__device__ __forceinline__ void gv_gather(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                          int nthreads) {
  const int rows = nch * kChunkRows, per = (rows + nthreads - 1) / nthreads, total = per * p.M;
  if (kMaxB >= 32 && total > 16) gv_gather_rounds<kMaxB >= 32 ? 32 : 8>(p, rows, per, xs, xm, nthreads);
  else if (kMaxB >= 16 && total > 8) gv_gather_rounds<kMaxB >= 16 ? 16 : 8>(p, rows, per, xs, xm, nthreads);
  else gv_gather_rounds<8>(p, rows, per, xs, xm, nthreads);
}

// Sum of the split partials of column block `colblk` in split order, plus bias, into out (the last block of a
// column block runs it after the ticket). `tid`/`nthreads`: the calling threads.
__device__ __forceinline__ void gv_reduce_partials(const QDesc& d, int colblk, int ksplit, int M, int tid,
                                                   int nthreads) {
  const int nblk0 = colblk * kGvCols;
  const int ncols = min(kGvCols, d.N - nblk0);
  for (int e = tid; e < ncols * M; e += nthreads) {
    const int m = e / ncols, n = nblk0 + e % ncols;
    const float* src = d.ws + (size_t)m * d.Np + n;
    const size_t stride = (size_t)M * d.Np;
    float v = 0.f;
    for (int s0 = 0; s0 < ksplit; s0 += 16) {  // 16 loads in flight, summed in split order
      float t[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) t[u] = s0 + u < ksplit ? __ldcg(src + (s0 + u) * stride) : 0.f;
#pragma unroll
      for (int u = 0; u < 16; ++u) v += t[u];
    }
    if (d.bias) v += __half2float(d.bias[n]);
    d.out[(size_t)m * d.ldo + n] = __float2half_rn(v);
  }
}

// gv_reduce_partials over four adjacent columns per item: 16 float4 loads (64 values) in flight per thread, so
// M rows of 256 columns take ceil(M * 64 / nthreads) rounds of L2 latency instead of ceil(M * 256 / nthreads)
// (a k = 4 verify, M = 5, with 16 splits: 2 rounds instead of 5). The same sums in the same split order
// (bit-identical); Np is a multiple of 32, so the loads stay inside the partials. The default
// (GemvParams::reduce_vec4; EXL2_GEMV_REDUCE=scalar selects gv_reduce_partials).
__device__ __forceinline__ void gv_reduce_partials_vec4(const QDesc& d, int colblk, int ksplit, int M, int tid,
                                                        int nthreads) {
  const int nblk0 = colblk * kGvCols;
  const int ncols = min(kGvCols, d.N - nblk0);
  const int quads = (ncols + 3) / 4;
  const size_t stride = (size_t)M * d.Np;
  for (int e = tid; e < quads * M; e += nthreads) {
    const int m = e / quads, n = nblk0 + 4 * (e % quads);
    const float4* src = reinterpret_cast<const float4*>(d.ws + (size_t)m * d.Np + n);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < ksplit; s0 += 16) {  // 16 loads in flight, summed in split order
      float4 t[16];
#pragma unroll
      for (int u = 0; u < 16; ++u)
        t[u] = s0 + u < ksplit ? __ldcg(src + (s0 + u) * (stride / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        v.x += t[u].x;
        v.y += t[u].y;
        v.z += t[u].z;
        v.w += t[u].w;
      }
    }
    const float o[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (n + c >= nblk0 + ncols) break;
      const float b = d.bias ? __half2float(d.bias[n + c]) : 0.f;
      d.out[(size_t)m * d.ldo + n + c] = __float2half_rn(o[c] + b);
    }
  }
}

// The fused RMSNorm input of exl2_gemv_add_norm and of a chain phase (GemvParams::norm_*).
struct GemvNorm {
  const void* res;
  int res_ld;
  const void* w;
  void* res_out;
  int res_out_ld;
  float eps;
};

// A planned small-M GEMV launch: its grid, dynamic shared memory, and whether it runs the TMA kernel.
struct GemvPlan {
  int blocks, smem;
  bool tma;
};

// Checks the arguments of one small-M GEMV (exl2_gemm.cu) and plans it into p (splits, ring, staged sizes):
// the arguments of exl2_gemv, and norm (null: none) those of exl2_gemv_add_norm. Returns a status.
// allow_span: F_SPAN may select span splits (the chain kernel walks one run per item and passes false).
int gemv_plan(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off, int minb, const void* xpre,
              int xpre_ld, const GemvNorm* norm, GemvParams& p, GemvPlan& pl, bool allow_span = true);

// Fields per phase of exl2_gemv_chain's table (exl2_gemv_chain.cu; keep in sync with ops/cuda_chain.py).
constexpr int kChainFields = 13;

// TMA-ring GEMV launch (exl2_gemv_tma.cu): p fully planned (ring_bytes set), `smem` dynamic bytes.
int gemv_tma_launch(const GemvParams& p, int blocks, int smem, cudaStream_t stream);
// Dynamic shared memory the TMA kernel needs beside its ring; maxgrp: most groups a block touches; norm_k: the
// fused norm's row length (0 without).
int gemv_tma_smem_extra(int M, int xstride, int maxnch, int maxgrp, int norm_k);

}  // namespace exl2q
