"""Lead of run 31c: is kvattn's sm90 prefill slower on torch.randn tensors because of their values or their memory?
The same plan timed in turns on four q / k / v sets (torch or kvattn memory x torch or numpy values). Run 32a
(BENCHMARKS.md): neither (torch's memory was 3-5% faster on b8_S2048; b1_S8192 equal in all four).

    PYTHONPATH=. python3 scripts/probe_prefill_memory.py
"""
import os
import sys

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvattn  # noqa: E402
from _bench import time_rounds  # noqa: E402

HQ, HKV, D = 32, 8, 128
for b, s in ((8, 2048), (1, 8192)):
    ip = np.arange(0, (b + 1) * s, s, dtype=np.int32)
    w = kvattn.BatchPrefillWithRaggedKVCache()
    w.plan(ip, ip, HQ, HKV, D, causal=True)
    shapes = ((b * s, HQ, D), (b * s, HKV, D), (b * s, HKV, D))
    tt = [torch.randn(sh, dtype=torch.bfloat16, device="cuda") for sh in shapes]
    torch.cuda.synchronize()
    rng = np.random.default_rng(0)
    npv = [rng.standard_normal(sh, dtype=np.float32).astype(ml_dtypes.bfloat16) for sh in shapes]
    styles = {
        "torch mem, torch values": [kvattn.asarray(x) for x in tt],
        "kvattn mem, torch values": [kvattn.from_numpy(kvattn.asarray(x).numpy()) for x in tt],
        "kvattn mem, numpy values": [kvattn.from_numpy(v) for v in npv],
        "torch mem, numpy values": [kvattn.asarray(torch.from_numpy(v.view(np.int16)).cuda().view(torch.bfloat16))
                                    for v in npv],
    }
    torch.cuda.synchronize()
    out = kvattn.empty(shapes[0], "bfloat16")
    fns = {k: (lambda a=a: w.run(*a, out=out)) for k, a in styles.items()}
    flops = 2 * b * HQ * s * s * D
    for k, us in time_rounds(fns, reps=30).items():
        print(f"b{b}_S{s:<6d} {k:26s} {flops / us / 1e6:7.1f} TFLOP/s", flush=True)
    for k, a in styles.items():
        print(k, [hex(x.ptr % 4096) for x in a], flush=True)
