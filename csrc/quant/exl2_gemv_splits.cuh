// Host: the small-M GEMV's per-run split counts balanced by bytes (TMA kernel, sm_90+).
//
// A launch's blocks are (descriptor, column block, split) items; a split never crosses a width run, so every run
// of every column block gets its own splits. The proportional rule of exl2_gemm.cu (each run floor(ksplit x its
// share of the bytes), at least 1) leaves short runs with whole-run items: the 8B's MLP at 4.0 bpw (gate 4:0.1
// 3:0.9, up 4:0.25 3:0.75, down 8:0.05 4:0.95) gets gate/up items of 48-348 KB and down items of 122-176 KB. A
// block streams about ring bytes per memory latency whatever the others do (~16 GB/s with the 32 KB ring), so
// the launch lasts as long as its longest item. H200 call U1 of 2026-12-02: gate/up took 31.9 us per launch for
// 61 MB (17.3 us past streaming at the read bandwidth), down 14.3 for 32 MB (6.7 past).
//
// balance_run_splits() starts from the proportional counts and gives one more split to the run with the longest
// item (chunks per split x bits) while the launch stays within `slots` blocks and each descriptor within the
// workspace's ksplit + kMaxRuns partials; it stops when the longest item's run can take no more.
#pragma once

#include <algorithm>

#include "quant/exl2_gemv.cuh"

namespace exl2q {

// The proportional rule: each run gets ksplit x its share of the bytes (chunks x bits), at least 1 and at most its
// chunks; the total can exceed ksplit by up to nruns - 1 (the workspace allows kMaxRuns more). Fills rbase[0..nruns]
// and raises maxnch to the longest split's chunks; returns the total.
inline int proportional_run_splits(const QDesc& d, int* rbase, int& maxnch) {
  const long long w = total_weight(d);
  int total = 0;
  for (int r = 0; r < d.nruns; ++r) {
    const Run& rr = d.runs[r];
    const int nr = rr.chunk_end - rr.chunk_start;
    const int k = (int)std::min<long long>(nr, std::max<long long>(1, (long long)d.ksplit * nr * rr.bits / w));
    rbase[r] = total;
    total += k;
    maxnch = std::max(maxnch, (nr + k - 1) / k);
  }
  rbase[d.nruns] = total;
  return total;
}

// Longest item of run r with k splits, in chunk-bits (a full column block's chunk of b bits is 2 KB x b).
inline long long run_item_cost(const Run& r, int k) {
  const int nr = r.chunk_end - r.chunk_start;
  return (long long)((nr + k - 1) / k) * r.bits;
}

// Rebalances p.rbase (and every descriptor's block_start) within `slots` blocks; `blocks` and `maxnch` are the
// launch's totals, recomputed. Descriptors without split-K storage (no workspace or counters) keep their splits.
inline void balance_run_splits(GemvParams& p, int slots, int& blocks, int& maxnch) {
  int k[kMaxDesc][kMaxRuns], total[kMaxDesc];
  for (int i = 0; i < p.ndesc; ++i) {
    for (int r = 0; r < p.d[i].nruns; ++r) k[i][r] = p.rbase[i][r + 1] - p.rbase[i][r];
    total[i] = p.rbase[i][p.d[i].nruns];
  }
  int items = blocks;
  for (;;) {
    int wi = 0, wr = 0;
    long long worst = -1;
    for (int i = 0; i < p.ndesc; ++i)
      for (int r = 0; r < p.d[i].nruns; ++r)
        if (const long long c = run_item_cost(p.d[i].runs[r], k[i][r]); c > worst) {
          worst = c;
          wi = i;
          wr = r;
        }
    const QDesc& d = p.d[wi];
    const Run& run = d.runs[wr];
    const bool can_split = d.ws && d.counters && k[wi][wr] < run.chunk_end - run.chunk_start &&
                           total[wi] + 1 <= d.ksplit + kMaxRuns && items + d.ncolblk <= slots;
    if (!can_split) break;  // more splits elsewhere would not shorten the launch
    ++k[wi][wr];
    ++total[wi];
    items += d.ncolblk;
  }
  blocks = 0;
  maxnch = 1;
  for (int i = 0; i < p.ndesc; ++i) {
    QDesc& d = p.d[i];
    int acc = 0;
    for (int r = 0; r < d.nruns; ++r) {
      p.rbase[i][r] = acc;
      acc += k[i][r];
      const int nr = d.runs[r].chunk_end - d.runs[r].chunk_start;
      maxnch = std::max(maxnch, (nr + k[i][r] - 1) / k[i][r]);
    }
    p.rbase[i][d.nruns] = acc;
    d.block_start = blocks;
    blocks += d.ncolblk * acc;
  }
}

// Span splits (GemvParams::span): every descriptor's ksplit splits of equal bytes over all its runs, fewer where
// a split would be empty (fewer chunks than splits at the widest run). Fills rbase (0 for every run, the split
// count at nruns) and every descriptor's block_start; returns the launch's blocks and sets maxnch.
inline int span_splits(GemvParams& p, int& maxnch) {
  int blocks = 0;
  maxnch = 1;
  for (int i = 0; i < p.ndesc; ++i) {
    QDesc& d = p.d[i];
    int k = d.ksplit, most = 1;
    if (d.nruns == 1) {  // the device takes the per-run walk (gv_work_at): equal chunk shares of the one run
      k = std::min(k, d.C);
      most = (d.C + k - 1) / k;
    }
    for (; k > 1 && d.nruns > 1; --k) {  // the most splits <= ksplit with none empty
      bool empty = false;
      most = 1;
      for (int s = 0; s < k && !empty; ++s) {
        int c0, c1, r0, r1;
        span_range(d, s, k, c0, c1, r0, r1);
        empty = c1 <= c0;
        most = std::max(most, c1 - c0);
      }
      if (!empty) break;
    }
    if (k == 1) most = d.C;  // (one run: ceil(C / 1))
    for (int r = 0; r < d.nruns; ++r) p.rbase[i][r] = 0;
    p.rbase[i][d.nruns] = k;
    d.block_start = blocks;
    blocks += d.ncolblk * k;
    maxnch = std::max(maxnch, most);
  }
  return blocks;
}

// Chunk-bits of the longest item of a plan (one column block's chunk of b bits is 2 KB x b).
inline long long longest_item(const GemvParams& p) {
  long long most = 0;
  for (int i = 0; i < p.ndesc; ++i) {
    const QDesc& d = p.d[i];
    const int k = p.rbase[i][d.nruns];
    const bool spans = p.span && d.nruns > 1;  // one run: gv_work_at's per-run walk
    for (int s = 0; s < (spans ? k : 0); ++s) {
      int c0, c1, r0, r1;
      span_range(d, s, k, c0, c1, r0, r1);
      long long bits = 0;
      for (int r = r0; r < r1; ++r)
        bits += (long long)(std::min(c1, d.runs[r].chunk_end) - std::max(c0, d.runs[r].chunk_start)) * d.runs[r].bits;
      most = std::max(most, bits);
    }
    for (int r = 0; r < (spans ? 0 : d.nruns); ++r)
      most = std::max(most, run_item_cost(d.runs[r], p.rbase[i][r + 1] - p.rbase[i][r]));
  }
  return most;
}

// Span splits instead of the per-run plan in p when they pay: when the per-run plan needs more blocks than the
// launch's `slots` (several waves: the 8B's head, 1,002 items of one run each against 501 span items), or when
// they shorten the longest item by 15% or more (the 8B's mixed 3/4-bit gate/up: 106 against 174 chunk-bits, one
// item per column block and run). Elsewhere the per-run plan stays (as short, and its blocks find their chunk
// range without walking the runs: V2/V3 of 2026-12-03 put that walk at +0.6-0.9 us per launch).
inline void take_span_if_it_pays(GemvParams& p, int slots, int& blocks, int& maxnch) {
  GemvParams q = p;
  int q_maxnch = 1;
  q.span = 1;
  const int q_blocks = span_splits(q, q_maxnch);
  const bool waves = slots > 0 && blocks > slots && q_blocks < blocks;
  if (!waves && 100 * longest_item(q) > 85 * longest_item(p)) return;
  p = q;
  blocks = q_blocks;
  maxnch = q_maxnch;
}

// The split plan past the proportional one, shared by exl2_gemv's planner and the host-only exl2_gemv_splits: per-run
// splits balanced within `slots` blocks (slots > 0), then span splits where they pay (span: F_SPAN may select them).
inline void refine_splits(GemvParams& p, const int64_t* blob, int slots, bool span, int& blocks, int& maxnch) {
  if (slots > 0) balance_run_splits(p, slots, blocks, maxnch);
  if (span && blob[F_SPAN]) take_span_if_it_pays(p, slots, blocks, maxnch);
}

// The most quantization groups a split of `maxnch` chunks touches, which the TMA GEMV stages the scales of: at most
// two group ends per chunk, and at most one more than its rows over the part's smallest group (F_GROUP_ROWS; a
// split may start inside a group); the most of any part. The 8B's 6-bit head (groups of 128 rows, 54-chunk
// splits): 109 -> 28 groups, 56 -> 14 KB of shared memory per block.
inline int staged_groups(const int64_t* blob, int ndesc, int maxnch) {
  int most = 1;
  for (int i = 0; i < ndesc; ++i) {
    const int64_t gmin = blob[(size_t)i * kDescLen + F_GROUP_ROWS];
    const int by_rows = gmin > 0 ? (int)((maxnch * kChunkRows + gmin - 1) / gmin) + 1 : 2 * maxnch + 1;
    most = std::max(most, std::min(2 * maxnch + 1, by_rows));
  }
  return most;
}

}  // namespace exl2q
