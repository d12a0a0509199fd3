"""PYTHONPATH=. python3 scripts/ab_rope_decode.py

A/B in turns: RoPE decode (NeoX, theta 5e5) with 2 stages (default, 3 CTAs / SM) vs 3 stages (2 CTAs / SM) vs
refill-first; plain beside. One request of each case checked against the reference."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, random_device, request_kv, time_rounds  # noqa: E402
from bench_variants import ROPE, expected  # noqa: E402

CONFIGS = (("plain", {}, None), ("rope st2", dict(rope=ROPE), None), ("rope st3", dict(rope=ROPE), dict(stages=3)),
           ("rope st3 refill1st", dict(rope=ROPE), dict(stages=3, refill_first=True)))


def main():
    rng = np.random.default_rng(0)
    for case, lens in (("b64_L4096", [4096] * 64), ("b1_L65536", [65536])):
        pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), 16, rng=rng)
        shape = (pt.num_pages_used, 16, 8, 128)
        k, v = random_device(shape, "bfloat16", rng), random_device(shape, "bfloat16", rng)
        q = random_device((len(lens), 32, 128), "bfloat16", rng)
        out = kvattn.empty(q.shape, "bfloat16")
        ws = {}
        for name, kw, tn in CONFIGS:
            ws[name] = kvattn.BatchDecodeWithPagedKVCache(tuning=tn)
            ws[name].plan(pt, 32, 8, 128, **kw)
        t = time_rounds({n: (lambda w=w: w.run(q, k, v, out=out)) for n, w in ws.items()})
        kk, vv = request_kv(pt, k, v, 0)   # request 0 against the reference
        ro = expected("rope", q[0:1].numpy(), kk, vv)
        errs = {}
        for n, w in ws.items():
            if n != "plain":
                w.run(q, k, v, out=out)
                errs[n] = f"{np.linalg.norm(out[0:1].numpy() - ro) / np.linalg.norm(ro):.0e}"
        print(case, " ".join(f"{n}: {us:.1f}us ({t['plain'] / us:.3f})" for n, us in t.items()), " err", errs,
              flush=True)


if __name__ == "__main__":
    main()
