"""Batch prefill benchmark (H200): TFLOP/s of causal prefill (ragged and paged), the long-prefix append and
speculative verification (TB/s vs the copy ceiling), with a sampled correctness check of every case.

    PYTHONPATH=. python3 scripts/bench_prefill.py [--cta-rows 64,128] [--backend auto,sm80] [--quick] [--peers]

FLOPs of causal prefill: 2 * B * Hq * S^2 * D (ANCHORS.md's convention). Append: 4 * Hq * D * (attended pairs).
Ceilings measured in the same process: bf16 GEMM 8192^3 (torch or cupy, skipped when neither imports) and a
2 GiB device-to-device copy.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import kvattn  # noqa: E402
from kvattn import _dtypes  # noqa: E402
from kvattn.formats import PageTable  # noqa: E402
from kvattn.prefill import BatchPrefillWithPagedKVCache, BatchPrefillWithRaggedKVCache  # noqa: E402
from kvattn.timing import copy_bandwidth_tbs, time_us  # noqa: E402
from _prefill_ref import allowed as _allowed, request_ref, sample_rows  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
BF = _dtypes.to_numpy("bfloat16")
FI_FA2 = {"b1_S8192": 336, "b8_S2048": 316, "b1_S32768": 383, "b32_S1024": 278, "paged_b1_S8192": 313}


def gemm_tflops():
    try:
        import torch
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        ts = []
        for _ in range(30):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); a @ b; e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        return 2 * 8192 ** 3 / (np.median(ts) * 1e-3) / 1e12
    except Exception:
        pass
    return None


def rand(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(BF)


def check(rng, q_h, qo_indptr, fetch, out, causal, reqs, window=-1, cap=0.0, mask=None):
    """Worst relative L2 error of 16 sampled rows of each request in reqs (mask: request reqs[0]'s bool mask)."""
    o = out.numpy()
    worst = 0.0
    for i in reqs:
        qi = q_h[qo_indptr[i]:qo_indptr[i + 1]]
        k, v = fetch(i)
        rows = sample_rows(qi.shape[0], 16, rng)
        ro, _ = request_ref(qi, k, v, rows, causal, window, cap, 1 / np.sqrt(qi.shape[-1]), mask)
        got = o[qo_indptr[i] + rows].astype(np.float64)
        worst = max(worst, float(np.linalg.norm(got - ro) / np.linalg.norm(ro)) if np.isfinite(got).all() else np.inf)
    return worst


def pairs(qo, kv, causal):
    qo, kv = np.asarray(qo, np.int64), np.asarray(kv, np.int64)
    if not causal:
        return int((qo * kv).sum())
    return int((qo * (kv - qo) + qo * (qo + 1) // 2).sum())


def ragged_case(rng, name, qo_lens, kv_lens, cta_rows, causal=True, backend="auto"):
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q_h = rand(rng, (int(qo_indptr[-1]), HQ, D))
    k_h, v_h = rand(rng, (int(kv_indptr[-1]), HKV, D)), rand(rng, (int(kv_indptr[-1]), HKV, D))
    q, k, v = kvattn.from_numpy(q_h), kvattn.from_numpy(k_h), kvattn.from_numpy(v_h)
    w = BatchPrefillWithRaggedKVCache(backend=backend)
    w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=causal, cta_rows=cta_rows)
    out = kvattn.empty(q.shape, "bfloat16")
    us = time_us(lambda: w.run(q, k, v, out=out))
    err = check(rng, q_h, qo_indptr, lambda i: (k_h[kv_indptr[i]:kv_indptr[i + 1]], v_h[kv_indptr[i]:kv_indptr[i + 1]]),
                out, causal, [0, len(qo_lens) - 1])
    return w, us, err


def paged_case(rng, qo_lens, kv_lens, cta_rows, causal=True, backend="auto"):
    npages = [-(-n // PS) for n in kv_lens]
    total = sum(npages)
    ids = rng.permutation(total).astype(np.int32)
    pt = PageTable(np.concatenate([[0], np.cumsum(npages)]).astype(np.int32), ids,
                   np.array([n - (p - 1) * PS for n, p in zip(kv_lens, npages)], np.int32), PS)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q_h = rand(rng, (int(qo_indptr[-1]), HQ, D))
    kc, vc = rand(rng, (total, PS, HKV, D)), rand(rng, (total, PS, HKV, D))
    q, k, v = kvattn.from_numpy(q_h), kvattn.from_numpy(kc), kvattn.from_numpy(vc)
    w = BatchPrefillWithPagedKVCache(backend=backend)
    w.plan(qo_indptr, pt, HQ, HKV, D, causal=causal, cta_rows=cta_rows)
    out = kvattn.empty(q.shape, "bfloat16")
    us = time_us(lambda: w.run(q, k, v, out=out))

    def fetch(i):
        p = pt.pages(i)
        n = int(pt.kv_lens[i])
        return kc[p].reshape(-1, HKV, D)[:n], vc[p].reshape(-1, HKV, D)[:n]
    err = check(rng, q_h, qo_indptr, fetch, out, causal, [0, len(qo_lens) - 1])
    return w, us, err


SWEEP = {64: [(), (("KVATTN_PF_KK_UNROLL", 8),), (("KVATTN_PF_QREGS", 1),)],
         128: [(), (("KVATTN_PF_SUBN2", 32),), (("KVATTN_PF_KK_UNROLL", 1),),
               (("KVATTN_PF_FAST64", 1),), (("KVATTN_PF_FOLD", 1),), (("KVATTN_PF_FAST64", 1), ("KVATTN_PF_FOLD", 1))]}


def variant_case(rng, label, *, s=8192, d=128, dtype="bfloat16", causal=True, window=-1, cap=0.0, custom=False,
                 backend="auto"):
    """One ragged request of s tokens (Hq 32, Hkv 8) with the given options: (label, w, us, TFLOP/s, err).
    FLOPs count the attended pairs (causal / window); a custom mask counts every pair (the kernel visits all)."""
    npd = _dtypes.to_numpy(dtype)
    q_h = rng.standard_normal((s, HQ, d), dtype=np.float32).astype(npd)
    k_h = rng.standard_normal((s, HKV, d), dtype=np.float32).astype(npd)
    v_h = rng.standard_normal((s, HKV, d), dtype=np.float32).astype(npd)
    mask = rng.random((s, s)) < 0.5 if custom else None
    w = BatchPrefillWithRaggedKVCache(backend=backend)
    w.plan([0, s], [0, s], HQ, HKV, d, causal=causal, window_left=window, logits_soft_cap=cap,
           custom_mask=None if mask is None else mask.ravel(), q_dtype=dtype)
    q, k, v = kvattn.from_numpy(q_h), kvattn.from_numpy(k_h), kvattn.from_numpy(v_h)
    out = kvattn.empty(q.shape, dtype)
    us = time_us(lambda: w.run(q, k, v, out=out))
    allowed = _allowed(s, s, np.arange(s), causal, window).sum() if not custom else s * s
    err = check(rng, q_h, [0, s], lambda i: (k_h, v_h), out, causal, [0], window, cap, mask)
    return label, w, us, 4 * HQ * d * int(allowed) / us / 1e6, err


EXTRA = [("causal (reference case)", {}), ("non-causal", dict(causal=False)), ("head_dim 64", dict(d=64)),
         ("head_dim 256", dict(d=256)), ("float16", dict(dtype="float16")),
         ("custom mask (50%), non-causal", dict(causal=False, custom=True, s=4096)),
         ("sliding window 1024", dict(window=1024)), ("logits soft cap 30", dict(cap=30.0))]


#: the EXTRA cases the peers also run: (label, b, s, head_dim, causal)
EXTRA_PEERS = [("non-causal", 1, 8192, 128, False), ("head_dim 64", 1, 8192, 64, True),
               ("head_dim 256", 1, 8192, 256, True)]


def extra(peers=None):
    """The variants ANCHORS/the issue ask to report: b1 x 8192 (mask: 4096), Hq 32 / Hkv 8, with the kernel's
    registers, dynamic shared memory and CTAs per SM; peers: FlashInfer's backends to time beside them."""
    rng = np.random.default_rng(1)
    print(f"{'case':32s} {'kernel':>9s} {'time':>10s} {'TFLOP/s':>8s} {'regs':>5s} {'smem KB':>7s} {'CTA/SM':>6s} "
          f"{'err':>9s}")
    for label, kw in EXTRA:
        label, w, us, tf, err = variant_case(rng, label, **kw)
        st = w.last_plan.info
        regs = st["kernel"].resources.registers if st["kernel"].resources else -1
        occ = min(65536 // (st["threads"] * regs), (228 * 1024) // (st["smem"] + 1024))
        print(f"{label:32s} {st['backend'] + '/' + str(st['cta_rows']):>9s} {us:8.1f}us {tf:8.0f} {regs:5d} "
              f"{st['smem'] / 1024:7.1f} {occ:6d} {err:9.2e}")
    if peers:
        print("\npeers in this process (TFLOP/s)")
        rates = peer_rates(EXTRA_PEERS, peers)
        for (name, impl), tf in sorted(rates.items()):
            ref = rates.get((name, "kvattn"))
            print(f"{name:12s} {impl:20s} {tf:8.2f}" + (f"   kvattn / this: {ref / tf:.2f}" if ref else ""))


def sweep():
    from kvattn import prefill
    rng = np.random.default_rng(0)
    print(f"{'tile':>4s} {'defines':60s} {'case':10s} {'TFLOP/s':>8s} {'err':>9s}")
    for rows, lst in SWEEP.items():
        for defs in lst:
            prefill.TUNING[rows] = defs
            for name, b, s in (("b1_S8192", 1, 8192), ("b8_S2048", 8, 2048)):
                w, us, err = ragged_case(rng, name, [s] * b, [s] * b, rows)
                print(f"{rows:4d} {str(defs):60s} {name:10s} {2 * b * HQ * s * s * D / us / 1e6:8.0f} {err:9.2e}")
        prefill.TUNING.pop(rows, None)


def engine_fns(torch, name, b, s, d, causal, fi_backends, sdpa_backends=("FLASH_ATTENTION", "CUDNN_ATTENTION")):
    """{engine: fn} of one ragged prefill shape (b requests of s tokens, bf16, Hq HQ / Hkv HKV, head_dim d) on the
    same new torch tensors: "kvattn" (its arrays over torch's memory, out given), "fi_<backend>" for each FlashInfer
    backend and "torch_<flash|cudnn>" for each PyTorch SDPA backend that imports and runs (else a printed line)."""
    dt = torch.bfloat16
    q = torch.randn(b * s, HQ, d, dtype=dt, device="cuda")   # [tokens, Hq, d]
    k = torch.randn(b * s, HKV, d, dtype=dt, device="cuda")  # [tokens, Hkv, d]
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    ip = np.arange(0, (b + 1) * s, s, dtype=np.int32)
    kw = BatchPrefillWithRaggedKVCache()
    kw.plan(ip, ip, HQ, HKV, d, causal=causal)
    kq, kk, kv, ko = kvattn.asarray(q), kvattn.asarray(k), kvattn.asarray(v), kvattn.empty((b * s, HQ, d), "bfloat16")
    fns = {"kvattn": lambda: kw.run(kq, kk, kv, out=ko)}
    try:
        import flashinfer
        indptr = torch.from_numpy(ip).cuda()
        for backend in fi_backends:   # (a workspace each: they are timed in turns)
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            fw.plan(indptr, indptr, HQ, HKV, d, causal=causal, q_data_type=dt)
            fw.run(q, k, v)
            fns["fi_" + backend] = lambda fw=fw: fw.run(q, k, v)
    except Exception as exc:
        print(f"# FlashInfer prefill {name}: {exc.__class__.__name__}: {str(exc)[:120]}")
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qb = q.view(b, s, HQ, d).transpose(1, 2)
        kb, vb = (x.view(b, s, HKV, d).transpose(1, 2) for x in (k, v))
        for be in sdpa_backends:
            def sdpa(be=be):
                with sdpa_kernel(getattr(SDPBackend, be)):
                    return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=True)
            sdpa()
            fns["torch_" + be.split("_")[0].lower()] = sdpa
    except Exception as exc:
        print(f"# PyTorch SDPA {name}: {exc.__class__.__name__}: {str(exc)[:120]}")
    return fns


def peer_rates(shapes, fi_backends):
    """TFLOP/s of kvattn, FlashInfer (ragged prefill, each of fi_backends) and PyTorch SDPA (flash, cuDNN) on the
    shapes ((name, b, s) causal at head_dim 128, or (name, b, s, head_dim, causal)), all on the same torch tensors
    and timed in turns (scripts/_bench.time_rounds: 3 rounds of alternating order, each timing after a 2 s rest so
    every engine starts at the same clock, not under the power cap a sustained run engages (run 45e); kvattn on
    the torch tensors as kvattn arrays, out given), and FlashInfer's paged speculative verify in TB/s (default
    shapes only), in this process. Each peer is optional: a missing package or
    an error prints a line instead of a figure."""
    out = {}
    try:
        import torch
    except ImportError:
        print("# peers not measured: torch is not importable")
        return out
    from _bench import PREFILL_REST_S, time_rounds, torch_time_us  # noqa: E402 (scripts/_bench.py)
    dt = torch.bfloat16
    for name, b, s, *more in shapes:
        d, causal = more if more else (D, True)
        flops = (2 if causal else 4) * b * HQ * s * s * d
        fns = engine_fns(torch, name, b, s, d, causal, fi_backends)
        for impl, us in time_rounds(fns, reps=10, rest_s=PREFILL_REST_S).items():
            out[(name, impl)] = flops / us / 1e6
    if any(more for _, _, _, *more in shapes):
        return out
    try:   # speculative verify: batch 64 x 4 queries, causal, paged KV of 4096 (page 16)
        import flashinfer
        b, ql, kl = 64, 4, 4096
        npg = kl // PS
        cache = torch.randn(b * npg, 2, PS, HKV, D, dtype=dt, device="cuda")
        q = torch.randn(b * ql, HQ, D, dtype=dt, device="cuda")
        i32 = dict(dtype=torch.int32, device="cuda")
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for backend in fi_backends:
            fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            fw.plan(torch.arange(0, (b + 1) * ql, ql, **i32), torch.arange(0, (b + 1) * npg, npg, **i32),
                    torch.randperm(b * npg, **i32), torch.full((b,), PS, **i32), HQ, HKV, D, PS, causal=True,
                    q_data_type=dt, kv_data_type=dt)
            us = torch_time_us(lambda: fw.run(q, cache), reps=20)
            out[("spec_verify", "fi_paged_" + backend + " TB/s")] = 2 * b * kl * HKV * D * 2 / us / 1e6
    except Exception as exc:
        print(f"# FlashInfer paged verify: {exc.__class__.__name__}: {str(exc)[:120]}")
    return out


def warm_peers(fi_backends, head_dims):
    """Build FlashInfer's JIT ragged prefill modules (one per backend and head dim) and exit."""
    import torch
    import flashinfer
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ip = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
    for backend in fi_backends:
        for d in head_dims:
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(ip, ip, HQ, HKV, d, causal=True, q_data_type=torch.bfloat16)
        print(f"warm: ragged prefill {backend}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cta-rows", default="auto", help="comma list of query tiles to try (auto = plan's choice)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--extra", action="store_true", help="only the variant table (non-causal, D 64/256, fp16, ...)")
    ap.add_argument("--backend", default="auto", help="comma list of backends to time (auto, sm80, sm90)")
    ap.add_argument("--sweep", action="store_true", help="time the tuning knobs of prefill.cuh on two shapes")
    ap.add_argument("--warm-peers", action="store_true", help="only build FlashInfer's JIT prefill modules")
    ap.add_argument("--peers", nargs="?", const="fa2", default=None,
                    help="also time PyTorch SDPA and FlashInfer here (comma list of its backends: fa2, fa3)")
    args = ap.parse_args()
    if args.sweep:
        return sweep()
    if args.warm_peers:
        return warm_peers(args.peers.split(",") if args.peers else ["fa2", "fa3"], (64, 128, 256) if args.extra else (128,))
    if args.extra:
        return extra(args.peers and args.peers.split(","))
    tiles = [None if t == "auto" else int(t) for t in args.cta_rows.split(",")]
    rng = np.random.default_rng(0)
    gemm = gemm_tflops()
    copy = copy_bandwidth_tbs()
    print(f"ceilings: bf16 GEMM {gemm and f'{gemm:.0f}'} TFLOP/s, copy {copy:.2f} TB/s")
    rows = []
    shapes = [("b1_S8192", 1, 8192), ("b8_S2048", 8, 2048)] + ([] if args.quick else [("b1_S32768", 1, 32768),
                                                                                     ("b32_S1024", 32, 1024)])
    for be in args.backend.split(","):
        for t in tiles:
            for name, b, s in shapes:
                w, us, err = ragged_case(rng, name, [s] * b, [s] * b, t, backend=be)
                tf = 2 * b * HQ * s * s * D / us / 1e6
                rows.append((f"ragged {name}", w, us, f"{tf:.0f} TFLOP/s",
                             f"{tf / FI_FA2[name]:.2f}x fa2" + (f", {tf / gemm:.2f} GEMM" if gemm else ""), err))
            w, us, err = paged_case(rng, [8192], [8192], t, backend=be)
            tf = 2 * HQ * 8192 ** 2 * D / us / 1e6
            rows.append(("paged b1_S8192", w, us, f"{tf:.0f} TFLOP/s",
                         f"{tf / FI_FA2['paged_b1_S8192']:.2f}x fa2 paged", err))
            qo, kv = [256], [65536 + 256]
            w, us, err = ragged_case(rng, "append", qo, kv, t, backend=be)
            tf = 4 * HQ * D * pairs(qo, kv, True) / us / 1e6
            rows.append(("append 256 x 65536 prefix", w, us, f"{tf:.0f} TFLOP/s",
                         f"target 300, split={w.last_plan.info['schedule'].split}", err))
    for t in [None, 16]:
        w, us, err = paged_case(rng, [4] * 64, [4096] * 64, t)
        nbytes = 2 * 64 * 4096 * HKV * D * 2
        tbs = nbytes / us / 1e6
        rows.append(("spec verify b64 x 4, kv 4096", w, us, f"{tbs:.2f} TB/s",
                     f"{tbs / copy:.2f} of copy (target 0.88)", err))
    print(f"{'case':28s} {'kernel':>9s} {'time':>10s} {'rate':>15s}  {'vs':34s} {'max rel err':>11s}")
    for name, w, us, rate, vs, err in rows:
        kern = f"{w.last_plan.info['backend']}/{w.last_plan.info['cta_rows']}"
        print(f"{name:28s} {kern:>9s} {us:8.1f}us {rate:>15s}  {vs:34s} {err:11.2e}")
    if args.peers:
        peers = peer_rates(shapes, args.peers.split(","))
        print("\nsame data, timed in turns (TFLOP/s, causal, same shapes; vs columns above use ANCHORS.md's fa2)")
        for (name, impl), tf in sorted(peers.items()):
            print(f"{name:12s} {impl:20s} {tf:8.2f}")
        print("\nkvattn vs the peers of this process")
        for name, w, us, rate, vs, err in rows:
            key = name.split()[-1]
            if key in {n for n, _, _ in shapes} or "verify" in name:
                fa2, fl = peers.get((key, "fi_fa2")), peers.get((key, "torch_flash"))
                if "verify" in name:
                    fa2 = peers.get(("spec_verify", "fi_paged_fa2 TB/s"))
                fa3, cud = peers.get((key, "fi_fa3")), peers.get((key, "torch_cudnn"))
                # the ragged shapes: kvattn's figure of the same rounds (same data, in turns), not the first table's
                same = name.startswith("ragged")
                val = peers.get((key, "kvattn"), float(rate.split()[0])) if same else float(rate.split()[0])
                print(f"{name:28s} {w.last_plan.info['backend']:5s} {val:10.1f}{' (same run)' if same else ''}  " +
                      (f"{val / fa2:.2f}x FlashInfer fa2" if fa2 else "no fa2") +
                      (f", {val / fa3:.2f}x fa3" if fa3 else "") + (f", {val / cud:.2f}x cuDNN" if cud else "") +
                      (f", {val / fl:.2f}x PyTorch flash" if fl else ""))


if __name__ == "__main__":
    main()
