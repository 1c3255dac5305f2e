// Error reporting and version query for the C ABI (see api.h).
#include "common/api.h"

#include <stdarg.h>
#include <stdio.h>

static thread_local char g_last_error[512] = "";

namespace exl2 {
int set_error(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return code;
}

int check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return set_error((int)err, "%s: %s", what, cudaGetErrorString(err));
  return EXL2_OK;
}
}  // namespace exl2

EXL2_API const char* exl2_last_error() { return g_last_error; }

// Bumped whenever an exported signature changes, or what an argument means, or the package needs a new function
// (10: exl2_decode_inputs and exl2_mapped_pointer, layers/decode_io.cu; exl2_paged_attention's flags bit 9, the
// streamed kernel; 12: exl2_sample_top_k's hist workspace and rows without a top-k; 13: that workspace holds the
// chunks' sorted keys, and may be null; 14: the GEMV descriptor's F_VEC8 field, kDescLen 48); ops/library.py checks
// it.
EXL2_API int exl2_abi_version() { return 14; }

// --- programmatic dependent launch switch (common/pdl.cuh) ---
#include "common/pdl.cuh"

static int g_pdl = -1;  // -1: not decided yet (on where the current device is sm_90+)

namespace exl2 {
bool pdl_enabled() {
  if (g_pdl < 0) {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    g_pdl = major >= 9 ? 1 : 0;
  }
  return g_pdl == 1;
}
}  // namespace exl2

// on: 1 enables PDL launches where the device supports them, 0 disables; returns whether it is now enabled.
EXL2_API int exl2_set_pdl(int on) {
  g_pdl = -1;
  const bool supported = exl2::pdl_enabled();
  g_pdl = on && supported ? 1 : 0;
  return g_pdl;
}
