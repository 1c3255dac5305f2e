// Quantized KV cache formats shared by the quantize-on-write kernel (kv_quant.cu) and the attention kernel over
// quantized pages (paged_attention_quant.cu). The arithmetic is defined by exl2_backend/ops/reference_kvquant.py:
// per group of 32 elements of a (token, kv head) row, integer formats rotate by the orthonormal 32-point
// Walsh-Hadamard transform, then scale = fp16(absmax / qmax) and code = clamp(rint(y / scale)) + bias;
// e4m3 stores the e4m3fn code of y / scale without a rotation. Scales: fp16 [slots, Hkv, D / 32].
#pragma once

#include <cuda_fp8.h>

#include "layers/common.cuh"

namespace exl2 {
namespace layers {

// Format codes of the C ABI (exl2_backend/cache/kv_types.py KVFormat.abi). kFmtF16 is internal: fp16 pages
// (no scales) read by the tensor-core attention kernel for paged_attention.cu.
enum KVFmt : int { kFmtF16 = 0, kFmtE4M3 = 1, kFmtI8 = 2, kFmtI4 = 3 };

constexpr int KV_GROUP = 32;
constexpr float KV_INV_SQRT_GROUP = 0.17677669529663688f;  // 1 / sqrt(32) rounded to fp32, as the reference

template <int F>
struct KVFormat;
// QMAX: largest code magnitude; NDIV / div(i): candidate divisors of the group absmax (scale = absmax / div),
// the one with the smallest squared group error wins (kv_types.py KVFormat.divisors).
template <>
struct KVFormat<kFmtF16> {
  static constexpr int BITS = 16;
  static constexpr bool ROT = false;
};
template <>
struct KVFormat<kFmtE4M3> {
  static constexpr int BITS = 8;
  static constexpr bool ROT = false;
  static constexpr float QMAX = 448.f;
  static constexpr int NDIV = 1;
  __device__ static constexpr float div(int) { return 448.f; }
};
template <>
struct KVFormat<kFmtI8> {
  static constexpr int BITS = 8;
  static constexpr bool ROT = true;
  static constexpr float QMAX = 127.f;
  static constexpr int NDIV = 1;
  __device__ static constexpr float div(int) { return 127.f; }
};
template <>
struct KVFormat<kFmtI4> {
  static constexpr int BITS = 4;
  static constexpr bool ROT = true;
  static constexpr float QMAX = 7.f;
  static constexpr int NDIV = 6;
  __device__ static constexpr float div(int i) {
    return i == 0 ? 7.f : i == 1 ? 7.5f : i == 2 ? 8.f : i == 3 ? 8.5f : i == 4 ? 9.f : 10.f;
  }
};

inline bool kv_fmt_valid(int f) { return f == kFmtE4M3 || f == kFmtI8 || f == kFmtI4; }
inline int kv_fmt_bits(int f) { return f == kFmtI4 ? 4 : 8; }

// In-warp orthonormal WHT of 32 values, one per lane (lane i holds element i of the group): the reference's
// butterfly (a, b) -> (a + b, a - b) at strides 1..16, each add rounded once, then the 1/sqrt(32) multiply.
__device__ __forceinline__ float warp_fwht32(float x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, x, h);
    x = (lane & h) ? __fsub_rn(other, x) : __fadd_rn(x, other);
  }
  return __fmul_rn(x, KV_INV_SQRT_GROUP);
}

// --- decoding packed codes into floats (attention read path) --------------------------------------------------
// A lane holds E consecutive elements of one row: E * BITS / 8 bytes, loaded as NB / 4 32-bit words. Integer
// codes decode to the centred value c - bias (exact small integers); e4m3 codes to their value. The group scale
// is applied by the caller (factored out of the dot products).

template <int NB>
struct KVRaw {
  uint32_t w[NB / 4];
};

template <int NB>
__device__ __forceinline__ KVRaw<NB> kv_load(const uint8_t* p) {
  KVRaw<NB> r;
  if constexpr (NB == 16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    r.w[0] = u.x, r.w[1] = u.y, r.w[2] = u.z, r.w[3] = u.w;
  } else if constexpr (NB == 8) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    r.w[0] = u.x, r.w[1] = u.y;
  } else {
    static_assert(NB == 4, "lane loads are 4, 8 or 16 bytes");
    r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  }
  return r;
}

template <int NB>
__device__ __forceinline__ KVRaw<NB> kv_zero() {
  KVRaw<NB> r;
#pragma unroll
  for (int i = 0; i < NB / 4; ++i) r.w[i] = 0u;
  return r;
}

// byte b (0..255) -> float(b) - bias without an int->float conversion: 0x4B0000bb is the float 2^23 + b.
__device__ __forceinline__ float byte_to_f(uint32_t word, int i, float bias_plus_2p23) {
  return __uint_as_float(__byte_perm(word, 0x4B00u, 0x5440u | (unsigned)i)) - bias_plus_2p23;
}

template <int F, int E>
__device__ __forceinline__ void kv_decode(const KVRaw<E * KVFormat<F>::BITS / 8>& r, float* f) {
  if constexpr (F == kFmtI8) {
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = byte_to_f(r.w[i / 4], i % 4, 8388736.f);  // 2^23 + 128
  } else if constexpr (F == kFmtI4) {
#pragma unroll
    for (int j = 0; j < E / 8; ++j) {  // a word holds 8 elements: nibble 2m -> byte m of lo, 2m + 1 -> of hi
      const uint32_t lo = r.w[j] & 0x0F0F0F0Fu, hi = (r.w[j] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        f[8 * j + 2 * m] = byte_to_f(lo, m, 8388616.f);  // 2^23 + 8
        f[8 * j + 2 * m + 1] = byte_to_f(hi, m, 8388616.f);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)((r.w[i / 2] >> (16 * (i % 2))) & 0xFFFFu);
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
}

}  // namespace layers
}  // namespace exl2
