"""One-shot A/B of prefill tuning defines on the 128-row tile: TFLOP/s (causal b1_S8192, b8_S2048) + sampled error.

    PYTHONPATH=. python scripts/ab_prefill.py
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_prefill as bp  # noqa: E402
from kvattn import prefill  # noqa: E402

CANDIDATES = [(), (("KVATTN_PF_FAST64", 1),), (("KVATTN_PF_FOLD", 1),),
              (("KVATTN_PF_FAST64", 1), ("KVATTN_PF_FOLD", 1))]

if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for name, b, s in (("b1_S8192", 1, 8192), ("b8_S2048", 8, 2048)):
        for defs in CANDIDATES:
            prefill.TUNING[128] = defs
            w, us, err = bp.ragged_case(rng, name, [s] * b, [s] * b, 128)
            print(f"{name:10s} {str(defs):60s} {2 * b * bp.HQ * s * s * bp.D / us / 1e6:6.0f} TFLOP/s err {err:.2e}",
                  flush=True)
