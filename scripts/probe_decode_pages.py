"""PYTHONPATH=. python3 scripts/probe_decode_pages.py

Why decode at page size 1 trails page 16 (issue 12): b64_L4096 (bf16 Hq32/Hkv8/D128, NHD) at page sizes 1 and 16,
pages scattered over the pool (as an allocator leaves them) or in order (page ids 0, 1, 2, ...), timed in turns in
one process. If page 1 in order runs near page 16, the cost is where the rows lie in memory (DRAM / TLB locality),
not the kernel's page-id loads (run 28c: it does not). Then the A/B at page sizes 16 / 8 / 4 / 2 / 1 of the copies'
page ids loaded a tile ahead into registers (the default since run 28f) against the kernel before ("ids at use":
tuning ids_ahead=False). One request of each case checked against the float64 reference."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, random_device, request_kv, time_rounds  # noqa: E402
from kvattn import reference  # noqa: E402
from kvattn.timing import copy_bandwidth_tbs  # noqa: E402

LENS = [4096] * 64
HQ, HKV, D = 32, 8, 128


def case(page, scattered, rng):
    pt = kvattn.PageTable.from_kv_lens(np.asarray(LENS), page, rng=rng)
    if not scattered:   # the same table with its pages in pool order
        pt = kvattn.PageTable(pt.indptr, np.arange(pt.num_pages_used), pt.last_page_len, page)
    shape = (pt.num_pages_used, page, HKV, D)
    k, v = random_device(shape, "bfloat16", rng), random_device(shape, "bfloat16", rng)
    q = random_device((len(LENS), HQ, D), "bfloat16", rng)
    out = kvattn.empty(q.shape, "bfloat16")
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    return pt, q, k, v, out, w


def main():
    rng = np.random.default_rng(0)
    copy = copy_bandwidth_tbs()
    cases = {f"page{p} in order": case(p, False, rng) for p in (16, 1)}
    for p in (16, 8, 4, 2, 1):   # the A/B: page ids loaded a tile ahead (the default) against the kernel before
        data = cases[f"page{p} scattered"] = case(p, True, rng)
        before = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(ids_ahead=False))
        before.plan(data[0], HQ, HKV, D)
        cases[f"page{p} ids at use"] = data[:5] + (before,)
    t = time_rounds({n: (lambda c=c: c[5].run(c[1], c[2], c[3], out=c[4])) for n, c in cases.items()})
    nbytes = 2 * sum(LENS) * HKV * D * 2
    print(f"copy ceiling {copy:.2f} TB/s; b64_L4096 bf16 Hq{HQ}/Hkv{HKV}/D{D}")
    for n, (pt, q, k, v, out, w) in cases.items():
        w.run(q, k, v, out=out)
        kk, vv = request_kv(pt, k, v, 0)
        ro = reference.attention(q[0:1].numpy().astype(np.float64), kk.astype(np.float64), vv.astype(np.float64))
        err = np.linalg.norm(out[0:1].numpy() - ro) / np.linalg.norm(ro)
        tbs = nbytes / t[n] / 1e6
        print(f"{n:22s} {t[n]:8.1f} us  {tbs:5.2f} TB/s  {tbs / copy:.3f} of copy  err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
