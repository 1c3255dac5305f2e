// EXL2 dequantization of a prepared linear to fp16 W[K, n1 - n0] (columns n0..n1 of Np) in original row order,
// bit-exact with the reference (format doc b.6): w = fp16(fp16(q - z) * fp16(fp16((c+1)^2) * max16)).
// Used for large M: dequantize into scratch, then cuBLAS (torch.matmul) on the Python side.
//
// Grid (column blocks of 128 within [n0, n1), chunks C); block = 4 warps, one 32-column warp tile each. A warp
// decodes its 64x32 tile into a swizzled shared tile; the block then writes each stored row to its original
// row (xmap) as 16-byte vectors.
#include "common/api.h"
#include "quant/exl2_quant.cuh"

namespace exl2q {
namespace {

// Logical 16-byte column chunk k of tile row `row` lives at chunk k ^ ((row >> 3) & 3): a lane's pairs sit
// 8 rows apart per t4, so without the swizzle the 4 t4 groups would hit the same banks.
__device__ __forceinline__ int tile_index(int row, int col) {
  return row * kBlockCols + ((((col >> 3) ^ (row >> 3)) & 3) | ((col >> 3) & ~3)) * 8 + (col & 7);
}

__device__ __forceinline__ __half2 as_h2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return h;
}

template <int B>
__device__ __forceinline__ void dq_tile(const QDesc& d, const uint32_t* src, int lane, int wcol, int n0, int chunk,
                                        __half* tile) {
  uint32_t w[2][B];
  load_lane_words<B>(src, lane, w);
  const int gid = lane >> 2, t4 = lane & 3;
  const int info = __ldg(d.info + chunk);
  const int g0 = info & kInfoGroupMask, g1 = g0 + ((info >> 30) & 1);  // groups of units 0 and 1
  float sc[2][2][2];  // [unit][nt][column gid / gid+8]
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int g = u ? g1 : g0;
    const float mx = __ldg(d.maxf + g);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t* row = d.scales + (size_t)g * (d.Np / 8) + (n0 + 16 * nt) / 8;
      sc[u][nt][0] = scale_of((__ldg(row) >> (4 * gid)) & 15u, mx);
      sc[u][nt][1] = scale_of((__ldg(row + 1) >> (4 * gid)) & 15u, mx);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    uint32_t q[16];
    q[0] = pair_qz<B, 0>(w[nt]);   q[1] = pair_qz<B, 1>(w[nt]);   q[2] = pair_qz<B, 2>(w[nt]);
    q[3] = pair_qz<B, 3>(w[nt]);   q[4] = pair_qz<B, 4>(w[nt]);   q[5] = pair_qz<B, 5>(w[nt]);
    q[6] = pair_qz<B, 6>(w[nt]);   q[7] = pair_qz<B, 7>(w[nt]);   q[8] = pair_qz<B, 8>(w[nt]);
    q[9] = pair_qz<B, 9>(w[nt]);   q[10] = pair_qz<B, 10>(w[nt]); q[11] = pair_qz<B, 11>(w[nt]);
    q[12] = pair_qz<B, 12>(w[nt]); q[13] = pair_qz<B, 13>(w[nt]); q[14] = pair_qz<B, 14>(w[nt]);
    q[15] = pair_qz<B, 15>(w[nt]);
#pragma unroll
    for (int p = 0; p < 16; ++p) {
      const int s = p >> 2, r = p & 3;
      const int row = 32 * (s >> 1) + 8 * t4 + 4 * (s & 1) + 2 * (r >> 1);
      const int col = wcol + 16 * nt + gid + 8 * (r & 1);
      const float scale = sc[s >> 1][nt][r & 1];
      const float2 f = __half22float2(as_h2(q[p]));
      tile[tile_index(row, col)] = __float2half_rn(f.x * scale);
      tile[tile_index(row + 1, col)] = __float2half_rn(f.y * scale);
    }
  }
}

__global__ void __launch_bounds__(128) dequant_kernel(const __grid_constant__ QDesc d, __half* out, int n_begin,
                                                      int n_end) {
  __shared__ __align__(16) __half tile[kChunkRows * kBlockCols];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int c = blockIdx.y;
  const int nblk0 = n_begin + blockIdx.x * kBlockCols, n0 = nblk0 + warp * kWarpCols;
  if (n0 < n_end) {
    int r = 0;
    while (c >= d.runs[r].chunk_end) ++r;
    const Run& run = d.runs[r];
    const int J = d.Np / kWarpCols;
    const uint32_t* src =
        d.packed + run.word_base + ((long long)(c - run.chunk_start) * J + n0 / kWarpCols) * (64 * run.bits);
    switch (run.bits) {
      case 8: dq_tile<8>(d, src, lane, warp * kWarpCols, n0, c, tile); break;
      case 6: dq_tile<6>(d, src, lane, warp * kWarpCols, n0, c, tile); break;
      case 5: dq_tile<5>(d, src, lane, warp * kWarpCols, n0, c, tile); break;
      case 4: dq_tile<4>(d, src, lane, warp * kWarpCols, n0, c, tile); break;
      case 3: dq_tile<3>(d, src, lane, warp * kWarpCols, n0, c, tile); break;
      default: dq_tile<2>(d, src, lane, warp * kWarpCols, n0, c, tile); break;
    }
  }
  __syncthreads();
  const int ld = n_end - n_begin;
  const int nvec = min(kBlockCols, n_end - nblk0) / 8;
  for (int e = tid; e < kChunkRows * (kBlockCols / 8); e += blockDim.x) {
    const int row = e >> 4, v = e & 15;
    if (v >= nvec) continue;
    const unsigned dst = __ldg(d.xmap + c * kChunkRows + row);
    if (dst == 0xFFFFu) continue;  // padding row
    const uint4 val = *reinterpret_cast<const uint4*>(tile + tile_index(row, v * 8));
    *reinterpret_cast<uint4*>(out + (size_t)dst * ld + (nblk0 - n_begin) + v * 8) = val;
  }
}

int parse_desc_simple(const int64_t* f, QDesc& d) {
  d = QDesc{};
  d.packed = reinterpret_cast<const uint32_t*>(f[F_PACKED]);
  d.scales = reinterpret_cast<const uint32_t*>(f[F_SCALES]);
  d.maxf = reinterpret_cast<const float*>(f[F_MAXF]);
  d.info = reinterpret_cast<const int*>(f[F_INFO]);
  d.xmap = reinterpret_cast<const uint16_t*>(f[F_XMAP]);
  d.K = (int)f[F_K]; d.Kpad = (int)f[F_KPAD]; d.N = (int)f[F_N]; d.Np = (int)f[F_NP];
  d.C = (int)f[F_C]; d.G = (int)f[F_G]; d.nruns = (int)f[F_NRUNS];
  EXL2_REQUIRE(d.packed && d.scales && d.maxf && d.info && d.xmap, "exl2_dequant: null tensor pointer");
  EXL2_REQUIRE(d.Np > 0 && d.Np % 32 == 0 && d.C > 0 && d.Kpad == d.C * kChunkRows && d.K <= 65535,
               "exl2_dequant: bad shape K=%d Np=%d C=%d", d.K, d.Np, d.C);
  EXL2_REQUIRE(d.nruns >= 1 && d.nruns <= kMaxRuns, "exl2_dequant: bad run count %d", d.nruns);
  int expect = 0;
  for (int r = 0; r < kMaxRuns; ++r) {
    const int64_t* rr = f + F_RUNS + 4 * r;
    d.runs[r] = r < d.nruns ? Run{(int)rr[0], (int)rr[1], (int)rr[2], (long long)rr[3]} : Run{8, d.C, 1 << 30, 0};
    if (r < d.nruns) {
      const int b = d.runs[r].bits;
      EXL2_REQUIRE((b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8) && d.runs[r].chunk_start == expect &&
                       d.runs[r].chunk_end > expect,
                   "exl2_dequant: bad run %d", r);
      expect = d.runs[r].chunk_end;
    }
  }
  EXL2_REQUIRE(expect == d.C, "exl2_dequant: runs cover %d of %d chunks", expect, d.C);
  return EXL2_OK;
}

}  // namespace
}  // namespace exl2q

using namespace exl2q;

// out: fp16 [K, n_end - n_begin] (row stride n_end - n_begin); n_begin multiple of 128, n_end multiple of 32.
EXL2_API int exl2_dequant(const int64_t* blob, void* out, int n_begin, int n_end, void* stream) {
  EXL2_REQUIRE(blob && out, "exl2_dequant: null argument");
  QDesc d;
  int st = parse_desc_simple(blob, d);
  if (st) return st;
  EXL2_REQUIRE(n_begin >= 0 && n_begin % kBlockCols == 0 && n_end > n_begin && n_end <= d.Np && n_end % 32 == 0,
               "exl2_dequant: bad column range %d..%d of Np=%d", n_begin, n_end, d.Np);
  dim3 grid((n_end - n_begin + kBlockCols - 1) / kBlockCols, d.C);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  dequant_kernel<<<grid, kBlockWarps * 32, 0, s>>>(d, reinterpret_cast<__half*>(out), n_begin, n_end);
  return exl2::check_launch("exl2_dequant");
}
