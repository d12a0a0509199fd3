// Batch decode on a paged KV cache: tensor-core (mma.sync m16n8k16) split-KV kernel.
//
// CTA (chunk c = blockIdx.x / z_split, kv head h = blockIdx.y) walks the work items [chunk_indptr[c], chunk_indptr[c+1])
// of the plan as ONE stream of KV tiles (4 x WTOK tokens), so the cp.async pipeline keeps bytes in flight across
// item boundaries. The rows of the MMA tile are the group's query heads (head-group fusion): heads
// [z * ROWS, +ROWS) of the group with z = blockIdx.x % z_split, so any group size works; the z slices of one
// chunk are adjacent CTAs, so their common K/V is read from DRAM once and then hit in L2. Each of the 4 warps takes WTOK
// tokens of every tile; their partial softmax states are merged
// through shared memory at the end of each item. Scores live in the log2 domain; the LSE written is natural.
//
// An fp8 cache (KV = __nv_fp8_e4m3 / e5m2) lands in shared memory as fp8 (half the bytes of a stage) and is
// converted in registers: K through ldmatrix of byte pairs (the QK reduction runs over the dims in the order the
// fragments hold them, and the query fragments are read in that order), V through ldmatrix.trans of byte pairs
// (even and odd dims in separate n-blocks, put back in order by the epilogue). The products run in f16 (fp8 is
// exact in f16; bf16 queries are converted per row with a power-of-two scale); k_scale folds into the score
// scale, v_scale into the epilogue.
#pragma once
#include "merge.cuh"
#include "traits.cuh"
#include "variant.cuh"
#include "warp_merge.cuh"

#ifndef KVATTN_REFILL_FIRST
#define KVATTN_REFILL_FIRST 0
#endif
// Tokens per warp per tile: 0 = the rule below (kvattn.decode.warp_tokens mirrors it), else 8, 16 or 32 (A/B builds;
// 8: 16-bit caches only).
#ifndef KVATTN_DECODE_WTOK
#define KVATTN_DECODE_WTOK 0
#endif
// The copies' page ids loaded a tile ahead into registers (1, the default), their offsets computed just before the
// tile's copies are issued, so no iteration waits on an id load; 0: each tile's offsets computed a tile ahead,
// right after their id loads (a miss stalls that iteration: one id a row at page size 1), the ids of pages under
// 8 tokens prefetched into L1. Run 28f (scripts/probe_decode_pages.py, b64_L4096): page 1 0.750 -> 0.994 of the
// copy ceiling, page 2 0.841 -> 1.004, page 16 1.002 -> 1.015; run 28g: +1.1-1.7% on the five anchors, but head
// dim 256 at 16-token warp tiles (one CTA of 4 warps a SM, 16 rows a thread) 11% slower, so -1 (the default) takes
// it below head dim 256 and with 8-token warp tiles (head dim 256's default since run 29a: +4.6% there).
#ifndef KVATTN_DECODE_IDS_AHEAD
#define KVATTN_DECODE_IDS_AHEAD -1
#endif
// KVATTN_DECODE_SLIM 1 (groups of at most 8 query heads, 16-bit caches, 8-token warp tiles): Q slots of 8 rows (the
// MMA tile's rows 8-15 read rows 0-7 again; their states are never stored) and the head dim merged in 4 phases, so
// head dim 256 fits a third stage at 2 CTAs per SM (kvattn.decode.slim_fits).
#ifndef KVATTN_DECODE_SLIM
#define KVATTN_DECODE_SLIM 0
#endif

// The fused merge's states loaded together by a lane (merge_state_run's R: 1 or 4): its run of states is a chain of
// L2 round trips, n / split of them at 1, a quarter as many at 4. Python builds 4 for plans that fuse the merge
// (run 33b: b1_L2048 17.4 -> 15.3 us) and leaves 1 (fewer registers) for the others; tuning fused_merge_batch.
#ifndef KVATTN_FUSED_MERGE_BATCH
#define KVATTN_FUSED_MERGE_BATCH 1
#endif

// Timing experiment only (scripts/trace_decode.py; never set by the library): 1 = thread 0 of each CTA of a
// stand-alone decode launch stamps the GPU's global timer (ns) at its events (DecodeTraceEvent) into
// kvattn_decode_trace, read back by the script through cuModuleGetGlobal. Off, the stamps compile to nothing.
#ifndef KVATTN_DECODE_TRACE
#define KVATTN_DECODE_TRACE 0
#endif
#if KVATTN_DECODE_TRACE
#define KVATTN_DTRACE_CTAS 1024
#define KVATTN_DTRACE_EVENTS 8
extern "C" {
__device__ unsigned long long kvattn_decode_trace[KVATTN_DTRACE_CTAS * KVATTN_DTRACE_EVENTS];
}
#endif
namespace kvattn {
enum DecodeTraceEvent {
  kDTraceStart = 0,      // the CTA's first instruction
  kDTraceStreamEnd = 1,  // its partial state written (before the fused merge's arrival)
  kDTraceArrived = 2,    // its arrival counted (fused merge), every thread past the barrier after it
  kDTraceMerged = 3,     // (the last CTA of a request's pieces) the merged rows written
  kDTraceEnd = 4,        // its last instruction
  kDTraceLast = 5,       // 1 where this CTA merged (a value)
};
__device__ __forceinline__ void decode_trace(int e, long long value = -1) {
#if KVATTN_DECODE_TRACE
  const int cta = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0 && cta < KVATTN_DTRACE_CTAS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    kvattn_decode_trace[cta * KVATTN_DTRACE_EVENTS + e] = value >= 0 ? (unsigned long long)value : t;
  }
#endif
}
}  // namespace kvattn

namespace kvattn {

// Mirrored by kvattn.decode.DECODE_PARAMS (a test checks size and offsets). Strides in elements.
struct DecodeParams {
  const void* q;               // [batch, Hq, D_QK]
  const void* k;               // cache base; token t of page p, head h at p*kv_stride_page + t*kv_stride_token + h*kv_stride_head
  const void* v;
  void* o;                     // [batch, Hq, D_VO]
  float* lse;                  // [batch, Hq] natural log, may be null
  float* tmp_o;                // [partial rows, Hq, D_VO] float32
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
  const float* k_scale_ptr;    // fp8 cache: per-KV-head scales [Hkv] (may be null), times k_scale / v_scale
  const float* v_scale_ptr;
  float k_scale, v_scale;
  // Split-KV merged in this launch (null counters: the partial states go to the separate merge kernel):
  int* counters;               // [merges, Hkv, z_split] arrivals, 0 between launches
  const int* merge_of_req;     // [batch] the request's merge index, -1 when it is not merged
  int off_merge_indptr, off_merge_req;
};

// A: the element types and head dims (traits.cuh).
// This CTA's thread index and barrier in DecodeKernel (SUB: of its warpgroup; threads 128 w .. 128 w + 127 take
// barrier 1 + w). Macros, not member functions: with SUB false the kernels compile to the machine code they had
// before SUB existed (helper functions moved a few integer instructions).
#define KV_TID (SUB ? threadIdx.x % THREADS : threadIdx.x)
#define KV_SYNC()                                                        \
  do {                                                                   \
    if constexpr (SUB) named_sync(1 + (int)threadIdx.x / THREADS, THREADS); \
    else __syncthreads();                                                \
  } while (0)

template <bool IDS> struct RowRefOf { using type = long long; };   // DecodeKernel::RowRef
template <> struct RowRefOf<true> { using type = int; };

// SUB: the CTA is one warpgroup of a larger one (the mixed launch, mixed.cuh: three decode CTAs in one 384-thread
// CTA, each its own shared memory and named barrier); false: a CTA of its own (the same machine code as before).
template <class A, int M_TILES, int STAGES_, class V, bool SUB = false>
struct DecodeKernel {
  using Variant = V;
  using Q = typename A::Q;
  using KV = typename A::KV;
  using O = typename A::O;
  static constexpr int D_QK = A::D_QK;
  static constexpr int D_VO = A::D_VO;
  static constexpr bool kFp8 = A::kFp8;
  static constexpr bool kQToHalf = kFp8 && IsBf16<Q>::value;   // bf16 queries, fp8 cache
  using MT = typename A::MT;                        // the tensor-core operand type
  static constexpr int WARPS = 4;
  static constexpr int THREADS = WARPS * 32;
  // Tokens per warp per tile: 16, or 32 where a 16-token stage would carry at most half of head dim 128's 32 KB:
  // an fp8 cache at head dims 64 / 128 and a 16-bit one at 64 (twice the work per barrier, one softmax rescale
  // per 32 tokens; measured 2026-12-01 in BENCHMARKS.md); 8 where a 16-bit 16-token stage is 64 KB (head dim
  // 256): its 32-token stages fit 2 CTAs (8 warps) per SM, 3.10 -> 3.95 TB/s on b64_L4096 (run 29a).
  static constexpr int WTOK = KVATTN_DECODE_WTOK ? KVATTN_DECODE_WTOK
                              : 64 * (A::K_ROW_BYTES + A::V_ROW_BYTES) <= 16384 ? 32
                              : !kFp8 && 64 * (A::K_ROW_BYTES + A::V_ROW_BYTES) >= 65536 ? 8 : 16;
  static constexpr int NB = WTOK / 8;                // 8-token n-blocks of a warp's scores
  static constexpr int PB = (NB + 1) / 2;            // 16-token P fragments (WTOK 8: one, its tokens 8-15 zero)
  static_assert(WTOK >= 16 || !kFp8, "8-token warp tiles: 16-bit caches");
  static constexpr int TILE = WARPS * WTOK;          // tokens per pipeline stage
  static constexpr int Q_CHUNKS = A::QK_CHUNKS;      // 16-byte chunks of a query row
  static constexpr int CHUNKS = A::VO_CHUNKS;        // 8-column chunks of an output row
  static constexpr int K_CHUNKS = A::K_ROW_BYTES / 16;   // 16-byte chunks per K row
  static constexpr int V_CHUNKS = A::V_ROW_BYTES / 16;   // and per V row
  static constexpr int ROWS = 16 * M_TILES;          // query rows of the MMA tile
  static constexpr int STAGES = STAGES_;             // cp.async ring depth (tiles in flight + 1)
  static constexpr int K_BYTES = TILE * A::K_ROW_BYTES;   // K of a stage (V follows)
  static constexpr int V_BYTES = TILE * A::V_ROW_BYTES;
  // The epilogue merges the warps' states in the stage just consumed: in one pass (m / l there too, the stage
  // padded to fit), or for an fp8 cache or 8-token warp tiles in two passes of D_VO / 2 columns (m / l in their own
  // region: SPLIT_ML).
  static constexpr bool SLIM = KVATTN_DECODE_SLIM != 0;
  static_assert(!SLIM || (!kFp8 && M_TILES == 1 && WTOK == 8), "slim: 16-bit caches, one MMA tile, 8-token warp tiles");
  static constexpr int MERGE_PHASES = SLIM ? 4 : (kFp8 && WTOK == 16) || WTOK == 8 ? 2 : 1;
  static constexpr bool SPLIT_ML = kFp8 || MERGE_PHASES >= 2;
  using Merge = WarpMerge<D_VO / MERGE_PHASES, WARPS, V::kSoftmax, kFp8 ? 0 : 4>;
  // the merge's scratch in a stage (fp8: within K and V, static_assert below; SPLIT_ML: without m / l)
  static constexpr int SCRATCH = kFp8 ? 0 : SPLIT_ML ? Merge::O_BYTES : Merge::BYTES;
  static constexpr int STAGE_BYTES =   // K and V, or the merge's scratch (which is larger at 16 tokens per warp)
      K_BYTES + V_BYTES > SCRATCH ? K_BYTES + V_BYTES : SCRATCH;
  static constexpr int Q_ROWS = SLIM ? 8 : ROWS;                   // query rows a Q slot holds
  static constexpr int Q_BYTES = Q_ROWS * D_QK * (int)sizeof(Q);   // one Q slot; STAGES slots, by item ordinal
  static constexpr int RS_OFFSET = STAGES * (STAGE_BYTES + Q_BYTES);   // fp8: per-slot row scales, merge m / l
  static constexpr int SMEM_BYTES = RS_OFFSET + (kFp8 ? STAGES * ROWS * 4 : 0) + (SPLIT_ML ? Merge::ML_BYTES : 0);
  // The tile's copies: TPR adjacent threads take one token's K row and V row (TPR divides both rows' 16-byte
  // chunks and THREADS; one page offset serves both): thread t copies chunks t % TPR + k TPR of rows t / TPR + j
  // (THREADS / TPR). Equal K and V rows: TPR = K_CHUNKS, one chunk of each row per thread.
  static constexpr int TPR = gcd(gcd(K_CHUNKS, V_CHUNKS), THREADS);
  static constexpr int ROWS_PER_THREAD = TILE * TPR / THREADS;   // K (and V) rows each thread copies per tile
  static_assert(TILE % (THREADS / TPR) == 0, "whole copy passes per tile");
  static_assert(SPLIT_ML ? Merge::O_BYTES <= STAGE_BYTES : K_BYTES + V_BYTES <= STAGE_BYTES,
                "epilogue scratch fits a stage");
  static_assert(!(kFp8 && V::kQK), "a query / key transform (RoPE) needs a 16-bit cache");
  static_assert(!(SUB && kFp8), "a decode warpgroup of a mixed launch: 16-bit caches (q_rows_to_half takes the CTA)");
  static_assert(!V::kQK || 32 % (D_QK / 8) == 0,
                "a query / key transform's lanes (D_QK / 8 a key row, D_QK / 16 a 16-dim group) tile a warp: D_QK 64, "
                "128 or 256");

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

  // Byte offset of 16-byte chunk c of row r in a K / a V tile.
  __device__ __forceinline__ static int k_at(int r, int c) { return swz_bytes<A::K_ROW_BYTES>(r, c); }
  __device__ __forceinline__ static int v_at(int r, int c) { return swz_bytes<A::V_ROW_BYTES>(r, c); }

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
      const int row = KV_TID / TPR + j * (THREADS / TPR);
      const int tok = min(c.t0 + row, c.end - 1);
      int pg, in;
      if (p.page_shift >= 0) { pg = tok >> p.page_shift; in = tok & (p.page_size - 1); }
      else { pg = tok / p.page_size; in = tok - pg * p.page_size; }
      off[j] = (long long)p.page_indices[pbase + pg] * p.kv_stride_page + (long long)in * p.kv_stride_token;
    }
    // Pages under 8 tokens: the page ids of the item's next tile, into L1 (one thread per 128-byte line). They
    // are loaded one iteration from now, and with one id per row (page size 1) an L2 round trip each time stood
    // between a tile's issue and its offsets (ncu, session 9: page size 1 at 0.72 of page 16's rate, long-scoreboard
    // stalls 2.4x; run 20c: +4.7%). Larger pages share a line over several tiles (and the hint cost them ~0.5%).
    constexpr int LINES = TILE / 32 + 1;   // a tile's ids span at most TILE + 1 ints
    const int nt = c.t0 + TILE;
    if (p.page_size < 8 && KV_TID < LINES && nt < c.end) {
      const int last = min(nt + TILE, c.end) - 1;
      const int a = p.page_shift >= 0 ? nt >> p.page_shift : nt / p.page_size;
      const int b = p.page_shift >= 0 ? last >> p.page_shift : last / p.page_size;
      const int i = a + 32 * (int)KV_TID;
      if (i <= b) prefetch_l1(p.page_indices + pbase + i);
    }
  }

  // (IDS_AHEAD) The page ids of the K/V rows this thread copies for the cursor's tile (loaded, not yet used).
  __device__ __forceinline__ void load_ids(const Cursor& c, int (&ids)[ROWS_PER_THREAD]) const {
    if (!c.valid()) return;
    const int* pi = p.page_indices + p.page_indptr[c.req];
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int tok = min(c.t0 + KV_TID / TPR + j * (THREADS / TPR), c.end - 1);
      ids[j] = pi[p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page_size];
    }
  }
  // (IDS_AHEAD) The element offsets of those rows from their page ids.
  __device__ __forceinline__ void offsets_of(const Cursor& c, const int (&ids)[ROWS_PER_THREAD],
                                             long long (&off)[ROWS_PER_THREAD]) const {
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int tok = min(c.t0 + KV_TID / TPR + j * (THREADS / TPR), c.end - 1);
      const int in = p.page_shift >= 0 ? tok & (p.page_size - 1) : tok % p.page_size;
      off[j] = (long long)ids[j] * p.kv_stride_page + (long long)in * p.kv_stride_token;
    }
  }

  __device__ __forceinline__ int slot(const Cursor& c) const { return (c.w - c.w_first) % STAGES; }
  __device__ __forceinline__ Q* q_slot(const Cursor& c, unsigned char* smem) const {
    return reinterpret_cast<Q*>(smem + STAGES * STAGE_BYTES + slot(c) * Q_BYTES);
  }
  // fp8 with bf16 queries: the power-of-two factors of the slot's query rows (q_rows_to_half)
  __device__ __forceinline__ float* row_scales(const Cursor& c, unsigned char* smem) const {
    return reinterpret_cast<float*>(smem + RS_OFFSET) + slot(c) * ROWS;
  }

  __device__ __forceinline__ void issue(const Cursor& c, const long long (&off)[ROWS_PER_THREAD],
                                        unsigned char* stage, Q* qs) const {
    constexpr int STEP = TPR * (16 / (int)sizeof(KV));   // elements between a thread's chunks of a row
    const int chunk = KV_TID % TPR;
    const KV* kb = static_cast<const KV*>(p.k) + h * p.kv_stride_head + chunk * (16 / (int)sizeof(KV));
    const KV* vb = static_cast<const KV*>(p.v) + h * p.kv_stride_head + chunk * (16 / (int)sizeof(KV));
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int row = KV_TID / TPR + j * (THREADS / TPR);
      const int bytes = c.t0 + row < c.end ? 16 : 0;
#pragma unroll
      for (int k = 0; k < K_CHUNKS / TPR; ++k)
        cp_async16(stage + k_at(row, chunk + k * TPR), kb + off[j] + k * STEP, bytes);
#pragma unroll
      for (int k = 0; k < V_CHUNKS / TPR; ++k)
        cp_async16(stage + K_BYTES + v_at(row, chunk + k * TPR), vb + off[j] + k * STEP, bytes);
    }
    if (c.t0 == c.begin) {  // first tile of an item: bring its query rows (zeros past the group)
      const Q* qb = static_cast<const Q*>(p.q) + c.req * p.q_stride_n + (long long)head0 * p.q_stride_h;
      for (int i = KV_TID; i < Q_ROWS * Q_CHUNKS; i += THREADS) {
        const int r = i / Q_CHUNKS, ch = i % Q_CHUNKS;
        const bool ok = r < nrows;
        cp_async16(qs + swz<D_QK>(r, ch), ok ? qb + r * p.q_stride_h + ch * 8 : qb, ok ? 16 : 0);
      }
    }
  }

  // What a thread keeps of the producer's next tile between iterations: its rows' element offsets, or (IDS_AHEAD)
  // their page ids.
  static constexpr bool IDS_AHEAD = KVATTN_DECODE_IDS_AHEAD < 0 ? D_QK < 256 || WTOK == 8 : KVATTN_DECODE_IDS_AHEAD != 0;
  using RowRef = typename RowRefOf<IDS_AHEAD>::type;

  // Issue the producer's tile into the slot consumed at iteration it - 1, move the producer on, and start the
  // page-id loads of its next tile (used one iteration later). Always commits a group (maybe empty).
  __device__ __forceinline__ void refill(Cursor& prod, RowRef (&off)[ROWS_PER_THREAD], unsigned char* smem,
                                         int it) const {
    if (prod.valid()) {
      if constexpr (IDS_AHEAD) {
        long long o[ROWS_PER_THREAD];
        offsets_of(prod, off, o);
        issue(prod, o, smem + ((it + STAGES - 1) % STAGES) * STAGE_BYTES, q_slot(prod, smem));
        advance(prod);
        load_ids(prod, off);
      } else {
        issue(prod, off, smem + ((it + STAGES - 1) % STAGES) * STAGE_BYTES, q_slot(prod, smem));
        advance(prod);
        row_offsets(prod, off);
      }
    }
    cp_async_commit();
  }

  __device__ void run(int c_index, unsigned char* smem) const {
    const int lane = KV_TID % 32, warp = KV_TID / 32;
    const int* chunk_indptr = p.plan + p.off_chunk_indptr;
    Cursor prod{chunk_indptr[c_index], chunk_indptr[c_index], chunk_indptr[c_index + 1], 0, 0, 0, 0};
    if (p.counters && c_index == 0) write_empty_rows();
    if (prod.w >= prod.w_end) return;
    load_item(prod);
    Cursor cons = prod;
    RowRef off[ROWS_PER_THREAD];
    if constexpr (IDS_AHEAD) load_ids(prod, off);
    else row_offsets(prod, off);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) refill(prod, off, smem, s + 1 - STAGES);   // fills slot s

    float o[M_TILES][CHUNKS][4];
    float m[M_TILES][2], l[M_TILES][2];
    float sc[M_TILES][2];   // fp8: each row's score scale (score_scale * k_scale * the query row's factor)
    const float k_factor = kFp8 ? p.score_scale * kv_cache_scale(p.k_scale_ptr, p.k_scale, h) : 0.f;
    int kv_len = 0;
    // the query / key transform's per-thread constants (the same dims for Q, by all threads, and K, by lanes)
    const typename V::QKState qk_state = V::template qk_init<D_QK>(p, qk_dims<D_QK>(KV_TID));
    for (int it = 0; cons.valid(); ++it) {
      unsigned char* stage = smem + (it % STAGES) * STAGE_BYTES;
#if KVATTN_REFILL_FIRST
      // Refill the slot freed by the previous iteration BEFORE waiting for this tile: STAGES tiles are in
      // flight during the wait (two barriers per tile instead of one).
      KV_SYNC();
      refill(prod, off, smem, it);
      cp_async_wait<STAGES - 1>();
      KV_SYNC();
#else
      // Wait for this tile, then refill the slot freed by the previous iteration (one barrier per tile).
      cp_async_wait<STAGES - 2>();
      KV_SYNC();
      refill(prod, off, smem, it);
#endif

      if (cons.t0 == cons.begin) {  // a new item: reset the running state
        reset_state(o, m, l);
        if (VariantTraits<V>::kNeedsDiag) {   // the row's diagonal (kv_len - 1) for masks and positions
          const int np = p.page_indptr[cons.req + 1] - p.page_indptr[cons.req];
          kv_len = np == 0 ? 0 : (np - 1) * p.page_size + p.last_page_len[cons.req];
        }
        if constexpr (V::kQK) {   // the item's query rows (landed with its first tile), at the row's diagonal
          transform_rows<V, D_QK>(p, qk_state, q_slot(cons, smem), 0, nrows, KV_TID, THREADS, cons.req, false,
                               [&](int) { return kv_len - 1; });
          KV_SYNC();
        }
        if constexpr (kQToHalf) {
          q_rows_to_half<D_QK, ROWS, THREADS>(q_slot(cons, smem), row_scales(cons, smem));
          KV_SYNC();
        }
        if constexpr (kFp8) {
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              sc[mt][r] = kQToHalf ? k_factor * row_scales(cons, smem)[mt * 16 + lane / 4 + 8 * r] : k_factor;
        }
      }
      compute_tile(stage, q_slot(cons, smem), cons, kv_len, lane, warp, qk_state, sc, o, m, l);
      if (cons.t0 + TILE >= cons.end) epilogue(smem, stage, cons, lane, warp, o, m, l);
      advance(cons);
    }
    cp_async_wait<0>();
  }

  // S = Q K^T of this warp's 16 tokens for m-tile mt (accumulator layout).
  __device__ __forceinline__ void qk_product(const unsigned char* ks, const Q* q_tile, int mt, int tw, int lane,
                                             float (&s)[NB][4]) const {
    const int j = lane / 8;
    if constexpr (!kFp8) {
      const KV* kt = reinterpret_cast<const KV*>(ks);
#pragma unroll
      for (int kk = 0; kk < D_QK / 16; ++kk) {
        unsigned a[4];
        ldmatrix_x4(a, q_tile + swz<D_QK>(SLIM ? lane % 8 : mt * 16 + (j % 2) * 8 + lane % 8, 2 * kk + j / 2));
        if constexpr (NB == 1) {   // 8 tokens: (tokens 0-7, chunk 2 kk), (0-7, 2 kk + 1)
          unsigned b[2];
          ldmatrix_x2(b, kt + swz<D_QK>(tw + lane % 8, 2 * kk + j % 2));
          Mma<MT>::run(s[0], a, b[0], b[1]);
        }
#pragma unroll
        for (int g2 = 0; g2 < NB / 2; ++g2) {   // 16 tokens each
          unsigned b[4];
          ldmatrix_x4(b, kt + swz<D_QK>(tw + 16 * g2 + (j / 2) * 8 + lane % 8, 2 * kk + j % 2));
          Mma<MT>::run(s[2 * g2], a, b[0], b[1]);
          Mma<MT>::run(s[2 * g2 + 1], a, b[2], b[3]);
        }
      }
    } else {
      // A K register from ldmatrix holds dims 4t..4t+3 of token g: the k16 step's logical k (2t, 2t+1) are dims
      // (4t, 4t+1) and (2t+8, 2t+9) are (4t+2, 4t+3), so the query fragments are read in the same order.
      const int g = lane / 4, t = lane % 4;
#pragma unroll
      for (int k2 = 0; k2 < D_QK / 32; ++k2) {
        unsigned kr[NB / 2][4];   // per 16 tokens: (0-7, step 2 k2), (8-15, 2 k2), (0-7, 2 k2 + 1), (8-15, 2 k2 + 1)
#pragma unroll
        for (int g2 = 0; g2 < NB / 2; ++g2)
          ldmatrix_x4(kr[g2], ks + k_at(tw + 16 * g2 + (j % 2) * 8 + lane % 8, 2 * k2 + j / 2));
#pragma unroll
        for (int hs = 0; hs < 2; ++hs) {
          const int kk = 2 * k2 + hs;
          const uint2 lo =
              *reinterpret_cast<const uint2*>(q_tile + swz<D_QK>(mt * 16 + g, 2 * kk + t / 2) + (t & 1) * 4);
          const uint2 hi =
              *reinterpret_cast<const uint2*>(q_tile + swz<D_QK>(mt * 16 + g + 8, 2 * kk + t / 2) + (t & 1) * 4);
          const unsigned a[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
          for (int g2 = 0; g2 < NB / 2; ++g2) {
            unsigned b[4];
            Fp8<KV>::lo_hi(kr[g2][2 * hs], b[0], b[1]);
            Fp8<KV>::lo_hi(kr[g2][2 * hs + 1], b[2], b[3]);
            Mma<half>::run(s[2 * g2], a, b[0], b[1]);
            Mma<half>::run(s[2 * g2 + 1], a, b[2], b[3]);
          }
        }
      }
    }
  }

  // O += P V of this warp's WTOK tokens (pa: P as A fragments, one per 16 tokens).
  __device__ __forceinline__ void pv_product(const unsigned char* vs, const unsigned (&pa)[PB][4], int tw,
                                             int lane, float (&o)[CHUNKS][4]) const {
    const int j = lane / 8;
    if constexpr (!kFp8) {
      const KV* vt = reinterpret_cast<const KV*>(vs);
#pragma unroll
      for (int dp = 0; dp < D_VO / 16; ++dp) {
        if constexpr (NB == 1) {   // 8 tokens (P's tokens 8-15 are zero): (0-7, chunk 2 dp), (0-7, 2 dp + 1)
          unsigned b[2];
          ldmatrix_x2_trans(b, vt + swz<D_VO>(tw + lane % 8, 2 * dp + j % 2));
          Mma<MT>::run(o[2 * dp], pa[0], b[0], 0u);
          Mma<MT>::run(o[2 * dp + 1], pa[0], b[1], 0u);
        }
#pragma unroll
        for (int g2 = 0; g2 < NB / 2; ++g2) {   // 16 tokens each
          unsigned b[4];
          ldmatrix_x4_trans(b, vt + swz<D_VO>(tw + 16 * g2 + (j % 2) * 8 + lane % 8, 2 * dp + j / 2));
          Mma<MT>::run(o[2 * dp], pa[g2], b[0], b[1]);
          Mma<MT>::run(o[2 * dp + 1], pa[g2], b[2], b[3]);
        }
      }
    } else {
      // ldmatrix.trans of byte pairs gives tokens (2t, 2t+1) of dims (2g, 2g+1) of a 16-dim chunk: the even dims
      // feed n-block 2c, the odd ones 2c + 1 (WarpMerge::stash_even_odd reads them back in order).
#pragma unroll
      for (int c2 = 0; c2 < D_VO / 32; ++c2) {
#pragma unroll
        for (int g2 = 0; g2 < NB / 2; ++g2) {
          unsigned vr[4];   // (tokens 0-7, chunk 2 c2), (8-15, 2 c2), (0-7, 2 c2 + 1), (8-15, 2 c2 + 1)
          ldmatrix_x4_trans(vr, vs + v_at(tw + 16 * g2 + (j % 2) * 8 + lane % 8, 2 * c2 + j / 2));
#pragma unroll
          for (int hs = 0; hs < 2; ++hs) {
            const int c = 2 * c2 + hs;
            unsigned e0, o0, e1, o1;
            Fp8<KV>::even_odd(vr[2 * hs], e0, o0);
            Fp8<KV>::even_odd(vr[2 * hs + 1], e1, o1);
            Mma<half>::run(o[2 * c], pa[g2], e0, e1);
            Mma<half>::run(o[2 * c + 1], pa[g2], o0, o1);
          }
        }
      }
    }
  }

  __device__ __forceinline__ void compute_tile(unsigned char* stage, const Q* q_tile, const Cursor& c, int kv_len,
                                               int lane, int warp, const typename V::QKState& qk_state,
                                               const float (&sc)[M_TILES][2], float (&o)[M_TILES][CHUNKS][4],
                                               float (&m)[M_TILES][2], float (&l)[M_TILES][2]) const {
    const int tw = warp * WTOK;  // this warp's first token in the tile
    if constexpr (V::kQK) {   // this warp's WTOK key rows, at their kv positions (only this warp reads them)
      transform_key_rows<V, D_QK, WTOK>(p, qk_state, reinterpret_cast<KV*>(stage), tw, lane, c.t0, c.req);
      __syncwarp();
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float s[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] = 0.f;
      qk_product(stage, q_tile, mt, tw, lane, s);
      // Scores -> log2 domain, masks, online softmax over the thread's two rows (g, g+8).
      float rc[2] = {0.f, 0.f};   // the variant's per-row constants (rows are query heads head0 + row)
      if constexpr (V::kPositional) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
          rc[r] = V::row_init(p, min(head0 + mt * 16 + lane / 4 + 8 * r, p.num_qo_heads - 1), c.req);
      }
      float mx[2] = {KVATTN_NEG_INF, KVATTN_NEG_INF};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = c.t0 + tw + nb * 8 + 2 * (lane % 4) + (e & 1);
          float x = V::logits(p, s[nb][e] * (kFp8 ? sc[mt][e >> 1] : p.score_scale));
          if constexpr (V::kPositional) x = V::logits_at(p, x, tok, kv_len - 1, rc[e >> 1]);
          bool ok = tok < c.end;
          if (V::kWindow) ok = ok && (p.window_left < 0 || tok >= kv_len - 1 - p.window_left);
          if (V::kKeep) ok = ok && V::keep(p, tok, kv_len - 1);
          x = ok ? x : KVATTN_NEG_INF;
          s[nb][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      unsigned pa[PB][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float scale = row_probs<V, false>(p, s, r, mx[r], m[mt][r], l[mt][r]);
        if constexpr (V::kSoftmax) {   // (weights are never rescaled)
#pragma unroll
          for (int dn = 0; dn < CHUNKS; ++dn) { o[mt][dn][2 * r] *= scale; o[mt][dn][2 * r + 1] *= scale; }
        }
      }
#pragma unroll
      for (int g2 = 0; g2 < NB / 2; ++g2) a_from_c<MT>(&s[2 * g2][0], pa[g2]);
      if constexpr (NB == 1) {   // one 8-token n-block: k 0-7 of the fragment, tokens 8-15 zero
        pa[0][0] = Mma<MT>::pack(s[0][0], s[0][1]);
        pa[0][1] = Mma<MT>::pack(s[0][2], s[0][3]);
        pa[0][2] = pa[0][3] = 0u;
      }
      pv_product(stage + K_BYTES, pa, tw, lane, o[mt]);
    }
  }

  // Merge the 4 warps' states of this item through the stage's shared memory and write o / lse.
  __device__ void epilogue(unsigned char* smem, unsigned char* stage, const Cursor& c, int lane, int warp,
                           float (&o)[M_TILES][CHUNKS][4], float (&m)[M_TILES][2], float (&l)[M_TILES][2]) const {
    const Merge wm =
        SPLIT_ML ? Merge(stage, reinterpret_cast<float*>(smem + SMEM_BYTES - Merge::ML_BYTES)) : Merge(stage);
    const int partial = p.plan[p.off_work_partial + c.w];
    constexpr int PCH = CHUNKS / MERGE_PHASES;   // output chunks per merge phase
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int ph = 0; ph < MERGE_PHASES; ++ph) {
        KV_SYNC();  // every warp is done with the stage's K/V (and the previous phase's scratch)
        if constexpr (kFp8) {
          if (ph == 0) wm.stash_ml(warp, lane, m[mt], l[mt]);
          wm.stash_even_odd(warp, lane, o[mt], ph * PCH);
        } else if constexpr (MERGE_PHASES >= 2) {   // 8-token warp tiles: a stage holds 1 / MERGE_PHASES of them
          if (ph == 0) wm.stash_ml(warp, lane, m[mt], l[mt]);
          wm.stash_cols(warp, lane, o[mt], ph * PCH);
        } else {
          wm.stash(warp, lane, o[mt], m[mt], l[mt]);
        }
        KV_SYNC();
        const int rows = min(16, nrows - mt * 16);
        for (int i = KV_TID; i < rows * PCH; i += THREADS) {
          const int row = i / PCH, ch = ph * PCH + i % PCH;
          float acc[8];
          float lse = wm.merge(row, i % PCH, acc);
          if constexpr (kFp8) {
            const float vs = kv_cache_scale(p.v_scale_ptr, p.v_scale, h);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] *= vs;
          }
          const int head = head0 + mt * 16 + row;
          if (partial < 0) {
            store_row(c.req, head, ch, acc, lse);
          } else {
            Vec8<float>::store(p.tmp_o + ((long long)partial * p.num_qo_heads + head) * D_VO + ch * 8, acc);
            if (ch == 0) p.tmp_lse[(long long)partial * p.num_qo_heads + head] = lse;
          }
        }
      }
    }
    if (!SUB && partial >= 0) decode_trace(kDTraceStreamEnd);
    if (partial >= 0 && p.counters) merge_if_last(c, reinterpret_cast<int*>(stage));
  }

  // Fused split-KV merge: the last CTA to write one of the request's partial states (for this KV head and z
  // slice) merges all of them, in their fixed order (so the bits do not depend on which CTA came last), and
  // writes o / lse. Thread 0 arrives with a gpu-scope acquire-release atomic after the CTA barrier (release is
  // cumulative: it orders the whole CTA's partial-state stores), and the last arrival's acquire makes every
  // writer's stores visible to its CTA after the next barrier; the last one leaves the counter at 0. (One
  // thread's MEMBAR.ALL.GPU instead of every thread's MEMBAR.SC.GPU pair; no faster in run 20c.)
  // first_n (the request's first partial row and count, or count 0: not the last) lives in the stage just merged,
  // free until the next iteration's barrier: static shared memory would cost a CTA per SM (3 CTAs fill the SM's
  // 228 KB exactly at head dim 128).
  __device__ void merge_if_last(const Cursor& c, int* first_n) const {
    KV_SYNC();
    if (KV_TID == 0) {
      const int m = p.merge_of_req[c.req];
      const int* mi = p.plan + p.off_merge_indptr;
      const int first = mi[m], n = mi[m + 1] - first;
      int* cnt;
      if constexpr (SUB)   // the KV heads and this CTA's z slice from its parameters (its grid is not its own)
        cnt = p.counters + ((long long)m * (p.num_qo_heads / p.group_size) + h) * p.z_split +
              (head0 - h * p.group_size) / ROWS;
      else
        cnt = p.counters + ((long long)m * gridDim.y + h) * p.z_split + (blockIdx.x % p.z_split);
      const bool last = atomic_add_acq_rel_gpu(cnt, 1) == n - 1;
      if (last) atomicExch(cnt, 0);
      first_n[0] = first;
      first_n[1] = last ? n : 0;
    }
    KV_SYNC();
    const int first = first_n[0], n = first_n[1];
    if (!SUB) decode_trace(kDTraceArrived);
    if (n == 0) return;   // (every thread has read first_n before the next item's epilogue barrier)
    if (!SUB) decode_trace(kDTraceLast, 1);
    // `split` adjacent lanes (a power of two, at most 8, so that at most two passes of the CTA's threads cover
    // every (head, 8-column chunk)) merge consecutive runs of the n states of one (head, chunk) and combine them
    // through shuffles in a fixed tree (the bits depend on n alone). A run is a chain of dependent L2 loads: the
    // tail of the whole launch for a request split over every SM (b1_L65536: 49 states).
    const int units = nrows * CHUNKS;
    int split = 1;
    while (split < 8 && units * split <= THREADS) split *= 2;
    const long long row = (long long)p.num_qo_heads * D_VO;
    for (int i0 = 0; i0 < units * split; i0 += THREADS) {   // (a uniform trip count: whole warps shuffle)
      const int i = i0 + KV_TID, u = min(i / split, units - 1), part = i % split;
      const int head = head0 + u / CHUNKS, ch = u % CHUNKS;
      const int b = part * n / split, e = i < units * split ? (part + 1) * n / split : b;
      float acc[8];
      float lse = merge_state_run<true, KVATTN_FUSED_MERGE_BATCH>(
          p.tmp_o + ((long long)(first + b) * p.num_qo_heads + head) * D_VO + ch * 8, row,
          p.tmp_lse + (long long)(first + b) * p.num_qo_heads + head, p.num_qo_heads, e - b, acc);
      for (int off = 1; off < split; off *= 2) combine_lane_states(acc, lse, off, 0xffffffffu);
      if (part == 0 && i < units * split) store_row(c.req, head, ch, acc, lse);
    }
    if (!SUB) decode_trace(kDTraceMerged);
  }

  // Output row req, head `head`, 8-column chunk ch of a finished state (the variant's output hook applied),
  // converted to O.
  __device__ __forceinline__ void store_row(int req, int head, int ch, float (&acc)[8], float lse) const {
    if constexpr (V::kOutput) {
      const float f = V::output(p, head, lse);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= f;
    }
    Vec8<O>::store(static_cast<O*>(p.o) + req * p.o_stride_n + head * p.o_stride_h + ch * 8, acc);
    if (p.lse && ch == 0) p.lse[req * p.lse_stride_n + head] = lse;
  }

  // Fused merges: the requests without KV (merges of no partial state) get o = 0, lse = -inf from chunk 0.
  __device__ void write_empty_rows() const {
    const int nm = plan_header(p.plan).num_merge;
    const int* mi = p.plan + p.off_merge_indptr;
    for (int m = KV_TID; m < nm; m += THREADS) {
      if (mi[m + 1] != mi[m]) continue;
      const int req = p.plan[p.off_merge_req + m];
      for (int i = 0; i < nrows * CHUNKS; ++i) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        store_row(req, head0 + i / CHUNKS, i % CHUNKS, acc, KVATTN_NEG_INF);
      }
    }
  }
};
#undef KV_TID
#undef KV_SYNC

// The packed RoPE builds ask for 3 CTAs per SM where their shared memory allows 3 (each CTA also takes 1 KB the
// system reserves, of 228 KB per SM; then 168 registers): left to itself ptxas gave the packed rotation at head
// dim 128 196-223 registers, 2 CTAs. (0: no minimum, as before.)
template <class K>
constexpr int decode_min_ctas() {
  return K::Variant::kQK && !KVATTN_ROPE_F32 && 3 * (K::SMEM_BYTES + 1024) <= 228 * 1024 ? 3 : 0;
}
template <class A, int M_TILES, int STAGES, class V>
__global__ void __launch_bounds__(128, decode_min_ctas<DecodeKernel<A, M_TILES, STAGES, V>>())
    decode_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  decode_trace(kDTraceStart);
  allow_dependent_launch();   // the split-KV merge kernel may launch now and wait for this grid's end on the GPU
  const int chunk = blockIdx.x / p.z_split, z = blockIdx.x - chunk * p.z_split;
  DecodeKernel<A, M_TILES, STAGES, V> k(p, blockIdx.y, z);
  k.run(chunk, smem_raw);
  decode_trace(kDTraceEnd);
}

}  // namespace kvattn
