// RoPE and the fp16 KV-cache write after the q/k/v GEMV, in the block that writes each column block's final
// values (exl2_gemv_tma.cuh tma_finish): q heads rotated in place in the GEMV's output, k heads rotated into the K
// cache, v heads copied into the V cache, at the token's slot. The work of rope_kv_write (layers/rope.cu) without
// its launch: one kernel fewer per layer on the decode path, where that launch cost ~3.5 us (H200, 8B at 1k).
//
// Exact: the same rotation of the same fp16 values (rope_math.cuh, cos/sin of the fp32 angle evaluated in double),
// so the q the attention reads and the cache rows carry the bits of the GEMV followed by rope_kv_write.
// Layout: descriptor 0 holds the q heads, 1 the k heads, 2 the v heads (head_dim D each, N a multiple of D);
// D divides the 256-column block, so no head straddles two blocks and a pair (i, i + D/2) stays in one.
#pragma once

#include "layers/rope_math.cuh"
#include "quant/exl2_gemv.cuh"

namespace exl2q {

// Host: the int64 arguments behind blob field F_ROPE: positions [M], inv_freq [D/2] fp32, slots [M], K cache,
// V cache ([num_slots, Hk, D] fp16 each), num_slots, D.
enum RopeArg { kRopePos = 0, kRopeInvFreq, kRopeSlots, kRopeKc, kRopeVc, kRopeNumSlots, kRopeD, kRopeArgs };

// Host: checks the fused rope's arguments against the launch's descriptors and sets them in p.
inline int plan_rope(const int64_t* a, GemvParams& p) {
  const int D = (int)a[kRopeD];
  EXL2_REQUIRE(p.ndesc == 3, "exl2_gemv rope: %d parts, needs q, k and v", p.ndesc);
  EXL2_REQUIRE(D >= 16 && D % 16 == 0 && kGvCols % D == 0, "exl2_gemv rope: head_dim %d must divide %d", D, kGvCols);
  EXL2_REQUIRE(p.d[0].N % D == 0 && p.d[1].N % D == 0 && p.d[1].N == p.d[2].N,
               "exl2_gemv rope: q / k / v widths %d / %d / %d are not whole heads of %d with k = v", p.d[0].N,
               p.d[1].N, p.d[2].N, D);
  EXL2_REQUIRE(a[kRopePos] && a[kRopeInvFreq] && a[kRopeSlots] && a[kRopeKc] && a[kRopeVc] && a[kRopeNumSlots] > 0,
               "exl2_gemv rope: null argument");
  EXL2_REQUIRE(a[kRopeKc] % 16 == 0 && a[kRopeVc] % 16 == 0, "exl2_gemv rope: caches must be 16-byte aligned");
  EXL2_REQUIRE(reinterpret_cast<uintptr_t>(p.d[2].out) % 16 == 0 && p.d[2].ldo % 8 == 0,
               "exl2_gemv rope: v output rows must be 16-byte aligned");
  p.rope_pos = reinterpret_cast<const long long*>(a[kRopePos]);
  p.rope_inv_freq = reinterpret_cast<const float*>(a[kRopeInvFreq]);
  p.rope_slots = reinterpret_cast<const long long*>(a[kRopeSlots]);
  p.rope_kc = reinterpret_cast<__half*>(a[kRopeKc]);
  p.rope_vc = reinterpret_cast<__half*>(a[kRopeVc]);
  p.rope_num_slots = a[kRopeNumSlots];
  p.rope_d = D;
  return EXL2_OK;
}

// Compute threads [0, nthreads) of the block that wrote the final values of column block `colblk` of descriptor
// `di`, after a barrier over them (their stores are then visible to each other).
__device__ __forceinline__ void gv_rope_kv(const GemvParams& p, int di, int colblk, int tid, int nthreads) {
  const QDesc& d = p.d[di];
  const int D = p.rope_d, half = D / 2, M = p.M;
  const int n0 = colblk * kGvCols, ncols = min(kGvCols, d.N - n0);  // whole heads (d.N and n0 multiples of D)
  const long long row = (long long)p.d[1].N;                       // cache elements per slot (Hk * D)
  if (di == 2) {  // v: the block's columns of each token, 8 halves per item, into the V cache
    const int vecs = ncols / 8;
    for (int e = tid; e < M * vecs; e += nthreads) {
      const int m = e / vecs, c = n0 + 8 * (e - m * vecs);
      const long long slot = p.rope_slots[m];
      if (slot < 0 || slot >= p.rope_num_slots) continue;
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(d.out + (size_t)m * d.ldo + c));
      *reinterpret_cast<uint4*>(p.rope_vc + slot * row + c) = v;
    }
    return;
  }
  const int pairs = (ncols / D) * half;  // (head, i) pairs of the block per token
  for (int e = tid; e < M * pairs; e += nthreads) {
    const int m = e / pairs, r = e - m * pairs, h = r / half, i = r - h * half;
    const int n = n0 + h * D + i;
    __half* o = d.out + (size_t)m * d.ldo + n;
    const float x1 = __half2float(__ldcg(o)), x2 = __half2float(__ldcg(o + half));
    const float ang = __fmul_rn((float)p.rope_pos[m], p.rope_inv_freq[i]);
    double s, c;
    sincos((double)ang, &s, &c);
    const float co = (float)c, si = (float)s;
    const __half o1 = __float2half_rn(exl2::layers::rope_first(x1, x2, co, si));
    const __half o2 = __float2half_rn(exl2::layers::rope_second(x1, x2, co, si));
    if (di == 0) {  // q: in place
      o[0] = o1;
      o[half] = o2;
    } else {  // k: into the K cache
      const long long slot = p.rope_slots[m];
      if (slot < 0 || slot >= p.rope_num_slots) continue;
      __half* k = p.rope_kc + slot * row + n;
      k[0] = o1;
      k[half] = o2;
    }
  }
}

}  // namespace exl2q
