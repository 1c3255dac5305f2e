// The bound of a persistent decode kernel's weight streaming (a device-call diagnostic, not part of the library).
//
// Issue 3 asks for 80% of the HBM roofline at batch 1; the launch-per-GEMV decode step streams the 8B's GEMV weights
// at ~57% of the H100's read bandwidth, and sessions 9-36 traced the rest to every launch boundary (the next
// GEMV's input stage, split-K finish and tail: ~8-10 us per GEMV, docs/performance.md). A persistent kernel keeps
// streaming through a boundary only as far as its shared-memory ring reaches. This program measures how far that
// is, with the real amount of data and the real dependency count, but without the GEMV arithmetic:
//
// - one launch streams a whole 8B decode step's GEMV weights (32 layers x q/k/v 12.6 MB, o 8.4 MB, gate/up
//   58.7 MB, down 29.4 MB = 3.49 GB) in 8 KB bulk copies (one 4-bit chunk of a 256-column block) through a ring
//   per block, one producer lane ahead of 8 consumer warps, as the TMA GEMV does (exl2_gemv_tma.cuh);
// - phases (128) depend on each other all-to-all, the worst case of the real step (the norms need every column):
//   when a block has consumed its share of phase p, it writes its part of phase p's output vector, then takes a
//   ticket; its consumers start phase p + 1 only when every block's ticket of phase p is in, and after loading
//   the whole input vector (`in_kb`, from L2: a norm's h, residual and weight) into shared memory. The producer
//   never waits for a dependency (weights are constants): it runs ahead as far as the ring holds;
// - `work` ALU operations per 32-bit word stand for the dequantization and the products (the real kernel's
//   4-bit M = 1 inner loop is ~12 instructions per word).
//
// It prints, per configuration, the step's streaming time, GB/s and the ratio to two ceilings measured in the same
// run: a plain read of the same bytes (16-byte loads) and the same ring with no dependencies. If the dependent
// ring at some depth comes within ~10% of the ring without dependencies, a persistent decode can approach the
// streaming ceiling; the gap that remains per boundary, times 128, is what such a kernel would still pay.
//
// Beside it, the library's own design with the same bytes: one launch per phase (phase_launch, 128 launches with
// programmatic dependent launch in a CUDA graph), first bare, then with the real GEMV's parts added one at a time
// (its work items, the split-K finish, staged scales, the real inputs), so the difference between this bound and
// the library's GEMVs is attributed part by part.
//
//   nvcc -O3 -std=c++17 -I csrc -gencode arch=compute_90a,code=sm_90a -o persistent_bound \
//     scripts/device/persistent_bound.cu && ./persistent_bound
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/bulk_copy.cuh"
#include "cuda_check.h"

constexpr int kWarps = 8;               // consumer warps
constexpr int kThreads = 32 * (kWarps + 1);
constexpr int kCopy = 8192;             // bytes per bulk copy (kWarps x 1 KB)
constexpr int kMaxSlots = 32;
constexpr int kLayers = 32;
constexpr int kPhasesPerLayer = 4;
constexpr int kPhases = kLayers * kPhasesPerLayer;
constexpr int kVecElems = 32768;       // halves per output vector buffer (two: phases alternate)
constexpr long long kTimeoutCycles = 4000000000LL;  // ~2 s: a wait that long means a bug; the run reports it

// persistent_stream's phase dependency. kSyncOne: one ticket word per phase, a fence and a release reduction per
// block, thread 0 polling with acquire loads (the first form). kSyncRelease: the same without the fence (the
// reduction's release orders the block's stores). kSyncSpread: eight ticket words per phase on separate 128-byte
// lines (block b adds to word b % 8), eight lanes polling one each with relaxed loads and a back-off, then one
// acquire fence: fewer arrivals queue on one word and fewer polls hammer it.
enum Sync { kSyncOne = 0, kSyncRelease = 1, kSyncSpread = 2 };
constexpr int kTicketStride = 256;  // uint32 words of tickets per phase (8 lines of 128 bytes in use)

// One 8B layer's GEMV weight bytes at 4.0 bpw (q/k/v, o, gate/up, down), rounded to whole copies.
constexpr long long kPhaseBytes[kPhasesPerLayer] = {12582912, 8388608, 58720256, 29360128};

struct Params {
  const unsigned char* weights;  // the phases' weights, back to back
  long long phase_off[kPhases + 1];
  unsigned int* tickets;         // [kPhases][kTicketStride], zeroed before each launch
  __half* vec;                   // [2][kVecElems]: phase p writes vec[p & 1], phase p + 1 reads it
  int in_elems;                  // elements of the input vector every block loads per phase (in_kb * 512)
  int slots;                     // ring slots of kCopy bytes
  int deps;                      // 0: no dependencies (the streaming ceiling)
  int sync;                      // persistent_stream's dependency: kSync*
  int input_tma;                 // persistent_stream: the input vector by one bulk copy into shared memory
  int work;                      // ALU operations per 32-bit word
  int ph;                        // phase_launch: this launch's phase
  int features;                  // phase_launch: Feature bits
  const unsigned short* xmap;    // [14336] a permutation (the gathered input's row order)
  float* partials;               // [2][112][16][256] split-K partials
  unsigned int* counters;        // [2][128] split-K tickets, re-armed by the last block of each column block
  long long* fixed;              // [3][kVecElems] kFixed: 64-bit fixed-point outputs
  unsigned int* failed;          // set when a wait timed out
  float* sink;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using namespace exl2;

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory"); }

// mbar_wait with a bound: false (and the failure flag) after kTimeoutCycles.
__device__ __forceinline__ bool bounded_wait(uint32_t bar, uint32_t parity, unsigned int* failed) {
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - t0 > kTimeoutCycles) {
      atomicOr(failed, 1u);
      return false;
    }
  return true;
}

__device__ __forceinline__ void chunk_range(const Params& p, int ph, int& c0, int& c1) {
  const long long n = (p.phase_off[ph + 1] - p.phase_off[ph]) / kCopy;
  c0 = (int)(n * blockIdx.x / gridDim.x);
  c1 = (int)(n * (blockIdx.x + 1) / gridDim.x);
}

// Thread 0 initializes the ring's full / empty barriers and one more (the input's or the scales'); the block syncs.
template <typename Full, typename Empty>
__device__ __forceinline__ void init_ring(Full full, Empty empty, int slots, uint32_t extra) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kWarps);
    }
    mbar_init(extra, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// Consumers: `bytes` of the input vector from L2 (16-byte loads through L2, eight per thread in flight before any
// is used, as the library's norm loads), summed over the block; every warp then depends on every load (red:
// [kWarps] floats of shared memory).
__device__ __forceinline__ float load_input(const void* vec, int bytes, float* red) {
  constexpr int kInFlight = 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* in = reinterpret_cast<const uint4*>(vec);
  const int n = bytes / 16;
  float s = 0.f;
  for (int v0 = threadIdx.x; v0 < n; v0 += kInFlight * kWarps * 32) {
    uint4 x[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int v = v0 + u * kWarps * 32;
      x[u] = v < n ? __ldcg(in + v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) s += __uint_as_float((x[u].x ^ x[u].y ^ x[u].z ^ x[u].w) & 0x3f7fffffu);
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) red[warp] = s;
  consumers_sync();
  const float r = red[(warp + 1) % kWarps];
  consumers_sync();  // red is reused
  return r;
}

// Consumers: ring entry i (slot i % slots): wait for it, read the warp's 1 KB, release the slot, then `work` FMAs
// per 32-bit word. False when the wait timed out.
template <typename Full, typename Empty>
__device__ __forceinline__ bool consume_chunk(const Params& p, const unsigned char* ring, Full full, Empty empty,
                                              int i, float& acc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = i % p.slots;
  if (!bounded_wait(full(s), (i / p.slots) & 1, p.failed)) return false;
  const uint4* w = reinterpret_cast<const uint4*>(ring + (size_t)s * kCopy + warp * 1024) + 2 * lane;
  const uint4 a = w[0], b = w[1];
  __syncwarp();
  if (lane == 0) mbar_arrive(empty(s));
  const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  float part[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) part[k] = __uint_as_float((words[k] & 0x007fffffu) | 0x3f800000u);
  for (int j = 0; j < p.work; ++j)
#pragma unroll
    for (int k = 0; k < 8; ++k) part[k] = fmaf(part[k], 0.999f, 1e-3f);
#pragma unroll
  for (int k = 0; k < 8; ++k) acc += part[k];
  return true;
}

// Consumers: this block's share of a phase's output vector (the whole vector over the grid).
__device__ __forceinline__ void write_share(__half* out, int elems, float acc) {
  const int per = (elems + gridDim.x - 1) / gridDim.x;
  for (int e = threadIdx.x; e < per; e += kWarps * 32) {
    const int idx = blockIdx.x * per + e;
    if (idx < elems) out[idx] = __float2half(acc * 1e-6f + (float)e);
  }
}
#endif

__global__ void __launch_bounds__(kThreads) persistent_stream(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t bars = smem_addr(smem);
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kMaxSlots + s); };
  float* red = reinterpret_cast<float*>(smem + 2 * kMaxSlots * 8);  // [kWarps]
  unsigned char* ring = smem + 1024;
  unsigned char* input = ring + (size_t)p.slots * kCopy;  // input_tma: [in_elems] halves
  const uint32_t input_bar = bars + 8 * 2 * kMaxSlots;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  init_ring(full, empty, p.slots, input_bar);
  if (warp == kWarps) {  // the producer: every phase's share back to back, never waiting for a dependency
    if (lane != 0) return;
    const uint64_t pol = evict_first_policy();
    int i = 0;
    for (int ph = 0; ph < kPhases; ++ph) {
      int c0, c1;
      chunk_range(p, ph, c0, c1);
      const unsigned char* src = p.weights + p.phase_off[ph];
      for (int c = c0; c < c1; ++c, ++i) {
        const int s = i % p.slots;
        if (i >= p.slots && !bounded_wait(empty(s), ((i / p.slots) - 1) & 1, p.failed)) return;
        mbar_expect_tx(full(s), kCopy);
        bulk_copy(smem_addr(ring + (size_t)s * kCopy), src + (size_t)c * kCopy, kCopy, full(s), pol);
      }
    }
    return;
  }
  float acc = 0.f;
  int i = 0;
  for (int ph = 0; ph < kPhases; ++ph) {
    if (p.deps && ph > 0) {
      // Phase ph - 1 complete everywhere (its tickets), then the whole input vector from L2 into the block.
      const unsigned int* t = p.tickets + (size_t)(ph - 1) * kTicketStride;
      if (p.sync == kSyncSpread) {
        if (warp == 0 && lane < 8) {
          const unsigned int want = (gridDim.x - lane + 7) / 8;  // blocks b with b % 8 == lane
          const long long t0 = clock64();
          unsigned int got;
          for (;;) {
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(got) : "l"(t + lane * 32) : "memory");
            if (got >= want) break;
            if (clock64() - t0 > kTimeoutCycles) {
              atomicOr(p.failed, 1u);
              break;
            }
            __nanosleep(32);
          }
          asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
      } else if (threadIdx.x == 0) {
        const long long t0 = clock64();
        unsigned int got;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(got) : "l"(t) : "memory");
          if (clock64() - t0 > kTimeoutCycles) {
            atomicOr(p.failed, 1u);
            break;
          }
        } while (got < gridDim.x);
      }
      const __half* in = p.vec + (size_t)((ph - 1) & 1) * kVecElems;
      if (p.input_tma) {  // one bulk copy of the input into shared memory, then the block sums it there
        if (threadIdx.x == 0) {
          asm volatile("fence.proxy.async.global;" ::: "memory");  // generic-proxy writes seen by the copy
          mbar_expect_tx(input_bar, 2 * p.in_elems);
          bulk_copy(smem_addr(input), in, 2 * p.in_elems, input_bar, evict_first_policy());
        }
        if (!bounded_wait(input_bar, (ph - 1) & 1, p.failed)) return;
        float x = 0.f;
        const uint4* v = reinterpret_cast<const uint4*>(input);
        for (int e = threadIdx.x; e < p.in_elems / 8; e += kWarps * 32) {
          const uint4 u = v[e];
          x += __uint_as_float((u.x ^ u.y ^ u.z ^ u.w) & 0x3f7fffffu);
        }
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (lane == 0) red[warp] = x;
        consumers_sync();
        acc += red[(warp + 1) % kWarps];
        consumers_sync();
      } else {
        consumers_sync();
        acc += load_input(in, 2 * p.in_elems, red);
      }
    }
    int c0, c1;
    chunk_range(p, ph, c0, c1);
    for (int c = c0; c < c1; ++c, ++i)
      if (!consume_chunk(p, ring, full, empty, i, acc)) return;
    if (p.deps) {
      write_share(p.vec + (size_t)(ph & 1) * kVecElems, p.in_elems, acc);
      consumers_sync();
      if (threadIdx.x == 0) {  // the ticket (release: this block's stores before it)
        unsigned int* t = p.tickets + (size_t)ph * kTicketStride + (p.sync == kSyncSpread ? (blockIdx.x % 8) * 32 : 0);
        if (p.sync == kSyncOne) asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(t), "r"(1u) : "memory");
      }
    }
  }
  if (acc == 12345.f) p.sink[0] = acc;  // keeps the arithmetic
#endif
}

// The library's plan for the 8B at M = 1 (exl2_gemv_chain's printout of one layer: 264 / 256 / 224 / 256 items):
// per phase the column blocks of 256 outputs and the split-K pieces of each; K rows; whether the input is the
// normalized residual stream (q/k/v, gate/up: h, residual and the norm weight from L2) or gathered rows (o, down:
// the item's K rows through the activation permutation).
__constant__ int kColBlocks[kPhasesPerLayer] = {24, 16, 112, 16};
__constant__ int kSplits[kPhasesPerLayer] = {11, 16, 2, 16};
__constant__ int kRowsK[kPhasesPerLayer] = {4096, 4096, 4096, 14336};
__constant__ bool kNormInput[kPhasesPerLayer] = {true, false, true, false};
constexpr int kScaleGroupRows = 128;  // rows per scale group (512 bytes of scales per group and column block)
constexpr int kMaxItemRows = 1536;    // the largest gathered K slice (down: 14336 / 16 = 896 rows)
enum Feature { kItems = 1, kFinish = 2, kScales = 4, kInputs = 8, kFixed = 16, kLeft = 32 };
constexpr int kPhaseRingOffset = 1024 + 2 * kMaxItemRows + 12288;  // 16 KB

// One phase per launch, as the library runs a decode step (programmatic dependent launch, captured in a graph):
// the producer issues its first ring fill before waiting for the previous launch, the consumers wait, load the
// input, consume, and write their output. `features` adds the library GEMV's parts one at a time:
//   kItems  the plan's work items (column block x split): 224 on 264 blocks for gate/up, the rest idle;
//   kFinish split-K: every item stores its 256 partial sums, takes its column block's ticket, the last one sums the
//           column block's partials in split order and writes 256 outputs (the next phase's input);
//   kScales the item's group scales staged by a bulk copy before the ring's first fill, waited for before the
//           first chunk;
//   kInputs the real inputs: q/k/v and gate/up load 24 KB (the norm's rows), o and down their K slice (o through
//           the activation permutation, down in order; slice indices loaded before the wait, then one dependent
//           2-byte load per row);
//   kFixed  (a candidate, not the library) o, gate/up and down finish without a ticket: each item adds its 256
//           partial sums as 64-bit fixed-point integers into the output (red.add, no wait; integer sums do not
//           depend on the order, so the result stays deterministic), the next phase reads the 64-bit sums (the
//           norm's h 32 KB instead of 8 KB, down's gather two 8-byte loads per row) and zeroes the buffer that
//           the phase after it adds into (three buffers in turn). q/k/v keeps its ticket (its finish applies the
//           rope and writes the KV cache);
//   kLeft   (a candidate, not the library) gate/up leaves its two split-K partials in place (no ticket, no sum:
//           they stay in a workspace of their own) and down's gather sums them, in split order, for gate and up
//           of each of its rows (four 4-byte loads per row instead of the 2-byte one): bit-identical to the
//           finish it replaces.
// Without a feature: even chunk ranges over every block, the 24 KB input, each block writing its share.
__global__ void __launch_bounds__(kThreads) phase_launch(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint32_t bars = smem_addr(smem);
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kMaxSlots + s); };
  const uint32_t scale_bar = bars + 8 * 2 * kMaxSlots;
  float* red = reinterpret_cast<float*>(smem + 2 * kMaxSlots * 8 + 16);  // [kWarps]
  int* s_last = reinterpret_cast<int*>(smem + 2 * kMaxSlots * 8 + 16 + 4 * kWarps);
  unsigned short* xm = reinterpret_cast<unsigned short*>(smem + 1024);        // [kMaxItemRows]
  const float* scl = reinterpret_cast<const float*>(smem + 1024 + 2 * kMaxItemRows);  // [<= 12 KB]
  unsigned char* ring = smem + kPhaseRingOffset;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ph = p.ph, role = ph % kPhasesPerLayer;
  const bool items = p.features & kItems;
  const int nitems = items ? kColBlocks[role] * kSplits[role] : gridDim.x;
  if ((int)blockIdx.x >= nitems) return;
  const int item = blockIdx.x;
  const long long n = (p.phase_off[ph + 1] - p.phase_off[ph]) / kCopy;
  const int c0 = (int)(n * item / nitems), c1 = (int)(n * (item + 1) / nitems);
  const int split = item % kSplits[role], colblk = item / kSplits[role];
  const int krows = kRowsK[role] / kSplits[role];  // the item's K slice
  const int scale_bytes = ((krows + kScaleGroupRows - 1) / kScaleGroupRows + 1) * 512;
  init_ring(full, empty, p.slots, scale_bar);
  const unsigned char* src = p.weights + p.phase_off[ph];
  if (warp == kWarps) {
    if (lane != 0) return;
    const uint64_t pol = evict_first_policy();
    if (p.features & kScales) {  // any bytes of the right size: the weights' first ones stand for the scales
      mbar_expect_tx(scale_bar, scale_bytes);
      bulk_copy(smem_addr(scl), src + (size_t)split * scale_bytes, scale_bytes, scale_bar, pol);
    }
    for (int c = c0, i = 0; c < c1; ++c, ++i) {
      const int s = i % p.slots;
      if (i == p.slots) asm volatile("griddepcontrol.wait;" ::: "memory");
      if (i >= p.slots && !bounded_wait(empty(s), ((i / p.slots) - 1) & 1, p.failed)) return;
      mbar_expect_tx(full(s), kCopy);
      bulk_copy(smem_addr(ring + (size_t)s * kCopy), src + (size_t)c * kCopy, kCopy, full(s), pol);
    }
    return;
  }
  const bool real_inputs = p.features & kInputs;
  const bool gathered = real_inputs && !kNormInput[role];
  if (gathered) {  // the slice's permutation indices: constants, before the wait
    // o reads through the activation permutation; down in order (the library folds down's order into gate/up's
    // output columns, so its gather reads neighbouring features)
    for (int r = threadIdx.x; r < krows; r += kWarps * 32)
      xm[r] = role == 3 ? split * krows + r : p.xmap[(split * krows + r) % kRowsK[role]];
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  float acc = 0.f;
  const __half* in = p.vec + (size_t)((ph + 1) & 1) * kVecElems;  // the previous phase's output
  const bool fixed = (p.features & kFixed) && role != 0;
  const bool prev_fixed = (p.features & kFixed) && role != 1 && ph > 0;  // o's input is the attention's
  const bool left = (p.features & kLeft) && role == 2;       // gate/up leaves its partials
  const bool prev_left = (p.features & kLeft) && role == 3;  // down sums them in its gather
  const long long* in64 = p.fixed + (size_t)((ph + 2) % 3) * kVecElems;
  if (p.features & kFixed) {  // zero the buffer phase ph + 1 adds into (last read by phase ph - 1)
    long long* z = p.fixed + (size_t)((ph + 1) % 3) * kVecElems;
    const int per = (kVecElems + gridDim.x - 1) / gridDim.x;
    for (int e = threadIdx.x; e < per; e += kWarps * 32)
      if (blockIdx.x * per + e < kVecElems) z[blockIdx.x * per + e] = 0;
  }
  if (ph > 0) {
    consumers_sync();
    if (gathered && prev_left) {  // down: gate and up from gate/up's two partials each
      const float* part = p.partials + (size_t)((ph + 1) & 1) * 112 * 16 * 256;
      float x = 0.f;
      for (int r = threadIdx.x; r < krows; r += kWarps * 32) {
        const int f = xm[r], g = (f >> 8) * 16 * 256 + (f & 255), u = g + 56 * 16 * 256;
        const float gate = __ldcg(part + g) + __ldcg(part + g + 256), up = __ldcg(part + u) + __ldcg(part + u + 256);
        x += gate * up;
      }
      for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane == 0) red[warp] = x;
      consumers_sync();
      acc += red[(warp + 1) % kWarps];
    } else if (gathered && prev_fixed) {  // down: silu(gate) * up from the 64-bit sums
      float x = 0.f;
      for (int r = threadIdx.x; r < krows; r += kWarps * 32)
        x += (float)__ldcg(in64 + xm[r]) * (float)__ldcg(in64 + 14336 + xm[r]);
      for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane == 0) red[warp] = x;
      consumers_sync();
      acc += red[(warp + 1) % kWarps];
    } else if (gathered) {
      float x = 0.f;
      for (int r = threadIdx.x; r < krows; r += kWarps * 32) x += __half2float(__ldcg(in + xm[r]));
      for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane == 0) red[warp] = x;
      consumers_sync();
      acc += red[(warp + 1) % kWarps];
    } else if (prev_fixed) {  // the norm: h as 64-bit sums, the residual and the weight as halves
      acc += load_input(in64, 4096 * 8, red) + load_input(in, 16 * 1024, red);
    } else {
      acc += load_input(in, 24 * 1024, red);
    }
  }
  if (p.features & kScales) {
    if (!bounded_wait(scale_bar, 0, p.failed)) return;
  }
  for (int c = c0, i = 0; c < c1; ++c, ++i) {
    if (!consume_chunk(p, ring, full, empty, i, acc)) return;
    if (p.features & kScales) acc += scl[(i * 64 / kScaleGroupRows) * 128 + threadIdx.x % 128];
  }
  __half* out = p.vec + (size_t)(ph & 1) * kVecElems;
  if (left) {  // the partials only; down sums them
    p.partials[((size_t)(ph & 1) * 112 * 16 + colblk * 16 + split) * 256 + threadIdx.x] = acc;
    return;
  }
  if (fixed) {  // fire and forget: the next launch's wait makes the sums visible
    long long* o64 = p.fixed + (size_t)(ph % 3) * kVecElems + colblk * 256 + threadIdx.x;
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(o64), "l"((long long)(acc * 1048576.f)) : "memory");
    return;
  }
  if (!(p.features & kFinish)) {
    write_share(out, 24 * 512, acc);
    return;
  }
  // Split-K: this item's partials, the column block's ticket, the last item's ordered sum.
  const size_t cb = (size_t)(ph & 1) * 112 + colblk;
  p.partials[(cb * 16 + split) * 256 + threadIdx.x] = acc;
  consumers_sync();
  unsigned int* counter = p.counters + (ph & 1) * 128 + colblk;
  if (threadIdx.x == 0) {
    __threadfence();
    *s_last = atomicAdd(counter, 1u) == (unsigned)kSplits[role] - 1;
  }
  consumers_sync();
  if (!*s_last) return;
  __threadfence();
  float sum = 0.f;
  for (int j = 0; j < kSplits[role]; ++j) sum += __ldcg(p.partials + (cb * 16 + j) * 256 + threadIdx.x);
  out[colblk * 256 + threadIdx.x] = __float2half(sum * 1e-6f);
  if (threadIdx.x == 0) *counter = 0;  // re-armed for the next launch
#endif
}

// The ceiling of plain loads: every thread streams 16-byte loads, 8 in flight.
__global__ void __launch_bounds__(256) plain_read(const uint4* src, size_t n, float* sink) {
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __ldcs(src + i + k * stride);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n; i += stride) acc ^= __ldcs(src + i).x;
  if (acc == 0x12345678u) sink[0] = (float)acc;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  Params p{};
  long long total = 0;
  for (int ph = 0; ph < kPhases; ++ph) {
    p.phase_off[ph] = total;
    total += kPhaseBytes[ph % kPhasesPerLayer];
  }
  p.phase_off[kPhases] = total;
  unsigned char* weights = nullptr;
  CHECK(cudaMalloc(&weights, total));
  CHECK(cudaMemset(weights, 0x3c, total));
  p.weights = weights;
  CHECK(cudaMalloc(&p.tickets, kPhases * kTicketStride * sizeof(unsigned int)));
  CHECK(cudaMalloc(&p.vec, 2 * kVecElems * sizeof(__half)));
  CHECK(cudaMemset(p.vec, 0, 2 * kVecElems * sizeof(__half)));
  CHECK(cudaMalloc(&p.failed, sizeof(unsigned int)));
  CHECK(cudaMemset(p.failed, 0, sizeof(unsigned int)));
  CHECK(cudaMalloc(&p.sink, sizeof(float)));
  printf("%s, %d SMs; one decode step's GEMV weights: %.3f GB in %d phases\n", prop.name, sms, total / 1e9, kPhases);

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // The plain-load ceiling over the same bytes.
  std::vector<float> ms;
  for (int r = 0; r < 6; ++r) {
    CHECK(cudaEventRecord(e0));
    plain_read<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(weights), total / 16, p.sink);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (r) ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  const float plain_ms = median(ms);
  printf("plain 16-byte loads: %.3f ms, %.0f GB/s\n", plain_ms, total / plain_ms / 1e6);

  CHECK(cudaFuncSetAttribute(persistent_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  struct Config {
    int per_sm, ring_kb, deps, in_kb, work, sync, input_tma;
  };
  std::vector<Config> configs;
  for (int work : {0, 12})
    for (int per_sm : {2, 1})
      for (int ring_kb : {24, 48, 96, 192})
        for (int deps : {0, 1}) {
          if (per_sm == 2 && ring_kb > 104) continue;
          configs.push_back({per_sm, ring_kb, deps, 24, work});
        }
  configs.push_back({2, 96, 1, 8, 12});   // a smaller input vector (o_proj's, down's share)
  configs.push_back({2, 96, 1, 56, 12});  // a larger one
  configs.push_back({2, 96, 0, 24, 24});  // more arithmetic
  configs.push_back({2, 96, 1, 24, 24});
  // The dependency's form (Sync) and the input by one bulk copy; 72 KB rings leave two blocks per SM room for it.
  configs.push_back({2, 72, 0, 24, 0});
  for (int work : {12, 0})
    for (int per_sm : {2, 1})
      for (int sync : {kSyncOne, kSyncRelease, kSyncSpread})
        for (int tma : {0, 1}) {
          if (work == 0 && (sync != kSyncSpread || per_sm == 1)) continue;
          configs.push_back({per_sm, per_sm == 2 ? 72 : 96, 1, 24, work, sync, tma});
        }
  printf("blocks/SM ring_KB deps in_KB work [sync input] | ms     GB/s  vs_plain vs_ring_nodeps | per-boundary cost us"
         "\n");
  float nodeps_ms[4][256] = {};
  for (const Config& c : configs) {
    p.slots = c.ring_kb * 1024 / kCopy;
    p.deps = c.deps;
    p.in_elems = c.in_kb * 512;
    p.work = c.work;
    p.sync = c.sync;
    p.input_tma = c.input_tma;
    // Padded so that exactly per_sm blocks fit an SM (the library's GEMV is held at two by its 96 registers).
    const int smem = std::max(1024 + p.slots * kCopy + (c.input_tma ? c.in_kb * 1024 : 0),
                              (c.per_sm == 2 ? 100 : 120) * 1024);
    int occ = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, persistent_stream, kThreads, smem));
    if (occ < c.per_sm) {
      printf("%d %d: only %d blocks per SM fit\n", c.per_sm, c.ring_kb, occ);
      continue;
    }
    ms.clear();
    for (int r = 0; r < 5; ++r) {
      CHECK(cudaMemset(p.tickets, 0, kPhases * kTicketStride * sizeof(unsigned int)));
      CHECK(cudaEventRecord(e0));
      persistent_stream<<<sms * c.per_sm, kThreads, smem>>>(p);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaGetLastError());
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (r) ms.push_back(t);
    }
    unsigned int failed = 0;
    CHECK(cudaMemcpy(&failed, p.failed, sizeof(failed), cudaMemcpyDeviceToHost));
    if (failed) {
      printf("%d %d %d %d %d: a wait timed out (a bug): figures void\n", c.per_sm, c.ring_kb, c.deps, c.in_kb, c.work);
      CHECK(cudaMemset(p.failed, 0, sizeof(unsigned int)));
      continue;
    }
    const float t = median(ms);
    float& base = nodeps_ms[c.per_sm][c.ring_kb];
    if (!c.deps && c.work == 0) base = t;
    const float ref = base > 0 ? base : t;
    static const char* const kSyncNames[] = {"one", "release", "spread"};
    printf("%d %3d %d %2d %2d %s%s | %.3f %5.0f %.3f %.3f | %.2f\n", c.per_sm, c.ring_kb, c.deps, c.in_kb, c.work,
           c.deps ? kSyncNames[c.sync] : "", c.deps && c.input_tma ? " tma" : "", t, total / t / 1e6, plain_ms / t,
           ref / t, c.deps ? (t - ref) * 1000 / (kPhases - 1) : 0.f);
  }
  // Launch per phase (the library's design): 128 launches of phase_launch with programmatic dependent launch,
  // captured in a CUDA graph, two blocks per SM; the library GEMV's parts added one at a time (Feature).
  std::vector<unsigned short> perm(14336);
  for (int r = 0; r < 14336; ++r) perm[r] = (unsigned short)((r * 7919) % 14336);  // 7919 is prime: a permutation
  unsigned short* xmap = nullptr;
  CHECK(cudaMalloc(&xmap, perm.size() * 2));
  CHECK(cudaMemcpy(xmap, perm.data(), perm.size() * 2, cudaMemcpyHostToDevice));
  p.xmap = xmap;
  CHECK(cudaMalloc(&p.partials, sizeof(float) * 2 * 112 * 16 * 256));
  CHECK(cudaMalloc(&p.counters, sizeof(unsigned int) * 2 * 128));
  CHECK(cudaMemset(p.counters, 0, sizeof(unsigned int) * 2 * 128));
  CHECK(cudaMalloc(&p.fixed, sizeof(long long) * 3 * kVecElems));
  CHECK(cudaMemset(p.fixed, 0, sizeof(long long) * 3 * kVecElems));
  CHECK(cudaFuncSetAttribute(phase_launch, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  printf("launch per phase (graph of %d PDL launches, 2 blocks/SM): ring_KB work features | ms GB/s vs_plain | "
         "per-boundary cost us\n", kPhases);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Run {
    int ring_kb, work, features;
  };
  const int all = kItems | kFinish | kScales | kInputs;
  const Run runs[] = {{24, 0, 0}, {48, 0, 0}, {96, 0, 0}, {24, 12, 0}, {48, 12, 0}, {24, 12, kItems},
                      {24, 12, kItems | kFinish}, {24, 12, kItems | kFinish | kScales}, {24, 12, all},
                      {48, 12, all}, {24, 0, all}, {24, 12, kInputs}, {24, 12, kScales}, {24, 12, 0},
                      {24, 12, all | kFixed}, {24, 12, all}, {24, 12, all | kFixed}, {24, 0, all | kFixed},
                      {24, 12, all | kLeft}, {24, 12, all}, {24, 12, all | kLeft}, {24, 12, all | kFixed},
                      {24, 12, all}};
  for (const Run& run : runs) {
    Params q = p;
    q.slots = run.ring_kb * 1024 / kCopy;
    q.work = run.work;
    q.features = run.features;
    const int smem = std::max(kPhaseRingOffset + q.slots * kCopy, 100 * 1024);  // two blocks per SM, as the GEMV
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(sms * 2);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int ph = 0; ph < kPhases; ++ph) {
      q.ph = ph;
      CHECK(cudaLaunchKernelEx(&cfg, phase_launch, q));
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    ms.clear();
    for (int r = 0; r < 6; ++r) {
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaGetLastError());
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (r) ms.push_back(t);
    }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    unsigned int failed = 0;
    CHECK(cudaMemcpy(&failed, p.failed, sizeof(failed), cudaMemcpyDeviceToHost));
    const float t = median(ms);
    const float ref = nodeps_ms[2][run.ring_kb] > 0 ? nodeps_ms[2][run.ring_kb] : t;
    printf("%3d %2d %s%s%s%s%s | %.3f %5.0f %.3f | %.2f%s\n", run.ring_kb, run.work,
           run.features & kItems ? "items " : "", run.features & kFinish ? "finish " : "",
           run.features & kScales ? "scales " : "", run.features & kInputs ? "inputs " : "",
           run.features & kFixed ? "fixed" : run.features & kLeft ? "left" : "", t, total / t / 1e6,
           plain_ms / t, (t - ref) * 1000 / (kPhases - 1), failed ? " (a wait timed out: void)" : "");
    if (failed) CHECK(cudaMemset(p.failed, 0, sizeof(unsigned int)));
  }
  return 0;
}
