"""Decode latency of small batches, eager and as serving engines run a decode step: inside a CUDA graph.

    PYTHONPATH=. python3 scripts/bench_latency.py [--cases b1_L2048,...]

Per case and merge placement (the plan's choice, `auto`, and the merge kernel forced, `apart`): `eager` = the
median of back-to-back run() calls bracketed by events (host launch cost included where it exceeds the GPU's);
`graph` = one graph of STEPS run() calls replayed, its event time / STEPS (the GPU's time per step, launch gaps
between kernels included). bf16 Hq32/Hkv8/D128, page 16, pages scattered; each case checked against the reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import decode_cases, kvattn, last_request_error, table  # noqa: E402
from kvattn.stream import Event  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D, PAGE, STEPS = 32, 8, 128, 16, 20
CASES = {"b1_L512": [512], "b1_L2048": [2048], "b4_L1024": [1024] * 4, "b1_L8192": [8192], "b8_L2048": [2048] * 8,
         "b32_L2048": [2048] * 32}


def graph_us(run, stream) -> float:
    """GPU microseconds per step: STEPS calls captured once, the replay timed (median of 10)."""
    with kvattn.graphs.capture(stream) as cap:
        for _ in range(STEPS):
            run()
    g = cap.graph
    g.replay(stream)
    times = []
    for _ in range(10):
        a, b = Event(), Event()
        a.record(stream)
        g.replay(stream)
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_ms(b) * 1e3 / STEPS)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    if not kvattn.gpu_available():
        print("bench_latency: no CUDA GPU found")
        return 0
    rows = []
    for name, lens, pt, q, k, v, s in decode_cases(args.cases.split(","), CASES, PAGE, HQ, HKV, D):
        row = dict(case=name)
        for label, tn in (("auto", None), ("apart", dict(fused_merge=False))):
            out = kvattn.empty(q.shape, "bfloat16")
            w = kvattn.BatchDecodeWithPagedKVCache(tuning=tn)
            w.plan(pt, HQ, HKV, D, stream=s)
            run = lambda w=w, out=out: w.run(q, k, v, out=out, stream=s)   # noqa: E731
            row[f"{label} eager"] = f"{time_us(run, stream=s, reps=200):.1f}"
            row[f"{label} graph"] = f"{graph_us(run, s):.1f}"
            row[f"{label} err"] = f"{last_request_error(pt, q, k, v, out, s):.0e}"
            if tn is None:
                row["auto merge"] = "in launch" if w.last_plan.merge is None else "kernel"
        rows.append(row)
        print(row, flush=True)
    print(f"\ndecode latency, us per step ({kvattn._driver.device_name()}); graph = {STEPS} steps in one graph")
    table(rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
