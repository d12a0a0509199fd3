// An fp8 KV cache expanded once per call into 16-bit K / V rows (kvattn/fp8_expand.py): the prefill of a long
// prompt reads every K/V tile once per query tile, and expanding a tile in the attention kernel on each read costs
// that kernel half its rate (BENCHMARKS.md, session 24); expanded once, the 16-bit kernel reads the rows instead.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace kvattn {

struct ExpandParams {
  const void* k;               // fp8 cache: request r's token j, head h at
  const void* v;               //   page_indices[page_indptr[r] + j / page_size] * c_page + (j % page_size) * c_token
                               //   + h * c_head
  void* k_out;                 // [ws_indptr[batch], Hkv, D] of T: request r's token j at row ws_indptr[r] + j
  void* v_out;
  const int* page_indptr;      // [batch + 1]
  const int* page_indices;     // [page_indptr[batch]]
  const int* ws_indptr;        // [batch + 1]: the requests' first output rows (exclusive sums of their KV lengths)
  const float* k_scale_ptr;    // per-KV-head scales [Hkv] (null: k_scale alone); the cache holds x / scale
  const float* v_scale_ptr;
  long long c_page, c_token, c_head;   // cache strides, in elements
  float k_scale, v_scale;
  int num_kv_heads, page_size, page_shift;   // page_shift >= 0: page_size == 1 << page_shift
};

// One thread expands one 16-byte chunk (16 values) of one (token, KV head) row of K and of V; blockIdx.y is the
// request. Each value is the fp8 value times its head's scale, rounded once to T (dequant16, as the attention
// kernels' in-kernel expansion).
template <typename KV, typename T, int D>
__global__ void __launch_bounds__(256) expand_kv8_kernel(const __grid_constant__ ExpandParams p) {
  constexpr int CH = D / 16;
  const int r = blockIdx.y;
  const int row0 = __ldg(p.ws_indptr + r), n = __ldg(p.ws_indptr + r + 1) - row0;
  const int first = __ldg(p.page_indptr + r);
  const int per_token = p.num_kv_heads * CH;
  const float kf = p.k_scale, vf = p.v_scale;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)n * per_token;
       i += (long long)gridDim.x * blockDim.x) {
    const int j = int(i / per_token), rem = int(i - (long long)j * per_token);
    const int h = rem / CH, c = rem - h * CH;
    const int pg = p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
    const int in = j - pg * p.page_size;
    const long long src = (long long)__ldg(p.page_indices + first + pg) * p.c_page + (long long)in * p.c_token +
                          (long long)h * p.c_head + c * 16;
    const uint4 kw = __ldg(reinterpret_cast<const uint4*>(static_cast<const KV*>(p.k) + src));
    const uint4 vw = __ldg(reinterpret_cast<const uint4*>(static_cast<const KV*>(p.v) + src));
    const long long dst = ((long long)(row0 + j) * p.num_kv_heads + h) * D + c * 16;
    uint4 lo, hi;
    dequant16<KV, T>(kw, kv_cache_scale(p.k_scale_ptr, kf, h), lo, hi);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.k_out) + dst) = lo;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.k_out) + dst + 8) = hi;
    dequant16<KV, T>(vw, kv_cache_scale(p.v_scale_ptr, vf, h), lo, hi);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.v_out) + dst) = lo;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.v_out) + dst + 8) = hi;
  }
}

}  // namespace kvattn
