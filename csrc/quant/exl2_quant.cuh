// In-memory layout of a prepared EXL2 linear, its descriptor, and the per-lane decoders shared by the fused
// GEMM (exl2_gemm.cu) and the dequantizer (exl2_dequant.cu). The packing side is
// exl2_backend/ops/cuda_quant.py (pack_qtensor); both must agree bit for bit.
//
// Layout. Stored rows (activation order) are grouped in width runs (8,6,5,4,3,2 bits, non-increasing);
// each run is padded with zero-point rows to a multiple of 64 rows. A CHUNK is 64 rows of one run; chunks
// are numbered 0..C-1 over all runs. Columns are cut in warp tiles of 32 (two mma n-tiles of 16).
// For chunk c of run r and warp tile j (J = Np/32 tiles), the 64*b words at
//     packed + run.word_base + ((c - run.chunk_start) * J + j) * 64 * b
// hold everything one warp needs: a MAIN plane part [2 n-tiles][32 lanes][m words] followed by an AUX part
// [2][32][a words] (m + a = b): 8-bit: m=8; 6 = 4+2; 5 = 4+1; 4 = 4; 3 = 2+1; 2 = 2 (low bits in MAIN, except
// 3-bit: see below).
// Each lane owns 16 PAIRS per n-tile per chunk, pair p = 4*s + r (s = mma k-step 0..3, r = A register):
//     row(p) = 32*(s/2) + 8*t + 4*(s%2) + 2*(r>=2)  (+1 for the high half),  t = lane % 4
//     col(p) = 16*nt + lane/4 + 8*(r%2)
// so an A register of mma.m16n8k16 is one decoded pair and the lane's B operand for a 32-row unit is 8
// consecutive activations (one 16-byte shared load). A plane of width w stores pair p in word
// p / (16/w) at bit offset w*(p % (16/w)) of the low half (low value) and of the high half (high value),
// which is what the 0x6400 (fp16 1024.0) mantissa trick decodes two values at a time from.
// 3-bit is the exception: its three words k = 0, 1, 2 (MAIN 0, 1 and AUX) each hold pairs 5k..5k+4 as whole
// 3-bit fields at offsets 0, 3, 6, 9, 12 of each half, and bit 15 of word k is bit k of pair 15. The split
// layout (2 low bits + 1 high bit per pair) cost 4 INT ops per pair and made the 3-bit GEMV INT-bound.
// chunk info [C]: group of the chunk's first 32-row unit (bits 0..29); bit 30/31: a group ends with unit 0/1.
// xmap [Kpad] uint16: original input feature of each padded row (0xFFFF = padding row, activation 0).
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

namespace exl2q {

constexpr int kMaxRuns = 6;
constexpr int kMaxDesc = 4;
constexpr int kChunkRows = 64;
constexpr int kWarpCols = 32;
constexpr int kBlockWarps = 4;
constexpr int kBlockCols = kBlockWarps * kWarpCols;  // 128 columns per block
#ifndef EXL2_GEMM_STAGES
#define EXL2_GEMM_STAGES 4  // H200: 4 beat 6 and 8 (less shared memory -> all blocks resident)
#endif
constexpr int kStages = EXL2_GEMM_STAGES;  // per-warp cp.async ring depth in chunks (kStages - 1 in flight)
constexpr int kInfoGroupMask = 0x3FFFFFFF;
constexpr int kDescLen = 24 + 4 * kMaxRuns;  // int64 fields per descriptor in the host blob

struct Run {
  int bits, chunk_start, chunk_end;
  long long word_base;
};

struct QDesc {
  const uint32_t* packed;   // words, layout above
  const uint32_t* scales;   // q_scale as on disk: [G, Np/8], 4-bit codes
  const float* maxf;        // [G]: fp16(q_scale_max / 256) as float
  const int* info;          // [C]
  const uint16_t* xmap;     // [Kpad]
  const __half* bias;       // [Np] or null
  __half* out;              // out[m * ldo + n], n < N
  float* ws;                // split-K partials [ksplit][M][Np] (ksplit > 1)
  int* counters;            // [ncolblk], zero between launches
  int ldo, K, Kpad, N, Np, C, G, nruns, ksplit, ncolblk, block_start;
  Run runs[kMaxRuns];
};

// Blob field indices (host side, int64 each); keep in sync with cuda_quant.py.
enum BlobField {
  F_PACKED = 0, F_SCALES, F_MAXF, F_INFO, F_XMAP, F_BIAS, F_OUT, F_WS, F_COUNTERS,
  F_LDO, F_K, F_KPAD, F_N, F_NP, F_C, F_G, F_NRUNS, F_KSPLIT, F_RUNS,  // runs: bits, start, end, word_base
  F_SCL16 = F_RUNS + 4 * kMaxRuns,  // small-M GEMV: fp16 scales [G][Np/32][8 gid][4] (exl2_gemm.cu, gemv)
  F_ROPE,  // small-M GEMV, first descriptor only: 0, or a host pointer to the fused rope's int64 arguments
           // (exl2_gemv_rope.cuh RopeArg), read during the call
  F_SLOTS,  // small-M GEMV (TMA kernel), first descriptor only: the blocks one launch may plan; > 0 balances the
            // per-run split counts by bytes within it (exl2_gemv_splits.cuh), 0 keeps the proportional split
  F_GROUP_ROWS,  // the fewest rows of any quantization group (0: unknown); bounds the groups a split touches, so the
                 // TMA GEMV stages no more scale rows than it can read (the 8B's head: 56 -> 14 KB per block)
  F_SPAN,  // small-M GEMV (TMA kernel), first descriptor only: 1 = splits of equal bytes that may span width runs
           // (span_range; the block re-arms its ring at each run it enters), 0 = splits inside one run
  F_VEC8  // 1: xmap in aligned runs of 8 (each 8 stored rows: 8 consecutive features from a multiple of 8, or 8
          // padding rows), which the TMA GEMV's gated input needs (gv_gather_gated_runs)
};

// Sum over runs of chunks * bits: the split-K work measure (bytes are proportional to it).
__host__ __device__ inline long long total_weight(const QDesc& d) {
  long long w = 0;
  for (int r = 0; r < d.nruns; ++r) w += (long long)(d.runs[r].chunk_end - d.runs[r].chunk_start) * d.runs[r].bits;
  return w;
}

// First chunk whose cumulative weight reaches `target`.
__host__ __device__ inline int chunk_at(const QDesc& d, long long target) {
  long long acc = 0;
  for (int r = 0; r < d.nruns; ++r) {
    const Run& rr = d.runs[r];
    long long w = (long long)(rr.chunk_end - rr.chunk_start) * rr.bits;
    if (target < acc + w) return rr.chunk_start + (int)((target - acc + rr.bits - 1) / rr.bits);
    acc += w;
  }
  return d.C;
}

// Chunk range [c0, c1) of split s: equal byte shares, so mixed-width splits stay balanced.
__host__ __device__ inline void split_range(const QDesc& d, int s, int& c0, int& c1) {
  long long w = total_weight(d);
  c0 = chunk_at(d, w * s / d.ksplit);
  c1 = chunk_at(d, w * (s + 1) / d.ksplit);
}

// Chunk range [c0, c1) of split s of `splits` with equal byte shares over all runs (the TMA GEMV's span splits:
// a split may cover the end of one width run and the start of the next). 32-bit arithmetic: every block of the
// GEMV computes this before its first copy (C <= 1024 chunks of <= 8 bits, splits <= 1024). *r0 / *r1: the runs
// of c0 and one past the last run the range touches.
__host__ __device__ inline int chunk_at32(const QDesc& d, int target, int& r) {
  int acc = 0;
  for (r = 0; r < d.nruns; ++r) {
    const Run& rr = d.runs[r];
    const int w = (rr.chunk_end - rr.chunk_start) * rr.bits;
    if (target < acc + w) return rr.chunk_start + (target - acc + rr.bits - 1) / rr.bits;
    acc += w;
  }
  return d.C;
}
__host__ __device__ inline void span_range(const QDesc& d, int s, int splits, int& c0, int& c1, int& r0, int& r1) {
  int w = 0;  // total_weight in 32-bit arithmetic
  for (int r = 0; r < d.nruns; ++r) w += (d.runs[r].chunk_end - d.runs[r].chunk_start) * d.runs[r].bits;
  c0 = chunk_at32(d, w * s / splits, r0);
  c1 = chunk_at32(d, w * (s + 1) / splits, r1);
  if (r0 < d.nruns && c0 >= d.runs[r0].chunk_end) ++r0;  // c0 rounded up to the next run's first chunk
  if (r1 >= d.nruns || c1 > d.runs[r1].chunk_start) ++r1;  // r1: the run holding c1 - 1, plus one
  r0 = min(r0, d.nruns - 1);
  r1 = min(max(r1, r0 + 1), d.nruns);
}

// ---- per-lane decode ------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t h2sub(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t h2fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

template <int S>
__device__ __forceinline__ uint32_t shr(uint32_t x) {
  if constexpr (S > 0) return x >> S;
  else if constexpr (S < 0) return x << (-S);
  else return x;
}

// (a & b) | c in one LOP3: with b and c in registers (a LOP3 takes one immediate, so C++ `(a & m) | k` would
// cost two). The INT pipe (half the FP rate) is this kernel's tightest resource.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

constexpr int main_words(int b) { return b == 8 ? 8 : (b >= 4 ? 4 : 2); }

// Pair P of one n-tile as half2 (q - z): exact small integers. w = the lane's b words of that n-tile.
// A field at bit offset o of each half becomes fp16 1024 + 2^o q after OR-ing in the exponent of 1024
// (needs o + width <= 10); an HFMA2 by 2^-o then removes both the offset and the zero point.
template <int B, int P>
__device__ __forceinline__ uint32_t pair_qz(const uint32_t* w) {
  constexpr uint32_t kMagic = 0x64006400u;  // fp16 1024.0 in both halves
  if constexpr (B == 8) {
    uint32_t v = __byte_perm(w[P / 2], 0x64u, (P & 1) ? 0x4341 : 0x4240);  // bytes -> 0x64qq = 1024 + q
    return h2sub(v, 0x64806480u);                                          // - (1024 + 128)
  } else if constexpr (B == 4) {
    uint32_t word = w[P >> 2];
    if constexpr ((P & 3) >= 2) word >>= 8;
    if constexpr ((P & 1) == 0) return h2sub(and_or(word, 0x000F000Fu, kMagic), 0x64086408u);
    else return h2fma(and_or(word, 0x00F000F0u, kMagic), 0x2C002C00u, 0xD480D480u);  // (1024+16q)/16 - 72
  } else if constexpr (B == 2) {
    constexpr int o = 2 * (P & 3);
    uint32_t word = w[P >> 3];
    if constexpr ((P & 7) >= 4) word >>= 8;
    const uint32_t v = and_or(word, 0x00030003u << o, kMagic);
    if constexpr (o == 0) return h2sub(v, 0x64026402u);
    else if constexpr (o == 2) return h2fma(v, 0x34003400u, 0xDC08DC08u);  // /4 - 258
    else if constexpr (o == 4) return h2fma(v, 0x2C002C00u, 0xD420D420u);  // /16 - 66
    else return h2fma(v, 0x24002400u, 0xCC80CC80u);                        // /64 - 18
  } else if constexpr (B == 6) {
    uint32_t lo = and_or(w[P >> 2] >> (4 * (P & 3)), 0x000F000Fu, kMagic);
    return h2sub(and_or(shr<2 * (P & 7) - 4>(w[4 + (P >> 3)]), 0x00300030u, lo), 0x64206420u);
  } else if constexpr (B == 5) {
    uint32_t lo = and_or(w[P >> 2] >> (4 * (P & 3)), 0x000F000Fu, kMagic);
    return h2sub(and_or(shr<P - 4>(w[4]), 0x00100010u, lo), 0x64106410u);
  } else {  // 3: whole 3-bit fields (layout above); ~1.4 INT ops per pair against 4 for split low/high planes
    static_assert(B == 3, "bit width");
    if constexpr (P == 15) {  // bit k of the value is bit 15 of word k: moved to bits 5, 6, 7
      uint32_t v = and_or(w[0] >> 10, 0x00200020u, kMagic);
      v = and_or(w[1] >> 9, 0x00400040u, v);
      v = and_or(w[2] >> 8, 0x00800080u, v);  // w[2] >> 8 is shared with pairs 13 and 14
      return h2fma(v, 0x28002800u, 0xD080D080u);  // (1024 + 32q) / 32 - 36
    } else {
      constexpr int o = 3 * (P % 5);  // offset in word P / 5; 9 and 12 read the word shifted by 8 (one shift, two pairs)
      const uint32_t word = o <= 6 ? w[P / 5] : w[P / 5] >> 8;
      constexpr int oo = o <= 6 ? o : o - 8;
      const uint32_t v = and_or(word, 0x00070007u << oo, kMagic);
      if constexpr (oo == 0) return h2sub(v, 0x64046404u);
      else if constexpr (oo == 1) return h2fma(v, 0x38003800u, 0xE008E008u);  // /2 - 516
      else if constexpr (oo == 3) return h2fma(v, 0x30003000u, 0xD820D820u);  // /8 - 132
      else if constexpr (oo == 4) return h2fma(v, 0x2C002C00u, 0xD440D440u);  // /16 - 68
      else return h2fma(v, 0x24002400u, 0xCD00CD00u);                         // oo == 6: /64 - 20
    }
  }
}

// The lane's words of both n-tiles of one chunk tile (base = start of the 64*B words).
template <int B>
__device__ __forceinline__ void load_lane_words(const uint32_t* base, int lane, uint32_t (&w)[2][B]) {
  constexpr int m = main_words(B), a = B - m;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const uint32_t* p = base + (nt * 32 + lane) * m;
    if constexpr (m == 8) {
      uint4 u = reinterpret_cast<const uint4*>(p)[0], v = reinterpret_cast<const uint4*>(p)[1];
      w[nt][0] = u.x; w[nt][1] = u.y; w[nt][2] = u.z; w[nt][3] = u.w;
      w[nt][4] = v.x; w[nt][5] = v.y; w[nt][6] = v.z; w[nt][7] = v.w;
    } else if constexpr (m == 4) {
      uint4 u = *reinterpret_cast<const uint4*>(p);
      w[nt][0] = u.x; w[nt][1] = u.y; w[nt][2] = u.z; w[nt][3] = u.w;
    } else {
      uint2 u = *reinterpret_cast<const uint2*>(p);
      w[nt][0] = u.x; w[nt][1] = u.y;
    }
    const uint32_t* q = base + 64 * m;
    if constexpr (a == 2) {
      uint2 u = reinterpret_cast<const uint2*>(q)[nt * 32 + lane];
      w[nt][m] = u.x; w[nt][m + 1] = u.y;
    } else if constexpr (a == 1) {
      w[nt][m] = q[nt * 32 + lane];
    }
  }
}

// fp16 scale of code c (0..15) for a group with max16 = maxf: fp16(fp16((c+1)^2) * max16), as float.
// The fp32 product is exact, so one round-to-nearest conversion equals the fp16 multiply (format doc b.4).
__device__ __forceinline__ float scale_of(uint32_t c, float maxf) {
  return __half2float(__float2half_rn((float)((c + 1) * (c + 1)) * maxf));
}

}  // namespace exl2q
