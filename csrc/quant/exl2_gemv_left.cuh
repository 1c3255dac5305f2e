// Split-K partials left to the next GEMV: gate/up skips its split-K finish and down sums the partials in its gather.
//
// A decode step's gate/up GEMV splits K two ways (112 column blocks on 264 planned blocks), so each column block's
// last block waits for a ticket (an atomic round trip) and loads the two partials (another) before the launch can
// end, while the DRAM has little else to do. Session 37 measured the library without any split-K finish (BD6: -0.10
// ms per 8B decode step for o, gate/up and down together) and modelled gate/up alone leaving its partials (-0.06 ms).
// Here gate/up's blocks store their partials and exit (GemvParams::leave); down gathers g and u as sums of those
// partials in split order plus the bias, rounded to fp16 — the arithmetic of gv_reduce_partials(_vec4) — then
// silu_mul, so its input, its output and everything after it are bit-identical to the launches with the finish.
// Down's gather reads k floats per value instead of one half (k = 2 at M <= 8 on the 8B: its rows' 16 KB at M = 1).
#pragma once

#include "common/activation.cuh"
#include "common/api.h"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

constexpr int kLeftMaxSplits = 16;  // splits per part the gather sums (it loads kLeftSplitStep per round)

// Host: the arguments of a launch that leaves its partials (leave) or sums a producer's (consume: the producer's
// two parts, gate then up).
struct GemvLeft {
  int leave;
  const float* ws[2];
  const __half* bias[2];
  int k[2], ld[2];
};

// Host: checks `a` against the planned launch and sets it in p (after the descriptors are planned).
inline int plan_left(const GemvLeft& a, const void* xpre, int gate_off, bool norm, bool rope, GemvParams& p) {
  EXL2_REQUIRE(!p.cluster && !p.probe, "exl2_gemv (left partials): no cluster split-K or probe launch");
  EXL2_REQUIRE(p.M <= 8, "exl2_gemv (left partials): M=%d (1..8: one token tile)", p.M);
  if (a.leave) {
    EXL2_REQUIRE(!rope, "exl2_gemv (leave partials): no fused rope");
    for (int i = 0; i < p.ndesc; ++i)
      EXL2_REQUIRE(p.d[i].ws, "exl2_gemv (leave partials): part %d has no partials buffer", i);
    p.leave = 1;
    return EXL2_OK;
  }
  EXL2_REQUIRE(!xpre && !norm && gate_off == 0, "exl2_gemv (left partials): no pre-gathered, normed or gated input");
  EXL2_REQUIRE(p.ndesc == 1, "exl2_gemv (left partials): one part");
  for (int j = 0; j < 2; ++j) {
    EXL2_REQUIRE(a.ws[j] && reinterpret_cast<uintptr_t>(a.ws[j]) % 4 == 0, "exl2_gemv (left partials): null or "
                 "misaligned partials");
    EXL2_REQUIRE(a.k[j] >= 1 && a.k[j] <= kLeftMaxSplits, "exl2_gemv (left partials): %d splits (1..%d)", a.k[j],
                 kLeftMaxSplits);
    EXL2_REQUIRE(a.ld[j] >= p.d[0].K, "exl2_gemv (left partials): partial rows of %d < K=%d", a.ld[j], p.d[0].K);
    p.left_ws[j] = a.ws[j];
    p.left_bias[j] = a.bias[j];
    p.left_k[j] = a.k[j];
    p.left_ld[j] = a.ld[j];
  }
  return EXL2_OK;
}

constexpr int kLeftSplitStep = 2;  // splits per part loaded per round: 8 items x 2 parts x 2 = 32 loads in flight

// The values at (m[u], i[u]) of both producer parts: each part's k partials summed in split order from 0 (the
// arithmetic of gv_reduce_partials_vec4: v = 0; v += t[s] for every split, zeros past k changing nothing since v is
// never -0); the bias and the rounding are the caller's. Both parts' loads of a round go out together,
// kLeftSplitStep splits of each: one round at the 8B's two splits.
template <int kB>
__device__ __forceinline__ void left_sums(const GemvParams& p, const int (&m)[kB], const unsigned (&i)[kB],
                                          const bool (&ok)[kB], float (&v)[2][kB]) {
#pragma unroll
  for (int u = 0; u < kB; ++u) v[0][u] = v[1][u] = 0.f;
  const int k = max(p.left_k[0], p.left_k[1]);
  for (int s0 = 0; s0 < k; s0 += kLeftSplitStep) {
    float t[2][kB][kLeftSplitStep];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int u = 0; u < kB; ++u)
#pragma unroll
        for (int s = 0; s < kLeftSplitStep; ++s)
          t[j][u][s] = ok[u] && s0 + s < p.left_k[j]
                           ? __ldcg(p.left_ws[j] + ((size_t)(s0 + s) * p.M + m[u]) * p.left_ld[j] + i[u])
                           : 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int u = 0; u < kB; ++u)
#pragma unroll
        for (int s = 0; s < kLeftSplitStep; ++s) v[j][u] += t[j][u][s];
  }
}

// The split's input rows in stored order, xs[m * xstride + r] = fp16(silu_mul(g, u)) with g and u the left partials'
// sums at the row's input feature (xm[r]; padding rows 0), by `nthreads` threads from thread 0 (callers
// synchronize); items in (token, row) order as gv_gather_items, 8 in flight per thread.
__device__ __forceinline__ void gv_gather_left(const GemvParams& p, int nch, __half* xs, const unsigned short* xm,
                                               int nthreads) {
  constexpr int kB = 8;
  const int rows = nch * kChunkRows, items = rows * p.M;
  for (int e0 = threadIdx.x; e0 < items; e0 += kB * nthreads) {
    int m[kB], o[kB];
    unsigned i[kB];
    bool ok[kB];
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int e = e0 + u * nthreads;
      m[u] = e / rows;
      const int r = e - m[u] * rows;
      i[u] = e < items ? xm[r] : 0xFFFFu;
      ok[u] = i[u] != 0xFFFFu;
      if (!ok[u]) i[u] = 0;
      o[u] = m[u] * p.xstride + r;
    }
    float v[2][kB];  // gate, up
    left_sums<kB>(p, m, i, ok, v);
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      if (e0 + u * nthreads >= items) continue;
      const float bg = p.left_bias[0] && ok[u] ? __half2float(p.left_bias[0][i[u]]) : 0.f;
      const float bu = p.left_bias[1] && ok[u] ? __half2float(p.left_bias[1][i[u]]) : 0.f;
      const __half gh = __float2half_rn(v[0][u] + bg), uh = __float2half_rn(v[1][u] + bu);
      xs[o[u]] = ok[u] ? __float2half_rn(exl2::silu_mul(__half2float(gh), __half2float(uh))) : __float2half_rn(0.f);
    }
  }
}

}  // namespace exl2q
