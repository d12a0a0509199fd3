// Batch decode on a paged KV cache: tensor-core (mma.sync m16n8k16) split-KV kernel.
//
// CTA (chunk c = blockIdx.x / z_split, kv head h = blockIdx.y) walks the work items [chunk_indptr[c], chunk_indptr[c+1])
// of the plan as ONE stream of 64-token KV tiles, so the cp.async pipeline keeps bytes in flight across item
// boundaries. The rows of the MMA tile are the group's query heads (head-group fusion): heads
// [z * ROWS, +ROWS) of the group with z = blockIdx.x % z_split, so any group size works; the z slices of one
// chunk are adjacent CTAs, so their common K/V is read from DRAM once and then hit in L2. Each of the 4 warps takes 16 tokens of every tile; their partial softmax states are merged
// through shared memory at the end of each item. Scores live in the log2 domain; the LSE written is natural.
#pragma once
#include "mma.cuh"
#include "variant.cuh"
#include "warp_merge.cuh"

#ifndef KVATTN_REFILL_FIRST
#define KVATTN_REFILL_FIRST 0
#endif

namespace kvattn {

// Mirrored by kvattn.decode.DECODE_PARAMS (a test checks size and offsets). Strides in elements.
struct DecodeParams {
  const void* q;               // [batch, Hq, D]
  const void* k;               // cache base; token t of page p, head h at p*kv_stride_page + t*kv_stride_token + h*kv_stride_head
  const void* v;
  void* o;                     // [batch, Hq, D]
  float* lse;                  // [batch, Hq] natural log, may be null
  float* tmp_o;                // [partial rows, Hq, D] float32
  float* tmp_lse;              // [partial rows, Hq]
  const int* plan;             // the scheduler's int32 work lists (kvattn.scheduler layout)
  const int* page_indptr;      // [batch + 1]
  const int* page_indices;     // [pages]
  const int* last_page_len;    // [batch]
  long long q_stride_n, q_stride_h, o_stride_n, o_stride_h, lse_stride_n;
  long long kv_stride_page, kv_stride_token, kv_stride_head;
  int off_chunk_indptr, off_work_req, off_work_begin, off_work_end, off_work_partial;
  int num_qo_heads, group_size, page_size, page_shift;   // page_shift = log2(page_size), or -1
  int window_left, z_split;
  float score_scale;           // log2(e) * sm_scale, or sm_scale / cap with a soft cap
  float cap_log2;              // log2(e) * cap (soft cap only)
  const float* variant_data;   // the variant's parameters (ALiBi: slopes [Hq]), may be null
};

template <int D, int M_TILES, int STAGES_, class V, typename T>
struct DecodeKernel {
  static constexpr int WARPS = 4;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int TILE = WARPS * 16;           // tokens per pipeline stage
  static constexpr int CHUNKS = D / 8;               // 16-byte chunks per row
  static constexpr int ROWS = 16 * M_TILES;          // query rows of the MMA tile
  static constexpr int STAGES = STAGES_;             // cp.async ring depth (tiles in flight + 1)
  static constexpr int KV_ELEMS = TILE * D;          // one of K or V per stage
  static constexpr int SCRATCH_PAD = (WarpMerge<D, 4>::BYTES - 2 * TILE * D * 2) / 2;  // epilogue room, elements
  static constexpr int STAGE_ELEMS = 2 * KV_ELEMS + SCRATCH_PAD;   // K, V (+ room for the epilogue)
  static constexpr int Q_ELEMS = ROWS * D;           // one Q slot; STAGES slots, by item ordinal
  static constexpr int SMEM_BYTES = (STAGES * STAGE_ELEMS + STAGES * Q_ELEMS) * 2;
  static constexpr int ROWS_PER_THREAD = TILE * CHUNKS / THREADS;   // K rows each thread copies per tile
  static_assert(D % 64 == 0, "head_dim must be 64, 128 or 256");
  static_assert((THREADS % CHUNKS) == 0, "thread layout");
  static_assert(WarpMerge<D, WARPS>::BYTES <= STAGE_ELEMS * 2, "epilogue scratch fits a stage");

  // Position in the tile stream: work item w (index into the plan), its token range, tile start t0.
  // Item w's query rows live in Q slot (w - w_first) % STAGES: the producer runs at most STAGES - 1 tiles
  // (so items) ahead, so a slot is rewritten only after the item that used it is finished.
  struct Cursor {
    int w, w_first, w_end, req, begin, end, t0;
    __device__ __forceinline__ bool valid() const { return w < w_end; }
  };

  const DecodeParams& p;
  const int h;        // kv head
  const int head0;    // first query head of this CTA: h * group_size + blockIdx.z * ROWS
  const int nrows;    // query heads of this CTA (<= ROWS)
  __device__ DecodeKernel(const DecodeParams& p_, int h_, int z)
      : p(p_), h(h_), head0(h_ * p_.group_size + z * ROWS), nrows(min(ROWS, p_.group_size - z * ROWS)) {}

  __device__ __forceinline__ void load_item(Cursor& c) const {
    if (c.w < c.w_end) {
      c.req = p.plan[p.off_work_req + c.w];
      c.begin = p.plan[p.off_work_begin + c.w];
      c.end = p.plan[p.off_work_end + c.w];
      c.t0 = c.begin;
    }
  }
  __device__ __forceinline__ void advance(Cursor& c) const {
    c.t0 += TILE;
    if (c.t0 >= c.end) { ++c.w; load_item(c); }
  }

  // Element offsets (page base + in-page token) of the K/V rows this thread copies for the cursor's tile.
  __device__ __forceinline__ void row_offsets(const Cursor& c, long long (&off)[ROWS_PER_THREAD]) const {
    if (!c.valid()) return;
    const int pbase = p.page_indptr[c.req];
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int row = threadIdx.x / CHUNKS + j * (THREADS / CHUNKS);
      const int tok = min(c.t0 + row, c.end - 1);
      int pg, in;
      if (p.page_shift >= 0) { pg = tok >> p.page_shift; in = tok & (p.page_size - 1); }
      else { pg = tok / p.page_size; in = tok - pg * p.page_size; }
      off[j] = (long long)p.page_indices[pbase + pg] * p.kv_stride_page + (long long)in * p.kv_stride_token;
    }
  }

  __device__ __forceinline__ T* q_slot(const Cursor& c, T* smem) const {
    return smem + STAGES * STAGE_ELEMS + ((c.w - c.w_first) % STAGES) * Q_ELEMS;
  }

  __device__ __forceinline__ void issue(const Cursor& c, const long long (&off)[ROWS_PER_THREAD], T* stage,
                                        T* qs) const {
    const int chunk = threadIdx.x % CHUNKS;
    const T* kb = static_cast<const T*>(p.k) + h * p.kv_stride_head + chunk * 8;
    const T* vb = static_cast<const T*>(p.v) + h * p.kv_stride_head + chunk * 8;
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int row = threadIdx.x / CHUNKS + j * (THREADS / CHUNKS);
      const int bytes = c.t0 + row < c.end ? 16 : 0;
      cp_async16(stage + swz<D>(row, chunk), kb + off[j], bytes);
      cp_async16(stage + KV_ELEMS + swz<D>(row, chunk), vb + off[j], bytes);
    }
    if (c.t0 == c.begin) {  // first tile of an item: bring its query rows (zeros past the group)
      const T* qb = static_cast<const T*>(p.q) + c.req * p.q_stride_n + (long long)head0 * p.q_stride_h;
      for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, ch = i % CHUNKS;
        const bool ok = r < nrows;
        cp_async16(qs + swz<D>(r, ch), ok ? qb + r * p.q_stride_h + ch * 8 : qb, ok ? 16 : 0);
      }
    }
  }

  // Issue the producer's tile into the slot consumed at iteration it - 1, move the producer on, and start the
  // page-id loads of its next tile (used one iteration later). Always commits a group (maybe empty).
  __device__ __forceinline__ void refill(Cursor& prod, long long (&off)[ROWS_PER_THREAD], T* smem, int it) const {
    if (prod.valid()) {
      issue(prod, off, smem + ((it + STAGES - 1) % STAGES) * STAGE_ELEMS, q_slot(prod, smem));
      advance(prod);
      row_offsets(prod, off);
    }
    cp_async_commit();
  }

  __device__ void run(int c_index, T* smem) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int* chunk_indptr = p.plan + p.off_chunk_indptr;
    Cursor prod{chunk_indptr[c_index], chunk_indptr[c_index], chunk_indptr[c_index + 1], 0, 0, 0, 0};
    if (prod.w >= prod.w_end) return;
    load_item(prod);
    Cursor cons = prod;
    long long off[ROWS_PER_THREAD];
    row_offsets(prod, off);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) refill(prod, off, smem, s + 1 - STAGES);   // fills slot s

    float o[M_TILES][CHUNKS][4];
    float m[M_TILES][2], l[M_TILES][2];
    int kv_len = 0;
    // the query / key transform's per-thread constants (the same dims for Q, by all threads, and K, by lanes)
    const typename V::QKState qk_state = V::template qk_init<D>(p, qk_dims<D>(threadIdx.x));
    for (int it = 0; cons.valid(); ++it) {
      T* stage = smem + (it % STAGES) * STAGE_ELEMS;
#if KVATTN_REFILL_FIRST
      // Refill the slot freed by the previous iteration BEFORE waiting for this tile: STAGES tiles are in
      // flight during the wait (two barriers per tile instead of one).
      __syncthreads();
      refill(prod, off, smem, it);
      cp_async_wait<STAGES - 1>();
      __syncthreads();
#else
      // Wait for this tile, then refill the slot freed by the previous iteration (one barrier per tile).
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      refill(prod, off, smem, it);
#endif

      if (cons.t0 == cons.begin) {  // a new item: reset the running state
        reset_state(o, m, l);
        if (VariantTraits<V>::kNeedsDiag) {   // the row's diagonal (kv_len - 1) for masks and positions
          const int np = p.page_indptr[cons.req + 1] - p.page_indptr[cons.req];
          kv_len = np == 0 ? 0 : (np - 1) * p.page_size + p.last_page_len[cons.req];
        }
        if constexpr (V::kQK) {   // the item's query rows (landed with its first tile), at the row's diagonal
          transform_rows<V, D>(p, qk_state, q_slot(cons, smem), 0, nrows, threadIdx.x, THREADS, cons.req, false,
                               [&](int) { return kv_len - 1; });
          __syncthreads();
        }
      }
      compute_tile(stage, q_slot(cons, smem), cons, kv_len, lane, warp, qk_state, o, m, l);
      if (cons.t0 + TILE >= cons.end) epilogue(stage, cons, lane, warp, o, m, l);
      advance(cons);
    }
    cp_async_wait<0>();
  }

  __device__ __forceinline__ void compute_tile(const T* stage, const T* q_tile, const Cursor& c, int kv_len, int lane, int warp,
                                               const typename V::QKState& qk_state,
                                               float (&o)[M_TILES][CHUNKS][4], float (&m)[M_TILES][2],
                                               float (&l)[M_TILES][2]) const {
    const T* ks = stage;
    const T* vs = stage + KV_ELEMS;
    const int tw = warp * 16;  // this warp's first token in the tile
    if constexpr (V::kQK) {   // this warp's 16 key rows, at their kv positions (only this warp reads them)
      transform_rows<V, D>(p, qk_state, const_cast<T*>(stage), tw, 16, lane, 32, c.req, true,
                           [&](int r) { return c.t0 + r; });
      __syncwarp();
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float s[2][4];
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4], b[4];
        const int j = lane / 8;
        ldmatrix_x4(a, q_tile + swz<D>(mt * 16 + (j % 2) * 8 + lane % 8, 2 * kk + j / 2));
        ldmatrix_x4(b, ks + swz<D>(tw + (j / 2) * 8 + lane % 8, 2 * kk + j % 2));
        Mma<T>::run(s[0], a, b[0], b[1]);
        Mma<T>::run(s[1], a, b[2], b[3]);
      }
      // Scores -> log2 domain, masks, online softmax over the thread's two rows (g, g+8).
      float rc[2] = {0.f, 0.f};   // the variant's per-row constants (rows are query heads head0 + row)
      if constexpr (V::kPositional) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
          rc[r] = V::row_init(p, min(head0 + mt * 16 + lane / 4 + 8 * r, p.num_qo_heads - 1), c.req);
      }
      float mx[2] = {KVATTN_NEG_INF, KVATTN_NEG_INF};
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = c.t0 + tw + nb * 8 + 2 * (lane % 4) + (e & 1);
          float x = V::logits(p, s[nb][e] * p.score_scale);
          if constexpr (V::kPositional) x = V::logits_at(p, x, tok, kv_len - 1, rc[e >> 1]);
          bool ok = tok < c.end;
          if (V::kWindow) ok = ok && (p.window_left < 0 || tok >= kv_len - 1 - p.window_left);
          if (V::kKeep) ok = ok && V::keep(p, tok, kv_len - 1);
          x = ok ? x : KVATTN_NEG_INF;
          s[nb][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      unsigned pa[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (V::kSoftmax) {
          float base;
          const float scale = online_max(m[mt][r], mx[r], base);
          float sum = 0.f;
#pragma unroll
          for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              float& x = s[nb][2 * r + e2];
              x = fast_exp2(x - base);
              sum += x;
            }
          l[mt][r] = l[mt][r] * scale + sum;
#pragma unroll
          for (int dn = 0; dn < CHUNKS; ++dn) { o[mt][dn][2 * r] *= scale; o[mt][dn][2 * r + 1] *= scale; }
        } else {   // weights, never rescaled: m is 0 once the warp saw a tile
          float sum = 0.f;
#pragma unroll
          for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              float& x = s[nb][2 * r + e2];
              x = variant_prob<V>(p, x);
              sum += x;
            }
          m[mt][r] = 0.f;
          l[mt][r] += sum;
        }
      }
      a_from_c<T>(&s[0][0], pa);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned b[4];
        const int j = lane / 8;
        ldmatrix_x4_trans(b, vs + swz<D>(tw + (j % 2) * 8 + lane % 8, 2 * dp + j / 2));
        Mma<T>::run(o[mt][2 * dp], pa, b[0], b[1]);
        Mma<T>::run(o[mt][2 * dp + 1], pa, b[2], b[3]);
      }
    }
  }

  // Merge the 4 warps' states of this item through the stage's shared memory and write o / lse.
  __device__ void epilogue(T* stage, const Cursor& c, int lane, int warp, float (&o)[M_TILES][CHUNKS][4],
                           float (&m)[M_TILES][2], float (&l)[M_TILES][2]) const {
    const WarpMerge<D, WARPS, V::kSoftmax> wm(stage);
    const int partial = p.plan[p.off_work_partial + c.w];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      __syncthreads();  // every warp is done with the stage's K/V (and the previous m-tile's scratch)
      wm.stash(warp, lane, o[mt], m[mt], l[mt]);
      __syncthreads();
      const int rows = min(16, nrows - mt * 16);
      for (int i = threadIdx.x; i < rows * CHUNKS; i += THREADS) {
        const int row = i / CHUNKS, ch = i % CHUNKS;
        float acc[8];
        float lse = wm.merge(row, ch, acc);
        const int head = head0 + mt * 16 + row;
        if (partial < 0) {
          if constexpr (V::kOutput) {
            const float f = V::output(p, head, lse);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] *= f;
          }
          Vec8<T>::store(static_cast<T*>(p.o) + c.req * p.o_stride_n + head * p.o_stride_h + ch * 8, acc);
          if (p.lse && ch == 0) p.lse[c.req * p.lse_stride_n + head] = lse;
        } else {
          Vec8<float>::store(p.tmp_o + ((long long)partial * p.num_qo_heads + head) * D + ch * 8, acc);
          if (ch == 0) p.tmp_lse[(long long)partial * p.num_qo_heads + head] = lse;
        }
      }
    }
  }
};

template <int D, int M_TILES, int STAGES, class V, typename T>
__global__ void __launch_bounds__(128) decode_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int chunk = blockIdx.x / p.z_split, z = blockIdx.x - chunk * p.z_split;
  DecodeKernel<D, M_TILES, STAGES, V, T> k(p, blockIdx.y, z);
  k.run(chunk, reinterpret_cast<T*>(smem_raw));
}

}  // namespace kvattn
