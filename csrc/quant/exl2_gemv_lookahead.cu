// The L2 lookahead between two small-M GEMVs: which bytes of a GEMV the launch before it prefetches.
//
// Why: every GEMV launch spends microseconds that move no weights (its tail: the ring draining, the split-K
// ticket and last block's sum; the next launch's start: PDL release, constants, the input gather). A launch that
// knows the next one's weight ranges (GemvParams::lookahead) has its producer warps prefetch them into L2 once
// their last ring copy is issued (tma_lookahead), so the DRAM keeps streaming across the boundary and the next
// launch's first copies hit L2.
//
// Which bytes: all of the next GEMV's blocks start at once, each at the first chunk of its split, so the
// lookahead is the first bytes of every split (a split's chunk rows, all its columns, are one contiguous
// stretch of the packed words), `budget` bytes in all shared by split size, after the small constants every
// block reads before its first weight: chunk info, act-order map and fp16 lane scales.
#include <algorithm>

#include "common/api.h"
#include "quant/exl2_gemv.cuh"

namespace {

// Appends [addr, addr + bytes) shrunk to 16-byte boundaries (the bulk prefetch's alignment); false when full.
bool add_range(int64_t* out, int max_ranges, int& n, uintptr_t addr, long long bytes) {
  const uintptr_t a = (addr + 15) & ~(uintptr_t)15;
  const long long b = (long long)(((addr + bytes) & ~(uintptr_t)15) - a);
  if (b <= 0) return true;
  if (n >= max_ranges) return false;
  out[2 * n] = (int64_t)a;
  out[2 * n + 1] = b;
  ++n;
  return true;
}

}  // namespace

// blob: ndesc descriptors of the next GEMV as its launch plans them (cuda_quant.py layout, F_KSPLIT set, F_SCL16
// required); budget: weight bytes to share among its splits (>= 0). out: [max_ranges][2] int64 (device address,
// bytes; both multiples of 16), *count the ranges written, at most kMaxLookaheadRanges.
EXL2_API int exl2_gemv_lookahead_ranges(const int64_t* blob, int ndesc, int64_t budget, int64_t* out, int max_ranges,
                                        int* count) {
  using namespace exl2q;
  EXL2_REQUIRE(blob && out && count, "exl2_gemv_lookahead_ranges: null argument");
  EXL2_REQUIRE(ndesc >= 1 && ndesc <= kMaxDesc, "exl2_gemv_lookahead_ranges: %d descriptors (1..%d)", ndesc,
               kMaxDesc);
  EXL2_REQUIRE(budget >= 0, "exl2_gemv_lookahead_ranges: budget %lld < 0", (long long)budget);
  max_ranges = std::min(max_ranges, kMaxLookaheadRanges);
  *count = 0;
  QDesc d[kMaxDesc];
  long long weight_bytes = 0;
  for (int i = 0; i < ndesc; ++i) {
    const int64_t* f = blob + (size_t)i * kDescLen;
    if (const int st = parse_desc(f, d[i])) return st;
    EXL2_REQUIRE(f[F_SCL16], "exl2_gemv_lookahead_ranges: descriptor %d has no fp16 scales", i);
    EXL2_REQUIRE(d[i].ksplit >= 1 && d[i].ksplit <= d[i].C, "exl2_gemv_lookahead_ranges: ksplit %d outside 1..%d",
                 d[i].ksplit, d[i].C);
    for (int r = 0; r < d[i].nruns; ++r)
      weight_bytes += (long long)(d[i].runs[r].chunk_end - d[i].runs[r].chunk_start) * d[i].Np * 8 * d[i].runs[r].bits;
  }
  int n = 0;
  bool room = true;
  for (int i = 0; i < ndesc && room; ++i) {  // the constants, whole
    const int64_t* f = blob + (size_t)i * kDescLen;
    room = add_range(out, max_ranges, n, (uintptr_t)f[F_INFO], 4LL * d[i].C) &&
           add_range(out, max_ranges, n, (uintptr_t)f[F_XMAP], 2LL * d[i].Kpad) &&
           add_range(out, max_ranges, n, (uintptr_t)f[F_SCL16], 2LL * d[i].G * d[i].Np);
  }
  for (int i = 0; i < ndesc && room && budget > 0; ++i) {  // each split's first bytes
    const QDesc& q = d[i];
    const long long w = total_weight(q);
    const long long row_bytes = (long long)q.Np * 8;  // one chunk row of 64 rows at one bit per weight
    for (int r = 0; r < q.nruns && room; ++r) {
      const Run& run = q.runs[r];
      const int nr = run.chunk_end - run.chunk_start, k = run_split_count(q, r, w);
      const uintptr_t base = reinterpret_cast<uintptr_t>(q.packed + run.word_base);
      for (int s = 0; s < k && room; ++s) {  // split s holds chunks [nr * s / k, nr * (s + 1) / k) of the run
        const long long c0 = (long long)nr * s / k, c1 = (long long)nr * (s + 1) / k;
        const long long len = (c1 - c0) * row_bytes * run.bits;
        const long long share = std::min<long long>(len, (long long)((double)budget * len / weight_bytes));
        room = add_range(out, max_ranges, n, base + c0 * row_bytes * run.bits, share);
      }
    }
  }
  EXL2_REQUIRE(room, "exl2_gemv_lookahead_ranges: more than %d ranges", max_ranges);
  *count = n;
  return EXL2_OK;
}
