// Batch prefill / append, Hopper mainloop (sm_90a): warpgroup MMA (wgmma) with K/V streamed by cp.async.
//
// Same plan items, parameters, variants and epilogue as prefill.cuh (PrefillKernel's helpers); only the
// mainloop differs. One CTA = two warpgroups (8 warps, 256 threads) = 128 packed query rows, 64 per warpgroup
// (wgmma's M). KV tiles of N = 128 tokens stream through a 3-stage cp.async ring (page lookups computed two
// tiles ahead) into shared memory laid out the way wgmma reads it: 128-byte swizzle, i.e. per 64-column block
// of the head dim, 128-byte rows whose 16-byte chunk c sits at chunk c ^ (row % 8).
// S = Q K^T reads Q and K from shared memory (both K-major). O += P V reads P from registers (the S
// accumulators rounded to T: the accumulator layout of two adjacent 8-column blocks is the A layout of one
// k16 step) and V from shared memory, MN-major (the transpose bit).
// Per warpgroup, S(i+1) = Q K(i+1)^T is issued together with O += P(i) V(i), and the softmax of S(i+1) runs
// while P(i) V(i) is on the tensor cores; O is rescaled once both are done.
#pragma once
#include "prefill.cuh"
#include "wgmma.cuh"

namespace kvattn {

template <int D, bool SOFT_CAP, bool WINDOW, bool CUSTOM, typename T>
struct PrefillSm90 {
  using Base = PrefillKernel<D, 4, 2, SOFT_CAP, WINDOW, CUSTOM, T>;   // helpers only (items, masks, epilogue)
  using Item = typename Base::Item;
  static constexpr int THREADS = 256;
  static constexpr int ROWS = 128;                    // packed query rows per CTA
  static constexpr int N = 128;                       // KV tokens per tile
  static constexpr int STAGES = 3;
  static constexpr int CHUNKS = D / 8;                // 16-byte chunks per row
  static constexpr int Q_ELEMS = ROWS * D;
  static constexpr int KV_ELEMS = N * D;              // one of K or V per stage
  static constexpr int SMEM_BYTES = (Q_ELEMS + STAGES * 2 * KV_ELEMS) * (int)sizeof(T) + 2 * N * 8;
  static constexpr int RSTEP = THREADS / CHUNKS;      // rows per copy pass
  static constexpr int RPT = N / RSTEP;               // rows each thread copies per tile (of K and of V)
  static constexpr int SN = N / 2;                    // S accumulators per thread
  static constexpr int ON = D / 2;                    // O accumulators per thread
  static_assert(D == 64 || D == 128, "the sm90 mainloop covers head_dim 64 and 128");

  // Element offset of 16-byte chunk c of row r in a [R][D] tile: 64-column blocks of R rows of 128 bytes.
  template <int R> __device__ __forceinline__ static int sw(int r, int c) {
    return (c >> 3) * (R * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
  }

  __device__ __forceinline__ static void load_q(const PrefillParams& p, const Item& it, T* qs, int kvh) {
    const T* qg = static_cast<const T*>(p.q);
    const int group = p.group_size;
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
      const int r = i / CHUNKS, ch = i % CHUNKS;
      const bool ok = r < it.nrows;
      const int pr = it.row0 + (ok ? r : 0);
      const int tq = pr / group, h = pr - tq * group;
      const T* src = qg + (long long)(it.qo_start + tq) * p.q_stride_n + (long long)(kvh * group + h) * p.q_stride_h + ch * 8;
      cp_async16(qs + sw<ROWS>(r, ch), src, ok ? 16 : 0);
    }
  }

  // K and V rows of the tile starting at kv index t0 (element offsets `off`); rows past ke are zero-filled.
  __device__ __forceinline__ static void issue_kv(const PrefillParams& p, T* stage, const long long* off, int t0,
                                                  int ke, int kvh) {
    const int chunk = threadIdx.x % CHUNKS;
    const T* kg = static_cast<const T*>(p.k) + kvh * p.kv_stride_head + chunk * 8;
    const T* vg = static_cast<const T*>(p.v) + kvh * p.kv_stride_head + chunk * 8;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int row = threadIdx.x / CHUNKS + j * RSTEP;
      const long long o = off[row];
      const int bytes = t0 + row < ke ? 16 : 0;
      cp_async16(stage + sw<N>(row, chunk), kg + o, bytes);
      cp_async16(stage + KV_ELEMS + sw<N>(row, chunk), vg + o, bytes);
    }
  }

  // S = Q K^T for this warpgroup's 64 rows (issued and committed, not waited for).
  __device__ __forceinline__ static void issue_qk(float (&s)[SN], unsigned q_addr, unsigned k_addr) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned koff = (kk & 3) * 32;   // k16 step inside a 128-byte row
      Wgmma<T, N>::ss(s, sw128_desc(q_addr + (kk >> 2) * (ROWS * 128) + koff, 0),
                      sw128_desc(k_addr + (kk >> 2) * (N * 128) + koff, 0), kk > 0);
    }
    wgmma_commit();
  }

  // O += P V over the tile's N tokens, 16 at a time (issued and committed).
  __device__ __forceinline__ static void issue_pv(float (&o)[ON], const unsigned (&pa)[N / 16][4], unsigned v_addr) {
#pragma unroll
    for (int ks = 0; ks < N / 16; ++ks) Wgmma<T, D>::rs(o, pa[ks], sw128_desc(v_addr + ks * 16 * 128, N * 128), 1);
    wgmma_commit();
  }

  // Scores of the tile at t0 -> probabilities in place (online softmax over this thread's rows g, g + 8);
  // `scale` is the factor O must be multiplied by.
  template <bool MASK>
  __device__ __forceinline__ static void softmax(const PrefillParams& p, const Item& it, float (&s)[SN], int t0,
                                                 const int (&tok)[2], int lane, float (&m)[1][2], float (&l)[1][2],
                                                 float (&scale)[2]) {
    float mx[2] = {KVATTN_NEG_INF, KVATTN_NEG_INF};
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = Base::template score<MASK, false>(p, it, s[4 * nb + e], t0 + nb * 8 + 2 * (lane % 4) + (e & 1),
                                                          tok[e >> 1]);
        s[4 * nb + e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[0][r], mx[r]);
      scale[r] = m_new == KVATTN_NEG_INF ? 1.f : fast_exp2(m[0][r] - m_new);
      const float base = m_new == KVATTN_NEG_INF ? 0.f : m_new;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          float& x = s[4 * nb + 2 * r + e2];
          x = fast_exp2(x - base);
          sum += x;
        }
      l[0][r] = l[0][r] * scale[r] + sum;
      m[0][r] = m_new;
    }
  }

  __device__ __forceinline__ static void softmax_tile(const PrefillParams& p, const Item& it, float (&s)[SN], int t0,
                                                      const int (&tok)[2], int lane, float (&m)[1][2],
                                                      float (&l)[1][2], float (&scale)[2]) {
    if (Base::needs_mask(p, it, t0, N)) softmax<true>(p, it, s, t0, tok, lane, m, l, scale);
    else softmax<false>(p, it, s, t0, tok, lane, m, l, scale);
  }

  // P (the probabilities in s) as the A fragments of the k16 steps of P V.
  __device__ __forceinline__ static void pack_p(const float (&s)[SN], unsigned (&pa)[N / 16][4]) {
#pragma unroll
    for (int ks = 0; ks < N / 16; ++ks) {
      pa[ks][0] = Mma<T>::pack(s[8 * ks + 0], s[8 * ks + 1]);
      pa[ks][1] = Mma<T>::pack(s[8 * ks + 2], s[8 * ks + 3]);
      pa[ks][2] = Mma<T>::pack(s[8 * ks + 4], s[8 * ks + 5]);
      pa[ks][3] = Mma<T>::pack(s[8 * ks + 6], s[8 * ks + 7]);
    }
  }

  __device__ static void run(const PrefillParams& p, int w, T* smem) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4;
    const int kvh = blockIdx.y;
    Item it = Base::load_item(p, p.plan, w);
    T* qs = smem;
    T* kvs = smem + Q_ELEMS;
    long long* offs = reinterpret_cast<long long*>(kvs + STAGES * 2 * KV_ELEMS);   // [2][N]: tile t in slot t & 1
    const int ntiles = (it.ke - it.kb + N - 1) / N;

    // Prologue: Q joins tile 0's copy group; tile 1 is the second group; tile 2's page lookups.
    load_q(p, it, qs, kvh);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (s < ntiles) {
        if (tid < N) offs[s * N + tid] = Base::tok_offset(p, it.pages, min(it.kb + s * N + tid, it.ke - 1));
        __syncthreads();
        issue_kv(p, kvs + s * 2 * KV_ELEMS, offs + s * N, it.kb + s * N, it.ke, kvh);
      }
      cp_async_commit();
    }
    if (tid < N && 2 < ntiles) offs[tid] = Base::tok_offset(p, it.pages, min(it.kb + 2 * N + tid, it.ke - 1));

    // This thread's rows (warp * 16 + lane / 4 + 8 r): their query tokens, clamped for padding rows.
    int tok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) tok[r] = (it.row0 + min(warp * 16 + lane / 4 + 8 * r, it.nrows - 1)) / p.group_size;
    float o[1][CHUNKS][4];
    float m[1][2], l[1][2];
    reset_state(o, m, l);
    float (&acc)[ON] = reinterpret_cast<float (&)[ON]>(o);

    if (ntiles > 0) {
      const unsigned q_addr = smem_addr(qs) + wg * 64 * 128;
      const unsigned kv_addr = smem_addr(kvs);
      float s[SN];
      float sc[2];
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();
      wgmma_fence();
      issue_qk(s, q_addr, kv_addr);
      wgmma_wait<0>();
      fence_regs(s);
      softmax_tile(p, it, s, it.kb, tok, lane, m, l, sc);

      for (int ti = 0; ti + 1 < ntiles; ++ti) {
        // Tile ti + 1 has landed, and every warpgroup is done with P(ti-1) V(ti-1): its stage takes tile ti + 2.
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        if (ti + 2 < ntiles)
          issue_kv(p, kvs + ((ti + 2) % STAGES) * 2 * KV_ELEMS, offs + (ti & 1) * N, it.kb + (ti + 2) * N, it.ke, kvh);
        cp_async_commit();
        if (tid < N && ti + 3 < ntiles)
          offs[((ti + 3) & 1) * N + tid] = Base::tok_offset(p, it.pages, min(it.kb + (ti + 3) * N + tid, it.ke - 1));

        unsigned pa[N / 16][4];
        pack_p(s, pa);
        wgmma_fence();
        issue_qk(s, q_addr, kv_addr + ((ti + 1) % STAGES) * 2 * KV_ELEMS * (int)sizeof(T));
        issue_pv(acc, pa, kv_addr + ((ti % STAGES) * 2 * KV_ELEMS + KV_ELEMS) * (int)sizeof(T));
        wgmma_wait<1>();
        fence_regs(s);
        softmax_tile(p, it, s, it.kb + (ti + 1) * N, tok, lane, m, l, sc);
        wgmma_wait<0>();
        fence_regs(acc);
        if (sc[0] != 1.f || sc[1] != 1.f) {
#pragma unroll
          for (int i = 0; i < ON / 4; ++i) {
            acc[4 * i + 0] *= sc[0]; acc[4 * i + 1] *= sc[0];
            acc[4 * i + 2] *= sc[1]; acc[4 * i + 3] *= sc[1];
          }
        }
      }
      // Last tile: its V landed before the previous iteration's barrier (or the prologue's).
      unsigned pa[N / 16][4];
      pack_p(s, pa);
      wgmma_fence();
      issue_pv(acc, pa, kv_addr + (((ntiles - 1) % STAGES) * 2 * KV_ELEMS + KV_ELEMS) * (int)sizeof(T));
      wgmma_wait<0>();
      fence_regs(acc);
    }
    cp_async_wait<0>();
    it = Base::load_item(p, static_cast<const volatile int*>(p.plan), w);
    Base::store_rows(p, it, kvh, warp, lane, o, m, l);
  }
};

template <int D, bool SOFT_CAP, bool WINDOW, bool CUSTOM, typename T>
__global__ void __launch_bounds__(256, 1) prefill_sm90_kernel(const __grid_constant__ PrefillParams p) {
  if ((int)blockIdx.x >= p.plan[0]) return;   // padded grid (graph mode) or fewer items than launched
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  PrefillSm90<D, SOFT_CAP, WINDOW, CUSTOM, T>::run(p, blockIdx.x, reinterpret_cast<T*>(smem_raw));
}

}  // namespace kvattn
