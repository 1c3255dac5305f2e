// C ABI conventions of libexl2_kernels: every exported function is `extern "C"`, takes raw device
// pointers, sizes and a cudaStream_t, and returns an int status (0 = ok, else a cudaError_t or an
// EXL2_ERR_* code). exl2_last_error() gives the message of the last failure on the calling thread.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#define EXL2_API extern "C" __attribute__((visibility("default")))

enum Exl2Status {
  EXL2_OK = 0,
  EXL2_ERR_INVALID_ARGUMENT = 10001,
  EXL2_ERR_UNSUPPORTED = 10002,
};

namespace exl2 {
// Records a message for exl2_last_error() and returns `code`.
int set_error(int code, const char* fmt, ...);
// Returns 0 or records the pending launch error.
int check_launch(const char* what);
}  // namespace exl2

#define EXL2_REQUIRE(cond, ...)                                          \
  do {                                                                   \
    if (!(cond)) return exl2::set_error(EXL2_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)
