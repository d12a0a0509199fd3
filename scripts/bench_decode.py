"""Batch decode benchmark on the GPU: kvattn vs the copy ceiling and FlashInfer (both decode paths), same process.

    PYTHONPATH=. python scripts/bench_decode.py [--extra] [--no-peers] [--json out.jsonl]

Every case is also checked against the float64 reference on a sample of requests (the longest included).
Useful bytes: K and V of the real lengths, read once.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from _bench import kvattn, random_device, record, table, time_rounds, torch_time_us, try_flashinfer
from kvattn import reference
from kvattn.timing import copy_bandwidth_tbs, time_us

SKEWED = [32768 if i % 16 == 0 else 256 + (i * 389) % 1024 for i in range(64)]
MAIN = {"b64_L4096": [4096] * 64, "b16_L32768": [32768] * 16, "b64_skewed": SKEWED,
        "b1_L65536": [65536], "b128_L1024": [1024] * 128}


def extra_cases():
    base = dict(hq=32, hkv=8, d=128, dtype="bfloat16", layout="NHD", page=16)
    out = {}
    for name, over in [("D64", dict(d=64)), ("D256", dict(d=256)), ("GQA1", dict(hq=32, hkv=32)),
                       ("GQA8", dict(hq=64, hkv=8)), ("GQA32", dict(hq=32, hkv=1)), ("GQA16", dict(hq=64, hkv=4)),
                       ("fp16", dict(dtype="float16")), ("HND", dict(layout="HND")), ("page1", dict(page=1))]:
        out[f"b64_L4096_{name}"] = ([4096] * 64, {**base, **over})
    for b in (1, 8, 32, 128, 256, 512):
        out[f"b{b}_L2048"] = ([2048] * b, base)
    out["b1_L512"], out["b4_L1024"] = ([512], base), ([1024] * 4, base)   # small batches' chunk sizes (run 34d)
    return out


TUNINGS = {"default": {}, "l2_256B": dict(l2_prefetch=True), "refill1st": dict(refill_first=True),
           "st3": dict(stages=3), "st3_refill1st": dict(stages=3, refill_first=True),
           "st4_refill1st": dict(stages=4, refill_first=True), "fused_merge": dict(fused_merge=True),
           "mt2": dict(m_tiles=2, sm90_route=False), "mt1": dict(m_tiles=1, sm90_route=False),
           "wtok16": dict(wtok=16), "merge_1lane": dict(merge_lanes=1),
           "merge_plain": dict(merge_programmatic=False),
           "merge_before": dict(merge_lanes=1, merge_programmatic=False), "merge_apart": dict(fused_merge=False),
           # the fused merge loading one state a round a lane (the kernel before run 33b; "fused_merge": 4)
           "fused_b1": dict(fused_merge=True, fused_merge_batch=1),
           # the kernel before run 28f: each tile's page-id loads used right away (ids_ahead: loaded a tile ahead)
           "ids_at_use": dict(ids_ahead=False),
           # 8-token warp tiles (head dim 256's default since run 29a: 2 CTAs per SM); at 256, wtok16 is the kernel
           # before (one CTA per SM, ids as used)
           "wtok8": dict(wtok=8), "wtok8_ids_ahead": dict(wtok=8, ids_ahead=True),
           # no split-KV merge where the batch fills the slots (as FlashInfer's tensor-core decode: b64_L4096 as 512
           # CTAs in about two waves of 2 per SM)
           "nosplit": dict(allow_no_split=True), "nosplit_2cta": dict(allow_no_split=True, ctas_per_sm=2),
           "nosplit_st3_2cta": dict(allow_no_split=True, ctas_per_sm=2, stages=3),
           # small batches cut into chunks of at least 96 / 64 / 32 tokens instead of 128 (b1_L2048: 17 / 21 / 32
           # chunks a KV head instead of 13), the merge fused into the launch or apart
           "chunk96_fused": dict(min_chunk_tokens=96, fused_merge=True),
           "chunk64_fused": dict(min_chunk_tokens=64, fused_merge=True),
           "chunk64_apart": dict(min_chunk_tokens=64, fused_merge=False),
           "chunk32_fused": dict(min_chunk_tokens=32, fused_merge=True),
           # the smallest chunk a sixteenth of the mean request (decode.auto_min_chunk_tokens: run 34d's lead)
           "chunk_auto_fused": dict(min_chunk_tokens="auto", fused_merge=True),
           # head dim 256 (groups <= 8): the slim kernel (8-row Q slots, 3 stages; off by default since run 34c)
           "slim": dict(slim=True), "slim_off": dict(slim=False),
           # GQA 32+: the decode kernel instead of the sm90 prefill kernel (the default route since run 35d), and the
           # route's KV split over two waves of slots (prepared in session 21)
           "route_off": dict(sm90_route=False), "route_waves2": dict(sm90_route_waves=2)}


def build(lens, cfg, rng):
    hq, hkv, d, dtype, layout, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["layout"], cfg["page"]
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), page, rng=rng)
    npages = pt.num_pages_used
    shape = (npages, page, hkv, d) if layout == "NHD" else (npages, hkv, page, d)
    k, v = random_device(shape, dtype, rng), random_device(shape, dtype, rng)
    q = random_device((len(lens), hq, d), dtype, rng)
    return pt, q, k, v


def time_kvattn(pt, q, k, v, cfg, tuning=None):
    out = kvattn.empty(q.shape, cfg["dtype"])
    w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=cfg["layout"], tuning=tuning)
    t0 = time.perf_counter()
    w.plan(pt, cfg["hq"], cfg["hkv"], cfg["d"], q_dtype=cfg["dtype"])
    plan_us = (time.perf_counter() - t0) * 1e6
    w.run(q, k, v, out=out)
    us = time_us(lambda: w.run(q, k, v, out=out))
    return us, out, w, plan_us


def sample_error(rng, lens, pt, q, k, v, out, cfg):
    """Max relative L2 error over the longest request and 3 random ones, against the float64 reference."""
    sample = sorted({int(np.argmax(lens)), *rng.choice(len(lens), min(3, len(lens)), replace=False).tolist()})
    qh, kh, vh, oh = q.numpy(), k.numpy(), v.numpy(), out.numpy()
    sub = kvattn.PageTable(np.concatenate([[0], np.cumsum([pt.indptr[i + 1] - pt.indptr[i] for i in sample])]),
                           np.concatenate([pt.indices[pt.indptr[i]:pt.indptr[i + 1]] for i in sample]),
                           pt.last_page_len[sample], cfg["page"])
    ro = reference.batch_attention_paged(qh[sample], kh, vh, np.arange(len(sample) + 1), sub, kv_layout=cfg["layout"])
    return max(float(np.linalg.norm(oh[i].astype(np.float64) - ro[j]) / np.linalg.norm(ro[j]))
               for j, i in enumerate(sample))


def run_case(name, lens, cfg, rng, ceiling, torch, fi, jsonl, tunings=None):
    lens = np.asarray(lens)
    pt, q, k, v = build(lens, cfg, rng)
    nbytes = int(lens.sum()) * cfg["hkv"] * cfg["d"] * 2 * k.itemsize
    us, out, w, plan_us = time_kvattn(pt, q, k, v, cfg)
    tbs = nbytes / us / 1e6
    err = sample_error(rng, lens, pt, q, k, v, out, cfg)
    row = dict(case=name, us=round(us, 1), TBps=round(tbs, 2), frac=round(tbs / ceiling, 3), err=f"{err:.1e}",
               plan_us=round(plan_us), chunks=w.last_plan.info["grid"][0], merges=w.last_plan.info["schedule"].num_merge)
    hq, hkv, d, dtype, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"]
    peers = {}   # FlashInfer's decode paths, planned: {column: run}
    if fi is not None and cfg["layout"] == "NHD":
        dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
        ind, idx, last = (torch.from_numpy(np.array(a)).cuda() for a in (pt.indptr, pt.indices, pt.last_page_len))
        for tc, col in ((False, "fi_cc"), (True, "fi_tc")):
            try:   # a workspace each: both stay planned for the turns below
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                fw.plan(ind, idx, last, hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)
                peers[col] = lambda fw=fw: fw.run(tq, (tk, tv))
            except Exception as exc:
                row[col] = f"error {exc.__class__.__name__}"
    for col, frun in peers.items():   # alone, after kvattn's own pass (as kvattn's us column)
        try:
            fus = torch_time_us(frun)
            row[col] = f"{fus:.0f}us {nbytes / fus / 1e6:.2f}"
            row[col + "_tbs"] = round(nbytes / fus / 1e6, 3)
        except Exception as exc:
            row[col] = f"error {exc.__class__.__name__}"
    if tunings:   # timed in turns (time_rounds): the clocks drift over a long sequence of timings
        fns = {}
        for tname, tuning in tunings.items():
            tw = kvattn.BatchDecodeWithPagedKVCache(kv_layout=cfg["layout"], tuning=tuning)
            tw.plan(pt, cfg["hq"], cfg["hkv"], cfg["d"], q_dtype=cfg["dtype"])
            tout = kvattn.empty(q.shape, cfg["dtype"])
            fns[tname] = lambda tw=tw, tout=tout: tw.run(q, k, v, out=tout)
        # the peers in the same turns (on the legacy default stream, torch's current one, as time_us times)
        fns.update({f"{col}_turns": frun for col, frun in peers.items() if isinstance(row.get(col + "_tbs"), float)})
        for tname, tus in time_rounds(fns).items():
            row[tname] = round(nbytes / tus / 1e6, 3)
    if peers:
        torch.cuda.synchronize()
    record(jsonl, **row, cfg=cfg)
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--extra", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the case names to run")
    ap.add_argument("--skip", default=None, help="comma-separated substrings of the case names to leave out")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peers-on", default=None, help="comma-separated substrings of the extra cases FlashInfer runs "
                    "too (it builds a module for each shape; GQA32 crashes it)")
    ap.add_argument("--tune", action="store_true", help="also time the tuning alternatives (TB/s columns), with "
                    "FlashInfer's decode paths in the same turns where it runs (fi_cc_turns, fi_tc_turns)")
    ap.add_argument("--tunings", default=None, help="with --tune: a comma-separated subset of " + ",".join(TUNINGS))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ceiling = copy_bandwidth_tbs()
    print(f"copy ceiling {ceiling:.3f} TB/s (2 GiB device-to-device, read + write); GPU "
          f"{kvattn._driver.device_name()}")
    record(args.json, section="ceiling", copy_TBps=round(ceiling, 3))
    torch, fi = (None, None) if args.no_peers else try_flashinfer()
    base = dict(hq=32, hkv=8, d=128, dtype="bfloat16", layout="NHD", page=16)
    cases = {k: (v, base) for k, v in MAIN.items()}
    if args.extra:
        cases.update(extra_cases())
    tune_names = args.tunings.split(",") if args.tunings else list(TUNINGS)
    rows = []
    for name, (lens, cfg) in cases.items():
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        if args.skip and any(o in name for o in args.skip.split(",")):
            continue
        # FlashInfer JIT-compiles a module per shape: main cases, and those --peers-on names
        peer = fi if name in MAIN or (args.peers_on and any(o in name for o in args.peers_on.split(","))) else None
        tunings = None
        if args.tune and (name in MAIN or args.tunings):
            tunings = {t: TUNINGS[t] for t in tune_names}
        rows.append(run_case(name, lens, cfg, rng, ceiling, torch, peer, args.json, tunings))
    print(f"\ndecode, bf16 unless named, Hq 32 Hkv 8 D 128 page 16 unless named; copy ceiling {ceiling:.2f} TB/s")
    table(rows, ["case", "us", "TBps", "frac", "fi_cc", "fi_tc", "err", "chunks", "merges", "plan_us"])
    if args.tune:
        print("\ntuning alternatives, TB/s")
        table(rows, ["case", "TBps", *tune_names, "fi_cc_turns", "fi_tc_turns"])


if __name__ == "__main__":
    main()
