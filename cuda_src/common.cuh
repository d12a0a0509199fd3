// Shared device helpers: 8-element vector loads/stores with float conversion, math helpers.
// NVRTC-safe: no host headers.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace kvattn {

// The header of every op's packed int32 plan buffer (kvattn/contract.py PLAN_HEADER: same fields, same order;
// tests/test_contract.py checks them against each other).
struct PlanHeader {
  int num_items;          // work items; a padded graph-mode grid exits past it
  int num_merge;          // output rows merged from partial states
  int batch_size;         // requests in the plan
  int num_partial_rows;   // partial (o, lse) rows the items write
  int num_chunks;         // decode: CTAs of the split-KV grid
  int num_kv_heads;       // prefill: KV heads per item (the sm90 kernel's units are items x heads)
  int kv_head_group;      // prefill: KV heads walked together (sm90 units by head group; 0: all of them)
  int reserved[1];
};
static_assert(sizeof(PlanHeader) == 32, "PlanHeader: 8 int32, as kvattn/contract.py");

__device__ __forceinline__ const PlanHeader& plan_header(const int* plan) {
  return *reinterpret_cast<const PlanHeader*>(plan);
}

// Programmatic dependent launch (sm_90+; no-ops before, and when the launch carries no programmatic dependency).
// A kernel launched with the programmatic-serialization attribute starts while its predecessor runs; it must
// wait before reading what the predecessor writes. The predecessor lets it launch early with the trigger.
__device__ __forceinline__ void wait_for_predecessor_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A hint: bring the 128-byte line holding p into L1 (no register, no wait).
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// *p += v as one gpu-scope acquire-release atomic (sm_70+): the release half orders what the calling thread's
// CTA wrote before a preceding barrier, the acquire half what other CTAs released before theirs. Returns the old value.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
#define KVATTN_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x without the MUFU unit (FMA and integer pipes; row_probs' POLY): x = j + f with j = round(x) (adding 1.5 * 2^23
// leaves j in the low mantissa bits), 2^f on [-0.5, 0.5] by a degree-3 polynomial (relative error under 7.5e-5,
// below the rounding of P to bf16 or fp16; tests/test_prefill_cpu.py mirrors it in float32), and j added to the
// result's exponent field. x must be finite and at most 127; below -125 it gives 2^-125 (not 0): callers pass
// scores minus a running max, finite on unmasked tiles, where 2^-125 weighs nothing beside the row's max term.
__device__ __forceinline__ float poly_exp2(float x) {
  x = fmaxf(x, -125.f);
  const float t = __fadd_rn(x, 12582912.f);
  const float f = __fsub_rn(x, __fsub_rn(t, 12582912.f));
  const float p = fmaf(fmaf(fmaf(0.0551715083f, f, 0.242610738f), f, 0.693260976f), f, 0.999928097f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// The sum of x over this lane's quad (the 4 lanes holding one row of an mma accumulator).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Online softmax of one row whose scores are spread over a quad of lanes (the mma accumulator layout): mx is this
// thread's max of the row's new scores, in the units of the running max m. Updates m and returns the factor
// the row's old sum and accumulators take; base is what to subtract from the scores before exp2 (0 while the
// row has seen no score, so that -inf scores give 0).
// LAZY = t > 0: a running max that the new scores exceed by at most t (log2 units) is kept, so the probabilities
// may reach 2^t and the factor is exactly 1: the caller skips the accumulators' rescale (O / l and the LSE m + log2 l
// are the same sums against another reference). 0: the max always moves.
template <int LAZY = 0>
__device__ __forceinline__ float online_max(float& m, float mx, float& base) {
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  if constexpr (LAZY > 0) {
    if (m != KVATTN_NEG_INF && mx <= m + LAZY) {
      base = m;
      return 1.f;
    }
  }
  const float m_new = fmaxf(m, mx);
  const float scale = m_new == KVATTN_NEG_INF ? 1.f : fast_exp2(m - m_new);
  base = m_new == KVATTN_NEG_INF ? 0.f : m_new;
  m = m_new;
  return scale;
}

// 8 consecutive elements <-> float[8]. Pointers must be 8-element aligned.
// RAW = 16-byte words holding 8 elements; load_raw / convert split a load from its use (more loads in flight).
template <typename T> struct Vec8;

template <typename T> struct Raw8 {
  static constexpr int WORDS = sizeof(T) / 2;
  uint4 w[WORDS];
  // COHERENT: data written by other CTAs of the running kernel (read through L2, never the read-only path).
  template <bool COHERENT = false> __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < WORDS; ++i)
      w[i] = COHERENT ? __ldcg(reinterpret_cast<const uint4*>(p) + i) : __ldg(reinterpret_cast<const uint4*>(p) + i);
  }
  __device__ __forceinline__ void to_float(float (&f)[8]) const;
};

template <> __device__ __forceinline__ void Raw8<float>::to_float(float (&f)[8]) const {
  const float* x = reinterpret_cast<const float*>(w);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = x[i];
}
template <> __device__ __forceinline__ void Raw8<half>::to_float(float (&f)[8]) const {
  const half2* h = reinterpret_cast<const half2*>(w);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 t = __half22float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}
template <> __device__ __forceinline__ void Raw8<__nv_bfloat16>::to_float(float (&f)[8]) const {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(w);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 t = __bfloat1622float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}

template <> struct Vec8<float> {
  __device__ __forceinline__ static void load(const float* p, float (&f)[8]) {
    float4 a = __ldg(reinterpret_cast<const float4*>(p));
    float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
  __device__ __forceinline__ static void store(float* p, const float (&f)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
};

template <> struct Vec8<half> {
  __device__ __forceinline__ static void load(const half* p, float (&f)[8]) {
    uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const half2* h = reinterpret_cast<const half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 t = __half22float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
  }
  __device__ __forceinline__ static void store(half* p, const float (&f)[8]) {
    uint4 u; half2* h = reinterpret_cast<half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  }
};

template <> struct Vec8<__nv_bfloat16> {
  __device__ __forceinline__ static void load(const __nv_bfloat16* p, float (&f)[8]) {
    uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 t = __bfloat1622float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, const float (&f)[8]) {
    uint4 u; __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  }
};

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace kvattn
