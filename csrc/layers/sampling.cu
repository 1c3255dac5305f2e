// sample_tokens: per-row greedy argmax or exponential race, one launch for B rows, no host sync.
//
// Semantics (ops/reference_sampling.py): temperature 0 -> argmax(logits), ties to the lowest id (NaN counts as
// the largest, as torch.argmax). Otherwise p = softmax(logits / T) (or the given filtered probabilities) and
// token = argmax p_i / max(-log(u_i), 2^-25), with p = 0 scoring -1 and ties to the lowest id. A row whose logits
// hold a NaN gives -1 in every mode (probs given or not): the engine fails that sequence (a numerical fault)
// instead of emitting the NaN's index, which the greedy graphs would otherwise feed back unseen.
//
// Grid (chunks of CHUNK tokens, B). Each CTA reduces its chunk to (local max, local sum of exp, best candidate
// under the local normalization, which orders tokens like the global one), writes that partial, and the last
// CTA of a row (atomic counter) combines the partials in a fixed order: global max and sum, then the exact
// race score of each chunk's candidate. exp/log are evaluated in double and rounded to fp32 (fast math would
// otherwise use approximate intrinsics); divisions are IEEE. The result equals the reference except where two
// race scores agree to within a few ulps (softmax sums are accumulated in a different order).
#include <math.h>

#include "common/pdl.cuh"
#include "layers/common.cuh"
#include "layers/sample_race.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int THREADS = 256;
constexpr int ITEMS = 8;
constexpr int CHUNK = THREADS * ITEMS;

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = lane < THREADS / 32 ? scratch[lane] : -INFINITY;
    m = warp_max(m);
    if (lane == 0) scratch[32] = m;
  }
  __syncthreads();
  v = scratch[32];
  __syncthreads();
  return v;
}

struct SampleArgs {
  const float* logits;
  int64_t ls;
  const float* probs;  // nullable
  int64_t ps;
  const float* uniforms;
  int64_t us;
  const float* temperature;  // [B]
  float4* partials;          // [B, nchunk]: (max, sum, idx bits or -1 for a chunk holding a NaN logit, score)
  int* counters;             // [B], zero on entry; reset to zero by the last CTA
  int64_t* out;              // [B]
  int V, nchunk;
};

__global__ void __launch_bounds__(THREADS) sample_kernel(const SampleArgs a) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  __shared__ Cand cscratch[33];
  __shared__ float fscratch[33];
  __shared__ bool is_last;
  const int chunk = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const float temp = a.temperature[b];
  const int mode = temp == 0.f ? 0 : (a.probs != nullptr ? 2 : 1);  // 0 greedy, 1 softmax race, 2 probs race
  const float* lrow = a.logits + b * a.ls;
  const float* urow = a.uniforms + b * a.us;
  const float* prow = a.probs == nullptr ? nullptr : a.probs + b * a.ps;
  const int base = chunk * CHUNK;

  float x[ITEMS];
  // a NaN or +inf logit (an fp16 overflow) faults the row, in every mode (a filtered row's probs are read beside
  // its logits); -inf is a legitimate masked token
  bool has_fault = false;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int e = base + k * THREADS + tid;
    const float l = e < a.V ? lrow[e] : -INFINITY;
    has_fault |= isnan(l) || l == INFINITY;
    x[k] = mode == 2 ? (e < a.V ? prow[e] : -INFINITY) : l;
  }
  has_fault = __syncthreads_or(has_fault);

  float m = -INFINITY, s = 0.f;
  Cand best{-INFINITY, INT_MAX};
  if (mode == 0) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int e = base + k * THREADS + tid;
      const Cand c{x[k], e};
      if (e < a.V && better(c, best)) best = c;
    }
    best = block_best<THREADS>(best, cscratch);
  } else {
    float u[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int e = base + k * THREADS + tid;
      u[k] = e < a.V ? urow[e] : 1.f;
    }
    if (mode == 1) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        x[k] = __fdiv_rn(x[k], temp);
        m = fmaxf(m, x[k]);
      }
      m = block_max(m, fscratch);
      const float mu = m == -INFINITY ? 0.f : m;
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const float pe = exp_f(__fsub_rn(x[k], mu));
        s = __fadd_rn(s, pe);
        x[k] = pe;  // local weight, proportional to p
      }
      s = block_sum(s, fscratch);
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int e = base + k * THREADS + tid;
      const Cand c{race(x[k], u[k]), e};
      if (e < a.V && better(c, best)) best = c;
    }
    best = block_best<THREADS>(best, cscratch);
  }

  if (tid == 0) {
    a.partials[(int64_t)b * a.nchunk + chunk] =
        make_float4(mode == 0 ? best.v : m, s, __int_as_float(has_fault ? -1 : best.i), best.v);
    __threadfence();
    is_last = atomicAdd(&a.counters[b], 1) == a.nchunk - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // ---- last CTA of row b: combine the chunk partials in a fixed order ----
  const float4* part = a.partials + (int64_t)b * a.nchunk;
  bool row_fault = false;
  for (int c = tid; c < a.nchunk; c += THREADS) row_fault |= __float_as_int(__ldcg(&part[c]).z) == -1;
  if (__syncthreads_or(row_fault)) {  // block-uniform: every thread leaves here
    if (tid == 0) {
      a.out[b] = -1;
      a.counters[b] = 0;
    }
    return;
  }
  Cand fin{-INFINITY, INT_MAX};
  if (mode == 1) {
    float M = -INFINITY;
    for (int c = tid; c < a.nchunk; c += THREADS) M = fmaxf(M, __ldcg(&part[c]).x);
    M = block_max(M, fscratch);
    const float Mu = M == -INFINITY ? 0.f : M;
    float S = 0.f;
    for (int c = tid; c < a.nchunk; c += THREADS) {
      const float4 pc = __ldcg(&part[c]);
      if (pc.x != -INFINITY) S = __fadd_rn(S, __fmul_rn(pc.y, exp_f(__fsub_rn(pc.x, Mu))));
    }
    S = block_sum(S, fscratch);
    for (int c = tid; c < a.nchunk; c += THREADS) {
      const int i = __float_as_int(__ldcg(&part[c]).z);
      if (i >= a.V) continue;
      const float p = __fdiv_rn(exp_f(__fsub_rn(__fdiv_rn(lrow[i], temp), Mu)), S);
      const Cand cand{race(p, urow[i]), i};
      if (better(cand, fin)) fin = cand;
    }
  } else {
    for (int c = tid; c < a.nchunk; c += THREADS) {
      const float4 pc = __ldcg(&part[c]);
      const Cand cand{pc.w, __float_as_int(pc.z)};
      if (better(cand, fin)) fin = cand;
    }
  }
  fin = block_best<THREADS>(fin, cscratch);
  if (tid == 0) {
    a.out[b] = fin.i < a.V ? fin.i : 0;
    a.counters[b] = 0;
  }
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// Number of fp32x4 partials the workspace needs per row (ops/cuda_layers.py sizes workspace as B * this).
EXL2_API int exl2_sample_tokens_chunks(int64_t vocab) {
  return (int)((vocab + exl2::layers::CHUNK - 1) / exl2::layers::CHUNK);
}

// logits/uniforms (and probs, nullable) [B, V] fp32 with row strides; temperature [B] fp32 (0 = greedy; with
// probs given, rows with T > 0 race over probs); partials fp32 [B, nchunk, 4]; counters int32 [B] zeroed;
// out int64 [B]: token ids, -1 for a row whose logits hold a NaN.
EXL2_API int exl2_sample_tokens(const float* logits, int64_t logits_stride, const float* probs, int64_t probs_stride,
                                const float* uniforms, int64_t uniforms_stride, const float* temperature,
                                float* partials, int32_t* counters, int64_t* out, int64_t B, int64_t V,
                                cudaStream_t stream) {
  using namespace exl2::layers;
  EXL2_REQUIRE(B >= 0 && B < 65536 && V > 0 && V < (1ll << 30), "sample_tokens: bad shape [%lld, %lld]",
               (long long)B, (long long)V);
  if (B == 0) return EXL2_OK;
  SampleArgs a;
  a.logits = logits;
  a.ls = logits_stride;
  a.probs = probs;
  a.ps = probs_stride;
  a.uniforms = uniforms;
  a.us = uniforms_stride;
  a.temperature = temperature;
  a.partials = reinterpret_cast<float4*>(partials);
  a.counters = counters;
  a.out = out;
  a.V = (int)V;
  a.nchunk = exl2_sample_tokens_chunks(V);
  EXL2_REQUIRE(aligned16(partials), "sample_tokens: partials must be 16-byte aligned");
  exl2::launch_kernel(sample_kernel, dim3((unsigned)a.nchunk, (unsigned)B), THREADS, 0, stream, a);
  return exl2::check_launch("sample_tokens");
}
