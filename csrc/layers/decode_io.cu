// decode_inputs: the first kernel of a captured greedy decode step (runtime/greedy_graphs.py). It reads the step's
// staging rows straight from pinned host memory (mapped: a kernel may dereference it over PCIe) and unpacks them
// into the graph's static inputs; a row whose token is -1 takes the previous step's greedy token instead, which
// the previous graph's sampler wrote into (mapped) host memory as well.
//
// Why: an engine decode step with the lookahead ran a staging upload, a device-to-device copy of the token, the
// graph (whose first five nodes unpacked the staging rows), the sampler and a readback as separate stream
// operations. H200 call AL2 of 2026-12-04 (8B at 1k): 38.6 us per step over the graph replay, 28 us of it idle gaps
// between those operations. With this kernel a step is one graph launch.
#include "common/api.h"
#include "common/pdl.cuh"

namespace exl2 {
namespace layers {
namespace {

constexpr int kDecodeIoThreads = 128;

// One block per row b: stage [B][ld] int64 = [token | position | context length | cache slot | W page ids].
__global__ void __launch_bounds__(kDecodeIoThreads)
    decode_inputs_kernel(const int64_t* __restrict__ stage, int64_t ld, const int64_t* __restrict__ prev,
                         int64_t* __restrict__ ids, int64_t* __restrict__ pos, int32_t* __restrict__ lens,
                         int64_t* __restrict__ slots, int32_t* __restrict__ tables, int64_t tables_ld, int W) {
  exl2::pdl_wait_and_trigger();  // the static inputs may still be read by the stream's previous kernel
  const int64_t b = blockIdx.x;
  const int64_t* row = stage + b * ld;
  const int t = threadIdx.x;
  if (t == 0) {
    // both loads issued before the branch: one round trip over the bus, not two (each is a host read)
    const int64_t token = row[0];
    const int64_t previous = prev != nullptr ? prev[b] : 0;
    ids[b] = token == -1 && prev != nullptr ? previous : token;  // -1: FROM_PREVIOUS (reference_decode_io)
  } else if (t == 1) {
    pos[b] = row[1];
  } else if (t == 2) {
    lens[b] = (int32_t)row[2];
  } else if (t == 3) {
    slots[b] = row[3];
  }
  for (int j = t; j < W; j += kDecodeIoThreads) tables[b * tables_ld + j] = (int32_t)row[4 + j];
}

}  // namespace
}  // namespace layers
}  // namespace exl2

// stage: device-accessible address of B staging rows (row stride ld >= 4 + W int64); prev: B previous tokens or
// null (rows with token -1 then keep -1, which the embedding maps to a zero row); outputs: ids [B], pos [B],
// lens [B] int32, slots [B], tables [B][tables_ld >= W] int32.
EXL2_API int exl2_decode_inputs(const int64_t* stage, int64_t ld, const int64_t* prev, int64_t* ids, int64_t* pos,
                                int32_t* lens, int64_t* slots, int32_t* tables, int64_t tables_ld, int B, int W,
                                cudaStream_t stream) {
  EXL2_REQUIRE(B >= 0 && B < 65536 && W >= 0, "decode_inputs: bad shape B=%d W=%d", B, W);
  EXL2_REQUIRE(ld >= 4 + (int64_t)W && tables_ld >= W, "decode_inputs: row strides %lld / %lld too small for W=%d",
               (long long)ld, (long long)tables_ld, W);
  EXL2_REQUIRE(stage && ids && pos && lens && slots && (tables || W == 0), "decode_inputs: null pointer");
  if (B == 0) return EXL2_OK;
  exl2::launch_kernel(exl2::layers::decode_inputs_kernel, B, exl2::layers::kDecodeIoThreads, 0, stream, stage, ld,
                      prev, ids, pos, lens, slots, tables, tables_ld, W);
  return exl2::check_launch("decode_inputs");
}

// The device address of pinned host memory at `host` (cudaHostGetDevicePointer): fails for memory that is not
// pinned, or not mapped into the device's address space.
EXL2_API int exl2_mapped_pointer(void* host, void** device) {
  EXL2_REQUIRE(host && device, "mapped_pointer: null pointer");
  const cudaError_t err = cudaHostGetDevicePointer(device, host, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return exl2::set_error((int)err, "mapped_pointer: %p is not mapped pinned host memory: %s", host,
                           cudaGetErrorString(err));
  }
  return EXL2_OK;
}
