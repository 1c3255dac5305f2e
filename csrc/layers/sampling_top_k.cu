// sample_top_k: the exponential race over each row's top-k tokens (k <= 64), with top-p and min-p applied inside
// them, in one launch for B rows and without the full-vocabulary sort of the torch filter path.
//
// Semantics (ops/reference_sampling.py sampling_probs + sample_tokens): temperature T > 0, x = logits / T, tokens
// ranked by x descending with equal x to the lower id (the reference's stable sort of p = softmax(x); p is
// monotone in x, so both rank alike except where two distinct x round to one p). The first k ranks are kept; among
// them, rank r stays while the probability mass ranked above it is below top_p times the top-k mass (the top token
// always stays); min-p keeps p >= min_p * p_max. The winner is argmax w_i / max(-log(u_i), 2^-25) over the kept
// tokens, w_i = exp(x_i - x_max) (proportional to the reference's renormalized p; exp in double, rounded to fp32).
// Temperature 0 rows are top-1: their argmax. A row whose logits hold a NaN or +inf gives -1. Equal to the
// reference except where two race scores, or the mass at the top-p boundary and top_p's share, agree to within a
// few ulps (the sums are accumulated in another order), as sampling.cu.
//
// Grid (chunks of CHUNK tokens, B). Each CTA sorts its chunk's (x, id) keys and writes its best KMAX with a fault
// flag; the last CTA of a row (atomic counter) sorts all chunks' candidates, which hold the row's top KMAX, and
// draws. Keys: the order-preserving bits of x above the complemented id, so keys are distinct and descending key
// order is the ranking.
#include <math.h>
#include <stdint.h>

#include "common/pdl.cuh"
#include "layers/common.cuh"
#include "layers/sample_race.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int THREADS = 256;
constexpr int CHUNK = 2048;
constexpr int KMAX = 64;                      // largest top_k; each chunk passes on its best KMAX
constexpr int MAX_CHUNKS = 64;                // vocabularies up to 131,072 tokens
constexpr int MERGED = KMAX * MAX_CHUNKS;     // candidates the last CTA sorts (padded with key 0)
constexpr int SLOT = KMAX + 1;                // per chunk: KMAX keys, then the chunk's fault flag

__device__ __forceinline__ uint64_t make_key(float x, int id) {
  const uint32_t u = x == 0.f ? 0u : __float_as_uint(x);  // -0 as +0: equal x rank by id (not x + 0, which fast
                                                           // math may fold away)
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)ord << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)id);
}

__device__ __forceinline__ float key_x(uint64_t key) {
  const uint32_t ord = (uint32_t)(key >> 32);
  return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7FFFFFFFu) : ~ord);
}

__device__ __forceinline__ int key_id(uint64_t key) { return (int)(0xFFFFFFFFu - (uint32_t)key); }

// n keys in shared memory sorted descending (n a power of two), by the whole block
__device__ void bitonic_sort_desc(uint64_t* keys, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += THREADS) {
        const int lo = 2 * i - (i & (stride - 1));  // i with a zero bit inserted at `stride`
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const uint64_t a = keys[lo], b = keys[hi];
        if ((a < b) == desc) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

struct TopKArgs {
  const float* logits;
  int64_t ls;
  const float* uniforms;
  int64_t us;
  const float* temperature;  // [B]
  const int64_t* top_k;      // [B], 1..KMAX (greedy rows: any)
  const float* top_p;        // [B], >= 1: off
  const float* min_p;        // [B], <= 0: off
  uint64_t* cand;            // [B, nchunk, SLOT]
  int* counters;             // [B], zero on entry; reset to zero by the last CTA
  int64_t* out;              // [B]
  int V, nchunk;
};

__global__ void __launch_bounds__(THREADS) sample_top_k_kernel(const TopKArgs a) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  __shared__ uint64_t keys[MERGED];  // a chunk's CHUNK keys, then the row's merged candidates
  __shared__ float wsh[KMAX];
  __shared__ int kept;
  __shared__ bool is_last;
  __shared__ Cand cscratch[33];
  const int chunk = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const float temp = a.temperature[b];
  const float* lrow = a.logits + b * a.ls;
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
  bitonic_sort_desc(keys, CHUNK);
  uint64_t* slot = a.cand + ((int64_t)b * a.nchunk + chunk) * SLOT;
  if (tid < KMAX) slot[tid] = keys[tid];
  if (tid == 0) slot[KMAX] = fault ? 1u : 0u;
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
  bitonic_sort_desc(keys, n);

  const int k = temp > 0.f ? (int)min(max(a.top_k[b], (int64_t)1), (int64_t)KMAX) : 1;
  const float x_max = key_x(keys[0]);
  if (tid < k) wsh[tid] = exp_f(__fsub_rn(key_x(keys[tid]), x_max));  // 1 for the top token
  __syncthreads();
  if (tid == 0) {  // how many of the k stay: top-p over the top-k mass, then min-p (one thread: a fixed order)
    const float top_p = a.top_p[b], min_p = a.min_p[b];
    double mass = 0.0;
    for (int r = 0; r < k; ++r) mass += (double)wsh[r];
    const double limit = (double)top_p * mass;
    int r = 1;  // the top token always stays
    double above = (double)wsh[0];
    while (r < k && (top_p >= 1.f || above < limit) && (min_p <= 0.f || wsh[r] >= min_p)) above += (double)wsh[r++];
    kept = wsh[0] > 0.f ? r : 1;  // x overflowed to inf (a tiny temperature): the top token alone
  }
  __syncthreads();

  Cand best{-INFINITY, INT_MAX};
  if (tid < kept) {
    const int id = key_id(keys[tid]);
    best = Cand{race(wsh[tid], a.uniforms[b * a.us + id]), id};
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

// logits/uniforms [B, V] fp32 with row strides (V <= 131072); temperature [B] fp32 (0 = greedy); top_k [B] int64
// in 1..64 for sampled rows; top_p, min_p [B] fp32; cand: B * ceil(V / 2048) * 65 uint64 of workspace; counters
// int32 [B] zeroed; out int64 [B]: token ids, -1 for a row whose logits hold a NaN or +inf.
EXL2_API int exl2_sample_top_k(const float* logits, int64_t logits_stride, const float* uniforms,
                               int64_t uniforms_stride, const float* temperature, const int64_t* top_k,
                               const float* top_p, const float* min_p, uint64_t* cand, int32_t* counters,
                               int64_t* out, int64_t B, int64_t V, cudaStream_t stream) {
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
  a.counters = counters;
  a.out = out;
  a.V = (int)V;
  a.nchunk = (int)((V + CHUNK - 1) / CHUNK);
  exl2::launch_kernel(sample_top_k_kernel, dim3((unsigned)a.nchunk, (unsigned)B), THREADS, 0, stream, a);
  return exl2::check_launch("sample_top_k");
}
