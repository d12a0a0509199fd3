"""CPU tests of cascade attention's schedule: a float64 emulation of the level work items and the stacked merge
matches reference.cascade_attention, every (row, head, KV token) is covered once per level and every partial slot
is written once; plan() argument errors are raised before any GPU call."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvattn
from kvattn import reference, scheduler
from kvattn.formats import CascadeLevels, PageTable

NEG = -np.inf


def _items_run(items, qo_indptr, kv_lens, group, causal):
    """Per item (kv head 0): [(global row, head in group, kv begin, kv end, partial row)] for every packed row."""
    out = []
    for req, row0, nrows, kb, ke, partial, pstride, _ in items:
        qs = int(qo_indptr[req])
        tok_lo = row0 // group
        for pr in range(row0, row0 + nrows):
            t, hg = pr // group, pr % group
            out.append((qs + t, hg, int(kb), int(ke), int(partial) + (t - tok_lo) * int(pstride), int(req)))
    return out


def _emulate(q, k4, v4, levels, group, cta_rows, chunks, causal, sm_scale):
    """float64 result of the cascade plan: each level's items write partial (o, lse) slots, one stacked merge."""
    rows, hq, d = q.shape
    slots = sum(chunks)
    slot0 = np.cumsum([0] + list(chunks[:-1]))
    po = np.full((rows * slots, hq, d), np.nan)
    pl = np.full((rows * slots, hq), np.nan)
    written = np.zeros((rows * slots, hq), int)
    hkv = hq // group
    for li, (qo_indptr, pt) in enumerate(levels):
        last = li == len(levels) - 1
        qo = np.diff(qo_indptr)
        items = scheduler.plan_cascade_level(qo, pt.kv_lens, group, cta_rows, chunks[li], slots, int(slot0[li]),
                                             causal=causal and last)
        for row, hg, kb, ke, prow, req in _items_run(items, qo_indptr, pt.kv_lens, group, causal):
            pages = pt.pages(req)
            kvl = int(pt.kv_lens[req])
            kk = k4[pages].reshape(-1, hkv, d)[:kvl]
            vv = v4[pages].reshape(-1, hkv, d)[:kvl]
            t = row - int(qo_indptr[req])
            hi = ke
            if causal and last:
                hi = min(ke, kvl - int(qo[req]) + t + 1)
            for kh in range(hkv):
                h = kh * group + hg
                written[prow, h] += 1
                if hi <= kb:
                    po[prow, h], pl[prow, h] = 0.0, NEG
                    continue
                s = kk[kb:hi, kh] @ q[row, h] * sm_scale
                m = s.max()
                p = np.exp(s - m)
                po[prow, h] = p @ vv[kb:hi, kh] / p.sum()
                pl[prow, h] = m + np.log(p.sum())
    assert (written == 1).all(), "every (row, slot, head) partial is written exactly once"
    o, lse = reference.merge_states(po.reshape(rows, slots, hq, d), pl.reshape(rows, slots, hq))
    return o, lse


@st.composite
def cascades(draw):
    ps = draw(st.sampled_from([1, 4, 16]))
    b = draw(st.integers(1, 6))
    qo = draw(st.lists(st.integers(0, 5), min_size=b, max_size=b))
    nlev = draw(st.integers(1, 3))
    # levels: coarse groupings of the last level's requests
    cuts = [sorted(set(draw(st.lists(st.integers(1, b - 1), max_size=b))) if b > 1 else []) for _ in range(nlev - 1)]
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    cq = np.concatenate([[0], np.cumsum(qo)])
    num_pages = 64
    lv = []
    for li in range(nlev):
        bounds = [0] + (cuts[li] if li < nlev - 1 else list(range(1, b))) + [b]
        qo_indptr = cq[bounds]
        g = len(bounds) - 1
        kv = rng.integers(0, 3 * ps + 3, g)
        if li == nlev - 1:
            kv = np.maximum(kv, np.diff(qo_indptr))   # causal needs kv >= qo on the last level
        lv.append((qo_indptr, PageTable.from_kv_lens(kv, ps, num_pages=num_pages, rng=rng)))
    return CascadeLevels(lv), ps, num_pages, rng


@settings(max_examples=40)
@given(cascades(), st.sampled_from([1, 4]), st.sampled_from([16, 64]), st.booleans())
def test_cascade_schedule_matches_reference(c, group, cta_rows, causal):
    levels, ps, num_pages, rng = c
    hkv, d = 2, 8
    hq = hkv * group
    rows = int(levels[0][0][-1])
    q = rng.standard_normal((rows, hq, d))
    k4 = rng.standard_normal((num_pages, ps, hkv, d))
    v4 = rng.standard_normal((num_pages, ps, hkv, d))
    chunks = [int(rng.integers(1, 4)) for _ in levels]
    o, lse = _emulate(q, k4, v4, levels, group, cta_rows, chunks, causal, 1 / np.sqrt(d))
    ro, rl = reference.cascade_attention(q, k4, v4, levels, causal=causal, return_lse=True)
    np.testing.assert_allclose(o, ro, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse[fin], rl[fin], atol=1e-12)


def test_cascade_chunks_fill_one_wave():
    # the benchmark's shared level: 128 rows x group 4 in 128-row tiles = 4 blocks, one wave of 16 slots per head
    assert scheduler.cascade_chunks([128], [32768], 4, 8, 128, num_sms=132, ctas_per_sm=1) == 4
    # short KV is not cut below PREFILL_MIN_CHUNK tokens; a full batch is not cut at all
    assert scheduler.cascade_chunks([1], [300], 4, 8, 16, num_sms=132, ctas_per_sm=4) == 2
    assert scheduler.cascade_chunks([1] * 256, [4096] * 256, 4, 8, 16, num_sms=132, ctas_per_sm=4) == 1
    assert scheduler.cascade_chunks([], [], 4, 8, 16) == 1


def test_plan_cascade_level_errors():
    with pytest.raises(ValueError, match="slots"):
        scheduler.plan_cascade_level([1], [10], 1, 16, 3, 2, 0)
    with pytest.raises(ValueError, match="causal"):
        scheduler.plan_cascade_level([5], [3], 1, 16, 1, 1, 0, causal=True)


def _two_level():
    lv0 = (np.array([0, 3]), PageTable([0, 2], [0, 1], [4], 4))
    lv1 = (np.array([0, 1, 2, 3]), PageTable([0, 1, 2, 3], [2, 3, 4], [1, 2, 3], 4))
    return CascadeLevels([lv0, lv1])


def test_cascade_plan_argument_errors():
    w = kvattn.MultiLevelCascadeAttentionWrapper(2)
    with pytest.raises(ValueError, match="num_levels=2"):
        w.plan(CascadeLevels([_two_level()[0]]), None, 8, 2, 64)
    with pytest.raises(TypeError, match="page_tables"):
        w.plan([np.array([0, 3])], None, 8, 2, 64)
    with pytest.raises(ValueError, match="page_tables: expected one per level"):
        w.plan([np.array([0, 3]), np.array([0, 3])], [_two_level()[0][1]], 8, 2, 64)
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(_two_level(), None, 8, 2, 48)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(_two_level(), None, 7, 2, 64)
    with pytest.raises(TypeError, match="num_kv_heads: required"):
        w.plan(_two_level(), None, 8)
    lv = _two_level()
    short = CascadeLevels([lv[0], (lv[1][0], PageTable([0, 1, 2, 3], [2, 3, 4], [1, 1, 1], 4))])
    # request 0 of the last level: qo 1, kv 1 is fine; make one with qo 2 > kv 1
    bad = CascadeLevels([(np.array([0, 3]), lv[0][1]), (np.array([0, 2, 3]), PageTable([0, 1, 2], [2, 3], [1, 1], 4))])
    with pytest.raises(ValueError, match="causal: the last level"):
        w.plan(bad, None, 8, 2, 64, causal=True)
    del short
    g = kvattn.MultiLevelCascadeAttentionWrapper(2, use_cuda_graph=True, max_batch_size=2, max_total_qo=8,
                                                 max_num_pages=8)
    with pytest.raises(ValueError, match="groups exceed max_batch_size 2"):
        g.plan(_two_level(), None, 8, 2, 64)
    with pytest.raises(ValueError, match="needs max_batch_size"):
        kvattn.MultiLevelCascadeAttentionWrapper(2, use_cuda_graph=True)


def test_cascade_plan_buffer_holds_every_level(monkeypatch):
    """plan() with the GPU calls stubbed: the one host buffer it uploads holds, per level, the header, lengths,
    pages and exactly the work items plan_cascade_level gives; the stacked merge covers every row's slots."""
    import types
    from kvattn import cascade, contract
    from kvattn.memory import DeviceArray

    class Cfg:
        backend, spec, threads, smem, ctas_per_sm, persistent = "sm80", None, 128, 1024, 2, False

    class Kernel:
        def _allow_smem(self, n):
            pass

    launches, uploads = [], []
    monkeypatch.setattr(cascade, "launch_config", lambda *a: Cfg())
    monkeypatch.setattr(cascade, "get_kernel", lambda spec: Kernel())
    monkeypatch.setattr(cascade, "merge_spec", lambda *a: None)
    monkeypatch.setattr(cascade, "Launch", lambda k, grid, block, smem, p: launches.append((grid, p)) or grid)
    base = 1 << 32

    def upload(self, host, copies, regions, stream, fills=()):
        uploads.append((host.copy(), copies))
        return ({name: DeviceArray(base, shape, dt) for name, (shape, dt) in regions.items()},
                types.SimpleNamespace(ptr=1), None)

    monkeypatch.setattr(cascade.MultiLevelCascadeAttentionWrapper, "_upload", upload)
    monkeypatch.setattr(cascade.MultiLevelCascadeAttentionWrapper, "_stage", lambda self, n: np.zeros(n, np.uint8))
    lv = CascadeLevels([(np.array([0, 5, 9]), PageTable([0, 3, 4], [7, 1, 2, 9], [16, 3], 16)),
                        (np.array([0, 2, 5, 5, 9]), PageTable([0, 1, 2, 2, 4], [3, 4, 5, 6], [4, 9, 0, 1], 16))])
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, num_sms=8)
    w.plan(lv, None, 8, 2, 64, causal=True)
    (host, copies), = uploads
    assert copies == [("plan", 0, host.size)]
    h = host.view(np.int32)
    info = w.last_plan.info
    slots = info["slots"]
    chunks = [x["chunks"] for x in info["levels"]]
    attention = [(g, p) for g, p in launches if isinstance(g, tuple)]   # the merge's grid is an int
    assert slots == sum(chunks) and len(attention) == 2 and len(launches) == 3
    slot0 = np.cumsum([0] + chunks[:-1])
    for li, ((grid, p), (qo_indptr, pt)) in enumerate(zip(attention, lv)):
        start = (int(p["plan"]) - base) // 4
        items = scheduler.plan_cascade_level(np.diff(qo_indptr), pt.kv_lens, 4, info["levels"][li]["cta_rows"],
                                             chunks[li], slots, int(slot0[li]), causal=li == 1)
        assert h[start + contract.NUM_ITEMS] == items.shape[0] == grid[0] and grid[1] == 2
        assert h[start + contract.BATCH_SIZE] == pt.batch_size
        assert h[start + contract.NUM_KV_HEADS] == 2   # the sm90 kernel's units: items x KV heads
        off = {k: int(p[f"off_{k}"]) for k in ("qo_indptr", "kv_len", "page_indptr", "page_indices", "items")}
        b = pt.batch_size
        assert np.array_equal(h[start + off["qo_indptr"]:][:b + 1], qo_indptr)
        assert np.array_equal(h[start + off["kv_len"]:][:b], pt.kv_lens)
        assert np.array_equal(h[start + off["page_indptr"]:][:b + 1], pt.indptr)
        assert np.array_equal(h[start + off["page_indices"]:][:pt.indices.size], pt.indices)
        assert np.array_equal(h[start + off["items"]:][:items.size].reshape(items.shape), items)
        assert int(p["causal"]) == (li == 1)
    mp = info["merge_params"]
    assert int(mp["n"]) == slots and int(mp["num_rows"]) == 9 and int(mp["s_row"]) == slots * 8 * 64
    assert h[(int(attention[0][1]["plan"]) - base) // 4 + contract.NUM_MERGE] == 9


def test_request_pieces_number_each_requests_items_in_order():
    from kvattn.cascade import request_pieces
    piece, counts = request_pieces(np.array([0, 0, 1, 3, 3, 3, 1]), 5)
    assert piece.tolist() == [0, 1, 0, 0, 1, 2, 1] and counts.tolist() == [2, 2, 0, 3, 0]
    # a split decode schedule: every (request, piece) once, pieces below the request's count
    from kvattn import scheduler
    kv = np.array([700, 3, 4000, 256, 1])
    plan = scheduler.plan_decode(kv, 16, 8, 8, 128, num_sms=20, ctas_per_sm=3, allow_no_split=False)
    piece, counts = request_pieces(plan.work_req, kv.size)
    pairs = set(zip(plan.work_req.tolist(), piece.tolist()))
    assert len(pairs) == plan.num_work and all(p < counts[r] for r, p in pairs) and counts.max() > 1


def test_mixed_choice_weighs_level_0s_unit_rounds():
    from kvattn.cascade import mixed_choice
    # 128 requests on a 32768-token prefix: level 0 is 128 equal units, which a split of the SMs would walk in two
    # rounds: two launches (run 22c: 263.9 us in one launch against 185.4 in two)
    assert mixed_choice([128], [32768], [256] * 128, 32, 8, 128, 132) is None
    # 32 requests on 8192 (run 22c: one launch 41.6 us against 48.2): one launch, most SMs on level 0
    p = mixed_choice([32], [8192], [256] * 32, 32, 8, 128, 132)
    assert p is not None and 66 <= p < 132
    assert mixed_choice([0], [0], [10], 32, 8, 128, 132) is None


def test_deterministic_level_cuts_each_block_by_its_own_length():
    """plan_cascade_level with split_tokens: a group's items (KV ranges, slots of its rows) are the same alone and
    among companions; the blocks past their own chunks get empty chunks (they write lse -inf)."""
    def items_of(qo, kv, g):
        qo, kv = np.array(qo), np.array(kv)
        chunks = 4
        it = scheduler.plan_cascade_level(qo, kv, 4, 128, chunks, 8, 2, split_tokens=4096, max_split_chunks=4)
        mine = it[it[:, 0] == g]
        start = int(np.cumsum(qo)[g] - qo[g])
        rel = mine.copy()
        rel[:, 0] = 0
        rel[:, 5] -= start * 8   # partial row = token * slots + slot0 + k: relative to the group's first token
        return sorted(map(tuple, rel.tolist()))
    alone = items_of([3], [9000], 0)
    assert len(alone) == 4 and sum(1 for r in alone if r[4] > r[3]) == 3   # 9000 tokens: 3 real chunks, 1 empty
    assert items_of([7, 3, 40], [100, 9000, 20000], 1) == alone
    with pytest.raises(ValueError, match="chunks"):
        scheduler.plan_cascade_level(np.array([3]), np.array([9000]), 4, 128, 2, 8, 0, split_tokens=4096)


def test_deterministic_cascade_refuses_graph_mode():
    with pytest.raises(ValueError, match="deterministic"):
        kvattn.MultiLevelCascadeAttentionWrapper(2, deterministic=True, use_cuda_graph=True, max_batch_size=4,
                                                 max_total_qo=8, max_num_pages=16)
    assert kvattn.MultiLevelCascadeAttentionWrapper(2, deterministic=True).deterministic


@pytest.mark.parametrize("after", [False, True])
def test_decode_level_after_level_0_plans_one_grid_on_every_sm(after, monkeypatch):
    """bench_cascade.py's prefix 32768 / batch 128 shape (no SM split pays: mixed_choice None), faked driver:
    without DECODE_AFTER_LEVEL_0 level 0 and the decode level are two launches; with it (the default) one mixed
    grid holds level 0's 128 persistent CTAs, then the decode level's warpgroups (three a CTA) scheduled on all 132
    SMs; run() issues it and the stacked merge only."""
    from _fake_driver import fake_driver
    from kvattn import cascade
    assert cascade.DECODE_AFTER_LEVEL_0
    monkeypatch.setattr(cascade, "DECODE_AFTER_LEVEL_0", after)
    with fake_driver() as calls:
        b, ps = 128, 16
        rng = np.random.default_rng(0)
        perm = rng.permutation(32768 // ps + b * 256 // ps).astype(np.int32)
        pre = PageTable([0, 32768 // ps], perm[:32768 // ps], [ps], ps)
        suf = PageTable(np.arange(b + 1) * (256 // ps), perm[32768 // ps:], np.full(b, ps), ps)
        levels = CascadeLevels([(np.array([0, b]), pre), (np.arange(b + 1), suf)])
        w = kvattn.MultiLevelCascadeAttentionWrapper(2).plan(levels, None, 32, 8, 128)
        last = w.last_plan.info["levels"][-1]
        assert cascade.mixed_choice([b], [32768], [256] * b, 32, 8, 128, w.num_sms) is None
        assert last["backend"] == "decode" and last["mixed_with_level_0"] == after and last["after_level_0"] == after
        assert last["sms"] == w.num_sms == 132   # the decode level scheduled on every SM either way
        q = kvattn.empty((b, 32, 128), "bfloat16")
        k = kvattn.empty((int(perm.size), ps, 8, 128), "bfloat16")
        n = len(calls)
        w.run(q, k, k, out=kvattn.empty(q.shape, "bfloat16"))
        launched = [args for name, args in calls[n:] if name.startswith("cuLaunch")]
        assert len(launched) == (2 if after else 3), calls.names(n)   # (+ the stacked merge)
        if after:   # level 0: 4 query blocks of 128 rows x 4 chunks x 8 KV heads, a persistent CTA each; then
            # the decode CTAs of a wave over every SM (a split would have given the decode level ~20 SMs)
            units, grid_x = 128, int(launched[0][1])
            assert units + 100 < grid_x <= units + w.num_sms, grid_x


@pytest.mark.parametrize("at_plan", [False, True])
def test_decode_level_empty_slots_set_once_at_plan(at_plan, monkeypatch):
    """kvattn.cascade.EMPTY_SLOTS_AT_PLAN, faked driver: the decode level's slots that requests of fewer pieces
    leave (suffixes of 1..2999 tokens) are set to lse = -inf by one 2-D memset over every row's decode slots; with
    the flag (the default), plan() issues it on the plan's stream after its copy and before the event run() waits
    on, and run() issues only launches; without it, run() issues it before its launches, every call."""
    from _fake_driver import fake_driver
    from kvattn import cascade
    from kvattn.kernels import NEG_INF_BITS
    assert cascade.EMPTY_SLOTS_AT_PLAN
    monkeypatch.setattr(cascade, "EMPTY_SLOTS_AT_PLAN", at_plan)
    with fake_driver() as calls:
        b, ps, hq = 64, 16, 32
        rng = np.random.default_rng(5)
        suffix = rng.integers(1, 3000, b)
        npg = -(-suffix // ps)
        perm = rng.permutation(1024 // ps + int(npg.sum())).astype(np.int32)
        pre = PageTable([0, 1024 // ps], perm[:1024 // ps], [ps], ps)
        suf = PageTable(np.concatenate([[0], np.cumsum(npg)]), perm[1024 // ps:], suffix - (npg - 1) * ps, ps)
        levels = CascadeLevels([(np.array([0, b]), pre), (np.arange(b + 1), suf)])
        s = kvattn.Stream()
        n = len(calls)
        w = kvattn.MultiLevelCascadeAttentionWrapper(2).plan(levels, None, hq, 8, 128, stream=s)
        last = w.last_plan.info["levels"][-1]
        assert last["backend"] == "decode" and last["partial_fill"], w.last_plan.info["levels"]
        planned = calls[n:]
        q = kvattn.empty((b, hq, 128), "bfloat16")
        k = kvattn.empty((int(perm.size), ps, 8, 128), "bfloat16")
        for _ in range(2):
            n = len(calls)
            w.run(q, k, k, out=kvattn.empty(q.shape, "bfloat16"), stream=s)
            ran = [c for c in calls[n:] if c[0].startswith(("cuMemset", "cuLaunch"))]
            assert [name for name, _ in ran].count("cuMemsetD2D32Async") == (0 if at_plan else 1), ran
            assert ran[0][0] == ("cuLaunchKernel" if at_plan else "cuMemsetD2D32Async"), ran
        names = [name for name, _ in planned]
        assert names.count("cuMemsetD2D32Async") == (1 if at_plan else 0), names
        if at_plan:   # after the plan's copy, before its last event record (the one run() waits on)
            i = names.index("cuMemsetD2D32Async")
            assert names.index("cuMemcpyHtoDAsync") < i < len(names) - 1 - names[::-1].index("cuEventRecord"), names
        memset = planned[i][1] if at_plan else ran[0][1]
        _, pitch, value, width, height, stream = memset   # every row's decode slots (the level's last `chunks`)
        slots = sum(x["chunks"] for x in w.last_plan.info["levels"])
        assert (pitch, value, width, height) == (4 * hq * slots, NEG_INF_BITS, hq * last["chunks"], b)
        assert int(stream) == s.ptr
