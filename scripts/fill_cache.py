"""Fill KVATTN_CACHE_DIR with the kernels the GPU tests and benchmarks use (so a bare GPU machine skips NVRTC).

    KVATTN_CACHE_DIR=.kvcache python scripts/fill_cache.py [--entries LIST]

--entries: also write the cache-relative path of each of these kernels' entries to LIST, one a line (what
scripts/pack_cache.sh packs: the folder also keeps entries of earlier sources, which no machine will hit again).
"""
import concurrent.futures
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvattn import decode, kernels, ops  # noqa: E402,F401
try:
    from kvattn import prefill  # noqa: F401  (registers its default set)
except ImportError:
    pass
from kvattn.variants import Variant  # noqa: E402


def specs():
    out = [s for ss in kernels.REGISTRY.values() for s in ss]
    for d in decode.HEAD_DIMS:
        for mt in ((1, 2) if d <= 128 else (1,)):
            for t in decode.DTYPES:
                for v in (Variant(), Variant(True, False), Variant(False, True), Variant(True, True)):
                    out.append(decode.decode_spec(d, mt, v, t))   # (and its fused-merge twin, below)
    for stages in (2, 3, 4):
        for l2 in (False, True):
            for refill in (False, True):
                out.append(decode.decode_spec(128, 1, Variant(), "bfloat16", stages, l2, refill))
    out.append(decode.decode_spec(64, 1, Variant(), "bfloat16", wtok=16))   # bench_decode --tune: the A/B of wtok
    out += [decode.decode_spec(d, 1, Variant(), "bfloat16", ids_ahead=False) for d in (64, 128)]   # and ids_at_use
    out += [decode.decode_spec(128, 1, Variant(), "bfloat16", wtok=8, ids_ahead=a) for a in (None, True)]   # wtok8
    out.append(decode.decode_spec(256, 1, Variant(), "bfloat16", wtok=16))   # and head dim 256's kernel before it
    for d in decode.HEAD_DIMS:   # test_decode_ab_builds_match_reference: the A/B builds with a soft cap, fused or not
        for t in decode.DTYPES:
            for tn in (dict(wtok=8), dict(wtok=16), dict(ids_ahead=True), dict(ids_ahead=False)):
                out += [decode.decode_spec(d, 1, Variant(True, False), t, fused_merge_batch=fm, **tn) for fm in (1, 4)]
    # test_head_dim_256_slim_and_two_stage_kernels_match_reference: the slim A/B build (tuning slim=True)
    out += [decode.decode_spec(256, 1, Variant(True, False), t, fused_merge_batch=fm, slim=True)
            for t in decode.DTYPES for fm in (1, 4)]
    from kvattn import prefill as pf
    for defs in ((("KVATTN_PF_FAST64", 1),), (("KVATTN_PF_FOLD", 1),), (("KVATTN_PF_FAST64", 1), ("KVATTN_PF_FOLD", 1))):
        pf.TUNING[128] = defs
        out.append(pf.prefill_spec(128, 128, Variant(), "bfloat16"))
        pf.TUNING.pop(128)
    flags = [Variant(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]
    for t in ("bfloat16", "float16"):
        for v in flags:
            for d in (64, 128, 256):
                for rows in pf.CONFIGS:
                    if not (d == 256 and rows == 128):
                        out.append(pf.prefill_spec(d, rows, v, t))
            for d in pf.SM90_HEAD_DIMS:   # ragged, and paged (interleaved K / V tiles)
                out += [pf.sm90_spec(d, v, t), pf.sm90_spec(d, v, t, interleaved=True)]
    for d in decode.HEAD_DIMS:   # ALiBi (the GPU tests and scripts/bench_variants.py)
        for v in (Variant(alibi=True), Variant(window=True, alibi=True)):
            out.append(decode.decode_spec(d, 1, v, "bfloat16"))
    for d in (64, 128):
        out += [pf.prefill_spec(d, rows, Variant(alibi=True), "bfloat16") for rows in pf.CONFIGS]
        out += [pf.sm90_spec(d, Variant(alibi=True), "bfloat16", interleaved=il) for il in (False, True)]
    saved = pf.SM90_TUNING   # test_sm90_kv_split_ring_with_o_by_tma: K / V on their own barriers at 3 stages
    pf.SM90_TUNING = (("KVATTN_SM90_KVSPLIT", 1),)
    out += [pf.sm90_spec(d, Variant(), "bfloat16", interleaved=il) for d in (64, 128) for il in (False, True)]
    # test_sm90_kv_tiles_over_128_tokens, test_sm90_running_max_kept_or_moved and ab_sm90.py --tilen / --lazymax: KV
    # tiles of 144 / 160 tokens, the max moved at every tile, their controls; persistent and a CTA a unit, ragged and
    # paged; test_sm90_group_divide_build / ab_sm90.py --groupdiv; test_sm90_qhalf_builds / ab_sm90.py --qhalf;
    # test_sm90_narrow_last_pv_build, test_block_sparse_narrow_last_pv_build / ab_sm90.py --narrow
    for defs in ((("KVATTN_SM90_N", 144), ("KVATTN_SM90_STAGES", 2)), (("KVATTN_SM90_N", 160), ("KVATTN_SM90_STAGES", 2)),
                 (("KVATTN_SM90_STAGES", 2),), (("KVATTN_SM90_LAZY_MAX", 0),), (),
                 (("KVATTN_GROUP_MAGIC", 0),), (("KVATTN_SM90_QHALF", 1),), (("KVATTN_SM90_QHALF", 2),),
                 (("KVATTN_SM90_NARROW", 1),)):
        pf.SM90_TUNING = defs
        out += [pf.sm90_spec(128, Variant(), "bfloat16", persistent=ps, interleaved=il)
                for ps in (False, True) for il in (False, True)]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ab_sm90 import BOUNDARY_BUILDS   # ab_sm90.py --boundary, test_sm90_boundary_builds: ragged and paged
    for what, defs in BOUNDARY_BUILDS[:-1]:   # (the test's "before": fp16 too, a CTA a unit too)
        pf.SM90_TUNING = defs
        out += [pf.sm90_spec(128, Variant(), t, persistent=ps, interleaved=il) for il in (False, True)
                for ps in (True, False) for t in ("bfloat16", "float16") if what == "before" or (ps and t == "bfloat16")]
    for n in (160, 192):   # test_sm90_head_dim_64_kv_tiles_over_128_tokens
        pf.SM90_TUNING = (("KVATTN_SM90_N", n), ("KVATTN_SM90_STAGES", 3))
        out += [pf.sm90_spec(64, Variant(), "bfloat16", persistent=ps, interleaved=il)
                for ps in (True, False) for il in (False, True)]
    from ab_sm90 import D64_BUILDS, TILE64_BUILDS   # ab_sm90.py --tilen64 / --d64 (ragged, persistent)
    for _, defs in TILE64_BUILDS + D64_BUILDS:
        pf.SM90_TUNING = defs
        out.append(pf.sm90_spec(64, Variant(), "bfloat16"))
    from ab_sm90 import WG3_BUILDS   # ab_sm90.py --wg3 (ragged, persistent); test_sm90_three_consumer_warpgroups_build
    for what, defs in WG3_BUILDS[1:]:   # (the test's two builds: a CTA a unit and paged too)
        pf.SM90_TUNING = defs
        tested = what in ("WG3", "WG3, O per thread")
        out += [pf.sm90_spec(64, Variant(), "bfloat16", persistent=ps, interleaved=il)
                for ps in (True, False) for il in (False, True) if tested or (ps and not il)]
    from ab_sm90 import RING64_BUILDS   # ab_sm90.py --ring64, test_sm90_head_dim_64_ring_builds (persistent)
    for _, defs in RING64_BUILDS[1:]:
        pf.SM90_TUNING = defs
        out += [pf.sm90_spec(64, Variant(), "bfloat16", persistent=True, interleaved=il, long_tiles=lt)
                for il in (False, True) for lt in (False, True) if not (il and lt)]
    pf.SM90_TUNING = ()   # head dim 64's long-tile default (test_sm90_head_dim_64_long_tiles_by_default)
    out += [pf.sm90_spec(64, Variant(), t, persistent=ps, long_tiles=True, fused_merge=fm)
            for t in ("bfloat16", "float16") for ps, fm in ((True, False), (True, True), (False, False))]
    for k in (0, 1, 2, 3):   # ab_sm90.py --exp2poly (ragged, bf16, every head dim); test_sm90_exp2_poly_build (3)
        pf.SM90_TUNING = (("KVATTN_SM90_EXP2_POLY", k),)
        out += [pf.sm90_spec(d, Variant(), "bfloat16") for d in pf.SM90_HEAD_DIMS]
        if k == 3:
            out += [pf.sm90_spec(d, Variant(), t, persistent=ps, interleaved=il) for d in (64, 128)
                    for t in ("bfloat16", "float16") for ps in (True, False) for il in (False, True)]
    pf.SM90_TUNING = (("KVATTN_SM90_LAZY_MAX", 0),)   # test_sm90_running_max_kept_or_moved (fp16 too)
    out += [pf.sm90_spec(128, Variant(), "float16", persistent=ps, interleaved=il)
            for ps in (False, True) for il in (False, True)]
    pf.SM90_TUNING = saved
    from kvattn import mixed   # the mixed op's one-launch kernels (tests: plain, window, soft cap; both dtypes)
    for t in ("bfloat16", "float16"):
        for v in (Variant(), Variant(True, False), Variant(False, True)):
            for il in (False, True):   # pages that are boxes take the interleaved prefill tiles
                out.append(mixed.mixed_spec(pf.sm90_spec(128, v, t, persistent=True, interleaved=il),
                                            decode.decode_spec(128, 1, v, t), mixed.MAX_SUBS))
    for stages, subs in ((3, 2), (4, 1)):   # bench_mixed.py --sweep
        out.append(mixed.mixed_spec(pf.sm90_spec(128, Variant(), "bfloat16", persistent=True, interleaved=True),
                                    decode.decode_spec(128, 1, Variant(), "bfloat16", stages), subs))
    from kvattn.merge import merge_spec
    sinks = (Variant(sink=True), Variant(alibi=True, sink=True))   # attention sinks (tests, bench_variants)
    for v in sinks:
        out += [decode.decode_spec(d, 1, v, "bfloat16") for d in decode.HEAD_DIMS]
        out.append(merge_spec("float32", "bfloat16", v))
    for d in (64, 128):
        for v in (Variant(sink=True), Variant(window=True, sink=True)):
            out += [pf.prefill_spec(d, rows, v, "bfloat16") for rows in pf.CONFIGS]
            out += [pf.sm90_spec(d, v, "bfloat16", interleaved=il) for il in (False, True)]
    out.append(decode.decode_spec(64, 1, Variant(sink=True, rope=1), "bfloat16"))   # python -m kvattn
    for rope in (1, 2):   # fused RoPE (tests, bench_variants): decode, and the sm80 prefill tiles it runs on
        v = Variant(rope=rope)
        out += [decode.decode_spec(d, 1, v, "bfloat16") for d in decode.HEAD_DIMS]
        out += [pf.prefill_spec(d, rows, v, "bfloat16") for d in (64, 128, 256) for rows in (64, 16)]
        out += [pf.prefill_spec(64, 128, v, "bfloat16")] + [pf.sm90_spec(d, v, "bfloat16") for d in (64, 128)]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ab_rope_decode   # its A/B builds of the RoPE key rotation
    for _, kw, tn in ab_rope_decode.CONFIGS:
        if tn:
            out.append(decode.decode_spec(128, 1, Variant(rope=2 if kw["rope"].interleave else 1), "bfloat16",
                                          rope_defines=tn["rope_defines"]))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from _user_variants import EVEN_KEYS, HALF_LOGITS, HEAD_SCALE, SIGMOID   # the GPU tests' user variants
    for v in (HALF_LOGITS, EVEN_KEYS, SIGMOID, HEAD_SCALE):
        out += [decode.decode_spec(d, 1, v, "bfloat16") for d in (64, 128)]
        out += [pf.prefill_spec(128, rows, v, "bfloat16") for rows in pf.CONFIGS]
        out += [pf.sm90_spec(128, v, "bfloat16", interleaved=il) for il in (False, True)]
        out.append(merge_spec("float32", "bfloat16", v))
    for kv in ("float8_e4m3fn", "float8_e5m2"):   # fp8 caches (tests, scripts/bench_fp8.py and its stage sweep)
        for d in decode.HEAD_DIMS:
            for t in decode.DTYPES:
                for v in (Variant(), Variant(True, False), Variant(False, True), Variant(True, True)):
                    out.append(decode.decode_spec(d, 1, v, t, kv_dtype=kv))
        for stages in (2, 3):
            out += [decode.decode_spec(d, 1, Variant(), "bfloat16", stages, kv_dtype=kv) for d in decode.HEAD_DIMS]
    for kv in ("float8_e4m3fn", "float8_e5m2"):   # fp8 caches in prefill (tests: every variant flag, both paths)
        for t in ("bfloat16", "float16"):
            for v in flags:
                for d in (64, 128, 256):
                    for rows in pf.CONFIGS:
                        if not (d == 256 and rows == 128):
                            out.append(pf.prefill_spec(d, rows, v, t, kv))
                for d in pf.SM90_HEAD_DIMS:
                    out.append(pf.sm90_spec(d, v, t, kv))
    from kvattn import page   # append_paged_kv_cache (tests, scripts/bench_append.py)
    out += [page.append_spec(t, d, r, kv) for t in ("bfloat16", "float16") for d in (64, 128, 256) for r in (0, 1, 2)
            for kv in (None, "float8_e4m3fn", "float8_e5m2")]
    saved, page.LOADS_FIRST = page.LOADS_FIRST, 1 - page.LOADS_FIRST   # the other load order: its GPU test, --loads-first
    out += [page.append_spec("bfloat16", d) for d in (64, 128, 256)] + [page.append_spec("bfloat16", 128, 1)]
    page.LOADS_FIRST = saved
    out += _fused_merge_twins(out)   # small batches' plans (the GPU tests') take the fused-merge instance
    # the instances run 50a's bare machine still compiled: sm90 persistent with the merge fused or the warpgroups split,
    # fp16 a CTA a unit, RoPE on 128-row sm80 tiles and D256 wgmma, the mixed kernel at head dim 64, fp8 expansions
    for d, vs in ((64, (Variant(),)), (128, (Variant(), Variant(True, False), Variant(False, True)))):
        out += [pf.sm90_spec(d, v, "bfloat16", persistent=True, interleaved=il, fused_merge=True)
                for v in vs for il in (False, True)]
    out += [pf.sm90_spec(128, Variant(), "bfloat16", persistent=True, interleaved=il, wg_split=True) for il in (False, True)]
    out += [pf.sm90_spec(128, Variant(), "float16", persistent=False, interleaved=il) for il in (False, True)]
    for rope in (1, 2):
        out += [pf.prefill_spec(128, 128, Variant(rope=rope), "bfloat16"), pf.sm90_spec(256, Variant(rope=rope), "bfloat16")]
    out.append(mixed.mixed_spec(pf.sm90_spec(64, Variant(), "bfloat16", persistent=True, interleaved=True),
                                decode.decode_spec(64, 1, Variant(), "bfloat16"), mixed.MAX_SUBS))
    from kvattn.fp8_expand import expand_spec
    out += [expand_spec(kv, t, d) for kv in ("float8_e4m3fn", "float8_e5m2") for t in ("bfloat16", "float16")
            for d in (64, 128, 256)]
    return list(dict.fromkeys(out))


def _fused_merge_twins(specs):
    """The fused-merge build (KVATTN_FUSED_MERGE_BATCH) of each decode instance in specs built without it (and not
    slim or traced): decode_spec(..., fused_merge_batch=FUSED_MERGE_BATCH) differs from it by that define alone."""
    skip = ("KVATTN_FUSED_MERGE_BATCH", "KVATTN_DECODE_SLIM", "KVATTN_DECODE_TRACE")
    return [dataclasses.replace(s, defines=s.defines + (("KVATTN_FUSED_MERGE_BATCH", decode.FUSED_MERGE_BATCH),))
            for s in specs if s.header == "decode.cuh" and not any(k in skip for k, _ in s.defines)]


def _compile(spec):
    spec.compile("sm_90a")


def entry_path(spec, arch="sm_90a") -> str:
    """The spec's cache entry, relative to the cache folder (kvattn.cache's key of what spec.compile asks for)."""
    from kvattn import cache
    k = cache.key(spec.source(), spec.all_options(), [spec.kernel], arch)
    return os.path.join(k[:2], k + ".cubin")


if __name__ == "__main__":
    t0 = time.time()
    ss = specs()
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as ex:
        list(ex.map(_compile, ss))
    print(f"{len(ss)} kernels in {os.environ.get('KVATTN_CACHE_DIR')} ({time.time() - t0:.0f} s)")
    if "--entries" in sys.argv:
        with open(sys.argv[sys.argv.index("--entries") + 1], "w") as f:
            f.write("".join(entry_path(s) + "\n" for s in ss))
