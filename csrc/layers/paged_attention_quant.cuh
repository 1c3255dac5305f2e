// What the two decode attention kernels over quantized pages share: the parameters, the split geometry, the
// split checks, the q staging and the write of a row tile's output or split partial (the steps the fp16 kernel
// shares too are in attn_split_steps.cuh). paged_attention_quant.cu holds the CUDA-core kernel (a lane's share
// of a key's dot products, reduced by shuffles) and the reduce kernel; paged_attention_quant_mma.cu the
// tensor-core kernel. Both fill the same partials, so one reduce kernel serves them.
#pragma once

#include <math.h>

#include "layers/attn_split_steps.cuh"
#include "layers/common.cuh"
#include "layers/kv_quant.cuh"

namespace exl2 {
namespace layers {

// The one-pass tensor-core kernels' running max (paged_attention_quant_mma.cu online_step, the fp16 streamed
// kernel) moves only when a step's max passes it by more than this (log2 units), so the accumulator's rescale (on
// the output mma's dependency chain) runs in few steps: at 32k a warp takes ~10 steps of a split, and over random
// keys an exact max of its 4 rows rises in ~6 of them (step s sets a record with odds 1 - (1 - 1/s)^4), a lazy
// one after the first rarely. Probabilities against a stale max reach 2^kLazyMaxLog2 (fp32 sums; their hi / lo
// fp16 parts keep ~2^-22 relative), and a split's (m, l, o) stay consistent for the combine whatever max they
// were taken against.
constexpr float kLazyMaxLog2 = 8.f;

template <int RT>
constexpr int qattn_keys_max() {  // keys per split held in shared memory: RT * keys_max floats = 32 KiB
  return RT <= 8 ? 1024 : 512;
}

struct QAttnParams {
  const half* q;
  int64_t q_bs, q_ts, q_hs;  // q strides (elements); dims contiguous
  const uint8_t* kc;         // [P, S, Hkv, D * kbits / 8]
  const half* ks;            // [P, S, Hkv, D / 32]
  const uint8_t* vc;
  const half* vs;
  const int* block_tables;  // [B, bt_stride]
  int64_t bt_stride;
  const int* context_lens;  // [B]
  half* out;                // [B, Tq, Hq, D] contiguous
  float* part_o;            // [B, Tq, Hq, nsplit, D] (rotated domain for rotated V formats)
  float* part_ml;           // [B, Tq, Hq, nsplit, 2] (max in log2 units, sum)
  int Tq, Hq, Hkv, G, R, row_tiles, nsplit, min_split, log2S, max_pages, num_pages;
  float scale_log2;  // softmax scale * log2(e)
  int prefetch;      // tensor-core kernel, L2 prefetches (kQAttnPrefetch*): set by its launcher
};

// The tensor-core kernel (paged_attention_quant_mma.cu): row tiles of 8 (p.row_tiles set for them), the same
// splits (checked here: at most 1024 keys each), partials and reduce as the CUDA-core kernel; launches the
// attention kernel only.
// k_fmt / v_fmt: KVFmt codes, kFmtF16 for fp16 pages (ks / vs unused). variant 0: two passes (scores into shared
// memory, then the outputs); 1 / 2: one pass with an online softmax, 1 or 2 steps in flight. stages 2 / 3 (a
// one-pass variant): the one-pass kernel with each warp's steps staged in shared memory, the same bits; 0: in
// registers. tiles 2 / 3 (2 stages): that many row tiles per CTA sharing each column's ring (a verify step's rows).
int launch_paged_attention_quant_mma(const QAttnParams& p, int k_fmt, int v_fmt, int D, int B, int variant,
                                     int stages, int tiles, cudaStream_t stream);
// The streamed decode attention (paged_attention_stream.cu: Tq = 1, D = 128, all kv heads of a split per CTA, bulk
// copies into a shared-memory ring) over fp16 pages (both formats kFmtF16) or code pages, then its reduce launch;
// p.row_tiles unused.
int launch_paged_attention_stream(const QAttnParams& p, int k_fmt, int v_fmt, int D, int B, cudaStream_t stream);
// Whether the streamed attention takes these pages on tensor cores (paged_attention_stream_mma.cu: fp16 pages, 8 kv
// heads, 1 / 2 / 4 / 8 query heads per kv head, decode steps), and that kernel's launch (its reduce is the caller's).
bool stream_mma_takes(int k_fmt, int v_fmt, const QAttnParams& p);
int launch_paged_attention_stream_mma(const QAttnParams& p, int B, cudaStream_t stream);
// The split combination into p.out (paged_attention_quant.cu; nothing when nsplit == 1); rot: V rotated (int
// formats) -> the sums are rotated back.
int launch_paged_attention_quant_reduce(const QAttnParams& p, bool rot, int D, int B, cudaStream_t stream);

// Splits of at most keys_max keys must cover the table's pages; min_split within (0, keys_max].
inline int qattn_check_splits(const QAttnParams& p, int keys_max) {
  EXL2_REQUIRE((int64_t)p.nsplit * keys_max >= ((int64_t)p.max_pages << p.log2S),
               "paged_attention_quant: nsplit %d too small for %d pages of %d (split <= %d keys)", p.nsplit,
               p.max_pages, 1 << p.log2S, keys_max);
  EXL2_REQUIRE(p.min_split <= keys_max && p.min_split > 0, "paged_attention_quant: min_split %d out of range",
               p.min_split);
  return EXL2_OK;
}

__device__ __forceinline__ float qattn_load_scale(const half* p) {
  return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
}

// An unused split (or an empty context): zeros where this launch writes the output itself (nsplit == 1); the
// reduce kernel covers the other case. NTH: the CTA's threads (here and below).
template <int D, int RT, int NTH = kAttnThreads>
__device__ __forceinline__ void qattn_empty_split(const QAttnParams& p, int b, int kvh, int row0) {
  if (p.nsplit != 1) return;
  for (int i = threadIdx.x; i < RT * D; i += NTH) {
    const int row = row0 + i / D;
    if (row < p.R) {
      const int j = row / p.G, hq = kvh * p.G + row % p.G;
      p.out[(((int64_t)b * p.Tq + j) * p.Hq + hq) * D + i % D] = __float2half_rn(0.f);
    }
  }
}

// q rows of the tile -> qs [RT][D] fp32, rotated like the keys, times `mul`; rows past R are zeros. One (row,
// group) per warp step.
template <int D, int RT, bool ROT, int NTH = kAttnThreads>
__device__ __forceinline__ void qattn_stage_q(const QAttnParams& p, int b, int kvh, int row0, float mul, float* qs) {
  constexpr int NG = D / KV_GROUP;
  const int lane = threadIdx.x & 31;
  for (int u = threadIdx.x >> 5; u < RT * NG; u += NTH / 32) {
    const int r = u / NG, g = u % NG, row = row0 + r;
    float x = 0.f;
    if (row < p.R) {
      const int j = row / p.G, hq = kvh * p.G + row % p.G;
      x = __half2float(p.q[b * p.q_bs + j * p.q_ts + hq * p.q_hs + g * KV_GROUP + lane]);
    }
    if constexpr (ROT) x = warp_fwht32(x);
    qs[r * D + g * KV_GROUP + lane] = x * mul;
  }
}

// The row tile's output from the warps' partial sums red [warps][RT][D]: the final fp16 rows (nsplit == 1,
// rotated back for rotated V formats) or the split's fp32 partial and statistics. A warp covers 32 consecutive
// dims of one row (RT * D and D are multiples of 32), so the rotation back is one in-warp transform and the row
// test is warp-uniform. P: QAttnParams, or the fp16 kernel's AttnParams (ROT false).
template <int D, int RT, bool ROT, int NTH = kAttnThreads, typename P>
__device__ __forceinline__ void attn_write_rows(const P& p, const float* red, const float* row_m,
                                                const float* row_l, int b, int kvh, int row0, int split) {
  for (int i = threadIdx.x; i < RT * D; i += NTH) {
    const int r = i / D, d = i % D, row = row0 + r;
    if (row >= p.R) continue;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) o += red[(w * RT + r) * D + d];
    const int j = row / p.G, hq = kvh * p.G + row % p.G;
    const int64_t prow = ((int64_t)b * p.Tq + j) * p.Hq + hq;
    if (p.nsplit == 1) {
      const float l = row_l[r];
      o = l > 0.f ? o / l : 0.f;
      if constexpr (ROT) o = warp_fwht32(o);
      p.out[prow * D + d] = __float2half_rn(o);
    } else {
      const int64_t ps = prow * p.nsplit + split;
      p.part_o[ps * D + d] = o;
      if (d == 0) {
        p.part_ml[ps * 2] = row_m[r];
        p.part_ml[ps * 2 + 1] = row_l[r];
      }
    }
  }
}

}  // namespace layers
}  // namespace exl2
