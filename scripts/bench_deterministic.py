"""What deterministic (batch-invariant) decode and prefill cost: the decode anchors and three causal prefills with deterministic=False and True in one
process (bf16 Hq32/Hkv8/D128, page 16, scattered pages; median of 3 alternating rounds of median-of-30), each
checked against the float64 reference on one request.

    PYTHONPATH=. python3 scripts/bench_deterministic.py
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, random_device, request_kv, table  # noqa: E402
from bench_decode import MAIN as CASES  # noqa: E402
from kvattn import reference  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def main():
    if not kvattn.gpu_available():
        print("bench_deterministic: no CUDA GPU found")
        return 0
    rng = np.random.default_rng(0)
    print(f"GPU {kvattn._driver.device_name()}; split {kvattn.decode.DETERMINISTIC_SPLIT_TOKENS} tokens")
    rows = []
    for name, lens in CASES.items():
        pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=rng)
        shape = (pt.num_pages_used, PAGE, HKV, D)
        k, v = random_device(shape, "bfloat16", rng), random_device(shape, "bfloat16", rng)
        q = random_device((len(lens), HQ, D), "bfloat16", rng)
        out = kvattn.empty(q.shape, "bfloat16")
        runs = {}
        for det in (False, True):
            w = kvattn.BatchDecodeWithPagedKVCache(deterministic=det)
            w.plan(pt, HQ, HKV, D)
            runs[det] = (w, lambda w=w: w.run(q, k, v, out=out))
        t = {False: [], True: []}
        for _ in range(3):
            for det in (False, True):
                t[det].append(time_us(runs[det][1], reps=30))
        base, det = float(np.median(t[False])), float(np.median(t[True]))
        runs[True][1]()
        i = int(np.argmax(lens))
        kk, vv = request_kv(pt, k, v, i)
        ro = reference.attention(q[i:i + 1].numpy().astype(np.float64), kk, vv)
        err = float(np.linalg.norm(out[i:i + 1].numpy() - ro) / np.linalg.norm(ro))
        rows.append(dict(case=name, default=f"{base:.1f} us", deterministic=f"{det:.1f} us",
                         **{"det/default": f"{det / base:.3f}"}, err=f"{err:.1e}"))
    for name, b, s in (("prefill causal b1_S8192", 1, 8192), ("prefill causal b8_S2048", 8, 2048),
                       ("prefill causal b1_qo512_kv32768", 1, None)):
        qo, kv = ([s] * b, [s] * b) if s else ([512], [32768])
        qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        ki = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
        q = random_device((int(qi[-1]), HQ, D), "bfloat16", rng)
        k, v = (random_device((int(ki[-1]), HKV, D), "bfloat16", rng) for _ in range(2))
        out = kvattn.empty(q.shape, "bfloat16")
        fns = {}
        for det in (False, True):
            w = kvattn.BatchPrefillWithRaggedKVCache(deterministic=det)
            w.plan(qi, ki, HQ, HKV, D, causal=True)
            fns[det] = lambda w=w: w.run(q, k, v, out=out)
        t = {False: [], True: []}
        for _ in range(3):
            for det in (False, True):
                t[det].append(time_us(fns[det], reps=20))
        base, det = float(np.median(t[False])), float(np.median(t[True]))
        fns[True]()
        qh, kh, vh = q.numpy()[-64:], k.numpy()[ki[-2]:], v.numpy()[ki[-2]:]
        ro = reference.attention(qh.astype(np.float64), kh.astype(np.float64), vh.astype(np.float64), causal=True)
        # (the last 64 query rows of the last request against its whole KV: bottom-right causal alignment)
        err = float(np.linalg.norm(out.numpy()[-64:] - ro) / np.linalg.norm(ro))
        rows.append(dict(case=name, default=f"{base:.1f} us", deterministic=f"{det:.1f} us",
                         **{"det/default": f"{det / base:.3f}"}, err=f"{err:.1e}"))
    print("\ndefault vs deterministic=True (det/default <= 1.10 is the target)")
    table(rows, ["case", "default", "deterministic", "det/default", "err"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
