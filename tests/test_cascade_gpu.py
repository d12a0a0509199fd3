"""GPU tests of MultiLevelCascadeAttentionWrapper against the float64 reference (reference.cascade_attention):
1..3 levels with empty groups and empty requests, both kernels (the shared level's 128-row tile takes sm90),
fp8 caches, graph replay across re-plans, poisoned outputs."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvattn
from kvattn import _dtypes, graphs, reference
from kvattn.formats import CascadeLevels, PageTable

from _gpu import assert_lse, poisoned, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
TOL = {"bfloat16": 1e-2, "float16": 2e-3}


def _levels(rng, qo_lens, group_sizes, level_kv, page_size, num_pages=None):
    """CascadeLevels whose level l groups the requests by group_sizes[l] (the last level: one group per request)
    with kv lengths level_kv[l] (random scattered pages of a pool of num_pages, default: the pages needed + 2;
    distinct across levels)."""
    cq = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    need = sum(-(-int(n) // page_size) for kv in level_kv for n in kv)
    free = rng.permutation(need + 2 if num_pages is None else num_pages).astype(np.int32)
    used = 0
    out = []
    for sizes, kv in zip(group_sizes, level_kv):
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        npg = [-(-int(n) // page_size) for n in kv]
        ids = free[used:used + sum(npg)]
        used += sum(npg)
        last = [int(n) - (p - 1) * page_size if p else 0 for n, p in zip(kv, npg)]
        out.append((cq[bounds], PageTable(np.concatenate([[0], np.cumsum(npg)]), ids, last, page_size)))
    assert used <= free.size
    return CascadeLevels(out)


def run_case(rng, levels, *, hkv, group, d, dtype="bfloat16", causal=False, layout="NHD", num_pages=None,
             kv_dtype=None, cap=0.0, backend="auto", wrapper=None):
    """Plan levels (on wrapper, else a new wrapper), run on fresh random q / caches into poisoned out / lse, and
    check both against the reference; returns the wrapper."""
    hq = hkv * group
    npd = _dtypes.to_numpy(dtype)
    ps = levels.page_size
    num_pages = num_pages or max(int(pt.indices.max(initial=-1)) + 1 for _, pt in levels) + 2
    rows = int(levels[0][0][-1])
    q = rng.standard_normal((rows, hq, d)).astype(npd)
    shape = (num_pages, ps, hkv, d) if layout == "NHD" else (num_pages, hkv, ps, d)
    kc = rng.standard_normal(shape).astype(npd)
    vc = rng.standard_normal(shape).astype(npd)
    scales = {}
    if kv_dtype:
        ks, vs = rng.uniform(0.005, 0.02, (2, hkv)).astype(np.float32)
        b = [1, 1, hkv, 1] if layout == "NHD" else [1, hkv, 1, 1]
        lim = 440.0 if kv_dtype == "float8_e4m3fn" else 57000.0   # fp8 casts of out-of-range values give NaN
        kc = np.clip(kc.astype(np.float64) / ks.reshape(b), -lim, lim).astype(_dtypes.to_numpy(kv_dtype))
        vc = np.clip(vc.astype(np.float64) / vs.reshape(b), -lim, lim).astype(_dtypes.to_numpy(kv_dtype))
        scales = dict(k_scale=ks, v_scale=vs)
        kref, vref = kc.astype(np.float64) * ks.reshape(b), vc.astype(np.float64) * vs.reshape(b)
    else:
        kref, vref = kc, vc
    w = wrapper or kvattn.MultiLevelCascadeAttentionWrapper(len(levels), kv_layout=layout, backend=backend)
    w.plan(levels, None, hq, hkv, d, causal=causal, q_dtype=dtype, kv_dtype=kv_dtype, logits_soft_cap=cap)
    out = poisoned((rows, hq, d), dtype)
    lse = poisoned((rows, hq), "float32")
    w.run(kvattn.from_numpy(q), kvattn.from_numpy(kc), kvattn.from_numpy(vc), out=out, lse=lse, **scales)
    ro, rl = reference.cascade_attention(q, kref, vref, levels, kv_layout=layout, causal=causal,
                                         logits_soft_cap=cap, return_lse=True)
    o, l = out.numpy(), lse.numpy()
    if rows:
        assert rel_l2(o, ro) <= TOL[dtype], (rel_l2(o, ro), w.last_plan.info["levels"])
        assert_lse(l, rl, TOL[dtype])
    return w


@st.composite
def level_sets(draw):
    b = draw(st.integers(1, 12))
    qo = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    nlev = draw(st.integers(1, 3))
    sizes = []
    for _ in range(nlev - 1):   # coarse levels: consecutive runs of requests (a run may be empty)
        parts, left = [], b
        while left:
            n = draw(st.integers(0, left))
            parts.append(n)
            left -= n
        sizes.append(parts)
    sizes.append([1] * b)
    ps = draw(st.sampled_from([1, 5, 16]))
    level_kv = [draw(st.lists(st.integers(0, 700), min_size=len(s), max_size=len(s))) for s in sizes]
    if draw(st.booleans()):   # causal on the last level needs kv >= qo
        level_kv[-1] = [max(k, q) for k, q in zip(level_kv[-1], qo)]
        causal = True
    else:
        causal = False
    return qo, sizes, level_kv, ps, causal


@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(level_sets(), st.sampled_from([(1, 4, 128), (2, 8, 64), (4, 1, 128), (1, 16, 64)]),
       st.sampled_from(["bfloat16", "float16"]), st.sampled_from(["NHD", "HND"]), st.integers(0, 2**31))
def test_cascade_matches_reference(ls, heads, dtype, layout, seed):
    qo, sizes, level_kv, ps, causal = ls
    rng = np.random.default_rng(seed)
    hkv, group, d = heads
    npages = sum(-(-k // ps) for kv in level_kv for k in kv) + 2
    levels = _levels(rng, qo, sizes, level_kv, ps, npages)
    run_case(rng, levels, hkv=hkv, group=group, d=d, dtype=dtype, causal=causal, layout=layout, num_pages=npages)


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("backend", ["auto", "sm80"])
def test_shared_prefix_decode(kv_dtype, backend):
    """The benchmark's shape, smaller: 64 decode rows share a 4096-token prefix (128-row tiles: sm90 under auto),
    each with its own suffix; 3 levels with a per-conversation middle level; soft cap on one."""
    rng = np.random.default_rng(7)
    b = 64
    lv = _levels(rng, [1] * b, [[b], [1] * b], [[4096], rng.integers(1, 600, b)], 16)
    w = run_case(rng, lv, hkv=8, group=4, d=128, kv_dtype=kv_dtype, backend=backend)
    if backend == "auto" and kvattn._driver.arch() == "sm_90a":
        assert w.last_plan.info["levels"][0]["backend"] == "sm90"
    lv3 = _levels(rng, [3] * 16, [[16], [4] * 4, [1] * 16], [[2048], [512, 0, 300, 1024], rng.integers(3, 200, 16)],
                  16)
    run_case(rng, lv3, hkv=2, group=4, d=128, causal=True, cap=30.0, backend=backend)


@pytest.mark.parametrize("hkv, group, d, cap, layout, b, kv_dtype", [
    (1, 8, 64, 0.0, "HND", 400, None), (4, 1, 128, 30.0, "NHD", 128, None), (2, 32, 128, 0.0, "NHD", 200, None),
    (8, 4, 128, 0.0, "NHD", 64, "float8_e4m3fn")])
def test_decode_suffix_level(hkv, group, d, cap, layout, b, kv_dtype):
    """The decode kernel as the last level across head dims, groups (32: two m tiles), soft cap, layouts and fp8;
    3 levels with a middle level of empty and full groups, suffixes of 1..2999 tokens (requests cut into pieces,
    some with fewer than the level's slots). At head dim 128 with a 16-bit cache and one m tile on an sm_90 GPU,
    level 0 and the decode level run in one launch where mixed_choice predicts a gain."""
    rng = np.random.default_rng(11)
    mid = [b // 4, 0, b // 2, b - b // 4 - b // 2]
    lv = _levels(rng, [1] * b, [[b], mid, [1] * b], [[1500], [300, 0, 17, 900], rng.integers(1, 3000, b)], 16)
    w = run_case(rng, lv, hkv=hkv, group=group, d=d, cap=cap, layout=layout, kv_dtype=kv_dtype)
    last = w.last_plan.info["levels"][-1]
    assert last["backend"] == "decode", w.last_plan.info["levels"]
    if kvattn._driver.arch() == "sm_90a" and d == 128 and kv_dtype is None and group < 32:
        from kvattn.cascade import mixed_choice
        (qo0, pt0), (_, ptl) = lv[0], lv[-1]
        predicted = mixed_choice(np.diff(qo0), pt0.kv_lens, ptl.kv_lens, hkv * group, hkv, d, w.num_sms)
        assert last["mixed_with_level_0"] == (predicted is not None), (predicted, w.last_plan.info["levels"])


@pytest.mark.parametrize("levels_kind", ["2 levels, b128", "3 levels, b64"])
def test_decode_level_after_level_0_in_one_grid(levels_kind, monkeypatch):
    """kvattn.cascade.DECODE_AFTER_LEVEL_0 (the default since run 53a; bench_cascade.py --after-level-0 its A/B): where
    no SM split pays (forced here), the decode level's CTAs join level 0's grid after its persistent CTAs, both
    scheduled on every SM; the result is the reference's, on sm_90 at head dim 128 in one launch."""
    from kvattn import cascade
    monkeypatch.setattr(cascade, "DECODE_AFTER_LEVEL_0", True)
    monkeypatch.setattr(cascade, "mixed_choice", lambda *args, **kwargs: None)
    rng = np.random.default_rng(13)
    if levels_kind == "2 levels, b128":
        b = 128
        lv = _levels(rng, [1] * b, [[b], [1] * b], [[4096], rng.integers(1, 600, b)], 16)
    else:
        b = 64
        mid = [16, 0, 32, 16]
        lv = _levels(rng, [1] * b, [[b], mid, [1] * b], [[1500], [300, 0, 17, 900], rng.integers(1, 3000, b)], 16)
    w = run_case(rng, lv, hkv=8, group=4, d=128)
    last = w.last_plan.info["levels"][-1]
    assert last["backend"] == "decode", w.last_plan.info["levels"]
    if kvattn._driver.arch() == "sm_90a":
        assert last["mixed_with_level_0"] and last["after_level_0"], w.last_plan.info["levels"]
        assert last["sms"] == w.num_sms


def test_decode_level_empty_slots_set_at_plan(monkeypatch):
    """kvattn.cascade.EMPTY_SLOTS_AT_PLAN (the default since run 55a): the decode level's
    slots that requests of fewer pieces leave are set empty once, by plan(), not before every run(). One wrapper,
    three plans, each planned and run twice: the later plans' empty slots held the earlier runs' partial states (long
    suffixes first, then suffixes of 1..2999 tokens, then a larger batch), so a slot left unset shows in the result."""
    from kvattn import cascade
    monkeypatch.setattr(cascade, "EMPTY_SLOTS_AT_PLAN", True)
    rng = np.random.default_rng(17)
    w = kvattn.MultiLevelCascadeAttentionWrapper(2)
    for b, lo, hi in ((64, 2500, 3000), (64, 1, 3000), (96, 1, 800)):
        lv = _levels(rng, [1] * b, [[b], [1] * b], [[1500], rng.integers(lo, hi, b)], 16)
        for _ in range(2):
            run_case(rng, lv, hkv=8, group=4, d=128, wrapper=w)
        last = w.last_plan.info["levels"][-1]
        assert last["backend"] == "decode" and last["partial_fill"], w.last_plan.info["levels"]


def test_cascade_graph_replay_after_replan():
    rng = np.random.default_rng(3)
    hkv, group, d, ps = 2, 4, 128, 16
    hq = hkv * group
    bf = _dtypes.to_numpy("bfloat16")
    max_pages, max_rows = 1500, 64
    kc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    vc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    w = kvattn.MultiLevelCascadeAttentionWrapper(2, use_cuda_graph=True, max_batch_size=32, max_total_qo=max_rows,
                                                 max_num_pages=max_pages // 2)
    qbuf = kvattn.empty((max_rows, hq, d), "bfloat16")
    obuf = poisoned((max_rows, hq, d), "bfloat16")
    lbuf = poisoned((max_rows, hq), "float32")
    s = kvattn.Stream()

    def one(qo_lens, prefix, suffix):
        b = len(qo_lens)
        lv = _levels(rng, qo_lens, [[b], [1] * b], [[prefix], suffix], ps, max_pages)
        rows = int(sum(qo_lens))
        q = rng.standard_normal((max_rows, hq, d)).astype(bf)
        tmp = kvattn.from_numpy(q)
        kvattn._driver.call("cuMemcpyDtoDAsync", qbuf.ptr, tmp.ptr, tmp.nbytes, s.handle)
        w.plan(lv, None, hq, hkv, d, causal=True, stream=s)
        return lv, q[:rows], rows

    lv, q, rows = one([1] * 8, 3000, [5] * 8)
    with graphs.capture(s) as cap:
        w.run(qbuf, kd, vd, out=obuf, lse=lbuf, stream=s)
    for case in (None, ([2] * 32, 1000, list(rng.integers(2, 300, 32))), ([40], 9000, [100])):
        if case is not None:
            qo_lens, prefix, suffix = case
            obuf.fill_bytes(0xFF)
            lv, q, rows = one(qo_lens, prefix, suffix)
        cap.graph.replay(s)
        s.synchronize()
        ro, rl = reference.cascade_attention(q, kc, vc, lv, causal=True, return_lse=True)
        o, l = obuf.numpy(), lbuf.numpy()
        assert rel_l2(o[:rows], ro) <= 1e-2
        assert_lse(l[:rows], rl, 1e-2)
        assert np.isnan(o[rows:].astype(np.float32)).all(), "rows past the batch are not touched"


def test_cascade_numpy_inputs_and_errors():
    rng = np.random.default_rng(1)
    lv = _levels(rng, [2, 1], [[2], [1, 1]], [[64], [10, 20]], 16, 16)
    bf = _dtypes.to_numpy("bfloat16")
    q = rng.standard_normal((3, 8, 64)).astype(bf)
    kc = rng.standard_normal((16, 16, 2, 64)).astype(bf)
    vc = rng.standard_normal((16, 16, 2, 64)).astype(bf)
    w = kvattn.MultiLevelCascadeAttentionWrapper(2)
    w.plan(lv, None, 8, 2, 64)
    o = w.run(q, kc, vc)
    assert rel_l2(o.numpy(), reference.cascade_attention(q, kc, vc, lv)) <= 1e-2
    with pytest.raises(ValueError, match="q: expected shape"):
        w.run(q[:2], kc, vc)
    with pytest.raises(ValueError, match="the page table uses page id"):
        w.run(q, kc[:3], vc[:3])


def test_deterministic_cascade_is_batch_invariant():
    """deterministic=True: a request's output and LSE bits in a 2-level cascade (a shared prefix, its own suffix)
    alone equal its bits inside 8 random batches of 1..40 companions sharing the prefix (their rows packed with
    its own in level 0's tiles), on 132 / 66 / 17 SMs."""
    rng = np.random.default_rng()
    hkv, group, d, ps = 2, 4, 128, 16
    hq = hkv * group
    bf = _dtypes.to_numpy("bfloat16")
    prefix, tq, tk = 9008, 3, 5000            # the request: 3 query rows, 5000 tokens of its own (two splits);
    # the shared prefix is whole pages (563 of 16)
    npre, nown = -(-prefix // ps), -(-tk // ps)
    max_pages = npre + nown + 41 * 200
    kc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    vc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    q0 = rng.standard_normal((tq, hq, d)).astype(bf)
    pre_pages = np.arange(npre)
    own_pages = np.arange(npre, npre + nown)

    def run(qo, kv, pos, num_sms=None):
        # the levels built explicitly (level 0: the prefix, one group; level 1: each request's own pages), so the
        # request's levels are the same alone and in a batch (from_shared_prefixes would give a request alone its
        # whole list as prefix)
        free = iter(range(npre + nown, max_pages))
        own = [own_pages if i == pos else np.array([next(free) for _ in range(-(-k // ps))], np.int64)
               for i, k in enumerate(kv)]
        qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        pre = kvattn.PageTable(np.array([0, npre], np.int32), pre_pages.astype(np.int32),
                               np.array([prefix - (npre - 1) * ps], np.int32), ps)
        suf = kvattn.PageTable(np.concatenate([[0], np.cumsum([p.size for p in own])]).astype(np.int32),
                               np.concatenate(own).astype(np.int32),
                               np.array([k - (-(-k // ps) - 1) * ps for k in kv], np.int32), ps)
        levels = kvattn.CascadeLevels([(np.array([0, qi[-1]], np.int32), pre), (qi, suf)])
        q = np.concatenate([q0 if i == pos else rng.standard_normal((n, hq, d)).astype(bf)
                            for i, n in enumerate(qo)])
        w = kvattn.MultiLevelCascadeAttentionWrapper(2, deterministic=True, num_sms=num_sms)
        w.plan(levels, None, hq, hkv, d, causal=True)
        o, lse = w.run(q, kc, vc, return_lse=True)
        return o.numpy()[qi[pos]:qi[pos + 1]], lse.numpy()[qi[pos]:qi[pos + 1]], levels, q

    o0, l0, lv, q = run([tq], [tk], 0)
    ro = reference.cascade_attention(q, kc, vc, lv, causal=True)
    assert rel_l2(o0, ro) <= 1e-2
    for trial in range(8):
        n = int(rng.integers(1, 41))
        qo = [int(x) for x in rng.integers(1, 6, n)]
        kv = [int(a + rng.integers(0, 3000)) for a in qo]
        pos = int(rng.integers(n + 1))
        qo.insert(pos, tq)
        kv.insert(pos, tk)
        o, lse, _, _ = run(qo, kv, pos, num_sms=int(rng.choice([132, 66, 17])))
        assert np.array_equal(o.view(np.uint16), o0.view(np.uint16)), f"trial {trial}: output bits"
        assert np.array_equal(lse.view(np.uint32), l0.view(np.uint32)), f"trial {trial}: lse bits"
