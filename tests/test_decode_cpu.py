"""CPU tests of the decode wrapper's plan-time validation (raised before any GPU call)."""
import numpy as np
import pytest

import kvattn


def _pt():
    return kvattn.PageTable.from_kv_lens(np.array([10, 20]), 16, rng=0)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(head_dim=96), ValueError, "head_dim: expected one of"),
    (dict(num_qo_heads=6, num_kv_heads=4), ValueError, "must be a multiple of num_kv_heads"),
    (dict(q_dtype="float32"), TypeError, "q_dtype: expected float16 or bfloat16"),
    (dict(kv_dtype="float16"), TypeError, "kv_dtype: expected q_dtype"),
    (dict(window_left=-2), ValueError, "window_left: expected -1"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap: expected a finite value"),
])
def test_plan_validation(kwargs, exc, msg):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    args.update(kwargs)
    w = kvattn.BatchDecodeWithPagedKVCache()
    with pytest.raises(exc, match=msg):
        w.plan(_pt(), args.pop("num_qo_heads"), args.pop("num_kv_heads"), args.pop("head_dim"), **args)


def test_plan_needs_a_page_table():
    with pytest.raises(TypeError, match="page_table: expected a kvattn.PageTable"):
        kvattn.BatchDecodeWithPagedKVCache().plan({"indptr": [0]}, 8, 2, 128)


def test_constructor_validation():
    with pytest.raises(ValueError, match="kv_layout: expected 'NHD' or 'HND'"):
        kvattn.BatchDecodeWithPagedKVCache(kv_layout="NDH")
    with pytest.raises(ValueError, match="use_cuda_graph=True needs max_batch_size"):
        kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True)


def test_smem_formula_matches_kernel_constants():
    # The compile step's resource report has static smem only; the launch uses this formula.
    from kvattn import decode
    assert decode.smem_bytes(128, 1, 3) == (3 * (2 * 64 * 128 + 768) + 3 * 16 * 128) * 2
    assert 3 * (decode.smem_bytes(128, 1) + 1024) <= 228 * 1024   # three CTAs per SM at head_dim 128


def test_one_wave_of_chunks_never_overshoots():
    # ceil(264 / 32) = 9 chunks would launch 288 CTAs on 264 slots: a second, nearly empty wave.
    from kvattn import scheduler
    assert scheduler.default_num_chunks(32, num_sms=132, ctas_per_sm=2) == 8
    assert scheduler.default_num_chunks(8, num_sms=132, ctas_per_sm=1) == 16


@pytest.mark.parametrize("change", [dict(num_qo_heads=16), dict(head_dim=64), dict(q_dtype="float16"),
                                    dict(sm_scale=0.1), dict(window_left=100), dict(logits_soft_cap=30.0),
                                    dict(page_size=8)])
def test_graph_mode_refuses_a_later_plan_that_changes_a_baked_value(change):
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=4, max_num_pages=64, num_sms=132)
    base = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)

    def plan(**kw):
        a = {**base, **kw}
        pt = kvattn.PageTable.from_kv_lens([30, 5], a.pop("page_size"), rng=0)
        w.plan(pt, a.pop("num_qo_heads"), a.pop("num_kv_heads"), a.pop("head_dim"), **a)

    try:
        plan()
    except kvattn.CudaUnavailableError:   # no GPU: the checks ran; commit the baked values as a plan would
        w._baked = w._pending_bake
    name = list(change)[0]
    with pytest.raises(ValueError, match=f"in graph mode {name} is baked into the captured graph"):
        plan(**change)


@pytest.mark.parametrize("head_dim,kv,expected", [(64, None, 3), (128, None, 3), (256, None, 2),
                                                   (64, "float8_e4m3fn", 3), (128, "float8_e4m3fn", 3),
                                                   (256, "float8_e4m3fn", 2)])
def test_decode_instances_keep_their_ctas_per_sm(head_dim, expected, kv):
    """The plan sizes its split for the CTAs an SM holds, from the compiled kernel's registers and static shared
    memory: 3 at head dims 64 / 128 (3 x 76.8 KB of stages fill the 228 KB exactly at 128, so one static byte would
    cost a third of the CTAs), 2 at 256 (8-token warp tiles; an fp8 cache: 64-token stages)."""
    from kvattn import decode
    from kvattn.variants import Variant
    spec = decode.decode_spec(head_dim, 1, Variant(), "bfloat16", kv_dtype=kv)
    compiled, _ = spec.compile("sm_90a")
    (res,) = compiled.resources.values()
    assert res.static_smem == 0, res
    assert res.ctas_per_sm(decode.THREADS, decode.smem_bytes(head_dim, 1, kv_dtype=kv), limit=3) == expected


def test_resources_ctas_per_sm_counts_static_shared_memory_and_registers():
    from kvattn.compiler import Resources
    assert Resources(registers=160).ctas_per_sm(128, 76800) == 3
    assert Resources(registers=160, static_smem=8).ctas_per_sm(128, 76800) == 2
    assert Resources(registers=168).ctas_per_sm(128, 1024) == 3      # 4 warps x 168 x 32 registers
    assert Resources(registers=128).ctas_per_sm(128, 1024) == 4
    assert Resources(registers=32).ctas_per_sm(128, 0, limit=3) == 3


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("flags", [dict(rope=1), dict(rope=2), dict(rope=1, sink=True), dict(alibi=True, sink=True)])
def test_variant_decode_instances_keep_three_ctas_per_sm(head_dim, flags):
    """A variant's decode instance keeps the plain kernel's 3 CTAs per SM (168 registers at most): one more register
    would cost a third of the CTAs (run 17f, BENCHMARKS.md: RoPE decode at 2 CTAs per SM, 3 stages, ran 0.74 of
    plain against 0.86 at 3)."""
    from kvattn import decode
    from kvattn.variants import Variant
    compiled, _ = decode.decode_spec(head_dim, 1, Variant(**flags), "bfloat16").compile("sm_90a")
    (res,) = compiled.resources.values()
    assert res.spills == 0 and res.stack_frame == 0, res
    assert res.ctas_per_sm(decode.THREADS, decode.smem_bytes(head_dim, 1), limit=3) == 3, res


def test_merge_lanes_spread_few_rows_with_many_states():
    """The split-KV merge's lanes per (row, head, 8 columns): 16 where one long request has 49 states (b1_L65536:
    one round of loads each instead of 13), none where every row has at most 4, and never a grid past the thread
    budget (a big graph-mode batch whose state counts are unknown at capture)."""
    from kvattn.merge import LANE_THREAD_BUDGET, lane_shift, merge_grid
    units_b1 = 1 * 32 * 16   # rows x heads x 8-column chunks at Hq 32, head_dim 128
    assert lane_shift(units_b1, 49) == 4
    assert lane_shift(units_b1, 9) == 2 and lane_shift(units_b1, 8) == 1 and lane_shift(units_b1, 4) == 0
    assert lane_shift(units_b1, None) == 4
    for units in (units_b1, 64 * 32 * 16, 128 * 32 * 16, 1024 * 64 * 32):
        shift = lane_shift(units, None)
        assert units << shift <= max(LANE_THREAD_BUDGET, units)
        assert merge_grid(units, shift) * 256 >= units << shift
    assert lane_shift(128 * 32 * 16, None) == 1 and lane_shift(1024 * 64 * 32, None) == 0


def test_auto_m_tiles_takes_two_tiles_only_for_large_groups_of_the_plain_kernels():
    """auto m_tiles: 2 for GQA 32+ at head dim 128 with a 16-bit cache and the plain / soft-cap / window kernels
    (measured faster there); 1 for smaller groups, other head dims, fp8 caches and hooked variants."""
    from kvattn.decode import auto_m_tiles
    from kvattn.variants import Variant
    plain, rope = Variant(), Variant(rope=1)
    assert auto_m_tiles(32, 128, "bfloat16", plain) == 2
    assert auto_m_tiles(64, 128, None, Variant(True, True)) == 2
    assert auto_m_tiles(16, 128, "bfloat16", plain) == 1
    assert auto_m_tiles(32, 64, "bfloat16", plain) == 1
    assert auto_m_tiles(32, 256, "bfloat16", plain) == 1
    assert auto_m_tiles(32, 128, "float8_e4m3fn", plain) == 1
    assert auto_m_tiles(32, 128, "bfloat16", rope) == 1
    assert auto_m_tiles(32, 128, "bfloat16", Variant(sink=True)) == 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("build", [dict(ids_ahead=False), dict(ids_ahead=True), dict(rope=1, rope_f32=True),
                                   dict(rope=1, cheb4=True), dict(rope=2), dict(wtok=8), dict(wtok=16)])
def test_decode_ab_builds_compile_without_spills(head_dim, build):
    """The builds the A/B scripts time against the default (bench_decode's ids_at_use, ids ahead forced at every
    head dim, 8-token warp tiles below head dim 256, 16-token ones at 256; ab_rope_decode's float32 and Chebyshev
    rotations) stay correct builds: no spills, and the plain kernel's CTAs per SM (3 below head dim 256; at 256 2
    with its default 8-token warp tiles, 1 with 16-token ones), their shared memory as Python sizes it (the spec's
    static_assert)."""
    from kvattn import decode
    from kvattn.variants import Variant
    rope = build.get("rope", 0)
    defines = ((("KVATTN_ROPE_F32", 1),) if build.get("rope_f32") else
               (("KVATTN_ROPE_CHEB", 1), ("KVATTN_ROPE_BATCH", 4)) if build.get("cheb4") else ())
    wtok = build.get("wtok")
    spec = decode.decode_spec(head_dim, 1, Variant(rope=rope), "bfloat16", rope_defines=defines,
                              ids_ahead=build.get("ids_ahead"), wtok=wtok)
    compiled, _ = spec.compile("sm_90a")
    (res,) = compiled.resources.values()
    assert res.spills == 0 and res.stack_frame == 0, res
    expected = 3 if head_dim < 256 else 1 if wtok == 16 else 2
    assert res.ctas_per_sm(decode.THREADS, decode.smem_bytes(head_dim, 1, wtok=wtok), limit=3) == expected


def test_slim_fits_head_dim_256_groups_of_at_most_8_with_16_bit_caches():
    from kvattn.decode import slim_fits
    assert slim_fits(256, 8, "bfloat16") and slim_fits(256, 1, "float16") and slim_fits(256, 4, "bfloat16", wtok=8)
    assert not slim_fits(256, 16, "bfloat16")               # 16 query rows need the 16-row Q slot
    assert not slim_fits(256, 4, "float8_e4m3fn")           # fp8 caches: their own stages
    assert not slim_fits(256, 4, "bfloat16", wtok=16)       # 16-token warp tiles: one CTA per SM anyway
    assert not slim_fits(128, 4, "bfloat16") and not slim_fits(128, 4, "bfloat16", wtok=8)


@pytest.mark.parametrize("flags", [dict(), dict(soft_cap=True, window=True), dict(rope=1), dict(alibi=True, sink=True)])
def test_slim_head_dim_256_holds_three_stages_at_two_ctas_per_sm(flags):
    """The slim kernel (8-row Q slots, the merge in 4 phases) fits head dim 256's third stage in the 2 CTAs per SM
    of the 2-stage kernel: 3 stages of 32 KB of K / V each, no spills, its shared memory as Python sizes it (the
    spec's static_assert)."""
    from kvattn import decode
    from kvattn.variants import Variant
    spec = decode.decode_spec(256, 1, Variant(**flags), "bfloat16", slim=True)
    assert ("KVATTN_DECODE_SLIM", 1) in spec.defines and ", 3, " in spec.kernel
    compiled, _ = spec.compile("sm_90a")
    (res,) = compiled.resources.values()
    assert res.spills == 0 and res.stack_frame == 0 and not res.wgmma_serialized, res
    smem = decode.smem_bytes(256, 1, kv_dtype="bfloat16", slim=True)
    assert smem == 3 * (32 * 1024 + 8 * 256 * 2) + 2 * 4 * 16 * 4
    assert res.ctas_per_sm(decode.THREADS, smem, limit=3) == 2, res
