"""GPU tests of decode with an fp8 (e4m3 / e5m2) KV cache against the float64 reference on the dequantised cache."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvattn
from kvattn import _dtypes, reference
from _gpu import assert_decode_rows, assert_lse, poisoned, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
GPU = settings(max_examples=40, deadline=None)
# The products run in f16 with an fp8 cache: bf16 queries keep bf16's bound, f16 queries f16's.
TOL = {"bfloat16": (1e-2, 1e-2), "float16": (2e-3, 2e-3)}


def quantised_case(rng, kv_lens, page_size, hq, hkv, d, dtype, kv_dtype, layout, scale_kind):
    """(page table, q, k8, v8, k_scale, v_scale): the cache holds (true values) / scale rounded to kv_dtype."""
    pt = kvattn.PageTable.from_kv_lens(np.asarray(kv_lens), page_size, rng=rng)
    pages = pt.num_pages_used + 2
    shape = (pages, page_size, hkv, d) if layout == "NHD" else (pages, hkv, page_size, d)
    axis = 2 if layout == "NHD" else 1
    if scale_kind == "none":
        ks = vs = None
        kf = vf = np.ones(hkv)
    elif scale_kind == "float":
        ks, vs = float(rng.uniform(0.01, 0.1)), float(rng.uniform(0.01, 0.1))
        kf, vf = np.full(hkv, ks), np.full(hkv, vs)
    else:
        kf = vf = None
        ks = rng.uniform(0.01, 0.1, hkv).astype(np.float32)
        vs = rng.uniform(0.01, 0.1, hkv).astype(np.float32)
        kf, vf = ks.astype(np.float64), vs.astype(np.float64)
    bshape = [1] * 4
    bshape[axis] = hkv
    npk = _dtypes.to_numpy(kv_dtype)
    lim = 440.0 if kv_dtype == "float8_e4m3fn" else 57000.0   # inside the format's range (e4m3fn: NaN past 448)
    k8 = np.clip(rng.standard_normal(shape) / kf.reshape(bshape), -lim, lim).astype(npk)
    v8 = np.clip(rng.standard_normal(shape) / vf.reshape(bshape), -lim, lim).astype(npk)
    q = rng.standard_normal((len(kv_lens), hq, d)).astype(_dtypes.to_numpy(dtype))
    return pt, q, k8, v8, ks, vs


def check(rng, kv_lens, page, hq, hkv, d, dtype, kv_dtype, layout="NHD", scale_kind="float", window=-1, cap=0.0,
          device_scales=False, q_gain=None, sm_scale=None):
    pt, q, k8, v8, ks, vs = quantised_case(rng, kv_lens, page, hq, hkv, d, dtype, kv_dtype, layout, scale_kind)
    if q_gain is not None:   # rows beyond f16's range: the kernel scales them by a power of two
        q = (q.astype(np.float64) * q_gain).astype(q.dtype)
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=layout)
    w.plan(pt, hq, hkv, d, q_dtype=dtype, kv_dtype=kv_dtype, window_left=window, logits_soft_cap=cap,
           sm_scale=sm_scale)
    out, lse = poisoned(q.shape, dtype), poisoned(q.shape[:2], "float32")
    rks, rvs = ks, vs
    if device_scales and isinstance(ks, np.ndarray):
        ks, vs = kvattn.from_numpy(ks), kvattn.from_numpy(vs)
    w.run(q, k8, v8, out=out, lse=lse, k_scale=ks, v_scale=vs)
    ro, rl = reference.batch_attention_paged(q, k8, v8, np.arange(len(kv_lens) + 1), pt, kv_layout=layout,
                                             window_left=window, logits_soft_cap=cap, sm_scale=sm_scale,
                                             return_lse=True, k_scale=rks, v_scale=rvs)
    got = out.numpy()
    otol, ltol = TOL[dtype]
    assert_decode_rows(got, ro, kv_lens, otol)
    assert_lse(lse.numpy(), rl, ltol * (abs(sm_scale or 1.0) * (q_gain or 1.0) if q_gain else 1.0))


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_fp8_decode_matches_reference(data, seed):
    rng = np.random.default_rng(seed)
    batch = data.draw(st.integers(1, 32), "batch")
    lens = data.draw(st.lists(st.one_of(st.integers(0, 600), st.integers(0, 5000)), min_size=batch,
                              max_size=batch), "kv_lens")
    group = data.draw(st.sampled_from([1, 4, 5, 8, 16, 32]), "group")
    hkv = data.draw(st.integers(1, 3), "hkv")
    d = data.draw(st.sampled_from([64, 128, 256]), "head_dim")
    dtype = data.draw(st.sampled_from(["bfloat16", "float16"]), "dtype")
    kv_dtype = data.draw(st.sampled_from(["float8_e4m3fn", "float8_e5m2"]), "kv_dtype")
    layout = data.draw(st.sampled_from(["NHD", "HND"]), "layout")
    page = data.draw(st.sampled_from([1, 16, 64]), "page_size")
    scale_kind = data.draw(st.sampled_from(["none", "float", "per_head"]), "scales")
    window = data.draw(st.sampled_from([-1, -1, 40]), "window_left")
    cap = data.draw(st.sampled_from([0.0, 0.0, 30.0]), "soft_cap")
    check(rng, lens, page, group * hkv, hkv, d, dtype, kv_dtype, layout, scale_kind, window, cap,
          device_scales=data.draw(st.booleans(), "device_scales"))


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_decode_long_and_skewed(kv_dtype):
    lens = [32768 if i % 16 == 0 else 256 + (i * 389) % 1024 for i in range(33)] + [65536, 0]
    check(np.random.default_rng(), lens, 16, 32, 8, 128, "bfloat16", kv_dtype, scale_kind="per_head")


def test_fp8_decode_large_queries():
    """bf16 query rows far outside f16's range (|q| ~ 2^20) are scaled per row inside the kernel."""
    check(np.random.default_rng(), [700, 3000], 16, 8, 2, 128, "bfloat16", "float8_e4m3fn", q_gain=2.0 ** 20,
          sm_scale=2.0 ** -24)


def test_fp8_graph_replay_with_device_scales():
    """A captured fp8 run replays later plans (other lengths) with new per-head scale values in the same arrays."""
    rng = np.random.default_rng()
    hq, hkv, d, page, max_b, max_pages = 16, 4, 128, 16, 8, 2048
    pt, q, k8, v8, ks, vs = quantised_case(rng, [3000] * max_b, page, hq, hkv, d, "bfloat16", "float8_e4m3fn",
                                           "NHD", "per_head")
    dk, dv = kvattn.from_numpy(k8), kvattn.from_numpy(v8)
    dq, out = kvattn.from_numpy(q), kvattn.empty(q.shape, "bfloat16")
    dks, dvs = kvattn.from_numpy(ks), kvattn.from_numpy(vs)
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=max_b, max_num_pages=max_pages)
    s = kvattn.Stream()
    graph = None
    for step, batch in enumerate([8, 3, 6]):
        lens = rng.integers(1, 3000, batch)
        pt = kvattn.PageTable.from_kv_lens(lens, page, num_pages=k8.shape[0], rng=rng)
        w.plan(pt, hq, hkv, d, kv_dtype="float8_e4m3fn", stream=s)
        ks, vs = rng.uniform(0.01, 0.1, (2, hkv)).astype(np.float32)
        dks.copy_from_host(ks, s)
        dvs.copy_from_host(vs, s)
        out.fill_bytes(0xFF, s)
        if graph is None:
            with kvattn.graphs.capture(s) as cap:
                w.run(dq, dk, dv, out=out, k_scale=dks, v_scale=dvs, stream=s)
            graph = cap.graph
        graph.replay(s)
        ro = reference.batch_attention_paged(q[:batch], k8, v8, np.arange(batch + 1), pt, k_scale=ks, v_scale=vs)
        assert rel_l2(out.numpy(s)[:batch], ro) <= 1e-2, f"step {step} batch {batch}"


def test_fp8_cache_as_torch_uint8_and_float8():
    """A serving engine's fp8 cache as torch float8 tensors or raw uint8 bytes, out=None, torch's stream."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    pt, q, k8, v8, ks, vs = quantised_case(rng, [1000, 77, 4096], 16, 32, 8, 128, "bfloat16", "float8_e4m3fn",
                                           "NHD", "float")
    ro = reference.batch_attention_paged(q, k8, v8, np.arange(4), pt, k_scale=ks, v_scale=vs)
    tq = torch.from_numpy(q.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
    tk = torch.from_numpy(k8.view(np.uint8)).cuda()
    tv = torch.from_numpy(v8.view(np.uint8)).cuda()
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, 32, 8, 128, kv_dtype="float8_e4m3fn")
    for k, v in ((tk, tv), (tk.view(torch.float8_e4m3fn), tv.view(torch.float8_e4m3fn))):
        o = torch.from_dlpack(w.run(tq, k, v, k_scale=ks, v_scale=vs))
        got = o.float().cpu().numpy()
        assert rel_l2(got, ro) <= 1e-2
