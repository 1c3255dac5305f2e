// Programmatic dependent launch (PDL, sm_90+): a kernel launched with the attribute may start while the
// previous kernel in the stream is still running. It must call pdl_wait() before it reads anything the
// previous kernels wrote or writes anything they may still read; work on constant data (weights, their
// scales and maps) may come before. pdl_launch_dependents() lets the next kernel launch early: called at a
// block's start, the next kernel's blocks fill SMs as this kernel's blocks retire, hiding launch latency and
// tails inside CUDA graphs (captured launches keep the attribute as programmatic graph edges).
// On sm_80..89 both are no-ops and launch_kernel() never sets the attribute.
#pragma once

#include <cuda_runtime.h>

namespace exl2 {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// pdl_wait() then pdl_launch_dependents(), for a kernel with nothing to do before the wait. A measurement build
// with EXL2_PDL_EARLY_TRIGGER triggers first: the next kernel may then launch (and a GEMV request its first
// weights) while this one still waits on its predecessor. Safe either way: a dependent launches only once every
// block of this grid has started, and its own pdl_wait() still waits for this grid to complete. H200 call H3 of
// 2026-12-02 (8B decode graph step): 3.110 ms with it against 2.999 ms without; it stays a measurement build.
__device__ __forceinline__ void pdl_wait_and_trigger() {
#ifdef EXL2_PDL_EARLY_TRIGGER
  pdl_launch_dependents();
  pdl_wait();
#else
  pdl_wait();
  pdl_launch_dependents();
#endif
}

// Whether launches on the current device get the PDL attribute (set by exl2_set_pdl; off below sm_90).
bool pdl_enabled();

// Let `Kernel` take `bytes` of dynamic shared memory on the current device: its opt-in attribute, set once per
// device and only ever raised (the 48 KB default also counts the kernel's static arrays). cudaSuccess or the
// failing call's error (cudaErrorInvalidDevice past 64 devices).
template <auto Kernel>
cudaError_t opt_in_dynamic_smem(size_t bytes) {
  static size_t set_bytes[64] = {};  // per device
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (bytes > set_bytes[dev]) {
    const cudaError_t set = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (set != cudaSuccess) return set;
    set_bytes[dev] = bytes;
  }
  return cudaSuccess;
}

// Launch `kernel` (which must call pdl_wait() before any dependent access) with the PDL attribute when enabled.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

}  // namespace exl2
