// Warp-level tensor-core and async-copy primitives (sm_80+ PTX; compiled for sm_90a).
#pragma once
#include "common.cuh"

namespace kvattn {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes 0 fills the 16 bytes with zeros and reads nothing.
// KVATTN_L2_PREFETCH=1 adds the .L2::256B hint: L2 fetches the whole 256-byte segment at once.
#ifndef KVATTN_L2_PREFETCH
#define KVATTN_L2_PREFETCH 0
#endif
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
#if KVATTN_L2_PREFETCH
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}
// Two 8x8 matrices (lanes 0-15 give the row addresses): 8-token warp tiles of the decode kernel.
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(smem)));
}

// D(16x8, f32) += A(16x16) * B(16x8), operands of type T (half or bf16).
template <typename T> struct Mma;
template <> struct Mma<half> {
  __device__ __forceinline__ static void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float x, float y) {
    half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
  }
};
template <> struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
  }
};

// The A fragment (16 x 16) of a k16 step from two adjacent 8-column accumulator fragments c[0..3], c[4..7]
// (the C layout of n-blocks 2k and 2k + 1 is the A layout of k16 step k), rounded to T.
template <typename T> __device__ __forceinline__ void a_from_c(const float* c, unsigned (&a)[4]) {
  a[0] = Mma<T>::pack(c[0], c[1]);
  a[1] = Mma<T>::pack(c[2], c[3]);
  a[2] = Mma<T>::pack(c[4], c[5]);
  a[3] = Mma<T>::pack(c[6], c[7]);
}

// Element offset of 16-byte chunk c of row r in a [rows][D] tile whose chunks are XOR-swizzled by r % 8,
// so that ldmatrix over 8 rows at one chunk column hits 8 different bank groups.
template <int D> __device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

}  // namespace kvattn
