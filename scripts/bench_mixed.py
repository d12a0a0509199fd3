"""A continuous-batching step on the GPU: 2 prefills of 4096 tokens + 126 single-token decodes, every request with
4096 tokens of KV (causal), bf16 Hq32/Hkv8/D128, page 16, scattered pages. Measures (us, median of 30):
- mixed: kvattn's BatchMixedWithPagedKVCache (one plan, ONE launch: prefill CTAs on some SMs, decode CTAs on the
  others; `--sweep` also times forced prefill SM counts);
- one_prefill: kvattn's BatchPrefillWithPagedKVCache over the whole mixed batch (one prefill launch + its merge;
  the decodes ride in 128-row tiles);
- separate: kvattn prefill of the 2 prefills, then kvattn batch decode of the 126 decodes (two plans, back to back);
- fi_separate: FlashInfer's paged prefill (fa2 and fa3) then its tensor-core decode, the same way.
err: the worst relative L2 error of the mixed op's sampled rows (both prefills, 4 decodes) against the float64
reference.

    PYTHONPATH=. python scripts/bench_mixed.py [--no-peers] [--warm-peers] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _bench import kvattn, table, try_flashinfer  # noqa: E402
from kvattn.formats import PageTable  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D, PAGE, L = 32, 8, 128, 16, 4096
NP, ND = 2, 126


def sub_table(pt, idx):
    return PageTable(np.concatenate([[0], np.cumsum([pt.indptr[i + 1] - pt.indptr[i] for i in idx])]),
                     np.concatenate([pt.pages(i) for i in idx]), pt.last_page_len[idx], PAGE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--warm-peers", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the mixed op at forced prefill SM counts")
    args = ap.parse_args()
    import torch
    from _prefill_ref import request_ref, sample_rows
    rng = np.random.default_rng(0)
    _, fi = (None, None) if args.no_peers else try_flashinfer()
    b = NP + ND
    pt = PageTable.from_kv_lens(np.full(b, L), PAGE, rng=rng)
    qo = np.array([L] * NP + [1] * ND)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    tk = torch.randn((pt.indices.size, PAGE, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn_like(tk)
    tq = torch.randn((int(qo_indptr[-1]), HQ, D), dtype=torch.bfloat16, device="cuda")
    pre, dec = sub_table(pt, list(range(NP))), sub_table(pt, list(range(NP, b)))
    dev = lambda a: torch.from_numpy(np.array(a, np.int32)).cuda()
    if args.warm_peers:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for backend in ("fa2", "fa3"):
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(dev(qo_indptr[:NP + 1]), dev(pre.indptr), dev(pre.indices), dev(pre.last_page_len), HQ, HKV, D,
                   PAGE, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        print("warm: paged prefill", flush=True)
        return
    qa, ka, va = kvattn.asarray(tq), kvattn.asarray(tk), kvattn.asarray(tv)
    out = kvattn.empty(qa.shape, "bfloat16")
    one = kvattn.BatchPrefillWithPagedKVCache()
    one.plan(qo_indptr, pt, HQ, HKV, D, causal=True)
    row = dict(case=f"{NP}x{L} prefill + {ND} decodes of {L}",
               one_prefill=round(time_us(lambda: one.run(qa, ka, va, out=out)), 1),
               tile=f"{one.last_plan.info['backend']}/{one.last_plan.info['cta_rows']}")
    mx = kvattn.BatchMixedWithPagedKVCache()
    mx.plan(qo_indptr, pt, HQ, HKV, D, causal=True)
    row["mixed"] = round(time_us(lambda: mx.run(qa, ka, va, out=out)), 1)
    row["mixed_torch"] = round(time_us(lambda: mx.run(tq, tk, tv)), 1)   # torch tensors in, out=None
    st = mx.last_plan
    row["split"] = f"{st['prefill_sms']} SMs prefill / {st['decode_ctas']} decode CTAs, fused={st['fused']}"
    sweep = []
    if args.sweep:   # decode (stages, warpgroups per CTA) x prefill SMs
        for stages, subs in ((2, 3), (3, 2), (4, 1)):
            mxs = kvattn.BatchMixedWithPagedKVCache(tuning=dict(decode_stages=stages, decode_ctas_per_sm=subs))
            r = dict(decode=f"{stages} stages x {subs}")
            for sms in (64, 72, 76, 80, 84, 88, 92, 96, 104):
                mxs.plan(qo_indptr, pt, HQ, HKV, D, causal=True, prefill_sms=sms)
                r[str(sms)] = round(time_us(lambda: mxs.run(qa, ka, va, out=out)), 1) if mxs.last_plan["fused"] else "-"
            sweep.append(r)
    o = torch.from_dlpack(mx.run(tq, tk, tv)).float().cpu().numpy()   # the checked output: the mixed op's
    p = kvattn.BatchPrefillWithPagedKVCache()
    p.plan(qo_indptr[:NP + 1], pre, HQ, HKV, D, causal=True)
    d = kvattn.BatchDecodeWithPagedKVCache()
    d.plan(dec, HQ, HKV, D)
    npre = int(qo_indptr[NP])
    qp, qd, op, od = qa[:npre], qa[npre:], out[:npre], out[npre:]

    def separate():
        p.run(qp, ka, va, out=op)
        d.run(qd, ka, va, out=od)
    row["separate"] = round(time_us(separate), 1)
    row["prefill_only"] = round(time_us(lambda: p.run(qp, ka, va, out=op)), 1)
    row["decode_only"] = round(time_us(lambda: d.run(qd, ka, va, out=od)), 1)
    row["mixed/separate"] = round(row["mixed"] / row["separate"], 3)
    # reference: sampled rows of both prefills and 4 decodes
    qh, kh, vh = tq.float().cpu().numpy(), tk.float().cpu().numpy(), tv.float().cpu().numpy()
    worst = 0.0
    for i in [0, 1] + rng.choice(np.arange(NP, b), 4, replace=False).tolist():
        n = int(pt.kv_lens[i])
        kk = kh[pt.pages(i)].reshape(-1, HKV, D)[:n]
        vv = vh[pt.pages(i)].reshape(-1, HKV, D)[:n]
        qi = qh[qo_indptr[i]:qo_indptr[i + 1]]
        rows = sample_rows(qi.shape[0], 16, rng)
        ro, _ = request_ref(qi, kk, vv, rows, True, -1, 0.0, 1 / np.sqrt(D))
        got = o[qo_indptr[i] + rows]
        worst = max(worst, float(np.linalg.norm(got - ro) / np.linalg.norm(ro)))
    row["err"] = f"{worst:.1e}"
    if fi is not None:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        dw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        dw.plan(dev(dec.indptr), dev(dec.indices), dev(dec.last_page_len), HQ, HKV, D, PAGE,
                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        tqp, tqd = tq[:npre], tq[npre:]
        for backend in ("fa2", "fa3"):
            try:
                pw = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                pw.plan(dev(qo_indptr[:NP + 1]), dev(pre.indptr), dev(pre.indices), dev(pre.last_page_len), HQ, HKV,
                        D, PAGE, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

                def fi_sep():
                    pw.run(tqp, (tk, tv))
                    dw.run(tqd, (tk, tv))
                row[f"fi_{backend}+decode"] = round(time_us(fi_sep), 1)
            except Exception as exc:
                row[f"fi_{backend}+decode"] = f"error {exc.__class__.__name__}"
    torch.cuda.synchronize()
    print(row, flush=True)
    table([row], ["case", "mixed", "mixed_torch", "split", "separate", "mixed/separate", "prefill_only",
                  "decode_only", "one_prefill", "tile", "fi_fa2+decode", "fi_fa3+decode", "err"])
    if sweep:
        print("\nmixed us by the prefill part's SMs (columns) and the decode part's configuration (rows):")
        table(sweep, list(sweep[0]))


if __name__ == "__main__":
    main()
