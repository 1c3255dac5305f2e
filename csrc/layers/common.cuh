// Helpers shared by the non-GEMM layer kernels: dtype codes, float conversion, 16-byte vector loads,
// warp/block reductions. The library is built with --use_fast_math, so where a kernel must match the
// torch reference op for op it uses the explicit _rn intrinsics (no FMA contraction, IEEE division) and
// double-precision transcendentals (fast math maps sinf/expf/logf to approximate intrinsics).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/api.h"

namespace exl2 {
namespace layers {

// dtype codes of the C ABI (ops/cuda_layers.py: _DTYPE_CODES)
enum DType : int { kF16 = 0, kBF16 = 1, kF32 = 2 };

__device__ __forceinline__ float to_f(half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ half from_f<half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }

// N contiguous elements held unconverted, as 16-byte words when N > 1 (N * sizeof(T) a multiple of 16, the
// address 16-byte aligned): loads stay in flight until the first at(). Held as T[N] of 16-bit types, the compiler
// unpacks each element into its own register right after the load, and so waits for every load in turn.
template <typename T, int N, bool kWords = (N > 1)>
struct RawVec {
  static_assert(N * (int)sizeof(T) % 16 == 0, "vector must be a multiple of 16 bytes");
  uint4 w[N * (int)sizeof(T) / 16];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < N * (int)sizeof(T) / 16; ++i) w[i] = reinterpret_cast<const uint4*>(p)[i];
  }
  __device__ __forceinline__ void store(T* p) const {
#pragma unroll
    for (int i = 0; i < N * (int)sizeof(T) / 16; ++i) reinterpret_cast<uint4*>(p)[i] = w[i];
  }
  __device__ __forceinline__ float at(int i) const { return to_f(reinterpret_cast<const T*>(w)[i]); }
};
template <typename T, int N>
struct RawVec<T, N, false> {
  T v[N];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = p[i];
  }
  __device__ __forceinline__ void store(T* p) const {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = v[i];
  }
  __device__ __forceinline__ float at(int i) const { return to_f(v[i]); }
};

// N contiguous elements -> float[N]; N * sizeof(T) must be 16-byte aligned when N > 1.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* p, float* f) {
  if constexpr (N == 1) {
    f[0] = to_f(*p);
  } else {
    constexpr int BYTES = N * (int)sizeof(T);
    static_assert(BYTES % 16 == 0, "vector must be a multiple of 16 bytes");
    uint4 buf[BYTES / 16];
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) buf[i] = reinterpret_cast<const uint4*>(p)[i];
    const T* e = reinterpret_cast<const T*>(buf);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f(e[i]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const float* f) {
  if constexpr (N == 1) {
    *p = from_f<T>(f[0]);
  } else {
    constexpr int BYTES = N * (int)sizeof(T);
    static_assert(BYTES % 16 == 0, "vector must be a multiple of 16 bytes");
    uint4 buf[BYTES / 16];
    T* e = reinterpret_cast<T*>(buf);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = from_f<T>(f[i]);
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) reinterpret_cast<uint4*>(p)[i] = buf[i];
  }
}

// Round-trip through T (the value an unfused op would have stored).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f(from_f<T>(v));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `scratch` holds >= 33 floats; the call ends with the result visible and scratch free for reuse.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nwarps ? scratch[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) scratch[32] = s;
  }
  __syncthreads();
  return scratch[32];
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Dispatch a runtime dtype code to a C++ type (fp16 / bf16) for element tensors.
#define EXL2_DISPATCH_HALF(code, T, ...)                                                  \
  do {                                                                                    \
    if ((code) == exl2::layers::kF16) {                                                   \
      using T = half;                                                                     \
      __VA_ARGS__                                                                         \
    } else if ((code) == exl2::layers::kBF16) {                                           \
      using T = __nv_bfloat16;                                                            \
      __VA_ARGS__                                                                         \
    } else {                                                                              \
      return exl2::set_error(EXL2_ERR_UNSUPPORTED, "%s: unsupported dtype code %d", __func__, (int)(code)); \
    }                                                                                     \
  } while (0)

}  // namespace layers
}  // namespace exl2
