// sample_top_k: the exponential race over each sampled row's kept tokens, in one launch for B rows and without the
// full-vocabulary sort of the torch filter path: rows with a top-k of at most KMAX (top-p and min-p applied inside
// it), and rows without a top-k, whose top-p / min-p run over the whole row (sample_nucleus.cuh).
//
// Semantics (ops/reference_sampling.py sampling_probs + sample_tokens): temperature T > 0, x = logits / T, tokens
// ranked by x descending with equal x to the lower id (the reference's stable sort of p = softmax(x); p is
// monotone in x, so both rank alike except where two distinct x round to one p). The first k ranks are kept (all
// without a top-k); among them, rank r stays while the probability mass ranked above it is below top_p times
// their mass (the top token always stays); min-p keeps p >= min_p * p_max. The winner is argmax
// w_i / max(-log(u_i), 2^-25) over the kept tokens, w_i = exp(x_i - x_max) (proportional to the reference's
// renormalized p; exp in double, rounded to fp32). Temperature 0 rows are top-1: their argmax. A row whose logits
// hold a NaN or +inf gives -1. Equal to the reference except where two race scores, or the mass at the top-p
// boundary and top_p's share, agree to within a few ulps (the sums are accumulated in another order), as
// sampling.cu.
//
// Grid (chunks of CHUNK tokens, B). Each CTA sorts its chunk's keys (sample_keys.cuh) and writes its best KMAX
// with a fault flag (and, for a row without top-k, its mass and histogram); the last CTA of a row (atomic counter)
// sorts all chunks' candidates, which hold the row's top KMAX, and draws among them, unless a row without top-k
// keeps more than those (sample_nucleus.cuh).
#include <math.h>
#include <stdint.h>

#include "common/pdl.cuh"
#include "layers/common.cuh"
#include "layers/sample_keys.cuh"
#include "layers/sample_nucleus.cuh"
#include "layers/sample_race.cuh"

namespace exl2 {
namespace layers {
namespace {

using nucleus::CHUNK;
using nucleus::HIST;
using nucleus::KMAX;
using nucleus::MAX_CHUNKS;
using nucleus::MERGED;
using nucleus::SLOT;
using nucleus::THREADS;
using nucleus::WARPS;

struct TopKArgs {
  const float* logits;
  int64_t ls;
  const float* uniforms;
  int64_t us;
  const float* temperature;  // [B]
  const int64_t* top_k;      // [B], 1..KMAX; above KMAX: no top-k (greedy rows: any)
  const float* top_p;        // [B], >= 1: off
  const float* min_p;        // [B], <= 0: off
  uint64_t* cand;            // [B, nchunk, SLOT]
  uint64_t* hist;            // [B, nchunk, HIST], or null when no row goes without a top-k
  int* counters;             // [B], zero on entry; reset to zero by the last CTA
  int64_t* out;              // [B]
  int V, nchunk;
};

__global__ void __launch_bounds__(THREADS) sample_top_k_kernel(const TopKArgs a) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  __shared__ uint64_t keys[MERGED];  // a chunk's CHUNK keys (and its histogram), then the row's merged candidates
  __shared__ float wsh[KMAX];
  __shared__ int kept;
  __shared__ bool is_last;
  __shared__ Cand cscratch[33];
  __shared__ double dscratch[WARPS];
  __shared__ unsigned long long uscratch[WARPS];
  __shared__ double limit;
  const int chunk = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const float temp = a.temperature[b];
  // no top-k: top-p / min-p over the whole row (hist null: the caller says no row is)
  const bool wide = temp > 0.f && a.top_k[b] > KMAX && a.hist != nullptr;
  const float* lrow = a.logits + b * a.ls;
  const float* urow = a.uniforms + b * a.us;
  const int base = chunk * CHUNK;

  bool fault = false;
  for (int j = tid; j < CHUNK; j += THREADS) {
    const int e = base + j;
    uint64_t key = 0;  // padding: below every token's key
    if (e < a.V) {
      const float l = lrow[e];
      fault |= isnan(l) || l == INFINITY;  // -inf is a masked token
      key = make_key(temp > 0.f ? __fdiv_rn(l, temp) : l, e);
    }
    keys[j] = key;
  }
  fault = __syncthreads_or(fault);
  bitonic_sort_desc<THREADS>(keys, CHUNK);
  uint64_t* slot = a.cand + ((int64_t)b * a.nchunk + chunk) * SLOT;
  if (tid < KMAX) slot[tid] = keys[tid];
  if (tid == 0) slot[KMAX] = fault ? 1u : 0u;
  if (wide && !fault) {
    const double mass = nucleus::chunk_histogram(keys, urow, keys + CHUNK,
                                                 a.hist + ((int64_t)b * a.nchunk + chunk) * HIST, dscratch,
                                                 uscratch);
    if (tid == 0) slot[KMAX + 1] = (uint64_t)__double_as_longlong(mass);
  }
  __threadfence();  // every writer's stores are visible device-wide before the ticket is taken
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(&a.counters[b], 1) == a.nchunk - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // ---- last CTA of row b: the row's top KMAX from all chunks' candidates ----
  const uint64_t* row = a.cand + (int64_t)b * a.nchunk * SLOT;
  bool row_fault = false;
  for (int c = tid; c < a.nchunk; c += THREADS) row_fault |= __ldcg(&row[c * SLOT + KMAX]) != 0;
  if (__syncthreads_or(row_fault)) {  // block-uniform
    if (tid == 0) {
      a.out[b] = -1;
      a.counters[b] = 0;
    }
    return;
  }
  int n = KMAX;
  while (n < a.nchunk * KMAX) n <<= 1;
  for (int j = tid; j < n; j += THREADS) {
    const int c = j / KMAX;
    keys[j] = c < a.nchunk ? __ldcg(&row[c * SLOT + j % KMAX]) : 0;
  }
  __syncthreads();
  bitonic_sort_desc<THREADS>(keys, n);

  // ranks looked at here: the top k, or (no top-k) the candidates, which the kept tokens may run past
  const int k = wide ? min(KMAX, a.V) : temp > 0.f ? (int)min(max(a.top_k[b], (int64_t)1), (int64_t)KMAX) : 1;
  const float x_max = key_x(keys[0]);
  if (tid < k) wsh[tid] = exp_f(__fsub_rn(key_x(keys[tid]), x_max));  // 1 for the top token
  double row_mass = 0.0;  // no top-k: the row's mass relative to x_max, from the chunks' (fixed order)
  if (wide) {
    for (int c = tid; c < a.nchunk; c += THREADS) {
      const float m = key_x(__ldcg(&row[c * SLOT]));
      if (m > -INFINITY)
        row_mass += __longlong_as_double((long long)__ldcg(&row[c * SLOT + KMAX + 1])) *
                    exp((double)m - (double)x_max);
    }
    row_mass = nucleus::block_sum(row_mass, dscratch);
  }
  __syncthreads();
  if (tid == 0) {  // how many ranks stay: top-p over the mass, then min-p (one thread: a fixed order)
    const float top_p = a.top_p[b], min_p = a.min_p[b];
    double mass = row_mass;
    if (!wide)
      for (int r = 0; r < k; ++r) mass += (double)wsh[r];
    limit = top_p < 1.f ? (double)top_p * mass : INFINITY;
    int r = 1;  // the top token always stays
    double above = (double)wsh[0];
    while (r < k && above < limit && (min_p <= 0.f || wsh[r] >= min_p)) above += (double)wsh[r++];
    // x overflowed to inf (a tiny temperature): the top token alone; 0: the kept tokens run past the candidates
    kept = !(wsh[0] > 0.f) ? 1 : wide && r == k && k < a.V ? 0 : r;
  }
  __syncthreads();

  Cand best{-INFINITY, INT_MAX};
  if (kept > 0) {
    if (tid < kept) {
      const int id = key_id(keys[tid]);
      best = Cand{race(wsh[tid], urow[id]), id};
    }
  } else {
    const nucleus::Row r{urow, row, a.hist + (int64_t)b * a.nchunk * HIST, x_max, a.min_p[b], limit,
                         a.V, a.nchunk};
    best = nucleus::sample_wide_row(r, keys);
  }
  best = block_best<THREADS>(best, cscratch);  // ties to the lowest id
  if (tid == 0) {
    a.out[b] = best.i < a.V ? best.i : 0;
    a.counters[b] = 0;
  }
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// logits/uniforms [B, V] fp32 with row strides (V <= 131072); temperature [B] fp32 (0 = greedy); top_k [B] int64,
// 1..64 or above 64 for no top-k; top_p, min_p [B] fp32; cand: B * ceil(V / 2048) * 66 and hist
// B * ceil(V / 2048) * 6657 uint64 of workspace (hist null: no row goes without a top-k, rows above 64 take the top
// 64); counters int32 [B] zeroed; out int64 [B]: token ids, -1 for a row whose logits hold a NaN or +inf.
EXL2_API int exl2_sample_top_k(const float* logits, int64_t logits_stride, const float* uniforms,
                               int64_t uniforms_stride, const float* temperature, const int64_t* top_k,
                               const float* top_p, const float* min_p, uint64_t* cand, uint64_t* hist,
                               int32_t* counters, int64_t* out, int64_t B, int64_t V, cudaStream_t stream) {
  using namespace exl2::layers;
  EXL2_REQUIRE(B >= 0 && B < 65536 && V > 0 && V <= (int64_t)CHUNK * MAX_CHUNKS,
               "sample_top_k: bad shape [%lld, %lld] (vocabulary at most %d)", (long long)B, (long long)V,
               CHUNK * MAX_CHUNKS);
  if (B == 0) return EXL2_OK;
  TopKArgs a;
  a.logits = logits;
  a.ls = logits_stride;
  a.uniforms = uniforms;
  a.us = uniforms_stride;
  a.temperature = temperature;
  a.top_k = top_k;
  a.top_p = top_p;
  a.min_p = min_p;
  a.cand = cand;
  a.hist = hist;
  a.counters = counters;
  a.out = out;
  a.V = (int)V;
  a.nchunk = (int)((V + CHUNK - 1) / CHUNK);
  exl2::launch_kernel(sample_top_k_kernel, dim3((unsigned)a.nchunk, (unsigned)B), THREADS, 0, stream, a);
  return exl2::check_launch("sample_top_k");
}
