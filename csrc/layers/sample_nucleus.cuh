// Rows sampled without a top-k (top-p and / or min-p over the whole vocabulary) in sample_top_k_kernel
// (sampling_top_k.cu), for when the kept tokens run past the row's best KMAX candidates.
//
// Each chunk CTA adds, besides its best KMAX keys, its mass relative to its top token and a histogram over bins of
// 1/32 nat below that top (per bin: mass, count, and the best race key of every bin up to it). Bins sit on the
// absolute grid floor(32 x), so a chunk's bin and the row's differ by an exact integer offset. NBIN bins span 32
// nats: a token further below the row's top has w < 1.3e-14, so it can neither hold the top-p boundary (the mass
// past the window is < 2e-9 of the row's, below 1 - top_p for any fp32 top_p < 1) nor win the race (the top
// token scores >= 1 / 16.6, such a token < 1.3e-14 * 2^25).
//
// The row's last CTA merges the histograms and finds the boundary bin g* (the first whose cumulative mass reaches
// top_p times the row's); every token above it stays, every token below it goes. Bins above both g* and the
// min-p cut are settled by the chunks' prefix race keys; the bins between token by token, read from the runs of
// those bins in the chunks' sorted keys (no pass over the row); the tokens of g* are sorted (at most MERGED of
// them) and walked in rank order. A crowded g* (a very flat row) is narrowed by
// passes over 8-bit digits of the keys until one digit's tokens fit. The mass sums run in double in another order
// than the reference's fp32 cumsum, so a token whose mass above it agrees with top_p's share to within a few fp32
// ulps may land the other way (as everywhere in these samplers); the chunks' bin sums are shared-memory atomics,
// so for such a token the side may also vary between runs.
#pragma once

#include <math.h>
#include <stdint.h>

#include "layers/sample_keys.cuh"
#include "layers/sample_race.cuh"

namespace exl2 {
namespace layers {
namespace nucleus {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int CHUNK = 2048;
constexpr int KMAX = 64;                   // largest top_k; each chunk passes on its best KMAX
constexpr int MAX_CHUNKS = 64;             // vocabularies up to 131,072 tokens
constexpr int MERGED = KMAX * MAX_CHUNKS;  // keys in shared memory: the merged candidates, or g*'s tokens
constexpr int SLOT = KMAX + 2;             // per chunk: KMAX keys, the fault flag, the mass below its top (double)
constexpr int NBIN = 1024;                 // bins of 1/32 nat: 32 nats
// per chunk, in uint64 words: NBIN (mass f32, count i32); NBIN prefix race keys; NBIN + 1 int32 bin starts (the
// position of each bin's first token in the chunk's sorted keys; the last: the window's token count); the sorted
// keys themselves and each one's (w f32, race f32) relative to the chunk's top, so the last CTA reads a bin's
// tokens without a pass over the row and without an exp or a log per token
constexpr int HS_BEST = NBIN, HS_START = 2 * NBIN, HS_KEYS = 2 * NBIN + NBIN / 2 + 1, HS_WR = HS_KEYS + CHUNK;
constexpr int HIST = HS_WR + CHUNK;
static_assert(CHUNK + HS_START <= MERGED, "a chunk's histogram sits beside its keys");
static_assert(NBIN % THREADS == 0 && MERGED % THREADS == 0, "whole per-thread spans");

struct BinStat {
  float mass;
  int count;
};

// the absolute bin grid floor(32 x), exact (x * 32 is exact in fp32), clamped far beyond any window
__device__ __forceinline__ int64_t grid_of(float x) {
  return (int64_t)fminf(fmaxf(floorf(x * 32.f), -0x1p60f), 0x1p60f);
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// lane's inclusive prefix sum of v over the warp's lanes
__device__ __forceinline__ double warp_inclusive_sum(double v) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) >= o) v += n;
  }
  return v;
}

// the sum over the lanes before this one, from warp_inclusive_sum's result
__device__ __forceinline__ double warp_exclusive_of(double inc) {
  const double e = __shfl_up_sync(0xffffffffu, inc, 1);
  return (threadIdx.x & 31) == 0 ? 0.0 : e;
}

// the block's sum, on every thread (warps added in a fixed order); scratch holds WARPS doubles
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  double t = 0.0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) t += scratch[w];
  __syncthreads();
  return t;
}

// the sum of v over the threads before this one (threadIdx order); scratch holds WARPS doubles
__device__ __forceinline__ double block_exclusive_sum(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double inc = warp_inclusive_sum(v), excl = warp_exclusive_of(inc);
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  double base = 0.0;
  for (int w = 0; w < warp; ++w) base += scratch[w];
  __syncthreads();
  return base + excl;
}

// h[0, NBIN) in shared memory replaced by its inclusive prefix maximum; scratch holds WARPS words
__device__ __forceinline__ void block_prefix_max(unsigned long long* h, unsigned long long* scratch) {
  constexpr int PER = NBIN / THREADS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long v[PER], run = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) v[i] = run = max(run, h[threadIdx.x * PER + i]);
  unsigned long long inc = run;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc = max(inc, n);
  }
  unsigned long long excl = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) excl = 0;
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  for (int w = 0; w < warp; ++w) excl = max(excl, scratch[w]);
#pragma unroll
  for (int i = 0; i < PER; ++i) h[threadIdx.x * PER + i] = max(v[i], excl);
  __syncthreads();
}

// A chunk of a row sampled without top-k, after its CHUNK keys are sorted (keys[0] its top): its histogram, bin
// starts, sorted keys and their (w, race) relative to its top (HIST words to `out`), and its mass below its top,
// returned on every thread. scratch is HS_START words of shared memory (beside the sorted keys); dscratch WARPS
// doubles, uscratch WARPS words.
__device__ double chunk_histogram(const uint64_t* keys, const float* urow, uint64_t* scratch, uint64_t* out,
                                  double* dscratch, unsigned long long* uscratch) {
  const float top = key_x(keys[0]);
  BinStat* hs = reinterpret_cast<BinStat*>(scratch);                        // [NBIN]
  unsigned long long* hb = reinterpret_cast<unsigned long long*>(scratch + NBIN);  // [NBIN] race keys
  for (int g = threadIdx.x; g < NBIN; g += THREADS) {
    hs[g] = BinStat{0.f, 0};
    hb[g] = 0;
  }
  __syncthreads();
  double s = 0.0;
  const int64_t ftop = grid_of(top);
  for (int j = threadIdx.x; j < CHUNK; j += THREADS) {  // in sorted order: token j's (w, race) beside its key
    const uint64_t key = keys[j];
    const float x = key_x(key);
    uint64_t wr = 0;
    if (key != 0 && x > -INFINITY) {  // not padding, not masked
      const int e = key_id(key);
      const float w = exp_f(__fsub_rn(x, top));
      s += (double)w;
      const int64_t g = ftop - grid_of(x);
      if (g < NBIN) {
        const float r = race(w, urow[e]);
        atomicAdd(&hs[g].mass, w);
        atomicAdd(&hs[g].count, 1);
        atomicMax(&hb[g], (unsigned long long)make_key(r, e));
        wr = ((uint64_t)__float_as_uint(r) << 32) | __float_as_uint(w);
      }
    }
    out[HS_WR + j] = wr;
  }
  __syncthreads();
  block_prefix_max(hb, uscratch);
  for (int i = threadIdx.x; i < HS_START; i += THREADS) out[i] = scratch[i];
  {  // bin starts: the counts' exclusive prefix (sorted keys run through the bins in order)
    constexpr int PER = NBIN / THREADS;
    int run = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) run += hs[threadIdx.x * PER + i].count;
    int start = (int)block_exclusive_sum((double)run, dscratch);
    int* starts = reinterpret_cast<int*>(out + HS_START);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      starts[threadIdx.x * PER + i] = start;
      start += hs[threadIdx.x * PER + i].count;
    }
    if (threadIdx.x == THREADS - 1) starts[NBIN] = start;
  }
  for (int i = threadIdx.x; i < CHUNK; i += THREADS) out[HS_KEYS + i] = keys[i];
  return block_sum(s, dscratch);
}

// The positions [a, b) in chunk histogram h's sorted keys of the tokens of the row's bins [ga, gb] (the chunk's
// bin 0 is the row's bin off).
__device__ __forceinline__ void bin_run(const uint64_t* h, int64_t off, int ga, int gb, int& a, int& b) {
  const int* starts = reinterpret_cast<const int*>(h + HS_START);
  const int64_t ja = ga - off, jb = gb - off + 1;
  a = ja <= 0 ? 0 : __ldcg(&starts[min(ja, (int64_t)NBIN)]);
  b = jb <= 0 ? 0 : __ldcg(&starts[min(jb, (int64_t)NBIN)]);
}

// Token p of chunk histogram h's sorted keys (key k) into the race unless min-p drops it: its weight and race
// score relative to the chunk's top, times `scale` (the chunk's top relative to the row's).
__device__ __forceinline__ void race_sorted(const uint64_t* h, int p, unsigned long long k, float scale, float min_p,
                                            Cand& best) {
  const uint64_t wr = __ldcg(&h[HS_WR + p]);
  if (min_p > 0.f && !(__fmul_rn(__uint_as_float((uint32_t)wr), scale) >= min_p)) return;
  const Cand o{__fmul_rn(__uint_as_float((uint32_t)(wr >> 32)), scale), key_id(k)};
  if (better(o, best)) best = o;
}

// One row sampled without top-k whose kept tokens run past its candidates, in its last CTA (all threads).
struct Row {
  const float* urow;      // [V] uniforms
  const uint64_t* slots;  // [nchunk, SLOT]
  const uint64_t* hist;   // [nchunk, HIST]
  float x_max, min_p;
  double limit;  // top_p times the row's mass (relative to x_max); infinity without top-p
  int V, nchunk;
};

// The thread's best race candidate among the row's kept tokens (block_best merges them); keys: MERGED words of
// shared memory, free on entry.
__device__ Cand sample_wide_row(const Row& r, uint64_t* keys) {
  __shared__ double cscale[MAX_CHUNKS];  // exp(chunk top - row top)
  __shared__ int64_t coff[MAX_CHUNKS];   // the row's bin of a chunk's bin 0
  __shared__ double dscratch[WARPS], s_above;
  __shared__ unsigned long long s_kmin, s_kmax, s_prefix;
  __shared__ int s_gstar, s_ncol, s_count;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t gtop = grid_of(r.x_max);
  for (int c = tid; c < r.nchunk; c += THREADS) {
    const float m = key_x(__ldcg(&r.slots[c * SLOT]));
    cscale[c] = m > -INFINITY ? exp((double)m - (double)r.x_max) : 0.0;
    coff[c] = m > -INFINITY ? gtop - grid_of(m) : (int64_t)NBIN;
  }
  __syncthreads();
  double* hm = reinterpret_cast<double*>(keys);  // [NBIN] the row's histogram
  int* hc = reinterpret_cast<int*>(keys + NBIN);  // [NBIN]
  {  // each thread PER_T bins, chunks 4 at a time: 16 loads in flight per thread (a loop of dependent L2 loads
     // would take ~40 us)
    constexpr int PER_T = NBIN / THREADS, UNROLL = 4;
    double m[PER_T] = {};
    int n[PER_T] = {};
    for (int c0 = 0; c0 < r.nchunk; c0 += UNROLL) {
      uint64_t word[UNROLL][PER_T];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int c = c0 + u;
        const int64_t off = c < r.nchunk ? coff[c] : (int64_t)NBIN;
#pragma unroll
        for (int i = 0; i < PER_T; ++i) {
          const int64_t j = tid + i * THREADS - off;
          word[u][i] = j >= 0 ? __ldcg(&r.hist[(int64_t)c * HIST + j]) : 0ull;
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const double scale = c0 + u < r.nchunk ? cscale[c0 + u] : 0.0;
#pragma unroll
        for (int i = 0; i < PER_T; ++i) {
          m[i] += (double)__uint_as_float((uint32_t)word[u][i]) * scale;
          n[i] += (int)(word[u][i] >> 32);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < PER_T; ++i) {
      hm[tid + i * THREADS] = m[i];
      hc[tid + i * THREADS] = n[i];
    }
  }
  __syncthreads();
  if (warp == 0) {  // g*: the first bin whose cumulative mass reaches the limit (NBIN: none does)
    constexpr int PER = NBIN / 32;
    double part = 0.0;
    for (int i = 0; i < PER; ++i) part += hm[lane * PER + i];
    const double inc = warp_inclusive_sum(part);
    double cum = warp_exclusive_of(inc);
    const unsigned reach = __ballot_sync(0xffffffffu, inc >= r.limit);
    if (lane == 0) {
      s_gstar = NBIN;
      s_above = 0.0;
    }
    __syncwarp();
    if (reach != 0 && lane == __ffs(reach) - 1) {
      for (int i = 0; i < PER; ++i) {
        const int g = lane * PER + i;
        if (cum + hm[g] >= r.limit || i == PER - 1) {
          s_gstar = g;
          s_above = cum;
          break;
        }
        cum += hm[g];
      }
    }
  }
  __syncthreads();
  const int gstar = s_gstar;
  // min-p: bins below g_cut hold only tokens with w > min_p * e^(1/32) (kept without a look), bins above g_hard
  // only tokens with w < min_p * e^(-1/32) (dropped)
  const double cut = r.min_p > 0.f ? -32.0 * log((double)r.min_p) : 2.0 * NBIN;
  const int gcut = (int)fmin(fmax(floor(cut) - 1.0, 0.0), (double)NBIN);
  const int ghard = (int)fmin(fmax(ceil(cut) + 2.0, 0.0), (double)(NBIN - 1));
  const int gsafe = min(gstar, gcut);
  const int ghi = min(gstar, ghard);  // bins g_safe .. g_hi need their tokens looked at
  const bool crowded = gstar <= ghi && hc[gstar] > MERGED;
  if (tid == 0) {
    s_ncol = 0;
    s_kmin = ~0ull;
    s_kmax = 0;
  }
  __syncthreads();  // hm / hc are dead: keys collect g*'s tokens from here

  Cand best{-INFINITY, INT_MAX};
  if (gsafe > 0) {  // bins above g_safe: the chunks' prefix race keys
    for (int c = tid; c < r.nchunk; c += THREADS) {
      const long long j = min((long long)gsafe - 1 - coff[c], (long long)NBIN - 1);
      if (j < 0) continue;
      const uint64_t k = __ldcg(&r.hist[(int64_t)c * HIST + NBIN + j]);
      if (k == 0) continue;
      const Cand o{__fmul_rn(key_x(k), (float)cscale[c]), key_id(k)};
      if (better(o, best)) best = o;
    }
  }
  // bins g_safe .. g* - 1 raced token by token, g*'s tokens collected (or their key range, if crowded): each warp
  // reads the runs of these bins in its chunks' sorted keys
  unsigned long long kmin = ~0ull, kmax = 0;
  if (gsafe <= ghi) {
    for (int c = warp; c < r.nchunk; c += WARPS) {
      const uint64_t* h = r.hist + (int64_t)c * HIST;
      int a, b;
      bin_run(h, coff[c], gsafe, ghi, a, b);
      const float scale = (float)cscale[c];
      for (int p = a + lane; p < b; p += 32) {
        const unsigned long long k = __ldcg(&h[HS_KEYS + p]);
        const int64_t g = gtop - grid_of(key_x(k));
        if (g < gstar) {
          race_sorted(h, p, k, scale, r.min_p, best);
        } else if (crowded) {
          kmin = min(kmin, k);
          kmax = max(kmax, k);
        } else {
          const int i = atomicAdd(&s_ncol, 1);
          if (i < MERGED) keys[i] = k;
        }
      }
    }
  }
  if (crowded) {
    atomicMin(&s_kmin, kmin);
    atomicMax(&s_kmax, kmax);
  }
  __syncthreads();
  double above = s_above;

  if (crowded) {  // narrow g* by 8-bit digits of the keys until the boundary digit's tokens fit in `keys`
    double* wm = reinterpret_cast<double*>(keys);                   // [WARPS][256] per-warp digit masses
    unsigned* wc = reinterpret_cast<unsigned*>(keys + WARPS * 256);  // [WARPS][256] and counts
    unsigned long long prefix = s_kmax;
    int shift = ((63 - __clzll((long long)(s_kmin ^ s_kmax))) / 8) * 8;
    for (;;) {
      const unsigned long long range = shift + 8 >= 64 ? 0ull : ~0ull << (shift + 8);
      for (int i = lane; i < 256; i += 32) {
        wm[warp * 256 + i] = 0.0;
        wc[warp * 256 + i] = 0;
      }
      __syncwarp();
      for (int c = warp; c < r.nchunk; c += WARPS) {  // g*'s runs, a warp per chunk: every lane the same trips
        const uint64_t* h = r.hist + (int64_t)c * HIST;
        int a, b;
        bin_run(h, coff[c], gstar, gstar, a, b);
        for (int p0 = a; p0 < b; p0 += 32) {
          const int p = p0 + lane;
          int d = -1;
          double w = 0.0;
          if (p < b) {
            const unsigned long long k = __ldcg(&h[HS_KEYS + p]);
            if ((k & range) == (prefix & range)) {
              d = (int)((k >> shift) & 255);
              w = (double)__uint_as_float((uint32_t)__ldcg(&h[HS_WR + p])) * cscale[c];
            }
          }
          if (!__any_sync(0xffffffffu, d >= 0)) continue;
          // the run is sorted, so equal digits sit in consecutive lanes: a segmented sum (one scan, a fixed order)
          const int dprev = __shfl_up_sync(0xffffffffu, d, 1), dnext = __shfl_down_sync(0xffffffffu, d, 1);
          const bool tail = lane == 31 || dnext != d;
          const unsigned heads = __ballot_sync(0xffffffffu, lane == 0 || dprev != d);
          const int head = 31 - __clz(heads & (0xffffffffu >> (31 - lane)));  // this lane's segment's first lane
          const double inc = warp_inclusive_sum(w);
          const double before = __shfl_sync(0xffffffffu, inc, max(head - 1, 0));
          if (tail && d >= 0) {  // one writer per digit and warp
            wm[warp * 256 + d] += head > 0 ? inc - before : inc;
            wc[warp * 256 + d] += lane - head + 1;
          }
          __syncwarp();
        }
      }
      __syncthreads();
      {  // digit tid's totals over the warps (fixed order), into row 0
        double m = 0.0;
        unsigned n = 0;
        for (int w = 0; w < WARPS; ++w) {
          m += wm[w * 256 + tid];
          n += wc[w * 256 + tid];
        }
        __syncthreads();
        wm[tid] = m;
        wc[tid] = n;
      }
      __syncthreads();
      if (warp == 0) {  // the boundary digit: from the top down, the first whose cumulative mass reaches the limit
        double part = 0.0;
        for (int i = 0; i < 8; ++i) part += wm[255 - (lane * 8 + i)];
        const double inc = warp_inclusive_sum(part);
        double cum = warp_exclusive_of(inc);
        const unsigned reach = __ballot_sync(0xffffffffu, above + inc >= r.limit);
        if (lane == 0) {  // none reaches it (rounding): every digit of the range stays
          s_count = 0;
          s_above = above + inc;  // unused
          s_prefix = prefix & range;
        }
        __syncwarp();
        if (reach != 0 && lane == __ffs(reach) - 1) {
          cum += above;
          for (int i = 0; i < 8; ++i) {
            const int d = 255 - (lane * 8 + i);
            if (cum + wm[d] >= r.limit || i == 7) {
              s_prefix = (prefix & range) | ((unsigned long long)d << shift);
              s_count = max((int)wc[d], 1);
              s_above = cum;
              break;
            }
            cum += wm[d];
          }
        }
      }
      __syncthreads();
      above = s_above;
      if (s_count <= MERGED || shift == 0) break;
      prefix = s_prefix;
      shift -= 8;
      __syncthreads();  // row 0 read before the next pass zeroes it
    }
    // bin g*'s tokens: above the boundary digit kept (raced now), in it collected, below it dropped; when no
    // digit reached the limit, the whole last range stays
    const unsigned long long lo = s_prefix;
    const unsigned long long span = s_count == 0 ? (shift + 8 >= 64 ? ~0ull : (1ull << (shift + 8)) - 1)
                                                 : (1ull << shift) - 1;
    const unsigned long long hi = lo + span;  // the boundary digit's (or the range's) last key
    const bool listed = s_count > 0;
    for (int c = warp; c < r.nchunk; c += WARPS) {
      const uint64_t* h = r.hist + (int64_t)c * HIST;
      int a, b;
      bin_run(h, coff[c], gstar, gstar, a, b);
      const float scale = (float)cscale[c];
      for (int p = a + lane; p < b; p += 32) {
        const unsigned long long k = __ldcg(&h[HS_KEYS + p]);
        if (k > hi || (!listed && k >= lo)) {
          race_sorted(h, p, k, scale, r.min_p, best);
        } else if (listed && k >= lo) {
          const int i = atomicAdd(&s_ncol, 1);
          if (i < MERGED) keys[i] = k;
        }
      }
    }
    __syncthreads();
  }

  const int ncol = min(s_ncol, MERGED);
  if (ncol > 0) {  // the boundary's tokens in rank order: each stays while the mass above it is below the limit
    int n2 = 1;
    while (n2 < ncol) n2 <<= 1;
    for (int i = ncol + tid; i < n2; i += THREADS) keys[i] = 0;
    __syncthreads();
    bitonic_sort_desc<THREADS>(keys, n2);
    constexpr int PER = MERGED / THREADS;
    float wl[PER];
    double part = 0.0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = tid * PER + i;
      wl[i] = idx < ncol ? exp_f(__fsub_rn(key_x(keys[idx]), r.x_max)) : 0.f;
      part += (double)wl[i];
    }
    double run = above + block_exclusive_sum(part, dscratch);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = tid * PER + i;
      if (idx < ncol && run < r.limit && (r.min_p <= 0.f || wl[i] >= r.min_p)) {
        const int id = key_id(keys[idx]);
        const Cand o{race(wl[i], r.urow[id]), id};
        if (better(o, best)) best = o;
      }
      run += (double)wl[i];
    }
  }
  return best;
}

}  // namespace nucleus
}  // namespace layers
}  // namespace exl2
