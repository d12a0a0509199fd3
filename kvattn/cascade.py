"""Multi-level cascade attention: shared prefixes computed once for all the query rows that share them.

    levels = kvattn.CascadeLevels.from_shared_prefixes(page_lists, kv_lens, qo_lens, page_size=16)
    w = kvattn.MultiLevelCascadeAttentionWrapper(num_levels=2)
    w.plan(levels, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    o = w.run(q, k_cache, v_cache)       # q [total_qo, Hq, D]; caches as BatchPrefillWithPagedKVCache

A level is a (qo_indptr, PageTable) pair: its groups partition the query rows, and every row of a group attends
to the group's pages. Level 0 is usually one group per shared prefix: all its rows (e.g. one decode token of
each of 128 requests, times the GQA group) are packed into full tensor-core query tiles, so the prefix's KV is
read once per tile instead of once per request. The causal mask (bottom-right aligned) applies to the last
level only: a row sees every token of the coarser levels.

One plan, one workspace, one host-to-device copy, one captured graph: plan() schedules every level with the
prefill kernels (each level its own query tile, so a 512-row shared level takes the 128-row wgmma tile and a
4-row suffix level the 16-row tile), packs every level's work list into one plan buffer and issues one copy.
A last level of one query row per request (a decode step's suffix) runs on the decode kernel instead (one wave
of balanced chunks; each piece of a request writes its own merge slot of the row, and the slots a request with
fewer pieces leaves are set empty by a memset: before run()'s launches, or once at plan() with
EMPTY_SLOTS_AT_PLAN), and where mixed_choice predicts a gain, in one launch with level 0 (cuda_src/mixed.cuh, as
kvattn.mixed: level 0's persistent CTAs on some SMs, decode warpgroups on the rest; with DECODE_AFTER_LEVEL_0 where
no split pays: the decode CTAs after level 0's in one grid).
Every query row owns `slots` consecutive float32 partial states, one per (level, KV chunk): each block of level l
is cut into chunks[l] KV chunks (an empty chunk writes lse = -inf). run() launches one prefill kernel per level
and one stacked merge that combines each row's slots, level 0 first (deterministic: fixed order, no atomics).
Graph mode bakes the levels' query tiles and chunk counts from the first plan(); later plans within the bounds
(max_batch_size groups per level, max_total_qo rows, max_num_pages pages per level) reuse the captured graph.
Workspace: max_total_qo (or the rows) * slots * Hq * D * 4 bytes of partial states.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _dtypes, _validate as _v, scheduler, tma
from ._attn_args import check_plan_args
from ._binding import import_array
from .compiler import Resources
from .contract import NUM_MERGE, align4, page_size_shift
from .decode import THREADS as DECODE_THREADS, auto_m_tiles, decode_params, decode_spec, default_stages
from .decode import smem_bytes as decode_smem_bytes
from .formats import CascadeLevels
from .kernels import NEG_INF_BITS, Launch, ParamBuffer, get_kernel
from .merge import MERGE_PARAMS, merge_spec
from .mixed import DECODE_BYTES_PER_SM, MAX_SUBS, PREFILL_FLOPS_PER_SM, mixed_kernel, mixed_launch, split_sms
from .opcore import AttentionOp, PagedKV, fill_steps, on_device
from .prefill import (BACKENDS, DEFAULT_WORKSPACE, DETERMINISTIC_SPLIT_CHUNKS, DETERMINISTIC_SPLIT_TOKENS,
                      choose_cta_rows, launch_config, level_layout, level_params, sm90_tile,
                      sm90_usable, write_level, launch_grid)
from .variants import Variant, plan_variant

#: The decode level's rate on the whole GPU (run 22b: 134 MB of 256-token suffixes in ~45 us; longer chunks more).
DECODE_HBM_BYTES = 3.4e12
#: Where mixed_choice finds no split of the SMs that pays, put the decode level's CTAs in level 0's grid anyway,
#: after its persistent CTAs, with both levels scheduled on every SM: the decode CTAs start on the SMs level 0 leaves
#: idle (its 128 units of prefix 32768 / batch 128 leave 4 of 132) and on each SM as its level-0 CTA ends, instead
#: of after the whole level and a second launch. H100, run 53a (bench_cascade.py --after-level-0, 3 alternating rounds):
#: prefix 32768 / batch 128 198.0 -> 189.4 us; the cases where a split pays (or level 0 is not persistent) unchanged.
DECODE_AFTER_LEVEL_0 = True
#: Where some request of the decode level has fewer pieces than the level's merge slots (partial_fill), the slots it
#: leaves are set empty (lse = -inf) once, by a memset at plan() on the plan's stream beside its copy (True), rather
#: than by a memset step before every run()'s launches (False): no kernel writes those slots, so they stay empty
#: from run to run, and run() issues one driver call and one GPU operation fewer. H100, run 55a (bench_cascade.py
#: --empty-at-plan, in turns, us): prefix 32768 / batch 128 190.5 -> 189.3, prefix 8192 / batch 32 51.7 -> 48.7,
#: three levels 105.3 -> 104.3 (torch tensors alike).
EMPTY_SLOTS_AT_PLAN = True


@dataclasses.dataclass(frozen=True)
class _DecodeLevel:
    """A cascade level run by the decode kernel: its schedule (scheduler.plan_decode's layout, packed buffer, items,
    their requests and pieces), kernel, grid, shared memory, z slices and m tiles."""
    layout: object
    buffer: np.ndarray
    work_req: np.ndarray
    work_piece: np.ndarray   # each item's piece of its request (its merge slot within the level)
    pieces: int              # the level's merge slots: the most pieces of a request
    partial_fill: bool       # some request has fewer pieces: its other slots are set empty (EMPTY_SLOTS_AT_PLAN)
    kernel: object
    grid: tuple
    smem: int
    z_split: int
    m_tiles: int


def mixed_choice(qo0, kv0, dec_kv, hq: int, hkv: int, d: int, num_sms: int, ctas_per_sm: int = 1) -> int | None:
    """The SMs for level 0 (groups' query rows qo0, KV kv0: int [G0]) in one launch with a decode level of KV
    lengths dec_kv (int [G]), or None where two launches one after the other are predicted faster: level 0 takes
    whole rounds of its equal units (the persistent CTAs walk them: 128 units on 112 SMs take two rounds, run
    22c), the decode SMs stream DECODE_BYTES_PER_SM each (kvattn.mixed's rates, run 22a)."""
    qo0, kv0, dec_kv = (np.asarray(a, np.int64) for a in (qo0, kv0, dec_kv))
    flops = 4.0 * float((qo0 * kv0).sum()) * hq * d
    nbytes = float(dec_kv.sum()) * hkv * d * 2 * 2
    n, group, rows = num_sms, hq // hkv, 128
    blocks = int((-(-(qo0[kv0 > 0] * group) // rows)).sum())
    if not blocks or n < 2:
        return None

    def level0_us(sms):
        units = blocks * hkv * scheduler.cascade_chunks(qo0, kv0, group, hkv, rows, num_sms=sms,
                                                        ctas_per_sm=ctas_per_sm)
        return -(-units // sms) * flops / units / PREFILL_FLOPS_PER_SM * 1e6

    def decode_us(sms):
        return nbytes / min(sms * DECODE_BYTES_PER_SM, DECODE_HBM_BYTES) * 1e6
    p_est = split_sms(flops, nbytes, n)
    best = min(range(max(1, p_est - 16), min(n - 1, p_est + 16) + 1, 2),
               key=lambda p: max(level0_us(p), decode_us(n - p)))
    if max(level0_us(best), decode_us(n - best)) > 0.97 * (level0_us(n) + decode_us(n)):
        return None
    return best


def request_pieces(work_req: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [W]: each item's piece index within its request, in work order; int64 [batch]: pieces per request)
    of a decode schedule's items (work_req int [W])."""
    req = np.asarray(work_req, np.int64)
    counts = np.bincount(req, minlength=batch)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.argsort(req, kind="stable")
    piece = np.empty(req.size, np.int64)
    piece[order] = np.arange(req.size) - first[req[order]]
    return piece.astype(np.int32), counts


def as_levels(levels, page_tables) -> CascadeLevels:
    """A CascadeLevels from plan()'s first arguments: a CascadeLevels (page_tables None), or a list of qo_indptr
    arrays with a list of PageTables."""
    if isinstance(levels, CascadeLevels):
        if page_tables is not None:
            raise ValueError("page_tables: give either a CascadeLevels or qo_indptr and page_table lists, not both")
        return levels
    if page_tables is None:
        raise TypeError("levels: expected a kvattn.CascadeLevels, or a list of qo_indptr arrays with page_tables "
                        "(a list of kvattn.PageTable)")
    levels, page_tables = list(levels), list(page_tables)
    if len(levels) != len(page_tables):
        raise ValueError(f"page_tables: expected one per level ({len(levels)}), got {len(page_tables)}")
    return CascadeLevels(list(zip(levels, page_tables)))


class MultiLevelCascadeAttentionWrapper(AttentionOp):
    """Cascade attention over a paged KV cache (see the module docstring).

    num_levels: the levels every plan() gives. kv_layout: "NHD" or "HND" (as BatchPrefillWithPagedKVCache).
    use_cuda_graph: fix the buffers and grids from max_batch_size (groups of any level), max_total_qo (query
    rows) and max_num_pages (pages of any level). backend: "auto", "sm80" or "sm90" (as the prefill wrappers).
    deterministic: batch-invariant results (a row's output and LSE bits do not depend on the other groups of the
    batch, the batch size or the SM count): every level on the prefill kernels with a fixed query tile (128 rows;
    64 at head_dim 256 off the wgmma kernel), each block cut by its own length as deterministic prefill cuts it,
    a fixed DETERMINISTIC_SPLIT_CHUNKS merge slots per level (a row's states sit at the same slots in every batch,
    so the stacked merge's rounds are the same), the merge in its fixed order; not with use_cuda_graph yet.
    """

    DEFAULT_WORKSPACE = DEFAULT_WORKSPACE

    def __init__(self, num_levels, kv_layout="NHD", use_cuda_graph=False, max_batch_size=None, max_total_qo=None,
                 max_num_pages=None, workspace_bytes=None, num_sms=None, backend="auto", device=None,
                 deterministic=False):
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if deterministic and use_cuda_graph:
            raise ValueError("deterministic: not built with use_cuda_graph for cascade yet (its chunk counts would "
                             "have to be bounded by max_num_pages); use deterministic=True without graph mode")
        self.deterministic = bool(deterministic)
        self.num_levels = _v.as_int(num_levels, "num_levels", min_value=1)
        super().__init__(kv_layout, use_cuda_graph,
                         dict(max_batch_size=max_batch_size, max_total_qo=max_total_qo, max_num_pages=max_num_pages),
                         ("max_batch_size", "max_total_qo", "max_num_pages"), workspace_bytes, num_sms, device)
        self.backend = backend

    @on_device
    def plan(self, levels, page_tables=None, num_qo_heads=None, num_kv_heads=None, head_dim=None, *, causal=False,
             sm_scale=None, logits_soft_cap=0.0, q_dtype="bfloat16", kv_dtype=None, stream=None):
        """Schedule the levels (host arrays are read now).

        levels: a kvattn.CascadeLevels, or a list of num_levels qo_indptr arrays (int [G_l + 1]) with page_tables
        a list of kvattn.PageTable (G_l groups each). causal: bottom-right causal mask on the last level.
        kv_dtype: q's dtype or an fp8 type (run() then takes k_scale / v_scale).
        """
        lv = as_levels(levels, page_tables)
        if len(lv) != self.num_levels:
            raise ValueError(f"levels: this wrapper was built for num_levels={self.num_levels}, got {len(lv)}")
        for name, x in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if x is None:
                raise TypeError(f"{name}: required")
        hq, hkv, d, q_dtype, kv_dtype, _, cap = check_plan_args(num_qo_heads, num_kv_heads, head_dim, q_dtype,
                                                                 kv_dtype, -1, logits_soft_cap, fp8_kv=True)
        scale = (1.0 / math.sqrt(d)) if sm_scale is None else _v.as_float(sm_scale, "sm_scale")
        causal = bool(causal)
        group = hq // hkv
        total_qo = int(lv[0][0][-1])
        ps = lv.page_size
        shapes = []
        for li, (qo_indptr, pt) in enumerate(lv):
            qo = np.diff(qo_indptr).astype(np.int64)
            kv = pt.kv_lens.astype(np.int64)
            last = li == len(lv) - 1
            if causal and last and (kv < qo).any():
                i = int(np.argmax(kv < qo))
                raise ValueError(f"causal: the last level needs kv_len >= qo_len for every request; request {i} "
                                 f"has qo_len {int(qo[i])} > kv_len {int(kv[i])}")
            if self.use_cuda_graph:
                if qo.size > self.max_batch_size:
                    raise ValueError(f"levels[{li}]: {qo.size} groups exceed max_batch_size {self.max_batch_size}")
                if pt.indices.size > self.max_num_pages:
                    raise ValueError(f"levels[{li}]: {pt.indices.size} pages exceed max_num_pages "
                                     f"{self.max_num_pages}")
            shapes.append((qo, kv, causal and last))
        if self.use_cuda_graph and total_qo > self.max_total_qo:
            raise ValueError(f"levels: {total_qo} query rows exceed max_total_qo {self.max_total_qo}")
        variant, _ = plan_variant(None, hq, lv[-1][1].batch_size, cap > 0, False, False, None, None, None)

        # every level's query tile and kernel, then its chunk count (graph mode: those the first plan() baked)
        baked = self._baked if self.use_cuda_graph else None
        wide = d == 256 and baked is None and sm90_usable(self.backend, d, variant, q_dtype, kv_dtype)
        det = dict(split_tokens=DETERMINISTIC_SPLIT_TOKENS, max_split_chunks=DETERMINISTIC_SPLIT_CHUNKS) \
            if self.deterministic else {}
        if self.deterministic:   # a query tile that does not depend on the batch
            tiles = [128 if d != 256 or wide else 64] * len(shapes)
        else:
            tiles = (list(baked["cta_rows"]) if baked is not None else
                     [choose_cta_rows(qo.sum() * group / max(int(np.count_nonzero(qo)), 1), d, wide)
                      for qo, _, _ in shapes])
        cfgs = []
        kvil = tma.interleaved_tiles(PagedKV(self.kv_layout, ps, hkv, d, _dtypes.to_numpy(kv_dtype), 1), sm90_tile(d)[0])
        for rows in tiles:
            cfg = launch_config(self.backend, d, rows, variant, q_dtype, kv_dtype, kvil)
            get_kernel(cfg.spec)._allow_smem(cfg.smem)   # now, not during a graph capture
            cfgs.append(cfg)
        # a decode step's suffix level on the decode kernel, and where it applies, in one launch with level 0
        dk = (None if self.deterministic else   # (the decode kernel's bits differ from the prefill kernel's)
              self._decode_kernel(shapes[-1], len(lv), hq, hkv, d, q_dtype, kv_dtype, variant))
        mix = self._mixed_split(shapes, cfgs, dk, hq, hkv, d, kv_dtype) if dk is not None else None
        sms = [self.num_sms] * len(lv)   # the SMs each level is scheduled on
        if mix is not None and mix[1] is not None:   # (None: the decode CTAs after level 0's, both on every SM)
            sms[0], sms[-1] = mix[1], self.num_sms - mix[1]
        if self.deterministic:   # every row's states at the same slots whatever the batch (the merge's rounds)
            chunks = [DETERMINISTIC_SPLIT_CHUNKS] * len(shapes)
        else:
            chunks = (list(baked["chunks"]) if baked is not None else
                      [scheduler.cascade_chunks(qo, kv, group, hkv, rows, causal=c, num_sms=n,
                                                ctas_per_sm=cfg.ctas_per_sm)
                       for (qo, kv, c), rows, cfg, n in zip(shapes, tiles, cfgs, sms)])
        dec = None
        if dk is not None:
            dec = self._decode_level(dk, shapes[-1][1], hkv, d, ps, sms[-1], MAX_SUBS if mix else None)
            chunks[-1] = dec.pieces   # its requests' partial states: one slot per piece
        self._bake(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=ps,
                   sm_scale=scale, causal=causal, logits_soft_cap=cap, cta_rows=tuple(tiles), chunks=tuple(chunks))
        slots = sum(chunks)
        slot0 = np.cumsum([0] + chunks[:-1])

        # one plan buffer: every level's header, lengths, work list and pages
        items, offs, bases, caps = [], [], [], []
        pos = 0
        for li, ((qo, kv, c), rows) in enumerate(zip(shapes, tiles)):
            if dec is not None and li == len(lv) - 1:   # the decode kernel's plan, then the level's page table
                b, nnz = qo.size, lv[li][1].indices.size
                off = dict(plan=0, indptr=dec.layout.size, indices=dec.layout.size + align4(b + 1))
                off["last"] = off["indices"] + align4(max(nnz, 1))
                items.append(np.zeros((0, 8), np.int32))
                offs.append(off)
                bases.append(pos)
                caps.append(0)
                pos += off["last"] + align4(b)
                continue
            it = scheduler.plan_cascade_level(qo, kv, group, rows, chunks[li], slots, int(slot0[li]), causal=c,
                                              **det)
            if self.use_cuda_graph:
                nb = self.max_batch_size
                cap_w = scheduler.prefill_bounds(nb, self.max_total_qo, group, hkv, rows,
                                                 max_split_chunks=chunks[li])[0]
                cap_p = self.max_num_pages
            else:
                nb, cap_w, cap_p = qo.size, it.shape[0], lv[li][1].indices.size
            off, size = level_layout(nb, cap_w, 0, cap_p, None)
            items.append(it)
            offs.append(off)
            bases.append(pos)
            caps.append(cap_w)
            pos += size
        total_i32 = pos
        host = self._stage(total_i32 * 4)
        h = host.view(np.int32)
        for li, (qo_indptr, pt) in enumerate(lv):
            end = bases[li + 1] if li + 1 < len(lv) else total_i32
            if dec is not None and li == len(lv) - 1:
                o, b = offs[li], pt.batch_size
                h[bases[li]:end] = 0
                h[bases[li]:bases[li] + dec.layout.size] = dec.buffer
                # every request writes its state into its row's slot of the stacked merge (row = request: one
                # query row each), none to out
                wp = bases[li] + dec.layout.work_partial
                h[wp:wp + dec.work_req.size] = dec.work_req * slots + int(slot0[li]) + dec.work_piece
                h[bases[li] + o["indptr"]:bases[li] + o["indptr"] + b + 1] = pt.indptr
                h[bases[li] + o["indices"]:bases[li] + o["indices"] + pt.indices.size] = pt.indices
                h[bases[li] + o["last"]:bases[li] + o["last"] + b] = pt.last_page_len
                continue
            write_level(h[bases[li]:end], offs[li], items[li], pt.batch_size, qo_indptr, pt.kv_lens, pt.indptr,
                        pt.indices, num_kv_heads=hkv, num_partial_rows=total_qo * slots)
        h[bases[0] + NUM_MERGE] = total_qo   # the stacked merge's row count (read by the graph-mode merge)
        max_rows = self.max_total_qo if self.use_cuda_graph else total_qo
        regions = {
            "plan": ((total_i32,), "int32"),
            "tmp_o": ((max(max_rows * slots, 1), hq, d), "float32"),
            "tmp_lse": ((max(max_rows * slots, 1), hq), "float32"),
        }
        # requests of fewer pieces than the decode level's slots: those slots empty (lse = -inf), every row's at once
        fills = ([("tmp_lse", 4 * hq * int(slot0[-1]), 4 * hq * slots, NEG_INF_BITS, hq * dec.pieces, total_qo)]
                 if dec is not None and dec.partial_fill else [])
        dev, s, copy_done = self._upload(host, [("plan", 0, total_i32 * 4)], regions, stream,
                                         fills=fills if EMPTY_SLOTS_AT_PLAN else ())

        base = dev["plan"].ptr
        launches, params = [], []
        for li, cfg in enumerate(cfgs):
            if dec is not None and li == len(cfgs) - 1:
                at = base + 4 * bases[li]
                o = offs[li]
                p = decode_params(at, dec.layout, dev["tmp_o"].ptr, dev["tmp_lse"].ptr, at + 4 * o["indptr"],
                                  at + 4 * o["indices"], at + 4 * o["last"], hq=hq, group=group, page_size=ps,
                                  window_left=-1, z_split=dec.z_split, scale=scale, cap=cap, variant_ptr=0)
                params.append(p)
                if mix is None:
                    launches.append(Launch(dec.kernel, dec.grid, DECODE_THREADS, dec.smem, p))
                continue
            p = level_params(base + 4 * bases[li], offs[li], dev["tmp_o"].ptr, dev["tmp_lse"].ptr, 0, hq=hq,
                             group=group, page_size=ps, page_shift=page_size_shift(ps), causal=shapes[li][2],
                             window_left=-1, scale=scale, cap=cap, variant_ptr=0)
            params.append(p)
            launches.append(Launch(get_kernel(cfg.spec), launch_grid(cfg, caps[li], hkv, sms[li]),
                                   cfg.threads, cfg.smem, p)
                            if caps[li] and not (mix is not None and li == 0) else None)
        if not EMPTY_SLOTS_AT_PLAN:   # the same memset before every run()'s launches
            launches[:0] = fill_steps(dev, fills)
        if mix is not None:   # level 0's CTAs, then the decode level's warpgroups, in one grid
            pre_ctas = launch_grid(cfgs[0], caps[0], hkv, sms[0])[0] if caps[0] else 0
            launches.append(mixed_launch(mix[0], params[0], pre_ctas, cfgs[0].smem, params[-1], dec.grid, dec.smem,
                                         MAX_SUBS))
        mp = ParamBuffer(MERGE_PARAMS)
        mp.set(o_in=dev["tmp_o"].ptr, lse_in=dev["tmp_lse"].ptr, indptr=0, out_rows=0,
               num_rows_dev=base + NUM_MERGE * 4 if self.use_cuda_graph else 0,
               s_row=slots * hq * d, s_n=hq * d, s_h=d, l_row=slots * hq, l_n=hq, l_h=1,
               num_rows=0 if self.use_cuda_graph else total_qo,   # (graph mode: the header's count, read on replay)
               n=slots, num_heads=hq, head_dim=d, variant_data=0)
        merge = (Launch(get_kernel(merge_spec("float32", q_dtype, Variant())), -(-max_rows * hq * (d // 8) // 256),
                        256, 0, mp) if max_rows else None)
        pages = max((int(pt.indices.max(initial=-1)) + 1 for _, pt in lv), default=0)
        kv = PagedKV(self.kv_layout, ps, hkv, d, _dtypes.to_numpy(kv_dtype), pages)
        maps = tma.attach(kv, [p for li, (p, cfg) in enumerate(zip(params, cfgs))
                               if cfg.backend == "sm90" and not (dec is not None and li == len(cfgs) - 1)],
                          sm90_tile(d)[0], interleaved=kvil)
        return self._finish_plan(
            rows=total_qo, max_rows=max_rows, hq=hq, d=d, dtype=q_dtype, kv=kv, launch=launches, params=params,
            merge=merge, merge_params=mp, s=s, copy_done=copy_done, bind_tma=tma.binder(None, maps),
            levels=tuple(dict(cta_rows=rows, chunks=n, backend=cfg.backend, items=it.shape[0])
                         if not (dec is not None and li == len(tiles) - 1) else
                         dict(cta_rows=16 * dec.m_tiles, chunks=dec.pieces, backend="decode", items=dec.work_req.size,
                              partial_fill=dec.partial_fill,
                              mixed_with_level_0=mix is not None, after_level_0=mix is not None and mix[1] is None,
                              sms=sms[-1])
                         for li, (rows, n, cfg, it) in enumerate(zip(tiles, chunks, cfgs, items))),
            slots=slots, variant=variant, num_kv_heads=hkv)

    def _decode_kernel(self, shape, num_levels, hq, hkv, d, q_dtype, kv_dtype, variant):
        """(decode kernel, m tiles, z slices, shared memory) for the last level, or None where it stays on
        the prefill kernels: unless every group of it is one query row with KV (a decode step's suffix level,
        below at least one shared level), outside graph mode, with backend "auto". Its CTAs stream the level's
        KV at the decode kernel's rate, where the 16-row prefill tile did not (BENCHMARKS.md)."""
        qo, kv, _ = shape
        if (num_levels < 2 or self.use_cuda_graph or self.backend != "auto" or qo.size == 0 or (qo != 1).any()
                or (kv < 1).any()):
            return None
        group = hq // hkv
        mt = auto_m_tiles(group, d, kv_dtype, variant)
        stages = default_stages(d, kv_dtype)
        kernel = get_kernel(decode_spec(d, mt, variant, q_dtype, stages, kv_dtype=kv_dtype))
        return kernel, mt, -(-group // (16 * mt)), decode_smem_bytes(d, mt, stages, kv_dtype)

    def _mixed_split(self, shapes, cfgs, dk, hq, hkv, d, kv_dtype):
        """(mixed kernel, SMs for level 0) where level 0 (the persistent wgmma kernel) and the decode level run
        in one launch (cuda_src/mixed.cuh: level 0's CTAs on some SMs, three decode warpgroups per CTA on the
        others; the split: mixed_choice), or None: 16-bit caches, decode warpgroups that fit one CTA's shared
        memory, a kernel without spills, and a predicted gain over two launches (mixed_choice). With
        DECODE_AFTER_LEVEL_0, where no split pays: (mixed kernel, None), the decode CTAs after level 0's."""
        cfg0 = cfgs[0]
        kernel, _, _, smem = dk
        if cfg0.backend != "sm90" or not cfg0.persistent or _dtypes.to_numpy(kv_dtype).itemsize != 2:
            return None
        best = mixed_choice(shapes[0][0], shapes[0][1], shapes[-1][1], hq, hkv, d, self.num_sms, cfg0.ctas_per_sm)
        if best is None and not DECODE_AFTER_LEVEL_0:
            return None
        mk = mixed_kernel(cfg0.spec, kernel.spec, cfg0.smem, smem, MAX_SUBS)
        return (mk, best) if mk is not None else None

    def _decode_level(self, dk, kv, hkv, d, page_size, num_sms, ctas_per_sm):
        """The decode level's schedule (a _DecodeLevel) on num_sms SMs: one wave of balanced chunks (a request may
        be cut into pieces, each writing its own merge slot of the row; the level's slot count is the most
        pieces of a request)."""
        kernel, mt, z_split, smem = dk
        cps = ctas_per_sm or (kernel.resources or Resources()).ctas_per_sm(DECODE_THREADS, smem, limit=3)
        plan = scheduler.plan_decode(kv, page_size, hkv * z_split, hkv * z_split, d, num_sms=num_sms,
                                     ctas_per_sm=cps, allow_no_split=False)
        piece, counts = request_pieces(plan.work_req, kv.size)
        most = int(counts.max(initial=1))
        return _DecodeLevel(plan.layout, plan.buffer, plan.work_req.copy(), piece, most,
                            bool((counts < most).any()), kernel, (plan.num_chunks * z_split, hkv, 1), smem, z_split,
                            mt)

    @on_device
    def run(self, q, k_cache, v_cache=None, out=None, lse=None, return_lse=False, stream=None, k_scale=None,
            v_scale=None):
        """q: [total_qo, Hq, D]; caches as BatchPrefillWithPagedKVCache.run (NHD / HND, or one [pages, 2, ...]
        array). out: [total_qo, Hq, D] in q's dtype; lse: [total_qo, Hq] float32, natural log (graph mode: the
        arrays may keep max_total_qo rows). Returns out, or (out, lse) with return_lse. Capturable when every
        array is a device array and out (and lse) are given."""
        p, s, capturing = self._begin_run(stream)
        q = import_array(q, s, capturing)
        k, v, kv_strides = p.kv.bind(k_cache, v_cache, s, capturing)
        return self._execute(p, s, capturing, q, k, v, kv_strides, out, lse, return_lse, k_scale, v_scale)
