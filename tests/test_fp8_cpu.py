"""CPU tests of the fp8 KV cache: dtype and scale validation, every fp8 decode instance compiles without spills,
the reference's dequantisation."""
import numpy as np
import pytest

import kvattn
from kvattn import _dtypes, decode, reference
from kvattn._attn_args import check_plan_args
from kvattn.opcore import _kv_scale
from kvattn.variants import Variant

ARCH = "sm_90a"


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2", "e4m3", "e5m2"])
def test_decode_accepts_fp8_caches(kv):
    r = check_plan_args(32, 8, 128, "bfloat16", kv, -1, 0.0, fp8_kv=True)
    assert r[4] == _dtypes.dtype_name(kv) and _dtypes.is_fp8(r[4])


def test_fp8_refused_where_not_built():
    with pytest.raises(TypeError, match="kv_dtype: expected q_dtype"):
        check_plan_args(32, 8, 128, "bfloat16", "float8_e4m3fn", -1, 0.0)
    with pytest.raises(TypeError, match="kv_dtype"):
        check_plan_args(32, 8, 128, "bfloat16", "float16", -1, 0.0, fp8_kv=True)


def test_fp8_with_rope_refused_before_any_gpu_call():
    w = kvattn.BatchDecodeWithPagedKVCache()
    pt = kvattn.PageTable.from_kv_lens(np.array([5]), 16)
    with pytest.raises(ValueError, match="rope: fused RoPE"):
        w.plan(pt, 8, 2, 128, kv_dtype="float8_e4m3fn", rope=kvattn.RoPE())


@pytest.mark.parametrize("bad, exc, msg", [
    (-1.0, ValueError, "k_scale: expected a positive finite"), (0.0, ValueError, "positive"),
    (float("nan"), ValueError, "positive finite"), (float("inf"), ValueError, "positive finite"),
    (np.array([1, 2], np.float64), TypeError, "k_scale: expected a float32 array"),
    (np.array([1, -2, 1, 1], np.float32), ValueError, "k_scale: every per-head scale"),
    (np.array([1, np.nan, 1, 1], np.float32), ValueError, "positive and finite"),
])
def test_scale_validation(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        _kv_scale(bad, "k_scale", 4, None, False)


def test_float_scales_pack_without_a_device():
    assert _kv_scale(None, "k_scale", 4, None, False) == (0, 1.0, None)
    assert _kv_scale(0.25, "v_scale", 4, None, False) == (0, 0.25, None)


def test_reference_dequantises_the_cache():
    rng = np.random.default_rng(1)
    pt = kvattn.PageTable.from_kv_lens(np.array([40, 7]), 16, rng=rng)
    shape = (pt.num_pages_used, 16, 2, 64)
    k8 = rng.standard_normal(shape).astype(_dtypes.to_numpy("e4m3"))
    v8 = rng.standard_normal(shape).astype(_dtypes.to_numpy("e5m2"))
    q = rng.standard_normal((2, 4, 64))
    ks, vs = np.array([0.5, 2.0]), 0.125
    got = reference.batch_attention_paged(q, k8, v8, np.arange(3), pt, k_scale=ks, v_scale=vs)
    kd = k8.astype(np.float64) * ks[None, None, :, None]
    vd = v8.astype(np.float64) * vs
    assert np.array_equal(got, reference.batch_attention_paged(q, kd, vd, np.arange(3), pt))
    with pytest.raises(ValueError, match="k_scale: expected a float or \\[2\\]"):
        reference.batch_attention_paged(q, k8, v8, np.arange(3), pt, k_scale=np.ones(3))


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("q", ["bfloat16", "float16"])
def test_fp8_decode_instances_compile_without_spills(kv, q):
    for d in decode.HEAD_DIMS:
        for v in (Variant(), Variant(soft_cap=True, window=True)):
            spec = decode.decode_spec(d, 1, v, q, kv_dtype=kv)
            compiled, _ = spec.compile(ARCH)
            (res,) = compiled.resources.values()
            assert res.spill_stores == 0 and res.spill_loads == 0, (d, v, res)


def test_prefill_fp8_with_rope_refused_before_any_gpu_call():
    w = kvattn.BatchPrefillWithRaggedKVCache()
    indptr = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="rope: fused RoPE"):
        w.plan(indptr, indptr, 8, 2, 128, kv_dtype="float8_e5m2", rope=kvattn.RoPE())


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_prefill_instances_compile_without_spills(kv):
    from kvattn import prefill
    specs = [prefill.prefill_spec(d, rows, Variant(), "bfloat16", kv) for d in (64, 128, 256)
             for rows in prefill.CONFIGS if not (d == 256 and rows == 128)]
    # (head_dim 256 with an fp8 cache spills a few consumer registers on the sm90 kernel (224 of them beside 128
    # O accumulators): "auto" gives it to the mma.sync kernel (test_prefill_cpu.py::test_auto_backend_choice))
    specs += [prefill.sm90_spec(d, v, t, kv) for d in (64, 128) for t in ("bfloat16", "float16")
              for v in (Variant(), Variant(soft_cap=True, window=True))]
    for spec in specs:
        compiled, _ = spec.compile(ARCH)
        (res,) = compiled.resources.values()
        assert res.spill_stores == 0 and res.spill_loads == 0, (spec.kernel, res)
        assert "__nv_fp8" in spec.kernel


def test_a_16bit_cache_given_or_not_is_one_prefill_instance():
    """A 16-bit cache is q's type: the same kernel (and cache entry) whether kv_dtype is given or not."""
    from kvattn import prefill
    assert prefill.prefill_spec(128, 128, Variant(), "bfloat16", "bfloat16").kernel == \
        prefill.prefill_spec(128, 128, Variant(), "bfloat16").kernel
    assert "fp8" not in prefill.sm90_spec(128, Variant(), "float16").kernel


def test_fp8_expand_once_policy():
    """kvattn.fp8_expand.wanted: an fp8 cache is expanded once per call where the queries re-read it (on average at
    least MIN_QUERY_TILES 128-row query tiles a request), always with "once", never with "kernel", in graph mode, for
    a 16-bit cache or an unbuilt head dim."""
    from kvattn import fp8_expand
    long_prompts, appends = np.array([2048, 1024]), np.array([16, 1, 30])
    assert fp8_expand.wanted("auto", "float8_e4m3fn", 128, long_prompts, 4, False)
    assert not fp8_expand.wanted("auto", "float8_e4m3fn", 128, appends, 4, False)
    assert fp8_expand.wanted("once", "float8_e5m2", 64, appends, 4, False)
    assert not fp8_expand.wanted("kernel", "float8_e4m3fn", 128, long_prompts, 4, False)
    assert not fp8_expand.wanted("auto", "float8_e4m3fn", 128, long_prompts, 4, True)       # graph mode
    assert not fp8_expand.wanted("once", "bfloat16", 128, long_prompts, 4, False)
    assert not fp8_expand.wanted("once", "float8_e4m3fn", 192, long_prompts, 4, False)
    assert not fp8_expand.wanted("auto", "float8_e4m3fn", 128, np.zeros(0, np.int64), 4, False)
    assert not fp8_expand.wanted("once", "float8_e4m3fn", 128, np.ones(fp8_expand.MAX_BATCH + 1, np.int64), 4, False)
    with pytest.raises(ValueError, match="fp8_expand: expected one of"):
        fp8_expand.wanted("always", "float8_e4m3fn", 128, long_prompts, 4, False)


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_expand_kernels_compile(kv):
    """The expansion kernel (its parameter struct's size checked against kvattn's by a static_assert), no spills."""
    from kvattn import fp8_expand
    for t in ("bfloat16", "float16"):
        for d in fp8_expand.HEAD_DIMS:
            compiled, _ = fp8_expand.expand_spec(kv, t, d).compile(ARCH)
            (res,) = compiled.resources.values()
            assert res.spill_stores == 0, res
