// Paged KV-cache append: new K / V rows scattered into their pages (any page size, NHD / HND through strides),
// K optionally rotated (fused RoPE) on the way. Memory bound: 16-byte loads and stores, no shared memory.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "variant.cuh"

// KVATTN_APPEND_HINTS (the A/B of bench_append.py --hints; 0, the default, is plain loads and stores): 1 reads the
// new rows without allocating in L1 and stores the cache rows as streaming (.cs: evict first), since each byte is
// touched once; 2 the loads alone.
#ifndef KVATTN_APPEND_HINTS
#define KVATTN_APPEND_HINTS 0
#endif
// KVATTN_APPEND_LOADS_FIRST (kvattn.page.LOADS_FIRST chooses; bench_append.py --loads-first is the A/B): 1
// issues a thread's new-row loads before its index lookups (request, page range, page id: three dependent round
// trips that the loads, which need only the token, do not wait for), so their latency overlaps the lookups'.
#ifndef KVATTN_APPEND_LOADS_FIRST
#define KVATTN_APPEND_LOADS_FIRST 0
#endif

namespace kvattn {

// 16 bytes read once (the new rows): through the read-only path, or (hints) without an L1 line.
__device__ __forceinline__ uint4 append_load16(const void* p) {
#if KVATTN_APPEND_HINTS
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return __ldg(reinterpret_cast<const uint4*>(p));
#endif
}

// 16 bytes of a cache row: a plain store, or (hints 1) a streaming one.
__device__ __forceinline__ void append_store16(void* p, uint4 v) {
#if KVATTN_APPEND_HINTS == 1
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#else
  *reinterpret_cast<uint4*>(p) = v;
#endif
}

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
  const float* k_scale_ptr;     // fp8 cache: per-KV-head scales [Hkv] (null: k_scale alone); it stores x / scale
  const float* v_scale_ptr;
  long long new_stride_n, new_stride_h;
  long long c_page, c_token, c_head;
  int nnz, num_kv_heads, batch_size, page_size, num_pages;
  float rope_log2_theta, rope_rcp_scale;   // ROPE != 0: angle = pos * rcp_scale * theta^(-2 i / D)
  float k_scale, v_scale;
};

template <typename KV> struct Fp8Kind;
template <> struct Fp8Kind<__nv_fp8_e4m3> { static constexpr __nv_fp8_interpretation_t value = __NV_E4M3; };
template <> struct Fp8Kind<__nv_fp8_e5m2> { static constexpr __nv_fp8_interpretation_t value = __NV_E5M2; };

// 8 values / scale (IEEE division, as numpy's float32), rounded to nearest and saturated to the finite range.
template <typename KV>
__device__ __forceinline__ void store8_fp8(KV* out, const float (&f)[8], float scale) {
  unsigned w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned pair = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(f[2 * i], scale),
                                                               __fdiv_rn(f[2 * i + 1], scale)),
                                                   __NV_SATFINITE, Fp8Kind<KV>::value);
    w[i / 2] |= pair << (16 * (i % 2));
  }
  *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
}

// One thread moves 16 dims of up to HPT heads of one token, in K and in V: dims [d0, d0 + 8) and [d0 + D/2,
// d0 + D/2 + 8), the pairs NeoX RoPE rotates together; D / 16 threads per (token, group of HPT heads). The
// token's page is found once for its heads, and every 16-byte load of a thread is issued before its stores (and,
// with KVATTN_APPEND_LOADS_FIRST, before the page is looked up). A
// token whose request, position or page is out of range (device-side index arrays are not checked on the host)
// is not written. ROPE: 0 none, 1 NeoX halves, 2 GPT-J interleaved pairs (variant.cuh's rope_rotate). KV: the
// cache's element type (T, or fp8: each value is stored as value / its head's scale).
template <typename T, int D, int ROPE, int HPT = 4, typename KV = T>
__global__ void __launch_bounds__(256) append_paged_kernel(const __grid_constant__ AppendParams p) {
  constexpr int PER = D / 16;
  const unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned row = gid / PER;
  const int d0 = int(gid - row * PER) * 8;
  const unsigned groups = unsigned(p.num_kv_heads + HPT - 1) / HPT;
  const int t = int(row / groups);
  const int h0 = int(row - unsigned(t) * groups) * HPT;
  if (t >= p.nnz) return;
  uint4 k_lo[HPT], k_hi[HPT], v_lo[HPT], v_hi[HPT];
  auto load_rows = [&]() {   // this thread's 16 dims of each of its heads of the token, in K and V
    const T* kin = static_cast<const T*>(p.k_new) + (long long)t * p.new_stride_n + d0;
    const T* vin = static_cast<const T*>(p.v_new) + (long long)t * p.new_stride_n + d0;
#pragma unroll
    for (int i = 0; i < HPT; ++i) {
      const long long hs = (long long)(h0 + i) * p.new_stride_h;
      if (h0 + i < p.num_kv_heads) {
        k_lo[i] = append_load16(kin + hs);
        k_hi[i] = append_load16(kin + hs + D / 2);
        v_lo[i] = append_load16(vin + hs);
        v_hi[i] = append_load16(vin + hs + D / 2);
      }
    }
  };
  if constexpr (KVATTN_APPEND_LOADS_FIRST != 0) load_rows();   // (the rows exist for every t < nnz)
  const int b = __ldg(p.batch_indices + t), pos = __ldg(p.positions + t);
  if (b < 0 || b >= p.batch_size || pos < 0) return;
  const int first = __ldg(p.page_indptr + b), npages = __ldg(p.page_indptr + b + 1) - first;
  const int kv_len = npages > 0 ? (npages - 1) * p.page_size + __ldg(p.last_page_len + b) : 0;
  if (pos >= kv_len) return;
  const int pg = pos / p.page_size;
  const int page = __ldg(p.page_indices + first + pg);
  if (page < 0 || page >= p.num_pages) return;
  const long long dst = (long long)page * p.c_page + (long long)(pos - pg * p.page_size) * p.c_token + d0;
  if constexpr (KVATTN_APPEND_LOADS_FIRST == 0) load_rows();
  float inv[8];
  if constexpr (ROPE != 0) rope_inv_freq<ROPE == 2, D>(inv, d0, p.rope_log2_theta);
#pragma unroll
  for (int i = 0; i < HPT; ++i) {
    if (h0 + i >= p.num_kv_heads) break;
    const long long off = dst + (long long)(h0 + i) * p.c_head;
    KV* kout = static_cast<KV*>(p.k_cache) + off;
    KV* vout = static_cast<KV*>(p.v_cache) + off;
    if constexpr (IsFp8<KV>::value) {
      Raw8<T> r;
      float a[8], c[8];
      r.w[0] = k_lo[i]; r.to_float(a);
      r.w[0] = k_hi[i]; r.to_float(c);
      if constexpr (ROPE != 0) rope_rotate<ROPE == 2>(a, c, inv, (float)pos * p.rope_rcp_scale);
      const float ks = kv_cache_scale(p.k_scale_ptr, p.k_scale, h0 + i);
      store8_fp8(kout, a, ks);
      store8_fp8(kout + D / 2, c, ks);
      const float vs = kv_cache_scale(p.v_scale_ptr, p.v_scale, h0 + i);
      r.w[0] = v_lo[i]; r.to_float(a);
      r.w[0] = v_hi[i]; r.to_float(c);
      store8_fp8(vout, a, vs);
      store8_fp8(vout + D / 2, c, vs);
    } else {
      if constexpr (ROPE != 0) {
        Raw8<T> lo, hi;
        lo.w[0] = k_lo[i];
        hi.w[0] = k_hi[i];
        float a[8], c[8];
        lo.to_float(a);
        hi.to_float(c);
        rope_rotate<ROPE == 2>(a, c, inv, (float)pos * p.rope_rcp_scale);
        Vec8<T>::store(kout, a);
        Vec8<T>::store(kout + D / 2, c);
      } else {
        append_store16(kout, k_lo[i]);
        append_store16(kout + D / 2, k_hi[i]);
      }
      append_store16(vout, v_lo[i]);
      append_store16(vout + D / 2, v_hi[i]);
    }
  }
}

}  // namespace kvattn
