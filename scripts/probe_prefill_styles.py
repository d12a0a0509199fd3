"""Why the framework path's causal prefill can trail kvattn's arrays (run 15c: b1_S8192 torch, out=None 582
TFLOP/s against 640 with kvattn arrays and out given, both on the same data in one process):

    PYTHONPATH=. python3 scripts/probe_prefill_styles.py

Times, on the same torch-generated data, four call styles (kvattn arrays with out given / out=None; torch tensors
with out=None / out given) with the persistent sm90 kernel and with one CTA per unit, in 3 interleaved rounds
(median of 30 back-to-back calls each), so a style's own cost shows apart from the machine's drift.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvattn  # noqa: E402
from kvattn import prefill  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main():
    import torch
    for name, b, s in (("b1_S8192", 1, 8192), ("b8_S2048", 8, 2048)):
        indptr = np.arange(0, (b + 1) * s, s, dtype=np.int32)
        tq, tk, tv = (torch.randn((b * s, h, D), dtype=torch.bfloat16, device="cuda") for h in (HQ, HKV, HKV))
        tout = torch.empty_like(tq)
        q, k, v = kvattn.asarray(tq), kvattn.asarray(tk), kvattn.asarray(tv)
        out = kvattn.empty(q.shape, "bfloat16")
        flops = 2 * b * HQ * s * s * D
        rates = {}
        for rnd in range(3):
            for persistent in (True, False):
                prefill.SM90_PERSISTENT = persistent
                w = kvattn.BatchPrefillWithRaggedKVCache()
                w.plan(indptr, indptr, HQ, HKV, D, causal=True)
                styles = {"kvattn, out given": lambda: w.run(q, k, v, out=out),
                          "kvattn, out=None": lambda: w.run(q, k, v),
                          "torch, out=None": lambda: w.run(tq, tk, tv),
                          "torch, out=torch": lambda: w.run(tq, tk, tv, out=tout)}
                for style, fn in (styles.items() if rnd % 2 == 0 else reversed(styles.items())):
                    key = ("persistent" if persistent else "CTA per unit", style)
                    rates.setdefault(key, []).append(flops / time_us(fn) / 1e6)
        prefill.SM90_PERSISTENT = True
        for (kernel, style), r in rates.items():
            print(f"{name:9s} {kernel:13s} {style:18s} " + " ".join(f"{x:6.1f}" for x in r)
                  + f"   median {np.median(r):6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
