"""run()'s Python time on a machine without a GPU (issue 9's host cost, the part kvattn itself spends).

    .venv/bin/python scripts/probe_host_cpu.py [--profile]

The driver is faked (tests/_fake_driver.py: every cu* call answered at once), so what is timed is kvattn's own
Python around its driver calls: decode b1_L2048 and causal ragged prefill b8_S2048 (bf16 Hq32/Hkv8/D128, page 16)
with kvattn arrays, `out` given and out=None; then plan() of decode b1_L2048 and ragged / paged prefill b8_S2048
(best of 5 rounds of 300 calls); then append_paged_kv_cache's three index paths on bench_append.py's cases. The fake's own calls (one context query and one launch a run) are
timed alone and subtracted ("kvattn" column). On the GPU host the same Python costs about 1.7x this machine's
(session 22: 14.2 us a decode run() there, 5.7 of it the driver's launch). Best of 5 rounds of 20,000 calls.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _fake_driver import fake_driver  # noqa: E402

import kvattn  # noqa: E402
from kvattn import _driver  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def per_call_us(fn, n=20000, rounds=5) -> float:
    for _ in range(500):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def plan_cases():
    """{name: one plan() call}: decode b1_L2048, causal ragged and paged prefill b8_S2048."""
    rng = np.random.default_rng(0)
    pt = kvattn.PageTable.from_kv_lens(np.array([2048]), PAGE, rng=rng)
    dec = kvattn.BatchDecodeWithPagedKVCache()
    indptr = np.arange(9, dtype=np.int32) * 2048
    pt8 = kvattn.PageTable.from_kv_lens(np.full(8, 2048), PAGE, rng=rng)
    ragged, paged = kvattn.BatchPrefillWithRaggedKVCache(), kvattn.BatchPrefillWithPagedKVCache()
    return {"decode b1_L2048": lambda: dec.plan(pt, HQ, HKV, D),
            "ragged prefill b8_S2048": lambda: ragged.plan(indptr, indptr, HQ, HKV, D, causal=True),
            "paged prefill b8_S2048": lambda: paged.plan(indptr, pt8, HQ, HKV, D, causal=True)}


def append_cases():
    """{case: {path: one append_paged_kv_cache call}}: bench_append.py's two cases (bf16 Hkv8/D128, page 16) through
    a host PageTable with append_indptr, with host batch_indices / positions, and with device arrays."""
    out = {}
    for name, kv, new in (("b256 x 1 on 512", [512] * 256, [1] * 256), ("b8 x 4096 on 4096", [4096] * 8, [4096] * 8)):
        pt = kvattn.PageTable.from_kv_lens(np.array(kv), PAGE, rng=np.random.default_rng(0))
        indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        kn = kvattn.empty((int(indptr[-1]), HKV, D), "bfloat16")
        kc = kvattn.empty((pt.num_pages_used, PAGE, HKV, D), "bfloat16")
        b, pos = kvattn.get_batch_indices_positions(indptr, pt)
        dev = tuple(kvattn.empty(a.shape, "int32") for a in (pt.indptr, pt.indices, pt.last_page_len, b, pos))
        out[name] = {
            "PageTable + append_indptr": lambda kn=kn, kc=kc, i=indptr, pt=pt: kvattn.append_paged_kv_cache(
                kn, kn, i, kc, kc, pt),
            "host batch_indices": lambda kn=kn, kc=kc, pt=pt, b=b, pos=pos: kvattn.append_paged_kv_cache(
                kn, kn, None, kc, kc, pt, batch_indices=b, positions=pos),
            "device arrays": lambda kn=kn, kc=kc, d=dev: kvattn.append_paged_kv_cache(
                kn, kn, None, kc, kc, d[:3], batch_indices=d[3], positions=d[4])}
    return out


def cases():
    """{name: (run() with out given, run() with out=None)}"""
    rng = np.random.default_rng(0)
    pt = kvattn.PageTable.from_kv_lens(np.array([2048]), PAGE, rng=rng)
    dec = kvattn.BatchDecodeWithPagedKVCache()
    dec.plan(pt, HQ, HKV, D)
    k = kvattn.empty((pt.num_pages_used, PAGE, HKV, D), "bfloat16")
    v = kvattn.empty(k.shape, "bfloat16")
    q = kvattn.empty((1, HQ, D), "bfloat16")
    out = kvattn.empty(q.shape, "bfloat16")
    indptr = np.arange(9, dtype=np.int32) * 2048
    pre = kvattn.BatchPrefillWithRaggedKVCache()
    pre.plan(indptr, indptr, HQ, HKV, D, causal=True)
    pq = kvattn.empty((8 * 2048, HQ, D), "bfloat16")
    pk = kvattn.empty((8 * 2048, HKV, D), "bfloat16")
    pv = kvattn.empty(pk.shape, "bfloat16")
    po = kvattn.empty(pq.shape, "bfloat16")
    return {"decode b1_L2048": (lambda: dec.run(q, k, v, out=out), lambda: dec.run(q, k, v)),
            "prefill b8_S2048": (lambda: pre.run(pq, pk, pv, out=po), lambda: pre.run(pq, pk, pv))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions of each run()")
    args = ap.parse_args()
    with fake_driver() as calls:
        runs = cases()
        n = len(calls)
        runs["decode b1_L2048"][0]()
        per_run = len(calls) - n   # the fake's calls in one run(): a context query and the launch(es)
        fake_us = per_call_us(lambda: _driver.current_context_id()) * per_run
        print(f"{'case':<18} {'out given':>10} {'out=None':>10} {'kvattn (out given)':>20}")
        for name, (given, none) in runs.items():
            a, b = per_call_us(given), per_call_us(none)
            print(f"{name:<18} {a:>10.2f} {b:>10.2f} {a - fake_us:>20.2f}", flush=True)
        print(f"(the fake driver's {per_run} calls a run: {fake_us:.2f} us, subtracted in the last column)")
        print(f"\n{'plan()':<26} {'us (fake driver included)':>26}")
        for name, fn in plan_cases().items():
            print(f"{name:<26} {per_call_us(fn, n=300):>26.1f}", flush=True)
        print(f"\n{'append_paged_kv_cache':<20} {'path':<28} {'us (fake driver included)':>26}")
        for name, paths in append_cases().items():
            for path, fn in paths.items():
                print(f"{name:<20} {path:<28} {per_call_us(fn, n=1000):>26.1f}", flush=True)
        if args.profile:
            for name, (given, _) in runs.items():
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20000):
                    given()
                prof.disable()
                print(f"\n# {name}, out given")
                pstats.Stats(prof).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
