"""GPU tests of append_paged_kv_cache against reference.append_paged_kv_cache: NHD / HND, page sizes 1..16 with
partial last pages, scattered pages, host and device index arrays, fused RoPE, graph capture; bad device indices
write nothing."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvattn
from kvattn import _dtypes, graphs, reference
from kvattn.formats import PageTable

from _gpu import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _case(rng, old_lens, new_lens, ps, hkv, d, dtype, layout, spare=3):
    """(k_cache, v_cache numpy, PageTable after the append, append_indptr, k_new, v_new)."""
    kv = np.asarray(old_lens) + np.asarray(new_lens)
    pt = PageTable.from_kv_lens(kv, ps, num_pages=int((-(-kv // ps)).sum()) + spare, rng=rng)
    n = pt.indices.size + spare
    shape = (n, ps, hkv, d) if layout == "NHD" else (n, hkv, ps, d)
    npd = _dtypes.to_numpy(dtype)
    kc = rng.standard_normal(shape).astype(npd)
    vc = rng.standard_normal(shape).astype(npd)
    ind = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    kn = rng.standard_normal((int(ind[-1]), hkv, d)).astype(npd)
    vn = rng.standard_normal((int(ind[-1]), hkv, d)).astype(npd)
    return kc, vc, pt, ind, kn, vn


@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.tuples(st.integers(0, 70), st.integers(0, 40)), min_size=1, max_size=9),
       st.sampled_from([1, 5, 16]), st.sampled_from([(1, 64), (4, 128), (2, 256)]),
       st.sampled_from(["bfloat16", "float16"]), st.sampled_from(["NHD", "HND"]), st.booleans(),
       st.integers(0, 2**31))
def test_append_matches_reference(lens, ps, heads, dtype, layout, on_device, seed):
    rng = np.random.default_rng(seed)
    hkv, d = heads
    old, new = zip(*lens)
    kc, vc, pt, ind, kn, vn = _case(rng, old, new, ps, hkv, d, dtype, layout)
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    if on_device:
        b, pos = kvattn.get_batch_indices_positions(ind, pt)
        dev = tuple(kvattn.from_numpy(a) for a in (pt.indptr, pt.indices, pt.last_page_len))
        kvattn.append_paged_kv_cache(kvattn.from_numpy(kn), kvattn.from_numpy(vn), None, kd, vd, dev, layout,
                                     batch_indices=kvattn.from_numpy(b), positions=kvattn.from_numpy(pos))
    else:
        kvattn.append_paged_kv_cache(kn, vn, ind, kd, vd, pt, layout)
    b, pos = reference.batch_indices_positions(ind, pt.kv_lens)
    rk, rv = reference.append_paged_kv_cache(kn, vn, b, pos, kc, vc, pt, kv_layout=layout)
    assert np.array_equal(kd.numpy().view(np.uint16), rk.view(np.uint16)), "K cache differs (a copy is exact)"
    assert np.array_equal(vd.numpy().view(np.uint16), rv.view(np.uint16)), "V cache differs"


def _rope_case(rng, layout, interleave=False, scale=1.0):
    """Append with fused RoPE (theta 5e5) into a bf16 cache: (K cache after it as float64, the reference's K cache,
    the K cache before, the V cache after, the reference's V cache)."""
    kc, vc, pt, ind, kn, vn = _case(rng, [100, 3000, 0], [1, 17, 40], 16, 2, 128, "bfloat16", layout)
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    rope = kvattn.RoPE(theta=5e5, scale=scale, interleave=interleave)
    kvattn.append_paged_kv_cache(kn, vn, ind, kd, vd, pt, layout, rope=rope)
    b, pos = reference.batch_indices_positions(ind, pt.kv_lens)
    kr = reference.apply_rope(kn, pos, interleave=interleave, rope_scale=scale, rope_theta=5e5)
    rk, rv = reference.append_paged_kv_cache(kr, vn, b, pos, kc.astype(np.float64), vc, pt, kv_layout=layout)
    return kd.numpy().astype(np.float64), rk, kc, vd, rv


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_with_rope(interleave, layout):
    got, rk, kc, vd, rv = _rope_case(np.random.default_rng(4), layout, interleave, scale=2.0)
    # the rotated rows differ from the reference by the bf16 rounding of the stored values (2^-8 relative) and
    # float32 angles; every other slot is untouched
    assert np.all(np.abs(got - rk) <= 2 ** -7 * np.abs(rk) + 1e-2), np.max(np.abs(got - rk))
    untouched = rk == kc.astype(np.float64)
    assert np.array_equal(got[untouched], rk[untouched])
    assert np.array_equal(vd.numpy().view(np.uint16), rv.view(np.uint16))


def test_append_device_indices_out_of_range_write_nothing():
    rng = np.random.default_rng(2)
    kc, vc, pt, ind, kn, vn = _case(rng, [10, 20], [2, 2], 4, 2, 64, "bfloat16", "NHD")
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    dev = tuple(kvattn.from_numpy(a) for a in (pt.indptr, pt.indices, pt.last_page_len))
    b = np.array([0, 5, -1, 1], np.int32)        # requests 5 and -1 do not exist
    pos = np.array([12, 0, 0, 21], np.int32)     # 12 >= kv_len 12 of request 0: out of range
    kvattn.append_paged_kv_cache(kn, vn, None, kd, vd, dev, batch_indices=kvattn.from_numpy(b),
                                 positions=kvattn.from_numpy(pos))
    rk, rv = reference.append_paged_kv_cache(kn[3:], vn[3:], b[3:], pos[3:], kc, vc, pt)
    assert np.array_equal(kd.numpy().view(np.uint16), rk.view(np.uint16))
    assert np.array_equal(vd.numpy().view(np.uint16), rv.view(np.uint16))


@pytest.fixture
def other_load_order_build():
    """page.cuh's KVATTN_APPEND_LOADS_FIRST build that is not the default (the A/B of bench_append.py --loads-first)
    for the test's calls, the default build restored after."""
    from kvattn import page
    default = page.LOADS_FIRST
    page.LOADS_FIRST = 1 - default
    page._launchers.clear()
    yield
    page.LOADS_FIRST = default
    page._launchers.clear()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_other_load_order_build_matches_reference(other_load_order_build, layout):
    """The load order that is not the default (a token's new rows loaded after its page lookup, the kernel before
    run 53a): every page size's slots exact, fused RoPE within bf16 rounding, and out-of-range device indices
    (request, position) still write nothing."""
    rng = np.random.default_rng(7)
    for ps, (hkv, d) in ((1, (1, 64)), (5, (4, 128)), (16, (8, 128)), (16, (2, 256))):
        kc, vc, pt, ind, kn, vn = _case(rng, [0, 33, 70, 5], [40, 1, 17, 0], ps, hkv, d, "bfloat16", layout)
        kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
        b, pos = kvattn.get_batch_indices_positions(ind, pt)
        b[1], pos[2] = 9, pt.kv_lens[b[2]]   # a request that does not exist, a position past its request's end
        dev = tuple(kvattn.from_numpy(a) for a in (pt.indptr, pt.indices, pt.last_page_len))
        kvattn.append_paged_kv_cache(kvattn.from_numpy(kn), kvattn.from_numpy(vn), None, kd, vd, dev, layout,
                                     batch_indices=kvattn.from_numpy(b), positions=kvattn.from_numpy(pos))
        keep = np.ones(b.size, bool)
        keep[[1, 2]] = False
        rk, rv = reference.append_paged_kv_cache(kn[keep], vn[keep], b[keep], pos[keep], kc, vc, pt,
                                                 kv_layout=layout)
        assert np.array_equal(kd.numpy().view(np.uint16), rk.view(np.uint16)), f"K cache differs at page size {ps}"
        assert np.array_equal(vd.numpy().view(np.uint16), rv.view(np.uint16)), f"V cache differs at page size {ps}"
    got, rk, *_ = _rope_case(rng, layout)
    assert np.all(np.abs(got - rk) <= 2 ** -7 * np.abs(rk) + 1e-2), np.max(np.abs(got - rk))


def test_append_errors_before_any_write():
    rng = np.random.default_rng(3)
    kc, vc, pt, ind, kn, vn = _case(rng, [10, 20], [2, 2], 4, 2, 64, "bfloat16", "NHD")
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    with pytest.raises(ValueError, match="positions: token 0 has position 12"):
        kvattn.append_paged_kv_cache(kn, vn, None, kd, vd, pt, batch_indices=[0, 0, 1, 1], positions=[12, 0, 0, 1])
    with pytest.raises(TypeError, match="k_cache: expected dtype bfloat16, got float16"):
        kvattn.append_paged_kv_cache(kn, vn, ind, kvattn.from_numpy(kc.astype(np.float16)), vd, pt)
    with pytest.raises(ValueError, match="k_cache: expected shape"):   # one KV head where k_new has two
        kvattn.append_paged_kv_cache(kn, vn, ind, np.ascontiguousarray(kc[:, :, :1]), vd, pt)
    with pytest.raises(ValueError, match="page_size 4 differs from the cache's 8"):
        kvattn.append_paged_kv_cache(kn, vn, ind, kc.reshape(-1, 8, 2, 64), vc.reshape(-1, 8, 2, 64), pt)
    with pytest.raises(ValueError, match="v_new: expected shape"):
        kvattn.append_paged_kv_cache(kn, vn[:3], ind, kd, vd, pt)
    assert np.array_equal(kd.numpy().view(np.uint16), kc.view(np.uint16)), "nothing written"
    assert np.array_equal(vd.numpy().view(np.uint16), vc.view(np.uint16)), "nothing written"


def test_append_captured_in_a_graph():
    rng = np.random.default_rng(6)
    kc, vc, pt, ind, kn, vn = _case(rng, [30, 7, 100], [1, 1, 1], 16, 4, 128, "bfloat16", "NHD")
    kd, vd = kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    dev = tuple(kvattn.from_numpy(a) for a in (pt.indptr, pt.indices, pt.last_page_len))
    b, pos = kvattn.get_batch_indices_positions(ind, pt)
    bd, pd = kvattn.from_numpy(b), kvattn.from_numpy(pos)
    knd, vnd = kvattn.from_numpy(kn), kvattn.from_numpy(vn)
    s = kvattn.Stream()
    with graphs.capture(s) as cap:
        kvattn.append_paged_kv_cache(knd, vnd, None, kd, vd, dev, batch_indices=bd, positions=pd, stream=s)
    assert np.array_equal(kd.numpy().view(np.uint16), kc.view(np.uint16)), "capture runs nothing"
    cap.graph.replay(s)
    s.synchronize()
    rk, rv = reference.append_paged_kv_cache(kn, vn, b, pos, kc, vc, pt)
    assert np.array_equal(kd.numpy().view(np.uint16), rk.view(np.uint16))
    assert np.array_equal(vd.numpy().view(np.uint16), rv.view(np.uint16))


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rope", [False, True])
def test_append_quantises_into_an_fp8_cache(kv_dtype, per_head, rope):
    """k / k_scale rounded to nearest, saturated (values past the finite range included); V likewise; without RoPE
    bit for bit what numpy's float32 division and ml_dtypes' rounding give, with RoPE within one fp8 step."""
    rng = np.random.default_rng(11)
    hkv, d = 4, 128
    kc, vc, pt, ind, kn, vn = _case(rng, [33, 0, 500], [3, 16, 1], 16, hkv, d, "bfloat16", "NHD")
    f8 = _dtypes.to_numpy(kv_dtype)
    kn[0, 0, :4] = np.array([3000.0, -3000.0, 1e5, -1e5]).astype(kn.dtype)   # beyond e4m3's 448 (e5m2: 57344)
    k8 = rng.standard_normal(kc.shape).astype(f8)
    v8 = rng.standard_normal(vc.shape).astype(f8)
    ks = rng.uniform(0.01, 0.05, hkv).astype(np.float32) if per_head else 0.02
    vs = rng.uniform(0.01, 0.05, hkv).astype(np.float32) if per_head else 0.03
    kd, vd = kvattn.from_numpy(k8), kvattn.from_numpy(v8.view(np.uint8))   # V as raw bytes: kv_dtype names it
    r = kvattn.RoPE(theta=1e4) if rope else None
    kvattn.append_paged_kv_cache(kn, vn, ind, kd, vd, pt, k_scale=ks, v_scale=vs, kv_dtype=kv_dtype, rope=r)
    b, pos = reference.batch_indices_positions(ind, pt.kv_lens)
    lim = float(ml_dtypes.finfo(f8).max)
    sk = np.broadcast_to(np.asarray(ks, np.float32), (hkv,))[None, :, None]
    sv = np.broadcast_to(np.asarray(vs, np.float32), (hkv,))[None, :, None]
    kf = (reference.apply_rope(kn, pos) if rope else kn.astype(np.float32)).astype(np.float32)
    qk = np.clip(kf / sk, -lim, lim).astype(f8)
    qv = np.clip(vn.astype(np.float32) / sv, -lim, lim).astype(f8)
    rk, rv = reference.append_paged_kv_cache(qk, qv, b, pos, k8, v8, pt)
    got_k = kd.numpy().view(np.uint8).view(f8)
    got_v = vd.numpy().view(f8)
    assert np.array_equal(got_v.view(np.uint8), rv.astype(f8).view(np.uint8)), "V quantised differently"
    if not rope:
        assert np.array_equal(got_k.view(np.uint8), rk.astype(f8).view(np.uint8)), "K quantised differently"
    else:
        step = 2.0 ** -3 if kv_dtype == "float8_e4m3fn" else 2.0 ** -2
        g, want = got_k.astype(np.float64), rk.astype(np.float64)
        assert np.all(np.abs(g - want) <= step * np.abs(want) + 2 * float(ml_dtypes.finfo(f8).smallest_subnormal))
    with pytest.raises(TypeError, match="kv_dtype= "):
        kvattn.append_paged_kv_cache(kn, vn, ind, vd, vd, pt)   # raw bytes without kv_dtype
    with pytest.raises(TypeError, match="k_scale: scales apply to an fp8 cache"):
        kvattn.append_paged_kv_cache(kn, vn, ind, kvattn.from_numpy(kc), kvattn.from_numpy(vc), pt, k_scale=0.5)
