// The residual stream and its tile sums of squares for a GEMV that applies its input's RMSNorm at the output
// (exl2_gemv_post_norm), where no feeding GEMV wrote them: the first layer's input (the embedding rows), or a
// producer that cannot feed. r = round(h + residual) (r = h without a residual) and per row and 256-column tile the
// sum of squares of r in exl2_gemv_post.cuh's order, so r and the sums are bit-identical to exl2_gemv_feed's.
//
// Grid (tiles, M) of one warp: lane L holds the tile's quads L and 32 + L.
#include "common/api.h"
#include "common/pdl.cuh"
#include "layers/common.cuh"
#include "quant/exl2_gemv_post.cuh"

using namespace exl2q;

namespace {

struct RowFeedParams {
  const __half* h;    // [M, ldh]
  const __half* res;  // [M, res_ld] or null
  __half* r_out;      // [M, ldr] or null (with a residual: receives r)
  float* ss;          // [M, ss_ld]
  int ldh, res_ld, ldr, ss_ld, N;
};

__global__ void __launch_bounds__(32) row_feed_kernel(const __grid_constant__ RowFeedParams p) {
  exl2::pdl_wait_and_trigger();  // h and the residual come from the previous kernel
  const int tile = blockIdx.x, m = blockIdx.y, lane = threadIdx.x;
  float half_sum[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int n = tile * kPostTileCols + 4 * (32 * hf + lane);
    const bool cols = n < p.N;  // N % 8 == 0: all four columns or none
    float rf[4] = {0.f, 0.f, 0.f, 0.f};
    if (cols) {
      const uint2 hv = *reinterpret_cast<const uint2*>(p.h + (size_t)m * p.ldh + n);
      const __half* hh = reinterpret_cast<const __half*>(&hv);
      __align__(8) __half r[4];
      if (p.res) {
        const uint2 rv = *reinterpret_cast<const uint2*>(p.res + (size_t)m * p.res_ld + n);
        const __half* rh = reinterpret_cast<const __half*>(&rv);
#pragma unroll
        for (int c = 0; c < 4; ++c) r[c] = __float2half_rn(__fadd_rn(__half2float(hh[c]), __half2float(rh[c])));
        if (p.r_out) *reinterpret_cast<uint2*>(p.r_out + (size_t)m * p.ldr + n) = *reinterpret_cast<const uint2*>(r);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) r[c] = hh[c];
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) rf[c] = __half2float(r[c]);
    }
    half_sum[hf] = exl2::layers::warp_sum(post_quad_chain(rf));
  }
  if (lane == 0) p.ss[(size_t)m * p.ss_ld + tile] = __fadd_rn(half_sum[0], half_sum[1]);
}

}  // namespace

// h [M, ldh] fp16 (M >= 1), residual [M, res_ld] or null, r_out [M, ldr] or null (needs a residual; receives
// round(h + residual); must alias neither input), ss fp32 [M, ss_ld] (ss_ld >= ceil(N / 256)) receives the tile
// sums of squares of r. N a multiple of 8; rows 16-byte aligned.
EXL2_API int exl2_row_feed(const void* h, int M, int ldh, const void* residual, int res_ld, void* r_out, int ldr,
                           float* ss, int ss_ld, int N, void* stream) {
  using exl2::layers::aligned16;
  EXL2_REQUIRE(h && ss, "exl2_row_feed: null argument");
  EXL2_REQUIRE(M >= 1 && N >= 8 && N % 8 == 0, "exl2_row_feed: M=%d, N=%d (a multiple of 8)", M, N);
  const int tiles = (N + kPostTileCols - 1) / kPostTileCols;
  EXL2_REQUIRE(ss_ld >= tiles, "exl2_row_feed: ss row stride %d < %d tiles", ss_ld, tiles);
  EXL2_REQUIRE(aligned16(h) && ldh % 8 == 0 && ldh >= N && (!residual || (aligned16(residual) && res_ld % 8 == 0
               && res_ld >= N)) && (!r_out || (aligned16(r_out) && ldr % 8 == 0 && ldr >= N)),
               "exl2_row_feed: rows must start 16-byte aligned and hold N=%d halves", N);
  EXL2_REQUIRE(!r_out || residual, "exl2_row_feed: r_out without a residual");
  EXL2_REQUIRE(!r_out || (r_out != h && r_out != residual), "exl2_row_feed: r_out aliases an input");
  const RowFeedParams p{reinterpret_cast<const __half*>(h), reinterpret_cast<const __half*>(residual),
                        reinterpret_cast<__half*>(r_out), ss, ldh, res_ld, ldr, ss_ld, N};
  exl2::launch_kernel(row_feed_kernel, dim3((unsigned)tiles, (unsigned)M), dim3(32), 0,
                      reinterpret_cast<cudaStream_t>(stream), p);
  return exl2::check_launch("exl2_row_feed");
}
