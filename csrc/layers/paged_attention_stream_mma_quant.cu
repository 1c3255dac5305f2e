// The streamed decode attention over code pages (q8, q6, q4, fp8) on tensor cores (sm_90+): the ring of
// paged_attention_stream.cu (a CTA per split for all 8 kv heads; each 16-token chunk's K codes, K scales, V codes
// and V scales one bulk copy each), with the arithmetic of paged_attention_stream_mma.cu. Why: over code pages the
// decode steps ran the register tensor-core kernel (paged_attention_quant_mma.cu), bound by its instructions and
// registers: at 32k ~43 us per layer for the 8B's q8 cache (1.6 TB/s) and ~34 us for q4 (1.1 TB/s) on an H100,
// where fp16 pages stream at 2.5 TB/s through the fp16 kernel.
//
// Two compute warps per kv head h: warp (h, a) takes tokens [8 a, 8 a + 8) of every chunk. It dequantizes its
// tokens' K and V rows of head h into fp16 rows of the fp16 kernel's layout (one 66 KB work area beside the ring;
// the warps write disjoint 16-byte runs), releases the ring slot, and runs the fp16 kernel's step on its token
// half: S for its 8-token tile (8 mma.m16n8k16), its own online softmax, O^T += V^T P^T over its 8 tokens
// (mma.m16n8k8, P as fp16 hi + residue). The two warps' states of a head are combined at the end. (One warp per
// head over whole chunks ran each chunk's dequantization and products as one dependent chain: at 32k, 42 us per
// layer for q8 and 40 for q4 on an H100, no faster than the register kernel; H100 call BC3 of 2026-12-06.)
// A lane dequantizes one group of 32 dims of one token (token lane / 4, group lane % 4): codes to exact fp16
// integers by the 0x64 exponent trick (1024 + code, minus 1024 + the bias), times the group scale, rounded once to
// fp16 (the precision of an fp16 cache holding the dequantized values, as the register kernel's V operand); e4m3
// codes convert pairwise. Tokens past the split are zeros.
// Integer formats hold rotated rows (kv_quant.cuh): the query rows are rotated per group of 32 before their
// fragments are taken, the sums over V stay rotated and are rotated back by the reduce launch (or here, with one
// split). Decode steps only (one query per sequence, G <= 8 rows per kv head: the fp16 kernel's first half-tile).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>

#include "common/api.h"
#include "common/bulk_copy.cuh"
#include "common/pdl.cuh"
#include "layers/attn_stream_mma.cuh"
#include "layers/attn_stream_ring.cuh"
#include "layers/kv_quant.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kWarps = 2 * kSmHkv;             // compute warps, two per kv head
// No producer warp: warp 0 refills each slot once every warp has released it. With a 17th warp one of the SM's four
// schedulers would hold 5 warps, which caps the kernel at 96 registers (5 x 32 x 96 of its 16K) and it spilled.
constexpr int kThreads = kWarps * 32;
constexpr int kMaxStages = 8;
constexpr int kQRows = 8;                      // staged query rows per kv head (G <= 8)
constexpr int kQBytes = kSmHkv * kQRows * kSmD * 2;  // fp16 [8 heads][8 rows][128]: 16 KB
constexpr int kSmemTarget = 220 * 1024;        // ring + work area + staged q

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void compute_sync() {  // the compute warps only (named barrier 1)
  asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory");
}

__device__ __forceinline__ uint32_t as_u32(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
__device__ __forceinline__ __half2 as_h2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

// Two integer codes (bytes 0 and 1 of `two`, low byte the lower dim) minus `off2` (1024 + bias) times `s2`: the
// bytes become the mantissas of 1024 + code (exact), the subtraction is exact, the product rounds once.
__device__ __forceinline__ uint32_t int_pair(uint32_t two, __half2 off2, __half2 s2) {
  const uint32_t h = __byte_perm(two, 0x64646464u, 0x4140u);  // [b0, 0x64, b1, 0x64]
  return as_u32(__hmul2(__hsub2(as_h2(h), off2), s2));
}

// Dequantizes token half `a` (tokens 8 a .. 8 a + 7) of head h's rows of one chunk region (codes [16 tokens][8
// heads][128 * BITS / 8], scales fp16 [16][8][4]) into fp16 rows at `rows` (row pitch kSmRowPitch, head h at byte
// 256 h); tokens >= nvalid: zeros.
template <int F>
__device__ __forceinline__ void dequant_rows(const uint8_t* codes, const uint8_t* scales, int h, int a, int nvalid,
                                             unsigned char* rows) {
  constexpr int kRowCodeBytes = kSmD * KVFormat<F>::BITS / 8;   // one (token, head) row of codes
  constexpr int kGroupBytes = KV_GROUP * KVFormat<F>::BITS / 8;  // 32 bytes (8-bit) or 16 (int4)
  const int lane = threadIdx.x & 31, grp = lane & 3;
  {
    const int tk = 8 * a + (lane >> 2);
    uint4* dst = reinterpret_cast<uint4*>(rows + tk * kSmRowPitch + h * kSmD * 2 + grp * KV_GROUP * 2);
    if (tk >= nvalid) {  // past the split: any bits (a NaN times p = 0 would still be NaN)
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = make_uint4(0, 0, 0, 0);
      return;
    }
    const int row = tk * kSmHkv + h;
    const uint8_t* src = codes + row * kRowCodeBytes + grp * kGroupBytes;
    const __half2 s2 = __half2half2(reinterpret_cast<const __half*>(scales)[row * (kSmD / KV_GROUP) + grp]);
    uint32_t o[16];  // the group's 32 values as 16 half2, dims in order
    if constexpr (F == kFmtI8) {
      const __half2 off2 = __float2half2_rn(1152.f);  // 1024 + 128
      const uint4 a = reinterpret_cast<const uint4*>(src)[0], b = reinterpret_cast<const uint4*>(src)[1];
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        o[2 * i] = int_pair(w[i], off2, s2);
        o[2 * i + 1] = int_pair(w[i] >> 16, off2, s2);
      }
    } else if constexpr (F == kFmtI4) {
      const __half2 off2 = __float2half2_rn(1032.f);  // 1024 + 8
      const uint4 a = *reinterpret_cast<const uint4*>(src);
      const uint32_t w[4] = {a.x, a.y, a.z, a.w};  // 8 dims each: byte m holds dim 2m (low nibble), 2m + 1
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = w[i] & 0x0F0F0F0Fu, hi = (w[i] >> 4) & 0x0F0F0F0Fu;
        const uint32_t d0123 = __byte_perm(lo, hi, 0x5140u), d4567 = __byte_perm(lo, hi, 0x7362u);
        o[4 * i] = int_pair(d0123, off2, s2);
        o[4 * i + 1] = int_pair(d0123 >> 16, off2, s2);
        o[4 * i + 2] = int_pair(d4567, off2, s2);
        o[4 * i + 3] = int_pair(d4567 >> 16, off2, s2);
      }
    } else {  // e4m3: exact in fp16, times the scale
      const uint4 a = reinterpret_cast<const uint4*>(src)[0], b = reinterpret_cast<const uint4*>(src)[1];
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
            (__nv_fp8x2_storage_t)((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu), __NV_E4M3);
        o[i] = as_u32(__hmul2(*reinterpret_cast<const __half2*>(&r), s2));
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
  }
}

// The fp16 kernel's chunk step (attn_stream_mma.cuh) on token half `a` of a chunk at tokens tc..: S for the half's
// 8-token tile (its B fragments from the ldmatrix of both tiles; the partner warp's tile, possibly being written,
// is not used), the online softmax over its tokens (keys at or past t1 score -inf), O^T += V^T P^T over the same 8
// tokens with k = 8 products (the A fragments of the half's tokens only).
__device__ __forceinline__ void half_chunk_step(const uint32_t (&qa)[1][kSmD / 16][2], uint32_t kaddr,
                                                uint32_t vaddr, int tc, int a, int t1, float scale_log2,
                                                StreamMmaAcc<1>& acc) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  float sc[4] = {0.f, 0.f, 0.f, 0.f};  // S of the half's tile: row gid, tokens 8 a + 2 t4 + (0, 1) in c0, c1
#pragma unroll
  for (int kk = 0; kk < kSmD / 16; ++kk) {
    const uint4 kb = ldsm_x4(kaddr + kk * 32);
    exl2::mma16816(sc, qa[0][kk][0], 0u, qa[0][kk][1], 0u, a ? kb.z : kb.x, a ? kb.w : kb.y);
  }
  float x[2], mx = -INFINITY;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    x[e] = tc + 8 * a + 2 * t4 + e < t1 ? sc[e] * scale_log2 : -INFINITY;  // masks stale K's NaN too
    mx = fmaxf(mx, x[e]);
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(acc.m[0], mx), mu = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: p = 0
  const float alpha = exp2f(acc.m[0] - mu);
  acc.m[0] = m_new;
  const float p0 = exp2f(x[0] - mu), p1 = exp2f(x[1] - mu);
  acc.l[0] = fmaf(acc.l[0], alpha, p0 + p1);
  const uint32_t bh = pack_half2(p0, p1);  // P^T's B fragment (tokens 2 t4, +1 of the half), hi + residue
  const float2 hv = unpack_half2(bh);
  const uint32_t bl = pack_half2(p0 - hv.x, p1 - hv.y);
  const float a_even = __shfl_sync(0xffffffffu, alpha, 8 * t4);  // the lanes holding rows 2 t4, 2 t4 + 1
  const float a_odd = __shfl_sync(0xffffffffu, alpha, 8 * t4 + 4);
#pragma unroll
  for (int mt = 0; mt < kSmD / 16; ++mt) {
    const uint4 va = ldsm_x4_trans(vaddr + mt * 32);
    const uint32_t a0 = a ? va.z : va.x, a1 = a ? va.w : va.y;  // dims 16 mt + gid, + 8 over the half's tokens
    acc.o[0][mt][0] *= a_even;
    acc.o[0][mt][1] *= a_odd;
    acc.o[0][mt][2] *= a_even;
    acc.o[0][mt][3] *= a_odd;
    exl2::mma1688(acc.o[0][mt], a0, a1, bh);
    exl2::mma1688(acc.o[0][mt], a0, a1, bl);
  }
}
#endif

template <int KF, int VF>
__global__ void __launch_bounds__(kThreads, 1) paged_attention_stream_mma_quant_kernel(const QAttnParams p,
                                                                                        const int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];  // [ring: stages][work: kSmChunkBytes][q: kQBytes]
  __shared__ __align__(8) uint64_t bars[2 * kMaxStages];  // full[stages], empty[stages]
  __shared__ float wm[kWarps][kQRows], wl[kWarps][kQRows];
  const int b = blockIdx.y, split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = exl2::smem_addr(bars), empty0 = full0 + 8 * kMaxStages;
  stream_ring_init(full0, empty0, stages, kWarps);
  const StageLayout<KF, VF> lay(kSmHkv);
  unsigned char* ring = smem;
  unsigned char* work = smem + (size_t)stages * lay.total;
  __half* qs = reinterpret_cast<__half*>(work + kSmChunkBytes);
  const int smask = (1 << p.log2S) - 1;
  const int kc_row = kSmHkv * kSmD * KVFormat<KF>::BITS / 8, vc_row = kSmHkv * kSmD * KVFormat<VF>::BITS / 8;
  const int sc_row = kSmHkv * (kSmD / KV_GROUP) * 2;  // scale bytes per token
  const int* table = p.block_tables + (int64_t)b * p.bt_stride;
  auto sources = [&](int t, const uint8_t*(&src)[4]) {  // chunk at token t: its four regions' sources
    const int64_t slot = ((int64_t)__ldcg(table + (t >> p.log2S)) << p.log2S) | (t & smask);
    src[0] = p.kc + slot * kc_row;
    src[1] = reinterpret_cast<const uint8_t*>(p.ks) + slot * sc_row;
    src[2] = p.vc + slot * vc_row;
    src[3] = reinterpret_cast<const uint8_t*>(p.vs) + slot * sc_row;
    return slot;
  };
  const int bytes[4] = {lay.k_codes, lay.k_scales, lay.v_codes, lay.v_scales};
  if (p.prefetch && warp == 0) {
    // The ring's first fill into L2 while the previous kernel finishes (as paged_attention_stream.cu: stale
    // lengths or tables here cost only wasted reads; a slot out of range is skipped).
    const StreamRange pre = stream_split_range(p, __ldcg(p.context_lens + b), split);
    const int n_pre = min(stages, (pre.t1 - pre.t0 + kSmChunk - 1) / kSmChunk);
    for (int i = lane; i < n_pre; i += 32) {
      const uint8_t* src[4];
      const int64_t slot = sources(pre.t0 + i * kSmChunk, src);
      if (slot < 0 || slot >= ((int64_t)p.num_pages << p.log2S)) continue;
#pragma unroll
      for (int r = 0; r < 4; ++r)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src[r]), "r"(bytes[r]) : "memory");
    }
  }
  exl2::pdl_wait();  // q, the newest K / V row, the tables and lengths come from earlier kernels
  exl2::pdl_launch_dependents();

  const int ctx = qattn_clamp_ctx(p.context_lens[b], p);
  const StreamRange range = stream_split_range(p, ctx, split);
  const int t0 = range.t0, t1 = range.t1;
  if (t0 >= t1) {
    stream_empty_split<kSmD>(p, b, kWarps * 32);
    return;
  }
  const int nch = (t1 - t0 + kSmChunk - 1) / kSmChunk;
  const uint64_t pol = exl2::evict_first_policy();  // read once per step
  auto issue = [&](int c) {  // chunk c's four regions into slot c % stages (one thread)
    const int s = c % stages;
    const uint8_t* src[4];
    sources(t0 + c * kSmChunk, src);
    uint32_t dst = exl2::smem_addr(ring + (size_t)s * lay.total);
    exl2::mbar_expect_tx(full0 + 8 * s, lay.total);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      exl2::bulk_copy(dst, src[r], bytes[r], full0 + 8 * s, pol);
      dst += bytes[r];
    }
  };
  if (threadIdx.x == 0)
    for (int c = 0; c < min(stages, nch); ++c) issue(c);

  // compute warps: warp (h, a) = (warp % 8, warp / 8), kv head h, token half a of each chunk. The head's query
  // rows r < G (heads h G + r) staged as fp16 by both its warps, rotated per group of 32 where the keys are;
  // gid = lane / 4 (a row of S, a dim of O^T), t4 = lane % 4.
  const int h = warp % kSmHkv, a = warp / kSmHkv, gid = lane >> 2, t4 = lane & 3, G = p.G;
  __half* qh = qs + h * kQRows * kSmD;  // [kQRows][128]
  for (int i = a; i < G * (kSmD / KV_GROUP); i += 2) {  // (row, group) per step, a lane per dim: warp-uniform
    const int r = i / (kSmD / KV_GROUP), d = (i % (kSmD / KV_GROUP)) * KV_GROUP + lane;
    float x = __half2float(p.q[(int64_t)b * p.q_bs + (int64_t)(h * G + r) * p.q_hs + d]);
    if constexpr (KVFormat<KF>::ROT) x = warp_fwht32(x);
    qh[r * kSmD + d] = __float2half_rn(x);
  }
  compute_sync();
  uint32_t qa[1][kSmD / 16][2];
#pragma unroll
  for (int kk = 0; kk < kSmD / 16; ++kk)
#pragma unroll
    for (int u = 0; u < 2; ++u)
      qa[0][kk][u] = gid < G ? *reinterpret_cast<const uint32_t*>(qh + gid * kSmD + 16 * kk + 8 * u + 2 * t4) : 0u;
  StreamMmaAcc<1> acc;
  acc.init();
  const uint32_t kaddr = exl2::smem_addr(work) + stream_mma_lane_offset(h, lane);
  const uint32_t vaddr = kaddr + kSmChunk * kSmRowPitch;
  for (int c = 0; c < nch; ++c) {
    const int s = c % stages;
    exl2::mbar_wait(full0 + 8 * s, (c / stages) & 1);
    const int tc = t0 + c * kSmChunk, nvalid = min(kSmChunk, t1 - tc);
    const uint8_t* kcodes = ring + (size_t)s * lay.total;
    const uint8_t* kscales = kcodes + lay.k_codes;
    const uint8_t* vcodes = kscales + lay.k_scales;
    const uint8_t* vscales = vcodes + lay.v_codes;
    dequant_rows<KF>(kcodes, kscales, h, a, nvalid, work);
    dequant_rows<VF>(vcodes, vscales, h, a, nvalid, work + kSmChunk * kSmRowPitch);
    __syncwarp();  // the warp's rows are written; its reads of the slot are done
    if (lane == 0) exl2::mbar_arrive(empty0 + 8 * s);
    if (warp == 0 && c + stages < nch) {  // the slot's refill once all 16 warps have released it
      if (lane == 0) {
        exl2::mbar_wait(empty0 + 8 * s, (c / stages) & 1);
        issue(c + stages);
      }
      __syncwarp();
    }
    half_chunk_step(qa, kaddr, vaddr, tc, a, t1, p.scale_log2, acc);
    __syncwarp();  // every lane's reads of the rows are done before the next chunk's writes
  }

  // the row's sum over its 4 lanes; each warp's (m, l) and O^T through shared memory (the work area, once every
  // warp is done with it); then the head's two warps combined, warp (h, a) taking groups 2 a, 2 a + 1 of each row,
  // a lane per dim: 32 consecutive dims per step, as the rotation back needs
  acc.l[0] += __shfl_xor_sync(0xffffffffu, acc.l[0], 1);
  acc.l[0] += __shfl_xor_sync(0xffffffffu, acc.l[0], 2);
  if (t4 == 0 && gid < G) {
    wm[warp][gid] = acc.m[0];
    wl[warp][gid] = acc.l[0];
  }
  compute_sync();
  float* ow = reinterpret_cast<float*>(work);  // [warp][kQRows][128]: 64 KB of the 66 KB
#pragma unroll
  for (int mt = 0; mt < kSmD / 16; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        ow[(warp * kQRows + 2 * t4 + e) * kSmD + 16 * mt + gid + 8 * hi] = acc.o[0][mt][2 * hi + e];
  compute_sync();
  const int w0 = h, w1 = h + kSmHkv;  // the head's two warps
  for (int i = 0; i < G * 2; ++i) {
    const int r = i / 2, d = (2 * a + i % 2) * KV_GROUP + lane;
    const float m0 = wm[w0][r], m1 = wm[w1][r], M = fmaxf(m0, m1), Mu = M == -INFINITY ? 0.f : M;
    const float f0 = exp2f(m0 - Mu), f1 = exp2f(m1 - Mu);
    const float v = fmaf(f0, ow[(w0 * kQRows + r) * kSmD + d], f1 * ow[(w1 * kQRows + r) * kSmD + d]);
    const float lg = fmaf(f0, wl[w0][r], f1 * wl[w1][r]);
    const int64_t prow = (int64_t)b * p.Hq + h * G + r;  // Tq == 1
    if (p.nsplit == 1) {
      float y = lg > 0.f ? v / lg : 0.f;
      if constexpr (KVFormat<VF>::ROT) y = warp_fwht32(y);
      p.out[prow * kSmD + d] = __float2half_rn(y);
    } else {
      const int64_t ps = prow * p.nsplit + split;
      p.part_o[ps * kSmD + d] = v;
      if (d == 0) {
        p.part_ml[ps * 2] = M;
        p.part_ml[ps * 2 + 1] = lg;
      }
    }
  }
#else
  __trap();  // the host launches this kernel on sm_90+ only
#endif
}

template <int KF, int VF>
int launch_formats(const QAttnParams& p, int B, cudaStream_t stream) {
  const int stage = StageLayout<KF, VF>(kSmHkv).total;
  const int stages = min(kMaxStages, (kSmemTarget - kSmChunkBytes - kQBytes) / stage);
  const size_t smem = (size_t)stages * stage + kSmChunkBytes + kQBytes;
  constexpr auto kernel = paged_attention_stream_mma_quant_kernel<KF, VF>;
  const cudaError_t err = exl2::opt_in_dynamic_smem<kernel>(smem);
  if (err != cudaSuccess)
    return exl2::set_error((int)err, "paged_attention (stream, tensor cores, code pages): %d bytes of shared "
                           "memory: %s", (int)smem, cudaGetErrorString(err));
  exl2::launch_kernel(kernel, dim3((unsigned)p.nsplit, (unsigned)B), kThreads, smem, stream, p, stages);
  return check_launch("paged_attention (stream, tensor cores, code pages)");
}

}  // namespace

bool stream_mma_quant_takes(int k_fmt, int v_fmt, const QAttnParams& p) {
  const bool formats = (k_fmt == kFmtI8 && (v_fmt == kFmtI8 || v_fmt == kFmtI4)) ||
                       (k_fmt == kFmtI4 && v_fmt == kFmtI4) || (k_fmt == kFmtE4M3 && v_fmt == kFmtE4M3);
  return formats && p.Hkv == kSmHkv && (p.G == 1 || p.G == 2 || p.G == 4 || p.G == 8) && p.Tq == 1;
}

int launch_paged_attention_stream_mma_quant(const QAttnParams& p, int k_fmt, int v_fmt, int B, cudaStream_t stream) {
  EXL2_REQUIRE(stream_mma_quant_takes(k_fmt, v_fmt, p) && p.R == p.G,
               "paged_attention (stream, tensor cores, code pages): formats %d / %d, %d kv heads, %d rows, Tq %d",
               k_fmt, v_fmt, p.Hkv, p.R, p.Tq);
  if (k_fmt == kFmtI8 && v_fmt == kFmtI8) return launch_formats<kFmtI8, kFmtI8>(p, B, stream);
  if (k_fmt == kFmtI8) return launch_formats<kFmtI8, kFmtI4>(p, B, stream);
  if (k_fmt == kFmtI4) return launch_formats<kFmtI4, kFmtI4>(p, B, stream);
  return launch_formats<kFmtE4M3, kFmtE4M3>(p, B, stream);
}

}  // namespace layers
}  // namespace exl2
