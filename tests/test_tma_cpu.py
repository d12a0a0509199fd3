"""kvattn.tma without a GPU: which plans take TMA tiles, the tensor-map geometry of every cache layout, and the
parameter struct that carries the maps."""
import types

import numpy as np
import pytest

from kvattn import compiler, kernels, tma
from kvattn.opcore import PagedKV, RaggedKV
from kvattn.prefill import PREFILL_PARAMS

BF16, F8 = np.dtype("uint16"), np.dtype("uint8")   # only itemsize matters to tma_mode


def paged(ps, layout="NHD", dtype=BF16):
    kv = PagedKV(layout, ps, 2, 128, dtype, 10)
    return kv


@pytest.mark.parametrize("kv, tile, contiguous, want", [
    (RaggedKV("NHD", 1000, 2, 128, BF16), 128, True, (tma.MODE_RAGGED, 128)),
    (RaggedKV("HND", 1000, 2, 128, BF16), 64, True, (tma.MODE_RAGGED, 64)),
    (RaggedKV("NHD", 1000, 2, 128, BF16), 128, False, (tma.MODE_OFF, 0)),                    # block-sparse, C = 1
    (RaggedKV("NHD", 1000, 2, 128, BF16, tokens_per_page=64), 128, False, (tma.MODE_PAGED, 64)),  # block columns
    (RaggedKV("HND", 1024, 2, 128, BF16, tokens_per_page=256), 128, False, (tma.MODE_PAGED, 128)),
    (RaggedKV("NHD", 1000, 2, 128, BF16, tokens_per_page=16), 128, False, (tma.MODE_PAGED, 16)),
    (RaggedKV("NHD", 1000, 2, 128, BF16, tokens_per_page=24), 128, False, (tma.MODE_OFF, 0)),   # 24 ∤ 128
    (RaggedKV("NHD", 1000, 2, 128, BF16, tokens_per_page=4), 128, False, (tma.MODE_OFF, 0)),    # under 8 rows
    (RaggedKV("NHD", 1000, 2, 128, F8), 128, True, (tma.MODE_OFF, 0)),                       # fp8: producers expand
    (paged(16), 128, False, (tma.MODE_PAGED, 16)),
    (paged(8, "HND"), 64, False, (tma.MODE_PAGED, 8)),
    (paged(256), 128, False, (tma.MODE_PAGED, 128)),
    (paged(128), 64, False, (tma.MODE_PAGED, 64)),
    (paged(1), 128, False, (tma.MODE_OFF, 0)),
    (paged(5), 128, False, (tma.MODE_OFF, 0)),
    (paged(48), 128, False, (tma.MODE_OFF, 0)),
    (paged(512), 128, False, (tma.MODE_OFF, 0)),
    (paged(16, dtype=F8), 128, False, (tma.MODE_OFF, 0)),
])
def test_tma_mode(kv, tile, contiguous, want):
    assert tma.tma_mode(kv, tile, contiguous) == want


def fake(shape, itemsize=2):
    """A contiguous DeviceArray stand-in: shape and byte strides."""
    strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
    return types.SimpleNamespace(shape=shape, strides=strides, ptr=0, itemsize=itemsize)


def test_tensor_map_geometry_of_every_layout():
    n, h, d, p, ps = 1000, 2, 128, 10, 16
    # ragged NHD [n, H, D]: dims (D, H, slots, 1), boxes of the whole tile; the slot extent outgrows the view
    # (a captured graph's map must reach the rows a later plan of the same buffer names)
    ext = 1 << 28
    assert tma._dims(RaggedKV("NHD", n, h, d, BF16), fake((n, h, d)), 128) == (
        (d, h, ext, 1), (d * 2, h * d * 2, ext * h * d * 2), (64, 1, 128, 1))
    # ragged HND [H, n, D]: dims (D, slots, H, 1)
    assert tma._dims(RaggedKV("HND", n, h, d, BF16), fake((h, n, d)), 128) == (
        (d, ext, h, 1), (d * 2, n * d * 2, h * n * d * 2), (64, 128, 1, 1))
    # the byte span stays below 2^40
    big = fake((n, 64, 256))
    dims, strides, _ = tma._dims(RaggedKV("NHD", n, 64, 256, BF16), big, 64)
    assert strides[2] < 1 << 40 and dims[2] >= n
    # paged NHD [P, ps, H, D]: dims (D, H, ps, P), a box per page
    assert tma._dims(paged(ps), fake((p, ps, h, d)), ps) == (
        (d, h, ps, p), (d * 2, h * d * 2, ps * h * d * 2), (64, 1, ps, 1))
    # paged HND [P, H, ps, D]: dims (D, ps, H, P)
    assert tma._dims(paged(ps, "HND"), fake((p, h, ps, d)), ps) == (
        (d, ps, h, p), (d * 2, ps * d * 2, h * ps * d * 2), (64, ps, 1, 1))
    # block-sparse NHD [n, H, D] as pages of C tokens: dims (D, H, C, pages), the page extent unbounded like the
    # ragged slots (capped below 2^40 bytes)
    c = 64
    dims, strides, box = tma._dims(RaggedKV("NHD", 1024, h, d, BF16, tokens_per_page=c), fake((1024, h, d)), 64)
    assert dims[:3] == (d, h, c) and dims[3] >= 1024 // c and strides == (d * 2, h * d * 2, c * h * d * 2)
    assert box == (64, 1, 64, 1) and strides[2] * dims[3] < 1 << 40
    # block-sparse HND [H, n, D]: dims (D, C, H, pages), the page stride C tokens of one head
    dims, strides, box = tma._dims(RaggedKV("HND", 1024, h, d, BF16, tokens_per_page=c), fake((h, 1024, d)), 64)
    assert dims[:3] == (d, c, h) and strides == (d * 2, 1024 * d * 2, c * d * 2) and box == (64, 64, 1, 1)
    # one [P, 2, ps, H, D] cache: k = cache[:, 0] keeps the page stride of both
    k = types.SimpleNamespace(shape=(p, ps, h, d), strides=(2 * ps * h * d * 2, h * d * 2, d * 2, 2), ptr=0)
    assert tma._dims(paged(ps), k, ps)[1] == (d * 2, h * d * 2, 2 * ps * h * d * 2)


def test_tensor_maps_sit_64_byte_aligned_in_the_parameters():
    off = PREFILL_PARAMS.fields["tma_k"][1]
    assert off % 64 == 0 and PREFILL_PARAMS.fields["tma_v"][1] == off + 128
    assert PREFILL_PARAMS.fields["tma_qmap"][1] == off + 256 and PREFILL_PARAMS.fields["tma_omap"][1] == off + 384
    assert PREFILL_PARAMS.itemsize == off + 512
    src = '#include "prefill.cuh"\n' + kernels.size_assert("kvattn::PrefillParams", PREFILL_PARAMS)
    compiler.compile_cubin(src, "tma_params.cu", [], [], "sm_90a")


def test_attach_switches_the_launches_and_binds_both_maps(monkeypatch):
    params = [kernels.ParamBuffer(PREFILL_PARAMS) for _ in range(2)]
    assert tma.attach(paged(5), params, 128) is None
    assert all(p["tma_mode"] == 0 for p in params)
    binder = tma.attach(paged(16, "HND"), params, 128)
    assert all((p["tma_mode"], p["tma_rows"], p["tma_hnd"]) == (tma.MODE_PAGED, 16, 1) for p in params)
    calls = []
    monkeypatch.setattr(tma, "encode", lambda kv, a, rows, il=False: calls.append((a.ptr, rows)) or bytes([a.ptr]) * 128)
    k, v = types.SimpleNamespace(ptr=7, shape=(4,), strides=(2,)), types.SimpleNamespace(ptr=9, shape=(4,), strides=(2,))
    binder(k, v)
    binder(k, v)   # cached: encoded once
    assert calls == [(7, 16), (9, 16)]
    off = PREFILL_PARAMS.fields["tma_k"][1]
    for p in params:
        raw = bytes(p.raw)
        assert raw[off:off + 128] == bytes([7]) * 128 and raw[off + 128:off + 256] == bytes([9]) * 128
    with pytest.raises(ValueError, match="set_bytes"):
        params[0].set_bytes(PREFILL_PARAMS.itemsize - 8, bytes(16))


@pytest.mark.parametrize("kv, tile, want", [
    (paged(16), 128, True), (paged(8, "HND"), 64, True), (paged(256), 128, True), (paged(16), 80, True),
    (paged(5), 128, False), (paged(1), 128, False), (paged(16, dtype=F8), 128, False),
    (RaggedKV("NHD", 1000, 2, 128, BF16, tokens_per_page=64), 128, False),   # block-sparse columns keep 4-dim maps
    (RaggedKV("NHD", 1000, 2, 128, BF16), 128, False),
])
def test_interleaved_tiles_only_for_paged_caches_of_whole_boxes(kv, tile, want):
    assert tma.interleaved_tiles(kv, tile) == want


def test_interleaved_tensor_map_geometry():
    """5 dims (column of a 64-column block, row in an 8-row group, block, group, page), a box = a page's rows across
    every block of one head; NHD's blocks run over the heads of a token, HND's groups over the heads of a page."""
    h, d, p, ps, e = 8, 128, 10, 16, 2
    row = h * d * e   # NHD token stride
    assert tma._dims_interleaved(paged(ps), fake((p, ps, h, d)), ps) == (
        (64, 8, h * 2, ps // 8, p), (row, 128, 8 * row, ps * row), (64, 8, 2, ps // 8, 1))
    assert tma._dims_interleaved(paged(ps, "HND"), fake((p, h, ps, d)), ps) == (
        (64, 8, 2, h * ps // 8, p), (d * e, 128, 8 * d * e, h * ps * d * e), (64, 8, 2, ps // 8, 1))
    # a page larger than the tile: a box is the tile's rows inside it
    assert tma._dims_interleaved(paged(256), fake((p, 256, h, d)), 128)[2] == (64, 8, 2, 16, 1)
    # one [P, 2, ps, H, D] cache: k = cache[:, 0] keeps the page stride of both
    k = types.SimpleNamespace(shape=(p, ps, h, d), strides=(2 * ps * row, row, d * e, e), ptr=0, itemsize=e)
    assert tma._dims_interleaved(paged(ps), k, ps)[1][3] == 2 * ps * row
    # heads not contiguous in a token (NHD) or a page (HND): not describable
    gap = types.SimpleNamespace(shape=(p, ps, h, d), strides=(ps * row * 2, row * 2, d * e * 2, e), ptr=0, itemsize=e)
    with pytest.raises(tma.StridesNotMapped, match="heads contiguous"):
        tma._dims_interleaved(paged(ps), gap, ps)
    gap = types.SimpleNamespace(shape=(p, h, ps, d), strides=(h * ps * d * e * 2, ps * d * e * 2, d * e, e), ptr=0,
                                itemsize=e)
    with pytest.raises(tma.StridesNotMapped, match="heads contiguous"):
        tma._dims_interleaved(paged(ps, "HND"), gap, ps)


def test_interleaved_binder_falls_back_to_copies_for_unmapped_strides(monkeypatch):
    """Arrays an interleaved map cannot describe switch the launches to their per-thread copies (tma_mode 0) while
    they are bound; mappable arrays switch them back."""
    params = [kernels.ParamBuffer(PREFILL_PARAMS)]
    binder = tma.attach(paged(16), params, 128, interleaved=True)
    assert binder is not None and binder.interleaved and params[0]["tma_mode"] == tma.MODE_PAGED

    def encode(kv, a, rows, interleaved=False):
        assert interleaved
        if a.ptr == 1:
            raise tma.StridesNotMapped("k / v: interleaved tensor maps need each token's heads contiguous")
        return bytes([a.ptr]) * 128
    monkeypatch.setattr(tma, "encode", encode)
    good = [types.SimpleNamespace(ptr=x, shape=(4,), strides=(2,)) for x in (7, 9)]
    bad = types.SimpleNamespace(ptr=1, shape=(4,), strides=(4,))
    binder(bad, good[1])
    assert params[0]["tma_mode"] == tma.MODE_OFF
    binder(*good)
    assert params[0]["tma_mode"] == tma.MODE_PAGED
    assert bytes(params[0].raw)[PREFILL_PARAMS.fields["tma_k"][1]] == 7
    # block-sparse columns (a RaggedKV of pages) under an interleaved kernel: per-thread copies
    assert tma.attach(RaggedKV("NHD", 1024, 2, 128, BF16, tokens_per_page=64), params, 128, interleaved=True) is None


def test_query_tensor_map_geometry():
    """q [tokens, Hq, D] as (D, group, KV head, token); a box = one 64-column block of a CTA's packed rows (group
    heads of rows / group tokens), so the box's row order is the kernel's packed row order."""
    n, hq, d, e = 1000, 32, 128, 2
    q = types.SimpleNamespace(shape=(n, hq, d), strides=(hq * d * e, d * e, e), ptr=256, itemsize=e)
    assert tma.rows_dims(q, 4, 128) == ((d, 4, 8, n), (d * e, 4 * d * e, hq * d * e), (64, 4, 1, 32))
    assert tma.rows_dims(q, 1, 128)[2] == (64, 1, 1, 128)
    # graph mode: a later plan may read up to the bound's rows of the array captured with fewer
    assert tma.rows_dims(q, 4, 128, tokens=4096)[0] == (d, 4, 8, 4096) and tma.rows_dims(q, 4, 128, 10)[0][3] == n
    # a q slice of a fused qkv projection: rows strided past Hq * D, still mapped
    qkv = types.SimpleNamespace(shape=(n, hq, d), strides=(48 * d * e, d * e, e), ptr=256, itemsize=e)
    assert tma.rows_dims(qkv, 4, 128)[1] == (d * e, 4 * d * e, 48 * d * e)
    for bad in (types.SimpleNamespace(shape=(n, hq, d), strides=(hq * d * e, d * e, 2 * e), ptr=256, itemsize=e),
                types.SimpleNamespace(shape=(n, hq, d), strides=(hq * d * e + 2, d * e, e), ptr=256, itemsize=e),
                types.SimpleNamespace(shape=(n, hq, d), strides=(hq * d * e, d * e, e), ptr=258, itemsize=e)):
        with pytest.raises(tma.StridesNotMapped, match="q / out: a tensor map"):
            tma.rows_dims(bad, 4, 128)


@pytest.mark.parametrize("group, rows, d, want", [
    (4, 128, 128, True), (1, 128, 64, True), (8, 128, 256, True), (128, 128, 128, True),
    (3, 128, 128, False), (256, 128, 128, False), (4, 128, 96, False)])
def test_row_maps_only_where_packed_rows_are_whole_boxes(group, rows, d, want):
    assert tma.rows_mappable(group, rows, d) == want


def test_attach_rows_gives_the_query_and_output_binders(monkeypatch):
    params = [kernels.ParamBuffer(PREFILL_PARAMS)]
    q, o = tma.attach_rows(params, 4, 128)
    assert (q.rows, q.flag, o.rows, o.flag) == (128, "tma_q", 64, "tma_o")
    assert q.offset == PREFILL_PARAMS.fields["tma_qmap"][1] and o.offset == PREFILL_PARAMS.fields["tma_omap"][1]
    q, o = tma.attach_rows(params, 128, 128)   # 128 heads a KV head: a CTA's rows are one token, a warpgroup's half
    assert q is not None and o is None
    monkeypatch.setattr(tma, "QUERY_MAPS", False)
    assert tma.attach_rows(params, 4, 128)[0] is None


def test_qhalf_builds_take_64_row_query_boxes(monkeypatch):
    """The KVATTN_SM90_QHALF builds (scripts/ab_sm90.py --qhalf) issue a consumer warpgroup's 64 Q rows a box: the
    plan's q map has 64-row boxes there (no map where 64 rows are no whole tokens), 128 elsewhere."""
    from kvattn import prefill
    from kvattn.variants import Variant
    assert prefill.sm90_q_box_rows(prefill.sm90_spec(128, Variant(), "bfloat16")) == 128
    for mode in (1, 2):
        monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_QHALF", mode),))
        assert prefill.sm90_q_box_rows(prefill.sm90_spec(128, Variant(), "bfloat16")) == 64
    params = [kernels.ParamBuffer(PREFILL_PARAMS)]
    assert tma.attach_rows(params, 4, 128, q_rows=64)[0].rows == 64
    assert tma.attach_rows(params, 128, 128, q_rows=64)[0] is None   # 64 rows: half a token
    e = 2
    q = types.SimpleNamespace(shape=(64, 32, 128), strides=(32 * 128 * e, 128 * e, e), ptr=512, itemsize=e)
    assert tma.rows_dims(q, 4, 64)[2] == (64, 4, 1, 16)


def test_query_binder_sets_the_map_and_falls_back_for_unmapped_strides(monkeypatch):
    params = [kernels.ParamBuffer(PREFILL_PARAMS) for _ in range(2)]
    binder = tma.RowsTensorMap(params, 4, 128, "tma_qmap", "tma_q")
    calls = []

    def encode(dtype, a, dims, strides, box):
        calls.append(a.ptr)
        return bytes([a.ptr % 251]) * 128
    monkeypatch.setattr(tma, "_encode", encode)
    e = 2
    q = types.SimpleNamespace(shape=(64, 32, 128), strides=(32 * 128 * e, 128 * e, e), ptr=512, itemsize=e,
                              dtype=np.dtype("uint16"))
    binder(q)
    binder(q)   # the same array again: nothing encoded, nothing written
    assert calls == [512]
    off = PREFILL_PARAMS.fields["tma_qmap"][1]
    for p in params:
        assert p["tma_q"] == 1 and bytes(p.raw)[off:off + 128] == bytes([512 % 251]) * 128
    odd = types.SimpleNamespace(shape=(64, 32, 128), strides=(32 * 128 * e, 128 * e, 2 * e), ptr=1024, itemsize=e,
                                dtype=np.dtype("uint16"))
    binder(odd)
    assert calls == [512] and all(p["tma_q"] == 0 for p in params)
    binder(q)   # cached: mapped again without encoding
    assert calls == [512] and all(p["tma_q"] == 1 for p in params)


def test_plan_binder_calls_every_map_once_per_set_of_arrays():
    """run()'s binder hands each array to its map, and skips all of them when run() passes the same arrays (pointers,
    shapes, strides) as the call before; any change binds again."""
    from types import SimpleNamespace

    def arr(ptr, shape=(4, 2, 64), strides=(256, 128, 2)):
        return SimpleNamespace(ptr=ptr, shape=shape, strides=strides)
    seen = []
    q_map, kv_maps = (lambda q: seen.append(("q", q.ptr))), (lambda k, v: seen.append(("kv", k.ptr, v.ptr)))
    o_map = lambda o: seen.append(("o", o.ptr))   # noqa: E731
    assert tma.binder(None, None) is None and tma.binder(None, None, None) is None
    bind = tma.binder(q_map, kv_maps, o_map)
    a = [arr(1), arr(2), arr(3), arr(4)]
    bind(*a)
    bind(*a)                                  # the same arrays: nothing to bind
    bind(arr(1), arr(2), arr(3), arr(4))      # equal pointers, shapes and strides: nothing either
    bind(a[0], a[1], a[2], arr(4, strides=(512, 128, 2)))   # out's strides changed: every map again
    tma.binder(None, kv_maps)(arr(5), arr(6), arr(7), arr(8))
    tma.binder(q_map, None)(arr(9), arr(10), arr(11), arr(12))
    assert seen == [("q", 1), ("kv", 2, 3), ("o", 4), ("q", 1), ("kv", 2, 3), ("o", 4), ("kv", 6, 7), ("q", 9)]
