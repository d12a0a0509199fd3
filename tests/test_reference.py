"""The float64 reference: direct formulas and format equivalences (CPU only)."""
import math

import ml_dtypes
import numpy as np
from hypothesis import given, strategies as st

from kvattn import reference as ref
from kvattn.formats import BlockSparse, CascadeLevels, PagedKVLayout, PageTable

seeds = st.integers(0, 2**31)


def rand(rng, *shape):
    return rng.standard_normal(shape)


def naive(q, k, v, causal=False, sm_scale=None, window_left=-1, cap=0.0, alibi=None, mask=None, sinks=None):
    """Scalar loops straight from DESIGN.md section 3 (tiny sizes only)."""
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    sm_scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    o, lse = np.zeros((qo, hq, dv)), np.full((qo, hq), -np.inf)
    for h in range(hq):
        kh = h // (hq // hkv)
        for r in range(qo):
            s, keep = [], []
            for j in range(kv):
                x = float(np.dot(q[r, h], k[j, kh])) * sm_scale
                if cap > 0:
                    x = cap * math.tanh(x / cap)
                if alibi is not None:
                    x += alibi[h] * (j - (kv - qo + r))
                ok = (not causal or j <= kv - qo + r) and (window_left < 0 or j >= kv - qo + r - window_left)
                if mask is not None:
                    ok = ok and bool(mask[r, j])
                if ok:
                    s.append(x)
                    keep.append(j)
            if sinks is not None:   # the sink: one more logit whose value row is zero
                s.append(float(sinks[h]))
            if s:
                m = max(s)
                w = np.exp(np.array(s) - m)
                lse[r, h] = m + math.log(w.sum())
                o[r, h] = (w[:len(keep), None] * v[keep, kh]).sum(0) / w.sum() if keep else 0.0
    return o, lse


# -- single request: direct formulas -------------------------------------------
@given(seeds, st.integers(0, 5), st.integers(0, 7), st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 4, 8]),
       st.booleans(), st.integers(-1, 4), st.sampled_from([0.0, 0.5, 5.0]), st.booleans(), st.booleans())
def test_attention_matches_direct_formula(seed, qo, kv, hkv, g, d, causal, window, cap, use_alibi, use_mask):
    rng = np.random.default_rng(seed)
    causal = causal and kv >= qo
    q, k, v = rand(rng, qo, hkv * g, d), rand(rng, kv, hkv, d), rand(rng, kv, hkv, d + 1)
    alibi = rng.random(hkv * g) if use_alibi else None
    mask = rng.random((qo, kv)) < 0.6 if use_mask else None
    o, lse = ref.attention(q, k, v, causal=causal, window_left=window, logits_soft_cap=cap, alibi_slopes=alibi,
                           custom_mask=mask, return_lse=True)
    eo, else_ = naive(q, k, v, causal, None, window, cap, alibi, mask)
    assert o.dtype == np.float64 and o.shape == (qo, hkv * g, d + 1) and lse.shape == (qo, hkv * g)
    np.testing.assert_allclose(o, eo, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(else_))
    np.testing.assert_allclose(lse, else_, rtol=1e-10, atol=1e-12)
    assert not np.isnan(o).any() and not np.isnan(lse).any()


@given(seeds, st.integers(0, 5), st.integers(0, 7), st.booleans(), st.integers(-1, 3), st.booleans())
def test_sinks_match_direct_formula(seed, qo, kv, causal, window, use_mask):
    rng = np.random.default_rng(seed)
    causal = causal and kv >= qo
    q, k, v = rand(rng, qo, 4, 8), rand(rng, kv, 2, 8), rand(rng, kv, 2, 8)
    sinks = rng.standard_normal(4) * 3
    mask = rng.random((qo, kv)) < 0.5 if use_mask else None
    o, lse = ref.attention(q, k, v, causal=causal, window_left=window, custom_mask=mask, sinks=sinks,
                           return_lse=True)
    eo, el = naive(q, k, v, causal, None, window, mask=mask, sinks=sinks)
    np.testing.assert_allclose(o, eo, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, el, rtol=1e-10, atol=1e-12)   # a row with no kept key: o = 0, lse = sink


@given(seeds, st.integers(1, 6), st.integers(0, 4))
def test_causal_equals_lower_triangular_mask(seed, n, extra):
    rng = np.random.default_rng(seed)
    qo, kv = n, n + extra
    q, k, v = rand(rng, qo, 4, 8), rand(rng, kv, 2, 8), rand(rng, kv, 2, 8)
    tri = np.arange(kv)[None, :] <= np.arange(qo)[:, None] + (kv - qo)  # bottom-right aligned
    a = ref.attention(q, k, v, causal=True, return_lse=True)
    b = ref.attention(q, k, v, custom_mask=tri, return_lse=True)
    c = ref.attention(q, k, v, custom_mask=tri.ravel(), return_lse=True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12)
    for x, y in zip(b, c):
        np.testing.assert_array_equal(x, y)
    if extra == 0:
        np.testing.assert_allclose(a[0], ref.attention(q, k, v, custom_mask=np.tril(np.ones((n, n), bool))))


@given(seeds, st.integers(1, 4), st.integers(1, 4))
def test_gqa_equals_repeated_kv_heads(seed, hkv, g):
    rng = np.random.default_rng(seed)
    q, k, v = rand(rng, 3, hkv * g, 4), rand(rng, 6, hkv, 4), rand(rng, 6, hkv, 4)
    a = ref.attention(q, k, v, causal=True, return_lse=True)
    b = ref.attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), causal=True, return_lse=True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12)


@given(seeds, st.integers(0, 6), st.floats(0.1, 30.0))
def test_window_and_soft_cap_direct(seed, w, cap):
    rng = np.random.default_rng(seed)
    qo, kv = 4, 9
    q, k, v = rand(rng, qo, 2, 8) * 3, rand(rng, kv, 2, 8), rand(rng, kv, 2, 8)
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(8)
    s = cap * np.tanh(s / cap)
    pos = kv - qo + np.arange(qo)[:, None]
    j = np.arange(kv)[None, :]
    s = np.where((j <= pos) & (j >= pos - w), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    expect_lse = (np.log(p.sum(-1)) + s.max(-1)).T
    expect = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    o, lse = ref.attention(q, k, v, causal=True, window_left=w, logits_soft_cap=cap, return_lse=True)
    np.testing.assert_allclose(o, expect, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, expect_lse, rtol=1e-10)


def test_empty_and_fully_masked_rows():
    rng = np.random.default_rng(0)
    q = rand(rng, 2, 2, 4)
    o, lse = ref.attention(q, np.zeros((0, 1, 4)), np.zeros((0, 1, 3)), return_lse=True)
    assert o.shape == (2, 2, 3) and (o == 0).all() and np.isneginf(lse).all()
    k, v = rand(rng, 3, 1, 4), rand(rng, 3, 1, 4)
    mask = np.array([[False] * 3, [True, False, True]])
    o, lse = ref.attention(q, k, v, custom_mask=mask, alibi_slopes=np.ones(2), return_lse=True)
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all() and np.isfinite(lse[1]).all()
    o, lse = ref.attention(q[:0], k, v, return_lse=True)
    assert o.shape == (0, 2, 4) and lse.shape == (0, 2)


def test_low_precision_inputs_and_nan_data():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 2, 2, 8), rand(rng, 5, 2, 8), rand(rng, 5, 2, 8)
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32):
        qd, kd, vd = (x.astype(dt) for x in (q, k, v))
        o = ref.attention(qd, kd, vd)
        assert o.dtype == np.float64
        np.testing.assert_allclose(o, ref.attention(*(x.astype(np.float64) for x in (qd, kd, vd))), rtol=0)
    k[2, 0, 0] = np.nan  # NaN in data is allowed; it poisons exactly the rows that see it
    o = ref.attention(q, k, v, custom_mask=np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]], bool))
    assert np.isnan(o[0, 0]).all() and not np.isnan(o[1]).any() and not np.isnan(o[0, 1]).any()


# -- merge ----------------------------------------------------------------------
@given(seeds, st.integers(1, 9), st.lists(st.integers(0, 9), max_size=3), st.booleans())
def test_split_kv_and_merge_equals_unsplit(seed, kv, cuts, causal):
    rng = np.random.default_rng(seed)
    qo = min(3, kv)
    q, k, v = rand(rng, qo, 4, 8), rand(rng, kv, 2, 8), rand(rng, kv, 2, 8)
    full = ref.attention(q, k, v, causal=causal, return_lse=True)
    mask = np.arange(kv)[None, :] <= np.arange(qo)[:, None] + kv - qo if causal else np.ones((qo, kv), bool)
    bounds = [0] + sorted(min(c, kv) for c in cuts) + [kv]
    parts = [ref.attention(q, k[a:b], v[a:b], custom_mask=mask[:, a:b], return_lse=True)
             for a, b in zip(bounds[:-1], bounds[1:])]
    o, lse = ref.merge_states(np.stack([p[0] for p in parts], 1), np.stack([p[1] for p in parts], 1))
    np.testing.assert_allclose(o, full[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, full[1], rtol=1e-10)
    o2, lse2 = parts[0]
    for p in parts[1:]:  # pairwise, left to right
        o2, lse2 = ref.merge_state(o2, lse2, *p)
    np.testing.assert_allclose(o2, full[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse2, full[1], rtol=1e-10)


@given(seeds)
def test_merge_commutative_associative_and_inf(seed):
    rng = np.random.default_rng(seed)
    st_ = [(rand(rng, 4, 2, 3), rand(rng, 4, 2) * 3) for _ in range(3)]
    for o, lse in st_:
        lse[rng.random(lse.shape) < 0.3] = -np.inf
    (a, la), (b, lb), (c, lc) = st_
    ab = ref.merge_state(a, la, b, lb)
    ba = ref.merge_state(b, lb, a, la)
    np.testing.assert_allclose(ab[0], ba[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(ab[1], ba[1])
    left = ref.merge_state(*ab, c, lc)
    right = ref.merge_state(a, la, *ref.merge_state(b, lb, c, lc))
    np.testing.assert_allclose(left[0], right[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(left[1], right[1], rtol=1e-12)
    both = np.isneginf(la) & np.isneginf(lb)
    assert (ab[0][both] == 0).all() and np.isneginf(ab[1][both]).all() and not np.isnan(ab[0]).any()
    e = ref.merge_states(np.zeros((2, 0, 2, 3)), np.zeros((2, 0, 2)))
    assert (e[0] == 0).all() and np.isneginf(e[1]).all()


def test_merge_ignores_junk_in_empty_states_but_propagates_nan_lse():
    o_a, l_a = np.full((1, 1, 2), np.nan), np.array([[-np.inf]])  # an unwritten partial
    o_b, l_b = np.ones((1, 1, 2)), np.array([[0.5]])
    o, lse = ref.merge_state(o_a, l_a, o_b, l_b)
    assert (o == 1).all() and lse[0, 0] == 0.5
    o, lse = ref.merge_state(o_b, np.array([[np.nan]]), o_b, l_b)
    assert np.isnan(o).all() and np.isnan(lse).all()
    o, lse = ref.merge_state(o_a.astype(np.float16), l_a.astype(np.float32), o_b.astype(ml_dtypes.bfloat16), l_b)
    assert o.dtype == np.float64 and (o == 1).all()


# -- one KV content, four formats ------------------------------------------------
@st.composite
def batches(draw, max_b=4):
    b = draw(st.integers(1, max_b))
    kv = draw(st.lists(st.integers(0, 13), min_size=b, max_size=b))
    qo = [draw(st.integers(0, min(k, 4))) for k in kv]
    return qo, kv


@given(seeds, batches(), st.integers(1, 5), st.integers(0, 6), st.sampled_from(["NHD", "HND"]), st.booleans(),
       st.booleans(), st.sampled_from([0.0, 2.0]))
def test_ragged_paged_block_sparse_agree(seed, batch, ps, slack, layout, combined, causal, cap):
    qo, kv = batch
    rng = np.random.default_rng(seed)
    hkv, g, d = 2, 2, 4
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    kv_indptr = np.concatenate([[0], np.cumsum(kv)])
    q, k, v = rand(rng, qo_indptr[-1], hkv * g, d), rand(rng, kv_indptr[-1], hkv, d), rand(rng, kv_indptr[-1], hkv, d)
    pt = PageTable.from_kv_lens(kv, ps, num_pages=sum(-(-x // ps) for x in kv) + slack, rng=seed)
    num_pages = pt.num_pages_used + slack
    lay = PagedKVLayout(layout)
    kc = rng.standard_normal(lay.cache_shape(num_pages, ps, hkv, d)).astype(np.float32)  # junk in unused slots
    vc = rng.standard_normal(lay.cache_shape(num_pages, ps, hkv, d)).astype(np.float32)
    kn, vn = lay.to_nhd(kc), lay.to_nhd(vc)
    for i in range(len(kv)):  # write through the NHD views into the caches
        slots = pt.token_slots(i)
        kn[slots // ps, slots % ps] = k[kv_indptr[i]:kv_indptr[i + 1]]
        vn[slots // ps, slots % ps] = v[kv_indptr[i]:kv_indptr[i + 1]]
    k, v = k.astype(np.float32), v.astype(np.float32)  # what the cache holds
    opts = dict(causal=causal, logits_soft_cap=cap, return_lse=True)
    o_r, l_r = ref.batch_attention_ragged(q, k, v, qo_indptr, kv_indptr, **opts)
    if combined:
        args = (np.stack([kc, vc], 1), None)
    else:
        args = (kc, vc)
    o_p, l_p = ref.batch_attention_paged(q, *args, qo_indptr, pt, kv_layout=layout, **opts)
    np.testing.assert_allclose(o_p, o_r, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(l_p, l_r, rtol=1e-12)
    # per request, single-request attention agrees too
    for i in range(len(kv)):
        s, t = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
        o1, l1 = ref.attention(q[s], k[t], v[t], **opts)
        np.testing.assert_allclose(o_r[s], o1, rtol=1e-12, atol=1e-14)
    if not causal:  # block-sparse rows see a set of columns: no positions, no causal
        bsr = pt.to_block_sparse(qo_indptr, num_pages)
        o_b, l_b = ref.block_sparse_attention(q, kn.reshape(-1, hkv, d), vn.reshape(-1, hkv, d), bsr,  # copies
                                              logits_soft_cap=cap, return_lse=True)
        np.testing.assert_allclose(o_b, o_r, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(l_b, l_r, rtol=1e-12)


def test_block_sparse_equals_dense_mask():
    rng = np.random.default_rng(3)
    blocks = rng.random((3, 4)) < 0.5
    blocks[1] = False  # an empty block row
    mask = np.repeat(np.repeat(blocks, 2, 0), 3, 1)
    bsr = BlockSparse.from_dense_mask(mask, (2, 3))
    q, k, v = rand(rng, 6, 2, 4), rand(rng, 12, 1, 4), rand(rng, 12, 1, 5)
    o, lse = ref.block_sparse_attention(q, k, v, bsr, return_lse=True)
    eo, el = ref.attention(q, k, v, custom_mask=mask, return_lse=True)
    np.testing.assert_allclose(o, eo, rtol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(el))
    assert np.isneginf(lse[2:4]).all() and (o[2:4] == 0).all()


@given(seeds, batches(3), st.integers(1, 4), st.booleans())
def test_custom_mask_batched_matches_per_request(seed, batch, ps, causal):
    qo, kv = batch
    rng = np.random.default_rng(seed)
    masks = [rng.random((a, b)) < 0.5 for a, b in zip(qo, kv)]
    flat = np.concatenate([m.ravel() for m in masks])
    qo_indptr, kv_indptr = np.concatenate([[0], np.cumsum(qo)]), np.concatenate([[0], np.cumsum(kv)])
    q, k, v = rand(rng, sum(qo), 2, 4), rand(rng, sum(kv), 1, 4), rand(rng, sum(kv), 1, 4)
    o = ref.batch_attention_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal, custom_mask=flat, window_left=3)
    o2 = ref.batch_attention_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal, custom_mask=masks, window_left=3)
    np.testing.assert_array_equal(o, o2)
    for i, m in enumerate(masks):
        s, t = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
        np.testing.assert_allclose(o[s], ref.attention(q[s], k[t], v[t], causal=causal, custom_mask=m, window_left=3))


# -- cascade --------------------------------------------------------------------
@given(seeds, st.integers(1, 4), st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 8), min_size=1,
                                                                                 max_size=3)), min_size=1, max_size=3),
       st.booleans(), st.sampled_from(["NHD", "HND"]))
def test_cascade_equals_flat(seed, ps, groups, causal, layout):
    rng = np.random.default_rng(seed)
    lists, kv_lens, qo_lens, nxt = [], [], [], 0
    for shared, sfx in groups:
        prefix = list(range(nxt, nxt + shared))
        nxt += shared
        for n in sfx:
            cnt = -(-n // ps)
            lists.append(prefix + list(range(nxt, nxt + cnt)))
            nxt += cnt
            kv_lens.append(shared * ps + n)
            qo_lens.append(int(rng.integers(0, min(kv_lens[-1], 3) + 1)))
    perm = rng.permutation(nxt + 2)
    lists = [perm[np.array(p, dtype=np.int64)] for p in lists]
    c = CascadeLevels.from_shared_prefixes(lists, kv_lens, qo_lens, ps)
    qo_indptr, flat = c.flatten()
    lay = PagedKVLayout(layout)
    kc = rng.standard_normal(lay.cache_shape(nxt + 2, ps, 1, 4))
    vc = rng.standard_normal(lay.cache_shape(nxt + 2, ps, 1, 4))
    q = rand(rng, sum(qo_lens), 3, 4)
    a = ref.cascade_attention(q, kc, vc, c, kv_layout=layout, causal=causal, return_lse=True)
    b = ref.batch_attention_paged(q, kc, vc, qo_indptr, flat, kv_layout=layout, causal=causal, return_lse=True)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-10)


# -- append and RoPE ----------------------------------------------------------------
@given(seeds, batches(3), st.integers(1, 4), st.sampled_from(["NHD", "HND"]), st.booleans())
def test_append_then_attend(seed, batch, ps, layout, combined):
    qo, kv_new = batch
    rng = np.random.default_rng(seed)
    app = [int(rng.integers(0, k + 1)) for k in kv_new]
    pt = PageTable.from_kv_lens(kv_new, ps, num_pages=sum(-(-x // ps) for x in kv_new) + 1, rng=seed)
    lay = PagedKVLayout(layout)
    shape = lay.cache_shape(pt.num_pages_used + 1, ps, 2, 4)
    kc, vc = rand(rng, *shape).astype(np.float16), rand(rng, *shape).astype(np.float16)
    app_indptr = np.concatenate([[0], np.cumsum(app)])
    ak, av = rand(rng, app_indptr[-1], 2, 4), rand(rng, app_indptr[-1], 2, 4)
    bi, pos = ref.batch_indices_positions(app_indptr, kv_new)
    if combined:
        nk, nv = ref.append_paged_kv_cache(ak, av, bi, pos, np.stack([kc, vc], 1), None, pt, kv_layout=layout)
        assert nv is None and nk.dtype == np.float16
        nk, nv = nk[:, 0], nk[:, 1]
    else:
        nk, nv = ref.append_paged_kv_cache(ak, av, bi, pos, kc, vc, pt, kv_layout=layout)
    kn, vn = lay.to_nhd(nk), lay.to_nhd(nv)
    for i in range(len(kv_new)):
        slots = pt.token_slots(i)[kv_new[i] - app[i]:]
        a = slice(app_indptr[i], app_indptr[i + 1])
        np.testing.assert_array_equal(kn[slots // ps, slots % ps], ak[a].astype(np.float16))
        np.testing.assert_array_equal(vn[slots // ps, slots % ps], av[a].astype(np.float16))
    untouched = np.ones(kn.shape[:2], bool)
    untouched[pt.indices[pt.indptr[bi] + pos // ps], pos % ps] = False
    np.testing.assert_array_equal(kn[untouched], lay.to_nhd(kc)[untouched])
    np.testing.assert_array_equal(vn[untouched], lay.to_nhd(vc)[untouched])
    # attention over the appended cache equals attention over the ragged KV that now holds the tokens
    q = rand(rng, sum(qo), 4, 4)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    o = ref.batch_attention_paged(q, nk, nv, qo_indptr, pt, kv_layout=layout)
    for i in range(len(kv_new)):
        slots = pt.token_slots(i)
        s = slice(qo_indptr[i], qo_indptr[i + 1])
        np.testing.assert_allclose(o[s], ref.attention(q[s], kn[slots // ps, slots % ps], vn[slots // ps, slots % ps]))


@given(seeds, st.integers(1, 4).map(lambda x: 2 * x), st.integers(0, 50), st.integers(0, 50), st.booleans(),
       st.sampled_from([1.0, 2.0]))
def test_rope_properties(seed, d, m, n, interleave, scale):
    rng = np.random.default_rng(seed)
    q, k = rand(rng, 1, 2, d), rand(rng, 1, 2, d)
    kw = dict(interleave=interleave, rope_scale=scale)
    rq, rk = ref.apply_rope(q, [m], **kw), ref.apply_rope(k, [n], **kw)
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-12)
    # the score depends only on m - n
    s = np.sum(rq * rk)
    s2 = np.sum(ref.apply_rope(q, [m + 7], **kw) * ref.apply_rope(k, [n + 7], **kw))
    np.testing.assert_allclose(s, s2, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(ref.apply_rope(q, [0], **kw), q)
    # NeoX on halves == GPT-J on pairs after permuting dims
    perm = np.arange(d).reshape(2, d // 2).T.ravel()  # [0, d/2, 1, d/2+1, ...]
    neox = ref.apply_rope(q, [m], rope_scale=scale)
    gptj = ref.apply_rope(q[..., perm], [m], interleave=True, rope_scale=scale)
    np.testing.assert_allclose(gptj, neox[..., perm], rtol=1e-12, atol=1e-14)


def test_rope_known_values():
    x = np.zeros((1, 1, 4))
    x[0, 0, 0] = 1.0
    out = ref.apply_rope(x, [3], rope_theta=100.0)
    # NeoX: pair (0, 2) rotates with frequency theta^0 = 1
    np.testing.assert_allclose(out[0, 0], [math.cos(3), 0, math.sin(3), 0], atol=1e-15)
    x = np.zeros((1, 1, 4))
    x[0, 0, 2] = 1.0
    out = ref.apply_rope(x, [4], rope_theta=100.0, rope_scale=2.0, interleave=True)
    # GPT-J: pair (2, 3) rotates with frequency theta^(-2/4) = 0.1 at position 4 / 2
    np.testing.assert_allclose(out[0, 0], [0, 0, math.cos(0.2), math.sin(0.2)], atol=1e-15)
    x = rand(np.random.default_rng(0), 2, 1, 6)
    out = ref.apply_rope(x, [5, 9], rotary_dim=4)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
