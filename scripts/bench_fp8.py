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


def prefill_rows(rng, ceiling):
    """Causal prefill with an fp8 cache against the bf16 cache, ragged and paged (page 16, scattered), per backend:
    TFLOP/s (2 B Hq S^2 D) and the error of sampled rows against the float64 reference on the dequantised cache."""
    import torch
    from _prefill_ref import request_ref, sample_rows
    rows = []
    hq, hkv, d = 32, 8, 128
    for b, s_len in ((1, 8192), (8, 2048)):
        indptr = np.arange(0, (b + 1) * s_len, s_len, dtype=np.int32)
        tq = torch.randn((b * s_len, hq, d), dtype=torch.bfloat16, device="cuda")
        tk = torch.randn((b * s_len, hkv, d), dtype=torch.bfloat16, device="cuda")
        tv = torch.randn((b * s_len, hkv, d), dtype=torch.bfloat16, device="cuda")
        flops = 2 * b * hq * s_len * s_len * d
        pt = kvattn.PageTable.from_kv_lens(np.full(b, s_len), 16, rng=rng)
        pk = torch.zeros((pt.num_pages_used * 16, hkv, d), dtype=torch.bfloat16, device="cuda")
        order = torch.from_numpy(np.concatenate([np.arange(p * 16, p * 16 + 16) for p in pt.indices])).cuda()
        pv = torch.zeros_like(pk)
        pk[order], pv[order] = tk, tv
        pk, pv = pk.view(-1, 16, hkv, d), pv.view(-1, 16, hkv, d)
        for backend in ("sm90", "sm80"):
            row = dict(case=f"prefill causal b{b}_S{s_len}", backend=backend)
            for kv, mode in (("bfloat16", "auto"), ("float8_e4m3fn", "auto"), ("float8_e4m3fn", "kernel"),
                             ("float8_e5m2", "auto")):
                t8 = getattr(torch, kv)
                tag = (kv[:9] if kv != "bfloat16" else "bf16") + ("_kernel" if mode == "kernel" else "")
                k, v = (tk, tv) if kv == "bfloat16" else ((tk.float() / SCALE).to(t8), (tv.float() / SCALE).to(t8))
                sc = {} if kv == "bfloat16" else dict(k_scale=SCALE, v_scale=SCALE)
                for paged in (False, True):
                    if paged:
                        w = kvattn.BatchPrefillWithPagedKVCache(backend=backend)
                        w.fp8_expand = mode
                        w.plan(indptr, pt, hq, hkv, d, causal=True, kv_dtype=kv)
                        kk, vv = ((pk, pv) if kv == "bfloat16" else
                                  ((pk.float() / SCALE).to(t8), (pv.float() / SCALE).to(t8)))
                    else:
                        w = kvattn.BatchPrefillWithRaggedKVCache(backend=backend)
                        w.fp8_expand = mode
                        w.plan(indptr, indptr, hq, hkv, d, causal=True, kv_dtype=kv)
                        kk, vv = k, v
                    out = torch.empty_like(tq)
                    us = time_us(lambda: w.run(tq, kk, vv, out=out, **sc))
                    row[f"{tag}{'_paged' if paged else ''}"] = round(flops / us / 1e6, 1)
                if kv != "bfloat16":   # sampled rows of request 0 against the dequantised reference
                    o = w.run(tq, kk, vv, **sc)
                    o0 = torch.from_dlpack(o)[:s_len].float().cpu().numpy()
                    q0 = tq[:s_len].float().cpu().numpy()
                    kd = k[:s_len].float().cpu().numpy() * SCALE
                    vd = v[:s_len].float().cpu().numpy() * SCALE
                    r = sample_rows(s_len, 32, rng)
                    ro, _ = request_ref(q0, kd, vd, r, True, -1, 0.0, 1 / np.sqrt(d))
                    row[f"err_{kv[7:11]}{'_kernel' if mode == 'kernel' else ''}"] = \
                        f"{np.linalg.norm(o0[r] - ro) / np.linalg.norm(ro):.1e}"
            for t in ("", "_kernel"):
                row[f"e4m3{t}/bf16"] = round(row[f"float8_e4{t}"] / row["bf16"], 3)
                row[f"e4m3{t}/bf16_paged"] = round(row[f"float8_e4{t}_paged"] / row["bf16_paged"], 3)
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
    ap.add_argument("--prefill", action="store_true",
                    help="only the prefill table (fp8 cache expanded once per call / in the kernel vs bf16, TFLOP/s)")
    args = ap.parse_args()
    import torch
    if args.warm_peers:
        return warm_peers(torch, args.kv.split(","))
    rng = np.random.default_rng(0)
    ceiling = copy_bandwidth_tbs()
    print(f"copy ceiling {ceiling:.3f} TB/s; GPU {kvattn._driver.device_name()}")
    if args.prefill:
        rows = prefill_rows(rng, ceiling)
        print("\nfp8 cache in causal prefill, bf16 q, Hq32/Hkv8/D128, TFLOP/s (2 B Hq S^2 D); paged: page 16, scattered")
        table(rows, ["case", "backend", "bf16", "float8_e4", "float8_e4_kernel", "float8_e5", "e4m3/bf16",
                     "e4m3_kernel/bf16", "bf16_paged", "float8_e4_paged", "float8_e4_kernel_paged", "float8_e5_paged",
                     "e4m3/bf16_paged", "e4m3_kernel/bf16_paged", "err_e4m3", "err_e4m3_kernel", "err_e5m2"])
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
