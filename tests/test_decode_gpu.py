"""GPU tests of batch decode against the float64 reference."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvattn
from kvattn import _driver, _dtypes, decode, reference
from _gpu import assert_decode_rows, assert_lse, poisoned, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
GPU = settings(max_examples=50, deadline=None)
TOL = {"bfloat16": (1e-2, 1e-2), "float16": (2e-3, 2e-3)}


def make_case(rng, kv_lens, page_size, hq, hkv, d, dtype, layout, combined=False, slack_pages=3):
    npd = _dtypes.to_numpy(dtype)
    pt = kvattn.PageTable.from_kv_lens(np.asarray(kv_lens), page_size,
                                       num_pages=int(sum(-(-int(n) // page_size) for n in kv_lens)) + slack_pages,
                                       rng=rng)
    num_pages = pt.num_pages_used + slack_pages
    shape = (num_pages, page_size, hkv, d) if layout == "NHD" else (num_pages, hkv, page_size, d)
    k = rng.standard_normal(shape).astype(npd)
    v = rng.standard_normal(shape).astype(npd)
    q = rng.standard_normal((len(kv_lens), hq, d)).astype(npd)
    return pt, q, k, v


def check(rng, kv_lens, page_size, hq, hkv, d, dtype="bfloat16", layout="NHD", window_left=-1, cap=0.0,
          combined=False, sm_scale=None):
    pt, q, k, v = make_case(rng, kv_lens, page_size, hq, hkv, d, dtype, layout)
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout)
    w.plan(pt, hq, hkv, d, q_dtype=dtype, window_left=window_left, logits_soft_cap=cap, sm_scale=sm_scale)
    out = poisoned(q.shape, dtype)
    lse = poisoned(q.shape[:2], "float32")
    if combined:
        kv = np.stack([k, v], 1)
        w.run(q, kv, None, out=out, lse=lse)
    else:
        w.run(q, k, v, out=out, lse=lse)
    qo_indptr = np.arange(len(kv_lens) + 1, dtype=np.int32)
    ro, rl = reference.batch_attention_paged(q, k, v, qo_indptr, pt, kv_layout=layout, window_left=window_left,
                                             logits_soft_cap=cap, sm_scale=sm_scale, return_lse=True)
    got, got_lse = out.numpy(), lse.numpy()
    otol, ltol = TOL[dtype]
    assert_decode_rows(got, ro, kv_lens, otol)
    assert_lse(got_lse, rl, ltol)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_decode_matches_reference(data, seed):
    rng = np.random.default_rng(seed)
    batch = data.draw(st.integers(1, 64), "batch")
    lens = data.draw(st.lists(st.one_of(st.integers(0, 600), st.integers(0, 600), st.integers(0, 8192)), min_size=batch,
                              max_size=batch), "kv_lens")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 16, 32]), "group")
    hkv = data.draw(st.integers(1, 4), "hkv")
    d = data.draw(st.sampled_from([64, 128, 256]), "head_dim")
    dtype = data.draw(st.sampled_from(["bfloat16", "float16"]), "dtype")
    layout = data.draw(st.sampled_from(["NHD", "HND"]), "layout")
    page = data.draw(st.sampled_from([1, 3, 8, 16, 32, 64, 256]), "page_size")
    window = data.draw(st.sampled_from([-1, -1, 0, 17, 300]), "window_left")
    cap = data.draw(st.sampled_from([0.0, 0.0, 30.0, 5.0]), "soft_cap")
    combined = data.draw(st.booleans(), "combined")
    check(rng, lens, page, group * hkv, hkv, d, dtype, layout, window, cap, combined)


@pytest.mark.parametrize("lens", [[32768, 5, 0, 1000], [65536], [0, 0, 0], [1] * 200])
def test_decode_long_and_edge_batches(lens):
    check(np.random.default_rng(), lens, 16, 32, 8, 128)


def test_decode_skewed_batch():
    lens = [32768 if i % 16 == 0 else 256 + (i * 389) % 1024 for i in range(64)]
    check(np.random.default_rng(), lens, 16, 32, 8, 128)


def test_single_decode():
    rng = np.random.default_rng()
    q = rng.standard_normal((8, 128)).astype(_dtypes.to_numpy("bfloat16"))
    k = rng.standard_normal((777, 2, 128)).astype(q.dtype)
    v = rng.standard_normal((777, 2, 128)).astype(q.dtype)
    o, lse = kvattn.single_decode(q, k, v, return_lse=True)
    ro, rl = reference.attention(q[None], k, v, return_lse=True)
    assert rel_l2(o.numpy(), ro[0]) <= 1e-2
    assert_lse(lse.numpy(), rl[0], 1e-2)


def test_graph_mode_replays_after_replan_with_other_batch():
    rng = np.random.default_rng()
    hq, hkv, d, page, max_b, max_pages = 32, 8, 128, 16, 48, 4096
    npd = _dtypes.to_numpy("bfloat16")
    k = kvattn.from_numpy(rng.standard_normal((max_pages, page, hkv, d)).astype(npd))
    v = kvattn.from_numpy(rng.standard_normal((max_pages, page, hkv, d)).astype(npd))
    q = kvattn.empty((max_b, hq, d), "bfloat16")
    out = kvattn.empty((max_b, hq, d), "bfloat16")
    lse = kvattn.empty((max_b, hq), "float32")
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=max_b, max_num_pages=max_pages)
    s = kvattn.Stream()
    graph = None
    for step, batch in enumerate([40, 7, 48, 1, 23]):
        lens = rng.integers(0, 2000, batch)
        lens[0] = 5000
        pt = kvattn.PageTable.from_kv_lens(lens, page, num_pages=max_pages, rng=rng)
        w.plan(pt, hq, hkv, d, stream=s)
        qh = rng.standard_normal((max_b, hq, d)).astype(npd)
        q.copy_from_host(qh, s)
        out.fill_bytes(0xFF, s)
        # Graph mode: q/out/lse keep max_batch_size rows; the batch lives in the plan, rows past it are not read.
        if graph is None:
            w.run(q, k, v, out=out, lse=lse, stream=s)
            with kvattn.graphs.capture(s) as cap:
                w.run(q, k, v, out=out, lse=lse, stream=s)
            graph = cap.graph
        graph.replay(s)
        ro, rl = reference.batch_attention_paged(qh[:batch], k.numpy(), v.numpy(), np.arange(batch + 1), pt,
                                                 return_lse=True)
        got = out.numpy(s)[:batch]
        assert rel_l2(got, ro) <= 1e-2, f"step {step} batch {batch}"
        assert_lse(lse.numpy(s)[:batch], rl, 1e-2)


def test_run_errors_before_launch():
    rng = np.random.default_rng()
    pt, q, k, v = make_case(rng, [100, 50], 16, 8, 2, 64, "bfloat16", "NHD")
    w = kvattn.BatchDecodeWithPagedKVCache()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, k, v)
    w.plan(pt, 8, 2, 64)
    with pytest.raises(ValueError, match=r"q: expected shape \(2, 8, 64\)"):
        w.run(q[:1], k, v)
    with pytest.raises(TypeError, match="q: expected dtype bfloat16"):
        w.run(q.astype(np.float16), k, v)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        w.run(q, k[:, :8], v)
    with pytest.raises(ValueError, match="cache holds 1 pages"):
        w.run(q, k[:1], v[:1])
    g = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=1, max_num_pages=100)
    with pytest.raises(ValueError, match="exceeds max_batch_size 1"):
        g.plan(pt, 8, 2, 64)


def _batch_with(rng, target_pages, target_len, companions, pool_pages, page):
    """A PageTable of `companions` random requests with the target request (its pages and length) inserted at a
    random position: (table, the target's row)."""
    lens = list(rng.integers(0, 6000, companions))
    pos = int(rng.integers(companions + 1))
    lens.insert(pos, target_len)
    indptr, indices, last = [0], [], []
    for i, n in enumerate(lens):
        npg = -(-int(n) // page)
        pages = target_pages if i == pos else list(rng.integers(0, pool_pages, npg))
        indices += list(pages)
        indptr.append(len(indices))
        last.append(int(n) - (npg - 1) * page if npg else page)
    pt = kvattn.PageTable(np.array(indptr, np.int32), np.array(indices, np.int32), np.array(last, np.int32), page)
    return pt, pos


def test_deterministic_decode_is_batch_invariant():
    """deterministic=True: a request's output and LSE bits alone equal its bits inside 20 random batches of 1..128
    companions, on any SM count, and in graph mode."""
    rng = np.random.default_rng()
    hq, hkv, d, page, pool = 32, 8, 128, 16, 8192
    npd = _dtypes.to_numpy("bfloat16")
    k = kvattn.from_numpy(rng.standard_normal((pool, page, hkv, d)).astype(npd))
    v = kvattn.from_numpy(rng.standard_normal((pool, page, hkv, d)).astype(npd))
    L = 9000
    tpages = list(rng.integers(0, pool, -(-L // page)))
    qrow = rng.standard_normal((1, hq, d)).astype(npd)
    alone, _ = _batch_with(rng, tpages, L, 0, pool, page)
    w = kvattn.BatchDecodeWithPagedKVCache(deterministic=True)
    w.plan(alone, hq, hkv, d)
    o0, l0 = w.run(qrow, k, v, return_lse=True)
    o0, l0 = o0.numpy(), l0.numpy()
    ref = reference.batch_attention_paged(qrow, k.numpy(), v.numpy(), np.arange(2), alone)
    assert rel_l2(o0, ref) <= 1e-2
    for trial in range(20):
        pt, pos = _batch_with(rng, tpages, L, int(rng.integers(1, 129)), pool, page)
        q = rng.standard_normal((pt.batch_size, hq, d)).astype(npd)
        q[pos] = qrow[0]
        wb = kvattn.BatchDecodeWithPagedKVCache(deterministic=True, num_sms=int(rng.choice([132, 66, 17])))
        wb.plan(pt, hq, hkv, d)
        o, lse = wb.run(q, k, v, return_lse=True)
        assert np.array_equal(o.numpy()[pos].view(np.uint16), o0[0].view(np.uint16)), f"trial {trial}: output bits"
        assert np.array_equal(lse.numpy()[pos].view(np.uint32), l0[0].view(np.uint32)), f"trial {trial}: lse bits"
    # graph mode: one capture, replayed for new batches
    mb = 129
    g = kvattn.BatchDecodeWithPagedKVCache(deterministic=True, use_cuda_graph=True, max_batch_size=mb,
                                           max_num_pages=mb * 400)
    qg, og = kvattn.empty((mb, hq, d), "bfloat16"), kvattn.empty((mb, hq, d), "bfloat16")
    lg = kvattn.empty((mb, hq), "float32")
    s, graph = kvattn.Stream(), None
    for trial in range(3):
        pt, pos = _batch_with(rng, tpages, L, int(rng.integers(1, 129)), pool, page)
        g.plan(pt, hq, hkv, d, stream=s)
        qh = rng.standard_normal((mb, hq, d)).astype(npd)
        qh[pos] = qrow[0]
        qg.copy_from_host(qh, s)
        if graph is None:
            with kvattn.graphs.capture(s) as cap:
                g.run(qg, k, v, out=og, lse=lg, stream=s)
            graph = cap.graph
        graph.replay(s)
        assert np.array_equal(og.numpy(s)[pos].view(np.uint16), o0[0].view(np.uint16)), f"graph {trial}"
        assert np.array_equal(lg.numpy(s)[pos].view(np.uint32), l0[0].view(np.uint32)), f"graph {trial}"


MERGE_MODES = {"fused": dict(fused_merge=True, sm90_route=False),
               "fused_b1": dict(fused_merge=True, fused_merge_batch=1, sm90_route=False),
               "apart": dict(fused_merge=False, sm90_route=False)}   # (the decode kernel's merges, GQA 32 too)


@pytest.mark.parametrize("mode", list(MERGE_MODES))
@pytest.mark.parametrize("group, hkv", [(4, 2), (32, 1), (20, 2)])
def test_split_kv_merge_in_the_launch_and_apart(mode, group, hkv):
    """Split requests merged by the last CTA of their pieces (tuning fused_merge; its lanes loading 4 states a round,
    or 1: fused_b1) or by the separate merge kernel (the default), several z slices, empty requests between split
    ones: every run of the same plan (the arrival counters must be back at 0 after each) against the reference, on a
    freshly poisoned output."""
    fused = mode != "apart"
    rng = np.random.default_rng(group * 10 + hkv + len(mode))
    lens = [20000, 0, 7, 9000, 0, 65, 30000]
    hq, d = group * hkv, 128
    pt, q, k, v = make_case(rng, lens, 16, hq, hkv, d, "bfloat16", "NHD")
    w = kvattn.BatchDecodeWithPagedKVCache(tuning=MERGE_MODES[mode])
    w.plan(pt, hq, hkv, d)
    assert w.last_plan.info["schedule"].split
    assert (w.last_plan.merge is None) == fused
    batch = dict(w.last_plan.launches[0].kernel.spec.defines).get("KVATTN_FUSED_MERGE_BATCH", 1)
    assert batch == (decode.FUSED_MERGE_BATCH if mode == "fused" else 1), batch
    if not fused:   # the 30000-token request's states are spread over lanes that combine through shuffles
        assert w.last_plan.info["merge_params"]["lane_shift"] > 0
    ro, rl = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1, dtype=np.int32), pt, return_lse=True)
    qd, kd, vd = kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v)
    for _ in range(3):
        out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
        w.run(qd, kd, vd, out=out, lse=lse)
        got = out.numpy()
        assert_decode_rows(got, ro, lens, TOL["bfloat16"][0])
        assert_lse(lse.numpy(), rl, TOL["bfloat16"][1])


def test_merge_fused_only_where_the_grid_leaves_sms_idle():
    """tuning fused_merge=None: one launch where the grid has fewer CTAs than the GPU has SMs (a latency-bound call),
    the merge kernel after it on a full grid (faster there in GPU time); both outputs against the reference."""
    rng = np.random.default_rng(7)
    for lens, fused in (([2048], True), ([4096] * 16, False)):
        pt, q, k, v = make_case(rng, lens, 16, 32, 8, 128, "bfloat16", "NHD")
        w = kvattn.BatchDecodeWithPagedKVCache()
        w.plan(pt, 32, 8, 128)
        grid = w.last_plan.info["grid"]
        assert w.last_plan.info["schedule"].split
        assert (grid[0] * grid[1] < w.num_sms) == fused and (w.last_plan.merge is None) == fused, (lens, grid)
        out = poisoned(q.shape, "bfloat16")
        w.run(kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v), out=out)
        ro = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1, dtype=np.int32), pt)
        got = out.numpy()
        assert max(rel_l2(got[i], ro[i]) for i in range(len(lens))) <= TOL["bfloat16"][0]
    # a CUDA-graph wrapper keeps the merge kernel even where the grid leaves SMs idle (its launch is free in a replay)
    pt, q, k, v = make_case(rng, [2048], 16, 32, 8, 128, "bfloat16", "NHD")
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=4, max_num_pages=pt.num_pages_used)
    w.plan(pt, 32, 8, 128)
    assert w.last_plan.merge is not None


@requires_gpu
def test_large_groups_take_two_mma_tiles_per_cta():
    """GQA 32 at head dim 128 on the decode kernel (tuning sm90_route=False; auto m_tiles: 2, one CTA per KV
    head's 32 query heads) against the reference, with a soft cap and a window too; GQA 16 keeps one tile (two z
    slices)."""
    rng = np.random.default_rng(32)
    for hq, hkv, kw, tiles in ((32, 1, {}, 2), (64, 2, dict(logits_soft_cap=30.0, window_left=700), 2),
                               (64, 4, {}, 1)):
        pt, q, k, v = make_case(rng, [3000, 17, 1200], 16, hq, hkv, 128, "bfloat16", "NHD")
        w = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route=False))
        w.plan(pt, hq, hkv, 128, **kw)
        assert f"decode_kernel<kvattn::AttnTypes<128, 128, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16>, {tiles}," \
            in w.last_plan.launches[0].kernel.spec.kernel, w.last_plan.launches[0].kernel.spec.kernel
        out = poisoned(q.shape, "bfloat16")
        w.run(kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v), out=out)
        ro = reference.batch_attention_paged(q, k, v, np.arange(4, dtype=np.int32), pt, **kw)
        assert rel_l2(out.numpy(), ro) <= TOL["bfloat16"][0], (hq, hkv, kw)


@requires_gpu
@pytest.mark.parametrize("layout, page", [("NHD", 16), ("HND", 5), ("NHD", 1)])
def test_large_groups_route_to_the_sm90_prefill_kernel(layout, page):
    """Groups of 32+ at head dim 128 (16-bit cache, plain / soft cap / window) run on the sm90 prefill kernel
    (tuning sm90_route auto: one query token a request, a unit of `group` packed rows): empty, one-token,
    short and split requests against the float64 reference on poisoned out / lse, and with out=None and
    return_lse, and with its KV split over two waves; GQA 16 and a graph-mode wrapper stay on the decode kernel, and
    forcing the route there raises."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 prefill kernel needs an sm_90 GPU")
    rng = np.random.default_rng(page)
    lens = [3000, 0, 1, 17, 20000, 129]
    for hq, hkv, kw in ((32, 1, {}), (64, 2, dict(logits_soft_cap=30.0, window_left=700)), (64, 1, {})):
        pt, q, k, v = make_case(rng, lens, page, hq, hkv, 128, "bfloat16", layout)
        w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout)
        w.plan(pt, hq, hkv, 128, **kw)
        assert w.sm90_routed and w.last_plan.info["backend"] == "sm90" and not w.last_plan.info["wg_split"]
        _check_routed_runs(w, pt, q, k, v, lens, layout, kw)
    # the KV split over two waves of slots (tuning sm90_route_waves, the A/B of scripts/probe_gqa_prefill.py), and
    # a second plan() of the same wrapper (its routed prefill wrapper is reused) on another batch
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout, tuning=dict(sm90_route_waves=2))
    for batch in (lens, [500, 7, 0]):
        pt, q, k, v = make_case(rng, batch, page, 32, 1, 128, "bfloat16", layout)
        w.plan(pt, 32, 1, 128)
        assert w.sm90_routed
        out = poisoned(q.shape, "bfloat16")
        w.run(kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v), out=out)
        ro = reference.batch_attention_paged(q, k, v, np.arange(len(batch) + 1, dtype=np.int32), pt,
                                             kv_layout=layout)
        for i, n in enumerate(batch):
            assert (np.all(out.numpy()[i] == 0) if n == 0 else rel_l2(out.numpy()[i], ro[i]) <= TOL["bfloat16"][0]), i
    with pytest.raises(ValueError, match="sm90_route_waves"):
        kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout, tuning=dict(sm90_route_waves=0)).plan(pt, 32, 1, 128)
    # the split blocks merged inside the sm90 kernel (tuning sm90_route_fused_merge): twice on one plan (the
    # arrival counters are left at 0), with out given and out=None; 8 SMs, so blocks have 2-3 chunks (at most
    # prefill.FUSED_MERGE_MAX_CHUNKS)
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout, num_sms=8, tuning=dict(sm90_route_fused_merge=True))
    for hq, hkv in ((32, 1), (64, 2)):
        pt, q, k, v = make_case(rng, lens, page, hq, hkv, 128, "bfloat16", layout)
        w.plan(pt, hq, hkv, 128)
        info = w.last_plan.info
        assert w.sm90_routed and info["fused_merge"] and info["schedule"].split and w.last_plan.merge is None
        _check_routed_runs(w, pt, q, k, v, lens, layout, {}, repeats=2)
    # the instance whose consumer warpgroups split the KV tiles (tuning sm90_route_wg_split, the A/B of
    # scripts/probe_gqa_prefill.py)
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout, tuning=dict(sm90_route_wg_split=True))
    pt, q, k, v = make_case(rng, lens, page, 32, 1, 128, "bfloat16", layout)
    w.plan(pt, 32, 1, 128)
    assert w.sm90_routed and w.last_plan.info["wg_split"]
    out = poisoned(q.shape, "bfloat16")
    w.run(kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v), out=out)
    ro = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1, dtype=np.int32), pt, kv_layout=layout)
    for i, n in enumerate(lens):
        assert (np.all(out.numpy()[i] == 0) if n == 0 else rel_l2(out.numpy()[i], ro[i]) <= TOL["bfloat16"][0]), i
    pt, q, k, v = make_case(rng, lens, page, 64, 4, 128, "bfloat16", layout)
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout)
    w.plan(pt, 64, 4, 128)
    assert not w.sm90_routed
    g = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout, use_cuda_graph=True, max_batch_size=8,
                                           max_num_pages=pt.num_pages_used)
    g.plan(pt, 32, 1, 128)
    assert not g.sm90_routed
    with pytest.raises(ValueError, match="sm90_route"):
        kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout, use_cuda_graph=True, max_batch_size=8,
                                           max_num_pages=pt.num_pages_used,
                                           tuning=dict(sm90_route=True)).plan(pt, 32, 1, 128)


def _check_routed_runs(w, pt, q, k, v, lens, layout, kw, repeats=1):
    """run() of a planned routed wrapper `repeats` times, with out / lse given (poisoned) and with out=None and
    return_lse, against the float64 reference (plan keywords kw); empty requests must come back as zeros."""
    ro, rl = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1, dtype=np.int32), pt,
                                             kv_layout=layout, return_lse=True, **kw)
    qd, kd, vd = kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v)
    for _ in range(repeats):
        out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
        w.run(qd, kd, vd, out=out, lse=lse)
        o2, l2 = w.run(qd, kd, vd, return_lse=True)
        for got, gl in ((out.numpy(), lse.numpy()), (o2.numpy(), l2.numpy())):
            assert_decode_rows(got, ro, lens, TOL["bfloat16"][0])
            assert_lse(gl, rl, TOL["bfloat16"][1])


@requires_gpu
@pytest.mark.parametrize("layout, page, causal", [("NHD", 16, False), ("HND", 5, True)])
def test_wg_split_units_many_a_cta(layout, page, causal):
    """The sm90 instance whose two consumer warpgroups split a unit's KV tiles (prefill wrapper wg_split, the decode
    route's), on 3 SMs so each persistent CTA walks many units of odd and even tile counts (which warpgroup takes
    tile 0 alternates, the last tile's owner merges): one and two query tokens a request (32 and 64 packed rows),
    causal or not, empty and one-tile requests, against the float64 reference on poisoned out / lse."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 prefill kernel needs an sm_90 GPU")
    from kvattn.prefill import BatchPrefillWithPagedKVCache
    rng = np.random.default_rng(7 + page)
    lens = [3000, 0, 2, 17, 9000, 129, 128, 256, 384, 1000]
    qo = [0 if n == 0 else 1 + i % 2 for i, n in enumerate(lens)]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    pt, _, k, v = make_case(rng, lens, page, 32, 1, 128, "bfloat16", layout)
    q = rng.standard_normal((int(qo_indptr[-1]), 32, 128)).astype(_dtypes.to_numpy("bfloat16"))
    w = BatchPrefillWithPagedKVCache(kv_layout=layout, backend="sm90", num_sms=3)
    w.wg_split = True
    w.plan(qo_indptr, pt, 32, 1, 128, causal=causal, cta_rows=128)
    assert w.last_plan.info["wg_split"] and w.last_plan.info["backend"] == "sm90"
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v), out=out, lse=lse)
    ro, rl = reference.batch_attention_paged(q, k, v, qo_indptr, pt, kv_layout=layout, causal=causal,
                                             return_lse=True)
    assert rel_l2(out.numpy(), ro) <= TOL["bfloat16"][0]
    assert_lse(lse.numpy(), rl, TOL["bfloat16"][1])
    with pytest.raises(ValueError, match="at most 64 packed query rows"):
        w.plan(np.array([0, 3] + [3] * (len(lens) - 1), np.int32), pt, 32, 1, 128, cta_rows=128)
    # long units on a full grid, run back to back (each warpgroup waits on every tile in order: without
    # that wait a warpgroup ahead of the ring passed a parity wait two phases early and the launch failed, run 37c)
    pt, q, k, v = make_case(rng, [4096] * 64, 16, 32, 1, 128, "bfloat16", "NHD")
    w = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route_wg_split=True))
    w.plan(pt, 32, 1, 128)
    assert w.sm90_routed and w.last_plan.info["wg_split"]
    qd, kd, vd = kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v)
    out = poisoned(q.shape, "bfloat16")
    for _ in range(30):
        w.run(qd, kd, vd, out=out)
    ro = reference.batch_attention_paged(q, k, v, np.arange(65, dtype=np.int32), pt, kv_layout="NHD")
    assert rel_l2(out.numpy(), ro) <= TOL["bfloat16"][0]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("tuning", [dict(wtok=8), dict(wtok=16), dict(ids_ahead=True), dict(ids_ahead=False)])
@pytest.mark.parametrize("page, dtype", [(16, "bfloat16"), (5, "float16"), (1, "bfloat16")])
def test_decode_ab_builds_match_reference(d, tuning, page, dtype):
    """The builds the benchmarks time against the default (8- and 16-token warp tiles: head dim 256's default and
    the one before it; page ids loaded a tile ahead or as used) are correct kernels: requests empty, shorter than a
    tile, split over CTAs, against the float64 reference on a poisoned output, with a soft cap."""
    rng = np.random.default_rng(d + page)
    lens = [0, 7, 65, 300, 9000, 1]
    hq, hkv = 8, 2
    pt, q, k, v = make_case(rng, lens, page, hq, hkv, d, dtype, "NHD")
    w = kvattn.BatchDecodeWithPagedKVCache(tuning=tuning)
    w.plan(pt, hq, hkv, d, q_dtype=dtype, logits_soft_cap=30.0)
    check_soft_capped_run(w, pt, q, k, v, lens, dtype)


def check_soft_capped_run(w, pt, q, k, v, lens, dtype):
    """w (planned on pt with logits_soft_cap 30) run into a poisoned out / lse, against the float64 reference."""
    out, lse = poisoned(q.shape, dtype), poisoned(q.shape[:2], "float32")
    w.run(q, k, v, out=out, lse=lse)
    ro, rl = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1, dtype=np.int32), pt,
                                             logits_soft_cap=30.0, return_lse=True)
    got = out.numpy()
    otol, ltol = TOL[dtype]
    assert_decode_rows(got, ro, lens, otol)
    assert_lse(lse.numpy(), rl, ltol)


@pytest.mark.parametrize("slim", [None, True])
@pytest.mark.parametrize("hq, hkv, page, dtype", [(8, 8, 16, "bfloat16"), (16, 4, 5, "float16"), (16, 2, 16, "bfloat16"),
                                                  (32, 2, 16, "bfloat16")])
def test_head_dim_256_slim_and_two_stage_kernels_match_reference(slim, hq, hkv, page, dtype):
    """Head dim 256: the 2-stage kernel by default, and for groups of at most 8 the slim A/B build (tuning slim=True:
    8-row Q slots, 3 stages at 2 CTAs per SM); both against the float64 reference with a soft cap, on requests empty,
    shorter than a tile, split over CTAs (merged apart and, for the one-request batch, fused)."""
    rng = np.random.default_rng(hq + page)
    group = hq // hkv
    if slim and group > 8:
        pytest.skip("the slim kernel takes groups of at most 8 (test_slim_tuning_refuses_shapes_it_does_not_fit)")
    for lens in ([0, 7, 65, 300, 9000, 1], [2048]):
        pt, q, k, v = make_case(rng, lens, page, hq, hkv, 256, dtype, "NHD")
        w = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(slim=slim))
        w.plan(pt, hq, hkv, 256, q_dtype=dtype, logits_soft_cap=30.0)
        spec = w.last_plan.launches[0].kernel.spec
        assert (("KVATTN_DECODE_SLIM", 1) in spec.defines) == bool(slim), spec.defines
        check_soft_capped_run(w, pt, q, k, v, lens, dtype)


@requires_gpu
def test_slim_tuning_refuses_shapes_it_does_not_fit():
    pt = kvattn.PageTable.from_kv_lens([100], 16, rng=0)
    for hq, hkv, d in ((32, 2, 256), (8, 2, 128)):
        with pytest.raises(ValueError, match="tuning slim: the slim kernel takes"):
            kvattn.BatchDecodeWithPagedKVCache(tuning=dict(slim=True)).plan(pt, hq, hkv, d)
