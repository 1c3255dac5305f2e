// Decode attention over fp16 pages as one stream per split (sm_90+; flags bit 9 of exl2_paged_attention): a CTA
// takes one split of one sequence's context for ALL its kv heads, so each 16-token chunk of K (and of V) is one
// contiguous run of 16 * Hkv * D halves in the page, copied by one bulk copy (cp.async.bulk) into a ring of shared
// memory, 64 KB per stage for the 8B's 8 x 128. Why: the other decode kernels take one kv head per CTA, so a step
// gathers 256-byte rows 2 KB apart through registers or cp.async; at 32k the tensor-core one-pass kernel runs
// 255 registers, 12% occupancy and ~49 us per layer for ~32 us of bytes (ncu, H200 call AC1 of 2026-12-03).
// A streamed split keeps ~190 KB of copies in flight per SM with one producer lane, like the GEMV's weight ring.
//
// Block: 8 compute warps + 1 producer warp; one CTA per SM (the ring takes most of its shared memory); grid
// (nsplit, B). Splits are the other kernels' (qattn_split_len: 16-key multiples), partials and reduce launch the
// same, so only decode steps (Tq = 1) with D = 128, G <= 4 and Hkv in {2, 4, 8} come here (ops/cuda_layers.py).
// Warp w takes kv head w / WPH (WPH = 8 / Hkv warps per head) and steps w % WPH, w % WPH + WPH, ... of each chunk's
// four steps of 4 tokens. Lanes: token group tg = lane / 8 (token 4 * step + tg), sub = lane % 8 (16 dims,
// lane_dim); a score is 16 products per lane, summed over the 8 lanes of its group (3 shuffles).
// Softmax per chunk: the warp's scores of the chunk, their max, the running state rescaled once, then p * V.
// Finish: the token groups' sums by shuffles, the head's warps through shared memory; the split's partial (o, m, l)
// as the other kernels write it, or the output when nsplit == 1.
#include <cuda_fp16.h>
#include <math.h>
#include <stdlib.h>

#include "common/api.h"
#include "common/bulk_copy.cuh"
#include "common/pdl.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kStreamD = 128;
constexpr int kStreamChunk = 16;  // tokens per ring stage (page sizes are powers of two >= 16)
constexpr int kStreamWarps = 8;   // compute warps
constexpr int kStreamThreads = (kStreamWarps + 1) * 32;
constexpr int kStreamMaxStages = 8;
constexpr int kStreamSmemTarget = 192 * 1024;  // ring bytes aimed at (3 stages of the 8B's 64 KB)

// The ring's first fill prefetched into L2 before the PDL wait (QAttnParams::prefetch): on unless
// EXL2_ATTN_STREAM_PREFETCH=0 (read once; a measurement switch).
int stream_prefetch() {
  static const int v = [] {
    const char* e = getenv("EXL2_ATTN_STREAM_PREFETCH");
    return e != nullptr && atoi(e) == 0 ? 0 : 1;
  }();
  return v;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void stream_sync() {  // the compute warps only (named barrier 1)
  asm volatile("bar.sync 1, %0;" ::"n"(kStreamWarps * 32) : "memory");
}

// 16 halves (two 16-byte words) -> floats.
__device__ __forceinline__ void halves16(const uint4 a, const uint4 b, float (&f)[16]) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
// A lane's 16 dims of a 128-dim row: halves [8 sub, 8 sub + 8) and [64 + 8 sub, 72 + 8 sub), so the 8 lanes of a
// token group read 128 contiguous bytes per 16-byte load (conflict-free; 32-byte runs per lane hit each bank
// twice). The dim of the lane's element i:
__device__ __forceinline__ int lane_dim(int sub, int i) { return (i < 8 ? 0 : 56) + 8 * sub + i; }
// The lane's 16 dims of the row at `row` (shared memory, 16-byte aligned) -> floats.
__device__ __forceinline__ void load16(const half* row, int sub, float (&f)[16]) {
  halves16(reinterpret_cast<const uint4*>(row + 8 * sub)[0], reinterpret_cast<const uint4*>(row + 64 + 8 * sub)[0], f);
}
#endif

// G query heads per kv head (1, 2 or 4). __maxnreg__ instead of __launch_bounds__(288, 1), under which ptxas held
// the G = 4 kernel at 168 registers and spilled 108 bytes (it needs ~203: q and the accumulators of 4 heads).
template <int G>
__global__ void __maxnreg__(224) paged_attention_stream_kernel(const QAttnParams p, const int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int D = kStreamD;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[2 * kStreamMaxStages];  // full[stages], empty[stages]
  __shared__ float wm[kStreamWarps][G], wl[kStreamWarps][G];
  const int b = blockIdx.y, split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = exl2::smem_addr(bars), empty0 = full0 + 8 * kStreamMaxStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      exl2::mbar_init(full0 + 8 * s, 1);
      exl2::mbar_init(empty0 + 8 * s, kStreamWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int cap = p.max_pages << p.log2S, smask = (1 << p.log2S) - 1;
  const int row_halves = p.Hkv * D, chunk_halves = kStreamChunk * row_halves;
  const uint32_t chunk_bytes = (uint32_t)chunk_halves * 2;
  const int* table = p.block_tables + (int64_t)b * p.bt_stride;
  if (p.prefetch && warp == kStreamWarps) {
    // The ring's first fill into L2 while the previous kernel finishes: its lengths and tables may be stale here
    // (read past L1, so no stale line stays for the loads after the wait), which costs only wasted reads; the
    // copies after the wait then find their chunks in L2 (the newest K / V row included: L2 is where the previous
    // kernel's writes land).
    const int c_pre = min(max(__ldcg(p.context_lens + b), 0), cap);
    const int L_pre = qattn_split_len(c_pre, p.nsplit, p.min_split);
    const int t0_pre = split * L_pre, t1_pre = min(c_pre, t0_pre + L_pre);
    const int n_pre = min(stages, (t1_pre - t0_pre + kStreamChunk - 1) / kStreamChunk);
    for (int i = lane; i < 2 * n_pre; i += 32) {
      const int t = t0_pre + (i >> 1) * kStreamChunk;
      const int64_t slot = ((int64_t)__ldcg(table + (t >> p.log2S)) << p.log2S) | (t & smask);
      const half* src = reinterpret_cast<const half*>(i & 1 ? p.vc : p.kc) + slot * row_halves;
      if (slot >= 0 && slot < ((int64_t)p.num_pages << p.log2S))  // a stale table entry may be anything
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(chunk_bytes) : "memory");
    }
  }
  exl2::pdl_wait();  // q, the newest K / V row, the tables and lengths come from earlier kernels
  exl2::pdl_launch_dependents();

  int ctx = p.context_lens[b];
  ctx = ctx < 0 ? 0 : (ctx > cap ? cap : ctx);
  const int L = qattn_split_len(ctx, p.nsplit, p.min_split);
  const int t0 = split * L, t1 = min(ctx, t0 + L);
  half* ring = reinterpret_cast<half*>(smem);  // [stages][K chunk | V chunk]
  if (t0 >= t1) {  // an unused split; with one split (ctx == 0) the output is zeros, as the reference
    if (p.nsplit == 1 && warp < kStreamWarps)
      for (int i = threadIdx.x; i < p.Hq * D; i += kStreamWarps * 32)
        p.out[(int64_t)b * p.Hq * D + i] = __float2half_rn(0.f);
    return;
  }
  const int nch = (t1 - t0 + kStreamChunk - 1) / kStreamChunk;

  if (warp == kStreamWarps) {  // producer: lane 0 keeps `stages` chunks of K and V in flight
    if (lane == 0) {
      const uint64_t pol = exl2::evict_first_policy();  // read once per step
      for (int c = 0; c < nch; ++c) {
        const int s = c % stages;
        if (c >= stages) exl2::mbar_wait(empty0 + 8 * s, ((c / stages) - 1) & 1);
        const int t = t0 + c * kStreamChunk;
        const int64_t slot = ((int64_t)__ldg(table + (t >> p.log2S)) << p.log2S) | (t & smask);
        const uint32_t dst = exl2::smem_addr(ring + (size_t)s * 2 * chunk_halves);
        exl2::mbar_expect_tx(full0 + 8 * s, 2 * chunk_bytes);
        exl2::bulk_copy(dst, reinterpret_cast<const half*>(p.kc) + slot * row_halves, chunk_bytes, full0 + 8 * s, pol);
        exl2::bulk_copy(dst + chunk_bytes, reinterpret_cast<const half*>(p.vc) + slot * row_halves, chunk_bytes,
                        full0 + 8 * s, pol);
      }
    }
    return;
  }

  // compute warps
  const int wph = kStreamWarps / p.Hkv;  // warps per kv head
  const int h = warp / wph, wj = warp % wph, tg = lane >> 3, sub = lane & 7;
  float q[G][16];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const half* qrow = p.q + (int64_t)b * p.q_bs + (int64_t)(h * G + g) * p.q_hs + 8 * sub;
    halves16(__ldg(reinterpret_cast<const uint4*>(qrow)), __ldg(reinterpret_cast<const uint4*>(qrow + 64)), q[g]);
  }
  float m[G], l[G], acc[G][16];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[g][i] = 0.f;
  }
  constexpr int kSteps = kStreamChunk / 4;  // steps of 4 tokens per chunk
  for (int c = 0; c < nch; ++c) {
    const int s = c % stages;
    exl2::mbar_wait(full0 + 8 * s, (c / stages) & 1);
    const half* kch = ring + (size_t)s * 2 * chunk_halves;
    const half* vch = kch + chunk_halves;
    const int tc = t0 + c * kStreamChunk;
    float sc[kSteps][G];
    float mx[G];
#pragma unroll
    for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      if (st % wph != wj) continue;  // wph divides kSteps: a compile-time-shaped loop over the warp's steps
      const int token = 4 * st + tg;
      float k[16];
      load16(kch + (size_t)token * row_halves + h * D, sub, k);
      const bool valid = tc + token < t1;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) d = fmaf(q[g][i], k[i], d);
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        d += __shfl_xor_sync(0xffffffffu, d, 4);
        sc[st][g] = valid ? d * p.scale_log2 : -INFINITY;
        mx[g] = fmaxf(mx[g], sc[st][g]);
      }
    }
    float alpha[G], mu[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], 8));
      mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], 16));
      const float m_new = fmaxf(m[g], mx[g]);
      mu[g] = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: every p is 0, no NaN
      alpha[g] = exp2f(m[g] - mu[g]);
      m[g] = m_new;
      l[g] *= alpha[g];
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[g][i] *= alpha[g];
    }
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      if (st % wph != wj) continue;
      const int token = 4 * st + tg;
      if (tc + token >= t1) continue;  // past the split: its p is 0, but its V may be any bits (NaN * 0)
      float v[16];
      load16(vch + (size_t)token * row_halves + h * D, sub, v);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pr = exp2f(sc[st][g] - mu[g]);
        l[g] += pr;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[g][i] = fmaf(pr, v[i], acc[g][i]);
      }
    }
    __syncwarp();
    if (lane == 0) exl2::mbar_arrive(empty0 + 8 * s);  // this warp is done with the stage
  }

  // the four token groups of the warp (same dims, same running max) -> lanes of group 0
#pragma unroll
  for (int g = 0; g < G; ++g) {
    l[g] += __shfl_xor_sync(0xffffffffu, l[g], 8);
    l[g] += __shfl_xor_sync(0xffffffffu, l[g], 16);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], 8);
      acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], 16);
    }
  }
  stream_sync();  // every warp has read its last stage: the ring becomes the cross-warp buffer
  float* red = reinterpret_cast<float*>(smem);  // [warps][G][D]
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 16; ++i) red[(warp * G + g) * D + lane_dim(sub, i)] = acc[g][i];
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      wm[warp][g] = m[g];
      wl[warp][g] = l[g];
    }
  }
  stream_sync();
  // the head's warps combined: output (hq, d) per thread step
  for (int i = threadIdx.x; i < p.Hq * D; i += kStreamWarps * 32) {
    const int hq = i / D, d = i % D, hh = hq / G, g = hq % G;
    float M = -INFINITY;
    for (int j = 0; j < wph; ++j) M = fmaxf(M, wm[hh * wph + j][g]);
    const float Mu = M == -INFINITY ? 0.f : M;
    float o = 0.f, den = 0.f;
    for (int j = 0; j < wph; ++j) {
      const int w = hh * wph + j;
      const float f = exp2f(wm[w][g] - Mu);
      o = fmaf(f, red[(w * G + g) * D + d], o);
      den = fmaf(f, wl[w][g], den);
    }
    const int64_t prow = (int64_t)b * p.Hq + hq;
    if (p.nsplit == 1) {
      p.out[prow * D + d] = __float2half_rn(den > 0.f ? o / den : 0.f);
    } else {
      const int64_t ps = prow * p.nsplit + split;
      p.part_o[ps * D + d] = o;
      if (d == 0) {
        p.part_ml[ps * 2] = M;
        p.part_ml[ps * 2 + 1] = den;
      }
    }
  }
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

template <int G>
int launch_g(const QAttnParams& p, int stages, int B, cudaStream_t stream) {
  const int smem = stages * 2 * kStreamChunk * p.Hkv * kStreamD * 2;
  constexpr auto kernel = paged_attention_stream_kernel<G>;
  const cudaError_t err = exl2::opt_in_dynamic_smem<kernel>((size_t)smem);
  if (err != cudaSuccess)
    return exl2::set_error((int)err, "paged_attention (stream): %d bytes of shared memory: %s", smem,
                           cudaGetErrorString(err));
  exl2::launch_kernel(kernel, dim3((unsigned)p.nsplit, (unsigned)B), kStreamThreads, (size_t)smem, stream, p, stages);
  return check_launch("paged_attention (stream)");
}

}  // namespace

// The streamed decode attention of exl2_paged_attention (flags bit 9): a decode step (Tq == 1) over fp16 pages,
// D = 128, G = Hq / Hkv in {1, 2, 4}, Hkv in {2, 4, 8}, on sm_90+; its reduce launch when nsplit > 1. `a` holds the
// other kernels' parameters (part_o / part_ml laid out as theirs).
int launch_paged_attention_stream(const QAttnParams& a, int D, int B, cudaStream_t stream) {
  EXL2_REQUIRE(D == kStreamD && a.Tq == 1, "paged_attention (stream): decode steps with head_dim 128 only");
  EXL2_REQUIRE(a.Hkv == 2 || a.Hkv == 4 || a.Hkv == 8, "paged_attention (stream): %d kv heads (2, 4 or 8)", a.Hkv);
  EXL2_REQUIRE(a.G == 1 || a.G == 2 || a.G == 4, "paged_attention (stream): %d query heads per kv head (1, 2, 4)",
               a.G);
  EXL2_REQUIRE(a.log2S >= 4, "paged_attention (stream): pages of at least %d tokens", kStreamChunk);
  EXL2_REQUIRE(a.min_split >= kStreamChunk && a.min_split % kStreamChunk == 0,  // no chunk straddles two splits
               "paged_attention (stream): min_split %d must be a multiple of %d", a.min_split, kStreamChunk);
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) !=
                                                 cudaSuccess)
    return exl2::set_error(EXL2_ERR_UNSUPPORTED, "paged_attention (stream): no device");
  EXL2_REQUIRE(major >= 9, "paged_attention (stream): needs sm_90+ (bulk copies)");
  const int stages = min(kStreamMaxStages, kStreamSmemTarget / (2 * kStreamChunk * a.Hkv * kStreamD * 2));
  QAttnParams p = a;
  p.prefetch = stream_prefetch();
  const int st = a.G == 1   ? launch_g<1>(p, stages, B, stream)
                 : a.G == 2 ? launch_g<2>(p, stages, B, stream)
                            : launch_g<4>(p, stages, B, stream);
  return st != EXL2_OK ? st : launch_paged_attention_quant_reduce(a, false, D, B, stream);
}

}  // namespace layers
}  // namespace exl2
