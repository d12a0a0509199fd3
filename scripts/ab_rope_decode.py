"""PYTHONPATH=. python3 scripts/ab_rope_decode.py

A/B in turns: RoPE decode (NeoX, theta 5e5; GPT-J where named) with the key rows rotated in float32 (the build
before) vs in the cache type's packed arithmetic (the default), the next row's angle by a rotation (the default) or
by Chebyshev's recurrence, 8 (the default) or 4 rows loaded together; plain beside.
`--stages`: the earlier A/B of 2 stages (3 CTAs / SM) vs 3 (2 CTAs / SM) vs refill-first. `--refill`: the default
2-stage kernel with and without refill-first (the freed slot refilled before the wait), plain and RoPE. One request
of each case checked against the float64 reference."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, random_device, request_kv, time_rounds  # noqa: E402
from bench_variants import ROPE, ROPE_GPTJ, expected  # noqa: E402

STAGE_CONFIGS = (("plain", {}, None), ("rope st2", dict(rope=ROPE), None),
                 ("rope st3", dict(rope=ROPE), dict(stages=3)),
                 ("rope st3 refill1st", dict(rope=ROPE), dict(stages=3, refill_first=True)))
REFILL_CONFIGS = (("plain", {}, None), ("plain refill1st", {}, dict(refill_first=True)),
                  ("rope", dict(rope=ROPE), None), ("rope refill1st", dict(rope=ROPE), dict(refill_first=True)))
F32, CHEB = ("KVATTN_ROPE_F32", 1), ("KVATTN_ROPE_CHEB", 1)   # the float32 build before; Chebyshev's angles
BATCH4 = ("KVATTN_ROPE_BATCH", 4)   # rows loaded together (the default: 8)
CONFIGS = (("plain", {}, None), ("rope f32", dict(rope=ROPE), dict(rope_defines=(F32,))),
           ("rope packed (default: rot b8)", dict(rope=ROPE), None),
           ("rope packed rot b4", dict(rope=ROPE), dict(rope_defines=(BATCH4,))),
           ("rope packed cheb b4", dict(rope=ROPE), dict(rope_defines=(CHEB, BATCH4))),
           ("gptj f32", dict(rope=ROPE_GPTJ), dict(rope_defines=(F32,))),
           ("gptj packed", dict(rope=ROPE_GPTJ), None))


def main():
    configs = STAGE_CONFIGS if "--stages" in sys.argv else REFILL_CONFIGS if "--refill" in sys.argv else CONFIGS
    rng = np.random.default_rng(0)
    for case, lens in (("b64_L4096", [4096] * 64), ("b16_L32768", [32768] * 16), ("b1_L65536", [65536])):
        pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), 16, rng=rng)
        shape = (pt.num_pages_used, 16, 8, 128)
        k, v = random_device(shape, "bfloat16", rng), random_device(shape, "bfloat16", rng)
        q = random_device((len(lens), 32, 128), "bfloat16", rng)
        out = kvattn.empty(q.shape, "bfloat16")
        ws = {}
        for name, kw, tn in configs:
            ws[name] = kvattn.BatchDecodeWithPagedKVCache(tuning=tn)
            ws[name].plan(pt, 32, 8, 128, **kw)
        t = time_rounds({n: (lambda w=w: w.run(q, k, v, out=out)) for n, w in ws.items()})
        kk, vv = request_kv(pt, k, v, 0)   # request 0 against the reference
        ro = expected("rope", q[0:1].numpy(), kk, vv)
        ro_gptj = expected("rope GPT-J", q[0:1].numpy(), kk, vv)
        errs = {}
        for n, kw, _ in configs:
            if "rope" in kw:   # (the plain builds have no RoPE reference here)
                ws[n].run(q, k, v, out=out)
                ref = ro if "gptj" not in n else ro_gptj
                errs[n] = f"{np.linalg.norm(out[0:1].numpy() - ref) / np.linalg.norm(ref):.1e}"
        print(case, " ".join(f"{n}: {us:.1f}us ({t['plain'] / us:.3f})" for n, us in t.items()), " err", errs,
              flush=True)


if __name__ == "__main__":
    main()
