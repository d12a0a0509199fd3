"""Where a latency-bound split-KV decode launch's time goes, from in-kernel global-timer stamps (issue 12's b1_L2048:
the fused merge's launch took ~16.5 us of GPU time against 9 + 5 us for the decode and merge kernels apart, and
staging the states in shared memory did not change it):

    PYTHONPATH=. python3 scripts/trace_decode.py [--cases b1_L2048,b1_L512] [--chunks]
    python3 scripts/trace_decode.py --compile          # fill KVATTN_CACHE_DIR (no GPU)

The build with KVATTN_DECODE_TRACE=1 (cuda_src/decode.cuh: DecodeTraceEvent) has thread 0 of every CTA stamp
%globaltimer (ns, one clock for the whole GPU) at its start, when its partial state is written, when its arrival
has been counted (fused merge), when its merge is written (the last CTA of a request's pieces) and at its end.
Per case and merge mode (fused / apart) this prints, relative to the first CTA's start (us): the spread of the
CTAs' starts, stream ends, arrivals and ends, and the merging CTAs' merge times, for the last of 20 back-to-back
launches; and the launch's event-timed GPU time on the default build beside it (what the stamps cost).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import decode_cases, kvattn, last_request_error, read_device_global, table  # noqa: E402
from kvattn import decode  # noqa: E402
from kvattn.timing import time_us  # noqa: E402
from kvattn.variants import Variant  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = {"b1_L512": [512], "b1_L2048": [2048], "b4_L1024": [1024] * 4}
#: merge modes: the fused merge loading 4 states a round a lane (the default since run 33b) or one (the kernel
#: before: fused_merge_batch 1), or the merge kernel apart
MERGES = {"fused": dict(fused_merge=True), "fused_b1": dict(fused_merge=True, fused_merge_batch=1),
          "apart": dict(fused_merge=False)}
#: --chunks: the fused launch with small batches cut into chunks of at least 96 / 64 / 32 tokens (tuning
#: min_chunk_tokens; the default 128), its GPU time read from the stamps whatever the host
CHUNKS = {"fused": dict(fused_merge=True), **{f"fused_c{n}": dict(fused_merge=True, min_chunk_tokens=n)
                                              for n in (96, 64, 32, "auto")}}
CTAS, EVENTS = 1024, 8   # cuda_src/decode.cuh: KVATTN_DTRACE_*
START, STREAM_END, ARRIVED, MERGED, END, LAST = range(6)


def read_trace(w):
    return read_device_global(w.last_plan.launches[0].kernel.module, b"kvattn_decode_trace").reshape(CTAS, EVENTS)


def summarize(tr, ctas):
    """Spread (min / median / max, us from the first start) of each event over the launch's CTAs."""
    tr = tr[:ctas]
    t0 = tr[:, START].min()
    row = {}
    for name, e in (("start", START), ("stream end", STREAM_END), ("arrived", ARRIVED), ("end", END)):
        x = tr[:, e][tr[:, e] > 0]
        if x.size:
            row[name] = "/".join(f"{v:.1f}" for v in np.percentile((x - t0) / 1e3, [0, 50, 100]))
    merged = tr[tr[:, LAST] == 1]
    if merged.size:
        row["merge (last CTAs)"] = "/".join(f"{v:.1f}" for v in
                                            np.percentile((merged[:, MERGED] - merged[:, ARRIVED]) / 1e3, [0, 50, 100]))
    return row


def compile_all():
    for trace in (False, True):
        for batch in (1, 4):
            decode.decode_spec(D, 1, Variant(), "bfloat16", trace=trace, fused_merge_batch=batch).compile("sm_90a")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--chunks", action="store_true", help="the chunk sizes (CHUNKS) instead of the merge modes")
    args = ap.parse_args()
    modes = CHUNKS if args.chunks else MERGES
    if args.compile:
        compile_all()
        return 0
    if not kvattn.gpu_available():
        print("trace_decode: no CUDA GPU found")
        return 0
    rows = []
    for name, lens, pt, q, k, v, s in decode_cases(args.cases.split(","), CASES, PAGE, HQ, HKV, D):
        for merge in modes:
            row = dict(case=name, merge=merge)
            for trace in (False, True):
                out = kvattn.empty(q.shape, "bfloat16")
                w = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(**modes[merge], trace=trace))
                w.plan(pt, HQ, HKV, D, stream=s)
                run = lambda w=w, out=out: w.run(q, k, v, out=out, stream=s)   # noqa: E731
                row["traced us" if trace else "us"] = f"{time_us(run, stream=s, reps=20):.1f}"
                if trace:
                    grid = w.last_plan.info["grid"]
                    row["ctas"] = grid[0] * grid[1]
                    read_trace(w)   # (clears the stamps of the timed launches: a CTA that merged in one of them
                    run()           # but not in the last would keep that launch's stamps)
                    row.update(summarize(read_trace(w), grid[0] * grid[1]))
                row["err"] = f"{last_request_error(pt, q, k, v, out, s):.0e}"
            rows.append(row)
            print(row, flush=True)
    print(f"\ndecode launch timeline, us from the first CTA's start (min/median/max over CTAs; last of 20 launches; "
          f"{kvattn._driver.device_name()})")
    table(rows, ["case", "merge", "us", "traced us", "ctas", "start", "stream end", "arrived", "merge (last CTAs)",
                 "end", "err"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
