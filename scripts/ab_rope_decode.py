"""PYTHONPATH=. python3 scripts/ab_rope_decode.py

A/B in turns: RoPE decode (NeoX, theta 5e5) with 2 stages (default, 3 CTAs / SM) vs 3 stages (2 CTAs / SM) vs
refill-first; plain beside. One request of each case checked against the reference."""
import os
import sys
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, random_device, time_rounds
from kvattn import reference
ROPE = kvattn.RoPE(theta=5e5)
rng = np.random.default_rng(0)
for case, lens in (("b64_L4096", [4096] * 64), ("b1_L65536", [65536])):
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), 16, rng=rng)
    shape = (pt.num_pages_used, 16, 8, 128)
    k, v = random_device(shape, "bfloat16", rng), random_device(shape, "bfloat16", rng)
    q = random_device((len(lens), 32, 128), "bfloat16", rng)
    out = kvattn.empty(q.shape, "bfloat16")
    ws = {}
    for name, kw, tn in (("plain", {}, None), ("rope st2", dict(rope=ROPE), None),
                         ("rope st3", dict(rope=ROPE), dict(stages=3)),
                         ("rope st3 refill1st", dict(rope=ROPE), dict(stages=3, refill_first=True))):
        w = ws[name] = kvattn.BatchDecodeWithPagedKVCache(tuning=tn)
        w.plan(pt, 32, 8, 128, **kw)
    t = time_rounds({n: (lambda w=w: w.run(q, k, v, out=out)) for n, w in ws.items()})
    errs = {}
    for n, w in ws.items():
        if n == "plain":
            continue
        w.run(q, k, v, out=out)
        pages = pt.pages(0)
        kk = np.concatenate([k[int(pg)].numpy() for pg in pages])[:lens[0]].astype(np.float64)
        vv = np.concatenate([v[int(pg)].numpy() for pg in pages])[:lens[0]].astype(np.float64)
        qq = reference.apply_rope(q[0:1].numpy().astype(np.float64), [lens[0] - 1], rope_theta=ROPE.theta)
        kk = reference.apply_rope(kk, np.arange(lens[0]), rope_theta=ROPE.theta)
        ro = reference.attention(qq, kk, vv)
        errs[n] = float(np.linalg.norm(out[0:1].numpy() - ro) / np.linalg.norm(ro))
    print(case, " ".join(f"{n}: {us:.1f}us ({t['plain'] / us:.3f})" for n, us in t.items()),
          " err", {n: f"{e:.0e}" for n, e in errs.items()}, flush=True)
