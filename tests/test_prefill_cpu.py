"""CPU tests of the prefill scheduler, the prefill wrapper's validation and its parameter struct."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvattn
from kvattn import compiler, kernels, scheduler
from kvattn.prefill import (CONFIGS, PREFILL_PARAMS, BatchPrefillWithPagedKVCache, BatchPrefillWithRaggedKVCache,
                            choose_cta_rows, prefill_spec, smem_bytes,
                            SM90_HEAD_DIMS, sm90_smem_bytes, sm90_spec)
from kvattn.formats import PageTable
from kvattn.variants import Variant


def coverage(plan, qo, kv, group, causal, window_left):
    """Check every allowed (request, token, head, kv position) is covered exactly once; returns nothing."""
    qo, kv = np.asarray(qo), np.asarray(kv)
    qo_start = np.concatenate([[0], np.cumsum(qo)])
    cover = {}
    for it in plan.items:
        req, row0, nrows, kb, ke, part, pstride, _ = (int(x) for x in it)
        assert 0 <= kb <= ke <= kv[req] and 1 <= nrows
        assert (part < 0) == (pstride == 1 and part == -1) or part >= 0
        for r in range(row0, row0 + nrows):
            cover.setdefault((req, r), []).append((kb, ke, part, pstride, row0 // group))
    # partial rows written by items are all distinct and merged exactly once
    written = []
    for (req, r), spans in cover.items():
        tok = r // group
        spans.sort()
        # contiguous, non-overlapping, covering [lo, hi)
        diag = kv[req] - qo[req] + tok
        lo = 0 if window_left < 0 else max(0, diag - window_left)
        hi = min(kv[req], diag + 1) if causal else kv[req]
        assert spans[0][0] <= max(lo, 0) or spans[0][0] == spans[0][1]
        assert spans[-1][1] >= min(hi, kv[req])
        for a, b in zip(spans, spans[1:]):
            assert a[1] == b[0]
        if len(spans) == 1:
            assert spans[0][2] == -1
        else:
            for kb, ke, part, pstride, t_lo in spans:
                written.append((part + (tok - t_lo) * pstride, r % group, req))
    for req in range(qo.size):
        for r in range(qo[req] * group):
            assert (req, r) in cover, f"request {req} packed row {r} not covered"
    assert len(cover) == int((qo * group).sum())
    # merges: each merged output token gathers exactly the partial rows of its chunks
    merged = {}
    for m in range(plan.num_merge):
        rows = range(plan.merge_indptr[m], plan.merge_indptr[m + 1])
        tok = int(plan.merge_rows[m])
        req = int(np.searchsorted(qo_start, tok, side="right") - 1)
        assert tok not in merged
        merged[tok] = set(rows)
        assert all(0 <= x < plan.num_partial_rows for x in rows)
    for prow, h, req in written:
        assert any(prow in s for s in merged.values())
    seen = [x for s in merged.values() for x in s]
    assert len(seen) == len(set(seen))


@settings(max_examples=60, deadline=None)
@given(qo=st.lists(st.integers(0, 300), min_size=1, max_size=6), extra=st.lists(st.integers(0, 5000), min_size=6,
       max_size=6), group=st.sampled_from([1, 3, 4, 8, 40]), hkv=st.sampled_from([1, 8]),
       rows=st.sampled_from([16, 64, 128]), causal=st.booleans(), window=st.sampled_from([-1, 0, 100]),
       sms=st.sampled_from([4, 132]))
def test_plan_covers_each_pair_once(qo, extra, group, hkv, rows, causal, window, sms):
    kv = [q + e for q, e in zip(qo, extra)] if causal else extra[:len(qo)]
    plan = scheduler.plan_prefill(qo, kv, group, hkv, rows, causal=causal, window_left=window, num_sms=sms)
    coverage(plan, qo, kv, group, causal, window)
    again = scheduler.plan_prefill(qo, kv, group, hkv, rows, causal=causal, window_left=window, num_sms=sms)
    assert np.array_equal(plan.items, again.items)      # deterministic
    mi, mp, mm = scheduler.prefill_bounds(len(qo), max(sum(qo), 1), group, hkv, rows, num_sms=sms)
    assert plan.num_items <= mi and plan.num_partial_rows <= mp and plan.num_merge <= mm


def test_long_append_is_split_into_one_wave():
    plan = scheduler.plan_prefill([256], [65536 + 256], 4, 8, 128, causal=True, num_sms=132, ctas_per_sm=2)
    assert plan.split and plan.num_items * 8 <= 264
    lens = plan.items[:, 4] - plan.items[:, 3]
    assert lens.max() <= 1.1 * lens.mean()


def test_many_tiles_do_not_split_and_go_heavy_first():
    plan = scheduler.plan_prefill([8192], [8192], 4, 8, 128, causal=True)
    assert not plan.split
    lens = plan.items[:, 4] - plan.items[:, 3]
    assert (np.diff(lens) <= 0).all()


def test_head_slices_when_group_exceeds_tile():
    plan = scheduler.plan_prefill([3], [100], 40, 1, 16)
    assert plan.head_slices == 3 and plan.num_items == 9
    coverage(plan, [3], [100], 40, False, -1)


def test_causal_needs_kv_ge_qo():
    with pytest.raises(ValueError, match="kv_len >= qo_len"):
        scheduler.plan_prefill([5], [4], 1, 1, 16, causal=True)


def test_choose_cta_rows():
    assert choose_cta_rows(16, 128) == 16 and choose_cta_rows(17, 128) == 64 and choose_cta_rows(4096, 128) == 128
    assert choose_cta_rows(4096, 256) == 64


def test_param_struct_size_matches_c_struct():
    src = '#include "prefill.cuh"\n' + kernels.size_assert("kvattn::PrefillParams", PREFILL_PARAMS)
    compiler.compile_cubin(src, "prefill_asserts.cu", [], [], "sm_90a")


def test_variant_types():
    assert Variant().decode_type() == "kvattn::Builtin<false, false, false>"
    assert Variant(True, False, True).prefill_type() == "kvattn::Builtin<true, false, true>"
    with pytest.raises(ValueError):
        Variant(custom_mask=True).decode_type()


def test_smem_fits():
    for d in (64, 128, 256):
        for r in CONFIGS:
            if d == 256 and r == 128:
                continue
            assert smem_bytes(d, r) <= 227 * 1024


def _ragged():
    return BatchPrefillWithRaggedKVCache(num_sms=132)


@pytest.mark.parametrize("kw, err, match", [
    (dict(causal=True, kv_indptr=[0, 3, 10]), ValueError, "kv_len >= qo_len"),
    (dict(head_dim=96), ValueError, "head_dim"),
    (dict(num_qo_heads=6, num_kv_heads=4), ValueError, "multiple of num_kv_heads"),
    (dict(q_dtype="float32"), TypeError, "q_dtype"),
    (dict(kv_dtype="float16"), TypeError, "kv_dtype"),
    (dict(custom_mask=np.ones(5, bool)), ValueError, "custom_mask"),
    (dict(custom_mask=np.ones(4, np.uint8)), ValueError, "mask_indptr"),
    (dict(custom_mask=np.ones(4, np.uint8), mask_indptr=[0, 2, 4]), ValueError, "mask bytes"),
    (dict(custom_mask=np.ones(4, np.float32)), TypeError, "custom_mask"),
    (dict(qo_indptr=[0, 4, 3]), ValueError, "non-decreasing"),
    (dict(kv_indptr=[0, 10]), ValueError, "kv_indptr"),
    (dict(window_left=-2), ValueError, "window_left"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
])
def test_plan_rejects_bad_input(kw, err, match):
    args = dict(qo_indptr=[0, 4, 6], kv_indptr=[0, 10, 20], num_qo_heads=8, num_kv_heads=2, head_dim=128)
    args.update(kw)
    with pytest.raises(err, match=match):
        _ragged().plan(**args)


def test_graph_mode_needs_bounds_and_checks_them():
    with pytest.raises(ValueError, match="max_total_qo"):
        BatchPrefillWithPagedKVCache(use_cuda_graph=True, max_batch_size=4, max_num_pages=10, num_sms=132)
    with pytest.raises(ValueError, match="max_num_pages"):
        BatchPrefillWithPagedKVCache(use_cuda_graph=True, max_batch_size=4, max_total_qo=10, num_sms=132)


def test_paged_plan_rejects_bad_page_table():
    w = BatchPrefillWithPagedKVCache(num_sms=132)
    with pytest.raises(TypeError, match="PageTable"):
        w.plan([0, 1], [0, 1], 8, 2, 128)
    pt = PageTable(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([3], np.int32), 16)
    with pytest.raises(ValueError, match="qo_indptr"):
        w.plan([0, 1, 2], pt, 8, 2, 128)


def test_prefill_specs_are_registered():
    from kvattn import prefill  # noqa: F401
    specs = kernels.REGISTRY["prefill"]
    assert prefill_spec(128, 128, Variant(), "bfloat16") in specs and len(specs) <= 14
    assert sm90_spec(128, Variant(), "bfloat16") in specs
    assert sm90_spec(128, Variant(), "bfloat16", interleaved=True) in specs


def test_sm90_smem_fits_and_mirrors_the_kernel():
    for d in SM90_HEAD_DIMS:
        assert sm90_smem_bytes(d) <= 227 * 1024
    src = ('#include "prefill_sm90.cuh"\n'
           + "".join(f"static_assert(kvattn::PrefillSm90<{kernels.attn_types(d, 'bfloat16')}, "
                     f"kvattn::Builtin<false, false, false>>::SMEM_BYTES == {sm90_smem_bytes(d)}, \"smem\");\n"
                     for d in SM90_HEAD_DIMS))
    from kvattn import prefill
    defines = [f"-D{name}={value}" for name, value in prefill.SM90_TUNING]   # (KVATTN_TEST_SM90_DEFINES)
    compiler.compile_cubin(src, "sm90_asserts.cu", defines, [], "sm_90a")


def test_backend_is_checked():
    with pytest.raises(ValueError, match="backend"):
        BatchPrefillWithRaggedKVCache(backend="fa3")


@pytest.mark.parametrize("d", SM90_HEAD_DIMS)
def test_sm90_kernels_compile_without_spills_or_serialized_wgmma(d):
    # (head_dim 256's custom-mask instance spills 40 bytes beside its 80-token tiles: "auto" gives it to the
    # mma.sync kernel, as it does the all-variants instance)
    variants = (Variant(), Variant(soft_cap=True), Variant(window=True)) + ((Variant(custom_mask=True),) if d < 256 else ())
    for variant in variants:
        compiled, _ = sm90_spec(d, variant, "bfloat16").compile("sm_90a")
        assert all(r.spill_stores == 0 for r in compiled.resources.values()), compiled.log
        assert "serialized" not in compiled.log, compiled.log


@pytest.mark.parametrize("defs", [(("KVATTN_SM90_STREAM", 0),), (("KVATTN_SM90_EARLY", 0),), (("KVATTN_SM90_KVSPLIT", 1),),
                                  (("KVATTN_SM90_STAGES", 2), ("KVATTN_SM90_QBUF", 2)), (("KVATTN_SM90_LAZY", 0),),
                                  (("KVATTN_SM90_SHIFT", 0),), (("KVATTN_SM90_PTAIL", 0),),
                                  (("KVATTN_SM90_N", 144), ("KVATTN_SM90_STAGES", 2), ("persistent", 0)),
                                  (("KVATTN_SM90_N", 160), ("KVATTN_SM90_STAGES", 2), ("persistent", 0)),
                                  (("KVATTN_SM90_STAGES", 2), ("persistent", 0)),
                                  (("KVATTN_SM90_LAZY_MAX", 0),),
                                  (("KVATTN_SM90_BOUNDS", 0), ("KVATTN_SM90_STSM", 0)),
                                  (("KVATTN_SM90_BOUNDS", 0),), (("KVATTN_GROUP_MAGIC", 0),),
                                  (("KVATTN_SM90_QHALF", 1),), (("KVATTN_SM90_QHALF", 2),),
                                  (("KVATTN_SM90_QHALF", 2), ("persistent", 0)),
                                  (("KVATTN_GROUP_MAGIC", 0), ("persistent", 0)),
                                  (("KVATTN_SM90_NARROW", 1),), (("KVATTN_SM90_NARROW", 1), ("persistent", 0))])
def test_sm90_experiment_builds_compile_without_spills(defs, monkeypatch):
    """The build switches scripts/ab_sm90.py times against the default stay correct builds: the persistent
    head_dim 128 instance (("persistent", 0): the CTA-a-unit one) compiles with no spills and its shared memory
    mirrored by Python (a static_assert)."""
    from kvattn import prefill
    persistent = dict(defs).get("persistent", 1) == 1
    monkeypatch.setattr(prefill, "SM90_TUNING", tuple(d for d in defs if d[0] != "persistent"))
    compiled, _ = sm90_spec(128, Variant(), "bfloat16", persistent=persistent).compile("sm_90a")
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in compiled.resources.values()), compiled.log
    # ptxas serialising the wgmmas (C7515) cost a build 25% everywhere with no spill to show for it (run 33a)
    assert "serialized" not in compiled.log, compiled.log


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_exp2_poly_build_compiles_without_spills(d, monkeypatch):
    """ab_sm90.py --exp2poly's build (KVATTN_SM90_EXP2_POLY: a share of the exp2s by polynomial) at the head dims it
    is for: no spills, no serialised wgmma."""
    from kvattn import prefill
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_EXP2_POLY", 3),))
    compiled, _ = sm90_spec(d, Variant(), "bfloat16").compile("sm_90a")
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in compiled.resources.values()), compiled.log
    assert "serialized" not in compiled.log, compiled.log


@pytest.mark.parametrize("obuf", [1, 0])
@pytest.mark.parametrize("interleaved", [False, True])
def test_sm90_three_consumer_warpgroups_build(interleaved, obuf, monkeypatch):
    """ab_sm90.py --wg3's build (KVATTN_SM90_WG3: three consumer warpgroups, 192 query rows, 512 threads; O from its
    own buffer or per thread): the host's mirrors of its rows, threads and shared memory (the spec's static_asserts),
    no serialised wgmma; a CTA a unit spills nothing; persistent, the producers' 32 registers spill a few words (the
    A/B times it as it is)."""
    from kvattn import prefill
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_WG3", 1), ("KVATTN_SM90_OBUF", obuf)))
    assert (prefill.sm90_rows(), prefill.sm90_threads(), prefill.sm90_q_box_rows(sm90_spec(64, Variant(), "bfloat16"))
            ) == (192, 512, 192)
    assert sm90_smem_bytes(64) == (192 * 64 + 3 * 128 * 128 + obuf * 192 * 64) * 2 + 7 * 8   # (Q, stages, O buffer)
    for persistent in (False, True):
        compiled, _ = sm90_spec(64, Variant(), "bfloat16", persistent=persistent,
                                interleaved=interleaved).compile("sm_90a")
        spills = sum(r.spill_stores for r in compiled.resources.values())
        assert spills <= (24 if persistent else 0), compiled.log
        assert "serialized" not in compiled.log, compiled.log
    with pytest.raises(Exception, match="WG3"):   # head dim 128's registers do not fit three consumers
        sm90_spec(128, Variant(), "bfloat16").compile("sm_90a")


@pytest.mark.parametrize("qbuf,stages", [(2, 3), (1, 4), (2, 4)])
@pytest.mark.parametrize("long_tiles,interleaved", [(False, False), (True, False), (False, True)])
def test_sm90_head_dim_64_ring_builds_compile_without_spills(qbuf, stages, long_tiles, interleaved, monkeypatch):
    """ab_sm90.py --ring64's builds (head dim 64, KVATTN_SM90_QBUF=2 and / or KVATTN_SM90_STAGES=4) on the tiles the
    defaults' rule gives them (192 tokens on ragged K / V where it pays, 128 else and on paged caches): no spills, no
    serialised wgmma, their Q tiles and stages in the mirrored shared memory (two Q tiles and 4 stages of 192 tokens:
    229 KB of the 227 KiB)."""
    from kvattn import prefill
    monkeypatch.setattr(prefill, "SM90_TUNING", tuple((k, v) for k, v in (("KVATTN_SM90_QBUF", qbuf),
                                                                          ("KVATTN_SM90_STAGES", stages)) if v not in (1, 3)))
    spec = sm90_spec(64, Variant(), "bfloat16", persistent=True, interleaved=interleaved, long_tiles=long_tiles)
    compiled, _ = spec.compile("sm_90a")
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in compiled.resources.values()), compiled.log
    assert "serialized" not in compiled.log, compiled.log
    n = 192 if long_tiles else 128
    assert sm90_smem_bytes(64, defines=spec.defines) == (qbuf * 128 * 64 + stages * n * 128) * 2 + (2 * stages + qbuf) * 8


def test_sm90_three_consumer_warpgroups_plan(monkeypatch):
    """The host side of the WG3 build (the driver faked): with its tuning a head-dim-64 ragged plan takes 192-row units
    on the 512-thread instance with its shared memory, the query map's boxes are 192 packed rows (48 tokens of 4
    heads) and the output map's 64, and run() launches 512 threads; without the tuning a 192-row tile is refused."""
    from _fake_driver import fake_driver
    from kvattn import prefill
    qo, kv = [700, 33], [900, 700]
    with fake_driver() as calls:
        monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_WG3", 1),))
        w = BatchPrefillWithRaggedKVCache(backend="sm90")
        w.plan(np.cumsum([0] + qo), np.cumsum([0] + kv), 32, 8, 64, causal=True)
        info = w.last_plan.info
        assert (info["backend"], info["cta_rows"], info["threads"]) == ("sm90", 192, 512)
        assert info["smem"] == sm90_smem_bytes(64) and info["tma_q"] and info["tma_o"]
        assert info["schedule"].items[:, 2].max() == 192   # (a unit's packed rows)
        q, out = kvattn.empty((sum(qo), 32, 64), "bfloat16"), kvattn.empty((sum(qo), 32, 64), "bfloat16")
        k, v = kvattn.empty((sum(kv), 8, 64), "bfloat16"), kvattn.empty((sum(kv), 8, 64), "bfloat16")
        n = len(calls)
        w.run(q, k, v, out=out)
        boxes = {a[2]: [int(x) for x in a[5]] for name, a in calls[n:] if name == "cuTensorMapEncodeTiled"}
        assert boxes[q.ptr] == [64, 4, 1, 48] and boxes[out.ptr] == [64, 4, 1, 16]
        launches = [a for name, a in calls[n:] if name.startswith("cuLaunchKernel")]
        assert any(a[4:7] == (512, 1, 1) for a in launches)
        monkeypatch.setattr(prefill, "SM90_TUNING", ())
        with pytest.raises(ValueError, match="cta_rows"):
            BatchPrefillWithRaggedKVCache(backend="sm90").plan(np.cumsum([0] + qo), np.cumsum([0] + kv), 32, 8, 64,
                                                               causal=True, cta_rows=192)


@pytest.mark.parametrize("n", [160, 192])
@pytest.mark.parametrize("persistent", [True, False])
def test_sm90_head_dim_64_long_tile_builds_compile_without_spills(n, persistent, monkeypatch):
    """ab_sm90.py --tilen64's builds (head dim 64, KV tiles of 160 / 192 tokens in 3 stages, ragged): no spills, no
    serialised wgmma, their shared memory mirrored by Python (256-token tiles spill 56-88 bytes: not built; the
    paged, interleaved builds spill 4-8 bytes, which the GPU test runs but the A/B does not time)."""
    from kvattn import prefill
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_N", n), ("KVATTN_SM90_STAGES", 3)))
    compiled, _ = sm90_spec(64, Variant(), "bfloat16", persistent=persistent).compile("sm_90a")
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in compiled.resources.values()), compiled.log
    assert "serialized" not in compiled.log, compiled.log
    assert sm90_smem_bytes(64) == (128 * 64 + 3 * n * 128) * 2 + 7 * 8


@pytest.mark.parametrize("b, s, causal, want", [
    (1, 8192, True, True), (1, 8192, False, True), (8, 2048, True, True), (4, 4096, False, True),
    (32, 1024, False, False), (32, 1024, True, False), (64, 512, True, False), (1, 640, False, False),
    (1, 1536, False, True)])
def test_head_dim_64_long_tiles_where_the_model_gains(b, s, causal, want):
    """prefill.sm90_long_tiles on run 55a's shapes and their neighbours (group 4): 192-token tiles for long units,
    128 where a unit's KV ends in a short last tile (non-causal b32_S1024: 377 -> 335 TFLOP/s with 192)."""
    from kvattn import prefill
    assert prefill.sm90_long_tiles(64, Variant(), "bfloat16", True, [s] * b, [s] * b, causal, 4) == want


@pytest.mark.parametrize("kw", [dict(head_dim=128), dict(contiguous=False), dict(variant=Variant(soft_cap=True)),
                                dict(variant=Variant(window=True)), dict(kv_dtype="float8_e4m3fn"),
                                dict(qo_lens=[0], kv_lens=[0])])
def test_head_dim_64_long_tiles_only_where_measured(kw, monkeypatch):
    """Long tiles only at head dim 64, plain variant, 16-bit contiguous ragged K / V (paged 192-token tiles spill),
    a batch with KV; SM90_LONG_TILE = 0 turns them off."""
    from kvattn import prefill
    args = dict(head_dim=64, variant=Variant(), kv_dtype="bfloat16", contiguous=True, qo_lens=[8192],
                kv_lens=[8192], causal=True, group=4)
    assert prefill.sm90_long_tiles(**args)
    assert not prefill.sm90_long_tiles(**{**args, **kw})
    monkeypatch.setattr(prefill, "SM90_LONG_TILE", 0)
    assert not prefill.sm90_long_tiles(**args)


@pytest.mark.parametrize("fused_merge", [False, True])
def test_head_dim_64_long_tile_instance(fused_merge, monkeypatch):
    """The long-tile instance (sm90_spec long_tiles): KVATTN_SM90_N = 192 in its defines, its tile and shared memory
    read from them (launch_config's smem, the tensor maps' box rows), compiled without spills; SM90_TUNING's own
    tile wins (the A/Bs)."""
    from kvattn import prefill
    spec = sm90_spec(64, Variant(), "bfloat16", persistent=True, long_tiles=True, fused_merge=fused_merge)
    assert ("KVATTN_SM90_N", 192) in spec.defines
    assert prefill.sm90_tile(64, defines=spec.defines) == (192, 3)
    assert sm90_smem_bytes(64, defines=spec.defines) == (128 * 64 + 3 * 192 * 128) * 2 + 7 * 8
    compiled, _ = spec.compile("sm_90a")   # (its SMEM_BYTES check: a static_assert against the Python mirror)
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in compiled.resources.values()), compiled.log
    assert "serialized" not in compiled.log, compiled.log
    env = _fake_launch_env(monkeypatch, "sm_90a", 0)
    cfg = env.launch_config("auto", 64, 128, Variant(), "bfloat16", long_tiles=True)
    assert ("KVATTN_SM90_N", 192) in cfg.spec.defines and cfg.smem == sm90_smem_bytes(64, defines=cfg.spec.defines)
    assert ("KVATTN_SM90_N", 192) not in env.launch_config("auto", 64, 128, Variant(), "bfloat16").spec.defines
    monkeypatch.setattr(prefill, "SM90_TUNING", (("KVATTN_SM90_N", 160),))
    assert dict(sm90_spec(64, Variant(), "bfloat16", long_tiles=True).defines)["KVATTN_SM90_N"] == 160


def _poly_exp2(x):
    """cuda_src/common.cuh poly_exp2, step by step in float32 (each fmaf one rounding)."""
    c = np.array([0.999928097, 0.693260976, 0.242610738, 0.0551715083], np.float32)
    x = np.maximum(np.asarray(x, np.float32), np.float32(-125))
    t = x + np.float32(12582912)
    f = x - (t - np.float32(12582912))
    p = c[3]
    for k in (2, 1, 0):
        p = (p.astype(np.float64) * f + c[k]).astype(np.float32)
    return (p.view(np.int32) + (t.view(np.int32) << 23)).view(np.float32)


def test_poly_exp2_within_its_bound():
    """The polynomial exp2 (its float32 steps as the kernel takes them): relative error under 7.5e-5 from 2^-125 to
    2^8 (what the softmax feeds it: scores minus a running max, at most 8 above it with the lazy max), below the
    rounding of P to fp16 (2^-11) or bf16; exact powers of two where the polynomial is (x integer: 2^0 p(0));
    anything below -125, -inf included, gives 2^-125 (times p(0))."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-125, 8, 400001), rng.uniform(-40, 8, 200000)]).astype(np.float32)
    got = _poly_exp2(x).astype(np.float64)
    assert np.max(np.abs(got / np.exp2(x.astype(np.float64)) - 1)) < 7.5e-5
    floor = _poly_exp2(np.float32(-125))   # 2^-125 p(0)
    assert floor == pytest.approx(2.0 ** -125, rel=7.5e-5)
    assert np.all(_poly_exp2(np.array([-126, -1e30, -np.inf], np.float32)) == floor)
    ints = np.arange(-125, 9, dtype=np.float32)
    assert np.array_equal(_poly_exp2(ints), (np.float32(0.999928097) * np.exp2(ints)).astype(np.float32))


class _FakeKernel:
    """A loaded kernel's ptxas report, without a GPU."""

    def __init__(self, spills):
        self.resources = compiler.Resources(168, spills, spills, 0, 0)


def _fake_launch_env(monkeypatch, arch="sm_90a", sm90_spills=0, persistent_spills=None):
    """persistent_spills: the persistent sm90 instances' spills (None: sm90_spills, as the one-unit ones)."""
    from kvattn import prefill

    def spills(spec):
        if "sm90" not in spec.header:
            return 0
        persistent = ("KVATTN_SM90_PERSIST", 1) in spec.defines
        return persistent_spills if persistent and persistent_spills is not None else sm90_spills
    monkeypatch.setattr(prefill._driver, "arch", lambda: arch)
    monkeypatch.setattr(prefill, "get_kernel", lambda spec: _FakeKernel(spills(spec)))
    return prefill


@pytest.mark.parametrize("d, rows, arch, spills, want", [
    (128, 128, "sm_90a", 0, "sm90"), (64, 128, "sm_90a", 0, "sm90"),
    (128, 64, "sm_90a", 0, "sm80"), (128, 16, "sm_90a", 0, "sm80"), (256, 64, "sm_90a", 0, "sm80"),
    (128, 128, "sm_80", 0, "sm80"), (128, 128, "sm_90a", 60, "sm80"), (256, 128, "sm_90a", 0, "sm90")])
def test_auto_backend_choice(monkeypatch, d, rows, arch, spills, want):
    prefill = _fake_launch_env(monkeypatch, arch, spills)
    cfg = prefill.launch_config("auto", d, rows, Variant(), "bfloat16")
    assert cfg.backend == want
    if want == "sm90":
        assert cfg.threads == prefill.SM90_THREADS and cfg.smem == sm90_smem_bytes(d) and cfg.ctas_per_sm == 1
    else:
        assert cfg.threads == 128 and cfg.smem == smem_bytes(d, rows)


@pytest.mark.parametrize("arch, spills, backend", [("sm_90a", 60, "auto"), ("sm_80", 0, "auto"), ("sm_90a", 0, "sm80")])
def test_head_dim_256_takes_128_rows_only_on_the_wgmma_kernel(monkeypatch, arch, spills, backend):
    prefill = _fake_launch_env(monkeypatch, arch, spills)
    assert not prefill.sm90_usable(backend, 256, Variant(), "bfloat16")
    assert prefill.choose_cta_rows(4096, 256, wgmma=False) == 64
    with pytest.raises(ValueError, match="cta_rows: 128 with head_dim 256 needs the sm90 kernel"):
        prefill.launch_config(backend, 256, 128, Variant(), "bfloat16")
    prefill = _fake_launch_env(monkeypatch, "sm_90a", 0)
    assert prefill.sm90_usable("auto", 256, Variant(), "bfloat16")
    assert prefill.choose_cta_rows(4096, 256, wgmma=True) == 128
    assert prefill.choose_cta_rows(40, 256, wgmma=True) == 64


def test_forced_backends(monkeypatch):
    prefill = _fake_launch_env(monkeypatch, "sm_90a", sm90_spills=60)
    assert prefill.launch_config("sm90", 128, 128, Variant(True, True, True), "bfloat16").backend == "sm90"
    assert prefill.launch_config("sm80", 128, 128, Variant(), "bfloat16").backend == "sm80"
    with pytest.raises(ValueError, match="backend: 'sm90' needs"):
        prefill.launch_config("sm90", 256, 64, Variant(), "bfloat16")
    prefill = _fake_launch_env(monkeypatch, "sm_80")
    with pytest.raises(ValueError, match="backend: 'sm90' needs"):
        prefill.launch_config("sm90", 128, 128, Variant(), "bfloat16")


def _baked_plan(w, plan, **kw):
    """The first graph-mode plan(): on a machine without a GPU it stops after its checks (its baked values are
    then committed by hand, as a successful plan commits them)."""
    try:
        plan(w, **kw)
    except kvattn.CudaUnavailableError:
        w._baked = w._pending_bake


@pytest.mark.parametrize("change", [dict(num_qo_heads=16), dict(head_dim=64), dict(q_dtype="float16"),
                                    dict(sm_scale=0.1), dict(window_left=100), dict(logits_soft_cap=30.0),
                                    dict(causal=False), dict(cta_rows=64), dict(num_kv_heads=4, num_qo_heads=8)])
def test_graph_mode_refuses_a_later_plan_that_changes_a_baked_value(change):
    w = kvattn.BatchPrefillWithRaggedKVCache(use_cuda_graph=True, max_batch_size=4, max_total_qo=512, num_sms=132)
    base = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, causal=True, cta_rows=128)

    def plan(w, **kw):
        args = {**base, **kw}
        w.plan([0, 40, 60], [0, 100, 140], args.pop("num_qo_heads"), args.pop("num_kv_heads"),
               args.pop("head_dim"), **args)

    _baked_plan(w, plan)
    name = [k for k in change if change[k] != base.get(k)][0]
    with pytest.raises(ValueError, match=f"in graph mode {name} is baked into the captured graph"):
        plan(w, **change)


def test_deterministic_prefill_takes_graph_mode():
    w = BatchPrefillWithRaggedKVCache(deterministic=True, use_cuda_graph=True, max_batch_size=4, max_total_qo=64)
    assert w.deterministic and w.use_cuda_graph


@pytest.mark.parametrize("d, variant, kv_dtype, persistent", [
    (128, Variant(), None, True), (64, Variant(True, True, False), None, True), (128, Variant(alibi=True), None, True),
    (256, Variant(), None, False), (128, Variant(rope=1), None, False), (128, Variant(), "float8_e4m3fn", False)])
def test_persistent_sm90_instances_and_their_grid(monkeypatch, d, variant, kv_dtype, persistent):
    """The persistent sm90 instances (16-bit caches, no fused RoPE, head_dim <= 128) are built with
    KVATTN_SM90_PERSIST and launched on min(units, SMs) CTAs; the others on one CTA per (item, KV head)."""
    prefill = _fake_launch_env(monkeypatch, "sm_90a", 0)
    cfg = prefill.launch_config("sm90", d, 128, variant, "bfloat16", kv_dtype)
    assert cfg.persistent == persistent
    assert (("KVATTN_SM90_PERSIST", 1) in cfg.spec.defines) == persistent
    assert prefill.launch_grid(cfg, 40, 8, 132) == ((132, 1, 1) if persistent else (40, 8, 1))
    assert prefill.launch_grid(cfg, 3, 8, 132) == ((24, 1, 1) if persistent else (3, 8, 1))
    monkeypatch.setattr(prefill, "SM90_PERSISTENT", False)   # the A/B switch: every instance one CTA per unit
    cfg = prefill.launch_config("sm90", d, 128, variant, "bfloat16", kv_dtype)
    assert not cfg.persistent and prefill.launch_grid(cfg, 40, 8, 132) == (40, 8, 1)
    assert prefill.launch_grid(prefill.launch_config("sm80", d if d < 256 else 128, 64, Variant(), "bfloat16"),
                               40, 8, 132) == (40, 8, 1)


@pytest.mark.parametrize("one_unit_spills, want", [(0, "sm90"), (40, "sm80")])
def test_auto_falls_back_from_a_spilling_persistent_instance(monkeypatch, one_unit_spills, want):
    """auto: where the persistent sm90 instance spills (a user variant's key transform may), the one-unit sm90
    instance if it does not, else the mma.sync kernel; backend "sm90" takes the persistent one regardless."""
    prefill = _fake_launch_env(monkeypatch, "sm_90a", one_unit_spills, persistent_spills=24)
    cfg = prefill.launch_config("auto", 128, 128, Variant(), "bfloat16")
    assert cfg.backend == want
    if want == "sm90":
        assert not cfg.persistent and ("KVATTN_SM90_PERSIST", 1) not in cfg.spec.defines
        assert prefill.launch_grid(cfg, 40, 8, 132) == (40, 8, 1)
    forced = prefill.launch_config("sm90", 128, 128, Variant(), "bfloat16")
    assert forced.persistent and prefill.launch_grid(forced, 40, 8, 132) == (132, 1, 1)


@pytest.mark.parametrize("d, variant, interleaved", [(128, Variant(), True), (128, Variant(soft_cap=True, window=True), True),
                                                     (128, Variant(), False), (64, Variant(), False)])
def test_wg_split_instances_compile_without_spills(d, variant, interleaved):
    """The persistent instance whose two consumer warpgroups split each unit's KV tiles (wg_split: tuning
    sm90_route_wg_split of the decode route of large GQA groups): paged (interleaved) and ragged tiles."""
    spec = sm90_spec(d, variant, "bfloat16", persistent=True, interleaved=interleaved, wg_split=True)
    assert ("KVATTN_SM90_WGSPLIT", 1) in spec.defines
    assert ("KVATTN_SM90_WGSPLIT", 1) not in sm90_spec(d, variant, "bfloat16", interleaved=interleaved).defines
    compiled, _ = spec.compile("sm_90a")
    assert all(r.spill_stores == 0 for r in compiled.resources.values()), compiled.log
    assert "serialized" not in compiled.log, compiled.log


@pytest.mark.parametrize("kw, match", [
    (dict(qo_indptr=[0, 3, 4], num_qo_heads=32, num_kv_heads=1), "at most 64 packed query rows a request .got 96"),
    (dict(head_dim=256), "head_dim <= 128 .got 256"),
    (dict(cta_rows=64), "cta_rows 128 .got 64"),
    (dict(kv_dtype="float8_e4m3fn"), "a 16-bit cache .got float8_e4m3"),
])
def test_wg_split_plan_refuses_what_it_does_not_fit(monkeypatch, kw, match):
    """wg_split: every request's packed rows within one warpgroup's 64, checked before any kernel is chosen."""
    _fake_launch_env(monkeypatch)
    w = _ragged()
    w.wg_split = True
    args = dict(qo_indptr=[0, 1, 2], kv_indptr=[0, 300, 700], num_qo_heads=32, num_kv_heads=1, head_dim=128,
                cta_rows=128)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        w.plan(**args)


def test_wg_split_needs_the_sm90_kernel(monkeypatch):
    prefill = _fake_launch_env(monkeypatch, "sm_80")
    with pytest.raises(ValueError, match="wg_split: needs the sm90 kernel"):
        prefill.launch_config("auto", 128, 128, Variant(), "bfloat16", wg_split=True)
    prefill = _fake_launch_env(monkeypatch, "sm_90a")
    cfg = prefill.launch_config("auto", 128, 128, Variant(), "bfloat16", wg_split=True)
    assert cfg.backend == "sm90" and ("KVATTN_SM90_WGSPLIT", 1) in cfg.spec.defines



@pytest.mark.parametrize("group", list(range(1, 257)))
def test_group_magic_divides_every_row_exactly(group):
    """The plan's (mul, shift) for the kernels' row_token (KVATTN_GROUP_MAGIC): (x * mul) >> shift == x // group on
    small rows, random ones up to 2^31 - 1, multiples of the group and their neighbours; mul fits 32 bits."""
    from kvattn.prefill import group_magic
    mul, shift = group_magic(group)
    assert 0 < mul < 1 << 32
    rng = np.random.default_rng(group)
    x = np.concatenate([np.arange(1 << 14), rng.integers(0, 2**31, 1 << 14), [2**31 - 1],
                        np.arange(1, 1 << 12) * group * 524287 % 2**31]).astype(np.uint64)
    x = np.concatenate([x, x - (x > 0), np.minimum(x + 1, 2**31 - 1)])
    assert np.array_equal((x * np.uint64(mul)) >> np.uint64(shift), x // np.uint64(group))


def _walk_makespan(plan, hkv, nb, causal):
    """The slowest persistent CTA's summed unit costs (the TAIL_* model of kvattn.scheduler) over the plan's items
    in the sm90 kernel's snake walk, counted one unit at a time (independent of the scheduler's vectorised
    version)."""
    hg = plan.kv_head_group
    W = plan.num_items
    hg = hg if 0 < hg < hkv and hkv % hg == 0 and W * hg >= nb else hkv
    loads = [0.0] * nb
    for g in range(hkv // hg):
        for local in range(W * hg):
            r, c = divmod(local, nb)
            it = plan.items[local // hg]
            tiles = -(-int(it[4] - it[3]) // 128)
            cost = scheduler.TAIL_UNIT_TILES + tiles + (scheduler.TAIL_PART_TILES if it[5] >= 0 else 0)
            if causal and int(it[4]) == int(plan.items[:, 4][(plan.items[:, 0] == it[0]) & (plan.items[:, 1] == it[1])].max()):
                cost += scheduler.TAIL_MASK_TILES
            loads[nb - 1 - c if r & 1 else c] += cost
    return max(loads)


def test_tail_split_fills_the_last_round(monkeypatch):
    """Non-causal b1_S8192 at Hq32 / Hkv8 on 132 persistent CTAs: 2048 equal units walk 16 rounds where 15.5 would
    do; with persistent_ctas the walk's last 9 blocks are cut into 5 chunks each (every pair still covered once,
    merged once), and the model's slowest CTA gains. A balanced causal walk, and persistent_ctas 0, keep the plan."""
    monkeypatch.setattr(scheduler, "WALK_BALANCE", False)
    qo = [8192]
    plain = scheduler.plan_prefill(qo, qo, 4, 8, 128, num_sms=132, kv_bytes_per_token=4096)
    cut = scheduler.plan_prefill(qo, qo, 4, 8, 128, num_sms=132, kv_bytes_per_token=4096, persistent_ctas=132)
    assert not plain.split and cut.split and cut.max_chunks == 5 and cut.num_items == 256 - 9 + 45
    coverage(cut, qo, qo, 4, False, -1)
    before, after = _walk_makespan(plain, 8, 132, False), _walk_makespan(cut, 8, 132, False)
    assert after <= before * (1 - scheduler.TAIL_MIN_GAIN)
    causal = dict(causal=True, num_sms=132, kv_bytes_per_token=4096)
    assert np.array_equal(scheduler.plan_prefill(qo, qo, 4, 8, 128, persistent_ctas=132, **causal).items,
                          scheduler.plan_prefill(qo, qo, 4, 8, 128, **causal).items)


@settings(max_examples=40, deadline=None)
@given(qo=st.lists(st.integers(1, 200), min_size=1, max_size=6), extra=st.lists(st.integers(0, 3000), min_size=6,
       max_size=6), group=st.sampled_from([1, 4, 8]), hkv=st.sampled_from([1, 2, 8]), causal=st.booleans(),
       ctas=st.sampled_from([3, 17, 132]))
def test_tail_split_keeps_coverage_and_only_gains(qo, extra, group, hkv, causal, ctas):
    """Any batch with persistent_ctas (the walk balance off): every (row, KV position) covered once and merged
    once; where the plan changes, the model's slowest CTA gains at least TAIL_MIN_GAIN."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "WALK_BALANCE", False)
        _tail_split_case(qo, extra, group, hkv, causal, ctas)


@settings(max_examples=60, deadline=None)
@given(qo=st.lists(st.integers(1, 3000), min_size=1, max_size=8), extra=st.lists(st.integers(0, 5000), min_size=8,
       max_size=8), group=st.sampled_from([1, 4, 8]), hkv=st.sampled_from([1, 2, 8]), causal=st.booleans(),
       ctas=st.sampled_from([3, 17, 132]))
def test_tail_split_early_refusal_is_exact(qo, extra, group, hkv, causal, ctas):
    """scheduler._tail_cannot_gain (the bound that skips the cut candidates' evaluation) never refuses a cut the
    full evaluation would take: the same plan with the bound switched off."""
    _same_plan_without(scheduler, "_tail_cannot_gain", qo, extra, group, hkv, causal, ctas, 512)


def _same_plan_without(module, bound, qo, extra, group, hkv, causal, ctas, bytes_per_head):
    """The persistent plan equals the one with module.<bound> (an early refusal) switched off."""
    kv = [q + e for q, e in zip(qo, extra)]
    kw = dict(causal=causal, num_sms=ctas, kv_bytes_per_token=hkv * bytes_per_head, persistent_ctas=ctas)
    with_bound = module.plan_prefill(qo, kv, group, hkv, 128, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, bound, lambda *args: False)
        without = module.plan_prefill(qo, kv, group, hkv, 128, **kw)
    assert np.array_equal(with_bound.items, without.items) and with_bound.max_chunks == without.max_chunks


def test_tail_split_refuses_causal_b8_s2048_early(monkeypatch):
    """Issue 13's causal b8_S2048 (Hq32 / Hkv8, 132 persistent CTAs): the walk is not cut, and the bound says so
    before the candidates are evaluated."""
    said = []
    bound = scheduler._tail_cannot_gain
    monkeypatch.setattr(scheduler, "_tail_cannot_gain", lambda *args: said.append(bound(*args)) or said[-1])
    qo = [2048] * 8
    kw = dict(causal=True, num_sms=132, kv_bytes_per_token=4096, persistent_ctas=132)
    plan = scheduler.plan_prefill(qo, qo, 4, 8, 128, **kw)
    assert said == [True] and not plan.split


def _tail_split_case(qo, extra, group, hkv, causal, ctas):
    kv = [q + e for q, e in zip(qo, extra)]
    kw = dict(causal=causal, num_sms=ctas, kv_bytes_per_token=hkv * 512)
    plain = scheduler.plan_prefill(qo, kv, group, hkv, 128, **kw)
    cut = scheduler.plan_prefill(qo, kv, group, hkv, 128, persistent_ctas=ctas, **kw)
    coverage(cut, qo, kv, group, causal, -1)
    if plain.split or np.array_equal(plain.items, cut.items):
        assert np.array_equal(plain.items, cut.items)   # an already split plan is never cut again
        return
    nb = min(ctas, plain.num_items * hkv)
    assert _walk_makespan(cut, hkv, nb, causal) <= _walk_makespan(plain, hkv, nb, causal) * (1 - scheduler.TAIL_MIN_GAIN) + 1e-9


def _plans_both_ways(qo, kv, group, hkv, **kw):
    """(snake, placed): plan_prefill with the walk balance off and on."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "WALK_BALANCE", False)
        snake = scheduler.plan_prefill(qo, kv, group, hkv, 128, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "WALK_BALANCE", True)
        return snake, scheduler.plan_prefill(qo, kv, group, hkv, 128, **kw)


@settings(max_examples=40, deadline=None)
@given(qo=st.lists(st.integers(1, 400), min_size=1, max_size=12), extra=st.lists(st.integers(0, 3000), min_size=12,
       max_size=12), group=st.sampled_from([1, 4, 8]), hkv=st.sampled_from([1, 2, 8]), causal=st.booleans(),
       ctas=st.sampled_from([3, 17, 132]), bpt=st.sampled_from([0, 512, 8192]))
def test_walk_balance_places_the_same_items_and_only_gains(qo, extra, group, hkv, causal, ctas, bpt):
    """The walk balance (scheduler.WALK_BALANCE) only moves items: the same items as the snake's plan, every
    (row, KV position) covered and merged once, each item in its L2 window (the windows stay in order); where the
    order changes, the model's slowest CTA (counted unit by unit, _walk_makespan) gains at least TAIL_MIN_GAIN,
    and scheduler.walk_makespan agrees with the unit-by-unit count."""
    kv = [q + e for q, e in zip(qo, extra)]
    kvb = hkv * bpt
    snake, placed = _plans_both_ways(qo, kv, group, hkv, causal=causal, num_sms=ctas, kv_bytes_per_token=kvb,
                                     persistent_ctas=ctas)
    coverage(placed, qo, kv, group, causal, -1)
    assert sorted(map(tuple, placed.items.tolist())) == sorted(map(tuple, snake.items.tolist()))
    win = scheduler._l2_windows(np.asarray(kv, np.int64), kvb * placed.kv_head_group // hkv)
    assert np.all(np.diff(win[placed.items[:, 0]]) >= 0)
    nb = min(ctas, placed.num_items * hkv)
    for plan in (snake, placed):
        assert scheduler.walk_makespan(plan, hkv, nb, causal, qo, kv, group) == pytest.approx(
            _walk_makespan(plan, hkv, nb, causal))
    if not np.array_equal(snake.items, placed.items):
        assert _walk_makespan(placed, hkv, nb, causal) <= _walk_makespan(snake, hkv, nb, causal) * (
            1 - scheduler.TAIL_MIN_GAIN) + 1e-9


@settings(max_examples=60, deadline=None)
@given(qo=st.lists(st.integers(1, 3000), min_size=1, max_size=12), extra=st.lists(st.integers(0, 5000), min_size=12,
       max_size=12), equal=st.booleans(), group=st.sampled_from([1, 4, 8]), hkv=st.sampled_from([1, 2, 8]),
       causal=st.booleans(), ctas=st.sampled_from([3, 17, 132]), bpt=st.sampled_from([0, 512]))
def test_walk_balance_early_refusal_is_exact(qo, extra, equal, group, hkv, causal, ctas, bpt):
    """scheduler._walk_cannot_gain (every round's items cost the same: skip the round loop) never refuses a
    placement the loop would take: the same plan with the bound switched off; equal lengths (equal: every request
    the first one's) are where it refuses."""
    if equal:
        qo, extra = [qo[0]] * len(qo), [extra[0]] * len(qo)
    _same_plan_without(scheduler, "_walk_cannot_gain", qo, extra, group, hkv, causal, ctas, bpt)


def test_walk_balance_refuses_non_causal_b64_s512_early(monkeypatch):
    """Non-causal b64_S512 (Hq32 / Hkv8, 132 persistent CTAs: 1024 equal items, a last round partly empty): the
    loads are uneven but no placement within the rounds can move them; the bound says so before the round loop
    (run before it: 62 rounds of numpy calls, ~350 us of plan() on the CPU machine)."""
    said = []
    bound = scheduler._walk_cannot_gain
    monkeypatch.setattr(scheduler, "_walk_cannot_gain", lambda *args: said.append(bound(*args)) or said[-1])
    qo = [512] * 64
    plan = scheduler.plan_prefill(qo, qo, 4, 8, 128, causal=False, num_sms=132, kv_bytes_per_token=4096,
                                  persistent_ctas=132)
    assert said == [True] and plan.num_items == 64 * 512 * 4 // 128


def test_walk_balance_on_an_append_batch():
    """32 causal appends (1-600 new tokens on 0-3000 cached ones; Hq32 / Hkv8, 132 CTAs, 7 L2 windows): the snake
    deals the long blocks of several windows' rounds to the same CTAs (model: 348 tiles on the slowest CTA, the
    mean 298); the balanced walk's slowest CTA is at least 5% lighter (322)."""
    rng = np.random.default_rng(1)
    qo = rng.integers(1, 600, 32)
    kv = qo + rng.integers(0, 3000, 32)
    snake, placed = _plans_both_ways(qo, kv, 4, 8, causal=True, num_sms=132, kv_bytes_per_token=4096,
                                     persistent_ctas=132)
    before, after = (scheduler.walk_makespan(p, 8, 132, True, qo, kv, 4) for p in (snake, placed))
    assert after <= before * 0.95
