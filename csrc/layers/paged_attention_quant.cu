// Paged decode / verify attention reading quantized K/V pages directly (formats: layers/kv_quant.cuh), the
// flash-decoding scheme of paged_attention.cu: grid (row_tiles * nsplit, Hkv, B), a CTA takes one kv head of
// one sequence, RT query rows (row = j * G + g) and one split of the context; scores -> shared memory (phase 1),
// softmax statistics (phase 2), o = sum p * v (phase 3), split partials combined by a reduce kernel.
//
// No page is ever expanded to fp16 in memory: each lane loads the codes of E consecutive elements of a key
// (E * bits / 8 bytes) and its group scale, decodes them in registers and applies the scale once per dot product
// (scores) or per probability (values). Rotated formats are attended in the rotated domain: q is rotated once
// per CTA (q . k = Hq . Hk for the orthonormal H), the output is rotated back once per row (sum p Hv = H sum p v).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/pdl.cuh"
#include "layers/attn_combine.cuh"
#include "layers/attn_host_args.h"
#include "layers/paged_attention_quant.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int NW = kAttnWarps;
constexpr int NT = kAttnThreads;

template <int RT>
constexpr int keys_max() {
  return qattn_keys_max<RT>();
}

// E: elements per lane per key. 16 for one or two rows (a 16-byte load of 8-bit codes); 8 from four rows on, except
// 4-bit codes at four rows (8 bytes either way). The q and accumulator registers are RT * E each: at E = 16 the
// 8-bit kernel of four rows (GQA 4, the 8B's decode) took 168 registers, 3 CTAs per SM and 1.33 waves at 32k
// (ncu, H200 2026-12-02: 91.7 us, DRAM 17% of peak; at E = 8: 80 registers, 75.0 us). The 4-bit kernel at E = 8
// got slower (52.9 -> 74.8 us), so it keeps 16.
template <int RT, int BITS>
constexpr int lane_elems() {
  return RT <= 2 || (RT <= 4 && BITS <= 4) ? 16 : 8;
}

template <int D, int RT, int U, int KF, int VF>
__global__ void __launch_bounds__(NT) paged_attention_quant_kernel(const QAttnParams p) {
  exl2::pdl_wait_and_trigger();  // inputs come from the previous kernel (PDL launch)
  constexpr int MAXB = KVFormat<KF>::BITS > KVFormat<VF>::BITS ? KVFormat<KF>::BITS : KVFormat<VF>::BITS;
  constexpr int E = lane_elems<RT, MAXB>();
  constexpr int TPK = D / E;     // lanes per key
  constexpr int KPW = 32 / TPK;  // keys per warp step
  constexpr int KPS = NW * KPW;  // keys per CTA step
  constexpr int KM = keys_max<RT>();
  constexpr int NG = D / KV_GROUP;
  constexpr int KBITS = KVFormat<KF>::BITS, VBITS = KVFormat<VF>::BITS;
  constexpr int KNB = E * KBITS / 8, VNB = E * VBITS / 8;  // code bytes per lane per key
  constexpr int KROW = D * KBITS / 8, VROW = D * VBITS / 8;  // code bytes per (slot, kv head)
  constexpr int STEPS = ilog2(RT) < ilog2(TPK) ? ilog2(RT) : ilog2(TPK);  // halving butterfly steps
  constexpr int NV = RT >> STEPS;                                          // rows a lane ends up owning
  constexpr int REPL = (TPK >> STEPS) - 1;  // lanes holding copies of the same sums differ in these bits
  static_assert(NW * RT * D <= RT * KM, "reduction buffer must fit in the score buffer");
  static_assert(TPK >= 2 && TPK <= 32, "lanes per key");

  extern __shared__ float smem[];  // q staging [RT][D]; scores [RT][KM]; cross-warp buffer [NW][RT][D]
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
    qattn_empty_split<D, RT>(p, b, kvh, row0);
    return;
  }
  const int end = min(start + L, ctx);
  const int n = end - start;

  const int first_page = start >> p.log2S;
  const int npages = ((end - 1) >> p.log2S) - first_page + 1;
  attn_load_pages(p, b, first_page, npages, pages);

  // q rows -> shared memory, rotated like the keys, times scale * log2(e)
  qattn_stage_q<D, RT, KVFormat<KF>::ROT>(p, b, kvh, row0, p.scale_log2, smem);
  __syncthreads();  // pages[], q staging

  const int ks = lane / TPK;        // key slot within the warp step
  const int dl = (lane % TPK) * E;  // first of this lane's E elements (all in one scale group)
  const int S_mask = (1 << p.log2S) - 1;

  float qf[RT][E];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) qf[r][e] = smem[r * D + dl + e];

  int own_base = 0;  // rows this lane owns after the butterfly, and the last key each may see (causal)
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
  __syncthreads();  // q staging read: smem becomes the score buffer

  auto row_index = [&](int t) -> int64_t {  // (slot, kv head) row of key t
    const int64_t slot = ((int64_t)pages[(t >> p.log2S) - first_page] << p.log2S) | (t & S_mask);
    return slot * p.Hkv + kvh;
  };

  // ---- phase 1: scores ----
  for (int t0 = start; t0 < end; t0 += KPS * U) {
    KVRaw<KNB> kr[U];
    float ksc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      if (t < end) {
        const int64_t ri = row_index(t);
        kr[u] = kv_load<KNB>(p.kc + ri * KROW + dl * KBITS / 8);
        ksc[u] = qattn_load_scale(p.ks + ri * NG + dl / KV_GROUP);
      } else {
        kr[u] = kv_zero<KNB>();
        ksc[u] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      float kf[E];
      kv_decode<KF, E>(kr[u], kf);
      float s[RT];
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float a = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) a = fmaf(qf[r][e], kf[e], a);
        s[r] = a * ksc[u];
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
  attn_softmax_rows<RT, KM>(smem, n, row_m, row_l);
  __syncthreads();

  // ---- phase 3: o = sum_t p[t] * v[t] (scale folded into p) ----
  float acc[RT][E];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
  for (int t0 = start; t0 < end; t0 += KPS * U) {
    KVRaw<VNB> vr[U];
    float vsc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      if (t < end) {
        const int64_t ri = row_index(t);
        vr[u] = kv_load<VNB>(p.vc + ri * VROW + dl * VBITS / 8);
        vsc[u] = qattn_load_scale(p.vs + ri * NG + dl / KV_GROUP);
      } else {
        vr[u] = kv_zero<VNB>();
        vsc[u] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u * KPS + warp * KPW + ks;
      if (t < end) {
        float vf[E];
        kv_decode<VF, E>(vr[u], vf);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const float pr = smem[r * KM + (t - start)] * vsc[u];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[r][e] = fmaf(pr, vf[e], acc[r][e]);
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
      for (int e = 0; e < E; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
  __syncthreads();  // done reading probabilities: reuse smem
  float* red = smem;  // [NW][RT][D]
  if (ks == 0) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int e = 0; e < E; ++e) red[(warp * RT + r) * D + dl + e] = acc[r][e];
  }
  __syncthreads();
  attn_write_rows<D, RT, KVFormat<VF>::ROT>(p, red, row_m, row_l, b, kvh, row0, split);
}

// One CTA per output row (b, j, hq), one thread per dim: combine the splits in order, rotate back. STAGED: the
// row's partials through shared memory first (attn_combine.cuh; bit-identical), where they fit.
template <int D, bool ROT, bool STAGED>
__global__ void __launch_bounds__(D) attn_quant_reduce_kernel(const QAttnParams p) {
  extern __shared__ float combine_smem[];
  exl2::pdl_wait_and_trigger();
  const int64_t prow = blockIdx.x;
  const int b = (int)(prow / ((int64_t)p.Tq * p.Hq));
  const int d = threadIdx.x;
  const int ctx = attn_clamp_ctx(p.context_lens[b], p);
  const int L = attn_split_len(ctx, p.nsplit, p.min_split);
  const int used = ctx > 0 ? (ctx + L - 1) / L : 0;
  const float* ml = p.part_ml + prow * p.nsplit * 2;
  float o;
  if constexpr (STAGED) {
    o = attn_combine_staged<D>(ml, p.part_o + prow * p.nsplit * D, used, combine_smem);
  } else {
    const float* po = p.part_o + prow * p.nsplit * D + d;
    o = attn_combine_in_order(used, [&](int i) { return ml[i]; }, [&](int s) { return po[(int64_t)s * D]; });
  }
  if constexpr (ROT) o = warp_fwht32(o);
  p.out[prow * D + d] = __float2half_rn(o);
}

// The same combination by slices of 32 dims, one warp per (row, slice): grid (rows, D / 32), 4x the CTAs of the
// kernel above at D = 128, each staging a quarter of the row's partials. Where the splits are many (the streamed
// kernel's 132 at 32k: 68 KB of partials per row on the 8B decode's 32 CTAs) the one-CTA-per-row kernel waits on
// one long stream of loads per row. Bit-identical (attn_combine_staged_slice).
template <int D, bool ROT>
__global__ void __launch_bounds__(32) attn_quant_reduce_slice_kernel(const QAttnParams p) {
  extern __shared__ float combine_smem[];
  exl2::pdl_wait_and_trigger();
  const int64_t prow = blockIdx.x;
  const int slice = blockIdx.y, b = (int)(prow / ((int64_t)p.Tq * p.Hq));
  const int ctx = attn_clamp_ctx(p.context_lens[b], p);
  const int L = attn_split_len(ctx, p.nsplit, p.min_split);
  const int used = ctx > 0 ? (ctx + L - 1) / L : 0;
  float o = attn_combine_staged_slice<D>(p.part_ml + prow * p.nsplit * 2, p.part_o + prow * p.nsplit * D, used,
                                         slice, combine_smem);
  if constexpr (ROT) o = warp_fwht32(o);  // the slice is one group of 32: the warp rotates it back
  p.out[prow * D + 32 * slice + (threadIdx.x & 31)] = __float2half_rn(o);
}

// Splits from which the reduce runs in slices (attn_quant_reduce_slice_kernel): EXL2_ATTN_REDUCE_SLICE_MIN, read
// once; 0 (the default until measured on the GPU) never.
int reduce_slice_min() {
  static const int v = [] {
    const char* e = getenv("EXL2_ATTN_REDUCE_SLICE_MIN");
    return e != nullptr && atoi(e) > 0 ? atoi(e) : 0;
  }();
  return v;
}

// The split combination after either attention kernel (nothing to do when nsplit == 1).
template <int D, bool ROT>
int launch_reduce(const QAttnParams& p, int B, cudaStream_t stream) {
  if (p.nsplit == 1) return EXL2_OK;
  const int64_t combine_bytes = attn_combine_smem(p.nsplit, D);
  const unsigned rows = (unsigned)((int64_t)B * p.Tq * p.Hq);
  const int64_t slice_bytes = (int64_t)p.nsplit * (32 + 2) * 4;
  if (reduce_slice_min() > 0 && p.nsplit >= reduce_slice_min() && reinterpret_cast<uintptr_t>(p.part_o) % 16 == 0 &&
      attn_combine_fits<attn_quant_reduce_slice_kernel<D, ROT>>(slice_bytes)) {
    exl2::launch_kernel(attn_quant_reduce_slice_kernel<D, ROT>, dim3(rows, D / 32), 32, (size_t)slice_bytes, stream,
                        p);
    return check_launch("paged_attention_quant reduce (slices)");
  }
  constexpr auto staged = attn_quant_reduce_kernel<D, ROT, true>;
  if (reinterpret_cast<uintptr_t>(p.part_o) % 16 == 0 && attn_combine_fits<staged>(combine_bytes))
    exl2::launch_kernel(staged, rows, D, (size_t)combine_bytes, stream, p);
  else
    exl2::launch_kernel(attn_quant_reduce_kernel<D, ROT, false>, rows, D, 0, stream, p);
  return check_launch("paged_attention_quant reduce");
}

template <int D, int RT, int U, int KF, int VF>
int launch(const QAttnParams& p, int B, cudaStream_t stream) {
  const int st = qattn_check_splits(p, keys_max<RT>());
  if (st != EXL2_OK) return st;
  const dim3 grid((unsigned)(p.row_tiles * p.nsplit), (unsigned)p.Hkv, (unsigned)B);
  const size_t smem = sizeof(float) * RT * keys_max<RT>();
  exl2::launch_kernel(paged_attention_quant_kernel<D, RT, U, KF, VF>, grid, NT, smem, stream, p);
  return check_launch("paged_attention_quant");
}

template <int D, int KF, int VF>
int launch_rt(const QAttnParams& p, int rt, int B, cudaStream_t stream) {
  switch (rt) {  // key steps in flight: more for small tiles (few registers per key), fewer for large
    case 1: return launch<D, 1, 8, KF, VF>(p, B, stream);
    case 2: return launch<D, 2, 8, KF, VF>(p, B, stream);
    case 4: return launch<D, 4, 8, KF, VF>(p, B, stream);
    case 8: return launch<D, 8, 4, KF, VF>(p, B, stream);
    case 16: return launch<D, 16, 2, KF, VF>(p, B, stream);
  }
  return set_error(EXL2_ERR_INVALID_ARGUMENT, "paged_attention_quant: bad row tile %d", rt);
}

template <int D>
int launch_fmt(const QAttnParams& p, int rt, int kf, int vf, int B, cudaStream_t stream) {
  if (kf == kFmtE4M3 && vf == kFmtE4M3) return launch_rt<D, kFmtE4M3, kFmtE4M3>(p, rt, B, stream);
  if (kf == kFmtI8 && vf == kFmtI8) return launch_rt<D, kFmtI8, kFmtI8>(p, rt, B, stream);
  if (kf == kFmtI8 && vf == kFmtI4) return launch_rt<D, kFmtI8, kFmtI4>(p, rt, B, stream);
  if (kf == kFmtI4 && vf == kFmtI4) return launch_rt<D, kFmtI4, kFmtI4>(p, rt, B, stream);
  return set_error(EXL2_ERR_UNSUPPORTED, "paged_attention_quant: format pair (%d, %d) not built", kf, vf);
}

}  // namespace

// Timing probe, results WRONG: EXL2_ATTN_PROBE=1 leaves the split combination out (the output keeps whatever it
// held). It measures what the reduce launch costs a decode step: H200 call AA1 of 2026-12-03, 8B at 1k, 2.315 ->
// 2.228 ms, the most any way of combining the splits elsewhere could gain.
static bool reduce_probe() {
  static const bool v = [] {
    const char* e = getenv("EXL2_ATTN_PROBE");
    const bool on = e != nullptr && atoi(e) == 1;
    if (on) fprintf(stderr, "exl2_backend: EXL2_ATTN_PROBE=1: attention timing probe, results are WRONG\n");
    return on;
  }();
  return v;
}

int launch_paged_attention_quant_reduce(const QAttnParams& p, bool rot, int D, int B, cudaStream_t stream) {
  if (reduce_probe()) return EXL2_OK;
  if (D == 64) return rot ? launch_reduce<64, true>(p, B, stream) : launch_reduce<64, false>(p, B, stream);
  return rot ? launch_reduce<128, true>(p, B, stream) : launch_reduce<128, false>(p, B, stream);
}

}  // namespace layers
}  // namespace exl2

// q [B, Tq, Hq, D] fp16 (strides in elements, dims contiguous); k_codes / v_codes uint8 [P, S, Hkv, D * bits / 8]
// and k_scales / v_scales fp16 [P, S, Hkv, D / 32], contiguous; formats 1 e4m3, 2 int8, 3 int4 (pairs as
// kv_quant_write); block_tables [B, bt_stride] int32; context_lens [B] int32; out [B, Tq, Hq, D] fp16 contiguous;
// workspace fp32 of B*Tq*Hq*nsplit*(D+2) floats (unused if nsplit == 1). Row tiles as exl2_paged_attention, at
// most max_row_tile (4, 8 or 16) rows each; use_mma bits 0-1 = 1..3 select the tensor-core kernel (row tiles of 8,
// paged_attention_quant_mma.cu; its variant (use_mma & 3) - 1), bits 2-3 its stages in shared memory (0, or 2 / 3
// with a one-pass variant), bits 4-5 row tiles per CTA (0 or 1: one; 2 / 3 with 2 stages); use_mma 64 alone: the
// streamed kernel (paged_attention_stream.cu: decode steps, D = 128, sm_90+).
EXL2_API int exl2_paged_attention_quant(const void* q, int64_t q_bs, int64_t q_ts, int64_t q_hs, const void* k_codes,
                                        const void* k_scales, const void* v_codes, const void* v_scales, int k_fmt,
                                        int v_fmt, const int32_t* block_tables, int64_t bt_stride,
                                        const int32_t* context_lens, void* out, float* workspace, int64_t B,
                                        int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, int64_t num_pages,
                                        int64_t page_size, int64_t max_pages, int64_t nsplit, int64_t min_split,
                                        float scale, int max_row_tile, int use_mma, cudaStream_t stream) {
  using namespace exl2::layers;
  if (int st = attn_check_shape("paged_attention_quant", B, Tq, Hq, Hkv, D, num_pages, page_size, max_pages,
                                 nsplit, workspace))
    return st;
  EXL2_REQUIRE(kv_fmt_valid(k_fmt) && kv_fmt_valid(v_fmt), "paged_attention_quant: bad formats %d, %d", k_fmt,
               v_fmt);
  if (B == 0) return EXL2_OK;
  QAttnParams p;
  attn_fill_common(p, q, q_bs, q_ts, q_hs, block_tables, bt_stride, context_lens, out, workspace, B, Tq, Hq, Hkv, D,
                   num_pages, page_size, max_pages, nsplit, min_split, scale);
  p.kc = (const uint8_t*)k_codes;
  p.ks = (const half*)k_scales;
  p.vc = (const uint8_t*)v_codes;
  p.vs = (const half*)v_scales;
  EXL2_REQUIRE(use_mma == 64 || (use_mma >= 0 && use_mma < 64 && ((use_mma & 3) != 0 || use_mma == 0)),
               "paged_attention_quant: use_mma %d (kernel code 0..3, stages << 2, tiles << 4; or 64 alone)", use_mma);
  p.prefetch = 0;
  if (use_mma == 64) {  // the streamed kernel (paged_attention_stream.cu), with its own shape checks
    p.row_tiles = 1;
    return launch_paged_attention_stream(p, k_fmt, v_fmt, (int)D, (int)B, stream);
  }
  const int stages = (use_mma >> 2) & 3, tiles = use_mma >> 4 ? use_mma >> 4 : 1;
  use_mma &= 3;
  EXL2_REQUIRE(max_row_tile == 4 || max_row_tile == 8 || max_row_tile == 16,
               "paged_attention_quant: row tile cap %d (4, 8 or 16)", max_row_tile);
  // The tensor-core kernel takes row tiles of 8 (its mma's 16 rows hold the tile's q in two fp16 parts);
  // the CUDA-core kernel the smallest power of two up to the cap.
  int rt = use_mma ? 8 : p.R <= 1 ? 1 : p.R <= 2 ? 2 : p.R <= 4 ? 4 : p.R <= 8 ? 8 : 16;
  if (!use_mma) rt = rt < max_row_tile ? rt : max_row_tile;
  p.row_tiles = (p.R + rt - 1) / rt;
  EXL2_REQUIRE((int64_t)p.row_tiles * nsplit < (1ll << 31), "paged_attention_quant: grid too large");
  int st;
  if (use_mma) {
    st = launch_paged_attention_quant_mma(p, k_fmt, v_fmt, (int)D, (int)B, use_mma - 1, stages, tiles, stream);
  } else {
    st = D == 64 ? launch_fmt<64>(p, rt, k_fmt, v_fmt, (int)B, stream)
                 : launch_fmt<128>(p, rt, k_fmt, v_fmt, (int)B, stream);
  }
  if (st != EXL2_OK) return st;
  return launch_paged_attention_quant_reduce(p, v_fmt != kFmtE4M3, (int)D, (int)B, stream);
}
