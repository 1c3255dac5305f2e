// silu_mul, embedding, kv_cache_write: memory-bound elementwise / gather / scatter kernels with 16-byte
// accesses where the rows are aligned.
#include "common/activation.cuh"
#include "common/pdl.cuh"
#include "layers/common.cuh"

namespace exl2 {
namespace layers {
namespace {

// gate, up [T, I] (row strides gs, us) -> out [T, I] (row stride os). grid (T, chunks of I).
template <typename T, int VEC>
__global__ void silu_mul_kernel(const T* __restrict__ gate, int64_t gs, const T* __restrict__ up, int64_t us,
                                T* __restrict__ out, int64_t os, int I) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  const int64_t row = blockIdx.x;
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (c >= I) return;
  float g[VEC], u[VEC];
  load_vec<VEC>(gate + row * gs + c, g);
  load_vec<VEC>(up + row * us + c, u);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    g[k] = exl2::silu_mul(g[k], u[k]);
  }
  store_vec<VEC>(out + row * os + c, g);
}

// ids [T] int64, table [V, H] -> out [T, H]. An id outside [0, V) yields a zero row (no host sync to raise).
template <typename T, int VEC>
__global__ void embedding_kernel(const int64_t* __restrict__ ids, const T* __restrict__ table, T* __restrict__ out,
                                 int64_t V, int H) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  const bool ok = id >= 0 && id < V;
  for (int c = threadIdx.x * VEC; c < H; c += blockDim.x * VEC) {
    float f[VEC];
    if (ok) {
      load_vec<VEC>(table + id * H + c, f);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) f[k] = 0.f;
    }
    store_vec<VEC>(out + t * H + c, f);
  }
}

// k, v [T, Hkv, D] (token/head strides) -> caches [P * S, Hkv, D] at rows slots[t]; slots < 0 or past the
// cache are skipped. Pure copy (no float round trip): 16-byte words or 2-byte elements.
template <typename W>
__global__ void kv_cache_write_kernel(const W* __restrict__ k, int64_t kts, int64_t khs, const W* __restrict__ v,
                                      int64_t vts, int64_t vhs, W* __restrict__ kc, W* __restrict__ vc,
                                      const int64_t* __restrict__ slots, int64_t num_slots, int hkv, int dw) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0 || slot >= num_slots) return;
  const int per = hkv * dw;  // words per token per tensor
  for (int w = threadIdx.x; w < 2 * per; w += blockDim.x) {
    const bool is_v = w >= per;
    const int r = is_v ? w - per : w;
    const int h = r / dw, d = r - h * dw;
    const W val = is_v ? v[t * vts + h * vhs + d] : k[t * kts + h * khs + d];
    (is_v ? vc : kc)[slot * per + r] = val;
  }
}

}  // namespace
}  // namespace layers
}  // namespace exl2

using namespace exl2::layers;

EXL2_API int exl2_silu_mul(const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
                           int64_t out_stride, int64_t rows, int64_t inter, int dtype, cudaStream_t stream) {
  EXL2_REQUIRE(rows >= 0 && rows < (1ll << 31) && inter >= 0 && inter < (1ll << 24), "silu_mul: bad shape");
  if (rows == 0 || inter == 0) return EXL2_OK;
  const bool vec = inter % 8 == 0 && gate_stride % 8 == 0 && up_stride % 8 == 0 && out_stride % 8 == 0 &&
                   aligned16(gate) && aligned16(up) && aligned16(out);
  const int threads = 256, per = vec ? 8 : 1;
  const dim3 grid((unsigned)rows, (unsigned)((inter + threads * per - 1) / (threads * per)));
  EXL2_DISPATCH_HALF(dtype, T, {
    if (vec)
      exl2::launch_kernel(silu_mul_kernel<T, 8>, grid, threads, 0, stream, (const T*)gate, gate_stride, (const T*)up, up_stride,
                                                          (T*)out, out_stride, (int)inter);
    else
      exl2::launch_kernel(silu_mul_kernel<T, 1>, grid, threads, 0, stream, (const T*)gate, gate_stride, (const T*)up, up_stride,
                                                          (T*)out, out_stride, (int)inter);
  });
  return exl2::check_launch("silu_mul");
}

EXL2_API int exl2_embedding(const int64_t* ids, const void* table, void* out, int64_t tokens, int64_t vocab,
                            int64_t hidden, int dtype, cudaStream_t stream) {
  EXL2_REQUIRE(tokens >= 0 && tokens < (1ll << 31) && vocab > 0 && hidden > 0 && hidden < (1ll << 30),
               "embedding: bad shape");
  if (tokens == 0) return EXL2_OK;
  const bool vec = hidden % 8 == 0 && aligned16(table) && aligned16(out);
  const int64_t nvec = vec ? hidden / 8 : hidden;
  const int threads = nvec >= 256 ? 256 : (int)((nvec + 31) / 32 * 32);
  EXL2_DISPATCH_HALF(dtype, T, {
    if (vec)
      exl2::launch_kernel(embedding_kernel<T, 8>, (unsigned)tokens, threads, 0, stream, ids, (const T*)table, (T*)out, vocab,
                                                                       (int)hidden);
    else
      exl2::launch_kernel(embedding_kernel<T, 1>, (unsigned)tokens, threads, 0, stream, ids, (const T*)table, (T*)out, vocab,
                                                                       (int)hidden);
  });
  return exl2::check_launch("embedding");
}

// k/v strides in elements (2-byte types); caches contiguous [P, S, Hkv, D].
EXL2_API int exl2_kv_cache_write(const void* k, int64_t k_ts, int64_t k_hs, const void* v, int64_t v_ts, int64_t v_hs,
                                 void* k_cache, void* v_cache, const int64_t* slots, int64_t tokens,
                                 int64_t num_slots, int64_t hkv, int64_t head_dim, int elem_bytes,
                                 cudaStream_t stream) {
  EXL2_REQUIRE(tokens >= 0 && tokens < (1ll << 31) && hkv > 0 && head_dim > 0 && hkv * head_dim < (1 << 24),
               "kv_cache_write: bad shape");
  EXL2_REQUIRE(elem_bytes == 2, "kv_cache_write: only 2-byte cache elements are supported (got %d)", elem_bytes);
  if (tokens == 0) return EXL2_OK;
  const bool vec = head_dim % 8 == 0 && k_ts % 8 == 0 && k_hs % 8 == 0 && v_ts % 8 == 0 && v_hs % 8 == 0 &&
                   aligned16(k) && aligned16(v) && aligned16(k_cache) && aligned16(v_cache);
  const int threads = 128;
  if (vec) {
    exl2::launch_kernel(kv_cache_write_kernel<uint4>, (unsigned)tokens, threads, 0, stream, 
        (const uint4*)k, k_ts / 8, k_hs / 8, (const uint4*)v, v_ts / 8, v_hs / 8, (uint4*)k_cache, (uint4*)v_cache,
        slots, num_slots, (int)hkv, (int)(head_dim / 8));
  } else {
    exl2::launch_kernel(kv_cache_write_kernel<uint16_t>, (unsigned)tokens, threads, 0, stream, 
        (const uint16_t*)k, k_ts, k_hs, (const uint16_t*)v, v_ts, v_hs, (uint16_t*)k_cache, (uint16_t*)v_cache,
        slots, num_slots, (int)hkv, (int)head_dim);
  }
  return exl2::check_launch("kv_cache_write");
}
