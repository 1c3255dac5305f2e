// Decode / verify attention over quantized (and, for paged_attention.cu, fp16) K/V pages on the tensor cores:
// the flash-decoding scheme of paged_attention_quant.cu (grid (row_tiles * nsplit, Hkv, B); scores -> shared
// memory, softmax statistics, o = sum p v, the same split partials for the same reduce kernel), with both
// products as mma.m16n8k16.
//
// Why: the CUDA-core kernel spends ~90 instructions per lane per key (a lane's 8 dims x 4 rows of FMAs, the
// butterfly across 16 lanes, the score store) and ran the 8B's q8 cache at 32k at 59 us per layer, 1.1 TB/s
// (H200 call J1 of 2026-12-02), slower than the fp16 cache it reads half the bytes of. Here a warp takes 16 keys
// per step in ~250 instructions: call K1, q8 at 32k 45.8 against 65.5 us per layer, q4 39.2 against 55.3 (each
// kernel at its best split); 8B decode at 32k 241.7 against 208.8 tok/s (q8), 251.1 against 220.1 (q4).
//
// Precision: codes decode exactly into fp16 (integers minus their bias, |c| <= 128; e4m3 values are fp16
// values). The fp32 operand of each product (q, the probabilities) is split into two fp16 parts, x = hi + lo
// (|lo| <= 2^-11 |x|, its own rounding error 2^-22 |x|): the tile's 8 query rows are the mma's rows 0..7 (hi) and
// again 8..15 (lo), so a product costs one mma and keeps ~fp32 accuracy (a row's two C rows are added at the end).
// Scores: exact integer (or e4m3) dot products per group of 32 dims, scaled by the key's fp32 group scale after
// the mma, then by the softmax scale. Values: the B operand is code * scale rounded to fp16 once (the precision of
// fp16 attention over the dequantized values; any magnitude an fp16 cache holds stays in the normal range, where
// a probability times a scale would fall into subnormals for small values).
//
// Layouts (lane = 4 gid + t4, fragments as common/mma.cuh):
//   scores S[row][key] = sum_g ks[key][g] * sum_{d in g} q[row][d] c[key][d]:
//     A = q, rows gid (hi) / gid + 8 (lo); B = codes, n = key (8 per mma, two n-blocks per 16 keys); k = the 16
//     dims of half h of group g, permuted: lane t4 holds dims g*32 + t4*8 + [0, 8), pair (2h) for k 2t4, 2t4+1 and
//     pair (2h + 1) for k 2t4+8, 2t4+9 (kpair_dim). A lane's K codes of a key and group are one 8- or 4-byte load.
//   outputs O[row][d] = sum_key p[row][key] (vs[key][g] c[key][d]), per group g:
//     A = p, rows gid (hi) / gid + 8 (lo), k = keys 2t4, 2t4+1, 2t4+8, 2t4+9 of the 16; B = codes * vs, n = dim:
//     mma j (0..3) of group g takes dims g*32 + n*4 + j, so a lane's V codes of a key and group are its 4 dims
//     gid*4 + [0, 4): one 4- or 2-byte load. C then holds dims g*32 + (2t4)*4 + j and g*32 + (2t4 + 1)*4 + j.
#include <stdlib.h>

#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kTileRows = 8;  // query rows per CTA: the mma's rows hold them twice (hi, lo)
constexpr int kKeysPerStep = 16;

// L2 prefetches (QAttnParams::prefetch bits; EXL2_ATTN_QUANT_PREFETCH selects them, read once). The scores phase
// waits on K loads and the output phase on V loads, with at most two steps of 16 keys in flight per warp
// (registers), so hints that keep the DRAM busy ahead of them were worth a try. H200 call K2 of
// 2026-12-02 (scripts/attention_sweep.py, 8B attention at 32k, 4 CTAs per SM, us per layer, fp16 / q8 / q4 pages):
// none 59.8 / 45.8 / 39.0; the first K rows (default) 59.0 / 45.2 / 38.1; with all V rows 66.4 / 50.2 / 42.7;
// with all K rows too 69.2 / 51.2 / 43.8: the whole-split prefetches only compete with the demand loads.
constexpr int kPrefetchKHead = 1;   // the split's first kPrefetchKeys K rows and scales, before the PDL wait
constexpr int kPrefetchV = 2;       // all its V rows and scales, as the scores phase starts (q8 at 32k: 34 MB)
constexpr int kPrefetchKAll = 4;    // all its K rows and scales, before the PDL wait
constexpr int kPrefetchKeys = 64;

int prefetch_mode() {
  static const int v = [] {
    const char* e = getenv("EXL2_ATTN_QUANT_PREFETCH");
    return e ? (atoi(e) & 7) : kPrefetchKHead;
  }();
  return v;
}

bool deep_variant() {
  static const bool v = [] {
    const char* e = getenv("EXL2_ATTN_QUANT_MMA_DEEP");
    return e != nullptr && atoi(e) == 1;
  }();
  return v;
}

// Rows [t_begin, t_end) of head kvh (code bytes `row_bytes` per row, then NG fp16 scales) into L2.
template <int NG>
__device__ __forceinline__ void prefetch_rows(const uint8_t* codes, const half* scales, int row_bytes, int t_begin,
                                              int t_end, const int* pages, int first_page, int log2S, int Hkv,
                                              int kvh) {
  for (int t = t_begin + (int)threadIdx.x; t < t_end; t += kQAttnThreads) {
    const int64_t slot = ((int64_t)pages[(t >> log2S) - first_page] << log2S) | (t & ((1 << log2S) - 1));
    const int64_t ri = slot * Hkv + kvh;
    for (int off = 0; off < row_bytes; off += 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(codes + ri * row_bytes + off));
    if (scales != nullptr) asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + ri * NG));
  }
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
__device__ __forceinline__ __half2 bits_h2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return h;
}

// fp32 pair -> (hi, lo) fp16 pairs with hi + lo == x to ~2^-22 relative.
__device__ __forceinline__ void split_f16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  hi = h2_bits(h);
  lo = h2_bits(__floats2half2_rn(x0 - hf.x, x1 - hf.y));
}

// int codes + bias as fp16 1024 + c (the half 0x6400 | byte, or | nibble): subtracting 1024 + bias is exact.
template <int F>
__device__ __forceinline__ uint32_t minus_bias(uint32_t h) {
  constexpr uint32_t kBias = F == kFmtI8 ? 0x64806480u : 0x64086408u;  // 1152 = 1024 + 128, 1032 = 1024 + 8
  return h2_bits(__hsub2(bits_h2(h), bits_h2(kBias)));
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two_bytes & 0xFFFFu), __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// ---- K side: a lane's 8 dims of one key and group --------------------------------------------------------------
template <int F>
struct KChunk {
  uint32_t w[F == kFmtI4 ? 1 : F == kFmtF16 ? 4 : 2];
};

template <int F>
__device__ __forceinline__ KChunk<F> load_k_chunk(const uint8_t* p, bool valid) {
  KChunk<F> c;
  if constexpr (F == kFmtF16) {
    const uint4 u = valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
    c.w[0] = u.x, c.w[1] = u.y, c.w[2] = u.z, c.w[3] = u.w;
  } else if constexpr (F == kFmtI4) {
    c.w[0] = valid ? __ldg(reinterpret_cast<const unsigned int*>(p)) : 0u;
  } else {
    const uint2 u = valid ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
    c.w[0] = u.x, c.w[1] = u.y;
  }
  return c;
}

// The two of the chunk's 8 dims that pair p (0..3) holds, low half first: (p, p + 4) for 4-bit codes (a word's
// nibble k is dim k, so one shift and mask yields the pair), (2p, 2p + 1) for bytes.
template <int F>
__host__ __device__ constexpr int kpair_dim(int p, int i) {
  return F == kFmtI4 ? p + 4 * i : 2 * p + i;
}

template <int F>
__device__ __forceinline__ uint32_t k_pair(const KChunk<F>& c, int p) {
  if constexpr (F == kFmtF16) {
    return c.w[p];
  } else if constexpr (F == kFmtI8) {
    return minus_bias<F>(__byte_perm(c.w[p >> 1], 0x64646464u, (p & 1) ? 0x4342u : 0x4140u));
  } else if constexpr (F == kFmtI4) {
    return minus_bias<F>(((c.w[0] >> (4 * p)) & 0x000F000Fu) | 0x64006400u);
  } else {
    return e4m3x2_to_f16x2(c.w[p >> 1] >> (16 * (p & 1)));
  }
}

// ---- V side: a lane's 4 dims of one key and group ---------------------------------------------------------------
template <int F>
struct VChunk {
  uint32_t w[F == kFmtF16 ? 2 : 1];
};

template <int F>
__device__ __forceinline__ VChunk<F> load_v_chunk(const uint8_t* p, bool valid) {
  VChunk<F> c;
  if constexpr (F == kFmtF16) {
    const uint2 u = valid ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
    c.w[0] = u.x, c.w[1] = u.y;
  } else if constexpr (F == kFmtI4) {
    c.w[0] = valid ? (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p)) : 0u;
  } else {
    c.w[0] = valid ? __ldg(reinterpret_cast<const unsigned int*>(p)) : 0u;
  }
  return c;
}

// Two keys' chunks -> h[j] = {dim j of key 0, dim j of key 1} as fp16, j = 0..3.
template <int F>
__device__ __forceinline__ void v_pairs(const VChunk<F>& c0, const VChunk<F>& c1, uint32_t (&h)[4]) {
  const uint32_t v0 = c0.w[0], v1 = c1.w[0];
  if constexpr (F == kFmtF16) {
    h[0] = __byte_perm(v0, v1, 0x5410u);
    h[1] = __byte_perm(v0, v1, 0x7632u);
    h[2] = __byte_perm(c0.w[1], c1.w[1], 0x5410u);
    h[3] = __byte_perm(c0.w[1], c1.w[1], 0x7632u);
  } else if constexpr (F == kFmtI4) {
    const uint32_t x = __byte_perm(v0, v1, 0x5410u);  // nibble j of key 0 at bit 4j, of key 1 at 16 + 4j
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = minus_bias<F>(((x >> (4 * j)) & 0x000F000Fu) | 0x64006400u);
  } else {
    const uint32_t lo = __byte_perm(v0, v1, 0x5140u), hi = __byte_perm(v0, v1, 0x7362u);  // interleaved bytes
    if constexpr (F == kFmtI8) {
      h[0] = minus_bias<F>(__byte_perm(lo, 0x64646464u, 0x4140u));
      h[1] = minus_bias<F>(__byte_perm(lo, 0x64646464u, 0x4342u));
      h[2] = minus_bias<F>(__byte_perm(hi, 0x64646464u, 0x4140u));
      h[3] = minus_bias<F>(__byte_perm(hi, 0x64646464u, 0x4342u));
    } else {
      h[0] = e4m3x2_to_f16x2(lo);
      h[1] = e4m3x2_to_f16x2(lo >> 16);
      h[2] = e4m3x2_to_f16x2(hi);
      h[3] = e4m3x2_to_f16x2(hi >> 16);
    }
  }
}

// The NG group scales of one key row (fp16, contiguous: 8 bytes at D = 128, 4 at D = 64), kept as loaded and
// converted where used (registers: U steps of them are in flight). Padded slots may hold NaN scales: not loaded.
template <int NG>
struct RowScales {
  uint32_t w[NG / 2];
  __device__ __forceinline__ float s(int g) const {
    const float2 f = __half22float2(bits_h2(w[g >> 1]));
    return (g & 1) ? f.y : f.x;
  }
};

// {scale of key 0, scale of key 1} of group g as fp16 (the value side's B operand is code * scale).
template <int NG>
__device__ __forceinline__ __half2 scale_pair(const RowScales<NG>& k0, const RowScales<NG>& k1, int g) {
  return bits_h2(__byte_perm(k0.w[g >> 1], k1.w[g >> 1], (g & 1) ? 0x7632u : 0x5410u));
}
template <int NG>
__device__ __forceinline__ RowScales<NG> load_row_scales(const half* p, bool valid) {
  RowScales<NG> r;
  if constexpr (NG == 4) {
    const uint2 u = valid ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
    r.w[0] = u.x, r.w[1] = u.y;
  } else {
    static_assert(NG == 2, "head_dim 64 or 128");
    r.w[0] = valid ? __ldg(reinterpret_cast<const unsigned int*>(p)) : 0u;
  }
  return r;
}

// U1 / U3: steps of 16 keys in flight per warp in the scores / output phase; MINB: CTAs per SM the registers
// are bounded for (4: 128 registers).
template <int D, int KF, int VF, int U1, int U3, int MINB>
__global__ void __launch_bounds__(kQAttnThreads, MINB) paged_attention_quant_mma_kernel(const QAttnParams p) {
  constexpr int U = U1;
  constexpr int NW = kQAttnWarps, RT = kTileRows;
  constexpr int KM = qattn_keys_max<RT>();
  constexpr int NG = D / KV_GROUP;
  constexpr int KBITS = KVFormat<KF>::BITS, VBITS = KVFormat<VF>::BITS;
  constexpr int KROW = D * KBITS / 8, VROW = D * VBITS / 8;  // code bytes per (slot, kv head)
  constexpr bool KSCALED = KF != kFmtF16, VSCALED = VF != kFmtF16;  // fp16 pages have no group scales
  static_assert(NW * RT * D <= RT * KM, "reduction buffer must fit in the score buffer");

  extern __shared__ float smem[];  // q staging [RT][D]; scores [RT][KM]; cross-warp buffer [NW][RT][D]
  __shared__ int pages[KM / 16 + 2];
  __shared__ float row_m[RT], row_l[RT];

  // PDL: before the wait this kernel reads only what kernels before the previous one wrote (block tables,
  // context lengths: the previous kernel had passed its own wait when this one launched) and only prefetches
  // K/V into L2 (a hint; the newest slot, written by the previous kernel, is read after the wait).
  const int tile = blockIdx.x % p.row_tiles, split = blockIdx.x / p.row_tiles;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int ctx = qattn_clamp_ctx(p.context_lens[b], p);
  const int L = qattn_split_len(ctx, p.nsplit, p.min_split);
  const int start = split * L;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, t4 = lane & 3;
  const int row0 = tile * RT;
  if (start >= ctx) {
    exl2::pdl_wait_and_trigger();
    qattn_empty_split<D, RT>(p, b, kvh, row0);
    return;
  }
  const int end = min(start + L, ctx);
  const int n = end - start;
  const int first_page = start >> p.log2S;
  qattn_load_pages(p, b, first_page, ((end - 1) >> p.log2S) - first_page + 1, pages);
  __syncthreads();  // pages[]
  if (p.prefetch & (kPrefetchKHead | kPrefetchKAll))
    prefetch_rows<NG>(p.kc, p.ks, KROW, start, (p.prefetch & kPrefetchKAll) ? end : min(end, start + kPrefetchKeys),
                      pages, first_page, p.log2S, p.Hkv, kvh);
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  qattn_stage_q<D, RT, KVFormat<KF>::ROT>(p, b, kvh, row0, 1.f, smem);  // the scale is applied to the fp32 sums
  __syncthreads();

  // A fragments of q for every (group, half): hi for row gid, lo for row gid + 8.
  uint32_t qa[NG][2][4];
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // pair 2h -> a0 / a1, pair 2h + 1 -> a2 / a3
        const float* qr = smem + gid * D + g * KV_GROUP + t4 * 8;
        const int pr = 2 * h + i;
        split_f16x2(qr[kpair_dim<KF>(pr, 0)], qr[kpair_dim<KF>(pr, 1)], qa[g][h][2 * i], qa[g][h][2 * i + 1]);
      }
  const int row = row0 + gid;
  const int own_lim = row < p.R ? ctx - p.Tq + row / p.G : -1;  // last key row gid may see (causal); none past R
  __syncthreads();  // q staging read: smem becomes the score buffer

  const int S_mask = (1 << p.log2S) - 1;
  auto slot_of = [&](int t) -> int64_t {  // cache slot of key t (a 16-key step never crosses a page)
    return ((int64_t)pages[(t >> p.log2S) - first_page] << p.log2S) | (t & S_mask);
  };

  if (p.prefetch & kPrefetchV) prefetch_rows<NG>(p.vc, p.vs, VROW, start, end, pages, first_page, p.log2S, p.Hkv, kvh);

  // ---- phase 1: scores, U steps of 16 keys in flight per warp ----
  for (int t0 = start + warp * kKeysPerStep; t0 < end; t0 += NW * kKeysPerStep * U) {
    KChunk<KF> kc[U][2][NG];    // keys t + nb * 8 + gid
    RowScales<NG> ksc[U][2][2];  // keys t + nb * 8 + 2 t4 + e
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      const int64_t base = t < end ? slot_of(t) : 0;
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const int key = t + nb * 8 + gid;
        const uint8_t* row_p = p.kc + ((base + nb * 8 + gid) * p.Hkv + kvh) * KROW;
#pragma unroll
        for (int g = 0; g < NG; ++g)
          kc[u][nb][g] = load_k_chunk<KF>(row_p + (g * KV_GROUP + t4 * 8) * KBITS / 8, key < end);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ke = nb * 8 + 2 * t4 + e;
          if constexpr (KSCALED)
            ksc[u][nb][e] = load_row_scales<NG>(p.ks + ((base + ke) * p.Hkv + kvh) * NG, t + ke < end);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      if (t >= end) break;
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        float s[2] = {0.f, 0.f};
#pragma unroll
        for (int g = 0; g < NG; ++g) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int h = 0; h < 2; ++h)
            mma16816(c, qa[g][h][0], qa[g][h][1], qa[g][h][2], qa[g][h][3], k_pair<KF>(kc[u][nb][g], 2 * h),
                     k_pair<KF>(kc[u][nb][g], 2 * h + 1));
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // hi + lo rows
            if constexpr (KSCALED) s[e] = fmaf(ksc[u][nb][e].s(g), c[e] + c[2 + e], s[e]);
            else s[e] += c[e] + c[2 + e];
          }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = t + nb * 8 + 2 * t4 + e;
          if (key < end) smem[gid * KM + (key - start)] = key <= own_lim ? s[e] * p.scale_log2 : -INFINITY;
        }
      }
    }
  }
  __syncthreads();

  qattn_softmax<RT, KM>(smem, n, row_m, row_l);
  __syncthreads();

  // ---- phase 3: o = sum p * vs * v per group ----
  float acc[NG][4][4];
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[g][j][i] = 0.f;
  const int kk[4] = {2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9};  // this lane's keys of the 16 (k index order)
  for (int t0 = start + warp * kKeysPerStep; t0 < end; t0 += NW * kKeysPerStep * U3) {
    VChunk<VF> vw[U3][4][NG];
    RowScales<NG> vsc[U3][4];
    float pk[U3][4];
#pragma unroll
    for (int u = 0; u < U3; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      const int64_t base = t < end ? slot_of(t) : 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool valid = t + kk[i] < end;
        const int64_t ri = (base + kk[i]) * p.Hkv + kvh;
#pragma unroll
        for (int g = 0; g < NG; ++g)
          vw[u][i][g] = load_v_chunk<VF>(p.vc + ri * VROW + (g * KV_GROUP + gid * 4) * VBITS / 8, valid);
        if constexpr (VSCALED) vsc[u][i] = load_row_scales<NG>(p.vs + ri * NG, valid);
        pk[u][i] = valid ? smem[gid * KM + (t - start) + kk[i]] : 0.f;  // stale scores past the split's keys
      }
    }
#pragma unroll
    for (int u = 0; u < U3; ++u) {
      if (t0 + u * NW * kKeysPerStep >= end) break;
      uint32_t a[4];  // a0 / a1: p of keys 2t4, 2t4+1 (hi, lo); a2 / a3: keys 2t4+8, 2t4+9
      split_f16x2(pk[u][0], pk[u][1], a[0], a[1]);
      split_f16x2(pk[u][2], pk[u][3], a[2], a[3]);
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        uint32_t b0[4], b1[4];
        v_pairs<VF>(vw[u][0][g], vw[u][1][g], b0);
        v_pairs<VF>(vw[u][2][g], vw[u][3][g], b1);
        if constexpr (VSCALED) {
          const __half2 s0 = scale_pair(vsc[u][0], vsc[u][1], g), s1 = scale_pair(vsc[u][2], vsc[u][3], g);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            b0[j] = h2_bits(__hmul2(bits_h2(b0[j]), s0));
            b1[j] = h2_bits(__hmul2(bits_h2(b1[j]), s1));
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) mma16816(acc[g][j], a[0], a[1], a[2], a[3], b0[j], b1[j]);
      }
    }
  }
  __syncthreads();  // done reading probabilities: reuse smem
  float* red = smem;  // [NW][RT][D]
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)  // c0 / c1 (hi rows) + c2 / c3 (lo rows): dim g*32 + (2 t4 + e)*4 + j of row gid
        red[(warp * RT + gid) * D + g * KV_GROUP + (2 * t4 + e) * 4 + j] = acc[g][j][e] + acc[g][j][2 + e];
  __syncthreads();
  qattn_write_rows<D, RT, KVFormat<VF>::ROT>(p, red, row_m, row_l, b, kvh, row0, split);
}

template <int D, int KF, int VF>
int launch(const QAttnParams& p, int B, cudaStream_t stream) {
  const dim3 grid((unsigned)(p.row_tiles * p.nsplit), (unsigned)p.Hkv, (unsigned)B);
  const size_t smem = sizeof(float) * kTileRows * qattn_keys_max<kTileRows>();
  QAttnParams q = p;
  q.prefetch = prefetch_mode();
  // Two steps of 16 keys in flight per warp in the scores phase (one for fp16 pages: the same bytes; two spill)
  // and one in the output phase, 128 registers. EXL2_ATTN_QUANT_MMA_DEEP=1 (a measurement build): twice those,
  // 168 registers, 3 CTAs per SM. H200 call K4 of 2026-12-02 measured it at 55.2 against 43.4 us per layer (q8 at
  // 32k), but never in one wave: 66 splits (4 CTAs per SM) are 528 CTAs for its 396 slots, and 50 (the split
  // for 3 per SM before attention_splits rounded down) 400. To run again at 49 splits (ATTN_CTAS_PER_SM=3).
  constexpr int U1 = KF == kFmtF16 ? 1 : 2;
  if (deep_variant())
    exl2::launch_kernel(paged_attention_quant_mma_kernel<D, KF, VF, 2 * U1, 2, 3>, grid, kQAttnThreads, smem, stream,
                        q);
  else
    exl2::launch_kernel(paged_attention_quant_mma_kernel<D, KF, VF, U1, 1, 4>, grid, kQAttnThreads, smem, stream, q);
  return check_launch("paged_attention_quant (mma)");
}

template <int D>
int launch_fmt(const QAttnParams& p, int kf, int vf, int B, cudaStream_t stream) {
  if (kf == kFmtF16 && vf == kFmtF16) return launch<D, kFmtF16, kFmtF16>(p, B, stream);
  if (kf == kFmtE4M3 && vf == kFmtE4M3) return launch<D, kFmtE4M3, kFmtE4M3>(p, B, stream);
  if (kf == kFmtI8 && vf == kFmtI8) return launch<D, kFmtI8, kFmtI8>(p, B, stream);
  if (kf == kFmtI8 && vf == kFmtI4) return launch<D, kFmtI8, kFmtI4>(p, B, stream);
  if (kf == kFmtI4 && vf == kFmtI4) return launch<D, kFmtI4, kFmtI4>(p, B, stream);
  return set_error(EXL2_ERR_UNSUPPORTED, "paged_attention_quant (mma): format pair (%d, %d) not built", kf, vf);
}

}  // namespace

int launch_paged_attention_quant_mma(const QAttnParams& p, int k_fmt, int v_fmt, int D, int B, cudaStream_t stream) {
  if (D == 64) return launch_fmt<64>(p, k_fmt, v_fmt, B, stream);
  if (D == 128) return launch_fmt<128>(p, k_fmt, v_fmt, B, stream);
  return set_error(EXL2_ERR_INVALID_ARGUMENT, "paged_attention_quant (mma): head_dim %d", D);
}

}  // namespace layers
}  // namespace exl2
