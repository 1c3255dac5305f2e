// Quantize-on-write of the KV cache (formats in layers/kv_quant.cuh), optionally fused with RoPE: q rotated in
// place, k rotated and rounded to the activation dtype (bit for bit the rope_kernel of rope.cu), then k and v
// quantized into the code/scale caches at slots[t]. Codes and scales equal reference_kvquant.quantize exactly.
//
// Grid (T, Y): CTA (t, y) handles token t. Each of its 4 warps quantizes one 32-element group ("unit") of k or v
// (units 0 .. 2 * Hk * D/32 - 1, K first), one element per lane, so a decode step spreads its few units over
// many CTAs instead of looping in one. The q heads are spread over the Y CTAs of a token.
#include <math.h>

#include "common/pdl.cuh"
#include "layers/kv_quant.cuh"
#include "layers/rope_math.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int QW = 4;  // warps per CTA, one unit each

struct KVQuantArgs {
  void* q;  // [T, Hq, D] rotated in place (rope only)
  int64_t q_ts, q_hs;
  int hq;
  const void* k;  // [T, Hk, D]
  int64_t k_ts, k_hs;
  const void* v;
  int64_t v_ts, v_hs;
  int hk, D;
  uint8_t* kc;  // [num_slots, Hk, D * kbits / 8]
  half* ks;     // [num_slots, Hk, D / 32]
  uint8_t* vc;
  half* vs;
  const int64_t* slots;
  int64_t num_slots;
  const int64_t* positions;  // [T]; null: no rope
  const float* inv_freq;     // [D / 2]
};

// Quantize the group this warp holds (x = element `lane`) into codes (the row's code bytes) and scale.
template <int F>
__device__ __forceinline__ void quantize_group(float x, uint8_t* codes, half* scale, int lane) {
  using Fmt = KVFormat<F>;
  if constexpr (Fmt::ROT) x = warp_fwht32(x);
  const float amax = warp_max(fabsf(x));
  half s16 = __float2half_rn(fminf(__fdiv_rn(amax, Fmt::div(0)), 65504.f));
  if constexpr (F == kFmtE4M3) {
    const float s = __half2float(s16);
    uint8_t code = 0;
    if (s != 0.f) code = __nv_cvt_float_to_fp8(fminf(fmaxf(__fdiv_rn(x, s), -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
    codes[lane] = code;
  } else {
    // candidate scales in order; a later one must beat the best squared error strictly (warp_sum's xor order is
    // the reference's halving sum, and every step is a single rounded op, so the choice is reproducible)
    float c = 0.f, best = 0.f;
#pragma unroll
    for (int i = 0; i < Fmt::NDIV; ++i) {
      const half t16 = i == 0 ? s16 : __float2half_rn(fminf(__fdiv_rn(amax, Fmt::div(i)), 65504.f));
      const float s = __half2float(t16);
      const float ci = s != 0.f ? fminf(fmaxf(rintf(__fdiv_rn(x, s)), -Fmt::QMAX - 1.f), Fmt::QMAX) : 0.f;
      if constexpr (Fmt::NDIV > 1) {
        const float d = __fsub_rn(x, __fmul_rn(ci, s));
        const float err = warp_sum(__fmul_rn(d, d));
        if (i == 0 || err < best) {
          best = err;
          c = ci;
          s16 = t16;
        }
      } else {
        c = ci;
      }
    }
    const int code = (int)c + (int)Fmt::QMAX + 1;
    if constexpr (F == kFmtI8) {
      codes[lane] = (uint8_t)code;
    } else {
      const int hi = __shfl_down_sync(0xffffffffu, code, 1);
      if ((lane & 1) == 0) codes[lane >> 1] = (uint8_t)(code | (hi << 4));
    }
  }
  if (lane == 0) *scale = s16;
}

template <typename T, int KF, int VF>
__global__ void __launch_bounds__(QW * 32) kv_quant_kernel(const KVQuantArgs a) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  extern __shared__ float cs[];  // cos [D/2], sin [D/2] (rope only)
  const int64_t t = blockIdx.x;
  const int y = blockIdx.y, Y = gridDim.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int D = a.D, half_d = D / 2;
  const bool rope = a.positions != nullptr;
  // Every load that does not need the cos/sin table is issued before it is built, and each round's q loads before
  // its stores: written load-then-store, the compiler kept every later load (the slot, k, v, the next q pair)
  // behind the q stores they may alias, one dependent round trip each on every layer's critical path.
  const int64_t slot = a.slots[t];
  const float pos = rope ? (float)a.positions[t] : 0.f;  // int64 -> fp32, round to nearest like torch's .float()
  const int ng = D / KV_GROUP;
  const int unit = y * QW + warp;
  const bool store = slot >= 0 && slot < a.num_slots && unit < 2 * a.hk * ng;  // padding token: nothing stored
  const bool is_k = unit < a.hk * ng;
  const int rem = is_k ? unit : unit - a.hk * ng;
  const int h = rem / ng, g = rem % ng;
  const int d = g * KV_GROUP + lane;
  const int pi = d < half_d ? d : d - half_d;  // the rotation pair of element d
  T e1 = from_f<T>(0.f), e2 = from_f<T>(0.f);  // k: the pair (rope) or the element; v: the element
  if (store) {
    if (is_k) {
      const T* kh = (const T*)a.k + t * a.k_ts + (int64_t)h * a.k_hs;
      e1 = rope ? kh[pi] : kh[d];
      if (rope) e2 = kh[pi + half_d];
    } else {
      e1 = ((const T*)a.v + t * a.v_ts + (int64_t)h * a.v_hs)[d];
    }
  }
  if (rope) {
    // q in place, pairs (i, i + D/2) of this block's heads y, y + Y, ...: kR per thread per round
    constexpr int kR = 4;
    const int nq = a.hq > y ? (a.hq - y + Y - 1) / Y : 0;
    const int items = nq * half_d, step = kR * (int)blockDim.x;
    for (int base = 0; base == 0 || base < items; base += step) {  // round 0 also builds the table
      T x1[kR], x2[kR];
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        const int e = base + j * blockDim.x + tid;
        if (e < items) {
          const int hq = y + (e / half_d) * Y, i = e % half_d;
          const T* qh = (const T*)a.q + t * a.q_ts + (int64_t)hq * a.q_hs;
          x1[j] = qh[i];
          x2[j] = qh[i + half_d];
        }
      }
      if (base == 0) {
        rope_table(pos, a.inv_freq, half_d, cs);
        __syncthreads();
      }
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        const int e = base + j * blockDim.x + tid;
        if (e < items) {
          const int hq = y + (e / half_d) * Y, i = e % half_d;
          T* qh = (T*)a.q + t * a.q_ts + (int64_t)hq * a.q_hs;
          const float f1 = to_f(x1[j]), f2 = to_f(x2[j]), co = cs[i], si = cs[half_d + i];
          qh[i] = from_f<T>(rope_first(f1, f2, co, si));
          qh[i + half_d] = from_f<T>(rope_second(f1, f2, co, si));
        }
      }
    }
  }
  if (!store) return;
  const int64_t row = slot * a.hk + h;
  if (is_k) {
    float x;
    if (rope) {  // the rotation of rope_kernel, rounded to T as the unfused op stores it
      const float x1 = to_f(e1), x2 = to_f(e2), co = cs[pi], si = cs[half_d + pi];
      x = round_to<T>(d < half_d ? rope_first(x1, x2, co, si) : rope_second(x1, x2, co, si));
    } else {
      x = to_f(e1);
    }
    quantize_group<KF>(x, a.kc + row * (D * KVFormat<KF>::BITS / 8) + g * (KV_GROUP * KVFormat<KF>::BITS / 8),
                       a.ks + row * ng + g, lane);
  } else {
    quantize_group<VF>(to_f(e1), a.vc + row * (D * KVFormat<VF>::BITS / 8) + g * (KV_GROUP * KVFormat<VF>::BITS / 8),
                       a.vs + row * ng + g, lane);
  }
}

template <typename T, int KF, int VF>
void launch(const KVQuantArgs& a, int64_t tokens, cudaStream_t stream) {
  const int units = 2 * a.hk * (a.D / KV_GROUP);
  const int y = (units + QW - 1) / QW;
  const size_t smem = a.positions != nullptr ? sizeof(float) * a.D : 0;
  exl2::launch_kernel(kv_quant_kernel<T, KF, VF>, dim3((unsigned)tokens, (unsigned)y), QW * 32, smem, stream, a);
}

template <typename T>
int launch_fmt(const KVQuantArgs& a, int64_t tokens, int kf, int vf, cudaStream_t stream) {
  if (kf == kFmtE4M3 && vf == kFmtE4M3) launch<T, kFmtE4M3, kFmtE4M3>(a, tokens, stream);
  else if (kf == kFmtI8 && vf == kFmtI8) launch<T, kFmtI8, kFmtI8>(a, tokens, stream);
  else if (kf == kFmtI8 && vf == kFmtI4) launch<T, kFmtI8, kFmtI4>(a, tokens, stream);
  else if (kf == kFmtI4 && vf == kFmtI4) launch<T, kFmtI4, kFmtI4>(a, tokens, stream);
  else return set_error(EXL2_ERR_UNSUPPORTED, "kv_quant_write: format pair (%d, %d) not built", kf, vf);
  return check_launch("kv_quant_write");
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// k, v [T, Hk, D] (strides in elements, last dim contiguous) quantized into k_codes / v_codes uint8
// [num_slots, Hk, D * bits / 8] and k_scales / v_scales fp16 [num_slots, Hk, D / 32] at slots [T] int64 (< 0 or
// past the cache: skipped). With positions [T] int64 and inv_freq [D/2] fp32 given, q [T, Hq, D] is rotated in
// place (RoPE) and k is rotated before quantizing; positions null: a plain quantized write (q unused, hq 0).
// Formats: 1 e4m3, 2 int8, 3 int4 (pairs e4m3/e4m3, int8/int8, int8/int4, int4/int4). dtype: 0 fp16, 1 bf16.
EXL2_API int exl2_kv_quant_write(void* q, int64_t q_ts, int64_t q_hs, int64_t hq, const void* k, int64_t k_ts,
                                 int64_t k_hs, const void* v, int64_t v_ts, int64_t v_hs, int64_t hk, void* k_codes,
                                 void* k_scales, void* v_codes, void* v_scales, const int64_t* slots, int64_t num_slots,
                                 const int64_t* positions, const float* inv_freq, int64_t tokens, int64_t head_dim,
                                 int k_fmt, int v_fmt, int dtype, cudaStream_t stream) {
  using namespace exl2::layers;
  EXL2_REQUIRE(head_dim > 0 && head_dim % KV_GROUP == 0 && head_dim <= 1024,
               "kv_quant_write: head_dim %lld must be a multiple of 32, <= 1024", (long long)head_dim);
  EXL2_REQUIRE(tokens >= 0 && tokens < (1ll << 31) && hq >= 0 && hk > 0 && hk < 4096 && num_slots > 0,
               "kv_quant_write: bad shape");
  EXL2_REQUIRE(kv_fmt_valid(k_fmt) && kv_fmt_valid(v_fmt), "kv_quant_write: bad formats %d, %d", k_fmt, v_fmt);
  EXL2_REQUIRE(k != nullptr && v != nullptr && k_codes != nullptr && k_scales != nullptr && v_codes != nullptr &&
                   v_scales != nullptr && slots != nullptr,
               "kv_quant_write: null pointer");
  EXL2_REQUIRE(positions == nullptr || (inv_freq != nullptr && (hq == 0 || q != nullptr)),
               "kv_quant_write: rope needs inv_freq (and q when hq > 0)");
  if (tokens == 0) return EXL2_OK;
  KVQuantArgs a;
  a.q = q;
  a.q_ts = q_ts;
  a.q_hs = q_hs;
  a.hq = positions != nullptr ? (int)hq : 0;
  a.k = k;
  a.k_ts = k_ts;
  a.k_hs = k_hs;
  a.v = v;
  a.v_ts = v_ts;
  a.v_hs = v_hs;
  a.hk = (int)hk;
  a.D = (int)head_dim;
  a.kc = (uint8_t*)k_codes;
  a.ks = (half*)k_scales;
  a.vc = (uint8_t*)v_codes;
  a.vs = (half*)v_scales;
  a.slots = slots;
  a.num_slots = num_slots;
  a.positions = positions;
  a.inv_freq = inv_freq;
  EXL2_DISPATCH_HALF(dtype, T, { return launch_fmt<T>(a, tokens, k_fmt, v_fmt, stream); });
  return EXL2_OK;
}
