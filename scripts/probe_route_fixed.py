"""GQA 32 decode (Hq32/Hkv1, b64) time against KV length: the sm90 route (128-row, wg_split), the decode kernel and a copy
of as many bytes, in turns, each checked against the float64 reference; then T = a + b * MB fitted (issue 12: where
the route loses, run 37g: a fixed ~14 us a call against the copy's 3, at 0.95 of the copy's marginal rate).

    PYTHONPATH=. python3 scripts/probe_route_fixed.py
"""
import numpy as np
import kvattn
from kvattn import _driver
from kvattn.stream import as_stream
from _bench import time_rounds
from bench_decode import build, sample_error
rng = np.random.default_rng(0)
cfg = dict(hq=32, hkv=1, d=128, dtype="bfloat16", layout="NHD", page=16)
rows = {"route": [], "route_wgsplit": [], "decode": [], "copy": []}
mbs = []
for L in (1024, 2048, 4096, 8192, 16384):
    lens = [L] * 64
    pt, q, k, v = build(lens, cfg, rng)
    nbytes = 2 * sum(lens) * 128 * 2
    src, dst = kvattn.empty((nbytes // 2,), "uint8"), kvattn.empty((nbytes // 2,), "uint8")
    s = as_stream(None)
    ws = {"route": kvattn.BatchDecodeWithPagedKVCache(),
          "route_wgsplit": kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route_wg_split=True)),
          "decode": kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route=False))}
    outs = {}
    for n, w in ws.items():
        w.plan(pt, 32, 1, 128, q_dtype="bfloat16")
        outs[n] = kvattn.empty(q.shape, "bfloat16")
    fns = {n: (lambda w=w, o=outs[n]: w.run(q, k, v, out=o)) for n, w in ws.items()}
    fns["copy"] = lambda: _driver.call("cuMemcpyDtoDAsync", dst.ptr, src.ptr, nbytes // 2, s.handle)
    for f in fns.values():
        f()
    us = time_rounds(fns)
    info = ws["route"].last_plan.info
    sched = info.get("schedule")
    errs = {n: sample_error(rng, lens, pt, q, k, v, outs[n], cfg) for n in ws}
    print(f"L{L:6d} {nbytes / 1e6:7.1f} MB " + " ".join(f"{n} {us[n]:7.1f}" for n in fns)
          + f"  items {sched.num_items} launches {len(ws['route'].last_plan.launches)} merge {sched.num_merge}"
          + f"  err {max(errs.values()):.1e}", flush=True)
    mbs.append(nbytes / 1e6)
    for n in fns:
        rows[n].append(us[n])
for n, ys in rows.items():
    b, a = np.polyfit(mbs, ys, 1)
    print(f"fit {n:14s} a = {a:6.2f} us fixed, {1 / b:6.3f} TB/s marginal (the KV bytes; the copy: read + written)")
