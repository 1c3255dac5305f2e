// Paged decode / verify attention, flash-decoding style.
//
// Grid (row_tiles * nsplit, Hkv, B). A CTA takes one kv head of one sequence, the RT query rows of one tile
// of that head's G * Tq rows (row = j * G + g: query j, q head kvh * G + g), and one split of the context.
// Every sequence's context is cut into nsplit equal parts at run time (context_lens lives on the device),
// so one launch shape serves any lengths and the grid stays fixed under CUDA-graph capture.
//   phase 1: scores = q . k (fp32, log2 domain) for the split's keys -> shared memory, causal mask applied;
//   phase 2: per-row max and exp2 -> probabilities in place, row sums;
//   phase 3: o = sum p * v; reduced across warps; written as an fp32 partial (o, m, l) per split, or as the
//            final fp16 output when nsplit == 1.
// The partials are combined in split order (deterministic): with a tickets buffer, by the last CTA of each
// (sequence, kv head, row tile) to finish (one launch; it leaves its ticket at zero for the next launch and
// graph replay); without one, by attn_reduce_kernel (a second launch). Both give the same bits.
//
// Thread layout in phases 1 and 3: TPK = D / 8 lanes share a key, each holding 8 dims as one 16-byte load;
// a warp covers 32 / TPK keys per step. The per-key dot products of the RT rows are reduced over the TPK
// lanes with a butterfly that halves the row set at each step (RT + log2 TPK shuffles instead of RT * log2 TPK).
#include <math.h>

#include "common/pdl.cuh"
#include "layers/attn_combine.cuh"
#include "layers/attn_host_args.h"
#include "layers/attn_split_steps.cuh"
#include "layers/common.cuh"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int NW = kAttnWarps;  // warps per CTA (the shared steps of attn_split_steps.cuh assume it)
constexpr int NT = kAttnThreads;

template <int RT>
constexpr int keys_max() {  // keys per split held in shared memory: RT * keys_max floats = 32 KiB
  return RT <= 8 ? 1024 : 512;
}

// Keys of its split a CTA prefetches into L2 before the PDL wait: enough to cover the first loads' latency,
// few enough that every CTA's share fits L2 (528 CTAs x 64 keys x 512 bytes = 17 MB for the 8B at 32k). H200 call
// I3 of 2026-12-02 (8B decode at 32k, graph critical path): prefetching whole splits (134 MB per layer, past the
// 50 MB L2) delayed the rope/KV-write kernel before it from 3.4 to 14.3 us per layer.
constexpr int kPrefetchKeys = 64;

struct AttnParams {
  const half* q;
  int64_t q_bs, q_ts, q_hs;  // q strides (elements); dims contiguous
  const half* kc;            // [P, S, Hkv, D]
  const half* vc;
  const int* block_tables;  // [B, bt_stride]
  int64_t bt_stride;
  const int* context_lens;  // [B]
  half* out;                // [B, Tq, Hq, D] contiguous
  float* part_o;            // [B, Tq, Hq, nsplit, D]
  float* part_ml;           // [B, Tq, Hq, nsplit, 2] (max in log2 units, sum)
  int* tickets;             // [B, Hkv, row_tiles], zero on entry and exit; null: separate reduce kernel
  int Tq, Hq, Hkv, G, R, row_tiles, nsplit, min_split, log2S, max_pages, num_pages;
  float scale_log2;  // softmax scale * log2(e)
};

__device__ __forceinline__ void h8_to_f(const uint4& u, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// Combine the `used` split partials of output row prow at dim d, in split order. Loads go through L2 (__ldcg):
// with tickets the partials were written by other CTAs of this launch.
template <int D>
__device__ __forceinline__ float combine_splits(const AttnParams& p, int64_t prow, int d, int used) {
  const float* ml = p.part_ml + prow * p.nsplit * 2;
  const float* po = p.part_o + prow * p.nsplit * D + d;
  return attn_combine_in_order(used, [&](int i) { return __ldcg(ml + i); },
                               [&](int s) { return __ldcg(po + (int64_t)s * D); });
}

// U: key steps per thread with loads in flight (more bytes in flight per CTA vs more registers)
template <int D, int RT, int U>
__global__ void __launch_bounds__(NT) paged_attention_kernel(const AttnParams p) {
  // PDL: before the wait this kernel reads only what earlier kernels than the previous one wrote (block
  // tables, context lengths: the previous kernel had passed its own wait when this one launched) and only
  // prefetches K/V into L2 (a hint; the newest slot, written by the previous kernel, is read after the wait).
  constexpr int TPK = D / 8;     // lanes per key
  constexpr int KPW = 32 / TPK;  // keys per warp step
  constexpr int KPS = NW * KPW;  // keys per CTA step
  constexpr int KM = keys_max<RT>();
  constexpr int STEPS = ilog2(RT) < ilog2(TPK) ? ilog2(RT) : ilog2(TPK);  // halving butterfly steps
  constexpr int NV = RT >> STEPS;                                          // rows a lane ends up owning
  constexpr int REPL = (TPK >> STEPS) - 1;  // lanes holding copies of the same sums differ in these bits
  static_assert(NW * RT * D <= RT * KM, "reduction buffer must fit in the score buffer");

  extern __shared__ float smem[];  // scores / probabilities [RT][KM]; later the cross-warp buffer [NW][RT][D]
  __shared__ int pages[KM / 16 + 2];
  __shared__ float row_m[RT], row_l[RT];

  const int tile = blockIdx.x % p.row_tiles, split = blockIdx.x / p.row_tiles;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int ctx = attn_clamp_ctx(p.context_lens[b], p);
  const int L = attn_split_len(ctx, p.nsplit, p.min_split);
  const int start = split * L;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = tile * RT;

  if (start >= ctx) {  // an unused split (or an empty context)
    exl2::pdl_wait_and_trigger();
    // no key at all (ctx == 0): the reference gives zeros, written here unless the reduce kernel does it
    if (p.nsplit == 1 || (p.tickets != nullptr && split == 0)) {
      for (int i = tid; i < RT * D; i += NT) {
        const int row = row0 + i / D;
        if (row < p.R) {
          const int j = row / p.G, hq = kvh * p.G + row % p.G;
          p.out[(((int64_t)b * p.Tq + j) * p.Hq + hq) * D + i % D] = __float2half_rn(0.f);
        }
      }
    }
    return;
  }
  const int end = min(start + L, ctx);
  const int n = end - start;

  const int first_page = start >> p.log2S;
  const int npages = ((end - 1) >> p.log2S) - first_page + 1;
  attn_load_pages(p, b, first_page, npages, pages);
  __syncthreads();  // pages[]
  const int npre = min(n, kPrefetchKeys);
  for (int i = tid; i < 2 * npre; i += NT) {  // the split's first K and V rows of head kvh into L2 (D halves)
    const int t = start + (i >> 1);
    const int64_t slot = ((int64_t)pages[(t >> p.log2S) - first_page] << p.log2S) | (t & ((1 << p.log2S) - 1));
    const half* row = ((i & 1) ? p.vc : p.kc) + slot * (int64_t)p.Hkv * D + (int64_t)kvh * D;
#pragma unroll
    for (int off = 0; off < D; off += 64) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
  }
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)

  const int ks = lane / TPK;       // key slot within the warp step
  const int dl = (lane % TPK) * 8; // first of this lane's 8 dims
  const int64_t kv_row = (int64_t)p.Hkv * D;
  const int S_mask = (1 << p.log2S) - 1;

  float qf[RT][8];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int row = row0 + r;
    if (row < p.R) {
      const int j = row / p.G, hq = kvh * p.G + row % p.G;
      const uint4 u = *reinterpret_cast<const uint4*>(p.q + b * p.q_bs + j * p.q_ts + hq * p.q_hs + dl);
      h8_to_f(u, qf[r]);
#pragma unroll
      for (int k = 0; k < 8; ++k) qf[r][k] *= p.scale_log2;
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) qf[r][k] = 0.f;
    }
  }
  // rows this lane owns after the butterfly, and the last key each may see (causal by absolute position)
  int own_base = 0;
#pragma unroll
  for (int k = 0; k < STEPS; ++k)
    if (lane & (TPK >> (k + 1))) own_base += RT >> (k + 1);
  const bool writer = (lane & REPL) == 0;
  int own_lim[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int row = row0 + own_base + i;
    own_lim[i] = row < p.R ? ctx - p.Tq + row / p.G : -1;
  }

  auto key_offset = [&](int t) -> int64_t {
    const int64_t slot = ((int64_t)pages[(t >> p.log2S) - first_page] << p.log2S) | (t & S_mask);
    return slot * kv_row + (int64_t)kvh * D + dl;
  };

  // ---- phase 1: scores ----
  for (int t0 = start; t0 < end; t0 += KPS * U) {
    uint4 kr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      kr[u] = t < end ? __ldg(reinterpret_cast<const uint4*>(p.kc + key_offset(t))) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      float kf[8];
      h8_to_f(kr[u], kf);
      float s[RT];
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) a = fmaf(qf[r][k], kf[k], a);
        s[r] = a;
      }
      butterfly<RT, TPK / 2>(s, lane);
      if (writer && t < end) {
#pragma unroll
        for (int i = 0; i < NV; ++i) smem[(own_base + i) * KM + (t - start)] = t <= own_lim[i] ? s[i] : -INFINITY;
      }
    }
  }
  __syncthreads();

  // ---- phase 2: softmax statistics per row (log2 domain) ----
  for (int r = warp; r < RT; r += NW) {
    float* sr = smem + r * KM;
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, sr[i]);
    m = warp_max(m);
    const float mu = m == -INFINITY ? 0.f : m;  // fully masked row: all p = 0, no NaN
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = exp2f(sr[i] - mu);
      sr[i] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      row_m[r] = m;
      row_l[r] = l;
    }
  }
  __syncthreads();

  // ---- phase 3: o = sum_t p[t] * v[t] ----
  float acc[RT][8];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[r][k] = 0.f;
  for (int t0 = start; t0 < end; t0 += KPS * U) {
    uint4 vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      vr[u] = t < end ? __ldg(reinterpret_cast<const uint4*>(p.vc + key_offset(t))) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      if (t < end) {
        float vf[8];
        h8_to_f(vr[u], vf);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const float pr = smem[r * KM + (t - start)];
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[r][k] = fmaf(pr, vf[k], acc[r][k]);
        }
      }
    }
  }
  // across the key slots of a warp, then across warps through shared memory
#pragma unroll
  for (int o = TPK; o < 32; o <<= 1)
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[r][k] += __shfl_xor_sync(0xffffffffu, acc[r][k], o);
  __syncthreads();  // done reading probabilities: reuse smem
  float* red = smem;  // [NW][RT][D]
  if (ks == 0) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int k = 0; k < 8; ++k) red[(warp * RT + r) * D + dl + k] = acc[r][k];
  }
  __syncthreads();
  attn_write_rows<D, RT, false, NT>(p, red, row_m, row_l, b, kvh, row0, split);
  if (p.nsplit == 1 || p.tickets == nullptr) return;
  // Ticket: every used split of this (b, kvh, tile) counts in once its partials are out; the last one
  // combines them. Each thread fences its own partial stores before the barrier (release), the last CTA
  // fences after reading the ticket (acquire) and reads the partials through L2.
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  const int used = (ctx + L - 1) / L;
  int* ticket = p.tickets + ((int64_t)b * p.Hkv + kvh) * p.row_tiles + tile;
  if (tid == 0) {
    const int prev = atomicAdd(ticket, 1);
    is_last = prev == used - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = tid; i < RT * D; i += NT) {
    const int r = i / D, d = i % D, row = row0 + r;
    if (row >= p.R) continue;
    const int j = row / p.G, hq = kvh * p.G + row % p.G;
    const int64_t prow = ((int64_t)b * p.Tq + j) * p.Hq + hq;
    p.out[prow * D + d] = __float2half_rn(combine_splits<D>(p, prow, d, used));
  }
  if (tid == 0) *ticket = 0;  // ready for the next launch (and graph replay)
}

// One CTA per output row (b, j, hq), one thread per dim: combine the splits in order. STAGED: the row's partials
// through shared memory first (attn_combine.cuh; bit-identical), where they fit the dynamic shared memory.
template <int D, bool STAGED>
__global__ void __launch_bounds__(D) attn_reduce_kernel(const AttnParams p) {
  extern __shared__ float combine_smem[];
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  const int64_t prow = blockIdx.x;
  const int b = (int)(prow / ((int64_t)p.Tq * p.Hq));
  const int d = threadIdx.x;
  const int ctx = attn_clamp_ctx(p.context_lens[b], p);
  const int L = attn_split_len(ctx, p.nsplit, p.min_split);
  const int used = ctx > 0 ? (ctx + L - 1) / L : 0;
  const float o = STAGED ? attn_combine_staged<D>(p.part_ml + prow * p.nsplit * 2, p.part_o + prow * p.nsplit * D,
                                                  used, combine_smem)
                         : combine_splits<D>(p, prow, d, used);
  p.out[prow * D + d] = __float2half_rn(o);
}

template <int D, int RT, int U>
int launch(const AttnParams& p, int B, cudaStream_t stream) {
  EXL2_REQUIRE((int64_t)p.nsplit * keys_max<RT>() >= ((int64_t)p.max_pages << p.log2S),
               "paged_attention: nsplit %d too small for %d pages of %d (split <= %d keys)", p.nsplit, p.max_pages,
               1 << p.log2S, keys_max<RT>());
  EXL2_REQUIRE(p.min_split <= keys_max<RT>() && p.min_split > 0, "paged_attention: min_split %d out of range",
               p.min_split);
  const dim3 grid((unsigned)(p.row_tiles * p.nsplit), (unsigned)p.Hkv, (unsigned)B);
  const size_t smem = sizeof(float) * RT * keys_max<RT>();
  exl2::launch_kernel(paged_attention_kernel<D, RT, U>, grid, NT, smem, stream, p);
  int st = check_launch("paged_attention");
  if (st != EXL2_OK || p.nsplit == 1 || p.tickets != nullptr) return st;
  const int64_t combine_bytes = attn_combine_smem(p.nsplit, D);
  const unsigned rows = (unsigned)((int64_t)B * p.Tq * p.Hq);
  constexpr auto staged = attn_reduce_kernel<D, true>;
  if (reinterpret_cast<uintptr_t>(p.part_o) % 16 == 0 && attn_combine_fits<staged>(combine_bytes))
    exl2::launch_kernel(staged, rows, D, (size_t)combine_bytes, stream, p);
  else
    exl2::launch_kernel(attn_reduce_kernel<D, false>, rows, D, 0, stream, p);
  return check_launch("paged_attention reduce");
}

// flags bit 0: deeper unroll (8 key steps in flight) for row tiles <= 4
template <int D>
int launch_rt(const AttnParams& p, int rt, int flags, int B, cudaStream_t stream) {
  const bool deep = flags & 1;
  switch (rt) {
    case 1: return deep ? launch<D, 1, 8>(p, B, stream) : launch<D, 1, 4>(p, B, stream);
    case 2: return deep ? launch<D, 2, 8>(p, B, stream) : launch<D, 2, 4>(p, B, stream);
    case 4: return deep ? launch<D, 4, 8>(p, B, stream) : launch<D, 4, 4>(p, B, stream);
    case 8: return launch<D, 8, 4>(p, B, stream);
    case 16: return launch<D, 16, 2>(p, B, stream);
  }
  return set_error(EXL2_ERR_INVALID_ARGUMENT, "paged_attention: bad row tile %d", rt);
}

// The parameters of the kernels that read fp16 pages through the quantized formats' code (paged_attention_quant.cuh:
// the tensor-core kernel, the streamed one, their reduce), for row tiles of `rows`.
QAttnParams quant_params(const AttnParams& a, int rows) {
  QAttnParams p = {};
  p.q = a.q;
  p.q_bs = a.q_bs;
  p.q_ts = a.q_ts;
  p.q_hs = a.q_hs;
  p.kc = reinterpret_cast<const uint8_t*>(a.kc);
  p.vc = reinterpret_cast<const uint8_t*>(a.vc);
  p.block_tables = a.block_tables;
  p.bt_stride = a.bt_stride;
  p.context_lens = a.context_lens;
  p.out = a.out;
  p.part_o = a.part_o;
  p.part_ml = a.part_ml;
  p.Tq = a.Tq;
  p.Hq = a.Hq;
  p.Hkv = a.Hkv;
  p.G = a.G;
  p.R = a.R;
  p.row_tiles = (a.R + rows - 1) / rows;
  p.nsplit = a.nsplit;
  p.min_split = a.min_split;
  p.log2S = a.log2S;
  p.max_pages = a.max_pages;
  p.num_pages = a.num_pages;
  p.scale_log2 = a.scale_log2;
  return p;
}

// fp16 pages through the tensor-core kernel of the quantized formats (paged_attention_quant_mma.cu): the same
// splits and partials, tiles of 8 rows, its own reduce launch.
int launch_tensor_core(const AttnParams& a, int D, int B, int variant, int stages, int tiles, cudaStream_t stream) {
  const QAttnParams p = quant_params(a, 8);
  EXL2_REQUIRE((int64_t)p.row_tiles * p.nsplit < (1ll << 31), "paged_attention: grid too large");
  const int st = launch_paged_attention_quant_mma(p, kFmtF16, kFmtF16, D, B, variant, stages, tiles, stream);
  return st != EXL2_OK ? st : launch_paged_attention_quant_reduce(p, false, D, B, stream);
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// Rows per CTA tile for G * Tq query rows per kv head (ops/cuda_layers.py mirrors this and keys_max).
EXL2_API int exl2_paged_attention_row_tile(int64_t rows) {
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : rows <= 8 ? 8 : 16;
}

// q [B, Tq, Hq, D] fp16 (strides in elements, dims contiguous, 16-byte aligned rows); caches [P, S, Hkv, D]
// fp16 contiguous; block_tables [B, bt_stride] int32 (first max_pages entries used); context_lens [B] int32;
// out [B, Tq, Hq, D] fp16 contiguous; workspace fp32 of B*Tq*Hq*nsplit*(D+2) floats (unused if nsplit == 1);
// flags: bit 0 = deeper load unroll for small row tiles; bits 1-2 = row tile cap (0: 16, 1: 8, 2: 4; more,
// smaller tiles for a verify step's rows, ops/cuda_layers.ATTN_MAX_ROW_TILE); bits 3-4 = the tensor-core kernel
// (paged_attention_quant_mma.cu over fp16 pages: row tiles of 8, its reduce launch, no tickets), variant bits - 1
// (0 two passes, 1 / 2 one pass); bits 5-6 = its stages in shared memory (0 none, 2 / 3 with a one-pass variant),
// bits 7-8 = row tiles per CTA (0 or 1: one; 2 / 3 with 2 stages; launch_paged_attention_quant_mma); bit 9 = the
// streamed kernel (paged_attention_stream.cu: decode steps, D = 128, sm_90+; bits 3-8 zero). tickets: int32
// [B * Hkv * row_tiles],
// all zero (and left so), to combine the splits inside the one launch; null: a second (reduce) launch does it.
EXL2_API int exl2_paged_attention(const void* q, int64_t q_bs, int64_t q_ts, int64_t q_hs, const void* k_cache,
                                  const void* v_cache, const int32_t* block_tables, int64_t bt_stride,
                                  const int32_t* context_lens, void* out, float* workspace, int64_t B, int64_t Tq,
                                  int64_t Hq, int64_t Hkv, int64_t D, int64_t num_pages, int64_t page_size,
                                  int64_t max_pages, int64_t nsplit, int64_t min_split, float scale, int flags,
                                  int32_t* tickets, cudaStream_t stream) {
  using namespace exl2::layers;
  if (int st = attn_check_shape("paged_attention", B, Tq, Hq, Hkv, D, num_pages, page_size, max_pages, nsplit,
                                 workspace))
    return st;
  if (B == 0) return EXL2_OK;
  AttnParams p;
  attn_fill_common(p, q, q_bs, q_ts, q_hs, block_tables, bt_stride, context_lens, out, workspace, B, Tq, Hq, Hkv, D,
                   num_pages, page_size, max_pages, nsplit, min_split, scale);
  p.kc = (const half*)k_cache;
  p.vc = (const half*)v_cache;
  const int cap_code = (flags >> 1) & 3;
  EXL2_REQUIRE(cap_code <= 2, "paged_attention: bad row tile cap code %d", cap_code);
  const int rt = min(exl2_paged_attention_row_tile(p.R), 16 >> cap_code);
  p.row_tiles = (p.R + rt - 1) / rt;
  p.tickets = nsplit > 1 ? tickets : nullptr;
  EXL2_REQUIRE((int64_t)p.row_tiles * nsplit < (1ll << 31), "paged_attention: grid too large");
  const int mma = (flags >> 3) & 3, stages = (flags >> 5) & 3, tiles = (flags >> 7) & 3;
  const int stream_kernel = (flags >> 9) & 1;
  EXL2_REQUIRE(flags >> 10 == 0 && (mma || (!stages && !tiles)) && !(stream_kernel && mma),
               "paged_attention: bad flags %d", flags);
  if (stream_kernel)
    return launch_paged_attention_stream(quant_params(p, p.R), kFmtF16, kFmtF16, (int)D, (int)B, stream);
  if (mma) return launch_tensor_core(p, (int)D, (int)B, mma - 1, stages, tiles ? tiles : 1, stream);
  if (D == 64) return launch_rt<64>(p, rt, flags, (int)B, stream);
  return launch_rt<128>(p, rt, flags, (int)B, stream);
}
