"""GQA 32 decode on the sm90 route (b64, Hq32/Hkv1): global-timer stamps (KVATTN_SM90_TRACE=2, ns, comparable across
CTAs) of each CTA's first unit: the start spread, when the first K/V tile landed, the last P V, the last end, against
the call's time (run 37j: L4096 47.8 us a call, 40.0 from the first CTA's start to the last end).

    PYTHONPATH=. python3 scripts/trace_route.py
"""
import numpy as np
import kvattn
from kvattn import prefill
from kvattn.timing import time_us
from bench_decode import build
from trace_sm90 import read_trace, Q_COPY, START0, LAST_PV0, END0, END1
rng = np.random.default_rng(0)
for L in (1024, 4096):
    cfg = dict(hq=32, hkv=1, d=128, dtype="bfloat16", layout="NHD", page=16)
    pt, q, k, v = build([L] * 64, cfg, rng)
    out = kvattn.empty(q.shape, "bfloat16")
    prefill.SM90_TUNING = (("KVATTN_SM90_TRACE", 2),)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, 32, 1, 128, q_dtype="bfloat16")
    prefill.SM90_TUNING = ()
    us = time_us(lambda: w.run(q, k, v, out=out))
    tr = read_trace(w)
    u = tr[:, 0, :].astype(np.int64)
    u = u[u[:, END0] > 0]
    t0 = u[:, Q_COPY].min()
    us_ = lambda x: (x - t0) / 1e3
    print(f"L{L}: call {us:.1f} us; {len(u)} CTAs; q_copy (start) spread {us_(u[:, Q_COPY]).max():.2f} us; "
          f"first data median {np.median(us_(u[:, START0])):.2f}; last pv median {np.median(us_(u[:, LAST_PV0])):.2f} "
          f"max {us_(u[:, LAST_PV0]).max():.2f}; end max {us_(np.maximum(u[:, END0], u[:, END1])).max():.2f} us",
          flush=True)
