"""Batch decode on a paged KV cache: plan() on the host, run() only launches (capturable).

    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout="NHD")
    w.plan(page_table, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    o = w.run(q, k_cache, v_cache)        # q [batch, Hq, D]; caches [pages, page_size, Hkv, D] (NHD)

plan() schedules with kvattn.scheduler.plan_decode, packs the work lists AND the page table into one
pinned host buffer and issues one host-to-device copy into a fixed workspace region. run() launches the
split-KV kernel and, when the plan split a request, the merge kernel over the partial states; where the grid has
fewer CTAs than the GPU has SMs (tuning fused_merge), one launch: the last CTA to write one of a request's
partial states (an arrival counter per merge, KV head and z slice in the plan buffer, left at 0 by every
launch) merges them in their fixed order.
"""
from __future__ import annotations

import math

import numpy as np

from . import _dtypes, scheduler
from .contract import align4, page_size_shift
from ._attn_args import DTYPES, HEAD_DIMS, check_plan_args
from ._validate import as_int
from .compiler import Resources
from .formats import PageTable
from .kernels import KernelSpec, Launch, ParamBuffer, attn_types, get_kernel, memo_spec, register
from ._binding import import_array
from .memory import asarray
from .opcore import AttentionOp, PagedKV, on_device
from .stream import as_stream
from .variants import Variant, plan_variant

DECODE_PARAMS = np.dtype([
    ("q", "u8"), ("k", "u8"), ("v", "u8"), ("o", "u8"), ("lse", "u8"), ("tmp_o", "u8"), ("tmp_lse", "u8"),
    ("plan", "u8"), ("page_indptr", "u8"), ("page_indices", "u8"), ("last_page_len", "u8"),
    ("q_stride_n", "i8"), ("q_stride_h", "i8"), ("o_stride_n", "i8"), ("o_stride_h", "i8"), ("lse_stride_n", "i8"),
    ("kv_stride_page", "i8"), ("kv_stride_token", "i8"), ("kv_stride_head", "i8"),
    ("off_chunk_indptr", "i4"), ("off_work_req", "i4"), ("off_work_begin", "i4"), ("off_work_end", "i4"),
    ("off_work_partial", "i4"),
    ("num_qo_heads", "i4"), ("group_size", "i4"), ("page_size", "i4"), ("page_shift", "i4"), ("window_left", "i4"),
    ("z_split", "i4"), ("score_scale", "f4"), ("cap_log2", "f4"), ("variant_data", "u8"),
    ("k_scale_ptr", "u8"), ("v_scale_ptr", "u8"), ("k_scale", "f4"), ("v_scale", "f4"),
    ("counters", "u8"), ("merge_of_req", "u8"), ("off_merge_indptr", "i4"), ("off_merge_req", "i4"),
], align=True)

THREADS = 128
LOG2E = 1.4426950408889634
DEFAULT_WORKSPACE = 128 << 20


# Kernel tuning: defaults measured on the H200 (BENCHMARKS.md); a `tuning=` dict overrides them.
#: The split of deterministic mode, in tokens: a multiple of every cut granularity (16..64).
DETERMINISTIC_SPLIT_TOKENS = 2048

#: fused_merge: split-KV partial states merged inside the decode launch (the last CTA of each request's pieces
#: merges them; decode.cuh merge_if_last), so a plan is one launch. None (auto): only where the grid has fewer
#: CTAs than the GPU has SMs, never in deterministic mode (the two merges' bits differ) and never with
#: use_cuda_graph (in a replay the merge kernel's launch is free: run 20c, b1_L2048 10.3 us per step apart against
#: 14.7 fused, b1_L512 9.0 against 10.6; eagerly, on a host-bound call, one launch saves ~4 us). Measured on the
#: H200 (runs 17b / 17c, BENCHMARKS.md): with a full grid the merge kernel after the decode launch was as fast or
#: faster in GPU time on 10 of 12 cases (up to 5.9%: the fused merge runs at the launch's tail and every split
#: item pays a release fence; page size 1 and GQA 8 were 2.4% / 0.3% faster fused); with a part-filled grid
#: (b1_L2048: 104 CTAs) one launch was 15% faster on a slow host (16.7 against 19.7 us) and 3% slower on a fast one.
#: Merging after each CTA's stream instead (run 18d) was slower still on full grids (b64_L4096 -2.6%, b128_L1024
#: -4%): every CTA's merges then land on the launch's tail.
#: m_tiles: None (auto: auto_m_tiles) or the 16-row MMA tiles per CTA (1 or 2).
#: merge_lanes: None (auto: kvattn.merge.lane_shift) or 1 (one lane per unit: the A/B); merge_programmatic: the
#: merge kernel launched programmatically (it starts while decode ends; False: a plain launch, the A/B).
#: rope_defines: ((name, value), ...) compile switches of fused RoPE's key rotation (cuda_src/variant.cuh:
#: KVATTN_ROPE_F32, KVATTN_ROPE_BATCH, KVATTN_ROPE_CHEB; the A/B of scripts/ab_rope_decode.py), RoPE builds only;
#: ids_ahead: the copies' page ids loaded a tile ahead into registers (KVATTN_DECODE_IDS_AHEAD): None (below head
#: dim 256 and with 8-token warp tiles, as measured in runs 28g / 29a), True, or False (the kernel before: the A/B of
#: scripts/probe_decode_pages.py).
#: fused_merge_batch: the partial states a lane of the fused merge loads together (1 or 4; KVATTN_FUSED_MERGE_BATCH);
#: None: FUSED_MERGE_BATCH where the plan fuses the merge, else 1 (so full grids keep the instance of fewer registers).
#: Run 33b (bench_decode, in turns): b1_L2048 0.494 -> 0.563 TB/s (17.4 -> 15.3 us), its merging CTAs' tail 5.9 -> 2.8
#: us (trace_decode); b4_L1024 trace 3.5 -> 2.6 us; b8_L2048 -1% (both fused there slower than apart, the default).
FUSED_MERGE_BATCH = 4
#: slim: the slim kernel (KVATTN_DECODE_SLIM: 8-row Q slots, a 4-phase merge, 3 stages at 2 CTAs per SM) where
#: slim_fits (head dim 256 with a 16-bit cache, groups of at most 8): None (auto: SLIM), True (an error where it does
#: not fit) or False (the 2-stage kernel). Off by default: run 34c (b64_L4096 head dim 256, in turns) 3.815 TB/s
#: against the 2-stage kernel's 3.908, so a third stage is not what that shape lacks (BENCHMARKS.md).
SLIM = False
#: min_chunk_tokens: the split path's smallest chunk in tokens (None: kvattn.scheduler.MIN_CHUNK_TOKENS, 128; "auto":
#: auto_min_chunk_tokens, the A/B of run 34d's lead). Small batches take fewer, longer chunks (b1_L2048: 13 a KV
#: head); smaller chunks put more CTAs on the SMs but give the merge more states (run 34d, BENCHMARKS.md).
#: sm90_route: a batch of large GQA groups runs on the sm90 prefill kernel (kvattn.prefill, one query token a
#: request: a unit of `group` packed rows of its 128), where the decode kernel's mma.sync tiles are issue-bound
#: (run 35c, GQA 32 b64_L4096: 45.2 us against 54.4, 0.695 of copy against 0.578). None (auto): large_plain_group
#: (groups of 32+ at head dim 128 with a 16-bit cache and the built-in plain / soft-cap / window variants), on an
#: sm_90 GPU, outside graph and deterministic mode; True (those modes raise) or False (the decode
#: kernel). sm90_route_waves: the routed plan's KV split counted in waves of the SMs (the prefill wrapper's
#: split_waves; 1: GQA 32 b64_L4096 is 128 units of 2048 tokens, one a CTA; 2: 4 chunks a request, two units a CTA,
#: the A/B: run 36a 51.2 us against 45.9, so 1). sm90_route_wg_split: True runs the route's groups of at most 64 (a
#: request's rows fit one consumer warpgroup) on the sm90 instance whose two consumer warpgroups split each unit's
#: KV tiles (kvattn.prefill wg_split: no product spent on a warpgroup of padding rows); off by default: run 37e,
#: GQA 32 b64_L4096 46.8 us against the 128-row ping-pong's 45.8 (the padded products are not what limits it).
#: sm90_route_fused_merge: the routed plan's split blocks merged inside the sm90 kernel (the prefill wrapper's
#: fused_merge: no merge launch; the last warp of a block's chunks merges them); off: runs 43c-43d, 1-5 us slower.
#: item_overhead: a request's fixed cost on the split scheduler's cost line, in tokens (None: item_overhead_tokens).
#: Run 39e (H200, in turns, bf16 Hq32/Hkv8/D128 page 16): an fp8 cache streams its tokens twice as fast while a
#: request's start and end cost what they cost, so counting 128 tokens a request instead of 32 gave e4m3 +3.8% on
#: b64_skewed (0.750 -> 0.778 of copy), +3.6% on a mixed batch of 128 (a quarter 4096 tokens, the rest 128-640),
#: +0.8-4% on b64_L4096 / b64_L1024 / short requests; bf16 0.5-0.7% slower with 128 on those, so it keeps 32.
FP8_ITEM_OVERHEAD = 128
DEFAULT_TUNING = dict(stages=None, l2_prefetch=False, allow_no_split=False, ctas_per_sm=None, m_tiles=None,
                      refill_first=False, fused_merge=None, wtok=None, merge_lanes=None, merge_programmatic=True,
                      rope_defines=(), ids_ahead=None, trace=False, fused_merge_batch=None, min_chunk_tokens=None,
                      slim=None, sm90_route=None, sm90_route_waves=1,
                      sm90_route_wg_split=False, sm90_route_fused_merge=False, item_overhead=None)


def item_overhead_tokens(kv_dtype: str | None) -> int:
    """The split scheduler's per-request cost in tokens (tuning item_overhead's default): FP8_ITEM_OVERHEAD for an
    fp8 cache, else kvattn.scheduler.ITEM_OVERHEAD_TOKENS."""
    return FP8_ITEM_OVERHEAD if _dtypes.is_fp8(kv_dtype) else scheduler.ITEM_OVERHEAD_TOKENS


def warp_tokens(head_dim: int, kv_dtype: str | None = None, forced: int | None = None,
                head_dim_vo: int | None = None) -> int:
    """Tokens per warp per tile (mirrors DecodeKernel::WTOK): 32 where 16 would make a stage of at most half head
    dim 128's 32 KB (an fp8 cache at head dims 64 / 128, a 16-bit one at 64), 8 where a 16-bit 16-token stage would
    be 64 KB (head dim 256: 2 CTAs per SM; run 29a +27%), else 16; `forced` (tuning) wins.
    head_dim_vo: V's head dim where it differs from head_dim (Q / K's)."""
    if forced:
        return forced
    fp8 = _dtypes.is_fp8(kv_dtype)
    stage16 = 64 * (head_dim + (head_dim_vo or head_dim)) * (1 if fp8 else 2)   # bytes of a 16-token stage
    return 32 if stage16 <= 16384 else 8 if not fp8 and stage16 >= 65536 else 16


def default_stages(head_dim: int, kv_dtype: str | None = None, wtok: int | None = None,
                   head_dim_vo: int | None = None, slim: bool = False) -> int:
    """Measured on the H200 (BENCHMARKS.md): a 32 KB stage (head_dim 128 at 16 tokens per warp) is best with 2
    stages and 3 CTAs per SM (+2..4% over 3 stages and 2 CTAs per SM on 4 of the 5 anchor cases); 64 at 16 tokens
    per warp with 3 stages (3 CTAs per SM); 256 fits one CTA per SM either way, so 3 stages keep more bytes in
    flight. An fp8 cache's stages (128 tokens) have 16-bit's bytes: the same choice, but at 256 (64-token stages)
    2 stages fit 2 CTAs per SM (1.5x faster than 3)."""
    if slim:
        return 3
    if _dtypes.is_fp8(kv_dtype):
        return 2 if head_dim in (128, 256) else 3
    return 2 if head_dim * warp_tokens(head_dim, kv_dtype, wtok, head_dim_vo) == 128 * 16 else 3


def auto_min_chunk_tokens(kv_lens) -> int:
    """tuning min_chunk_tokens="auto" (an A/B candidate, not the default): a sixteenth of the mean length of the
    non-empty requests, in steps of 16, within [32, 128], so a small batch's requests get about 16 chunks each. It
    reproduces the best of run 34d's traced launches (the last CTA's end: b1_L512 32 tokens 8.8 us against 12.9 at
    128, b4_L1024 64 tokens 12.2 against 13.8, b1_L2048 128 tokens 11.0, the default); not yet timed end to end."""
    kv = np.asarray(kv_lens)
    nz = kv[kv > 0]
    mean = int(nz.mean()) if nz.size else 0
    return min(128, max(32, mean // 256 * 16))


def large_plain_group(group: int, head_dim: int, kv_dtype: str | None, variant: Variant) -> bool:
    """Groups of 32+ query heads a KV head at head dim 128 with a 16-bit cache and the plain / soft-cap / window
    kernels: where auto_m_tiles takes 2 tiles, and where the sm90 route applies (sm90_route)."""
    plain = not (variant.is_user or variant.rope or variant.alibi or variant.sink or variant.custom_mask)
    return group >= 32 and head_dim == 128 and not _dtypes.is_fp8(kv_dtype) and plain


def auto_m_tiles(group: int, head_dim: int, kv_dtype: str | None, variant: Variant) -> int:
    """16-row MMA tiles per CTA: 2 (one CTA takes 32 query heads of a KV head and reads each tile once, where two
    z slices of 16 rows would each read it) for groups of 32+ at head dim 128 (64: not measured) with a 16-bit
    cache and the plain / soft-cap / window kernels (the instances fill_cache builds; run 20d: GQA 32 2.36
    against 2.17 TB/s, while GQA 16 was slower with 2: 3.27 against 3.86), else 1."""
    return 2 if large_plain_group(group, head_dim, kv_dtype, variant) else 1


@memo_spec
def decode_spec(head_dim: int, mt: int, variant: Variant, dtype: str, stages: int | None = None,
                l2_prefetch: bool = False, refill_first: bool = False, kv_dtype: str | None = None,
                wtok: int | None = None, head_dim_vo: int | None = None, rope_defines: tuple = (),
                ids_ahead: bool | None = None, trace: bool = False, fused_merge_batch: int = 1,
                slim: bool = False) -> KernelSpec:
    """wtok: tokens per warp per tile forced (8, 16 or 32; None or the rule's value: warp_tokens' rule, no define;
    8: 16-bit caches only).
    rope_defines: RoPE's compile switches (A/B builds; RoPE instances only); ids_ahead: None (the kernel's rule)
    or KVATTN_DECODE_IDS_AHEAD forced on / off; trace: the timer-stamp build (KVATTN_DECODE_TRACE,
    scripts/trace_decode.py); fused_merge_batch: the fused merge's states a lane loads together (1 or 4).
    head_dim_vo: V / O's head dim where it differs from head_dim (Q / K's): compile tests only, no op runs it.
    slim: 8-row Q slots and a 4-phase merge (KVATTN_DECODE_SLIM; groups of at most 8, see slim_fits): its default
    stages are 3."""
    kv_dtype = kv_dtype or dtype
    stages = stages or default_stages(head_dim, kv_dtype, wtok, head_dim_vo, slim)
    args = f"{attn_types(head_dim, dtype, kv_dtype, head_dim_vo)}, {mt}, {stages}, {variant.decode_type()}"
    traits = f"kvattn::DecodeKernel<{args}>"
    defines = (("KVATTN_L2_PREFETCH", int(l2_prefetch)), ("KVATTN_REFILL_FIRST", int(refill_first)))
    if wtok and wtok != warp_tokens(head_dim, kv_dtype, head_dim_vo=head_dim_vo):
        defines += (("KVATTN_DECODE_WTOK", int(wtok)),)
    if variant.rope:
        defines += tuple((k, int(v)) for k, v in rope_defines)
    if ids_ahead is not None:
        defines += (("KVATTN_DECODE_IDS_AHEAD", int(ids_ahead)),)
    if trace:
        defines += (("KVATTN_DECODE_TRACE", 1),)
    if fused_merge_batch != 1:
        defines += (("KVATTN_FUSED_MERGE_BATCH", int(fused_merge_batch)),)
    if slim:
        defines += (("KVATTN_DECODE_SLIM", 1),)
    smem = smem_bytes(head_dim, mt, stages, kv_dtype, wtok, head_dim_vo, slim)
    return KernelSpec("decode.cuh", f"kvattn::decode_kernel<{args}>", defines=defines, prelude=variant.prelude(),
                      checks=((f"{traits}::SMEM_BYTES", smem), (f"{traits}::THREADS", THREADS)))


def slim_fits(head_dim: int, group: int, kv_dtype: str, wtok: int | None = None) -> bool:
    """Whether the slim kernel (KVATTN_DECODE_SLIM) serves this shape: head dim 256 with a 16-bit cache at 8-token
    warp tiles (its default) and at most 8 query heads a KV head (one Q slot row each)."""
    return (head_dim == 256 and not _dtypes.is_fp8(kv_dtype) and group <= 8
            and warp_tokens(head_dim, kv_dtype, wtok) == 8)


def smem_bytes(head_dim: int, mt: int, stages: int | None = None, kv_dtype: str | None = None,
               wtok: int | None = None, head_dim_vo: int | None = None, slim: bool = False) -> int:
    """Dynamic shared memory of decode_kernel (mirrors DecodeKernel::SMEM_BYTES; a static_assert checks it).
    head_dim: Q / K's; head_dim_vo: V / O's (None: head_dim)."""
    dvo = head_dim_vo or head_dim
    fp8 = _dtypes.is_fp8(kv_dtype)
    tile = 4 * warp_tokens(head_dim, kv_dtype, wtok, head_dim_vo)   # tokens per stage
    stages = stages or default_stages(head_dim, kv_dtype, wtok, head_dim_vo, slim)
    rows = 16 * mt
    merge_ml = 2 * 4 * 16 * 4                      # WarpMerge's m and l
    if fp8:   # K, V fp8 tiles; Q slots; their row scales; m / l apart
        return stages * (tile * (head_dim + dvo) + rows * head_dim * 2) + stages * rows * 4 + merge_ml
    if tile == 4 * 8:   # 8-token warp tiles: the merge in phases of dvo / phases columns, m / l apart
        phases, q_rows = (4, 8) if slim else (2, rows)   # slim: 4 phases, 8-row Q slots
        stage = max(4 * 16 * (dvo // phases + 4) * 4, tile * (head_dim + dvo) * 2)
        return stages * (stage + q_rows * head_dim * 2) + merge_ml
    stage = max(4 * 16 * (dvo + 4) * 4 + merge_ml, tile * (head_dim + dvo) * 2)   # the merge's scratch, or K + V
    return stages * (stage + rows * head_dim * 2)


register("decode", [decode_spec(d, 1, Variant(), t, kv_dtype=kv) for d in HEAD_DIMS for t in DTYPES
                    for kv in (t, *_dtypes.FP8)]
         + [decode_spec(128, 1, Variant(soft_cap=True, window=True), "bfloat16")]
         # the instances of plans that fuse the split-KV merge (small batches: tuning fused_merge_batch)
         + [decode_spec(d, 1, Variant(), t, kv_dtype=kv, fused_merge_batch=FUSED_MERGE_BATCH) for d in HEAD_DIMS
            for t in DTYPES for kv in (t, *_dtypes.FP8)])


def decode_params(plan: int, layout, tmp_o: int, tmp_lse: int, page_indptr: int, page_indices: int,
                  last_page_len: int, *, hq, group, page_size, window_left, z_split, scale, cap, variant_ptr,
                  counters=0, merge_of_req=0) -> ParamBuffer:
    """The decode kernel's parameters for a plan buffer at device address `plan` (its scheduler layout `layout`)
    and the page table at the given addresses (array pointers and strides are bound by run()). counters: the
    fused merge's arrivals (0: the partial states go to a merge kernel, or are the caller's, as cascade's)."""
    p = ParamBuffer(DECODE_PARAMS)
    p.set(tmp_o=tmp_o, tmp_lse=tmp_lse, plan=plan, page_indptr=page_indptr, page_indices=page_indices,
          last_page_len=last_page_len, off_chunk_indptr=layout.chunk_indptr, off_work_req=layout.work_req,
          off_work_begin=layout.work_begin, off_work_end=layout.work_end, off_work_partial=layout.work_partial,
          num_qo_heads=hq, group_size=group, page_size=page_size, page_shift=page_size_shift(page_size),
          window_left=window_left, z_split=z_split,
          score_scale=(scale / cap) if cap > 0 else scale * LOG2E, cap_log2=cap * LOG2E,
          variant_data=variant_ptr, k_scale=1.0, v_scale=1.0, counters=counters, merge_of_req=merge_of_req,
          off_merge_indptr=layout.merge_indptr, off_merge_req=layout.merge_req)
    return p


class BatchDecodeWithPagedKVCache(AttentionOp):
    """Decode (one query token per request) against a paged KV cache. See the module docstring.

    kv_layout: "NHD" (caches [pages, page_size, Hkv, D]) or "HND" ([pages, Hkv, page_size, D]).
    use_cuda_graph: fix every buffer and the grid at construction from max_batch_size / max_num_pages, so
    one captured run() replays correctly after any later plan() within those bounds.
    device: the GPU (an ordinal or a kvattn Device; None: the current context's device at the first plan());
    plan() and run() run in its context and leave the caller's current context as it was.
    deterministic: batch-invariant results. Every request is split at fixed multiples of
    DETERMINISTIC_SPLIT_TOKENS of its own tokens, so a request's output and LSE bits do not depend on the other
    requests of the batch, the batch size or the GPU's SM count (graph mode included).
    """

    DEFAULT_WORKSPACE = DEFAULT_WORKSPACE

    def __init__(self, kv_layout="NHD", use_cuda_graph=False, max_batch_size=None, max_num_pages=None,
                 workspace_bytes=None, num_sms=None, tuning=None, device=None, deterministic=False):
        super().__init__(kv_layout, use_cuda_graph, dict(max_batch_size=max_batch_size, max_num_pages=max_num_pages),
                         ("max_batch_size", "max_num_pages"), workspace_bytes, num_sms, device)
        unknown = set(tuning or {}) - set(DEFAULT_TUNING)
        if unknown:
            raise ValueError(f"tuning: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_TUNING)}")
        self.tuning = {**DEFAULT_TUNING, **(tuning or {})}
        self.deterministic = bool(deterministic)
        self._route = None      # (sm90_route) the prefill wrapper the last plan() handed the batch to
        self._route_op = None   # that wrapper, kept for later plans (its workspace and staging buffers)

    # -- plan ------------------------------------------------------------------------------------
    @on_device
    def plan(self, page_table: PageTable, num_qo_heads, num_kv_heads, head_dim, *, q_dtype="bfloat16",
             kv_dtype=None, sm_scale=None, window_left=-1, logits_soft_cap=0.0, alibi_slopes=None, sinks=None,
             rope=None, rope_offsets=None, variant=None, variant_params=None, stream=None):
        """Schedule the batch described by page_table (its host arrays are read now, not at run()).

        alibi_slopes: float [num_qo_heads] (ALiBi: s += slope[h] * (j - (kv_len - 1)), natural-log units).
        sinks: float [num_qo_heads] (attention sinks: one logit per head in the softmax's denominator, in the
        units of the scaled scores, as GPT-OSS). rope: kvattn.RoPE(theta, scale, interleave) rotates q (at
        kv_len - 1 + offset) and k (at j + offset) inside the kernel; rope_offsets: int [batch] or None (0).
        variant: a user variant (kvattn.Variant.from_cuda), with its declared parameters in variant_params
        ({name: value}); the keyword shortcuts window_left / logits_soft_cap / alibi_slopes / sinks / rope select
        the built-ins. Slopes, sinks, RoPE's numbers and variant parameters are data of the plan: in graph mode a
        later plan() may change their values.

        The work lists reach the device by one async copy on `stream`. run() on another stream waits for that
        copy; but the next plan() rewrites the same device region, so runs on other streams must be done first.
        """
        if not isinstance(page_table, PageTable):
            raise TypeError(f"page_table: expected a kvattn.PageTable, got {type(page_table).__name__}")
        num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, window_left, logits_soft_cap = check_plan_args(
            num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, window_left, logits_soft_cap, fp8_kv=True)
        if rope is not None and _dtypes.is_fp8(kv_dtype):
            raise ValueError(f"rope: fused RoPE rotates the cache's keys in 16 bits; with kv_dtype {kv_dtype} store "
                             f"rotated keys (apply RoPE before quantising) and pass rope=None")
        batch = page_table.batch_size
        nnz = int(page_table.indptr[-1])
        kv_lens = page_table.kv_lens
        if self.use_cuda_graph:
            if batch > self.max_batch_size:
                raise ValueError(f"page_table: batch size {batch} exceeds max_batch_size {self.max_batch_size}")
            if nnz > self.max_num_pages:
                raise ValueError(f"page_table: {nnz} pages exceed max_num_pages {self.max_num_pages}")
        variant, vvals = plan_variant(variant, num_qo_heads, batch, logits_soft_cap > 0, window_left >= 0, False,
                                      alibi_slopes, sinks, variant_params, rope, rope_offsets,
                                      int(kv_lens.max(initial=0)))
        self._route = self._sm90_route(page_table, num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale,
                                       window_left, logits_soft_cap, variant, stream)
        if self._route is not None:
            self._plan = self._route.last_plan   # (its info: the prefill plan's; backend "sm90")
            return
        self._bake(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype,
                   kv_dtype=kv_dtype,
                   page_size=page_table.page_size, sm_scale=sm_scale, window_left=window_left,
                   logits_soft_cap=logits_soft_cap, variant=variant)
        num_sms = self.num_sms
        group = num_qo_heads // num_kv_heads
        tn = self.tuning
        mt = tn["m_tiles"] or auto_m_tiles(group, head_dim, kv_dtype, variant)   # larger groups: sliced over CTAs
        zsplit = -(-group // (16 * mt))
        fits = mt == 1 and slim_fits(head_dim, group, kv_dtype, tn["wtok"])
        if tn["slim"] and not fits:
            raise ValueError(f"tuning slim: the slim kernel takes a 16-bit cache at 8-token warp tiles and groups of "
                             f"at most 8 (head_dim {head_dim}, group {group}, kv_dtype {kv_dtype})")
        slim = fits and (SLIM if tn["slim"] is None else tn["slim"])
        stages = tn["stages"] or default_stages(head_dim, kv_dtype, tn["wtok"], slim=slim)
        smem = smem_bytes(head_dim, mt, stages, kv_dtype, tn["wtok"], slim=slim)
        def kernel_for(merge_batch):
            return get_kernel(decode_spec(head_dim, mt, variant, q_dtype, stages, tn["l2_prefetch"],
                                          tn["refill_first"], kv_dtype, tn["wtok"], rope_defines=tn["rope_defines"],
                                          ids_ahead=tn["ids_ahead"], trace=tn["trace"], fused_merge_batch=merge_batch,
                                          slim=slim))
        kernel = kernel_for(tn["fused_merge_batch"] or 1)
        # at most 3 (measured: BENCHMARKS.md); from the kernel's registers and static shared memory as compiled
        ctas_per_sm = tn["ctas_per_sm"] or (kernel.resources or Resources()).ctas_per_sm(THREADS, smem, limit=3)

        # Host buffers: plan region then page table (indptr, indices, last_page_len), one copy.
        split = DETERMINISTIC_SPLIT_TOKENS if self.deterministic else None
        if self.use_cuda_graph:
            max_work = (scheduler.fixed_split_items(self.max_num_pages * page_table.page_size, self.max_batch_size,
                                                    split) if split else None)
            layout = scheduler.graph_layout(self.max_batch_size, num_kv_heads * zsplit, num_sms=num_sms,
                                            ctas_per_sm=ctas_per_sm, max_work=max_work)
            cap_b, cap_p = self.max_batch_size, self.max_num_pages
        else:
            layout = max_work = None
            cap_b, cap_p = batch, nnz
        plan_cap = layout.size if layout else scheduler.plan_size_bound(
            batch, num_kv_heads * zsplit, num_sms=num_sms, ctas_per_sm=ctas_per_sm,
            max_work=scheduler.fixed_split_items(int(kv_lens.sum()), batch, split) if split else 0)
        off_indptr = align4(plan_cap)
        off_indices = off_indptr + align4(cap_b + 1)
        off_last = off_indices + align4(max(cap_p, 1))
        off_merge_of = off_last + align4(max(cap_b, 1))      # fused merge: request -> merge index
        off_counters = off_merge_of + align4(max(cap_b, 1))  # fused merge: arrivals [merges <= cap_b, Hkv, z_split]
        off_variant = off_counters + align4(max(cap_b * num_kv_heads * zsplit, 1))   # the variant's data (float32)
        vdata = variant.data(num_qo_heads, batch, cap_b, **vvals)
        total_i32 = off_variant + (align4(vdata.size) if vdata is not None else 0)
        host_bytes = self._stage(total_i32 * 4)
        host = host_bytes.view(np.int32)
        plan = scheduler.plan_decode(
            kv_lens, page_table.page_size, num_kv_heads * zsplit, num_kv_heads * zsplit, head_dim, num_sms=num_sms,
            ctas_per_sm=ctas_per_sm, max_batch_size=self.max_batch_size if self.use_cuda_graph else None,
            max_chunks=layout.max_chunks if layout else None, out=host[:plan_cap],
            allow_no_split=tn["allow_no_split"], split_tokens=split, max_work=max_work,
            min_chunk_tokens=(auto_min_chunk_tokens(kv_lens) if tn["min_chunk_tokens"] == "auto"
                              else tn["min_chunk_tokens"]),
            item_overhead=item_overhead_tokens(kv_dtype) if tn["item_overhead"] is None else tn["item_overhead"])
        host[off_indptr:off_indptr + batch + 1] = page_table.indptr
        host[off_indices:off_indices + nnz] = page_table.indices
        host[off_last:off_last + batch] = page_table.last_page_len
        fused = tn["fused_merge"]
        if fused is None:   # (graph mode: the grid is the layout's, so the choice holds for every later plan;
            # deterministic mode: one merge for every batch, since the two merges' bits differ)
            # a CUDA-graph wrapper: the merge kernel (its launch costs nothing in a replay, and the fused merge
            # took longer on the GPU: b1_L2048 14.7 against 10.3 us per replayed step, session 9)
            fused = (not self.deterministic and not self.use_cuda_graph
                     and plan.num_chunks * zsplit * num_kv_heads < num_sms)
        if fused and tn["fused_merge_batch"] is None:
            kernel = kernel_for(FUSED_MERGE_BATCH)
        if fused:   # zeros: the counters' state between launches (each launch leaves them at 0)
            host[off_merge_of:off_variant] = 0
            host[off_merge_of:off_merge_of + cap_b] = -1
            host[off_merge_of + plan.merge_req] = np.arange(plan.num_merge, dtype=np.int32)
        if vdata is not None:
            host[off_variant:off_variant + vdata.size] = vdata.view(np.int32)

        max_partial = (layout.max_work if layout else max(plan.num_partial_rows, 1))
        regions = {
            "plan": ((total_i32,), "int32"),
            "tmp_o": ((max_partial, num_qo_heads, head_dim), "float32"),
            "tmp_lse": ((max_partial, num_qo_heads), "float32"),
        }
        dev, s, copy_done = self._upload(host_bytes, [("plan", 0, total_i32 * 4)], regions, stream)

        base = dev["plan"].ptr
        L = plan.layout
        page_size = page_table.page_size
        scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
        variant_ptr = base + off_variant * 4 if vdata is not None else 0
        p = decode_params(base, L, dev["tmp_o"].ptr, dev["tmp_lse"].ptr, base + off_indptr * 4,
                          base + off_indices * 4, base + off_last * 4, hq=num_qo_heads, group=group,
                          page_size=page_size, window_left=window_left, z_split=zsplit, scale=scale,
                          cap=logits_soft_cap, variant_ptr=variant_ptr,
                          counters=base + off_counters * 4 if fused else 0, merge_of_req=base + off_merge_of * 4)
        merge_rows = 0 if fused else L.max_merge if self.use_cuda_graph else plan.num_merge
        merge, mp = self._merge_launch(merge_rows, dev["tmp_o"], dev["tmp_lse"], base, L.merge_indptr, L.merge_req,
                                       num_qo_heads, head_dim, q_dtype, variant, variant_ptr,
                                       None if self.use_cuda_graph else plan.merge_indptr,
                                       self.deterministic or tn["merge_lanes"] == 1, tn["merge_programmatic"])
        grid = (plan.num_chunks * zsplit, num_kv_heads, 1)
        kv = PagedKV(self.kv_layout, page_size, num_kv_heads, head_dim, _dtypes.to_numpy(kv_dtype),
                     int(page_table.indices.max(initial=-1)) + 1)
        return self._finish_plan(
            rows=batch, max_rows=self.max_batch_size if self.use_cuda_graph else batch, hq=num_qo_heads,
            d=head_dim, dtype=q_dtype, kv=kv, launch=Launch(kernel, grid, THREADS, smem, p), params=p, merge=merge,
            merge_params=mp, s=s, copy_done=copy_done,
            schedule=plan, kernel=kernel, grid=grid, smem=smem, num_kv_heads=num_kv_heads)

    @property
    def sm90_routed(self) -> bool:
        """Whether the last plan() handed the batch to the sm90 prefill kernel (tuning sm90_route)."""
        return self._route is not None

    def _sm90_route(self, page_table, hq, hkv, head_dim, q_dtype, kv_dtype, sm_scale, window_left, cap, variant,
                    stream):
        """(sm90_route) The paged prefill wrapper planned for this batch, one query token a request; or None."""
        from . import prefill
        waves = as_int(self.tuning["sm90_route_waves"], "tuning sm90_route_waves", min_value=1)
        on = self.tuning["sm90_route"]
        if on is None:
            on = (large_plain_group(hq // hkv, head_dim, kv_dtype, variant)
                  and not self.use_cuda_graph and not self.deterministic
                  and prefill.sm90_usable("auto", head_dim, variant, q_dtype, kv_dtype))
        elif on and (self.use_cuda_graph or self.deterministic):
            raise ValueError("tuning sm90_route=True: not in graph or deterministic mode (the decode kernel's)")
        if not on:
            return None
        if self._route_op is None:
            self._route_op = prefill.BatchPrefillWithPagedKVCache(kv_layout=self.kv_layout, backend="sm90",
                                                                  num_sms=self._num_sms, device=self._device_arg)
        w = self._route_op
        w.split_waves = waves
        w.wg_split = bool(self.tuning["sm90_route_wg_split"]) and hq // hkv <= prefill.WG_ROWS
        w.fused_merge = bool(self.tuning["sm90_route_fused_merge"])
        w.plan(np.arange(page_table.batch_size + 1, dtype=np.int32), page_table, hq, hkv, head_dim, q_dtype=q_dtype,
               kv_dtype=kv_dtype, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=cap, cta_rows=128,
               stream=stream)
        return w

    # -- run -------------------------------------------------------------------------------------
    @on_device
    def run(self, q, k_cache, v_cache=None, out=None, lse=None, return_lse=False, stream=None, k_scale=None,
            v_scale=None):
        """Attention of each request's query against its pages.

        q: [batch, num_qo_heads, head_dim]; k_cache / v_cache: [pages, page_size, Hkv, D] ("NHD") or
        [pages, Hkv, page_size, D] ("HND"), or k_cache [pages, 2, ...] with v_cache None; of the plan's kv_dtype
        (an fp8 cache may also be given as uint8 bytes).
        k_scale / v_scale (fp8 cache): the cache holds k / k_scale and v / v_scale: None (1), a positive float
        (per tensor) or an array [num_kv_heads] float32 (per KV head). In graph mode a float is captured with the
        graph; a device array's values may change between replays.
        out: [batch, num_qo_heads, head_dim] (q's dtype); lse: [batch, num_qo_heads] float32 natural log.
        Graph mode: q / out / lse may keep max_batch_size rows (rows past the batch are not touched).
        stream: None (the legacy default stream, as in PyTorch and CuPy) or any stream kvattn.stream accepts.
        Returns out, or (out, lse) with return_lse: the caller's arrays as given, or new kvattn arrays from the
        stream-ordered pool (readable at once by torch.from_dlpack / cupy.asarray, which order after the run).
        Capturable when out (and lse) are given.
        """
        if self._route is not None:
            return self._route.run(q, k_cache, v_cache, out=out, lse=lse, return_lse=return_lse, stream=stream,
                                   k_scale=k_scale, v_scale=v_scale)
        p, s, capturing = self._begin_run(stream)
        q = import_array(q, s, capturing)
        k, v, kv_strides = p.kv.bind(k_cache, v_cache, s, capturing)
        return self._execute(p, s, capturing, q, k, v, kv_strides, out, lse, return_lse, k_scale, v_scale)



def single_decode(q, k, v, *, kv_layout="NHD", sm_scale=None, window_left=-1, logits_soft_cap=0.0,
                  return_lse=False, stream=None):
    """One request with contiguous K/V. q: [Hq, D]; k, v: [kv_len, Hkv, D] ("NHD") or [Hkv, kv_len, D] ("HND").

    The contiguous K/V is one page of kv_len tokens. Returns o [Hq, D] (and lse [Hq]) as DeviceArrays.
    """
    s = as_stream(stream)
    q, k, v = asarray(q, s), asarray(k, s), asarray(v, s)
    if q.ndim != 2 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v: expected [Hq, D], [kv, Hkv, D], [kv, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}")
    kv_len, hkv = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    pt = PageTable(np.array([0, 1 if kv_len else 0], np.int32), np.zeros(1 if kv_len else 0, np.int32),
                   np.array([kv_len if kv_len else 1], np.int32), max(kv_len, 1))
    w = BatchDecodeWithPagedKVCache(kv_layout=kv_layout)
    w.plan(pt, q.shape[0], hkv, q.shape[1], q_dtype=q.dtype_name, sm_scale=sm_scale, window_left=window_left,
           logits_soft_cap=logits_soft_cap, stream=s)
    r = w.run(q.reshape(1, *q.shape), k.reshape(1, *k.shape), v.reshape(1, *v.shape), return_lse=return_lse, stream=s)
    if return_lse:
        return r[0].reshape(q.shape), r[1].reshape(q.shape[0])
    return r.reshape(q.shape)
