"""Where a persistent sm90 prefill CTA's time goes at its unit boundaries, from in-kernel clock stamps:

    PYTHONPATH=. python3 scripts/trace_sm90.py [--paged]
    python3 scripts/trace_sm90.py --compile          # fill KVATTN_CACHE_DIR (no GPU)

The build with KVATTN_SM90_TRACE=1 (cuda_src/prefill_sm90.cuh: TraceEvent) stamps clock64() at each unit's events (the
Q copy's issue, tile 0's issue, consumer 0's start, first turn, first Q K^T, first softmax, last Q K^T, last P V, the
bulk-stored epilogue's Q barrier, staged rows and warpgroup barrier, and its end; consumer 1's start, last P V and
end) into a device array, read back here through cuModuleGetGlobal after the case's timed runs (the last run's stamps;
zeroed after reading). Per case it prints the medians, in SM cycles and in tile times, of the stretches between them,
and a least-squares fit of a unit's time (consumer 0's end to end) against its tiles: the fixed cost per unit and the
cost per tile. The same case is timed on the default build beside it (what the stamps cost).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import read_device_global  # noqa: E402
from kvattn import prefill  # noqa: E402
from kvattn.variants import Variant  # noqa: E402

TRACE = (("KVATTN_SM90_TRACE", 1),)
CTAS, UNITS, EVENTS = 132, 128, 20   # cuda_src/prefill_sm90.cuh: KVATTN_TRACE_*
(Q_COPY, TILE0, START0, TURN0, QK0, SOFT0, LAST_QK0, LAST_PV0, END0, START1, LAST_PV1, END1, Q_ISSUED, LOOKUP,
 EMPTY) = range(15)
TILES = 15
O_QFREE, O_ROWS, O_SYNC = 16, 17, 18   # the bulk-stored epilogue's steps (consumer 0)
CASES = [("non-causal b32_S1024", 32, 1024, False), ("causal b32_S1024", 32, 1024, True),
         ("causal b8_S2048", 8, 2048, True), ("causal b1_S8192", 1, 8192, True),
         ("non-causal b1_S8192", 1, 8192, False)]


def read_trace(w):   # (zeroed after the read: the next case, same module, starts clean)
    module = w.last_plan.launches[0].kernel.module
    return read_device_global(module, b"kvattn_sm90_trace").reshape(CTAS, UNITS, EVENTS)


def stretches(tr):
    """Per (CTA, unit r >= 1) stretch lengths in cycles, for units with tiles and all stamps present."""
    rows = []
    for c in range(tr.shape[0]):
        units = [r for r in range(UNITS) if tr[c, r, END0] > 0 and tr[c, r, TILES] > 0]
        for a, b in zip(units, units[1:]):
            if b != a + 1:
                continue
            p, u = tr[c, a], tr[c, b]
            rows.append(dict(
                tiles=u[TILES],
                unit=u[END0] - p[END0],
                epilogue=p[END0] - p[LAST_PV0],
                epi_qfree=p[O_QFREE] - p[LAST_PV0],
                epi_rows=p[O_ROWS] - p[O_QFREE],
                epi_sync=p[O_SYNC] - p[O_ROWS],
                epi_store=p[END0] - p[O_SYNC],
                wait_data=u[START0] - p[END0],
                turn=u[TURN0] - u[START0],
                qk0=u[QK0] - u[TURN0],
                soft0=u[SOFT0] - u[QK0],
                mainloop=u[LAST_PV0] - u[SOFT0],
                qfree_to_copy=u[Q_COPY] - p[LAST_QK0],
                copy_to_start=u[START0] - u[Q_COPY],
                tile0_issue=u[TILE0] - u[Q_COPY],
                q_issue=u[Q_ISSUED] - u[Q_COPY],
                lookup=u[LOOKUP] - u[Q_ISSUED],
                empty_wait=u[EMPTY] - u[LOOKUP],
                tma_issue=u[TILE0] - u[EMPTY],
                lastqk_to_lastpv=p[LAST_PV0] - p[LAST_QK0],
                c1_lag=u[START1] - u[START0],
                c1_end_lag=u[END1] - u[END0],
            ))
    return rows


def report(name, rows, us_trace, us_plain):
    if not rows:
        print(f"trace {name}: no stamped unit pairs")
        return
    tiles = np.array([r["tiles"] for r in rows], float)
    unit = np.array([r["unit"] for r in rows], float)
    fit = np.polyfit(tiles, unit, 1) if len(set(tiles)) > 1 else (np.median(unit / tiles), 0.0)
    print(f"trace {name:22s} {len(rows)} unit pairs, median tiles {np.median(tiles):.0f}; time {us_plain:.1f} us "
          f"(traced build {us_trace:.1f})", flush=True)
    if len(set(tiles)) > 1:
        print(f"trace {name:22s} fit: unit = {fit[1]:.0f} + {fit[0]:.0f} x tiles cycles", flush=True)
    tile_cycles = np.median(np.array([r["mainloop"] for r in rows], float) / np.maximum(tiles - 1, 1))
    print(f"trace {name:22s} mainloop cycles per tile after the first (consumer 0): {tile_cycles:.0f}", flush=True)
    for key in rows[0]:
        if key == "tiles":
            continue
        x = np.array([r[key] for r in rows], float)
        print(f"trace {name:22s} {key:18s} median {np.median(x):8.0f}  p10 {np.percentile(x, 10):8.0f}  "
              f"p90 {np.percentile(x, 90):8.0f} cycles  = {np.median(x) / tile_cycles:5.2f} tiles", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--only", default="", help="comma list of case names")
    ap.add_argument("--paged", action="store_true", help="also the paged page-16 causal b8_S2048 case")
    args = ap.parse_args()
    if args.compile:
        for defs in ((), TRACE):
            prefill.SM90_TUNING = defs
            prefill.sm90_spec(128, Variant(), "bfloat16").compile("sm_90a")
            prefill.sm90_spec(128, Variant(), "bfloat16", interleaved=True).compile("sm_90a")
        prefill.SM90_TUNING = ()
        return
    import bench_prefill as bp
    rng = np.random.default_rng(0)
    cases = [c for c in CASES if not args.only or c[0] in args.only.split(",")]
    cases += ([("paged causal b8_S2048", 8, 2048, True)] if args.paged else [])
    for name, b, s, causal in cases:
        run = bp.paged_case if name.startswith("paged") else bp.ragged_case
        extra = () if name.startswith("paged") else (name,)
        prefill.SM90_TUNING = ()
        _, us_plain, _ = run(rng, *extra, [s] * b, [s] * b, 128, causal=causal, backend="sm90")
        prefill.SM90_TUNING = TRACE
        w, us_trace, err = run(rng, *extra, [s] * b, [s] * b, 128, causal=causal, backend="sm90")
        prefill.SM90_TUNING = ()
        report(name, stretches(read_trace(w)), us_trace, us_plain)
        print(f"trace {name:22s} err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
