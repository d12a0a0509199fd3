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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvattn import _driver  # noqa: E402
from _bench import series_us  # noqa: E402
from bench_prefill import D, HQ, engine_fns  # noqa: E402

CASES = [("causal b1_S8192", 1, 8192, True), ("causal b8_S2048", 8, 2048, True), ("causal b32_S1024", 32, 1024, True),
         ("non-causal b1_S8192", 1, 8192, False), ("causal b1_S32768", 1, 32768, True)]


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
    print(f"{'case':22s} {'engine':11s} {'fresh':>6s} {'sustained':>9s}  (each order: fresh/sustained)")
    for name, b, s, causal in CASES:
        fns = engine_fns(torch, name, b, s, D, causal, ("fa3",), ("CUDNN_ATTENTION",))
        n = 120 if s >= 32768 else args.calls
        flops = (2 if causal else 4) * b * HQ * s * s * D
        got = {e: [] for e in fns}
        for order in (list(fns), list(fns)[::-1]):
            for e in order:
                us = series_us(fns[e], n, args.pause)
                got[e].append((flops / np.median(us[:30]) / 1e6, flops / np.median(us[n // 2:]) / 1e6))
        for e, pairs in got.items():
            fresh, sus = np.mean(pairs, axis=0)
            print(f"{name:22s} {e:11s} {fresh:6.0f} {sus:9.0f}  " + " ".join(f"{a:.0f}/{c:.0f}" for a, c in pairs),
                  flush=True)
        kf, ks = np.mean(got["kvattn"], axis=0)
        for peer in ("fi_fa3", "torch_cudnn"):
            if peer in got:
                pf, ps = np.mean(got[peer], axis=0)
                print(f"{name:22s} kvattn / {peer}: fresh {kf / pf:.3f}, sustained {ks / ps:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
