"""fp8 KV decode on the GPU: kvattn fp8 (e4m3, e5m2) vs kvattn bf16 and FlashInfer's fp8 and bf16 decode, same process.

    PYTHONPATH=. python scripts/bench_fp8.py [--no-peers] [--only NAME] [--json out.jsonl]

The bf16 cache is random (+-[0.5, 4)); the fp8 cache holds it / 0.5 (k_scale = v_scale = 0.5), converted by torch.
Bandwidth counts the fp8 bytes of the real lengths. Every column is timed the same way (kvattn.timing.time_us:
back-to-back calls, each between its own pair of events, median of 30), torch's and FlashInfer's calls included. err: relative L2 against the float64 reference on the dequantised
cache (the bound); err_bf16: against the unquantised bf16 cache (what quantisation costs).
"""
from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _bench import kvattn, record, table, try_flashinfer  # noqa: E402
from bench_decode import MAIN, build, time_kvattn
from kvattn import reference
from kvattn.timing import copy_bandwidth_tbs, time_us

SCALE = 0.5
FP8 = {"float8_e4m3fn": ("float8_e4m3fn", ml_dtypes.float8_e4m3fn), "float8_e5m2": ("float8_e5m2", ml_dtypes.float8_e5m2)}


def errors(rng, lens, pt, q, k, v, k8, v8, out, cfg, np8):
    """(error vs the dequantised cache, error vs the bf16 cache), worst of the longest request and 3 random ones."""
    import torch
    sample = sorted({int(np.argmax(lens)), *rng.choice(len(lens), min(3, len(lens)), replace=False).tolist()})
    sub = kvattn.PageTable(np.concatenate([[0], np.cumsum([pt.indptr[i + 1] - pt.indptr[i] for i in sample])]),
                           np.concatenate([pt.indices[pt.indptr[i]:pt.indptr[i + 1]] for i in sample]),
                           pt.last_page_len[sample], cfg["page"])
    qh, oh = q.numpy()[sample], out.float().cpu().numpy()[sample]
    k8h = k8.view(torch.uint8).cpu().numpy().view(np8)
    v8h = v8.view(torch.uint8).cpu().numpy().view(np8)
    ref8 = reference.batch_attention_paged(qh, k8h, v8h, np.arange(len(sample) + 1), sub, k_scale=SCALE, v_scale=SCALE)
    ref16 = reference.batch_attention_paged(qh, k.numpy(), v.numpy(), np.arange(len(sample) + 1), sub)
    rel = lambda r: max(float(np.linalg.norm(oh[j] - r[j]) / np.linalg.norm(r[j])) for j in range(len(sample)))
    return rel(ref8), rel(ref16)


def run_case(name, lens, cfg, rng, ceiling, torch, fi, jsonl, kv_dtype):
    lens = np.asarray(lens)
    pt, q, k, v = build(lens, cfg, rng)
    t8 = getattr(torch, kv_dtype)
    tk, tv = torch.from_dlpack(k), torch.from_dlpack(v)
    k8, v8 = (tk.float() / SCALE).to(t8), (tv.float() / SCALE).to(t8)
    nbytes = int(lens.sum()) * cfg["hkv"] * cfg["d"] * 2
    bf16_us, _, _, _ = time_kvattn(pt, q, k, v, cfg)
    row = dict(case=name, kv=kv_dtype[7:], bf16_us=round(bf16_us, 1))
    hq, hkv, d, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["page"]
    ka, va = kvattn.asarray(k8), kvattn.asarray(v8)
    for stages in (None, 2, 3):
        w = kvattn.BatchDecodeWithPagedKVCache(tuning=dict(stages=stages))
        w.plan(pt, hq, hkv, d, kv_dtype=kv_dtype)
        out = kvattn.empty(q.shape, "bfloat16")
        us = time_us(lambda: w.run(q, ka, va, out=out, k_scale=SCALE, v_scale=SCALE))
        if stages is None:
            row.update(us=round(us, 1), TBps=round(nbytes / us / 1e6, 2), frac=round(nbytes / us / 1e6 / ceiling, 3),
                       vs_bf16=round(bf16_us / us, 2))
            tq = torch.from_dlpack(q)
            tus = time_us(lambda: w.run(tq, k8, v8, k_scale=SCALE, v_scale=SCALE))   # torch in, out=None
            row["torch_us"] = round(tus, 1)
            o = torch.from_dlpack(w.run(tq, k8, v8, k_scale=SCALE, v_scale=SCALE))
            e8, e16 = errors(rng, lens, pt, q, k, v, k8, v8, o, cfg, FP8[kv_dtype][1])
            row.update(err=f"{e8:.1e}", err_bf16=f"{e16:.1e}")
        else:
            row[f"st{stages}_us"] = round(us, 1)
    if fi is not None:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        ind, idx, last = (torch.from_numpy(np.array(a)).cuda() for a in (pt.indptr, pt.indices, pt.last_page_len))
        tq = torch.from_dlpack(q)
        for tc, col in ((False, "fi8_cc"), (True, "fi8_tc")):
            try:
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                fw.plan(ind, idx, last, hq, hkv, d, page, q_data_type=torch.bfloat16, kv_data_type=t8)
                row[col] = round(time_us(lambda: fw.run(tq, (k8, v8), k_scale=SCALE, v_scale=SCALE)), 1)
            except Exception as exc:
                row[col] = f"error {exc.__class__.__name__}"
        try:
            fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            fw.plan(ind, idx, last, hq, hkv, d, page, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            row["fi16_tc"] = round(time_us(lambda: fw.run(tq, (tk, tv))), 1)
        except Exception as exc:
            row["fi16_tc"] = f"error {exc.__class__.__name__}"
        torch.cuda.synchronize()
    record(jsonl, **row, cfg=cfg)
    print(row, flush=True)
    return row


def warm_peers(torch, kv_dtypes):
    """Build FlashInfer's decode modules (bf16 q; the fp8 caches and bf16) on a tiny batch: its JIT cache is shared
    with a later process."""
    _, fi = try_flashinfer()
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    ind = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    for kv in [*kv_dtypes, "bfloat16"]:
        for tc in (False, True) if kv != "bfloat16" else (True,):
            fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            fw.plan(ind, idx, idx + 16, 32, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=getattr(torch, kv))
            print("warm", kv, tc, flush=True)


HQ, HKV, D = 32, 8, 128


def prefill_data(rng, b, s_len):
    """(indptr, q, k, v, page table, paged k, paged v): random bf16 torch tensors of b requests of s_len tokens,
    the paged copies in scattered 16-token pages."""
    import torch
    indptr = np.arange(0, (b + 1) * s_len, s_len, dtype=np.int32)
    tq = torch.randn((b * s_len, HQ, D), dtype=torch.bfloat16, device="cuda")
    tk = torch.randn((b * s_len, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn((b * s_len, HKV, D), dtype=torch.bfloat16, device="cuda")
    pt = kvattn.PageTable.from_kv_lens(np.full(b, s_len), 16, rng=rng)
    pk = torch.zeros((pt.num_pages_used * 16, HKV, D), dtype=torch.bfloat16, device="cuda")
    order = torch.from_numpy(np.concatenate([(pt.pages(i)[:, None] * 16 + np.arange(16)).ravel()[:s_len]
                                             for i in range(b)])).cuda()
    pv = torch.zeros_like(pk)
    pk[order], pv[order] = tk, tv
    return indptr, tq, tk, tv, pt, pk.view(-1, 16, HKV, D), pv.view(-1, 16, HKV, D)


def quantised(t, kv):
    """The bf16 tensor t as an fp8 cache of scale SCALE (kv: a torch float8 dtype name), or t itself (bf16)."""
    import torch
    return t if kv == "bfloat16" else (t.float() / SCALE).to(getattr(torch, kv))


def prefill_error(rng, w, tq, k, v, s_len, run_kv=None, **sc):
    """Relative L2 error of sampled rows of request 0 against the float64 reference on the dequantised cache: k / v
    ragged [tokens, Hkv, D] (the reference's), run_kv: what w.run takes (a paged plan's caches; None: k, v)."""
    import torch
    from _prefill_ref import request_ref, sample_rows
    o = w.run(tq, *(run_kv or (k, v)), **sc)
    o0 = torch.from_dlpack(o)[:s_len].float().cpu().numpy()
    q0 = tq[:s_len].float().cpu().numpy()
    f = SCALE if sc else 1.0
    kd, vd = k[:s_len].float().cpu().numpy() * f, v[:s_len].float().cpu().numpy() * f
    r = sample_rows(s_len, 32, rng)
    ro, _ = request_ref(q0, kd, vd, r, True, -1, 0.0, 1 / np.sqrt(D))
    return float(np.linalg.norm(o0[r] - ro) / np.linalg.norm(ro))


N64 = (("KVATTN_SM90_N", 64), ("KVATTN_SM90_STAGES", 6))
#: prefill_ab's builds: name -> (cache type, SM90_TUNING); "bf16" first (the reference column)
AB_BUILDS = {"bf16": ("bfloat16", ()), "fp8 landed": ("float8_e4m3fn", ()),
             "fp8 registers": ("float8_e4m3fn", (("KVATTN_SM90_FP8TMA", 0),)),
             "fp8 landed+pf": ("float8_e4m3fn", (("KVATTN_SM90_FP8PF", 1),)),
             "bf16 N64x6": ("bfloat16", N64), "fp8 N64x6": ("float8_e4m3fn", N64),
             "fp8 N64x6+pf": ("float8_e4m3fn", N64 + (("KVATTN_SM90_FP8PF", 1),)),
             # timing only (wrong results): no expansion; the expansion's copies without its arithmetic
             "fp8 no expansion": ("float8_e4m3fn", (("KVATTN_SM90_FP8X", 1),)),
             "fp8 copy only": ("float8_e4m3fn", (("KVATTN_SM90_FP8X", 2),)),
             "fp8 expand || land": ("float8_e4m3fn", (("KVATTN_SM90_FP8X", 3),)),
             "fp8 landed float": ("float8_e4m3fn", (("KVATTN_SM90_FP8BITS", 0),)),
             "e5m2 landed": ("float8_e5m2", ()), "e5m2 landed float": ("float8_e5m2", (("KVATTN_SM90_FP8BITS", 0),))}
AB_SHAPES = {"b1_S8192": (1, 8192), "b8_S2048": (8, 2048), "b32_S1024": (32, 1024), "b64_S100": (64, 100)}


def prefill_ab(rng, names=("bf16", "fp8 landed", "fp8 registers"), shapes=tuple(AB_SHAPES), layouts=("ragged", "paged"),
               rounds=3):
    """The sm90 kernel's fp8 tiles landed in their stages and expanded in place (KVATTN_SM90_FP8TMA=1, persistent,
    the default) against the producers' register loads (0, one CTA per unit), and the other AB_BUILDS, beside the
    bf16 cache, e4m3, causal, ragged and paged (page 16, scattered); builds timed in `rounds` rounds of alternating
    order, each checked against the float64 reference."""
    import torch
    from kvattn import prefill, tma
    builds = [(n, *AB_BUILDS[n]) for n in names]
    for shape in shapes:
        b, s_len = AB_SHAPES[shape]
        indptr, tq, tk, tv, pt, pk, pv = prefill_data(rng, b, s_len)
        flops = 2 * b * HQ * s_len * s_len * D
        for paged in (x == "paged" for x in layouts):
            rates, errs = {n: [] for n, _, _ in builds}, {}
            for r in range(rounds):
                for name, kv, defs in (builds if r % 2 == 0 else builds[::-1]):
                    prefill.SM90_TUNING = defs
                    tma.FP8_MAPS = dict(defs).get("KVATTN_SM90_FP8TMA", 1) == 1
                    sc = {} if kv == "bfloat16" else dict(k_scale=SCALE, v_scale=SCALE)
                    if paged:
                        w = kvattn.BatchPrefillWithPagedKVCache(backend="sm90")
                        w.plan(indptr, pt, HQ, HKV, D, causal=True, kv_dtype=kv)
                        k, v = quantised(pk, kv), quantised(pv, kv)
                    else:
                        w = kvattn.BatchPrefillWithRaggedKVCache(backend="sm90")
                        w.plan(indptr, indptr, HQ, HKV, D, causal=True, kv_dtype=kv)
                        k, v = quantised(tk, kv), quantised(tv, kv)
                    out = torch.empty_like(tq)
                    rates[name].append(flops / time_us(lambda: w.run(tq, k, v, out=out, **sc)) / 1e6)
                    if r == 0:
                        errs[name] = prefill_error(rng, w, tq, quantised(tk, kv), quantised(tv, kv), s_len,
                                                   run_kv=(k, v), **sc)
            prefill.SM90_TUNING, tma.FP8_MAPS = (), True
            base = np.median(rates[builds[0][0]])
            for name, _, _ in builds:
                med = np.median(rates[name])
                print(f"fp8tma causal b{b}_S{s_len}{' paged' if paged else ''}: {name:14s} "
                      + " ".join(f"{x:6.1f}" for x in rates[name])
                      + f"  median {med:6.1f} TFLOP/s ({med / base:.3f} of {builds[0][0]})  err {errs[name]:.1e}",
                      flush=True)


def prefill_rows(rng, ceiling):
    """Causal prefill with an fp8 cache against the bf16 cache, ragged and paged (page 16, scattered), per backend:
    TFLOP/s (2 B Hq S^2 D) and the error of sampled rows against the float64 reference on the dequantised cache."""
    import torch
    rows = []
    hq, hkv, d = HQ, HKV, D
    for b, s_len in ((1, 8192), (8, 2048)):
        indptr, tq, tk, tv, pt, pk, pv = prefill_data(rng, b, s_len)
        flops = 2 * b * hq * s_len * s_len * d
        for backend in ("sm90", "sm80"):
            row = dict(case=f"prefill causal b{b}_S{s_len}", backend=backend)
            for kv in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                k, v = quantised(tk, kv), quantised(tv, kv)
                sc = {} if kv == "bfloat16" else dict(k_scale=SCALE, v_scale=SCALE)
                for paged in (False, True):
                    if paged:
                        w = kvattn.BatchPrefillWithPagedKVCache(backend=backend)
                        w.plan(indptr, pt, hq, hkv, d, causal=True, kv_dtype=kv)
                        kk, vv = quantised(pk, kv), quantised(pv, kv)
                    else:
                        w = kvattn.BatchPrefillWithRaggedKVCache(backend=backend)
                        w.plan(indptr, indptr, hq, hkv, d, causal=True, kv_dtype=kv)
                        kk, vv = k, v
                    out = torch.empty_like(tq)
                    us = time_us(lambda: w.run(tq, kk, vv, out=out, **sc))
                    row[f"{kv[:9] if kv != 'bfloat16' else 'bf16'}{'_paged' if paged else ''}"] = round(flops / us / 1e6, 1)
                if kv != "bfloat16":   # sampled rows of request 0 against the dequantised reference
                    w = kvattn.BatchPrefillWithRaggedKVCache(backend=backend)
                    w.plan(indptr, indptr, hq, hkv, d, causal=True, kv_dtype=kv)
                    row[f"err_{kv[7:11]}"] = f"{prefill_error(rng, w, tq, k, v, s_len, **sc):.1e}"
            row["e4m3/bf16"] = round(row["float8_e4"] / row["bf16"], 3)
            row["e4m3/bf16_paged"] = round(row["float8_e4_paged"] / row["bf16_paged"], 3)
            print(row, flush=True)
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv", default="float8_e4m3fn,float8_e5m2")
    ap.add_argument("--warm-peers", action="store_true", help="only JIT-compile FlashInfer's modules for the cases")
    ap.add_argument("--prefill", action="store_true", help="only the prefill table (fp8 cache vs bf16, TFLOP/s)")
    ap.add_argument("--prefill-ab", action="store_true",
                    help="only the sm90 fp8 prefill A/B: landed + expanded in place vs register loads (prefill_ab)")
    ap.add_argument("--builds", default="bf16,fp8 landed,fp8 registers", help="--prefill-ab: AB_BUILDS names")
    ap.add_argument("--shapes", default=",".join(AB_SHAPES), help="--prefill-ab: AB_SHAPES names")
    ap.add_argument("--layouts", default="ragged,paged", help="--prefill-ab: ragged and / or paged")
    args = ap.parse_args()
    import torch
    if args.warm_peers:
        return warm_peers(torch, args.kv.split(","))
    rng = np.random.default_rng(0)
    ceiling = copy_bandwidth_tbs()
    print(f"copy ceiling {ceiling:.3f} TB/s; GPU {kvattn._driver.device_name()}")
    if args.prefill_ab:
        return prefill_ab(rng, *(a.split(",") for a in (args.builds, args.shapes, args.layouts)))
    if args.prefill:
        rows = prefill_rows(rng, ceiling)
        print("\nfp8 cache in causal prefill, bf16 q, Hq32/Hkv8/D128, TFLOP/s (2 B Hq S^2 D); paged: page 16, scattered")
        table(rows, ["case", "backend", "bf16", "float8_e4", "float8_e5", "e4m3/bf16", "bf16_paged", "float8_e4_paged",
                     "float8_e5_paged", "e4m3/bf16_paged", "err_e4m3", "err_e5m2"])
        return
    _, fi = (None, None) if args.no_peers else try_flashinfer()
    base = dict(hq=32, hkv=8, d=128, dtype="bfloat16", layout="NHD", page=16)
    cases = dict(MAIN)
    cases["b64_L4096_D256"] = [4096] * 64
    cases["b64_L4096_D64"] = [4096] * 64
    rows = []
    for kv in args.kv.split(","):
        for name, lens in cases.items():
            if args.only and not any(o in name for o in args.only.split(",")):
                continue
            cfg = dict(base, d=int(name.split("_D")[1])) if "_D" in name else base
            peer = fi if name in MAIN else None   # FlashInfer JIT-compiles a module per head dim: D128 only
            rows.append(run_case(name, lens, cfg, rng, ceiling, torch, peer, args.json, kv))
    print(f"\nfp8 KV decode (bf16 q), Hq 32 Hkv 8 D 128 page 16 unless named; us; copy ceiling {ceiling:.2f} TB/s; "
          f"frac counts fp8 bytes")
    table(rows, ["case", "kv", "us", "TBps", "frac", "bf16_us", "vs_bf16", "torch_us", "st2_us", "st3_us", "fi8_cc",
                 "fi8_tc", "fi16_tc", "err", "err_bf16"])


if __name__ == "__main__":
    main()
