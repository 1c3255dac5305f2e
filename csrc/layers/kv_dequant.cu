// Quantized KV cache pages -> fp16 / bf16 (formats in layers/kv_quant.cuh), bit for bit
// reference_kvquant.dequantize_pages: code minus bias (or the e4m3 value) times the fp32 group scale, rotated back
// by the 32-point Walsh-Hadamard transform for the rotated formats, rounded once to the output dtype.
//
// Why: prefill chunks over a quantized history (ops/attention_prefill_quant.py) dequantize the key blocks they
// read. In torch ops that is ~20 passes over fp32 temporaries per block; at 32k context every chunk re-reads the
// whole history (H200 call K3 of 2026-12-02: 8B prefill of 32k tokens 14,631 tok/s over fp16 pages, 6,341 over q8).
//
// Grid: one warp per 32-element group of one (page, slot, kv head) row, one element per lane; 8 warps per CTA.
#include "layers/kv_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kDequantWarps = 8;

struct DequantArgs {
  const uint8_t* codes;  // [P, S, Hkv, D * bits / 8]
  const half* scales;    // [P, S, Hkv, D / 32]
  const int64_t* pages;  // [U]
  int64_t num_pages, rows_per_page;  // P, S * Hkv
  int64_t groups;                    // U * S * Hkv * D / 32
  int ngroups;                       // D / 32
  void* out;                         // [U, S, Hkv, D]
};

template <int F>
__device__ __forceinline__ float decode_element(const uint8_t* row, int e) {
  if constexpr (F == kFmtI4) {
    const uint32_t byte = row[e >> 1];
    return (float)((e & 1) ? byte >> 4 : byte & 15u) - 8.f;
  } else if constexpr (F == kFmtI8) {
    return (float)row[e] - 128.f;
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)row[e], __NV_E4M3);
    return __half2float(__half(h));
  }
}

template <int F, typename T>
__global__ void __launch_bounds__(kDequantWarps * 32) kv_dequant_kernel(const DequantArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t unit = (int64_t)blockIdx.x * kDequantWarps + (threadIdx.x >> 5);  // (page i, row in page, group)
  if (unit >= a.groups) return;  // warp-uniform
  const int g = (int)(unit % a.ngroups);
  const int64_t row = unit / a.ngroups;  // row of the output [U * S * Hkv]
  const int64_t i = row / a.rows_per_page, r = row % a.rows_per_page;
  int64_t pg = a.pages[i];
  pg = pg < 0 ? 0 : (pg >= a.num_pages ? a.num_pages - 1 : pg);  // never fault on a bad index
  const int64_t src = pg * a.rows_per_page + r;  // row of the cache
  const int row_bytes = a.ngroups * KV_GROUP * KVFormat<F>::BITS / 8;
  const uint8_t* codes = a.codes + src * row_bytes + g * KV_GROUP * KVFormat<F>::BITS / 8;
  const float s = __half2float(a.scales[src * a.ngroups + g]);
  float x = __fmul_rn(decode_element<F>(codes, lane), s);
  if constexpr (KVFormat<F>::ROT) x = warp_fwht32(x);
  reinterpret_cast<T*>(a.out)[row * a.ngroups * KV_GROUP + g * KV_GROUP + lane] = from_f<T>(x);
}

template <int F>
int launch_fmt(const DequantArgs& a, int dtype, cudaStream_t stream) {
  const unsigned blocks = (unsigned)((a.groups + kDequantWarps - 1) / kDequantWarps);
  EXL2_DISPATCH_HALF(dtype, T, { kv_dequant_kernel<F, T><<<blocks, kDequantWarps * 32, 0, stream>>>(a); });
  return check_launch("kv_dequant_pages");
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// codes uint8 [P, S, Hkv, D * bits / 8] and scales fp16 [P, S, Hkv, D / 32], contiguous; fmt 1 e4m3, 2 int8, 3 int4;
// pages int64 [U] (clamped into [0, P)); out [U, S, Hkv, D] contiguous, dtype 0 fp16 / 1 bf16.
EXL2_API int exl2_kv_dequant_pages(const void* codes, const void* scales, int fmt, const int64_t* pages, int64_t U,
                                   int64_t P, int64_t S, int64_t Hkv, int64_t D, void* out, int dtype,
                                   cudaStream_t stream) {
  using namespace exl2::layers;
  EXL2_REQUIRE(kv_fmt_valid(fmt), "kv_dequant_pages: bad format %d", fmt);
  EXL2_REQUIRE(D > 0 && D % KV_GROUP == 0, "kv_dequant_pages: head_dim %lld not a multiple of 32", (long long)D);
  EXL2_REQUIRE(U >= 0 && P > 0 && S > 0 && Hkv > 0, "kv_dequant_pages: bad shape");
  const int64_t groups = U * S * Hkv * (D / KV_GROUP);
  if (groups == 0) return EXL2_OK;
  EXL2_REQUIRE((groups + kDequantWarps - 1) / kDequantWarps < (1ll << 31), "kv_dequant_pages: too many pages");
  DequantArgs a;
  a.codes = (const uint8_t*)codes;
  a.scales = (const half*)scales;
  a.pages = pages;
  a.num_pages = P;
  a.rows_per_page = S * Hkv;
  a.groups = groups;
  a.ngroups = (int)(D / KV_GROUP);
  a.out = out;
  if (fmt == kFmtI8) return launch_fmt<kFmtI8>(a, dtype, stream);
  if (fmt == kFmtI4) return launch_fmt<kFmtI4>(a, dtype, stream);
  return launch_fmt<kFmtE4M3>(a, dtype, stream);
}
