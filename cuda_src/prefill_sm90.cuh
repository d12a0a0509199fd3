// Batch prefill / append, Hopper mainloop (sm_90a): warpgroup MMA (wgmma), warp-specialised.
//
// Same plan items, parameters, variants and epilogue as prefill.cuh (PrefillKernel's helpers); only the
// mainloop differs. Where kPersist (the host's choice), the kernel is persistent: a grid of at most one CTA per
// SM walks the (item, KV head) units by KV head groups, longest first within L2 windows (kvattn/scheduler.py;
// Walk below), CTA b taking unit b of every even round of gridDim.x units and unit gridDim.x - 1 - b of every odd
// one (snake order: the rounds' sums even out). The ring of K/V stages runs on across a CTA's units, so the
// producers load the next unit's Q and first tiles while the consumers finish a unit (its last P V, its
// epilogue). One CTA = three warpgroups (384 threads) for 128 packed query rows:
//   - the producer warpgroup (24 registers after setmaxnreg, 40 when persistent) fills a ring of K/V tiles
//     (N = 128 tokens in 3 stages; 80 tokens in 2 at head_dim 256). A full tile of a 16-bit cache, where run()
//     bound tensor maps (kvattn/tma.py), is a few TMA boxes issued by the lanes of one warp, their bytes expected
//     by the stage's `full` mbarrier (where the ring has 2 stages, K and V of a stage have their own `full` and
//     `empty` mbarriers: KVSPLIT). Otherwise (the last, partial tile of an item, block-sparse columns, odd page sizes, RoPE) each
//     warp looks up the page offsets of N / 4 rows (one per lane) and copies them with cp.async, coalesced
//     16-byte chunks, zero-filled past the item's KV. Every producer thread arrives on `full` once its own
//     copies land (cp.async.mbarrier.arrive; the Q rows go with tile 0): the producers never wait for them. The Q
//     tile itself is a few TMA boxes of one thread where run() bound a map of q (kvattn.tma.RowsTensorMap);
//   - two consumer warpgroups (240 registers) own 64 query rows each (wgmma's M). They wait on `full`, fence
//     the landed copies (generic proxy) against the tensor cores' reads (async proxy), run
//     S = Q K^T (Q and K from shared memory, K-major), the online softmax, and O += P V (P from registers:
//     the S accumulators rounded to Q's type; V from shared memory, MN-major through the transpose bit), then release
//     the stage on its `empty` mbarrier. S(i+1) is issued together with P(i) V(i), and the softmax of S(i+1)
//     runs while P(i) V(i) is on the tensor cores. The two consumers are not tied to each other by CTA
//     barriers; they take turns issuing their products (ping-pong on two named barriers), so one's softmax
//     overlaps the other's matrix products. A whole unit's O goes out as TMA boxes of one thread per warpgroup, its
//     rows staged in the K half of the unit's last stage (store_o_tma), where run() bound a map of o.
// An fp8 cache (KV = __nv_fp8_e4m3 / e5m2): the producers load its rows into registers, expand them (times
// k_scale / v_scale, rounded once to Q's type) into the same 16-bit tiles, and arrive on `full` once their stores are
// made visible to the tensor cores; the consumers are unchanged.
// Shared memory layout of every tile: 128-byte swizzle, i.e. per 64-column block of the head dim, 128-byte rows
// whose 16-byte chunk c sits at chunk c ^ (row % 8); Q's blocks of 128 rows follow each other, and so do K's and V's
// blocks of N rows, or (KVATTN_SM90_KVIL) K's and V's 8-row groups of every block.
#pragma once
#include "prefill.cuh"
#include "sm90.cuh"
#include "wgmma.cuh"

// Timing experiments only (scripts/ab_sm90.py; never set by the library): 1 = the producers copy no K/V (the
// consumers run on whatever the stages hold), 2 = the consumers skip the softmax. They say where a tile's time goes.
#ifndef KVATTN_SM90_X
#define KVATTN_SM90_X 0
#endif
// On tiles that need no mask, plain softmax variants take the row max over the raw scores and fold the score
// scale into the exponent, p = exp2(fma(s, scale, -m)): one FFMA per score instead of FMUL + FADD (needs
// scale > 0; other scales take the masked path). +2-5% on the H200 (scripts/ab_sm90.py --fold, BENCHMARKS.md).
#ifndef KVATTN_SM90_FOLD
#define KVATTN_SM90_FOLD 1
#endif
#ifndef KVATTN_SM90_PERSIST
#define KVATTN_SM90_PERSIST 0
#endif
// TMA tiles: each box's page id loaded a tile ahead, the copies' row offsets only before a copied tile (1), or
// both looked up at each tile (0; the A/B of scripts/ab_sm90.py --prefetch).
#ifndef KVATTN_SM90_PREFETCH
#define KVATTN_SM90_PREFETCH 1
#endif

// Persistent consumers: their ping-pong turns run as one stream over the CTA's units (consumer 1 opens it once,
// consumer 0 closes it once), so consumer 0 starts a unit's first Q K^T while consumer 1 still stores the previous
// unit, instead of the two resynchronising at every unit boundary (+0.4-1.7%, scripts/ab_sm90.py --stream; 0: the
// per-unit turns, for the A/B).
#ifndef KVATTN_SM90_STREAM
#define KVATTN_SM90_STREAM 1
#endif

// Persistent consumers: the loads of the unit's item for its epilogue and of the next unit's item are issued
// before the wait for the unit's last P V, so their latency (two dependent global loads each) overlaps it
// instead of following it and the epilogue (scripts/ab_sm90.py --early; 0: loaded where used).
#ifndef KVATTN_SM90_EARLY
#define KVATTN_SM90_EARLY 1
#endif

// O by TMA: the thread that stored a unit's O waits for the bulk store to have read its stage (and releases the
// stage) only after the next unit's first softmax, not in the epilogue (1: run 31a, causal b32_S1024 +2.1%,
// b8_S2048 +1.6%); with 3 stages the stage is not reloaded before the next unit's third tile. 0: waited in the
// epilogue, where that one thread's wait held its warpgroup (the A/B of scripts/ab_sm90.py --lazy).
#ifndef KVATTN_SM90_LAZY
#define KVATTN_SM90_LAZY 1
#endif

// A unit's last tile whose kept columns all lie in one 64-column half (a causal unit of 32 or 64 query tokens every
// other unit, a block-sparse row's odd 64-column block, a partial last tile) runs its P V over that half's 64
// tokens only (1; 0: the whole tile, the default until scripts/ab_sm90.py --narrow measures it).
#ifndef KVATTN_SM90_NARROW
#define KVATTN_SM90_NARROW 0
#endif

// A ragged cache's item whose KV does not end on a tile: its last tile by the same TMA box as the full ones, moved
// back to end at the item's end (its first rows repeat tokens of the tile before, masked below `lo` in the softmax),
// so no row past the item is read and no tile is copied per thread (those copies cost a unit ~0.8 us: run 26f).
// 0: that tile copied per thread, zero-filled past the item (the A/B of scripts/ab_sm90.py --shift).
#ifndef KVATTN_SM90_SHIFT
#define KVATTN_SM90_SHIFT 1
#endif

// A paged cache's item whose KV does not end on a tile: the whole pages (boxes) of its last tile by TMA, as in a full
// tile, and only the rows of its last, partial page (and the zeros past the item) copied per thread, where the
// whole tile was copied per thread (0; the A/B of scripts/ab_sm90.py --ptail). Not where K and V have their own
// barriers (KVSPLIT).
#ifndef KVATTN_SM90_PTAIL
#define KVATTN_SM90_PTAIL 1
#endif

// A row's running max is kept until a tile's scores exceed it by more than this (log2 units; online_max's LAZY):
// the probabilities may reach 2^8 (exact in P's 16-bit type), and the O accumulators' rescale (64 multiplies a
// thread, between the P V wait and the next turn) is skipped on the tiles that keep it: after the first few tiles,
// nearly all. +1.2-2.9% on the H100 (scripts/ab_sm90.py --lazymax, BENCHMARKS.md run 46b); 0: moved at every tile.
#ifndef KVATTN_SM90_LAZY_MAX
#define KVATTN_SM90_LAZY_MAX 8
#endif

// Of each 8 consecutive 8-column blocks of an unmasked tile's scores, this many take their exp2 from a polynomial
// on the FMA pipe (common.cuh poly_exp2) instead of the MUFU unit, whose 16 results a clock per SM bound the
// softmax where the products are short (head_dim 64: a tile's exp2s take the MUFU as long as its two products take
// the tensor cores). -1 (the default): 2 at head dim 64, 0 (every exp2 on the MUFU) at 128 and 256. Run 55a (H100,
// scripts/ab_sm90.py --exp2poly): head dim 64 +1.2% with 128-token tiles and +3% with 192 (2 of 8; 3 of 8 loses
// 3%), head dim 128 -4 to -9%, 256 even.
#ifndef KVATTN_SM90_EXP2_POLY
#define KVATTN_SM90_EXP2_POLY -1
#endif

// Masked tiles whose masks are column bounds only (the causal diagonal, the item's KV end, a moved box's repeated
// first columns) on a plain softmax: each row keeps one column range, tested as two integer compares with the
// column offset as an immediate against per-row limits set once a tile; this is the instance's only masked path,
// for any score scale (1). 0: the general masked path (per score: the column index, three compares), the A/B of
// scripts/ab_sm90.py --boundary. Causal units end on such a tile: +0.7-2.1% on short causal batches over 0, and the
// tile loop 1113 instructions instead of 1232 (run 47d); the scale folded into the exponent here too, beside the
// general path, lost 0.7-1.4% on unmasked cases (a 1706-instruction loop, run 47c).
#ifndef KVATTN_SM90_BOUNDS
#define KVATTN_SM90_BOUNDS 1
#endif

// A whole unit's normalised O rows staged for its bulk store by stmatrix (1: four 8x8 blocks a store, 8 stores a
// thread at head_dim 128), or by 4-byte shared-memory stores (0: 32 a thread; the A/B of ab_sm90.py --boundary).
#ifndef KVATTN_SM90_STSM
#define KVATTN_SM90_STSM 1
#endif

// 1 = every unit's rows fit one warpgroup (at most 64) and the two consumer warpgroups split its KV tiles
// (PrefillSm90::consume_split); the instance the decode wrapper's sm90 route of large GQA groups runs. Set by the
// host (kvattn.prefill.sm90_spec's wg_split), never a default.
#ifndef KVATTN_SM90_WGSPLIT
#define KVATTN_SM90_WGSPLIT 0
#endif

// 1 = a split item's consumer warps merge its chunks' partial states themselves (PrefillSm90::merge_if_last): the
// last warp of a block's chunks to store its 16 rows merges them and writes O / LSE, so the plan needs no merge
// launch. Set by the host (kvattn.prefill.sm90_spec's fused_merge) for plans whose blocks have few chunks, plain
// variants (no output hook), head_dim up to 128; the launch's off_counters (0: none) turns it on per plan.
#ifndef KVATTN_SM90_FMERGE
#define KVATTN_SM90_FMERGE 0
#endif

// Experiment (scripts/ab_sm90.py --qbuf; 1, the default, builds one Q tile): QBUF = 2 gives persistent CTAs two Q
// tiles, used by alternate units with tiles, so the producers copy a unit's Q while the unit before it still runs
// (not after its last Q K^T); with head_dim 128 only 2 K/V stages then fit (KVATTN_SM90_STAGES=2 with it). Runs
// 27a / 27b (BENCHMARKS.md): the lost stage costs far more than the second Q tile gives; kept for the A/B.
#ifndef KVATTN_SM90_QBUF
#define KVATTN_SM90_QBUF 1
#endif

// Experiment (scripts/ab_sm90.py --qhalf; 0, the default, is the kernel before): each consumer warpgroup's 64 Q rows
// are their own half of the Q tile, with their own `qfree` (that warpgroup's last Q K^T done) and `qfull` (the
// half's TMA bytes landed) mbarriers, so the producer refills consumer 0's half without waiting for consumer 1's
// last Q K^T (~1050 cycles later at a unit boundary: run 33d's trace). 1: both halves, then tile 0; 2: half 0, tile
// 0, then half 1 (tile 0 no longer waits for consumer 1). The Q tensor map's boxes are 64 rows in these builds
// (kvattn.tma.attach_rows). Where the halves apply (kQHalf) see PrefillSm90.
#ifndef KVATTN_SM90_QHALF
#define KVATTN_SM90_QHALF 0
#endif

// K / V tile layout: 1 = 8-row groups, each holding all the rows' 64-column blocks (1024 bytes each), so one 5-dim
// TMA box copies a page's rows across the whole head dim (a page-16 tile at head dim 128: 16 boxes instead of 32;
// run 29b, causal b1_S8192 563 -> 632 TFLOP/s); the instance of paged caches (kvattn.tma.interleaved_tiles, whose
// maps are 5-dim). 0 = 64-column blocks of N rows (ragged K / V: its tiles start at any token, not on a group).
#ifndef KVATTN_SM90_KVIL
#define KVATTN_SM90_KVIL 0
#endif

// Experiment (scripts/ab_sm90.py --wg3; 0, the default, is the kernel before): 1 = three consumer warpgroups for 192
// packed query rows (512 threads), taking their turns in a ring of three named barriers, so two of them can be in
// their softmax while the third's products run (head dim 64, whose softmax outlasts its matrix products). Head dim
// 64 only (the consumers' 160 registers hold a 64-column O and a 128-token S); the host plans 192-row units for it
// (kvattn.prefill: cta_rows 192). Not with wg_split, the fused merge, the Q halves or a second Q tile.
#ifndef KVATTN_SM90_WG3
#define KVATTN_SM90_WG3 0
#endif
// (WG3 builds) 1 = a whole unit's O goes out by TMA from a buffer of its own (the last stage's K half holds 128 of
// its 192 rows), 0 = per-thread stores (the A/B).
#ifndef KVATTN_SM90_OBUF
#define KVATTN_SM90_OBUF 1
#endif

// Timing experiment only (scripts/trace_sm90.py; never set by the library): 1 = persistent CTAs stamp clock64()
// at each unit's boundary events (KVATTN_TRACE_* below) into kvattn_sm90_trace, read back by the script through
// cuModuleGetGlobal; 2 = the same stamps from the global timer (ns, comparable across CTAs: scripts/trace_route.py).
// Off, the stamps compile to nothing.
#ifndef KVATTN_SM90_TRACE
#define KVATTN_SM90_TRACE 0
#endif
#if KVATTN_SM90_TRACE
#define KVATTN_TRACE_CTAS 132
#define KVATTN_TRACE_UNITS 128
#define KVATTN_TRACE_EVENTS 20
extern "C" {
__device__ unsigned long long kvattn_sm90_trace[KVATTN_TRACE_CTAS * KVATTN_TRACE_UNITS * KVATTN_TRACE_EVENTS];
}
#endif

namespace kvattn {

// Event e of the CTA's unit `slot` (KVATTN_SM90_TRACE): the SM's cycle count, or `value` where given.
enum TraceEvent {
  kTraceQCopy = 0,     // producer thread 0: qfree passed, the Q copy about to be issued
  kTraceTile0 = 1,     // producer thread 0: tile 0 issued
  kTraceStart0 = 2,    // consumer 0 (thread 128): the unit's Q and tile 0 have landed
  kTraceTurn0 = 3,     //   its first turn
  kTraceQk0 = 4,       //   its first Q K^T done
  kTraceSoft0 = 5,     //   its first softmax done
  kTraceLastQk0 = 6,   //   its last Q K^T done (qfree)
  kTraceLastPv0 = 7,   //   its last P V done
  kTraceEnd0 = 8,      //   its epilogue done
  kTraceStart1 = 9,    // consumer 1 (thread 256): Q and tile 0 landed
  kTraceLastPv1 = 10,  //   its last P V done
  kTraceEnd1 = 11,     //   its epilogue done
  kTraceQIssued = 12,  // producer thread 0: its Q copies issued
  kTraceLookup = 13,   //   tile 0's page id / row offset loaded
  kTraceEmpty = 14,    //   tile 0's stage free
  kTraceTiles = 15,    // the unit's tiles (a value)
  kTraceOQfree0 = 16,  // consumer 0, its bulk-stored epilogue: the Q barrier passed (the K half free to stage O)
  kTraceORows0 = 17,   //   its rows normalised and staged in shared memory (the LSE stored)
  kTraceOSync0 = 18,   //   its warpgroup's barrier passed (the bulk store issued next)
};
// KVATTN_SM90_TRACE 1: the SM's cycle counter; 2: the global timer in ns (comparable across CTAs).
__device__ __forceinline__ unsigned long long kvattn_trace_now() {
#if KVATTN_SM90_TRACE == 2
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
#else
  return (unsigned long long)clock64();
#endif
}
__device__ __forceinline__ void trace_stamp(int slot, int e, long long value = -1) {
#if KVATTN_SM90_TRACE
  if (slot < KVATTN_TRACE_UNITS && blockIdx.x < KVATTN_TRACE_CTAS)
    kvattn_sm90_trace[(blockIdx.x * KVATTN_TRACE_UNITS + slot) * KVATTN_TRACE_EVENTS + e] =
        value >= 0 ? (unsigned long long)value : kvattn_trace_now();
#endif
}
#define KVATTN_TRACE(thread, slot, e) \
  do { if (KVATTN_SM90_TRACE && threadIdx.x == (thread)) trace_stamp(slot, e); } while (0)

// A: the element types and head dims (traits.cuh).
template <class A, class V>
struct PrefillSm90 {
  using Q = typename A::Q;
  using KV = typename A::KV;
  using T = Q;   // the 16-bit tiles' and MMA operands' type (an fp8 cache is expanded to it)
  static constexpr int D_QK = A::D_QK;
  static constexpr int D_VO = A::D_VO;
  static constexpr bool kFp8 = A::kFp8;
  // Full K/V tiles by TMA where run() bound tensor maps (kvattn/tma.py): 16-bit caches whose keys need no transform.
  static constexpr bool kTma = !kFp8 && !V::kQK && KVATTN_SM90_X == 0;
  // Persistent CTAs (see the top; kvattn.prefill.sm90_persistent decides: 16-bit caches, no fused RoPE, head_dim
  // <= 128, where the loop's state fits), their producers given 40 registers (24 spill); else one CTA per unit.
  static constexpr bool kPersist = KVATTN_SM90_PERSIST;
  // The score scale folded into the exponent on unmasked tiles (KVATTN_SM90_FOLD): plain softmax variants up to
  // head_dim 128 (at 256 the fold's extra live value makes the sliding-window instance spill).
  static constexpr bool kFold =
      KVATTN_SM90_FOLD && D_QK <= 128 && D_VO <= 128 && !V::kLogits && !V::kPositional && V::kSoftmax;
  // (KVATTN_SM90_BOUNDS) variants whose masks are column bounds only: their masked tiles take softmax<true, true>
  // (kFold: plain softmax, no logits transform)
  static constexpr bool kBoundsMask = KVATTN_SM90_BOUNDS && kFold && !V::kWindow && !V::kKeep && !V::kCustomMask;
  using Base = PrefillKernel<A, 4, 2, V>;   // helpers only (items, masks, epilogue)
  using Item = typename Base::Item;
  static constexpr int CONSUMERS = KVATTN_SM90_WG3 ? 3 : 2;   // consumer warpgroups, 64 query rows each
  static constexpr int THREADS = 128 * (1 + CONSUMERS);        // producer warpgroup + the consumers
  static constexpr int PRODUCERS = 128;
  // A query / key transform (fused RoPE) or the fp8 expansion runs in the producers: they get the registers for it.
  // (WG3: 128 registers a thread at launch; the producers keep 24 or, persistent, 32 of them.)
  static constexpr int PRODUCER_REGS = V::kQK || kFp8 ? 56 : kPersist ? (CONSUMERS == 3 ? 32 : 40) : 24;
  static constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 160 : V::kQK || kFp8 ? 224 : kPersist ? 232 : 240;
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;   // a thread's registers at launch (168, WG3 128)
  static_assert(!(kFp8 && V::kQK), "fused RoPE needs a 16-bit cache");
  static_assert(!V::kQK || PRODUCERS % (D_QK / 16) == 0,
                "a query / key transform's threads (D_QK / 16 a row) tile the producers: D_QK 64, 128 or 256");
  // setmaxnreg.inc waits for registers the CTA's other warps released: the consumers take at most what they free.
  static_assert(PRODUCERS * (LAUNCH_REGS - PRODUCER_REGS) >= CONSUMERS * 128 * (CONSUMER_REGS - LAUNCH_REGS),
                "register budget");
  static_assert(CONSUMERS == 2 || (D_QK == 64 && D_VO == 64 && !kFp8 && !V::kQK),
                "WG3: head dim 64, a 16-bit cache, no query / key transform");
  static constexpr int ROWS = 64 * CONSUMERS;         // packed query rows per CTA
  // exp2s of each 8 score blocks from the polynomial (KVATTN_SM90_EXP2_POLY; -1: by head dim)
  static constexpr int EXP2_POLY =
      KVATTN_SM90_EXP2_POLY >= 0 ? KVATTN_SM90_EXP2_POLY : D_QK == 64 && D_VO == 64 ? 2 : 0;
  // KV tokens per tile and ring depth: 128-token tiles in 3 stages up to head_dim 128; head_dim 256's 64 KB
  // query tile leaves room for 2 stages of 80-token tiles (5% faster than 64 on the H200). KVATTN_SM90_N /
  // _STAGES override them (experiments; kvattn.prefill.sm90_tile mirrors them).
#ifdef KVATTN_SM90_N
  static constexpr int N = KVATTN_SM90_N;
#else
  static constexpr int N = D_QK + D_VO > 256 ? 80 : 128;
#endif
#ifdef KVATTN_SM90_STAGES
  static constexpr int STAGES = KVATTN_SM90_STAGES;
#else
  static constexpr int STAGES = D_QK + D_VO > 256 ? 2 : 3;
#endif
  static constexpr int Q_CHUNKS = A::QK_CHUNKS;       // 16-byte chunks per Q / K row
  static constexpr int CHUNKS = A::VO_CHUNKS;         // per V / O row
  static constexpr int QK_BLOCKS = D_QK / 64, VO_BLOCKS = D_VO / 64;   // 64-column blocks of a K / V row
  // The K / V tile layout (KVATTN_SM90_KVIL): the bytes between 64-column blocks and between 8-row groups.
  static constexpr bool KVIL = KVATTN_SM90_KVIL && kTma;
  static constexpr unsigned K_BLOCK_BYTES = KVIL ? 1024 : N * 128, K_GROUP_BYTES = KVIL ? QK_BLOCKS * 1024 : 1024;
  static constexpr unsigned V_BLOCK_BYTES = KVIL ? 1024 : N * 128, V_GROUP_BYTES = KVIL ? VO_BLOCKS * 1024 : 1024;
  static constexpr int Q_ELEMS = ROWS * D_QK;
  static constexpr int K_ELEMS = N * D_QK;            // K of a stage (V follows)
  static constexpr int STAGE_ELEMS = K_ELEMS + N * D_VO;
  static constexpr int QBUF = KVATTN_SM90_QBUF;   // Q tiles (a CTA of one unit uses the first)
  static_assert(QBUF == 1 || QBUF == 2, "KVATTN_SM90_QBUF: one or two Q tiles");
  // K and V of a stage have their own `full` and `empty` mbarriers where the ring has 2 stages (head_dim 256), so the
  // producers reload a stage's K once the consumers' Q K^T of it has completed, not after its P V too: with the
  // two consumers ping-ponging, a 2-stage joint ring is always full and leaves the copies no lead (head_dim 128 with
  // 2 stages: 412 TFLOP/s joint, 630 split). At 3 stages the joint ring has lead enough and the split's extra
  // barrier traffic costs 1-5% (scripts/ab_sm90.py --kvsplit, runs 27a / 27b). KVATTN_SM90_KVSPLIT=0 / 1 forces it.
#ifdef KVATTN_SM90_KVSPLIT
  static constexpr bool KVSPLIT = KVATTN_SM90_KVSPLIT;
#else
  static constexpr bool KVSPLIT = STAGES < 3;
#endif
  // KVATTN_SM90_WGSPLIT (kvattn.prefill's wg_split: the decode wrapper's sm90 route of large GQA groups): every
  // unit's rows fit one warpgroup and the two consumer warpgroups split its KV tiles (consume_split).
  static constexpr bool kWgSplit = KVATTN_SM90_WGSPLIT;
  static_assert(!kWgSplit || (!KVSPLIT && (4 * CHUNKS + 4) * 128 * 4 <= STAGE_ELEMS * (int)sizeof(T)),
                "wg split: one K/V ring (no KVSPLIT), and a stage holds a warpgroup's state for the merge");
  static constexpr bool kFusedMerge = KVATTN_SM90_FMERGE;
  static_assert(!kFusedMerge || (!V::kOutput && !kWgSplit && D_VO <= 128),
                "fused split merge: no output hook, not wg_split, head_dim_vo <= 128 (its registers)");
  // (KVATTN_SM90_QHALF) Q rows of one TMA box of q: a consumer warpgroup's 64 in these builds, else the tile's 128.
  static constexpr int Q_BOX = KVATTN_SM90_QHALF ? 64 : ROWS;
  // The Q halves on their own barriers (KVATTN_SM90_QHALF): not with two Q tiles, K and V on their own barriers, a
  // query transform (its producers rotate the copied rows), or wg_split (its warpgroups share every row).
  static constexpr bool kQHalf = KVATTN_SM90_QHALF && QBUF == 1 && !KVSPLIT && !kWgSplit && !V::kQK;
  // The Q tiles' barriers: qfree[QBUF]; QHALF builds add 3 (kQHalf: qfree[2], one a consumer warpgroup, and
  // qfull[2], the halves' TMA bytes).
  static constexpr int QBARS = KVATTN_SM90_QHALF ? QBUF + 3 : QBUF;
  static_assert(CONSUMERS == 2 || (!kWgSplit && !kFusedMerge && !KVATTN_SM90_QHALF && QBUF == 1 && !KVSPLIT),
                "WG3: not with wg_split, the fused merge, the Q halves, two Q tiles or split K / V barriers");
  // (WG3) The O tile's buffer, after the stages (OBUF_ELEMS 0: none; see kTmaO).
  static constexpr int OBUF_ELEMS = CONSUMERS == 3 && KVATTN_SM90_OBUF ? ROWS * D_VO : 0;
  static constexpr int SMEM_BYTES = (QBUF * Q_ELEMS + STAGES * STAGE_ELEMS + OBUF_ELEMS) * (int)sizeof(T) +
                                    (2 * STAGES + QBARS + (KVSPLIT ? 2 * STAGES : 0)) * 8;
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: at most 227 KB per CTA (fewer stages, or one Q tile)");
  // LPR adjacent lanes copy one token's K and V rows (LPR divides both rows' 16-byte chunks and 32): lane l
  // chunks l % LPR + k LPR (equal rows up to head dim 256: LPR = CHUNKS, one chunk of each row per lane).
  static constexpr int LPR = gcd(gcd(Q_CHUNKS, CHUNKS), 32);
  static constexpr int RPI = 32 / LPR;                // rows one warp-wide copy instruction covers
  static constexpr int RPW = N / 4;                   // rows of a tile each producer warp copies (one per lane)
  // Tiles over 128 tokens (KVATTN_SM90_N, experiments): a producer lane holds the offsets of two rows of its
  // warp's band, lane and 32 + lane.
  static constexpr bool kHiRows = RPW > 32;
  static constexpr int SN = N / 2;                    // S accumulators per thread
  static constexpr int ON = D_VO / 2;                 // O accumulators per thread
  // fp8: lanes per row of the expansion (dividing both rows' 16-byte fp8 chunks), rows per warp-wide load
  static constexpr int LPR8 = gcd(gcd(D_QK / 16, D_VO / 16), 32);
  static constexpr int RPI8 = 32 / LPR8;
  static_assert(D_VO == 64 || D_VO == 128 || D_VO == 256,
                "P V is one wgmma of N = D_VO: wgmma.cuh has the instances of 64, 128 and 256");
  static_assert(N % 16 == 0 && RPW <= 64 && RPW % RPI == 0, "KV tile shape");
  static_assert(!kFp8 || (RPW % RPI8 == 0 && !kHiRows),
                "fp8: a producer warp's rows are whole warp-wide loads of both K and V, one row per lane");
  static_assert(!kHiRows || !V::kQK, "tiles over 128 tokens: no key transform (its threads tile 128 rows)");

  // Element offset of 16-byte chunk c of row r in a [R][D] tile (any D): 64-column blocks of R rows of 128 bytes.
  template <int R> __device__ __forceinline__ static int sw(int r, int c) {
    return (c >> 3) * (R * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
  }
  // The same in a K (B = QK_BLOCKS) or V (B = VO_BLOCKS) tile: sw<N>, or (KVIL) 8-row groups of B blocks of 8 rows.
  template <int B> __device__ __forceinline__ static int kvsw(int r, int c) {
    if constexpr (KVIL) return (r >> 3) * (B * 512) + (c >> 3) * 512 + (r & 7) * 64 + (((c & 7) ^ (r & 7)) << 3);
    else return sw<N>(r, c);
  }

  // The barriers after the K/V stages: full[STAGES], empty[STAGES], the Q tiles' QBARS (qfree[QBUF], kQHalf:
  // qfree[2] then qfull[2]), then (KVSPLIT) V's full[STAGES] and empty[STAGES]. Without KVSPLIT, V shares K's:
  // v_full is `full`.
  __device__ __forceinline__ static unsigned long long* v_full(unsigned long long* full) {
    return KVSPLIT ? full + 2 * STAGES + QBARS : full;
  }
  // (KVSPLIT) K's `empty` barriers from V's (vempty = v_full(full) + STAGES).
  __device__ __forceinline__ static unsigned long long* k_empty(unsigned long long* vempty) {
    return vempty - (2 * STAGES + QBARS);
  }

  __device__ __forceinline__ static void load_q(const PrefillParams& p, const Item& it, Q* qs, int kvh) {
    Base::template copy_q<ROWS, PRODUCERS>(p, it, qs, kvh, [](int r, int ch) { return sw<ROWS>(r, ch); });
  }

  // The Q tile by TMA where run() bound p.tma_qmap (kvattn.tma.RowsTensorMap) and the item's rows start on a token:
  // one box (64 columns, group heads, 1 KV head, ROWS / group tokens) per 64-column block, its bytes expected by
  // tile 0's `full` barrier. Issued by one thread, where the producers' 16 per-thread copies each took ~6200 SM
  // cycles a unit to issue, 2 tile-times, all of it before tile 0 (scripts/trace_sm90.py, run 30b). Rows past the
  // item read other requests' queries (zeros past the tensor): padding rows, never stored. Not with a query
  // transform (fused RoPE rotates the copied rows once they land: its producers wait for their own copies).
  static constexpr bool kTmaQ = !V::kQK;
  // The O tile by TMA (kvattn.tma.RowsTensorMap of o): each consumer warpgroup writes its 64 normalised rows into
  // the K half of the unit's last stage (dead once every consumer's last Q K^T has completed: qfree; the stage is
  // released only after the store has read it) and one thread stores them as D_VO / 64 boxes (64 columns, group
  // heads, 64 / group tokens), where the per-thread global stores took ~3400 SM cycles a unit (run 30a). Whole units
  // of one request only (a box writes all its rows: a unit short of 128 rows, or a split's float partial rows, keep
  // the per-thread stores; where K and V of a stage are released apart, KVSPLIT, the unit's last K is released only
  // once the store has read it, with its V), nor in the head_dim 64 custom-mask instance (its persistent build
  // spills 4 bytes with the store's code). WG3: each warpgroup's rows staged in its part of the O buffer (kOBuf).
  static constexpr bool kOBuf = OBUF_ELEMS > 0;
  static constexpr bool kTmaO = (kOBuf || ROWS * D_VO <= K_ELEMS) && sizeof(typename A::O) == 2 &&
                                !(V::kCustomMask && D_VO == 64);
  __device__ __forceinline__ static bool o_by_tma(const PrefillParams& p, const Item& it) {
    return kTmaO && p.tma_o != 0 && it.partial < 0 && it.nrows == ROWS && it.row0 % p.group_size == 0;
  }
  __device__ __forceinline__ static bool q_by_tma(const PrefillParams& p, const Item& it) {
    return kTmaQ && p.tma_q != 0 && it.row0 % p.group_size == 0;
  }
  // (KVATTN_SM90_SHIFT) Where a tile of the item's tokens from t0 on is loaded from: a tile that would end past the
  // item, on a ragged cache (one run of tokens per request: the rows are the item's own), of an item longer than a
  // tile, is the box that ends at the item's end; else t0.
  // (Not the paged caches' instance, KVIL; nor custom mask + window, whose persistent build then spills 48 bytes.)
  static constexpr bool kShift = KVATTN_SM90_SHIFT && kTma && !KVIL && !(V::kCustomMask && V::kWindow);
  // (KVATTN_SM90_PTAIL) A paged item's partial last tile: its whole pages by TMA.
  static constexpr bool kPagedTail = KVATTN_SM90_PTAIL && kTma && !KVSPLIT;
  // (KVATTN_SM90_NARROW) 128-token tiles whose K and V share their barriers.
  static constexpr bool kNarrow = KVATTN_SM90_NARROW && N == 128 && !KVSPLIT;
  __device__ __forceinline__ static int box_start(const PrefillParams& p, const Item& it, int t0) {
    return kShift && p.tma_mode == 1 && t0 + N > it.ke && it.ke - N > it.kb ? it.ke - N : t0;
  }
  // The first kv index of the own tokens of the tile loaded from t0: past t0 where it is a moved box (box_start),
  // whose first columns repeat tokens of the tile before.
  __device__ __forceinline__ static int own_start(const PrefillParams& p, const Item& it, int t0) {
    const int r = (it.ke - it.kb) % N;
    return kShift && p.tma_mode == 1 && t0 + N == it.ke && r != 0 ? it.ke - r : t0;
  }
  // Rows h0 * Q_BOX .. h1 * Q_BOX - 1 of the tile (the whole tile unless kQHalf), their bytes expected by `bar`.
  __device__ __forceinline__ static void issue_q_tma(const PrefillParams& p, const Item& it, Q* qs, int kvh,
                                                     unsigned long long* bar, int h0 = 0, int h1 = ROWS / Q_BOX) {
    mbar_expect_tx(bar, (h1 - h0) * Q_BOX * D_QK * (int)sizeof(Q));
    const int tok = it.qo_start + it.tok_lo;
#pragma unroll
    for (int h = 0; h < ROWS / Q_BOX; ++h) {
      if (h < h0 || h >= h1) continue;
      // (a half's first token: its rows' first; rows start on a token, 64 a multiple of the group: q map bound)
      const int t = h == 0 ? tok : tok + h * (Q_BOX / p.group_size);
#pragma unroll
      for (int cb = 0; cb < QK_BLOCKS; ++cb)
        tma_load_4d(qs + cb * (ROWS * 64) + h * (Q_BOX * 64), &p.tma_qmap, cb * 64, 0, kvh, t, bar);
    }
  }

  // Producer warp pw's RPW rows of K and V of the tile starting at kv index t0; `off` is the element offset of
  // row RPW pw + lane (lanes < RPW), off_hi of row RPW pw + 32 + lane (kHiRows). Rows past ke are zero-filled;
  // rows below `from` are left alone (PTAIL: they come by TMA).
  __device__ __forceinline__ static void issue_kv(const PrefillParams& p, T* stage, long long off, long long off_hi,
                                                  int t0, int ke, int kvh, int pw, int lane, int from = 0) {
    const int chunk = lane % LPR, sub = lane / LPR;
    const KV* kg = static_cast<const KV*>(p.k) + kvh * p.kv_stride_head + chunk * 8;
    const KV* vg = static_cast<const KV*>(p.v) + kvh * p.kv_stride_head + chunk * 8;
#pragma unroll 2
    for (int j = 0; j < RPW / RPI; ++j) {
      const int rr = j * RPI + sub;
      // (kHiRows: rows 32.. of the band come from off_hi; j * RPI >= 32 is the same for every lane)
      const long long o = kHiRows ? __shfl_sync(0xffffffffu, j * RPI >= 32 ? off_hi : off, rr & 31)
                                  : __shfl_sync(0xffffffffu, off, rr);
      const int row = RPW * pw + rr;
      if (row < from) continue;
      const int bytes = t0 + row < ke ? 16 : 0;
#pragma unroll
      for (int k = 0; k < Q_CHUNKS / LPR; ++k)
        cp_async16(stage + kvsw<QK_BLOCKS>(row, chunk + k * LPR), kg + o + k * LPR * 8, bytes);
#pragma unroll
      for (int k = 0; k < CHUNKS / LPR; ++k)
        cp_async16(stage + K_ELEMS + kvsw<VO_BLOCKS>(row, chunk + k * LPR), vg + o + k * LPR * 8, bytes);
    }
  }

  // (TMA) The page id of box `box` (p.tma_rows rows) of the tile at t0, its first row clamped into the item (lanes
  // past the tile's boxes must not read past its page list; ragged: the request's first token).
  __device__ __forceinline__ static int box_page(const PrefillParams& p, const Item& it, int t0, int box) {
    int pg, in;
    Base::page_slot(p, min(t0 + box * p.tma_rows, it.ke - 1), pg, in);
    return __ldg(it.pages + pg);
  }

  // (TMA) Lane `box` of producer warp 0 issues box `box` (rows box * p.tma_rows ...) of K and V of the full tile
  // at t0, every 64-column block of it; lane 0 makes the stage's `full` barrier expect the tile's bytes. Another
  // lane's box may land before that (the transaction count may go below zero), but the phase cannot complete
  // before lane 0 arrives, after its expect_tx. (A __syncwarp here made ptxas spill the 24-register producers.)
  // Only full tiles of items that start on a box boundary come here (produce), so every box lies in one page.
  // id: the box's page id (box_page). PART: 0 both K and V on `bar`, 1 K only, 2 V only (KVSPLIT).
  // rows: the tile's first rows that come by TMA, whole boxes (PTAIL: a partial tile's whole pages; else N).
  template <int PART = 0>
  __device__ __forceinline__ static void issue_kv_tma(const PrefillParams& p, T* stage, int t0, int box, int id,
                                                      int kvh, unsigned long long* bar, int rows = N) {
    constexpr int ELEMS = PART == 0 ? STAGE_ELEMS : PART == 1 ? K_ELEMS : N * D_VO;
    if (box == 0) mbar_expect_tx(bar, ELEMS / N * rows * (int)sizeof(T));
    const int r0 = box * p.tma_rows;
    if (r0 >= rows) return;
    int pg, in;
    Base::page_slot(p, t0 + r0, pg, in);   // a full tile: its boxes lie in the item
    // ragged: the "page" id is the request's first token, in one page of (many) slots
    const int slot = p.tma_mode == 1 ? id + in : in, page = p.tma_mode == 1 ? 0 : id;
    if constexpr (KVIL) {
      // one box of K and one of V: the box's rows across every 64-column block (5-dim maps: column, row in the
      // 8-row group, block (NHD: of every head), group (HND: of every head), page; kvattn/tma.py)
      const int g = (p.tma_hnd ? kvh * (p.page_size >> 3) : 0) + (slot >> 3);
      if constexpr (PART != 2)
        tma_load_5d(stage + (r0 >> 3) * (QK_BLOCKS * 512), &p.tma_k, 0, 0, p.tma_hnd ? 0 : kvh * QK_BLOCKS, g, page, bar);
      if constexpr (PART != 1)
        tma_load_5d(stage + K_ELEMS + (r0 >> 3) * (VO_BLOCKS * 512), &p.tma_v, 0, 0, p.tma_hnd ? 0 : kvh * VO_BLOCKS, g,
                    page, bar);
      return;
    }
    const int c1 = p.tma_hnd ? slot : kvh, c2 = p.tma_hnd ? kvh : slot;
    if constexpr (D_QK == D_VO && PART == 0) {
#pragma unroll
      for (int cb = 0; cb < D_QK / 64; ++cb) {
        tma_load_4d(stage + cb * (N * 64) + r0 * 64, &p.tma_k, cb * 64, c1, c2, page, bar);
        tma_load_4d(stage + K_ELEMS + cb * (N * 64) + r0 * 64, &p.tma_v, cb * 64, c1, c2, page, bar);
      }
    } else {
      if constexpr (PART != 2) {
#pragma unroll
        for (int cb = 0; cb < D_QK / 64; ++cb)
          tma_load_4d(stage + cb * (N * 64) + r0 * 64, &p.tma_k, cb * 64, c1, c2, page, bar);
      }
      if constexpr (PART != 1) {
#pragma unroll
        for (int cb = 0; cb < D_VO / 64; ++cb)
          tma_load_4d(stage + K_ELEMS + cb * (N * 64) + r0 * 64, &p.tma_v, cb * 64, c1, c2, page, bar);
      }
    }
  }

  // fp8: producer warp pw's RPW rows of K and V of the tile at t0, loaded, expanded and stored (zero past ke).
  __device__ __forceinline__ static void expand_kv8(const PrefillParams& p, T* stage, long long off, int t0, int ke,
                                                    int kvh, int pw, int lane) {
    constexpr int C8 = LPR8;                      // lanes per row (each k: chunk + k C8 of K, of V)
    constexpr int KN = D_QK / 16 / C8, VN = D_VO / 16 / C8;
    constexpr int ITER = RPW / RPI8;              // warp-wide loads per tile (of K and of V)
    constexpr int GROUP = ITER % 4 == 0 ? 4 : 2;  // rows per lane loaded before any is expanded (bytes in flight)
    static_assert(ITER % GROUP == 0, "fp8 rows per producer warp");
    const int chunk = lane % C8, sub = lane / C8;
    const KV* kg = static_cast<const KV*>(p.k) + kvh * p.kv_stride_head + chunk * 16;
    const KV* vg = static_cast<const KV*>(p.v) + kvh * p.kv_stride_head + chunk * 16;
    const float ks = kv_cache_scale(p.k_scale_ptr, p.k_scale, kvh), vs = kv_cache_scale(p.v_scale_ptr, p.v_scale, kvh);
#pragma unroll
    for (int j0 = 0; j0 < ITER; j0 += GROUP) {
      uint4 kw[GROUP][KN], vw[GROUP][VN];
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        const int rr = (j0 + j) * RPI8 + sub;
        const long long o = __shfl_sync(0xffffffffu, off, rr);
        const bool ok = t0 + RPW * pw + rr < ke;
#pragma unroll
        for (int k = 0; k < KN; ++k)
          kw[j][k] = ok ? __ldg(reinterpret_cast<const uint4*>(kg + o + k * C8 * 16)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < VN; ++k)
          vw[j][k] = ok ? __ldg(reinterpret_cast<const uint4*>(vg + o + k * C8 * 16)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        const int row = RPW * pw + (j0 + j) * RPI8 + sub;
        uint4 lo, hi;
#pragma unroll
        for (int k = 0; k < KN; ++k) {
          dequant16<KV, T>(kw[j][k], ks, lo, hi);
          *reinterpret_cast<uint4*>(stage + kvsw<QK_BLOCKS>(row, 2 * (chunk + k * C8))) = lo;
          *reinterpret_cast<uint4*>(stage + kvsw<QK_BLOCKS>(row, 2 * (chunk + k * C8) + 1)) = hi;
        }
#pragma unroll
        for (int k = 0; k < VN; ++k) {
          dequant16<KV, T>(vw[j][k], vs, lo, hi);
          *reinterpret_cast<uint4*>(stage + K_ELEMS + kvsw<VO_BLOCKS>(row, 2 * (chunk + k * C8))) = lo;
          *reinterpret_cast<uint4*>(stage + K_ELEMS + kvsw<VO_BLOCKS>(row, 2 * (chunk + k * C8) + 1)) = hi;
        }
      }
    }
  }

  // S = Q K^T for this warpgroup's 64 rows (issued and committed, not waited for).
  __device__ __forceinline__ static void issue_qk(float (&s)[SN], unsigned q_addr, unsigned k_addr) {
#pragma unroll
    for (int kk = 0; kk < D_QK / 16; ++kk) {
      const unsigned koff = (kk & 3) * 32;   // k16 step inside a 128-byte row
      Wgmma<T, N>::ss(s, sw128_desc(q_addr + (kk >> 2) * (ROWS * 128) + koff, 0),
                      sw128_desc(k_addr + (kk >> 2) * K_BLOCK_BYTES + koff, 0, K_GROUP_BYTES), kk > 0);
    }
    wgmma_commit();
  }

  // O += P V over the tile's tokens 16 KS0 .. 16 KS1 - 1 (all N by default), 16 at a time (issued and committed).
  template <int KS0 = 0, int KS1 = N / 16>
  __device__ __forceinline__ static void issue_pv(float (&o)[ON], const unsigned (&pa)[N / 16][4], unsigned v_addr) {
#pragma unroll
    for (int ks = KS0; ks < KS1; ++ks)
      Wgmma<T, D_VO>::rs(o, pa[ks], sw128_desc(v_addr + ks * 2 * V_GROUP_BYTES, V_BLOCK_BYTES, V_GROUP_BYTES), 1);
    wgmma_commit();
  }

  // (kNarrow) Which half of the unit's last tile (as loaded: a moved box ends at the item's end) holds every kept
  // column: 1 the first, 2 the second, 0 neither. The other half's probabilities are 0 (its columns are masked).
  __device__ __forceinline__ static int narrow_half(const PrefillParams& p, const Item& it, int ntiles) {
    if constexpr (!kNarrow) {
      return 0;
    } else {
      const int start = box_start(p, it, it.kb + (ntiles - 1) * N);   // (t0 itself unless kShift moves it)
      const int lo = own_start(p, it, start) - start, hi = it.ke - start;
      return hi <= N / 2 ? 1 : lo >= N / 2 ? 2 : 0;
    }
  }
  // The unit's last P V: half (narrow_half's) picks its tokens, the first or second 64 or all N. (Q K^T stays whole:
  // an N = 64 wgmma beside the N = 128 ones, into half of the same accumulators or into their own, makes ptxas
  // serialise every wgmma of the kernel.)
  __device__ __forceinline__ static void issue_pv_at(float (&o)[ON], const unsigned (&pa)[N / 16][4], unsigned v_addr,
                                                     int half) {
    if constexpr (kNarrow) {
      if (half == 1) return issue_pv<0, N / 32>(o, pa, v_addr);
      if (half == 2) return issue_pv<N / 32, N / 16>(o, pa, v_addr);
    }
    issue_pv(o, pa, v_addr);
  }

  // Custom mask: the N bits of row tok from kv index j0 on (bit k of out[k / 32] is the pair (tok, j0 + k)), read
  // as MW + 1 aligned 32-bit words and shifted into place (the host pads the mask for the last words).
  static constexpr int MW = (N + 31) / 32;
  __device__ __forceinline__ static void mask_bits(const PrefillParams& p, const Item& it, int tok, int j0,
                                                   unsigned (&out)[MW]) {
    const long long bit = it.mask_bit0 + (long long)tok * it.kv_len + j0;
    const unsigned* w = reinterpret_cast<const unsigned*>(p.mask) + (bit >> 5);
    const int sh = (int)(bit & 31);
    unsigned lo = __ldg(w);
#pragma unroll
    for (int i = 0; i < MW; ++i) {
      const unsigned hi = __ldg(w + i + 1);
      out[i] = __funnelshift_r(lo, hi, sh);
      lo = hi;
    }
  }

  // Scores of the tile at t0 -> probabilities in place (online softmax over this thread's rows g, g + 8);
  // `scale` is the factor O must be multiplied by. lo: the tile's own first kv index (own_start; t0 < lo: a moved
  // box, whose columns below lo repeat the tile before and are masked). BOUNDS (kBoundsMask): the masks are row r's
  // column range [lo, min(ke - 1, diagonal)], as offsets from this thread's first column.
  template <bool MASK, bool BOUNDS = false>
  __device__ __forceinline__ static void softmax(const PrefillParams& p, const Item& it, float (&s)[SN], int t0, int lo,
                                                 const int (&tok)[2], const float (&rc)[2], int lane,
                                                 float (&m)[1][2], float (&l)[1][2], float (&scale)[2]) {
    constexpr bool FOLD = kFold && !MASK;
    int hi[2] = {0, 0}, lo_c = 0;   // (BOUNDS) the kept columns' offsets from this thread's first: [lo_c, hi[r]]
    if constexpr (BOUNDS) {
      const int c0 = t0 + 2 * (lane % 4);
#pragma unroll
      for (int r = 0; r < 2; ++r) hi[r] = (p.causal ? min(it.ke - 1, it.delta + tok[r]) : it.ke - 1) - c0;
      lo_c = lo - c0;
    }
    unsigned cm[2][MW];   // custom mask: bit 8 nb + e of cm[r][..] is this thread's pair (row r, column nb, e)
    if constexpr (V::kCustomMask && MASK) {
#pragma unroll
      for (int r = 0; r < 2; ++r) mask_bits(p, it, tok[r], t0 + 2 * (lane % 4), cm[r]);
    }
    float mx[2] = {KVATTN_NEG_INF, KVATTN_NEG_INF};
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const bool keep = !(V::kCustomMask && MASK) || ((cm[r][nb / 4] >> ((nb % 4) * 8 + (e & 1))) & 1u);
        float x;
        if constexpr (BOUNDS) {
          const int c = nb * 8 + (e & 1);   // (an immediate)
          x = c <= hi[r] && c >= lo_c ? s[4 * nb + e] * p.score_scale : KVATTN_NEG_INF;
        } else {
          x = FOLD ? s[4 * nb + e] :
              Base::template score<MASK, false, true>(p, it, s[4 * nb + e], t0 + nb * 8 + 2 * (lane % 4) + (e & 1),
                                                      tok[r], rc[r], keep);
          if (MASK && kShift && t0 + nb * 8 + 2 * (lane % 4) + (e & 1) < lo) x = KVATTN_NEG_INF;
        }
        s[4 * nb + e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float (&sb)[N / 8][4] = reinterpret_cast<float (&)[N / 8][4]>(s);   // the C layout's 8-column blocks
#pragma unroll
    for (int r = 0; r < 2; ++r)
      scale[r] = row_probs<V, FOLD, KVATTN_SM90_LAZY_MAX, EXP2_POLY>(p, sb, r, mx[r], m[0][r], l[0][r]);
  }

  __device__ __forceinline__ static void softmax_tile(const PrefillParams& p, const Item& it, float (&s)[SN], int t0,
                                                      const int (&tok)[2], const float (&rc)[2], int lane,
                                                      float (&m)[1][2], float (&l)[1][2], float (&scale)[2]) {
    if constexpr (KVATTN_SM90_X == 2) {
      scale[0] = scale[1] = 1.f;
      return;
    }
    const int lo = kShift ? own_start(p, it, t0) : t0;
    const bool masked = Base::needs_mask(p, it, t0, N) || (kShift && t0 < lo), fold = p.score_scale > 0.f;
    if (masked || (kFold && !fold)) softmax<true, kBoundsMask>(p, it, s, t0, lo, tok, rc, lane, m, l, scale);
    else softmax<false>(p, it, s, t0, lo, tok, rc, lane, m, l, scale);
  }

  // The O accumulators of this thread's two rows times the softmax's rescale factors (skipped where both are 1).
  __device__ __forceinline__ static void rescale(float (&acc)[ON], const float (&sc)[2]) {
    if (sc[0] != 1.f || sc[1] != 1.f) {
#pragma unroll
      for (int i = 0; i < ON / 4; ++i) {
        acc[4 * i + 0] *= sc[0]; acc[4 * i + 1] *= sc[0];
        acc[4 * i + 2] *= sc[1]; acc[4 * i + 3] *= sc[1];
      }
    }
  }

  // P (the probabilities in s) as the A fragments of the k16 steps of P V.
  __device__ __forceinline__ static void pack_p(const float (&s)[SN], unsigned (&pa)[N / 16][4]) {
#pragma unroll
    for (int ks = 0; ks < N / 16; ++ks) a_from_c<T>(&s[8 * ks], pa[ks]);
  }

  // (kQK) The producers transform tile u's keys (and, with tile 0, the queries) once its copies have landed,
  // then announce it: every producer waits for its own copies, a named barrier makes all of them visible, each
  // thread rotates its 16 dims of the tile's rows, makes its writes visible to the tensor cores (async proxy)
  // and arrives on the stage's `full` barrier.
  __device__ __forceinline__ static void transform_and_announce(const PrefillParams& p, const Item& it, Q* qs,
                                                                T* kvs, unsigned long long* full,
                                                                unsigned long long* vfull, int u, int g,
                                                                const typename V::QKState& qk_state) {
    named_sync(3, PRODUCERS);
    const int t0 = it.kb + u * N;
    if (u == 0)
      transform_rows_at<V, D_QK>(p, qk_state, qs, [](int r, int c) { return sw<ROWS>(r, c); }, 0, it.nrows, threadIdx.x,
                              PRODUCERS, it.req, false, [&](int r) { return it.delta + Base::row_token(p, it.row0 + r); });
    transform_rows_at<V, D_QK>(p, qk_state, kvs + ((g + u) % STAGES) * STAGE_ELEMS, [](int r, int c) { return kvsw<QK_BLOCKS>(r, c); },
                            0, min(N, it.ke - t0), threadIdx.x, PRODUCERS, it.req, true, [&](int r) { return t0 + r; });
    fence_proxy_async();
    mbar_arrive(&full[(g + u) % STAGES]);
    if constexpr (KVSPLIT) mbar_arrive(&vfull[(g + u) % STAGES]);
  }

  // One unit's Q and K/V tiles; g counts the tiles the CTA's earlier units put through the ring (stage g % STAGES,
  // its (g / STAGES)-th use), nq the earlier units that had tiles: the Q of such a unit waits until the consumers
  // released the previous one's (qfree: its last Q K^T has completed). Units without tiles touch neither (else
  // the consumers, who need no Q for them, could run two qfree phases ahead and the parity wait would hang).
  // KVSPLIT: full / empty are K's barriers (and Q's, with tile 0), vfull / vempty V's; else they are full / empty.
  __device__ static void produce(const PrefillParams& p, const Item& it, Q* qs, T* kvs, unsigned long long* full,
                                 unsigned long long* empty, unsigned long long* qfree, int kvh, int g, int nq,
                                 int slot = 0) {
    unsigned long long* vfull = v_full(full);
    unsigned long long* vempty = KVSPLIT ? vfull + STAGES : empty;
    // (WG3: the warp read from lane 0, warp-uniform to the compiler, as the consumers' warpgroup: 32 registers)
    const int lane = threadIdx.x % 32;
    const int pw = CONSUMERS == 3 ? __shfl_sync(0xffffffffu, threadIdx.x / 32, 0) : threadIdx.x / 32;
    const int ntiles = (it.ke - it.kb + N - 1) / N;
    if (ntiles == 0) return;
    const typename V::QKState qk_state = V::template qk_init<D_QK>(p, qk_dims<D_QK>(threadIdx.x));
    // (kQHalf) consumer warpgroup h's half of Q, once that warpgroup's last Q K^T of the previous unit is done
    bool q_tma = false;   // (kQHalf: the item's Q by TMA)
    auto q_half = [&](int h) {
      if (nq >= 1) mbar_wait(&qfree[h], (nq - 1) & 1);
      if (q_tma && threadIdx.x == 0) {
        issue_q_tma(p, it, qs, kvh, &qfree[2 + h], h, h + 1);   // (its bytes expected before the arrival)
        mbar_arrive(&qfree[2 + h]);
      }
    };
    if constexpr (kQHalf) {
      q_tma = q_by_tma(p, it);
      q_half(0);
      if (KVATTN_SM90_QHALF == 1 || !q_tma) q_half(1);
      if (!q_tma) {
        load_q(p, it, qs, kvh);   // lands before tile 0 is announced, as below; qfull passes at once
        if (threadIdx.x == 0) {
          mbar_arrive(&qfree[2]);
          mbar_arrive(&qfree[3]);
        }
      }
    } else {
      if (nq >= QBUF) mbar_wait(qfree, (nq / QBUF - 1) & 1);   // (qfree, qs: this unit's Q slot's)
    }
    KVATTN_TRACE(0, slot, kTraceQCopy);
    if constexpr (!kQHalf) {
      if (q_by_tma(p, it)) {
        if (threadIdx.x == 0) issue_q_tma(p, it, qs, kvh, &full[g % STAGES]);
      } else {
        load_q(p, it, qs, kvh);   // lands before tile 0 is announced (the arrival waits for every earlier copy)
      }
    }
    KVATTN_TRACE(0, slot, kTraceQIssued);
    const int my_row = RPW * pw + min(lane, RPW - 1);   // the tile row whose offset this lane holds
    const int my_row_hi = RPW * pw + min(32 + lane, RPW - 1);   // (kHiRows) its second row
    long long off, off_hi = 0;
    auto offsets_at = [&](int t0) {   // this lane's rows' offsets in the tile at kv index t0 (for issue_kv)
      off = Base::tok_offset(p, it.pages, min(t0 + my_row, it.ke - 1));
      if constexpr (kHiRows) off_hi = Base::tok_offset(p, it.pages, min(t0 + my_row_hi, it.ke - 1));
    };
    offsets_at(it.kb);
    // full tiles as TMA boxes (16-bit cache, no key transform, a map bound by run(), item on a box boundary)
    const bool tma = kTma && p.tma_mode != 0 && (p.tma_mode == 1 || it.kb % p.tma_rows == 0);
    // (TMA, warp 0) this lane's box page id of the next tile, loaded a tile ahead (KVATTN_SM90_PREFETCH)
    int box_id = KVATTN_SM90_PREFETCH && tma && pw == 0 ? box_page(p, it, it.kb, lane) : 0;
    if (KVATTN_SM90_TRACE && threadIdx.x == 0 && (box_id | (int)off) == -12345) trace_stamp(slot, 0);   // (use both)
    KVATTN_TRACE(0, slot, kTraceLookup);
    for (int t = 0; t < ntiles; ++t) {
      const int u = g + t, st = u % STAGES;
      if (kQHalf && KVATTN_SM90_QHALF == 2 && q_tma && t == 1) q_half(1);   // (after tile 0)
      if (u >= STAGES) mbar_wait(&empty[st], (u / STAGES - 1) & 1);
      if (t == 0) KVATTN_TRACE(0, slot, kTraceEmpty);
      // boxes: a full tile, or (SHIFT) the partial last one's box moved back to end at the item's end
      const bool boxes = tma && (it.kb + (t + 1) * N <= it.ke || (kShift && box_start(p, it, it.kb + t * N) != it.kb + t * N));
      if constexpr (KVSPLIT) {   // a copied tile's K and V are copied together
        if (u >= STAGES && !boxes) mbar_wait(&vempty[st], (u / STAGES - 1) & 1);
      }
      if (boxes) {
        // one page lookup per lane of warp 0, in parallel
        const int t0 = kShift ? box_start(p, it, it.kb + t * N) : it.kb + t * N;
        if constexpr (KVSPLIT) {
          const int id = KVATTN_SM90_PREFETCH ? box_id : box_page(p, it, t0, lane);
          if (pw == 0) issue_kv_tma<1>(p, kvs + st * STAGE_ELEMS, t0, lane, id, kvh, &full[st]);
          cp_async_mbar_arrive(&full[st]);   // after this thread's earlier copies (the Q rows before tile 0)
          if (u >= STAGES) mbar_wait(&vempty[st], (u / STAGES - 1) & 1);
          if (pw == 0) issue_kv_tma<2>(p, kvs + st * STAGE_ELEMS, t0, lane, id, kvh, &vfull[st]);
          mbar_arrive(&vfull[st]);
        } else {
          if (pw == 0)
            issue_kv_tma(p, kvs + st * STAGE_ELEMS, t0, lane, KVATTN_SM90_PREFETCH ? box_id : box_page(p, it, t0, lane),
                         kvh, &full[st]);
          cp_async_mbar_arrive(&full[st]);   // after this thread's earlier copies (the Q rows before tile 0)
        }
        if (t == 0) KVATTN_TRACE(0, slot, kTraceTile0);
        if (t + 1 < ntiles) {
          if (KVATTN_SM90_PREFETCH && pw == 0) box_id = box_page(p, it, t0 + N, lane);
          // the copies' row offsets only where the next tile is copied (the item's last, partial tile)
          if (!KVATTN_SM90_PREFETCH || t0 + 2 * N > it.ke) offsets_at(t0 + N);
        }
        continue;
      }
      if constexpr (KVATTN_SM90_X == 1) {
        if (t == 0) asm volatile("cp.async.wait_all;\n" ::: "memory");
        fence_proxy_async();
        mbar_arrive(&full[st]);
        if constexpr (KVSPLIT) mbar_arrive(&vfull[st]);
      } else if constexpr (kFp8) {
        expand_kv8(p, kvs + st * STAGE_ELEMS, off, it.kb + t * N, it.ke, kvh, pw, lane);
        if (t == 0) asm volatile("cp.async.wait_all;\n" ::: "memory");   // this thread's Q copies, before tile 0
        fence_proxy_async();   // the stores (generic proxy) before the tensor cores' reads (async proxy)
        mbar_arrive(&full[st]);
        if constexpr (KVSPLIT) mbar_arrive(&vfull[st]);
      } else {
        // (PTAIL) a paged item's partial last tile: its whole pages as boxes, the rest copied
        const int by_tma = kPagedTail && tma && p.tma_mode == 2 ? (it.ke - it.kb - t * N) / p.tma_rows * p.tma_rows : 0;
        if (by_tma > 0 && pw == 0)
          issue_kv_tma(p, kvs + st * STAGE_ELEMS, it.kb + t * N, lane,
                       KVATTN_SM90_PREFETCH ? box_id : box_page(p, it, it.kb + t * N, lane), kvh, &full[st], by_tma);
        issue_kv(p, kvs + st * STAGE_ELEMS, off, off_hi, it.kb + t * N, it.ke, kvh, pw, lane, by_tma);
        if constexpr (V::kQK) {   // announce the previous tile, transformed, while this one is in flight
          cp_async_commit();
          if (t > 0) {
            cp_async_wait<1>();
            transform_and_announce(p, it, qs, kvs, full, vfull, t - 1, g, qk_state);
          }
        } else {
          cp_async_mbar_arrive(&full[st]);
          if constexpr (KVSPLIT) cp_async_mbar_arrive(&vfull[st]);
        }
      }
      if (t + 1 < ntiles) offsets_at(it.kb + (t + 1) * N);
    }
    if (kQHalf && KVATTN_SM90_QHALF == 2 && q_tma && ntiles == 1) q_half(1);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if constexpr (V::kQK) transform_and_announce(p, it, qs, kvs, full, vfull, ntiles - 1, g, qk_state);
  }

  // Ping-pong: the consumers take turns issuing their matrix products (named barriers 1 and 2, each over both
  // consumer warpgroups), so the tensor cores run one's products while the other does its softmax. Every unit
  // has ntiles + 1 issue points for both; consumer 1 opens with a turn for consumer 0 and consumer 0 closes
  // by taking consumer 1's last one, so all arrivals are matched. WG3: a ring of three (barriers 1, 2 and 7, each
  // over a consumer and the one before it); the last consumer opens and consumer 0 closes.
  __device__ __forceinline__ static void my_turn(int cwg) {
    named_sync(CONSUMERS == 2 || cwg < 2 ? 1 + cwg : 7, 256);
  }
  __device__ __forceinline__ static void their_turn(int cwg) {
    named_arrive(CONSUMERS == 2 ? 2 - cwg : cwg == 0 ? 2 : cwg == 1 ? 7 : 1, 256);
  }

  // (kTmaO) This consumer warpgroup's 64 rows of O (normalised, the LSE to global memory by store_rows) into the K
  // half `so` of the unit's last stage, then one thread's bulk tensor store of them; that thread releases the
  // stage for the warpgroup's 4 warps (vempty) once the store has read it. qfree / qpar: the unit's Q barrier and
  // the parity of its phase (every consumer's last Q K^T has completed: nothing reads the K half any more).
  // The release is release_o_stage's (`pend` := the stage): here, or after the next unit's first softmax (LAZY).
  // (KVATTN_SM90_STSM) This warp's 16 rows of a whole unit (every row real, partial < 0), normalised, into the
  // staged tile at so + place(row, col) by stmatrix, 16 columns a store; their LSE to global memory.
  template <class Place>
  __device__ __forceinline__ static void stage_rows(const PrefillParams& p, const Item& it, int kvh, int cw, int lane,
                                                    const float (&o)[1][CHUNKS][4], const float (&m)[1][2],
                                                    const float (&l)[1][2], typename A::O* so, Place place) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lr = quad_sum(l[0][r]);
      int tq, head;
      Base::row_dest(p, it, cw * 16 + lane / 4 + 8 * r, kvh, tq, head);
      float lse;
      Base::row_scale(m[0][r], lr, inv[r], lse);
      if constexpr (V::kOutput) inv[r] *= V::output(p, head, lse);
      if (p.lse && lane % 4 == 0) p.lse[(long long)(it.qo_start + tq) * p.lse_stride_n + head] = lse;
    }
    using M = Mma<typename A::O>;
    const int row = cw * 16 + (lane / 8 % 2) * 8 + lane % 8, half = lane / 16;   // this lane's address: block lane / 8
#pragma unroll
    for (int dn = 0; dn < CHUNKS; dn += 2)
      stmatrix_x4(so + place(row, (dn + half) * 8),
                  M::pack(o[0][dn][0] * inv[0], o[0][dn][1] * inv[0]), M::pack(o[0][dn][2] * inv[1], o[0][dn][3] * inv[1]),
                  M::pack(o[0][dn + 1][0] * inv[0], o[0][dn + 1][1] * inv[0]),
                  M::pack(o[0][dn + 1][2] * inv[1], o[0][dn + 1][3] * inv[1]));
  }

  __device__ __forceinline__ static void store_o_tma(const PrefillParams& p, const Item& it, int kvh, int cw, int lane,
                                                     const float (&o)[1][CHUNKS][4], const float (&m)[1][2],
                                                     const float (&l)[1][2], T* so, unsigned long long* vempty,
                                                     unsigned long long* qfree, int qpar, int last_st, int& pend,
                                                     int slot = 0) {
    using O = typename A::O;
    const int cwg = cw / 4;
    O* mine = reinterpret_cast<O*>(so) + cwg * (64 * D_VO);
    // Both warpgroups' last Q K^T have read the stage's K. kQHalf: this warpgroup's own qfree, and consumer 0 waits
    // for consumer 1's; consumer 1 must not wait for consumer 0's: where the next unit has one tile, consumer 0 can
    // complete its next qfree phase before consumer 1 looks, and a parity wait two phases behind never returns. Its
    // last turn (my_turn before the last P V) already follows consumer 0's last Q K^T (wgmma_wait, then their_turn).
    mbar_wait(qfree + (kQHalf ? cwg : 0), qpar);
    if (kQHalf && cwg == 0) mbar_wait(qfree + 1, qpar);
    KVATTN_TRACE(128, slot, kTraceOQfree0);
    // row (0..127) of the tile, column: this warpgroup's rows as D_VO / 64 boxes of 64 rows of 128 swizzled bytes
    auto place = [](int row, int col) {
      const int r = row & 63;
      return (col >> 6) * 4096 + r * 64 + ((((col & 63) >> 3) ^ (r & 7)) << 3) + (col & 7);
    };
    if constexpr (KVATTN_SM90_STSM) stage_rows(p, it, kvh, cw, lane, o, m, l, mine, place);
    else Base::template store_rows<1, true>(p, it, kvh, cw, lane, o, m, l, mine, place);
    fence_proxy_async();   // the stores (generic proxy) before the bulk store's reads (async proxy)
    KVATTN_TRACE(128, slot, kTraceORows0);
    named_sync(4 + cwg, 128);
    KVATTN_TRACE(128, slot, kTraceOSync0);
    if (threadIdx.x % 128 == 0) {
      const int tok = it.qo_start + Base::row_token(p, it.row0 + cwg * 64);
#pragma unroll
      for (int cb = 0; cb < VO_BLOCKS; ++cb) tma_store_4d(&p.tma_omap, mine + cb * 4096, cb * 64, 0, kvh, tok);
      tma_store_commit();
    }
    pend = last_st;
    if constexpr (!KVATTN_SM90_LAZY) release_o_stage(vempty, pend);
  }

  // (kOBuf) This consumer warpgroup's 64 rows of O (normalised, the LSE to global memory) into its part of the O
  // buffer `obuf`, once its store before has read it, then one thread's bulk tensor store of them.
  __device__ __forceinline__ static void store_o_buf(const PrefillParams& p, const Item& it, int kvh, int cw, int lane,
                                                     const float (&o)[1][CHUNKS][4], const float (&m)[1][2],
                                                     const float (&l)[1][2], T* obuf) {
    using O = typename A::O;
    const int cwg = cw / 4;
    O* mine = reinterpret_cast<O*>(obuf) + cwg * (64 * D_VO);
    if (threadIdx.x % 128 == 0) tma_store_wait_read<0>();
    named_sync(4 + cwg, 128);
    auto place = [](int row, int col) {   // as store_o_tma's
      const int r = row & 63;
      return (col >> 6) * 4096 + r * 64 + ((((col & 63) >> 3) ^ (r & 7)) << 3) + (col & 7);
    };
    if constexpr (KVATTN_SM90_STSM) stage_rows(p, it, kvh, cw, lane, o, m, l, mine, place);
    else Base::template store_rows<1, true>(p, it, kvh, cw, lane, o, m, l, mine, place);
    fence_proxy_async();   // the stores (generic proxy) before the bulk store's reads (async proxy)
    named_sync(4 + cwg, 128);
    if (threadIdx.x % 128 == 0) {
      const int tok = it.qo_start + Base::row_token(p, it.row0 + cwg * 64);
#pragma unroll
      for (int cb = 0; cb < VO_BLOCKS; ++cb) tma_store_4d(&p.tma_omap, mine + cb * 4096, cb * 64, 0, kvh, tok);
      tma_store_commit();
    }
  }

  // The stage this warpgroup last stored its O from (pend, -1: none), released for its 4 warps once the bulk store
  // has read it; LAZY calls it after a unit's first softmax (the producers need the stage again for the third tile).
  // KVSPLIT: vempty is V's barriers; the stage's K (k_empty) is released with it.
  __device__ __forceinline__ static void release_o_stage(unsigned long long* vempty, int& pend) {
    if (pend >= 0) {
      if (threadIdx.x % 128 == 0) {
        tma_store_wait_read<0>();
        mbar_arrive_n(vempty + pend, 4);
        if constexpr (KVSPLIT && kTmaO) mbar_arrive_n(k_empty(vempty) + pend, 4);
      }
      pend = -1;
    }
  }

  // One unit's tiles (ring positions g ...): every tile's stage is released on `empty` once this warp is done
  // with it, the Q tile on `qfree` after the unit's last Q K^T. STREAM (KVATTN_SM90_STREAM): the unit's turns are
  // part of the CTA's one stream; consumer 1 opens it where `open` (the CTA's first unit with tiles), and the
  // caller closes it after the last unit. w: the unit's plan item; w_next: the next unit's (-1: none), returned
  // in `next` (EARLY).
  template <bool STREAM>
  __device__ static void consume(const PrefillParams& p, const Item& it, const Q* qs, const T* kvs,
                                 unsigned long long* full, unsigned long long* empty, unsigned long long* qfree,
                                 int kvh, int w, int g, bool open, int w_next, Item& next, int& pend,
                                 int qpar = 0, int slot = 0) {
    if constexpr (kWgSplit) {
      consume_split(p, it, qs, kvs, full, empty, qfree, kvh, w, g, w_next, next, qpar);
      return;
    }
    unsigned long long* vfull = v_full(full);
    unsigned long long* vempty = KVSPLIT ? vfull + STAGES : empty;
    constexpr bool EARLY = KVATTN_SM90_EARLY;
    // (KVSPLIT) a unit whose O goes out by TMA keeps its last tile's K until the store has read it (release_o_stage)
    const bool keep_last_k = KVSPLIT && kTmaO && EARLY && o_by_tma(p, it);
    Item again;   // (EARLY) the unit's item, loaded anew for the epilogue
    auto load_early = [&] {
      again = Base::load_item(p, static_cast<const volatile int*>(p.plan), w);
      if (w_next >= 0) next = Base::load_item(p, p.plan, w_next);
    };
    const int lane = threadIdx.x % 32, cw = threadIdx.x / 32 - 4;   // consumer warp
    // its warpgroup (WG3: read from lane 0, so the compiler knows it warp-uniform and keeps what derives from it,
    // the Q descriptors and the turns' barriers, in uniform registers)
    const int cwg = CONSUMERS == 3 ? __shfl_sync(0xffffffffu, cw / 4, 0) : cw / 4;
    const int ntiles = (it.ke - it.kb + N - 1) / N;
    const int narrow = narrow_half(p, it, ntiles);   // (kNarrow) the last tile's P V over one half
    // This thread's rows (cw * 16 + lane / 4 + 8 r): their query tokens, clamped for padding rows.
    int tok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) tok[r] = Base::row_token(p, it.row0 + min(cw * 16 + lane / 4 + 8 * r, it.nrows - 1));
    float rc[1][2];   // the variant's per-row constants (kPositional)
    Base::row_consts(p, it, kvh, cw * 16, lane, rc);
    float o[1][CHUNKS][4];
    float m[1][2], l[1][2];
    reset_state(o, m, l);
    float (&acc)[ON] = reinterpret_cast<float (&)[ON]>(o);

    if (ntiles > 0) {
      const unsigned q_addr = smem_addr(qs) + cwg * 64 * 128;
      const unsigned kv_addr = smem_addr(kvs);
      constexpr unsigned STAGE_BYTES = STAGE_ELEMS * sizeof(T);
      float s[SN];
      float sc[2];
      if (cwg == CONSUMERS - 1 && (!STREAM || open)) their_turn(cwg);
      if constexpr (kQHalf) mbar_wait(qfree + 2 + cwg, qpar);   // this warpgroup's Q rows (qfull)
      mbar_wait(&full[g % STAGES], (g / STAGES) & 1);
      KVATTN_TRACE(128, slot, kTraceStart0);
      KVATTN_TRACE(256, slot, kTraceStart1);
      fence_proxy_async();   // the copies were generic-proxy writes; wgmma reads through the async proxy
      my_turn(cwg);
      KVATTN_TRACE(128, slot, kTraceTurn0);
      wgmma_fence();
      issue_qk(s, q_addr, kv_addr + (g % STAGES) * STAGE_BYTES);
      their_turn(cwg);
      wgmma_wait<0>();
      fence_regs(s);
      KVATTN_TRACE(128, slot, kTraceQk0);
      if (ntiles == 1 && lane == 0) mbar_arrive(qfree + (kQHalf ? cwg : 0));
      if (ntiles == 1) KVATTN_TRACE(128, slot, kTraceLastQk0);
      // the tile's K is done with (a unit's last K that holds its O: released after the store, release_o_stage)
      if (KVSPLIT && lane == 0 && !(keep_last_k && ntiles == 1)) mbar_arrive(&empty[g % STAGES]);
      softmax_tile(p, it, s, it.kb, tok, rc[0], lane, m, l, sc);
      KVATTN_TRACE(128, slot, kTraceSoft0);
      release_o_stage(vempty, pend);
      if (KVATTN_SM90_TRACE && threadIdx.x == 128) trace_stamp(slot, kTraceTiles, ntiles);

      for (int ti = 0; ti + 1 < ntiles; ++ti) {
        const int nxt = ti + 1, cur_st = (g + ti) % STAGES, nxt_st = (g + nxt) % STAGES;
        mbar_wait(&full[nxt_st], ((g + nxt) / STAGES) & 1);
        if constexpr (KVSPLIT) mbar_wait(&vfull[cur_st], ((g + ti) / STAGES) & 1);
        fence_proxy_async();
        unsigned pa[N / 16][4];
        pack_p(s, pa);
        my_turn(cwg);
        wgmma_fence();
        issue_qk(s, q_addr, kv_addr + nxt_st * STAGE_BYTES);
        issue_pv(acc, pa, kv_addr + cur_st * STAGE_BYTES + K_ELEMS * sizeof(T));
        their_turn(cwg);
        wgmma_wait<1>();
        fence_regs(s);
        if (nxt == ntiles - 1 && lane == 0) mbar_arrive(qfree + (kQHalf ? cwg : 0));   // the unit's last Q K^T done
        if (nxt == ntiles - 1) KVATTN_TRACE(128, slot, kTraceLastQk0);
        if (KVSPLIT && lane == 0 && !(keep_last_k && nxt == ntiles - 1)) mbar_arrive(&empty[nxt_st]);   // its K
        softmax_tile(p, it, s, kShift ? box_start(p, it, it.kb + nxt * N) : it.kb + nxt * N, tok, rc[0], lane, m, l,
                     sc);
        wgmma_wait<0>();
        fence_regs(acc);
        if (lane == 0) mbar_arrive(&vempty[cur_st]);   // this warp is done with tile ti's stage (KVSPLIT: its V)
        rescale(acc, sc);
      }
      if constexpr (KVSPLIT) {
        mbar_wait(&vfull[(g + ntiles - 1) % STAGES], ((g + ntiles - 1) / STAGES) & 1);
        fence_proxy_async();
      }
      unsigned pa[N / 16][4];
      pack_p(s, pa);
      my_turn(cwg);
      wgmma_fence();
      const int last_st = (g + ntiles - 1) % STAGES;
      issue_pv_at(acc, pa, kv_addr + last_st * STAGE_BYTES + K_ELEMS * sizeof(T), narrow);
      their_turn(cwg);
      if (!STREAM && cwg == 0) my_turn(cwg);   // the last consumer's last arrival
      if constexpr (EARLY) load_early();   // in flight while the last P V runs
      wgmma_wait<0>();
      fence_regs(acc);
      KVATTN_TRACE(128, slot, kTraceLastPv0);
      KVATTN_TRACE(256, slot, kTraceLastPv1);
      if (EARLY && o_by_tma(p, again)) {   // the stage released after the bulk store has read it (kOBuf: now)
        if constexpr (kOBuf) {
          if (lane == 0) mbar_arrive(&vempty[last_st]);
          store_o_buf(p, again, kvh, cw, lane, o, m, l, const_cast<T*>(kvs) + STAGES * STAGE_ELEMS);
        } else {
          store_o_tma(p, again, kvh, cw, lane, o, m, l, const_cast<T*>(kvs) + last_st * STAGE_ELEMS, vempty, qfree,
                      qpar, last_st, pend, slot);
        }
        KVATTN_TRACE(128, slot, kTraceEnd0);
        KVATTN_TRACE(256, slot, kTraceEnd1);
        return;
      }
      if (lane == 0) mbar_arrive(&vempty[last_st]);
    } else if constexpr (EARLY) {
      load_early();
    }
    if constexpr (EARLY) {
      Base::store_rows(p, again, kvh, cw, lane, o, m, l);
      if (kFusedMerge && again.partial >= 0 && p.off_counters) merge_if_last(p, again, w, kvh, cw, lane);
    } else {
      const Item mine = Base::load_item(p, static_cast<const volatile int*>(p.plan), w);
      Base::store_rows(p, mine, kvh, cw, lane, o, m, l);
      if (kFusedMerge && mine.partial >= 0 && p.off_counters) merge_if_last(p, mine, w, kvh, cw, lane);
      if (w_next >= 0) next = Base::load_item(p, p.plan, w_next);
    }
    KVATTN_TRACE(128, slot, kTraceEnd0);
    KVATTN_TRACE(256, slot, kTraceEnd1);
  }

  // (kFusedMerge) After this consumer warp stored its 16 rows (cw * 16 + lane / 4 + 8 r) of chunk k of a split
  // block's partial state: it arrives on the counter of (block, KV head, warp), and the last of the block's n chunks
  // (n <= FMERGE_MAX) to arrive merges the rows' n states and writes O / LSE (merge_rows). Arrival: the lanes'
  // stores, __syncwarp, lane 0's gpu-scope acquire-release add (no fence: release is cumulative over the warp's
  // stores __syncwarp ordered before it); the last one's acquire, then __syncwarp, orders the lanes' L2 loads (__ldcg)
  // of the other chunks' states after it (its own it reads back: each lane loads the elements it stored). It leaves
  // the counter at 0. Item field 7: (merge slot << 12) | k (kvattn.scheduler._prefill_items); n = the item's pstride.
  static constexpr int FMERGE_MAX = 8;   // (kvattn.prefill.FUSED_MERGE_MAX_CHUNKS)
  __device__ static void merge_if_last(const PrefillParams& p, const Item& it, int w, int kvh, int cw, int lane) {
    const int key = static_cast<const volatile int*>(p.plan)[p.off_items + 8 * w + 7];
    const int k = key & 4095, n = it.pstride;
    int* cnt = const_cast<int*>(p.plan) + p.off_counters +
               ((long long)(key >> 12) * plan_header(p.plan).num_kv_heads + kvh) * 8 + cw;
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      last = atomic_add_acq_rel_gpu(cnt, 1) == n - 1;
      if (last) atomicExch(cnt, 0);
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __syncwarp();
    if (n <= 2) merge_rows<2>(p, it, k, n, cw, lane, kvh);
    else if (n <= 4) merge_rows<4>(p, it, k, n, cw, lane, kvh);
    else merge_rows<FMERGE_MAX>(p, it, k, n, cw, lane, kvh);
  }

  // (kFusedMerge) The merge of this warp's 16 rows' n <= N chunk states (rows partial - k + i, i < n, of tmp_o /
  // tmp_lse) into O / LSE, in two passes: the chunks' LSEs (their weights), then each 8-column block's weighted sum
  // in chunk order. Every load is unconditional (chunk indices clamped to n - 1 with weight 0, padding rows read row
  // 0's states and store nothing), so the compiler issues them together, not one L2 round trip a load; the sums'
  // order does not depend on which chunk came last (the bits are those of any run).
  template <int N>
  __device__ static void merge_rows(const PrefillParams& p, const Item& it, int k, int n, int cw, int lane, int kvh) {
    using O = typename A::O;
    const int col = 2 * (lane % 4);
    const long long step = (long long)p.num_qo_heads * D_VO;   // one chunk's row to the next
    bool ok[2];
    float wgt[2][N];
    const float* src[2];   // this row's chunk-0 state in tmp_o
    O* dst[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = cw * 16 + lane / 4 + 8 * r;
      ok[r] = row < it.nrows;
      int tq, head;
      Base::row_dest(p, it, ok[r] ? row : 0, kvh, tq, head);
      const long long prow0 = it.partial - k + (long long)(tq - it.tok_lo) * n;
      src[r] = p.tmp_o + (prow0 * p.num_qo_heads + head) * D_VO + col;
      dst[r] = static_cast<O*>(p.o) + (long long)(it.qo_start + tq) * p.o_stride_n + (long long)head * p.o_stride_h + col;
      float ls[N], mx = KVATTN_NEG_INF;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        ls[i] = __ldcg(p.tmp_lse + (prow0 + min(i, n - 1)) * p.num_qo_heads + head);
        ls[i] = i < n ? ls[i] : KVATTN_NEG_INF;
        mx = fmaxf(mx, ls[i]);
      }
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        wgt[r][i] = ls[i] == KVATTN_NEG_INF ? 0.f : fast_exp2((ls[i] - mx) * kLog2e);
        sum += wgt[r][i];
      }
      const float inv = mx == KVATTN_NEG_INF ? 0.f : 1.f / sum;
#pragma unroll
      for (int i = 0; i < N; ++i) wgt[r][i] *= inv;
      if (ok[r] && p.lse && lane % 4 == 0)
        p.lse[(long long)(it.qo_start + tq) * p.lse_stride_n + head] = mx == KVATTN_NEG_INF ? KVATTN_NEG_INF : mx + __logf(sum);
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
      for (int i = 0; i < N; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float2 x = __ldcg(reinterpret_cast<const float2*>(src[r] + min(i, n - 1) * step + c * 8));
          acc[r][0] = fmaf(wgt[r][i], x.x, acc[r][0]);
          acc[r][1] = fmaf(wgt[r][i], x.y, acc[r][1]);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (ok[r]) *reinterpret_cast<unsigned*>(dst[r] + c * 8) = Mma<O>::pack(acc[r][0], acc[r][1]);
    }
  }

  // (kWgSplit) One unit whose rows fit one warpgroup (at most 64: a decode batch's large GQA group, one query token
  // a request), its KV tiles split between the two consumer warpgroups: each runs the unit's rows (Q rows 0-63)
  // against every other tile, so no product is spent on a second warpgroup of padding rows (the 128-row ping-pong
  // would give warpgroup 1 only padding). No turns: each warpgroup issues its products as its tiles land. Units
  // alternate which warpgroup takes tile 0 (qpar). At the unit's end the warpgroup without the last tile (B) puts
  // its state into the last tile's stage, still held, and the other (A) merges it with its own, stores the rows
  // and releases that stage. Every tile's stage is released by each warp of both warpgroups (`empty` counts 8): the
  // one that does not run it waits on its `full` barrier first, in tile order. So each warpgroup sees every phase of
  // every stage (a parity wait two phases ahead of a stage would pass at once: the stages alternate between the
  // warpgroups; run 37c's launch failure), and it sees tile 0's, whose phase covers the Q rows. Each warp arrives
  // on qfree after its warpgroup's last Q K^T, or after tile 0's wait where it has none.
  __device__ static void consume_split(const PrefillParams& p, const Item& it, const Q* qs, const T* kvs,
                                       unsigned long long* full, unsigned long long* empty,
                                       unsigned long long* qfree, int kvh, int w, int g, int w_next, Item& next,
                                       int qpar) {
    const int lane = threadIdx.x % 32, cwg = (threadIdx.x / 32 - 4) / 4, rw = (threadIdx.x / 32) % 4;  // row warp
    const int ntiles = (it.ke - it.kb + N - 1) / N;
    const int first = cwg ^ qpar;                        // this warpgroup's first tile (0 or 1)
    const int mine = ntiles > first ? (ntiles - first + 1) / 2 : 0;   // tiles it runs
    const bool owner_last = ntiles > 0 && ((ntiles - 1) & 1) == first;   // whether the unit's last tile is this one's
    int tok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) tok[r] = Base::row_token(p, it.row0 + min(rw * 16 + lane / 4 + 8 * r, it.nrows - 1));
    float rc[1][2];
    Base::row_consts(p, it, kvh, rw * 16, lane, rc);
    float o[1][CHUNKS][4];
    float m[1][2], l[1][2];
    reset_state(o, m, l);
    float (&acc)[ON] = reinterpret_cast<float (&)[ON]>(o);
    constexpr unsigned STAGE_BYTES = STAGE_ELEMS * sizeof(T);
    const unsigned q_addr = smem_addr(qs), kv_addr = smem_addr(kvs);
    auto release = [&](int t) {
      if (lane == 0) mbar_arrive(&empty[(g + t) % STAGES]);
    };
    auto ack = [&](int t) {   // the other warpgroup's tile t: waited for in order, then released
      mbar_wait(&full[(g + t) % STAGES], ((g + t) / STAGES) & 1);
      release(t);
    };
    if (ntiles > 0 && first == 1) {   // tile 0 is the other warpgroup's: Q has landed once it has
      ack(0);
      if (mine == 0 && lane == 0) mbar_arrive(qfree);   // (no Q K^T here)
    }
    // Each tile whole (Q K^T, softmax, P V, release) before the next: the other warpgroup's tile overlaps it, and
    // a warpgroup that held its tile until its next one landed (Q K^T of the next issued with P V of this one, as
    // in consume) would leave the ring one stage to load into (run 37a: 54.9 us against 45.9 for GQA 32).
    for (int i = 0; i < mine; ++i) {
      const int t = first + 2 * i, st = (g + t) % STAGES;
      mbar_wait(&full[st], ((g + t) / STAGES) & 1);
      fence_proxy_async();
      float s[SN];
      float sc[2];
      wgmma_fence();
      issue_qk(s, q_addr, kv_addr + st * STAGE_BYTES);
      wgmma_wait<0>();
      fence_regs(s);
      if (i == mine - 1 && lane == 0) mbar_arrive(qfree);   // this warpgroup's last Q K^T has completed
      softmax_tile(p, it, s, kShift ? box_start(p, it, it.kb + t * N) : it.kb + t * N, tok, rc[0], lane, m, l, sc);
      rescale(acc, sc);
      unsigned pa[N / 16][4];
      pack_p(s, pa);
      wgmma_fence();
      issue_pv(acc, pa, kv_addr + st * STAGE_BYTES + K_ELEMS * sizeof(T));
      wgmma_wait<0>();
      fence_regs(acc);
      if (t != ntiles - 1 || ntiles == 1) release(t);   // (the last tile's stage, held for the merge)
      if (t + 1 < ntiles) ack(t + 1);
    }
    if (ntiles >= 2) {   // both warpgroups hold a state: B's goes through the last tile's stage to A
      const int last_st = (g + ntiles - 1) % STAGES;
      float* x = reinterpret_cast<float*>(const_cast<T*>(kvs) + last_st * STAGE_ELEMS) + threadIdx.x % 128;
      named_sync(1, 256);   // A's last P V has completed: nothing reads the stage any more
      if (!owner_last) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) x[(4 * c + e) * 128] = o[0][c][e];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          x[(4 * CHUNKS + r) * 128] = m[0][r];
          x[(4 * CHUNKS + 2 + r) * 128] = l[0][r];
        }
        fence_proxy_async();   // (the producers' next copies into this stage come through the async proxy)
      }
      named_sync(1, 256);
      if (owner_last) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float mb = x[(4 * CHUNKS + r) * 128], lb = x[(4 * CHUNKS + 2 + r) * 128];
          const float mx = fmaxf(m[0][r], mb);
          // (a row empty in both stays empty: no -inf - -inf)
          const float fa = mx == KVATTN_NEG_INF ? 0.f : exp2f(m[0][r] - mx);
          const float fb = mx == KVATTN_NEG_INF ? 0.f : exp2f(mb - mx);
          m[0][r] = mx;
          l[0][r] = l[0][r] * fa + lb * fb;
#pragma unroll
          for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) o[0][c][e] = o[0][c][e] * fa + x[(4 * c + e) * 128] * fb;
        }
        fence_proxy_async();
        release(ntiles - 1);
      }
    }
    // The rows go out from A (the last tile's warpgroup; warpgroup 0 where the unit has no tiles).
    const Item again = Base::load_item(p, static_cast<const volatile int*>(p.plan), w);
    if (ntiles > 0 ? owner_last : cwg == 0) Base::store_rows(p, again, kvh, rw, lane, o, m, l);
    if (w_next >= 0) next = Base::load_item(p, p.plan, w_next);
  }

  // The CTA's walk over the (item, KV head) units: rounds of nb units (nb: the grid, or in a mixed launch (mixed.cuh)
  // its first `ctas`), CTA b taking unit b of every even round and unit nb - 1 - b of every odd one (snake order:
  // the rounds' sums even out). The units come head group by head group (hg KV heads, the plan header's
  // kv_head_group: the CTAs in flight share those heads' K/V in L2), within a group by plan item (sorted longest
  // first within L2 windows: kvattn/scheduler.py), then by head. Each group starts its rounds afresh, so a group's
  // short last units and the next group's long first ones never share a round: one snake through all groups gave
  // the CTAs that took a group's first units at a boundary its second ones too (causal b1_S16384 one head at a
  // time: -13%, run 35a). Groups only where each fills a round and hg divides Hkv; else one group (the walk before).
  struct UnitOf {
    int item, head;
  };
  struct Walk {
    int nb, hkv, hg, per, rounds, total;   // per: units a group; rounds: a group's; total: all groups'
    __device__ __forceinline__ Walk(int items, int hkv_, int hg_, int nb_) : nb(nb_), hkv(hkv_) {
      hg = hg_ > 0 && hg_ < hkv_ && hkv_ % hg_ == 0 && items * hg_ >= nb_ ? hg_ : hkv_;
      per = items * hg;
      rounds = (per + nb - 1) / nb;
      total = rounds * (hkv / hg);
    }
    // The unit of round q (< total), or -1 where the round's group has no unit left for this CTA.
    __device__ __forceinline__ int unit(int q) const {
      const int grp = hg == hkv ? 0 : q / rounds, r = q - grp * rounds;
      const int local = r * nb + (r & 1 ? nb - 1 - (int)blockIdx.x : (int)blockIdx.x);
      return local < per ? grp * per + local : -1;
    }
    // The first round from q on with a unit (total: none).
    __device__ __forceinline__ int next(int q) const {
      while (q < total && unit(q) < 0) ++q;
      return q;
    }
    __device__ __forceinline__ UnitOf of(int f) const {
      if (hg == hkv) return {f / hkv, f % hkv};   // one group (the common case: no more divisions)
      const int grp = f / per, r = f - grp * per;
      return {r / hg, grp * hg + r % hg};
    }
  };

  // Closes the consumers' stream of turns (STREAM): consumer 0 takes consumer 1's last arrival.
  static constexpr bool STREAM_TURNS = KVATTN_SM90_STREAM && !kWgSplit;
  __device__ __forceinline__ static void close_turns(bool opened) {
    if (STREAM_TURNS && opened && (threadIdx.x / 32 - 4) / 4 == 0) my_turn(0);
  }

  // MIXED: the first `ctas` CTAs of a mixed launch run the (persistent) prefill.
  template <bool MIXED = false>
  __device__ static void run(const PrefillParams& p, Q* smem, int ctas = 0) {
    T* qs = smem;                        // [QBUF] Q tiles
    T* kvs = smem + QBUF * Q_ELEMS;
    unsigned long long* full =
        reinterpret_cast<unsigned long long*>(kvs + STAGES * STAGE_ELEMS + OBUF_ELEMS);             // [STAGES]
    unsigned long long* empty = full + STAGES;                                                      // [STAGES]
    unsigned long long* qfree = empty + STAGES;                                                     // [QBARS]
    unsigned long long* vfull = v_full(full);                                                      // [STAGES]
    unsigned long long* vempty = vfull + STAGES;                                                   // [STAGES]
    if (threadIdx.x == 0) {
      for (int i = 0; i < STAGES; ++i) {
        mbar_init(&full[i], PRODUCERS);
        mbar_init(&empty[i], 4 * CONSUMERS);   // one arrival per consumer warp
        if constexpr (KVSPLIT) {
          mbar_init(&vfull[i], PRODUCERS);
          mbar_init(&vempty[i], 4 * CONSUMERS);
        }
      }
      if constexpr (kQHalf) {   // qfree[2]: one a consumer warpgroup's 4 warps; qfull[2]: the producer's arrival + bytes
        for (int i = 0; i < 2; ++i) mbar_init(&qfree[i], 4);
        for (int i = 2; i < 4; ++i) mbar_init(&qfree[i], 1);
      } else {
        for (int i = 0; i < QBUF; ++i) mbar_init(&qfree[i], 4 * CONSUMERS);
      }
    }
    __syncthreads();
    const int items = plan_header(p.plan).num_items;   // a padded grid (graph mode) walks only these
    if constexpr (!kPersist) {   // one CTA per unit: item blockIdx.x, KV head blockIdx.y
      if ((int)blockIdx.x >= items) return;
      if (threadIdx.x < PRODUCERS) {
        regs_dec<PRODUCER_REGS>();
        produce(p, Base::load_item(p, p.plan, blockIdx.x), qs, kvs, full, empty, qfree, blockIdx.y, 0, 0);
      } else {
        regs_inc<CONSUMER_REGS>();
        const Item it = Base::load_item(p, p.plan, blockIdx.x);
        Item none;
        int pend = -1;   // (its stage is never reloaded)
        consume<STREAM_TURNS>(p, it, qs, kvs, full, empty, qfree, blockIdx.y, blockIdx.x, 0, true, -1, none, pend);
        close_turns(it.ke > it.kb);
        if (kTmaO && threadIdx.x % 128 == 0) tma_store_wait<0>();
      }
      return;
    }
    const Walk walk(items, plan_header(p.plan).num_kv_heads, plan_header(p.plan).kv_head_group,
                    MIXED ? ctas : (int)gridDim.x);
    int g = 0;   // ring tiles of this CTA's earlier units
    if (threadIdx.x < PRODUCERS) {
      regs_dec<PRODUCER_REGS>();
      int nq = 0;   // of them, units with tiles
      for (int r = walk.next(0); r < walk.total; r = walk.next(r + 1)) {
        const UnitOf u = walk.of(walk.unit(r));
        const Item it = Base::load_item(p, p.plan, u.item);
        produce(p, it, qs + (nq % QBUF) * Q_ELEMS, kvs, full, empty, &qfree[nq % QBUF], u.head, g, nq, r);
        const int ntiles = (it.ke - it.kb + N - 1) / N;
        g += ntiles;
        nq += ntiles > 0;
      }
    } else {
      regs_inc<CONSUMER_REGS>();
      bool opened = false;   // consumer 1 has opened the stream of turns (the CTA had a unit with tiles)
      int nq = 0;            // the CTA's earlier units with tiles (their Q slots alternate where QBUF = 2)
      Item it;
      int pend = -1;         // (LAZY) the stage of this warpgroup's last O store, not yet released
      int r = walk.next(0);
      if (r < walk.total) it = Base::load_item(p, p.plan, walk.of(walk.unit(r)).item);
      for (int rn; r < walk.total; r = rn) {
        rn = walk.next(r + 1);
        const UnitOf u = walk.of(walk.unit(r));
        Item next;
        consume<STREAM_TURNS>(p, it, qs + (nq % QBUF) * Q_ELEMS, kvs, full, empty, &qfree[nq % QBUF], u.head,
                              u.item, g, !opened, rn < walk.total ? walk.of(walk.unit(rn)).item : -1, next, pend,
                              (nq / QBUF) & 1, r);
        const int ntiles = (it.ke - it.kb + N - 1) / N;
        g += ntiles;
        nq += ntiles > 0;
        opened = opened || ntiles > 0;
        it = next;
      }
      close_turns(opened);
      if (kTmaO && threadIdx.x % 128 == 0) tma_store_wait<0>();   // (the O stores of the last units)
    }
  }
};

template <class A, class V>
__global__ void __launch_bounds__(PrefillSm90<A, V>::THREADS, 1)
    prefill_sm90_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  PrefillSm90<A, V>::run(p, reinterpret_cast<typename A::Q*>(smem_raw));
}

}  // namespace kvattn
