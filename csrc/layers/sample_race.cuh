// The exponential race both samplers draw with (sampling.cu, sampling_top_k.cu; ops/reference_sampling.py):
// token = argmax p_i / max(-log(u_i), 2^-25), exp and log evaluated in double and rounded to fp32 (the build's fast
// math would otherwise take approximate intrinsics), divisions IEEE; and the block argmax that picks the winner.
#pragma once

namespace exl2 {
namespace layers {

__device__ __forceinline__ float exp_f(float x) { return (float)exp((double)x); }

// race score of probability-like weight p against uniform u: p / max(-log(u), 2^-25), p = 0 -> -1
// (u = 1 gives -log(u) = -0.0, which the clamp turns into 2^-25, as the reference's clamp_min)
__device__ __forceinline__ float race(float p, float u) {
  const float e = fmaxf(-(float)log((double)u), 0x1p-25f);
  return p > 0.f ? __fdiv_rn(p, e) : -1.f;
}

struct Cand {
  float v;
  int i;
};

// a beats b: larger value (NaN largest), then lower index (NaN rows end as -1; the order still decides within them)
__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  const bool an = isnan(a.v), bn = isnan(b.v);
  if (an != bn) return an;
  if (!an && a.v != b.v) return a.v > b.v;
  return a.i < b.i;
}

// the block's best candidate (better's order) for a block of THREADS threads; scratch holds 33 Cands
template <int THREADS>
__device__ __forceinline__ Cand block_best(Cand c, Cand* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Cand other{__shfl_xor_sync(0xffffffffu, c.v, o), __shfl_xor_sync(0xffffffffu, c.i, o)};
    if (better(other, c)) c = other;
  }
  if (lane == 0) scratch[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < THREADS / 32 ? scratch[lane] : Cand{-INFINITY, INT_MAX};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      Cand other{__shfl_xor_sync(0xffffffffu, c.v, o), __shfl_xor_sync(0xffffffffu, c.i, o)};
      if (better(other, c)) c = other;
    }
    if (lane == 0) scratch[32] = c;
  }
  __syncthreads();
  c = scratch[32];
  __syncthreads();
  return c;
}

}  // namespace layers
}  // namespace exl2
