// The streamed decode attention over fp16 pages on tensor cores (sm_90+): what paged_attention_stream.cu does for
// fp16 pages with 8 kv heads (Llama 3 1B / 8B / 70B), its scores and sums as mma.sync products read from the ring
// by ldmatrix. Why: that kernel's CUDA-core compute (a 3-shuffle sum per score, per-token exp and FMAs over 16 dims
// a lane) left it latency-bound at one CTA per SM: 81 us per layer at 32k against 50 us for the register one-pass
// kernel (H200 call AP1 of 2026-12-05), while its ring kept the bytes in flight. Here a warp's whole work per
// 16-token chunk is 8 ldmatrix + 16 mma for the scores and 8 ldmatrix + 16 mma for the sums.
//
// Block: 8 compute warps (warp h = kv head h) + 1 producer warp; one CTA per SM; grid (nsplit, B, row tiles); splits,
// partials and the reduce launch as the other decode kernels. The producer copies each token's 2 KB row of K (all
// heads) and of V by its own bulk copy into a row of 2,064 bytes, so the 8 rows an ldmatrix phase reads start in 8
// different 16-byte bank groups (2,048-byte rows would put them all in one: 8-way conflicts).
// Per warp and chunk, with the G query heads of kv head h as rows 0..G-1 of a 16-row tile (rows G.. zero):
//   S [16 heads, 16 tokens]   = Q [16, 128] . K^T           (A: q in registers; B: K rows, ldmatrix)
//   O^T [128 dims, 8 heads]  += V^T [128, 16] . P^T [16, 8]  (A: V rows, ldmatrix.trans; B: S's accumulators)
// S's accumulator layout (row = head gid, columns = tokens 2 t4, 2 t4 + 1) is P^T's B-fragment layout, so the
// probabilities go from the softmax to the second product without shared memory. P enters as two fp16 parts (hi +
// the rounding residue), so the sums keep ~fp32 precision of P; V and q are fp16 already.
// Verify steps (Tq > 1, EXL2_BACKEND_ATTN_STREAM_VERIFY on the host): G x Tq rows per kv head in tiles of 16, the
// tile in blockIdx.z; with more than 8 rows both halves of the tile are real (S's c2 / c3, q's a1 / a3, a second
// O^T), and each row masks the keys past its own position.
#include <cuda_fp16.h>
#include <math.h>

#include "common/api.h"
#include "common/bulk_copy.cuh"
#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "layers/attn_stream_ring.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kD = 128;
constexpr int kHkv = 8;
constexpr int kChunk = 16;                          // tokens per ring stage
constexpr int kWarps = kHkv;                        // compute warps, one per kv head
constexpr int kThreads = (kWarps + 1) * 32;         // + the producer warp
constexpr int kRowBytes = kHkv * kD * 2;            // 2,048: one token's K (or V) row of all heads in the page
// Rows 2,064 bytes apart: each ldmatrix phase's 8 rows fall in 8 bank groups, though 7 of 8 rows' bulk copies
// then start 16 bytes into a 128-byte line (what cost the GEMV ring 7%, session 46). Session 46's BL3, 32k attention
// alone: 53.6 us per layer here, 54.7 with line-aligned rows (2,176: 8-way ldmatrix conflicts), 53.8 at 2,080.
constexpr int kRowPitch = kRowBytes + 16;           // its row in shared memory
constexpr int kStageBytes = 2 * kChunk * kRowPitch;  // K rows, then V rows: 66,048
constexpr int kStages = 3;                          // 198,144 bytes of ring
constexpr int kMaxRows = 64;                        // query rows per kv head (G x Tq): at most 4 tiles of 16

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint4 ldsm_x4(uint32_t addr) {
  uint4 r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
__device__ __forceinline__ uint4 ldsm_x4_trans(uint32_t addr) {
  uint4 r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_half2(uint32_t u) {
  return __half22float2(*reinterpret_cast<const __half2*>(&u));
}
#endif

// HALVES: 1 for decode steps (R = G <= 8 rows per kv head, one 8-row half of the 16-row tile), 2 for verify steps
// (R = G * Tq rows in tiles of 16, blockIdx.z the tile).
template <int HALVES>
__global__ void __launch_bounds__(kThreads, 1) paged_attention_stream_mma_kernel(const QAttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char ring[];  // [kStages][K rows | V rows], rows of kRowPitch bytes
  __shared__ __align__(8) uint64_t bars[2 * kStages];      // full[kStages], empty[kStages]
  const int b = blockIdx.y, split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = exl2::smem_addr(bars), empty0 = full0 + 8 * kStages;
  stream_ring_init(full0, empty0, kStages, kWarps);
  const int smask = (1 << p.log2S) - 1;
  const int* table = p.block_tables + (int64_t)b * p.bt_stride;
  auto slot_of = [&](int t) { return ((int64_t)__ldcg(table + (t >> p.log2S)) << p.log2S) | (t & smask); };
  if (p.prefetch && warp == kWarps) {
    // The ring's first fill into L2 while the previous kernel finishes (as paged_attention_stream.cu: stale
    // lengths or tables here cost only wasted reads; a slot out of range is skipped).
    const StreamRange pre = stream_split_range(p, __ldcg(p.context_lens + b), split);
    const int n_pre = min(kStages, (pre.t1 - pre.t0 + kChunk - 1) / kChunk);
    for (int i = lane; i < 2 * n_pre; i += 32) {
      const int64_t slot = slot_of(pre.t0 + (i >> 1) * kChunk);
      if (slot < 0 || slot >= ((int64_t)p.num_pages << p.log2S)) continue;
      const uint8_t* src = ((i & 1) ? p.vc : p.kc) + slot * kRowBytes;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(kChunk * kRowBytes) : "memory");
    }
  }
  exl2::pdl_wait();  // q, the newest K / V row, the tables and lengths come from earlier kernels
  exl2::pdl_launch_dependents();

  const int ctx = attn_clamp_ctx(p.context_lens[b], p);
  const StreamRange range = stream_split_range(p, ctx, split);
  const int t0 = range.t0, t1 = range.t1;
  if (t0 >= t1) {
    if (warp < kWarps) stream_empty_split<kD>(p, b, kWarps * 32);
    return;
  }
  const int nch = (t1 - t0 + kChunk - 1) / kChunk;

  if (warp == kWarps) {  // producer: one bulk copy per lane per chunk (lanes 0-15 K rows, 16-31 V rows)
    const uint64_t pol = exl2::evict_first_policy();  // read once per step
    const int row = lane & 15;
    const uint8_t* base = lane < 16 ? p.kc : p.vc;
    for (int c = 0; c < nch; ++c) {
      const int s = c % kStages;
      if (c >= kStages) exl2::mbar_wait(empty0 + 8 * s, ((c / kStages) - 1) & 1);
      if (lane == 0) exl2::mbar_expect_tx(full0 + 8 * s, 2 * kChunk * kRowBytes);
      __syncwarp();  // the expected bytes are set before any copy can complete them
      const int64_t slot = slot_of(t0 + c * kChunk);  // a chunk never straddles pages (16 | page size)
      const uint32_t dst = exl2::smem_addr(ring + (size_t)s * kStageBytes + (lane >> 4) * kChunk * kRowPitch +
                                           row * kRowPitch);
      exl2::bulk_copy(dst, base + (slot + row) * kRowBytes, kRowBytes, full0 + 8 * s, pol);
    }
    return;
  }

  // compute warps: kv head h = warp; gid = lane / 4 (a row of S, a dim of O^T), t4 = lane % 4. The tile's rows:
  // 16 z + gid (S's c0 / c1, A's a0 / a2) and, with two halves, 16 z + 8 + gid (c2 / c3, a1 / a3); row r is query
  // j = r / G of head g = r % G, and sees keys < ctx - Tq + j + 1 (causal; all of the split for a decode step).
  const int h = warp, gid = lane >> 2, t4 = lane & 3, G = p.G;
  int lim[HALVES];                           // the lane's rows' key limits
  uint32_t qa[HALVES][kD / 16][2];           // q fragments: [half][16-dim step][dims 2 t4, +1 | 8 + 2 t4, +1]
#pragma unroll
  for (int hf = 0; hf < HALVES; ++hf) {
    const int r = 16 * blockIdx.z + 8 * hf + gid, j = r / G;
    const bool real = r < p.R;
    lim[hf] = real ? min(t1, ctx - p.Tq + j + 1) : t1;  // rows past R: zero q, outputs never written
    const half* qrow = p.q + (int64_t)b * p.q_bs + (int64_t)j * p.q_ts + (int64_t)(h * G + r % G) * p.q_hs;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
      for (int u = 0; u < 2; ++u)
        qa[hf][kk][u] = real ? __ldg(reinterpret_cast<const unsigned int*>(qrow + 16 * kk + 8 * u + 2 * t4)) : 0u;
  }
  float o[HALVES][kD / 16][4];  // O^T per half: [m-tile][c0 (dim gid, row 2 t4), c1 (row 2 t4 + 1), c2, c3 (dim +8)]
#pragma unroll
  for (int hf = 0; hf < HALVES; ++hf)
#pragma unroll
    for (int mt = 0; mt < kD / 16; ++mt) o[hf][mt][0] = o[hf][mt][1] = o[hf][mt][2] = o[hf][mt][3] = 0.f;
  float m[HALVES], l[HALVES];  // the lane's rows' running max (log2 units) and this lane's share of their sums
#pragma unroll
  for (int hf = 0; hf < HALVES; ++hf) m[hf] = -INFINITY, l[hf] = 0.f;
  // ldmatrix lane address within a stage region: matrix mi = lane / 8 holds tokens 8 (mi >> 1) + lane % 8 and the
  // 8 dims from 8 (mi & 1) of a 16-dim step; the same pattern serves K (B fragments of two 8-token tiles) and V
  // (transposed: A fragments of a 16-dim tile).
  const int mi = lane >> 3;
  const uint32_t lane_off = (uint32_t)((8 * (mi >> 1) + (lane & 7)) * kRowPitch + h * kD * 2 + 8 * (mi & 1) * 2);
  const uint32_t ring0 = exl2::smem_addr(ring);
  for (int c = 0; c < nch; ++c) {
    const int s = c % kStages;
    exl2::mbar_wait(full0 + 8 * s, (c / kStages) & 1);
    const int tc = t0 + c * kChunk, nvalid = min(kChunk, t1 - tc);
    unsigned char* vstage = ring + (size_t)s * kStageBytes + kChunk * kRowPitch;
    if (nvalid < kChunk) {  // V rows past the split may hold any bits: P = 0 times NaN would still be NaN
      for (int i = lane; i < (kChunk - nvalid) * (kD * 2 / 16); i += 32) {
        const int r = nvalid + i / (kD * 2 / 16), w = i % (kD * 2 / 16);
        *reinterpret_cast<uint4*>(vstage + r * kRowPitch + h * kD * 2 + 16 * w) = make_uint4(0, 0, 0, 0);
      }
      __syncwarp();
    }
    const uint32_t kaddr = ring0 + (uint32_t)(s * kStageBytes) + lane_off;
    const uint32_t vaddr = kaddr + kChunk * kRowPitch;
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // S: [token tile][c0..c3]
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint4 kb = ldsm_x4(kaddr + kk * 32);
      const uint32_t a1 = HALVES == 2 ? qa[HALVES - 1][kk][0] : 0u, a3 = HALVES == 2 ? qa[HALVES - 1][kk][1] : 0u;
      exl2::mma16816(sc[0], qa[0][kk][0], a1, qa[0][kk][1], a3, kb.x, kb.y);
      exl2::mma16816(sc[1], qa[0][kk][0], a1, qa[0][kk][1], a3, kb.z, kb.w);
    }
    uint32_t bh[HALVES][2], bl[HALVES][2];  // P^T's B fragments per half (tokens 2 t4, +1 of each tile), hi + residue
    float alpha[HALVES];                    // the lane's row's rescale factor per half (1: its max stays)
    bool raise_any = false;
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) {
      // row 16 z + 8 hf + gid's scores of tokens 8 nt + 2 t4 + e: c0, c1 (half 0) or c2, c3 (half 1)
      float x[2][2], mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // keys past the row's limit (the split's end included: this masks NaN of stale K) score -inf
          x[nt][e] = tc + 8 * nt + 2 * t4 + e < lim[hf] ? sc[nt][2 * hf + e] * p.scale_log2 : -INFINITY;
          mx = fmaxf(mx, x[nt][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // a lazy running max (kLazyMaxLog2): the first valid key raises it from -inf, a fully masked row never does
      const bool raise = mx > m[hf] + kLazyMaxLog2;
      raise_any |= raise;
      alpha[hf] = raise ? exp2f(m[hf] - mx) : 1.f;  // 0 when m was -inf (o and l are still 0)
      if (raise) m[hf] = mx;
      const float mu = m[hf] == -INFINITY ? 0.f : m[hf];  // nothing seen yet: p = 0
      float pr[2][2], psum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pr[nt][e] = exp2f(x[nt][e] - mu);
          psum += pr[nt][e];
        }
      l[hf] = fmaf(l[hf], alpha[hf], psum);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        bh[hf][nt] = pack_half2(pr[nt][0], pr[nt][1]);
        const float2 hv = unpack_half2(bh[hf][nt]);
        bl[hf][nt] = pack_half2(pr[nt][0] - hv.x, pr[nt][1] - hv.y);
      }
    }
    if (__any_sync(0xffffffffu, raise_any)) {  // warp-uniform; most chunks past a split's first keep every max
#pragma unroll
      for (int hf = 0; hf < HALVES; ++hf) {
        const float a_even = __shfl_sync(0xffffffffu, alpha[hf], 8 * t4);  // the lanes of rows 2 t4, 2 t4 + 1
        const float a_odd = __shfl_sync(0xffffffffu, alpha[hf], 8 * t4 + 4);
#pragma unroll
        for (int mt = 0; mt < kD / 16; ++mt) {
          o[hf][mt][0] *= a_even;
          o[hf][mt][1] *= a_odd;
          o[hf][mt][2] *= a_even;
          o[hf][mt][3] *= a_odd;
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < kD / 16; ++mt) {
      const uint4 va = ldsm_x4_trans(vaddr + mt * 32);
#pragma unroll
      for (int hf = 0; hf < HALVES; ++hf) {
        exl2::mma16816(o[hf][mt], va.x, va.y, va.z, va.w, bh[hf][0], bh[hf][1]);
        exl2::mma16816(o[hf][mt], va.x, va.y, va.z, va.w, bl[hf][0], bl[hf][1]);
      }
    }
    if (nvalid < kChunk) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // zeroed rows -> copies
    __syncwarp();
    if (lane == 0) exl2::mbar_arrive(empty0 + 8 * s);  // this warp is done with the stage
  }

#pragma unroll
  for (int hf = 0; hf < HALVES; ++hf) {
    // the row's sum over its 4 lanes; then each lane's two output rows' (m, l)
    l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 1);
    l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 2);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 16 * blockIdx.z + 8 * hf + 2 * t4 + e;
      const float mg = __shfl_sync(0xffffffffu, m[hf], 8 * t4 + 4 * e);
      const float lg = __shfl_sync(0xffffffffu, l[hf], 8 * t4 + 4 * e);
      if (r >= p.R) continue;
      const int64_t prow = ((int64_t)b * p.Tq + r / G) * p.Hq + h * G + r % G;
#pragma unroll
      for (int mt = 0; mt < kD / 16; ++mt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int d = 16 * mt + gid + 8 * hi;
          const float v = o[hf][mt][2 * hi + e];
          if (p.nsplit == 1) {
            p.out[prow * kD + d] = __float2half_rn(lg > 0.f ? v / lg : 0.f);
          } else {
            p.part_o[(prow * p.nsplit + split) * kD + d] = v;
          }
        }
      if (p.nsplit > 1 && gid == 0) {
        const int64_t ps = prow * p.nsplit + split;
        p.part_ml[ps * 2] = mg;
        p.part_ml[ps * 2 + 1] = lg;
      }
    }
  }
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

}  // namespace

bool stream_mma_takes(int k_fmt, int v_fmt, const QAttnParams& p) {
  return k_fmt == kFmtF16 && v_fmt == kFmtF16 && p.Hkv == kHkv && (p.G == 1 || p.G == 2 || p.G == 4 || p.G == 8) &&
         p.Tq >= 1 && p.G * p.Tq <= kMaxRows;
}

int launch_paged_attention_stream_mma(const QAttnParams& p, int B, cudaStream_t stream) {
  EXL2_REQUIRE(p.Hkv == kHkv && p.G >= 1 && p.G <= 8 && p.R == p.G * p.Tq && p.R <= kMaxRows,
               "paged_attention (stream, tensor cores): %d kv heads, %d rows per kv head", p.Hkv, p.R);
  const bool one_half = p.R <= 8;  // a decode step's G <= 8 rows: the tile's first half only
  const int tiles = one_half ? 1 : (p.R + 15) / 16;
  constexpr size_t smem = (size_t)kStages * kStageBytes;
  const auto kernel = one_half ? paged_attention_stream_mma_kernel<1> : paged_attention_stream_mma_kernel<2>;
  const cudaError_t err = one_half ? exl2::opt_in_dynamic_smem<paged_attention_stream_mma_kernel<1>>(smem)
                                   : exl2::opt_in_dynamic_smem<paged_attention_stream_mma_kernel<2>>(smem);
  if (err != cudaSuccess)
    return exl2::set_error((int)err, "paged_attention (stream, tensor cores): %d bytes of shared memory: %s",
                           (int)smem, cudaGetErrorString(err));
  exl2::launch_kernel(kernel, dim3((unsigned)p.nsplit, (unsigned)B, (unsigned)tiles), kThreads, smem, stream, p);
  return check_launch("paged_attention (stream, tensor cores)");
}

}  // namespace layers
}  // namespace exl2
