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
#include "layers/attn_mma_stage.cuh"
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

// Rows [t_begin, t_end) of head kvh (code bytes `row_bytes` per row, then NG fp16 scales) into L2 (NTH: the CTA's
// threads).
template <int NG, int NTH = kAttnThreads>
__device__ __forceinline__ void prefetch_rows(const uint8_t* codes, const half* scales, int row_bytes, int t_begin,
                                              int t_end, const int* pages, int first_page, int log2S, int Hkv,
                                              int kvh) {
  for (int t = t_begin + (int)threadIdx.x; t < t_end; t += NTH) {
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

// (a & mask) | bits in one lop3: the compiler splits it in two, since a lop3 takes one immediate operand (the
// constant in a register, set once outside the loops, lets it take both).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));  // 0xEA: (a & b) | c
  return d;
}

// Nibbles at bits 0..3 and 16..19 as fp16 1024 + c, minus 1032: c - 8, exact.
__device__ __forceinline__ uint32_t low_nibbles_minus_bias(uint32_t w) {
  return minus_bias<kFmtI4>(and_or(w, 0x000F000Fu, 0x64006400u));
}
// Nibbles at bits 4..7 and 20..23 as fp16 1024 + 16 c (0x6400 | c << 4, no shift): times 1/16 minus 72 is c - 8,
// exact (the fma's exact result is a small integer). So a word's four pairs cost one shift (by 8), not three.
__device__ __forceinline__ uint32_t high_nibbles_minus_bias(uint32_t w) {
  constexpr uint32_t kSixteenth = 0x2C002C00u, kMinus72 = 0xD480D480u;  // 1 / 16, -(64 + 8) as fp16 pairs
  return h2_bits(__hfma2(bits_h2(and_or(w, 0x00F000F0u, 0x64006400u)), bits_h2(kSixteenth), bits_h2(kMinus72)));
}

// The four pairs of a word of 4-bit codes: pair j holds the nibbles at bits 4j and 16 + 4j, minus their bias.
__device__ __forceinline__ void i4_pairs(uint32_t w, uint32_t (&h)[4]) {
  const uint32_t w8 = w >> 8;
  h[0] = low_nibbles_minus_bias(w);
  h[1] = high_nibbles_minus_bias(w);
  h[2] = low_nibbles_minus_bias(w8);
  h[3] = high_nibbles_minus_bias(w8);
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
    const uint32_t w = (p & 2) ? c.w[0] >> 8 : c.w[0];  // one shift for pairs 2 and 3 once the calls inline
    return (p & 1) ? high_nibbles_minus_bias(w) : low_nibbles_minus_bias(w);
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
    i4_pairs(__byte_perm(v0, v1, 0x5410u), h);  // nibble j of key 0 at bit 4j, of key 1 at 16 + 4j
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

// ---- the steps both kernels share -------------------------------------------------------------------------------

// A warp step of 16 keys [t, t + 16): its K side (the scores) and V side (the outputs).
template <int KF, int NG>
struct KStep {
  KChunk<KF> c[2][NG];    // keys t + nb * 8 + gid, the lane's 8 dims of group g
  RowScales<NG> s[2][2];  // keys t + nb * 8 + 2 t4 + e
};
template <int VF, int NG>
struct VStep {
  VChunk<VF> c[4][NG];  // keys t + step_key(i), the lane's 4 dims of group g
  RowScales<NG> s[4];
};

// The lane's keys of a step in the output mma's k order: 2t4, 2t4+1, 2t4+8, 2t4+9 (also the keys of its score
// C fragments, nb * 8 + 2 t4 + e, for i = 2 nb + e).
__device__ __forceinline__ int step_key(int i, int t4) { return 2 * t4 + (i & 1) + 8 * (i >> 1); }

// The split a CTA attends to and the lane's place in it.
struct MmaSplit {
  int split, kvh, b, ctx, start, end, first_page, row0, gid, t4;
  const int* pages;
  __device__ __forceinline__ int64_t slot(const QAttnParams& p, int t) const {  // a step never crosses a page
    return ((int64_t)pages[(t >> p.log2S) - first_page] << p.log2S) | (t & ((1 << p.log2S) - 1));
  }
};

// CTAs per split and kv head with NT row tiles per CTA: the launchers' grid x is tile_groups * nsplit, and
// mma_split_setup reads a CTA's group and split back from blockIdx.x.
__host__ __device__ __forceinline__ int tile_groups(int row_tiles, int nt) { return (row_tiles + nt - 1) / nt; }

// Geometry, pages and L2 prefetch of the first K rows, all before the PDL wait. NT row tiles per CTA (the staged
// kernel's shared rings; 1 elsewhere): CTA x covers tiles [NT * (x % groups), + NT) of split x / groups (groups:
// tile_groups); sp.row0 is its first row. false: an unused split (or an empty context), whose outputs are already
// written (after the wait).
template <int D, int KF, int RT, int NT = 1>
__device__ __forceinline__ bool mma_split_setup(const QAttnParams& p, MmaSplit& sp, int* pages) {
  constexpr int NG = D / KV_GROUP, KROW = D * KVFormat<KF>::BITS / 8, NTH = NT * kAttnThreads;
  const int groups = tile_groups(p.row_tiles, NT);
  const int tile = blockIdx.x % groups;
  sp.split = blockIdx.x / groups;
  sp.kvh = blockIdx.y, sp.b = blockIdx.z;
  // PDL: before the wait this kernel reads only what kernels before the previous one wrote (block tables,
  // context lengths: the previous kernel had passed its own wait when this one launched) and only prefetches
  // K/V into L2 (a hint; the newest slot, written by the previous kernel, is read after the wait).
  sp.ctx = attn_clamp_ctx(p.context_lens[sp.b], p);
  const int L = attn_split_len(sp.ctx, p.nsplit, p.min_split);
  sp.start = sp.split * L;
  sp.row0 = tile * NT * RT;
  sp.gid = (threadIdx.x & 31) >> 2, sp.t4 = threadIdx.x & 3;
  sp.pages = pages;
  if (sp.start >= sp.ctx) {
    exl2::pdl_wait_and_trigger();
    qattn_empty_split<D, NT * RT, NTH>(p, sp.b, sp.kvh, sp.row0);
    return false;
  }
  sp.end = min(sp.start + L, sp.ctx);
  sp.first_page = sp.start >> p.log2S;
  attn_load_pages<NTH>(p, sp.b, sp.first_page, ((sp.end - 1) >> p.log2S) - sp.first_page + 1, pages);
  __syncthreads();  // pages[]
  if (p.prefetch & (kPrefetchKHead | kPrefetchKAll))
    prefetch_rows<NG, NTH>(p.kc, p.ks, KROW, sp.start,
                           (p.prefetch & kPrefetchKAll) ? sp.end : min(sp.end, sp.start + kPrefetchKeys), pages,
                           sp.first_page, p.log2S, p.Hkv, sp.kvh);
  return true;
}

// The PDL wait, then q staged into qs [NT * RT][D] (rotated like the keys, unscaled: the softmax scale comes later).
template <int D, int KF, int RT, int NT = 1>
__device__ __forceinline__ void mma_split_stage_q(const QAttnParams& p, const MmaSplit& sp, float* qs) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  qattn_stage_q<D, NT * RT, KVFormat<KF>::ROT, NT * kAttnThreads>(p, sp.b, sp.kvh, sp.row0, 1.f, qs);
  __syncthreads();
}

template <int D, int KF, int RT, int NT = 1>
__device__ __forceinline__ bool mma_split_begin(const QAttnParams& p, MmaSplit& sp, int* pages, float* qs) {
  if (!mma_split_setup<D, KF, RT, NT>(p, sp, pages)) return false;
  mma_split_stage_q<D, KF, RT, NT>(p, sp, qs);
  return true;
}

// A fragments of q for every (group, half) from qs: hi for row gid, lo for row gid + 8.
template <int D, int KF>
__device__ __forceinline__ void q_fragments(const float* qs, int gid, int t4, uint32_t (&qa)[D / KV_GROUP][2][4]) {
#pragma unroll
  for (int g = 0; g < D / KV_GROUP; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // pair 2h -> a0 / a1, pair 2h + 1 -> a2 / a3
        const float* qr = qs + gid * D + g * KV_GROUP + t4 * 8;
        const int pr = 2 * h + i;
        split_f16x2(qr[kpair_dim<KF>(pr, 0)], qr[kpair_dim<KF>(pr, 1)], qa[g][h][2 * i], qa[g][h][2 * i + 1]);
      }
}

// The K side of the step at key t (slot `base`): codes of keys t + nb * 8 + gid, scales of the lane's score keys.
template <int D, int KF>
__device__ __forceinline__ void load_k_step(KStep<KF, D / KV_GROUP>& k, const QAttnParams& p, const MmaSplit& sp,
                                            int t, int64_t base) {
  constexpr int NG = D / KV_GROUP, KBITS = KVFormat<KF>::BITS, KROW = D * KBITS / 8;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const int key = t + nb * 8 + sp.gid;
    const uint8_t* row_p = p.kc + ((base + nb * 8 + sp.gid) * p.Hkv + sp.kvh) * KROW;
#pragma unroll
    for (int g = 0; g < NG; ++g)
      k.c[nb][g] = load_k_chunk<KF>(row_p + (g * KV_GROUP + sp.t4 * 8) * KBITS / 8, key < sp.end);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int ke = nb * 8 + 2 * sp.t4 + e;
      if constexpr (KF != kFmtF16)
        k.s[nb][e] = load_row_scales<NG>(p.ks + ((base + ke) * p.Hkv + sp.kvh) * NG, t + ke < sp.end);
    }
  }
}

// The V side of the step at key t (slot `base`): codes and scales of the lane's keys t + step_key(i).
template <int D, int VF>
__device__ __forceinline__ void load_v_step(VStep<VF, D / KV_GROUP>& v, const QAttnParams& p, const MmaSplit& sp,
                                            int t, int64_t base) {
  constexpr int NG = D / KV_GROUP, VBITS = KVFormat<VF>::BITS, VROW = D * VBITS / 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool valid = t + step_key(i, sp.t4) < sp.end;
    const int64_t ri = (base + step_key(i, sp.t4)) * p.Hkv + sp.kvh;
#pragma unroll
    for (int g = 0; g < NG; ++g)
      v.c[i][g] = load_v_chunk<VF>(p.vc + ri * VROW + (g * KV_GROUP + sp.gid * 4) * VBITS / 8, valid);
    if constexpr (VF != kFmtF16) v.s[i] = load_row_scales<NG>(p.vs + ri * NG, valid);
  }
}

// Scores of row gid for the lane's keys nb * 8 + 2 t4 + e (before the softmax scale and the mask).
template <int KF, int NG>
__device__ __forceinline__ void step_scores(const uint32_t (&qa)[NG][2][4], const KStep<KF, NG>& k,
                                            float (&s)[2][2]) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    s[nb][0] = s[nb][1] = 0.f;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h)
        mma16816(c, qa[g][h][0], qa[g][h][1], qa[g][h][2], qa[g][h][3], k_pair<KF>(k.c[nb][g], 2 * h),
                 k_pair<KF>(k.c[nb][g], 2 * h + 1));
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // hi + lo rows
        if constexpr (KF != kFmtF16) s[nb][e] = fmaf(k.s[nb][e].s(g), c[e] + c[2 + e], s[nb][e]);
        else s[nb][e] += c[e] + c[2 + e];
      }
    }
  }
}

// acc += p v for the step: a = the probabilities of the lane's keys (step_key order) as hi / lo A fragments.
template <int VF, int NG>
__device__ __forceinline__ void step_outputs(float (&acc)[NG][4][4], const uint32_t (&a)[4], const VStep<VF, NG>& v) {
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    uint32_t b0[4], b1[4];
    v_pairs<VF>(v.c[0][g], v.c[1][g], b0);
    v_pairs<VF>(v.c[2][g], v.c[3][g], b1);
    if constexpr (VF != kFmtF16) {
      const __half2 s0 = scale_pair(v.s[0], v.s[1], g), s1 = scale_pair(v.s[2], v.s[3], g);
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

// The warp's outputs of row gid into red [NW][RT][D], times `scale`: c0 / c1 (hi rows) + c2 / c3 (lo rows) are
// dims g*32 + (2 t4 + e)*4 + j.
template <int D, int RT>
__device__ __forceinline__ void store_warp_rows(float* red, const float (&acc)[D / KV_GROUP][4][4], int warp, int gid,
                                                int t4, float scale) {
#pragma unroll
  for (int g = 0; g < D / KV_GROUP; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        red[(warp * RT + gid) * D + g * KV_GROUP + (2 * t4 + e) * 4 + j] = (acc[g][j][e] + acc[g][j][2 + e]) * scale;
}

template <int NG>
__device__ __forceinline__ void zero_acc(float (&acc)[NG][4][4]) {
#pragma unroll
  for (int g = 0; g < NG; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[g][j][i] = 0.f;
}

// ---- two passes: all scores of the split into shared memory, the softmax statistics, then the outputs ----------

// U1 / U3: steps of 16 keys in flight per warp in the scores / output phase; MINB: CTAs per SM the registers
// are bounded for (4: 128 registers).
template <int D, int KF, int VF, int U1, int U3, int MINB>
__global__ void __launch_bounds__(kAttnThreads, MINB) paged_attention_quant_mma_kernel(const QAttnParams p) {
  constexpr int NW = kAttnWarps, RT = kTileRows;
  constexpr int KM = qattn_keys_max<RT>();
  constexpr int NG = D / KV_GROUP;
  constexpr int VROW = D * KVFormat<VF>::BITS / 8;
  static_assert(NW * RT * D <= RT * KM, "reduction buffer must fit in the score buffer");

  extern __shared__ float smem[];  // q staging [RT][D]; scores [RT][KM]; cross-warp buffer [NW][RT][D]
  __shared__ int pages[KM / 16 + 2];
  __shared__ float row_m[RT], row_l[RT];
  MmaSplit sp;
  if (!mma_split_begin<D, KF, RT>(p, sp, pages, smem)) return;
  const int warp = threadIdx.x >> 5, gid = sp.gid, t4 = sp.t4, start = sp.start, end = sp.end;
  uint32_t qa[NG][2][4];
  q_fragments<D, KF>(smem, gid, t4, qa);
  const int row = sp.row0 + gid;
  const int own_lim = row < p.R ? sp.ctx - p.Tq + row / p.G : -1;  // last key row gid may see (causal); none past R
  __syncthreads();  // q staging read: smem becomes the score buffer

  if (p.prefetch & kPrefetchV)
    prefetch_rows<NG>(p.vc, p.vs, VROW, start, end, pages, sp.first_page, p.log2S, p.Hkv, sp.kvh);

  // ---- phase 1: scores, U1 steps of 16 keys in flight per warp ----
  for (int t0 = start + warp * kKeysPerStep; t0 < end; t0 += NW * kKeysPerStep * U1) {
    KStep<KF, NG> ks[U1];
#pragma unroll
    for (int u = 0; u < U1; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      load_k_step<D, KF>(ks[u], p, sp, t, t < end ? sp.slot(p, t) : 0);
    }
#pragma unroll
    for (int u = 0; u < U1; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      if (t >= end) break;
      float s[2][2];
      step_scores<KF, NG>(qa, ks[u], s);
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = t + nb * 8 + 2 * t4 + e;
          if (key < end) smem[gid * KM + (key - start)] = key <= own_lim ? s[nb][e] * p.scale_log2 : -INFINITY;
        }
    }
  }
  __syncthreads();

  attn_softmax_rows<RT, KM>(smem, end - start, row_m, row_l);
  __syncthreads();

  // ---- phase 3: o = sum p * vs * v per group, U3 steps in flight ----
  float acc[NG][4][4];
  zero_acc(acc);
  for (int t0 = start + warp * kKeysPerStep; t0 < end; t0 += NW * kKeysPerStep * U3) {
    VStep<VF, NG> vs[U3];
    float pk[U3][4];
#pragma unroll
    for (int u = 0; u < U3; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      load_v_step<D, VF>(vs[u], p, sp, t, t < end ? sp.slot(p, t) : 0);
#pragma unroll
      for (int i = 0; i < 4; ++i)  // stale scores past the split's keys: zeros
        pk[u][i] = t + step_key(i, t4) < end ? smem[gid * KM + (t - start) + step_key(i, t4)] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U3; ++u) {
      if (t0 + u * NW * kKeysPerStep >= end) break;
      uint32_t a[4];  // a0 / a1: p of keys 2t4, 2t4+1 (hi, lo); a2 / a3: keys 2t4+8, 2t4+9
      split_f16x2(pk[u][0], pk[u][1], a[0], a[1]);
      split_f16x2(pk[u][2], pk[u][3], a[2], a[3]);
      step_outputs<VF, NG>(acc, a, vs[u]);
    }
  }
  __syncthreads();  // done reading probabilities: reuse smem
  store_warp_rows<D, RT>(smem, acc, warp, gid, t4, 1.f);
  __syncthreads();
  attn_write_rows<D, RT, KVFormat<VF>::ROT>(p, smem, row_m, row_l, sp.b, sp.kvh, sp.row0, sp.split);
}

// ---- one pass (online softmax): each step's scores feed its outputs in registers ---------------------------------
// The score C fragments of a step are, lane for lane, the probabilities' A fragments of its output mma (keys
// nb * 8 + 2 t4 + e): no score buffer, and each step's K and V loads are in flight together, where the two-pass
// kernel waits on the K loads of all its steps, then on the V loads. A row's running max and sum live in the four
// lanes of its gid; the accumulator is rescaled when the max grows.

// A lane's running state of row gid: max and sum in the log2 domain (l: this lane's keys only), the outputs.
template <int NG>
struct OnlineRow {
  float m = -INFINITY, l = 0.f;
  float acc[NG][4][4];
};

// One step of 16 keys [t, t + 16) into the running state (keys past `end` or `own_lim` masked).
template <int KF, int VF, int NG>
__device__ __forceinline__ void online_step(const uint32_t (&qa)[NG][2][4], const KStep<KF, NG>& k,
                                            const VStep<VF, NG>& v, int t, int end, int own_lim, int t4,
                                            float scale_log2, OnlineRow<NG>& r) {
  float s[2][2];
  step_scores<KF, NG>(qa, k, s);
  float mx = -INFINITY;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = t + nb * 8 + 2 * t4 + e;
      s[nb][e] = key < end && key <= own_lim ? s[nb][e] * scale_log2 : -INFINITY;
      mx = fmaxf(mx, s[nb][e]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  // The running max is lazy (kLazyMaxLog2). A row's four lanes agree on `raise` (same mx, same m); the first
  // valid key always raises (-inf + 8 = -inf), a fully masked row never does (its p stay exp2(-inf - 0) = 0).
  const bool raise = mx > r.m + kLazyMaxLog2;
  if (__any_sync(0xffffffffu, raise)) {  // warp-uniform: lanes of rows that keep their max multiply by 1
    const float alpha = raise ? exp2f(r.m - mx) : 1.f;  // 0 when m was -inf (acc and l are still 0)
    r.l *= alpha;
    if (raise) r.m = mx;
#pragma unroll
    for (int g = 0; g < NG; ++g)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) r.acc[g][j][i] *= alpha;
  }
  const float mu = r.m == -INFINITY ? 0.f : r.m;
  float pk[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pk[i] = exp2f(s[i >> 1][i & 1] - mu);
  r.l += (pk[0] + pk[1]) + (pk[2] + pk[3]);
  uint32_t a[4];
  split_f16x2(pk[0], pk[1], a[0], a[1]);
  split_f16x2(pk[2], pk[3], a[2], a[3]);
  step_outputs<VF, NG>(r.acc, a, v);
}

// The warps' rows combined (their maxima, sums and outputs through shared memory `red` [NW][RTT][D], which may
// alias the q staging and the staged kernel's rings: its first barrier orders every warp's last read of those
// before the writes) and the CTA's rows written as the split's partials (or the output). RTT: the CTA's rows (NT
// tiles of kTileRows); the lane's warp is column `col` of the NW that split the keys, and holds CTA row `rr`.
template <int D, int VF, int RTT = kTileRows>
__device__ __forceinline__ void online_finish(const QAttnParams& p, const MmaSplit& sp, OnlineRow<D / KV_GROUP>& r,
                                              float* red, float (&row_m)[RTT], float (&row_l)[RTT],
                                              float (&warp_m)[kAttnWarps][RTT], float (&warp_l)[kAttnWarps][RTT],
                                              int col, int rr) {
  constexpr int NW = kAttnWarps, NTH = RTT / kTileRows * kAttnThreads;
  const int t4 = sp.t4;
  r.l += __shfl_xor_sync(0xffffffffu, r.l, 1);
  r.l += __shfl_xor_sync(0xffffffffu, r.l, 2);
  if (t4 == 0) {
    warp_m[col][rr] = r.m;
    warp_l[col][rr] = r.l;
  }
  __syncthreads();  // warp statistics; q staging read: smem becomes the cross-warp buffer
  float mc = -INFINITY;
#pragma unroll
  for (int w = 0; w < NW; ++w) mc = fmaxf(mc, warp_m[w][rr]);
  const float muc = mc == -INFINITY ? 0.f : mc;
  store_warp_rows<D, RTT>(red, r.acc, col, rr, t4, exp2f(r.m - muc));
  if (col == 0 && t4 == 0) {
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) l += warp_l[w][rr] * exp2f(warp_m[w][rr] - muc);
    row_m[rr] = mc;
    row_l[rr] = l;
  }
  __syncthreads();
  attn_write_rows<D, RTT, KVFormat<VF>::ROT, NTH>(p, red, row_m, row_l, sp.b, sp.kvh, sp.row0, sp.split);
}

// U steps of 16 keys in flight per warp, loaded into registers (1: 168 registers, 3 CTAs per SM; 2: 2 per SM).
template <int D, int KF, int VF, int U, int MINB>
__global__ void __launch_bounds__(kAttnThreads, MINB) paged_attention_quant_mma_online_kernel(const QAttnParams p) {
  constexpr int NW = kAttnWarps, RT = kTileRows;
  constexpr int NG = D / KV_GROUP;

  extern __shared__ float smem[];  // q staging [RT][D]; cross-warp buffer [NW][RT][D]
  __shared__ int pages[qattn_keys_max<RT>() / 16 + 2];
  __shared__ float row_m[RT], row_l[RT], warp_m[NW][RT], warp_l[NW][RT];
  MmaSplit sp;
  if (!mma_split_begin<D, KF, RT>(p, sp, pages, smem)) return;
  const int warp = threadIdx.x >> 5, gid = sp.gid, t4 = sp.t4, end = sp.end;
  uint32_t qa[NG][2][4];
  q_fragments<D, KF>(smem, gid, t4, qa);
  const int row = sp.row0 + gid;
  const int own_lim = row < p.R ? sp.ctx - p.Tq + row / p.G : -1;  // last key row gid may see (causal); none past R

  OnlineRow<NG> r;
  zero_acc(r.acc);
  for (int t0 = sp.start + warp * kKeysPerStep; t0 < end; t0 += NW * kKeysPerStep * U) {
    KStep<KF, NG> ks[U];
    VStep<VF, NG> vs[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      const int64_t base = t < end ? sp.slot(p, t) : 0;
      load_k_step<D, KF>(ks[u], p, sp, t, base);
      load_v_step<D, VF>(vs[u], p, sp, t, base);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * NW * kKeysPerStep;
      if (t >= end) break;
      online_step<KF, VF, NG>(qa, ks[u], vs[u], t, end, own_lim, t4, p.scale_log2, r);
    }
  }
  online_finish<D, VF>(p, sp, r, smem, row_m, row_l, warp_m, warp_l, warp, gid);
}

// Bytes of the staged kernel's q staging [NT * kTileRows][D] floats, ahead of its rings.
template <int D, int NT>
__host__ __device__ constexpr int staged_q_bytes() {
  return (int)sizeof(float) * NT * kTileRows * D;
}

// ---- one pass with each warp's steps staged in shared memory (attn_mma_stage.cuh) -------------------------------
// A ring of NS stages per warp: the copies of the next NS - 1 steps are in flight (cp.async, no registers held for
// them) while the warp computes one, read back in the register kernels' lane layout: the same bits as
// paged_attention_quant_mma_online_kernel (for the same splits). The default for code pages (the caller's
// `stages`: ops/cuda_layers.attn_stages). 168 registers (3 CTAs per SM; at 128, q8 and fp8 spill 104-128 bytes);
// the rings take 64 / 96 KB per CTA for fp16 pages (NS = 2 / 3), 34 / 51 KB for q8, after 4 KB of q staging per
// row tile at D = 128. The ring's first steps are copied before the PDL wait where the previous kernel wrote none
// of their keys.
//
// NT > 1 (a verify step's rows: 20 per kv head at k = 4 are three row tiles): the CTA holds NT row tiles of 8 as NT
// warps per key column, 128 * NT threads, and the NT warps of a column share its ring: warp (tile 0, column c)
// copies the column's steps, a named barrier per step (id 1 + c, the column's warps) publishes the landed step and
// frees the stage the previous one used. So each split's K and V are read once for all its rows instead of once
// per row tile; each warp's arithmetic is the NT = 1 kernel's for its tile (the same bits for the same splits).
// One CTA per SM: at NT = 3, 384 threads hold 168 registers each, and ptxas spills 12-52 bytes for fp16, fp8 and q8
// pages at D = 128 (none at NT = 2, 198-202 registers).
template <int D, int KF, int VF, int NS, int NT, int MINB>
__global__ void __launch_bounds__(kAttnThreads * NT, MINB)
    paged_attention_quant_mma_staged_kernel(const QAttnParams p) {
  constexpr int NW = kAttnWarps, RT = kTileRows, RTT = NT * RT;
  constexpr int NG = D / KV_GROUP;
  constexpr int kStride = NW * kKeysPerStep;  // keys between a column's consecutive steps
  using S = AttnStage<D, KF, VF>;
  static_assert(NT == 1 || NS == 2, "shared rings are built with 2 stages");

  // The q staging [RTT][D] floats, then the columns' stage rings [NW][NS][S::BYTES] (apart: the first steps' copies
  // start before q is staged); after the loop the cross-warp buffer [NW][RTT][D] floats uses the same bytes.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  __shared__ int pages[qattn_keys_max<RT>() / 16 + 2];
  __shared__ float row_m[RTT], row_l[RTT], warp_m[NW][RTT], warp_l[NW][RTT];
  MmaSplit sp;
  if (!mma_split_setup<D, KF, RT, NT>(p, sp, pages)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = sp.gid, t4 = sp.t4, end = sp.end;
  // The warp's row tile and key column, the lane's row in the CTA; whether the warp copies its column's steps.
  // (Spelled out for NT = 1, where the compiler cannot know that warp < NW.)
  const int tl = NT == 1 ? 0 : warp / NW, col = NT == 1 ? warp : warp % NW, rr = tl * RT + gid;
  const bool copies = NT == 1 || warp < NW;

  const unsigned char* ring = smem_raw + staged_q_bytes<D, NT>() + col * NS * S::BYTES;
  const uint32_t ring_s = smem_addr(ring);
  // One commit group per step, empty past the split: the group count behind each wait stays the same.
  auto issue = [&](int t, int stage) {
    if (t < end)
      stage_issue<D, KF, VF>(ring_s + stage * S::BYTES, p.kc, p.ks, p.vc, p.vs, p.Hkv, sp.kvh, sp.slot(p, t), t,
                             end, lane);
    cp_async_commit();
  };
  const int t_first = sp.start + col * kKeysPerStep;
  // The ring's first fill. Leading steps whose keys all precede the newest Tq (the rows the previous kernel
  // writes) are copied before the PDL wait, so their DRAM round trip overlaps the wait and q's loads; the kernels
  // before the previous one are complete (mma_split_setup), and so are those rows. The rest follow the wait.
  int early = 0;
  if (copies) {
    const int old_end = sp.ctx - p.Tq;
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      const int t = t_first + s * kStride;
      if (early == s && min(t + kKeysPerStep, end) <= old_end) {
        issue(t, s);
        ++early;
      }
    }
  }
  mma_split_stage_q<D, KF, RT, NT>(p, sp, smem);
  uint32_t qa[NG][2][4];
  q_fragments<D, KF>(smem + tl * RT * D, gid, t4, qa);
  const int row = sp.row0 + rr;
  const int own_lim = row < p.R ? sp.ctx - p.Tq + row / p.G : -1;  // last key row gid may see (causal); none past R
  if (copies) {
#pragma unroll
    for (int s = 0; s < NS - 1; ++s)
      if (s >= early) issue(t_first + s * kStride, s);
  }

  OnlineRow<NG> r;
  zero_acc(r.acc);
  int stage = 0;  // the stage of step t
  for (int t = t_first; t < end; t += kStride) {
    const int freed = stage == 0 ? NS - 1 : stage - 1;  // the stage the previous step used
    if constexpr (NT == 1) {
      issue(t + (NS - 1) * kStride, freed);
      cp_async_wait<NS - 1>();  // this lane's copies of step t landed
      __syncwarp();             // and every lane's
    } else {
      if (copies) cp_async_wait<NS - 2>();  // step t landed (step t + kStride is not issued yet)
      // Step t visible to the column's warps, each of which has finished reading the previous step.
      asm volatile("bar.sync %0, %1;" ::"r"(1 + col), "n"(32 * NT) : "memory");
      if (copies) issue(t + (NS - 1) * kStride, freed);
    }
    KStep<KF, NG> ks;
    VStep<VF, NG> vs;
    stage_read_k<D, KF, VF>(ks, ring + stage * S::BYTES, gid, t4);
    stage_read_v<D, KF, VF>(vs, ring + stage * S::BYTES, gid, t4);
    online_step<KF, VF, NG>(qa, ks, vs, t, end, own_lim, t4, p.scale_log2, r);
    if constexpr (NT == 1) __syncwarp();  // every lane has read the stage before the next iteration refills it
    stage = stage + 1 == NS ? 0 : stage + 1;
  }
  if (copies) cp_async_wait<0>();  // no copy lands after the stages become the cross-warp buffer
  online_finish<D, VF, RTT>(p, sp, r, smem, row_m, row_l, warp_m, warp_l, col, rr);
}

// Launch `Kernel` with `bytes` of dynamic shared memory, opted into on every size (exl2::opt_in_dynamic_smem): the
// 48 KB default counts the static arrays too (H200 call AD1: fp16 pages at D = 64 with 3 stages, exactly 48 KB of
// rings, failed to launch without the attribute).
template <auto Kernel>
int launch_with_smem(dim3 grid, int threads, size_t bytes, cudaStream_t stream, const QAttnParams& q) {
  const cudaError_t err = exl2::opt_in_dynamic_smem<Kernel>(bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return set_error((int)err, "paged_attention_quant (mma, staged): %zu bytes of shared memory: %s", bytes,
                     cudaGetErrorString(err));
  }
  exl2::launch_kernel(Kernel, grid, threads, bytes, stream, q);
  return check_launch("paged_attention_quant (mma, staged)");
}

template <int D, int KF, int VF, int NS, int NT>
int launch_staged(const QAttnParams& q, int B, cudaStream_t stream) {
  constexpr int MINB = NT == 1 ? 3 : 1;
  const dim3 grid((unsigned)(tile_groups(q.row_tiles, NT) * q.nsplit), (unsigned)q.Hkv, (unsigned)B);
  const size_t ring = staged_q_bytes<D, NT>() + (size_t)kAttnWarps * NS * AttnStage<D, KF, VF>::BYTES;
  const size_t red = sizeof(float) * kAttnWarps * NT * kTileRows * D;
  return launch_with_smem<paged_attention_quant_mma_staged_kernel<D, KF, VF, NS, NT, MINB>>(
      grid, NT * kAttnThreads, ring > red ? ring : red, stream, q);
}

template <int D, int KF, int VF>
int launch(const QAttnParams& p, int B, int variant, int stages, int tiles, cudaStream_t stream) {
  QAttnParams q = p;
  q.prefetch = prefetch_mode();
  if (stages == 2 && tiles == 3) return launch_staged<D, KF, VF, 2, 3>(q, B, stream);
  if (stages == 2 && tiles == 2) return launch_staged<D, KF, VF, 2, 2>(q, B, stream);
  if (stages == 2) return launch_staged<D, KF, VF, 2, 1>(q, B, stream);
  if (stages == 3) return launch_staged<D, KF, VF, 3, 1>(q, B, stream);
  const dim3 grid((unsigned)(p.row_tiles * p.nsplit), (unsigned)p.Hkv, (unsigned)B);  // one row tile per CTA
  if (variant > 0) {  // one pass: U = 1 (168 registers, 3 CTAs per SM) or 2 (2 per SM)
    const size_t smem = sizeof(float) * kAttnWarps * kTileRows * D;
    if (variant == 1)
      exl2::launch_kernel(paged_attention_quant_mma_online_kernel<D, KF, VF, 1, 3>, grid, kAttnThreads, smem, stream,
                          q);
    else
      exl2::launch_kernel(paged_attention_quant_mma_online_kernel<D, KF, VF, 2, 2>, grid, kAttnThreads, smem, stream,
                          q);
    return check_launch("paged_attention_quant (mma, one pass)");
  }
  const size_t smem = sizeof(float) * kTileRows * qattn_keys_max<kTileRows>();
  // Two steps of 16 keys in flight per warp in the scores phase (one for fp16 pages: the same bytes; two spill)
  // and one in the output phase, 128 registers. EXL2_ATTN_QUANT_MMA_DEEP=1 (a measurement build): twice those,
  // 168 registers, 3 CTAs per SM. H200 call K4 of 2026-12-02 measured it at 55.2 against 43.4 us per layer (q8 at
  // 32k), but never in one wave: 66 splits (4 CTAs per SM) are 528 CTAs for its 396 slots, and 50 (the split
  // for 3 per SM before attention_splits rounded down) 400. To run again at 49 splits (ATTN_CTAS_PER_SM=3).
  constexpr int U1 = KF == kFmtF16 ? 1 : 2;
  if (deep_variant())
    exl2::launch_kernel(paged_attention_quant_mma_kernel<D, KF, VF, 2 * U1, 2, 3>, grid, kAttnThreads, smem, stream,
                        q);
  else
    exl2::launch_kernel(paged_attention_quant_mma_kernel<D, KF, VF, U1, 1, 4>, grid, kAttnThreads, smem, stream, q);
  return check_launch("paged_attention_quant (mma)");
}

template <int D>
int launch_fmt(const QAttnParams& p, int kf, int vf, int B, int variant, int stages, int tiles, cudaStream_t stream) {
  if (kf == kFmtF16 && vf == kFmtF16) return launch<D, kFmtF16, kFmtF16>(p, B, variant, stages, tiles, stream);
  if (kf == kFmtE4M3 && vf == kFmtE4M3) return launch<D, kFmtE4M3, kFmtE4M3>(p, B, variant, stages, tiles, stream);
  if (kf == kFmtI8 && vf == kFmtI8) return launch<D, kFmtI8, kFmtI8>(p, B, variant, stages, tiles, stream);
  if (kf == kFmtI8 && vf == kFmtI4) return launch<D, kFmtI8, kFmtI4>(p, B, variant, stages, tiles, stream);
  if (kf == kFmtI4 && vf == kFmtI4) return launch<D, kFmtI4, kFmtI4>(p, B, variant, stages, tiles, stream);
  return set_error(EXL2_ERR_UNSUPPORTED, "paged_attention_quant (mma): format pair (%d, %d) not built", kf, vf);
}

}  // namespace

int launch_paged_attention_quant_mma(const QAttnParams& p, int k_fmt, int v_fmt, int D, int B, int variant,
                                     int stages, int tiles, cudaStream_t stream) {
  EXL2_REQUIRE(variant >= 0 && variant <= 2, "paged_attention_quant (mma): variant %d (0..2)", variant);
  EXL2_REQUIRE(stages == 0 || ((stages == 2 || stages == 3) && variant > 0),
               "paged_attention_quant (mma): %d stages (0, or 2 / 3 with a one-pass variant)", stages);
  EXL2_REQUIRE(tiles == 1 || (stages == 2 && (tiles == 2 || tiles == 3)),
               "paged_attention_quant (mma): %d row tiles per CTA (1, or 2 / 3 with 2 stages)", tiles);
  const int st = qattn_check_splits(p, qattn_keys_max<kTileRows>());
  if (st != EXL2_OK) return st;
  if (D == 64) return launch_fmt<64>(p, k_fmt, v_fmt, B, variant, stages, tiles, stream);
  if (D == 128) return launch_fmt<128>(p, k_fmt, v_fmt, B, variant, stages, tiles, stream);
  return set_error(EXL2_ERR_INVALID_ARGUMENT, "paged_attention_quant (mma): head_dim %d", D);
}

}  // namespace layers
}  // namespace exl2
