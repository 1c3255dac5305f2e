// CHECK(cuda call): print the failing call and its error, and return 1 from main (the device diagnostics'
// standalone programs: stream_bench.cu, kv_stream_bench.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)
