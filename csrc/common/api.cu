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

// Bumped whenever an exported signature changes; ops/library.py checks it.
EXL2_API int exl2_abi_version() { return 1; }
