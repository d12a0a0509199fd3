"""GPU tests of BatchMixedWithPagedKVCache (prefill + decode requests in one launch) against the float64 reference
(reference.batch_attention_paged over the whole batch): random mixes of prefills, chunked-prefill appends, empty
requests and decodes, NHD / HND, page sizes 1 and 16, causal or not, window and soft cap, SM splits forced to
the extremes, poisoned outputs and LSE; the one-launch path is asserted where it applies (sm_90, 16-bit cache)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvattn
from kvattn import _driver, reference
from kvattn.formats import PageTable

from _gpu import assert_lse, poisoned, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
TOL = {"bfloat16": 1e-2, "float16": 2e-3}


def run_case(rng, qo, kv, *, hkv=2, group=4, d=128, dtype="bfloat16", layout="NHD", page_size=16, causal=True,
             window_left=-1, cap=0.0, prefill_sms=None, expect_fused=None):
    hq = hkv * group
    npd = kvattn._dtypes.to_numpy(dtype)
    pt = PageTable.from_kv_lens(np.array(kv), page_size, num_pages=sum(-(-n // page_size) for n in kv) + 3, rng=rng)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    rows = int(qo_indptr[-1])
    npages = int(pt.indices.max(initial=-1)) + 4
    shape = (npages, page_size, hkv, d) if layout == "NHD" else (npages, hkv, page_size, d)
    q = rng.standard_normal((rows, hq, d)).astype(npd)
    kc = rng.standard_normal(shape).astype(npd)
    vc = rng.standard_normal(shape).astype(npd)
    w = kvattn.BatchMixedWithPagedKVCache(kv_layout=layout)
    w.plan(qo_indptr, pt, hq, hkv, d, causal=causal, q_dtype=dtype, window_left=window_left, logits_soft_cap=cap,
           prefill_sms=prefill_sms)
    if expect_fused is not None:
        assert w.last_plan["fused"] == expect_fused, w.last_plan
    out = poisoned((rows, hq, d), dtype)
    lse = poisoned((rows, hq), "float32")
    w.run(kvattn.from_numpy(q), kvattn.from_numpy(kc), kvattn.from_numpy(vc), out=out, lse=lse)
    ro, rl = reference.batch_attention_paged(q, kc, vc, qo_indptr, pt, kv_layout=layout, causal=causal,
                                             window_left=window_left, logits_soft_cap=cap, return_lse=True)
    if rows:
        o = out.numpy()
        assert rel_l2(o, ro) <= TOL[dtype], (rel_l2(o, ro), w.last_plan)
        assert_lse(lse.numpy(), rl, TOL[dtype])
    return w


SM90 = kvattn.gpu_available() and _driver.arch() == "sm_90a"


def test_two_prefills_and_many_decodes_in_one_launch():
    rng = np.random.default_rng(1)
    qo = [700, 300] + [1] * 40
    kv = [700, 900] + rng.integers(1, 3000, 40).tolist()
    w = run_case(rng, qo, kv, expect_fused=True if SM90 else None)
    st_ = w.last_plan
    assert (st_["prefill"].start, st_["prefill"].stop) == (0, 2) and st_["decode"].stop == 42


@pytest.mark.parametrize("prefill_sms", [1, 131])
def test_extreme_sm_splits(prefill_sms):
    rng = np.random.default_rng(2)
    n = kvattn.Device(0).sm_count
    run_case(rng, [1] * 9 + [257, 64], rng.integers(1, 2000, 11).tolist(), prefill_sms=min(prefill_sms, n - 1),
             layout="HND", expect_fused=True if SM90 else None)


def test_decodes_only_and_prefills_only_take_one_part():
    rng = np.random.default_rng(3)
    w = run_case(rng, [1] * 5, [10, 400, 1, 17, 33], expect_fused=False)
    assert w.last_plan["prefill_plan"] is None
    w = run_case(rng, [33, 12], [40, 12], expect_fused=False)
    assert w.last_plan["decode_plan"] is None


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.integers(0, 300), min_size=0, max_size=3), st.integers(0, 30), st.booleans(),
       st.sampled_from(["NHD", "HND"]), st.sampled_from([1, 16]), st.sampled_from(["bfloat16", "float16"]),
       st.sampled_from([(-1, 0.0), (64, 0.0), (-1, 30.0)]), st.sampled_from([(2, 4), (1, 8), (4, 1)]),
       st.integers(0, 2 ** 31 - 1))
def test_mixed_batches_match_the_reference(pre_qo, n_dec, decodes_first, layout, page_size, dtype, var, heads,
                                           seed):
    rng = np.random.default_rng(seed)
    pre_kv = [q + int(rng.integers(0, 200)) for q in pre_qo]          # chunked-prefill appends: kv >= qo
    causal = bool(seed % 2)   # (a decode without KV, allowed when not causal, may land in the prefill part)
    dec_kv = rng.integers(0 if not causal else 1, 1500, n_dec).tolist()
    dec_qo = [1] * n_dec
    qo, kv = (dec_qo + pre_qo, dec_kv + pre_kv) if decodes_first else (pre_qo + dec_qo, pre_kv + dec_kv)
    if not qo:
        qo, kv = [1], [5]
    window_left, cap = var
    run_case(rng, qo, kv, hkv=heads[0], group=heads[1], layout=layout, page_size=page_size, dtype=dtype,
             window_left=window_left, cap=cap, causal=causal)


@pytest.mark.parametrize("fp8_expand", ["once", "kernel"])
@pytest.mark.parametrize("scale_kind", ["float", "per_head"])
def test_fp8_cache_with_scales(fp8_expand, scale_kind):
    """A mixed batch over an fp8 cache (two launches): the prefill part either expands the cache once per call or
    reads it in the kernel, the decode part reads it in the kernel; per-tensor or per-head scales reach both
    parts. Against the float64 reference on the dequantised cache; outputs poisoned."""
    from test_fp8_gpu import quantised_case
    rng = np.random.default_rng()
    hkv, group, d = 2, 4, 128
    hq = hkv * group
    qo, kv = [1500, 300] + [1] * 12, [1500, 900] + rng.integers(1, 3000, 12).tolist()
    pt, _, k8, v8, ks, vs = quantised_case(rng, kv, 16, hq, hkv, d, "bfloat16", "float8_e4m3fn", "NHD",
                                           scale_kind)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    rows = int(qo_indptr[-1])
    q = rng.standard_normal((rows, hq, d)).astype(kvattn._dtypes.to_numpy("bfloat16"))
    w = kvattn.BatchMixedWithPagedKVCache()
    w._pre.fp8_expand = fp8_expand
    w.plan(qo_indptr, pt, hq, hkv, d, causal=True, kv_dtype="float8_e4m3fn")
    assert (w._pre._fp8 is not None) == (fp8_expand == "once") and not w.last_plan["fused"]
    out, lse = poisoned((rows, hq, d), "bfloat16"), poisoned((rows, hq), "float32")
    w.run(q, k8, v8, out=out, lse=lse, k_scale=ks, v_scale=vs)
    ro, rl = reference.batch_attention_paged(q, k8, v8, qo_indptr, pt, causal=True, return_lse=True, k_scale=ks,
                                             v_scale=vs)
    assert rel_l2(out.numpy(), ro) <= TOL["bfloat16"]
    assert_lse(lse.numpy(), rl, TOL["bfloat16"])
