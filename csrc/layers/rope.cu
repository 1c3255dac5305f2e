// apply_rope: NeoX half rotation of q and k (optional) in one launch, in place or out of place, on strided
// [T, H, D] views (last dim contiguous), e.g. q/k slices of a fused QKV output. One CTA per token.
// The table and the rotation: layers/rope_math.cuh.
#include "common/pdl.cuh"
#include "layers/common.cuh"
#include "layers/rope_math.cuh"

namespace exl2 {
namespace layers {
namespace {

struct RopeTensor {
  const void* in;
  void* out;
  int64_t in_ts, in_hs, out_ts, out_hs;  // token and head strides, elements
  int heads;
};

template <typename T, int VEC>
__global__ void rope_kernel(RopeTensor q, RopeTensor k, const int64_t* __restrict__ positions,
                            const float* __restrict__ inv_freq, int D) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  extern __shared__ float cs[];  // cos [D/2], sin [D/2]
  const int64_t t = blockIdx.x;
  const int half = D / 2;
  const float pos = (float)positions[t];  // int64 -> fp32, round to nearest like torch's .float()
  rope_table(pos, inv_freq, half, cs);
  __syncthreads();

  const int nchunk = half / VEC;
  const int total = (q.heads + k.heads) * nchunk;
  for (int w = threadIdx.x; w < total; w += blockDim.x) {
    int h = w / nchunk;
    const int c = (w - h * nchunk) * VEC;
    const RopeTensor& x = h < q.heads ? q : k;
    if (h >= q.heads) h -= q.heads;
    const T* src = (const T*)x.in + t * x.in_ts + h * x.in_hs + c;
    T* dst = (T*)x.out + t * x.out_ts + h * x.out_hs + c;
    float x1[VEC], x2[VEC], o1[VEC], o2[VEC];
    load_vec<VEC>(src, x1);
    load_vec<VEC>(src + half, x2);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float co = cs[c + j], si = cs[half + c + j];
      o1[j] = rope_first(x1[j], x2[j], co, si);
      o2[j] = rope_second(x1[j], x2[j], co, si);
    }
    store_vec<VEC>(dst, o1);
    store_vec<VEC>(dst + half, o2);
  }
}

// rope_kv_write: q rotated in place, k rotated straight into the K cache and v copied into the V cache at
// slots[t] (page * S + offset; < 0 or past the cache: no cache write), one CTA per token. The rotation is the
// one of rope_kernel, op for op, so the cached k and the rotated q carry the same bits as apply_rope +
// kv_cache_write. Caches [P * S, Hk, D] contiguous, same element type as q/k/v.
template <typename T, int VEC>
__global__ void rope_kv_kernel(RopeTensor q, RopeTensor k, const T* __restrict__ v, int64_t v_ts, int64_t v_hs,
                               T* __restrict__ kc, T* __restrict__ vc, const int64_t* __restrict__ slots,
                               int64_t num_slots, const int64_t* __restrict__ positions,
                               const float* __restrict__ inv_freq, int D) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  extern __shared__ float cs[];  // cos [D/2], sin [D/2]
  const int64_t t = blockIdx.x;
  const int half = D / 2;
  const int64_t slot = slots[t];
  const bool write = slot >= 0 && slot < num_slots;
  const float pos = (float)positions[t];
  const int nchunk = half / VEC, per = D / VEC;
  const int hk = write ? k.heads : 0;
  const int nrot = (q.heads + hk) * nchunk;  // rotation items (q heads, then k heads), then v copy items
  const int total = nrot + hk * per;
  const int64_t row = (int64_t)k.heads * D;  // cache elements per slot
  // Rounds of kR items per thread: every load of a round is issued before its first store (written load-then-store
  // per item, each load waited behind the previous item's stores: one dependent round trip per item on every
  // layer's critical path), and the first round's loads before the cos/sin table, which they do not need.
  constexpr int kR = 4;
  for (int base = 0; base < total; base += kR * (int)blockDim.x) {
    RawVec<T, VEC> a[kR], b[kR];  // rotation: the two halves; copy: a
#pragma unroll
    for (int j = 0; j < kR; ++j) {
      const int w = base + j * blockDim.x + threadIdx.x;
      if (w < nrot) {
        int h = w / nchunk;
        const int c = (w - h * nchunk) * VEC;
        const bool is_k = h >= q.heads;
        const RopeTensor& x = is_k ? k : q;
        if (is_k) h -= q.heads;
        const T* src = (const T*)x.in + t * x.in_ts + h * x.in_hs + c;
        a[j].load(src);
        b[j].load(src + half);
      } else if (w < total) {
        const int u = w - nrot, h = u / per, c = (u - h * per) * VEC;
        a[j].load(v + t * v_ts + (int64_t)h * v_hs + c);
      }
    }
    if (base == 0) {  // uniform: every thread runs the same rounds
      rope_table(pos, inv_freq, half, cs);
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < kR; ++j) {
      const int w = base + j * blockDim.x + threadIdx.x;
      if (w < nrot) {
        int h = w / nchunk;
        const int c = (w - h * nchunk) * VEC;
        const bool is_k = h >= q.heads;
        if (is_k) h -= q.heads;
        T* dst = is_k ? kc + slot * row + (int64_t)h * D + c : (T*)q.out + t * q.out_ts + h * q.out_hs + c;
        float o1[VEC], o2[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float x1 = a[j].at(e), x2 = b[j].at(e), co = cs[c + e], si = cs[half + c + e];
          o1[e] = rope_first(x1, x2, co, si);
          o2[e] = rope_second(x1, x2, co, si);
        }
        store_vec<VEC>(dst, o1);
        store_vec<VEC>(dst + half, o2);
      } else if (w < total) {
        const int u = w - nrot, h = u / per, c = (u - h * per) * VEC;
        a[j].store(vc + slot * row + (int64_t)h * D + c);
      }
    }
  }
}

bool vec_ok(const RopeTensor& x) {
  return x.heads == 0 || (aligned16(x.in) && aligned16(x.out) && x.in_ts % 8 == 0 && x.in_hs % 8 == 0 &&
                          x.out_ts % 8 == 0 && x.out_hs % 8 == 0);
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// q [T, Hq, D] -> q_out (may equal q); k [T, Hk, D] -> k_out (k may be null with hk = 0); strides in elements.
// positions [T] int64, inv_freq [D/2] fp32.
EXL2_API int exl2_apply_rope(const void* q, int64_t q_ts, int64_t q_hs, void* q_out, int64_t qo_ts, int64_t qo_hs,
                             int64_t hq, const void* k, int64_t k_ts, int64_t k_hs, void* k_out, int64_t ko_ts,
                             int64_t ko_hs, int64_t hk, const int64_t* positions, const float* inv_freq,
                             int64_t tokens, int64_t head_dim, int dtype, cudaStream_t stream) {
  using namespace exl2::layers;
  EXL2_REQUIRE(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 1024, "apply_rope: head_dim %lld must be even, <= 1024",
               (long long)head_dim);
  EXL2_REQUIRE(tokens >= 0 && tokens < (1ll << 31) && hq >= 0 && hk >= 0 && (hq + hk) * head_dim < (1ll << 30),
               "apply_rope: bad shape");
  EXL2_REQUIRE(hk == 0 || (k != nullptr && k_out != nullptr), "apply_rope: k is null but hk = %lld", (long long)hk);
  if (tokens == 0 || hq + hk == 0) return EXL2_OK;
  RopeTensor qt{q, q_out, q_ts, q_hs, qo_ts, qo_hs, (int)hq};
  RopeTensor kt{k, k_out, k_ts, k_hs, ko_ts, ko_hs, (int)hk};
  const bool vec = (head_dim / 2) % 8 == 0 && vec_ok(qt) && vec_ok(kt);
  const size_t smem = sizeof(float) * head_dim;
  EXL2_DISPATCH_HALF(dtype, T, {
    if (vec)
      exl2::launch_kernel(rope_kernel<T, 8>, (unsigned)tokens, 128, smem, stream, qt, kt, positions, inv_freq, (int)head_dim);
    else
      exl2::launch_kernel(rope_kernel<T, 1>, (unsigned)tokens, 128, smem, stream, qt, kt, positions, inv_freq, (int)head_dim);
  });
  return exl2::check_launch("apply_rope");
}

// q [T, Hq, D] rotated in place; k [T, Hk, D] rotated into k_cache; v [T, Hk, D] copied into v_cache; caches
// contiguous [num_slots, Hk, D] of the same 2-byte type; slots [T] int64; strides in elements.
EXL2_API int exl2_rope_kv_write(void* q, int64_t q_ts, int64_t q_hs, int64_t hq, const void* k, int64_t k_ts,
                                int64_t k_hs, const void* v, int64_t v_ts, int64_t v_hs, int64_t hk, void* k_cache,
                                void* v_cache, const int64_t* slots, int64_t num_slots, const int64_t* positions,
                                const float* inv_freq, int64_t tokens, int64_t head_dim, int dtype,
                                cudaStream_t stream) {
  using namespace exl2::layers;
  EXL2_REQUIRE(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 1024,
               "rope_kv_write: head_dim %lld must be even, <= 1024", (long long)head_dim);
  EXL2_REQUIRE(tokens >= 0 && tokens < (1ll << 31) && hq >= 0 && hk > 0 && (hq + hk) * head_dim < (1ll << 30),
               "rope_kv_write: bad shape");
  EXL2_REQUIRE(k != nullptr && v != nullptr && k_cache != nullptr && v_cache != nullptr && slots != nullptr,
               "rope_kv_write: null pointer");
  if (tokens == 0) return EXL2_OK;
  RopeTensor qt{q, q, q_ts, q_hs, q_ts, q_hs, (int)hq};
  RopeTensor kt{k, nullptr, k_ts, k_hs, 0, 0, (int)hk};
  const bool vec = (head_dim / 2) % 8 == 0 && vec_ok(qt) && aligned16(k) && k_ts % 8 == 0 && k_hs % 8 == 0 &&
                   aligned16(v) && v_ts % 8 == 0 && v_hs % 8 == 0 && aligned16(k_cache) && aligned16(v_cache);
  const size_t smem = sizeof(float) * head_dim;
  EXL2_DISPATCH_HALF(dtype, T, {
    if (vec)
      exl2::launch_kernel(rope_kv_kernel<T, 8>, (unsigned)tokens, 128, smem, stream, 
          qt, kt, (const T*)v, v_ts, v_hs, (T*)k_cache, (T*)v_cache, slots, num_slots, positions, inv_freq,
          (int)head_dim);
    else
      exl2::launch_kernel(rope_kv_kernel<T, 1>, (unsigned)tokens, 128, smem, stream, 
          qt, kt, (const T*)v, v_ts, v_hs, (T*)k_cache, (T*)v_cache, slots, num_slots, positions, inv_freq,
          (int)head_dim);
  });
  return exl2::check_launch("rope_kv_write");
}
