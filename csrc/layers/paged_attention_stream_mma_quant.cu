// The streamed decode attention over code pages (q8, q6, q4, fp8) on tensor cores (sm_90+): the ring of
// paged_attention_stream.cu (a CTA per split for all 8 kv heads; each 16-token chunk's K codes, K scales, V codes
// and V scales one bulk copy each), with the arithmetic of paged_attention_stream_mma.cu. Why: over code pages the
// decode steps ran the register tensor-core kernel (paged_attention_quant_mma.cu), bound by its instructions and
// registers: at 32k ~43 us per layer for the 8B's q8 cache (1.6 TB/s) and ~34 us for q4 (1.1 TB/s) on an H100,
// where fp16 pages stream at 2.5 TB/s through the fp16 kernel.
//
// Per chunk each compute warp (= kv head h) dequantizes its head's 16 K rows into fp16 rows of the fp16 kernel's
// layout (a 33 KB work area beside the ring: warp h writes and reads only its head's 256 bytes of each row, so no
// barrier between warps), takes the chunk's scores and softmax from them (attn_stream_mma.cuh), dequantizes the V
// rows into the same rows, releases the ring slot and adds the values. One work area for K and V in turn leaves
// the ring more of the shared memory: the kernel is bound by the bytes in flight (H100 call BC3 of 2026-12-06, with
// K and V areas side by side and 4 q8 stages, 136 KB in flight per SM: 1.69 TB/s at 32k, where the fp16 kernel's
// 198 KB stream at 2.5; two warps per head on half chunks each, BC4, ran slower still).
// A lane dequantizes one group of 32 dims of a token per pass (token lane / 4 + 8 pass, group lane % 4): codes to
// exact fp16 integers by the 0x64 exponent trick (1024 + code, minus 1024 + the bias), times the group scale,
// rounded once to fp16 (the precision of an fp16 cache holding the dequantized values, as the register kernel's V
// operand); e4m3 codes convert pairwise. Tokens past the split are zeros.
// Integer formats hold rotated rows (kv_quant.cuh): each warp rotates its query rows per group of 32 before taking
// their fragments, the sums over V stay rotated and are rotated back by the reduce launch (or here, with one split).
// Decode steps only (one query per sequence, G <= 8 rows per kv head: the fp16 kernel's first half-tile).
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

constexpr int kWarps = kSmHkv;                 // compute warps, one per kv head
constexpr int kThreads = (kWarps + 1) * 32;    // + the producer warp
constexpr int kMaxStages = 8;
constexpr int kQRows = 8;                      // staged query rows per kv head (G <= 8)
constexpr int kWorkBytes = kSmChunk * kSmRowPitch;  // one chunk's fp16 K (then V) rows: 33,024 bytes
// The work area first holds the staged q (fp16 [8 heads][8 rows][128]) and last the warps' outputs (fp32 [8][8][128])
static_assert(kSmHkv * kQRows * kSmD * 4 <= kWorkBytes, "the outputs fit the work area");
constexpr int kSmemTarget = 220 * 1024;        // ring + work area

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

// Dequantizes warp h's rows of one chunk region (codes [16 tokens][8 heads][128 * BITS / 8], scales fp16
// [16][8][4]) into fp16 rows at `rows` (row pitch kSmRowPitch, head h at byte 256 h); tokens >= nvalid: zeros.
template <int F>
__device__ __forceinline__ void dequant_rows(const uint8_t* codes, const uint8_t* scales, int h, int nvalid,
                                             unsigned char* rows) {
  constexpr int kRowCodeBytes = kSmD * KVFormat<F>::BITS / 8;   // one (token, head) row of codes
  constexpr int kGroupBytes = KV_GROUP * KVFormat<F>::BITS / 8;  // 32 bytes (8-bit) or 16 (int4)
  const int lane = threadIdx.x & 31, grp = lane & 3;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int tk = 8 * pass + (lane >> 2);
    uint4* dst = reinterpret_cast<uint4*>(rows + tk * kSmRowPitch + h * kSmD * 2 + grp * KV_GROUP * 2);
    if (tk >= nvalid) {  // past the split: any bits (a NaN times p = 0 would still be NaN)
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = make_uint4(0, 0, 0, 0);
      continue;
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
#endif

template <int KF, int VF>
__global__ void __launch_bounds__(kThreads, 1) paged_attention_stream_mma_quant_kernel(const QAttnParams p,
                                                                                        const int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];  // [ring: stages][work: kWorkBytes]
  __shared__ __align__(8) uint64_t bars[2 * kMaxStages];  // full[stages], empty[stages]
  __shared__ float wm[kWarps][kQRows], wl[kWarps][kQRows];
  const int b = blockIdx.y, split = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t full0 = exl2::smem_addr(bars), empty0 = full0 + 8 * kMaxStages;
  stream_ring_init(full0, empty0, stages, kWarps);
  const StageLayout<KF, VF> lay(kSmHkv);
  unsigned char* ring = smem;
  unsigned char* work = smem + (size_t)stages * lay.total;
  __half* qs = reinterpret_cast<__half*>(work);  // until the query fragments are in registers
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
  if (p.prefetch && warp == kWarps) {
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
    if (warp < kWarps) stream_empty_split<kSmD>(p, b, kWarps * 32);
    return;
  }
  const int nch = (t1 - t0 + kSmChunk - 1) / kSmChunk;

  if (warp == kWarps) {  // producer: lane 0 keeps `stages` chunks in flight
    if (lane == 0) {
      const uint64_t pol = exl2::evict_first_policy();  // read once per step
      for (int c = 0; c < nch; ++c) {
        const int s = c % stages;
        if (c >= stages) exl2::mbar_wait(empty0 + 8 * s, ((c / stages) - 1) & 1);
        const uint8_t* src[4];
        sources(t0 + c * kSmChunk, src);
        uint32_t dst = exl2::smem_addr(ring + (size_t)s * lay.total);
        exl2::mbar_expect_tx(full0 + 8 * s, lay.total);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          exl2::bulk_copy(dst, src[r], bytes[r], full0 + 8 * s, pol);
          dst += bytes[r];
        }
      }
    }
    return;
  }

  // compute warps: kv head h = warp; its query rows r < G (heads h G + r) staged as fp16, rotated per group of 32
  // where the keys are; gid = lane / 4 (a row of S, a dim of O^T), t4 = lane % 4.
  const int h = warp, gid = lane >> 2, t4 = lane & 3, G = p.G;
  __half* qh = qs + h * kQRows * kSmD;  // [kQRows][128]
  {
    // (row, group) items, a lane per dim: every load in flight first (one after another they were a fifth of the
    // kernel at 32k, each an L2 round trip behind the streaming CTAs: ncu, H100 call BC6), then the rotations
    constexpr int kItems = kQRows * (kSmD / KV_GROUP);
    float x[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int r = i / (kSmD / KV_GROUP), d = (i % (kSmD / KV_GROUP)) * KV_GROUP + lane;
      x[i] = r < G ? __half2float(p.q[(int64_t)b * p.q_bs + (int64_t)(h * G + r) * p.q_hs + d]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int r = i / (kSmD / KV_GROUP), d = (i % (kSmD / KV_GROUP)) * KV_GROUP + lane;
      if (r >= G) break;  // warp-uniform
      if constexpr (KVFormat<KF>::ROT) x[i] = warp_fwht32(x[i]);
      qh[r * kSmD + d] = __float2half_rn(x[i]);
    }
  }
  __syncwarp();
  uint32_t qa[1][kSmD / 16][2];
#pragma unroll
  for (int kk = 0; kk < kSmD / 16; ++kk)
#pragma unroll
    for (int u = 0; u < 2; ++u)
      qa[0][kk][u] = gid < G ? *reinterpret_cast<const uint32_t*>(qh + gid * kSmD + 16 * kk + 8 * u + 2 * t4) : 0u;
  const int lim[1] = {t1};
  compute_sync();  // every warp's fragments are taken before any warp's rows overwrite the staged q
  StreamMmaAcc<1> acc;
  acc.init();
  const uint32_t rows_addr = exl2::smem_addr(work) + stream_mma_lane_offset(h, lane);
  for (int c = 0; c < nch; ++c) {
    const int s = c % stages;
    exl2::mbar_wait(full0 + 8 * s, (c / stages) & 1);
    const int tc = t0 + c * kSmChunk, nvalid = min(kSmChunk, t1 - tc);
    const uint8_t* kcodes = ring + (size_t)s * lay.total;
    const uint8_t* kscales = kcodes + lay.k_codes;
    const uint8_t* vcodes = kscales + lay.k_scales;
    const uint8_t* vscales = vcodes + lay.v_codes;
    dequant_rows<KF>(kcodes, kscales, h, nvalid, work);
    __syncwarp();  // the warp's K rows are written
    const StreamMmaP<1> P = stream_mma_scores<1>(qa, rows_addr, tc, lim, p.scale_log2, acc);
    __syncwarp();  // every lane's reads of the K rows are done
    dequant_rows<VF>(vcodes, vscales, h, nvalid, work);
    __syncwarp();  // the warp's V rows are written; its reads of the slot are done
    if (lane == 0) exl2::mbar_arrive(empty0 + 8 * s);
    stream_mma_values<1>(rows_addr, P, acc);
    __syncwarp();  // every lane's reads of the rows are done before the next chunk's writes
  }

  // the row's sum over its 4 lanes; rows' (m, l) and O^T through shared memory (the work area, once every warp
  // is done with it), then a lane per dim: 32 consecutive dims per step, as the rotation back needs
  acc.l[0] += __shfl_xor_sync(0xffffffffu, acc.l[0], 1);
  acc.l[0] += __shfl_xor_sync(0xffffffffu, acc.l[0], 2);
  if (t4 == 0 && gid < G) {
    wm[h][gid] = acc.m[0];
    wl[h][gid] = acc.l[0];
  }
  compute_sync();
  float* ow = reinterpret_cast<float*>(work) + h * kQRows * kSmD;  // [kQRows][128]
#pragma unroll
  for (int mt = 0; mt < kSmD / 16; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
#pragma unroll
      for (int e = 0; e < 2; ++e) ow[(2 * t4 + e) * kSmD + 16 * mt + gid + 8 * hi] = acc.o[0][mt][2 * hi + e];
  __syncwarp();
  for (int i = 0; i < G * (kSmD / KV_GROUP); ++i) {
    const int r = i / (kSmD / KV_GROUP), d = (i % (kSmD / KV_GROUP)) * KV_GROUP + lane;
    const float v = ow[r * kSmD + d], lg = wl[h][r];
    const int64_t prow = (int64_t)b * p.Hq + h * G + r;  // Tq == 1
    if (p.nsplit == 1) {
      float y = lg > 0.f ? v / lg : 0.f;
      if constexpr (KVFormat<VF>::ROT) y = warp_fwht32(y);
      p.out[prow * kSmD + d] = __float2half_rn(y);
    } else {
      const int64_t ps = prow * p.nsplit + split;
      p.part_o[ps * kSmD + d] = v;
      if (d == 0) {
        p.part_ml[ps * 2] = wm[h][r];
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
  const int stages = min(kMaxStages, (kSmemTarget - kWorkBytes) / stage);
  const size_t smem = (size_t)stages * stage + kWorkBytes;
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
