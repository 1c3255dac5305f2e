// The TMA GEMV's input taken from the decode attention's split partials (GemvParams::comb): o_proj combines the
// splits of the rows it reads inside its input gather, so the attention needs no reduce launch (one launch and
// one round trip fewer per layer; exl2_gemv_attn in exl2_gemm.cu, CudaLinearOp.attn_combined in ops/cuda_quant.py).
// The arithmetic is attn_combine_in_order's (layers/attn_combine.cuh), value for value: the max of the split
// maxima, then the weights exp2f(m_s - max), den and num as fmaf chains in split order, num / den rounded to fp16,
// so the GEMV sees the bits the reduce kernel would have written.
// Two steps after the PDL wait: (1) per (token, head) row, the split statistics (one pass over global memory), then
// the weights and den, in shared memory; (2) per (token, stored row), its partials' weighted sum. Every column
// block repeats the combination of its rows: it pays while the splits are few (ops/cuda_layers routes up to
// ATTN_COMBINE_MAX_SPLITS).
#pragma once

#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr int kAttnCombineBatch = 16;  // loads in flight per thread

// Floats of shared memory per (token, head): each split's (max, sum), whose max becomes the split's weight, then den
// (even, so every pair stays 8-byte aligned).
__host__ __device__ inline int attn_combine_stride(int nsplit) { return 2 * nsplit + 2; }

// Bytes of shared memory the two steps need for M tokens of `hq` heads.
__host__ __device__ inline int attn_combine_bytes(int M, int hq, int nsplit) {
  return (M * hq * attn_combine_stride(nsplit) * 4 + 15) & ~15;
}

// The splits that hold keys for token m, as the attention kernels count them (qattn_clamp_ctx, qattn_split_len).
__device__ __forceinline__ int attn_used_splits(const GemvParams& p, int m) {
  int ctx = __ldg(p.comb.ctx + m / p.comb.tq);
  ctx = ctx < 0 ? 0 : (ctx > p.comb.cap ? p.comb.cap : ctx);
  int len = (ctx + p.comb.nsplit - 1) / p.comb.nsplit;
  len = (len + 15) & ~15;
  len = len > p.comb.min_split ? len : p.comb.min_split;
  return ctx > 0 ? (ctx + len - 1) / len : 0;
}

// Step 1, per (token, head) row r, in w = cb + r * attn_combine_stride(nsplit): the used splits' (max, sum) pairs
// from global memory, kAttnCombineBatch in flight (one pass), then in split order w[2s] = exp2f(max_s - max)
// (all 0 when every split is empty) and w[2 nsplit] = den.
__device__ __forceinline__ void gv_attn_weights(const GemvParams& p, float* cb, int nthreads) {
  const int S = p.comb.nsplit, rows = p.M * p.comb.hq;
  for (int r = threadIdx.x; r < rows; r += nthreads) {
    const int used = attn_used_splits(p, r / p.comb.hq);
    const float2* ml = reinterpret_cast<const float2*>(p.comb.ml + (size_t)r * S * 2);
    float* w = cb + r * attn_combine_stride(S);
    float2* pairs = reinterpret_cast<float2*>(w);
    float m = -INFINITY;
    for (int s0 = 0; s0 < used; s0 += kAttnCombineBatch) {
      float2 t[kAttnCombineBatch];
#pragma unroll
      for (int k = 0; k < kAttnCombineBatch; ++k) t[k] = s0 + k < used ? __ldcg(ml + s0 + k) : make_float2(0.f, 0.f);
#pragma unroll
      for (int k = 0; k < kAttnCombineBatch; ++k)
        if (s0 + k < used) {
          m = fmaxf(m, t[k].x);
          pairs[s0 + k] = t[k];
        }
    }
    float den = 0.f;
    for (int s = 0; s < used; ++s) {
      const float2 ml_s = pairs[s];
      float ws = 0.f;
      if (m != -INFINITY) {
        ws = exp2f(ml_s.x - m);
        den = fmaf(ws, ml_s.y, den);
      }
      w[2 * s] = ws;
    }
    w[2 * S] = den;
  }
}

// Step 2, the split's rows in stored order into xs[m * xstride + r]: each row's partials, kAttnCombineBatch loads
// in flight, num as an fmaf chain in split order, num / den in fp16 (0 where den is not positive; padding rows 0).
// cb: step 1's weights, after a barrier.
__device__ __forceinline__ void gv_gather_attn(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                               const float* cb, int nthreads) {
  const int rows = nch * kChunkRows, items = rows * p.M, S = p.comb.nsplit, D = p.comb.d;
  for (int e = threadIdx.x; e < items; e += nthreads) {
    const int m = e / rows, r = e - m * rows;
    const unsigned i = xm[r];
    float o = 0.f;
    if (i != 0xFFFFu) {
      const int h = (int)i / D, d = (int)i - h * D, row = m * p.comb.hq + h;
      const int used = attn_used_splits(p, m);
      const float* po = p.comb.o + (size_t)row * S * D + d;
      const float* w = cb + row * attn_combine_stride(S);
      float num = 0.f;
      for (int s0 = 0; s0 < used; s0 += kAttnCombineBatch) {
        float t[kAttnCombineBatch];
#pragma unroll
        for (int k = 0; k < kAttnCombineBatch; ++k) t[k] = s0 + k < used ? __ldcg(po + (size_t)(s0 + k) * D) : 0.f;
#pragma unroll
        for (int k = 0; k < kAttnCombineBatch; ++k)
          if (s0 + k < used) num = fmaf(w[2 * (s0 + k)], t[k], num);
      }
      const float den = w[2 * S];
      o = den > 0.f ? num / den : 0.f;
    }
    xs[m * p.xstride + r] = __float2half_rn(o);
  }
}

}  // namespace exl2q
