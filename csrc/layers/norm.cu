// rms_norm and add_rms_norm (residual add fused): one CTA per row, fp32 accumulation, the row kept in
// registers between the sum-of-squares pass and the scaling pass (re-read only past MAXV vectors per thread).
// Same arithmetic as reference.rms_norm: y = (x * rsqrt(mean(x^2) + eps)) * w, rounded once.
#include "common/pdl.cuh"
#include "layers/common.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int MAXV = 4;  // vectors per thread cached in registers

// x, res [T, H] (row strides), w [H]; out [T, H]; res_out [T, H] = round(x + res) when res != nullptr.
// Pointers may alias (in place): every element is read and written by the same thread, reads first.
constexpr int kMaxThreads = 512;  // every load in flight takes up to 80 registers (fp32 weights)

template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const W* w,
                                T* out, int64_t out_stride, T* res_out, int64_t res_out_stride, int H, float eps) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  __shared__ float scratch[33];
  const int64_t row = blockIdx.x;
  x += row * x_stride;
  out += row * out_stride;
  if (res != nullptr) {
    res += row * res_stride;
    res_out += row * res_out_stride;
  }
  const int nvec = H / VEC, tid = threadIdx.x, nt = blockDim.x;

  // All of the thread's loads first, then the arithmetic and the stores: written load-then-store per vector,
  // the compiler kept each load behind the previous vector's res_out store (they may alias), one dependent round
  // trip per load on the critical path of a launch (H200 call N4: the same pattern in the fused norm).
  float v[MAXV][VEC];
  RawVec<T, VEC> xr[MAXV], r[MAXV];  // unconverted until every load is issued
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int c = tid + i * nt;
    if (c < nvec) {
      xr[i].load(x + c * VEC);
      if (res != nullptr) r[i].load(res + c * VEC);
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int c = tid + i * nt;
    if (c < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] = xr[i].at(k);
      if (res != nullptr) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[i][k] = round_to<T>(__fadd_rn(v[i][k], r[i].at(k)));
        store_vec<VEC>(res_out + c * VEC, v[i]);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss = __fmaf_rn(v[i][k], v[i][k], ss);
    }
  }
  for (int c = tid + MAXV * nt; c < nvec; c += nt) {  // rows longer than MAXV * blockDim vectors
    float t[VEC];
    load_vec<VEC>(x + c * VEC, t);
    if (res != nullptr) {
      float r[VEC];
      load_vec<VEC>(res + c * VEC, r);
#pragma unroll
      for (int k = 0; k < VEC; ++k) t[k] = round_to<T>(__fadd_rn(t[k], r[k]));
      store_vec<VEC>(res_out + c * VEC, t);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) ss = __fmaf_rn(t[k], t[k], ss);
  }

  const float total = block_sum(ss, scratch);
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(total, (float)H), eps));

  RawVec<W, VEC> wr[MAXV];  // the weights, all in flight before the first use
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int c = tid + i * nt;
    if (c < nvec) wr[i].load(w + c * VEC);
  }
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int c = tid + i * nt;
    if (c < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] = __fmul_rn(__fmul_rn(v[i][k], inv), wr[i].at(k));
      store_vec<VEC>(out + c * VEC, v[i]);
    }
  }
  for (int c = tid + MAXV * nt; c < nvec; c += nt) {
    float t[VEC], wf[VEC];
    load_vec<VEC>(res != nullptr ? res_out + c * VEC : x + c * VEC, t);  // this thread wrote res_out[c]
    load_vec<VEC>(w + c * VEC, wf);
#pragma unroll
    for (int k = 0; k < VEC; ++k) t[k] = __fmul_rn(__fmul_rn(t[k], inv), wf[k]);
    store_vec<VEC>(out + c * VEC, t);
  }
}

template <typename T, typename W>
int launch(const void* x, int64_t xs, const void* res, int64_t rs, const void* w, void* out, int64_t os,
           void* res_out, int64_t ros, int64_t rows, int64_t H, float eps, cudaStream_t stream) {
  // 16-byte vectors when every row start is aligned; odd hidden sizes take the scalar path
  const bool vec = H % 8 == 0 && xs % 8 == 0 && os % 8 == 0 && aligned16(x) && aligned16(out) && aligned16(w) &&
                   (res == nullptr || (rs % 8 == 0 && ros % 8 == 0 && aligned16(res) && aligned16(res_out)));
  const int64_t nvec = vec ? H / 8 : H;
  int threads = (int)((nvec + MAXV - 1) / MAXV);
  threads = threads < 32 ? 32 : (threads > kMaxThreads ? kMaxThreads : (threads + 31) / 32 * 32);
  const dim3 grid((unsigned)rows);
  if (vec) {
    exl2::launch_kernel(rms_norm_kernel<T, W, 8>, grid, threads, 0, stream, 
        (const T*)x, xs, (const T*)res, rs, (const W*)w, (T*)out, os, (T*)res_out, ros, (int)H, eps);
  } else {
    exl2::launch_kernel(rms_norm_kernel<T, W, 1>, grid, threads, 0, stream, 
        (const T*)x, xs, (const T*)res, rs, (const W*)w, (T*)out, os, (T*)res_out, ros, (int)H, eps);
  }
  return check_launch("rms_norm");
}

int rms_norm_impl(const void* x, int64_t xs, const void* res, int64_t rs, const void* w, void* out, int64_t os,
                  void* res_out, int64_t ros, int64_t rows, int64_t H, float eps, int dtype, int wdtype,
                  cudaStream_t stream) {
  EXL2_REQUIRE(rows >= 0 && H > 0 && H < (1 << 30), "rms_norm: bad shape [%lld, %lld]", (long long)rows,
               (long long)H);
  EXL2_REQUIRE(rows < (1ll << 31), "rms_norm: too many rows (%lld)", (long long)rows);
  EXL2_REQUIRE(wdtype == dtype || wdtype == kF32, "rms_norm: weight dtype %d must match x (%d) or be fp32",
               wdtype, dtype);
  if (rows == 0) return EXL2_OK;
  EXL2_DISPATCH_HALF(dtype, T, {
    if (wdtype == kF32) return launch<T, float>(x, xs, res, rs, w, out, os, res_out, ros, rows, H, eps, stream);
    return launch<T, T>(x, xs, res, rs, w, out, os, res_out, ros, rows, H, eps, stream);
  });
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// x [T, H] (row stride x_stride), weight [H] -> out [T, H] (row stride out_stride). out may equal x.
EXL2_API int exl2_rms_norm(const void* x, int64_t x_stride, const void* weight, void* out, int64_t out_stride,
                           int64_t rows, int64_t hidden, float eps, int dtype, int weight_dtype, cudaStream_t stream) {
  return exl2::layers::rms_norm_impl(x, x_stride, nullptr, 0, weight, out, out_stride, nullptr, 0, rows, hidden, eps,
                                     dtype, weight_dtype, stream);
}

// res_out = x + residual (rounded to dtype), out = rms_norm(res_out). res_out may equal residual or x.
EXL2_API int exl2_add_rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t res_stride,
                               const void* weight, void* out, int64_t out_stride, void* res_out,
                               int64_t res_out_stride, int64_t rows, int64_t hidden, float eps, int dtype,
                               int weight_dtype, cudaStream_t stream) {
  EXL2_REQUIRE(residual != nullptr && res_out != nullptr, "add_rms_norm: residual and res_out are required");
  return exl2::layers::rms_norm_impl(x, x_stride, residual, res_stride, weight, out, out_stride, res_out,
                                     res_out_stride, rows, hidden, eps, dtype, weight_dtype, stream);
}
