"""GPU tests of batch prefill / append (paged and ragged) against the float64 reference."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvattn
from kvattn import _driver, _dtypes, graphs, prefill, reference, tma
from kvattn.formats import PageTable
from kvattn.prefill import BatchPrefillWithPagedKVCache, BatchPrefillWithRaggedKVCache, single_prefill, sm90_tile
from kvattn.variants import Variant

from _gpu import assert_lse, poisoned, rel_l2, requires_gpu
from _prefill_ref import request_ref, sample_rows

pytestmark = [pytest.mark.gpu, requires_gpu]
TOL = {"bfloat16": 1e-2, "float16": 2e-3}
SAMPLE_ROWS = 48


def _kv_pages(rng, kv_lens, page_size, hkv, d, dtype, layout):
    """Scattered pages: (k_cache, v_cache numpy, PageTable)."""
    npages = [-(-int(n) // page_size) for n in kv_lens]
    total = sum(npages)
    perm = rng.permutation(total + 3).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([int(n) - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, npages)], np.int32)
    pt = PageTable(indptr, perm[:total], last, page_size)
    shape = (total + 3, page_size, hkv, d) if layout == "NHD" else (total + 3, hkv, page_size, d)
    npd = _dtypes.to_numpy(dtype)
    return rng.standard_normal(shape).astype(npd), rng.standard_normal(shape).astype(npd), pt


def _poison_tails(kc, vc, pt, layout):
    """NaN in every slot no request's KV covers: last-page tails and pages outside the table."""
    used = np.zeros(kc.shape[0], bool)
    used[pt.indices] = True
    for c in (kc, vc):
        c[~used] = np.nan
        for i in range(pt.batch_size):
            pages = pt.pages(i)
            if pages.size:
                tail = slice(int(pt.last_page_len[i]), None)
                if layout == "NHD":
                    c[pages[-1], tail] = np.nan
                else:
                    c[pages[-1], :, tail] = np.nan


def _request_kv(kc, vc, pt, i, layout):
    pages = pt.pages(i)
    n = int(pt.kv_lens[i])
    k, v = kc[pages], vc[pages]
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return k.reshape(-1, *k.shape[2:])[:n], v.reshape(-1, *v.shape[2:])[:n]


def _quantise(rng, kc, vc, kv_dtype, head_axis):
    """fp8 caches holding (kc, vc) / per-head scales: (k8, v8, k_scale, v_scale [Hkv] float32, and the dequantised
    float64 caches the reference reads)."""
    hkv = kc.shape[head_axis]
    ks, vs = rng.uniform(0.005, 0.02, (2, hkv)).astype(np.float32)
    b = [1] * kc.ndim
    b[head_axis] = hkv
    lim = 440.0 if kv_dtype == "float8_e4m3fn" else 57000.0
    npk = _dtypes.to_numpy(kv_dtype)
    k8 = np.clip(kc.astype(np.float64) / ks.reshape(b), -lim, lim).astype(npk)
    v8 = np.clip(vc.astype(np.float64) / vs.reshape(b), -lim, lim).astype(npk)
    return k8, v8, ks, vs, k8.astype(np.float64) * ks.reshape(b), v8.astype(np.float64) * vs.reshape(b)


def _device_cache(rng, k, v, kv_dtype, head_axis):
    """(device k, v; run()'s scale arguments; the host k, v the reference reads): the cache as is, or quantised."""
    if not kv_dtype:
        return (kvattn.from_numpy(k), kvattn.from_numpy(v)), {}, k, v
    k8, v8, ks, vs, kd, vd = _quantise(rng, k, v, kv_dtype, head_axis)
    return (kvattn.from_numpy(k8), kvattn.from_numpy(v8)), dict(k_scale=ks, v_scale=vs), kd, vd


def run_case(rng, *, dtype, d, hkv, group, qo_lens, kv_lens, paged, layout="NHD", page_size=16, causal=False,
             window_left=-1, cap=0.0, custom=False, sm_scale=None, check_requests=None, cta_rows=None,
             backend="auto", kv_dtype=None, poison_tails=False, num_sms=None, fp8_expand=None, fused_merge=False,
             runs=1):
    """num_sms: the SM count the wrappers schedule for (the persistent sm90 grid's size). kv_dtype: an fp8 cache (the random cache quantised with per-head scales; the reference reads it
    dequantised). poison_tails (paged, 16-bit): the slots past each request's KV on its last page and the
    unused pages hold NaN (a kernel that let them into a result would show it). fused_merge: the wrappers'.
    runs: run() that many times on the one plan, fresh queries each time."""
    hq = hkv * group
    npd = _dtypes.to_numpy(dtype)
    qo_lens, kv_lens = np.asarray(qo_lens), np.asarray(kv_lens)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(npd)
    masks = [rng.random((int(a), int(b))) < 0.7 for a, b in zip(qo_lens, kv_lens)] if custom else None
    flat = np.concatenate([m.ravel() for m in masks]) if custom else None
    if paged:
        kc, vc, pt = _kv_pages(rng, kv_lens, page_size, hkv, d, dtype, layout)
        if poison_tails:
            _poison_tails(kc, vc, pt, layout)
        w = BatchPrefillWithPagedKVCache(kv_layout=layout, backend=backend, num_sms=num_sms)
        w.fp8_expand = fp8_expand or w.fp8_expand
        w.fused_merge = fused_merge
        w.plan(qo_indptr, pt, hq, hkv, d, causal=causal, custom_mask=flat, sm_scale=sm_scale,
               window_left=window_left, logits_soft_cap=cap, q_dtype=dtype, cta_rows=cta_rows, kv_dtype=kv_dtype)
        args, scales, kc, vc = _device_cache(rng, kc, vc, kv_dtype, 2 if layout == "NHD" else 1)
        fetch = lambda i: _request_kv(kc, vc, pt, i, layout)  # noqa: E731
    else:
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        n = int(kv_indptr[-1])
        shape = (n, hkv, d) if layout == "NHD" else (hkv, n, d)
        k, v = rng.standard_normal(shape).astype(npd), rng.standard_normal(shape).astype(npd)
        w = BatchPrefillWithRaggedKVCache(kv_layout=layout, backend=backend, num_sms=num_sms)
        w.fp8_expand = fp8_expand or w.fp8_expand
        w.fused_merge = fused_merge
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal, custom_mask=flat, sm_scale=sm_scale,
               window_left=window_left, logits_soft_cap=cap, q_dtype=dtype, cta_rows=cta_rows, kv_dtype=kv_dtype)
        args, scales, k, v = _device_cache(rng, k, v, kv_dtype, 1 if layout == "NHD" else 0)

        def fetch(i):
            s = slice(kv_indptr[i], kv_indptr[i + 1])
            return (k[s], v[s]) if layout == "NHD" else (k[:, s].transpose(1, 0, 2), v[:, s].transpose(1, 0, 2))
    if backend != "auto":
        assert w.last_plan.info["backend"] == backend
    total = int(qo_indptr[-1])
    for r in range(runs):
        if r:
            q = rng.standard_normal(q.shape).astype(npd)
        out = poisoned((total, hq, d), dtype)
        lse = poisoned((total, hq), "float32")
        w.run(kvattn.from_numpy(q), *args, out=out, lse=lse, **scales)
        o_h, l_h = out.numpy().astype(np.float64), lse.numpy()
        assert not np.isnan(o_h).any(), "output has unwritten (NaN) elements"
        assert not np.isnan(l_h).any(), "lse has unwritten (NaN) elements"
        reqs = range(len(qo_lens)) if check_requests is None else check_requests
        for i in reqs:
            if qo_lens[i] == 0:
                continue
            kk, vv = fetch(i)
            rows = sample_rows(int(qo_lens[i]), SAMPLE_ROWS, rng)
            qi = q[qo_indptr[i]:qo_indptr[i + 1]]
            ro, rl = request_ref(qi, kk, vv, rows, causal, window_left, cap,
                                 sm_scale if sm_scale is not None else 1 / np.sqrt(d), masks[i] if custom else None)
            got = o_h[qo_indptr[i] + rows]
            err = rel_l2(got, ro)
            assert err <= TOL[dtype], f"run {r}, request {i} (qo {qo_lens[i]}, kv {kv_lens[i]}): rel L2 {err:.2e}"
            assert_lse(l_h[qo_indptr[i] + rows], rl, TOL[dtype])
    return w


@st.composite
def cases(draw):
    causal = draw(st.booleans())
    b = draw(st.integers(1, 3))
    qo = [draw(st.one_of(st.integers(1, 8), st.integers(0, 1024))) for _ in range(b)]
    if causal:
        kv = [q + draw(st.integers(0, 3072)) for q in qo]
    else:
        kv = [draw(st.one_of(st.integers(0, 64), st.integers(0, 4096))) for _ in range(b)]
    return dict(
        dtype=draw(st.sampled_from(["bfloat16", "float16"])), d=draw(st.sampled_from([64, 128, 256])),
        hkv=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 4, 5, 8])), qo_lens=qo, kv_lens=kv,
        layout=draw(st.sampled_from(["NHD", "HND"])), page_size=draw(st.sampled_from([1, 5, 16, 64])),
        causal=causal, window_left=draw(st.sampled_from([-1, -1, -1, 0, 37, 300])),
        cap=draw(st.sampled_from([0.0, 0.0, 0.0, 30.0])), custom=draw(st.sampled_from([False, False, False, True])),
        backend=draw(st.sampled_from(["auto", "auto", "sm80"])))


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(c=cases(), seed=st.integers(0, 2**31 - 1))
def test_paged_matches_reference(c, seed):
    run_case(np.random.default_rng(seed), paged=True, **c)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(c=cases(), seed=st.integers(0, 2**31 - 1))
def test_ragged_matches_reference(c, seed):
    c.pop("page_size")
    run_case(np.random.default_rng(seed), paged=False, **c)


@pytest.mark.parametrize("cta_rows,backend", [(16, "sm80"), (64, "sm80"), (128, "sm80"), (128, "sm90")])
@pytest.mark.parametrize("group", [1, 5, 8])
def test_every_query_tile(cta_rows, backend, group):
    run_case(np.random.default_rng(cta_rows * 10 + group), dtype="bfloat16", d=128, hkv=2, group=group,
             qo_lens=[1, 70, 4, 300], kv_lens=[1000, 70, 900, 2000], paged=True, causal=True, cta_rows=cta_rows,
             backend=backend)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("variant", ["causal", "plain", "window", "cap", "custom", "all"])
def test_sm90_mainloop(d, dtype, variant):
    """The wgmma kernel (forced, including the instance that auto-selection skips for its spills) on tiles
    that straddle the mask boundaries, several KV tiles, padding rows, an empty KV and a split KV."""
    kw = dict(causal=variant in ("causal", "all"), window_left=77 if variant in ("window", "all") else -1,
              cap=20.0 if variant in ("cap", "all") else 0.0, custom=variant in ("custom", "all"))
    if kw["causal"]:
        qo, kv = [130, 33, 1, 200], [130, 700, 1, 4500]
    else:
        qo, kv = [130, 33, 1, 200], [300, 0, 129, 4500]
    for paged in (True, False):
        run_case(np.random.default_rng(hash((d, dtype, variant, paged)) % 2**32), dtype=dtype, d=d, hkv=2, group=4,
                 qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=128, backend="sm90", **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_sm90_interleaved_tiles_with_variants(d, layout):
    """The interleaved K / V tiles (KVATTN_SM90_KVIL, paged caches' default) under every mask and the soft cap,
    page 16, persistent and one-unit CTAs, TMA and copied tiles against the reference."""
    for variant in ("causal", "plain", "all"):
        kw = dict(causal=variant != "plain", window_left=77 if variant == "all" else -1,
                  cap=20.0 if variant == "all" else 0.0, custom=variant == "all")
        qo, kv = ([130, 33, 1, 200], [130, 700, 1, 4500]) if kw["causal"] else ([130, 33, 1, 200], [300, 0, 129, 4500])
        for num_sms in (None, 3):
            w = run_case(np.random.default_rng(hash((d, layout, variant, num_sms)) % 2**32), dtype="bfloat16", d=d,
                         hkv=2, group=4, qo_lens=qo, kv_lens=kv, paged=True, layout=layout, cta_rows=128,
                         backend="sm90", num_sms=num_sms, **kw)
            assert prefill.sm90_interleaved(w.last_plan.info["kernel"].spec) and w.last_plan.info["tma"]


@pytest.mark.parametrize("num_sms", [1, 3, 7])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_persistent_ctas_walk_many_units(num_sms, d, causal):
    """Persistent CTAs: a grid of num_sms CTAs, each walking many (item, KV head) units through one ring of stages
    (units of 1 to 40 tiles, units without any, TMA and copied tiles, split KV, padding rows), paged and ragged,
    every request against the reference."""
    if causal:
        qo, kv = [130, 33, 1, 200, 64, 5], [130, 700, 1, 4500, 64, 5000]
    else:
        qo, kv = [130, 33, 1, 200, 64, 5], [300, 0, 129, 4500, 0, 5000]
    for paged in (True, False):
        w = run_case(np.random.default_rng(hash((num_sms, d, causal, paged)) % 2**32), dtype="bfloat16", d=d,
                     hkv=2, group=4, qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=128, backend="sm90",
                     causal=causal, num_sms=num_sms)
        units = w.last_plan.info["schedule"].num_items * 2
        assert w.last_plan.info["grid"] == (min(units, num_sms), 1, 1) and units > 4 * num_sms


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_kv_split_ring_with_o_by_tma(d, causal, monkeypatch):
    """The A/B build with K and V of each of the 3 stages on their own barriers (KVATTN_SM90_KVSPLIT=1): whole units
    store O by tensor map from the K half of their last stage, so that stage's K is released only once the store
    has read it. 3 persistent CTAs walk many units (the ring reuses every stage, short units of 1 tile among long
    ones, units of fewer than 128 rows, split KV), paged and ragged, run 3 times on one plan, against the
    reference (a wrong release hangs or reads a reloaded K half)."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_KVSPLIT", 1),))
    qo, kv = ([256, 32, 1, 200, 96, 5], [256, 700, 1, 1500, 96, 2000]) if causal else \
        ([256, 32, 1, 200, 96, 5], [300, 100, 129, 1500, 0, 2000])
    for paged in (True, False):
        w = run_case(np.random.default_rng(hash((d, causal, paged)) % 2**32), dtype="bfloat16", d=d, hkv=2, group=4,
                     qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=128, backend="sm90", causal=causal, num_sms=3,
                     runs=3)
        info = w.last_plan.info
        assert "KVATTN_SM90_KVSPLIT" in info["kernel"].spec.uri() and info["tma_o"]


@pytest.mark.parametrize("n", [144, 160])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_kv_tiles_over_128_tokens(n, causal, monkeypatch):
    """The A/B builds of KV tiles over 128 tokens (KVATTN_SM90_N 144 / 160, 2 stages; scripts/ab_sm90.py --tilen):
    producer lanes hold two rows' offsets for the copied tiles, TMA boxes of 144 / 160 rows (ragged) or 9 / 10
    pages (paged, page 16). KV lengths around the tile boundaries, a request shorter than a tile, split KV, paged
    and ragged, a CTA a unit (the A/B's builds) and 3 persistent CTAs, run twice on one plan, against the
    reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_N", n), ("KVATTN_SM90_STAGES", 2)))
    qo, kv = ([n, 33, 1, 200, n - 16, 5], [n, 700, 1, 1500, n + 16, 2000]) if causal else \
        ([n, 33, 1, 200, 96, 5], [2 * n, 100, n + 1, 1500, 0, 2000])
    for persist in (False, True):   # (the persistent build spills 8 / 80 bytes: correct, not timed)
        monkeypatch.setattr(prefill, "SM90_PERSISTENT", persist)
        for paged in (True, False):
            w = run_case(np.random.default_rng(hash((n, causal, paged, persist)) % 2**32), dtype="bfloat16", d=128,
                         hkv=2, group=4, qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=128, backend="sm90",
                         causal=causal, num_sms=3, runs=2)
            info = w.last_plan.info
            assert f"KVATTN_SM90_N={n}" in info["kernel"].spec.uri() and info["tma"]


@pytest.mark.parametrize("n", [160, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_head_dim_64_kv_tiles_over_128_tokens(n, causal, monkeypatch):
    """Head dim 64's A/B builds of longer KV tiles in 3 stages (KVATTN_SM90_N 160 / 192, scripts/ab_sm90.py
    --tilen64; the ragged builds without spills, the paged ones with 4-8 bytes: correct, not timed): producer lanes holding two rows' offsets, TMA boxes of 160 / 192 rows
    (ragged) or 10 / 12 pages (paged, page 16), moved last boxes, a request shorter than a tile, split KV; a CTA a
    unit and 3 persistent CTAs, run twice on one plan, against the reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_N", n), ("KVATTN_SM90_STAGES", 3)))
    qo, kv = ([n, 33, 1, 200, n - 16, 5], [n, 700, 1, 1500, n + 16, 2000]) if causal else \
        ([n, 33, 1, 200, 96, 5], [2 * n, 100, n + 1, 1500, 0, 2000])
    for persist in (False, True):
        monkeypatch.setattr(prefill, "SM90_PERSISTENT", persist)
        for paged in (True, False):
            w = run_case(np.random.default_rng(hash((64, n, causal, paged, persist)) % 2**32), dtype="bfloat16",
                         d=64, hkv=2, group=4, qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=128, backend="sm90",
                         causal=causal, num_sms=3, runs=2)
            info = w.last_plan.info
            assert f"KVATTN_SM90_N={n}" in info["kernel"].spec.uri() and info["tma"]


@pytest.mark.parametrize("layout,dtype", [("NHD", "bfloat16"), ("HND", "float16")])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_head_dim_64_long_tiles_by_default(layout, dtype, causal, monkeypatch):
    """Head dim 64's defaults (run 55a): on contiguous ragged K / V where prefill.sm90_long_tiles takes them, KV tiles
    of 192 tokens, with 2 of 8 exp2s from the polynomial on unmasked tiles. Long requests beside a request shorter
    than a tile, one of one token and KV lengths off the tile, on 3 persistent CTAs, on 132 (tail split, the merge
    fused and not) and a CTA a unit, against the reference; a batch of short requests keeps 128-token tiles."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    qo, kv = ([1500, 33, 1, 400], [3000, 700, 1, 2000]) if causal else ([700, 33, 1, 200], [4000, 100, 129, 2300])
    assert prefill.sm90_long_tiles(64, Variant(), dtype, True, qo, kv, causal, 4)
    for num_sms, persist, fused in ((3, True, False), (132, True, False), (132, True, True), (3, False, False)):
        monkeypatch.setattr(prefill, "SM90_PERSISTENT", persist)
        w = run_case(np.random.default_rng(hash((layout, causal, num_sms, persist, fused)) % 2**32), dtype=dtype,
                     d=64, hkv=2, group=4, qo_lens=qo, kv_lens=kv, paged=False, layout=layout, cta_rows=128,
                     causal=causal, num_sms=num_sms, fused_merge=fused, runs=2)
        info = w.last_plan.info
        assert info["backend"] == "sm90" and info["tma"]
        assert "KVATTN_SM90_N=192" in info["kernel"].spec.uri()
    short = ([64] * 6, [640] * 6)
    assert not prefill.sm90_long_tiles(64, Variant(), dtype, True, *short, causal, 4)
    w = run_case(np.random.default_rng(7), dtype=dtype, d=64, hkv=2, group=4, qo_lens=short[0], kv_lens=short[1],
                 paged=False, layout=layout, cta_rows=128, causal=causal)
    assert "KVATTN_SM90_N" not in w.last_plan.info["kernel"].spec.uri()


@pytest.mark.parametrize("obuf", [1, 0])
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_three_consumer_warpgroups_build(obuf, group, causal, monkeypatch):
    """The experiment build of three consumer warpgroups a CTA (KVATTN_SM90_WG3, scripts/ab_sm90.py --wg3: 192-row
    units, their turns in a ring of three; whole units' O by TMA from its own buffer, or per thread): head dim 64, O
    and the LSE against the reference, persistent CTAs (3 SMs: the turns' stream and the O buffer's reuse run on over
    many units; 132: the tail split) and a CTA a unit, ragged (Q by TMA) and paged, units of 192 rows, short ones, a
    one-token request, KV lengths off the tile."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_WG3", 1), ("KVATTN_SM90_OBUF", obuf)))
    assert prefill.sm90_rows() == 192
    qo, kv = ([500, 33, 1, 200, 48], [900, 700, 1, 1500, 2000]) if causal else ([500, 33, 1, 200, 48], [300, 100, 129, 1500, 2000])
    for num_sms, persist, paged in ((3, True, False), (132, True, False), (3, False, True), (3, True, True)):
        monkeypatch.setattr(prefill, "SM90_PERSISTENT", persist)
        w = run_case(np.random.default_rng(hash((group, causal, num_sms, persist, paged)) % 2**32), dtype="bfloat16",
                     d=64, hkv=2, group=group, qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=192, backend="sm90",
                     causal=causal, num_sms=num_sms, runs=2)
        info = w.last_plan.info
        assert info["backend"] == "sm90" and info["threads"] == 512 and "KVATTN_SM90_WG3=1" in info["kernel"].spec.uri()
        assert info["tma_q"] and info["tma_o"]   # (192 rows: whole boxes of 48 or 24 tokens; O: of 64 rows)


@pytest.mark.parametrize("defs", [(("KVATTN_SM90_QBUF", 2),), (("KVATTN_SM90_STAGES", 4),),
                                  (("KVATTN_SM90_QBUF", 2), ("KVATTN_SM90_STAGES", 4))], ids=["2q", "4st", "2q4st"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_head_dim_64_ring_builds(defs, causal, monkeypatch):
    """The experiment builds of scripts/ab_sm90.py --ring64 at head dim 64: two Q tiles (KVATTN_SM90_QBUF=2, the next
    unit's Q loaded while the unit before it runs), 4 stages, both. Persistent CTAs (3: many units each, the Q slots
    alternating and the ring running on across units; a unit without tiles between, non-causal), on 192-token tiles
    where the defaults' rule takes them and on 128 (a batch of short requests, a paged cache), O and the LSE against
    the reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", defs)
    monkeypatch.setattr(prefill, "SM90_PERSISTENT", True)
    long = ([1500, 33, 1, 400], [3000, 700, 1, 2000]) if causal else ([700, 33, 1, 200], [4000, 100, 129, 2300])
    short = ([64, 1, 64, 30, 64, 64], [640, 1, 700, 30, 100, 640]) if causal else ([64, 1, 64, 30, 64, 64],
                                                                                   [640, 0, 700, 129, 100, 640])
    for (qo, kv), paged, tile in ((long, False, 192), (short, False, 128), (short, True, 128)):
        w = run_case(np.random.default_rng(hash((defs, causal, paged, tile)) % 2**32), dtype="bfloat16", d=64, hkv=2,
                     group=4, qo_lens=qo, kv_lens=kv, paged=paged, cta_rows=128, backend="sm90", causal=causal,
                     num_sms=3, runs=2)
        uri = w.last_plan.info["kernel"].spec.uri()
        assert all(f"{k}={v}" in uri for k, v in defs) and ("KVATTN_SM90_N=192" in uri) == (tile == 192)


@pytest.mark.parametrize("lazy", [8, 0])
@pytest.mark.parametrize("dtype,sm_scale", [("bfloat16", None), ("bfloat16", 2.0), ("float16", 2.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_running_max_kept_or_moved(lazy, dtype, sm_scale, causal, monkeypatch):
    """A row's running max kept until a tile's max exceeds it by more than 8 log2 units (the default,
    KVATTN_SM90_LAZY_MAX=8: probabilities up to 2^8 in P, fp16 and bf16, the O rescale skipped) and moved at every
    tile (0, the A/B build). sm_scale 2.0 spreads the scores (~30 log2 units a standard deviation) so rows move their
    max mid-sequence by more than 8; at the default scale they mostly keep it after the first tile. O and the LSE
    against the reference, persistent CTAs and a CTA a unit, paged and ragged, masked (causal) and unmasked tiles,
    1-tile units."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    defs = (("KVATTN_SM90_LAZY_MAX", 0),) if lazy == 0 else ()
    monkeypatch.setattr(prefill, "SM90_TUNING", defs)
    qo, kv = ([256, 33, 1, 200, 5], [256, 700, 1, 1500, 2000]) if causal else ([256, 33, 1, 200, 5], [300, 100, 129, 1500, 2000])
    for w in _sm90_walks(monkeypatch, (lazy, dtype, sm_scale, causal), qo, kv, dtype=dtype, causal=causal,
                         sm_scale=sm_scale):
        assert ("KVATTN_SM90_LAZY_MAX=0" in w.last_plan.info["kernel"].spec.uri()) == (lazy == 0)


def _sm90_walks(monkeypatch, key, qo, kv, **case):
    """run_case on the sm90 kernel (head_dim 128, Hkv 2, group 4 unless given, 3 SMs, two runs a plan) with persistent
    CTAs and a CTA a unit, on a ragged and a paged cache: yields each wrapper (its data seeded from key)."""
    case = dict(dict(d=128, hkv=2, group=4), **case)
    for persist in (False, True):
        monkeypatch.setattr(prefill, "SM90_PERSISTENT", persist)
        for paged in (False, True):
            yield run_case(np.random.default_rng(hash((key, persist, paged)) % 2**32), qo_lens=qo, kv_lens=kv,
                           paged=paged, cta_rows=128, backend="sm90", num_sms=3, runs=2, **case)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype,sm_scale", [("bfloat16", None), ("float16", 2.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_exp2_poly_build(d, dtype, sm_scale, causal, monkeypatch):
    """The build whose unmasked tiles take 3/8 of their exp2s from common.cuh's polynomial (KVATTN_SM90_EXP2_POLY=3,
    scripts/ab_sm90.py --exp2poly): O and the LSE against the reference, persistent CTAs on a ragged cache and a CTA
    a unit on a paged one. sm_scale 2.0 spreads the scores (~30 log2 units a standard deviation): exponents far
    below the polynomial's clamp (-125) and, with the lazy running max, up to +8."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_EXP2_POLY", 3),))
    qo, kv = ([256, 33, 1, 200, 5], [256, 700, 1, 1500, 2000]) if causal else ([256, 33, 1, 200, 5], [300, 100, 129, 1500, 2000])
    for persist, paged in ((True, False), (False, True)):
        monkeypatch.setattr(prefill, "SM90_PERSISTENT", persist)
        w = run_case(np.random.default_rng(hash((d, dtype, causal, paged)) % 2**32), qo_lens=qo, kv_lens=kv,
                     paged=paged, cta_rows=128, backend="sm90", num_sms=3, runs=2, d=d, hkv=2, group=4, dtype=dtype,
                     causal=causal, sm_scale=sm_scale)
        assert "KVATTN_SM90_EXP2_POLY=3" in w.last_plan.info["kernel"].spec.uri()


BOUNDARY_OFF = (("KVATTN_SM90_BOUNDS", 0), ("KVATTN_SM90_STSM", 0))


@pytest.mark.parametrize("defs", [(), BOUNDARY_OFF])
@pytest.mark.parametrize("dtype,sm_scale", [("bfloat16", None), ("float16", None), ("bfloat16", -0.05)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_boundary_builds(defs, dtype, sm_scale, causal, monkeypatch):
    """The default unit boundary (masked tiles by column bounds, O rows staged by stmatrix) and the build without
    either (scripts/ab_sm90.py --boundary): causal diagonals with queries shorter than their KV, moved last boxes (KV
    not a multiple of 128), a KV shorter than a tile (copied, masked past its end), one-token requests, whole units
    (O by TMA) and partial ones; a negative score scale (the default: the bounds path on every tile; the build
    before: the general masked path). O and the LSE against the reference, persistent CTAs and a CTA a unit, paged
    and ragged."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", defs)
    qo, kv = [256, 33, 1, 200, 96, 64], [256, 700, 1, 1500, 100, 2048]
    for w in _sm90_walks(monkeypatch, (defs, dtype, sm_scale, causal), qo, kv, dtype=dtype, causal=causal,
                         sm_scale=sm_scale):
        assert all(f"{k}={v}" in w.last_plan.info["kernel"].spec.uri() for k, v in defs)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_group_divide_build(group, causal, monkeypatch):
    """The build whose packed rows find their query tokens by dividing by the group size (KVATTN_GROUP_MAGIC=0,
    scripts/ab_sm90.py --groupdiv) instead of the default multiplier and shift: groups 1, 3 (no power of two), 4 and
    8, whole and partial units, causal and not, against the reference (O and LSE)."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_GROUP_MAGIC", 0),))
    qo, kv = [256, 33, 1, 200, 96], [256, 700, 1, 1500, 100]
    for w in _sm90_walks(monkeypatch, (group, causal), qo, kv, dtype="bfloat16", causal=causal, group=group):
        assert "KVATTN_GROUP_MAGIC=0" in w.last_plan.info["kernel"].spec.uri()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_narrow_last_pv_build(group, causal, monkeypatch):
    """The build whose units' last P V runs over one 64-token half where the other half's columns are all masked
    (KVATTN_SM90_NARROW=1, scripts/ab_sm90.py --narrow): causal units of 128 / 32 / 16 query tokens (groups 1, 4,
    8: their last tiles end at multiples of 128 / 32 / 16 columns), KV not a multiple of 128 (ragged: a moved last
    box, kept columns in its second half for 700 and 2048 + 60; paged: the first half), one-token and one-tile
    requests; O and LSE against the reference, persistent CTAs and a CTA a unit, ragged and paged."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_NARROW", 1),))
    qo, kv = [256, 33, 1, 200, 96, 64, 300], [256, 700, 1, 1500, 100, 2048 + 60, 300]
    for w in _sm90_walks(monkeypatch, ("narrow", group, causal), qo, kv, dtype="bfloat16", causal=causal,
                         group=group):
        assert "KVATTN_SM90_NARROW=1" in w.last_plan.info["kernel"].spec.uri()


def test_block_sparse_narrow_last_pv_build(monkeypatch):
    """Block-sparse (64, 64) rows of odd and even block counts on the KVATTN_SM90_NARROW=1 build (a row's last tile
    holds one 64-column block: its P V over that half), against the float64 reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    from kvattn.formats import BlockSparse
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_NARROW", 1),))
    rng = np.random.default_rng(7)
    mb, nb = 8, 16
    counts = [1, 2, 3, 5, 8, 13, 16, 0]
    cols = np.concatenate([np.sort(rng.choice(nb, n, replace=False)) for n in counts]).astype(np.int32)
    bsr = BlockSparse(np.concatenate([[0], np.cumsum(counts)]), cols, (64, 64), (mb * 64, nb * 64))
    bf = _dtypes.to_numpy("bfloat16")
    q = rng.standard_normal((mb * 64, 32, 128)).astype(bf)
    k = rng.standard_normal((nb * 64, 8, 128)).astype(bf)
    v = rng.standard_normal((nb * 64, 8, 128)).astype(bf)
    w = kvattn.BlockSparseAttentionWrapper()
    w.plan(bsr, 32, 8, 128)
    assert w.last_plan.info["backend"] == "sm90"
    assert "KVATTN_SM90_NARROW=1" in w.last_plan.info["kernel"].spec.uri()
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v), out=out, lse=lse)
    ro, rl = reference.block_sparse_attention(q, k, v, bsr, return_lse=True)
    assert rel_l2(out.numpy(), ro) <= 1e-2
    assert_lse(lse.numpy(), rl, 1e-2)


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_qhalf_builds(mode, group, causal, monkeypatch):
    """Each consumer warpgroup's Q rows on their own barriers (KVATTN_SM90_QHALF, scripts/ab_sm90.py --qhalf; 1: both
    halves before tile 0, 2: half 1 after it): 64-row q boxes (groups 1, 4, 8), per-thread Q copies where 64 rows
    are no whole tokens (group 3, items starting inside a token), one-tile and many-tile units back to back on 3
    persistent CTAs, whole and partial units; O and LSE against the reference, persistent and a CTA a unit, paged
    and ragged, two runs a plan."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    defs = (("KVATTN_SM90_QHALF", mode),)
    monkeypatch.setattr(prefill, "SM90_TUNING", defs)
    qo, kv = [256, 33, 1, 200, 96, 64], [256, 700, 1, 1500, 100, 2048]
    for w in _sm90_walks(monkeypatch, (mode, group, causal), qo, kv, dtype="bfloat16", causal=causal, group=group):
        assert f"KVATTN_SM90_QHALF={mode}" in w.last_plan.info["kernel"].spec.uri()
        assert w.last_plan.info["tma_q"] == (group != 3)


QHALF_BACK_TO_BACK = """
import sys
sys.path.insert(0, "tests")
import numpy as np
import test_prefill_gpu as t
from kvattn import prefill
prefill.SM90_TUNING = (("KVATTN_SM90_QHALF", int(sys.argv[1])),)
for i in range(int(sys.argv[2])):   # 96 one-tile units a KV head, back to back on 2 persistent CTAs
    t.run_case(np.random.default_rng(i), qo_lens=[32] * 48, kv_lens=[32] * 48, paged=False, d=128, hkv=2, group=4,
               dtype="bfloat16", causal=True, cta_rows=128, backend="sm90", num_sms=2, runs=4)
"""


@pytest.mark.parametrize("mode", [1, 2])
def test_sm90_qhalf_one_tile_units_back_to_back(mode):
    """QHALF builds on walks of one-tile units back to back, where consumer 0 can finish the next unit's only Q K^T
    before consumer 1 stores this unit's O: the store's wait on consumer 0's qfree would then look for a phase two
    behind and never return (run 49c hung on causal b8_S2048 with =1). A child process under a timeout, so a hang
    fails this test instead of the suite (100 s, far above what 48 small runs take); its runs check O and LSE
    against the reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-c", QHALF_BACK_TO_BACK, str(mode), "12"], capture_output=True, text=True,
                           timeout=100)
    except subprocess.TimeoutExpired:
        pytest.fail(f"KVATTN_SM90_QHALF={mode}: one-tile units back to back hung (no result in 100 s)")
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("qo,kv,causal,sms", [([163], [427], True, 5), ([129], [894], False, 3),
                                              ([69, 41], [730, 839], False, 3), ([5, 13, 34], [1895, 2764, 2327], False, 3),
                                              ([90, 44], [1222, 412], True, 3)])
def test_sm90_tail_split(qo, kv, causal, sms, monkeypatch):
    """The persistent walk's tail split (prefill.SM90_TAIL_SPLIT, scripts/ab_sm90.py --tail): plans that nothing
    else splits, whose last round the scheduler fills by cutting the walk's last blocks into 2-3 chunks (found on
    the CPU: each of these plans splits with the switch on and not without), merged by the merge kernel; ragged and
    paged, two runs a plan, O and LSE against the reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    monkeypatch.setattr(prefill, "SM90_TAIL_SPLIT", True)
    for paged in (False, True):
        w = run_case(np.random.default_rng(hash((tuple(qo), paged)) % 2**32), qo_lens=qo, kv_lens=kv, paged=paged,
                     d=128, hkv=2, group=4, dtype="bfloat16", causal=causal, cta_rows=128, backend="sm90",
                     num_sms=sms, runs=2)
        assert w.last_plan.info["schedule"].split, "the tail split did not cut this plan"


@pytest.mark.parametrize("qo,kv,causal", [([73, 91, 183], [1082, 1196, 766], True),
                                          ([104, 257, 64], [508, 311, 1016], False),
                                          ([1, 12, 151, 101, 131], [1118, 255, 784, 490, 484], True)])
def test_sm90_walk_balance(qo, kv, causal, monkeypatch):
    """The walk balance (scheduler.WALK_BALANCE, scripts/ab_sm90.py --balance): mixed-length batches whose items
    the scheduler places off the snake's order on 5 persistent CTAs (found on the CPU; checked here against the
    plan with the switch off), ragged and paged, two runs a plan, O and LSE against the reference."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    from kvattn import scheduler
    plans = []
    original = scheduler.plan_prefill

    def spy(*args, **kw):
        plans.append((args, kw, original(*args, **kw)))
        return plans[-1][2]
    monkeypatch.setattr(scheduler, "plan_prefill", spy)
    monkeypatch.setattr(scheduler, "WALK_BALANCE", True)
    for paged in (False, True):
        run_case(np.random.default_rng(hash((tuple(qo), paged)) % 2**32), qo_lens=qo, kv_lens=kv, paged=paged,
                 d=128, hkv=2, group=4, dtype="bfloat16", causal=causal, cta_rows=128, backend="sm90", num_sms=5,
                 runs=2)
        args, kw, placed = plans[-1]
        monkeypatch.setattr(scheduler, "WALK_BALANCE", False)
        snake = original(*args, **kw)
        monkeypatch.setattr(scheduler, "WALK_BALANCE", True)
        assert kw["persistent_ctas"] == 5 and not np.array_equal(snake.items, placed.items), \
            "the balance did not move this plan's items"


@pytest.mark.parametrize("group", [None, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_persistent_ctas_walk_kv_head_groups(group, causal, monkeypatch):
    """KV head groups (the plan header's kv_head_group): with the L2 window shrunk below the longest request's K/V
    (1300 tokens x 4 heads x 512 bytes: 2.6 MiB), the scheduler's one head at a time (None), or groups of 2 (the
    kernel takes any divisor of Hkv), the persistent CTAs walk the units group by group (3 CTAs), or as one group
    where a group's units would not fill a round (132 CTAs: the kernel's fallback); every (item, head) unit is
    still computed once: every request of a paged and a ragged batch against the reference."""
    from kvattn import scheduler
    monkeypatch.setattr(scheduler, "PREFILL_L2_WINDOW_BYTES", 1 << 20)
    if group is not None:
        monkeypatch.setattr(scheduler, "kv_head_group", lambda kv, hkv, bpt: group)
    qo, kv = ([130, 33, 1, 200, 64, 5], [130, 700, 1, 1300, 64, 900]) if causal else \
        ([130, 33, 1, 200, 64, 5], [300, 0, 129, 1300, 0, 900])
    for paged in (True, False):
        for num_sms in (3, 132):
            w = run_case(np.random.default_rng(hash((group, causal, paged, num_sms)) % 2**32),
                         dtype="bfloat16", d=128, hkv=4, group=2, qo_lens=qo, kv_lens=kv, paged=paged,
                         cta_rows=128, backend="sm90", causal=causal, num_sms=num_sms)
            assert w.last_plan.info["schedule"].kv_head_group == (group or 1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [8, 16, 64, 256])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kvil", [False, True])
def test_sm90_tma_tiles_read_only_the_requests_kv(layout, page_size, d, kvil, monkeypatch):
    """Full KV tiles come as TMA boxes (one per page or per tile), the last partial tile through zero-filling
    copies: NaN in the last pages' tails and in unused pages never reaches a result. Causal and not, KV
    lengths around the tile and page boundaries, a split KV. kvil: the interleaved K / V tiles (one 5-dim box a
    page across the head dim: the default of paged caches), else the 64-column blocks (the A/B build)."""
    monkeypatch.setattr(prefill, "SM90_TUNING", () if kvil else (("KVATTN_SM90_KVIL", 0),))
    for causal in (True, False):
        qo, kv = ([130, 1, 64, 300], [130, 257, 128 + page_size, 5000]) if causal else ([130, 1, 64, 33],
                                                                                         [129, 256, 1, 4099])
        w = run_case(np.random.default_rng(page_size + d + causal), dtype="bfloat16", d=d, hkv=2, group=4,
                     qo_lens=qo, kv_lens=kv, paged=True, layout=layout, page_size=page_size, causal=causal,
                     cta_rows=128, backend="sm90", poison_tails=True)
        tile = sm90_tile(d)[0]
        assert w.last_plan.info["tma"] == (tile % page_size == 0 or page_size % tile == 0), (tile, page_size)
        assert prefill.sm90_interleaved(w.last_plan.info["kernel"].spec) == (kvil and w.last_plan.info["tma"])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_tiles_never_read_another_requests_kv(layout):
    """Request 1's K / V are NaN: the other requests' results stay exact, on both backends (sm90: full tiles by
    TMA, and a partial last tile by the box that ends at the item's end, KVATTN_SM90_SHIFT: request 0's 333 and
    request 2's 4097 tokens end mid-tile, request 2 right after the NaN request)."""
    rng = np.random.default_rng(11)
    qo, kv = np.array([200, 40, 77]), np.array([333, 300, 4097])
    hkv, group, d = 2, 4, 128
    qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    ki = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    n = int(ki[-1])
    bf = _dtypes.to_numpy("bfloat16")
    k = rng.standard_normal((n, hkv, d)).astype(bf)
    v = rng.standard_normal((n, hkv, d)).astype(bf)
    k[ki[1]:ki[2]] = np.nan
    v[ki[1]:ki[2]] = np.nan
    q = rng.standard_normal((int(qi[-1]), hkv * group, d)).astype(bf)
    dev = lambda a: kvattn.from_numpy(a if layout == "NHD" else np.ascontiguousarray(a.transpose(1, 0, 2)))  # noqa: E731
    for backend in ("sm80", "sm90"):
        for causal in (True, False):
            w = BatchPrefillWithRaggedKVCache(kv_layout=layout, backend=backend)
            w.plan(qi, ki, hkv * group, hkv, d, causal=causal, cta_rows=128)
            assert w.last_plan.info["tma"] == (backend == "sm90")
            out = w.run(kvattn.from_numpy(q), dev(k), dev(v)).numpy().astype(np.float64)
            for i in (0, 2):
                rows = sample_rows(int(qo[i]), SAMPLE_ROWS, rng)
                ro, _ = request_ref(q[qi[i]:qi[i + 1]], k[ki[i]:ki[i + 1]], v[ki[i]:ki[i + 1]], rows, causal, -1,
                                    0.0, 1 / np.sqrt(d), None)
                assert rel_l2(out[qi[i] + rows], ro) <= TOL["bfloat16"], (backend, causal, i)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_sm90_query_and_output_tiles_by_tensor_maps(group):
    """The sm90 kernel copies each unit's Q tile and stores each whole unit's O by tensor maps (kvattn.tma
    RowsTensorMap): q a slice of a fused qkv buffer and out a slice of a wider poisoned buffer (row strides past
    Hq * D), units of 128 packed rows and shorter ones; every request matches the reference and nothing outside the
    out slice is written. The per-thread copies and stores (the maps switched off) give the same results."""
    rng = np.random.default_rng(12 + group)
    hkv, d = 2, 128
    hq = hkv * group
    qo, kv = np.array([256, 100, 33, 128]), np.array([300, 1000, 50, 128])
    qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    ki = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    n, nk = int(qi[-1]), int(ki[-1])
    bf = _dtypes.to_numpy("bfloat16")
    qkv = rng.standard_normal((n, hq + 2 * hkv, d)).astype(bf)
    k = rng.standard_normal((nk, hkv, d)).astype(bf)
    v = rng.standard_normal((nk, hkv, d)).astype(bf)
    q = qkv[:, :hq]
    kd, vd = kvattn.from_numpy(k), kvattn.from_numpy(v)
    qd = kvattn.from_numpy(qkv)[:, :hq]
    results = {}
    for maps in (True, False):
        saved = tma.QUERY_MAPS, tma.OUTPUT_MAPS
        tma.QUERY_MAPS = tma.OUTPUT_MAPS = maps
        try:
            w = BatchPrefillWithRaggedKVCache(backend="sm90")
            w.plan(qi, ki, hq, hkv, d, causal=True, cta_rows=128)
        finally:
            tma.QUERY_MAPS, tma.OUTPUT_MAPS = saved
        assert (w.last_plan.info["tma_q"], w.last_plan.info["tma_o"]) == (maps, maps)
        wide = poisoned((n, hq + 3, d), "bfloat16")
        w.run(qd, kd, vd, out=wide[:, :hq])
        got = wide.numpy()
        assert np.array_equal(got[:, hq:].view(np.uint16), poisoned((n, 3, d), "bfloat16").numpy().view(np.uint16))
        out = got[:, :hq].astype(np.float64)
        for i in range(len(qo)):
            rows = sample_rows(int(qo[i]), SAMPLE_ROWS, rng)
            ro, _ = request_ref(q[qi[i]:qi[i + 1]], k[ki[i]:ki[i + 1]], v[ki[i]:ki[i + 1]], rows, True, -1, 0.0,
                                1 / np.sqrt(d), None)
            assert rel_l2(out[qi[i] + rows], ro) <= TOL["bfloat16"], (maps, i)
        results[maps] = out
    # the same products in the same order: the two paths differ only in how Q arrives and O leaves
    assert np.array_equal(results[True], results[False])


@pytest.mark.parametrize("paged, layout, d, group, causal, window, cap", [
    (True, "NHD", 128, 32, False, -1, 0.0), (True, "HND", 64, 5, True, -1, 0.0),
    (False, "NHD", 128, 4, True, 300, 0.0), (True, "NHD", 128, 8, False, -1, 30.0)])
def test_sm90_fused_split_merge(paged, layout, d, group, causal, window, cap):
    """Split blocks merged inside the sm90 kernel (the wrappers' fused_merge, PrefillSm90::merge_if_last): blocks
    of 2 to 7 chunks (24 SMs), padding rows (groups of 5, short requests), unsplit and empty requests, sliding
    window and soft cap, against the float64 reference three times on one plan (the arrival counters must be back
    at 0 after each run); no merge launch."""
    if _driver.arch() != "sm_90a":
        pytest.skip("the sm90 kernel needs an sm_90 GPU")
    qo = [1, 1, 0, 1, 1] if group == 32 else [7, 40, 0, 1, 20]
    kv = [4000, 9000, 0, 2, 700] if not causal else [4000, 9000, 0, 3, 700]
    w = run_case(np.random.default_rng(group * 7 + d), dtype="bfloat16", d=d, hkv=2, group=group, qo_lens=qo,
                 kv_lens=kv, paged=paged, layout=layout, causal=causal, window_left=window, cap=cap, num_sms=24,
                 backend="sm90", cta_rows=128, fused_merge=True, runs=3)
    info = w.last_plan.info
    assert info["fused_merge"] and info["schedule"].split and 2 <= info["schedule"].max_chunks <= 8
    assert w.last_plan.merge is None


def test_speculative_verify_shape():
    run_case(np.random.default_rng(1), dtype="bfloat16", d=128, hkv=8, group=4, qo_lens=[4] * 64,
             kv_lens=[4096] * 64, paged=True, causal=True, check_requests=[0, 17, 63])


def test_long_append_splits_kv():
    w = run_case(np.random.default_rng(2), dtype="bfloat16", d=128, hkv=8, group=4, qo_lens=[256],
                 kv_lens=[65536 + 256], paged=False, causal=True)
    assert w.last_plan.info["schedule"].split


def test_long_prefill_and_empty_requests():
    run_case(np.random.default_rng(3), dtype="float16", d=64, hkv=1, group=8, qo_lens=[0, 5000, 3, 0],
             kv_lens=[10, 5000, 0, 0], paged=True, causal=False, check_requests=[1, 2])


def test_single_prefill():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((100, 8, 128)).astype(_dtypes.to_numpy("bfloat16"))
    k = rng.standard_normal((300, 2, 128)).astype(_dtypes.to_numpy("bfloat16"))
    v = rng.standard_normal((300, 2, 128)).astype(_dtypes.to_numpy("bfloat16"))
    o, lse = single_prefill(q, k, v, causal=True, return_lse=True)
    ro, rl = kvattn.reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                        causal=True, return_lse=True)
    assert rel_l2(o.numpy(), ro) <= 1e-2
    assert_lse(lse.numpy(), rl, 1e-2)


def test_graph_replay_after_replan():
    rng = np.random.default_rng(5)
    hkv, group, d, ps = 2, 4, 128, 16
    hq = hkv * group
    bf = _dtypes.to_numpy("bfloat16")
    max_pages = 2000
    kc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    vc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    w = BatchPrefillWithPagedKVCache(use_cuda_graph=True, max_batch_size=8, max_num_pages=max_pages,
                                     max_total_qo=1024)
    qbuf = kvattn.empty((1024, hq, d), "bfloat16")
    obuf = kvattn.empty((1024, hq, d), "bfloat16")
    lbuf = kvattn.empty((1024, hq), "float32")

    def batch(qo_lens, kv_lens):
        npages = [-(-n // ps) for n in kv_lens]
        ids = rng.permutation(max_pages)[:sum(npages)].astype(np.int32)
        pt = PageTable(np.concatenate([[0], np.cumsum(npages)]).astype(np.int32), ids,
                       np.array([n - (p - 1) * ps for n, p in zip(kv_lens, npages)], np.int32), ps)
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(bf)
        return pt, qo_indptr, q

    def check(pt, qo_indptr, q):
        o, l = obuf.numpy()[:q.shape[0]], lbuf.numpy()[:q.shape[0]]
        for i in range(pt.batch_size):
            pages = pt.pages(i)
            n = int(pt.kv_lens[i])
            kk = kc[pages].reshape(-1, hkv, d)[:n]
            vv = vc[pages].reshape(-1, hkv, d)[:n]
            qi = q[qo_indptr[i]:qo_indptr[i + 1]]
            rows = sample_rows(qi.shape[0], SAMPLE_ROWS, rng)
            ro, rl = request_ref(qi, kk, vv, rows, True, -1, 0.0, 1 / np.sqrt(d))
            assert rel_l2(o[qo_indptr[i] + rows], ro) <= 1e-2
            assert_lse(l[qo_indptr[i] + rows], rl, 1e-2)

    def upload(q):
        tmp = kvattn.from_numpy(q)
        kvattn._driver.call("cuMemcpyDtoDAsync", qbuf.ptr, tmp.ptr, tmp.nbytes, kvattn.default_stream().handle)
        kvattn.default_stream().synchronize()

    pt, qi, q = batch([100, 30, 7], [500, 30, 4000])
    upload(q)
    s = kvattn.Stream()   # capture needs a created stream (the legacy default stream cannot capture)
    w.plan(qi, pt, hq, hkv, d, causal=True, stream=s)
    t = int(qi[-1])
    with graphs.capture(s) as cap:
        w.run(qbuf[:t], kd, vd, out=obuf[:t], lse=lbuf[:t], stream=s)
    cap.graph.replay(s)
    s.synchronize()
    check(pt, qi, q)
    # a different batch (more requests, one long append that splits): same graph
    for qo_lens, kv_lens in (([4] * 8, [3000, 40, 4, 900, 16, 17, 2500, 4]), ([300], [20000])):
        pt, qi, q = batch(qo_lens, kv_lens)
        upload(q)
        w.plan(qi, pt, hq, hkv, d, causal=True, stream=s)
        cap.graph.replay(s)
        s.synchronize()
        check(pt, qi, q)


def test_bad_inputs_raise_before_launch():
    w = BatchPrefillWithRaggedKVCache()
    w.plan([0, 4, 6], [0, 10, 20], 8, 2, 128, causal=True)
    q = kvattn.empty((5, 8, 128), "bfloat16")
    k = kvattn.empty((20, 2, 128), "bfloat16")
    with pytest.raises(ValueError, match="q: expected shape"):
        w.run(q, k, k)
    q = kvattn.empty((6, 8, 128), "float16")
    with pytest.raises(TypeError, match="q: expected dtype"):
        w.run(q, k, k)


def test_deterministic_prefill_is_batch_invariant():
    """deterministic=True: a request's output and LSE bits alone equal its bits inside 10 random ragged batches
    of 1..40 companions, on any SM count (its KV split is fixed)."""
    rng = np.random.default_rng()
    hq, hkv, d = 32, 8, 128
    npd = _dtypes.to_numpy("bfloat16")
    tq, tk = 300, 9000
    q0 = rng.standard_normal((tq, hq, d)).astype(npd)
    k0 = rng.standard_normal((tk, hkv, d)).astype(npd)
    v0 = rng.standard_normal((tk, hkv, d)).astype(npd)

    def run(qo, kv, pos, num_sms=None):
        qs = [rng.standard_normal((n, hq, d)).astype(npd) if i != pos else q0 for i, n in enumerate(qo)]
        ks = [rng.standard_normal((n, hkv, d)).astype(npd) if i != pos else k0 for i, n in enumerate(kv)]
        vs = [rng.standard_normal((n, hkv, d)).astype(npd) if i != pos else v0 for i, n in enumerate(kv)]
        qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        ki = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
        w = kvattn.BatchPrefillWithRaggedKVCache(deterministic=True, num_sms=num_sms)
        w.plan(qi, ki, hq, hkv, d, causal=True)
        o, lse = w.run(np.concatenate(qs), np.concatenate(ks), np.concatenate(vs), return_lse=True)
        return o.numpy()[qi[pos]:qi[pos + 1]], lse.numpy()[qi[pos]:qi[pos + 1]]

    o0, l0 = run([tq], [tk], 0)
    ref = reference.attention(q0.astype(np.float64), k0.astype(np.float64), v0.astype(np.float64), causal=True)
    assert rel_l2(o0, ref) <= 1e-2
    for trial in range(10):
        n = int(rng.integers(1, 41))
        qo = list(rng.integers(1, 400, n))
        kv = [int(a + rng.integers(0, 3000)) for a in qo]
        pos = int(rng.integers(n + 1))
        qo.insert(pos, tq)
        kv.insert(pos, tk)
        o, lse = run(qo, kv, pos, num_sms=int(rng.choice([132, 66, 17])))
        assert np.array_equal(o.view(np.uint16), o0.view(np.uint16)), f"trial {trial}: output bits"
        assert np.array_equal(lse.view(np.uint32), l0.view(np.uint32)), f"trial {trial}: lse bits"


def test_deterministic_prefill_graph_replay_is_batch_invariant():
    """deterministic=True in graph mode: one captured run, replayed for 6 random batches of 0..7 companions around
    one request (its KV over 4 splits long: the chunk cap), gives that request's output and LSE bits alone
    (eager, deterministic)."""
    rng = np.random.default_rng()
    hkv, group, d, ps = 2, 4, 128, 16
    hq = hkv * group
    bf = _dtypes.to_numpy("bfloat16")
    max_pages, max_qo, tq, tk = 3000, 2048, 300, 20000
    kc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    vc = rng.standard_normal((max_pages, ps, hkv, d)).astype(bf)
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    q0 = rng.standard_normal((tq, hq, d)).astype(bf)
    n0 = -(-tk // ps)

    def table(kv_lens, pos):
        npages = [-(-n // ps) for n in kv_lens]
        others = iter(rng.permutation(np.arange(n0, max_pages)))
        ids = [np.arange(n0) if i == pos else np.array([next(others) for _ in range(p)], np.int64)
               for i, p in enumerate(npages)]
        return PageTable(np.concatenate([[0], np.cumsum(npages)]).astype(np.int32),
                         np.concatenate(ids).astype(np.int32),
                         np.array([n - (p - 1) * ps for n, p in zip(kv_lens, npages)], np.int32), ps)

    eager = BatchPrefillWithPagedKVCache(deterministic=True)
    eager.plan(np.array([0, tq], np.int32), table([tk], 0), hq, hkv, d, causal=True)
    o0, l0 = eager.run(q0, kd, vd, return_lse=True)
    o0, l0 = o0.numpy(), l0.numpy()
    k0 = kc[:n0].reshape(-1, hkv, d)[:tk].astype(np.float64)
    v0 = vc[:n0].reshape(-1, hkv, d)[:tk].astype(np.float64)
    rows = sample_rows(tq, SAMPLE_ROWS, rng)
    ro, rl = request_ref(q0, k0, v0, rows, True, -1, 0.0, 1 / np.sqrt(d))
    assert rel_l2(o0[rows], ro) <= 1e-2
    assert_lse(l0[rows], rl, 1e-2)
    w = BatchPrefillWithPagedKVCache(deterministic=True, use_cuda_graph=True, max_batch_size=8,
                                     max_num_pages=max_pages, max_total_qo=max_qo)
    qbuf, obuf = kvattn.empty((max_qo, hq, d), "bfloat16"), kvattn.empty((max_qo, hq, d), "bfloat16")
    lbuf = kvattn.empty((max_qo, hq), "float32")
    s = kvattn.Stream()
    graph = None
    for trial in range(6):
        n = int(rng.integers(0, 8))
        qo = [int(x) for x in rng.integers(1, 200, n)]
        kv = [a + int(rng.integers(0, 2000)) for a in qo]
        pos = int(rng.integers(n + 1))
        qo.insert(pos, tq)
        kv.insert(pos, tk)
        qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        qh = rng.standard_normal((max_qo, hq, d)).astype(bf)
        qh[qi[pos]:qi[pos + 1]] = q0
        qbuf.copy_from_host(qh, s)
        obuf.fill_bytes(0xFF, s)
        w.plan(qi, table(kv, pos), hq, hkv, d, causal=True, stream=s)
        if graph is None:
            with graphs.capture(s) as cap:
                w.run(qbuf, kd, vd, out=obuf, lse=lbuf, stream=s)
            graph = cap.graph
        graph.replay(s)
        o, lse = obuf.numpy(s)[qi[pos]:qi[pos + 1]], lbuf.numpy(s)[qi[pos]:qi[pos + 1]]
        assert np.array_equal(o.view(np.uint16), o0.view(np.uint16)), f"trial {trial}: output bits"
        assert np.array_equal(lse.view(np.uint32), l0.view(np.uint32)), f"trial {trial}: lse bits"


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(c=cases(), seed=st.integers(0, 2**31 - 1), kv=st.sampled_from(["float8_e4m3fn", "float8_e5m2"]),
       paged=st.booleans())
def test_fp8_cache_matches_reference(c, seed, kv, paged):
    """fp8 caches (both formats, per-head scales) in paged and ragged prefill, both backends, every variant."""
    if not paged:
        c.pop("page_size")
    run_case(np.random.default_rng(seed), paged=paged, kv_dtype=kv, **c)


@pytest.mark.parametrize("mode", ["once", "kernel"])
@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("paged, layout, page_size", [(True, "NHD", 16), (True, "HND", 5), (False, "NHD", 16),
                                                      (False, "HND", 16)])
def test_fp8_cache_expanded_once_or_in_kernel(mode, kv, paged, layout, page_size):
    """An fp8 cache expanded once per call into 16-bit rows (kvattn.fp8_expand) or tile by tile in the kernel: per-head
    scales, empty and short requests, causal and a window, against the float64 reference on the dequantised cache."""
    for causal, window in ((True, -1), (False, 100)):
        w = run_case(np.random.default_rng(page_size + paged), dtype="bfloat16", d=128, hkv=2, group=4,
                     qo_lens=[300, 0, 5, 900], kv_lens=[700, 0, 33, 900], paged=paged, layout=layout,
                     page_size=page_size, causal=causal, window_left=window, kv_dtype=kv, fp8_expand=mode)
        assert w.last_plan.info["fp8_expand"] == (mode == "once")


def test_fp8_expansion_workspace_reused_and_run_on_another_stream():
    """Plans that fit reuse the expansion's workspace; a run() on a created stream (the plan's copy and the expansion
    ordered on it) matches the reference after a larger and a smaller plan."""
    rng = np.random.default_rng(3)
    for lens in ([2000, 1500], [400, 100, 900]):
        run_case(rng, dtype="bfloat16", d=128, hkv=2, group=4, qo_lens=lens, kv_lens=lens, paged=True,
                 causal=True, kv_dtype="float8_e4m3fn", fp8_expand="once")
    w2 = BatchPrefillWithRaggedKVCache()
    w2.fp8_expand = "once"
    ind = np.array([0, 300, 800], np.int32)
    w2.plan(ind, ind, 8, 2, 128, causal=True, kv_dtype="float8_e5m2")
    first = w2._fp8.ws_k.ptr
    w2.plan(ind[:2], ind[:2], 8, 2, 128, causal=True, kv_dtype="float8_e5m2")
    assert w2._fp8.ws_k.ptr == first   # 300 rows fit the 800 of the first plan's workspace
    q = rng.standard_normal((300, 8, 128)).astype(np.float32).astype(_dtypes.to_numpy("bfloat16"))
    k, v = (rng.standard_normal((300, 2, 128)) for _ in range(2))
    (k8, v8), scales, kd, vd = _device_cache(rng, k, v, "float8_e5m2", 1)
    s = kvattn.Stream()
    out = w2.run(kvattn.from_numpy(q), k8, v8, stream=s, **scales)
    got = out.numpy(s).astype(np.float64)
    rows = np.arange(0, 300, 7)
    ro, _ = request_ref(q, kd, vd, rows, True, -1, 0.0, 1 / np.sqrt(128))
    assert rel_l2(got[rows], ro) <= TOL["bfloat16"]


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_cache_long_causal(backend, kv):
    run_case(np.random.default_rng(7), dtype="bfloat16", d=128, hkv=2, group=4, qo_lens=[1500, 3, 700],
             kv_lens=[1500, 4000, 2000], paged=True, causal=True, backend=backend, kv_dtype=kv)
