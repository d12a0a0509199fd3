"""Tensor maps (TMA descriptors) of a KV cache for the sm90 prefill kernel, whose producers then load each full
K / V tile with a few bulk tensor copies (one box of 64 columns x R rows each) instead of per-thread 16-byte
copies.

A map views k (or v) as 4 dims, innermost first: (head_dim, head, token slot, page) for "NHD" and (head_dim,
slot, head, page) for "HND" (strides grow outward), boxes of 64 x 1 x R x 1 (NHD) or 64 x R x 1 x 1 (HND),
with the kernel's 128-byte swizzle. Ragged K / V is one page of total_kv slots (a box is the whole KV tile);
a paged cache has page_size slots per page (a box is one page, or the tile inside a larger page), and
block-sparse K / V pages of C slots, one per column block (HND: the page stride is below the head stride).
A paged cache (PagedKV) instead takes the kernel instance with interleaved K / V tiles (interleaved_tiles) and
5-dim maps, (64 columns, row in an 8-row group, 64-column block, 8-row group, page), whose box is a page's rows
across the whole head dim: half the boxes of a 16-token page at head dim 128. The kernel
takes the boxes only for full tiles of an item that starts on a box boundary: a tile that ends past the item's
KV (whose rows must read as zeros, whatever the cache holds there) keeps the zero-filling per-thread copies for
the rows past its last whole page (its whole pages still come as boxes: KVATTN_SM90_PTAIL), but for ragged K / V,
where the item's last tile is the box ending at the item's end (its first rows repeat the tile before, masked by
the kernel: KVATTN_SM90_SHIFT), so no row outside the item is read.
run() encodes the maps for its k / v (cuTensorMapEncodeTiled; cached per pointer, shape and strides) and writes
them into the launches' parameters.

The query and output tiles have maps too (RowsTensorMap): q or o [tokens, Hq, D] as (head_dim, group, KV head,
token), a box (64, group, 1, rows / group) being one 64-column block of packed rows (a CTA's 128 of q, a consumer
warpgroup's 64 of o), so one thread copies a unit's Q, and one stores a warpgroup's O, with head_dim / 64 boxes
instead of 128 threads' per-thread copies (which took 2 tile-times a unit to issue) and stores (1 tile-time).
"""
from __future__ import annotations

import ctypes

from . import _driver
from .opcore import PagedKV, RaggedKV

MODE_OFF, MODE_RAGGED, MODE_PAGED = 0, 1, 2
#: False: sm90 plans copy each unit's Q tile per thread, not by its tensor map (the A/B of scripts/ab_sm90.py --qtma)
QUERY_MAPS = True
#: False: sm90 plans store O per thread, not by its tensor map (the A/B of scripts/ab_sm90.py --otma)
OUTPUT_MAPS = True
#: The packed rows of one box: the sm90 CTA's query tile, a consumer warpgroup's output rows
Q_BOX_ROWS, O_BOX_ROWS = 128, 64


class StridesNotMapped(ValueError):
    """An interleaved tensor map cannot describe these cache strides (the binder falls back to copies)."""
_CACHE_LIMIT = 16   # distinct (k, v) bindings remembered per plan
_MAP_BYTES = 128    # sizeof(CUtensorMap)


def tma_mode(kv, tile: int, contiguous: bool) -> tuple[int, int]:
    """(mode, box rows) for a plan's KV accessor and the kernel's KV tile; contiguous: a RaggedKV read as one
    run of tokens per request (the ragged op). Block-sparse columns (a RaggedKV of C-token pages) are paged.
    MODE_OFF where whole boxes cannot cover a tile: fp8 caches (their producers expand the bytes), page (or
    column block) sizes that are not a multiple of 8 (a box's rows must span whole 1024-byte swizzle atoms) or
    neither divide nor are divided by the tile."""
    if kv.dtype.itemsize != 2:
        return MODE_OFF, 0
    if isinstance(kv, RaggedKV) and kv.tokens_per_page == 1:
        return (MODE_RAGGED, tile) if contiguous else (MODE_OFF, 0)
    if isinstance(kv, (PagedKV, RaggedKV)):   # a page table, or block-sparse columns (pages of C tokens)
        ps = kv.page_size if isinstance(kv, PagedKV) else kv.tokens_per_page
        if ps % 8 == 0 and ps <= 256 and (tile % ps == 0 or ps % tile == 0):
            return MODE_PAGED, min(ps, tile)
    return MODE_OFF, 0


def _encode(dtype, a, dims, strides, box) -> bytes:
    """cuTensorMapEncodeTiled of array a (16-bit dtype, 128-byte swizzle) as the 128-byte map."""
    drv = _driver.driver()
    dt = (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if dtype.name == "bfloat16" else
          drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    tmap = _driver.call("cuTensorMapEncodeTiled", dt, len(dims), a.ptr, [u64(x) for x in dims],
                        [u64(x) for x in strides], [u32(x) for x in box], [u32(1)] * len(dims),
                        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return ctypes.string_at(tmap.getPtr(), _MAP_BYTES)


def interleaved_tiles(kv, tile: int) -> bool:
    """Whether a plan over this KV accessor takes the sm90 instance with interleaved K / V tiles (KVATTN_SM90_KVIL):
    a paged cache whose pages are whole boxes. Its tile layout lets one 5-dim box carry a page's rows across the
    whole head dim (a page-16 tile of head dim 128: 16 boxes instead of 32; run 29b, causal b1_S8192: 563 -> 632
    TFLOP/s, 0.97 of ragged). Ragged K / V keeps the other layout: its tiles start at any token, not on 8-row
    groups."""
    return isinstance(kv, PagedKV) and tma_mode(kv, tile, False)[0] == MODE_PAGED


def _slots(n: int, stride: int) -> int:
    """The slot extent of a ragged map: unbounded in practice (2^28 tokens, less where the byte span would pass
    the 2^40 limit), never below the array's n. The kernel only addresses tokens of the plan's requests; a graph
    replays the map it captured, and a later plan of the same buffer may name more rows than the captured view
    had (the pointer-based copies read them too)."""
    return max(n, min(1 << 28, ((1 << 40) - 1) // stride))


def _pages(n: int, stride: int) -> int:
    """The page extent of a block-sparse map: as _slots (a later plan of a captured buffer may name blocks past
    the captured view), below the 2^40-byte span and 2^32 entries."""
    return max(n, min(1 << 24, ((1 << 40) - 1) // stride))


def _dims(kv, a, rows: int):
    """(global dims, global byte strides of dims 1..3, box dims) of array a (a DeviceArray of the cache)."""
    d = kv.head_dim
    s = a.strides
    if isinstance(kv, RaggedKV) and kv.tokens_per_page > 1:   # block-sparse: [n, H, D] / [H, n, D] as pages of C
        c = kv.tokens_per_page
        if kv.layout == "NHD":
            h, pages = a.shape[1], _pages(a.shape[0] // c, s[0] * c)
            return (d, h, c, pages), (s[1], s[0], s[0] * c), (64, 1, rows, 1)
        h, pages = a.shape[0], _pages(a.shape[1] // c, s[1] * c)
        return (d, c, h, pages), (s[1], s[0], s[1] * c), (64, rows, 1, 1)
    if isinstance(kv, RaggedKV):   # NHD [n, H, D] / HND [H, n, D]: one page of (many) slots
        if kv.layout == "NHD":
            h, ext = a.shape[1], _slots(a.shape[0], s[0])
            return (d, h, ext, 1), (s[1], s[0], s[0] * ext), (64, 1, rows, 1)
        h, ext = a.shape[0], _slots(a.shape[1], s[1])
        return (d, ext, h, 1), (s[1], s[0], s[0] * h), (64, rows, 1, 1)
    if kv.layout == "NHD":         # [P, ps, H, D]
        p, ps, h = a.shape[0], a.shape[1], a.shape[2]
        return (d, h, ps, p), (s[2], s[1], s[0]), (64, 1, rows, 1)
    p, h, ps = a.shape[0], a.shape[1], a.shape[2]   # HND [P, H, ps, D]
    return (d, ps, h, p), (s[2], s[1], s[0]), (64, rows, 1, 1)


def _dims_interleaved(kv, a, rows: int):
    """(global dims, byte strides of dims 1..4, box dims) of a paged cache array for the kernel's interleaved K / V
    tiles (KVATTN_SM90_KVIL): 5 dims, innermost first: column of a 64-column block, row in an 8-row group, block
    (NHD: of every head, whose rows must be contiguous), group (HND: of every head, whose pages must be contiguous),
    page; a box = a page's `rows` rows across every block of one head."""
    d, s, e = kv.head_dim, a.strides, a.itemsize
    blocks = d // 64
    if kv.layout == "NHD":         # [P, ps, H, D]
        p, ps, h = a.shape[0], a.shape[1], a.shape[2]
        if s[2] != d * e or s[3] != e:
            raise StridesNotMapped(f"k / v: interleaved tensor maps need each token's heads contiguous (strides {s})")
        return (64, 8, h * blocks, ps // 8, p), (s[1], 64 * e, 8 * s[1], s[0]), (64, 8, blocks, rows // 8, 1)
    p, h, ps = a.shape[0], a.shape[1], a.shape[2]   # HND [P, H, ps, D]
    if s[1] != ps * s[2] or s[3] != e:
        raise StridesNotMapped(f"k / v: interleaved tensor maps need each page's heads contiguous (strides {s})")
    return (64, 8, blocks, h * ps // 8, p), (s[2], 64 * e, 8 * s[2], s[0]), (64, 8, blocks, rows // 8, 1)


def encode(kv, a, rows: int, interleaved: bool = False) -> bytes:
    """The 128-byte tensor map of cache array a (interleaved: the 5-dim map of _dims_interleaved)."""
    dims, strides, box = _dims_interleaved(kv, a, rows) if interleaved else _dims(kv, a, rows)
    return _encode(kv.dtype, a, dims, strides, box)


class _Binder:
    """What run()'s map binders share: the maps encoded once per key (pointers, shapes, strides) and remembered
    (_CACHE_LIMIT keys), b"" for arrays whose strides no map describes."""

    __slots__ = ("_cache", "_bound")

    def __init__(self):
        self._cache = {}
        self._bound = None   # the key whose maps the parameters hold now (the usual run(): the same arrays again)

    def _blob(self, key, make) -> bytes:
        blob = self._cache.get(key)
        if blob is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            try:
                blob = make()
            except StridesNotMapped:
                blob = b""
            self._cache[key] = blob
        return blob


class KVTensorMaps(_Binder):
    """run()'s binder: writes the tensor maps of (k, v) into the parameters of the launches that read them. Arrays
    whose strides an interleaved map cannot describe (heads not contiguous in a token / page) switch those launches
    to their per-thread copies (same tile layout) for as long as they are bound."""

    __slots__ = ("kv", "rows", "params", "offset", "mode", "interleaved")

    def __init__(self, kv, rows: int, params, offset: int, mode: int, interleaved: bool = False):
        super().__init__()
        self.kv, self.rows, self.params, self.offset = kv, rows, tuple(params), offset
        self.mode, self.interleaved = mode, interleaved

    def __call__(self, k, v):
        key = (k.ptr, v.ptr, k.shape, k.strides, v.strides)
        if key == self._bound:
            return
        blob = self._blob(key, lambda: (encode(self.kv, k, self.rows, self.interleaved)
                                        + encode(self.kv, v, self.rows, self.interleaved)))
        for p in self.params:
            if blob:
                p.set_bytes(self.offset, blob)
            p.set(tma_mode=self.mode if blob else MODE_OFF)
        self._bound = key


def attach(kv, params, tile: int, contiguous: bool = False, interleaved: bool = False) -> KVTensorMaps | None:
    """Switch the sm90 launches of these ParamBuffers to TMA tiles where the accessor allows it (tma_mode) and
    return run()'s binder, or None (the launches keep their per-thread copies). interleaved: the launches' kernel
    has interleaved K / V tiles (KVATTN_SM90_KVIL), which take paged maps only."""
    mode, rows = tma_mode(kv, tile, contiguous)
    if mode == MODE_OFF or not params or (interleaved and not (mode == MODE_PAGED and isinstance(kv, PagedKV))):
        return None
    for p in params:
        p.set(tma_mode=mode, tma_rows=rows, tma_hnd=int(kv.layout == "HND"))
    return KVTensorMaps(kv, rows, params, params[0].dtype.fields["tma_k"][1], mode, interleaved)


def rows_dims(a, group: int, rows: int, tokens: int = 0):
    """(global dims, byte strides of dims 1..3, box dims) of the map of q or o [tokens, Hq, D] (any row / head
    strides, D contiguous): (D, group, Hkv, tokens), a box = one 64-column block of `rows` packed rows. tokens:
    at least this many rows (graph mode: a later plan may use up to the bound's rows of the captured array)."""
    n, hq, d = a.shape
    n = max(n, tokens)
    s, e = a.strides, a.itemsize
    if s[2] != e or s[0] % 16 or s[1] % 16 or a.ptr % 16:
        raise StridesNotMapped(f"q / out: a tensor map needs head_dim contiguous and 16-byte aligned rows / heads "
                               f"(strides {s})")
    return (d, group, hq // group, n), (s[1], group * s[1], s[0]), (64, group, 1, rows // group)


def rows_mappable(group: int, rows: int, head_dim: int) -> bool:
    """Whether `rows` packed rows are whole boxes: group heads of rows / group tokens."""
    return rows % group == 0 and group <= 256 and rows // group <= 256 and head_dim % 64 == 0


class RowsTensorMap(_Binder):
    """run()'s binder of a q or o map (rows_dims) into the sm90 launches' parameters (`field`, and `flag` = 1);
    arrays a map cannot describe switch those launches to their per-thread copies / stores while bound."""

    __slots__ = ("group", "rows", "tokens", "params", "offset", "flag")

    def __init__(self, params, group: int, rows: int, field: str, flag: str, tokens: int = 0):
        super().__init__()
        self.group, self.rows, self.tokens, self.params, self.flag = group, rows, tokens, tuple(params), flag
        self.offset = self.params[0].dtype.fields[field][1]

    def __call__(self, q):
        key = (q.ptr, q.shape, q.strides)
        if key == self._bound:
            return
        blob = self._blob(key, lambda: _encode(q.dtype, q, *rows_dims(q, self.group, self.rows, self.tokens)))
        for p in self.params:
            if blob:
                p.set_bytes(self.offset, blob)
            p.set(**{self.flag: int(bool(blob))})
        self._bound = key


def attach_rows(params, group: int, head_dim: int, tokens: int = 0, q_rows: int = Q_BOX_ROWS):
    """(query binder, output binder) of the sm90 launches of these ParamBuffers, each None where its packed rows
    are not whole boxes (or the A/B switch is off). tokens: rows_dims'. q_rows: packed rows of a q box (the
    kernel's Q_BOX: 64 in the KVATTN_SM90_QHALF builds)."""
    q = (RowsTensorMap(params, group, q_rows, "tma_qmap", "tma_q", tokens)
         if QUERY_MAPS and rows_mappable(group, q_rows, head_dim) else None)
    o = (RowsTensorMap(params, group, O_BOX_ROWS, "tma_omap", "tma_o", tokens)
         if OUTPUT_MAPS and rows_mappable(group, O_BOX_ROWS, head_dim) else None)
    return q, o


def binder(q_map: RowsTensorMap | None, kv_maps: KVTensorMaps | None, o_map: RowsTensorMap | None = None):
    """run()'s (q, k, v, out) binder of a plan's tensor maps (query, K / V, output), or None without any."""
    if q_map is None and kv_maps is None and o_map is None:
        return None
    last = [None]   # the arrays of the previous call: the usual run() passes the same ones again (one check, not 3)

    def bind(q, k, v, out):
        key = (q.ptr, k.ptr, v.ptr, out.ptr, q.shape, k.shape, q.strides, k.strides, v.strides, out.strides)
        if key == last[0]:
            return
        if q_map is not None:
            q_map(q)
        if kv_maps is not None:
            kv_maps(k, v)
        if o_map is not None:
            o_map(out)
        last[0] = key
    return bind
