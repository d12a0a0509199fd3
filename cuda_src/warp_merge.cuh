// Merge of the partial softmax states of WARPS warps that each saw part of the same KV, through shared memory.
// Scratch layout: o [WARPS][16][D + 4] floats (padded rows), then m [WARPS][16], then l [WARPS][16].
#pragma once
#include "common.cuh"

namespace kvattn {

// Empty online-softmax state: o = 0, running max m = -inf, row sums l = 0 (MT m-tiles of 16 rows).
template <int MT, int CHUNKS>
__device__ __forceinline__ void reset_state(float (&o)[MT][CHUNKS][4], float (&m)[MT][2], float (&l)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = KVATTN_NEG_INF;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int dn = 0; dn < CHUNKS; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dn][e] = 0.f;
  }
}

// SOFTMAX false (a non-softmax variant's states: m is 0 once a warp saw a tile): a row whose weights sum to 0 is
// empty. D: the columns merged at once (a kernel may merge its head dim in phases of D columns); PAD: floats
// after each o row (4 keeps stash's float2 stores conflict-free).
template <int D, int WARPS, bool SOFTMAX = true, int PAD = 4> struct WarpMerge {
  static constexpr int OSTRIDE = D + PAD;
  static constexpr int CHUNKS = D / 8;
  static constexpr int O_BYTES = WARPS * 16 * OSTRIDE * 4;
  static constexpr int ML_BYTES = 2 * WARPS * 16 * 4;
  static constexpr int BYTES = O_BYTES + ML_BYTES;
  float* so;
  float* sm;
  float* sl;
  __device__ explicit WarpMerge(void* scratch)
      : so(static_cast<float*>(scratch)), sm(so + WARPS * 16 * OSTRIDE), sl(sm + WARPS * 16) {}
  // o scratch (O_BYTES) and m / l scratch (ML_BYTES) apart
  __device__ WarpMerge(void* o_scratch, float* ml) : so(static_cast<float*>(o_scratch)), sm(ml), sl(ml + WARPS * 16) {}

  // The row sums (reduced over the quad) and running maxima of a warp's 16 rows.
  __device__ __forceinline__ void stash_ml(int warp, int lane, const float (&m)[2], const float (&l)[2]) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lr = quad_sum(l[r]);
      if (t == 0) { sm[warp * 16 + g + 8 * r] = m[r]; sl[warp * 16 + g + 8 * r] = lr; }
    }
  }

  // Columns [8 dn0, 8 dn0 + D) of a warp's o in the even/odd layout of an fp8 V product: accumulator pair
  // (2c, 2c + 1) holds, for this thread's rows, columns 16c + 4t + {0, 2} and 16c + 4t + {1, 3}.
  template <int DN>
  __device__ __forceinline__ void stash_even_odd(int warp, int lane, const float (&o)[DN][4], int dn0) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < CHUNKS / 2; ++c) {
        const float* ev = o[dn0 + 2 * c];
        const float* od = o[dn0 + 2 * c + 1];
        *reinterpret_cast<float4*>(so + (warp * 16 + g + 8 * r) * OSTRIDE + 16 * c + 4 * t) =
            make_float4(ev[2 * r], od[2 * r], ev[2 * r + 1], od[2 * r + 1]);
      }
  }

  // Columns [8 dn0, 8 dn0 + D) of a warp's o (mma accumulator layout), for a kernel that merges its head dim in
  // phases of D columns (m / l through stash_ml, once).
  template <int DN>
  __device__ __forceinline__ void stash_cols(int warp, int lane, const float (&o)[DN][4], int dn0) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int dn = 0; dn < CHUNKS; ++dn)
        *reinterpret_cast<float2*>(so + (warp * 16 + g + 8 * r) * OSTRIDE + dn * 8 + 2 * t) =
            make_float2(o[dn0 + dn][2 * r], o[dn0 + dn][2 * r + 1]);
  }

  // Each warp stores its 16-row state: o (mma accumulator layout), running max m (log2 domain), row sums l
  // (per-thread partials, reduced over the quad here). A __syncthreads() must follow before merge().
  __device__ __forceinline__ void stash(int warp, int lane, const float (&o)[CHUNKS][4], const float (&m)[2],
                                        const float (&l)[2]) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lr = quad_sum(l[r]);
      const int row = g + 8 * r;
      if (t == 0) { sm[warp * 16 + row] = m[r]; sl[warp * 16 + row] = lr; }
#pragma unroll
      for (int dn = 0; dn < CHUNKS; ++dn)
        *reinterpret_cast<float2*>(so + (warp * 16 + row) * OSTRIDE + dn * 8 + 2 * t) =
            make_float2(o[dn][2 * r], o[dn][2 * r + 1]);
    }
  }

  // The merged, normalised 8 columns [8 ch, 8 ch + 8) of `row`; returns the natural-log LSE (-inf if empty).
  __device__ __forceinline__ float merge(int row, int ch, float (&acc)[8]) const {
    float mw[WARPS], big = KVATTN_NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) { mw[w] = sm[w * 16 + row]; big = fmaxf(big, mw[w]); }
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    if (big == KVATTN_NEG_INF) return KVATTN_NEG_INF;
    float lsum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = fast_exp2(mw[w] - big);
      lsum += f * sl[w * 16 + row];
      const float* src = so + (w * 16 + row) * OSTRIDE + ch * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(f, src[e], acc[e]);
    }
    if (!SOFTMAX && !(lsum > 0.f)) return KVATTN_NEG_INF;   // acc is 0: every weight was 0
    const float inv = 1.f / lsum;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= inv;
    return (big + __log2f(lsum)) * kLn2;
  }
};

}  // namespace kvattn
