// The element types and head dims of one attention instance: every kernel template takes one AttnTypes and reads
// its types and dims from it alone. Q: the queries; KV: the cache (Q's type, or fp8); O: the output; D_QK: the
// head dim of Q and K (the QK^T reduction, RoPE), D_VO: that of V and O (P V, the output, the split-KV states).
// MLA (576 / 512) or DeepSeek (192 / 128) instances differ in dims only. Each kernel keeps its own tiling struct
// (decode.cuh, prefill.cuh, prefill_sm90.cuh): tiles and shared memory derive from these.
#pragma once
#include "fp8.cuh"

namespace kvattn {

constexpr int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

template <int D_QK_, int D_VO_, typename Q_, typename KV_, typename O_>
struct AttnTypes {
  using Q = Q_;
  using KV = KV_;
  using O = O_;
  static constexpr int D_QK = D_QK_;
  static constexpr int D_VO = D_VO_;
  static constexpr bool kFp8 = IsFp8<KV>::value;
  using MT = typename MmaType<Q, KV>::type;            // the tensor-core operand type (f16 for an fp8 cache)
  static constexpr int QK_CHUNKS = D_QK / 8;           // 8-element chunks of a Q / K row (16 bytes at 16 bits)
  static constexpr int VO_CHUNKS = D_VO / 8;           // of a V / O row (and of an output accumulator row)
  static constexpr int K_ROW_BYTES = D_QK * (int)sizeof(KV);
  static constexpr int V_ROW_BYTES = D_VO * (int)sizeof(KV);
  static_assert(sizeof(Q) == 2, "queries are f16 or bf16");
  static_assert(kFp8 || IsSame<Q, KV>::value, "a 16-bit cache has the queries' type (one MMA operand type)");
  static_assert(D_QK % 64 == 0 && D_VO % 64 == 0, "head dims are multiples of 64 (the swizzles' 128-byte groups)");
};

}  // namespace kvattn
