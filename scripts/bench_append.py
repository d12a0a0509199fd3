"""Paged KV-cache append on the GPU: kvattn.append_paged_kv_cache vs FlashInfer's, same process.

    PYTHONPATH=. python scripts/bench_append.py [--no-peers] [--json out.jsonl]

bf16, Hkv 8, D 128, page 16, pages scattered. Columns: dev_us (device index arrays: the capturable path, kvattn
arrays), torch_us (every argument a torch tensor), host_path_us (numpy indices and a PageTable: checked, copied),
graph_us (the device path captured once, replayed); TBps / frac: bytes read + written (2 x the new K and V) against
the copy ceiling; host_us: host time of one device-path call (1000 calls, no sync between); fi_us: FlashInfer's
append_paged_kv_cache on the same torch tensors. ok: every appended slot holds its token's K and V bit for bit.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, record, table, try_flashinfer  # noqa: E402
from kvattn import graphs  # noqa: E402
from kvattn.formats import PageTable  # noqa: E402
from kvattn.timing import copy_bandwidth_tbs, time_us  # noqa: E402

HKV, D, PAGE = 8, 128, 16
CASES = {"b256_append1_kv512": ([512] * 256, [1] * 256), "b8_append4096_kv4096": ([4096] * 8, [4096] * 8)}


def run_case(name, kv_after, new, rng, ceiling, torch, fi, jsonl):
    kv_after, new = np.asarray(kv_after), np.asarray(new)
    pt = PageTable.from_kv_lens(kv_after, PAGE, rng=rng)
    npages = pt.indices.size
    tk = torch.randn((npages, PAGE, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn_like(tk)
    ind = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    nnz = int(ind[-1])
    kn = torch.randn((nnz, HKV, D), dtype=torch.bfloat16, device="cuda")
    vn = torch.randn_like(kn)
    b, pos = kvattn.get_batch_indices_positions(ind, pt)
    dev = lambda a: torch.from_numpy(np.array(a, np.int32)).cuda()
    tb, tp, t_indptr, t_idx, t_last = dev(b), dev(pos), dev(pt.indptr), dev(pt.indices), dev(pt.last_page_len)
    torch.cuda.synchronize()
    ka, va, kna, vna = (kvattn.asarray(x) for x in (tk, tv, kn, vn))
    ba, pa = kvattn.asarray(tb), kvattn.asarray(tp)
    tab = tuple(kvattn.asarray(x) for x in (t_indptr, t_idx, t_last))
    call = lambda: kvattn.append_paged_kv_cache(kna, vna, None, ka, va, tab, batch_indices=ba, positions=pa)
    nbytes = 2 * 2 * nnz * HKV * D * 2
    row = dict(case=name, nnz=nnz)
    us = time_us(call)
    row.update(dev_us=round(us, 1), TBps=round(nbytes / us / 1e6, 2), frac=round(nbytes / us / 1e6 / ceiling, 3))
    row["torch_us"] = round(time_us(lambda: kvattn.append_paged_kv_cache(
        kn, vn, None, tk, tv, (t_indptr, t_idx, t_last), batch_indices=tb, positions=tp)), 1)
    row["host_path_us"] = round(time_us(lambda: kvattn.append_paged_kv_cache(kn, vn, ind, tk, tv, pt)), 1)
    kvattn.default_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        call()
    row["host_us"] = round((time.perf_counter() - t0) * 1e3, 2)
    kvattn.default_stream().synchronize()
    s = kvattn.Stream()
    with graphs.capture(s) as cap:
        kvattn.append_paged_kv_cache(kna, vna, None, ka, va, tab, batch_indices=ba, positions=pa, stream=s)
    tk.zero_()
    tv.zero_()
    torch.cuda.synchronize()
    row["graph_us"] = round(time_us(lambda: cap.graph.replay(s), stream=s), 1)
    s.synchronize()
    page = t_idx[t_indptr[tb.long()].long() + (tp // PAGE).long()].long()
    slot = (tp % PAGE).long()
    ok = bool(torch.equal(tk[page, slot], kn) and torch.equal(tv[page, slot], vn))
    row["ok"] = ok
    if fi is not None:
        try:
            row["fi_us"] = round(time_us(lambda: fi.append_paged_kv_cache(kn, vn, tb, tp, (tk, tv), t_idx, t_indptr,
                                                                           t_last, kv_layout="NHD")), 1)
            row["vs_fi"] = round(row["fi_us"] / row["dev_us"], 2)
        except Exception as exc:
            row["fi_us"] = f"error {exc.__class__.__name__}: {str(exc)[:60]}"
    torch.cuda.synchronize()
    record(jsonl, **row)
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the large case at 1, 2, 4, 8 heads per thread")
    ap.add_argument("--hints", action="store_true", help="also time both cases with page.cuh's cache hints 1 and 2")
    ap.add_argument("--loads-first", action="store_true",
                    help="also time both cases with the new rows' loads issued before the page lookup, in turns")
    args = ap.parse_args()
    import torch
    rng = np.random.default_rng(0)
    ceiling = copy_bandwidth_tbs()
    print(f"copy ceiling {ceiling:.3f} TB/s; GPU {kvattn._driver.device_name()}")
    _, fi = (None, None) if args.no_peers else try_flashinfer()
    rows = [run_case(n, kv, new, rng, ceiling, torch, fi, args.json) for n, (kv, new) in CASES.items()]
    def sweep(knob, values, tag):
        """Both cases under each value of page.<knob> in turn (the launchers rebuilt), then the default again."""
        from kvattn import page
        default = getattr(page, knob)
        for x in values:
            setattr(page, knob, x)
            page._launchers.clear()
            for n in ("b256_append1_kv512", "b8_append4096_kv4096"):
                r = run_case(n, *CASES[n], rng, ceiling, torch, None, args.json)
                rows.append(dict(r, case=f"{n} {tag}={x}"))
        setattr(page, knob, default)
        page._launchers.clear()
    if args.sweep:
        sweep("HEADS_PER_THREAD", (1, 2, 8, 4), "HPT")
    if args.hints:   # in turns with the plain kernel (hints 0 last), the cache's bits checked as every case's
        sweep("HINTS", (1, 2, 0, 1, 2, 0), "hints")
    if args.loads_first:   # in turns with the default kernel, the cache's bits checked as every case's
        sweep("LOADS_FIRST", (1, 0, 1, 0, 1, 0), "loads_first")
    print(f"\npaged KV append, bf16 Hkv8/D128 page 16; us; copy ceiling {ceiling:.2f} TB/s")
    table(rows, ["case", "nnz", "dev_us", "TBps", "frac", "torch_us", "host_path_us", "graph_us", "host_us", "fi_us",
                 "vs_fi", "ok"])


if __name__ == "__main__":
    main()
