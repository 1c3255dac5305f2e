// Host side of the split-K decode attention entry points (exl2_paged_attention over fp16 pages,
// exl2_paged_attention_quant over quantized ones): the shape checks and the launch parameters both take alike.
// P is AttnParams or QAttnParams; their cache pointers and kernel choices are set by each entry point.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/api.h"

namespace exl2 {
namespace layers {

// EXL2_OK when the kernels take this shape, else the C ABI's error, its message prefixed with `who`. An empty batch
// (B == 0) launches nothing and needs no workspace.
inline int attn_check_shape(const char* who, int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t num_pages, int64_t page_size, int64_t max_pages, int64_t nsplit,
                            const float* workspace) {
  EXL2_REQUIRE(D == 64 || D == 128, "%s: head_dim %lld not supported (64, 128)", who, (long long)D);
  EXL2_REQUIRE(Hkv > 0 && Hq > 0 && Hq % Hkv == 0, "%s: Hq %lld not a multiple of Hkv %lld", who, (long long)Hq,
               (long long)Hkv);
  EXL2_REQUIRE(page_size >= 16 && (page_size & (page_size - 1)) == 0 && page_size <= (1 << 20),
               "%s: page size %lld must be a power of two >= 16", who, (long long)page_size);
  EXL2_REQUIRE(B >= 0 && B < 65536 && Tq > 0 && Hkv < 65536 && max_pages > 0 && num_pages > 0 && nsplit >= 1,
               "%s: bad shape", who);
  EXL2_REQUIRE(max_pages * page_size < (1ll << 30), "%s: context too long", who);
  EXL2_REQUIRE(B == 0 || nsplit == 1 || workspace != nullptr, "%s: workspace required for nsplit > 1", who);
  return EXL2_OK;
}

// Everything of p but the caches, the row tiles, the tickets and the kernel's own switches. q [B, Tq, Hq, D]
// (strides q_bs / q_ts / q_hs in elements); workspace: the splits' partial outputs [B, Tq, Hq, nsplit, D], then
// their (max, sum) pairs [B, Tq, Hq, nsplit, 2].
template <class P>
void attn_fill_common(P& p, const void* q, int64_t q_bs, int64_t q_ts, int64_t q_hs, const int32_t* block_tables,
                      int64_t bt_stride, const int32_t* context_lens, void* out, float* workspace, int64_t B,
                      int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, int64_t num_pages, int64_t page_size,
                      int64_t max_pages, int64_t nsplit, int64_t min_split, float scale) {
  p.q = (const half*)q;
  p.q_bs = q_bs;
  p.q_ts = q_ts;
  p.q_hs = q_hs;
  p.block_tables = block_tables;
  p.bt_stride = bt_stride;
  p.context_lens = context_lens;
  p.out = (half*)out;
  p.Tq = (int)Tq;
  p.Hq = (int)Hq;
  p.Hkv = (int)Hkv;
  p.G = (int)(Hq / Hkv);
  p.R = (int)(p.G * Tq);
  p.nsplit = (int)nsplit;
  p.min_split = (int)min_split;
  int log2S = 0;
  while ((1ll << log2S) < page_size) ++log2S;
  p.log2S = log2S;
  p.max_pages = (int)max_pages;
  p.num_pages = (int)num_pages;
  p.scale_log2 = scale * 1.4426950408889634f;  // the kernels' softmax runs in log2 units
  p.part_o = workspace;
  p.part_ml = workspace == nullptr ? nullptr : workspace + B * Tq * Hq * nsplit * D;
}

}  // namespace layers
}  // namespace exl2
