"""CPU tests of the decode split-KV scheduler (kvattn.scheduler): properties checked by brute force."""
from __future__ import annotations

import math

import numpy as np

from kvattn import contract
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvattn import scheduler
from kvattn.scheduler import (
    HEADER_SIZE,
    ITEM_OVERHEAD_TOKENS as OV,
    MIN_CHUNK_COST,
    cut_granularity,
    decode_layout,
    default_num_chunks,
    graph_layout,
    plan_decode,
    plan_size_bound,
)

HYP = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REGIONS = ("chunk_indptr", "work_req", "work_begin", "work_end", "work_partial", "merge_indptr",
           "merge_req")


def skewed(n: int) -> np.ndarray:
    i = np.arange(n)
    return np.where(i % 16 == 0, 32768, 256 + (i * 389) % 1024)


def check_plan(plan, kv, *, page_size, num_kv_heads, num_sms=132, ctas_per_sm=2,
               max_batch_size=None, max_chunks=None, min_chunk_tokens=None):
    """Assert every documented property of ``plan`` for the batch ``kv``."""
    kv = np.asarray(kv, dtype=np.int64)
    B = kv.size
    lay = plan.layout
    buf = plan.buffer
    G = cut_granularity(page_size)
    assert plan.granularity == G
    assert buf.dtype == np.int32 and buf.ndim == 1 and buf.size == lay.size

    # ---- layout: aligned, ordered, non-overlapping regions ---------------------------------
    offs = [lay.header, lay.chunk_indptr, lay.work_req, lay.work_begin, lay.work_end,
            lay.work_partial, lay.merge_indptr, lay.merge_req]
    lens = [HEADER_SIZE, lay.max_chunks + 1] + [lay.max_work] * 4 + [lay.max_merge + 1,
                                                                     lay.max_merge]
    assert lay.header == 0
    for o in offs:
        assert o % 4 == 0
    for (o, n), o2 in zip(zip(offs, lens), offs[1:] + [lay.size]):
        assert o + n <= o2
    assert lay.size % 4 == 0

    # ---- header / grid ---------------------------------------------------------------------
    graph = max_batch_size is not None
    assert plan.graph == graph
    W, M, R = plan.num_work, plan.num_merge, plan.num_partial_rows
    h = plan.header   # kvattn.contract.PLAN_HEADER, read by name
    assert [h[contract.NUM_ITEMS], h[contract.NUM_MERGE], h[contract.BATCH_SIZE], h[contract.NUM_PARTIAL_ROWS],
            h[contract.NUM_CHUNKS]] == [W, M, B, R, plan.num_chunks]
    assert not h[contract.HEADER_INT32 - 3:].any()
    assert plan.batch_size == B
    assert plan.split == (R > 0)
    c_one_wave = default_num_chunks(num_kv_heads, num_sms=num_sms, ctas_per_sm=ctas_per_sm)
    if graph:
        mc = c_one_wave if max_chunks is None else max_chunks
        assert lay == decode_layout(mc, max_batch_size + mc, max_batch_size)
        assert lay == graph_layout(max_batch_size, num_kv_heads, num_sms=num_sms,
                                   ctas_per_sm=ctas_per_sm, max_chunks=max_chunks)
        assert plan.num_chunks == mc
    else:
        assert (lay.max_chunks, lay.max_work, lay.max_merge) == (plan.num_chunks, W, M)
        assert lay.size <= plan_size_bound(B, num_kv_heads, num_sms=num_sms,
                                           ctas_per_sm=ctas_per_sm, max_chunks=max_chunks)
    assert plan.num_chunks >= 1
    C = plan.active_chunks
    assert 1 <= C <= plan.num_chunks
    if max_chunks is not None:
        assert plan.num_chunks <= max_chunks

    # ---- views are views of the buffer with the documented lengths -------------------------
    for name, n in zip(REGIONS, (plan.num_chunks + 1, W, W, W, W, M + 1, M)):
        v = getattr(plan, name)
        assert v.base is buf.base or v.base is buf, name
        assert v.size == n, name
        if n:
            assert np.shares_memory(v, buf)
    ci = plan.chunk_indptr.astype(np.int64)
    req = plan.work_req.astype(np.int64)
    beg = plan.work_begin.astype(np.int64)
    end = plan.work_end.astype(np.int64)
    part = plan.work_partial.astype(np.int64)
    mi = plan.merge_indptr.astype(np.int64)
    mreq = plan.merge_req.astype(np.int64)

    # ---- chunk_indptr ----------------------------------------------------------------------
    assert ci[0] == 0 and ci[-1] == W
    assert np.all(np.diff(ci) >= 0)
    assert np.all(ci[C:] == W)  # chunks past the active ones are empty (graph padding)
    pad = buf[lay.chunk_indptr:lay.chunk_indptr + lay.max_chunks + 1]
    assert np.all(pad[plan.num_chunks:] == W)

    # ---- work items: valid, aligned, never empty --------------------------------------------
    if W:
        assert np.all((req >= 0) & (req < B))
        assert np.all(beg >= 0) and np.all(end > beg) and np.all(end <= kv[req])
        assert np.all((beg == 0) | (beg % G == 0))
        assert np.all((end == kv[req]) | (end % G == 0))
    # unused slots
    for o, fill in ((lay.work_req, -1), (lay.work_begin, 0), (lay.work_end, 0),
                    (lay.work_partial, 0)):
        assert np.all(buf[o + W:o + lay.max_work] == fill)
    assert np.all(buf[lay.merge_req + M:lay.merge_req + lay.max_merge] == -1)
    assert np.all(buf[lay.merge_indptr + M + 1:lay.merge_indptr + lay.max_merge + 1] == R)

    # ---- coverage: every (request, kv position) exactly once; kv order per request ------------
    items_of = {}
    for w in range(W):
        items_of.setdefault(int(req[w]), []).append(w)
    for r in range(B):
        ws = items_of.get(r, [])
        if kv[r] == 0:
            assert ws == []
            continue
        assert ws, f"request {r} not covered"
        b = beg[ws]
        assert np.all(np.diff(b) > 0), "items of a request not in kv order"
        assert b[0] == 0 and end[ws[-1]] == kv[r]
        assert np.all(end[ws[:-1]] == b[1:]), "gap or overlap inside a request"

    # ---- partial rows and merge list ----------------------------------------------------------
    assert mi[0] == 0 and mi[-1] == R and np.all(np.diff(mi) >= 0)
    assert np.all((mreq >= 0) & (mreq < B))
    assert len(set(mreq.tolist())) == M, "request twice in the merge list"
    assert np.all(np.diff(mreq) > 0)  # merge list in request order
    rows = part[part >= 0]
    assert sorted(rows.tolist()) == list(range(R)), "partial rows not a permutation of 0..R-1"
    pos = {int(r): m for m, r in enumerate(mreq)}
    split_reqs = 0
    for r in range(B):
        ws = items_of.get(r, [])
        if kv[r] == 0:
            m = pos[r]
            assert mi[m] == mi[m + 1], "empty request with a non-empty merge range"
        elif len(ws) == 1:
            assert r not in pos
            assert part[ws[0]] == -1
            assert beg[ws[0]] == 0 and end[ws[0]] == kv[r]
        else:
            split_reqs += 1
            m = pos[r]
            assert list(part[ws]) == list(range(mi[m], mi[m + 1])), "merge range not in kv order"
    assert M == split_reqs + int(np.count_nonzero(kv == 0))

    # ---- chunk-count rule and balance -------------------------------------------------------
    n = int(np.count_nonzero(kv))
    if n == 0:
        assert W == 0 and C == 1 and M == B
        return plan
    line = int(kv.sum() + OV * n)  # length of the cost line
    cap = max_chunks if max_chunks is not None else (c_one_wave if graph else None)
    no_split = (n * num_kv_heads >= num_sms * ctas_per_sm and (cap is None or n <= cap)
                and (int(kv.max()) + OV) * n <= 1.1 * line)
    if no_split:
        assert C == W == n and R == 0
        assert list(ci[:n + 1]) == list(range(n + 1))
    else:
        c_split = c_one_wave if cap is None else min(c_one_wave, cap)
        min_cost = MIN_CHUNK_COST if min_chunk_tokens is None else min_chunk_tokens + scheduler.ITEM_OVERHEAD_TOKENS
        assert C == min(c_split, max(1, line // min_cost))
        assert W <= n + C - 1  # each cut adds at most one item
    per_item = end - beg + OV
    chunk_cost = np.add.reduceat(np.append(per_item, 0), ci[:-1]) * (np.diff(ci) > 0)
    mean = per_item.sum() / C
    assert chunk_cost.max() <= 1.1 * mean + G + OV
    if not no_split:  # the sharper stated bound of the split path
        assert chunk_cost.max() <= -(-line // C) + G + OV
    return plan


def run_and_check(kv, *, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128, **kw):
    plan = plan_decode(kv, page_size, num_qo_heads, num_kv_heads, head_dim, **kw)
    kw.pop("out", None)
    check_plan(plan, kv, page_size=page_size, num_kv_heads=num_kv_heads, **kw)
    # deterministic: a second plan gives the identical buffer
    again = plan_decode(kv, page_size, num_qo_heads, num_kv_heads, head_dim, **kw)
    assert np.array_equal(again.buffer, plan.buffer)
    return plan


# ---------------------------------------------------------------------------------------------
# Hypothesis strategies
# ---------------------------------------------------------------------------------------------

lengths = st.one_of(
    st.just(0), st.integers(1, 64), st.integers(1, 2048), st.integers(0, 70000),
    st.sampled_from([1, 15, 16, 17, 32768, 70000]))


@st.composite
def batches(draw):
    kind = draw(st.sampled_from(["random", "skewed", "uniform", "zeros", "one_long"]))
    n = draw(st.integers(1, 300))
    if kind == "random":
        kv = np.array(draw(st.lists(lengths, min_size=n, max_size=n)), dtype=np.int64)
    elif kind == "skewed":
        kv = skewed(n)
    elif kind == "uniform":
        kv = np.full(n, draw(st.integers(1, 70000)), dtype=np.int64)
    elif kind == "zeros":
        kv = np.zeros(n, dtype=np.int64)
        idx = draw(st.lists(st.integers(0, n - 1), max_size=5))
        kv[idx] = draw(st.integers(1, 70000))
    else:
        kv = np.full(n, draw(st.integers(0, 300)), dtype=np.int64)
        kv[draw(st.integers(0, n - 1))] = 70000
    if draw(st.booleans()):  # sprinkle empty requests
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        kv[mask] = 0
    return kv


gpu = st.fixed_dictionaries({
    "page_size": st.sampled_from([1, 8, 16, 32, 48, 64, 128, 256]),
    "num_kv_heads": st.sampled_from([1, 2, 4, 8, 32]),
    "group": st.integers(1, 8),
    "num_sms": st.sampled_from([1, 8, 132]),
    "ctas_per_sm": st.integers(1, 4),
})


def _kw(g):
    return dict(page_size=g["page_size"], num_qo_heads=g["num_kv_heads"] * g["group"],
                num_kv_heads=g["num_kv_heads"], num_sms=g["num_sms"],
                ctas_per_sm=g["ctas_per_sm"])


@HYP
@given(kv=batches(), g=gpu, max_chunks=st.one_of(st.none(), st.integers(1, 600)))
def test_properties_plain(kv, g, max_chunks):
    run_and_check(kv, max_chunks=max_chunks, **_kw(g))


@HYP
@given(kv=batches(), g=gpu, extra=st.integers(0, 50),
       max_chunks=st.one_of(st.none(), st.integers(1, 600)), use_out=st.booleans())
def test_properties_graph(kv, g, extra, max_chunks, use_out):
    mbs = kv.size + extra
    kw = _kw(g)
    out = None
    if use_out:
        lay = graph_layout(mbs, kw["num_kv_heads"], num_sms=kw["num_sms"],
                           ctas_per_sm=kw["ctas_per_sm"], max_chunks=max_chunks)
        out = np.full(lay.size + 7, 12345, np.int32)  # stale garbage must be overwritten
    plan = run_and_check(kv, max_batch_size=mbs, max_chunks=max_chunks, out=out, **kw)
    if use_out:
        assert np.shares_memory(plan.buffer, out) and plan.buffer.size == lay.size
        assert np.all(out[lay.size:] == 12345)  # nothing written past the plan


@HYP
@given(kv=batches(), g=gpu)
def test_graph_layout_independent_of_batch(kv, g):
    kw = _kw(g)
    a = plan_decode(kv, head_dim=64, max_batch_size=300, **kw)
    b = plan_decode(kv[: max(1, kv.size // 2)], head_dim=64, max_batch_size=300, **kw)
    c = plan_decode(np.zeros(0, np.int64), head_dim=64, max_batch_size=300, **kw)
    assert a.layout == b.layout == c.layout
    assert a.num_chunks == b.num_chunks == c.num_chunks == a.layout.max_chunks


@HYP
@given(kv=batches(), g=gpu)
def test_out_buffer_matches_fresh_buffer(kv, g):
    kw = _kw(g)
    fresh = plan_decode(kv, head_dim=128, **kw)
    size = plan_size_bound(kv.size, kw["num_kv_heads"], num_sms=kw["num_sms"],
                           ctas_per_sm=kw["ctas_per_sm"])
    out = np.full(size, -7, np.int32)
    p = plan_decode(kv, head_dim=128, out=out, **kw)
    assert np.array_equal(p.buffer, fresh.buffer)
    assert p.layout == fresh.layout


# ---------------------------------------------------------------------------------------------
# The chunk-count rule on fixed cases
# ---------------------------------------------------------------------------------------------


def test_uniform_full_batch_does_not_split():
    kv = np.full(64, 4096)  # 64 * 8 = 512 CTAs >= 264, perfectly balanced
    p = run_and_check(kv)
    assert not p.split and p.num_merge == 0 and p.num_partial_rows == 0
    assert p.num_chunks == p.active_chunks == 64 and p.num_work == 64
    assert list(p.chunk_indptr) == list(range(65))
    assert np.all(p.work_partial == -1)


def test_uniform_full_batch_with_empty_requests():
    kv = np.full(70, 4096)
    kv[[3, 10]] = 0
    p = run_and_check(kv)
    assert not p.split and p.num_chunks == 68 and p.num_work == 68
    assert list(p.merge_req) == [3, 10] and list(p.merge_indptr) == [0, 0, 0]


def test_nearly_uniform_within_ten_percent_does_not_split():
    kv = np.full(40, 1000)
    kv[0] = 1100  # (1100 + 32) <= 1.1 * mean cost
    assert not run_and_check(kv).split


def test_unbalanced_full_batch_splits():
    p = run_and_check(skewed(256))
    assert p.split and p.num_chunks == 33  # floor(132 * 2 / 8)
    assert p.num_work <= 256 + 33 - 1


def test_small_batch_splits_one_wave():
    p = run_and_check(np.array([32768]))
    assert p.split and p.num_chunks == 33 and p.num_work == 33
    assert list(p.merge_req) == [0] and list(p.merge_indptr) == [0, 33]
    assert list(p.work_partial) == list(range(33))


def test_uniform_batch_too_small_for_gpu_splits():
    p = run_and_check(np.full(16, 8192))  # 16 * 8 = 128 < 264 CTAs
    assert p.split and p.num_chunks == 33


def test_tiny_batch_is_not_shredded():
    p = run_and_check(np.array([100, 40]))
    assert p.num_chunks == 1 and not p.split and p.num_work == 2
    p = run_and_check(np.array([1000]))  # 1032 cost units -> 6 chunks of >= MIN_CHUNK_COST
    assert p.num_chunks == 1032 // MIN_CHUNK_COST


def test_min_chunk_tokens_sets_the_small_batch_cap():
    # b1_L2048: 2080 cost units -> 13 chunks at the default 128 tokens, 21 at 64, 32 at 32
    for tokens, chunks in ((None, 13), (128, 13), (64, 21), (32, 32)):
        p = plan_decode(np.array([2048]), 16, 32, 8, 128, min_chunk_tokens=tokens)
        check_plan(p, [2048], page_size=16, num_kv_heads=8, min_chunk_tokens=tokens)
        assert p.num_chunks == chunks, tokens
    with pytest.raises(ValueError, match="min_chunk_tokens must be >= 16"):
        plan_decode(np.array([2048]), 16, 32, 8, 128, min_chunk_tokens=8)


def test_auto_min_chunk_tokens_is_a_sixteenth_of_the_mean_request():
    from kvattn.decode import auto_min_chunk_tokens
    assert [auto_min_chunk_tokens([n]) for n in (100, 512, 1000, 1024, 2048, 65536)] == [32, 32, 48, 64, 128, 128]
    assert auto_min_chunk_tokens([1024, 0, 0, 1024]) == 64 and auto_min_chunk_tokens([0, 0]) == 32


def test_max_chunks_caps_split():
    p = run_and_check(skewed(100), max_chunks=5)
    assert p.num_chunks == 5


def test_max_chunks_below_batch_forces_cuts_for_uniform_batch():
    # the no-split path needs one chunk per request: 64 > max_chunks, so it balances by cuts
    p = run_and_check(np.full(64, 4096), max_chunks=20)
    assert p.num_chunks == 20 and p.active_chunks == 20


def test_graph_mode_pads_chunks_and_merges():
    p = run_and_check(np.array([5000, 0, 300]), max_batch_size=8, max_chunks=40)
    assert p.num_chunks == 40 and p.layout.max_work == 48 and p.layout.max_merge == 8
    assert p.active_chunks == min(33, (5032 + 332) // MIN_CHUNK_COST)


def test_all_empty_and_zero_batch():
    p = run_and_check(np.zeros(5, np.int64))
    assert p.num_work == 0 and p.num_chunks == 1 and p.num_merge == 5
    assert list(p.merge_req) == [0, 1, 2, 3, 4] and list(p.merge_indptr) == [0] * 6
    p = run_and_check(np.zeros(0, np.int64))
    assert p.num_work == 0 and p.num_merge == 0 and p.num_chunks == 1
    p = run_and_check([], max_batch_size=4)
    assert p.num_chunks == p.layout.max_chunks


def test_accepts_lists_int32_and_numpy_scalars():
    kv = [7, 0, 3000, 65]
    a = run_and_check(kv)
    b = plan_decode(np.array(kv, np.int32), np.int64(16), 32, np.int32(8), 128)
    c = plan_decode(np.array(kv, np.uint16), 16, 32, 8, 128)
    assert np.array_equal(a.buffer, b.buffer) and np.array_equal(a.buffer, c.buffer)


def test_granularity_rule():
    assert [cut_granularity(p) for p in (1, 8, 16, 32, 48, 64, 128, 256)] == \
        [16, 16, 16, 32, 16, 64, 64, 64]


def test_large_values_no_overflow():
    kv = np.full(300, 2**31 - 1, np.int64)
    kv[::2] = 5
    run_and_check(kv, num_sms=1000, ctas_per_sm=64, num_kv_heads=1, num_qo_heads=1)


def test_layout_offsets_example():
    lay = decode_layout(33, 289, 256)
    assert lay.chunk_indptr == 8
    assert lay.work_req == 8 + 36
    assert lay.work_begin == lay.work_req + 292
    assert lay.merge_indptr == lay.work_partial + 292
    assert lay.merge_req == lay.merge_indptr + 260
    assert lay.size == lay.merge_req + 256
    assert lay.nbytes == 4 * lay.size


# ---------------------------------------------------------------------------------------------
# Validation: one test per case, each naming the argument
# ---------------------------------------------------------------------------------------------

def _plan(kv=(1, 2), page_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64, **kw):
    return plan_decode(kv, page_size, num_qo_heads, num_kv_heads, head_dim, **kw)


def test_rejects_2d_kv_lens():
    with pytest.raises(ValueError, match="kv_lens must be 1-D"):
        _plan(np.ones((2, 2), np.int64))


def test_rejects_float_kv_lens():
    with pytest.raises(TypeError, match="kv_lens must hold integers"):
        _plan(np.array([1.0, 2.0]))


def test_rejects_bool_kv_lens():
    with pytest.raises(TypeError, match="kv_lens must hold integers"):
        _plan(np.array([True, False]))


def test_rejects_negative_kv_lens():
    with pytest.raises(ValueError, match="kv_lens must be non-negative"):
        _plan(np.array([4, -1, 7]))


def test_rejects_negative_int32_kv_lens():
    with pytest.raises(ValueError, match="kv_lens must be non-negative"):
        _plan(np.array([4, -1], np.int32))


def test_rejects_kv_lens_beyond_int32():
    with pytest.raises(ValueError, match="kv_lens must fit int32"):
        _plan(np.array([2**31]))


def test_rejects_kv_lens_beyond_int32_unsigned():
    with pytest.raises(ValueError, match="kv_lens must fit int32"):
        _plan(np.array([2**32], np.uint64))


def test_rejects_page_size_zero():
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        _plan(page_size=0)


def test_rejects_page_size_float():
    with pytest.raises(TypeError, match="page_size must be an int"):
        _plan(page_size=16.0)


def test_rejects_page_size_bool():
    with pytest.raises(TypeError, match="page_size must be an int"):
        _plan(page_size=True)


def test_rejects_heads_not_divisible():
    with pytest.raises(ValueError, match=r"num_qo_heads \(6\) must be a multiple of num_kv_heads"):
        _plan(num_qo_heads=6, num_kv_heads=4)


def test_rejects_num_kv_heads_zero():
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        _plan(num_kv_heads=0)


def test_rejects_num_qo_heads_zero():
    with pytest.raises(ValueError, match="num_qo_heads must be >= 1"):
        _plan(num_qo_heads=0)


def test_rejects_head_dim_zero():
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        _plan(head_dim=0)


def test_rejects_num_sms_zero():
    with pytest.raises(ValueError, match="num_sms must be >= 1"):
        _plan(num_sms=0)


def test_rejects_ctas_per_sm_zero():
    with pytest.raises(ValueError, match="ctas_per_sm must be >= 1"):
        _plan(ctas_per_sm=0)


def test_rejects_max_chunks_zero():
    with pytest.raises(ValueError, match="max_chunks must be >= 1"):
        _plan(max_chunks=0)


def test_rejects_max_batch_size_zero():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        _plan(max_batch_size=0)


def test_rejects_batch_above_max_batch_size():
    with pytest.raises(ValueError, match="batch size 3 exceeds max_batch_size 2"):
        _plan((1, 2, 3), max_batch_size=2)


def test_rejects_small_out():
    need = graph_layout(4, 2).size
    with pytest.raises(ValueError, match=rf"out is too small: the plan needs {need} int32"):
        _plan(max_batch_size=4, out=np.zeros(need - 1, np.int32))


def test_rejects_out_wrong_dtype():
    with pytest.raises(TypeError, match="out must have dtype int32"):
        _plan(out=np.zeros(4096, np.int64))


def test_rejects_out_not_array():
    with pytest.raises(TypeError, match="out must be a numpy int32 array"):
        _plan(out=bytearray(4096))


def test_rejects_out_2d():
    with pytest.raises(ValueError, match="out must be a 1-D contiguous int32 array"):
        _plan(out=np.zeros((64, 64), np.int32))


def test_validation_not_bypassed_by_cache():
    _plan(page_size=1)  # cache the config of page_size=1
    with pytest.raises(TypeError, match="page_size must be an int"):
        _plan(page_size=True)  # True == 1 must not hit the cached entry


def test_module_imports_only_numpy_and_stdlib():
    import ast
    import sys
    src = open(scheduler.__file__).read()
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods.add(node.module.split(".")[0])
    assert mods - {"numpy"} <= set(sys.stdlib_module_names), mods


def test_balance_bound_on_random_skewed_batch():
    kv = np.random.default_rng(3).integers(1, 32769, 256)
    p = run_and_check(kv)
    assert p.split
    ci = p.chunk_indptr
    cost = [int((p.work_end[a:b] - p.work_begin[a:b]).sum()) + OV * (b - a)
            for a, b in zip(ci[:-1], ci[1:])]
    assert max(cost) <= math.ceil((kv.sum() + OV * kv.size) / p.active_chunks) + 16 + OV


def test_rejects_out_read_only():
    out = np.zeros(4096, np.int32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        _plan(out=out)


def test_rejects_head_dim_beyond_int32():
    with pytest.raises(ValueError, match="head_dim must fit int32"):
        _plan(head_dim=2**31)


def test_ideal_cuts_exact_without_overflow():
    for total, C in ((10**6, 33), (2**40, 2**23 + 5), (2**62 // 3, 1000), (2**61, 2**21)):
        got = scheduler._ideal_cuts(total, C)
        k = [1, 2, C // 2, C - 2, C - 1]
        assert [int(got[i - 1]) for i in k] == [i * total // C for i in k]
        assert np.all(np.diff(got) >= 0)


def test_batch_larger_than_preallocated_ranges():
    kv = np.tile(skewed(64), 50)  # 3200 requests
    run_and_check(kv)
    run_and_check(np.full(3000, 128))  # no-split path with req = iota(3000)
    run_and_check(np.zeros(3000, np.int64), max_batch_size=3000)


def test_decode_layout_rejects_negative():
    with pytest.raises(ValueError, match="max_work must be a non-negative int"):
        decode_layout(4, -1, 2)


def test_merge_lists_is_the_cumulative_partial_count():
    from kvattn.scheduler import merge_lists
    indptr, rows = merge_lists(np.array([2, 3, 1, 4]), np.array([7, 0, 5, 9]))
    assert indptr.dtype == np.int32 and rows.dtype == np.int32
    assert list(indptr) == [0, 2, 5, 6, 10] and list(rows) == [7, 0, 5, 9]
    buf = np.full(8, -5, np.int32)
    merge_lists(np.array([1, 1]), np.array([3, 4]), out_indptr=buf[2:5])
    assert list(buf) == [-5, -5, 0, 1, 2, -5, -5, -5]
    empty, _ = merge_lists(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert list(empty) == [0]


# ---------------------------------------------------------------------------------------------
# Batch-invariant (deterministic) schedule: fixed-size splits
# ---------------------------------------------------------------------------------------------
def _request_items(plan, r):
    """Request r's items in token order (the work list may deal them to chunks in any order): (begin, end, partial
    row), and its merge list (partial rows in merge order, or None when it is not merged)."""
    req, beg, end, part = plan.work_req, plan.work_begin, plan.work_end, plan.work_partial
    items = sorted((int(beg[i]), int(end[i]), int(part[i])) for i in range(plan.num_work) if req[i] == r)
    mreq, mi = list(plan.merge_req), plan.merge_indptr
    merged = None
    if r in mreq:
        m = mreq.index(r)
        merged = list(range(int(mi[m]), int(mi[m + 1])))
    return items, merged


@HYP
@given(kv=batches(), g=gpu, split=st.sampled_from([64, 2048]), graph=st.booleans(), seed=st.integers(0, 2**31))
def test_fixed_split_schedule_is_batch_invariant(kv, g, split, graph, seed):
    """A request's items (its tokens cut at multiples of split_tokens), partial rows in item order and merge list
    are those it gets alone, whatever the batch, the SM count or graph mode."""
    kw = _kw(g)
    if split % cut_granularity(kw["page_size"]):
        split = 2048
    rng = np.random.default_rng(seed)
    kv = kv[:64]
    r = int(rng.integers(kv.size))

    def plan_of(lens, **extra):
        if graph:
            mbs = lens.size + 3
            extra.update(max_batch_size=mbs, max_work=scheduler.fixed_split_items(int(lens.sum()) + 5000, mbs, split))
        return plan_decode(lens, kw["page_size"], kw["num_qo_heads"], kw["num_kv_heads"], 128, num_sms=kw["num_sms"],
                           ctas_per_sm=kw["ctas_per_sm"], split_tokens=split, **extra)

    plan = plan_of(kv)
    items, merged = _request_items(plan, r)
    L = int(kv[r])
    assert [(b, e) for b, e, _ in items] == [(k, min(k + split, L)) for k in range(0, L, split)]
    if len(items) > 1:   # split: partial rows in item order, merged in that order
        assert merged == [p for _, _, p in items] and all(p >= 0 for _, _, p in items)
    else:
        assert all(p == -1 for _, _, p in items)
    alone = plan_decode(kv[r:r + 1], kw["page_size"], kw["num_qo_heads"], kw["num_kv_heads"], 128, num_sms=132,
                        ctas_per_sm=3, split_tokens=split)
    a_items, a_merged = _request_items(alone, 0)
    assert [(b, e) for b, e, _ in a_items] == [(b, e) for b, e, _ in items]
    assert (a_merged is None) == (merged is None)
    ci = plan.chunk_indptr
    assert ci[0] == 0 and ci[-1] == plan.num_work and np.all(np.diff(ci) >= 0)
    assert plan.num_work <= plan.layout.max_work
    if plan.num_work:   # balanced chunks: each within one item of its ideal share
        cost = (plan.work_end.astype(np.int64) - plan.work_begin + scheduler.ITEM_OVERHEAD_TOKENS)
        per_chunk = [int(cost[ci[c]:ci[c + 1]].sum()) for c in range(plan.active_chunks)]
        assert max(per_chunk) <= cost.sum() / plan.active_chunks + cost.max()


def test_fixed_split_deals_a_skewed_batch_evenly():
    """The skewed decode anchor (4 requests of 32768 tokens, 60 of 256-1280): its 64 full items are dealt across
    the chunks instead of piling into consecutive runs (1.27 x the equal share before), and every item is listed
    once, in its chunk."""
    lens = np.array([32768 if i % 16 == 0 else 256 + (i * 389) % 1024 for i in range(64)])
    plan = plan_decode(lens, 16, 32, 8, 128, num_sms=132, ctas_per_sm=3, split_tokens=2048)
    ci = plan.chunk_indptr
    cost = plan.work_end.astype(np.int64) - plan.work_begin + scheduler.ITEM_OVERHEAD_TOKENS
    per_chunk = np.array([cost[ci[c]:ci[c + 1]].sum() for c in range(plan.active_chunks)])
    assert plan.active_chunks == 49 and per_chunk.min() > 0
    assert per_chunk.max() <= 1.12 * per_chunk.mean()
    seen = sorted(zip(plan.work_req.tolist(), plan.work_begin.tolist()))
    want = sorted((r, b) for r, n in enumerate(lens) for b in range(0, int(n), 2048))
    assert seen == want


def test_fixed_split_must_be_a_multiple_of_the_granularity():
    with pytest.raises(ValueError, match="split_tokens must be a multiple of the cut granularity 64"):
        plan_decode([100], 64, 8, 8, 128, split_tokens=100)


@HYP
@given(qo=st.lists(st.integers(1, 700), min_size=1, max_size=12), extra=st.lists(st.integers(0, 20000), min_size=12,
       max_size=12), group=st.sampled_from([1, 4, 8]), causal=st.booleans(), seed=st.integers(0, 2**31))
def test_fixed_split_prefill_is_batch_invariant(qo, extra, group, causal, seed):
    """split_tokens fixed: a request's items (rows, KV chunks, chunk counts) are those it gets alone."""
    rng = np.random.default_rng(seed)
    qo = np.array(qo)
    kv = qo + np.array(extra[:qo.size])
    r = int(rng.integers(qo.size))

    def items_of(plan, req):
        it = plan.items
        return sorted(tuple(int(x) for x in row[1:5]) + (int(row[6]),) for row in it if row[0] == req)

    batch = scheduler.plan_prefill(qo, kv, group, 2, 128, causal=causal, num_sms=int(rng.choice([132, 17])), split_tokens=1024)
    alone = scheduler.plan_prefill(qo[r:r + 1], kv[r:r + 1], group, 2, 128, causal=causal, split_tokens=1024)
    assert items_of(batch, r) == items_of(alone, 0)
    assert all(ke - kb <= 1024 for _, _, kb, ke, _ in items_of(alone, 0))


@HYP
@given(qo=st.lists(st.integers(1, 700), min_size=1, max_size=12), extra=st.lists(st.integers(0, 40000), min_size=12,
       max_size=12), group=st.sampled_from([1, 4, 8]), causal=st.booleans(), cap=st.integers(1, 6),
       seed=st.integers(0, 2**31))
def test_capped_fixed_split_prefill_is_batch_invariant_and_bounded(qo, extra, group, causal, cap, seed):
    """split_tokens with max_split_chunks: a request's items are those it gets alone, no block has more than
    `cap` chunks, and the plan fits prefill_bounds(max_split_chunks=cap) (graph mode's buffers)."""
    rng = np.random.default_rng(seed)
    qo = np.array(qo)
    kv = qo + np.array(extra[:qo.size])
    r = int(rng.integers(qo.size))
    kw = dict(causal=causal, split_tokens=1024, max_split_chunks=cap)

    def items_of(plan, req):
        return sorted(tuple(int(x) for x in row[1:5]) + (int(row[6]),) for row in plan.items if row[0] == req)

    batch = scheduler.plan_prefill(qo, kv, group, 2, 128, num_sms=int(rng.choice([132, 17])), **kw)
    alone = scheduler.plan_prefill(qo[r:r + 1], kv[r:r + 1], group, 2, 128, **kw)
    assert items_of(batch, r) == items_of(alone, 0)
    assert int(batch.items[:, 6].max(initial=1)) <= cap
    mi, mp, mm = scheduler.prefill_bounds(qo.size, int(qo.sum()), group, 2, 128, max_split_chunks=cap)
    assert batch.num_items <= mi and batch.num_partial_rows <= mp and batch.num_merge <= mm


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=24), st.sampled_from([1, 4, 8]),
       st.booleans(), st.sampled_from([4096, 65536, 1 << 20]))
def test_prefill_l2_windows_group_requests_and_keep_the_items(lens, group, causal, bpt):
    """With kv_bytes_per_token, the prefill items come window by window (consecutive requests of about
    PREFILL_L2_WINDOW_BYTES of KV), longest first inside a window; the items themselves are those of the
    plan without windows."""
    qo = np.asarray(lens)
    kv = qo + np.arange(qo.size) % 3 * 100
    plain = scheduler.plan_prefill(qo, kv, group, 2, 128, causal=causal)
    win = scheduler.plan_prefill(qo, kv, group, 2, 128, causal=causal, kv_bytes_per_token=bpt)
    key = lambda items: sorted(map(tuple, items.tolist()))
    assert key(plain.items) == key(win.items)
    np.testing.assert_array_equal(plain.merge_rows, win.merge_rows)
    assert win.kv_head_group == scheduler.kv_head_group(kv, 2, bpt) and plain.kv_head_group == 2
    eff = bpt * win.kv_head_group // 2   # the windows count the bytes of the heads walked together
    before = np.cumsum(kv) - kv
    w = (before * eff // scheduler.PREFILL_L2_WINDOW_BYTES)[win.items[:, 0]]
    assert (np.diff(w) >= 0).all(), "windows out of request order"
    ln = win.items[:, 4] - win.items[:, 3]
    for x in np.unique(w):
        assert (np.diff(ln[w == x]) <= 0).all(), "a window's items are not longest first"
    if int(kv.sum()) * eff <= scheduler.PREFILL_L2_WINDOW_BYTES:   # one window: the plain order
        np.testing.assert_array_equal(plain.items, win.items)


@pytest.mark.parametrize("tokens, hkv, expect", [
    (8192, 8, 8),      # 32 MiB of K/V over 8 heads: one window, every head together
    (8193, 8, 1),      # past a window: one head at a time
    (32768, 8, 1),     # 128 MiB (b1_S32768 at Hkv 8, D 128, bf16)
    (200000, 8, 1),    # a head's K/V alone outgrows a window: still one head, never none
    (4096, 1, 1),
])
def test_prefill_kv_head_groups(tokens, hkv, expect, monkeypatch):
    """The KV heads the sm90 kernel walks together: all where the longest request's K/V fits an L2 window, else
    one; the plan carries it (the header field kv_head_group). Off (PREFILL_HEAD_GROUPS False) or without
    kv_bytes_per_token: all heads."""
    bpt = 8 * 2 * 128 * 2   # K and V of 8 heads, head dim 128, bf16 (whatever hkv: the bytes decide)
    kv = np.array([100, tokens, 7])
    assert scheduler.kv_head_group(kv, hkv, bpt) == expect
    plan = scheduler.plan_prefill(np.array([1, 1, 1]), kv, 4, hkv, 128, kv_bytes_per_token=bpt)
    assert plan.kv_head_group == expect
    assert scheduler.plan_prefill(np.array([1, 1, 1]), kv, 4, hkv, 128).kv_head_group == hkv
    monkeypatch.setattr(scheduler, "PREFILL_HEAD_GROUPS", False)
    assert scheduler.kv_head_group(kv, hkv, bpt) == hkv


def test_prefill_split_counts_waves_of_slots():
    """A batch too small to fill the GPU (GQA 32 decode on the prefill kernel: 64 requests of one query token, 4096
    tokens, one KV head) is cut into chunks that fill one wave of slots (2 a request over 132); counting two slots a
    CTA (the prefill wrapper's split_waves 2, the decode route's A/B) cuts 4 a request, a unit's worth each."""
    qo, kv = np.ones(64, np.int64), np.full(64, 4096)
    one = scheduler.plan_prefill(qo, kv, 32, 1, 128, num_sms=132, ctas_per_sm=1)
    two = scheduler.plan_prefill(qo, kv, 32, 1, 128, num_sms=132, ctas_per_sm=2)
    assert one.split and one.num_items == 128 and one.chunk == 2048
    assert two.split and two.num_items == 256 and two.chunk == 1024
    assert two.num_merge == one.num_merge == 64


@HYP
@given(qo=st.lists(st.integers(1, 300), min_size=1, max_size=8), extra=st.lists(st.integers(0, 30000), min_size=8,
       max_size=8), group=st.sampled_from([1, 4, 8, 32, 64]), causal=st.booleans())
def test_prefill_merge_slots_name_each_split_block_once(qo, extra, group, causal):
    """Item field 7 (the sm90 kernel's fused merge, (slot << 12) | k): the items of one (split block, head slice)
    share a slot and hold chunks 0..n-1 once each (n = their pstride), partial rows partial - k + i of one block
    for i < n; slots are 0..merge_slots-1; unsplit items keep 0."""
    qo = np.array(qo)
    kv = qo + np.array(extra[:qo.size])
    plan = scheduler.plan_prefill(qo, kv, group, 2, 128, causal=causal, num_sms=132, ctas_per_sm=1)
    it = plan.items
    split = it[:, 5] >= 0
    assert np.all(it[~split, 7] == 0)
    if not plan.split:
        assert plan.merge_slots == 0
        return
    slot, k = it[split, 7] >> 12, it[split, 7] & 4095
    assert sorted(set(slot.tolist())) == list(range(plan.merge_slots))
    for s in range(plan.merge_slots):
        mine = it[split][slot == s]
        n = int(mine[0, 6])
        assert sorted(k[slot == s].tolist()) == list(range(n)) and np.all(mine[:, 6] == n)
        assert len({(int(r[0]), int(r[1]), int(r[2]), int(r[5]) - int(kk)) for r, kk in zip(mine, k[slot == s])}) == 1
    assert plan.max_chunks == int(it[split, 6].max())


def test_item_overhead_weighs_each_request_on_the_cost_line():
    """item_overhead (the decode wrapper's fp8 default: kvattn.decode.FP8_ITEM_OVERHEAD): every request costs that
    many tokens more on the cost line, so chunks of many short requests get fewer tokens; chunk costs stay within
    the split path's bound counted with it; None is ITEM_OVERHEAD_TOKENS."""
    from kvattn import decode
    kv = skewed(64)
    kw = dict(num_sms=132, ctas_per_sm=3, allow_no_split=False)
    base = plan_decode(kv, 16, 32, 8, 128, **kw)
    assert np.array_equal(plan_decode(kv, 16, 32, 8, 128, item_overhead=OV, **kw).buffer, base.buffer)
    ov = decode.item_overhead_tokens("float8_e4m3fn")
    assert ov > OV == decode.item_overhead_tokens("bfloat16")
    plan = plan_decode(kv, 16, 32, 8, 128, item_overhead=ov, **kw)
    tokens = {}
    for p in (base, plan):
        ci = p.chunk_indptr.astype(np.int64)
        tok = np.append(p.work_end - p.work_begin, 0).astype(np.int64)
        per_chunk, items = np.add.reduceat(tok, ci[:-1]) * (np.diff(ci) > 0), np.diff(ci)
        tokens[p is plan] = int(per_chunk[np.argmax(items)])   # the chunk of the most requests
        assert per_chunk.sum() == kv.sum()
    assert tokens[True] < tokens[False]
    ci = plan.chunk_indptr.astype(np.int64)
    cost = np.append(plan.work_end - plan.work_begin + ov, 0).astype(np.int64)
    line = int(kv.sum()) + ov * int(np.count_nonzero(kv))
    assert (np.add.reduceat(cost, ci[:-1]) * (np.diff(ci) > 0)).max() <= -(-line // plan.num_chunks) + 16 + ov
