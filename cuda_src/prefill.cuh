// Batch prefill / append on a paged or ragged KV cache: FA2-style tensor-core kernel (mma.sync m16n8k16).
//
// One CTA (4 warps) runs one work item of the plan for one KV head (blockIdx.x = item, blockIdx.y = kv head):
// packed query rows [row0, row0 + nrows) of request req against KV tokens [kv_begin, kv_end). Packed row pr is
// query token pr / group and query head kv_head * group + pr % group (head-group fusion: the group's heads share
// every K/V tile load). The CTA's ROWS = 16 * MT * WARPS_M rows are split among WARPS_M warps (MT 16-row MMA
// tiles each); with WARPS_M = 1 the 4 warps split each 64-token KV tile instead and their softmax states are
// merged through shared memory at the end (small packed lengths: speculative verification, short appends).
// K/V tiles of 64 tokens stream through a cp.async ring of STAGES stages; each tile's per-token element offsets
// (page lookup) are computed one tile ahead into shared memory. A ragged KV is a paged KV with one "page" per
// request of 2^30 tokens whose id is the request's first token (kv_stride_page = kv_stride_token).
// Causal is bottom-right aligned: token i sees kv j <= kv_len - qo_len + i; the plan never schedules a fully
// masked tile, and only tiles that straddle a mask boundary take the masked path. Scores live in the log2
// domain; the LSE written is natural. Items with partial >= 0 write float32 (o, lse) rows that the merge kernel
// (merge.cuh, indexed form) combines: row partial + (token - first token of the item) * pstride.
// The mainloop (load_q / issue_kv / compute) is the part the Hopper kernel (prefill_sm90.cuh: wgmma,
// warp-specialised) replaces; it shares the plan, the item decoding (load_item), the variants (score,
// needs_mask), the Q copy (copy_q) and the epilogue (store_rows) defined here.
// An fp8 cache (KV = __nv_fp8_e4m3 / e5m2) streams through the ring as fp8; each tile is expanded (times
// k_scale / v_scale, rounded once to Q's type) into one 16-bit K/V tile that the unchanged mainloop reads.
#pragma once
#include "traits.cuh"
#include "variant.cuh"
#include "warp_merge.cuh"

// Packed rows' query tokens (row / group_size) by the plan's multiplier and shift, one wide multiply (1: the default,
// +0.3-6% on the sm90 kernel, run 48b), or by division (0: each runtime division is ~18 instructions, several through
// the MUFU pipe the softmax's exp2 share). The A/B of scripts/ab_sm90.py --groupdiv.
#ifndef KVATTN_GROUP_MAGIC
#define KVATTN_GROUP_MAGIC 1
#endif

namespace kvattn {

// Mirrored by kvattn.prefill.PREFILL_PARAMS (a test checks the size). Strides in elements; offsets in int32
// elements of `plan`.
// A CUtensorMap: opaque, 64-byte aligned, read from the kernel's parameter space by cp.async.bulk.tensor.
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};

struct PrefillParams {
  const void* q;               // [total_qo, Hq, D_QK] (any row / head strides, D_QK contiguous)
  const void* k;               // token t of page pg, head h at pg*kv_stride_page + t*kv_stride_token + h*kv_stride_head
  const void* v;
  void* o;                     // [total_qo, Hq, D_VO]
  float* lse;                  // [total_qo, Hq] natural log, may be null
  float* tmp_o;                // [partial rows, Hq, D_VO] float32
  float* tmp_lse;              // [partial rows, Hq]
  const int* plan;             // PlanHeader (common.cuh), then the regions below
  const unsigned char* mask;   // bit-packed custom mask (V::kCustomMask only), little bit order
  long long q_stride_n, q_stride_h, o_stride_n, o_stride_h, lse_stride_n;
  long long kv_stride_page, kv_stride_token, kv_stride_head;
  int off_qo_indptr, off_kv_len, off_page_indptr, off_page_indices, off_mask_indptr, off_items;
  int num_qo_heads, group_size, page_size, page_shift, causal, window_left;
  float score_scale;           // log2(e) * sm_scale, or sm_scale / cap with a soft cap
  float cap_log2;              // log2(e) * cap (soft cap only)
  const float* variant_data;   // the variant's parameters (ALiBi: slopes [Hq]), may be null
  const float* k_scale_ptr;    // fp8 cache: per-KV-head scales [Hkv] (may be null), times k_scale / v_scale
  const float* v_scale_ptr;
  float k_scale, v_scale;
  int tma_mode;                // sm90, 16-bit cache: 0 = per-thread copies only, 1 = ragged, 2 = paged tensor maps
  int tma_rows;                // rows of one box (kvattn/tma.py); an item takes the boxes if kb % tma_rows == 0
  int tma_hnd;                 // the maps' dims are (D, slot, head, page) ("HND"), else (D, head, slot, page)
  int tma_q;                   // sm90: 1 = each unit's Q tile by tma_qmap (kvattn.tma.RowsTensorMap), 0 = per-thread copies
  int tma_o;                   // sm90: 1 = whole units' O by tma_omap (stored from shared memory), 0 = per-thread stores
  int off_counters;            // sm90 fused split merge (KVATTN_SM90_FMERGE): int32 arrival counters in the plan; 0 = none
  unsigned group_mul;          // x / group_size = (x * group_mul) >> group_shr for 0 <= x < 2^31 (kvattn.prefill.group_magic)
  int group_shr;
  TmaMap tma_k, tma_v;         // cuTensorMapEncodeTiled descriptors of k and v, written by run()
  TmaMap tma_qmap;             // of q: (D_QK, group, Hkv, tokens), boxes of (64, group, 1, Q_BOX / group), written by run()
  TmaMap tma_omap;             // of o: (D_VO, group, Hkv, tokens), boxes of (64, group, 1, 64 / group), written by run()
};

// A: the element types and head dims (traits.cuh).
template <class A, int WARPS_M, int MT, class V>
struct PrefillKernel {
  using Q = typename A::Q;
  using KV = typename A::KV;
  using O = typename A::O;
  using T = Q;   // the 16-bit tiles' and MMA operands' type (an fp8 cache is expanded to it)
  static constexpr int D_QK = A::D_QK;
  static constexpr int D_VO = A::D_VO;
  static constexpr bool kFp8 = A::kFp8;
  static constexpr int WARPS = 4;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int WARPS_N = WARPS / WARPS_M;
  static constexpr int ROWS = 16 * MT * WARPS_M;     // packed query rows per CTA
  static constexpr int TILE = 64;                    // KV tokens per pipeline stage
  static constexpr int NW = TILE / WARPS_N;          // tokens of each tile a warp handles
  // Tokens per softmax step: the whole slice when the accumulators are small, else fewer (register budget).
  // Tuning knobs (defines of the KernelSpec; the defaults are what kvattn.prefill launches):
  //   KVATTN_PF_SUBN2: softmax step of the MT = 2 tiles; KVATTN_PF_KK_UNROLL: unroll of the QK^T k-loop;
  //   KVATTN_PF_QREGS: keep the Q fragments in registers (MT = 1 tiles; halves the ldmatrix traffic of QK^T).
#ifndef KVATTN_PF_SUBN2
#define KVATTN_PF_SUBN2 32
#endif
#ifndef KVATTN_PF_KK_UNROLL
#define KVATTN_PF_KK_UNROLL 2
#endif
#ifndef KVATTN_PF_QREGS
#define KVATTN_PF_QREGS 0
#endif
  //   KVATTN_PF_FAST64 (MT = 2, no variant): tiles that need no mask take the whole 64-token slice in one softmax
  //   step (Q fragments read once per tile instead of once per step); masked tiles keep KVATTN_PF_SUBN2, and
  //   the masked path recomputes its rows' query tokens instead of holding them across the mainloop.
#ifndef KVATTN_PF_FAST64
#define KVATTN_PF_FAST64 0
#endif
  //   KVATTN_PF_FOLD (no soft cap): on tiles that need no mask the row max is taken over the raw scores and
  //   the score scale is folded into the exponent, p = exp2(fma(s, score_scale, -m)): one FFMA per score
  //   instead of FMUL + FADD. Needs score_scale > 0 (max commutes with the scaling); other scales send every
  //   tile down the masked path, which keeps the separate multiply.
#ifndef KVATTN_PF_FOLD
#define KVATTN_PF_FOLD 0
#endif
  // (variant kernels of MT = 2 keep 16: their extra registers would spill at 32)
  static constexpr int SUB_CAP = MT == 2 ? (VariantTraits<V>::kAny ? 16 : KVATTN_PF_SUBN2) : 32;
  static constexpr int SUBN = (D_VO * MT <= 128) ? NW : (NW < SUB_CAP ? NW : SUB_CAP);
  static constexpr bool QREGS = KVATTN_PF_QREGS && MT == 1;
  static constexpr int KK_UNROLL = QREGS ? D_QK / 16 : KVATTN_PF_KK_UNROLL;
  static constexpr int QF = QREGS ? D_QK / 16 : 1;   // Q fragments held in registers
  static constexpr int NB = SUBN / 8;                // 8-token MMA blocks per step (compute's STEP / 8)
  static constexpr int Q_CHUNKS = A::QK_CHUNKS;      // 16-byte chunks per Q / K row
  static constexpr int CHUNKS = A::VO_CHUNKS;        // per V / O row (8-column blocks of the output)
  static constexpr int STAGES = (WARPS_M == 1 && D_QK + D_VO <= 256) ? 3 : 2;
  static constexpr int K_ELEMS = TILE * D_QK;        // K of a 16-bit stage (V follows)
  static constexpr int V_ELEMS = TILE * D_VO;
  static constexpr int STAGE_ELEMS = K_ELEMS + V_ELEMS; // a 16-bit stage
  static constexpr int Q_ELEMS = ROWS * D_QK;
  // TPR adjacent threads copy one token's K and V rows (TPR divides both rows' 16-byte chunks and THREADS):
  // thread t chunks t % TPR + k TPR of rows t / TPR + j RSTEP (equal rows: TPR = CHUNKS, one chunk of each).
  static constexpr int TPR = gcd(gcd(Q_CHUNKS, CHUNKS), THREADS);
  static constexpr int RSTEP = THREADS / TPR;        // rows per copy pass
  static constexpr int RPT = TILE / RSTEP;           // rows each thread copies per tile (of K and of V)
  // K/V region: STAGES 16-bit stages, or (fp8) one 16-bit K/V tile then STAGES fp8 stages
  static constexpr int FP8_STAGE = TILE * (A::K_ROW_BYTES + A::V_ROW_BYTES);   // an fp8 stage (K rows, then V's)
  static constexpr int KV_REGION = kFp8 ? STAGE_ELEMS * (int)sizeof(T) + STAGES * FP8_STAGE
                                        : STAGES * STAGE_ELEMS * (int)sizeof(T);
  static constexpr int SMEM_BYTES = Q_ELEMS * (int)sizeof(T) + KV_REGION + 2 * TILE * 8;
  static_assert(TILE % RSTEP == 0, "whole copy passes per tile");
  static_assert(!V::kQK || THREADS % (D_QK / 16) == 0,
                "a query / key transform's threads (D_QK / 16 a row) tile the CTA: D_QK 64, 128 or 256");
  static_assert(WARPS_N == 1 || MT == 1, "warps split the KV tile only with one m-tile per warp");
  static_assert(SUBN % 16 == 0, "softmax step is a multiple of the MMA k");
  static_assert(WARPS_N == 1 || WarpMerge<D_VO, WARPS>::BYTES <= KV_REGION, "warp-merge scratch fits the K/V stages");

  // Per-item state of this thread.
  struct Item {
    int req, row0, nrows, kb, ke, partial, pstride;
    int qo_start, qo_len, kv_len, delta, tok_lo, tok_hi;
    const int* pages;
    long long mask_bit0;     // first bit of the request's custom mask
  };

  // Page pg of the item's page list and slot `in` inside it of item token tok (ragged: one page of 2^30 slots).
  __device__ __forceinline__ static void page_slot(const PrefillParams& p, int tok, int& pg, int& in) {
    if (p.page_shift >= 0) { pg = tok >> p.page_shift; in = tok & ((1 << p.page_shift) - 1); }
    else { pg = tok / p.page_size; in = tok - pg * p.page_size; }
  }

  __device__ __forceinline__ static long long tok_offset(const PrefillParams& p, const int* pages, int tok) {
    int pg, in;
    page_slot(p, tok, pg, in);
    return (long long)__ldg(pages + pg) * p.kv_stride_page + (long long)in * p.kv_stride_token;
  }

  // fp8: the tile's rows as fp8 (row r of K at stage + r * D_QK bytes, V's after TILE rows), zero past ke.
  __device__ __forceinline__ static void issue_kv8(const PrefillParams& p, unsigned char* stage, const long long* off,
                                                   int t0, int ke, int kvh) {
    // threads per row (dividing both rows' 16-byte chunks), rows per pass
    constexpr int C8 = gcd(gcd(D_QK / 16, D_VO / 16), THREADS), RS8 = THREADS / C8;
    const int chunk = threadIdx.x % C8;
    const KV* kg = static_cast<const KV*>(p.k) + kvh * p.kv_stride_head + chunk * 16;
    const KV* vg = static_cast<const KV*>(p.v) + kvh * p.kv_stride_head + chunk * 16;
#pragma unroll
    for (int j = 0; j < TILE / RS8; ++j) {
      const int row = threadIdx.x / C8 + j * RS8;
      const long long o = off[row];
      const int bytes = t0 + row < ke ? 16 : 0;
#pragma unroll
      for (int k = 0; k < D_QK / 16 / C8; ++k)
        cp_async16(stage + row * D_QK + (chunk + k * C8) * 16, kg + o + k * C8 * 16, bytes);
#pragma unroll
      for (int k = 0; k < D_VO / 16 / C8; ++k)
        cp_async16(stage + TILE * D_QK + row * D_VO + (chunk + k * C8) * 16, vg + o + k * C8 * 16, bytes);
    }
  }

  // fp8: expand a landed fp8 stage into the 16-bit K/V tile (swizzled as the mainloop reads it).
  __device__ __forceinline__ static void expand_kv8(const unsigned char* stage, T* tile, float ks, float vs) {
    if constexpr (D_QK == D_VO) {   // one pass over the rows of both
      constexpr int D = D_QK, C8 = D / 16;
      for (int i = threadIdx.x; i < TILE * C8; i += THREADS) {
        const int row = i / C8, c = i % C8;
        uint4 lo, hi;
        dequant16<KV, T>(*reinterpret_cast<const uint4*>(stage + row * D + c * 16), ks, lo, hi);
        *reinterpret_cast<uint4*>(tile + swz<D>(row, 2 * c)) = lo;
        *reinterpret_cast<uint4*>(tile + swz<D>(row, 2 * c + 1)) = hi;
        dequant16<KV, T>(*reinterpret_cast<const uint4*>(stage + TILE * D + row * D + c * 16), vs, lo, hi);
        *reinterpret_cast<uint4*>(tile + K_ELEMS + swz<D>(row, 2 * c)) = lo;
        *reinterpret_cast<uint4*>(tile + K_ELEMS + swz<D>(row, 2 * c + 1)) = hi;
      }
    } else {
      expand_rows8<D_QK>(stage, tile, ks);
      expand_rows8<D_VO>(stage + TILE * D_QK, tile + K_ELEMS, vs);
    }
  }
  // The TILE fp8 rows of DR values at src (times scale) -> the 16-bit [TILE][DR] tile dst.
  template <int DR> __device__ __forceinline__ static void expand_rows8(const unsigned char* src, T* dst, float scale) {
    constexpr int C8 = DR / 16;
    for (int i = threadIdx.x; i < TILE * C8; i += THREADS) {
      const int row = i / C8, c = i % C8;
      uint4 lo, hi;
      dequant16<KV, T>(*reinterpret_cast<const uint4*>(src + row * DR + c * 16), scale, lo, hi);
      *reinterpret_cast<uint4*>(dst + swz<DR>(row, 2 * c)) = lo;
      *reinterpret_cast<uint4*>(dst + swz<DR>(row, 2 * c + 1)) = hi;
    }
  }

  __device__ __forceinline__ static void issue_kv(const PrefillParams& p, T* stage, const long long* off, int t0,
                                                  int ke, int kvh) {
    const int chunk = threadIdx.x % TPR;
    const KV* kg = static_cast<const KV*>(p.k) + kvh * p.kv_stride_head + chunk * 8;
    const KV* vg = static_cast<const KV*>(p.v) + kvh * p.kv_stride_head + chunk * 8;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int row = threadIdx.x / TPR + j * RSTEP;
      const long long o = off[row];
      const int bytes = t0 + row < ke ? 16 : 0;
#pragma unroll
      for (int k = 0; k < Q_CHUNKS / TPR; ++k)
        cp_async16(stage + swz<D_QK>(row, chunk + k * TPR), kg + o + k * TPR * 8, bytes);
#pragma unroll
      for (int k = 0; k < CHUNKS / TPR; ++k)
        cp_async16(stage + K_ELEMS + swz<D_VO>(row, chunk + k * TPR), vg + o + k * TPR * 8, bytes);
    }
  }

  // The item's R packed query rows (token pr / group, head kvh * group + pr % group), zero-filled past nrows,
  // copied by threads [0, NT): chunk ch of row r goes to qs + place(r, ch) (the mainloop's smem layout).
  template <int R, int NT, typename Place>
  __device__ __forceinline__ static void copy_q(const PrefillParams& p, const Item& it, Q* qs, int kvh, Place place) {
    const Q* qg = static_cast<const Q*>(p.q);
    const int group = p.group_size;
    for (int i = threadIdx.x; i < R * Q_CHUNKS; i += NT) {
      const int r = i / Q_CHUNKS, ch = i % Q_CHUNKS;
      const bool ok = r < it.nrows;
      const int pr = it.row0 + (ok ? r : 0);
      const int tq = row_token(p, pr), h = pr - tq * group;
      const Q* src = qg + (long long)(it.qo_start + tq) * p.q_stride_n + (long long)(kvh * group + h) * p.q_stride_h + ch * 8;
      cp_async16(qs + place(r, ch), src, ok ? 16 : 0);
    }
  }

  __device__ __forceinline__ static void load_q(const PrefillParams& p, const Item& it, Q* qs, int kvh) {
    copy_q<ROWS, THREADS>(p, it, qs, kvh, [](int r, int ch) { return swz<D_QK>(r, ch); });
  }

  // Score of kv token j for a row of query token tok: log2 domain, soft cap, masks (-inf when masked). CM: the
  // custom-mask bit of (tok, j), already looked up by the caller (MASK_BITS), else read here.
  template <bool MASK, bool FOLD, bool MASK_BITS = false>
  __device__ __forceinline__ static float score(const PrefillParams& p, const Item& it, float s, int j, int tok,
                                                float rc = 0.f, bool cm = true) {
    float x = V::logits(p, FOLD ? s : s * p.score_scale);
    if constexpr (V::kPositional) x = V::logits_at(p, x, j, it.delta + tok, rc);
    if (MASK) {
      const int lim = it.delta + tok;   // the diagonal of this row
      bool ok = j < it.ke;
      if (p.causal) ok = ok && j <= lim;
      if (V::kWindow) ok = ok && (p.window_left < 0 || j >= lim - p.window_left);
      if (V::kKeep) ok = ok && V::keep(p, j, lim);
      if (V::kCustomMask && MASK_BITS) {
        ok = ok && cm;
      } else if (V::kCustomMask) {
        if (ok) {
          const long long bit = it.mask_bit0 + (long long)tok * it.kv_len + j;
          ok = (__ldg(p.mask + (bit >> 3)) >> (bit & 7)) & 1;
        }
      }
      x = ok ? x : KVATTN_NEG_INF;
    }
    return x;
  }

  // The variant's per-row constants of this thread's rows (kPositional only): packed row pr is query head
  // kvh * group + pr % group.
  template <int NM>
  __device__ __forceinline__ static void row_consts(const PrefillParams& p, const Item& it, int kvh, int first_row,
                                                    int lane, float (&rc)[NM][2]) {
#pragma unroll
    for (int mt = 0; mt < NM; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rc[mt][r] = 0.f;
        if constexpr (V::kPositional) {
          const int pr = it.row0 + min(first_row + mt * 16 + lane / 4 + 8 * r, it.nrows - 1);
          rc[mt][r] = V::row_init(p, kvh * p.group_size + pr % p.group_size, it.req);
        }
      }
  }

  // Whether the tile of `tile` tokens starting at kv index t0 needs the masked path for some row of the item.
  __device__ __forceinline__ static bool needs_mask(const PrefillParams& p, const Item& it, int t0, int tile) {
    bool need = V::kCustomMask || t0 + tile > it.ke;
    if (p.causal) need = need || t0 + tile - 1 > it.delta + it.tok_lo;
    if (V::kWindow) need = need || (p.window_left >= 0 && t0 < it.delta + it.tok_hi - p.window_left);
    if (V::kKeep) need = need || V::tile_may_mask(p, t0, it.delta + it.tok_hi);
    return need;
  }

  // One 64-token tile (t0 = its first kv index) for this warp's rows and token slice.
  template <bool MASK, int STEP>
  __device__ __forceinline__ static void compute(const PrefillParams& p, const Item& it, const T* qs, const T* ks,
                                                 int t0, const int (&tokr)[MT][2], const float (&rc)[MT][2],
                                                 const unsigned (&qf)[QF][4], int lane,
                                                 int warp_m, int warp_n, float (&o)[MT][CHUNKS][4], float (&m)[MT][2],
                                                 float (&l)[MT][2]) {
    constexpr int NB = STEP / 8;
    constexpr bool FOLD = KVATTN_PF_FOLD && !MASK && !V::kLogits && V::kSoftmax;
    const T* vs = ks + K_ELEMS;
    const int j8 = lane / 8;
#pragma unroll
    for (int sub = 0; sub < NW / STEP; ++sub) {
      const int tw = warp_n * NW + sub * STEP;   // first token of this step inside the tile
      float s[MT][NB][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nb][e] = 0.f;
#pragma unroll KK_UNROLL
      for (int kk = 0; kk < D_QK / 16; ++kk) {
        unsigned a[MT][4];
        if constexpr (QREGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[0][e] = qf[kk][e];
        } else {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(a[mt], qs + swz<D_QK>((warp_m * MT + mt) * 16 + (j8 % 2) * 8 + lane % 8, 2 * kk + j8 / 2));
        }
#pragma unroll
        for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
          unsigned b[4];
          ldmatrix_x4(b, ks + swz<D_QK>(tw + nb2 * 16 + (j8 / 2) * 8 + lane % 8, 2 * kk + j8 % 2));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(s[mt][2 * nb2], a[mt], b[0], b[1]);
            Mma<T>::run(s[mt][2 * nb2 + 1], a[mt], b[2], b[3]);
          }
        }
      }
      // Scores -> log2 domain, variants, masks; online softmax over the thread's two rows (g, g + 8).
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {KVATTN_NEG_INF, KVATTN_NEG_INF};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = score<MASK, FOLD>(p, it, s[mt][nb][e], t0 + tw + nb * 8 + 2 * (lane % 4) + (e & 1),
                                              tokr[mt][e >> 1], rc[mt][e >> 1]);
            s[mt][nb][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
          }
        if constexpr (!V::kSoftmax) {   // weights, never rescaled
#pragma unroll
          for (int r = 0; r < 2; ++r) row_probs<V, FOLD>(p, s[mt], r, mx[r], m[mt][r], l[mt][r]);
          continue;
        }
        float scale[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) scale[r] = row_probs<V, FOLD>(p, s[mt], r, mx[r], m[mt][r], l[mt][r]);
        // Rescale the accumulators only when some row's running max moved (rare after the first tiles).
        if (__any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f)) {
#pragma unroll
          for (int dn = 0; dn < CHUNKS; ++dn) {
            o[mt][dn][0] *= scale[0]; o[mt][dn][1] *= scale[0];
            o[mt][dn][2] *= scale[1]; o[mt][dn][3] *= scale[1];
          }
        }
      }
      // O += P V over the step's tokens, 16 at a time.
#pragma unroll
      for (int kst = 0; kst < STEP / 16; ++kst) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) a_from_c<T>(&s[mt][2 * kst][0], pa[mt]);
#pragma unroll
        for (int dp = 0; dp < D_VO / 16; ++dp) {
          unsigned b[4];
          ldmatrix_x4_trans(b, vs + swz<D_VO>(tw + kst * 16 + (j8 % 2) * 8 + lane % 8, 2 * dp + j8 / 2));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(o[mt][2 * dp], pa[mt], b[0], b[1]);
            Mma<T>::run(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // Final (or partial) output of one packed row: `vals` are 8 consecutive elements starting at column `col`,
  // already normalised.
  // Packed row x's query token, x / p.group_size (0 <= x < 2^31).
  __device__ __forceinline__ static int row_token(const PrefillParams& p, int x) {
#if KVATTN_GROUP_MAGIC
    return (int)(((unsigned long long)(unsigned)x * p.group_mul) >> p.group_shr);
#else
    return x / p.group_size;
#endif
  }

  __device__ __forceinline__ static void row_dest(const PrefillParams& p, const Item& it, int row, int kvh, int& tq,
                                                  int& head) {
    const int pr = it.row0 + row;
    tq = row_token(p, pr);
    head = kvh * p.group_size + (pr - tq * p.group_size);
  }

  // A finished row's output factor 1 / l (0 for an empty row) and its LSE (natural log; -inf when empty), from its
  // running max m and its sum l over the row's quad. A non-softmax row is empty when its weights sum to 0 (its m is
  // 0 once it saw a tile).
  __device__ __forceinline__ static void row_scale(float m, float l, float& inv, float& lse) {
    const bool empty = V::kSoftmax ? m == KVATTN_NEG_INF : !(l > 0.f);
    inv = empty ? 0.f : 1.f / l;
    lse = empty ? KVATTN_NEG_INF : (m + __log2f(l)) * kLn2;
  }

  // Epilogue of warps that own whole rows: MTX 16-row tiles from row 16 * MTX * warp_m, accumulators in the
  // mma.sync C layout (o[mt][n8 block][4]; rows lane / 4 and lane / 4 + 8). l is this thread's partial sum.
  // SMEM (sm90, whole units of one request): the O rows go to shared memory, element (row, col) at so + place(row,
  // col), for the caller's bulk tensor store; the LSE still goes to global memory from here.
  template <int MTX, bool SMEM = false, class Place = int>
  __device__ __forceinline__ static void store_rows(const PrefillParams& p, const Item& it, int kvh, int warp_m,
                                                    int lane, const float (&o)[MTX][CHUNKS][4],
                                                    const float (&m)[MTX][2], const float (&l)[MTX][2],
                                                    O* so = nullptr, Place place = 0) {
#pragma unroll
    for (int mt = 0; mt < MTX; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float lr = quad_sum(l[mt][r]);
        const int row = (warp_m * MTX + mt) * 16 + lane / 4 + 8 * r;
        if (row < it.nrows) {
          int tq, head;
          row_dest(p, it, row, kvh, tq, head);
          float inv, lse;
          row_scale(m[mt][r], lr, inv, lse);
          const int col = 2 * (lane % 4);
          if (it.partial < 0) {
            if constexpr (V::kOutput) inv *= V::output(p, head, lse);
            if constexpr (SMEM) {
#pragma unroll
              for (int dn = 0; dn < CHUNKS; ++dn)
                *reinterpret_cast<unsigned*>(so + place(row, dn * 8 + col)) =
                    Mma<O>::pack(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
            } else {
              O* dst = static_cast<O*>(p.o) + (long long)(it.qo_start + tq) * p.o_stride_n + (long long)head * p.o_stride_h + col;
#pragma unroll
              for (int dn = 0; dn < CHUNKS; ++dn)   // (to O, a 16-bit type: two columns per 32-bit store)
                *reinterpret_cast<unsigned*>(dst + dn * 8) = Mma<O>::pack(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
            }
            if (p.lse && lane % 4 == 0) p.lse[(long long)(it.qo_start + tq) * p.lse_stride_n + head] = lse;
          } else {
            const long long prow = it.partial + (long long)(tq - it.tok_lo) * it.pstride;
            float* dst = p.tmp_o + (prow * p.num_qo_heads + head) * D_VO + col;
#pragma unroll
            for (int dn = 0; dn < CHUNKS; ++dn)
              *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
            if (lane % 4 == 0) p.tmp_lse[prow * p.num_qo_heads + head] = lse;
          }
        }
      }
  }

  // The item's fields. The epilogue reads them again through a volatile pointer, so that the ones it alone
  // needs are not held in registers across the mainloop (register budget of the MT = 2 tiles).
  template <typename P>
  __device__ __forceinline__ static Item load_item(const PrefillParams& p, P plan, int w) {
    Item it;
    const int base = p.off_items + 8 * w;
    it.req = plan[base]; it.row0 = plan[base + 1]; it.nrows = plan[base + 2]; it.kb = plan[base + 3];
    it.ke = plan[base + 4]; it.partial = plan[base + 5]; it.pstride = plan[base + 6];
    it.qo_start = plan[p.off_qo_indptr + it.req];
    it.qo_len = plan[p.off_qo_indptr + it.req + 1] - it.qo_start;
    it.kv_len = plan[p.off_kv_len + it.req];
    it.delta = it.kv_len - it.qo_len;
    it.tok_lo = row_token(p, it.row0);
    it.tok_hi = row_token(p, it.row0 + it.nrows - 1);
    it.pages = p.plan + p.off_page_indices + plan[p.off_page_indptr + it.req];
    it.mask_bit0 = V::kCustomMask ? (long long)plan[p.off_mask_indptr + it.req] * 8 : 0;
    return it;
  }

  __device__ static void run(const PrefillParams& p, int w, T* smem) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int kvh = blockIdx.y;
    Item it = load_item(p, p.plan, w);
    T* qs = smem;
    T* kvs = smem + Q_ELEMS;
    long long* offs = reinterpret_cast<long long*>(reinterpret_cast<unsigned char*>(kvs) + KV_REGION);   // [2][TILE]
    unsigned char* ring8 = reinterpret_cast<unsigned char*>(kvs + STAGE_ELEMS);   // fp8: the stages after the tile
    // the ring slot of tile t, and the 16-bit K/V tile the mainloop reads at tile t
    auto issue = [&](int t, int slot) {
      if constexpr (kFp8) issue_kv8(p, ring8 + slot * FP8_STAGE, offs + (t & 1) * TILE, it.kb + t * TILE, it.ke, kvh);
      else issue_kv(p, kvs + slot * STAGE_ELEMS, offs + (t & 1) * TILE, it.kb + t * TILE, it.ke, kvh);
    };

    load_q(p, it, qs, kvh);
    const int ntiles = (it.ke - it.kb + TILE - 1) / TILE;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ntiles) {
        if (tid < TILE) offs[(s & 1) * TILE + tid] = tok_offset(p, it.pages, min(it.kb + s * TILE + tid, it.ke - 1));
        __syncthreads();
        issue(s, s);
      }
      cp_async_commit();
    }
    __syncthreads();   // the prologue's reads of the offset slots are done
    if (tid < TILE && STAGES - 1 < ntiles)
      offs[((STAGES - 1) & 1) * TILE + tid] =
          tok_offset(p, it.pages, min(it.kb + (STAGES - 1) * TILE + tid, it.ke - 1));

    // This thread's rows: query token of rows g and g + 8 of each m-tile (clamped for padding rows).
    int tokr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = min((warp_m * MT + mt) * 16 + lane / 4 + 8 * r, it.nrows - 1);
        tokr[mt][r] = row_token(p, it.row0 + row);
      }
    float rc[MT][2];
    row_consts(p, it, kvh, warp_m * MT * 16, lane, rc);
    float o[MT][CHUNKS][4];
    float m[MT][2], l[MT][2];
    reset_state(o, m, l);

    unsigned qf[QF][4];
#pragma unroll
    for (int kk = 0; kk < QF; ++kk) qf[kk][0] = qf[kk][1] = qf[kk][2] = qf[kk][3] = 0u;
    const typename V::QKState qk_state = V::template qk_init<D_QK>(p, qk_dims<D_QK>(tid));   // (kQK) this thread's dims
    for (int ti = 0; ti < ntiles; ++ti) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int nt = ti + STAGES - 1;
      if (nt < ntiles) issue(nt, nt % STAGES);
      cp_async_commit();
      const bool pf_on = tid < TILE && nt + 1 < ntiles;
      long long pf = 0;
      if (pf_on) pf = tok_offset(p, it.pages, min(it.kb + (nt + 1) * TILE + tid, it.ke - 1));

      T* const tile = kFp8 ? kvs : kvs + (ti % STAGES) * STAGE_ELEMS;   // this tile's 16-bit K and V
      if constexpr (kFp8) {
        expand_kv8(ring8 + (ti % STAGES) * FP8_STAGE, tile, kv_cache_scale(p.k_scale_ptr, p.k_scale, kvh),
                   kv_cache_scale(p.v_scale_ptr, p.v_scale, kvh));
        __syncthreads();
      }
      if constexpr (V::kQK) {   // rotate Q (with tile 0) and this tile's keys in place; every warp reads them
        if (ti == 0)
          transform_rows<V, D_QK>(p, qk_state, qs, 0, it.nrows, tid, THREADS, it.req, false,
                               [&](int r) { return it.delta + row_token(p, it.row0 + r); });
        const int t0 = it.kb + ti * TILE;
        transform_rows<V, D_QK>(p, qk_state, tile, 0, min(TILE, it.ke - t0), tid, THREADS,
                             it.req, true, [&](int r) { return t0 + r; });
        __syncthreads();
      }
      if constexpr (QREGS) {
        if (ti == 0) {   // Q arrived with tile 0: its A fragments stay in registers for the whole item
#pragma unroll
          for (int kk = 0; kk < D_QK / 16; ++kk)
            ldmatrix_x4(qf[kk], qs + swz<D_QK>(warp_m * 16 + ((lane / 8) % 2) * 8 + lane % 8, 2 * kk + lane / 16));
        }
      }
      const T* ks = tile;
      const int t0 = it.kb + ti * TILE;
      bool need = needs_mask(p, it, t0, TILE);
      if (KVATTN_PF_FOLD && !V::kLogits) need = need || !(p.score_scale > 0.f);
      // KVATTN_PF_FAST64 (local constants: no new symbol in the default cubin): unmasked tiles in one 64-token
      // step; the masked path re-reads row0 / nrows from the plan for its rows' query tokens (4 fewer live
      // registers across the mainloop).
      constexpr bool FAST = KVATTN_PF_FAST64 && MT == 2 && !VariantTraits<V>::kAny;
      constexpr int SUBN_FAST = FAST ? NW : SUBN;
      if (need) {
        if constexpr (FAST) {
          const volatile int* vp = p.plan + p.off_items + 8 * w;
          const int row0 = vp[1], nrows = vp[2];
          int tk[MT][2];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              tk[mt][r] = row_token(p, row0 + min((warp_m * MT + mt) * 16 + lane / 4 + 8 * r, nrows - 1));
          compute<true, SUBN>(p, it, qs, ks, t0, tk, rc, qf, lane, warp_m, warp_n, o, m, l);
        } else {
          compute<true, SUBN>(p, it, qs, ks, t0, tokr, rc, qf, lane, warp_m, warp_n, o, m, l);
        }
      } else {
        compute<false, SUBN_FAST>(p, it, qs, ks, t0, tokr, rc, qf, lane, warp_m, warp_n, o, m, l);
      }
      if (pf_on) offs[((nt + 1) & 1) * TILE + tid] = pf;
    }
    cp_async_wait<0>();
    it = load_item(p, static_cast<const volatile int*>(p.plan), w);

    if constexpr (WARPS_N == 1) {
      store_rows(p, it, kvh, warp_m, lane, o, m, l);
    } else {
      // Merge the warps' states (each saw a quarter of every tile) through the K/V stages' shared memory.
      __syncthreads();
      const WarpMerge<D_VO, WARPS, V::kSoftmax> wm(kvs);
      wm.stash(warp, lane, o[0], m[0], l[0]);
      __syncthreads();
      for (int i = tid; i < it.nrows * CHUNKS; i += THREADS) {
        const int row = i / CHUNKS, ch = i % CHUNKS;
        float acc[8];
        float lse = wm.merge(row, ch, acc);
        int tq, head;
        row_dest(p, it, row, kvh, tq, head);
        if (it.partial < 0) {
          if constexpr (V::kOutput) {
            const float f = V::output(p, head, lse);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] *= f;
          }
          Vec8<O>::store(static_cast<O*>(p.o) + (long long)(it.qo_start + tq) * p.o_stride_n + (long long)head * p.o_stride_h + ch * 8, acc);
          if (p.lse && ch == 0) p.lse[(long long)(it.qo_start + tq) * p.lse_stride_n + head] = lse;
        } else {
          const long long prow = it.partial + (long long)(tq - it.tok_lo) * it.pstride;
          Vec8<float>::store(p.tmp_o + (prow * p.num_qo_heads + head) * D_VO + ch * 8, acc);
          if (ch == 0) p.tmp_lse[prow * p.num_qo_heads + head] = lse;
        }
      }
    }
  }
};

template <class A, int WARPS_M, int MT, class V>
__global__ void __launch_bounds__(128, 1) prefill_kernel(const __grid_constant__ PrefillParams p) {
  if ((int)blockIdx.x >= plan_header(p.plan).num_items) return;   // padded grid (graph mode) or fewer items than launched
  extern __shared__ __align__(128) unsigned char smem_raw[];
  PrefillKernel<A, WARPS_M, MT, V>::run(p, blockIdx.x, reinterpret_cast<typename A::Q*>(smem_raw));
}

}  // namespace kvattn
