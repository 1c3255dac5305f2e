// The tensor-core step of the streamed decode attention over one 16-token chunk held as fp16 rows in shared memory
// (row pitch 2,064 bytes: one token's 8 kv heads x 128 dims + 16), for the kernel over fp16 pages
// (paged_attention_stream_mma.cu: the ring's stage itself); its fragment helpers and state also serve the one
// over code pages (paged_attention_stream_mma_quant.cu: each chunk's K, then its V dequantized into such rows).
// Per warp (= kv head) and chunk: S = Q K^T (q in registers, K by ldmatrix, 16 mma), the online softmax, O^T += V^T P^T (V by
// ldmatrix.trans, P as fp16 hi + residue: 16 mma per half). Layouts: paged_attention_stream_mma.cu's header.
#pragma once

#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "common/mma.cuh"

namespace exl2 {
namespace layers {

constexpr int kSmD = 128;                        // head dim
constexpr int kSmHkv = 8;                        // kv heads (one warp each)
constexpr int kSmChunk = 16;                     // tokens per chunk
constexpr int kSmRowBytes = kSmHkv * kSmD * 2;   // 2,048: one token's fp16 K (or V) row of all heads
constexpr int kSmRowPitch = kSmRowBytes + 16;    // its row in shared memory (ldmatrix phases on 8 bank groups)
constexpr int kSmChunkBytes = 2 * kSmChunk * kSmRowPitch;  // K rows, then V rows: 66,048

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint4 ldsm_x4(uint32_t addr) {
  uint4 r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
__device__ __forceinline__ uint4 ldsm_x4_trans(uint32_t addr) {
  uint4 r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_half2(uint32_t u) {
  return __half22float2(*reinterpret_cast<const __half2*>(&u));
}

// A warp's running state over its query rows: O^T per half [m-tile][c0 (dim gid, row 2 t4), c1 (row 2 t4 + 1), c2,
// c3 (dim + 8)], and the lane's rows' running max (log2 units) and this lane's share of their sums.
template <int HALVES>
struct StreamMmaAcc {
  float o[HALVES][kSmD / 16][4];
  float m[HALVES], l[HALVES];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf)
#pragma unroll
      for (int mt = 0; mt < kSmD / 16; ++mt) o[hf][mt][0] = o[hf][mt][1] = o[hf][mt][2] = o[hf][mt][3] = 0.f;
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) m[hf] = -INFINITY, l[hf] = 0.f;
  }
};

// The ldmatrix lane address of warp (kv head) h within a chunk's K rows: matrix mi = lane / 8 holds tokens
// 8 (mi >> 1) + lane % 8 and the 8 dims from 8 (mi & 1) of a 16-dim step; the same pattern serves K (B fragments
// of two 8-token tiles) and V (transposed: A fragments of a 16-dim tile).
__device__ __forceinline__ uint32_t stream_mma_lane_offset(int h, int lane) {
  const int mi = lane >> 3;
  return (uint32_t)((8 * (mi >> 1) + (lane & 7)) * kSmRowPitch + h * kSmD * 2 + 8 * (mi & 1) * 2);
}

// The probabilities of one chunk as the second product's B fragments (tokens 2 t4, +1 of each 8-token tile, hi +
// residue) and the rescale factors of O^T's columns (rows 2 t4, 2 t4 + 1 of each half).
template <int HALVES>
struct StreamMmaP {
  uint32_t bh[HALVES][2], bl[HALVES][2];
  float a_even[HALVES], a_odd[HALVES];
};

// A chunk's scores at tokens tc.. (K rows at kaddr: a shared address plus the lane's offset) and the online
// softmax: qa the lane's q fragments [half][16-dim step][dims 2 t4, +1 | 8 + 2 t4, +1], lim each half's key limit
// (keys at or past it score -inf). Updates acc's running max and sums; returns what stream_mma_values needs.
template <int HALVES>
__device__ __forceinline__ StreamMmaP<HALVES> stream_mma_scores(const uint32_t (&qa)[HALVES][kSmD / 16][2],
                                                                uint32_t kaddr, int tc, const int (&lim)[HALVES],
                                                                float scale_log2, StreamMmaAcc<HALVES>& acc) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // S: [token tile][c0..c3]
#pragma unroll
  for (int kk = 0; kk < kSmD / 16; ++kk) {
    const uint4 kb = ldsm_x4(kaddr + kk * 32);
    const uint32_t a1 = HALVES == 2 ? qa[HALVES - 1][kk][0] : 0u, a3 = HALVES == 2 ? qa[HALVES - 1][kk][1] : 0u;
    exl2::mma16816(sc[0], qa[0][kk][0], a1, qa[0][kk][1], a3, kb.x, kb.y);
    exl2::mma16816(sc[1], qa[0][kk][0], a1, qa[0][kk][1], a3, kb.z, kb.w);
  }
  StreamMmaP<HALVES> P;
#pragma unroll
  for (int hf = 0; hf < HALVES; ++hf) {
    // row 16 z + 8 hf + gid's scores of tokens 8 nt + 2 t4 + e: c0, c1 (half 0) or c2, c3 (half 1)
    float x[2][2], mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // keys past the row's limit (the split's end included: this masks NaN of stale K) score -inf
        x[nt][e] = tc + 8 * nt + 2 * t4 + e < lim[hf] ? sc[nt][2 * hf + e] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, x[nt][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(acc.m[hf], mx), mu = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: p = 0
    const float alpha = exp2f(acc.m[hf] - mu);
    acc.m[hf] = m_new;
    float pr[2][2], psum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        pr[nt][e] = exp2f(x[nt][e] - mu);
        psum += pr[nt][e];
      }
    acc.l[hf] = fmaf(acc.l[hf], alpha, psum);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      P.bh[hf][nt] = pack_half2(pr[nt][0], pr[nt][1]);
      const float2 hv = unpack_half2(P.bh[hf][nt]);
      P.bl[hf][nt] = pack_half2(pr[nt][0] - hv.x, pr[nt][1] - hv.y);
    }
    P.a_even[hf] = __shfl_sync(0xffffffffu, alpha, 8 * t4);  // the lanes holding rows 2 t4, 2 t4 + 1
    P.a_odd[hf] = __shfl_sync(0xffffffffu, alpha, 8 * t4 + 4);
  }
  return P;
}

// O^T = O^T * alpha + V^T P^T for the chunk's V rows at vaddr (the lane's offset included; rows past the valid
// tokens must hold finite values).
template <int HALVES>
__device__ __forceinline__ void stream_mma_values(uint32_t vaddr, const StreamMmaP<HALVES>& P,
                                                  StreamMmaAcc<HALVES>& acc) {
#pragma unroll
  for (int mt = 0; mt < kSmD / 16; ++mt) {
    const uint4 va = ldsm_x4_trans(vaddr + mt * 32);
#pragma unroll
    for (int hf = 0; hf < HALVES; ++hf) {
      acc.o[hf][mt][0] *= P.a_even[hf];
      acc.o[hf][mt][1] *= P.a_odd[hf];
      acc.o[hf][mt][2] *= P.a_even[hf];
      acc.o[hf][mt][3] *= P.a_odd[hf];
      exl2::mma16816(acc.o[hf][mt], va.x, va.y, va.z, va.w, P.bh[hf][0], P.bh[hf][1]);
      exl2::mma16816(acc.o[hf][mt], va.x, va.y, va.z, va.w, P.bl[hf][0], P.bl[hf][1]);
    }
  }
}

// One chunk: its scores, then its values (K rows at kaddr, V rows at vaddr).
template <int HALVES>
__device__ __forceinline__ void stream_mma_chunk(const uint32_t (&qa)[HALVES][kSmD / 16][2], uint32_t kaddr,
                                                 uint32_t vaddr, int tc, const int (&lim)[HALVES], float scale_log2,
                                                 StreamMmaAcc<HALVES>& acc) {
  stream_mma_values<HALVES>(vaddr, stream_mma_scores<HALVES>(qa, kaddr, tc, lim, scale_log2, acc), acc);
}
#endif

}  // namespace layers
}  // namespace exl2
