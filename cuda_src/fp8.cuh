// fp8 (e4m3 / e5m2) KV: the register conversions that feed fp8 K / V tiles to f16 tensor cores, and the in-place
// bf16 -> f16 conversion of query rows (an fp8 cache runs its products in f16: every fp8 value is exact in f16).
#pragma once
#include "mma.cuh"

namespace kvattn {

template <typename T> struct IsFp8 { static constexpr bool value = false; };
template <> struct IsFp8<__nv_fp8_e4m3> { static constexpr bool value = true; };
template <> struct IsFp8<__nv_fp8_e5m2> { static constexpr bool value = true; };

// The element type of the tensor-core operands for queries Q and a cache of KV: f16 for an fp8 cache, else Q.
template <typename Q, typename KV, bool FP8 = IsFp8<KV>::value> struct MmaType { using type = Q; };
template <typename Q, typename KV> struct MmaType<Q, KV, true> { using type = half; };
template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

// Two fp8 values (the low bytes of x's halves) -> f16x2 bits (low half from the low byte).
template <typename KV> struct Fp8;
template <> struct Fp8<__nv_fp8_e4m3> {
  __device__ __forceinline__ static unsigned pair(unsigned short x) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3);
    return (unsigned)h.x | ((unsigned)h.y << 16);
  }
  // bytes (b0, b1) and (b2, b3) of a 32-bit word
  __device__ __forceinline__ static void lo_hi(unsigned w, unsigned& lo, unsigned& hi) {
    lo = pair((unsigned short)(w & 0xffffu));
    hi = pair((unsigned short)(w >> 16));
  }
  // bytes (b0, b2) and (b1, b3)
  __device__ __forceinline__ static void even_odd(unsigned w, unsigned& ev, unsigned& od) {
    lo_hi(prmt(w, 0x3120u), ev, od);
  }
};
template <> struct Fp8<__nv_fp8_e5m2> {   // e5m2 is the high byte of an f16: a byte permute is the conversion
  __device__ __forceinline__ static void lo_hi(unsigned w, unsigned& lo, unsigned& hi) {
    lo = prmt(w, 0x1404u);
    hi = prmt(w, 0x3424u);
  }
  __device__ __forceinline__ static void even_odd(unsigned w, unsigned& ev, unsigned& od) {
    ev = prmt(w, 0x2404u);
    od = prmt(w, 0x3414u);
  }
};

// 16 fp8 values (one 16-byte chunk) -> 16 values of T (two 16-byte chunks, in order), each times `scale`: the
// product of an fp8 value and a float, rounded once to T.
template <typename KV, typename T>
__device__ __forceinline__ void dequant16(const uint4& w, float scale, uint4& lo, uint4& hi) {
  const unsigned src[4] = {w.x, w.y, w.z, w.w};
  unsigned out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned a, b;
    Fp8<KV>::lo_hi(src[i], a, b);
    const float2 fa = __half22float2(*reinterpret_cast<const half2*>(&a));
    const float2 fb = __half22float2(*reinterpret_cast<const half2*>(&b));
    out[2 * i] = Mma<T>::pack(fa.x * scale, fa.y * scale);
    out[2 * i + 1] = Mma<T>::pack(fb.x * scale, fb.y * scale);
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

__device__ __forceinline__ float kv_cache_scale(const float* per_head, float f, int kv_head) {
  return per_head ? __ldg(per_head + kv_head) * f : f;
}

// Byte offset of 16-byte chunk c of row r in a [rows][ROW_BYTES] tile, XOR-swizzled so that 8 consecutive rows at
// one chunk column hit 8 different bank groups (64-byte rows: two rows share a 128-byte line). Rows of 128 k + 64
// bytes (fp8 head dims 192, 576) swizzle their last 64 bytes by r % 4, so that every chunk stays in its row.
template <int ROW_BYTES> __device__ __forceinline__ int swz_bytes(int r, int c) {
  static_assert(ROW_BYTES % 64 == 0, "rows of whole 64-byte groups");
  if constexpr (ROW_BYTES % 128 == 0) return r * ROW_BYTES + ((c ^ (r & 7)) << 4);
  else if constexpr (ROW_BYTES == 64) return r * ROW_BYTES + ((c ^ ((r >> 1) & 3)) << 4);
  else return r * ROW_BYTES + ((c ^ (c < ROW_BYTES / 128 * 8 ? r & 7 : r & 3)) << 4);
}

// In place: bf16 query rows [ROWS][D] (swizzle swz<D>) -> f16, each row scaled by a power of two 2^-e (e >= 0, the
// least that keeps the row's largest |q| below f16's range); rs[row] = 2^e, the factor its scores take back.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void q_rows_to_half(__nv_bfloat16* qs, float* rs) {
  constexpr int TPR = THREADS / ROWS;     // threads per row (a power of two dividing 32: lanes of one warp)
  constexpr int CPT = (D / 8) / TPR;      // 16-byte chunks per thread
  static_assert(TPR * ROWS == THREADS && CPT * TPR == D / 8 && 32 % TPR == 0, "q conversion layout");
  const int r = threadIdx.x / TPR, t = threadIdx.x % TPR;
  uint4 w[CPT];
  float mx = 0.f;
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    w[c] = *reinterpret_cast<const uint4*>(qs + swz<D>(r, t + c * TPR));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w[c]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int o = 1; o < TPR; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const int e = max(0, ((__float_as_int(mx) >> 23) & 0xff) - 127 - 15);   // |q| < 2^16 fits f16 after rounding
  const float down = __int_as_float((127 - e) << 23);
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w[c]);
    uint4 u;
    half2* o = reinterpret_cast<half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      o[i] = __floats2half2_rn(f.x * down, f.y * down);
    }
    *reinterpret_cast<uint4*>(qs + swz<D>(r, t + c * TPR)) = u;
  }
  if (t == 0) rs[r] = __int_as_float((127 + e) << 23);
}

}  // namespace kvattn
