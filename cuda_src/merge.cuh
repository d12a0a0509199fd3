// Merge of attention states (o, lse): the associative operator that split-KV, cascade and sequence
// parallelism reduce with. lse is the natural log; a state with lse = -inf is empty and never read.
#pragma once
#include "variant.cuh"

namespace kvattn {

// Mirrored by kvattn.merge.MERGE_PARAMS (a test checks size and offsets). Strides in elements.
struct MergeParams {
  const void* o_in;            // state i of output row m: o_in + base(m) + i*s_n + h*s_h + d
  const float* lse_in;         // lse_in + lbase(m) + i*l_n + h*l_h
  void* o_out;                 // o_out + row*so_row + h*so_h + d
  float* lse_out;              // lse_out + row*lo_row + h*lo_h; may be null
  const int* indptr;           // null: n stacked states per row; else row m merges input rows [indptr[m], indptr[m+1])
  const int* out_rows;         // null: output row m; else out_rows[m]
  const unsigned char* mask;   // null, or merge output row m only where mask[m] != 0
  const int* num_rows_dev;     // null: num_rows; else the row count lives in device memory (graph mode)
  long long s_row, s_n, s_h;
  long long l_row, l_n, l_h;
  long long so_row, so_h, lo_row, lo_h;
  int num_rows, n, num_heads, head_dim;
  int lane_shift;              // log2 of the lanes that share one (row, head, 8 columns): each merges a run of states
  const float* variant_data;   // the attention variant's data, read by its output hook (V::kOutput)
};

// Merges the n states of 8 consecutive elements (state i: o + i * o_n, lse[i * l_n]) in index order into acc
// (normalised) and returns their lse (-inf when every state is empty; acc is then 0). One pass, R states per
// round with online rescaling: the lse and o loads of a round are issued together, so each round costs one memory
// latency (a max-then-accumulate pass would cost two). COHERENT: the states were written by other CTAs of the
// running kernel (decode's fused split-KV merge, which takes R = 1: fewer registers inside its mainloop).
template <bool COHERENT, int R, typename TIn>
__device__ __forceinline__ float merge_state_run(const TIn* o, long long o_n, const float* lse, long long l_n, int n,
                                                 float (&acc)[8]) {
  static_assert(R == 1 || R == 4, "a round's maximum below is written for 1 or 4 states");
  float mx = KVATTN_NEG_INF, sum = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.f;
  for (int i0 = 0; i0 < n; i0 += R) {
    Raw8<TIn> raw[R];
    float l[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool ok = i0 + j < n;
      l[j] = ok ? (COHERENT ? __ldcg(lse + (i0 + j) * l_n) : lse[(i0 + j) * l_n]) : KVATTN_NEG_INF;
      if (ok) raw[j].template load<COHERENT>(o + (i0 + j) * o_n);
    }
    float bm = l[0];
    if constexpr (R == 4) bm = fmaxf(fmaxf(l[0], l[1]), fmaxf(l[2], l[3]));
    if (bm == KVATTN_NEG_INF) continue;
    const float m_new = fmaxf(mx, bm);
    const float scale = mx == KVATTN_NEG_INF ? 0.f : fast_exp2((mx - m_new) * kLog2e);
    sum *= scale;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] *= scale;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (l[j] != KVATTN_NEG_INF) {   // an empty state's o is never read (it may be garbage)
        const float w = fast_exp2((l[j] - m_new) * kLog2e);
        float v[8];
        raw[j].to_float(v);
        sum += w;
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = fmaf(w, v[k], acc[k]);
      }
    }
    mx = m_new;
  }
  if (mx != KVATTN_NEG_INF) {
    const float inv = 1.f / sum;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] *= inv;
  }
  return mx == KVATTN_NEG_INF ? KVATTN_NEG_INF : mx + __logf(sum);
}

// Merge this lane's normalised state (acc, lse; lse -inf: empty) with lane ^ off's (both in `mask`).
__device__ __forceinline__ void combine_lane_states(float (&acc)[8], float& lse, int off, unsigned mask) {
  const float other = __shfl_xor_sync(mask, lse, off);
  const float m = fmaxf(lse, other);
  const float w1 = m == KVATTN_NEG_INF ? 0.f : fast_exp2((lse - m) * kLog2e);
  const float w2 = m == KVATTN_NEG_INF ? 0.f : fast_exp2((other - m) * kLog2e);
  const float inv = m == KVATTN_NEG_INF ? 0.f : 1.f / (w1 + w2);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float o2 = __shfl_xor_sync(mask, acc[k], off);
    acc[k] = (w1 * acc[k] + w2 * o2) * inv;
  }
  lse = m == KVATTN_NEG_INF ? KVATTN_NEG_INF : m + __logf(w1 + w2);
}

// 2^lane_shift adjacent threads merge 8 consecutive elements of one (row, head) (head_dim / 8 such units per
// (row, head)): lane j takes the j-th of near-equal consecutive runs of the row's n states, and the runs combine
// through shuffles in a fixed tree, so the bits depend on n and lane_shift alone. One state chain per thread
// costs a memory latency per 4 states (b1_L65536 decode: 49 states per row, 14 us on 2 CTAs; split over 16 lanes,
// one round). Launched after the kernel that wrote the states, possibly programmatically (before it finishes).
// V: the attention variant whose output hook finishes each merged row (VariantBase: none).
template <typename TIn, typename TOut, class V = VariantBase>
__global__ void __launch_bounds__(256) merge_states_kernel(const __grid_constant__ MergeParams p) {
  // 32-bit index math (64-bit division costs ~100 instructions per thread; launches keep rows*heads*D/8*lanes
  // < 2^31).
  const unsigned tpp = unsigned(p.head_dim) >> 3;
  const unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned lanes = 1u << p.lane_shift, part = gid & (lanes - 1);
  const unsigned unit = gid >> p.lane_shift;
  const unsigned pair = unit / tpp;
  const int d = int(unit - pair * tpp) * 8;
  const int rows = p.num_rows_dev ? *p.num_rows_dev : p.num_rows;
  const int m = int(pair / unsigned(p.num_heads));
  const int h = int(pair - unsigned(m) * unsigned(p.num_heads));
  if (m >= rows) return;   // (a unit's lanes leave together: they share m)
  if (p.mask && !p.mask[m]) return;
  int n = p.n;
  long long base = m * p.s_row, lbase = m * p.l_row;
  if (p.indptr) {
    const int b = p.indptr[m];
    n = p.indptr[m + 1] - b;
    base = b * p.s_row;
    lbase = b * p.l_row;
  }
  const long long orow = p.out_rows ? p.out_rows[m] : m;
  // Only the states come from the predecessor (a programmatic launch: the attention kernel ending): the row
  // lists above are the plan's, copied before that kernel started, so their loads overlap its tail.
  wait_for_predecessor_grid();
  const float* lse = p.lse_in + lbase + h * p.l_h;
  const TIn* o = static_cast<const TIn*>(p.o_in) + base + h * p.s_h + d;
  const int b = int(part * unsigned(n) >> p.lane_shift), e = int((part + 1) * unsigned(n) >> p.lane_shift);
  float acc[8];
  float lse_row = merge_state_run<false, 4>(o + b * p.s_n, p.s_n, lse + b * p.l_n, p.l_n, e - b, acc);
  if (lanes > 1) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1) << (lane & ~(lanes - 1));
    for (unsigned off = 1; off < lanes; off *= 2) combine_lane_states(acc, lse_row, int(off), mask);
    if (part) return;
  }
  if constexpr (V::kOutput) {
    const float f = V::output(p, h, lse_row);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] *= f;
  }
  Vec8<TOut>::store(static_cast<TOut*>(p.o_out) + orow * p.so_row + h * p.so_h + d, acc);
  if (p.lse_out && d == 0) p.lse_out[orow * p.lo_row + h * p.lo_h] = lse_row;
}

}  // namespace kvattn
