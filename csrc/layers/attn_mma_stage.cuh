// Shared-memory staging of the tensor-core decode attention's steps (paged_attention_quant_mma.cu, the staged
// one-pass kernel): each warp copies the rows of its next steps of 16 keys (K and V codes, their group scales) into
// a ring of NS stages of its own with cp.async, and reads a step's fragments from there, in the same lane layout and
// with the same values as the register kernels' global loads (rows past the split's end are zero-filled, as those
// loads return zeros), so the results are the same bits. Why: with a step's K and V fragments in registers the fp16
// kernel runs 255 registers, 2 CTAs per SM and at most two steps in flight per warp; ncu at 32k (H200 call AC1 of
// 2026-12-03) put 53% of its stall samples on those loads (DRAM 58% busy, 0.27 eligible warps per scheduler).
//
// Stage layout (bytes): K codes [16][KROW], V codes [16][VROW], then for quantized formats K scales [16][NG] and V
// scales [16][NG] (fp16). A code row's 16-byte chunk c sits at chunk c ^ (row & (chunks - 1) & 7): the lanes that
// read one column of chunks from 8 rows hit 8 different bank groups.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "layers/kv_quant.cuh"

namespace exl2 {
namespace layers {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// N bytes (4, 8 or 16) global -> shared, asynchronously; zeros when !valid (nothing is read).
template <int N>
__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, bool valid) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  const int n = valid ? N : 0;
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <int D, int KF, int VF>
struct AttnStage {
  static constexpr int NG = D / KV_GROUP;
  static constexpr int KROW = D * KVFormat<KF>::BITS / 8, VROW = D * KVFormat<VF>::BITS / 8;
  static constexpr int KSCL = KF == kFmtF16 ? 0 : NG * 2, VSCL = VF == kFmtF16 ? 0 : NG * 2;  // bytes per row
  static constexpr int K_OFF = 0, V_OFF = 16 * KROW, KS_OFF = V_OFF + 16 * VROW, VS_OFF = KS_OFF + 16 * KSCL;
  static constexpr int BYTES = (VS_OFF + 16 * VSCL + 15) / 16 * 16;
  static_assert(KROW % 16 == 0 && VROW % 16 == 0, "code rows of whole 16-byte chunks");

  // Byte offset of byte `off` of code row `row` (row bytes `rb`) within its region.
  __device__ __forceinline__ static int code_at(int row, int off, int rb) {
    const int chunks = rb / 16;
    return row * rb + (((off >> 4) ^ (row & (chunks - 1) & 7)) << 4) + (off & 15);
  }
};

// A lane's chunks of one code region (row bytes RB) of a step: 16 rows of RB / 16 chunks over the warp's 32 lanes,
// chunk lane % kChunks of rows r0 + j * kRowStep (j < kRounds). Round j's offset within the region is the first
// one's with the swizzle bits of j * kRowStep flipped (r0 < kRowStep, both powers of two: r0 + j * kRowStep adds
// no carries, and the flipped bits lie below RB), plus j * kRowStep rows; its global offset is the first one's
// plus j * kRowStep rows of Hkv heads.
template <int RB>
struct LaneChunks {
  static constexpr int kChunks = RB / 16, kRounds = 16 * kChunks / 32, kRowStep = 32 / kChunks;
  static constexpr int kSwizzle = (kChunks - 1) & 7;
  static_assert(kChunks % 2 == 0 && 32 % kChunks == 0, "whole rounds of 32 lanes");
  __device__ __forceinline__ static constexpr int flip(int j) { return ((j * kRowStep) & kSwizzle) << 4; }
};

// Copy the rows of the step at key t (its 16 slots from `base`; rows at or past `end` zero-filled) into the stage
// at shared address `dst`. All 32 lanes take part. The same copies as one chunk per (lane + 32 j) in row-major
// order; the addresses are a 64-bit step base per region plus 32-bit lane offsets (the per-chunk 64-bit index
// arithmetic was ~110 of the q4 kernel's ~700 instructions per step).
template <int D, int KF, int VF>
__device__ __forceinline__ void stage_issue(uint32_t dst, const uint8_t* kc, const half* ks, const uint8_t* vc,
                                            const half* vs, int Hkv, int kvh, int64_t base, int t, int end,
                                            int lane) {
  using S = AttnStage<D, KF, VF>;
  const int64_t row0 = base * Hkv + kvh;  // the step's first row among all heads' rows
  const int lim = end - t;                // rows of the step that exist
  auto codes = [&](auto chunks, const uint8_t* src, uint32_t region) {
    using L = decltype(chunks);
    constexpr int RB = L::kChunks * 16;
    const int r0 = lane / L::kChunks, c = lane % L::kChunks;
    const uint8_t* first = src + row0 * RB + (r0 * Hkv * RB + c * 16);
    const int d0 = r0 * RB + ((c ^ (r0 & L::kSwizzle)) << 4);  // within the region (the flips stay below RB)
#pragma unroll
    for (int j = 0; j < L::kRounds; ++j)
      cp_async_zfill<16>(region + ((d0 ^ L::flip(j)) + j * L::kRowStep * RB), first + j * L::kRowStep * Hkv * RB,
                         r0 + j * L::kRowStep < lim);
  };
  codes(LaneChunks<S::KROW>{}, kc, dst + S::K_OFF);
  codes(LaneChunks<S::VROW>{}, vc, dst + S::V_OFF);
  static_assert(S::KSCL == S::VSCL, "both sides quantized (with scales) or both fp16");
  if constexpr (S::KSCL > 0) {  // lanes 0..15: K scales of row `lane`; 16..31: V scales of row lane - 16
    const int r = lane & 15;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(lane < 16 ? ks : vs) + (row0 + r * Hkv) * S::KSCL;
    cp_async_zfill<S::KSCL>(dst + (lane < 16 ? S::KS_OFF : S::VS_OFF) + r * S::KSCL, src, r < lim);
  }
}

// N bytes of shared memory at p into words (N = 2 fills the low half of w[0]).
template <int N, int W>
__device__ __forceinline__ void lds_words(const uint8_t* p, uint32_t (&w)[W]) {
  if constexpr (N == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
  } else if constexpr (N == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x, w[1] = u.y;
  } else if constexpr (N == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(N == 2, "2, 4, 8 or 16 bytes");
    w[0] = *reinterpret_cast<const unsigned short*>(p);
  }
}

// A step's K side from the stage `st` (shared memory), the values load_k_step reads from global memory: codes of
// keys nb * 8 + gid (the lane's 8 dims of each group), scales of keys nb * 8 + 2 t4 + e.
template <int D, int KF, int VF, class KStepT>
__device__ __forceinline__ void stage_read_k(KStepT& k, const uint8_t* st, int gid, int t4) {
  using S = AttnStage<D, KF, VF>;
  constexpr int KBITS = KVFormat<KF>::BITS, CB = KF == kFmtF16 ? 16 : (KF == kFmtI4 ? 4 : 8);
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
    for (int g = 0; g < S::NG; ++g)
      lds_words<CB>(st + S::K_OFF + S::code_at(nb * 8 + gid, (g * KV_GROUP + t4 * 8) * KBITS / 8, S::KROW),
                    k.c[nb][g].w);
    if constexpr (S::KSCL > 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) lds_words<S::KSCL>(st + S::KS_OFF + (nb * 8 + 2 * t4 + e) * S::KSCL, k.s[nb][e].w);
    }
  }
}

// A step's V side from the stage, as load_v_step: codes and scales of keys 2t4, 2t4+1, 2t4+8, 2t4+9 (i = 0..3).
template <int D, int KF, int VF, class VStepT>
__device__ __forceinline__ void stage_read_v(VStepT& v, const uint8_t* st, int gid, int t4) {
  using S = AttnStage<D, KF, VF>;
  constexpr int VBITS = KVFormat<VF>::BITS, CB = VF == kFmtF16 ? 8 : (VF == kFmtI4 ? 2 : 4);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = 2 * t4 + (i & 1) + 8 * (i >> 1);
#pragma unroll
    for (int g = 0; g < S::NG; ++g)
      lds_words<CB>(st + S::V_OFF + S::code_at(row, (g * KV_GROUP + gid * 4) * VBITS / 8, S::VROW), v.c[i][g].w);
    if constexpr (S::VSCL > 0) lds_words<S::VSCL>(st + S::VS_OFF + row * S::VSCL, v.s[i].w);
  }
}

}  // namespace layers
}  // namespace exl2
