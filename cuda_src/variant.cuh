// Attention variants as hook structs. A kernel takes one variant type V and calls its hooks at fixed points of
// its mainloop; VariantBase's hooks are the identity (scores untouched, every pair kept), so a variant that does
// not override a hook costs nothing (the calls inline away). NVRTC-safe: no host headers.
//
// Hooks (P: the kernel's parameter struct: DecodeParams or PrefillParams):
//   V::logits(p, x)                  x: a score in the log2 domain (q.k * p.score_scale) -> the transformed score
//   V::row_init(p, head)             (kPositional) a per-row constant, computed once per query row (e.g. a slope)
//   V::logits_at(p, x, j, diag, rc)  (kPositional) a position-dependent transform of the score of kv index j for
//                                    the row whose diagonal is diag; rc: that row's row_init
//   V::keep(p, j, diag)              whether the variant keeps kv index j for the query row whose diagonal
//                                    (bottom-right aligned causal limit) is diag; called when kKeep, and ANDed
//                                    with the kernel's own tests (ok = ok && V::keep(...))
//   V::tile_may_mask(p, t0, diag_hi) whether a kv tile starting at t0 may hold a pair keep() rejects for rows
//                                    whose diagonals are at most diag_hi (prefill's unmasked fast path)
// Mask modes the kernels implement themselves, switched on by traits (the mask data or bounds are plan
// parameters, and in-kernel code keeps their machine code exactly as tuned): kWindow (sliding window:
// j >= diag - p.window_left when p.window_left >= 0) and kCustomMask (the plan's bit-packed mask; every tile takes
// the masked path). Causal is a run-time flag of the prefill kernel.
// Traits: kLogits (logits is not the identity), kPositional (row_init / logits_at are used), kKeep (keep can
//   reject), kWindow, kCustomMask; VariantTraits: kMasks (kKeep || kWindow || kCustomMask), kAny.
#pragma once
#include "common.cuh"

namespace kvattn {

struct VariantBase {
  static constexpr bool kLogits = false;
  static constexpr bool kPositional = false;
  static constexpr bool kKeep = false;
  static constexpr bool kWindow = false;
  static constexpr bool kCustomMask = false;
  template <class P> __device__ __forceinline__ static float logits(const P&, float x) { return x; }
  template <class P> __device__ __forceinline__ static float row_init(const P&, int /*head*/) { return 0.f; }
  template <class P>
  __device__ __forceinline__ static float logits_at(const P&, float x, int /*j*/, int /*diag*/, float /*rc*/) {
    return x;
  }
  template <class P> __device__ __forceinline__ static bool keep(const P&, int, int) { return true; }
  // A variant with a keep() hook sends every tile down the masked path unless it says which tiles are safe.
  template <class P> __device__ __forceinline__ static bool tile_may_mask(const P&, int, int) { return true; }
};

// The mask traits every kernel reads.
template <class V> struct VariantTraits {
  static constexpr bool kMasks = V::kKeep || V::kWindow || V::kCustomMask;
  static constexpr bool kNeedsDiag = kMasks || V::kPositional;   // decode computes the row's diagonal
  static constexpr bool kAny = V::kLogits || V::kPositional || kMasks;
};

// The built-in variants: logits soft cap (s = cap * tanh(s / cap)), ALiBi (s += slope[head] * (j - diag), the
// slopes in p.variant_data, natural-log units), sliding window and a bit-packed custom mask (prefill), each
// selected at compile time.
template <bool SOFT_CAP, bool WINDOW, bool CUSTOM, bool ALIBI = false>
struct Builtin : VariantBase {
  static constexpr bool kLogits = SOFT_CAP;
  static constexpr bool kPositional = ALIBI;
  static constexpr bool kWindow = WINDOW;
  static constexpr bool kCustomMask = CUSTOM;

  template <class P> __device__ __forceinline__ static float logits(const P& p, float x) {
    if (SOFT_CAP) x = p.cap_log2 * tanhf(x);
    return x;
  }
  template <class P> __device__ __forceinline__ static float row_init(const P& p, int head) {
    return ALIBI ? __ldg(p.variant_data + head) * kLog2e : 0.f;   // the row's slope, in log2 units
  }
  template <class P>
  __device__ __forceinline__ static float logits_at(const P&, float x, int j, int diag, float rc) {
    return ALIBI ? fmaf(rc, (float)(j - diag), x) : x;
  }
};

}  // namespace kvattn
