"""Decode split-KV scheduler: plain Python + numpy, run on the host once per step by ``plan()``.

Kernel model
------------
Decode attends one query token per request to kv positions ``[0, kv_len)``.  The attention kernel
is launched with grid ``(num_chunks, num_kv_heads)``; CTA ``(c, h)`` processes, for KV head ``h``
and all query heads of its GQA group, the work items ``[chunk_indptr[c], chunk_indptr[c+1])``.
Work item ``w`` is ``(work_req[w], work_begin[w], work_end[w], work_partial[w])``: the request,
the token range ``[begin, end)`` inside it (never empty) and the partial row.  ``-1`` means the
item covers the whole request and writes the final output row directly; otherwise it writes
``(o, lse)`` into row ``work_partial[w]`` of a float32 temp buffer.  The merge (the merge kernel
after the decode launch, or inside it the last CTA of the request's pieces) then combines, for
``m in [0, num_merge)``, the rows ``[merge_indptr[m], merge_indptr[m+1])`` (in kv order) into the
output of request ``merge_req[m]``.  Requests with ``kv_len == 0`` are in the
merge list with an empty range (output 0, lse -inf); a request covered by a single whole item is
not.  So every request is written by exactly one item or by the merge kernel, never both.

Schedule
--------
Every non-empty request is a segment of the *cost line*: ``ITEM_OVERHEAD_TOKENS`` (the fixed
cost of one work item: query load, output / partial write, pipeline start) followed by its
``kv_len`` tokens.  Requests with ``kv_len == 0`` have no segment and produce no work item.

* **No split** (uniform, big batches): when the ``n`` non-empty requests already fill the GPU
  (``n * num_kv_heads >= num_sms * ctas_per_sm``), the largest cost is at most
  ``NO_SPLIT_BALANCE`` (1.1) times the mean, and ``n`` CTAs fit the grid bound ``max_chunks``,
  every chunk is one whole request: ``active_chunks = n``, no partial rows, and the merge list
  holds only the empty requests (so the merge launch can be skipped when there are none).
* **Split** otherwise: ``C = max(1, floor(num_sms * ctas_per_sm / num_kv_heads))`` chunks (one wave of
  CTAs), capped by ``max_chunks`` and by ``total_cost // MIN_CHUNK_COST`` (at least 1) so tiny
  batches are not shredded into chunks smaller than ``MIN_CHUNK_TOKENS``.  The cost line is cut
  at ``k * total / C`` (``cumsum`` + ``searchsorted``, no per-request loop).  A cut inside a
  request is rounded to the nearest multiple of the cut granularity ``G`` (token offset inside the
  request); a cut that falls in a request's overhead or rounds to ``<= 0`` moves to the request's
  start, one that rounds to ``>= kv_len`` moves to its end, so no item is empty.  Cuts are
  monotone, so a chunk may be empty (its CTA exits at once).

Cut granularity ``G = max(16, gcd(page_size, 64))``, the largest power of two <= 64 that divides
the page size, at least 16 (one tensor-core k-tile).  Pages of 16, 32 or 64 tokens: ``G`` is the
page, so every chunk starts on a page boundary; larger power-of-two pages: 64, which keeps the
balance error small; small or odd pages: 16.  Every item begins at 0 or at a multiple of ``G`` and
ends at ``kv_len`` or at a multiple of ``G``.

Balance bound (split path): the cost of a chunk (sum over its items of ``end - begin +
ITEM_OVERHEAD_TOKENS``) is at most ``ceil(total / C) + G + ITEM_OVERHEAD_TOKENS`` where
``total`` is the cost line length; the mean over the ``C`` active chunks is at least
``total / C``.  Each cut moves by at most ``G / 2`` right and ``G / 2 + ITEM_OVERHEAD_TOKENS`` left
(the latter either by snapping to a request start or by adding the overhead of the new item).

CUDA graphs
-----------
With ``max_batch_size`` (and optionally ``max_chunks``, default one wave
``max(1, floor(num_sms * ctas_per_sm / num_kv_heads))``: a ceiling would start a second, nearly empty
wave of CTAs, measured at half speed on the H200) the packed layout is fixed by the bounds, not by
the batch: ``max_work = max_batch_size + max_chunks`` (each cut adds at most one item),
``max_merge = max_batch_size``, and ``num_chunks`` (the grid) is always ``max_chunks``; chunks
past ``active_chunks`` have empty ranges.  In graph mode the merge kernel is part of the captured
graph anyway, so the no-split path is only taken when it fits ``max_chunks`` CTAs.

Packed buffer
-------------
``plan_decode`` writes one int32 host buffer (``DecodeLayout.size`` elements) that is copied to
the device in one copy.  Regions, each starting at a multiple of 4 int32 (16 bytes):
``header[8]`` (kvattn.contract.PLAN_HEADER: num_items = work items, num_merge, batch_size, num_partial_rows,
num_chunks),
``chunk_indptr[max_chunks + 1]`` (padded with its last value), ``work_req``, ``work_begin``,
``work_end``, ``work_partial`` (``max_work`` each), ``merge_indptr[max_merge + 1]`` (padded with
its last value), ``merge_req[max_merge]``.  Unused work / merge slots hold ``work_req = -1``,
``merge_req = -1`` and 0 elsewhere.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from .contract import HEADER_INT32, align4, write_header

__all__ = [
    "ITEM_OVERHEAD_TOKENS",
    "MIN_CHUNK_TOKENS",
    "MIN_CHUNK_COST",
    "NO_SPLIT_BALANCE",
    "HEADER_SIZE",
    "DecodeLayout",
    "DecodePlan",
    "cut_granularity",
    "decode_layout",
    "default_num_chunks",
    "graph_layout",
    "plan_size_bound",
    "plan_decode",
    "merge_lists",
]

#: Fixed cost of one work item, in kv-token equivalents (query load, output or partial write,
#: pipeline fill).  Added to every item's token count when balancing.
ITEM_OVERHEAD_TOKENS = 32
#: Smallest chunk the split path aims for, in tokens; caps the chunk count for tiny batches.
MIN_CHUNK_TOKENS = 128
#: The same in cost units (tokens + one item's overhead).
MIN_CHUNK_COST = MIN_CHUNK_TOKENS + ITEM_OVERHEAD_TOKENS
#: The no-split path is taken only when max request cost <= NO_SPLIT_BALANCE * mean cost.
NO_SPLIT_BALANCE = 1.1
#: int32 elements of the header region (kvattn.contract.PLAN_HEADER).
HEADER_SIZE = HEADER_INT32

_INT32_MAX = 2**31 - 1


def cut_granularity(page_size: int) -> int:
    """Token granularity of cuts inside a request: ``max(16, gcd(page_size, 64))``."""
    return max(16, math.gcd(int(page_size), 64))


@dataclass(frozen=True)
class DecodeLayout:
    """Offsets (in int32 elements) of the regions of the packed plan buffer."""

    max_chunks: int
    max_work: int
    max_merge: int
    header: int
    chunk_indptr: int
    work_req: int
    work_begin: int
    work_end: int
    work_partial: int
    merge_indptr: int
    merge_req: int
    size: int

    @property
    def nbytes(self) -> int:
        return self.size * 4


@functools.lru_cache(maxsize=4096)
def decode_layout(max_chunks: int, max_work: int, max_merge: int) -> DecodeLayout:
    """Layout holding ``max_chunks`` chunks, ``max_work`` work items and ``max_merge`` merges."""
    for name, v in (("max_chunks", max_chunks), ("max_work", max_work), ("max_merge", max_merge)):
        if type(v) is not int or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    off = HEADER_SIZE
    chunk = off
    off += align4(max_chunks + 1)
    wreq = off
    off += align4(max_work)
    wbeg = off
    off += align4(max_work)
    wend = off
    off += align4(max_work)
    wpart = off
    off += align4(max_work)
    mind = off
    off += align4(max_merge + 1)
    mreq = off
    off += align4(max_merge)
    return DecodeLayout(max_chunks, max_work, max_merge, 0, chunk, wreq, wbeg, wend, wpart,
                        mind, mreq, off)


@functools.lru_cache(maxsize=4096)
def _template(layout: DecodeLayout) -> np.ndarray:
    """Buffer image of an empty plan: zeros, with -1 in the unused request slots."""
    t = np.zeros(layout.size, np.int32)
    t[layout.work_req:layout.work_req + layout.max_work] = -1
    t[layout.merge_req:layout.merge_req + layout.max_merge] = -1
    t.flags.writeable = False
    return t


@dataclass(frozen=True)
class DecodePlan:
    """Result of :func:`plan_decode`: scalars plus the packed int32 ``buffer``.

    ``num_chunks`` is the grid x to launch (``max_chunks`` in graph mode); ``active_chunks`` the
    chunks that may hold work (the rest have empty ranges).  The array properties are views into
    ``buffer``: ``chunk_indptr`` has ``num_chunks + 1`` entries, the ``work_*`` arrays
    ``num_work``, ``merge_indptr`` ``num_merge + 1`` and ``merge_req`` ``num_merge``.
    """

    num_chunks: int
    num_work: int
    num_merge: int
    num_partial_rows: int
    split: bool
    batch_size: int
    active_chunks: int
    granularity: int
    graph: bool
    layout: DecodeLayout
    buffer: np.ndarray

    @property
    def header(self) -> np.ndarray:
        return self.buffer[:HEADER_SIZE]

    @property
    def chunk_indptr(self) -> np.ndarray:
        o = self.layout.chunk_indptr
        return self.buffer[o:o + self.num_chunks + 1]

    @property
    def work_req(self) -> np.ndarray:
        o = self.layout.work_req
        return self.buffer[o:o + self.num_work]

    @property
    def work_begin(self) -> np.ndarray:
        o = self.layout.work_begin
        return self.buffer[o:o + self.num_work]

    @property
    def work_end(self) -> np.ndarray:
        o = self.layout.work_end
        return self.buffer[o:o + self.num_work]

    @property
    def work_partial(self) -> np.ndarray:
        o = self.layout.work_partial
        return self.buffer[o:o + self.num_work]

    @property
    def merge_indptr(self) -> np.ndarray:
        o = self.layout.merge_indptr
        return self.buffer[o:o + self.num_merge + 1]

    @property
    def merge_req(self) -> np.ndarray:
        o = self.layout.merge_req
        return self.buffer[o:o + self.num_merge]


class _Config(NamedTuple):
    gran: int
    slots: int  # num_sms * ctas_per_sm
    num_kv_heads: int
    c_target: int  # chunk count of the split path before the small-batch cap
    max_chunks: Optional[int]
    graph_layout: Optional[DecodeLayout]
    max_batch_size: Optional[int]


def _as_int(name: str, v, minimum: int) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool {v!r}")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}") from None
    if i < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {i}")
    if i > _INT32_MAX:
        raise ValueError(f"{name} must fit int32, got {i}")
    return int(i)


@functools.lru_cache(maxsize=256)
def _config(page_size, num_qo_heads, num_kv_heads, head_dim, num_sms, ctas_per_sm,
            max_batch_size, max_chunks, max_work=None) -> _Config:
    # Called only with exact Python ints / None (see plan_decode), so the cache keys are exact.
    page_size = _as_int("page_size", page_size, 1)
    num_qo_heads = _as_int("num_qo_heads", num_qo_heads, 1)
    num_kv_heads = _as_int("num_kv_heads", num_kv_heads, 1)
    head_dim = _as_int("head_dim", head_dim, 1)
    num_sms = _as_int("num_sms", num_sms, 1)
    ctas_per_sm = _as_int("ctas_per_sm", ctas_per_sm, 1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if max_batch_size is not None:
        max_batch_size = _as_int("max_batch_size", max_batch_size, 1)
    if max_chunks is not None:
        max_chunks = _as_int("max_chunks", max_chunks, 1)
    slots = num_sms * ctas_per_sm
    c_target = max(1, slots // num_kv_heads)
    if max_batch_size is not None and max_chunks is None:
        max_chunks = c_target
    if max_chunks is not None:
        c_target = min(c_target, max_chunks)
    layout = None
    if max_batch_size is not None:
        layout = decode_layout(max_chunks, max(max_work or 0, max_batch_size + max_chunks), max_batch_size)
    return _Config(cut_granularity(page_size), slots, num_kv_heads, c_target, max_chunks,
                   layout, max_batch_size)


def default_num_chunks(num_kv_heads: int, *, num_sms: int = 132, ctas_per_sm: int = 2) -> int:
    """Chunk count of the split path: one wave, ``max(1, floor(num_sms * ctas_per_sm / num_kv_heads))``."""
    slots = _as_int("num_sms", num_sms, 1) * _as_int("ctas_per_sm", ctas_per_sm, 1)
    return max(1, slots // _as_int("num_kv_heads", num_kv_heads, 1))


def graph_layout(max_batch_size: int, num_kv_heads: int, *, num_sms: int = 132,
                 ctas_per_sm: int = 2, max_chunks: Optional[int] = None,
                 max_work: Optional[int] = None) -> DecodeLayout:
    """The fixed layout :func:`plan_decode` uses in graph mode with these bounds (``max_work``: at least this
    many items, for fixed-size splits: :func:`fixed_split_items`).

    Size the pinned host buffer and the device region with it at construction.
    """
    mbs = _as_int("max_batch_size", max_batch_size, 1)
    if max_chunks is None:
        mc = default_num_chunks(num_kv_heads, num_sms=num_sms, ctas_per_sm=ctas_per_sm)
    else:
        mc = _as_int("max_chunks", max_chunks, 1)
    return decode_layout(mc, max(max_work or 0, mbs + mc), mbs)


def plan_size_bound(batch_size: int, num_kv_heads: int, *, num_sms: int = 132,
                    ctas_per_sm: int = 2, max_chunks: Optional[int] = None, max_work: int = 0) -> int:
    """int32 elements that hold any plan of ``batch_size`` requests outside graph mode (``max_work``: at least
    this many items)."""
    b = _as_int("batch_size", batch_size, 0)
    c = default_num_chunks(num_kv_heads, num_sms=num_sms, ctas_per_sm=ctas_per_sm)
    if max_chunks is not None:
        c = min(c, _as_int("max_chunks", max_chunks, 1))
    return decode_layout(max(b, c, 1), max(max_work, b + c), b).size


def fixed_split_items(total_tokens: int, batch_size: int, split_tokens: int) -> int:
    """An upper bound of the items of a fixed-split plan (``split_tokens``) of ``batch_size`` requests holding
    ``total_tokens`` tokens in all: each request's ceil(kv / split) <= kv // split + 1."""
    return total_tokens // split_tokens + batch_size


def _as_kv_lens(kv_lens):
    """Validated kv_lens as int64, and its max (0 when empty)."""
    kv = kv_lens if type(kv_lens) is np.ndarray else np.asarray(kv_lens)
    if kv.ndim != 1:
        raise ValueError(f"kv_lens must be 1-D, got shape {kv.shape}")
    dt = kv.dtype
    kind = dt.kind
    if kind not in "iu":
        if kv.size == 0 and kind in "fO":  # np.asarray([]) is float64
            return _EMPTY, 0
        raise TypeError(f"kv_lens must hold integers, got dtype {dt}")
    if kv.size == 0:
        return _EMPTY, 0
    # One reduction checks both bounds: a negative value is huge when read as unsigned.
    if kind == "i":
        top = int(kv.view(_UNSIGNED[dt.itemsize]).max())
    else:
        top = int(kv.max())
    if top > _INT32_MAX:
        lo = int(kv.min())
        if lo < 0:
            raise ValueError(f"kv_lens must be non-negative, got min {lo}")
        raise ValueError(f"kv_lens must fit int32, got max {int(kv.max())}")
    return kv.astype(np.int64, copy=False), top


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _check_out(out, layout: DecodeLayout) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy int32 array, got {type(out).__name__}")
    if out.dtype != np.int32:
        raise TypeError(f"out must have dtype int32, got {out.dtype}")
    if out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a 1-D contiguous int32 array, got shape {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    if out.size < layout.size:
        raise ValueError(
            f"out is too small: the plan needs {layout.size} int32 elements "
            f"({layout.size * 4} bytes), out has {out.size}")
    return out[:layout.size]


_EMPTY = np.zeros(0, np.int64)
_EMPTY.flags.writeable = False
_IOTA = np.arange(1024, dtype=np.int64)
_IOTA.flags.writeable = False


def _iota(n: int) -> np.ndarray:
    """0 .. n-1 as a read-only int64 view (no allocation for the common sizes)."""
    global _IOTA
    if n > _IOTA.size:
        _IOTA = np.arange(max(n, 2 * _IOTA.size), dtype=np.int64)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


def merge_lists(counts: np.ndarray, outputs: np.ndarray, out_indptr=None):
    """The merge lists of a reduction of partial states (split-KV decode and prefill now; cascade levels and
    context-parallel shards next): output row outputs[m] combines the counts[m] consecutive partial rows
    [indptr[m], indptr[m + 1]). counts, outputs: int [M]. Returns (indptr int32 [M + 1], rows int32 [M]);
    out_indptr: a caller's int32 [M + 1] view (e.g. the plan buffer) to write indptr into."""
    m = len(counts)
    indptr = np.empty(m + 1, np.int32) if out_indptr is None else out_indptr
    indptr[0] = 0
    np.cumsum(counts, out=indptr[1:])
    return indptr, np.asarray(outputs, np.int32)


def _ideal_cuts(total: int, C: int) -> np.ndarray:
    """``floor(k * total / C)`` for ``k = 1 .. C-1`` (int64, exact, no overflow)."""
    k = _iota(C)[1:]
    if C * total < 2**62:
        t = k * total
        t //= C
        return t
    q, r = divmod(total, C)  # k * q <= total and k * r < C * C: both fit int64
    t = k * r
    t //= C
    t += k * q
    return t


def _fixed_split(kv, nz_idx, nz_start, split: int, c_max: int, overhead: int):
    """(item starts: global token positions, chunk cuts: indices into the work list, chunks, work order) of the
    batch-invariant schedule: request i's items start at its tokens 0, split, 2 split, ...; the items are dealt
    to at most c_max chunks, largest first, in serpentine rounds (a chunk's items never change an item's result,
    so any grouping keeps the bits): every chunk within one item of its equal share, where consecutive runs of a
    skewed batch's items could not be (a long request's full items would pile into a few runs). Work order: the
    permutation of the items (canonical: request order, then token order) that lists each chunk's items
    together; None with one chunk (the canonical order)."""
    lens = kv if nz_idx is None else kv[nz_idx]
    per = (lens + split - 1) // split                        # items of each non-empty request
    first = np.repeat(nz_start, per)                         # each item's request start
    k = _iota(int(per.sum())) - np.repeat(per.cumsum() - per, per)
    starts = first + k * split
    w = starts.size
    ends = np.append(starts[1:], int(nz_start[-1] + lens[-1]))   # requests are adjacent on the token line
    c = max(1, min(c_max, w))
    if c == 1:
        return starts, _EMPTY, 1, None
    cost = ends - starts + overhead
    ranked = np.argsort(-cost, kind="stable")                 # largest first
    pos = _iota(w)
    chunk = pos % c
    back = (pos // c) & 1 == 1
    chunk[back] = c - 1 - chunk[back]                         # serpentine: 0 .. c-1, then c-1 .. 0, ...
    item_chunk = np.empty(w, np.int64)
    item_chunk[ranked] = chunk
    order = np.argsort(item_chunk, kind="stable")             # each chunk's items together, in canonical order
    cuts = np.bincount(item_chunk, minlength=c).cumsum()[:-1]
    return starts, cuts, c, order


def plan_decode(kv_lens, page_size, num_qo_heads, num_kv_heads, head_dim, *, num_sms=132,
                ctas_per_sm=2, max_batch_size=None, max_chunks=None, out=None,
                allow_no_split=True, split_tokens=None, max_work=None, min_chunk_tokens=None,
                item_overhead=None) -> DecodePlan:
    """Schedule a decode batch with per-request kv lengths ``kv_lens`` (see the module doc).

    ``max_batch_size`` (optionally with ``max_chunks``) selects graph mode: the buffer layout
    and the grid are fixed by the bounds.  Without it ``max_chunks`` only caps the chunk count
    and the layout is sized from the plan.  ``out``: a caller's 1-D int32 buffer (e.g. pinned
    host memory) of at least ``layout.size`` elements that receives the packed plan (the plan's
    ``buffer`` is then ``out[:layout.size]``); otherwise a new array is allocated.
    ``head_dim`` is validated but does not change the schedule.  ``allow_no_split=False`` always takes
    the split path (one wave of CTAs), for kernels that pipeline across the items of a chunk.
    ``split_tokens`` (a multiple of the cut granularity) is the batch-invariant schedule: every request is cut
    at the multiples of ``split_tokens`` of its own tokens, whatever the batch, so its items, partial states and
    merge order depend on its length alone; the items are then dealt to balanced chunks. ``max_work`` (graph
    mode): the item bound of the fixed layout (see :func:`fixed_split_items`). ``min_chunk_tokens``: the split
    path's smallest chunk (None: MIN_CHUNK_TOKENS; a decode tuning knob for small batches). ``item_overhead``:
    a request's fixed cost on the cost line in tokens (None: ITEM_OVERHEAD_TOKENS; a kernel whose tokens cost less,
    as an fp8 cache's, counts more of them a request).
    """
    t = int
    if (type(page_size) is t and type(num_qo_heads) is t and type(num_kv_heads) is t
            and type(head_dim) is t and type(num_sms) is t and type(ctas_per_sm) is t
            and (max_batch_size is None or type(max_batch_size) is t)
            and (max_chunks is None or type(max_chunks) is t)):
        cfg = _config(page_size, num_qo_heads, num_kv_heads, head_dim, num_sms, ctas_per_sm,
                      max_batch_size, max_chunks, max_work)
    else:
        cfg = _config(
            _as_int("page_size", page_size, 1), _as_int("num_qo_heads", num_qo_heads, 1),
            _as_int("num_kv_heads", num_kv_heads, 1), _as_int("head_dim", head_dim, 1),
            _as_int("num_sms", num_sms, 1), _as_int("ctas_per_sm", ctas_per_sm, 1),
            None if max_batch_size is None else _as_int("max_batch_size", max_batch_size, 1),
            None if max_chunks is None else _as_int("max_chunks", max_chunks, 1),
            None if max_work is None else _as_int("max_work", max_work, 1))
    min_cost = MIN_CHUNK_COST
    if min_chunk_tokens is not None:
        min_cost = _as_int("min_chunk_tokens", min_chunk_tokens, 16) + ITEM_OVERHEAD_TOKENS
    if split_tokens is not None:
        split_tokens = _as_int("split_tokens", split_tokens, 1)
        if split_tokens % cfg.gran:
            raise ValueError(f"split_tokens must be a multiple of the cut granularity {cfg.gran}, got {split_tokens}")

    kv, kv_max = _as_kv_lens(kv_lens)
    B = kv.size
    if cfg.max_batch_size is not None and B > cfg.max_batch_size:
        raise ValueError(f"batch size {B} exceeds max_batch_size {cfg.max_batch_size}")
    OV = ITEM_OVERHEAD_TOKENS if item_overhead is None else _as_int("item_overhead", item_overhead, 0)

    # Outputs of the scheduling step (consumed by the packing step below):
    #   C active chunks, W items; req / begin / end of the items (begin None = all zeros,
    #   starts/base set = begin is starts - base and end the next start - base);
    #   cuts = chunk_indptr[1:C] (None = 1..C-1, one item per chunk);
    #   merge_req (None = every request), rows, cnt (items per request
    #   when some request has several, else None).
    cnt = starts = order = None
    rows = 0
    if kv_max == 0:
        # Nothing to attend to: every request (if any) is an empty merge.
        C = 1
        W = 0
        req = end = cuts = merge_req = None
        num_merge = B
    else:
        nz = kv > 0
        n = int(np.count_nonzero(nz)) if B > 1 else 1
        cap = cfg.max_chunks
        if n == B:
            cost_end = kv.cumsum()
            cost_end += _iota(B + 1)[1:] * OV
        else:
            cost = kv + OV
            cost *= nz  # 0 for empty requests
            cost_end = cost.cumsum()
        total = int(cost_end[-1])
        if (split_tokens is None and allow_no_split and n * cfg.num_kv_heads >= cfg.slots
                and (cap is None or n <= cap)
                and (kv_max + OV) * n <= NO_SPLIT_BALANCE * total):
            # ---- no split: one whole request per chunk ---------------------------------
            C = W = n
            cuts = None
            if n == B:
                req = _iota(B)
                end = kv
                merge_req = _EMPTY
            else:
                req = nz.nonzero()[0]
                end = kv[req]
                merge_req = (~nz).nonzero()[0]
            num_merge = B - n
        else:
            # ---- split: equal-cost cuts of the concatenated cost line ------------------
            C = min(cfg.c_target, max(1, total // min_cost))
            G = cfg.gran
            tok_start = kv.cumsum()
            ntok = int(tok_start[-1])
            tok_start -= kv  # exclusive prefix sum: first global token of each request
            if n == B:
                nz_idx = None
                nz_start = tok_start
            else:
                nz_idx = nz.nonzero()[0]
                nz_start = tok_start[nz_idx]
            if split_tokens is not None:
                starts, cuts, C, order = _fixed_split(kv, nz_idx, nz_start, split_tokens, C, OV)
            elif C > 1:
                tcut = _ideal_cuts(total, C)
                ci = cost_end.searchsorted(tcut, side="right")  # request holding each cut
                kvi = kv[ci]
                # token offset of the cut inside request ci (cost_end - kv is its first token
                # on the cost line), rounded to the nearest multiple of G, clamped to
                # [0, kv_len]: a cut in the overhead or near an end moves to the boundary.
                tcut -= cost_end[ci]
                tcut += kvi
                tcut += G // 2
                tcut &= -G
                np.maximum(tcut, 0, out=tcut)
                np.minimum(tcut, kvi, out=tcut)
                tcut += tok_start[ci]  # global token position of every cut (monotone)
                # item starts: request starts and cuts, sorted, without duplicates (cuts may
                # coincide with each other or with request boundaries)
                starts = np.concatenate((nz_start, tcut))
                starts.sort()
                # (a cut never reaches ntok: the last chunk spans >= min_cost > G / 2)
                keep = np.empty(starts.size, bool)
                keep[0] = True
                np.not_equal(starts[1:], starts[:-1], out=keep[1:])
                starts = starts[keep]
                cuts = starts.searchsorted(tcut, side="left")
            else:
                starts = nz_start
                cuts = _EMPTY
            W = starts.size
            # owning request of each item, as an index into the non-empty requests
            owner = nz_start.searchsorted(starts, side="right")
            owner -= 1
            req = owner if nz_idx is None else nz_idx[owner]
            base = tok_start[req]
            if W == n:
                # no cut inside a request: only empty requests merge
                merge_req = _EMPTY if n == B else (~nz).nonzero()[0]
                num_merge = B - n
            else:
                cnt = np.bincount(req, minlength=B)
                merge_req = (cnt != 1).nonzero()[0]
                num_merge = merge_req.size
                rows = int(cnt[merge_req].sum())

    # ---- packing into the int32 buffer ------------------------------------------------------
    graph = cfg.graph_layout is not None
    if graph:
        layout = cfg.graph_layout
        grid = layout.max_chunks
    else:
        layout = decode_layout(C, W, num_merge)
        grid = C
    buf = np.empty(layout.size, np.int32) if out is None else _check_out(out, layout)
    buf[:] = _template(layout)
    write_header(buf, num_items=W, num_merge=num_merge, batch_size=B, num_partial_rows=rows, num_chunks=grid)

    o = layout.chunk_indptr
    if cuts is None:
        if W:
            buf[o + 1:o + C] = _iota(C)[1:]
    elif C > 1:
        buf[o + 1:o + C] = cuts
    buf[o + C:o + layout.max_chunks + 1] = W

    if W:
        buf[layout.work_req:layout.work_req + W] = req
        o = layout.work_end
        ev = buf[o:o + W]
        if starts is None:  # whole requests: begin 0 (template), end kv_len
            ev[:] = end
        else:
            np.subtract(starts, base, out=buf[layout.work_begin:layout.work_begin + W])
            if ntok <= _INT32_MAX:
                ev[:-1] = starts[1:]
                ev[-1] = ntok
                np.subtract(ev, base, out=ev)
            else:  # global token positions overflow int32: subtract in int64
                e64 = np.append(starts[1:], ntok)
                e64 -= base
                ev[:] = e64
        wp = buf[layout.work_partial:layout.work_partial + W]
        if rows:
            split_item = cnt[req] > 1
            np.add.accumulate(split_item, dtype=np.int32, out=wp)
            wp -= 1
            wp[~split_item] = -1
        else:
            wp.fill(-1)
        if order is not None:   # the items listed chunk by chunk (partial rows stay those of the canonical order)
            for region in (layout.work_req, layout.work_begin, layout.work_end, layout.work_partial):
                buf[region:region + W] = buf[region:region + W][order]

    o = layout.merge_indptr
    if merge_req is None:
        # every request is empty: merge_req = 0..B-1 with empty ranges (template zeros)
        buf[layout.merge_req:layout.merge_req + B] = _iota(B)
    elif num_merge:
        buf[layout.merge_req:layout.merge_req + num_merge] = merge_req
        if rows:
            merge_lists(cnt[merge_req], merge_req, out_indptr=buf[o:o + num_merge + 1])
            buf[o + num_merge + 1:o + layout.max_merge + 1] = rows
    return DecodePlan(grid, W, num_merge, rows, rows > 0, B, C, cfg.gran, graph, layout, buf)


# =================================================================================================
# Prefill / append
# =================================================================================================
"""Prefill scheduler (``plan_prefill``).

Kernel model: the prefill kernel runs one *work item* per CTA for one KV head (grid ``(items, Hkv)``).  An
item is ``(req, row0, nrows, kv_begin, kv_end, partial, pstride, 0)`` (8 int32): packed query rows
``[row0, row0 + nrows)`` of request ``req`` (packed row ``p`` is query token ``p // group`` and head
``p % group`` of the KV head's group: head-group fusion) against KV tokens ``[kv_begin, kv_end)``.

Blocks: a request's queries are cut into blocks of ``tpb = cta_rows // group`` tokens (every block holds whole
tokens, so a token's heads are never split between two blocks' chunkings); when ``group > cta_rows`` a block is
one token and its heads are cut into ``nz = ceil(group / cta_rows)`` slices of ``cta_rows`` heads, one item each.
A block's KV range is ``[lo, hi)``: ``hi = kv`` (causal: ``min(kv, kv - qo + t1)``, fully masked tiles are never
scheduled), ``lo = 0`` (window: ``max(0, kv - qo + t0 - window_left)``).

Split: ``L0 = max(PREFILL_MIN_CHUNK, ceil64(total / slots_h))`` with ``slots_h = num_sms * ctas_per_sm //
num_kv_heads`` and ``total`` the KV tokens of every item.  No block longer than ``L0``: no split.  Otherwise
blocks are cut into near-equal 64-aligned chunks of at most ``L``: when the blocks fit one wave
(``blocks * nz <= slots_h``), ``L`` is the smallest chunk such that every chunk fits one wave; else ``L = L0``
(many items: the hardware's greedy CTA dispatch over heavy-first items balances them).  A split block's chunk
``k`` writes float32 partial rows ``partial + (token - t0) * pstride`` with ``partial = pbase + k`` and
``pstride = chunks``; the merge list combines, for every token of a split block, its ``chunks`` consecutive
partial rows into the output row (global query token index).  Unsplit items write the output directly
(``partial = -1``).  Items are ordered by KV length, longest first (stable, so the plan is deterministic),
within L2 windows: with ``kv_bytes_per_token`` given, consecutive requests are grouped into windows of about
``PREFILL_L2_WINDOW_BYTES`` of KV (a new window wherever the KV bytes before a request cross a multiple of it),
and the windows follow each other in request order.  The persistent kernel's CTAs walk the item list
together, so the items in flight at any time are those of one or two windows: each request's K/V is read from
memory about once and then served by L2 to its other query blocks.  Sorting the whole batch longest first
instead interleaves every request's blocks, and a batch whose KV outgrows L2 (32 x 1024 tokens: 134 MB at
Hq32/Hkv8/D128 bf16) rereads it from memory for every query block.

Head groups: the sm90 kernel walks its (item, KV head) units head group by head group (``kv_head_group`` heads
at a time, the plan header's field; each group walks the whole item list).  A request whose K/V over all heads
outgrows a window (b1 x 32768 tokens: 128 MiB) would otherwise have the CTAs in flight read every head's K/V at
once; where it does, the units go one KV head at a time (``kv_head_group`` 1; the kernel takes any divisor of
``num_kv_heads``), and the windows are counted on one head's bytes.
"""

PREFILL_TILE_KV = 64
#: Smallest KV chunk of a split item, in tokens.
PREFILL_MIN_CHUNK = 256
PREFILL_ITEM_FIELDS = 8
#: KV bytes of an L2 window of the prefill item order (0: one window, the whole batch longest first). H200, causal
#: bf16 Hq32/Hkv8 D128 (BENCHMARKS.md, run 24b), windows of 0 / 8 / 16 / 32 MiB: b32_S1024 330 / 382 / 379 / 375
#: TFLOP/s, b64_S512 233 / 260 / 258 / 250, b8_S2048 457 / 432 / 465 / 476, paged b8_S2048 411 / 370 / 402 / 417
#: (a window of one 8 MB request is worse there); b1 cases unchanged. 32 MiB: the best or within 4% of it.
PREFILL_L2_WINDOW_BYTES = 32 << 20
#: Whether the prefill units of a request whose K/V outgrows an L2 window are walked one KV head at a time
#: (kv_head_group; False: all heads together).
PREFILL_HEAD_GROUPS = True


@dataclass(frozen=True)
class PrefillPlan:
    """Result of :func:`plan_prefill`.  ``items`` int32 [W, 8]; ``merge_indptr`` int32 [M + 1] (rows of the
    partial buffer), ``merge_rows`` int32 [M] (global query token index of each merged row)."""

    items: np.ndarray
    merge_indptr: np.ndarray
    merge_rows: np.ndarray
    num_partial_rows: int
    split: bool
    chunk: int               # L of the split path (0: no split)
    tokens_per_block: int
    head_slices: int
    kv_head_group: int       # KV heads the sm90 kernel's units walk together (num_kv_heads: all)
    merge_slots: int = 0     # split blocks x head slices: item field 7's slots (0: field 7 unused)
    max_chunks: int = 1      # the most chunks of one block

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    @property
    def num_merge(self) -> int:
        return int(self.merge_rows.size)


def prefill_geometry(group_size: int, cta_rows: int):
    """(tokens per block, heads per slice, slices per block) for a GQA group and a CTA's packed rows."""
    if group_size <= cta_rows:
        return cta_rows // group_size, group_size, 1
    return 1, cta_rows, -(-group_size // cta_rows)


def prefill_bounds(max_batch_size: int, max_total_qo: int, group_size: int, num_kv_heads: int, cta_rows: int,
                   *, num_sms: int = 132, ctas_per_sm: int = 2, max_split_chunks: Optional[int] = None):
    """(max_items, max_partial_rows, max_merge) of any plan within the bounds (graph mode sizes with them).
    ``max_split_chunks``: the fixed-split schedule's cap of chunks per block (each block at most that many items
    per z slice, each of its query tokens at most that many partial rows)."""
    mb = _as_int("max_batch_size", max_batch_size, 1)
    mq = _as_int("max_total_qo", max_total_qo, 1)
    tpb, _, nz = prefill_geometry(group_size, cta_rows)
    max_blocks = min(mq, mq // tpb + mb)
    if max_split_chunks is not None:
        c = _as_int("max_split_chunks", max_split_chunks, 1)
        return max_blocks * nz * c, mq * c, mq
    slots_h = max(1, (num_sms * ctas_per_sm) // num_kv_heads)
    return max_blocks * nz + slots_h, 2 * tpb * slots_h, mq


def _ceil64(x):
    return (x + 63) // 64 * 64


def _prefill_blocks(qo, kv, group, rows, causal, window_left):
    """The query blocks of a batch: (tpb, hs, nz, request, first token t0, end token t1, KV range [lo, hi)) with
    the int64 arrays of length NB (see the section doc)."""
    tpb, hs, nz = prefill_geometry(group, rows)
    nblk = -(-qo // tpb)
    NB = int(nblk.sum())
    bfirst = np.cumsum(nblk) - nblk
    breq = np.repeat(np.arange(qo.size, dtype=np.int64), nblk)
    t0 = (np.arange(NB, dtype=np.int64) - bfirst[breq]) * tpb
    t1 = np.minimum(t0 + tpb, qo[breq])
    kvb = kv[breq]
    delta = kvb - qo[breq]
    hi = np.minimum(kvb, delta + t1) if causal else kvb.copy()
    hi = np.maximum(hi, 0)
    if window_left >= 0:
        lo = np.clip(delta + t0 - window_left, 0, hi)
    else:
        lo = np.zeros(NB, np.int64)
    return tpb, hs, nz, breq, t0, t1, lo, hi


def _cut(ln, split: int, cap=None):
    """(chunk size, chunk count) int64 [NB] of KV ranges of ln tokens cut at about `split` tokens: near-equal
    64-aligned chunks, at most cap of them (None: no cap); one chunk of the whole range where it fits. A function
    of each range alone."""
    n = np.maximum(1, -(-ln // split))
    if cap is not None:
        n = np.minimum(n, cap)
    csize = np.maximum(_ceil64(-(-ln // n)), 64)
    nchunk = np.maximum(1, -(-ln // csize))
    return np.where(nchunk > 1, csize, np.maximum(ln, 1)), nchunk


def _l2_windows(kv, bytes_per_token: int):
    """int64 [B]: the L2 window of each request (see the section doc): consecutive requests, a new window where
    the KV bytes before a request reach the next multiple of PREFILL_L2_WINDOW_BYTES."""
    if not bytes_per_token or not PREFILL_L2_WINDOW_BYTES:
        return np.zeros(kv.size, np.int64)
    before = np.cumsum(kv) - kv
    return before * int(bytes_per_token) // PREFILL_L2_WINDOW_BYTES


def kv_head_group(kv, num_kv_heads: int, bytes_per_token: int) -> int:
    """KV heads walked together (see the section doc): all where the longest request's K/V (kv: int [B] tokens;
    bytes_per_token over all heads) fits a window, else one. Run 35b (ab_sm90.py --hgroup, the walk restarted in
    every group): one head at a time against all heads together +1.5% causal b1_S32768, +7% causal b1_S16384,
    +0.7% causal b2_S16384, +1.1% non-causal b1_S16384; the groups that fit a window (2 or 4 heads) +1.6%, +4%,
    -1.5%, 0."""
    hkv = num_kv_heads
    if not (bytes_per_token and PREFILL_L2_WINDOW_BYTES and PREFILL_HEAD_GROUPS and kv.size):
        return hkv
    return hkv if int(kv.max()) * int(bytes_per_token) <= PREFILL_L2_WINDOW_BYTES else 1


def fused_merge_fits(max_chunks: int, slots: int) -> bool:
    """Whether item field 7 ((merge slot << 12) | chunk) holds a plan's split blocks: fewer than 4096 chunks a
    block and 2^19 merge slots (blocks x head slices)."""
    return max_chunks < 4096 and slots < (1 << 19)


def _prefill_items(breq, t0, ntok, lo, hi, csize, nchunk, nz, hs, group, pbase, pstride, chunked, window=None,
                   mslot=None):
    """The work items (int32 [W, 8], by window[request] (None: one window), then longest KV range first,
    stable) of blocks cut into nchunk[b] chunks of
    csize[b] tokens from lo[b] (clipped to hi[b]; a chunk past hi is empty), nz head slices each. Chunk k of a
    chunked block writes partial rows from pbase[b] + k with stride pstride[b]; other blocks pbase[b] (-1: the
    output) and pstride[b] as given. mslot[b] (chunked blocks): the block's merge slot, field 7 of its items
    ``((mslot[b] * nz + z) << 12) | k`` (the sm90 kernel's fused merge: its arrival counters); None: field 7 is 0
    (the caller passes None where fused_merge_fits says the fields do not fit)."""
    per = nchunk * nz
    W = int(per.sum())
    bidx = np.repeat(np.arange(breq.size, dtype=np.int64), per)
    q = np.arange(W, dtype=np.int64) - (np.cumsum(per) - per)[bidx]
    k, z = q // nz, q % nz
    items = np.zeros((W, PREFILL_ITEM_FIELDS), np.int32)
    kb = np.minimum(lo[bidx] + k * csize[bidx], hi[bidx])
    ke = np.minimum(kb + csize[bidx], hi[bidx])
    items[:, 0] = breq[bidx]
    items[:, 1] = t0[bidx] * group + z * hs
    items[:, 2] = ntok[bidx] * group if nz == 1 else np.minimum(hs, group - z * hs)
    items[:, 3] = kb
    items[:, 4] = ke
    sb = chunked[bidx]
    items[:, 5] = np.where(sb, pbase[bidx] + k, pbase[bidx])
    items[:, 6] = pstride[bidx]
    if mslot is not None:
        items[:, 7] = np.where(sb, ((mslot[bidx] * nz + z) << 12) | k, 0)
    if window is None:
        order = np.argsort(-(ke - kb), kind="stable")
    else:
        order = np.lexsort((-(ke - kb), window[breq[bidx]]))   # (lexsort is stable)
    return np.ascontiguousarray(items[order])



#: The persistent walk's tail split (plan_prefill's ``persistent_ctas``; switched on by prefill.SM90_TAIL_SPLIT).
#: Model of a unit's time in 128-token tiles: run 30's clock stamps (causal b8_S2048: 4633 cycles a unit beyond
#: its tiles, 3068 a tile, 1460 more for a causal unit's masked last tile); a split chunk's float32 partial store
#: and its share of the merge counted as one more tile (an estimate).
TAIL_UNIT_TILES = 1.5
TAIL_MASK_TILES = 0.5
TAIL_PART_TILES = 1.0
#: The split is taken only where the model's slowest CTA gains at least this fraction.
TAIL_MIN_GAIN = 0.01
TAIL_MAX_CHUNKS = 8
_TAIL_TILE = 128


def _snake_ctas(pos, nb: int) -> np.ndarray:
    """The persistent CTA of each walk position (int64 [...]): CTA p % nb in even rounds (p // nb), nb - 1 - p % nb
    in odd ones (the sm90 kernel's Walk)."""
    col = pos % nb
    return np.where((pos // nb) & 1, nb - 1 - col, col)


def _tail_cannot_gain(pre, units, nb: int, worst0: float) -> bool:
    """Whether no cut of the walk's last blocks can bring its slowest CTA (worst0) down by TAIL_MIN_GAIN: every
    candidate keeps the loads before the first cut position (pre: float64 [nb]) and a cut only adds its pieces'
    costs to the units' total (units: float64 [positions]), so neither the largest of those loads nor the mean load
    can drop. Skips the candidates' costly evaluation where it would refuse them all (causal issue-13 cases)."""
    return bool(max(pre.max(), units.sum() / nb) > worst0 * (1 - TAIL_MIN_GAIN))


def _tail_split(ln, win, nb: int, hg: int, causal: bool):
    """Where the persistent walk's last round leaves CTAs idle (e.g. 2048 equal units on 132 CTAs: 16 rounds where
    15.5 would do), cut the walk's last blocks into chunks whose units fill it. ln: int64 [NB] blocks' KV tokens,
    win: [NB] their L2 windows, nb: the persistent grid, hg: KV heads walked together (each head group walks the
    same list, so one group's balance is every group's). Returns (blocks, csize, nchunk) or None: no cut of the
    last ceil((NB * hg % nb) / hg) blocks into 2..TAIL_MAX_CHUNKS chunks gains TAIL_MIN_GAIN in the model."""
    NB = ln.size
    per = NB * hg
    if per <= nb or per % nb == 0:
        return None
    m = -(-(per % nb) // hg)
    order = np.lexsort((-ln, win))
    start = NB - int((win[order] == win[order[-1]]).sum())   # the last window's first block in the walk
    if m > NB - start:
        return None   # the chunks would leave their window
    mask = TAIL_MASK_TILES if causal else 0.0
    lens = ln[order]
    cost = TAIL_UNIT_TILES + mask + -(-lens // _TAIL_TILE)
    units = np.repeat(cost, hg)
    ctas = _snake_ctas(np.arange(per), nb)
    worst0 = np.bincount(ctas, weights=units, minlength=nb).max()
    if worst0 < units.sum() / nb * (1 + TAIL_MIN_GAIN):
        return None   # balanced already
    # The walk from the first position a chunk can reach (chunks are re-sorted with the last window's blocks,
    # longest first; a chunk is no longer than its block); the loads before it are the same for every candidate.
    first = min(start + int(np.searchsorted(-lens[start:], -lens[NB - m], side="right")), NB - m)
    pre = np.bincount(ctas[:first * hg], weights=units[:first * hg], minlength=nb)
    if _tail_cannot_gain(pre, units, nb, worst0):
        return None
    # Candidate 0 is the walk as it is; candidate c >= 1 cuts the last m blocks into c + 1 chunks.
    tl = lens[NB - m:]
    K = np.arange(1, TAIL_MAX_CHUNKS + 1)
    cs = np.maximum(_ceil64(-(-tl[None, :] // K[:, None])), 64)          # [K, m]
    cs[0] = np.maximum(tl, 1)
    nc = -(-tl[None, :] // cs)
    ok = np.concatenate([[True], (nc[1:] >= 2).all(1)])
    nck = nc.ravel()
    rep = np.repeat(np.arange(nck.size), nck)                              # a piece's (candidate, block)
    j = np.arange(rep.size) - (np.cumsum(nck) - nck)[rep]
    plen = np.minimum(cs.ravel()[rep], tl[rep % m] - j * cs.ravel()[rep])
    pcand = rep // m
    pcost = (TAIL_UNIT_TILES + np.where(pcand > 0, TAIL_PART_TILES, 0.0) + -(-plen // _TAIL_TILE)
             + np.where(j == nck[rep] - 1, mask, 0.0))
    nkeep = NB - m - first
    cand = np.concatenate([np.repeat(K - 1, nkeep), pcand])
    allen = np.concatenate([np.tile(lens[first:NB - m], K.size), plen])
    allcost = np.concatenate([np.tile(cost[first:NB - m], K.size), pcost])
    srt = np.lexsort((-allen, cand))
    cand, allcost = cand[srt], allcost[srt]
    rank = np.arange(cand.size) - np.searchsorted(cand, cand, side="left")
    pos = first * hg + (rank * hg)[:, None] + np.arange(hg)[None, :]
    loads = np.bincount((cand[:, None] * nb + _snake_ctas(pos, nb)).ravel(), weights=np.repeat(allcost, hg),
                        minlength=K.size * nb).reshape(K.size, nb) + pre
    worst = np.where(ok, loads.max(1), np.inf)
    c = int(np.argmin(worst))
    if c == 0 or worst[c] > worst[0] * (1 - TAIL_MIN_GAIN):
        return None
    return order[NB - m:], cs[c], nc[c]


#: Whether plan_prefill's ``persistent_ctas`` also places the items in the walk so that the CTAs' loads balance
#: (``_balance_walk``; scripts/ab_sm90.py --balance times it against the plain snake: +1.3-4.7% where the model
#: places anything, run 49b, H100).
WALK_BALANCE = True


def _walk_costs(items, causal: bool, qo, kv, group: int, tpb: int) -> np.ndarray:
    """float64 [W]: the TAIL_* model's cost of each item's unit (items int32 [W, 8]; qo, kv int64 [B]): its KV
    tiles, the fixed cost, a chunk's partial store, a causal block's masked last tile."""
    ln = items[:, 4].astype(np.int64) - items[:, 3]
    cost = TAIL_UNIT_TILES + -(-ln // _TAIL_TILE) + np.where(items[:, 5] >= 0, TAIL_PART_TILES, 0.0)
    if causal:
        req = items[:, 0]
        t1 = np.minimum(items[:, 1] // group + tpb, qo[req])
        cost += np.where(items[:, 4] == np.minimum(kv[req], kv[req] - qo[req] + t1), TAIL_MASK_TILES, 0.0)
    return cost


def _walk_group(hg: int, hkv: int, items: int, nb: int) -> int:
    """The KV heads a unit group the sm90 kernel's Walk takes for a plan's kv_head_group (hg) on nb CTAs: hg where
    it divides Hkv and a group's units fill a round, else all heads."""
    return hg if 0 < hg < hkv and hkv % hg == 0 and items * hg >= nb else hkv


def walk_makespan(plan: "PrefillPlan", num_kv_heads: int, nb: int, causal: bool, qo_lens, kv_lens,
                  group_size: int) -> float:
    """The model's slowest persistent CTA (summed unit costs in KV tiles, _walk_costs) of a plan on nb CTAs in the
    sm90 kernel's snake walk (scripts: the prediction beside an A/B)."""
    qo, kv = (np.asarray(x, np.int64) for x in (qo_lens, kv_lens))
    W, hkv, hg = plan.num_items, num_kv_heads, plan.kv_head_group
    hg = _walk_group(hg, hkv, W, nb)
    cost = _walk_costs(plan.items, causal, qo, kv, group_size, plan.tokens_per_block)
    load = np.bincount(_snake_ctas(np.arange(W * hg), nb), weights=np.repeat(cost, hg), minlength=nb)
    return float(load.max()) * (hkv // hg)


def _walk_cannot_gain(cost, edges) -> bool:
    """Whether the items of every round segment of the walk cost the same (cost: float64 [W]; edges: int [S - 1],
    the segments' first items after the first): the balance only permutes a segment's items among its slots, which
    then moves no load, so it would refuse. Skips its round loop on the equal-length non-causal batches."""
    changes = np.diff(cost) != 0
    changes[edges - 1] = False   # a change between two segments
    return not changes.any()


def _balance_walk(cost, win, nb: int, hg: int):
    """A placement (int64 [W]: the item at each walk slot) that lowers the slowest persistent CTA's summed cost,
    or None where the snake walk of the items as sorted is within TAIL_MIN_GAIN of it. The snake deals a round's
    units by position alone, so where item lengths vary (mixed lengths, causal, block-sparse rows) some CTAs get
    the long ones of several rounds. Here each round's items (longest first, as sorted) go to that round's slots
    in order of the load their CTAs carry so far, least first (a per-round LPT); items keep their L2 window and
    round. cost: float64 [W] (_walk_costs); win: int64 [W] windows, nondecreasing; hg: KV heads a unit group
    (an item's units take hg consecutive walk positions)."""
    W = cost.size
    per = W * hg
    if per <= nb:
        return None   # one round: every unit has its own CTA
    ctas = _snake_ctas(np.arange(per), nb).reshape(W, hg)
    ucost = np.repeat(cost, hg)   # each item's units, hg consecutive
    before = np.bincount(ctas.ravel(), ucost, nb)
    worst = before.max()
    if worst < before.mean() * (1 + TAIL_MIN_GAIN):
        return None
    seg = win * (per // nb + 1) + np.arange(W) * hg // nb   # (window, round of the item's first position)
    edges = np.flatnonzero(np.diff(seg)) + 1
    if _walk_cannot_gain(cost, edges):
        return None
    edges = edges.tolist()
    items = np.arange(W)
    place = items.copy()
    load = np.zeros(nb)
    for a, b in zip([0] + edges, edges + [W]):   # (few numpy calls a round: plan()'s host time)
        c = ctas[a:b]
        slots = load[c].max(1).argsort(kind="stable")
        place[a:b][slots] = items[a:b]
        load += np.bincount(c[slots].ravel(), ucost[a * hg:b * hg], nb)
    return place if load.max() <= worst * (1 - TAIL_MIN_GAIN) else None


def plan_prefill(qo_lens, kv_lens, group_size, num_kv_heads, cta_rows, *, causal=False, window_left=-1,
                 num_sms=132, ctas_per_sm=2, split_tokens=None, max_split_chunks=None,
                 kv_bytes_per_token=0, persistent_ctas=0) -> PrefillPlan:
    """Schedule a prefill / append batch (see the section doc above).  qo_lens, kv_lens: int [B].
    ``kv_bytes_per_token``: K and V bytes of one token over all KV heads (0: no L2 windows).
    ``split_tokens`` (a multiple of 64) is the batch-invariant schedule: ``L = split_tokens`` whatever the batch,
    so a block's chunks (near-equal 64-aligned pieces of its own KV range) and their merge order depend on the
    block alone. ``max_split_chunks`` (with split_tokens) caps a block's chunks: a KV range longer than
    ``split_tokens * max_split_chunks`` is cut into that many chunks (still a function of the block alone), so
    the partial states of any batch are bounded by ``max_total_qo * max_split_chunks`` (graph mode).
    ``persistent_ctas`` (> 0: the persistent sm90 grid, outside graph mode): where nothing else splits, the walk's
    last blocks may be cut so that the last round's units fill the grid (``_tail_split``); and the items are placed
    in the walk so that the CTAs' loads balance (``_balance_walk``, WALK_BALANCE)."""
    group = _as_int("group_size", group_size, 1)
    hkv = _as_int("num_kv_heads", num_kv_heads, 1)
    rows = _as_int("cta_rows", cta_rows, 16)
    qo, _ = _as_kv_lens(qo_lens)
    kv, _ = _as_kv_lens(kv_lens)
    if qo.size == 0 and kv.size == 0:
        qo = kv = _EMPTY
    if qo.shape != kv.shape:
        raise ValueError(f"qo_lens and kv_lens must have the same length, got {qo.size} and {kv.size}")
    if causal and (kv < qo).any():
        i = int(np.argmax(kv < qo))
        raise ValueError(f"causal: requires kv_len >= qo_len, request {i} has qo_len {int(qo[i])} > kv_len {int(kv[i])}")
    tpb, hs, nz, breq, t0, t1, lo, hi = _prefill_blocks(qo, kv, group, rows, causal, window_left)
    NB = breq.size
    ln = hi - lo
    slots_h = max(1, (num_sms * ctas_per_sm) // hkv)
    total = int(ln.sum()) * nz
    nchunk = np.ones(NB, np.int64)
    csize = np.maximum(ln, 1)
    L = 0
    if split_tokens is not None:
        split_tokens = _as_int("split_tokens", split_tokens, 64)
        if split_tokens % 64:
            raise ValueError(f"split_tokens must be a multiple of 64, got {split_tokens}")
    if NB and total:
        L0 = max(PREFILL_MIN_CHUNK, _ceil64(-(-total // slots_h))) if split_tokens is None else split_tokens
        maxlen = int(ln.max())
        if maxlen > L0:
            if split_tokens is not None:
                L = split_tokens
            elif NB * nz <= slots_h:
                lo_k, hi_k = PREFILL_MIN_CHUNK // 64, -(-maxlen // 64)   # hi_k always fits one wave
                while lo_k < hi_k:
                    mid = (lo_k + hi_k) // 2
                    if int(np.maximum(1, -(-ln // (64 * mid))).sum()) * nz <= slots_h:
                        hi_k = mid
                    else:
                        lo_k = mid + 1
                L = 64 * lo_k
            else:
                L = L0
            csize, nchunk = _cut(ln, L, _as_int("max_split_chunks", max_split_chunks, 1)
                                 if split_tokens is not None and max_split_chunks is not None else None)
    bpt = _as_int("kv_bytes_per_token", kv_bytes_per_token, 0)
    hg = kv_head_group(kv, hkv, bpt)
    windows = _l2_windows(kv, bpt * hg // hkv)
    if persistent_ctas and split_tokens is None and L == 0 and nz == 1 and NB:
        nb = min(_as_int("persistent_ctas", persistent_ctas, 1), NB * hkv)
        cut = _tail_split(ln, windows[breq], nb, hg if 0 < hg < hkv and NB * hg >= nb else hkv, causal)
        if cut is not None:
            blocks, cs, nc = cut
            csize, nchunk = csize.copy(), nchunk.copy()
            csize[blocks], nchunk[blocks] = cs, nc
    split_blk = nchunk > 1
    ntok = t1 - t0
    pcount = np.where(split_blk, ntok * nchunk, 0)
    pbase = np.cumsum(pcount) - pcount
    num_partial = int(pcount.sum())

    sb = split_blk
    max_chunks = int(nchunk.max(initial=1))
    slots = int(sb.sum()) * nz
    slots = slots if slots and fused_merge_fits(max_chunks, slots) else 0
    items = _prefill_items(breq, t0, ntok, lo, hi, csize, nchunk, nz, hs, group,
                           np.where(sb, pbase, -1), np.where(sb, nchunk, 1), sb, windows,
                           np.cumsum(sb) - 1 if slots else None)
    if persistent_ctas and WALK_BALANCE and split_tokens is None and items.size:
        nb = min(int(persistent_ctas), items.shape[0] * hkv)
        place = _balance_walk(_walk_costs(items, causal, qo, kv, group, tpb), windows[items[:, 0]], nb,
                              _walk_group(hg, hkv, items.shape[0], nb))
        if place is not None:
            items = np.ascontiguousarray(items[place])

    # merges: every token of every split block, its chunks' partial rows are consecutive
    sblk = np.nonzero(split_blk)[0]
    mt = ntok[sblk]
    mb = np.repeat(sblk, mt)
    mi = np.arange(int(mt.sum()), dtype=np.int64) - np.repeat(np.cumsum(mt) - mt, mt)
    qo_start = np.cumsum(qo) - qo
    merge_indptr, merge_rows = merge_lists(nchunk[mb], qo_start[breq[mb]] + t0[mb] + mi)
    return PrefillPlan(items, merge_indptr, merge_rows, num_partial, bool(sblk.size), int(L), tpb, nz, hg, slots,
                       max_chunks)


def cascade_chunks(qo_lens, kv_lens, group_size, num_kv_heads, cta_rows, *, causal=False, num_sms=132,
                   ctas_per_sm=2) -> int:
    """The chunk count of one cascade level: every block of the level is cut into this many chunks, enough for
    the level's items to fill one wave (``slots_h`` per KV head) without chunks under ``PREFILL_MIN_CHUNK``
    tokens (of its longest block)."""
    group = _as_int("group_size", group_size, 1)
    rows = _as_int("cta_rows", cta_rows, 16)
    qo, _ = _as_kv_lens(qo_lens)
    kv, _ = _as_kv_lens(kv_lens)
    _, _, nz, breq, _, _, lo, hi = _prefill_blocks(qo, kv, group, rows, causal, -1)
    if not breq.size:
        return 1
    slots_h = max(1, (num_sms * ctas_per_sm) // _as_int("num_kv_heads", num_kv_heads, 1))
    want = -(-slots_h // (breq.size * nz))
    return int(max(1, min(want, -(-int((hi - lo).max()) // PREFILL_MIN_CHUNK))))


def plan_cascade_level(qo_lens, kv_lens, group_size, cta_rows, chunks, slots, slot0, *, causal=False,
                       split_tokens=None, max_split_chunks=None):
    """The work items (int32 [W, 8]) of one cascade level (see the section doc): every block's KV range is cut
    into ``chunks`` near-equal 64-aligned chunks (trailing ones may be empty), and chunk k of the block holding
    query token t (global index) writes the float32 partial row ``t * slots + slot0 + k``: every query token
    owns ``slots`` consecutive partial rows, one per (level, chunk), that one stacked merge combines; an empty
    chunk writes lse -inf there. qo_lens, kv_lens: int [G] (the level's groups). ``split_tokens`` (with
    ``max_split_chunks``): each block cut by its own length as plan_prefill's batch-invariant schedule cuts it,
    the rest of its ``chunks`` empty."""
    group = _as_int("group_size", group_size, 1)
    rows = _as_int("cta_rows", cta_rows, 16)
    n = _as_int("chunks", chunks, 1)
    S = _as_int("slots", slots, 1)
    off = _as_int("slot0", slot0, 0)
    if off + n > S:
        raise ValueError(f"slot0 + chunks ({off} + {n}) exceeds slots {S}")
    qo, _ = _as_kv_lens(qo_lens)
    kv, _ = _as_kv_lens(kv_lens)
    if qo.shape != kv.shape:
        raise ValueError(f"qo_lens and kv_lens must have the same length, got {qo.size} and {kv.size}")
    if causal and (kv < qo).any():
        i = int(np.argmax(kv < qo))
        raise ValueError(f"causal: requires kv_len >= qo_len, request {i} has qo_len {int(qo[i])} > kv_len {int(kv[i])}")
    tpb, hs, nz, breq, t0, t1, lo, hi = _prefill_blocks(qo, kv, group, rows, causal, -1)
    NB = breq.size
    if split_tokens is not None:
        csize, nb = _cut(hi - lo, _as_int("split_tokens", split_tokens, 64), max_split_chunks)
        if NB and int(nb.max()) > n:
            raise ValueError(f"chunks: {n} is fewer than a block's {int(nb.max())} chunks of split_tokens")
    else:
        csize = np.maximum(_ceil64(-(-(hi - lo) // n)), 64) if n > 1 else np.maximum(hi - lo, 1)
    qo_start = np.cumsum(qo) - qo
    every = np.ones(NB, bool)
    return _prefill_items(breq, t0, t1 - t0, lo, hi, csize, np.full(NB, n, np.int64), nz, hs, group,
                          (qo_start[breq] + t0) * S + off, np.full(NB, S, np.int64), every)


__all__ += ["PREFILL_TILE_KV", "PREFILL_MIN_CHUNK", "PREFILL_ITEM_FIELDS", "PREFILL_HEAD_GROUPS", "PrefillPlan",
            "prefill_geometry", "kv_head_group",
            "prefill_bounds", "plan_prefill",
            "cascade_chunks", "plan_cascade_level"]
