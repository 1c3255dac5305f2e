// Read bandwidth of the GEMV's weight-streaming pattern without the GEMV (a device-call diagnostic, not part of
// the library): every block streams its own contiguous share of a buffer through a shared-memory ring of bulk
// copies (one producer lane, mbarrier full/empty pairs, 8 consumer warps that touch each slot and release it), as
// the TMA GEMV does; against plain 16-byte loads with 8 in flight per thread. Sizes from one 8B-layer phase
// (o_proj 8.4 MB, gate/up 58.7 MB) to 1 GiB; buffers rotate past the 50 MB L2. Prints GB/s per launch
// (back-to-back launches, the launch gap included) for each configuration.
//
//   nvcc -O3 -std=c++17 -I csrc -gencode arch=compute_90a,code=sm_90a -o stream_bench \
//     scripts/device/stream_bench.cu && ./stream_bench
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "quant/exl2_gemv_tma.cuh"  // the GEMV's own mbarrier and bulk-copy steps

constexpr int kConsumerWarps = 8;
constexpr int kMaxSlots = 16;

// Block b streams bytes [b * per_block, (b + 1) * per_block) in copies of `copy` bytes through `slots` slots.
__global__ void __launch_bounds__(32 * (kConsumerWarps + 1)) tma_stream(const char* src, size_t per_block, int copy,
                                                                        int slots, unsigned* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace exl2q;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t bars = smem_addr(smem);  // full[kMaxSlots], empty[kMaxSlots], 8 bytes each
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kMaxSlots + s); };
  unsigned char* ring = smem + 2 * kMaxSlots * 8 + 128 - (2 * kMaxSlots * 8) % 128;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const char* base = src + (size_t)blockIdx.x * per_block;
  const int n = (int)(per_block / copy);
  if (warp == kConsumerWarps) {
    if (lane == 0) {
      const uint64_t pol = evict_first_policy();
      for (int i = 0; i < n; ++i) {
        const int s = i % slots;
        if (i >= slots) mbar_wait(empty(s), ((i / slots) - 1) & 1);
        mbar_expect_tx(full(s), copy);
        bulk_copy(smem_addr(ring + (size_t)s * copy), base + (size_t)i * copy, copy, full(s), pol);
      }
    }
    return;
  }
  unsigned acc = 0;
  const int part = copy / kConsumerWarps;  // each warp reads its share of the slot, 16 bytes per lane per step
  for (int i = 0; i < n; ++i) {
    const int s = i % slots;
    mbar_wait(full(s), (i / slots) & 1);
    const uint4* p = reinterpret_cast<const uint4*>(ring + (size_t)s * copy + warp * part);
    for (int j = lane; j < part / 16; j += 32) {
      const uint4 v = p[j];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(s));
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the reads
#endif
}

// Plain loads: 256 threads, kU 16-byte loads in flight per thread, the block's contiguous share.
template <int kU>
__global__ void __launch_bounds__(256) ldg_stream(const uint4* src, size_t per_block, unsigned* out) {
  const uint4* p = src + (size_t)blockIdx.x * (per_block / 16);
  const size_t n = per_block / 16;
  unsigned acc = 0;
  for (size_t i = threadIdx.x; i < n; i += 256 * kU) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = i + u * 256 < n ? __ldcs(p + i + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kU; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t kBufs = 8, kMaxBytes = (size_t)1 << 30;
  const std::vector<size_t> sizes = {8u << 20, 29u << 20, 58u << 20, 256u << 20, kMaxBytes};
  std::vector<char*> bufs(kBufs);
  for (auto& b : bufs) {
    CHECK(cudaMalloc(&b, kMaxBytes + (1 << 20)));
    CHECK(cudaMemset(b, 1, kMaxBytes + (1 << 20)));
  }
  unsigned* out;
  CHECK(cudaMalloc(&out, 4));
  CHECK(cudaFuncSetAttribute(tma_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  printf("SMs %d; GB/s per launch (back-to-back, %zu rotating buffers)\n", sms, kBufs);
  printf("%-34s", "config \\ MB");
  for (size_t s : sizes) printf("%10zu", s >> 20);
  printf("\n");
  auto run = [&](const char* name, auto launch) -> int {
    printf("%-34s", name);
    for (size_t bytes : sizes) {
      const int reps = bytes >= kMaxBytes ? 10 : 80;
      for (int w = 0; w < 3; ++w) launch(bufs[w % kBufs], bytes);
      CHECK(cudaEventRecord(a));
      for (int r = 0; r < reps; ++r) launch(bufs[r % kBufs], bytes);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      CHECK(cudaGetLastError());
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      printf("%10.0f", bytes / (ms * 1e-3 / reps) / 1e9);
    }
    printf("\n");
    return 0;
  };
  for (int per_sm : {1, 2}) {
    for (int slots : {2, 4, 8}) {
      for (int copy : {8192, 16384}) {
        if (slots * copy * per_sm > 200 * 1024) continue;
        char name[64];
        snprintf(name, sizeof name, "tma %d/SM, %d x %d KB", per_sm, slots, copy / 1024);
        const int grid = per_sm * sms;
        const int smem = 2 * kMaxSlots * 8 + 128 + slots * copy;
        if (run(name, [&](char* src, size_t bytes) {
              const size_t per = bytes / grid / copy * copy;
              tma_stream<<<grid, 32 * (kConsumerWarps + 1), smem>>>(src, per, copy, slots, out);
            }))
          return 1;
      }
    }
  }
  for (int per_sm : {2, 4, 8}) {
    char name[64];
    snprintf(name, sizeof name, "ldg %d/SM x 256 thr, 8 in flight", per_sm);
    const int grid = per_sm * sms;
    if (run(name, [&](char* src, size_t bytes) {
          const size_t per = bytes / grid / 16 * 16;
          ldg_stream<8><<<grid, 256>>>(reinterpret_cast<const uint4*>(src), per, out);
        }))
      return 1;
  }
  return 0;
}
