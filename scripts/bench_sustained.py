"""Prefill fresh and sustained: each engine alone, after an idle pause, many calls back to back.

    PYTHONPATH=. python3 scripts/bench_sustained.py [--calls 300] [--pause 3]

A compute-bound prefill pulls the H200's clock from 1980 MHz to ~1650-1700 (SW power cap) after 30-80 ms of
back-to-back calls, for every engine (run 45e, BENCHMARKS.md). Figures timed in turns can therefore compare one
engine at full clock with another under the cap. Here each engine runs alone after `pause` seconds idle: "fresh" is
the median of its first 30 calls, "sustained" of the second half (a serving engine's steady state), each call
bracketed by its own events. Both orders (kvattn first, then the peers first); the table gives their mean.
Peers, when importable: FlashInfer's fa3 ragged prefill and PyTorch SDPA's cuDNN backend (torch tensors, same
data). bf16 Hq32/Hkv8/D128, ragged.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvattn  # noqa: E402
from kvattn import _driver  # noqa: E402
from kvattn.timing import Event, as_stream  # noqa: E402

HQ, HKV, D = 32, 8, 128
CASES = [("causal b1_S8192", 1, 8192, True), ("causal b8_S2048", 8, 2048, True), ("causal b32_S1024", 32, 1024, True),
         ("non-causal b1_S8192", 1, 8192, False), ("causal b1_S32768", 1, 32768, True)]


def series_us(fn, n: int, pause: float) -> np.ndarray:
    """[n] microseconds of n back-to-back calls of fn on the legacy stream, after `pause` seconds idle."""
    _driver.call("cuCtxSynchronize")
    time.sleep(pause)
    s = as_stream(None)
    events = [(Event(), Event()) for _ in range(n)]
    for a, b in events:
        a.record(s)
        fn()
        b.record(s)
    events[-1][1].synchronize()
    return np.array([a.elapsed_ms(b) * 1e3 for a, b in events])


def engines(torch, b, s, causal):
    """{name: fn} on the same torch tensors: kvattn (its arrays over torch's memory, out given), fa3, cuDNN."""
    ip = np.arange(0, (b + 1) * s, s, dtype=np.int32)
    tq = torch.randn((b * s, HQ, D), dtype=torch.bfloat16, device="cuda")
    tk = torch.randn((b * s, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn((b * s, HKV, D), dtype=torch.bfloat16, device="cuda")
    w = kvattn.BatchPrefillWithRaggedKVCache()
    w.plan(ip, ip, HQ, HKV, D, causal=causal)
    q, k, v = kvattn.asarray(tq), kvattn.asarray(tk), kvattn.asarray(tv)
    out = kvattn.empty(q.shape, "bfloat16")
    fns = {"kvattn": lambda: w.run(q, k, v, out=out)}
    try:
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        f = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
        ti = torch.from_numpy(ip).cuda()
        f.plan(ti, ti, HQ, HKV, D, causal=causal, q_data_type=torch.bfloat16)
        f.run(tq, tk, tv)
        fns["fa3"] = lambda: f.run(tq, tk, tv)
    except Exception as exc:   # peers are optional
        print(f"# FlashInfer fa3 not measured: {exc.__class__.__name__}: {str(exc)[:100]}")
    try:   # PyTorch SDPA's cuDNN backend on the same tensors ([b, H, s, D] views)
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qb = tq.view(b, s, HQ, D).transpose(1, 2)
        kb, vb = (x.view(b, s, HKV, D).transpose(1, 2) for x in (tk, tv))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=True)
        cudnn()
        fns["cudnn"] = cudnn
    except Exception as exc:
        print(f"# cuDNN (PyTorch SDPA) not measured: {exc.__class__.__name__}: {str(exc)[:100]}")
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per series (S32768: 120)")
    ap.add_argument("--pause", type=float, default=3.0, help="idle seconds before each series")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_sustained needs PyTorch (the peers' tensors)")
        return 0
    print(f"GPU {_driver.device_name()}; TFLOP/s, fresh = calls 0-30 after {args.pause:g} s idle, sustained = the "
          f"second half")
    print(f"{'case':22s} {'engine':7s} {'fresh':>6s} {'sustained':>9s}  (each order: fresh/sustained)")
    for name, b, s, causal in CASES:
        fns = engines(torch, b, s, causal)
        n = 120 if s >= 32768 else args.calls
        flops = (2 if causal else 4) * b * HQ * s * s * D
        got = {e: [] for e in fns}
        for order in (list(fns), list(fns)[::-1]):
            for e in order:
                us = series_us(fns[e], n, args.pause)
                got[e].append((flops / np.median(us[:30]) / 1e6, flops / np.median(us[n // 2:]) / 1e6))
        for e, pairs in got.items():
            fresh, sus = np.mean(pairs, axis=0)
            print(f"{name:22s} {e:7s} {fresh:6.0f} {sus:9.0f}  " + " ".join(f"{a:.0f}/{c:.0f}" for a, c in pairs),
                  flush=True)
        kf, ks = np.mean(got["kvattn"], axis=0)
        for peer in ("fa3", "cudnn"):
            if peer in got:
                pf, ps = np.mean(got[peer], axis=0)
                print(f"{name:22s} kvattn / {peer}: fresh {kf / pf:.3f}, sustained {ks / ps:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
