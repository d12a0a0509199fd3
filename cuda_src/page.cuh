// Paged KV-cache append: new K / V rows scattered into their pages (any page size, NHD / HND through strides),
// K optionally rotated (fused RoPE) on the way. Memory bound: 16-byte loads and stores, no shared memory.
#pragma once
#include "common.cuh"
#include "variant.cuh"

namespace kvattn {

// Mirrored by kvattn.page.APPEND_PARAMS (a test checks size and offsets). Strides in elements.
struct AppendParams {
  const void* k_new;            // token t, head h: k_new + t * new_stride_n + h * new_stride_h
  const void* v_new;            // same strides as k_new
  void* k_cache;                // page g, slot s, head h: + g * c_page + s * c_token + h * c_head
  void* v_cache;                // same strides as k_cache
  const int* batch_indices;     // [nnz] request of each new token
  const int* positions;         // [nnz] its position in the request
  const int* page_indptr;       // [batch + 1]
  const int* page_indices;      // [page_indptr[batch]]
  const int* last_page_len;     // [batch]
  long long new_stride_n, new_stride_h;
  long long c_page, c_token, c_head;
  int nnz, num_kv_heads, batch_size, page_size, num_pages;
  float rope_log2_theta, rope_rcp_scale;   // ROPE != 0: angle = pos * rcp_scale * theta^(-2 i / D)
};

// One thread moves 16 dims of one (token, head) row of K or V: [d0, d0 + 8) and [d0 + D/2, d0 + D/2 + 8), the
// pairs NeoX RoPE rotates together; D / 8 threads per (token, head): K's, then V's. A token whose request,
// position or page is out of range (device-side index arrays are not checked on the host) is not written.
// ROPE: 0 none, 1 NeoX halves, 2 GPT-J interleaved pairs (variant.cuh's rope_rotate).
template <typename T, int D, int ROPE>
__global__ void __launch_bounds__(256) append_paged_kernel(const __grid_constant__ AppendParams p) {
  constexpr int PER = D / 8;
  const unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned row = gid / PER;
  const int lane = int(gid - row * PER);
  const int t = int(row / unsigned(p.num_kv_heads));
  const int h = int(row - unsigned(t) * unsigned(p.num_kv_heads));
  if (t >= p.nnz) return;
  const bool is_v = lane >= PER / 2;
  const int d0 = (is_v ? lane - PER / 2 : lane) * 8;
  const int b = __ldg(p.batch_indices + t), pos = __ldg(p.positions + t);
  if (b < 0 || b >= p.batch_size || pos < 0) return;
  const int first = __ldg(p.page_indptr + b), npages = __ldg(p.page_indptr + b + 1) - first;
  const int kv_len = npages > 0 ? (npages - 1) * p.page_size + __ldg(p.last_page_len + b) : 0;
  if (pos >= kv_len) return;
  const int pg = pos / p.page_size;
  const int page = __ldg(p.page_indices + first + pg);
  if (page < 0 || page >= p.num_pages) return;
  const long long src = (long long)t * p.new_stride_n + (long long)h * p.new_stride_h + d0;
  const long long dst = (long long)page * p.c_page + (long long)(pos - pg * p.page_size) * p.c_token +
                        (long long)h * p.c_head + d0;
  const T* in = static_cast<const T*>(is_v ? p.v_new : p.k_new) + src;
  T* out = static_cast<T*>(is_v ? p.v_cache : p.k_cache) + dst;
  const uint4 lo = __ldg(reinterpret_cast<const uint4*>(in));
  const uint4 hi = __ldg(reinterpret_cast<const uint4*>(in + D / 2));
  if constexpr (ROPE != 0) {
    if (!is_v) {
      float a[8], c[8], inv[8];
      Vec8<T>::load(in, a);
      Vec8<T>::load(in + D / 2, c);
      rope_inv_freq<ROPE == 2, D>(inv, d0, p.rope_log2_theta);
      rope_rotate<ROPE == 2>(a, c, inv, (float)pos * p.rope_rcp_scale);
      Vec8<T>::store(out, a);
      Vec8<T>::store(out + D / 2, c);
      return;
    }
  }
  *reinterpret_cast<uint4*>(out) = lo;
  *reinterpret_cast<uint4*>(out + D / 2) = hi;
}

}  // namespace kvattn
