"""Shared-prefix (cascade) decode on the GPU: kvattn's MultiLevelCascadeAttentionWrapper vs flat paged decode and
FlashInfer's cascade and decode, same process.

    PYTHONPATH=. python scripts/bench_cascade.py [--no-peers] [--only NAME] [--json out.jsonl] [--warm-peers]
                                                 [--after-level-0] [--empty-at-plan]

bf16, Hq 32 / Hkv 8 / D 128, page 16, pages scattered (a random permutation of the pool), one query token per
request. Columns (us, median of 30 back-to-back calls, each between its own events):
- kv_us: kvattn cascade, kvattn arrays, out given; torch_us: torch tensors in, out=None (the stream-ordered pool),
  the legacy default stream (torch's current stream here).
- lvl0_us: the shared level alone (a 1-level wrapper), and its TFLOP/s (4 * rows * Hq * prefix * D) and fraction
  of the bf16 GEMM ceiling; bytes_frac: all KV bytes (read once) / kv_us against the copy ceiling.
- flat_us: kvattn's batch decode on the flattened page table (every request reads its whole prefix).
- fi_cascade / fi_flat: FlashInfer's MultiLevelCascadeAttentionWrapper and tensor-core decode on the same data.
err: the worst relative L2 error of 4 sampled requests against the float64 reference (flattened levels).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, record, table, try_flashinfer  # noqa: E402
from kvattn import reference  # noqa: E402
from kvattn.formats import CascadeLevels, PageTable  # noqa: E402
from kvattn.timing import copy_bandwidth_tbs, time_us  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16

#: name -> (batch, [per level: (group sizes, tokens per group)]); the last level is one group per request
CASES = {
    "pfx32768_b128_sfx256": (128, [([128], 32768), ([1] * 128, 256)]),
    "pfx8192_b32_sfx256": (32, [([32], 8192), ([1] * 32, 256)]),
    "3lvl_sys4096_conv8x2048_b64_sfx256": (64, [([64], 4096), ([8] * 8, 2048), ([1] * 64, 256)]),
}


def build(batch, spec, rng):
    """(CascadeLevels, number of pages): every level's pages drawn from one scattered pool."""
    need = sum(len(g) * (n // PAGE) for g, n in spec)
    perm = rng.permutation(need).astype(np.int32)
    used, levels = 0, []
    for sizes, n in spec:
        g = len(sizes)
        ids = perm[used:used + g * (n // PAGE)]
        used += ids.size
        qo = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        levels.append((qo, PageTable(np.arange(0, (g + 1) * (n // PAGE), n // PAGE), ids, np.full(g, PAGE), PAGE)))
    return CascadeLevels(levels), need


def sample_error(rng, levels, q, k, v, out):
    qo, flat = levels.flatten()
    b = flat.batch_size
    sample = sorted(rng.choice(b, 4, replace=False).tolist())
    sub = PageTable(np.concatenate([[0], np.cumsum([flat.indptr[i + 1] - flat.indptr[i] for i in sample])]),
                    np.concatenate([flat.pages(i) for i in sample]), flat.last_page_len[sample], PAGE)
    ref = reference.batch_attention_paged(q[sample], k, v, np.arange(len(sample) + 1), sub)
    return max(float(np.linalg.norm(out[i] - ref[j]) / np.linalg.norm(ref[j])) for j, i in enumerate(sample))


def flag_in_turns(flag, levels, rng, args, host, torch):
    """kvattn.cascade's module flag `flag` off, then on: each side's plan timed in 3 alternating rounds (medians,
    us) with kvattn arrays (out given) and with torch tensors (out=None), and each side's error (host: q, k, v as
    float32 numpy). Returns ({False: us, True: us}, the same for torch, {side: err}, {side: wrapper})."""
    from kvattn import cascade
    qa, ka, va, out, tq, tk, tv = args
    default, ws = getattr(cascade, flag), {}
    for side in (False, True):
        setattr(cascade, flag, side)
        ws[side] = kvattn.MultiLevelCascadeAttentionWrapper(len(levels)).plan(levels, None, HQ, HKV, D)
    setattr(cascade, flag, default)
    times, torch_times = {False: [], True: []}, {False: [], True: []}
    for _ in range(3):
        for side, w in ws.items():
            times[side].append(time_us(lambda w=w: w.run(qa, ka, va, out=out)))
            torch_times[side].append(time_us(lambda w=w: w.run(tq, tk, tv)))
    errs = {side: f"{sample_error(rng, levels, *host, torch.from_dlpack(w.run(tq, tk, tv)).float().cpu().numpy()):.1e}"
            for side, w in ws.items()}
    med = lambda t: {side: round(float(np.median(x)), 1) for side, x in t.items()}
    return med(times), med(torch_times), errs, ws


def after_level_0(row, levels, rng, args, host, torch):
    """Plans without and with kvattn.cascade.DECODE_AFTER_LEVEL_0 (the default: the decode level's CTAs in level 0's
    grid, after its CTAs, where no SM split pays), in turns (flag_in_turns)."""
    t, _, errs, ws = flag_in_turns("DECODE_AFTER_LEVEL_0", levels, rng, args, host, torch)
    applies = ws[True].last_plan.info["levels"][-1].get("after_level_0", False)
    row.update(turns_two_launch_us=t[False], turns_after_l0_us=t[True], two_launch_err=errs[False],
               after_l0_err=errs[True], after_l0_applies=applies)


def empty_at_plan(row, levels, rng, args, host, torch):
    """Plans without and with kvattn.cascade.EMPTY_SLOTS_AT_PLAN (the decode level's empty merge slots set once by
    plan(), not by a memset before every run()), in turns (flag_in_turns), kvattn arrays and the torch path."""
    t, tt, errs, ws = flag_in_turns("EMPTY_SLOTS_AT_PLAN", levels, rng, args, host, torch)
    row.update(turns_memset_run_us=t[False], turns_memset_plan_us=t[True], turns_memset_run_torch_us=tt[False],
               turns_memset_plan_torch_us=tt[True], memset_run_err=errs[False], memset_plan_err=errs[True],
               partial_fill=ws[True].last_plan.info["levels"][-1].get("partial_fill", False))


def run_case(name, batch, spec, rng, ceilings, torch, fi, jsonl, after=False, at_plan=False):
    copy_tbs, gemm = ceilings
    levels, npages = build(batch, spec, rng)
    tk = torch.randn((npages, PAGE, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn((npages, PAGE, HKV, D), dtype=torch.bfloat16, device="cuda")
    tq = torch.randn((batch, HQ, D), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    qa, ka, va = kvattn.asarray(tq), kvattn.asarray(tk), kvattn.asarray(tv)
    out = kvattn.empty((batch, HQ, D), "bfloat16")
    w = kvattn.MultiLevelCascadeAttentionWrapper(len(levels))
    w.plan(levels, None, HQ, HKV, D)
    row = dict(case=name, levels=len(levels))
    row["kv_us"] = round(time_us(lambda: w.run(qa, ka, va, out=out)), 1)
    row["torch_us"] = round(time_us(lambda: w.run(tq, tk, tv)), 1)
    row["plan"] = "/".join(f"{x['backend']}:{x['cta_rows']}x{x['chunks']}" for x in w.last_plan.info["levels"])
    o = torch.from_dlpack(w.run(tq, tk, tv)).float().cpu().numpy()
    host = (tq.float().cpu().numpy(), tk.float().cpu().numpy(), tv.float().cpu().numpy())
    row["err"] = f"{sample_error(rng, levels, *host, o):.1e}"
    if after:
        after_level_0(row, levels, rng, (qa, ka, va, out, tq, tk, tv), host, torch)
    if at_plan:
        empty_at_plan(row, levels, rng, (qa, ka, va, out, tq, tk, tv), host, torch)
    w0 = kvattn.MultiLevelCascadeAttentionWrapper(1)
    w0.plan(CascadeLevels([levels[0]]), None, HQ, HKV, D)
    l0 = time_us(lambda: w0.run(qa, ka, va, out=out))
    prefix = spec[0][1]
    flops = 4 * batch * HQ * prefix * D
    row.update(lvl0_us=round(l0, 1), lvl0_TFLOPs=round(flops / l0 / 1e6, 1))
    if gemm:
        row["lvl0_gemm_frac"] = round(flops / l0 / 1e6 / gemm, 2)
    nbytes = sum(len(g) * n for g, n in spec) * HKV * D * 2 * 2
    row["bytes_frac"] = round(nbytes / row["kv_us"] / 1e6 / copy_tbs, 2)
    qo, flat = levels.flatten()
    fw = kvattn.BatchDecodeWithPagedKVCache()
    fw.plan(flat, HQ, HKV, D)
    row["flat_us"] = round(time_us(lambda: fw.run(qa, ka, va, out=out)), 1)
    if fi is not None:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        dev = lambda a: torch.from_numpy(np.array(a, np.int32)).cuda()
        try:
            cw = fi.MultiLevelCascadeAttentionWrapper(len(levels), ws, "NHD")
            cw.plan([dev(q) for q, _ in levels], [dev(p.indptr) for _, p in levels], [dev(p.indices) for _, p in levels],
                    [dev(p.last_page_len) for _, p in levels], HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
            row["fi_cascade"] = round(time_us(lambda: cw.run(tq, (tk, tv))), 1)
        except Exception as exc:
            row["fi_cascade"] = f"error {exc.__class__.__name__}: {str(exc)[:80]}"
        try:
            dw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            dw.plan(dev(flat.indptr), dev(flat.indices), dev(flat.last_page_len), HQ, HKV, D, PAGE,
                    q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            row["fi_flat"] = round(time_us(lambda: dw.run(tq, (tk, tv))), 1)
        except Exception as exc:
            row["fi_flat"] = f"error {exc.__class__.__name__}"
        if isinstance(row.get("fi_cascade"), float):
            row["vs_fi"] = round(row["fi_cascade"] / row["kv_us"], 2)
    torch.cuda.synchronize()
    record(jsonl, **row)
    print(row, flush=True)
    return row


def gemm_tflops(torch):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_us(lambda: torch.matmul(a, b))
    return 2 * 8192 ** 3 / us / 1e6


def warm_peers(torch):
    """JIT-build FlashInfer's cascade (prefill) and decode modules on a tiny case; the cache is shared."""
    _, fi = try_flashinfer()
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    cw = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    cw.plan([torch.tensor([0, 2], **i32), torch.tensor([0, 1, 2], **i32)],
            [torch.tensor([0, 1], **i32), torch.tensor([0, 1, 2], **i32)],
            [torch.tensor([0], **i32), torch.tensor([1, 2], **i32)],
            [torch.tensor([16], **i32), torch.tensor([16, 16], **i32)], HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
    kc = torch.randn((3, PAGE, HKV, D), dtype=torch.bfloat16, device="cuda")
    cw.run(torch.randn((2, HQ, D), dtype=torch.bfloat16, device="cuda"), (kc, kc))
    dw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    dw.plan(torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([16], **i32), HQ, HKV, D, PAGE,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    torch.cuda.synchronize()
    print("warm: cascade + decode", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm-peers", action="store_true")
    ap.add_argument("--after-level-0", action="store_true",
                    help="also time each case's plan with and without the decode level after level 0 in one grid "
                         "(in turns)")
    ap.add_argument("--empty-at-plan", action="store_true",
                    help="also time each case's plan with the decode level's empty slots set by a memset before "
                         "every run() and once at plan() (in turns, kvattn arrays and torch tensors)")
    args = ap.parse_args()
    import torch
    if args.warm_peers:
        return warm_peers(torch)
    rng = np.random.default_rng(0)
    copy_tbs = copy_bandwidth_tbs()
    gemm = gemm_tflops(torch)
    print(f"copy ceiling {copy_tbs:.3f} TB/s, bf16 GEMM {gemm:.0f} TFLOP/s; GPU {kvattn._driver.device_name()}")
    _, fi = (None, None) if args.no_peers else try_flashinfer()
    rows = [run_case(n, b, spec, rng, (copy_tbs, gemm), torch, fi, args.json, args.after_level_0, args.empty_at_plan)
            for n, (b, spec) in CASES.items() if not args.only or args.only in n]
    print(f"\nshared-prefix decode, bf16 Hq32/Hkv8/D128 page 16; us; copy {copy_tbs:.2f} TB/s, GEMM {gemm:.0f} TFLOP/s")
    table(rows, ["case", "kv_us", "torch_us", "lvl0_us", "lvl0_TFLOPs", "lvl0_gemm_frac", "bytes_frac", "flat_us",
                 "fi_cascade", "fi_flat", "vs_fi", "err", "plan"]
          + (["turns_two_launch_us", "turns_after_l0_us", "after_l0_applies", "two_launch_err", "after_l0_err"]
             if args.after_level_0 else [])
          + (["turns_memset_run_us", "turns_memset_plan_us", "turns_memset_run_torch_us", "turns_memset_plan_torch_us",
              "partial_fill", "memset_run_err", "memset_plan_err"] if args.empty_at_plan else []))


if __name__ == "__main__":
    main()
