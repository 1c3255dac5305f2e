// Read bandwidth of the decode attention's K/V access pattern without the attention (a device-call diagnostic, not
// part of the library). One layer's fp16 cache of the 8B shape at `ctx` keys: pages of 256 slots, each slot 8 kv
// heads x 128 dims x 2 bytes = 2 KB of K (and the same of V). Two ways to read all of it with the same CTA count:
//   per head:  CTA (split, head) reads its split's keys of one head: 256-byte rows 2 KB apart (the attention
//              kernels' pattern, grid (nsplit, Hkv));
//   all heads: CTA i reads a split of 1/Hkv the keys for every head: whole 2 KB slots, contiguous.
// Each thread keeps `kInFlight` 16-byte loads in flight; buffers rotate over 4 layers (past the 50 MB L2). Prints
// us and GB/s per launch (back-to-back launches) for each pattern and CTA count. If the per-head pattern is much
// slower, the attention's CTA-to-head mapping costs DRAM efficiency; if not, its time is the kernel's own latency.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o kv_stream_bench scripts/device/kv_stream_bench.cu
//   ./kv_stream_bench [ctx=32768]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cuda_check.h"

constexpr int kHkv = 8, kRowBytes = 256, kSlotBytes = kHkv * kRowBytes;  // one slot: every head's row
constexpr int kThreads = 128, kInFlight = 8, kLayers = 4;

// Per head: CTA (split, head) reads rows [t0, t1) of head `head` in K and V. A thread's 16-byte piece p of row t:
// 16 pieces per row: 16 threads per row, 8 rows per round of the 128 threads.
__global__ void __launch_bounds__(kThreads) per_head(const uint4* k, const uint4* v, int ctx, int nsplit,
                                                     unsigned* sink) {
  const int split = blockIdx.x, head = blockIdx.y;
  const int len = (ctx + nsplit - 1) / nsplit, t0 = split * len, t1 = min(ctx, t0 + len);
  constexpr int kPieces = kRowBytes / 16, kRowsPerRound = kThreads / kPieces;
  const int piece = threadIdx.x % kPieces, r = threadIdx.x / kPieces;
  uint32_t acc = 0;
  for (int t = t0 + r; t < t1; t += kRowsPerRound * kInFlight) {
    uint4 a[kInFlight], b[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int tt = t + i * kRowsPerRound;
      const size_t idx = ((size_t)tt * kSlotBytes + head * kRowBytes) / 16 + piece;
      a[i] = tt < t1 ? __ldcs(k + idx) : make_uint4(0, 0, 0, 0);
      b[i] = tt < t1 ? __ldcs(v + idx) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) acc ^= a[i].x ^ a[i].w ^ b[i].y ^ b[i].z;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
}

// All heads: CTA i reads whole slots [t0, t1) of K and V (contiguous 2 KB each).
__global__ void __launch_bounds__(kThreads) all_heads(const uint4* k, const uint4* v, int ctx, int nctas,
                                                      unsigned* sink) {
  const int i = blockIdx.x;
  const size_t total = (size_t)ctx * kSlotBytes / 16;  // 16-byte pieces
  const size_t per = (total + nctas - 1) / nctas, p0 = i * per, p1 = p0 + per < total ? p0 + per : total;
  uint32_t acc = 0;
  for (size_t p = p0 + threadIdx.x; p < p1; p += (size_t)kThreads * kInFlight) {
    uint4 a[kInFlight], b[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const size_t q = p + (size_t)j * kThreads;
      a[j] = q < p1 ? __ldcs(k + q) : make_uint4(0, 0, 0, 0);
      b[j] = q < p1 ? __ldcs(v + q) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) acc ^= a[j].x ^ a[j].w ^ b[j].y ^ b[j].z;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

int main(int argc, char** argv) {
  const int ctx = argc > 1 ? atoi(argv[1]) : 32768;
  const size_t bytes = (size_t)ctx * kSlotBytes;  // K (or V) of one layer
  uint4 *k[kLayers], *v[kLayers];
  unsigned* sink;
  for (int l = 0; l < kLayers; ++l) {
    CHECK(cudaMalloc(&k[l], bytes));
    CHECK(cudaMalloc(&v[l], bytes));
    CHECK(cudaMemset(k[l], l + 1, bytes));
    CHECK(cudaMemset(v[l], l + 2, bytes));
  }
  CHECK(cudaMalloc(&sink, 4));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  printf("ctx %d: %.1f MB of K + V per layer, %d SMs\n", ctx, 2.0 * bytes / 1e6, sms);
  for (int ctas_per_sm : {2, 3, 4, 8}) {
    const int nsplit = sms * ctas_per_sm / kHkv, nctas = nsplit * kHkv;
    for (int pattern = 0; pattern < 2; ++pattern) {
      auto launch = [&](int l) {
        if (pattern == 0) per_head<<<dim3(nsplit, kHkv), kThreads>>>(k[l], v[l], ctx, nsplit, sink);
        else all_heads<<<nctas, kThreads>>>(k[l], v[l], ctx, nctas, sink);
      };
      for (int l = 0; l < kLayers; ++l) launch(l);  // warm-up
      constexpr int kReps = 20;
      CHECK(cudaEventRecord(e0));
      for (int i = 0; i < kReps; ++i) launch(i % kLayers);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      const double us = 1e3 * ms / kReps;
      printf("%-9s ctas/SM %d (%4d CTAs): %8.2f us  %7.1f GB/s\n", pattern ? "all heads" : "per head", ctas_per_sm,
             nctas, us, 2.0 * bytes / us / 1e3);
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
