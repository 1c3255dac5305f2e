// Fused EXL2 dequantize + GEMM for small M (1..32): y[M, N] = x[M, K] @ W (+ bias), fp32 accumulation.
//
// Grid: one block per (128-column block, K split) of each descriptor (up to kMaxDesc linears sharing x, e.g.
// q/k/v, in one launch). Block: 4 warps, each owning 32 columns over the block's whole K range, so no
// intra-block reduction. Each warp streams its weight tiles (64 rows x 32 columns, 256*b bytes) through a
// private kStages-deep cp.async ring (kStages - 1 chunks in flight), decodes pairs with the fp16 mantissa
// trick straight into mma.m16n8k16 A registers, and multiplies with activations gathered by xmap into shared memory
// (tokens are the mma N dimension: MT = ceil(M/8) mmas per decoded A). Integer (q - z) products are summed
// in fp32 per quantization group and scaled at group end. Split-K partials go to an fp32 workspace; the last
// block of a column block (atomic ticket) sums them in split order, so results are deterministic.
#include "common/api.h"
#include "common/pdl.cuh"
#include "quant/exl2_gemv.cuh"
#include "quant/exl2_gemv_splits.cuh"
#include "quant/exl2_gemv_rope.cuh"
#include "quant/exl2_gemv_norm.cuh"
#include "quant/exl2_quant.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {
// Function attributes (max dynamic shared memory, carveout) are per device: remember what was set for each
// kernel on each device, so a model split over GPUs configures every GPU it launches on.
enum { kGemmFuncId, kGemv2FuncId = kGemmFuncId + 4, kGemv3FuncId, kNumFuncIds };  // gemm: one per MT (1..4)
constexpr int kMaxDevices = 64;
int& smem_set_for_device(int func) {
  static int set[kNumFuncIds][kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    dev = 0;
  }
  return set[func][dev];
}
}  // namespace

namespace exl2q {
namespace {

struct GemmParams {
  QDesc d[kMaxDesc];
  const __half* x;  // [M, ldx]
  int ndesc, M, ldx;
  int slot_words;   // ring slot size per warp (64 * max bits)
  int xwin;         // chunks of activations staged per window
  int xstride;      // halves per staged activation row
  int off_x, off_scale, off_info;  // shared memory byte offsets
};

__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

constexpr int kGatherBatch = 4;  // activation gather items in flight per thread (registers vs. latency)

// One 32-row unit U of a chunk: B operands (8 activations per lane and token tile), two k-steps, group end.
template <int B, int MT, int U>
__device__ __forceinline__ void unit(const uint32_t (&w)[2][B], const __half* xchunk, const int (&xoff)[MT], int info,
                                     int& gl, const uint2* s_sc, TileAcc<MT>& a) {
  uint32_t xb[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    uint4 v = *reinterpret_cast<const uint4*>(xchunk + xoff[mt] + 32 * U);
    xb[mt][0] = v.x; xb[mt][1] = v.y; xb[mt][2] = v.z; xb[mt][3] = v.w;
  }
  tile_kstep<B, MT, 2 * U>(w, xb, a);
  tile_kstep<B, MT, 2 * U + 1>(w, xb, a);
  if ((info >> (30 + U)) & 1) {
    tile_flush(a, s_sc[gl * (kBlockWarps * 8)]);
    ++gl;
  }
}

template <int B, int MT>
__device__ __forceinline__ void chunk(const uint32_t* slot, int lane, const __half* xchunk, const int (&xoff)[MT],
                                      int info, int& gl, const uint2* s_sc, TileAcc<MT>& a) {
  uint32_t w[2][B];
  load_lane_words<B>(slot, lane, w);
  unit<B, MT, 0>(w, xchunk, xoff, info, gl, s_sc, a);
  unit<B, MT, 1>(w, xchunk, xoff, info, gl, s_sc, a);
}

// Per-lane copy state of the warp's weight stream: the current run's source pointer and stride.
struct IssueCursor {
  const uint32_t* src;  // this lane's first word of the next chunk
  long long step;       // words per chunk in this run (J * 64 * bits)
  int left;             // chunks left in this run
  int nvec;             // 16-byte vectors this lane copies per chunk
  int run;
};

__device__ __forceinline__ void cursor_at(const QDesc& d, IssueCursor& ic, int run, int c, int J, int j, int lane) {
  const Run& r = d.runs[run];
  ic.run = run;
  ic.step = (long long)J * 64 * r.bits;
  ic.left = r.chunk_end - c;
  ic.nvec = (16 * r.bits - lane + 31) >> 5;  // vectors lane, lane+32, ... below 16*bits
  ic.src = d.packed + r.word_base + (long long)(c - r.chunk_start) * ic.step + (long long)j * 64 * r.bits + 4 * lane;
}

// Register cap so the grid's blocks (planned at 4 per SM, 3 for M > 16) are all resident at once.
template <int MT>
__global__ void __launch_bounds__(128, MT <= 2 ? 4 : 3) gemm_kernel(const __grid_constant__ GemmParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
  int di = 0;
  while (di + 1 < p.ndesc && (int)blockIdx.x >= p.d[di + 1].block_start) ++di;
  const QDesc& d = p.d[di];
  const int local = blockIdx.x - d.block_start;
  const int colblk = local % d.ncolblk, split = local / d.ncolblk;
  int c0, c1;
  split_range(d, split, c0, c1);
  const int nch = c1 - c0;
  const int nblk0 = colblk * kBlockCols, n0 = nblk0 + warp * kWarpCols;
  const bool active = n0 < d.Np;
  const int J = d.Np / kWarpCols, j = n0 / kWarpCols;
  const int M = p.M;

  uint32_t* ring = reinterpret_cast<uint32_t*>(smem) + warp * kStages * p.slot_words;
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring) + 16 * lane;
  __half* xs = reinterpret_cast<__half*>(smem + p.off_x);
  uint2* s_sc = reinterpret_cast<uint2*>(smem + p.off_scale);
  int* s_info = reinterpret_cast<int*>(smem + p.off_info);

  // Weight prefetch first: it depends on nothing staged below.
  int run0 = 0;
  while (run0 + 1 < d.nruns && c0 >= d.runs[run0].chunk_end) ++run0;
  IssueCursor ic;
  cursor_at(d, ic, run0, c0, J, j, lane);
  int issued = 0, islot = 0;
  const int to_issue = active ? nch : 0;
  auto issue = [&]() {
    if (issued < to_issue) {
      if (ic.left == 0) cursor_at(d, ic, ic.run + 1, d.runs[ic.run + 1].chunk_start, J, j, lane);
      const uint32_t dst = ring_s + islot * (p.slot_words * 4);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < ic.nvec) cp_async16(dst + 512 * k, ic.src + 128 * k);
      ic.src += ic.step;
      --ic.left;
      ++issued;
    }
    cp_async_commit();
    islot = islot + 1 == kStages ? 0 : islot + 1;
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue();

  // Chunk info, and the fp16 scale of every (group, column) this block touches, laid out per lane.
  int g_first = 0, ngrp = 0;
  if (nch > 0) {
    const int last = __ldg(d.info + c1 - 1);
    g_first = __ldg(d.info + c0) & kInfoGroupMask;
    ngrp = (last & kInfoGroupMask) + ((last >> 30) & 1) - g_first + 1;
  }
  for (int i = tid; i < nch; i += blockDim.x) s_info[i] = __ldg(d.info + c0 + i);
  {
    const int n = nblk0 + tid;  // this thread's column; its slot in the lane layout of flush():
    __half* dst = reinterpret_cast<__half*>(s_sc) + ((tid >> 5) * 8 + (tid & 7)) * 4 + ((tid >> 4) & 1) * 2 +
                  ((tid >> 3) & 1);
    if (n < d.Np) {
      const uint32_t* codes = d.scales + n / 8;
      const int sh = 4 * (n & 7);
      for (int g0 = 0; g0 < ngrp; g0 += 8) {
        uint32_t cw[8];
        float mx[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (g0 + u < ngrp) {
            cw[u] = __ldg(codes + (size_t)(g_first + g0 + u) * (d.Np / 8));
            mx[u] = __ldg(d.maxf + g_first + g0 + u);
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const float c1 = (float)(((cw[u] >> sh) & 15u) + 1);  // fp16(fp16((c+1)^2) * max16), see scale_of
          if (g0 + u < ngrp) dst[(g0 + u) * (kBlockWarps * 8 * 4)] = __float2half_rn(c1 * c1 * mx[u]);
        }
      }
    }
  }

  TileAcc<MT> a;
  tile_zero(a);
  int xoff[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xoff[mt] = min(mt * 8 + gid, M - 1) * p.xstride + 8 * t4;  // tokens >= M: discarded
  int gl = 0, prun = run0, pleft = d.runs[run0].chunk_end - c0, pslot = 0;
  int pbits = d.runs[run0].bits;
  const uint2* s_sc_lane = s_sc + warp * 8 + gid;

  for (int w0 = 0; w0 < nch; w0 += p.xwin) {
    const int w1 = min(nch, w0 + p.xwin);
    // Activations of this window in stored (padded) row order: xs[m][row]. Items (8-row vector, token) are
    // gathered kGatherBatch at a time per thread so their loads overlap.
    const int vecs = (w1 - w0) * (kChunkRows / 8), items = vecs * M;
    const uint4* xmv = reinterpret_cast<const uint4*>(d.xmap + (c0 + w0) * kChunkRows);
    const unsigned short* xg = reinterpret_cast<const unsigned short*>(p.x);
    for (int base = tid; base < items; base += kGatherBatch * 128) {
      uint4 xm[kGatherBatch];
      int ev[kGatherBatch], mv[kGatherBatch];
#pragma unroll
      for (int u = 0; u < kGatherBatch; ++u) {
        const int it = base + 128 * u;
        ev[u] = it / M;
        mv[u] = it - ev[u] * M;
        if (it < items) xm[u] = __ldg(xmv + ev[u]);
      }
      uint32_t val[kGatherBatch][4];
#pragma unroll
      for (int u = 0; u < kGatherBatch; ++u) {
        if (base + 128 * u < items) {
          const unsigned short* xr = xg + (size_t)mv[u] * p.ldx;
          const uint32_t pr[4] = {xm[u].x, xm[u].y, xm[u].z, xm[u].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint32_t i0 = pr[q] & 0xFFFFu, i1 = pr[q] >> 16;
            const uint32_t v0 = i0 == 0xFFFFu ? 0u : (uint32_t)__ldg(xr + i0);
            const uint32_t v1 = i1 == 0xFFFFu ? 0u : (uint32_t)__ldg(xr + i1);
            val[u][q] = v0 | (v1 << 16);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kGatherBatch; ++u)
        if (base + 128 * u < items)
          *reinterpret_cast<uint4*>(xs + mv[u] * p.xstride + ev[u] * 8) =
              make_uint4(val[u][0], val[u][1], val[u][2], val[u][3]);
    }
    __syncthreads();
    if (active) {
      const __half* xchunk = xs;
#pragma unroll 1
      for (int i = w0; i < w1; ++i) {
        issue();
        cp_async_wait<kStages - 1>();
        __syncwarp();
        if (pleft == 0) {
          ++prun;
          pbits = d.runs[prun].bits;
          pleft = d.runs[prun].chunk_end - d.runs[prun].chunk_start;
        }
        --pleft;
        const uint32_t* slot = ring + pslot * p.slot_words;
        pslot = pslot + 1 == kStages ? 0 : pslot + 1;
        const int info = s_info[i];
        switch (pbits) {
          case 8: chunk<8, MT>(slot, lane, xchunk, xoff, info, gl, s_sc_lane, a); break;
          case 6: chunk<6, MT>(slot, lane, xchunk, xoff, info, gl, s_sc_lane, a); break;
          case 5: chunk<5, MT>(slot, lane, xchunk, xoff, info, gl, s_sc_lane, a); break;
          case 4: chunk<4, MT>(slot, lane, xchunk, xoff, info, gl, s_sc_lane, a); break;
          case 3: chunk<3, MT>(slot, lane, xchunk, xoff, info, gl, s_sc_lane, a); break;
          default: chunk<2, MT>(slot, lane, xchunk, xoff, info, gl, s_sc_lane, a); break;
        }
        xchunk += kChunkRows;
        __syncwarp();  // the slot is refilled by the next iteration's issue
      }
    }
    __syncthreads();  // the next window overwrites xs
  }
  // A group that continues past this split is scaled here (its partial is linear in the scale).
  if (active && nch > 0 && !((s_info[nch - 1] >> 31) & 1)) tile_flush(a, s_sc_lane[gl * (kBlockWarps * 8)]);

  if (d.ksplit == 1) {
    if (active) gv_store<MT>(d, a, n0, M, split, false);
    return;
  }
  if (active) gv_store<MT>(d, a, n0, M, split, true);
  // Ticket: the block's partials are released by one gpu-scope acq_rel atomic after the barrier (cumulative
  // over the other threads' stores); the last block acquires them the same way.
  __syncthreads();
  __shared__ int s_last;
  if (tid == 0) s_last = gv_ticket(d, colblk, d.ksplit);
  __syncthreads();
  if (!s_last) return;
  const int ncols = min(kBlockCols, d.N - nblk0);
  for (int e = tid; e < ncols * M; e += blockDim.x) {
    const int m = e / ncols, n = nblk0 + e % ncols;
    const float* src = d.ws + (size_t)m * d.Np + n;
    const size_t stride = (size_t)M * d.Np;
    float v = 0.f;
    for (int s0 = 0; s0 < d.ksplit; s0 += 8) {  // 8 loads in flight, summed in split order
      float t[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) t[u] = s0 + u < d.ksplit ? __ldcg(src + (s0 + u) * stride) : 0.f;
#pragma unroll
      for (int u = 0; u < 8; ++u) v += t[u];
    }
    if (d.bias) v += __half2float(d.bias[n]);
    d.out[(size_t)m * d.ldo + n] = __float2half_rn(v);
  }
  if (tid == 0) d.counters[colblk] = 0;  // ready for the next launch (and graph replay)
}

inline int align16(int x) { return (x + 15) & ~15; }

int parse_desc(const int64_t* f, QDesc& d) {
  d.packed = reinterpret_cast<const uint32_t*>(f[F_PACKED]);
  d.scales = reinterpret_cast<const uint32_t*>(f[F_SCALES]);
  d.maxf = reinterpret_cast<const float*>(f[F_MAXF]);
  d.info = reinterpret_cast<const int*>(f[F_INFO]);
  d.xmap = reinterpret_cast<const uint16_t*>(f[F_XMAP]);
  d.bias = reinterpret_cast<const __half*>(f[F_BIAS]);
  d.out = reinterpret_cast<__half*>(f[F_OUT]);
  d.ws = reinterpret_cast<float*>(f[F_WS]);
  d.counters = reinterpret_cast<int*>(f[F_COUNTERS]);
  d.ldo = (int)f[F_LDO]; d.K = (int)f[F_K]; d.Kpad = (int)f[F_KPAD]; d.N = (int)f[F_N]; d.Np = (int)f[F_NP];
  d.C = (int)f[F_C]; d.G = (int)f[F_G]; d.nruns = (int)f[F_NRUNS]; d.ksplit = (int)f[F_KSPLIT];
  EXL2_REQUIRE(d.packed && d.scales && d.maxf && d.info && d.xmap, "exl2 desc: null tensor pointer");
  EXL2_REQUIRE(d.Np > 0 && d.Np % 32 == 0 && d.N > 0 && d.N <= d.Np, "exl2 desc: bad N=%d Np=%d", d.N, d.Np);
  EXL2_REQUIRE(d.C > 0 && d.Kpad == d.C * kChunkRows && d.K <= d.Kpad && d.K <= 65535,
               "exl2 desc: bad K=%d Kpad=%d C=%d", d.K, d.Kpad, d.C);
  EXL2_REQUIRE(d.nruns >= 1 && d.nruns <= kMaxRuns, "exl2 desc: bad run count %d", d.nruns);
  int expect = 0, prev_bits = 9;
  for (int r = 0; r < kMaxRuns; ++r) {
    const int64_t* rr = f + F_RUNS + 4 * r;
    d.runs[r] = Run{(int)rr[0], (int)rr[1], (int)rr[2], (long long)rr[3]};
    if (r >= d.nruns) continue;
    const Run& x = d.runs[r];
    const bool width_ok = x.bits == 2 || x.bits == 3 || x.bits == 4 || x.bits == 5 || x.bits == 6 || x.bits == 8;
    EXL2_REQUIRE(width_ok && x.bits < prev_bits && x.chunk_start == expect && x.chunk_end > x.chunk_start,
                 "exl2 desc: bad run %d (bits %d, chunks %d..%d)", r, x.bits, x.chunk_start, x.chunk_end);
    prev_bits = x.bits;
    expect = x.chunk_end;
  }
  EXL2_REQUIRE(expect == d.C, "exl2 desc: runs cover %d of %d chunks", expect, d.C);
  for (int r = d.nruns; r < kMaxRuns; ++r) d.runs[r] = Run{8, d.C, 1 << 30, 0};  // sentinel for run cursors
  d.ncolblk = (d.Np + kBlockCols - 1) / kBlockCols;
  return EXL2_OK;
}

template <int MT>
int launch(const GemmParams& p, int blocks, int smem, cudaStream_t stream) {
  int& smem_set = smem_set_for_device(kGemmFuncId + MT - 1);
  if (smem_set == 0) {  // a hint: ask for the largest shared-memory carveout so planned blocks stay resident
    if (cudaFuncSetAttribute(gemm_kernel<MT>, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
      (void)cudaGetLastError();  // not fatal; clear it so check_launch does not report it
    smem_set = 48 * 1024;
  }
  if (smem > smem_set) {
    cudaError_t err = cudaFuncSetAttribute(gemm_kernel<MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return exl2::set_error((int)err, "exl2_gemm: %d bytes of shared memory: %s", smem,
                                                   cudaGetErrorString(err));
    smem_set = smem;
  }
  gemm_kernel<MT><<<blocks, kBlockWarps * 32, smem, stream>>>(p);
  return exl2::check_launch("exl2_gemm");
}

}  // namespace
}  // namespace exl2q

using namespace exl2q;

// blob: ndesc descriptors of kDescLen int64 (BlobField order); x: fp16 [M, ldx] device pointer.
EXL2_API int exl2_gemm(const int64_t* blob, int ndesc, const void* x, int M, int ldx, void* stream) {
  EXL2_REQUIRE(blob && x, "exl2_gemm: null argument");
  EXL2_REQUIRE(ndesc >= 1 && ndesc <= kMaxDesc, "exl2_gemm: %d descriptors (1..%d)", ndesc, kMaxDesc);
  EXL2_REQUIRE(M >= 1 && M <= 32, "exl2_gemm: M=%d outside 1..32", M);
  GemmParams p{};
  p.x = reinterpret_cast<const __half*>(x);
  p.ndesc = ndesc; p.M = M; p.ldx = ldx;
  int blocks = 0, maxnch = 1, max_bits = 2, ngrp_max = 1;
  for (int i = 0; i < ndesc; ++i) {
    QDesc& d = p.d[i];
    int st = parse_desc(blob + (size_t)i * kDescLen, d);
    if (st) return st;
    EXL2_REQUIRE(ldx >= d.K && d.ldo >= d.N && d.out, "exl2_gemm: bad ldx=%d/ldo=%d for K=%d N=%d", ldx, d.ldo,
                 d.K, d.N);
    EXL2_REQUIRE(d.ksplit >= 1 && d.ksplit <= d.C, "exl2_gemm: ksplit %d outside 1..%d", d.ksplit, d.C);
    EXL2_REQUIRE(d.ksplit == 1 || (d.ws && d.counters), "exl2_gemm: split-K needs a workspace and counters");
    d.block_start = blocks;
    blocks += d.ncolblk * d.ksplit;
    int most = 0;
    for (int s = 0; s < d.ksplit; ++s) {
      int a, b;
      split_range(d, s, a, b);
      most = std::max(most, b - a);
    }
    maxnch = std::max(maxnch, most);
    max_bits = std::max(max_bits, d.runs[0].bits);
    ngrp_max = std::max(ngrp_max, std::min(d.G, 2 * most));
  }
  p.slot_words = 64 * max_bits;
  p.xwin = std::max(1, std::min(maxnch, 16384 / (M * kChunkRows)));  // <= 32 KB of activations
  p.xstride = p.xwin * kChunkRows + 32;  // +64 bytes: token rows land in different banks
  int off = kBlockWarps * kStages * p.slot_words * 4;
  p.off_x = off; off = align16(off + M * p.xstride * 2);
  p.off_scale = off; off = align16(off + ngrp_max * kBlockCols * 2);  // fp16 scale per (group, column)
  p.off_info = off; off = align16(off + maxnch * 4);
  EXL2_REQUIRE(off <= 227 * 1024, "exl2_gemm: needs %d bytes of shared memory; use a larger ksplit", off);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch ((M + 7) / 8) {
    case 1: return launch<1>(p, blocks, off, s);
    case 2: return launch<2>(p, blocks, off, s);
    case 3: return launch<3>(p, blocks, off, s);
    default: return launch<4>(p, blocks, off, s);
  }
}

// =========================================================================================================
// Small-M GEMV (M = 1..8): same packed layout, designed for bytes in flight.
//
// Grid: exactly one wave. Block: 8 warps on 8 adjacent 32-column warp tiles (256 columns), one K split shared
// by all warps (so the activation gather into shared memory is shared). Each warp streams its tile's chunks
// straight into registers (no shared-memory ring): two register batches of CH chunks (~16 words per lane each),
// ping-ponged so one batch is always loading while the other is decoded (2..4 KB in flight per warp), with
// 16-byte non-allocating global loads. Decode is the fp16 mantissa trick into mma.m16n8k16 A registers with
// tokens as N (all M <= 8 cost the same). Scales are precomputed at load time as fp16 in the lane layout
// ([G][J][8 gid] uint2), so a group's scales are one 8-byte load issued a whole group ahead of use. Split-K
// partials are reduced in split order by the last block of each column block (deterministic).
// =========================================================================================================
namespace exl2q {
namespace {

constexpr int kGvPrefetch = 4;  // chunk tiles per warp prefetched into L2 before the gather

// Predicated streaming loads: the predicate lives inside the asm, so the outputs count as always written and
// the register batches are never kept alive across a skipped load (which made ptxas spill them).
__device__ __forceinline__ uint4 ldg_stream4(const uint32_t* p, bool ok) {
  uint4 r;
  asm volatile("{.reg .pred q; setp.ne.b32 q, %5, 0; @q ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];}"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "r"((int)ok));
  return r;
}
__device__ __forceinline__ uint2 ldg_stream2(const uint32_t* p, bool ok) {
  uint2 r;
  asm volatile("{.reg .pred q; setp.ne.b32 q, %3, 0; @q ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];}"
               : "=r"(r.x), "=r"(r.y) : "l"(p), "r"((int)ok));
  return r;
}
__device__ __forceinline__ uint32_t ldg_stream1(const uint32_t* p, bool ok) {
  uint32_t r;
  asm volatile("{.reg .pred q; setp.ne.b32 q, %2, 0; @q ld.global.nc.L1::no_allocate.u32 %0, [%1];}"
               : "=r"(r) : "l"(p), "r"((int)ok));
  return r;
}
__device__ __forceinline__ int ldg_info(const int* p, bool ok) {
  int r;
  asm volatile("{.reg .pred q; setp.ne.b32 q, %2, 0; @q ld.global.nc.u32 %0, [%1];}" : "=r"(r) : "l"(p), "r"((int)ok));
  return r;
}

// Chunks per register batch by width: ~16 words per lane (2*B words per chunk).
template <int B>
constexpr int gv_ch() { return B == 8 ? 1 : B == 6 ? 1 : B == 5 ? 1 : B == 4 ? 2 : B == 3 ? 2 : 4; }

// The lane's 2*B words of one chunk tile (tile = start of its 64*B words).
template <int B>
__device__ __forceinline__ void gv_load(const uint32_t* tile, int lane, uint32_t (&w)[2][B], bool ok) {
  constexpr int m = main_words(B), a = B - m;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const uint32_t* p = tile + (nt * 32 + lane) * m;
    if constexpr (m == 8) {
      uint4 u = ldg_stream4(p, ok), v = ldg_stream4(p + 4, ok);
      w[nt][0] = u.x; w[nt][1] = u.y; w[nt][2] = u.z; w[nt][3] = u.w;
      w[nt][4] = v.x; w[nt][5] = v.y; w[nt][6] = v.z; w[nt][7] = v.w;
    } else if constexpr (m == 4) {
      uint4 u = ldg_stream4(p, ok);
      w[nt][0] = u.x; w[nt][1] = u.y; w[nt][2] = u.z; w[nt][3] = u.w;
    } else {
      uint2 u = ldg_stream2(p, ok);
      w[nt][0] = u.x; w[nt][1] = u.y;
    }
    const uint32_t* q = tile + 64 * m + (nt * 32 + lane) * a;
    if constexpr (a == 2) {
      uint2 u = ldg_stream2(q, ok);
      w[nt][m] = u.x; w[nt][m + 1] = u.y;
    } else if constexpr (a == 1) {
      w[nt][m] = ldg_stream1(q, ok);
    }
  }
}

// Chunks [cs, ce) of one width run, ping-ponging two register batches.
template <int B>
__device__ __forceinline__ void gv_run(const GemvParams& p, const QDesc& d, const Run& run, int cs, int ce, int c0,
                                       int J, int j, int lane, const __half* xl, GvState& s,
                                       const uint2* scl_lane, __half* xs) {
  constexpr int CH = gv_ch<B>();
  const long long step = (long long)J * 64 * B;
  const uint32_t* tile0 = d.packed + run.word_base + (long long)(cs - run.chunk_start) * step + (long long)j * 64 * B;
  uint32_t wa[CH][2][B], wb[CH][2][B];
  int ia[CH], ib[CH];
  auto load = [&](uint32_t (&w)[CH][2][B], int (&inf)[CH], int c) {
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const bool ok = c + i < ce;
      gv_load<B>(tile0 + (long long)(c + i - cs) * step, lane, w[i], ok);
      inf[i] = ldg_info(d.info + c + i, ok);
    }
  };
  auto compute = [&](const uint32_t (&w)[CH][2][B], const int (&inf)[CH], int c) {
#pragma unroll
    for (int i = 0; i < CH; ++i)
      if (c + i < ce) gv_chunk<B>(w[i], inf[i], xl + (c + i - c0) * kChunkRows, s, scl_lane, J * 8, d.G);
  };
  load(wa, ia, cs);
  load(wb, ib, cs + CH);
  unsigned short* xm = reinterpret_cast<unsigned short*>(xs + p.M * p.xstride);
  gv_load_xmap(d, c0, ce - c0, xm, kGvWarps * 32);
  __syncthreads();
  // PDL: the constant loads above may run while the previous kernel finishes; x (and every write) comes after it.
  exl2::pdl_wait();
  // the activation gather overlaps the first two batches' DRAM reads
  gv_gather_items(p, ce - c0, xs, xm, kGvWarps * 32);
  __syncthreads();
#pragma unroll 1
  for (int c = cs; c < ce; c += 2 * CH) {
    compute(wa, ia, c);
    load(wa, ia, c + 2 * CH);
    compute(wb, ib, c + CH);
    load(wb, ib, c + 3 * CH);
  }
}

// The whole block for one width: [c0, c1) lies inside run `ri` (blocks never cross runs, so each width's code
// path is allocated on its own: one kernel body mixing widths made ptxas spill the register batches).
template <int B>
__device__ __forceinline__ void gv_block(const GemvParams& p, const QDesc& d, int di, int ri, int colblk, int gsplit,
                                         int ksplit, int c0, int c1) {
  extern __shared__ __align__(16) unsigned char smem[];
  __half* xs = reinterpret_cast<__half*>(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
  const int J = d.Np / kWarpCols;
  const int jw = colblk * kGvWarps + warp;
  const bool active = jw < J;
  const int j = active ? jw : J - 1;  // idle warps of a partial column block shadow the last tile (never write)
  const int M = p.M;
  const Run& run = d.runs[ri];
  const uint2* scl_lane = p.scl[di] + (size_t)j * 8 + gid;
  exl2::pdl_launch_dependents();  // every block is resident now: the next kernel may launch into freed SMs
  {  // start the first chunk tiles' DRAM reads (into L2) before the dependent activation gather
    const int c = c0 + lane;
    if (lane < kGvPrefetch && c < c1) {
      const uint32_t* t = d.packed + run.word_base + ((long long)(c - run.chunk_start) * J + j) * 64 * B;
#if __CUDA_ARCH__ >= 900
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(t), "r"(256 * B) : "memory");
#else
      asm volatile("prefetch.global.L2 [%0];" ::"l"(t));  // sm_80..89: no bulk prefetch, touch the first line
#endif
    }
  }
  GvState s;
  gv_zero(s);
  s.g = __ldg(d.info + c0) & kInfoGroupMask;
  s.sc = __ldg(scl_lane + (size_t)s.g * J * 8);
  const __half* xl = xs + min(gid, M - 1) * p.xstride + 8 * t4;  // tokens >= M: duplicates, discarded
  gv_run<B>(p, d, run, c0, c1, c0, J, j, lane, xl, s, scl_lane, xs);  // gathers x after its first loads
  // A group that continues past this split is scaled here (its partial is linear in the scale).
  if (!((__ldg(d.info + c1 - 1) >> 31) & 1)) gv_flush(s);

  if (ksplit == 1) {
    if (active) gv_store<1>(d, s, jw * kWarpCols, M, gsplit, false);
    return;
  }
  if (active) gv_store<1>(d, s, jw * kWarpCols, M, gsplit, true);
  __syncthreads();
  __shared__ int s_last;
  if (tid == 0) s_last = gv_ticket(d, colblk, ksplit);
  __syncthreads();
  if (!s_last) return;
  gv_reduce_partials(d, colblk, ksplit, M, tid, blockDim.x);
  if (tid == 0) d.counters[colblk] = 0;  // ready for the next launch (and graph replay)
}

template <int MINB>
__global__ void __launch_bounds__(kGvWarps * 32, MINB) gemv_kernel(const __grid_constant__ GemvParams p) {
  const GvWork w = gv_work(p);
  const QDesc& d = p.d[w.di];
  const int di = w.di, ri = w.ri, colblk = w.colblk, gsplit = w.gsplit, ksplit = w.ksplit, c0 = w.c0, c1 = w.c1;
  const Run& r = d.runs[ri];
  switch (r.bits) {
    case 8: gv_block<8>(p, d, di, ri, colblk, gsplit, ksplit, c0, c1); break;
    case 6: gv_block<6>(p, d, di, ri, colblk, gsplit, ksplit, c0, c1); break;
    case 5: gv_block<5>(p, d, di, ri, colblk, gsplit, ksplit, c0, c1); break;
    case 4: gv_block<4>(p, d, di, ri, colblk, gsplit, ksplit, c0, c1); break;
    case 3: gv_block<3>(p, d, di, ri, colblk, gsplit, ksplit, c0, c1); break;
    default: gv_block<2>(p, d, di, ri, colblk, gsplit, ksplit, c0, c1); break;
  }
}

template <int MINB>
int gemv_launch(const GemvParams& p, int blocks, int smem, cudaStream_t stream) {
  int& smem_set = smem_set_for_device(MINB == 3 ? kGemv3FuncId : kGemv2FuncId);
  if (smem_set == 0) {
    if (cudaFuncSetAttribute(gemv_kernel<MINB>, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
      (void)cudaGetLastError();
    smem_set = 48 * 1024;
  }
  if (smem > smem_set) {
    cudaError_t err = cudaFuncSetAttribute(gemv_kernel<MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
      return exl2::set_error((int)err, "exl2_gemv: %d bytes of shared memory: %s", smem, cudaGetErrorString(err));
    smem_set = smem;
  }
  exl2::launch_kernel(gemv_kernel<MINB>, blocks, kGvWarps * 32, smem, stream, p);
  return exl2::check_launch("exl2_gemv");
}

}  // namespace
}  // namespace exl2q

namespace {
// Exactly `total` splits over the runs of d (shares by bytes, at least 1 and at most the run's chunks each), for
// the TMA kernel's cluster mode where every descriptor's split count is the cluster size. False if impossible.
bool exact_run_splits(const exl2q::QDesc& d, int total, int* rbase, int& maxnch) {
  using namespace exl2q;
  if (total < d.nruns) return false;
  const long long w = total_weight(d);
  int k[kMaxRuns], sum = 0;
  for (int r = 0; r < d.nruns; ++r) {
    const int nr = d.runs[r].chunk_end - d.runs[r].chunk_start;
    k[r] = (int)std::min<long long>(nr, std::max<long long>(1, (long long)total * nr * d.runs[r].bits / w));
    sum += k[r];
  }
  for (int guard = 0; sum != total && guard < 4 * total + 8; ++guard) {  // one split at a time, widest run first
    for (int r = 0; r < d.nruns && sum != total; ++r) {
      const int nr = d.runs[r].chunk_end - d.runs[r].chunk_start;
      if (sum < total && k[r] < nr) { ++k[r]; ++sum; }
      else if (sum > total && k[r] > 1) { --k[r]; --sum; }
    }
  }
  if (sum != total) return false;
  int acc = 0;
  for (int r = 0; r < d.nruns; ++r) {
    const int nr = d.runs[r].chunk_end - d.runs[r].chunk_start;
    rbase[r] = acc;
    acc += k[r];
    maxnch = std::max(maxnch, (nr + k[r] - 1) / k[r]);
  }
  rbase[d.nruns] = acc;
  return true;
}
}  // namespace

// Small-M GEMV (M = 1..8; 1..32 with the TMA kernel, one decode feeding up to 4 token tiles). blob: ndesc
// descriptors (kDescLen int64, F_SCL16 set, F_KSPLIT the split count);
// minb: 0 = the TMA-ring kernel on sm_90+ (the register-batch kernel with 2 blocks per SM below sm_90); 1 = the
// same with its split-K reduced inside thread-block clusters (lost: H200 call F1 of 2026-12-02, down 21.8 against
// 15.0 us, q/o 11.0 against 7.5; off by default); 2 or 3 =
// the register-batch kernel variant with that many planned resident blocks per SM. Same output/workspace contract as exl2_gemm,
// with column blocks of 256 (counters: one per 256-column block).
// gate_off > 0: fused silu_mul input (x [M, ldx] holds gate at columns [0, K) and up at [gate_off, gate_off + K)).
namespace exl2q {
int gemv_plan(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off, int minb, const void* xpre,
              int xpre_ld, const GemvNorm* norm, GemvParams& p, GemvPlan& pl, bool allow_span) {
  EXL2_REQUIRE(blob && x, "exl2_gemv: null argument");
  EXL2_REQUIRE(ndesc >= 1 && ndesc <= kMaxDesc, "exl2_gemv: %d descriptors (1..%d)", ndesc, kMaxDesc);
  EXL2_REQUIRE(M >= 1 && M <= 32, "exl2_gemv: M=%d outside 1..32", M);
  EXL2_REQUIRE(minb >= 0 && minb <= 3, "exl2_gemv: minb %d (0..3)", minb);
  p = GemvParams{};
  pl = GemvPlan{0, 0, false};
  p.x = reinterpret_cast<const __half*>(x);
  p.ndesc = ndesc; p.M = M; p.ldx = ldx; p.gate_off = gate_off;
  p.xpre = reinterpret_cast<const __half*>(xpre);
  p.xpre_ld = xpre_ld;
  EXL2_REQUIRE(!xpre || (xpre_ld > 0 && xpre_ld % 8 == 0 && reinterpret_cast<uintptr_t>(xpre) % 16 == 0),
               "exl2_gemv: pre-gathered input needs a row stride that is a multiple of 8 and 16-byte alignment");
  EXL2_REQUIRE(gate_off >= 0, "exl2_gemv: gate_off %d < 0", gate_off);
  int blocks = 0, maxnch = 1;
  for (int i = 0; i < ndesc; ++i) {
    QDesc& d = p.d[i];
    const int64_t* f = blob + (size_t)i * kDescLen;
    int st = parse_desc(f, d);
    if (st) return st;
    p.scl[i] = reinterpret_cast<const uint2*>(f[F_SCL16]);
    EXL2_REQUIRE(p.scl[i], "exl2_gemv: no fp16 scales");
    EXL2_REQUIRE(ldx >= d.K + gate_off && d.ldo >= d.N && d.out, "exl2_gemv: bad ldx=%d/ldo=%d for K=%d N=%d",
                 ldx, d.ldo, d.K, d.N);
    EXL2_REQUIRE(gate_off == 0 || gate_off >= d.K, "exl2_gemv: gate_off %d overlaps the gate (K=%d)", gate_off, d.K);
    EXL2_REQUIRE(d.ksplit >= 1 && d.ksplit <= d.C, "exl2_gemv: ksplit %d outside 1..%d", d.ksplit, d.C);
    EXL2_REQUIRE(!xpre || d.Kpad <= xpre_ld, "exl2_gemv: pre-gathered rows %d < Kpad %d", xpre_ld, d.Kpad);
    EXL2_REQUIRE(d.ksplit == 1 || (d.ws && d.counters), "exl2_gemv: split-K needs a workspace and counters");
    d.ncolblk = (d.Np + kGvCols - 1) / kGvCols;
    d.block_start = blocks;
    const int total = proportional_run_splits(d, p.rbase[i], maxnch);
    EXL2_REQUIRE(total <= d.ksplit + kMaxRuns, "exl2_gemv: %d splits", total);
    blocks += d.ncolblk * total;
  }
  p.xstride = maxnch * kChunkRows + 8;  // +16 bytes: token rows start in different banks
  p.maxnch = maxnch;
  if (minb <= 1) {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      major = 0;
    }
    if (major >= 9) {
      // Ring: enough bytes in flight for the bandwidth, no more: everything a block loads through the cache
      // (activations, chunk info) queues behind its ring's copies. H200 call AJ3 of 2026-12-04, 8B decode step
      // (interleaved twice): 16 KB 2.266 / 2.266 ms, 20 KB 2.272 / 2.266, 24 KB 2.250 / 2.249, 28 KB 2.249 /
      // 2.250, 32 KB 2.275 / 2.280 (4-bit slots are 8 KB: three in flight at 24 KB). EXL2_GEMV_RING_KB overrides.
      static const int ring_kb = [] {
        const char* e = getenv("EXL2_GEMV_RING_KB");
        return e && atoi(e) > 0 ? atoi(e) : 24;
      }();
      static const int probe = [] {
        const char* e = getenv("EXL2_GEMV_PROBE");
        const int v = e ? atoi(e) & 7 : 0;
        if (v) fprintf(stderr, "exl2_backend: EXL2_GEMV_PROBE=%d: GEMV timing probe, results are WRONG\n", v);
        return v;
      }();
      p.probe = probe;
      static const int gather_mode = [] {  // EXL2_GEMV_GATHER=rows|items forces one gather (GemvParams)
        const char* e = getenv("EXL2_GEMV_GATHER");
        if (!e) return kGatherAuto;
        return strcmp(e, "rows") == 0 ? kGatherRows : strcmp(e, "items") == 0 ? kGatherItems : kGatherAuto;
      }();
      p.gather_mode = gather_mode;
      // The split-K sum four columns per item (H200 call H1: the 8B's k = 4 verify 1.29x a decode step against
      // 1.39x one column per item); EXL2_GEMV_REDUCE=scalar for the old walk.
      static const int reduce_vec4 = [] {
        const char* e = getenv("EXL2_GEMV_REDUCE");
        return e && strcmp(e, "scalar") == 0 ? 0 : 1;
      }();
      p.reduce_vec4 = reduce_vec4;
      // minb 1: cluster split-K. Every descriptor gets exactly ksplit splits, reduced inside a cluster of that
      // many blocks (2..16) through distributed shared memory; the ticket path where that is not possible.
      const int C = p.d[0].ksplit;
      bool cluster = minb == 1 && C >= 2 && C <= 16 && !(probe & kProbeNoReduce);
      for (int i = 0; i < ndesc && cluster; ++i) cluster = p.d[i].ksplit == C;
      if (cluster) {
        int rb[kMaxDesc][kMaxRuns + 1], mx = 1;
        for (int i = 0; i < ndesc && cluster; ++i) cluster = exact_run_splits(p.d[i], C, rb[i], mx);
        if (cluster) {
          blocks = 0;
          for (int i = 0; i < ndesc; ++i) {
            for (int r = 0; r <= p.d[i].nruns; ++r) p.rbase[i][r] = rb[i][r];
            p.d[i].block_start = blocks;
            blocks += p.d[i].ncolblk * C;
          }
          maxnch = mx;
          p.xstride = maxnch * kChunkRows + 8;
          p.maxnch = maxnch;
          p.cluster = C;
        }
      }
      // Per-run splits balanced by bytes within the launch's planned blocks, then span splits where they pay
      // (exl2_gemv_splits.cuh).
      if (!p.cluster) refine_splits(p, blob, (int)blob[F_SLOTS], allow_span && !probe, blocks, maxnch);
      p.xstride = maxnch * kChunkRows + 8;
      p.maxnch = maxnch;
      static const int prefetch_kb = [] {  // L2 prefetch past the ring, KB per block (0 = off until measured)
        const char* e = getenv("EXL2_GEMV_PREFETCH_KB");
        return e && atoi(e) > 0 ? atoi(e) : 0;
      }();
      p.maxgrp = staged_groups(blob, ndesc, maxnch);
      if (norm) {
        const int K = p.d[0].K;
        for (int i = 1; i < ndesc; ++i)
          EXL2_REQUIRE(p.d[i].K == K, "exl2_gemv_add_norm: parts with different K (%d, %d)", K, p.d[i].K);
        EXL2_REQUIRE(gate_off == 0 && !xpre && !p.cluster && !probe, "exl2_gemv_add_norm: no gated, pre-gathered, "
                     "cluster or probe launch");
        p.norm_k = K;
        p.norm_nt = norm_row_threads(K);
        EXL2_REQUIRE(K % kNormVec == 0 && p.norm_nt <= kMaxNormThreads, "exl2_gemv_add_norm: K=%d must be a "
                     "multiple of %d and at most %d", K, kNormVec, kMaxNormThreads * kNormVec * kNormMaxVecs);
        p.norm_res = reinterpret_cast<const __half*>(norm->res);
        p.norm_w = reinterpret_cast<const __half*>(norm->w);
        p.norm_res_out = reinterpret_cast<__half*>(norm->res_out);
        p.norm_res_ld = norm->res_ld;
        p.norm_res_out_ld = norm->res_out_ld;
        p.norm_eps = norm->eps;
      }
      if (gate_off > 0 && !xpre) {  // the gated input by vectors (gv_gather_gated_runs)
        EXL2_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 8 == 0 && gate_off % 8 == 0,
                     "exl2_gemv: a gated input needs 16-byte alignment and ldx, gate_off multiples of 8 (ldx %d, "
                     "gate_off %d); pre-gather it instead", ldx, gate_off);
        for (int i = 0; i < ndesc; ++i)
          EXL2_REQUIRE(blob[(size_t)i * kDescLen + F_VEC8] == 1, "exl2_gemv: a gated input needs the rows of "
                       "part %d in aligned runs of 8 features (F_VEC8); pre-gather it instead", i);
      }
      if (const int64_t* rope = reinterpret_cast<const int64_t*>(blob[F_ROPE])) {
        EXL2_REQUIRE(!p.cluster && !probe, "exl2_gemv: no fused rope with cluster split-K or a probe");
        if (const int st = plan_rope(rope, p)) return st;
      }
      const int extra = gemv_tma_smem_extra(M, p.xstride, maxnch, p.maxgrp, p.norm_k);
      int max_bits = 2;
      for (int i = 0; i < ndesc; ++i) max_bits = std::max(max_bits, p.d[i].runs[0].bits);  // runs: widest first
      const int slot = kGvWarps * 256 * max_bits;
      // Slots of the narrowest width that fill ring_kb, at least min_stages (>= 2) of the widest; room for the
      // cluster reduction's [M][256] fp32 partials. EXL2_GEMV_MIN_STAGES raises the floor (benchmarks): H200
      // calls U2 / U5 of 2026-12-02, 8B decode step 2.573 -> 2.607 ms with 4, 2.548 -> 2.589 with 3. Down gains
      // ~0.1 us; the 6-bit head (one split: 66 KB of staged scales beside the ring) loses 134 -> 170-175 us.
      static const int min_stages = [] {
        const char* e = getenv("EXL2_GEMV_MIN_STAGES");
        return e && atoi(e) >= 2 ? std::min(atoi(e), 32) : 2;  // 32: kTmaMaxStages
      }();
      int ring = std::max(std::max(min_stages * slot, M * kGvCols * 4), (ring_kb * 1024 / slot) * slot);
#ifdef EXL2_GEMV_DEEP_RING
      static const int deep_kb = [] {  // the deep ring (exl2_gemv_tma.cuh tma_stages): up to two blocks per SM
        const char* e = getenv("EXL2_GEMV_DEEP_RING_KB");
        return e && atoi(e) > 0 ? atoi(e) : 64;
      }();
      ring = std::max(ring, std::min((deep_kb * 1024 / slot) * slot, ((110 * 1024 - extra) / slot) * slot));
#endif
      p.ring_fill = ring_kb * 1024;
      p.min_stages = min_stages;
      EXL2_REQUIRE(ring + extra <= 227 * 1024 - 1024, "exl2_gemv: %d bytes of shared memory per block; use a larger ksplit",
                   ring + extra);
      p.ring_bytes = ring;
      p.prefetch_bytes = prefetch_kb * 1024;
      // The producer warp's order (results unchanged either way). H200 call AK4 of 2026-12-04, spec_bench, 8B at 1k,
      // interleaved twice: the group scales staged before the ring's first fill (the default; EXL2_GEMV_SCALES_FIRST=0
      // stages them after it) 2.253 / 2.252 ms per decode step against 2.269 / 2.266; at most one ring slot before
      // the PDL wait (EXL2_GEMV_PREWAIT_SLOTS=1, a measurement switch; default: the whole first fill) 2.280 / 2.276.
      static const int scales_first = [] {
        const char* e = getenv("EXL2_GEMV_SCALES_FIRST");
        return e && *e ? (atoi(e) > 0 ? 1 : 0) : 1;
      }();
      static const int prewait_slots = [] {
        const char* e = getenv("EXL2_GEMV_PREWAIT_SLOTS");
        return e && *e ? atoi(e) : -1;
      }();
      p.scales_first = scales_first;
      p.prewait_slots = prewait_slots;
      pl = GemvPlan{blocks, ring + extra, true};
      return EXL2_OK;
    }
  }
  EXL2_REQUIRE(M <= 8, "exl2_gemv: M=%d needs the TMA kernel (sm_90+, minb 0 or 1); this one takes 1..8", M);
  EXL2_REQUIRE(!xpre, "exl2_gemv: pre-gathered input needs the TMA kernel (sm_90+, minb 0 or 1)");
  EXL2_REQUIRE(!norm, "exl2_gemv_add_norm: the fused norm needs the TMA kernel (sm_90+, minb 0)");
  EXL2_REQUIRE(!blob[F_ROPE], "exl2_gemv: the fused rope needs the TMA kernel (sm_90+, minb 0 or 1)");
  const int smem = align16(M * p.xstride * 2) + maxnch * kChunkRows * 2;  // + the xmap slice
  EXL2_REQUIRE(smem <= 227 * 1024, "exl2_gemv: needs %d bytes of shared memory; use a larger ksplit", smem);
  pl = GemvPlan{blocks, smem, false};
  return EXL2_OK;
}
}  // namespace exl2q

namespace {
int gemv_impl(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off, int minb,
              const void* xpre, int xpre_ld, const exl2q::GemvNorm* norm, void* stream) {
  using namespace exl2q;
  GemvParams p;
  GemvPlan pl;
  const int st = gemv_plan(blob, ndesc, x, M, ldx, gate_off, minb, xpre, xpre_ld, norm, p, pl);
  if (st) return st;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (pl.tma) return gemv_tma_launch(p, pl.blocks, pl.smem, s);
  return minb == 3 ? gemv_launch<3>(p, pl.blocks, pl.smem, s) : gemv_launch<2>(p, pl.blocks, pl.smem, s);
}
}  // namespace

EXL2_API int exl2_gemv(const int64_t* blob, int ndesc, const void* x, int M, int ldx, int gate_off, int minb,
                       const void* xpre, int xpre_ld, void* stream) {
  return gemv_impl(blob, ndesc, x, M, ldx, gate_off, minb, xpre, xpre_ld, nullptr, stream);
}

// The small-M GEMV of rms_norm(h + residual) * weight (TMA kernel, sm_90+): the same output as exl2_add_rms_norm
// (hidden K = every part's in_features) followed by exl2_gemv, bit for bit, in one launch. h [M, ldh]; residual
// [M, res_ld] or null (input rms_norm(h)); weight fp16 [K]; res_out [M, res_out_ld] receives round(h + residual)
// (null: not written; it must not alias h or residual, which other blocks still read). Rows: K / 8 vectors, K
// at most 8192; every block keeps all M normalized rows in shared memory (M * K * 2 bytes).
EXL2_API int exl2_gemv_add_norm(const int64_t* blob, int ndesc, const void* h, int M, int ldh, const void* residual,
                                int res_ld, const void* weight, void* res_out, int res_out_ld, float eps,
                                void* stream) {
  if (const int st = exl2q::check_norm_args("exl2_gemv_add_norm", h, ldh, residual, res_ld, weight, res_out,
                                             res_out_ld, eps))
    return st;
  const exl2q::GemvNorm norm{residual, res_ld, weight, res_out, res_out_ld, eps};
  return gemv_impl(blob, ndesc, h, M, ldh, 0, 0, nullptr, 0, &norm, stream);
}

// The small-M GEMV's split counts per run (host only, for tests and tools): splits[i * kMaxRuns + r] for run r of
// descriptor i, proportional, then balanced within `slots` blocks when slots > 0 (what exl2_gemv plans on sm_90+
// with F_SLOTS set; F_WS and F_COUNTERS must be set for a descriptor to take more splits); with F_SPAN set, the
// descriptor's span splits at r = 0 (exl2_gemv_splits.cuh span_splits). *blocks: the total;
// *groups (when not null): the quantization groups per block whose scales the TMA kernel stages.
EXL2_API int exl2_gemv_splits(const int64_t* blob, int ndesc, int slots, int* splits, int* blocks, int* groups) {
  using namespace exl2q;
  EXL2_REQUIRE(blob && splits && blocks, "exl2_gemv_splits: null argument");
  EXL2_REQUIRE(ndesc >= 1 && ndesc <= kMaxDesc, "exl2_gemv_splits: %d descriptors (1..%d)", ndesc, kMaxDesc);
  GemvParams p{};
  p.ndesc = ndesc;
  int n = 0, maxnch = 1;
  for (int i = 0; i < ndesc; ++i) {
    QDesc& d = p.d[i];
    if (const int st = parse_desc(blob + (size_t)i * kDescLen, d)) return st;
    EXL2_REQUIRE(d.ksplit >= 1 && d.ksplit <= d.C, "exl2_gemv_splits: ksplit %d outside 1..%d", d.ksplit, d.C);
    d.ncolblk = (d.Np + kGvCols - 1) / kGvCols;
    d.block_start = n;
    n += d.ncolblk * proportional_run_splits(d, p.rbase[i], maxnch);
  }
  refine_splits(p, blob, slots, true, n, maxnch);  // span: splits[i * kMaxRuns], the rest 0
  for (int i = 0; i < ndesc; ++i)
    for (int r = 0; r < kMaxRuns; ++r)
      splits[i * kMaxRuns + r] = p.span ? (r == 0 ? p.rbase[i][p.d[i].nruns] : 0)
                                              : r < p.d[i].nruns ? p.rbase[i][r + 1] - p.rbase[i][r] : 0;
  *blocks = n;
  if (groups) *groups = staged_groups(blob, ndesc, maxnch);
  return EXL2_OK;
}

// Resident blocks per SM of the GEMV variant `minb` with `smem` bytes of dynamic shared memory (host query).
EXL2_API int exl2_gemv_occupancy(int minb, int smem, int* blocks_per_sm) {
  EXL2_REQUIRE(blocks_per_sm && (minb == 2 || minb == 3), "exl2_gemv_occupancy: bad argument");
  cudaError_t err = minb == 3
      ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, gemv_kernel<3>, kGvWarps * 32, smem)
      : cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, gemv_kernel<2>, kGvWarps * 32, smem);
  if (err != cudaSuccess) return exl2::set_error((int)err, "exl2_gemv_occupancy: %s", cudaGetErrorString(err));
  return EXL2_OK;
}
