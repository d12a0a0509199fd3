"""Batch prefill / append on a paged or ragged KV cache: plan() on the host, run() only launches (capturable).

    w = kvattn.BatchPrefillWithPagedKVCache(kv_layout="NHD")
    w.plan(qo_indptr, page_table, num_qo_heads=32, num_kv_heads=8, head_dim=128, causal=True)
    o = w.run(q, k_cache, v_cache)       # q [qo_indptr[-1], Hq, D]; caches [pages, page_size, Hkv, D] (NHD)

    r = kvattn.BatchPrefillWithRaggedKVCache()
    r.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True)
    o = r.run(q, k, v)                   # k, v [kv_indptr[-1], Hkv, D] (NHD) or [Hkv, kv_indptr[-1], D] (HND)

plan() picks the query tile from the packed query length (qo_len * group), schedules with
kvattn.scheduler.plan_prefill (KV split when the query tiles do not fill the GPU), packs the work list, the
lengths, the page table and the custom mask into one pinned host buffer and issues one host-to-device copy
into a fixed workspace region. run() launches the prefill kernel and, when the plan split some KV range, the
indexed merge kernel over the float32 partial states (deterministic: fixed order, no atomics).

Two kernels share the plan, the variants and the epilogue: backend "sm80" (prefill.cuh: mma.sync, 16/64/128-row
query tiles, any head_dim) and backend "sm90" (prefill_sm90.cuh: Hopper wgmma, warp-specialised, 128-row tiles,
head_dim 64/128). backend="auto" (the default) takes sm90 where it applies on an sm_90 GPU.

A ragged KV is the paged kernel with one "page" per request: page id = the request's first token, page size
2^30, page stride = token stride. Graph mode (use_cuda_graph=True) fixes every buffer, the query tile and the
grid from max_batch_size / max_total_qo / max_num_pages, so one captured run() serves any later plan() within
those bounds (same heads, head_dim, dtype, variant, causal flag, sm_scale, window and arrays).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _driver, _dtypes, _validate as _v, fp8_expand, scheduler, tma
from ._attn_args import check_plan_args
from ._binding import import_array
from .compiler import Resources
from .contract import HEADER_INT32, align4, page_size_shift, write_header
from .decode import LOG2E, THREADS
from .formats import PageTable, pack_mask
from .kernels import KernelSpec, Launch, ParamBuffer, attn_types, get_kernel, register
from .memory import asarray
from .opcore import AttentionOp, PagedKV, RaggedKV, on_device
from .stream import as_stream
from .variants import Variant, plan_variant

_PREFILL_SCALARS = np.dtype([
    ("q", "u8"), ("k", "u8"), ("v", "u8"), ("o", "u8"), ("lse", "u8"), ("tmp_o", "u8"), ("tmp_lse", "u8"),
    ("plan", "u8"), ("mask", "u8"),
    ("q_stride_n", "i8"), ("q_stride_h", "i8"), ("o_stride_n", "i8"), ("o_stride_h", "i8"), ("lse_stride_n", "i8"),
    ("kv_stride_page", "i8"), ("kv_stride_token", "i8"), ("kv_stride_head", "i8"),
    ("off_qo_indptr", "i4"), ("off_kv_len", "i4"), ("off_page_indptr", "i4"), ("off_page_indices", "i4"),
    ("off_mask_indptr", "i4"), ("off_items", "i4"),
    ("num_qo_heads", "i4"), ("group_size", "i4"), ("page_size", "i4"), ("page_shift", "i4"), ("causal", "i4"),
    ("window_left", "i4"),
    ("score_scale", "f4"), ("cap_log2", "f4"), ("variant_data", "u8"),
    ("k_scale_ptr", "u8"), ("v_scale_ptr", "u8"), ("k_scale", "f4"), ("v_scale", "f4"),
    ("tma_mode", "i4"), ("tma_rows", "i4"), ("tma_hnd", "i4"), ("tma_q", "i4"), ("tma_o", "i4"),
    ("off_counters", "i4"), ("group_mul", "u4"), ("group_shr", "i4"),
], align=True)
_TMA_OFFSET = -(-_PREFILL_SCALARS.itemsize // 64) * 64   # the tensor maps are 64-byte aligned (alignas(64) in C)
PREFILL_PARAMS = np.dtype({
    "names": list(_PREFILL_SCALARS.names) + ["tma_k", "tma_v", "tma_qmap", "tma_omap"],
    "formats": [_PREFILL_SCALARS.fields[n][0] for n in _PREFILL_SCALARS.names] + ["V128"] * 4,
    "offsets": [_PREFILL_SCALARS.fields[n][1] for n in _PREFILL_SCALARS.names] + [_TMA_OFFSET + 128 * i
                                                                                   for i in range(4)],
    "itemsize": _TMA_OFFSET + 512})

DEFAULT_WORKSPACE = 256 << 20
RAGGED_PAGE_SHIFT = 30
#: query tile (packed rows per CTA) -> (WARPS_M, MT) of prefill_kernel
CONFIGS = {128: (4, 2), 64: (4, 1), 16: (1, 1)}


def group_magic(group: int) -> tuple[int, int]:
    """(mul, shift) with x // group == (x * mul) >> shift for every 0 <= x < 2**31 (the kernels' row_token with
    KVATTN_GROUP_MAGIC): shift = 31 + ceil(log2 group), mul = ceil(2**shift / group) < 2**32; exact because
    mul * group - 2**shift < group <= 2**(shift - 31)."""
    shift = 31 + (group - 1).bit_length()
    mul = -(-(1 << shift) // group)
    assert mul < 1 << 32
    return mul, shift


def choose_cta_rows(packed_len: float, head_dim: int, wgmma: bool = False) -> int:
    """Query tile from the (average) packed query length qo_len * group; head_dim 256 takes the 128-row tile
    only on the wgmma kernel (wgmma: it will run, see sm90_usable), whose registers hold it."""
    if packed_len <= 16:
        return 16
    if packed_len <= 64 or (head_dim == 256 and not wgmma):
        return 64
    return 128


#: query tile -> KernelSpec defines (tuning knobs of prefill.cuh: KVATTN_PF_SUBN2, KVATTN_PF_KK_UNROLL,
#: KVATTN_PF_QREGS); empty = the header's defaults. scripts/bench_prefill.py --sweep overrides it.
TUNING: dict = {}
#: KernelSpec defines of the sm90 kernel (timing experiments of scripts/ab_sm90.py); empty = the defaults.
SM90_TUNING: tuple = ()
#: The define that builds the persistent sm90 instance (sm90_persistent decides where).
SM90_PERSIST_DEFINE = ("KVATTN_SM90_PERSIST", 1)
#: The define of the sm90 instance with interleaved K / V tiles (paged tensor maps: kvattn.tma.interleaved_tiles).
SM90_KVIL_DEFINE = ("KVATTN_SM90_KVIL", 1)
#: The define of the sm90 instance whose two consumer warpgroups split each unit's KV tiles (wg_split).
SM90_WGSPLIT_DEFINE = ("KVATTN_SM90_WGSPLIT", 1)
#: The define of the sm90 instance whose consumer warps merge a split block's chunks themselves (fused_merge).
SM90_FMERGE_DEFINE = ("KVATTN_SM90_FMERGE", 1)
#: A plan merges its split blocks inside the sm90 kernel (fused_merge) only where no block has more chunks than
#: this (PrefillSm90::FMERGE_MAX: the merge's loads of up to that many states are issued together).
FUSED_MERGE_MAX_CHUNKS = 8
#: Query rows of one consumer warpgroup: a plan's wg_split needs every unit to fit in them.
WG_ROWS = 64
#: Bytes after a custom mask the kernels may read (the sm90 kernel loads each row's bits of a tile as aligned 32-bit
#: words, up to 20 bytes past the last mask byte; the bits read there belong to no kept pair).
MASK_PAD = 32


def prefill_spec(head_dim: int, cta_rows: int, variant: Variant, dtype: str, kv_dtype: str | None = None,
                 head_dim_vo: int | None = None) -> KernelSpec:
    """The mma.sync kernel (backend "sm80") of prefill.cuh. head_dim_vo: V / O's head dim where it differs from
    head_dim (Q / K's): compile tests only, no op runs it."""
    wm, mt = CONFIGS[cta_rows]
    args = f"{attn_types(head_dim, dtype, kv_dtype, head_dim_vo)}, {wm}, {mt}, {variant.prefill_type()}"
    traits = f"kvattn::PrefillKernel<{args}>"
    return KernelSpec("prefill.cuh", f"kvattn::prefill_kernel<{args}>", defines=tuple(TUNING.get(cta_rows, ())),
                      prelude=variant.prelude(),
                      checks=((f"{traits}::SMEM_BYTES", smem_bytes(head_dim, cta_rows, kv_dtype, head_dim_vo)),
                              (f"{traits}::THREADS", THREADS), (f"{traits}::ROWS", cta_rows)))


def sm90_spec(head_dim: int, variant: Variant, dtype: str, kv_dtype: str | None = None,
              persistent: bool | None = None, head_dim_vo: int | None = None,
              interleaved: bool = False, wg_split: bool = False, fused_merge: bool = False,
              long_tiles: bool = False) -> KernelSpec:
    """The wgmma kernel (backend "sm90") of prefill_sm90.cuh: 128-row query tiles, head_dim 64, 128 or 256;
    persistent (None: sm90_persistent's choice) builds the persistent instance. head_dim_vo: as prefill_spec's.
    interleaved: the instance for paged tensor maps (kvattn.tma.interleaved_tiles: K / V tiles in 8-row groups of
    every 64-column block, one box a page); a KVATTN_SM90_KVIL in SM90_TUNING overrides it (the A/B).
    wg_split: the instance for units of at most WG_ROWS rows whose two consumer warpgroups split the KV tiles
    (PrefillSm90::consume_split), head_dim up to 128. fused_merge: the instance whose consumer warps merge a split
    block's chunks (PrefillSm90::merge_if_last; plain variants, head_dim up to 128, not with wg_split).
    long_tiles: KV tiles of SM90_LONG_TILE tokens (sm90_long_tiles says where) unless SM90_TUNING sets the tile."""
    args = f"{attn_types(head_dim, dtype, kv_dtype, head_dim_vo)}, {variant.prefill_type()}"
    traits = f"kvattn::PrefillSm90<{args}>"
    if persistent is None:
        persistent = sm90_persistent(head_dim, variant, kv_dtype)
    tuning = dict(SM90_TUNING)
    kvil = tuning.pop("KVATTN_SM90_KVIL", int(interleaved))
    if long_tiles and "KVATTN_SM90_N" not in tuning:
        tuning["KVATTN_SM90_N"] = SM90_LONG_TILE
    defines = (tuple(tuning.items()) + ((SM90_KVIL_DEFINE,) if kvil else ())
               + ((SM90_PERSIST_DEFINE,) if persistent else ())
               + ((SM90_WGSPLIT_DEFINE,) if wg_split else ())
               + ((SM90_FMERGE_DEFINE,) if fused_merge else ()))
    return KernelSpec("prefill_sm90.cuh", f"kvattn::prefill_sm90_kernel<{args}>", defines=defines,
                      prelude=variant.prelude(),
                      checks=((f"{traits}::SMEM_BYTES", sm90_smem_bytes(head_dim, head_dim_vo, defines)),
                              (f"{traits}::THREADS", sm90_threads(defines)), (f"{traits}::ROWS", sm90_rows(defines)))
                      + (((f"{traits}::FMERGE_MAX", FUSED_MERGE_MAX_CHUNKS),) if fused_merge else ()))


def sm90_q_box_rows(spec: KernelSpec) -> int:
    """Packed rows of one TMA box of q in this sm90 instance (PrefillSm90::Q_BOX): a consumer warpgroup's 64 in the
    KVATTN_SM90_QHALF builds (scripts/ab_sm90.py --qhalf), else the tile's (sm90_rows)."""
    return WG_ROWS if dict(spec.defines).get("KVATTN_SM90_QHALF", 0) else sm90_rows(spec.defines)


def sm90_consumers(defines=None) -> int:
    """Consumer warpgroups of an sm90 instance (PrefillSm90::CONSUMERS): 3 in the KVATTN_SM90_WG3 builds (the
    experiment of scripts/ab_sm90.py --wg3), else 2. defines: the instance's (None: SM90_TUNING)."""
    return 3 if dict(SM90_TUNING if defines is None else defines).get("KVATTN_SM90_WG3", 0) else 2


def sm90_rows(defines=None) -> int:
    """Packed query rows of an sm90 CTA (PrefillSm90::ROWS): 64 a consumer warpgroup."""
    return WG_ROWS * sm90_consumers(defines)


def sm90_threads(defines=None) -> int:
    """Threads of an sm90 CTA (PrefillSm90::THREADS): the producer warpgroup and the consumers."""
    return 128 * (1 + sm90_consumers(defines))


def sm90_interleaved(spec: KernelSpec) -> bool:
    """Whether this sm90 instance lays its K / V tiles out interleaved (KVATTN_SM90_KVIL: paged tensor maps only)."""
    return SM90_KVIL_DEFINE in spec.defines


def stages(head_dim: int, cta_rows: int, head_dim_vo: int | None = None) -> int:
    return 3 if CONFIGS[cta_rows][0] == 1 and head_dim + (head_dim_vo or head_dim) <= 256 else 2


def smem_bytes(head_dim: int, cta_rows: int, kv_dtype: str | None = None, head_dim_vo: int | None = None) -> int:
    """Dynamic shared memory of prefill_kernel (mirrors PrefillKernel::SMEM_BYTES, a static_assert checks it): Q,
    the K/V stages (fp8: one 16-bit K/V tile and the fp8 stages), the offset slots. head_dim: Q / K's;
    head_dim_vo: V / O's (None: head_dim)."""
    st = stages(head_dim, cta_rows, head_dim_vo)
    row = head_dim + (head_dim_vo or head_dim)   # a K row and a V row, in elements
    if _dtypes.is_fp8(kv_dtype):
        kv = 64 * row * 2 + st * 64 * row
    else:
        kv = st * 64 * row * 2
    return cta_rows * head_dim * 2 + kv + 2 * 64 * 8


def sm90_tile(head_dim: int, head_dim_vo: int | None = None, defines=None) -> tuple[int, int]:
    """(KV tokens per tile, ring stages) of prefill_sm90_kernel (mirrors PrefillSm90::N / STAGES, including the
    KVATTN_SM90_N / _STAGES overrides of an instance's defines, by default SM90_TUNING's)."""
    over = dict(SM90_TUNING if defines is None else defines)
    big = head_dim + (head_dim_vo or head_dim) > 256   # head_dim 256: 80-token tiles in 2 stages
    return (over.get("KVATTN_SM90_N", 80 if big else 128), over.get("KVATTN_SM90_STAGES", 2 if big else 3))


def sm90_smem_bytes(head_dim: int, head_dim_vo: int | None = None, defines=None) -> int:
    """Dynamic shared memory of prefill_sm90_kernel (mirrors PrefillSm90::SMEM_BYTES: Q, the ring of K and V
    tiles, a full and an empty mbarrier per stage, each Q tile's `qfree` mbarrier (3 more in the KVATTN_SM90_QHALF
    builds); KVATTN_SM90_QBUF Q tiles; V's own full and empty mbarriers per stage with 2 stages, or as
    KVATTN_SM90_KVSPLIT says; the WG3 builds' O buffer). defines: the instance's (None: SM90_TUNING)."""
    n, stages = sm90_tile(head_dim, head_dim_vo, defines)
    over = dict(SM90_TUNING if defines is None else defines)
    qbuf, split = over.get("KVATTN_SM90_QBUF", 1), over.get("KVATTN_SM90_KVSPLIT", stages < 3)
    bars = 2 * stages * (2 if split else 1) + qbuf + (3 if over.get("KVATTN_SM90_QHALF", 0) else 0)
    rows, dvo = sm90_rows(over), head_dim_vo or head_dim
    obuf = rows * dvo if sm90_consumers(over) == 3 and over.get("KVATTN_SM90_OBUF", 1) else 0   # (WG3's O buffer)
    return (qbuf * rows * head_dim + stages * n * (head_dim + dvo) + obuf) * 2 + bars * 8


#: Persistent sm90 CTAs (prefill_sm90.cuh: at most one CTA per SM, each walking its share of the (item, KV head)
#: units, the next unit's loads under the current one's last tile and epilogue) where they apply: 16-bit caches,
#: no fused RoPE, head_dim <= 128 (elsewhere the loop's state does not fit the warpgroups' registers). False: one
#: CTA per unit everywhere (the A/B of scripts/ab_sm90.py --persist).
SM90_PERSISTENT = True
#: The persistent walk's tail split (kvattn.scheduler._tail_split): where nothing else splits a plan and its last
#: round of units leaves CTAs idle, the walk's last blocks are cut into chunks (merged like any split) whose units
#: fill that round. Not in graph or deterministic mode, nor with wg_split; a wrapper's `tail_split` (this default)
#: turns it off for that wrapper. Run 48a (H100, ab_sm90.py --tail, BENCHMARKS.md session 36): non-causal b1_S8192
#: +1.8%, b2_S8192 +4.2%, b4_S4096 +3.6%, b32_S1024 +0.7%; causal anchor plans unchanged.
SM90_TAIL_SPLIT = True


def sm90_persistent(head_dim: int, variant: Variant, kv_dtype: str | None = None) -> bool:
    """Whether the sm90 instance of this head dim, variant and cache type is the persistent one."""
    return SM90_PERSISTENT and head_dim <= 128 and not variant.rope and not _dtypes.is_fp8(kv_dtype)


#: Head dim 64's longer KV tile (tokens) on contiguous ragged K / V (sm90_long_tiles; 0: never): its 32 KB stages
#: leave room for three of 192 tokens, and a tile's fixed costs (reductions, barriers, turns) weigh more against
#: products half as long as head dim 128's. Run 55a (H100, scripts/ab_sm90.py --tilen64, TFLOP/s): causal b1_S8192
#: 411 -> 429 (442 with 2 of 8 exp2s from the polynomial, head dim 64's default since), non-causal b1_S8192 427 ->
#: 447 (457), causal b8_S2048 327 -> 334 (336); non-causal b32_S1024 377 -> 335 (its 1024-token units end in a
#: 64-token tile), hence the model below.
SM90_LONG_TILE = 192
#: The model's cost of a long tile's column against a 128-token tile's (the b1_S8192 cases' gain), and the least
#: modelled gain that takes long tiles.
LONG_TILE_COST, LONG_TILE_MIN_GAIN = 0.955, 0.01


def sm90_long_tiles(head_dim: int, variant: Variant, kv_dtype: str | None, contiguous: bool, qo_lens, kv_lens,
                    causal: bool, group: int) -> bool:
    """Whether a plan's sm90 instance takes SM90_LONG_TILE-token KV tiles: head dim 64, the plain variant, a 16-bit
    contiguous ragged K / V (the measured instance: paged tiles of 192 spill), and fewer padded columns by the model:
    each unit (a request's 128 packed query rows) reads its KV span in whole tiles, long ones LONG_TILE_COST
    cheaper a column, taken where that gains LONG_TILE_MIN_GAIN. Non-causal spans are kv_len; causal ones kv_len -
    qo_len + the unit's last query token, a unit's tokens apart, so their padding averages (N - gcd(N, that
    step)) / 2. qo_lens, kv_lens: int [B]."""
    if not (SM90_LONG_TILE and head_dim == 64 and variant == Variant() and contiguous
            and not _dtypes.is_fp8(kv_dtype)):
        return False
    qo, kv = np.asarray(qo_lens, np.int64), np.asarray(kv_lens, np.int64)
    units = -(-qo * group // 128)
    if causal:
        step = 128 // group if 128 % group == 0 else 1   # query tokens a unit (1: units split a token's heads)
        span = kv - qo + (qo + step) / 2
        pad = {n: units.sum() * (n - math.gcd(n, step)) / 2 for n in (128, SM90_LONG_TILE)}
    else:
        span = kv
        pad = {n: float((units * (-kv % n)).sum()) for n in (128, SM90_LONG_TILE)}
    cols = float((units * span).sum())
    return cols > 0 and (cols + pad[SM90_LONG_TILE]) * LONG_TILE_COST <= (cols + pad[128]) * (1 - LONG_TILE_MIN_GAIN)


def launch_grid(cfg, items: int, num_kv_heads: int, num_sms: int) -> tuple[int, int, int]:
    """The grid of a prefill launch (LaunchConfig cfg) over `items` plan items (graph mode: their bound): one CTA
    per (item, KV head), or for a persistent sm90 instance min(items * num_kv_heads, num_sms) CTAs."""
    if not cfg.persistent:
        return (items, num_kv_heads, 1)
    return (min(items * num_kv_heads, num_sms), 1, 1)


BACKENDS = ("auto", "sm80", "sm90")
SM90_HEAD_DIMS = (64, 128, 256)
SM90_THREADS = 384   # a producer warpgroup and two consumer warpgroups (sm90_threads: the instance's)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The kernel a plan launches, with its block size, dynamic shared memory and CTAs per SM."""
    backend: str
    spec: KernelSpec
    threads: int
    smem: int
    ctas_per_sm: int

    @property
    def persistent(self) -> bool:
        """A persistent sm90 instance (its grid: launch_grid)."""
        return SM90_PERSIST_DEFINE in self.spec.defines


def launch_config(backend: str, head_dim: int, cta_rows: int, variant: Variant, dtype: str,
                  kv_dtype: str | None = None, interleaved: bool = False, wg_split: bool = False,
                  long_tiles: bool = False) -> LaunchConfig:
    """backend "sm90" (the wgmma kernel) takes 128-row tiles of head_dim 64/128/256 on sm_90 GPUs; "auto" takes
    it there unless its ptxas report shows spills (sm90_choice), else "sm80". interleaved: sm90_spec's (a paged
    cache that takes tensor maps). wg_split, long_tiles: sm90_spec's (the sm90 kernel only)."""
    sm90_ok = cta_rows == sm90_rows() and head_dim in SM90_HEAD_DIMS and _driver.arch() == "sm_90a"
    if backend == "sm90" and not sm90_ok:
        raise ValueError(f"backend: 'sm90' needs an sm_90 GPU, head_dim in {SM90_HEAD_DIMS} and cta_rows "
                         f"{sm90_rows()} (got {_driver.arch()}, head_dim {head_dim}, cta_rows {cta_rows})")
    spec = (sm90_choice(backend, head_dim, variant, dtype, kv_dtype, interleaved, wg_split, long_tiles=long_tiles)
            if sm90_ok else None)
    if wg_split and spec is None:
        raise ValueError(f"wg_split: needs the sm90 kernel (backend {backend!r}, head_dim {head_dim}, "
                         f"cta_rows {cta_rows}, {_driver.arch()})")
    if spec is not None:
        return LaunchConfig("sm90", spec, sm90_threads(spec.defines), sm90_smem_bytes(head_dim, defines=spec.defines),
                            1)
    if head_dim == 256 and cta_rows == 128:
        raise ValueError("cta_rows: 128 with head_dim 256 needs the sm90 kernel (an sm_90 GPU, backend 'auto' or "
                         "'sm90', a variant that compiles there without spills); use 64")
    spec = prefill_spec(head_dim, cta_rows, variant, dtype, kv_dtype)
    kernel = get_kernel(spec)
    smem = smem_bytes(head_dim, cta_rows, kv_dtype)
    occ = (kernel.resources or Resources()).ctas_per_sm(THREADS, smem)
    return LaunchConfig("sm80", spec, THREADS, smem, occ)


def sm90_choice(backend: str, head_dim: int, variant: Variant, dtype: str,
                kv_dtype: str | None = None, interleaved: bool = False,
                wg_split: bool = False, fused_merge: bool = False, long_tiles: bool = False) -> KernelSpec | None:
    """The wgmma instance a 128-row tile of this head dim and variant runs on, or None (the mma.sync kernel): on an
    sm_90 GPU and a head dim it covers, with backend "sm90" the persistent instance where sm90_persistent allows
    it, else the one-unit one; with "auto" the first of those two that compiles without spills (a user variant
    with a key transform may spill in the persistent one; at head_dim 256 the custom-mask, ALiBi, RoPE and fp8
    instances spill and go to the mma.sync kernel). interleaved, wg_split, fused_merge, long_tiles: sm90_spec's."""
    if backend == "sm80" or head_dim not in SM90_HEAD_DIMS or _driver.arch() != "sm_90a":
        return None
    persistent = sm90_persistent(head_dim, variant, kv_dtype)
    if backend == "sm90":
        return sm90_spec(head_dim, variant, dtype, kv_dtype, persistent, interleaved=interleaved, wg_split=wg_split,
                         fused_merge=fused_merge, long_tiles=long_tiles)
    for p in ((True, False) if persistent else (False,)):
        spec = sm90_spec(head_dim, variant, dtype, kv_dtype, p, interleaved=interleaved, wg_split=wg_split,
                         fused_merge=fused_merge, long_tiles=long_tiles)
        kernel = get_kernel(spec)
        if kernel.resources is None or kernel.resources.spill_stores == 0:
            return spec
    return None


def sm90_usable(backend: str, head_dim: int, variant: Variant, dtype: str, kv_dtype: str | None = None) -> bool:
    """Whether a 128-row tile of this head dim and variant runs on the wgmma kernel (sm90_choice)."""
    return sm90_choice(backend, head_dim, variant, dtype, kv_dtype) is not None


register("prefill", [prefill_spec(128, r, Variant(), "bfloat16") for r in (128, 64, 16)]
         + [prefill_spec(128, 128, Variant(), "float16"), prefill_spec(64, 128, Variant(), "bfloat16"),
            prefill_spec(256, 64, Variant(), "bfloat16"),
            prefill_spec(128, 128, Variant(soft_cap=True, window=True, custom_mask=True), "bfloat16")]
         + [sm90_spec(128, Variant(), t) for t in ("bfloat16", "float16")] + [sm90_spec(64, Variant(), "bfloat16")]
         + [sm90_spec(128, Variant(custom_mask=True), "bfloat16"), sm90_spec(256, Variant(), "bfloat16")]
         + [sm90_spec(128, v, "bfloat16", interleaved=True)   # paged caches' instances
            for v in (Variant(), Variant(soft_cap=True, window=True, custom_mask=True))])


# -- one prefill launch's share of a plan buffer (the paged / ragged ops have one, cascade one per level) -----
def level_layout(cap_b: int, cap_w: int, cap_m: int, cap_p: int, vdata, cap_c: int = 0) -> tuple[dict, int]:
    """({region: int32 offset}, int32 size) of one launch's plan buffer: header, qo_indptr, kv_len, page_indptr,
    mask_indptr, items, merge lists, pages, variant data, the fused merge's arrival counters (cap_c int32, zeroed
    by write_level; the kernel leaves them at 0); regions sized by the capacities (graph mode: bounds)."""
    off, pos = {}, HEADER_INT32
    for name, n in (("qo_indptr", cap_b + 1), ("kv_len", cap_b), ("page_indptr", cap_b + 1),
                    ("mask_indptr", cap_b), ("items", 8 * cap_w), ("merge_indptr", cap_m + 1),
                    ("merge_rows", cap_m), ("page_indices", cap_p),
                    ("variant", vdata.size if vdata is not None else 0), ("counters", cap_c)):
        off[name] = pos
        pos += align4(max(n, 1))
    return off, pos


def write_level(h: np.ndarray, off: dict, items: np.ndarray, batch: int, qo_indptr, kv_lens, page_indptr,
                page_indices, vdata=None, mask_offsets=None, *, num_kv_heads: int, num_partial_rows: int, merge=None,
                kv_head_group: int = 0):
    """Fill one launch's int32 plan buffer h (zeroed first). items: int32 [W, 8]; qo_indptr, page_indptr: int
    [batch + 1]; kv_lens: int [batch]; page_indices: int [pages]; merge: (indptr [M + 1], rows [M], capacity)
    of the split rows, the unused tail of indptr repeating its last value (graph mode's fixed merge grid)."""
    h[:] = 0
    nm = merge[1].size if merge is not None else 0
    write_header(h, num_items=items.shape[0], num_merge=nm, batch_size=batch, num_partial_rows=num_partial_rows,
                 num_kv_heads=num_kv_heads, kv_head_group=kv_head_group)
    h[off["qo_indptr"]:off["qo_indptr"] + batch + 1] = qo_indptr
    h[off["kv_len"]:off["kv_len"] + batch] = kv_lens
    h[off["page_indptr"]:off["page_indptr"] + batch + 1] = page_indptr
    if mask_offsets is not None:
        h[off["mask_indptr"]:off["mask_indptr"] + batch] = mask_offsets[:batch]
    h[off["items"]:off["items"] + items.size] = items.ravel()
    if merge is not None:
        indptr, rows, cap_m = merge
        mi = off["merge_indptr"]
        h[mi:mi + nm + 1] = indptr
        h[mi + nm + 1:mi + cap_m + 1] = indptr[-1]
        h[off["merge_rows"]:off["merge_rows"] + nm] = rows
    h[off["page_indices"]:off["page_indices"] + page_indices.size] = page_indices
    if vdata is not None:
        h[off["variant"]:off["variant"] + vdata.size] = vdata.view(np.int32)


def level_params(base: int, off: dict, tmp_o: int, tmp_lse: int, mask: int, *, hq, group, page_size, page_shift,
                 causal, window_left, scale, cap, variant_ptr) -> ParamBuffer:
    """The kernel parameters of one launch whose plan buffer starts at device address base (array pointers and
    strides are bound by run())."""
    p = ParamBuffer(PREFILL_PARAMS)
    p.set(tmp_o=tmp_o, tmp_lse=tmp_lse, plan=base, mask=mask,
          off_qo_indptr=off["qo_indptr"], off_kv_len=off["kv_len"], off_page_indptr=off["page_indptr"],
          off_page_indices=off["page_indices"], off_mask_indptr=off["mask_indptr"], off_items=off["items"],
          num_qo_heads=hq, group_size=group, page_size=page_size, page_shift=page_shift, causal=int(causal),
          **dict(zip(("group_mul", "group_shr"), group_magic(group))),
          window_left=window_left,
          score_scale=(scale / cap) if cap > 0 else scale * LOG2E, cap_log2=cap * LOG2E,
          variant_data=variant_ptr, k_scale=1.0, v_scale=1.0)
    return p


class _BatchPrefill(AttentionOp):
    """What the paged and ragged wrappers share: the schedule, the packing, the variants (on the plan/run core)."""

    _paged = True
    _fp8_expandable = False   # plans may expand an fp8 cache once per call (run() must call _bind_kv)
    #: Whether each request reads its own K/V, so the walk orders requests by L2 windows of their K/V bytes
    #: (scheduler.PREFILL_L2_WINDOW_BYTES). Block-sparse rows share one K/V: windows by row would only break the
    #: walk's longest-first order (scheduler.walk_makespan's model: 3-5% on the 8192^2 patterns).
    _own_kv = True
    DEFAULT_WORKSPACE = DEFAULT_WORKSPACE

    def __init__(self, kv_layout="NHD", use_cuda_graph=False, max_batch_size=None, max_num_pages=None,
                 max_total_qo=None, workspace_bytes=None, num_sms=None, backend="auto", device=None,
                 deterministic=False):
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        super().__init__(kv_layout, use_cuda_graph,
                         dict(max_batch_size=max_batch_size, max_total_qo=max_total_qo, max_num_pages=max_num_pages),
                         ("max_batch_size", "max_total_qo") + (("max_num_pages",) if self._paged else ()),
                         workspace_bytes, num_sms, device)
        self.backend = backend
        self.deterministic = bool(deterministic)
        #: KV-split slots the scheduler counts per CTA the SMs hold (1: a batch too small to fill the GPU is cut
        #: into chunks that fill one wave; 2: two waves, so a persistent CTA has a second unit whose loads overlap
        #: its first's tail). The decode route's A/B (decode tuning sm90_route_waves: 2 lost, run 36a); not in
        #: graph mode.
        self.split_waves = 1
        #: The sm90 instance whose two consumer warpgroups split each unit's KV tiles, for batches whose every
        #: request has at most WG_ROWS packed query rows (the decode wrapper's route of GQA groups of 32 and 64:
        #: a 128-row tile would be 3/4 padding). plan() raises where the batch does not fit it.
        self.wg_split = False
        #: An fp8 cache in the paged / ragged wrappers' plans: "auto" expands it once per call into 16-bit rows
        #: where the queries re-read it enough (kvattn.fp8_expand.wanted), "once" always (outside graph mode),
        #: "kernel" never (each K/V tile expanded inside the attention kernel on every read).
        self.fp8_expand = "auto"
        #: Split plans on the sm90 kernel merge their blocks' chunks inside it (PrefillSm90::merge_if_last: the last
        #: warp of a block's chunks to finish merges them) instead of in a merge launch: plain variants, head_dim up
        #: to 128, at most FUSED_MERGE_MAX_CHUNKS chunks a block, not in graph or deterministic mode, not with
        #: wg_split. The decode route's A/B (decode tuning sm90_route_fused_merge); off: runs 43c-43d (BENCHMARKS.md),
        #: 1-5 us slower than the merge kernel after a programmatic launch.
        self.fused_merge = False
        #: The persistent walk's tail split (SM90_TAIL_SPLIT, the default).
        self.tail_split = SM90_TAIL_SPLIT
        self._fp8 = None   # the current plan's Fp8Expansion, or None

    # -- plan ------------------------------------------------------------------------------------
    def _plan_common(self, qo_indptr, kv_lens, page_indptr, page_indices, page_size, page_shift, num_qo_heads,
                     num_kv_heads, head_dim, causal, custom_mask, mask_indptr, sm_scale, window_left,
                     logits_soft_cap, q_dtype, kv_dtype, cta_rows, stream, variant=None, alibi_slopes=None,
                     sinks=None, variant_params=None, rope=None, rope_offsets=None, make_kv=None):
        """make_kv: (num_kv_heads, head_dim, numpy dtype) -> the plan's KV accessor; None: the paged cache of these
        pages (paged ops) or ragged K / V (ragged op)."""
        hq, hkv, head_dim, q_dtype, kv_dtype, window_left, cap = check_plan_args(
            num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, window_left, logits_soft_cap, fp8_kv=True)
        if rope is not None and _dtypes.is_fp8(kv_dtype):
            raise ValueError(f"rope: fused RoPE rotates the cache's keys in 16 bits; with kv_dtype {kv_dtype} store "
                             f"rotated keys (apply RoPE before quantising) and pass rope=None")
        scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else _v.as_float(sm_scale, "sm_scale")
        causal = bool(causal)
        batch = qo_indptr.size - 1
        qo_lens = np.diff(qo_indptr).astype(np.int64)
        total_qo = int(qo_indptr[-1])
        if causal and (kv_lens < qo_lens).any():
            i = int(np.argmax(kv_lens < qo_lens))
            raise ValueError(f"causal: requires kv_len >= qo_len for every request; request {i} has qo_len "
                             f"{int(qo_lens[i])} > kv_len {int(kv_lens[i])}")
        if self.use_cuda_graph:
            if batch > self.max_batch_size:
                raise ValueError(f"qo_indptr: batch size {batch} exceeds max_batch_size {self.max_batch_size}")
            if total_qo > self.max_total_qo:
                raise ValueError(f"qo_indptr: {total_qo} query tokens exceed max_total_qo {self.max_total_qo}")
            if self._paged and page_indices.size > self.max_num_pages:
                raise ValueError(f"page_table: {page_indices.size} pages exceed max_num_pages {self.max_num_pages}")
        packed_mask, mask_offsets = self._mask(custom_mask, mask_indptr, qo_lens, kv_lens)
        group = hq // hkv
        contiguous = not self._paged and make_kv is None   # ragged K / V: one run of tokens per request
        expansion = None
        if self._fp8_expandable and fp8_expand.wanted(self.fp8_expand, kv_dtype, head_dim, qo_lens, group,
                                                      self.use_cuda_graph):
            # the fp8 cache expanded once per call (run()) into 16-bit ragged rows, which this plan reads
            npd8 = _dtypes.to_numpy(kv_dtype)
            kv8 = (PagedKV(self.kv_layout, page_size, hkv, head_dim, npd8, int(page_indices.max(initial=-1)) + 1)
                   if self._paged else RaggedKV(self.kv_layout, int(kv_lens.sum()), hkv, head_dim, npd8))
            expansion = fp8_expand.Fp8Expansion(kv8, page_indptr, page_indices, page_size, page_shift, kv_lens,
                                                q_dtype, self._fp8)
            total_kv = int(expansion.ws_indptr[-1])
            page_indptr, page_indices = np.arange(batch + 1, dtype=np.int32), expansion.ws_indptr[:-1]
            page_size, page_shift, kv_dtype, contiguous = 1 << RAGGED_PAGE_SHIFT, RAGGED_PAGE_SHIFT, q_dtype, True
            make_kv = lambda hkv_, d, npd: RaggedKV("NHD", total_kv, hkv_, d, npd)   # noqa: E731
        variant, vvals = plan_variant(variant, hq, batch, cap > 0, window_left >= 0, packed_mask is not None,
                                      alibi_slopes, sinks, variant_params, rope, rope_offsets,
                                      int(kv_lens.max(initial=0)))
        auto_rows = cta_rows is None
        if cta_rows is None and self.deterministic:
            cta_rows = 64 if head_dim == 256 else 128   # a query tile that does not depend on the batch
        elif cta_rows is None:
            if self.use_cuda_graph:
                packed = self.max_total_qo * group / self.max_batch_size
            else:
                nz = int(np.count_nonzero(qo_lens))
                packed = total_qo * group / max(nz, 1)
            cta_rows = choose_cta_rows(packed, head_dim,
                                       head_dim == 256 and sm90_usable(self.backend, head_dim, variant, q_dtype,
                                                                        kv_dtype))
            if cta_rows == 128 and sm90_rows() != 128 and head_dim == 64:   # (the WG3 experiment's 192-row tiles)
                cta_rows = sm90_rows()
        elif cta_rows not in CONFIGS and cta_rows != sm90_rows():
            raise ValueError(f"cta_rows: expected one of {sorted(CONFIGS)}, got {cta_rows}")
        self._bake(num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
                   page_size=page_size,
                   sm_scale=scale, causal=causal, window_left=window_left, logits_soft_cap=cap,
                   custom_mask=packed_mask is not None, cta_rows=cta_rows, variant=variant)
        npdtype = _dtypes.to_numpy(kv_dtype)
        if make_kv is not None:
            kv = make_kv(hkv, head_dim, npdtype)
        elif self._paged:
            kv = PagedKV(self.kv_layout, page_size, hkv, head_dim, npdtype, int(page_indices.max(initial=-1)) + 1)
        else:
            kv = RaggedKV(self.kv_layout, int(kv_lens.sum()), hkv, head_dim, npdtype)
        kvil = tma.interleaved_tiles(kv, sm90_tile(head_dim)[0]) and not variant.rope
        wg_split = bool(self.wg_split)
        if wg_split:
            rows = int(qo_lens.max(initial=0)) * group
            if (rows > WG_ROWS or cta_rows != 128 or head_dim > 128 or variant.rope or _dtypes.is_fp8(kv_dtype)
                    or self.use_cuda_graph):
                raise ValueError(f"wg_split: needs at most {WG_ROWS} packed query rows a request (got {rows}), "
                                 f"cta_rows 128 (got {cta_rows}), head_dim <= 128 (got {head_dim}), a 16-bit cache "
                                 f"(got {kv_dtype}), no fused RoPE and no graph mode")
        # (not in graph mode, whose captured kernel must hold for every later batch, nor in deterministic mode,
        # whose bits must not depend on the batch)
        long_tiles = (cta_rows == 128 and expansion is None and not wg_split and not self.use_cuda_graph
                      and not self.deterministic
                      and sm90_long_tiles(head_dim, variant, kv_dtype, contiguous, qo_lens, kv_lens, causal, group))
        cfg = launch_config(self.backend, head_dim, cta_rows, variant, q_dtype, kv_dtype, kvil, wg_split,
                            long_tiles=long_tiles)
        if cfg.backend == "sm80" and variant.rope and auto_rows and cta_rows == 128:
            cta_rows = 64   # the 128-row mma.sync tile has no registers left for the rotation (ptxas spills)
            cfg = launch_config(self.backend, head_dim, cta_rows, variant, q_dtype, kv_dtype)
        kernel = get_kernel(cfg.spec)
        kernel._allow_smem(cfg.smem)   # now, not during a graph capture
        occ = cfg.ctas_per_sm
        plan = scheduler.plan_prefill(qo_lens, kv_lens, group, hkv, cta_rows, causal=causal,
                                      window_left=window_left, num_sms=self.num_sms,
                                      ctas_per_sm=occ * (1 if self.use_cuda_graph else self.split_waves),
                                      split_tokens=DETERMINISTIC_SPLIT_TOKENS if self.deterministic else None,
                                      max_split_chunks=DETERMINISTIC_SPLIT_CHUNKS if self.deterministic else None,
                                      kv_bytes_per_token=(hkv * 2 * head_dim * _dtypes.to_numpy(kv_dtype).itemsize
                                                          if self._own_kv else 0),
                                      persistent_ctas=self.num_sms if (self.tail_split and cfg.persistent
                                                                       and not self.use_cuda_graph
                                                                       and not self.deterministic
                                                                       and not wg_split) else 0)

        fused = (self.fused_merge and cfg.backend == "sm90" and plan.merge_slots > 0
                 and plan.max_chunks <= FUSED_MERGE_MAX_CHUNKS and not self.deterministic and not self.use_cuda_graph
                 and not wg_split and variant.merge_type() is None and head_dim <= 128   # (None: no output hook)
                 and sm90_consumers(cfg.spec.defines) == 2)
        if fused:
            spec = sm90_choice(self.backend, head_dim, variant, q_dtype, kv_dtype, kvil, fused_merge=True,
                               long_tiles=long_tiles)
            fused = spec is not None and (SM90_PERSIST_DEFINE in spec.defines) == cfg.persistent
            if fused:
                cfg = dataclasses.replace(cfg, spec=spec)
                kernel = get_kernel(spec)
                kernel._allow_smem(cfg.smem)

        # Packed int32 buffer: header, qo_indptr, kv_len, page_indptr, mask_indptr, items, merge lists, pages.
        if self.use_cuda_graph:
            cap_b = self.max_batch_size
            cap_w, cap_part, cap_m = scheduler.prefill_bounds(
                cap_b, self.max_total_qo, group, hkv, cta_rows, num_sms=self.num_sms, ctas_per_sm=occ,
                max_split_chunks=DETERMINISTIC_SPLIT_CHUNKS if self.deterministic else None)
            cap_p = self.max_num_pages if self._paged else cap_b
        else:
            cap_b, cap_w, cap_part, cap_m = batch, plan.num_items, plan.num_partial_rows, plan.num_merge
            cap_p = page_indices.size
        if plan.num_items > cap_w or plan.num_partial_rows > cap_part or plan.num_merge > cap_m:
            raise AssertionError("prefill plan exceeds its graph-mode bounds")  # prefill_bounds guarantees it
        vdata = variant.data(hq, batch, cap_b, **vvals)
        off, total_i32 = level_layout(cap_b, cap_w, cap_m, cap_p, vdata,
                                      plan.merge_slots * hkv * 8 if fused else 0)   # (per consumer warp)
        mask_bytes = packed_mask.size if packed_mask is not None else 0
        ex_at = (total_i32 * 4 + mask_bytes + 15) // 16 * 16       # (the fp8 expansion's index arrays follow)
        ex_bytes = expansion.index.nbytes if expansion is not None else 0
        host = self._stage(ex_at + ex_bytes)
        h = host.view(np.int32)
        write_level(h[:total_i32], off, plan.items, batch, qo_indptr, kv_lens, page_indptr, page_indices, vdata,
                    mask_offsets, num_kv_heads=hkv, num_partial_rows=plan.num_partial_rows,
                    merge=(plan.merge_indptr, plan.merge_rows, cap_m), kv_head_group=plan.kv_head_group)
        if mask_bytes:
            host[total_i32 * 4:total_i32 * 4 + mask_bytes] = packed_mask
        if ex_bytes:
            host[ex_at:ex_at + ex_bytes] = expansion.index.view(np.uint8)

        regions = {
            "plan": ((total_i32,), "int32"),
            "tmp_o": ((max(cap_part, 1), hq, head_dim), "float32"),
            "tmp_lse": ((max(cap_part, 1), hq), "float32"),
            "mask": ((mask_bytes + MASK_PAD,), "uint8"),
        }
        copies = [("plan", 0, total_i32 * 4), ("mask", total_i32 * 4, mask_bytes)]
        if ex_bytes:
            regions["fp8_index"] = ((ex_bytes // 4,), "int32")
            copies.append(("fp8_index", ex_at, ex_bytes))
        dev, s, copy_done = self._upload(host, copies, regions, stream)
        if expansion is not None:
            expansion.bind_index(dev["fp8_index"].ptr)

        base = dev["plan"].ptr
        variant_ptr = base + off["variant"] * 4 if vdata is not None else 0
        p = level_params(base, off, dev["tmp_o"].ptr, dev["tmp_lse"].ptr, dev["mask"].ptr if mask_bytes else 0,
                         hq=hq, group=group, page_size=page_size, page_shift=page_shift, causal=causal,
                         window_left=window_left, scale=scale, cap=cap, variant_ptr=variant_ptr)
        if fused:
            p.set(off_counters=off["counters"])
        mi = off["merge_indptr"]
        merge_rows = 0 if fused else cap_m if self.use_cuda_graph else plan.num_merge
        merge, mp = self._merge_launch(merge_rows, dev["tmp_o"], dev["tmp_lse"], base, mi, off["merge_rows"], hq,
                                       head_dim, q_dtype, variant, variant_ptr,
                                       None if self.use_cuda_graph else plan.merge_indptr, self.deterministic)
        grid = launch_grid(cfg, cap_w, hkv, self.num_sms)
        sm90_maps = cfg.backend == "sm90" and not variant.rope
        maps = (tma.attach(kv, [p], sm90_tile(head_dim, defines=cfg.spec.defines)[0], contiguous=contiguous,
                           interleaved=sm90_interleaved(cfg.spec))
                if sm90_maps else None)
        max_rows = self.max_total_qo if self.use_cuda_graph else total_qo
        q_map, o_map = (tma.attach_rows([p], group, head_dim, tokens=max_rows, q_rows=sm90_q_box_rows(cfg.spec))
                        if sm90_maps else (None, None))
        if wg_split:
            o_map = None   # (consume_split stores its rows per thread: no map for run() to bind)
        self._finish_plan(
            rows=total_qo, max_rows=max_rows, hq=hq, d=head_dim,
            dtype=q_dtype, kv=kv, launch=Launch(kernel, grid, cfg.threads, cfg.smem, p) if cap_w > 0 else None,
            params=p, merge=merge, merge_params=mp, s=s, copy_done=copy_done, bind_tma=tma.binder(q_map, maps, o_map),
            schedule=plan, backend=cfg.backend, cta_rows=cta_rows, variant=variant, kernel=kernel,
            grid=grid, smem=cfg.smem, threads=cfg.threads, num_kv_heads=hkv, tma=maps is not None,
            tma_q=q_map is not None, tma_o=o_map is not None, wg_split=wg_split, fused_merge=fused,
            fp8_expand=expansion is not None)
        self._fp8 = expansion
        return self

    def _bind_kv(self, p, k_cache, v_cache, s, capturing, k_scale, v_scale):
        """(k, v, kv_strides, k_scale, v_scale, before) for _execute: the caller's cache, or (the plan expands an fp8
        cache once) its expansion into the workspace, whose 16-bit rows take no scales, and `before`, the
        expansion's launch (issued by _execute once every argument is checked; None without one)."""
        before = None
        if self._fp8 is not None:
            k_cache, v_cache, before = self._fp8.expand(k_cache, v_cache, s, capturing, k_scale, v_scale)
            k_scale = v_scale = None
        k, v, kv_strides = p.kv.bind(k_cache, v_cache, s, capturing)
        return k, v, kv_strides, k_scale, v_scale, before

    @staticmethod
    def _mask(custom_mask, mask_indptr, qo_lens, kv_lens):
        """(packed uint8 mask or None, int32 byte offsets [B + 1] or None), validated against the lengths."""
        if custom_mask is None:
            if mask_indptr is not None:
                raise ValueError("mask_indptr: given without custom_mask")
            return None, None
        bits = qo_lens * kv_lens
        nbytes = -(-bits // 8)
        if isinstance(custom_mask, (list, tuple)):
            if len(custom_mask) != qo_lens.size:
                raise ValueError(f"custom_mask: expected {qo_lens.size} per-request masks, got {len(custom_mask)}")
            parts = []
            for i, m in enumerate(custom_mask):
                m = _v.as_bool_array(m, f"custom_mask[{i}]")
                if m.size != bits[i]:
                    raise ValueError(f"custom_mask[{i}]: expected qo_len * kv_len = {int(bits[i])} entries, got {m.size}")
                parts.append(m.ravel())
            custom_mask = np.concatenate(parts) if parts else np.zeros(0, bool)
        m = custom_mask if isinstance(custom_mask, np.ndarray) else np.asarray(custom_mask)
        if m.dtype == np.bool_:
            if mask_indptr is not None:
                raise ValueError("mask_indptr: only for a bit-packed uint8 custom_mask (bool masks are packed here)")
            if m.size != int(bits.sum()):
                raise ValueError(f"custom_mask: expected sum(qo_len * kv_len) = {int(bits.sum())} entries, got {m.size}")
            ind = np.concatenate([[0], np.cumsum(bits)])
            packed, byte_indptr = pack_mask(m.ravel(), ind)
            return np.ascontiguousarray(packed, np.uint8), np.asarray(byte_indptr, np.int32)
        if m.dtype != np.uint8:
            raise TypeError(f"custom_mask: expected a bool array or a bit-packed uint8 array, got dtype {m.dtype}")
        if mask_indptr is None:
            raise ValueError("mask_indptr: required with a bit-packed uint8 custom_mask (byte offsets, [batch + 1])")
        mind = _v.as_indptr(mask_indptr, "mask_indptr", length=qo_lens.size + 1, total=m.size)
        if (np.diff(mind) != nbytes).any():
            i = int(np.argmax(np.diff(mind) != nbytes))
            raise ValueError(f"mask_indptr: request {i} has {int(np.diff(mind)[i])} mask bytes, expected "
                             f"ceil(qo_len * kv_len / 8) = {int(nbytes[i])}")
        return np.ascontiguousarray(m.ravel()), mind

#: The KV split of deterministic prefill, in tokens (a block's range longer than this is cut into near-equal
#: 64-aligned chunks of at most this many tokens), and its cap of chunks per block (a longer range is cut into
#: this many): both a function of the block alone. The cap bounds the partial states of any batch by
#: max_total_qo * 4 rows, which is what graph mode sizes its workspace with.
DETERMINISTIC_SPLIT_TOKENS = 4096
DETERMINISTIC_SPLIT_CHUNKS = 4


class BatchPrefillWithPagedKVCache(_BatchPrefill):
    """Prefill / append of ragged queries against a paged KV cache. See the module docstring.

    kv_layout: "NHD" (caches [pages, page_size, Hkv, D]) or "HND" ([pages, Hkv, page_size, D]).
    use_cuda_graph: fix the buffers, query tile and grid from max_batch_size, max_num_pages and max_total_qo.
    device: the GPU (an ordinal or a kvattn Device; None: the current context's device at the first plan()).
    deterministic: batch-invariant results: a fixed query tile (128 rows; 64 at head_dim 256) and a fixed KV
    split (DETERMINISTIC_SPLIT_TOKENS, at most DETERMINISTIC_SPLIT_CHUNKS chunks per block), so a request's bits
    do not depend on the rest of its batch or the GPU's SM count, in graph mode too (its workspace then holds
    max_total_qo * 4 partial rows: 16 MB per 1024 query tokens at Hq 32, D 128).
    """

    _paged = True
    _fp8_expandable = True

    @on_device
    def plan(self, qo_indptr, page_table: PageTable, num_qo_heads, num_kv_heads, head_dim, *, causal=False,
             custom_mask=None, mask_indptr=None, sm_scale=None, window_left=-1, logits_soft_cap=0.0,
             q_dtype="bfloat16", kv_dtype=None, cta_rows=None, alibi_slopes=None, sinks=None, rope=None,
             rope_offsets=None, variant=None, variant_params=None, stream=None):
        """Schedule the batch (host arrays are read now, not at run()).

        qo_indptr: int [B + 1] (query rows of request i are q[qo_indptr[i]:qo_indptr[i + 1]]); page_table: a
        kvattn.PageTable of B requests. custom_mask: bool (flat [sum(qo_i * kv_i)], row-major per request, or a
        list of [qo_i, kv_i]) or bit-packed uint8 with mask_indptr (byte offsets, [B + 1]); True = keep.
        cta_rows: override the query tile (16, 64, 128; for tuning). alibi_slopes: float [num_qo_heads] (ALiBi:
        s += slope[h] * (j - (kv - qo + r)), natural-log units). sinks: float [num_qo_heads] (one logit per head
        in the softmax's denominator). variant: a user variant (kvattn.Variant.from_cuda) with its declared
        parameters in variant_params; the keyword shortcuts select the built-ins. Slopes, sinks and variant
        parameters are plan data (graph mode: a later plan() may change their values). rope:
        kvattn.RoPE(theta, scale, interleave) rotates q (at kv - qo + r + offset) and k (at j + offset) inside the
        kernel; rope_offsets: int [B] or None (0).
        """
        if not isinstance(page_table, PageTable):
            raise TypeError(f"page_table: expected a kvattn.PageTable, got {type(page_table).__name__}")
        qo_indptr = _v.as_indptr(qo_indptr, "qo_indptr", length=page_table.indptr.size)
        ps = page_table.page_size
        return self._plan_common(qo_indptr, page_table.kv_lens.astype(np.int64), page_table.indptr,
                                 page_table.indices, ps, page_size_shift(ps), num_qo_heads, num_kv_heads, head_dim, causal,
                                 custom_mask, mask_indptr, sm_scale, window_left, logits_soft_cap, q_dtype,
                                 kv_dtype, cta_rows, stream, variant, alibi_slopes, sinks, variant_params, rope,
                                 rope_offsets)

    @on_device
    def run(self, q, k_cache, v_cache=None, out=None, lse=None, return_lse=False, stream=None, k_scale=None,
            v_scale=None):
        """q: [qo_indptr[-1], Hq, D]; caches [pages, page_size, Hkv, D] ("NHD") / [pages, Hkv, page_size, D]
        ("HND"), or k_cache [pages, 2, ...] with v_cache None. out: [total_qo, Hq, D] in q's dtype; lse:
        [total_qo, Hq] float32, natural log (graph mode: q / out / lse may keep max_total_qo rows). stream: None
        (the legacy default stream) or any stream kvattn.stream accepts. Returns out, or (out, lse) with
        return_lse: the caller's arrays as given, or new kvattn arrays from the stream-ordered pool. Capturable
        when every array is a device array and out (and lse) are given.
        k_scale / v_scale (fp8 cache, plan(kv_dtype=float8_e4m3fn / float8_e5m2)): the cache holds k / k_scale and
        v / v_scale; None (1), a positive float or float32 [num_kv_heads] (see BatchDecodeWithPagedKVCache.run).
        The cache is expanded to q's dtype (times its scale, rounded once): once per call into a workspace where the
        plan chose it (fp8_expand), else each K / V tile in shared memory."""
        p, s, capturing = self._begin_run(stream)
        q = import_array(q, s, capturing)
        k, v, kv_strides, k_scale, v_scale, before = self._bind_kv(p, k_cache, v_cache, s, capturing, k_scale,
                                                                   v_scale)
        return self._execute(p, s, capturing, q, k, v, kv_strides, out, lse, return_lse, k_scale, v_scale, before)


class BatchPrefillWithRaggedKVCache(_BatchPrefill):
    """Prefill of ragged queries against ragged (contiguous per request) K/V. See the module docstring.

    kv_layout: "NHD" (k, v [total_kv, Hkv, D]) or "HND" ([Hkv, total_kv, D]).
    use_cuda_graph: fix the buffers, query tile and grid from max_batch_size and max_total_qo.
    device: as BatchPrefillWithPagedKVCache.
    """

    _paged = False
    _fp8_expandable = True

    @on_device
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, *, causal=False,
             custom_mask=None, mask_indptr=None, sm_scale=None, window_left=-1, logits_soft_cap=0.0,
             q_dtype="bfloat16", kv_dtype=None, cta_rows=None, alibi_slopes=None, sinks=None, rope=None,
             rope_offsets=None, variant=None, variant_params=None, stream=None):
        """qo_indptr, kv_indptr: int [B + 1]. Other arguments as BatchPrefillWithPagedKVCache.plan."""
        qo_indptr = _v.as_indptr(qo_indptr, "qo_indptr")
        kv_indptr = _v.as_indptr(kv_indptr, "kv_indptr", length=qo_indptr.size)
        kv_lens = np.diff(kv_indptr).astype(np.int64)
        if kv_lens.size and kv_lens.max() >= 1 << RAGGED_PAGE_SHIFT:
            raise ValueError(f"kv_indptr: a request holds more than 2^{RAGGED_PAGE_SHIFT} tokens")
        b = qo_indptr.size - 1
        return self._plan_common(qo_indptr, kv_lens, np.arange(b + 1, dtype=np.int32), kv_indptr[:-1],
                                 1 << RAGGED_PAGE_SHIFT, RAGGED_PAGE_SHIFT, num_qo_heads, num_kv_heads, head_dim,
                                 causal, custom_mask, mask_indptr, sm_scale, window_left, logits_soft_cap, q_dtype,
                                 kv_dtype, cta_rows, stream, variant, alibi_slopes, sinks, variant_params, rope,
                                 rope_offsets)

    @on_device
    def run(self, q, k, v, out=None, lse=None, return_lse=False, stream=None, k_scale=None, v_scale=None):
        """q: [qo_indptr[-1], Hq, D]; k, v: [kv_indptr[-1], Hkv, D] ("NHD") or [Hkv, kv_indptr[-1], D] ("HND").
        Returns out (and lse) as BatchPrefillWithPagedKVCache.run."""
        p, s, capturing = self._begin_run(stream)
        q = import_array(q, s, capturing)
        k, v, kv_strides, k_scale, v_scale, before = self._bind_kv(p, k, v, s, capturing, k_scale, v_scale)
        return self._execute(p, s, capturing, q, k, v, kv_strides, out, lse, return_lse, k_scale, v_scale, before)


def single_prefill(q, k, v, causal=False, *, kv_layout="NHD", custom_mask=None, sm_scale=None, window_left=-1,
                   logits_soft_cap=0.0, return_lse=False, stream=None):
    """One request with contiguous K/V. q: [qo, Hq, D]; k, v: [kv, Hkv, D] ("NHD") or [Hkv, kv, D] ("HND").
    custom_mask: bool [qo, kv] (True = keep). Returns o [qo, Hq, D] (and lse [qo, Hq]) as DeviceArrays."""
    s = as_stream(stream)
    q, k, v = asarray(q, s), asarray(k, s), asarray(v, s)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v: expected 3-D arrays, got {q.shape}, {k.shape}, {v.shape}")
    kv_len, hkv = (k.shape[0], k.shape[1]) if _v.check_layout(kv_layout) == "NHD" else (k.shape[1], k.shape[0])
    if custom_mask is not None:
        custom_mask = np.asarray(custom_mask)
        if custom_mask.dtype == np.bool_:
            custom_mask = custom_mask.ravel()
    w = BatchPrefillWithRaggedKVCache(kv_layout=kv_layout)
    w.plan([0, q.shape[0]], [0, kv_len], q.shape[1], hkv, q.shape[2], causal=causal, custom_mask=custom_mask,
           mask_indptr=None if custom_mask is None or custom_mask.dtype == np.bool_ else [0, custom_mask.size],
           sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, q_dtype=q.dtype_name,
           stream=s)
    return w.run(q, k, v, return_lse=return_lse, stream=s)
