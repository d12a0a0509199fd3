"""A/B experiments on the sm90 prefill kernel, each in one process (bf16 unless named, Hq32/Hkv8, ragged):

    PYTHONPATH=. python3 scripts/ab_sm90.py [--split] [--tanh] [--d256] [--fold] [--persist] [--prefetch] [--order]
                                            [--hgroup]
                                            [--stream] [--early] [--shapes] [--kvsplit] [--pages] [--kvil] [--qtma] [--otma]
                                            [--lazy] [--shift] [--ptail] [--tilen]
                                            [--lazymax] [--boundary] [--groupdiv] [--tail] [--balance] [--qhalf]
                                            [--narrow] [--exp2poly] [--tilen64] [--d64] [--wg3] [--ring64]
                                            [--sustained]
    python3 scripts/ab_sm90.py --compile                                   # fill KVATTN_CACHE_DIR (no GPU)

--split: where a tile's time goes: the K/V loads left out (KVATTN_SM90_X=1) and the softmax left out (X=2),
  against the full kernel (head_dim 128; only X=0 is a correct kernel, the others' error is not printed).
--tanh: the soft cap's tanh (KVATTN_TANH 0 = tanhf, 1 = ex2 + fast reciprocal, 2 = tanh.approx.f32), cap 30,
  causal b1_S8192 head_dim 128, bf16 and fp16, with the error against the float64 reference.
--d256: head_dim 256's KV tile, ring depth and K/V split (KVATTN_SM90_N / _STAGES / _KVSPLIT), causal b1_S8192,
  beside the sm80 kernel.
--fold: the score scale folded into the exponent on unmasked tiles (KVATTN_SM90_FOLD=1, the default) against
  not (0), the --split shapes, with the error.
--persist: persistent CTAs (kvattn.prefill.SM90_PERSISTENT, the default) against one CTA per (item, KV head), the
  --split shapes and paged page-16 b8_S2048, with the error.
--prefetch: TMA tiles with each box's page id loaded a tile ahead (KVATTN_SM90_PREFETCH=1, the default) against
  looked up at each tile (0), paged page 16 and ragged, with the error.
--hgroup: long requests' units walked one KV head at a time (kvattn.scheduler.kv_head_group, the default) against all
  heads together and groups of heads that fit an L2 window, b1_S32768 / b1_S16384 / b2_S16384, b8_S2048 (control).
--order: the prefill item order's L2 windows (kvattn.scheduler.PREFILL_L2_WINDOW_BYTES: 0 = the whole batch
  longest first, else consecutive requests of about that much KV each, longest first inside), batched cases.
--stream: the persistent consumers' ping-pong turns as one stream over their units (KVATTN_SM90_STREAM=1, the
  default: no resynchronisation of the two consumer warpgroups at unit boundaries) against per unit (0), the --split
  shapes, causal b64_S512 and paged page-16 b8_S2048, with the error.
--early: the persistent consumers' item loads (the unit's again for its epilogue, the next unit's) issued before
  the wait for the unit's last P V (KVATTN_SM90_EARLY=1, the default) against where they are used (0), the
  --stream shapes.
--kvsplit: K and V of a stage released apart (KVATTN_SM90_KVSPLIT=1, O by TMA in both builds since session 31; the
  default only with 2 stages) against
  together (0), with 3 stages (the default: joint), with 2, and with 2 and two Q tiles (KVATTN_SM90_QBUF=2: a
  unit's Q copied while the unit before it runs), the --stream shapes and non-causal b32_S1024.
--shapes: the default kernel on unit shapes that separate a unit's fixed cost from its tiles (run_shapes).
--pages: paged prefill at page sizes 16-128, page 16 without TMA boxes, and ragged (run_pages).
--qtma: each unit's Q tile by one tensor map (the default) against per-thread copies (run 30c, BENCHMARKS.md).
--otma: whole units' O stored by one tensor map per consumer warpgroup (the default) against per-thread stores.
--lazy: the O stage released after the next unit's first softmax (the default) against in the epilogue, the
  --stream shapes and non-causal b32_S1024 (run 31a, BENCHMARKS.md, also measured the producer's tile 0 before
  the Q slot's wait: 4-6% slower, removed).
--shift: a ragged item's last, partial KV tile by the TMA box ending at the item's end (KVATTN_SM90_SHIFT=1, the
  default) against copied per thread, zero-filled (0), the --stream shapes, kv 960 and ragged random lengths.
--ptail: a paged item's partial last KV tile as TMA boxes for its whole pages and copies for the rest
  (KVATTN_SM90_PTAIL=1, the default) against the whole tile copied per thread (0), paged page-16 shapes.
--tilen: KV tiles over 128 tokens at head_dim 128 (TILE_BUILDS: 144 and 160 in 2 stages, a CTA a unit, beside
  128 in 2 and 3 stages a CTA a unit and the default), non-causal and causal b1_S8192, non-causal b32_S1024, causal
  b8_S2048.
--lazymax: a row's running max kept until a tile's max exceeds it by more than 8 (log2 units: P up to 256, the O
  rescale skipped; the default) against moved at every tile (KVATTN_SM90_LAZY_MAX=0), the --stream shapes and
  non-causal b32_S1024.
--boundary: a unit's boundary: the epilogue's rows staged by stmatrix (KVATTN_SM90_STSM) and the masked tiles'
  column-bounds softmax (KVATTN_SM90_BOUNDS), both the default, against stmatrix alone and neither (the kernel
  before); the --lazymax shapes.
--groupdiv: packed rows' query tokens by the plan's multiplier and shift (the default) against division by the
  group size (KVATTN_GROUP_MAGIC=0); the --lazymax shapes.
--qhalf: each consumer warpgroup's 64 Q rows on their own barriers (KVATTN_SM90_QHALF: consumer 0's half refilled
  without waiting for consumer 1's last Q K^T), 1 = both halves then tile 0, 2 = half 0, tile 0, half 1, against
  the default one Q tile; the --boundary shapes and non-causal b32_S1024, those of more than one request first.
--narrow: the unit's last tile's P V over one 64-token half where the other half's columns are all masked
  (KVATTN_SM90_NARROW=1) against the whole tile; the --boundary shapes of more than one request, causal b1_S8192,
  and block-sparse (64, 64) at 10% / 50% (8192 x 8192).
--tilen64: head dim 64's KV tiles of 160 and 192 tokens in 3 stages (TILE64_BUILDS; and 192 with --exp2poly's
  POLY 2) against 128 (every exp2 on the MUFU, as before run 55a), persistent, causal / non-causal b1_S8192,
  causal b8_S2048, non-causal b32_S1024, with the error.
--exp2poly: a share of an unmasked tile's exp2s from a polynomial on the FMA pipe (KVATTN_SM90_EXP2_POLY = 1 / 2 / 3
  eighths of the 8-column blocks) against every exp2 on the MUFU unit (0; the default since run 55a: 2 at head dim
  64, 0 elsewhere), head dims 64 / 128 / 256, with the error (variant_case: one request, causal FLOPs counted as
  the attended pairs).
--d64: head dim 64's defaults (POLY 2, 192-token tiles where prefill.sm90_long_tiles takes them) against those
  before run 55a (128-token tiles, POLY 0): --tilen64's cases, causal b32_S1024 and non-causal b4_S4096, with the
  error and the tile the default took.
--wg3: head dim 64 on three consumer warpgroups a CTA for 192 query rows (KVATTN_SM90_WG3; O by TMA from its own
  buffer or per thread; every exp2 on the MUFU; 4 stages) against the default two (--d64's defaults), persistent,
  --d64's cases, with the error.
--ring64: head dim 64 with two Q tiles (KVATTN_SM90_QBUF=2: the next unit's Q loaded while the unit before it runs),
  4 stages, and both, against the default, the defaults' tiles in each, persistent, --d64's cases, with the error.
--balance: the walk's items placed so that the persistent CTAs' loads balance (kvattn.scheduler.WALK_BALANCE)
  against the snake walk of the items as sorted: mixed-length causal and non-causal batches, appends, controls.
--tail: the persistent walk's last round filled by cutting its last blocks into chunks (prefill.SM90_TAIL_SPLIT)
  against the walk as it is, non-causal batches whose units leave the last round part empty, causal controls.
--sustained (with any experiment): each option timed as 150 back-to-back calls after a 2 s pause, the median of the
  second half (under the power cap), instead of 30 calls at the full clock.
--kvil: paged caches' interleaved K / V tiles (KVATTN_SM90_KVIL=1, one 5-dim box a page) against the kernel before
  (64-column blocks: 2 boxes a page at head_dim 128), pages 16 / 32.
--tanh is a single pass; every other experiment times its options in 3 rounds of alternating order (the GPU's clock
  drifts under load: BENCHMARKS.md, run 15d), each measurement on freshly drawn data, so the GPU idles between them
  and every option starts at the full clock (a sustained prefill runs under the power cap: run 45e).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvattn import prefill, scheduler  # noqa: E402
from kvattn.variants import Variant  # noqa: E402

SPLIT = {0: "full kernel", 1: "no K/V loads", 2: "no softmax"}
SPLIT_CASES = [("non-causal b1_S8192", 1, 8192, False), ("causal b1_S8192", 1, 8192, True),
               ("causal b8_S2048", 8, 2048, True), ("causal b32_S1024", 32, 1024, True)]
TANH = {0: "tanhf", 1: "ex2 + rcp", 2: "tanh.approx"}


def split_defines(x):
    return (("KVATTN_SM90_X", x),) if x else ()


def tile_defines(n, stages):
    return (("KVATTN_SM90_N", n), ("KVATTN_SM90_STAGES", stages))


#: head_dim 256's tile shapes and ring (2 stages: K and V released apart unless joint)
D256_BUILDS = [("N64 x2 split", tile_defines(64, 2)), ("N80 x2 split", tile_defines(80, 2)),
               ("N80 x2 joint", tile_defines(80, 2) + (("KVATTN_SM90_KVSPLIT", 0),))]


def compile_all():
    builds = [(split_defines(x), 128, Variant(), "bfloat16") for x in SPLIT]
    builds += [((("KVATTN_TANH", x),), 128, Variant(soft_cap=True), t) for x in TANH for t in ("bfloat16", "float16")]
    builds += [(defs, 256, Variant(), "bfloat16") for _, defs in D256_BUILDS]
    builds += [((("KVATTN_SM90_FOLD", 0),), 128, Variant(), "bfloat16")]
    for defs, d, v, t in builds:
        prefill.SM90_TUNING = defs
        prefill.sm90_spec(d, v, t).compile("sm_90a")
    prefill.SM90_TUNING = ()
    prefill.SM90_PERSISTENT = False
    prefill.sm90_spec(128, Variant(), "bfloat16").compile("sm_90a")
    prefill.SM90_PERSISTENT = True
    prefill.SM90_TUNING = (("KVATTN_SM90_PREFETCH", 0),)
    prefill.sm90_spec(128, Variant(), "bfloat16").compile("sm_90a")
    for defs in (STREAM_OFF, EARLY_OFF, QBUF2, STAGES2, KV_APART, JOINT + STAGES2, LAZY_OFF, SHIFT_OFF):
        prefill.SM90_TUNING = defs
        prefill.sm90_spec(128, Variant(), "bfloat16").compile("sm_90a")
    for _, defs, persist in TILE_BUILDS:   # --tilen
        prefill.SM90_TUNING = defs
        prefill.sm90_spec(128, Variant(), "bfloat16", persistent=persist).compile("sm_90a")
    for defs in ((), BLOCKS, PTAIL_OFF):   # the paged instances (--kvil, --pages, --ptail)
        prefill.SM90_TUNING = defs
        prefill.sm90_spec(128, Variant(), "bfloat16", interleaved=True).compile("sm_90a")
    prefill.SM90_TUNING = ()


ROUNDS = 3
AUTO_HEAD_GROUP = scheduler.kv_head_group


def compare(tag, name, flops, options, measure, rounds=ROUNDS):
    """Times measure() (-> (us, err)) under each option (what, apply: sets the build / launch knobs) in `rounds`
    rounds, every other round in reverse order: the GPU's clock drifts under sustained load (BENCHMARKS.md, run
    15d), so a single A-then-B pass would favour A. Prints each option's TFLOP/s per round and their median."""
    rates, errs = {what: [] for what, _ in options}, {}
    for r in range(rounds):
        for what, apply in (options if r % 2 == 0 else options[::-1]):
            # (stderr: a call cut by its limit shows the build it was in, hung or compiling; run 49c did not)
            print(f"{tag} {name}: {what}, round {r}", file=sys.stderr, flush=True)
            apply()
            us, errs[what] = measure()
            rates[what].append(flops / us / 1e6)
    prefill.SM90_TUNING, prefill.SM90_PERSISTENT = (), True
    for what, _ in options:
        e = "n/a" if errs[what] is None else f"{errs[what]:.1e}"
        print(f"{tag:8s} {name:24s} {what:16s} " + " ".join(f"{x:6.0f}" for x in rates[what])
              + f"  median {np.median(rates[what]):6.0f} TFLOP/s  err {e}", flush=True)


def tuning(defs):
    return lambda: setattr(prefill, "SM90_TUNING", defs)


def persistent(on):
    return lambda: setattr(prefill, "SM90_PERSISTENT", on)


def build(defs, persist):
    """An option's apply(): the build switches and persistent CTAs or a CTA a unit."""
    def apply():
        prefill.SM90_TUNING, prefill.SM90_PERSISTENT = defs, persist
    return apply


def case(bp, rng, name, b, s, causal, paged=False):
    """measure() of a ragged (or paged, page 16) causal / non-causal case of b requests of s tokens on sm90."""
    def measure():
        if paged:
            w, us, err = bp.paged_case(rng, [s] * b, [s] * b, 128, causal=causal, backend="sm90")
        else:
            w, us, err = bp.ragged_case(rng, name, [s] * b, [s] * b, 128, causal=causal, backend="sm90")
        return us, err
    return measure


def flops_of(bp, b, s, causal):
    return (2 if causal else 4) * b * bp.HQ * s * s * bp.D


def run_split(bp, rng):
    for name, b, s, causal in SPLIT_CASES:
        measure = case(bp, rng, name, b, s, causal)
        # only the full kernel computes attention: the others' error means nothing
        compare("split", name, flops_of(bp, b, s, causal),
                [(what, tuning(split_defines(x))) for x, what in SPLIT.items()],
                lambda: (measure()[0], None) if prefill.SM90_TUNING else measure())


def run_tanh(bp, rng):
    for t in ("bfloat16", "float16"):
        for x, what in TANH.items():
            prefill.SM90_TUNING = (("KVATTN_TANH", x),)
            label, w, us, tf, err = bp.variant_case(rng, f"soft cap 30 {t}", cap=30.0, dtype=t, backend="sm90")
            print(f"tanh  {label:22s} {what:14s} {us:9.1f} us {tf:6.0f} TFLOP/s err {err:.1e}", flush=True)
        prefill.SM90_TUNING = ()
        label, w, us, tf, err = bp.variant_case(rng, f"no cap {t}", dtype=t, backend="sm90")
        print(f"tanh  {label:22s} {'(no soft cap)':14s} {us:9.1f} us {tf:6.0f} TFLOP/s err {err:.1e}", flush=True)


def run_fold(bp, rng):
    for name, b, s, causal in SPLIT_CASES:
        compare("fold", name, flops_of(bp, b, s, causal),
                [("not folded", tuning((("KVATTN_SM90_FOLD", 0),))), ("folded (default)", tuning(()))],
                case(bp, rng, name, b, s, causal))


def run_persist(bp, rng):
    for name, b, s, causal in SPLIT_CASES + [("paged causal b8_S2048", 8, 2048, True)]:
        compare("persist", name, flops_of(bp, b, s, causal),
                [("CTA per unit", persistent(False)), ("persistent", persistent(True))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


def run_prefetch(bp, rng):
    for name, b, s in [("paged causal b1_S8192", 1, 8192), ("paged causal b8_S2048", 8, 2048),
                       ("ragged causal b1_S8192", 1, 8192)]:
        compare("prefetch", name, flops_of(bp, b, s, True),
                [("at each tile", tuning((("KVATTN_SM90_PREFETCH", 0),))), ("a tile ahead", tuning(()))],
                case(bp, rng, name, b, s, True, paged=name.startswith("paged")))


STREAM_OFF = (("KVATTN_SM90_STREAM", 0),)
EARLY_OFF = (("KVATTN_SM90_EARLY", 0),)
JOINT = (("KVATTN_SM90_KVSPLIT", 0),)
KV_APART = (("KVATTN_SM90_KVSPLIT", 1),)
STAGES2 = (("KVATTN_SM90_STAGES", 2),)
QBUF2 = STAGES2 + (("KVATTN_SM90_QBUF", 2),)
LAZY_OFF = (("KVATTN_SM90_LAZY", 0),)
SHIFT_OFF = (("KVATTN_SM90_SHIFT", 0),)
PTAIL_OFF = (("KVATTN_SM90_PTAIL", 0),)
BOUNDARY_CASES = SPLIT_CASES + [("causal b64_S512", 64, 512, True), ("paged causal b8_S2048", 8, 2048, True)]


def run_stream(bp, rng):
    for name, b, s, causal in BOUNDARY_CASES:
        compare("stream", name, flops_of(bp, b, s, causal),
                [("per unit", tuning(STREAM_OFF)), ("one stream", tuning(()))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


def run_early(bp, rng):
    for name, b, s, causal in BOUNDARY_CASES:
        compare("early", name, flops_of(bp, b, s, causal),
                [("loaded where used", tuning(EARLY_OFF)), ("loaded early", tuning(()))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


def run_lazy(bp, rng):
    """The stage a unit's O was stored from released after the next unit's first softmax (LAZY, the default)
    against in the epilogue, where the storing thread's wait for the read holds its warpgroup."""
    for name, b, s, causal in BOUNDARY_CASES + [("non-causal b32_S1024", 32, 1024, False)]:
        compare("lazy", name, flops_of(bp, b, s, causal),
                [("eager release", tuning(LAZY_OFF)), ("lazy release", tuning(()))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


#: 16 request lengths (query = KV) that end anywhere in a tile: the --shift / --ptail random-length cases
RANDOM_LENS = [int(x) for x in np.random.default_rng(1).integers(300, 3800, 16)]


def random_flops(bp):
    return sum(2 * bp.HQ * n * n * bp.D for n in RANDOM_LENS)   # causal


def run_shift(bp, rng):
    """A ragged item's last, partial tile by the TMA box ending at the item's end (SHIFT, the default) against
    per-thread copies zero-filled past the item."""
    options = [("copied tile", tuning(SHIFT_OFF)), ("shifted box", tuning(()))]
    for name, b, s, causal in BOUNDARY_CASES[:-1]:
        compare("shift", name, flops_of(bp, b, s, causal), options, case(bp, rng, name, b, s, causal))
    measure = lambda: bp.ragged_case(rng, "kv960", [1024] * 32, [960] * 32, 128, causal=False,  # noqa: E731
                                     backend="sm90")[1:]
    compare("shift", "non-causal b32 q1024 kv960", 4 * 32 * bp.HQ * 1024 * 960 * bp.D, options, measure)
    compare("shift", "causal 16 random 300-3800", random_flops(bp), options,
            lambda: bp.ragged_case(rng, "random", RANDOM_LENS, RANDOM_LENS, 128, causal=True, backend="sm90")[1:])


def run_ptail(bp, rng):
    """A paged item's partial last tile: its whole pages by TMA, the rest copied (PTAIL, the default), against
    the whole tile copied per thread (page 16, pages scattered)."""
    options = [("copied tile", tuning(PTAIL_OFF)), ("page boxes", tuning(()))]
    for name, b, s in [("paged causal b8_S2048", 8, 2048), ("paged causal b32_S1024", 32, 1024),
                       ("paged causal b64_S512", 64, 512), ("paged causal b1_S8192", 1, 8192)]:
        compare("ptail", name, flops_of(bp, b, s, True), options, case(bp, rng, name, b, s, True, paged=True))
    compare("ptail", "paged causal 16 random", random_flops(bp), options,
            lambda: bp.paged_case(rng, RANDOM_LENS, RANDOM_LENS, 128, causal=True, backend="sm90")[1:])


#: KV tiles over 128 tokens at head_dim 128 (FlashAttention-3 takes 176-token tiles for non-causal head_dim 128):
#: (what, SM90_TUNING, persistent). Tiles over 128 tokens leave room for 2 stages only (K and V released apart);
#: with a CTA a unit (240 consumer registers) 144 and 160 compile without spills (persistent, 232: 144 spills
#: 8 bytes, 160 80), so the family runs a CTA a unit, beside its 2- and 3-stage 128-token controls and the default.
TILE_BUILDS = [("N128 x3 (default)", (), True), ("N128 x3, CTA/unit", (), False),
               ("N128 x2 split, C/u", STAGES2, False), ("N144 x2 split, C/u", tile_defines(144, 2), False),
               ("N160 x2 split, C/u", tile_defines(160, 2), False)]


#: --tilen64: head dim 64's KV tiles (its 32 KB stages leave room for 3 of up to 192 tokens; 256 spills)
MUFU_ONLY = (("KVATTN_SM90_EXP2_POLY", 0),)
TILE64_BUILDS = [("N128 x3", tile_defines(128, 3) + MUFU_ONLY), ("N160 x3", tile_defines(160, 3) + MUFU_ONLY),
                 ("N192 x3", tile_defines(192, 3) + MUFU_ONLY),
                 ("N192 x3, poly 2/8", tile_defines(192, 3) + (("KVATTN_SM90_EXP2_POLY", 2),))]   # (--exp2poly's)
TILE64_CASES = [("D64 causal b1_S8192", 1, 8192, True), ("D64 non-causal b1_S8192", 1, 8192, False),
                ("D64 causal b8_S2048", 8, 2048, True), ("D64 non-causal b32_S1024", 32, 1024, False)]
#: --d64: head dim 64's defaults since run 55a (2 of 8 exp2s from the polynomial; 192-token tiles where
#: prefill.sm90_long_tiles takes them) against the defaults before (128-token tiles, every exp2 on the MUFU)
D64_BUILDS = [("before (N128, MUFU)", tile_defines(128, 3) + MUFU_ONLY), ("default", ())]
D64_CASES = TILE64_CASES + [("D64 causal b32_S1024", 32, 1024, True), ("D64 non-causal b4_S4096", 4, 4096, False)]


def compare_d64(bp, rng, tag, cases, builds, rows=lambda: 128):
    """compare() of each head-dim-64 ragged case (name, b, s, causal) on sm90 under each build (what, SM90_TUNING),
    with the error; rows(): the plan's query tile, read once the build is applied."""
    for name, b, s, causal in cases:
        def measure(b=b, s=s, causal=causal, name=name):
            d, bp.D = bp.D, 64
            try:
                return bp.ragged_case(rng, name, [s] * b, [s] * b, rows(), causal=causal, backend="sm90")[1:]
            finally:
                bp.D = d
        compare(tag, name, (2 if causal else 4) * b * bp.HQ * s * s * 64, [(w, tuning(d)) for w, d in builds],
                measure)


def run_tilen64(bp, rng):
    """Head dim 64: fewer, longer KV tiles (a tile's fixed costs: reductions, barriers, turns, against products half
    as long as head dim 128's) in 3 stages, persistent, against the default 128-token tiles; with the error."""
    compare_d64(bp, rng, "tilen64", TILE64_CASES, TILE64_BUILDS)


def run_d64(bp, rng):
    """Head dim 64's defaults against the defaults before them (D64_BUILDS), on ragged K / V, with the error and the
    KV tile the default took."""
    for name, b, s, causal in D64_CASES:
        def measure(b=b, s=s, causal=causal, name=name):
            d, bp.D = bp.D, 64
            try:
                w, us, err = bp.ragged_case(rng, name, [s] * b, [s] * b, 128, causal=causal, backend="sm90")
            finally:
                bp.D = d
            tiles[name] = prefill.sm90_tile(64, defines=w.last_plan.info["kernel"].spec.defines)[0]
            return us, err
        tiles = {}
        compare("d64", name, (2 if causal else 4) * b * bp.HQ * s * s * 64,
                [(w, tuning(d)) for w, d in D64_BUILDS], measure)
        print(f"d64      {name:24s} default's KV tile: {tiles[name]} tokens", flush=True)


#: --wg3: three consumer warpgroups for 192-row units (KVATTN_SM90_WG3, 128-token tiles: its 160-register consumers hold
#: no longer S; O by TMA from its own buffer, or per thread) against the default (two, 128 rows, 192-token tiles
#: where prefill.sm90_long_tiles takes them)
WG3 = (("KVATTN_SM90_WG3", 1),)
WG3_BUILDS = [("default", ()), ("WG3", WG3), ("WG3, O per thread", WG3 + (("KVATTN_SM90_OBUF", 0),)),
              ("WG3, MUFU only", WG3 + MUFU_ONLY), ("WG3, 4 stages", WG3 + (("KVATTN_SM90_STAGES", 4),))]


def run_wg3(bp, rng):
    """Head dim 64 on three consumer warpgroups (WG3_BUILDS: 192-row units; the default's 128), persistent, --d64's
    cases, with the error. (With the WG3 tuning only head dim 64 plans take the sm90 kernel: the A/B's cases.)"""
    compare_d64(bp, rng, "wg3", D64_CASES, WG3_BUILDS, rows=prefill.sm90_rows)


#: --ring64: head dim 64's ring and Q tiles, which its shared memory leaves room for (at head dim 128 a second Q
#: tile cost a stage: runs 27a / 27b): two Q tiles (KVATTN_SM90_QBUF=2: the producers load the next unit's Q while
#: the unit before it still runs, not after its last Q K^T), 4 stages instead of 3 (the copies' lead over products
#: half as long as head dim 128's), and both (229 KB with 192-token tiles), against the default
TWO_Q, FOUR_STAGES = (("KVATTN_SM90_QBUF", 2),), (("KVATTN_SM90_STAGES", 4),)
RING64_BUILDS = [("default", ()), ("2 Q tiles", TWO_Q), ("4 stages", FOUR_STAGES),
                 ("2 Q, 4 stages", TWO_Q + FOUR_STAGES)]


def run_ring64(bp, rng):
    """Head dim 64's ring depth and Q tiles (RING64_BUILDS; the tile the defaults' rule takes in each), persistent,
    --d64's cases, with the error."""
    compare_d64(bp, rng, "ring64", D64_CASES, RING64_BUILDS)


def run_tilen(bp, rng):
    """Fewer, larger KV tiles (the per-tile costs: softmax reductions, O rescale, barriers, turns) against the
    default 128-token tiles in 3 stages."""
    for name, b, s, causal in [("non-causal b1_S8192", 1, 8192, False), ("causal b1_S8192", 1, 8192, True),
                               ("non-causal b32_S1024", 32, 1024, False), ("causal b8_S2048", 8, 2048, True)]:
        compare("tilen", name, flops_of(bp, b, s, causal), [(w, build(d, p)) for w, d, p in TILE_BUILDS],
                case(bp, rng, name, b, s, causal))


LAZYMAX_OFF = (("KVATTN_SM90_LAZY_MAX", 0),)   # (LAZY_OFF above is the O stage's release: --lazy)


def run_lazymax(bp, rng):
    """A row's running max kept until a tile's max exceeds it by more than 8 (log2 units: P up to 256, the O rescale
    skipped; the default since run 46b) against moved at every tile (KVATTN_SM90_LAZY_MAX=0), the --stream shapes and
    non-causal b32_S1024, persistent."""
    for name, b, s, causal in BOUNDARY_CASES + [("non-causal b32_S1024", 32, 1024, False)]:
        compare("lazymax", name, flops_of(bp, b, s, causal),
                [("moved", tuning(LAZYMAX_OFF)), ("lazy, 8 (default)", tuning(()))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


BOUNDARY_OFF = (("KVATTN_SM90_BOUNDS", 0), ("KVATTN_SM90_STSM", 0))
BOUNDARY_BUILDS = [("before", BOUNDARY_OFF), ("stsm only", (("KVATTN_SM90_BOUNDS", 0),)), ("stsm + bounds (def)", ())]


def run_boundary(bp, rng):
    """The unit-boundary changes of session 34 (BENCHMARKS.md), each alone and together against none of them."""
    for name, b, s, causal in BOUNDARY_CASES + [("non-causal b32_S1024", 32, 1024, False)]:
        compare("boundary", name, flops_of(bp, b, s, causal), [(what, tuning(defs)) for what, defs in BOUNDARY_BUILDS],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


GROUP_DIVIDE = (("KVATTN_GROUP_MAGIC", 0),)


def run_groupdiv(bp, rng):
    """Row tokens by multiply and shift against by division (each ~18 instructions, some on the MUFU pipe)."""
    for name, b, s, causal in BOUNDARY_CASES + [("non-causal b32_S1024", 32, 1024, False)]:
        compare("groupdiv", name, flops_of(bp, b, s, causal),
                [("divide", tuning(GROUP_DIVIDE)), ("multiply + shift (default)", tuning(()))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


#: --qhalf: each consumer warpgroup's Q rows on their own barriers (KVATTN_SM90_QHALF), both halves then tile 0 (1)
#: or half 0, tile 0, half 1 (2), against one Q tile (the default)
QHALF_BUILDS = [("one Q tile (def)", ()), ("halves, then tile 0", (("KVATTN_SM90_QHALF", 1),)),
                ("half 0, tile 0, 1", (("KVATTN_SM90_QHALF", 2),))]


def run_qhalf(bp, rng):
    """Consumer 0's Q half refilled once its own last Q K^T is done, not both warpgroups' (~1050 cycles later at a
    unit boundary, run 33d's trace), against the default's one Q tile on one `qfree`."""
    short = [c for c in BOUNDARY_CASES if c[1] > 1] + [("non-causal b32_S1024", 32, 1024, False)]
    for name, b, s, causal in short + [c for c in BOUNDARY_CASES if c[1] == 1]:   # the unit-boundary cases first
        compare("qhalf", name, flops_of(bp, b, s, causal), [(what, tuning(defs)) for what, defs in QHALF_BUILDS],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


#: --narrow: the unit's last tile's P V over the half of its 64 tokens that holds its kept columns (KVATTN_SM90_NARROW)
NARROW = (("KVATTN_SM90_NARROW", 1),)


def block_sparse_case(rng, density):
    """measure() of 8192 x 8192 (64, 64) block-sparse attention at `density` (bench_block_sparse.py's case: units of
    ~13 blocks at 10%, their last tile half full in about half of the block rows)."""
    import kvattn
    from bench_block_sparse import HKV, S, pattern, sample_error
    from kvattn.timing import time_us
    bsr = pattern(rng, 64, 64, density)
    bf = kvattn._dtypes.to_numpy("bfloat16")
    q = rng.standard_normal((S, 32, 128)).astype(bf)
    k = rng.standard_normal((S, HKV, 128)).astype(bf)
    v = rng.standard_normal((S, HKV, 128)).astype(bf)
    dq, dk, dv = (kvattn.from_numpy(x) for x in (q, k, v))
    out = kvattn.empty(q.shape, "bfloat16")

    def measure():
        w = kvattn.BlockSparseAttentionWrapper()
        w.plan(bsr, 32, HKV, 128)
        us = time_us(lambda: w.run(dq, dk, dv, out=out))
        return us, sample_error(rng, bsr, *(x.astype(np.float32) for x in (q, k, v, out.numpy())))
    return measure, 4 * bsr.nnz_blocks * 64 * 64 * 32 * 128


def run_narrow(bp, rng):
    """The unit's last P V over one 64-token half where the other half is all masked (a causal unit of 32 / 64
    query tokens every other unit; a block row's odd 64-column block) against the whole tile (the default)."""
    opts = [("whole last tile (def)", tuning(())), ("narrow last P V", tuning(NARROW))]
    for name, b, s, causal in [c for c in BOUNDARY_CASES if c[1] > 1] + [("causal b1_S8192", 1, 8192, True)]:
        compare("narrow", name, flops_of(bp, b, s, causal), opts,
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))
    for density in (0.1, 0.5):
        measure, flops = block_sparse_case(rng, density)
        compare("narrow", f"block-sparse (64, 64) {density:.0%}", flops, opts, measure)


TAIL_CASES = [("non-causal b1_S8192", 1, 8192, False), ("non-causal b2_S8192", 2, 8192, False),
              ("non-causal b32_S1024", 32, 1024, False), ("non-causal b4_S4096", 4, 4096, False),
              ("causal b1_S8192", 1, 8192, True), ("causal b8_S2048", 8, 2048, True)]


def run_tail(bp, rng):
    """The persistent walk's last round filled by cutting its last blocks into chunks (prefill.SM90_TAIL_SPLIT,
    kvattn.scheduler._tail_split) against the walk as it is; the causal cases are controls (their plans do not
    change: the model finds their walks balanced within 1% or no cut that helps)."""
    default = prefill.SM90_TAIL_SPLIT

    def tail(on):
        return lambda: setattr(prefill, "SM90_TAIL_SPLIT", on)
    for name, b, s, causal in TAIL_CASES:
        qo = np.full(b, s)
        plan = scheduler.plan_prefill(qo, qo, bp.HQ // bp.HKV, bp.HKV, 128, causal=causal, num_sms=132,
                                      kv_bytes_per_token=bp.HKV * 4 * bp.D, persistent_ctas=132)
        print(f"tail {name}: {plan.num_items} items with the cut ({int(plan.split)} split, "
              f"{plan.max_chunks} chunks at most)", flush=True)
        compare("tail", name, flops_of(bp, b, s, causal), [("walk as is", tail(False)), ("tail split", tail(True))],
                case(bp, rng, name, b, s, causal))
    prefill.SM90_TAIL_SPLIT = default


#: --balance: (name, qo lens, kv lens, causal): mixed lengths, appends, and uniform controls
def balance_cases():
    rng = np.random.default_rng(7)
    q = [int(x) for x in rng.integers(1, 600, 32)]
    return [("causal 16 random 300-3800", RANDOM_LENS, RANDOM_LENS, True),
            ("append 32 q1-600 kv+0-3000", q, [x + int(e) for x, e in zip(q, rng.integers(0, 3000, 32))], True),
            ("non-causal 48 random 100-2000", *([[int(x) for x in rng.integers(100, 2000, 48)]] * 2), False),
            ("causal b4_S4096", [4096] * 4, [4096] * 4, True), ("causal b8_S2048", [2048] * 8, [2048] * 8, True),
            ("non-causal b32_S1024 (control)", [1024] * 32, [1024] * 32, False)]


def run_balance(bp, rng):
    """The walk's items placed so that the persistent CTAs' loads balance (kvattn.scheduler.WALK_BALANCE,
    _balance_walk) against the snake walk of the items as sorted; the model's slowest CTA printed first."""
    default = scheduler.WALK_BALANCE

    def balance(on):
        return lambda: setattr(scheduler, "WALK_BALANCE", on)
    for name, qo, kv, causal in balance_cases():
        kw = dict(causal=causal, num_sms=132, kv_bytes_per_token=bp.HKV * 4 * bp.D, persistent_ctas=132)
        loads = []
        for on in (False, True):
            scheduler.WALK_BALANCE = on
            plan = scheduler.plan_prefill(qo, kv, bp.HQ // bp.HKV, bp.HKV, 128, **kw)
            loads.append(scheduler.walk_makespan(plan, bp.HKV, 132, causal, qo, kv, bp.HQ // bp.HKV))
        print(f"balance {name}: model slowest CTA {loads[0]:.1f} -> {loads[1]:.1f} tiles "
              f"({loads[0] / loads[1] - 1:+.1%})", flush=True)
        flops = sum(4 * bp.HQ * a * b * bp.D - (2 * bp.HQ * a * a * bp.D if causal else 0) for a, b in zip(qo, kv))
        compare("balance", name[:24], flops, [("snake", balance(False)), ("balanced", balance(True))],
                lambda: bp.ragged_case(rng, name, qo, kv, 128, causal=causal, backend="sm90")[1:])
    scheduler.WALK_BALANCE = default


def sustained_us(fn, pause=2.0, calls=150):
    """--sustained: fn timed as a serving engine runs it, after `pause` s idle, `calls` back-to-back calls, the
    median of the second half (under the power cap: BENCHMARKS.md run 45e), in place of bench_prefill's time_us."""
    from _bench import series_us
    return float(np.median(series_us(fn, calls, pause)[calls // 2:]))


def run_kvsplit(bp, rng):
    for name, b, s, causal in BOUNDARY_CASES + [("non-causal b32_S1024", 32, 1024, False)]:
        compare("kvsplit", name, flops_of(bp, b, s, causal),
                [("joint, 3 stages", tuning(())), ("split, 3 stages", tuning(KV_APART)),
                 ("joint, 2 stages", tuning(JOINT + STAGES2)), ("split, 2 stages", tuning(STAGES2)),
                 ("split, 2 Q, 2 st", tuning(QBUF2))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))


SHAPES = [("non-causal b1_S8192", 1, 8192, 8192, False), ("causal b1_S8192", 1, 8192, 8192, True),
          ("non-causal b32_S1024", 32, 1024, 1024, False), ("non-causal b32 q1024 kv960", 32, 1024, 960, False),
          ("causal b32_S1024", 32, 1024, 1024, True)]


def run_shapes(bp, rng):
    """Where a short unit's time goes: 8192 units of 8 full tiles (non-causal b32_S1024), of 7 full tiles and a
    half tile (kv 960: the partial tile copied per thread and masked by the item's end), and causal (4.5 tiles, the
    last masked), against b1_S8192's long units (64 tiles). Each shape its own FLOPs; 3 alternating rounds."""
    rates = {name: [] for name, *_ in SHAPES}
    for r in range(ROUNDS):
        for name, b, sq, skv, causal in (SHAPES if r % 2 == 0 else SHAPES[::-1]):
            w, us, err = bp.ragged_case(rng, name, [sq] * b, [skv] * b, 128, causal=causal, backend="sm90")
            rates[name].append(((2 if causal else 4) * b * bp.HQ * sq * skv * bp.D / us / 1e6, us, err))
    for name, *_ in SHAPES:
        tf = [x[0] for x in rates[name]]
        print(f"shapes   {name:26s} " + " ".join(f"{x:6.0f}" for x in tf) + f"  median {np.median(tf):6.0f} TFLOP/s "
              f"{np.median([x[1] for x in rates[name]]):9.1f} us  err {rates[name][-1][2]:.1e}", flush=True)


def l2_window(nbytes):
    from kvattn import scheduler
    return lambda: setattr(scheduler, "PREFILL_L2_WINDOW_BYTES", nbytes)


def run_order(bp, rng):
    from kvattn import scheduler
    default = scheduler.PREFILL_L2_WINDOW_BYTES
    for name, b, s, causal in SPLIT_CASES[1:] + [("causal b64_S512", 64, 512, True),
                                                 ("non-causal b8_S2048", 8, 2048, False),
                                                 ("paged causal b8_S2048", 8, 2048, True)]:
        compare("order", name, flops_of(bp, b, s, causal),
                [(f"window {mb} MB" if mb else "longest first", l2_window(mb << 20)) for mb in (0, 8, 16, 32)],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))
    scheduler.PREFILL_L2_WINDOW_BYTES = default


def _fitted_group(kv, hkv, bpt):
    """Run 35a's rule: the most heads (a divisor of hkv) whose K/V of the longest request fits a window."""
    per_head = int(kv.max()) * int(bpt) // hkv
    return next((d for d in range(hkv, 0, -1) if hkv % d == 0 and per_head * d <= scheduler.PREFILL_L2_WINDOW_BYTES), 1)


def head_groups(fixed):
    """The plan's KV head groups: None = the scheduler's choice (kv_head_group), 0 = off (all heads together),
    "fit" = run 35a's fitted groups, else `fixed` heads a group."""
    def apply():
        scheduler.PREFILL_HEAD_GROUPS = fixed != 0
        scheduler.kv_head_group = (AUTO_HEAD_GROUP if fixed is None else _fitted_group if fixed == "fit"
                                   else (lambda kv, hkv, bpt: min(fixed or hkv, hkv)))
    return apply


def run_hgroup(bp, rng):
    """Long requests (K/V over all heads past an L2 window): units walked one KV head at a time (the default since
    run 35b) against all heads together and (run 35a's default) groups of the most heads that fit a window; causal
    b8_S2048 (8 MiB requests: one group by default) as the control."""
    for name, b, s, causal in [("causal b1_S32768", 1, 32768, True), ("causal b1_S16384", 1, 16384, True),
                               ("causal b2_S16384", 2, 16384, True), ("non-causal b1_S16384", 1, 16384, False),
                               ("causal b8_S2048", 8, 2048, True)]:
        compare("hgroup", name, flops_of(bp, b, s, causal),
                [("all heads", head_groups(0)), ("fitted groups", head_groups("fit")), ("auto", head_groups(None))],
                case(bp, rng, name, b, s, causal))
    head_groups(None)()


def run_d256(bp, rng):
    def measure():
        _, _, us, _, err = bp.variant_case(rng, "causal b1_S8192 D256", d=256, backend="sm90")
        return us, err
    compare("d256", "causal b1_S8192 D256", 4 * bp.HQ * 256 * (8192 * 8193 // 2),
            [(what, tuning(defs)) for what, defs in D256_BUILDS], measure)
    label, w, us, tf, err = bp.variant_case(rng, "causal b1_S8192 D256", d=256, backend="sm80")
    print(f"d256  {label:22s} {'sm80 / 64 rows':14s} {us:9.1f} us {tf:6.0f} TFLOP/s err {err:.1e}", flush=True)


def run_pages(bp, rng):
    """Where the paged path loses to ragged (issue 13: within 5%): causal b1_S8192 and b8_S2048 paged at page sizes
    16 / 32 / 64 / 128 (one TMA box a page, up to the 128-token tile), page 16 with the per-thread copies instead
    of boxes (TMA off), and ragged (one box a tile). Run 28c-28e (BENCHMARKS.md)."""
    from kvattn import tma
    mode = {}
    tma_mode = tma.tma_mode

    def option(what, ps, tma_on=True, ragged=False):
        def apply():
            bp.PS = ps
            tma.tma_mode = tma_mode if tma_on else (lambda *a: (tma.MODE_OFF, 0))
            mode.update(ragged=ragged)
        return what, apply
    options = [option("page 16 TMA", 16), option("page 16 cp.async", 16, tma_on=False), option("page 32", 32),
               option("page 64", 64), option("page 128", 128), option("ragged", 16, ragged=True)]
    for name, b, s in [("causal b1_S8192", 1, 8192), ("causal b8_S2048", 8, 2048)]:
        def measure():
            if mode["ragged"]:
                return bp.ragged_case(rng, name, [s] * b, [s] * b, 128, causal=True, backend="sm90")[1:]
            return bp.paged_case(rng, [s] * b, [s] * b, 128, causal=True, backend="sm90")[1:]
        compare("pages", name, flops_of(bp, b, s, True), options, measure)
    bp.PS, tma.tma_mode = 16, tma_mode


BLOCKS = (("KVATTN_SM90_KVIL", 0),)


def run_kvil(bp, rng):
    """Paged caches' interleaved K / V tiles (KVATTN_SM90_KVIL=1, the default: 8-row groups of all 64-column blocks,
    one 5-dim TMA box a page: 16 boxes a page-16 tile instead of 32) against the 64-column blocks of the kernel
    before (KVIL=0), paged at page 16 and 32, ragged beside, causal b1_S8192 / b8_S2048 and non-causal b1_S8192
    (run 29b, BENCHMARKS.md)."""
    mode = {}

    def option(what, ps, defs=(), ragged=False):
        def apply():
            bp.PS, prefill.SM90_TUNING = ps, defs
            mode.update(ragged=ragged)
        return what, apply
    options = [option("page 16 blocks", 16, BLOCKS), option("page 16 KVIL", 16), option("page 32 blocks", 32, BLOCKS),
               option("page 32 KVIL", 32), option("ragged", 16, ragged=True)]
    for name, b, s, causal in [("causal b1_S8192", 1, 8192, True), ("causal b8_S2048", 8, 2048, True),
                               ("non-causal b1_S8192", 1, 8192, False)]:
        def measure():
            if mode["ragged"]:
                return bp.ragged_case(rng, name, [s] * b, [s] * b, 128, causal=causal, backend="sm90")[1:]
            return bp.paged_case(rng, [s] * b, [s] * b, 128, causal=causal, backend="sm90")[1:]
        compare("kvil", name, flops_of(bp, b, s, causal), options, measure)
    bp.PS = 16


def run_map_ab(bp, rng, tag, switch, off, on):
    """A tensor map of kvattn.tma on (the default) against off (the module switch `switch` False), the --stream
    shapes but b1 non-causal, and non-causal b32_S1024; the same kernel binary (tma_q / tma_o are launch
    parameters)."""
    from kvattn import tma

    def maps(value):
        return lambda: setattr(tma, switch, value)
    for name, b, s, causal in BOUNDARY_CASES[1:] + [("non-causal b32_S1024", 32, 1024, False)]:
        compare(tag, name, flops_of(bp, b, s, causal), [(off, maps(False)), (on, maps(True))],
                case(bp, rng, name, b, s, causal, paged=name.startswith("paged")))
    setattr(tma, switch, True)


def run_qtma(bp, rng):
    """Each unit's Q tile by its tensor map (kvattn.tma.RowsTensorMap, one thread, head_dim / 64 boxes) against the
    producers' per-thread copies (tma.QUERY_MAPS = False)."""
    run_map_ab(bp, rng, "qtma", "QUERY_MAPS", "per-thread Q", "TMA Q")


def run_otma(bp, rng):
    """Whole units' O by its tensor map (each consumer warpgroup's rows staged in the last stage's K half, one bulk
    store) against per-thread global stores (tma.OUTPUT_MAPS = False)."""
    run_map_ab(bp, rng, "otma", "OUTPUT_MAPS", "per-thread O", "TMA O")


#: --exp2poly: head dims and cases (name, s, head_dim, causal: one request of s tokens, bp.variant_case)
EXP2POLY_CASES = [("D64 causal b1_S8192", 8192, 64, True), ("D64 non-causal b1_S8192", 8192, 64, False),
                  ("D64 causal b1_S2048", 2048, 64, True), ("D128 causal b1_S8192", 8192, 128, True),
                  ("D128 non-causal b1_S8192", 8192, 128, False), ("D256 causal b1_S8192", 8192, 256, True)]


def run_exp2poly(bp, rng):
    """Of each 8 consecutive 8-column score blocks of an unmasked tile, POLY take exp2 from a polynomial on the FMA
    pipe (KVATTN_SM90_EXP2_POLY: common.cuh poly_exp2) instead of the MUFU unit (0), POLY 1 / 2 / 3
    (12.5 / 25 / 37.5% of the exp2s), with the error against the float64 reference."""
    opts = [("MUFU only", tuning(MUFU_ONLY))] + [
        (f"poly {k}/8", tuning((("KVATTN_SM90_EXP2_POLY", k),))) for k in (1, 2, 3)]
    for name, s, d, causal in EXP2POLY_CASES:
        flops = (2 if causal else 4) * bp.HQ * s * s * d

        def measure(s=s, d=d, causal=causal):
            _, _, us, _, err = bp.variant_case(rng, name, s=s, d=d, causal=causal, backend="sm90")
            return us, err
        compare("exp2poly", name, flops, opts, measure)


EXPERIMENTS = {"ptail": run_ptail, "shift": run_shift, "lazy": run_lazy, "qtma": run_qtma, "otma": run_otma, "pages": run_pages, "kvil": run_kvil, "split": run_split, "tanh": run_tanh, "d256": run_d256, "fold": run_fold,
               "persist": run_persist,
               "prefetch": run_prefetch, "order": run_order, "hgroup": run_hgroup, "stream": run_stream,
               "early": run_early, "shapes": run_shapes, "kvsplit": run_kvsplit, "tilen": run_tilen,
               "lazymax": run_lazymax,
               "boundary": run_boundary, "groupdiv": run_groupdiv, "tail": run_tail, "balance": run_balance,
               "qhalf": run_qhalf, "narrow": run_narrow, "exp2poly": run_exp2poly, "tilen64": run_tilen64,
               "d64": run_d64, "wg3": run_wg3, "ring64": run_ring64}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    for flag in ("compile", "sustained", *EXPERIMENTS):
        ap.add_argument(f"--{flag}", action="store_true")
    args = ap.parse_args()
    if args.compile:
        compile_all()
        sys.exit(0)
    import bench_prefill as bp  # noqa: E402
    if args.sustained:   # every option timed under the power cap (its own calls back to back), not fresh
        bp.time_us = sustained_us
    chosen = [fn for name, fn in EXPERIMENTS.items() if getattr(args, name)] or list(EXPERIMENTS.values())
    rng = np.random.default_rng(0)
    for fn in chosen:
        fn(bp, rng)
