"""Where the sm90 prefill kernel's time goes: the same shapes with the K/V loads left out (X=1) and with the softmax
left out (X=2), TFLOP/s against the full kernel (X=0), all in one process (bf16, Hq32/Hkv8/D128, ragged).

    PYTHONPATH=. python3 scripts/ab_sm90.py            # on the GPU
    python3 scripts/ab_sm90.py --compile               # fill KVATTN_CACHE_DIR with the experiment builds (no GPU)

Only X=0 is a correct kernel; the others' error column is meaningless and printed as such.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvattn import prefill  # noqa: E402
from kvattn.variants import Variant  # noqa: E402

EXPERIMENTS = {0: "full kernel", 1: "no K/V loads", 2: "no softmax"}
CASES = [("non-causal b1_S8192", 1, 8192, False), ("causal b1_S8192", 1, 8192, True),
         ("causal b8_S2048", 8, 2048, True), ("causal b32_S1024", 32, 1024, True)]


def defines(x):
    return (("KVATTN_SM90_X", x),) if x else ()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    if args.compile:
        for x in EXPERIMENTS:
            prefill.SM90_TUNING = defines(x)
            prefill.sm90_spec(128, Variant(), "bfloat16").compile("sm_90a")
        sys.exit(0)
    import bench_prefill as bp  # noqa: E402
    rng = np.random.default_rng(0)
    rows = []
    for name, b, s, causal in CASES:
        flops = (2 if causal else 4) * b * bp.HQ * s * s * bp.D
        for x, what in EXPERIMENTS.items():
            prefill.SM90_TUNING = defines(x)
            w, us, err = bp.ragged_case(rng, name, [s] * b, [s] * b, 128, causal=causal, backend="sm90")
            rows.append((name, what, us, flops / us / 1e6, f"{err:.1e}" if x == 0 else "n/a"))
            print(f"{name:22s} {what:14s} {us:9.1f} us {flops / us / 1e6:6.0f} TFLOP/s err {rows[-1][-1]}", flush=True)
    prefill.SM90_TUNING = ()
