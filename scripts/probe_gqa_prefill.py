"""Large GQA groups in decode: the decode kernel (mma.sync, m_tiles) against the sm90 prefill kernel (wgmma, one
query token of `group` packed rows per item, KV split by its scheduler), same paged data, timed in turns.

    PYTHONPATH=. python3 scripts/probe_gqa_prefill.py [--all]

Issue 12's GQA 32 case (Hq 32, Hkv 1) runs at 0.55 of copy on the decode kernel: issue-bound on mma.sync with 8
warps an SM (BENCHMARKS.md, run 20b). A wgmma tile of 64 rows holds a group of 32 at half its rows; if the prefill
kernel streams such a batch near the copy rate, large groups can take that path ("decode (auto)": the decode
wrapper's default, tuning sm90_route; "routed, wg split": the route on the instance whose two consumer warpgroups
split each unit's KV tiles, tuning sm90_route_wg_split=True, instead of the default 128-row ping-pong; run 37e: 46.8
against 45.8 us; "routed, fused merge": the route with its split blocks merged inside the sm90 kernel, tuning
sm90_route_fused_merge=True, no merge launch, runs 43a-43d: 1-5 us slower; "routed, 2 waves": tuning
sm90_route_waves=2, run 36a 51.2 against 45.9 us, no longer timed; head slices of 16 rows before KV splits, run 43e:
slower or equal, removed; "routed, unit a request" and "..., wg split": the route planned for as many SMs as the
batch has (request, KV head) units, where those are 64 or more (about half the GPU), so no request is split and no
merge runs: each CTA streams twice the default's bytes; can half the SMs draw the HBM's rate? On the H200 this
was run 39a (session 25): 65.8 us ping-pong, 47.8 wg split, against 46.4 for the default: a CTA streams at most
~44-50 GB/s, so no. Not yet run on an H100, whose copy rate needs ~47 GB/s of each of 64 SMs; prediction (H100,
b64_L4096, default 57.1 us): 55-62 us on the ping-pong, 48-54 us with the warpgroups splitting the KV tiles, whose
tensor work per CTA then stays at the default's; a win there would be an H100-only rule).
Every figure is checked against the float64 reference
(bench_decode.sample_error).
"""
from __future__ import annotations

import sys

import numpy as np

from _bench import kvattn, time_rounds
from bench_decode import build, sample_error
from kvattn.prefill import BatchPrefillWithPagedKVCache
from kvattn.timing import copy_bandwidth_tbs

CASES = [("GQA32 b64_L4096", 32, 1, [4096] * 64), ("GQA32 b16_L16384", 32, 1, [16384] * 16),
         ("GQA32 b32_L4096", 32, 1, [4096] * 32), ("GQA32 b8_L8192", 32, 1, [8192] * 8),
         ("GQA32 b32_L2048", 32, 1, [2048] * 32), ("GQA32 b8_L2048", 32, 1, [2048] * 8),
         ("GQA64 b8_L4096", 64, 1, [4096] * 8)]
if "--all" in sys.argv:   # the cases the route does not take (run 37e's table)
    CASES += [("GQA16 Hq64/Hkv4", 64, 4, [4096] * 64), ("anchor Hq32/Hkv8", 32, 8, [4096] * 64)]


def main():
    rng = np.random.default_rng(0)
    copy = copy_bandwidth_tbs()
    print(f"copy {copy:.3f} TB/s")
    for name, hq, hkv, lens in CASES:
        cfg = dict(hq=hq, hkv=hkv, d=128, dtype="bfloat16", layout="NHD", page=16)
        pt, q, k, v = build(lens, cfg, rng)
        qo_indptr = np.arange(len(lens) + 1, dtype=np.int32)
        units = len(lens) * hkv   # (request, KV head) units: a grid of that many CTAs splits no request
        whole = 64 <= units < kvattn.device.get().sm_count   # (about half of an H100's or H200's 132 SMs, or more)
        names = ["decode", "decode (auto)", "routed, wg split", "routed, fused merge", "sm90 prefill", "sm80 prefill"]
        names += ["routed, unit a request", "routed, unit a request, wg split"] if whole else []
        outs = {n: kvattn.empty(q.shape, "bfloat16") for n in names}
        wd = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route=False))   # the decode kernel
        wd.plan(pt, hq, hkv, 128, q_dtype="bfloat16")
        wr = kvattn.BatchDecodeWithPagedKVCache()   # the decode wrapper's default (sm90_route auto)
        wr.plan(pt, hq, hkv, 128, q_dtype="bfloat16")
        w1 = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route_wg_split=True))   # warpgroups split the KV
        w1.plan(pt, hq, hkv, 128, q_dtype="bfloat16")
        w2 = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(sm90_route_fused_merge=True))   # no merge launch
        w2.plan(pt, hq, hkv, 128, q_dtype="bfloat16")
        w9 = BatchPrefillWithPagedKVCache(backend="sm90")
        w9.plan(qo_indptr, pt, hq, hkv, 128, q_dtype="bfloat16", cta_rows=128)
        w8 = BatchPrefillWithPagedKVCache(backend="sm80")
        w8.plan(qo_indptr, pt, hq, hkv, 128, q_dtype="bfloat16")
        ws = {"decode": wd, "decode (auto)": wr, "routed, wg split": w1, "routed, fused merge": w2, "sm90 prefill": w9,
              "sm80 prefill": w8}
        for n, wg in (("routed, unit a request", False), ("routed, unit a request, wg split", True)):
            if n in outs:
                ws[n] = kvattn.BatchDecodeWithPagedKVCache(num_sms=units, tuning=dict(sm90_route_wg_split=wg))
                ws[n].plan(pt, hq, hkv, 128, q_dtype="bfloat16")
        fns = {n: (lambda w=w, o=outs[n]: w.run(q, k, v, out=o)) for n, w in ws.items()}
        for f in fns.values():
            f()
        us = time_rounds(fns)
        nbytes = 2 * sum(lens) * hkv * 128 * 2
        for n in fns:
            err = sample_error(rng, lens, pt, q, k, v, outs[n], cfg)
            tbs = nbytes / us[n] / 1e6
            info = ws[n].last_plan.info
            sched = info.get("schedule") if "cta_rows" in info else None   # (a prefill plan's)
            print(f"{name:18s} {n:32s} {us[n]:8.1f} us {tbs:6.3f} TB/s {tbs / copy:5.3f} of copy  err {err:.1e}"
                  + (f"  (rows {info['cta_rows']}, items {sched.num_items}, chunks {sched.max_chunks}, "
                     f"fused {info.get('fused_merge')}, grid {info['grid']})"
                     if sched is not None else ""), flush=True)


if __name__ == "__main__":
    main()
