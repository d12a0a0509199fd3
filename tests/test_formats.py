"""Host-side KV-cache formats: construction, conversions and round trips (CPU only)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvattn import formats
from kvattn.formats import BlockSparse, CascadeLevels, PagedKVLayout, PageTable, Ragged, pack_mask, unpack_mask

lens_st = st.lists(st.integers(0, 20), min_size=1, max_size=6)


# -- Ragged -------------------------------------------------------------------
def test_ragged_basics():
    r = Ragged([0, 3, 3, 7])
    assert r.indptr.dtype == np.int32 and r.indptr.flags.c_contiguous
    assert r.batch_size == 3 and r.total == 7
    assert r.lengths.tolist() == [3, 0, 4]
    assert r.segment(2) == slice(3, 7) and r.segment(-1) == slice(3, 7)
    assert Ragged.from_lengths([3, 0, 4]) == r
    with pytest.raises(ValueError):
        r.segment(3)


def test_index_arrays_are_int32_copies_and_read_only():
    src = np.array([0, 2, 5], dtype=np.int64)
    r = Ragged(src)
    assert r.indptr.dtype == np.int32 and not r.indptr.flags.writeable
    src[1] = 1  # the caller's array stays theirs
    assert r.indptr.tolist() == [0, 2, 5]


# -- PageTable ------------------------------------------------------------------
def test_page_table_kv_lens_formula():
    pt = PageTable([0, 2, 2, 5], [4, 1, 0, 3, 2], [3, 0, 4], page_size=4)
    assert pt.batch_size == 3
    assert pt.kv_lens.tolist() == [7, 0, 12]
    assert pt.num_pages_used == 5
    assert pt.pages(2).tolist() == [0, 3, 2]
    assert pt.token_slots(0).tolist() == [16, 17, 18, 19, 4, 5, 6]
    assert pt.validate(5) is pt


@given(lens_st, st.integers(1, 6), st.integers(0, 8), st.integers(0, 2**31))
def test_from_kv_lens_scatter(kv_lens, page_size, slack, seed):
    need = sum(-(-k // page_size) for k in kv_lens)
    pt = PageTable.from_kv_lens(kv_lens, page_size, num_pages=need + slack, rng=seed)
    assert pt.kv_lens.tolist() == kv_lens
    assert pt.num_pages_used == need
    assert len(set(pt.indices.tolist())) == need  # no page used twice
    pt.validate(need + slack)
    assert pt == PageTable.from_kv_lens(kv_lens, page_size, num_pages=need + slack, rng=seed)  # reproducible
    for i, k in enumerate(kv_lens):
        lpl = int(pt.last_page_len[i])
        assert (1 <= lpl <= page_size) if k else lpl == 0


def test_from_kv_lens_is_scattered():
    pt = PageTable.from_kv_lens([200, 300], 4, num_pages=200, rng=1)
    assert not np.array_equal(pt.indices, np.sort(pt.indices))
    pt2 = PageTable.from_kv_lens([5], 2, rng=np.random.default_rng(0))
    assert sorted(pt2.indices.tolist()) == [0, 1, 2]


def test_to_device_uses_the_given_copy():
    pt = PageTable.from_kv_lens([3, 9], 4, rng=0)
    dev = pt.to_device(lambda a: ("dev", a.dtype.str, a.flags.c_contiguous))
    assert dev["page_size"] == 4 and dev["indices"] == ("dev", "<i4", True)
    assert set(pt.host_arrays()) == {"indptr", "indices", "last_page_len"}


@given(lens_st, st.lists(st.integers(0, 4), min_size=6, max_size=6), st.integers(1, 5), st.integers(0, 9),
       st.integers(0, 2**31))
def test_page_table_to_block_sparse_dense_mask(kv_lens, qo_all, page_size, slack, seed):
    qo = qo_all[: len(kv_lens)]
    pt = PageTable.from_kv_lens(kv_lens, page_size, num_pages=sum(-(-k // page_size) for k in kv_lens) + slack, rng=seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    num_pages = pt.num_pages_used + slack
    bsr = pt.to_block_sparse(qo_indptr, num_pages=num_pages)
    assert bsr.shape == (sum(qo), num_pages * page_size)
    expected = np.zeros(bsr.shape, dtype=bool)
    for i in range(pt.batch_size):
        expected[qo_indptr[i]:qo_indptr[i + 1], pt.token_slots(i)] = True
    assert np.array_equal(bsr.to_dense_mask(), expected)
    assert BlockSparse.from_page_table(pt, qo_indptr, num_pages) == bsr
    # and back: the dense mask re-blocked gives the same structure (up to column order)
    again = BlockSparse.from_dense_mask(expected, bsr.block_shape)
    assert np.array_equal(again.to_dense_mask(), expected)


def test_to_block_sparse_natural_block_shape():
    pt = PageTable.from_kv_lens([8, 12], 4, rng=0)  # full last pages
    bsr = pt.to_block_sparse([0, 3, 6])
    assert bsr.block_shape == (3, 4)  # R = qo_len, C = page_size
    assert bsr.indices.tolist() == pt.indices.tolist()


# -- BlockSparse --------------------------------------------------------------
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 5), st.integers(0, 5), st.integers(0, 2**31))
def test_bsr_dense_round_trip(r, c, mb, nb, seed):
    blocks = np.random.default_rng(seed).random((mb, nb)) < 0.4
    dense = np.repeat(np.repeat(blocks, r, 0), c, 1)
    bsr = BlockSparse.from_dense_mask(dense, (r, c))
    assert bsr.nnz_blocks == blocks.sum()
    assert np.array_equal(bsr.to_dense_mask(), dense)
    assert BlockSparse(bsr.indptr, bsr.indices, (r, c), (mb * r, nb * c)) == bsr


def test_bsr_scipy_semantics_example():
    # scipy docs example: indptr [0,2,3,6], indices [0,2,2,0,1,2], blocks 2x2 -> 6x6
    bsr = BlockSparse([0, 2, 3, 6], [0, 2, 2, 0, 1, 2], (2, 2), (6, 6))
    m = bsr.to_dense_mask().astype(int)
    assert m[:2].tolist() == [[1, 1, 0, 0, 1, 1]] * 2
    assert m[2:4].tolist() == [[0, 0, 0, 0, 1, 1]] * 2
    assert m[4:].tolist() == [[1] * 6] * 2
    assert bsr.columns(1).tolist() == [4, 5]


# -- Layouts ------------------------------------------------------------------
def test_paged_kv_layout_shapes_and_split():
    nhd, hnd = PagedKVLayout("NHD"), PagedKVLayout.of("HND")
    assert nhd.cache_shape(5, 16, 2, 8) == (5, 16, 2, 8)
    assert hnd.cache_shape(5, 16, 2, 8) == (5, 2, 16, 8)
    c = np.arange(5 * 2 * 2 * 16 * 8, dtype=np.float32).reshape(5, 2, 2, 16, 8)
    k, v = hnd.split(c)
    assert np.shares_memory(k, c) and hnd.dims(k) == (5, 16, 2, 8)
    assert np.array_equal(hnd.to_nhd(v)[3, 7, 1], c[3, 1, 1, 7])
    assert PagedKVLayout.of(nhd) is nhd


# -- Cascade ------------------------------------------------------------------
def test_cascade_docstring_example():
    c = CascadeLevels.from_shared_prefixes([[7, 3, 9], [7, 3, 4, 1]], kv_lens=[10, 13], qo_lens=[1, 1], page_size=4)
    (qo0, l0), (qo1, l1) = c
    assert qo0.tolist() == [0, 2] and l0.indices.tolist() == [7, 3] and l0.last_page_len.tolist() == [4]
    assert qo1.tolist() == [0, 1, 2] and l1.indices.tolist() == [9, 4, 1] and l1.last_page_len.tolist() == [2, 1]
    qo, flat = c.flatten()
    assert flat.kv_lens.tolist() == [10, 13] and flat.indices.tolist() == [7, 3, 9, 7, 3, 4, 1]


@st.composite
def shared_prefix_batches(draw):
    """Groups of requests that share a page prefix, in one scattered pool."""
    ps = draw(st.integers(1, 4))
    groups = draw(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
                           min_size=1, max_size=3))
    qo_lens, kv_lens, lists, sizes = [], [], [], []
    next_page = 0
    for shared, suffixes in groups:
        prefix = list(range(next_page, next_page + shared))
        next_page += shared
        for sfx in suffixes:
            n = -(-sfx // ps)
            lists.append(prefix + list(range(next_page, next_page + n)))
            next_page += n
            kv_lens.append(shared * ps + sfx)
            qo_lens.append(draw(st.integers(1, max(1, min(3, kv_lens[-1])))))
        sizes.append(len(suffixes))
    perm = np.random.default_rng(draw(st.integers(0, 2**31))).permutation(next_page)
    lists = [perm[np.array(p, dtype=np.int64)].tolist() for p in lists]
    return lists, kv_lens, qo_lens, ps, sizes, next_page


@given(shared_prefix_batches(), st.booleans())
def test_cascade_flatten_restores_page_lists(batch, explicit_groups):
    lists, kv_lens, qo_lens, ps, sizes, num_pages = batch
    c = CascadeLevels.from_shared_prefixes(lists, kv_lens, qo_lens, ps, group_sizes=sizes if explicit_groups else None)
    assert len(c) == 2 and c.page_size == ps
    c.validate(num_pages)
    qo, flat = c.flatten()
    assert qo.tolist() == np.concatenate([[0], np.cumsum(qo_lens)]).tolist()
    assert flat.kv_lens.tolist() == kv_lens
    for i, p in enumerate(lists):
        assert flat.pages(i).tolist() == p
    # the suffix level keeps at least qo_len tokens of each request (causal cascade stays exact)
    assert (c[1][1].kv_lens >= np.minimum(qo_lens, kv_lens)).all()


def test_cascade_levels_checks():
    pt = PageTable.from_kv_lens([4, 4], 4, rng=0)
    with pytest.raises(ValueError, match="same 3 query rows"):
        CascadeLevels([([0, 3], PageTable([0, 1], [0], [4], 4)), ([0, 1, 2], pt)])
    with pytest.raises(ValueError, match="boundaries"):
        CascadeLevels([([0, 1, 3], pt), ([0, 2, 3], pt)])
    with pytest.raises(TypeError, match="PageTable"):
        CascadeLevels([([0, 1], "pages")])
    with pytest.raises(ValueError, match="full last pages"):
        CascadeLevels([([0, 2], PageTable([0, 1], [0], [3], 4)), ([0, 1, 2], pt)]).flatten()


# -- Masks --------------------------------------------------------------------
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 11)), min_size=0, max_size=5), st.integers(0, 2**31))
def test_pack_unpack_round_trip(shapes, seed):
    rng = np.random.default_rng(seed)
    masks = [rng.random(s) < 0.5 for s in shapes]
    packed, mask_indptr = pack_mask(masks)
    assert packed.dtype == np.uint8 and mask_indptr.dtype == np.int32
    sizes = [int(np.prod(s)) for s in shapes]
    bit_indptr = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    assert np.diff(mask_indptr).tolist() == [-(-n // 8) for n in sizes]
    flat = np.concatenate([m.ravel() for m in masks]) if masks else np.zeros(0, bool)
    assert np.array_equal(unpack_mask(packed, mask_indptr, bit_indptr), flat)
    p2, mi2 = pack_mask(flat, bit_indptr)
    assert np.array_equal(p2, packed) and np.array_equal(mi2, mask_indptr)
    for i, m in enumerate(masks):  # each segment is numpy's little-bit-order packbits
        seg = packed[mask_indptr[i]:mask_indptr[i + 1]]
        assert np.array_equal(seg, np.packbits(m.ravel(), bitorder="little"))


def test_module_exports():
    for name in ("Ragged", "PageTable", "PagedKVLayout", "BlockSparse", "CascadeLevels", "pack_mask", "unpack_mask"):
        assert name in formats.__all__
