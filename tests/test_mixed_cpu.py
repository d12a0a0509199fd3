"""CPU tests of the mixed prefill + decode op: how a batch splits into its two parts, how the SMs split between
them, the part page tables, the parameter struct against C, and the mixed kernel's compile (no spills)."""
import numpy as np
import pytest
from _fake_driver import fake_driver

import kvattn
from kvattn import compiler, kernels, mixed
from kvattn.formats import PageTable


@pytest.mark.parametrize("qo, pre, dec", [
    ([4096, 4096, 1, 1, 1], (0, 2), (2, 5)),   # decodes at the end
    ([1, 1, 1, 300, 7], (3, 5), (0, 3)),       # at the start
    ([1, 5, 1, 1], (0, 2), (2, 4)),            # both ends: the longer run (the end: 2 > 1)
    ([1, 1, 5, 1], (2, 4), (0, 2)),            # the start's run is longer
    ([1, 1, 1], (0, 0), (0, 3)),               # decodes only
    ([5, 9], (0, 2), (2, 2)),                  # prefills only
    ([1, 0, 1], (0, 2), (2, 3)),               # an empty request is a prefill of no rows
])
def test_split_requests(qo, pre, dec):
    p, d = mixed.split_requests(np.array(qo))
    assert (p.start, p.stop) == pre and (d.start, d.stop) == dec


def test_split_sms_balances_the_parts_time():
    n = 132
    flops, nbytes = 275e9, 1.057e9   # 2 causal prefills of 4096 + 126 decodes of 4096 (bf16 Hq32/Hkv8/D128)
    p = mixed.split_sms(flops, nbytes, n)
    tp = flops / (mixed.PREFILL_FLOPS_PER_SM * p)
    td = nbytes / (mixed.DECODE_BYTES_PER_SM * (n - p))
    assert 1 <= p < n and abs(tp - td) / max(tp, td) < 0.05
    assert mixed.split_sms(1e15, 1.0, n) == n - 1 and mixed.split_sms(1.0, 1e15, n) == 1
    assert mixed.split_sms(0.0, 0.0, n) == n // 2


def test_sub_table_keeps_each_requests_pages():
    rng = np.random.default_rng(0)
    pt = PageTable.from_kv_lens(np.array([40, 1, 17, 33]), 16, rng=rng)
    sub = mixed.sub_table(pt, slice(1, 3))
    assert sub.batch_size == 2 and np.array_equal(sub.kv_lens, pt.kv_lens[1:3])
    for i in range(2):
        assert np.array_equal(sub.pages(i), pt.pages(1 + i))


def test_param_struct_size_matches_c_struct():
    src = '#include "mixed.cuh"\n' + kernels.size_assert("kvattn::MixedParams", mixed.MIXED_PARAMS)
    compiler.compile_cubin(src, "mixed_asserts.cu", [], [], "sm_90a")


@pytest.mark.parametrize("interleaved", [False, True])
def test_mixed_kernel_compiles_without_spills(interleaved):
    spec = mixed._default_spec(128, "bfloat16", interleaved)
    compiled, _ = spec.compile("sm_90a")
    (res,) = compiled.resources.values()
    assert res.spills == 0 and res.registers <= 168, res


def test_user_variants_are_refused_by_the_mixed_spec():
    from _user_variants import HALF_LOGITS
    from kvattn import decode, prefill
    from kvattn.variants import Variant
    pre = prefill.sm90_spec(128, HALF_LOGITS, "bfloat16", persistent=True)
    with pytest.raises(ValueError, match="user variants"):
        mixed.mixed_spec(pre, decode.decode_spec(128, 1, Variant(), "bfloat16"), 3)


def test_plan_argument_errors_name_the_argument():
    w = mixed.BatchMixedWithPagedKVCache(num_sms=132)
    pt = PageTable.from_kv_lens(np.array([40, 7]), 16, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match="page_table"):
        w.plan([0, 4, 5], "not a table", 8, 2, 128)
    with pytest.raises(ValueError, match="qo_indptr"):
        w.plan([0, 4], pt, 8, 2, 128)
    with pytest.raises(ValueError, match="prefill_sms"):
        w.plan([0, 4, 5], pt, 8, 2, 128, prefill_sms=132)
    with pytest.raises(ValueError, match="tuning"):
        mixed.BatchMixedWithPagedKVCache(tuning=dict(stages=3))
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(None, None, None)


def test_one_launch_only_where_predicted_to_pay():
    """fused_pays: a large decode part (run 29e: 2 causal prefills of 4096 + 126 decodes of 4096, Hq32/Hkv8/D128,
    measured 1048.6 us fused against 983.6 apart) goes apart; a small prefill beside many decodes (the GPU test's
    batch) goes in one launch."""
    n = 132
    pairs = 2 * (4096 * 4096 - 4096 * 4095 // 2)
    flops, nbytes = 4.0 * pairs * 32 * 128, 126 * 4096 * 8 * 128 * 2 * 2.0
    assert not mixed.fused_pays(flops, nbytes, n, mixed.split_sms(flops, nbytes, n))
    # on an H100 (3.35 TB/s peak, the decode alone ~3.0 TB/s) the same batch is faster in one launch (run 40e:
    # 1070.6 us at 76 prefill SMs against 1243.6 apart)
    h100 = mixed.DECODE_PEAK_FRACTION * 2619e6 * 2 * 5120 / 8
    assert mixed.fused_pays(flops, nbytes, n, mixed.split_sms(flops, nbytes, n), h100)
    h200 = mixed.DECODE_PEAK_FRACTION * 3201e6 * 2 * 6144 / 8
    assert not mixed.fused_pays(flops, nbytes, n, mixed.split_sms(flops, nbytes, n), h200)
    flops = 4.0 * (700 * 700 - 700 * 699 // 2 + 300 * 900 - 300 * 299 // 2) * 8 * 128
    nbytes = 40 * 1500 * 2 * 128 * 2 * 2.0
    assert mixed.fused_pays(flops, nbytes, n, mixed.split_sms(flops, nbytes, n))


def test_mixed_fp8_cache_expands_for_the_prefill_part_and_scales_reach_both_parts():
    """A mixed batch over an fp8 cache whose prefill part plans the expansion once per call: run() expands the
    caller's cache and binds the prefill kernel to the 16-bit rows (it bound the raw fp8 cache before, which that
    kernel reads as 16-bit rows), after every argument is checked, and the decode part takes the scales."""
    with fake_driver() as calls:
        pt = kvattn.PageTable.from_kv_lens(np.array([4096, 900, 900]), 16, rng=np.random.default_rng(0))
        qo = np.array([0, 4096, 4097, 4098], np.int32)
        w = kvattn.BatchMixedWithPagedKVCache()
        w.plan(qo, pt, 32, 8, 128, causal=True, kv_dtype="float8_e4m3fn")
        fp8 = w._pre._fp8
        assert fp8 is not None and not w.last_plan["fused"]
        k = kvattn.empty((pt.num_pages_used, 16, 8, 128), "float8_e4m3fn")
        q = kvattn.empty((4098, 32, 128), "bfloat16")
        n = len(calls)
        with pytest.raises(ValueError, match="^q: expected shape"):
            w.run(q[:4000], k, k, k_scale=0.5, v_scale=2.0)
        assert not [c for c in calls.names(n) if c.startswith("cuLaunch")]
        n = len(calls)
        w.run(q, k, k, k_scale=0.5, v_scale=2.0)
        launched = [int(args[0]) for name, args in calls[n:] if name.startswith("cuLaunchKernel")]
        assert launched[0] == int(fp8._launch.kernel.function)   # the expansion first
        pre, dec = w.last_plan["prefill_plan"], w.last_plan["decode_plan"]
        assert pre.info["params"]["k"] == fp8.ws_k.ptr and pre.info["params"]["v"] == fp8.ws_v.ptr
        assert dec.info["params"]["k"] == k.ptr
        assert (dec.info["params"]["k_scale"], dec.info["params"]["v_scale"]) == (0.5, 2.0)
