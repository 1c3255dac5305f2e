// Decode attention as one stream per split (sm_90+; flags bit 9 of exl2_paged_attention for fp16 pages, use_mma bit
// 6 of exl2_paged_attention_quant for code pages): a CTA takes one split of one sequence's context for ALL its kv
// heads, so each 16-token chunk of K (and of V, and of their group scales) is one contiguous run of the page, copied
// by one bulk copy (cp.async.bulk) into a ring of shared memory: 64 KB per stage for the 8B's fp16 pages, 34 KB for
// int8 codes. Why: the other decode kernels take one kv head per CTA, so a step gathers rows 2 KB (fp16) apart
// through registers or cp.async; at 32k the tensor-core one-pass kernel runs the 8B's fp16 attention at 255
// registers, 12% occupancy and ~49 us per layer for ~32 us of bytes (ncu, H200 call AC1 of 2026-12-03), and the
// code pages at 46% (int8) / 28% (int4) of the bandwidth (AD1). A streamed split keeps ~170-190 KB of copies in
// flight per SM with one producer lane, like the GEMV's weight ring.
//
// Block: 8 compute warps + 1 producer warp; one CTA per SM (the ring takes most of its shared memory); grid
// (nsplit, B). Splits are the other kernels' (attn_split_len: 16-key multiples), partials and reduce launch the
// same, so only decode steps (Tq = 1) with D = 128, G <= 4 and Hkv in {2, 4, 8} come here (ops/cuda_layers.py).
// Warp w takes kv head w / WPH (WPH = 8 / Hkv warps per head) and steps w % WPH, w % WPH + WPH, ... of each chunk's
// four steps of 4 tokens. Lanes: token group tg = lane / 8 (token 4 * step + tg), sub = lane % 8 (16 dims: two runs
// of 8, lane_dim); a score is 16 products per lane (each run's sum times its group scale for code pages), summed
// over the 8 lanes of its group (3 shuffles). Softmax per chunk: the warp's scores of the chunk, their max, the
// running state rescaled once, then p * V. Finish: the token groups' sums by shuffles, the head's warps through
// shared memory; the split's partial (o, m, l) as the other kernels write it, or the output when nsplit == 1.
// Integer codes hold rotated rows (kv_quant.cuh): q is rotated once (staged in shared memory), V's sums stay
// rotated and are rotated back by the reduce launch (or here, with one split).
#include <cuda_fp16.h>
#include <math.h>
#include <stdlib.h>

#include "common/api.h"
#include "common/bulk_copy.cuh"
#include "common/pdl.cuh"
#include "layers/attn_stream_ring.cuh"
#include "layers/kv_quant.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kStreamD = 128;
constexpr int kStreamChunk = 16;  // tokens per ring stage (page sizes are powers of two >= 16)
constexpr int kStreamWarps = 8;   // compute warps
constexpr int kStreamThreads = (kStreamWarps + 1) * 32;
constexpr int kStreamMaxStages = 8;
constexpr int kStreamSmemTarget = 192 * 1024;  // ring (+ staged q) bytes aimed at (3 stages of the 8B's fp16 64 KB)

// The ring's first fill prefetched into L2 before the PDL wait (QAttnParams::prefetch): on unless
// EXL2_ATTN_STREAM_PREFETCH=0 (read once; a measurement switch).
int stream_prefetch() {
  static const int v = [] {
    const char* e = getenv("EXL2_ATTN_STREAM_PREFETCH");
    return e != nullptr && atoi(e) == 0 ? 0 : 1;
  }();
  return v;
}

// Whether pages of format F (kFmtF16: fp16 pages, else a KVFmt code) come with group scales.
template <int F>
constexpr bool kScaled = F != kFmtF16;

// Bytes of one stage: K codes, K scales, V codes, V scales of kStreamChunk tokens (every region a multiple of 16).
template <int KF, int VF>
struct StageLayout {
  int k_codes, k_scales, v_codes, v_scales, total;
  __host__ __device__ StageLayout(int hkv) {
    const int scales = kStreamChunk * hkv * (kStreamD / KV_GROUP) * 2;
    k_codes = kStreamChunk * hkv * kStreamD * KVFormat<KF>::BITS / 8;
    k_scales = kScaled<KF> ? scales : 0;
    v_codes = kStreamChunk * hkv * kStreamD * KVFormat<VF>::BITS / 8;
    v_scales = kScaled<VF> ? scales : 0;
    total = k_codes + k_scales + v_codes + v_scales;
  }
};

// Staged q: fp32 [Hq][D] after the ring, for code pages (rotated there for rotated K formats).
template <int KF>
constexpr int staged_q_bytes(int hq) {
  return kScaled<KF> ? hq * kStreamD * 4 : 0;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void stream_sync() {  // the compute warps only (named barrier 1)
  asm volatile("bar.sync 1, %0;" ::"n"(kStreamWarps * 32) : "memory");
}

// A lane's 16 dims of a 128-dim row: elements [8 sub, 8 sub + 8) and [64 + 8 sub, 72 + 8 sub), so the 8 lanes of a
// token group read contiguous bytes per load (conflict-free; one 32-byte run per lane hits each bank twice). The
// dim of the lane's element i:
__device__ __forceinline__ int lane_dim(int sub, int i) { return (i < 8 ? 0 : 56) + 8 * sub + i; }

// 8 halves in a 16-byte word -> floats.
__device__ __forceinline__ void halves8(const uint4 u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// 8 elements of format F at shared address `p` -> floats (integer codes centred; the group scale is the caller's).
template <int F>
__device__ __forceinline__ void run8(const uint8_t* p, float* f) {
  if constexpr (F == kFmtF16) {
    halves8(*reinterpret_cast<const uint4*>(p), f);
  } else {
    KVRaw<KVFormat<F>::BITS> r;  // 8 elements: 8 bytes (8-bit codes) or 4 (int4)
    if constexpr (KVFormat<F>::BITS == 8) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      r.w[0] = u.x, r.w[1] = u.y;
    } else {
      r.w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
    kv_decode<F, 8>(r, f);
  }
}

// The lane's 16 elements of head h's row `row` of a chunk region (rows of Hkv heads of D elements).
template <int F>
__device__ __forceinline__ void lane_row(const uint8_t* region, int row, int hkv, int h, int sub, float (&f)[16]) {
  constexpr int EB = KVFormat<F>::BITS;  // bits per element
  const uint8_t* head = region + ((size_t)row * hkv + h) * (kStreamD * EB / 8);
  run8<F>(head + 8 * sub * EB / 8, f);
  run8<F>(head + (64 + 8 * sub) * EB / 8, f + 8);
}

// The lane's two group scales (runs 0 and 1) of head h's row `row` of a scale region; 1 without scales.
template <int F>
__device__ __forceinline__ float2 lane_scales(const uint8_t* region, int row, int hkv, int h, int sub) {
  if constexpr (!kScaled<F>) {
    return make_float2(1.f, 1.f);
  } else {
    const half* s = reinterpret_cast<const half*>(region) + ((size_t)row * hkv + h) * (kStreamD / KV_GROUP);
    return make_float2(__half2float(s[sub >> 2]), __half2float(s[2 + (sub >> 2)]));
  }
}
#endif

// G query heads per kv head (1, 2 or 4). 168 registers at most: the 9 warps of a CTA sit on the SM's 4
// sub-partitions 3 / 2 / 2 / 2, and one sub-partition's 16K registers must hold 3 warps (3 * 32 * 168 = 16,128).
// The G = 4 kernel wants ~205 (q and the accumulators of 4 heads) and spills; H200 call AN1 of 2026-12-05 ran it
// under __maxnreg__(224): every launch failed with "too many resources requested for launch".
template <int KF, int VF, int G>
__global__ void __launch_bounds__(kStreamThreads, 1) paged_attention_stream_kernel(const QAttnParams p,
                                                                                    const int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int D = kStreamD;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[2 * kStreamMaxStages];  // full[stages], empty[stages]
  __shared__ float wm[kStreamWarps][G], wl[kStreamWarps][G];
  const int b = blockIdx.y, split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = exl2::smem_addr(bars), empty0 = full0 + 8 * kStreamMaxStages;
  stream_ring_init(full0, empty0, stages, kStreamWarps);
  const StageLayout<KF, VF> lay(p.Hkv);
  const int smask = (1 << p.log2S) - 1;
  const int kc_row = p.Hkv * D * KVFormat<KF>::BITS / 8, vc_row = p.Hkv * D * KVFormat<VF>::BITS / 8;
  const int sc_row = p.Hkv * (D / KV_GROUP) * 2;  // scale bytes per token
  const int* table = p.block_tables + (int64_t)b * p.bt_stride;
  // The chunk c of the split at t0: its four regions' sources (scale regions only for scaled formats).
  auto sources = [&](int t, const uint8_t*(&src)[4]) {
    const int64_t slot = ((int64_t)__ldcg(table + (t >> p.log2S)) << p.log2S) | (t & smask);
    src[0] = p.kc + slot * kc_row;
    src[1] = kScaled<KF> ? reinterpret_cast<const uint8_t*>(p.ks) + slot * sc_row : nullptr;
    src[2] = p.vc + slot * vc_row;
    src[3] = kScaled<VF> ? reinterpret_cast<const uint8_t*>(p.vs) + slot * sc_row : nullptr;
    return slot;
  };
  const int bytes[4] = {lay.k_codes, lay.k_scales, lay.v_codes, lay.v_scales};
  if (p.prefetch && warp == kStreamWarps) {
    // The ring's first fill into L2 while the previous kernel finishes: its lengths and tables may be stale here
    // (read past L1, so no stale line stays for the loads after the wait), which costs only wasted reads; the
    // copies after the wait then find their chunks in L2 (the newest K / V row included: L2 is where the previous
    // kernel's writes land).
    const StreamRange pre = stream_split_range(p, __ldcg(p.context_lens + b), split);
    const int n_pre = min(stages, (pre.t1 - pre.t0 + kStreamChunk - 1) / kStreamChunk);
    for (int i = lane; i < n_pre; i += 32) {
      const uint8_t* src[4];
      const int64_t slot = sources(pre.t0 + i * kStreamChunk, src);
      if (slot < 0 || slot >= ((int64_t)p.num_pages << p.log2S)) continue;  // a stale entry may be anything
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if (bytes[r])
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src[r]), "r"(bytes[r]) : "memory");
    }
  }
  exl2::pdl_wait();  // q, the newest K / V row, the tables and lengths come from earlier kernels
  exl2::pdl_launch_dependents();

  const StreamRange range = stream_split_range(p, p.context_lens[b], split);
  const int t0 = range.t0, t1 = range.t1;
  const unsigned char* ring = smem;  // [stages][K codes | K scales | V codes | V scales]
  if (t0 >= t1) {
    if (warp < kStreamWarps) stream_empty_split<D>(p, b, kStreamWarps * 32);
    return;
  }
  const int nch = (t1 - t0 + kStreamChunk - 1) / kStreamChunk;

  if (warp == kStreamWarps) {  // producer: lane 0 keeps `stages` chunks in flight
    if (lane == 0) {
      const uint64_t pol = exl2::evict_first_policy();  // read once per step
      for (int c = 0; c < nch; ++c) {
        const int s = c % stages;
        if (c >= stages) exl2::mbar_wait(empty0 + 8 * s, ((c / stages) - 1) & 1);
        const uint8_t* src[4];
        sources(t0 + c * kStreamChunk, src);
        uint32_t dst = exl2::smem_addr(ring + (size_t)s * lay.total);
        exl2::mbar_expect_tx(full0 + 8 * s, lay.total);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if (bytes[r]) exl2::bulk_copy(dst, src[r], bytes[r], full0 + 8 * s, pol);
          dst += bytes[r];
        }
      }
    }
    return;
  }

  // compute warps
  const int wph = kStreamWarps / p.Hkv;  // warps per kv head
  const int h = warp / wph, wj = warp % wph, tg = lane >> 3, sub = lane & 7;
  float q[G][16];
  if constexpr (!kScaled<KF>) {  // fp16 pages: q straight from global memory (16-byte aligned rows)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const half* qrow = p.q + (int64_t)b * p.q_bs + (int64_t)(h * G + g) * p.q_hs;
#pragma unroll
      for (int r = 0; r < 2; ++r) halves8(__ldg(reinterpret_cast<const uint4*>(qrow + 64 * r + 8 * sub)), q[g] + 8 * r);
    }
  } else {  // code pages: q staged as fp32 [Hq][D], rotated per group of 32 where the keys are
    float* qs = reinterpret_cast<float*>(smem + (size_t)stages * lay.total);
    for (int i = threadIdx.x; i < p.Hq * D; i += kStreamWarps * 32)
      qs[i] = __half2float(p.q[(int64_t)b * p.q_bs + (int64_t)(i / D) * p.q_hs + i % D]);
    if constexpr (KVFormat<KF>::ROT) {
      stream_sync();
      for (int grp = warp; grp < p.Hq * D / KV_GROUP; grp += kStreamWarps)  // warp-uniform: every lane shuffles
        qs[grp * KV_GROUP + lane] = warp_fwht32(qs[grp * KV_GROUP + lane]);
    }
    stream_sync();
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 16; ++i) q[g][i] = qs[(h * G + g) * D + lane_dim(sub, i)];
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
    const uint8_t* kcodes = ring + (size_t)s * lay.total;
    const uint8_t* kscales = kcodes + lay.k_codes;
    const uint8_t* vcodes = kscales + lay.k_scales;
    const uint8_t* vscales = vcodes + lay.v_codes;
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
      lane_row<KF>(kcodes, token, p.Hkv, h, sub, k);
      const float2 ks = lane_scales<KF>(kscales, token, p.Hkv, h, sub);
      const bool valid = tc + token < t1;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d0 = 0.f, d1 = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          d0 = fmaf(q[g][i], k[i], d0);
          d1 = fmaf(q[g][8 + i], k[8 + i], d1);
        }
        float d = kScaled<KF> ? fmaf(d0, ks.x, d1 * ks.y) : d0 + d1;
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        d += __shfl_xor_sync(0xffffffffu, d, 4);
        sc[st][g] = valid ? d * p.scale_log2 : -INFINITY;  // NaN from unused slots' bits is masked here
        mx[g] = fmaxf(mx[g], sc[st][g]);
      }
    }
    float mu[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], 8));
      mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], 16));
      const float m_new = fmaxf(m[g], mx[g]);
      mu[g] = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: every p is 0, no NaN
      const float alpha = exp2f(m[g] - mu[g]);
      m[g] = m_new;
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[g][i] *= alpha;
    }
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      if (st % wph != wj) continue;
      const int token = 4 * st + tg;
      if (tc + token >= t1) continue;  // past the split: its p is 0, but its V may be any bits (NaN * 0)
      float v[16];
      lane_row<VF>(vcodes, token, p.Hkv, h, sub, v);
      const float2 vs = lane_scales<VF>(vscales, token, p.Hkv, h, sub);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pr = exp2f(sc[st][g] - mu[g]);
        l[g] += pr;
        const float p0 = pr * vs.x, p1 = pr * vs.y;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[g][i] = fmaf(p0, v[i], acc[g][i]);
          acc[g][8 + i] = fmaf(p1, v[8 + i], acc[g][8 + i]);
        }
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
  // the head's warps combined: output (hq, d) per thread step; a warp's 32 lanes take 32 consecutive dims (one
  // group: the rotation back with one split), and Hq * D is a multiple of the 256 threads (Hq >= 2)
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
      float y = den > 0.f ? o / den : 0.f;
      if constexpr (KVFormat<VF>::ROT) y = warp_fwht32(y);
      p.out[prow * D + d] = __float2half_rn(y);
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

template <int KF, int VF, int G>
int launch_g(const QAttnParams& p, int B, cudaStream_t stream) {
  const int stage = StageLayout<KF, VF>(p.Hkv).total, qbytes = staged_q_bytes<KF>(p.Hq);
  const int stages = min(kStreamMaxStages, (kStreamSmemTarget - qbytes) / stage);
  const int smem = stages * stage + qbytes;
  constexpr auto kernel = paged_attention_stream_kernel<KF, VF, G>;
  const cudaError_t err = exl2::opt_in_dynamic_smem<kernel>((size_t)smem);
  if (err != cudaSuccess)
    return exl2::set_error((int)err, "paged_attention (stream): %d bytes of shared memory: %s", smem,
                           cudaGetErrorString(err));
  exl2::launch_kernel(kernel, dim3((unsigned)p.nsplit, (unsigned)B), kStreamThreads, (size_t)smem, stream, p, stages);
  return check_launch("paged_attention (stream)");
}

template <int KF, int VF>
int launch_formats(const QAttnParams& p, int B, cudaStream_t stream) {
  return p.G == 1 ? launch_g<KF, VF, 1>(p, B, stream) : p.G == 2 ? launch_g<KF, VF, 2>(p, B, stream)
                                                                 : launch_g<KF, VF, 4>(p, B, stream);
}

}  // namespace

// The streamed decode attention (flags bit 9 of exl2_paged_attention, use_mma == 64 of exl2_paged_attention_quant):
// a decode step (Tq == 1), D = 128, G = Hq / Hkv in {1, 2, 4}, Hkv in {2, 4, 8}, on sm_90+, over fp16 pages
// (k_fmt = v_fmt = kFmtF16) or code pages (the kv_quant_write pairs); its reduce launch when nsplit > 1. `a` holds
// the other kernels' parameters (part_o / part_ml laid out as theirs).
int launch_paged_attention_stream(const QAttnParams& a, int k_fmt, int v_fmt, int D, int B, cudaStream_t stream) {
  const bool mma = D == kStreamD && stream_mma_takes(k_fmt, v_fmt, a);  // fp16 pages over 8 kv heads: tensor cores
  EXL2_REQUIRE(D == kStreamD && (a.Tq == 1 || mma),
               "paged_attention (stream): decode steps with head_dim 128 only (verify rows: fp16 pages over 8 kv "
               "heads, at most 64 rows per kv head)");
  EXL2_REQUIRE(a.Hkv == 2 || a.Hkv == 4 || a.Hkv == 8, "paged_attention (stream): %d kv heads (2, 4 or 8)", a.Hkv);
  EXL2_REQUIRE(a.G == 1 || a.G == 2 || a.G == 4 || (mma && a.G == 8),
               "paged_attention (stream): %d query heads per kv head (1, 2, 4; 8 for fp16 pages over 8 kv heads)",
               a.G);
  EXL2_REQUIRE(a.log2S >= 4, "paged_attention (stream): pages of at least %d tokens", kStreamChunk);
  EXL2_REQUIRE(a.min_split >= kStreamChunk && a.min_split % kStreamChunk == 0,  // no chunk straddles two splits
               "paged_attention (stream): min_split %d must be a multiple of %d", a.min_split, kStreamChunk);
  // Bulk copies fault on a source not 16-byte aligned (a sticky error that ends the context): checked, not assumed.
  const bool scaled = k_fmt != kFmtF16;
  EXL2_REQUIRE(aligned16(a.kc) && aligned16(a.vc) && (!scaled || (aligned16(a.ks) && aligned16(a.vs))),
               "paged_attention (stream): cache and scale tensors must start 16-byte aligned");
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) !=
                                                 cudaSuccess)
    return exl2::set_error(EXL2_ERR_UNSUPPORTED, "paged_attention (stream): no device");
  EXL2_REQUIRE(major >= 9, "paged_attention (stream): needs sm_90+ (bulk copies)");
  QAttnParams p = a;
  p.prefetch = stream_prefetch();
  int st;
  if (mma) st = launch_paged_attention_stream_mma(p, B, stream);
  else if (k_fmt == kFmtF16 && v_fmt == kFmtF16) st = launch_formats<kFmtF16, kFmtF16>(p, B, stream);
  else if (k_fmt == kFmtI8 && v_fmt == kFmtI8) st = launch_formats<kFmtI8, kFmtI8>(p, B, stream);
  else if (k_fmt == kFmtI4 && v_fmt == kFmtI4) st = launch_formats<kFmtI4, kFmtI4>(p, B, stream);
  else if (k_fmt == kFmtI8 && v_fmt == kFmtI4) st = launch_formats<kFmtI8, kFmtI4>(p, B, stream);
  else if (k_fmt == kFmtE4M3 && v_fmt == kFmtE4M3) st = launch_formats<kFmtE4M3, kFmtE4M3>(p, B, stream);
  else return exl2::set_error(EXL2_ERR_INVALID_ARGUMENT, "paged_attention (stream): formats %d, %d", k_fmt, v_fmt);
  const bool rot = v_fmt == kFmtI8 || v_fmt == kFmtI4;  // V's sums are rotated: the reduce rotates them back
  return st != EXL2_OK ? st : launch_paged_attention_quant_reduce(a, rot, D, B, stream);
}

}  // namespace layers
}  // namespace exl2
